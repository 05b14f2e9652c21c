"""foremoe.torch.replay: the router replay driver.

The three trainer shapes (verl with left padding, Megatron per-layer lists, slime per-micro-batch lists) count the
same loads as a direct count; the background thread's plans equal synchronous plans bitwise; one plan object per
micro-step; bad input, planner failures, timeouts and close() are handled; and over 2 gloo processes the driver
feeds the balanced layer for the recompute and update passes with results equal to the single-process reference.
"""

import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch (torch) is not installed; foremoe.torch needs it")

import foremoe  # noqa: E402
import foremoe.torch as ft  # noqa: E402


# -- random instances ------------------------------------------------------------------------------------------------


def random_trace(rng, max_tokens=300):
    """``[T, L, K]`` ids (skewed, with -1 drops) of a random dtype, ``[M + 1]`` offsets with non-empty micro-steps."""
    L, E, K = int(rng.integers(1, 5)), int(rng.integers(4, 40)), int(rng.integers(1, 5))
    K = min(K, E)
    M = int(rng.integers(1, 6))
    sizes = rng.integers(1, max_tokens // M + 2, size=M)
    T = int(sizes.sum())
    pop = np.exp(1.5 * rng.standard_normal(E))
    pop /= pop.sum()
    ids = np.stack([rng.choice(E, size=K, replace=False, p=pop) for _ in range(T * L)]).reshape(T, L, K)
    ids[rng.random(ids.shape) < 0.05] = -1
    dtype = [np.int16, np.int32, np.int64][int(rng.integers(0, 3))]
    return ids.astype(dtype), np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64), E


def bincount_loads(ids, offsets, E):
    """The independent reference: NumPy bincount per micro-step and layer."""
    M, L = len(offsets) - 1, ids.shape[1]
    out = np.zeros((M, L, E), dtype=np.int64)
    for m in range(M):
        seg = ids[offsets[m]:offsets[m + 1]].astype(np.int64)
        for l in range(L):
            v = seg[:, l].reshape(-1)
            out[m, l] = np.bincount(v[v >= 0], minlength=E)
    return out


def split_samples(rng, n):
    """Random cut of ``n`` tokens into 1-3 samples: their lengths."""
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(int(rng.integers(0, 3)), n - 1), replace=False))
    return np.diff(np.concatenate([[0], cuts, [n]])).tolist()


def as_verl(rng, ids, offsets):
    """verl's padded batch of the same tokens: samples as rows of ``[bs, seq, L, K]``, left padded with expert 0
    (not -1, as verl pads), rows shuffled, micro-batches as sample index lists; plus how many padded positions."""
    samples, groups = [], []
    for m in range(len(offsets) - 1):
        start, group = int(offsets[m]), []
        for n in split_samples(rng, int(offsets[m + 1] - offsets[m])):
            group.append(len(samples))
            samples.append(ids[start:start + n])
            start += n
        groups.append(group)
    seq = max(len(s) for s in samples) + int(rng.integers(1, 4))  # every sample has some padding
    perm = rng.permutation(len(samples))  # row of each sample
    routed = torch.zeros((len(samples), seq) + ids.shape[1:], dtype=torch.int64)
    mask = torch.zeros((len(samples), seq), dtype=torch.bool if rng.random() < 0.5 else torch.int64)
    for i, s in enumerate(samples):
        routed[perm[i], seq - len(s):] = torch.from_numpy(s.astype(np.int64))
        mask[perm[i], seq - len(s):] = 1
    return routed, mask, [[int(perm[i]) for i in g] for g in groups]


