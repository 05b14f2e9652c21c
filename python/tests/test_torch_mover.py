"""One mover (issue 29): ExpertStorage's moves and replica-gradient reductions run on the runtime's transfer engine,
across 2 and 4 gloo processes: with a per-rank and a node-shared host mirror, double buffers and prefetch, held
replica gradients, and reductions split over several batches, each run equal to the unbalanced reference and the
runs that must agree bitwise doing so. Every rank's engine really ran batches and reductions. Under the engine's
fault injector the run is still exact, and the counters come from the engine's telemetry."""

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch (torch) is not installed; foremoe.torch needs it")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("skipped: this torch build has no torch.distributed gloo backend", allow_module_level=True)

import torch_moe_cases as tc  # noqa: E402

import foremoe.torch as ft  # noqa: E402

G2 = tc.Case(world=2, experts=16, topk=2, hidden=32, ffn=32, dtype="float64", seed=31, spare=2)
G4 = tc.Case(world=4, experts=32, topk=4, hidden=16, ffn=24, nodes=2, dtype="float32", seed=32, spare=2)
RUNS = {
    "engine": dict(mirror=True),
    "engine_node": dict(mirror="node", local_world=2, double_buffer=True, prefetch="before_backward", lag=True),
    "engine_closed": dict(mirror=True, close=True),
    "engine_faults": dict(mirror=True, faults=dict(seed=9, fail_probability=0.2, corrupt_probability=0.6,
                                                   paired_only=True)),
    # Held replica gradients (issue 30): the held rule returns them on the engine too.
    "engine_hold": dict(mirror=True, hold=True, double_buffer=True, prefetch="before_backward", lag=True),
    "engine_hold_plain": dict(hold=True, prefetch="after_backward"),
    # One row per rank for returning replicas: the returns split into several reductions, by expert.
    "engine_room1": dict(mirror=True, room=1),
    "engine_hold_room1": dict(mirror=True, hold=True, double_buffer=True, prefetch="before_backward", lag=True,
                              room=1),
}
# Runs that must agree bitwise: the same bookkeeping and the same order of every addition, whatever the reductions'
# split (room=1) or whether the engine was closed between steps.
PAIRS = (("engine", "engine_room1"), ("engine_hold", "engine_hold_room1"), ("engine", "engine_closed"))
CASES = {"g2": G2, "g4": G4}
_runs = {}


def ranks_of(name, tmp_path_factory):
    if name not in _runs:
        case = CASES[name]
        tmp = str(tmp_path_factory.mktemp(f"mover-{name}"))
        tc.run_ranks(tc.fault_rank, case.world, (case, list(RUNS.values()), tmp), tmp, timeout=180.0)
        recs = [torch.load(f"{tmp}/rank{r}.pt") for r in range(case.world)]
        _runs[name] = {k: [rec["runs"][i] for rec in recs] for i, k in enumerate(RUNS)}
    return _runs[name]


def assert_bitwise(a, b, what):
    for ra, rb in zip(a, b):
        for key in ("out", "x_grad", "w_grad"):
            assert all(torch.equal(x, y) for x, y in zip(ra[key], rb[key])), (what, key)
        for key in ("grads", "params"):
            assert all(torch.equal(x[n], y[n]) for x, y in zip(ra[key], rb[key]) for n in x), (what, key)


@pytest.mark.parametrize("name", ["g2", "g4"])
def test_engine_runs_equal_the_reference(name, tmp_path_factory):
    case, got = CASES[name], ranks_of(name, tmp_path_factory)
    ref = tc.reference(case)
    for run in RUNS:
        if run == "engine_faults":
            continue  # test_engine_faults_fall_back_exactly
        assert not any(rec["errors"] for rec in got[run]), run
        tc.assert_equals_reference(case, got[run], ref, held="hold" in run)
        assert sum(s["moves"] for s in got[run][0]["sync"]) > 0, f"{run}: no move, the run proved nothing"
        # (A closed storage has no engine left to ask; its reductions are counted by the storage.)
        assert all(rec["mover"] == "host" and (rec["engine_batches"] > 0 or run == "engine_closed")
                   for rec in got[run]), run
        # Replica gradients returned on the engine's reductions, the same count on every rank.
        assert all(rec["engine_reductions"] == got[run][0]["engine_reductions"] > 0 for rec in got[run]), run
    for a, b in PAIRS:
        assert_bitwise(got[a], got[b], f"{a} vs {b}")
        for key in ("moves", "reused", "prefetched"):
            assert [s[key] for s in got[a][0]["sync"]] == [s[key] for s in got[b][0]["sync"]], (a, b, key)
    # Held runs really held some gradients across micro-steps, the same ones whatever the reductions' split.
    for run in ("engine_hold", "engine_hold_plain"):
        held = got[run][0]["held"]
        assert any(set(x) & set(y) for x, y in zip(held, held[1:])), run
    assert [rec["held"] for rec in got["engine_hold"]] == [rec["held"] for rec in got["engine_hold_room1"]]


