"""The per-call work foremoe.torch remembers across layer calls (issue 28's host overhead): ``ExpertStorage.bookkeep``
returns its last result again when the plan's layer has the same placement and used replicas, no owner changed and
the tracked rows are where that call left them, and the held-gradient schedule reuses the last plan's replica list.
Both must give exactly what the work done afresh gives, on random plan sequences that repeat layer plans as new
objects (as a replay driver hands out one per micro-step), change them, mark owners changed and drop the tracked
rows, with and without double buffers. No process group: the bookkeeping is the same on every rank."""

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch", reason="skipped: PyTorch (torch) is not installed; foremoe.torch needs it")

import foremoe  # noqa: E402
from foremoe.torch import ExpertStorage  # noqa: E402
from foremoe.torch import layer as L  # noqa: E402


def _plans(rng, E, G, S, n):
    """``n`` pairs of equal plans (two objects each), each planned with the previous one resident, so that
    placements repeat; a resident replica's expert loses its tokens at times, so that the same placement comes with
    other used replicas. Asserts that it happened."""
    own = np.repeat(np.arange(G), E // G).astype(np.int32)
    planner = foremoe.Planner(foremoe.Topology(1, G, S))
    pop = np.exp(2.0 * rng.standard_normal(E))
    out, prev, used = [], None, {}
    for _ in range(n):
        loads = rng.poisson(200 * pop / pop.sum() * E).astype(np.int64)
        if prev is not None:
            place = np.asarray(prev.gpu_slots[0])
            reps = [int(place[g, j]) for g in range(G) for j in range(S) if place[g, j] >= 0 and own[place[g, j]] != g]
            if reps and rng.random() < 0.5:
                loads[rng.choice(reps)] = 0
        pair = [planner.plan(loads[None], resident=prev, owners=own) for _ in range(2)]
        key = np.asarray(pair[0].gpu_slots[0]).tobytes()
        used.setdefault(key, set()).add((np.asarray(pair[0].slot_tokens[0]) > 0).tobytes())
        out.append(pair)
        prev = pair[0]
    assert any(len(u) > 1 for u in used.values())  # one placement, other used replicas
    return own, out


def _sequence(rng, plans, n, stay):
    """``n`` plan objects: the previous one's content again with probability ``stay`` (either object of it, as a
    driver hands out a new plan per micro-step), else a random one."""
    i, out = 0, []
    for _ in range(n):
        if rng.random() >= stay:
            i = int(rng.integers(len(plans)))
        out.append(plans[i][int(rng.integers(2))])
    return out


def _fresh_hold(st, plan, layer, gradients, changed):
    """The held-gradient schedule without any remembered work (the loop as it was before issue 28's cache)."""
    st._replicas_memo = None
    st._key_memo = None
    return L._hold_schedule(st, plan, layer, gradients, changed)


def _same(a, b):
    assert set(a) == set(b)
    for k in a:
        if isinstance(a[k], np.ndarray):
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("double_buffer", [False, True])
def test_remembered_bookkeeping_equals_fresh(seed, double_buffer):
    rng = np.random.default_rng(seed)
    E, G = [(16, 2), (32, 4), (12, 3)][seed % 3]
    S = E // G + 1 + seed % 2
    own, plans = _plans(rng, E, G, S, 40)
    for rank in range(G):
        w = {"w": torch.zeros(E // G, 2)}
        cached = ExpertStorage(w, own, S, rank=rank, world=G, double_buffer=double_buffer)
        fresh = ExpertStorage(w, own, S, rank=rank, world=G, double_buffer=double_buffer)
        hits = 0
        for plan in _sequence(rng, plans, 120, 0.6):
            changed = [] if rng.random() < 0.85 else sorted(rng.choice(G, size=rng.integers(1, G + 1), replace=False))
            if rng.random() < 0.05:  # a failed move or a dropped prefetch: every rank forgets every replica
                cached.resident_rows.fill(-1)
                fresh.resident_rows.fill(-1)
            fresh._book_memo = None
            memo = cached._book_memo
            got = cached.bookkeep(plan, 0, changed)
            hits += got is (memo[2] if memo is not None else None)
            want = fresh.bookkeep(plan, 0, changed)
            _same(got, want)
            np.testing.assert_array_equal(cached.resident_rows, fresh.resident_rows)
            np.testing.assert_array_equal(cached._copy_all, fresh._copy_all)
        assert hits > 10  # the remembered result was really used


@pytest.mark.parametrize("seed", range(6))
def test_remembered_hold_schedule_equals_fresh(seed):
    rng = np.random.default_rng(100 + seed)
    E, G = [(16, 2), (32, 4)][seed % 2]
    S = E // G + 2
    own, plans = _plans(rng, E, G, S, 30)
    w = {"w": torch.zeros(E // G, 2)}
    cached = ExpertStorage(w, own, S, rank=0, world=G)
    fresh = ExpertStorage(w, own, S, rank=0, world=G)
    sent = 0
    for plan in _sequence(rng, plans, 150, 0.5):
        mode = "flush" if rng.random() < 0.1 else "hold"
        got = L._hold_schedule(cached, plan, 0, mode, [])
        want = _fresh_hold(fresh, plan, 0, mode, [])
        assert got == want
        assert cached._held == fresh._held
        sent += len(got)
    assert sent > 0
    cached._held[(1, 0)] = 0
    with pytest.raises(RuntimeError, match=r"owner weights of ranks \[1\] changed"):
        L._hold_schedule(cached, plans[0][0], 0, "hold", [1])
