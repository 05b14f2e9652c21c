"""foremoe.torch's packing before the stage (pack_from_verl / pack_from_ids / pack_from_slime, StepPacking,
ReplayDriver.from_packing).

Properties on seeded random steps (FOREMOE_TEST_SEEDS multiplies the seeds): a packing is a permutation of the
samples, keeps every micro-batch within the token budget, is deterministic, never deviates more than the trainer's
token-balanced packing, and its loads are those the existing counters give for the packed micro-batches (all three
input forms agree). End to end: one optimizer step with gradient accumulation, once over the trainer's micro-batches
and once over the routing-aware ones, gives the same gradients, weights and mini-batch-normalised loss up to the
floating-point summation order (float64, 1e-12 of the largest magnitude), while a loss normalised per micro-batch
changes with the packing; over 2 gloo ranks the same holds for the balanced layer planned by a driver built on the
packing (of the whole mini-batch over both ranks, or of each rank's own samples with the loads summed over the
group). The verl-style example runs too.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch (torch) is not installed; foremoe.torch needs it")

import foremoe  # noqa: E402
import foremoe.torch as ft  # noqa: E402
import torch_moe_cases as tc  # noqa: E402

_SEEDS = 4 * max(1, int(os.environ.get("FOREMOE_TEST_SEEDS", "1") or 1))
TOL = 1e-12  # float64: relative to the largest magnitude (the summation order is all that changes)


def random_step(seed, S=None, L=None, E=None, K=2):
    """One step's samples: lengths ``[S]`` and routed ids ``[T, L, K]`` laid end to end (-1 drops), each sample
    leaning towards its own experts (per-sequence coherence, as on real routing)."""
    rng = np.random.default_rng(seed)
    S = S or int(rng.integers(6, 40))
    L = L or int(rng.integers(1, 4))
    E = E or int(rng.integers(4, 17))
    lengths = rng.integers(1, 40, S).astype(np.int64)
    ids = []
    for s in range(S):
        pop = np.exp(2.0 * rng.standard_normal(E))
        pop /= pop.sum()
        x = np.stack([rng.choice(E, size=K, replace=False, p=pop) for _ in range(lengths[s] * L)])
        ids.append(x.reshape(lengths[s], L, K))
    ids = np.concatenate(ids)
    ids[rng.random(ids.shape) < 0.05] = -1
    return lengths, ids.astype(np.int32), E


def shape_of(rng, lengths):
    """A trainer's micro-batch shape that fits: micro-steps, ranks and a token budget with some slack."""
    M, R = int(rng.integers(1, 5)), int(rng.integers(1, 4))
    budget = int(lengths.max()) + int(lengths.sum() * float(rng.uniform(1.0, 1.5)) / (M * R))
    return M, R, budget


def verl_batch(lengths, ids, seq_pad=3):
    """verl's padded batch of the same samples: ``[bs, seq, L, K]`` left-padded with expert 0, the mask 0/1."""
    seq = int(lengths.max()) + seq_pad
    routed = np.zeros((len(lengths), seq) + ids.shape[1:], dtype=ids.dtype)
    mask = np.zeros((len(lengths), seq), dtype=np.int64)
    off = np.concatenate([[0], np.cumsum(lengths)])
    for i, n in enumerate(lengths):
        routed[i, seq - n:] = ids[off[i]:off[i + 1]]
        mask[i, seq - n:] = 1
    return routed, mask


def bincount_loads(lengths, ids, micro_of, M, E):
    """The independent reference: NumPy bincount of every micro-step's samples, layer by layer."""
    off = np.concatenate([[0], np.cumsum(lengths)])
    out = np.zeros((M, ids.shape[1], E), np.int64)
    for s in range(len(lengths)):
        x = ids[off[s]:off[s + 1]]
        for layer in range(ids.shape[1]):
            v = x[:, layer].reshape(-1)
            out[micro_of[s], layer] += np.bincount(v[v >= 0], minlength=E)
    return out