# -- the input forms ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(10))
def test_input_forms_give_the_direct_count(seed, tmp_path):
    rng = np.random.default_rng(seed)
    ids, off, E = random_trace(rng)
    M, L = len(off) - 1, ids.shape[1]
    want = bincount_loads(ids, off, E)
    assert np.array_equal(foremoe.count_loads(ids, off, num_experts=E), want)
    assert np.array_equal(ft.loads_from_ids(ids, off, num_experts=E), want)
    assert np.array_equal(ft.loads_from_ids(torch.from_numpy(ids), torch.from_numpy(off), num_experts=E), want)
    # Megatron: one [T, K] per MoE layer for the stage (strided views, read in place), or one list per micro-batch.
    per_layer = [torch.from_numpy(ids)[:, l] for l in range(L)]
    assert np.array_equal(ft.loads_from_megatron(per_layer, off, num_experts=E), want)
    per_micro = [[t[off[m]:off[m + 1]] for t in per_layer] for m in range(M)]
    assert np.array_equal(ft.loads_from_megatron(per_micro, num_experts=E), want)
    # files through the format registry: Megatron's stacked [L, T, K], plain [T, L, K] ids
    np.save(tmp_path / "mg.npy", np.ascontiguousarray(ids.transpose(1, 0, 2)))
    assert np.array_equal(ft.loads_from_megatron(str(tmp_path / "mg.npy"), off, num_experts=E), want)
    np.save(tmp_path / "ids.npy", ids)
    assert np.array_equal(ft.loads_from_file(tmp_path / "ids.npy", off, num_experts=E), want)
    # slime: per micro-batch a list of per-sample [len, L, K] arrays (or dicts), or indices into the samples.
    mbs, samples, index = [], [], []
    for m in range(M):
        seg, start, mb = ids[off[m]:off[m + 1]], 0, []
        for n in split_samples(rng, len(seg)):
            mb.append(seg[start:start + n] if rng.random() < 0.5 else {"rollout_routed_experts": seg[start:start + n]})
            start += n
        mbs.append(mb)
        index.append(list(range(len(samples), len(samples) + len(mb))))
        samples.extend(mb)
    assert np.array_equal(ft.loads_from_slime(mbs, num_experts=E), want)
    order = rng.permutation(len(samples))
    shuffled = [samples[i] for i in order]
    where = np.argsort(order)
    assert np.array_equal(ft.loads_from_slime([[int(where[i]) for i in g] for g in index], samples=shuffled,
                                              num_experts=E), want)
    # verl: left padding holds expert 0 and must not count.
    routed, mask, groups = as_verl(rng, ids, off)
    got = ft.loads_from_verl(routed, mask, groups, num_experts=E)
    assert np.array_equal(got, want)
    unmasked = ft.loads_from_verl(routed, torch.ones_like(mask), groups, num_experts=E)
    assert (unmasked[..., 0] > want[..., 0]).all()  # the padding would have counted as expert 0
    assert np.array_equal(unmasked[..., 1:], want[..., 1:])
    # A fixed micro-batch size splits consecutive rows.
    per_row = ft.loads_from_verl(routed, mask, 1, num_experts=E)
    assert np.array_equal(ft.loads_from_verl(routed, mask, 2, num_experts=E)[0], per_row[:2].sum(axis=0))
    assert np.array_equal(ft.loads_from_verl(routed, mask, None, num_experts=E)[0], want.sum(axis=0))


def test_layer_map_drops_dense_layers():
    rng = np.random.default_rng(3)
    ids, off, E = random_trace(rng)
    L = ids.shape[1]
    lm = [-1] + list(range(L - 1))  # the first trace layer is dense
    want = bincount_loads(ids[:, 1:], off, E) if L > 1 else np.zeros((len(off) - 1, 0, E), np.int64)
    assert np.array_equal(ft.loads_from_ids(ids, off, num_experts=E, layer_map=lm), want)


