"""foremoe.torch replica moves under the seeded fault injector, across 2 and 4 gloo processes.

With a fresh host mirror every dropped, late or corrupted move falls back to the mirror and training equals the
fault-free single-process reference exactly. Without a mirror every rank fails with a clear error (no hang, no
output of that micro-step), and the group trains on exactly once the faults stop. A stale mirror is refused until
refresh_mirror(). The mirror is never a parameter or in the state_dict. Without verification a corrupted move does
change the numbers (so the checks can fail)."""

import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch (torch) is not installed; foremoe.torch needs it")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("skipped: this torch build has no torch.distributed gloo backend", allow_module_level=True)

import torch_moe_cases as tc  # noqa: E402

# The moves run on the transfer engine, whose fault injector fails, corrupts or delays its paired transfers between
# ranks (paired_only: the host mirror's copies do not fail); a delayed one lands late within the batch deadline (the
# engine has no per-move deadline to fall back at).
FAULTS = dict(fail_probability=0.2, corrupt_probability=0.25, delay_probability=0.15, delay_us=20_000, paired_only=True)
G2 = tc.Case(world=2, experts=16, topk=2, hidden=32, ffn=32, dtype="float64", seed=11)
G4 = tc.Case(world=4, experts=32, topk=4, hidden=32, ffn=32, nodes=2, dtype="float64", seed=12, steps=2)
RUNS = {
    "g2": (G2, {
        "seed1": dict(mirror=True, faults=dict(FAULTS, seed=1)),
        "seed2": dict(mirror=True, faults=dict(FAULTS, seed=2)),
        "seed3": dict(mirror=True, faults=dict(FAULTS, seed=3, corrupt_probability=0.6)),
        "no_mirror": dict(faults=dict(FAULTS, seed=4), faults_off_on_error=True, timeout=20.0),
        "stale": dict(mirror=True, skip_refresh=(0,)),
        "unverified": dict(mirror=True, verify=False, faults=dict(seed=5, corrupt_probability=0.5)),
    }),
    "g4": (G4, {
        "seed1": dict(mirror=True, faults=dict(FAULTS, seed=6)),
        "seed2": dict(mirror=True, faults=dict(FAULTS, seed=7)),
        "no_mirror": dict(faults=dict(FAULTS, seed=8, fail_probability=0.5), faults_off_on_error=True, timeout=20.0),
    }),
}
_runs = {}


def ranks_of(name, tmp_path_factory):
    """``{run: [per-rank record]}`` and whether each rank's gathered mirror equalled the full weights."""
    if name not in _runs:
        case, runs = RUNS[name]
        tmp = str(tmp_path_factory.mktemp(f"faults-{name}"))
        tc.run_ranks(tc.fault_rank, case.world, (case, list(runs.values()), tmp), tmp, timeout=120.0)
        recs = [torch.load(f"{tmp}/rank{r}.pt") for r in range(case.world)]
        _runs[name] = ({k: [rec["runs"][i] for rec in recs] for i, k in enumerate(runs)},
                       [rec["gathered"] for rec in recs])
    return _runs[name]


def totals(ranks):
    syncs = ranks[0]["sync"]
    assert all(rec["sync"] == syncs for rec in ranks), "ranks disagree on the sync counters"
    return {k: sum(s[k] for s in syncs) for k in ("moves", "faults", "verify_failures", "fallbacks")}


@pytest.mark.parametrize("name", ["g2", "g4"])
def test_faults_with_fresh_mirror_are_exact(name, tmp_path_factory):
    case, runs = RUNS[name]
    got, gathered = ranks_of(name, tmp_path_factory)
    assert all(gathered), "a mirror gathered from the owners differs from the full weights"
    ref = tc.reference(case)
    seeded = {k: totals(got[k]) for k in runs if k.startswith("seed")}
    for run, t in seeded.items():
        assert not any(rec["errors"] for rec in got[run]), run
        tc.assert_equals_reference(case, got[run], ref)
        # The mirror replaced every failed move, and some moves got through.
        assert t["fallbacks"] >= t["faults"], (run, t)
        assert t["moves"] > t["fallbacks"], (run, t)
        # The replica gradients returned on the engine the faults act on (its injector spares the reductions).
        assert all(rec["engine_reductions"] > 0 for rec in got[run]), run
    # Over the seeded runs (a handful of moves each) faults really happened and verification caught corrupted rows.
    assert sum(t["faults"] for t in seeded.values()) > 0, seeded
    assert sum(t["verify_failures"] for t in seeded.values()) > 0, seeded


@pytest.mark.parametrize("name", ["g2", "g4"])
def test_faults_without_mirror_fail_every_rank(name, tmp_path_factory):
    case, runs = RUNS[name]
    ranks = ranks_of(name, tmp_path_factory)[0]["no_mirror"]
    where = {(rec["errors"][0]["step"], rec["errors"][0]["micro"]) for rec in ranks if rec["errors"]}
    assert all(len(rec["errors"]) == 1 for rec in ranks), "not every rank failed"
    assert len(where) == 1, f"ranks failed at different micro-steps: {where}"
    messages = [rec["errors"][0]["message"] for rec in ranks]
    assert any("has no host mirror to fall back to" in msg and "replica move of expert" in msg for msg in messages)
    assert all("replica move" in msg for msg in messages), messages
    assert all(rec["errors"][0]["seconds"] < runs["no_mirror"]["timeout"] for rec in ranks), "a rank waited out"
    # The failed call produced nothing; retried without faults (every replica re-sent), the whole run is exact.
    tc.assert_equals_reference(case, ranks, tc.reference(case))


def test_stale_mirror_is_refused_until_refreshed(tmp_path_factory):
    ranks = ranks_of("g2", tmp_path_factory)[0]["stale"]
    for rec in ranks:
        assert [(e["step"], e["micro"]) for e in rec["errors"]] == [(1, 0)]
        assert "older than the owner weights" in rec["errors"][0]["message"]
        assert "refresh_mirror()" in rec["errors"][0]["message"]
    # After refresh_mirror() the retried call and the rest of the run equal the reference.
    tc.assert_equals_reference(G2, ranks, tc.reference(G2))


def test_mirror_is_not_a_parameter_or_state(tmp_path_factory):
    for rec in ranks_of("g2", tmp_path_factory)[0]["seed1"]:
        assert sorted(rec["param_names"]) == sorted(f"experts.{n}" for n in rec["names"])
        assert sorted(rec["state_dict"]) == sorted(f"experts.{n}" for n in rec["names"])


def test_without_verification_a_corrupted_move_is_wrong(tmp_path_factory):
    # The negative control: the same corruption with verification off reaches the numbers.
    # (Unverified, the engine cannot tell a corrupted copy from a good one, so `faults` stays 0: only the numbers show
    # that the injected corruption landed.)
    ranks = ranks_of("g2", tmp_path_factory)[0]["unverified"]
    assert totals(ranks)["moves"] > 0
    with pytest.raises(AssertionError):
        tc.assert_equals_reference(G2, ranks, tc.reference(G2))
