"""ExpertStorage.bind_parameters and bind_fused: a trainer's own per-expert parameters (what foremoe.megatron does with
Megatron's SequentialMLP experts) or fused ones (GroupedMLP's weight1/weight2) become the owner rows, in one process."""

import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch (torch) is not installed; foremoe.torch needs it")

import foremoe.torch as ft  # noqa: E402


def _storage_and_params():
    g = torch.Generator().manual_seed(3)
    params = {"w1": [torch.nn.Parameter(torch.randn(4, 3, generator=g, dtype=torch.float64)) for _ in range(2)],
              "w2": [torch.nn.Parameter(torch.randn(3, 4, generator=g, dtype=torch.float64)) for _ in range(2)]}
    st = ft.ExpertStorage({n: torch.zeros((2,) + tuple(ps[0].shape), dtype=torch.float64) for n, ps in params.items()},
                          [0, 0, 1, 1], 3, rank=0, world=2)
    return st, params


def test_bind_aliases_rows_and_tracks_updates():
    st, params = _storage_and_params()
    values = {n: [p.detach().clone() for p in ps] for n, ps in params.items()}
    st.bind_parameters(params)
    for n, ps in params.items():
        for i, p in enumerate(ps):
            assert p.data_ptr() == st.storage[n][i].data_ptr()
            assert torch.equal(st.storage[n][i], values[n][i])  # the parameters' values moved into the rows
    assert not st.owners_changed()
    with torch.no_grad():
        params["w2"][1].mul_(2.0)  # an optimizer's in-place step on one bound parameter
    assert st.owners_changed()
    assert torch.equal(st.storage["w2"][1], 2.0 * values["w2"][1])
    st.check_aliasing()
    params["w1"][0].data = params["w1"][0].data.clone()  # what a distributed optimizer's buffer does
    with pytest.raises(ValueError, match="bound trainer parameter no longer aliases its slot storage row"):
        st.check_aliasing()


def test_bind_bad_input():
    st, params = _storage_and_params()
    with pytest.raises(ValueError, match="no weight kind 'w3'"):
        st.bind_parameters({"w3": params["w1"]})
    with pytest.raises(ValueError, match="1 parameters of 'w1' for the 2 experts rank 0 owns"):
        st.bind_parameters({"w1": params["w1"][:1]})
    with pytest.raises(ValueError, match=r"parameter 0 of 'w1' is \[3, 4\]"):
        st.bind_parameters({"w1": params["w2"]})
    assert all(p.data_ptr() != st.storage["w1"][0].data_ptr() for p in params["w1"])  # nothing bound


def _storage_and_fused():
    g = torch.Generator().manual_seed(5)
    # Megatron's GroupedMLP layout: weight1 [H, n F1] for rows [H, F1], weight2 [n F, H] for rows [F, H] (n = 2)
    fused = {"w1": torch.nn.Parameter(torch.randn(3, 8, generator=g, dtype=torch.float64)),
             "w2": torch.nn.Parameter(torch.randn(4, 3, generator=g, dtype=torch.float64))}
    st = ft.ExpertStorage({"w1": torch.zeros(2, 3, 4, dtype=torch.float64), "w2": torch.zeros(2, 2, 3,
                           dtype=torch.float64)}, [0, 0, 1, 1], 3, rank=0, world=2)
    return st, fused


def test_bind_fused_aliases_owner_rows_and_tracks_updates():
    st, fused = _storage_and_fused()
    values = {n: p.detach().clone() for n, p in fused.items()}
    st.bind_fused(fused)
    for n, p in fused.items():
        assert p.shape == values[n].shape  # the parameter keeps its own (fused) shape
        assert p.data_ptr() == st.storage[n].data_ptr()  # expert 0's row is its first block
        assert torch.equal(st.storage[n][:2].reshape(-1), values[n].reshape(-1))
        assert torch.count_nonzero(st.storage[n][2:]) == 0  # the spare row is not touched
    assert not st.owners_changed()
    with torch.no_grad():
        fused["w1"].add_(1.0)  # an optimizer's in-place step
    assert st.owners_changed()
    assert torch.equal(st.storage["w1"][:2].reshape(-1), (values["w1"] + 1.0).reshape(-1))
    st.check_aliasing()
    fused["w2"].data = fused["w2"].data.clone()
    with pytest.raises(ValueError, match="bound trainer parameter no longer aliases"):
        st.check_aliasing()