def test_device_counter_is_used_for_device_ids():
    # No GPU here: a counter is still called for a tensor on the "meta" device (not the CPU), with the arguments of
    # foremoe.count_loads, and its result is what the driver plans from.
    ids = torch.zeros((6, 2, 2), dtype=torch.int64, device="meta")
    calls = []

    def counter(t, offsets, *, num_experts, layer_map, mask):
        calls.append((t.device.type, None if offsets is None else list(offsets), num_experts, layer_map, mask))
        return torch.arange(2 * 2 * num_experts).reshape(2, 2, num_experts)

    got = ft.loads_from_ids(ids, [0, 4, 6], num_experts=5, counter=counter)
    assert calls == [("meta", [0, 4, 6], 5, None, None)]
    assert np.array_equal(got, np.arange(20).reshape(2, 2, 5))


def test_device_counter_counts_the_registry_parts():
    # verl, Megatron and slime ids on a device are laid out by the C++ registry (metadata only) and counted there part
    # by part; each part's segments land in their micro-steps and layers.
    calls = []

    def counter(t, offsets, *, num_experts, layer_map, mask):
        calls.append((tuple(t.shape), list(offsets), None if mask is None else list(mask)))
        segs, layers = len(offsets) - 1, t.shape[1]
        return torch.arange(1, segs * layers * num_experts + 1).reshape(segs, layers, num_experts) * 10 ** len(calls)

    routed = torch.zeros((2, 3, 1, 2), dtype=torch.int64, device="meta")
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    got = ft.loads_from_verl(routed, mask, [[1], [0]], num_experts=2, counter=counter)
    assert calls == [((6, 1, 2), [0, 3, 6], [0, 1, 1, 1, 1, 1])]
    c = np.arange(1, 5).reshape(2, 1, 2) * 10
    assert np.array_equal(got, np.stack([c[1], c[0]]))
    calls.clear()
    per_layer = [torch.zeros((5, 2), dtype=torch.int32, device="meta") for _ in range(2)]
    got = ft.loads_from_megatron(per_layer, [0, 2, 5], num_experts=3, counter=counter)
    assert calls == [((5, 1, 2), [0, 2, 5], None)] * 2
    assert np.array_equal(got[:, 0], np.arange(1, 7).reshape(2, 3) * 10)
    assert np.array_equal(got[:, 1], np.arange(1, 7).reshape(2, 3) * 100)
    calls.clear()
    samples = [torch.zeros((n, 2, 1), dtype=torch.int16, device="meta") for n in (3, 1, 2)]
    got = ft.loads_from_slime([[0, 2], [1]], samples=samples, num_experts=2, counter=counter)
    assert [c[0] for c in calls] == [(3, 2, 1), (2, 2, 1), (1, 2, 1)]
    part = [np.arange(1, 5).reshape(2, 2) * 10 ** i for i in (1, 2, 3)]
    assert np.array_equal(got, np.stack([part[0] + part[1], part[2]]))


# -- planning in the background thread --------------------------------------------------------------------------------


def random_stage(rng):
    nodes, per = [(1, 2), (1, 4), (2, 2), (2, 3)][int(rng.integers(0, 4))]
    G = nodes * per
    E = G * int(rng.integers(2, 6))
    S = E // G + int(rng.integers(1, 4))
    M, L = int(rng.integers(1, 7)), int(rng.integers(1, 4))
    pop = np.exp(2.0 * rng.standard_normal((M, L, E)))
    loads = np.stack([[rng.multinomial(int(rng.integers(50, 2000)), p / p.sum()) for p in pm] for pm in pop])
    return foremoe.Topology(nodes, per, S), loads.astype(np.int64), G, E, L


def same_plan(a, b):
    for name in ("gpu_slots", "slot_tokens", "owner_gpu", "replica_count", "moves", "log_to_phys"):
        assert np.array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name))), name