# -- properties ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(_SEEDS))
def test_packing_is_a_permutation_within_budget_and_deterministic(seed):
    lengths, ids, E = random_step(seed)
    rng = np.random.default_rng(seed + 100)
    M, R, budget = shape_of(rng, lengths)
    p = ft.pack_from_ids(ids, lengths, num_experts=E, micro_steps=M, ranks=R, token_budget=budget)
    S = len(lengths)
    assert (p.num_sequences, p.num_micro_steps, p.num_ranks) == (S, M, R)
    # A permutation: every sample in exactly one micro-batch, per rank and over all ranks.
    every = p.micro_batches()
    assert len(every) == M and all(len(step) == R for step in every)
    assert sorted(s for step in every for mb in step for s in mb) == list(range(S))
    per_rank = [p.micro_batches(r) for r in range(R)]
    assert all(per_rank[r][m] == every[m][r] for r in range(R) for m in range(M))
    # Every micro-batch within the budget.
    fill = np.zeros((M, R), np.int64)
    np.add.at(fill, (p.micro_step, p.rank), lengths)
    assert fill.max() <= budget and fill.sum() == lengths.sum()
    # order(): the concatenated micro-batches' outputs back in the batch's order.
    flat = np.array([s for step in every for mb in step for s in mb])
    assert np.array_equal(flat[p.order()], np.arange(S))
    for r in range(R):
        mine = np.array([s for mb in per_rank[r] for s in mb], dtype=np.int64)
        assert np.array_equal(mine[p.order(r)], np.sort(mine))
    # Never worse than the trainer's token-balanced packing (the default start), and equal to the library's packer.
    assert p.deviation <= p.start_deviation
    hist = foremoe.sequence_histograms(ids, lengths, E)
    lib = foremoe.pack_micro_batches(lengths, hist, micro_steps=M, ranks=R, token_budget=budget)
    assert np.array_equal(lib.micro_step, p.micro_step) and np.array_equal(lib.rank, p.rank)
    # Deterministic, also from tensors.
    q = ft.pack_from_ids(torch.from_numpy(ids), torch.from_numpy(lengths), num_experts=E, micro_steps=M, ranks=R,
                         token_budget=budget)
    assert np.array_equal(q.micro_step, p.micro_step) and np.array_equal(q.rank, p.rank)
    assert q.deviation == p.deviation
    # The loads are the micro-steps' sums, all ranks together, and read-only.
    assert np.array_equal(p.loads, bincount_loads(lengths, ids, p.micro_step, M, E))
    assert not p.loads.flags.writeable and not p.micro_step.flags.writeable


