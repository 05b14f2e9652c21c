import json
import subprocess
import sys

import numpy as np
import pytest

import foremoe


def loads_mle(seed=0, M=3, L=4, E=32):
    rng = np.random.default_rng(seed)
    w = np.exp(1.2 * rng.standard_normal((1, L, E)))
    return rng.poisson(w * 200, size=(M, L, E)).astype(np.int64)


TOPO = dict(nodes=2, gpus_per_node=4, slots=6)


def test_topology():
    t = foremoe.Topology(2, 4, 6)
    assert (t.nodes, t.gpus_per_node, t.slots, t.num_gpus) == (2, 4, 6, 8)
    with pytest.raises(ValueError, match="gpus_per_node must be positive, got 0"):
        foremoe.Topology(1, 0, 2)
    # Link rates are the cost model's (cost.move_*), not the shape's: the old keywords are gone.
    assert not hasattr(t, "nvlink_gb_per_s")
    with pytest.raises(TypeError):
        foremoe.Topology(1, 8, 2, nvlink_gb_per_s=450.0)


def check_plan(p, loads_le, topo):
    L, E = loads_le.shape
    G, S = topo.num_gpus, topo.slots
    assert p.gpu_slots.shape == (L, G, S) and p.gpu_slots.dtype == np.int32
    assert p.slot_tokens.shape == (L, G, S) and p.slot_tokens.dtype == np.int64
    assert p.phys_to_log.shape == (L, G * S)
    assert p.replica_count.shape == (L, E) and p.owner_gpu.shape == (L, E)
    assert p.moves.shape[1] == 5 and p.imbalance.shape == (L,)
    for l in range(L):
        p2l = p.phys_to_log[l]
        np.testing.assert_array_equal(np.bincount(p2l[p2l >= 0], minlength=E), p.replica_count[l])
        # Token split covers every expert's load exactly, only on slots holding it.
        got = np.bincount(np.where(p2l >= 0, p2l, E), weights=p.slot_tokens[l].ravel(), minlength=E + 1)
        np.testing.assert_array_equal(got[:E].astype(np.int64), loads_le[l])
        assert got[E] == 0
        off, phys = p.log_to_phys_offsets[l], p.log_to_phys[l]
        for e in range(E):
            copies = phys[off[e]:off[e + 1]]
            assert np.all(p2l[copies] == e) and len(copies) == p.replica_count[l, e]
        assert p.gpu_slots[l][p.owner_gpu[l], :].shape[0] == E
        assert np.all([e in p.gpu_slots[l, p.owner_gpu[l, e]] for e in range(E)])
    assert np.all(p.imbalance >= 1.0 - 1e-12)


@pytest.mark.parametrize("strategy", foremoe.STRATEGIES)
def test_plan_shapes_and_invariants(strategy):
    loads = loads_mle()
    topo = foremoe.Topology(**TOPO)
    plans = foremoe.Planner(topo, strategy=strategy).plan(loads)
    assert isinstance(plans, list) and len(plans) == loads.shape[0]
    for m, p in enumerate(plans):
        check_plan(p, loads[m], topo)


def test_single_micro_step_and_round_trip():
    loads = loads_mle()[0]
    topo = foremoe.Topology(**TOPO)
    planner = foremoe.Planner(topo)
    p = planner.plan(loads)
    assert isinstance(p, foremoe.Plan) and p.num_moves > 0
    assert np.all(p.moves[:, 0] < loads.shape[0])
    again = planner.plan(loads, resident=p)
    assert again.num_moves == 0
    np.testing.assert_array_equal(again.gpu_slots, p.gpu_slots)
    # Placement objects and plain arrays work as resident too.
    assert planner.plan(loads, resident=p.placement).num_moves == 0
    assert planner.plan(loads, resident=p.gpu_slots.copy()).num_moves == 0
    assert p.placement == foremoe.Placement.from_array(topo, p.gpu_slots.copy(), loads.shape[1])


def test_arrays_are_views_kept_alive_by_the_plan():
    topo = foremoe.Topology(**TOPO)
    p = foremoe.Planner(topo).plan(loads_mle()[0])
    a = p.slot_tokens
    assert not a.flags.writeable
    assert np.shares_memory(p.gpu_slots, p.phys_to_log)
    ref = a.copy()
    del p
    np.testing.assert_array_equal(a, ref)