@pytest.mark.parametrize("seed", range(12))
def test_background_plans_equal_synchronous_plans(seed):
    rng = np.random.default_rng(100 + seed)
    topo, loads, G, E, L = random_stage(rng)
    owners = None
    if seed % 3 == 1:
        owners = ft.contiguous_owners(E, G)
    elif seed % 3 == 2:  # another sharding per layer
        owners = np.stack([rng.permutation(ft.contiguous_owners(E, G)) for _ in range(L)])
    resident = None
    if seed % 2:
        warm = np.maximum(loads[::-1] + rng.integers(0, 5, size=loads.shape), 0)
        resident = foremoe.Planner(topo).plan(warm, owners=owners)[-1]
    kw = dict(owners=owners, resident=resident, stage="recompute" if seed % 4 == 3 else "update")
    # With a tolerance the update stage's plans depend on the replica gradients held so far, which the driver's
    # one-micro-step-per-call path (owners given) chains like one call over the stage.
    tol = 1.02 if seed >= 6 else None
    want = foremoe.Planner(topo, tolerance=tol).plan(loads, **kw)
    with ft.ReplayDriver(foremoe.Planner(topo, tolerance=tol), loads, num_layers=L, **kw) as d:
        got = [d.plan(m) for m in reversed(range(len(d)))][::-1]  # asked last first: each waits
        assert [p for p in d] == got
        for m, p in enumerate(got):
            assert d.plan(m, layer=L - 1) is p  # one object per micro-step, for every pass
        assert d.last_plan is got[-1]
    assert not d.running
    assert len(got) == len(want)
    for a, b in zip(got, want):
        same_plan(a, b)
    assert not np.asarray(got[0].gpu_slots).flags.writeable


def test_drivers_sharing_a_planner_take_turns():
    rng = np.random.default_rng(7)
    topo, loads, G, E, L = random_stage(rng)
    owners = ft.contiguous_owners(E, G)
    want = foremoe.Planner(topo).plan(loads, owners=owners)
    shared = foremoe.Planner(topo)
    drivers = [ft.ReplayDriver(shared, loads, owners=owners) for _ in range(3)]
    for d in drivers:
        with d:
            for a, b in zip(d, want):
                same_plan(a, b)


class ScriptedPlanner:
    """A planner that fails, or waits for an event, at a given micro-step (else plans with a real planner)."""

    def __init__(self, topo, fail_at=None, block_at=None, delay=0.0):
        self.inner, self.calls = foremoe.Planner(topo), 0
        self.fail_at, self.block_at, self.delay = fail_at, block_at, delay
        self.release = threading.Event()

    def plan(self, loads, resident=None, **kw):
        m, self.calls = self.calls, self.calls + 1
        if m == self.block_at:
            self.release.wait(10.0)
        if m == self.fail_at:
            raise ValueError(f"scripted failure at call {m}")
        time.sleep(self.delay)
        return self.inner.plan(loads, resident=resident, **kw)