def test_bind_fused_bad_input_names_the_value():
    st, fused = _storage_and_fused()
    with pytest.raises(ValueError, match=r"bind_fused: parameter 'w1' is \[3, 7\] \(21 elements\), its 2 owner rows "
                                         r"\[2, 3, 4\] \(24 elements\)"):
        st.bind_fused({"w1": torch.nn.Parameter(torch.zeros(3, 7, dtype=torch.float64))})
    with pytest.raises(ValueError, match=r"bind_fused: parameter 'w1' is torch.float32, the storage of 'w1' "
                                         r"torch.float64"):
        st.bind_fused({"w1": torch.nn.Parameter(fused["w1"].detach().float())})
    with pytest.raises(ValueError, match="bind_fused: no weight kind 'w3'"):
        st.bind_fused({"w3": fused["w1"]})
    with pytest.raises(ValueError, match=r"bind_fused: parameter 'w1' \[8, 3\] is not contiguous"):
        st.bind_fused({"w1": torch.nn.Parameter(torch.zeros(3, 8, dtype=torch.float64)).t()})
    with pytest.raises(ValueError, match="bind_fused: 'w1' must be one fused parameter"):
        st.bind_fused({"w1": [fused["w1"]]})
    with pytest.raises(ValueError, match=r"bind_parameters: 'w1' is one tensor \[3, 8\].*bind_fused"):
        st.bind_parameters({"w1": fused["w1"]})
    with pytest.raises(ValueError, match="bind_fused: parameter 'w1' is on meta, the storage of 'w1' on cpu"):
        st.bind_fused({"w1": torch.nn.Parameter(torch.empty(3, 8, dtype=torch.float64, device="meta"))})  # no GPU
    assert all(p.data_ptr() != st.storage["w1"].data_ptr() for p in fused.values())  # nothing bound so far
    st.bind_fused({"w1": fused["w1"]})
    with pytest.raises(ValueError, match="bind_fused: parameter 'w1' is bound twice"):
        st.bind_fused({"w1": fused["w1"]})
    with pytest.raises(ValueError, match="owner row 0 of 'w1' is already bound to another parameter"):
        st.bind_fused({"w1": torch.nn.Parameter(torch.zeros(3, 8, dtype=torch.float64))})
    rows = [torch.nn.Parameter(torch.zeros(3, 4, dtype=torch.float64)) for _ in range(2)]
    with pytest.raises(ValueError, match=r"bind_parameters: parameter 0 of 'w1': owner row 0 of 'w1' is already"):
        st.bind_parameters({"w1": rows})
    st.bind_fused({"w2": fused["w2"]})  # the other kind still binds
    assert fused["w2"].data_ptr() == st.storage["w2"].data_ptr()


def test_bind_parameters_same_parameter_twice_and_device():
    st, params = _storage_and_params()
    with pytest.raises(ValueError, match="bind_parameters: parameter 1 of 'w1' is bound twice"):
        st.bind_parameters({"w1": [params["w1"][0], params["w1"][0]]})
    meta = [torch.nn.Parameter(torch.empty(4, 3, dtype=torch.float64, device="meta")) for _ in range(2)]
    with pytest.raises(ValueError, match="bind_parameters: parameter 0 of 'w1' is on meta"):
        st.bind_parameters({"w1": meta})
    with pytest.raises(ValueError, match=r"parameter 0 of 'w1' is torch.float32, the storage of 'w1' torch.float64"):
        st.bind_parameters({"w1": [torch.nn.Parameter(p.detach().float()) for p in params["w1"]]})
    assert all(p.data_ptr() != st.storage["w1"][0].data_ptr() for p in params["w1"])  # nothing bound