@pytest.mark.parametrize("name", ["g2", "g4"])
def test_split_reductions_keep_the_order(name, tmp_path_factory):
    got = ranks_of(name, tmp_path_factory)
    # At least as many reductions as with every row available, more in all (the bitwise equality with the Python
    # path is test_engine_moves_equal_the_python_moves_bitwise's).
    counts = {k: got[k][0]["engine_reductions"] for k in ("engine_room1", "engine", "engine_hold_room1", "engine_hold")}
    assert counts["engine_room1"] >= counts["engine"] and counts["engine_hold_room1"] >= counts["engine_hold"], counts
    assert counts["engine_room1"] + counts["engine_hold_room1"] > counts["engine"] + counts["engine_hold"], counts


def test_reductions_split_by_expert():
    red = types.SimpleNamespace(room=np.array([2, 1, 3]))
    pairs = [(0, 1), (0, 2), (3, 0), (3, 1), (3, 2), (5, 1), (7, 0), (7, 2), (8, 0)]
    got = ft.mover.GradReducer.batches(red, pairs)
    assert [p for b in got for p in b] == pairs  # experts ascending, each expert's holders ascending, nothing lost
    for b in got:  # every replica of an expert in the same reduction, no rank over its rows
        assert [p for p in pairs if p[0] in {e for e, _ in b}] == b
        assert np.all(np.bincount([g for _, g in b], minlength=3) <= red.room), b
    # Rank 1 has one row: experts 0, 3 and 5 each start a reduction; 7 and 8 join 5's (rank 0 holds two there).
    assert [sorted({e for e, _ in b}) for b in got] == [[0], [3], [5, 7, 8]]
    assert ft.mover.GradReducer.batches(red, []) == []


@pytest.mark.skipif(int(torch.__version__.split(".")[0]) < 2,
                    reason="skipped: gloo of torch < 2 has no bfloat16 collectives (the layer's exchanges)")
def test_bfloat16_engine_reductions_keep_the_order(tmp_path):
    case = tc.Case(world=4, experts=16, topk=4, hidden=16, ffn=16, dtype="bfloat16", seed=33, spare=2, steps=2)
    runs = [dict(), dict(room=1), dict(hold=True, lag=True, double_buffer=True),
            dict(hold=True, lag=True, double_buffer=True, room=1)]
    tc.run_ranks(tc.fault_rank, case.world, (case, runs, str(tmp_path)), str(tmp_path), timeout=180.0)
    recs = [torch.load(f"{tmp_path}/rank{r}.pt")["runs"] for r in range(case.world)]
    for i in (0, 2):
        whole, split = [rec[i] for rec in recs], [rec[i + 1] for rec in recs]
        assert not any(rec["errors"] for rec in whole + split)
        # Split into one reduction per expert or not, every bfloat16 addition in the same order: bitwise.
        assert_bitwise(whole, split, f"bfloat16 run {i}")
        assert all(rec["engine_reductions"] > 0 for rec in whole)
        assert split[0]["engine_reductions"] > whole[0]["engine_reductions"]


@pytest.mark.parametrize("name", ["g2", "g4"])
def test_engine_faults_fall_back_exactly(name, tmp_path_factory):
    case, ranks = CASES[name], ranks_of(name, tmp_path_factory)["engine_faults"]
    assert not any(rec["errors"] for rec in ranks)
    tc.assert_equals_reference(case, ranks, tc.reference(case))
    syncs = ranks[0]["sync"]
    assert all(rec["sync"] == syncs for rec in ranks), "ranks disagree on the sync counters"
    faults, fallbacks = sum(s["faults"] for s in syncs), sum(s["fallbacks"] for s in syncs)
    assert faults > 0 and fallbacks == faults, syncs
    assert sum(s["verify_failures"] for s in syncs) > 0, syncs


@pytest.mark.parametrize("name", ["g2", "g4"])
def test_closing_the_engine_between_steps_changes_nothing(name, tmp_path_factory):
    got = ranks_of(name, tmp_path_factory)
    assert not any(rec["errors"] for rec in got["engine_closed"])
    assert_bitwise(got["engine_closed"], got["engine"], "closed")


def test_close_is_refused_while_prefetched_moves_wait():
    full = {"w": torch.zeros(4, 3)}
    st = ft.ExpertStorage.from_full(full, [0, 0, 1, 1], 3, rank=0, world=2)
    assert st.engine_backend == "host"
    st._pending = {"layer": 5}  # what prefetch() leaves for the layer's next call
    with pytest.raises(ValueError, match="layer 5 has prefetched moves in flight"):
        st.close()
    st._pending = None
    st.close()  # no engine yet: nothing to end