@pytest.mark.parametrize("seed", range(_SEEDS))
def test_input_forms_agree_and_the_driver_plans_the_packed_micro_steps(seed):
    lengths, ids, E = random_step(seed + 50, L=2)
    rng = np.random.default_rng(seed + 150)
    M, R, budget = shape_of(rng, lengths)
    # A placement: two experts per GPU.
    gpu_of = np.arange(E) // 2
    kw = dict(num_experts=E, micro_steps=M, ranks=R, token_budget=budget, gpu_of=gpu_of)
    by_ids = ft.pack_from_ids(ids, lengths, **kw)
    routed, mask = verl_batch(lengths, ids)
    off = np.concatenate([[0], np.cumsum(lengths)])
    samples = [ids[off[s]:off[s + 1]] for s in range(len(lengths))]
    forms = [ft.pack_from_verl(routed, mask, **kw),
             ft.pack_from_verl(torch.from_numpy(routed), torch.from_numpy(mask).bool(), **kw),
             ft.pack_from_slime(samples, **kw),
             ft.pack_from_slime([{"rollout_routed_experts": torch.from_numpy(x)} for x in samples], **kw)]
    for i, p in enumerate(forms):
        assert np.array_equal(p.micro_step, by_ids.micro_step) and np.array_equal(p.rank, by_ids.rank), i
        assert np.array_equal(p.loads, by_ids.loads) and np.array_equal(p.lengths, lengths), i
    # The same [L, E] placement as [E]; a layer_map dropping a layer packs on the other one's routing.
    same = ft.pack_from_ids(ids, lengths, **{**kw, "gpu_of": np.tile(gpu_of, (2, 1))})
    assert np.array_equal(same.micro_step, by_ids.micro_step)
    one = ft.pack_from_ids(ids, lengths, **{**kw, "gpu_of": None}, layer_map=[-1, 0])
    want = foremoe.pack_micro_batches(lengths, foremoe.sequence_histograms(ids, lengths, E)[:, 1:],
                                      micro_steps=M, ranks=R, token_budget=budget)
    assert np.array_equal(one.micro_step, want.micro_step) and one.loads.shape == (M, 1, E)
    # verl's counter over the packed micro-batches (all ranks of a micro-step together) counts the same loads, and a
    # driver built from them plans what the driver built on the packing plans.
    planner = foremoe.Planner(foremoe.Topology(1, max(1, E // 2), 3))
    owners = np.arange(E) // 2
    packed = [[s for mb in step for s in mb] for step in by_ids.micro_batches()]
    nonempty = [m for m in range(M) if packed[m]]
    assert np.array_equal(ft.loads_from_verl(routed, mask, [packed[m] for m in nonempty], num_experts=E),
                          by_ids.loads[nonempty])
    with ft.ReplayDriver.from_packing(planner, by_ids, owners=owners) as drv:
        assert drv.num_micro_steps == M and np.array_equal(drv.loads, by_ids.loads)
        direct = [planner.plan(by_ids.loads[0], owners=owners)]
        for m in range(1, M):
            direct.append(planner.plan(by_ids.loads[m], resident=direct[-1], owners=owners))
        for m in range(M):
            assert np.array_equal(drv.plan(m).gpu_slots, direct[m].gpu_slots), m


def test_routing_aware_packing_evens_the_micro_steps():
    """On coherent routing the packed micro-steps' loads are closer to the step's share than the trainer's."""
    lengths, ids, E = random_step(7, S=64, L=2, E=16)
    M = 4
    budget = int(lengths.sum()) // M + int(lengths.max())
    p = ft.pack_from_ids(ids, lengths, num_experts=E, micro_steps=M, token_budget=budget)
    tm, _ = foremoe.pack_by_tokens(lengths, micro_steps=M, token_budget=budget)
    before = bincount_loads(lengths, ids, tm, M, E)
    share = before.sum(axis=0) / M

    def max_over_mean(loads):  # per micro-step and layer, the hottest expert over the mean
        return float((loads.max(axis=2) / loads.mean(axis=2)).mean())

    assert p.deviation < p.start_deviation
    assert ((p.loads - share) ** 2).sum() < ((before - share) ** 2).sum()
    assert max_over_mean(p.loads) < max_over_mean(before)


# -- errors --------------------------------------------------------------------------------------------------------


def test_bad_input_names_the_value():
    lengths, ids, E = random_step(3, S=6, L=1, E=4)
    kw = dict(num_experts=E, micro_steps=2, token_budget=int(lengths.sum()))
    with pytest.raises(ValueError, match=r"pack_from_ids: .*micro_steps = 0 is outside \[1, 1048576\]"):
        ft.pack_from_ids(ids, lengths, **{**kw, "micro_steps": 0})
    big = int(lengths.argmax())
    with pytest.raises(ValueError, match=f"pack_from_ids: .*sequence {big} has {lengths[big]} tokens, more than the "
                                         f"micro-batch token budget {lengths[big] - 1}"):
        ft.pack_from_ids(ids, lengths, **{**kw, "token_budget": int(lengths[big]) - 1})
    with pytest.raises(ValueError, match=r"pack_from_ids: gpu_of must be \[4\] or \[1, 4\] .*got shape \[3\]"):
        ft.pack_from_ids(ids, lengths, **kw, gpu_of=[0, 0, 1])
    with pytest.raises(ValueError, match=r"pack_from_ids: gpu_of\[0, 2\] = -1"):
        ft.pack_from_ids(ids, lengths, **kw, gpu_of=[0, 0, -1, 1])
    with pytest.raises(ValueError, match=r"pack_from_ids: lengths must be \[sequences\]"):
        ft.pack_from_ids(ids, [], **kw)
    with pytest.raises(ValueError, match="loads_from_ids"):  # the lengths do not cover the ids
        ft.pack_from_ids(ids, lengths[:-1], **kw)
    bad = ids.copy()
    bad[1, 0, 1] = E
    with pytest.raises(ValueError, match=f"expert id {E} at token 1, layer 0, k 1"):
        ft.pack_from_ids(bad, lengths, **kw)
    routed, mask = verl_batch(lengths, ids)
    with pytest.raises(ValueError, match="pack_from_verl"):
        ft.pack_from_verl(routed, mask[:, 1:], **kw)
    mask[2] = 0  # a sample with no valid token
    with pytest.raises(ValueError, match="pack_from_verl: .*sequence 2"):
        ft.pack_from_verl(routed, mask, **kw)
    with pytest.raises(ValueError, match="pack_from_slime: samples must be a non-empty list"):
        ft.pack_from_slime([], **kw)
    p = ft.pack_from_ids(ids, lengths, **kw, ranks=2)
    with pytest.raises(ValueError, match=r"StepPacking.micro_batches: rank = 2 is outside \[0, 1\]"):
        p.micro_batches(2)
    planner = foremoe.Planner(foremoe.Topology(1, 2, 3))
    with pytest.raises(ValueError, match="the packing spans 2 ranks"):
        ft.ReplayDriver.from_packing(planner, p, group=object())
    with pytest.raises(ValueError, match="packing must be a StepPacking .* got MicroBatchPacking"):
        ft.ReplayDriver.from_packing(planner, foremoe.pack_micro_batches(
            lengths, foremoe.sequence_histograms(ids, lengths, E), micro_steps=2, token_budget=int(lengths.sum())))


# -- end to end: one optimizer step, trainer's micro-batches vs routing-aware ones ----------------------------------


def close(got, want, what):
    """``got`` equals ``want`` within TOL of ``want``'s largest magnitude."""
    scale = float(want.abs().max())
    err = float((got - want).abs().max())
    assert err <= TOL * scale, f"{what}: max abs error {err:.3e} vs max |ref| {scale:.3e} (tol {TOL})"


class TinyMoE(torch.nn.Module):
    """A router over replayed expert ids (the weights recomputed from its logits, as with routing replay), the
    experts, and a dense output projection: every parameter gets a gradient."""

    def __init__(self, E, H, F, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.router = torch.nn.Parameter(torch.randn(H, E, generator=g, dtype=torch.float64) / H ** 0.5)
        self.experts = ft.SwiGLUExperts(E, H, F, dtype=torch.float64, generator=g)
        self.out = torch.nn.Parameter(torch.randn(H, H, generator=g, dtype=torch.float64) / H ** 0.5)

    def forward(self, x, ids):
        logits = (x @ self.router).gather(1, ids.clamp(min=0).long())
        return (x + self.experts(x, ids, torch.softmax(logits, dim=-1))) @ self.out


def token_losses(model, data, idx):
    """Per-token losses of the samples ``idx`` (concatenated in that order)."""
    x = torch.cat([data["x"][s] for s in idx])
    y = torch.cat([data["y"][s] for s in idx])
    return ((model(x, torch.cat([data["ids"][s] for s in idx])) - y) ** 2).sum(dim=1)


def one_step(data, micro_batches, per_micro_batch=False):
    """One optimizer step with gradient accumulation over ``micro_batches`` (``[micro_step][rank] -> samples``; the
    ranks' gradients summed as data parallelism's all-reduce does). The loss of a micro-batch is its token losses'
    sum over the mini-batch's tokens (``per_micro_batch``: over its own, averaged over the micro-batches). Returns
    the step's loss, the gradients and the weights after the step."""
    model = TinyMoE(data["E"], data["H"], 24, seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    total = sum(int(x.shape[0]) for x in data["x"])
    n_mb = sum(1 for step in micro_batches for mb in step if mb)
    loss_sum = torch.zeros((), dtype=torch.float64)
    for step in micro_batches:
        for mb in step:
            if not mb:
                continue  # an empty micro-batch adds nothing
            t = token_losses(model, data, mb)
            loss = t.sum() / t.numel() / n_mb if per_micro_batch else t.sum() / total
            loss.backward()
            loss_sum += loss.detach()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return loss_sum, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def e2e_data(seed, S=20, H=8, E=8):
    lengths, ids, E = random_step(seed, S=S, L=1, E=E)
    g = torch.Generator().manual_seed(seed)
    off = np.concatenate([[0], np.cumsum(lengths)])
    return dict(lengths=lengths, ids_flat=ids, E=E, H=H,
                ids=[torch.from_numpy(ids[off[s]:off[s + 1], 0]) for s in range(S)],
                x=[torch.randn(int(n), H, generator=g, dtype=torch.float64) for n in lengths],
                y=[torch.randn(int(n), H, generator=g, dtype=torch.float64) for n in lengths])


@pytest.mark.parametrize("seed", range(3))
def test_packed_step_equals_the_trainers_step(seed):
    data = e2e_data(seed)
    lengths, E = data["lengths"], data["E"]
    M, R = 3, 2
    budget = int(lengths.sum()) // (M * R) + int(lengths.max())
    tm, tr = foremoe.pack_by_tokens(lengths, micro_steps=M, ranks=R, token_budget=budget)
    trainer = [[[s for s in range(len(lengths)) if tm[s] == m and tr[s] == r] for r in range(R)] for m in range(M)]
    p = ft.pack_from_ids(data["ids_flat"], lengths, num_experts=E, micro_steps=M, ranks=R, token_budget=budget)
    packed = p.micro_batches()
    assert p.deviation < p.start_deviation
    assert sorted(map(sorted, (mb for st in packed for mb in st))) != sorted(map(sorted, (mb for st in trainer
                                                                                         for mb in st)))
    # The recompute stage (forward only, per packed micro-batch) back in the batch's order equals the whole batch's.
    model = TinyMoE(E, data["H"], 24, seed=5)
    with torch.no_grad():
        whole = token_losses(model, data, range(len(lengths)))
        outs = [token_losses(model, data, mb) for step in packed for mb in step]
        per_sample = [o for mb_out, mb in zip(outs, (mb for step in packed for mb in step))
                      for o in mb_out.split([int(lengths[s]) for s in mb])]
        close(torch.cat([per_sample[i] for i in p.order()]), whole, "recompute in the batch's order")
    # The update: equal up to the summation order, with the loss normalised over the mini-batch.
    loss_a, grads_a, params_a = one_step(data, trainer)
    loss_b, grads_b, params_b = one_step(data, packed)
    whole_loss, whole_grads, _ = one_step(data, [[list(range(len(lengths)))]])
    close(loss_b.reshape(1), loss_a.reshape(1), "mini-batch-normalised loss")
    close(loss_a.reshape(1), whole_loss.reshape(1), "loss over the trainer's micro-batches vs the whole batch")
    for n in grads_a:
        close(grads_b[n], grads_a[n], f"grad of {n}")
        close(grads_a[n], whole_grads[n], f"grad of {n}, trainer's micro-batches vs the whole batch")
        close(params_b[n], params_a[n], f"{n} after the step")
    # A loss normalised per micro-batch changes with the packing (so the comparison above could fail).
    pm_a, pg_a, _ = one_step(data, trainer, per_micro_batch=True)
    pm_b, pg_b, _ = one_step(data, packed, per_micro_batch=True)
    assert abs(float(pm_a - pm_b)) > 1e-6 * abs(float(pm_a)), (float(pm_a), float(pm_b))
    assert max(float((pg_a[n] - pg_b[n]).abs().max() / pg_a[n].abs().max()) for n in pg_a) > 1e-6


# -- end to end over 2 ranks: the balanced layer planned by a driver built on the packing -----------------------------


def packed_rank(rank, tmp):
    """Three runs in one group: the trainer's micro-batches (each rank's loads counted and summed over the group),
    the routing-aware packing of the whole mini-batch over both ranks (a driver from the packing), and each rank's
    packing of the samples the trainer gave it (``ranks=1``, the trainer's packing as the start, the drivers' loads
    summed over the group). Per run: the owned experts' accumulated gradients, the weights after the optimizer step,
    the mini-batch-normalised and the per-micro-batch losses, the driver's loads."""
    world = 2
    tc.init_group(rank, world, tmp)
    data = e2e_data(11, S=24, H=16, E=8)
    lengths, E = data["lengths"], data["E"]
    M = 3
    budget = int(lengths.sum()) // (M * world) + int(lengths.max())
    total = int(lengths.sum())
    tm, tr = foremoe.pack_by_tokens(lengths, micro_steps=M, ranks=world, token_budget=budget)
    trainer = [[s for s in range(len(lengths)) if tm[s] == m and tr[s] == rank] for m in range(M)]
    packing = ft.pack_from_ids(data["ids_flat"], lengths, num_experts=E, micro_steps=M, ranks=world,
                               token_budget=budget)
    mine = np.flatnonzero(tr == rank)  # this rank's samples, as the trainer dispatched them
    own = ft.pack_from_ids(torch.cat([data["ids"][s] for s in mine]).reshape(-1, 1, 2), lengths[mine],
                           num_experts=E, micro_steps=M, token_budget=budget, start=(tm[mine], np.zeros_like(tm[mine])))
    g = torch.Generator().manual_seed(3)
    logits = [torch.randn(int(n), 2, generator=g, dtype=torch.float64) for n in lengths]
    planner = foremoe.Planner(foremoe.Topology(1, world, E // world + 2))
    rec = {"runs": [], "moved": trainer != packing.micro_batches(rank), "own_loads": torch.from_numpy(own.loads.copy()),
           "own_moved": bool(own.deviation < own.start_deviation)}
    for name in ("trainer", "packed", "own"):
        layer = ft.BalancedMoE(ft.SwiGLUExperts(E, data["H"], 24, dtype=torch.float64,
                                                generator=torch.Generator().manual_seed(5)), E // world + 2,
                               timeout=60.0)
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        kw = dict(owners=layer.owners, timeout=60.0)
        if name == "trainer":
            batches = trainer
            ids = torch.cat([data["ids"][s] for mb in batches for s in mb]).reshape(-1, 1, 2)
            offsets = np.cumsum([0] + [sum(int(lengths[s]) for s in mb) for mb in batches])
            drv = ft.ReplayDriver.from_ids(planner, ids, offsets, num_experts=E, group=torch.distributed.group.WORLD,
                                           **kw)
        elif name == "packed":
            batches = packing.micro_batches(rank)
            drv = ft.ReplayDriver.from_packing(planner, packing, **kw)
        else:
            batches = [[int(mine[j]) for j in mb] for mb in own.micro_batches(0)]
            drv = ft.ReplayDriver.from_packing(planner, own, group=torch.distributed.group.WORLD, **kw)
        run = {"loss": 0.0, "per_mb": [], "replicas": 0}
        with drv:
            for m, mb in enumerate(batches):
                x, ids, lg, y = (torch.cat([src[s] for s in mb]) if mb else src[0][:0]
                                 for src in (data["x"], data["ids"], logits, data["y"]))  # [:0]: an empty one
                w = torch.softmax(lg, dim=-1)
                plan = drv.plan(m)
                run["replicas"] += int((np.asarray(plan.gpu_slots) >= 0).sum()) - E
                t = ((layer(x, ids, w, plan) - y) ** 2).sum(dim=1)
                (t.sum() / total).backward()
                run["loss"] += float(t.sum() / total)
                run["per_mb"].append((float(t.sum()), int(t.numel())))
        run["grads"] = {n: p.grad.clone() for n, p in layer.named_parameters()}
        opt.step()
        run["params"] = {n: p.detach().clone() for n, p in layer.named_parameters()}
        run["owned"] = layer.storage.owned_experts
        run["loads"] = torch.from_numpy(drv.loads.copy())  # torch.load reads tensors only
        rec["runs"].append(run)
    tc.save_and_leave(rec, tmp, rank)


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="skipped: this torch build has no torch.distributed gloo backend")
def test_packed_balanced_training_equals_the_trainers(tmp_path):
    tc.run_ranks(packed_rank, 2, (str(tmp_path),), str(tmp_path))
    ranks = [torch.load(f"{tmp_path}/rank{r}.pt") for r in range(2)]
    assert any(rec["moved"] for rec in ranks)  # the packing is not the trainer's
    assert any(rec["own_moved"] for rec in ranks)  # nor are the ranks' own packings
    for rec in ranks:  # every driver plans the micro-steps of all ranks together
        trainer, packed, own = rec["runs"]
        assert torch.equal(own["loads"], ranks[0]["own_loads"] + ranks[1]["own_loads"])
        assert trainer["loads"].sum() == packed["loads"].sum() == own["loads"].sum()
    losses = []
    for r, rec in enumerate(ranks):
        trainer = rec["runs"][0]
        for name, run in zip(("packed", "own"), rec["runs"][1:]):
            assert run["owned"] == trainer["owned"]
            for n in trainer["grads"]:
                close(run["grads"][n], trainer["grads"][n], f"rank {r}, {name}: accumulated grad of {n}")
                close(run["params"][n], trainer["params"][n], f"rank {r}, {name}: {n} after the step")
        losses.append([run["loss"] for run in rec["runs"]])
    a, b, c = (sum(x[i] for x in losses) for i in range(3))
    close(torch.tensor([b, c]), torch.tensor([a, a]), "mini-batch-normalised loss over both ranks")
    per_mb = [[s / n for rec in ranks for s, n in rec["runs"][i]["per_mb"] if n] for i in range(3)]
    pa, pb, pc = (sum(v) / len(v) for v in per_mb)
    assert abs(pa - pb) > 1e-6 * abs(pa) and abs(pa - pc) > 1e-6 * abs(pa), (pa, pb, pc)
    assert sum(run["replicas"] for rec in ranks for run in rec["runs"]) > 0  # the plans did replicate


def test_verl_packing_example_runs():
    """examples/python/verl_packing.py: the packed micro-steps are more even under the owners' placement, recompute
    in the batch's order equals the whole batch, and the update equals the trainer's (it asserts both itself)."""
    examples = Path(__file__).resolve().parents[2] / "examples" / "python"
    r = subprocess.run([sys.executable, str(examples / "verl_packing.py")], cwd=examples, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.rstrip().endswith("done"), r.stdout
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("micro-step max/mean"))
    before, after = (np.array(x.split(", "), dtype=float) for x in re.findall(r"\[([^\]]*)\]", line))
    assert after.mean() < before.mean(), line