def _flat_params():
    """Per-expert parameters as segments of one flat buffer (what Megatron's DDP with the distributed optimizer
    makes of them), and the buffer."""
    g = torch.Generator().manual_seed(7)
    flat = torch.randn(2 * (12 + 12) + 5, generator=g, dtype=torch.float64)
    params, at = {"w1": [], "w2": []}, 0
    for _ in range(2):
        for n, shape in (("w1", (4, 3)), ("w2", (3, 4))):
            params[n].append(torch.nn.Parameter(flat[at:at + 12].view(shape)))
            at += 12
    return flat, params


def test_copy_bound_rows_follow_the_parameters():
    """copy=True: the parameters keep their .data (the buffer), the rows hold a copy, refreshed after
    mark_copies_stale (a write through the buffer: no version moves), an in-place update or invalidate()."""
    st, _ = _storage_and_params()
    flat, params = _flat_params()
    ptrs = [p.data_ptr() for ps in params.values() for p in ps]
    st.bind_parameters(params, copy=True)
    assert st.copy_bound
    assert [p.data_ptr() for ps in params.values() for p in ps] == ptrs  # still in the buffer

    def rows_equal() -> bool:
        return all(torch.equal(st.storage[n][i], p) for n, ps in params.items() for i, p in enumerate(ps))

    assert rows_equal()
    assert not st.refresh_copies()  # nothing changed: no copy
    flat.data.add_(1.0)  # the optimizer writes the buffer through .data: no version counter moves
    assert not rows_equal() and not st.refresh_copies()  # undetectable without the mark
    st.mark_copies_stale()
    assert st.refresh_copies() and rows_equal() and st.owners_changed()
    with torch.no_grad():
        params["w2"][1].mul_(2.0)  # an in-place update of a parameter: its version moves
    assert st.refresh_copies() and rows_equal()
    flat.data.sub_(0.5)
    st.invalidate()
    assert st.refresh_copies() and rows_equal()
    st.check_aliasing()
    params["w1"][1].data = params["w1"][1].data.clone()  # replaced again: refused
    with pytest.raises(ValueError, match="copy-bound trainer parameter's .data was replaced since it was bound"):
        st.check_aliasing()


def test_rebind_copies_after_a_buffer_took_the_parameters():
    """Bound aliasing, then moved into a flat buffer (DDP wrapped after the binding): rebind_copies makes them
    copy-bound with the buffer's values; bad input is refused and changes nothing."""
    st, params = _storage_and_params()
    st.bind_parameters(params)
    flat, moved = _flat_params()
    for n, ps in params.items():
        for p, q in zip(ps, moved[n]):
            p.data = q.data  # DDP: `param.data = segment of its buffer` (values copied there)
    with pytest.raises(ValueError, match="no longer aliases its slot storage row"):
        st.check_aliasing()
    stranger = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"ExpertStorage.rebind_copies: a parameter \[4, 3\] is not bound"):
        st.rebind_copies([params["w1"][0], stranger])
    assert not st.copy_bound
    everything = [p for ps in params.values() for p in ps]
    st.rebind_copies(everything)
    st.check_aliasing()
    assert st.copy_bound and st.owners_changed()  # rows rewritten: replicas re-sent at the next sync
    assert all(torch.equal(st.storage[n][i], p) for n, ps in params.items() for i, p in enumerate(ps))
    with pytest.raises(ValueError, match="copy must be True or False, got 1"):
        ft.ExpertStorage({"w": torch.zeros(1, 2)}, [0], 1, rank=0, world=1).bind_parameters(
            {"w": [torch.nn.Parameter(torch.zeros(2))]}, copy=1)


