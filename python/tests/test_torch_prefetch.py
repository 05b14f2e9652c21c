"""foremoe.torch prefetch: a layer's replica moves posted ahead of its call (ExpertStorage/BalancedMoE.prefetch,
ReplayDriver.prefetch), staged and installed at the call, across 2 and 4 gloo processes.

With the next micro-step prefetched after this micro-step's backward, or already before it (the staged rows are
installed only at the next call), and with double buffers and a pipelined order (micro-step m's backward after
micro-step m + 1's forward, which a single buffer refuses), 3 RL steps equal the single-process reference and are
bitwise equal to the synchronous path, also under the seeded fault injector with a host mirror. Misuse (a prefetch
that does not fit the next call, prefetching twice) is a clear error on every rank and the group trains on exactly."""

import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch (torch) is not installed; foremoe.torch needs it")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("skipped: this torch build has no torch.distributed gloo backend", allow_module_level=True)

import torch_moe_cases as tc  # noqa: E402

# The moves run on the transfer engine, whose fault injector fails, corrupts or delays its paired transfers between
# ranks (paired_only: the host mirror's copies do not fail); a delayed one lands late within the batch deadline (the
# engine has no per-move deadline to fall back at).
FAULTS = dict(fail_probability=0.2, corrupt_probability=0.25, delay_probability=0.15, delay_us=20_000, paired_only=True)
# Few spare rows, so consecutive micro-steps' replicas share rows (what double buffers are for).
G2 = tc.Case(world=2, experts=16, topk=2, hidden=32, ffn=32, dtype="float64", seed=22, spare=1, skew=3.0)
G4 = tc.Case(world=4, experts=32, topk=4, hidden=32, ffn=32, nodes=2, dtype="float64", seed=22, spare=2,
             plain=((1, 1),))
RUNS = {
    "sync": dict(),
    "after_backward": dict(prefetch="after_backward"),
    "before_backward": dict(prefetch="before_backward", driver=True),
    "double_lag": dict(prefetch="before_backward", double_buffer=True, lag=True),
    "faults_sync": dict(mirror=True, faults=dict(FAULTS, seed=3)),
    "faults_prefetch": dict(mirror=True, faults=dict(FAULTS, seed=3), prefetch="before_backward", double_buffer=True,
                            lag=True),
}
CASES = {"g2": G2, "g4": G4}
_runs = {}


def ranks_of(name, tmp_path_factory):
    """``{run: [per-rank record]}`` of every run of RUNS in one group of ``CASES[name]``."""
    if name not in _runs:
        case = CASES[name]
        tmp = str(tmp_path_factory.mktemp(f"prefetch-{name}"))
        tc.run_ranks(tc.runs_rank, case.world, (case, list(RUNS.values()), tmp), tmp, timeout=120.0)
        recs = [torch.load(f"{tmp}/rank{r}.pt") for r in range(case.world)]
        _runs[name] = {k: [rec["runs"][i] for rec in recs] for i, k in enumerate(RUNS)}
    return _runs[name]


def assert_bitwise(a, b, what):
    for r, (x, y) in enumerate(zip(a, b)):
        for key in ("out", "x_grad", "w_grad"):
            assert all(torch.equal(u, v) for u, v in zip(x[key], y[key])), f"{what}: rank {r} {key}"
        for key in ("grads", "params"):
            assert all(torch.equal(u[n], v[n]) for u, v in zip(x[key], y[key]) for n in u), f"{what}: rank {r} {key}"


def summed(ranks, key):
    syncs = ranks[0]["sync"]
    assert all(rec["sync"] == syncs for rec in ranks), "ranks disagree on the sync counters"
    return sum(s[key] for s in syncs)


@pytest.mark.parametrize("name", ["g2", "g4"])
def test_prefetch_equals_reference_and_sync_bitwise(name, tmp_path_factory):
    case, got = CASES[name], ranks_of(name, tmp_path_factory)
    ref = tc.reference(case)
    assert summed(got["sync"], "prefetched") == 0
    for run in ("after_backward", "before_backward", "double_lag"):
        ranks = got[run]
        tc.assert_equals_reference(case, ranks, ref)
        assert_bitwise(ranks, got["sync"], run)
        # The moves really were posted ahead: every move of a planned micro-step was prefetched.
        moves, prefetched = summed(ranks, "moves"), summed(ranks, "prefetched")
        assert moves > 0 and prefetched == moves, (run, moves, prefetched)
        assert [s["moves"] for s in ranks[0]["sync"]] == [s["moves"] for s in got["sync"][0]["sync"]]
    # With double buffers some replicas lived in the second copy of their row.
    assert max(rec["max_row"] for rec in got["double_lag"]) >= case.slots
    assert max(rec["max_row"] for rec in got["sync"]) < case.slots


@pytest.mark.parametrize("name", ["g2", "g4"])
def test_prefetch_under_faults_with_mirror_is_exact(name, tmp_path_factory):
    case, got = CASES[name], ranks_of(name, tmp_path_factory)
    ranks = got["faults_prefetch"]
    assert not any(rec["errors"] for rec in ranks)
    tc.assert_equals_reference(case, ranks, tc.reference(case))
    assert_bitwise(ranks, got["faults_sync"], "faults")
    assert summed(ranks, "fallbacks") > 0 and summed(ranks, "prefetched") == summed(ranks, "moves")
    # The injector's draws are keyed by the engine's transfers, and prefetched moves land in staging rows: other
    # transfers than the synchronous run's, so other faults, but some in both, every one replaced.
    for run in (ranks, got["faults_sync"]):
        assert summed(run, "faults") > 0 and summed(run, "fallbacks") >= summed(run, "faults")


def test_prefetch_misuse_fails_every_rank(tmp_path):
    tc.run_ranks(tc.prefetch_misuse_rank, 2, (str(tmp_path),), str(tmp_path), timeout=90.0)
    recs = [torch.load(f"{tmp_path}/rank{r}.pt") for r in range(2)]
    for rec in recs:
        assert rec["other_plan"].startswith("ValueError") and "another placement" in rec["other_plan"], rec
        assert rec["twice"].startswith("ValueError") and "already has prefetched moves" in rec["twice"], rec
        assert rec["owners_changed"].startswith("ValueError") and "owner weights changed" in rec["owners_changed"]
        assert rec["plain_call"].startswith("ValueError") and "another layer or a plain call" in rec["plain_call"]
        for key in ("other_plan", "owners_changed", "plain_call"):
            assert "re-sent at the next call" in rec[key], rec[key]
        # After every error the next call is exact (every replica re-sent).
        assert all(rec[k] == "equal" for k in rec if k.startswith("after_")), rec
        assert int(rec["prefetched"]) > 0, rec