def stage(M=4, E=8, G=2, spare=2):
    rng = np.random.default_rng(M)
    return (foremoe.Topology(1, G, E // G + spare), rng.integers(0, 50, size=(M, 1, E)).astype(np.int64),
            ft.contiguous_owners(E, G))


def test_planner_exception_surfaces_in_the_caller():
    topo, loads, owners = stage()
    with ft.ReplayDriver(ScriptedPlanner(topo, fail_at=2), loads, owners=owners) as d:
        assert d.plan(0) is not None and d.plan(1) is not None  # planned before the failure: still handed out
        for m in (2, 3):
            with pytest.raises(ft.ReplayError, match="planning micro-step 2 of the update stage failed") as info:
                d.plan(m)
            assert isinstance(info.value.__cause__, ValueError)
            assert "scripted failure at call 2" in str(info.value)
    # A real planner failing in C++ (an owner rank outside the topology) is reported the same way.
    bad = owners.copy()
    bad[0] = 7
    with ft.ReplayDriver(foremoe.Planner(topo), loads, owners=bad) as d:
        with pytest.raises(ft.ReplayError, match="micro-step 0") as info:
            d.plan(0)
        assert isinstance(info.value.__cause__, ValueError)


def test_waits_have_deadlines_and_close_joins_the_thread():
    topo, loads, owners = stage(M=3)
    sp = ScriptedPlanner(topo, block_at=1)
    d = ft.ReplayDriver(sp, loads, owners=owners, timeout=5.0)
    assert d.plan(0) is not None
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="micro-step 1 of the update stage was not planned within 0.2 s"):
        d.plan(1, timeout=0.2)
    assert time.monotonic() - t0 < 2.0
    sp.release.set()
    d.close()
    assert not d.running
    assert d.plan(0) is not None  # made before close: still available
    # close() while planning: the thread stops after the micro-step in progress and is joined.
    topo, loads, owners = stage(M=60)
    d = ft.ReplayDriver(ScriptedPlanner(topo, delay=0.02), loads, owners=owners)
    d.plan(1)
    d.close()
    assert not d.running
    assert not d.ready(59)
    with pytest.raises(RuntimeError, match="micro-step 59 was not planned: the driver was closed"):
        d.plan(59)
    # A planner that never returns: close() gives up at its deadline instead of hanging.
    sp = ScriptedPlanner(topo, block_at=0)
    d = ft.ReplayDriver(sp, loads, owners=owners)
    with pytest.raises(RuntimeError, match="did not stop within 0.1 s"):
        d.close(timeout=0.1)
    sp.release.set()
    d.close()
    assert not d.running


def test_not_started_driver():
    topo, loads, owners = stage()
    d = ft.ReplayDriver(foremoe.Planner(topo), loads, owners=owners, start=False)
    with pytest.raises(RuntimeError, match="before start"):
        d.plan(0)
    with d.start():
        assert d.plan(0) is not None


# -- bad input ---------------------------------------------------------------------------------------------------------

_ids = np.random.default_rng(0).integers(0, 8, size=(10, 2, 2)).astype(np.int32)
_off = np.array([0, 4, 10])


def _out_of_range(a, where, value=99):
    b = a.copy()
    b[where] = value
    return b


def _verl_batch():
    r = torch.zeros((2, 6, 2, 2), dtype=torch.int64)
    r[:, 2:] = torch.from_numpy(_ids[:8].reshape(2, 4, 2, 2))
    m = torch.zeros((2, 6), dtype=torch.int64)
    m[:, 2:] = 1
    return r, m