def test_a_failed_move_batch_names_a_move_of_the_rank():
    full = {"w": torch.zeros(4, 3)}
    st = ft.ExpertStorage.from_full(full, [0, 0, 1, 1], 3, rank=0, world=2)
    pending = {"incoming": [(2, 1, 2, 7), (3, 1, 5, 8)], "index": [4, 6]}  # (expert, source, row, engine slot)
    ok = [{"ok": True}] * 7
    # A move into this rank failed: that move.
    bad = list(ok)
    bad[6] = {"ok": False}
    msg = st._engine_error(pending, bad, "device_error: x", 3)
    assert "layer 3: the replica move of expert 3 from rank 1 to rank 0 (row 5) did not land" in msg
    assert "device_error: x" in msg and "no host mirror" in msg
    # Every move into it landed (a move out of it or an exchange failed): its first incoming move, named as such.
    msg = st._engine_error(pending, ok, "aborted: y", 3)
    assert "every move into rank 0 landed (the first: expert 2 from rank 1 into row 2; 2 in all)" in msg, msg
    assert "aborted: y" in msg
    # Nothing comes into it.
    msg = st._engine_error({"incoming": [], "index": []}, ok, "timed_out: z", 3)
    assert "rank 0: the replica move batch failed (timed_out: z); no move goes into rank 0" in msg, msg


def test_a_failed_reduction_fails_every_rank_naming_the_layer(tmp_path):
    tc.run_ranks(tc.reduction_failure_rank, 2, (str(tmp_path),), str(tmp_path), timeout=120.0)
    got = [torch.load(f"{tmp_path}/rank{r}.pt") for r in range(2)]
    last = got[0]["last"]  # the last micro-step with replica gradients: its reduction is refused on rank 1
    # The earlier backwards returned gradients on the engine.
    assert all(g[m] == "no error" for g in got for m in range(last)) and got[0]["reductions"] > 0, got
    # Every rank raises naming the layer, each with its own failure (rank 1's refusal leaves rank 0's exchanges
    # unmatched until their deadline, so the status gather may time out too).
    for r, g in enumerate(got):
        assert g[last].startswith("RuntimeError: foremoe.torch: the replica gradient reduction of layer 0 failed on "
                                  "rank"), g[last]
        assert "no gradient of this layer reaches the parameters" in g[last], g[last]
    assert "rank 1" in got[1][last] and "submit_reduce: expert " in got[1][last], got[1][last]
    assert "holds no valid copy" in got[1][last], got[1][last]


def test_storages_share_one_engine(tmp_path):
    """foremoe.torch.mover's "One engine for the layers" on 2 gloo ranks (torch_moe_cases.shared_engine_rank)."""
    tmp = str(tmp_path)
    tc.run_ranks(tc.shared_engine_rank, 2, (tmp,), tmp, timeout=120.0)
    recs = [torch.load(f"{tmp}/rank{r}.pt") for r in range(2)]
    # Replicas moved into every storage (on rank 1: the plan replicates rank 0's hot expert there), each row
    # holding its expert's weights (checked on the rank).
    assert all(n > 0 for n in recs[1]["replicas"]), recs[1]["replicas"]
    assert recs[1]["late"][2] > 0 and recs[1]["reopened"][1] > 0
    for rec in recs:
        assert rec["shared"] == [True, True, True, False], rec["shared"]
        assert rec["layers"] == [0, 2, 4, 0], rec["layers"]  # own engine layers on the shared one
        assert rec["same_engine"] and rec["own_engine"]
        # One engine for serials 0..3 (the faulted storage counts as a user until it closes or is collected).
        assert rec["engines"] == [{"lo": 0, "hi": 3, "users": 4}], rec["engines"]
        assert rec["late"][:2] == (True, True), rec["late"]
        assert rec["engines_late"] == [{"lo": 0, "hi": 3, "users": 4}, {"lo": 4, "hi": 4, "users": 1}]
        assert rec["reopened"][0] is False, rec["reopened"]
        assert rec["after_close"] == [{"lo": 0, "hi": 3, "users": 1}, {"lo": 4, "hi": 4, "users": 1}]
        assert rec["after_collect"] == [{"lo": 4, "hi": 4, "users": 1}], rec["after_collect"]
        assert rec["after_all"] == [], rec["after_all"]


@pytest.mark.parametrize("hold", [False, True])
def test_corrupted_reductions_are_caught_and_run_again_exactly(hold, tmp_path):
    """With ``verify`` a replica gradient corrupted in transfer is caught on its owner before anything of its expert
    is added, and every rank runs the layer's reductions again (``ExpertStorage.reduction_retries``): the run still
    equals the unbalanced reference. The engine's fault injector, which foremoe.torch keeps off reductions, acts on
    them here (it corrupts paired transfers; the moves fall back to the host mirror)."""
    case, tmp = G2, str(tmp_path)
    opts = dict(mirror=True, hold=hold, faults=dict(seed=4, corrupt_probability=0.04, paired_only=True))
    tc.run_ranks(tc.corrupt_reductions_rank, case.world, (case, opts, tmp), tmp, timeout=180.0)
    got = [torch.load(f"{tmp}/rank{r}.pt") for r in range(case.world)]
    assert not any(rec["errors"] for rec in got), [rec["errors"] for rec in got]
    tc.assert_equals_reference(case, got, tc.reference(case), held=hold)
    retries = [rec["reduction_retries"] for rec in got]
    assert retries[0] > 0 and len(set(retries)) == 1, retries  # some reductions ran again, on every rank alike
