"""One mover (issue 29): ExpertStorage's moves on CPU storage run on the runtime's transfer engine, and give bitwise
what the Python moves (the path CUDA storage still takes) give, across 2 and 4 gloo processes: with a per-rank and a
node-shared host mirror, double buffers and prefetch. Every rank's engine really ran batches; the Python path ran
none. Under the engine's fault injector the run is still exact, and the counters come from the engine's telemetry."""

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
    "python": dict(mirror=True, mover="python"),
    "engine_node": dict(mirror="node", local_world=2, double_buffer=True, prefetch="before_backward", lag=True),
    "python_node": dict(mirror="node", local_world=2, double_buffer=True, prefetch="before_backward", lag=True,
                        mover="python"),
    "engine_closed": dict(mirror=True, close=True),
    "engine_faults": dict(mirror=True, faults=dict(seed=9, fail_probability=0.2, corrupt_probability=0.6,
                                                   paired_only=True)),
    # Held replica gradients (issue 30): the held rule returns them on the engine too.
    "engine_hold": dict(mirror=True, hold=True, double_buffer=True, prefetch="before_backward", lag=True),
    "python_hold": dict(mirror=True, hold=True, double_buffer=True, prefetch="before_backward", lag=True,
                        mover="python"),
    "engine_hold_plain": dict(hold=True, prefetch="after_backward"),
    "python_hold_plain": dict(hold=True, prefetch="after_backward", mover="python"),
}
PAIRS = (("engine", "python"), ("engine_node", "python_node"), ("engine_hold", "python_hold"),
         ("engine_hold_plain", "python_hold_plain"))
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
def test_engine_moves_equal_the_python_moves_bitwise(name, tmp_path_factory):
    case, got = CASES[name], ranks_of(name, tmp_path_factory)
    ref = tc.reference(case)
    for engine, python in PAIRS:
        for run in (engine, python):
            assert not any(rec["errors"] for rec in got[run]), run
            tc.assert_equals_reference(case, got[run], ref, held="hold" in run)
        assert_bitwise(got[engine], got[python], engine)
        # The same bookkeeping, so the same moves and reuse, whichever mover carried them.
        for key in ("moves", "reused", "prefetched"):
            assert [s[key] for s in got[engine][0]["sync"]] == [s[key] for s in got[python][0]["sync"]], key
        assert sum(s["moves"] for s in got[engine][0]["sync"]) > 0, "no move: the comparison proved nothing"
        assert all(rec["mover"] == "engine" and rec["engine_batches"] > 0 for rec in got[engine])
        assert all(rec["mover"] == "python" and rec["engine_batches"] == 0 for rec in got[python])
        # Replica gradients returned on the engine's reductions (the same count on every rank), none on the Python
        # path; held runs really held some across micro-steps.
        assert all(rec["engine_reductions"] == got[engine][0]["engine_reductions"] > 0 for rec in got[engine])
        assert all(rec["engine_reductions"] == 0 for rec in got[python])
        if "hold" in engine:
            assert [rec["held"] for rec in got[engine]] == [rec["held"] for rec in got[python]]
            assert any(set(a) & set(b) for a, b in zip(got[engine][0]["held"], got[engine][0]["held"][1:]))


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
    assert st.mover_kind == "engine"
    st._pending = {"layer": 5}  # what prefetch() leaves for the layer's next call
    with pytest.raises(ValueError, match="layer 5 has prefetched moves in flight"):
        st.close()
    st._pending = None
    st.close()  # no engine yet: nothing to end
