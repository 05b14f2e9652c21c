"""foremoe.pack_micro_batches (plan/packing.hpp through _core): valid packings, never worse than the start,
deterministic, histograms from routed ids, and errors that name the value."""

import numpy as np
import pytest

import foremoe


def _step(seed, S=48, L=3, E=8, K=2):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 30, S)
    hot = rng.integers(0, E, S)
    ids = []
    for s in range(S):
        x = rng.integers(0, E, (lengths[s], L, K))
        keep = rng.random((lengths[s], L, K)) < 0.5
        x[keep] = (hot[s] + np.arange(L)[None, :, None].repeat(lengths[s], 0).repeat(K, 2))[keep] % E
        ids.append(x)
    return lengths, np.concatenate(ids), E


def _check_valid(p, lengths, M, R, budget):
    assert p.micro_step.shape == (len(lengths),) and p.rank.shape == (len(lengths),)
    assert p.micro_step.min() >= 0 and p.micro_step.max() < M and p.rank.min() >= 0 and p.rank.max() < R
    fill = np.zeros((M, R), np.int64)
    np.add.at(fill, (p.micro_step, p.rank), lengths)
    assert (fill <= budget).all()
    batches = p.micro_batches(M, R)
    assert sorted(i for mb in batches for b in mb for i in b) == list(range(len(lengths)))


@pytest.mark.parametrize("seed", range(6))
def test_packing_is_valid_and_never_worse(seed):
    lengths, ids, E = _step(seed)
    hist = foremoe.sequence_histograms(ids, lengths, E)
    assert hist.shape == (len(lengths), 3, E) and hist.sum() == (ids >= 0).sum()
    M, R = 4, 2
    budget = int(lengths.sum() * 1.3 / (M * R)) + int(lengths.max())
    p = foremoe.pack_micro_batches(lengths, hist, micro_steps=M, ranks=R, token_budget=budget)
    _check_valid(p, lengths, M, R, budget)
    assert p.deviation <= p.start_deviation
    again = foremoe.pack_micro_batches(lengths, hist, micro_steps=M, ranks=R, token_budget=budget)
    assert (again.micro_step == p.micro_step).all() and (again.rank == p.rank).all()
    # The trainer's own packing as the start: never worse than it.
    tm, tr = foremoe.pack_by_tokens(lengths, micro_steps=M, ranks=R, token_budget=budget)
    start = ((tm + 1) % M, tr)
    q = foremoe.pack_micro_batches(lengths, hist, micro_steps=M, ranks=R, token_budget=budget, start=start)
    _check_valid(q, lengths, M, R, budget)
    assert q.deviation <= q.start_deviation
    # Under a placement (two experts per GPU) as well.
    gpu_of = np.tile(np.arange(E) // 2, (3, 1))
    g = foremoe.pack_micro_batches(lengths, hist, micro_steps=M, ranks=R, token_budget=budget, gpu_of=gpu_of)
    _check_valid(g, lengths, M, R, budget)
    assert g.deviation <= g.start_deviation


def test_packing_errors_name_the_value():
    lengths = np.array([3, 2])
    hist = np.array([[[3, 0]], [[1, 1]]])
    with pytest.raises(ValueError, match="sequence 0 has 3 tokens, more than the micro-batch token budget 2"):
        foremoe.pack_micro_batches(lengths, hist, micro_steps=2, token_budget=2)
    with pytest.raises(ValueError, match=r"micro_steps = 0 is outside \[1, 1048576\]"):
        foremoe.pack_micro_batches(lengths, hist, micro_steps=0, token_budget=4)
    with pytest.raises(ValueError, match="histograms hold 3 sequences, lengths 2"):
        foremoe.pack_micro_batches(lengths, np.zeros((3, 1, 2), np.int64), micro_steps=2, token_budget=4)
    with pytest.raises(ValueError, match=r"histograms\[sequence 1, layer 0, expert 0\] = -1"):
        foremoe.pack_micro_batches(lengths, np.array([[[3, 0]], [[-1, 1]]]), micro_steps=2, token_budget=4)
    with pytest.raises(ValueError, match=r"gpu_of has shape \[1, 3\], expected \[layers, experts\] = \[1, 2\]"):
        foremoe.pack_micro_batches(lengths, hist, micro_steps=2, token_budget=4, gpu_of=[[0, 1, 1]])
    with pytest.raises(ValueError, match=r"sequence 1 is placed at \(micro-step 2, rank 0\), outside 2 x 1"):
        foremoe.pack_micro_batches(lengths, hist, micro_steps=2, token_budget=4, start=([0, 2], [0, 0]))
    with pytest.raises(ValueError, match="must be \\[sequences, layers, experts\\]"):
        foremoe.pack_micro_batches(lengths, np.zeros((2, 2)), micro_steps=2, token_budget=4)
    with pytest.raises(ValueError, match="lengths sum to 5 tokens, routed_ids hold 4"):
        foremoe.sequence_histograms(np.zeros((4, 1, 1)), lengths, 2)
    with pytest.raises(ValueError, match="routed_ids"):
        foremoe.sequence_histograms(np.full((5, 1, 1), 2), lengths, 2)
    with pytest.raises(TypeError, match="token_budget must be an integer"):
        foremoe.pack_micro_batches(lengths, hist, micro_steps=2, token_budget="4")
