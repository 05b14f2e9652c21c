"""foremoe.torch in one process: the dispatch layout of every rank (simulated exchange), fixed owners in the
planner, the slot storage, and the layer on a group of one."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch (torch) is not installed; foremoe.torch needs it")

import foremoe  # noqa: E402
import foremoe.torch as ft  # noqa: E402


def routed(rng, G, E, K, skew=1.8):
    pop = np.exp(skew * rng.standard_normal(E))
    pop /= pop.sum()
    out = []
    for _ in range(G):
        T = int(rng.integers(0, 80))
        ids = np.stack([rng.choice(E, size=K, replace=False, p=pop) for _ in range(T)]) if T else np.zeros((0, K))
        ids = ids.astype(np.int64)
        ids[rng.random(ids.shape) < 0.05] = -1
        out.append(torch.from_numpy(ids))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_layouts_of_all_ranks_fit_together(seed):
    rng = np.random.default_rng(seed)
    nodes, per_node = [(1, 2), (2, 2), (2, 3)][seed % 3]
    G = nodes * per_node
    E, K = G * int(rng.integers(2, 6)), int(rng.integers(1, 5))
    S = E // G + int(rng.integers(1, 4))
    ids = routed(rng, G, E, K)
    src = np.stack([np.bincount(i[i >= 0].numpy(), minlength=E) for i in ids], axis=1)
    owners = ft.contiguous_owners(E, G)
    plan = foremoe.Planner(foremoe.Topology(nodes, per_node, S)).plan(src.sum(axis=1)[None], owners=owners)
    lays = [ft.local_layout(plan, 0, ids[r], src, r) for r in range(G)]
    p2l = np.asarray(plan.phys_to_log[0])
    split = lays[0].source_split
    assert np.array_equal(split.sum(axis=1), np.asarray(plan.slot_tokens[0]).reshape(-1))
    sends = []
    for r, lay in enumerate(lays):
        slots = lay.slots.numpy()
        flat = ids[r].numpy().reshape(-1)
        assert np.array_equal(slots.reshape(-1) < 0, flat < 0)
        assert np.array_equal(p2l[slots[slots >= 0]], ids[r].numpy()[slots >= 0])  # each slot hosts the expert
        assert np.array_equal(np.bincount(slots[slots >= 0], minlength=G * S), split[:, r])
        sent = slots.reshape(-1)[lay.order.numpy()]
        assert np.all(np.diff(sent) >= 0)  # grouped by destination rank, then slot
        assert np.array_equal(lay.send_tokens.numpy(), lay.order.numpy() // K)
        assert lay.input_splits == [int((sent // S == g).sum()) for g in range(G)]
        sends.append(np.stack([sent, np.full(sent.size, r)], axis=1))
    # The exchange all_to_all_single would make, then recv_perm: each rank's rows grouped by its own slots.
    for r, lay in enumerate(lays):
        assert lay.output_splits == [lays[s].input_splits[r] for s in range(G)]
        chunks = []
        for s in range(G):
            off = sum(lays[s].input_splits[:r])
            chunks.append(sends[s][off:off + lays[s].input_splits[r]])
        recv = np.concatenate(chunks) if chunks else np.zeros((0, 2), np.int64)
        grouped = recv[lay.recv_perm.numpy()]
        want = np.repeat(np.arange(r * S, (r + 1) * S), lay.slot_counts)
        assert np.array_equal(grouped[:, 0], want)
        assert np.array_equal(grouped[lay.recv_inverse.numpy()], recv)
        for j in range(S):  # inside a slot, sources in rank order
            src_ranks = grouped[grouped[:, 0] == r * S + j, 1]
            assert np.all(np.diff(src_ranks) >= 0)


def test_local_layout_bad_input():
    E, G, S = 8, 2, 6
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    src = np.stack([np.bincount(ids.reshape(-1).numpy(), minlength=E), np.zeros(E, np.int64)], axis=1)
    plan = foremoe.Planner(foremoe.Topology(1, G, S)).plan(src.sum(axis=1)[None], owners=ft.contiguous_owners(E, G))
    with pytest.raises(ValueError, match=r"expert id 8 at token 1, k 0 is outside \[0, 8\)"):
        ft.local_layout(plan, 0, torch.tensor([[0, 1], [8, 3], [4, 5], [6, 7]]), src, 0)
    with pytest.raises(ValueError, match=r"source_loads must be \[experts, ranks\] = \[8, 2\], got \[8, 3\]"):
        ft.local_layout(plan, 0, ids, np.zeros((E, 3), np.int64), 0)
    with pytest.raises(ValueError, match="rank 2 outside"):
        ft.local_layout(plan, 0, ids, src, 2)
    with pytest.raises(ValueError, match=r"layer 1 outside the plan's \[0, 1\)"):
        ft.local_layout(plan, 1, ids, src, 0)
    with pytest.raises(ValueError, match="expert_ids must be a \\[tokens, topk\\] torch.Tensor, got \\[8\\]"):
        ft.local_layout(plan, 0, ids.reshape(-1), src, 0)
    with pytest.raises(ValueError, match="must be int8, uint8, int16, uint16, int32 or int64, got float32"):
        ft.local_layout(plan, 0, ids.float(), src, 0)
    moved = src.copy()
    moved[0] = [0, 1]  # expert 0's token claimed by rank 1: the ids of rank 0 no longer match its column
    with pytest.raises(ValueError, match="expert 0 has 1 routed tokens but the plan gives its 1 copies 0"):
        ft.local_layout(plan, 0, ids, moved, 0)


def test_planner_keeps_given_owners():
    rng = np.random.default_rng(5)
    E, G, S = 24, 4, 9
    loads = rng.integers(0, 200, size=(3, 2, E)) * (rng.random((3, 2, E)) < 0.5)
    owners = rng.permutation(ft.contiguous_owners(E, G))
    topo = foremoe.Topology(2, 2, S)
    for p in foremoe.Planner(topo).plan(loads, owners=owners):
        assert np.array_equal(p.owner_gpu, np.stack([owners] * 2))
        for l in range(2):
            for g in range(G):
                assert set(np.flatnonzero(owners == g)) <= set(p.gpu_slots[l][g].tolist())
    per_layer = np.stack([owners, np.roll(owners, 1)])
    assert np.array_equal(foremoe.Planner(topo).plan(loads[0], owners=per_layer).owner_gpu, per_layer)
    with pytest.raises(ValueError, match=r"owners is \[2, 23\], expected \[2, 24\]"):
        foremoe.Planner(topo).plan(loads[0], owners=np.zeros((2, 23), np.int32))
    bad = owners.copy()
    bad[3] = 7
    with pytest.raises(ValueError, match="layer 0 expert 3 has owner GPU 7, outside"):
        foremoe.Planner(topo).plan(loads[0], owners=bad)
    with pytest.raises(ValueError, match="owners must hold integer"):
        foremoe.Planner(topo).plan(loads[0], owners=owners.astype(float))


def test_storage_owner_rows_are_the_parameters():
    E, G, S, H = 8, 2, 6, 4
    full = {"w": torch.arange(E * H * 3, dtype=torch.float64).reshape(E, H, 3),
            "b": torch.ones(E, 3, dtype=torch.float64)}
    st = ft.ExpertStorage.from_full(full, ft.contiguous_owners(E, G), S, rank=1, world=G)
    assert st.owned_experts == [4, 5, 6, 7]
    for name, p in st.params.items():
        assert isinstance(p, torch.nn.Parameter) and p.shape[0] == 4
        assert p.data_ptr() == st.storage[name].data_ptr()  # the first rows of the slot storage
        assert torch.equal(p, full[name][4:].to(p.dtype))
        assert st.replicas(name).shape[0] == S - 4 and not isinstance(st.replicas(name), torch.nn.Parameter)
    assert not st.owners_changed()
    with torch.no_grad():
        st.params["w"].add_(1.0)  # what an optimizer step does
    assert st.owners_changed() and float(st.storage["w"][0, 0, 0]) == float(full["w"][4, 0, 0]) + 1
    st.params["b"].data = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="owner parameter 'b' no longer aliases the slot storage"):
        st.check_aliasing()
    with pytest.raises(ValueError, match="rank 0 owns 8 experts but has only 6 slots"):
        ft.ExpertStorage.from_full(full, np.zeros(E, np.int32), S, rank=0, world=G)
    with pytest.raises(ValueError, match="expert 2 has owner rank 5"):
        ft.ExpertStorage.from_full(full, np.array([0, 0, 5, 1, 1, 1, 0, 0]), S, rank=0, world=G)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_group_of_one_equals_reference(dtype):
    E, K, H, T = 8, 2, 16, 30
    g = torch.Generator().manual_seed(3)
    experts = ft.SwiGLUExperts(E, H, 24, dtype=dtype, generator=g)
    full = {n: getattr(experts, n).detach().clone().requires_grad_(True) for n in experts.weight_names}
    layer = ft.BalancedMoE(experts, E)
    ids = torch.multinomial(torch.ones(T, E), K, generator=g)
    ids[0, 1] = -1
    x = torch.randn(T, H, generator=g, dtype=dtype, requires_grad=True)
    w = torch.softmax(torch.randn(T, K, generator=g, dtype=dtype), dim=-1)
    loads = np.bincount(ids[ids >= 0].numpy(), minlength=E)[None]
    plan = foremoe.Planner(foremoe.Topology(1, 1, E)).plan(loads, owners=layer.owners)
    out = layer(x, ids, w, plan)
    out.sum().backward()
    xr = x.detach().clone().requires_grad_(True)
    ref = ft.reference_moe(xr, ids, w, full, ft.SwiGLUExperts.expert)
    ref.sum().backward()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(out, ref, rtol=tol, atol=tol) and float(ref.abs().max()) > 0
    assert torch.allclose(x.grad, xr.grad, rtol=tol, atol=tol)
    for n in experts.weight_names:
        assert torch.allclose(getattr(layer.experts, n).grad, full[n].grad, rtol=tol, atol=tol)
    with torch.no_grad():  # forward only (the recompute stage): no graph kept
        assert not layer(x, ids, w, plan).requires_grad