BAD = {
    "ids_out_of_range": (lambda: ft.loads_from_ids(_out_of_range(_ids, (5, 1, 0)), _off, num_experts=8),
                         "expert id 99 at token 5, layer 1, k 0"),
    "ids_float": (lambda: ft.loads_from_ids(_ids.astype(np.float32), _off, num_experts=8), "dtype float32"),
    "ids_not_3d": (lambda: ft.loads_from_ids(_ids[0], None, num_experts=8), "3 dimensions, got shape [2, 2]"),
    "offsets_short": (lambda: ft.loads_from_ids(_ids, [0, 4, 9], num_experts=8),
                      "microbatch_offsets end at 9 but the trace has 10 tokens"),
    "offsets_long": (lambda: ft.loads_from_ids(_ids, [0, 11], num_experts=8), "end at 11 but the trace has 10"),
    "offsets_decrease": (lambda: ft.loads_from_ids(_ids, [0, 6, 4, 10], num_experts=8), "decrease at index 2: 6 then 4"),
    "mask_shape": (lambda: ft.loads_from_ids(_ids, _off, num_experts=8, mask=np.ones(9)), "mask must be [10]"),
    "megatron_id": (lambda: ft.loads_from_megatron([_ids[:, 0], _out_of_range(_ids[:, 1], (3, 1), -4)], _off,
                                                   num_experts=8), "layer 1"),
    "megatron_tokens": (lambda: ft.loads_from_megatron([_ids[:, 0], _ids[:9, 1]], _off, num_experts=8),
                        "layer 1 has indices [9, 2], layer 0 [10, 2]"),
    "megatron_layers": (lambda: ft.loads_from_megatron([[_ids[:4, 0], _ids[:4, 1]], [_ids[4:, 0]]], num_experts=8),
                        "micro-batch 1 has 1 MoE layers, micro-batch 0 has 2"),
    "megatron_offsets": (lambda: ft.loads_from_megatron([_ids[:, 0]], [0, 3], num_experts=8),
                         "end at 3 but the trace has 10 tokens"),
    "slime_layers": (lambda: ft.loads_from_slime([[_ids[:4]], [_ids[4:, :1]]], num_experts=8),
                     "micro-batch 1, sample 0 has [layers, topk] [1, 2], the first sample [2, 2]"),
    "slime_id": (lambda: ft.loads_from_slime([[_ids[:4]], [_out_of_range(_ids[4:], (2, 0, 1), 8)]], num_experts=8),
                 "micro-batch 1, sample 0"),
    "slime_missing_sample": (lambda: ft.loads_from_slime([[0], [2]], samples=[_ids[:3], _ids[3:6], _ids[6:]],
                                                         num_experts=8), "sample 1 is in no micro-batch"),
    "verl_mask_shape": (lambda: ft.loads_from_verl(_verl_batch()[0], _verl_batch()[1].T, num_experts=8),
                        "attention_mask must be [2, 6] to match routed_experts [2, 6, 2, 2], got [6, 2]"),
    "verl_mask_value": (lambda: ft.loads_from_verl(_verl_batch()[0], _verl_batch()[1] * 2, num_experts=8),
                        "attention_mask[0, 2] = 2 is not 0 or 1"),
    "verl_micro_batch_size": (lambda: ft.loads_from_verl(*_verl_batch(), 0, num_experts=8),
                              "micro-batch size must be positive, got 0"),
    "verl_no_mask": (lambda: ft.loads_from_verl(_verl_batch()[0], None, num_experts=8), "attention_mask is required"),
    "verl_not_4d": (lambda: ft.loads_from_verl(_verl_batch()[0][0], _verl_batch()[1], num_experts=8),
                    "4 dimensions"),
    "verl_id": (lambda: ft.loads_from_verl(torch.from_numpy(_out_of_range(_verl_batch()[0].numpy(), (1, 4, 0, 1),
                                                                          12)), _verl_batch()[1], num_experts=8),
                "expert id 12"),
    "verl_duplicate_sample": (lambda: ft.loads_from_verl(*_verl_batch(), [[0, 1], [1]], num_experts=8),
                              "sample 1 is in micro-batch 0 and micro-batch 1"),
    "verl_sample_out_of_range": (lambda: ft.loads_from_verl(*_verl_batch(), [[0], [1, 2]], num_experts=8),
                                 "micro-batch 1 names sample 2, outside [0, 2)"),
    "driver_layers": (lambda: ft.ReplayDriver.from_ids(foremoe.Planner(foremoe.Topology(1, 2, 6)), _ids, _off,
                                                       num_experts=8, num_layers=3, start=False),
                      "the recorded routing has 2 MoE layers, the model 3"),
    "driver_owners": (lambda: ft.ReplayDriver(foremoe.Planner(foremoe.Topology(1, 2, 6)), np.ones((2, 1, 8), np.int64),
                                              owners=np.zeros(7, np.int64), start=False), "owners must be [8]"),
    "driver_negative": (lambda: ft.ReplayDriver(foremoe.Planner(foremoe.Topology(1, 2, 6)),
                                                -np.ones((2, 1, 8), np.int64), start=False), "negative load -1"),
    "driver_stage": (lambda: ft.ReplayDriver(foremoe.Planner(foremoe.Topology(1, 2, 6)), np.ones((2, 1, 8), np.int64),
                                             stage="rollout", start=False), "'rollout'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_clear_error(case):
    fn, text = BAD[case]
    with pytest.raises(ValueError) as info:
        fn()
    assert text in str(info.value), str(info.value)


def test_micro_step_or_layer_outside_the_stage():
    topo, loads, owners = stage(M=3)
    with ft.ReplayDriver(foremoe.Planner(topo), loads, owners=owners) as d:
        with pytest.raises(ValueError, match=r"micro-step 3 outside the update stage's \[0, 3\) micro-steps"):
            d.plan(3)
        with pytest.raises(ValueError, match="micro-step -1 outside"):
            d.plan(-1)
        with pytest.raises(ValueError, match=r"layer 1 outside the recorded routing's \[0, 1\) MoE layers"):
            d.plan(0, layer=1)
        with pytest.raises(ValueError, match="micro_step must be an int"):
            d.plan(1.0)


# -- across processes: recompute and update replayed through the balanced layer ----------------------------------------

if torch.distributed.is_available() and torch.distributed.is_gloo_available():
    import torch_moe_cases as tc  # noqa: E402
    from torch_moe_cases import close  # noqa: E402

    REPLAY_CASE = tc.Case(world=2, experts=16, topk=2, hidden=32, ffn=40, steps=3, micro=3, dtype="float64", seed=11)


def replay_rank(rank, case, tmp):
    """One rank: every RL step's routing goes to a driver in one of the three trainer shapes (loads summed over the
    group); the recompute pass (no grad) and the update pass (forward + backward, the layer under activation
    checkpointing so the backward recomputes it and asks the driver again) run each micro-step under its plan."""
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint

    tc.init_group(rank, case.world, tmp)
    world = dist.group.WORLD
    E = case.experts
    data = tc.make_data(case)
    layer = ft.BalancedMoE(tc.make_experts(case), case.slots, timeout=60.0)
    opt = tc.make_optimizer(layer.parameters())
    planner = foremoe.Planner(foremoe.Topology(case.nodes, case.world // case.nodes, case.slots))
    rec = {"out": [], "recompute": [], "x_grad": [], "w_grad": [], "grads": [], "params": [], "loads_equal": [],
           "one_plan": [], "moves": 0, "owned": layer.storage.owned_experts, "names": list(layer.storage.names)}
    # The ranks disagree on the micro-step count: both fail with the shapes named, and the group stays usable.
    try:
        ft.ReplayDriver(planner, np.zeros((rank + 2, 1, E), np.int64), group=world, timeout=30.0)
        rec["shape_error"] = "no error"
    except ValueError as e:
        rec["shape_error"] = str(e)
    # An id out of range on rank 1 only: rank 1 names it, rank 0 names rank 1 (nobody waits for the other).
    ids = data[0][0][rank]["ids"].clone()
    if rank == 1:
        ids[2, 1] = 99
    try:
        ft.ReplayDriver.from_megatron(planner, [ids], num_experts=E, group=world, timeout=30.0)
        rec["id_error"] = "no error"
    except ValueError as e:
        rec["id_error"] = str(e)
    resident = None
    for s, step in enumerate(data):
        mine = [step[m][rank]["ids"] for m in range(case.micro)]
        sizes = [int(t.shape[0]) for t in mine]
        kw = dict(num_experts=E, owners=layer.owners, resident=resident, num_layers=1, group=world, timeout=60.0)
        if s % 3 == 0:  # Megatron: one [T, K] per MoE layer for the stage, token offsets
            drv = ft.ReplayDriver.from_megatron(planner, [torch.cat(mine)], np.cumsum([0] + sizes), **kw)
        elif s % 3 == 1:  # verl: one left-padded sample per micro-step, rows in reverse order, index lists
            seq = max(sizes) + 3
            routed = torch.zeros((case.micro, seq, 1, case.topk), dtype=torch.int64)
            mask = torch.zeros((case.micro, seq), dtype=torch.int64)
            for m, t in enumerate(mine):
                routed[case.micro - 1 - m, seq - sizes[m]:, 0] = t
                mask[case.micro - 1 - m, seq - sizes[m]:] = 1
            drv = ft.ReplayDriver.from_verl(planner, routed, mask, [[case.micro - 1 - m] for m in range(case.micro)],
                                            **kw)
        else:  # slime: per micro-batch, two samples [len, 1, K]
            drv = ft.ReplayDriver.from_slime(planner, [[t[:n // 2, None], t[n // 2:, None]]
                                                       for t, n in zip(mine, sizes)], **kw)
        with drv:
            rec["loads_equal"].append(bool(np.array_equal(drv.loads, tc.step_loads(case, step))))
            first = []
            with torch.no_grad():  # recompute: forward only
                for m, ranks in enumerate(step):
                    d = ranks[rank]
                    p = drv.plan(m)
                    first.append(p)
                    rec["recompute"].append(layer(d["x"], d["ids"], torch.softmax(d["logits"], dim=-1), p))
                    rec["moves"] += layer.last_sync.moves  # the update pass then reuses these replicas
            for m, ranks in enumerate(step):  # update: forward + backward with gradient accumulation
                d = ranks[rank]
                seen = []

                def run(x, logits, m=m, d=d, seen=seen):
                    p = drv.plan(m)
                    seen.append(p)
                    return layer(x, d["ids"], torch.softmax(logits, dim=-1), p)

                x = d["x"].clone().requires_grad_(True)
                logits = d["logits"].clone().requires_grad_(True)
                out = checkpoint(run, x, logits)
                (out * d["target"]).sum().backward()
                rec["one_plan"].append(len(seen) == 2 and all(p is first[m] for p in seen))
                tc.record_micro_step(rec, layer, out, x, logits)
            resident = drv.last_plan
        tc.optimizer_step(rec, opt, layer)
    tc.save_and_leave(rec, tmp, rank)


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="skipped: this torch build has no torch.distributed gloo backend")
def test_replayed_training_equals_reference(tmp_path):
    case = REPLAY_CASE
    tc.run_ranks(replay_rank, case.world, (case, str(tmp_path)), str(tmp_path))
    ranks = [torch.load(f"{tmp_path}/rank{r}.pt") for r in range(case.world)]
    ref = tc.reference(case)
    for r, rec in enumerate(ranks):
        other = 1 - r
        assert f"rank {other} has loads of shape [{other + 2}, 1, 16]" in rec["shape_error"], rec["shape_error"]
        want = "expert id 99 at token 2, layer 0, k 1" if r == 1 else "rank 1 of the group rejected its routing"
        assert want in rec["id_error"], rec["id_error"]
        assert rec["loads_equal"] == [True] * case.steps  # every form, summed over the ranks
        assert rec["one_plan"] == [True] * (case.steps * case.micro)
        owned = torch.tensor(rec["owned"])
        for i in range(case.steps * case.micro):
            close(rec["recompute"][i], ref["out"][i][r], case.dtype, f"rank {r} micro-step {i} recompute output")
            assert torch.equal(rec["recompute"][i], rec["out"][i]), f"rank {r} micro-step {i}: recompute != update"
            close(rec["out"][i], ref["out"][i][r], case.dtype, f"rank {r} micro-step {i} output")
            close(rec["x_grad"][i], ref["x_grad"][i][r], case.dtype, f"rank {r} micro-step {i} input grad")
            close(rec["w_grad"][i], ref["w_grad"][i][r], case.dtype, f"rank {r} micro-step {i} routing grad")
            for n in rec["names"]:
                close(rec["grads"][i][n], ref["grads"][i][n][owned], case.dtype, f"rank {r} micro-step {i} grad {n}")
        for s in range(case.steps):
            for n in rec["names"]:
                close(rec["params"][s][n], ref["params"][s][n][owned], case.dtype, f"rank {r} step {s} {n}")
    assert ranks[0]["moves"] > 0  # the plans replicated: weights moved