def _one_rank_copy_bound(mirror: bool):
    """A one-rank storage (two owned experts) whose parameters are copy-bound segments of a flat
    buffer, a plan for it, and what an optimizer step through the buffer does (values change, no version moves;
    the step post-hook marks the copies stale)."""
    import numpy as np
    import foremoe

    flat, params = _flat_params()
    st = ft.ExpertStorage({n: torch.zeros((2,) + tuple(ps[0].shape), dtype=torch.float64) for n, ps in params.items()},
                          [0, 0], 2, rank=0, world=1, mirror=mirror)
    st.bind_parameters(params, copy=True)
    plan = foremoe.Planner(foremoe.Topology(1, 1, 2)).plan(np.array([[3, 3]], dtype=np.float32),
                                                            owners=np.array([0, 0], dtype=np.int64))

    def step() -> None:
        flat.data.add_(1.0)
        st.mark_copies_stale()

    def rows_equal() -> bool:
        return all(torch.equal(st.storage[n][i], p) for n, ps in params.items() for i, p in enumerate(ps))

    return st, params, plan, step, rows_equal


def test_copy_bound_rows_refreshed_by_prefetch():
    """A prefetch after an optimizer step reads the owner rows: it copies the parameters in first, so the rows it
    sends from are the stepped ones and the call that follows (which refreshes copies first) keeps the prefetch."""
    st, _, plan, step, rows_equal = _one_rank_copy_bound(mirror=False)
    step()
    st.prefetch(plan, 0)
    assert rows_equal(), "prefetch read stale copy-bound owner rows"
    assert not st.refresh_copies()  # what the layer's call does first: nothing left to copy
    assert st.prefetch_flags(plan, 0) == (1, 0), "the prefetch made after the step no longer fits the call"
    st.drop_prefetch()


def test_copy_bound_rows_refreshed_by_refresh_mirror():
    """refresh_mirror after an optimizer step takes the stepped weights into the mirror, not stale copy-bound rows,
    and leaves it fresh."""
    st, params, _, step, rows_equal = _one_rank_copy_bound(mirror=True)
    step()
    st.refresh_mirror()
    assert rows_equal()
    for n, ps in params.items():
        for i, p in enumerate(ps):
            assert torch.equal(st.mirror.tensors[n][i], p), f"mirror of {n!r} expert {i} is stale"
    assert not st.refresh_copies() and not st.mirror_stale()


@pytest.mark.parametrize("how", ["in_place", "through_buffer"])
def test_balanced_moe_reads_refreshed_copy_bound_rows(how):
    """balanced_moe after an optimizer step on copy-bound parameters (an in-place step moves their versions; a
    write through the buffer is marked by mark_copies_stale) computes with the stepped weights."""
    st, params, plan, step, rows_equal = _one_rank_copy_bound(mirror=False)
    if how == "in_place":
        with torch.no_grad():
            params["w1"][0].mul_(3.0)
    else:
        step()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 4, generator=g, dtype=torch.float64)
    ids = torch.tensor([[0], [1]] * 3)
    rw = torch.rand(6, 1, generator=g, dtype=torch.float64)

    def fn(x, w1, w2):
        return (x @ w1) @ w2

    y = ft.balanced_moe(x, ids, rw, plan, st, fn)
    weights = {n: torch.stack([p.detach() for p in ps]) for n, ps in params.items()}
    assert torch.equal(y, ft.reference_moe(x, ids, rw, weights, fn)), "computed with stale copy-bound owner rows"
    assert rows_equal()


def test_refresh_refuses_a_replaced_copy_bound_parameter():
    """A copy-bound parameter whose .data was replaced again (another shape): the refresh that balanced_moe and
    prefetch run first raises check_aliasing's ValueError instead of copying the new tensor (or failing in copy_)."""
    st, params, plan, step, _ = _one_rank_copy_bound(mirror=False)
    params["w1"][1].data = torch.zeros(2, 6, dtype=torch.float64)
    step()
    with pytest.raises(ValueError, match="copy-bound trainer parameter's .data was replaced since it was bound"):
        st.refresh_copies()
    with pytest.raises(ValueError, match="copy-bound trainer parameter's .data was replaced since it was bound"):
        ft.balanced_moe(torch.zeros(2, 4, dtype=torch.float64), torch.tensor([[0], [1]]),
                        torch.ones(2, 1, dtype=torch.float64), plan, st, lambda x, w1, w2: (x @ w1) @ w2)