def test_threads_do_not_change_plans():
    loads = loads_mle(L=8)
    topo = foremoe.Topology(**TOPO)
    a = foremoe.Planner(topo, threads=1).plan(loads)
    b = foremoe.Planner(topo, threads=4).plan(loads)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.gpu_slots, y.gpu_slots)
        np.testing.assert_array_equal(x.slot_tokens, y.slot_tokens)


def test_one_planner_from_several_threads_plans_as_alone():
    # A ReplayDriver's thread and the trainer's thread may call one Planner at once; the calls take turns, and
    # alternating shapes (which rebuild the C++ planner) must not hand one thread the other's planner.
    import threading
    topo = foremoe.Topology(**TOPO)
    inputs = [loads_mle(seed=s, M=2, L=2 + s % 3, E=16 + 8 * (s % 2)) for s in range(6)]
    want = [[(p.gpu_slots.copy(), p.slot_tokens.copy()) for p in foremoe.Planner(topo).plan(x)] for x in inputs]
    shared = foremoe.Planner(topo)
    errors = []

    def work(offset):
        try:
            for r in range(40):
                i = (offset + r) % len(inputs)
                for (gs, st), p in zip(want[i], shared.plan(inputs[i])):
                    if not (np.array_equal(p.gpu_slots, gs) and np.array_equal(p.slot_tokens, st)):
                        errors.append(f"thread {offset} round {r} input {i}: a different plan")
        except Exception as e:  # a crash inside a worker fails the test below, naming it
            errors.append(f"thread {offset}: {e!r}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]


def test_float_and_narrow_int_loads():
    loads = loads_mle()
    topo = foremoe.Topology(**TOPO)
    ref = foremoe.Planner(topo).plan(loads)
    for x in (loads.astype(np.float64), loads.astype(np.int32)):
        got = foremoe.Planner(topo).plan(x)
        np.testing.assert_array_equal(got[-1].slot_tokens, ref[-1].slot_tokens)


@pytest.mark.parametrize("make, match", [
    (lambda L: np.full((4, 32), -1), "negative load -1 at micro-step 0, layer 0, expert 0"),
    (lambda L: np.zeros((2, 3, 4, 5)), r"loads must be \[layers, experts\] or \[micro_steps, layers, experts\]"),
    (lambda L: L.astype(np.float64) + 0.5, r"plan: loads\[0, 0\] = \d+\.5 is not an integer"),
    (lambda L: np.zeros((4, 100)), "cannot hold all 100 experts"),
])
def test_bad_loads(make, match):
    planner = foremoe.Planner(foremoe.Topology(1, 8, 4))
    with pytest.raises(ValueError, match=match):
        planner.plan(make(loads_mle()[0]))


def test_bad_options_and_resident():
    topo = foremoe.Topology(**TOPO)
    with pytest.raises(ValueError, match=r"unknown strategy 'greedy' \(registered: static, eplb, eplb-split, eplb-oracle, ultraep, "
                       "moonep, foremoe, foremoe-free"):
        foremoe.Planner(topo, strategy="greedy")
    with pytest.raises(ValueError, match="Planner: unknown key 'mode'"):
        foremoe.Planner(topo, mode="free")
    assert foremoe.STRATEGIES[:8] == ("static", "eplb", "eplb-split", "eplb-oracle", "ultraep", "moonep", "foremoe",
                                      "foremoe-free")
    with pytest.raises(ValueError, match=r"Planner.threads: must be in \[1, 1024\], got 0"):
        foremoe.Planner(topo, threads=0)
    with pytest.raises(ValueError, match="unknown stage 'train'"):
        foremoe.Planner(topo).plan(loads_mle()[0], stage="train")
    p = foremoe.Planner(topo).plan(loads_mle()[0])
    other = foremoe.Planner(foremoe.Topology(1, 8, 6))
    with pytest.raises(ValueError, match="resident placement is 8 GPUs x 6 slots"):
        foremoe.Planner(foremoe.Topology(1, 4, 12)).plan(loads_mle()[0], resident=p)
    with pytest.raises(ValueError, match="resident placement has 4 layers, the loads have 2"):
        other.plan(loads_mle(L=2)[0], resident=p)
    bad = p.gpu_slots.copy()
    bad[0, 0, :2] = 3
    with pytest.raises(ValueError, match="layer 0: LayerPlacement: GPU 0 holds two copies of expert 3"):
        foremoe.Placement.from_array(topo, bad, 32)


def test_plan_matches_cli(cli, tmp_path):
    loads = loads_mle(M=3, L=4, E=32)
    np.save(tmp_path / "loads.npy", loads)
    out = tmp_path / "plan.json"
    args = ["--loads", str(tmp_path / "loads.npy"), "--nodes", "2", "--gpus-per-node", "4", "--slots", "6"]
    subprocess.run([cli, "plan", *args, "--out", str(out)], check=True, capture_output=True)
    ref = json.loads(out.read_text())
    pyout = tmp_path / "plan_py.json"
    subprocess.run([sys.executable, "-m", "foremoe", "plan", *args, "--out", str(pyout)], check=True,
                   capture_output=True)
    got = json.loads(pyout.read_text())
    ref.pop("planner_seconds")
    got.pop("planner_seconds")
    assert got == ref


def test_exact_split_changes_only_the_split():
    loads = loads_mle(seed=3, M=4, L=6)
    topo = foremoe.Topology(**TOPO)
    fast = foremoe.Planner(topo).plan(loads)
    exact = foremoe.Planner(topo, exact_split=True).plan(loads)
    for m, (a, b) in enumerate(zip(fast, exact)):
        check_plan(b, loads[m], topo)
        np.testing.assert_array_equal(a.gpu_slots, b.gpu_slots)
        assert np.all(b.imbalance <= a.imbalance + 1e-12)


def test_paid_reowning_plans_are_valid():
    loads = loads_mle(seed=4)
    topo = foremoe.Topology(**TOPO)
    for m, p in enumerate(foremoe.Planner(topo, reowning_free=False).plan(loads)):
        check_plan(p, loads[m], topo)


@pytest.mark.parametrize("seed", range(4))
def test_tolerance_met_matches_max_gpu_load(seed):
    # tolerance_met[l] says whether the layer's busiest GPU is within tolerance x mean GPU load (the library's
    # floor rule); without a tolerance every layer meets it.
    loads = loads_mle(seed, M=2, E=32)
    topo = foremoe.Topology(**TOPO)
    for tol in (0.0, 1.0, 1.02, 1.3):
        for m, p in enumerate(foremoe.Planner(topo, strategy="foremoe", tolerance=tol).plan(loads)):
            assert len(p.tolerance_met) == p.num_layers
            for l in range(p.num_layers):
                limit = np.floor(loads[m, l].sum() / topo.num_gpus * tol * (1 + 1e-12))
                want = tol == 0.0 or p.max_gpu_load[l] <= limit
                assert p.tolerance_met[l] == want, (tol, m, l, p.max_gpu_load[l], limit)


def _gradient_returns(plans, gpus, slots):
    """(held returns, every-micro-step returns) of a chain of update plans, counted here on their own: a replica that
    runs tokens holds a gradient for its owner until a plan no longer keeps it on that GPU for that owner."""
    held = every = 0
    owes = {}  # (layer, gpu, expert) -> owner
    for p in plans:
        owner = np.asarray(p.owner_gpu)
        placed = np.asarray(p.phys_to_log).reshape(p.num_layers, gpus, slots)
        tokens = np.asarray(p.slot_tokens).reshape(p.num_layers, gpus, slots)
        keep, runs = {}, {}
        for l, g, s in zip(*np.nonzero(placed >= 0)):
            e = int(placed[l, g, s])
            if owner[l, e] != g:
                keep[(int(l), int(g), e)] = int(owner[l, e])
                if tokens[l, g, s] > 0:
                    runs[(int(l), int(g), e)] = int(owner[l, e])
        every += len(runs)
        held += sum(1 for k, o in owes.items() if keep.get(k) != o)
        owes = {k: o for k, o in owes.items() if keep.get(k) == o}
        owes.update(runs)
    return held + len(owes), every


@pytest.mark.parametrize("seed", range(3))
def test_hold_replica_gradients_keyword(seed):
    # The keyword reaches the planner: plans stay valid under both settings, and held returns never exceed
    # every-micro-step returns of the same plans.
    loads = loads_mle(seed, M=5, L=3, E=32)
    topo = foremoe.Topology(**TOPO)
    counts = {}
    for hold in (True, False):
        plans = foremoe.Planner(topo, strategy="foremoe", tolerance=1.02, hold_replica_gradients=hold).plan(loads)
        for m, p in enumerate(plans):
            check_plan(p, loads[m], topo)
        counts[hold] = _gradient_returns(plans, topo.num_gpus, topo.slots)
        assert counts[hold][0] <= counts[hold][1]
    with pytest.raises(ValueError, match="hold_replica_gradients"):
        foremoe.Planner(topo, hold_replica_gradients="yes")


@pytest.mark.parametrize("seed", range(3))
def test_held_chains_single_micro_steps_like_one_call(seed):
    # A stage planned one micro-step per call under fixed owners, with one HeldGradients passed to every call, gets
    # the plans of one call over the whole stage (the replay driver's streaming path).
    loads = loads_mle(seed, M=5, L=3, E=32)
    topo = foremoe.Topology(**TOPO)
    planner = foremoe.Planner(topo, strategy="foremoe", tolerance=1.02)
    owners = np.asarray(planner.plan(loads)[0].owner_gpu)
    whole = planner.plan(loads, owners=owners)
    held = foremoe.HeldGradients(loads.shape[1], topo.num_gpus, loads.shape[2])
    prev = None
    for m in range(loads.shape[0]):
        p = planner.plan(loads[m], resident=prev, owners=owners, held=held)
        for name in ("phys_to_log", "slot_tokens", "num_moves"):
            assert np.array_equal(np.asarray(getattr(p, name)), np.asarray(getattr(whole[m], name))), (m, name)
        prev = p
    assert sum(held.count(l) for l in range(loads.shape[1])) > 0  # replicas hold gradients after the stage
    with pytest.raises(ValueError, match="held needs owners"):
        planner.plan(loads, held=held)
    with pytest.raises(ValueError, match="held gradients are"):
        planner.plan(loads, owners=owners, held=foremoe.HeldGradients(1, topo.num_gpus, loads.shape[2]))


@pytest.mark.parametrize("strategy", ["eplb", "eplb-split"])
@pytest.mark.parametrize("interval", [1, 2, 3])
def test_eplb_interval_stateful_planner_follows_the_window(strategy, interval):
    """One Planner handed each finished step's loads (previous_loads, once per step) rebalances after every
    `eplb_interval`-th of them from the loads handed since the last rebalance, keeps its tables in between (also
    across a second call of the same step that hands none) and plans statically before the first."""
    topo = foremoe.Topology(**TOPO)
    steps = [loads_mle(seed=s, M=2) for s in range(7)]
    planner = foremoe.Planner(topo, strategy=strategy, eplb_interval=interval)
    for s, step in enumerate(steps):
        got = planner.plan(step, previous_loads=steps[s - 1] if s > 0 else None)
        again = planner.plan(step, stage="recompute")  # the same step again: no hand-over
        r = (s // interval) * interval  # the step of the last rebalance (0: none yet)
        window = sum(steps[t].sum(axis=0) for t in range(r - interval, r)) if r > 0 else None
        ref = foremoe.Planner(topo, strategy=strategy)  # interval 1, handed the window once
        want = ref.plan(step, previous_loads=window)
        want_again = ref.plan(step, stage="recompute")
        for a, b in zip(got + again, want + want_again):
            np.testing.assert_array_equal(a.gpu_slots, b.gpu_slots, err_msg=f"step {s}")
            np.testing.assert_array_equal(a.slot_tokens, b.slot_tokens, err_msg=f"step {s}")
        if interval > 1 and s % interval == 1 and s > 1:  # tables from older steps, not the previous one alone
            last = foremoe.Planner(topo, strategy=strategy).plan(step, previous_loads=steps[s - 1])
            assert any((a.gpu_slots != b.gpu_slots).any() for a, b in zip(got, last)), s


def test_eplb_interval_bad_values():
    topo = foremoe.Topology(**TOPO)
    for bad in (0, -2):
        with pytest.raises(ValueError, match=rf"^Planner\.eplb_interval: must be in \[1, 65536\], got {bad}$"):
            foremoe.Planner(topo, strategy="eplb", eplb_interval=bad)
