"""Routing-aware micro-batch packing (``include/foremoe/plan/packing.hpp``).

Within one optimizer step, which sequences form which micro-batch does not change the update when the loss is
normalised over the whole mini-batch (not per micro-batch) and recompute and update see the same micro-batches.
With routing replay every sequence's per-layer expert histogram is known before the stage runs, so the sequences
can be packed so that every micro-step's expert load is close to the step's share: a step-level placement is then
near-balanced in every micro-step. :func:`pack_micro_batches` returns such a packing; its result goes where verl's
``rearrange_micro_batches`` output goes (per rank, the sample indices of each micro-batch). In a torch trainer,
:func:`foremoe.torch.pack_from_verl` (and its siblings) count the samples' routing in the trainer's own layout, pack
it and hand the micro-steps to :meth:`foremoe.torch.ReplayDriver.from_packing`.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Tuple

import numpy as np

from . import _core
from ._args import int_array, integer

__all__ = ["MicroBatchPacking", "pack_micro_batches", "pack_by_tokens", "sequence_histograms"]


class MicroBatchPacking(NamedTuple):
    """Where every sequence runs: ``micro_step[s]`` and ``rank[s]`` (int32 ``[S]``); ``start_deviation`` and
    ``deviation``: the squared deviation of the micro-steps' loads from the step's share before (the start) and
    after (never higher)."""

    micro_step: np.ndarray
    rank: np.ndarray
    start_deviation: float
    deviation: float

    def micro_batches(self, micro_steps: int, ranks: int = 1) -> List[List[List[int]]]:
        """``[micro_step][rank]`` -> the sequence indices of that micro-batch (ascending)."""
        out: List[List[List[int]]] = [[[] for _ in range(ranks)] for _ in range(micro_steps)]
        for s, (m, r) in enumerate(zip(self.micro_step.tolist(), self.rank.tolist())):
            out[m][r].append(s)
        return out


def _shape(micro_steps: Any, ranks: Any, token_budget: Any, who: str) -> Tuple[int, int, int]:
    return (integer(micro_steps, f"{who}: micro_steps", 1, 1 << 20), integer(ranks, f"{who}: ranks", 1, 1 << 20),
            integer(token_budget, f"{who}: token_budget", 1, (1 << 63) - 1))


def pack_by_tokens(lengths: Any, *, micro_steps: int, token_budget: int, ranks: int = 1) -> Tuple[np.ndarray,
                                                                                               np.ndarray]:
    """The token-balanced packing trainers use: longest sequence first, to the micro-batch with the fewest tokens
    that has room. Returns ``(micro_step, rank)`` (int32 ``[S]``)."""
    who = "pack_by_tokens"
    m, r, b = _shape(micro_steps, ranks, token_budget, who)
    return _core.pack_by_tokens(int_array(lengths, f"{who}: lengths"), m, r, b)


def sequence_histograms(routed_ids: Any, lengths: Any, num_experts: int) -> np.ndarray:
    """Per-sequence expert histograms ``[S, L, E]`` (int64) from routed ids ``[T, L, K]`` of the sequences laid
    end to end (``lengths`` tokens each, in order); ids of -1 (no route) are not counted."""
    who = "sequence_histograms"
    e = integer(num_experts, f"{who}: num_experts", 1, 1 << 30)
    lens = int_array(lengths, f"{who}: lengths", lo=0)
    ids = np.asarray(routed_ids)
    if ids.ndim != 3:
        raise ValueError(f"{who}: routed_ids must be [tokens, layers, topk], got shape {list(ids.shape)}")
    if int(lens.sum()) != ids.shape[0]:
        raise ValueError(f"{who}: lengths sum to {int(lens.sum())} tokens, routed_ids hold {ids.shape[0]}")
    ids = int_array(ids, f"{who}: routed_ids", lo=-1, hi=e - 1)
    seq = np.repeat(np.arange(len(lens)), lens)
    L = ids.shape[1]
    out = np.zeros((len(lens), L, e), np.int64)
    for layer in range(L):
        x = ids[:, layer, :]
        keep = x >= 0
        s = np.broadcast_to(seq[:, None], x.shape)[keep]
        np.add.at(out[:, layer, :], (s, x[keep]), 1)
    return out


def pack_micro_batches(lengths: Any, histograms: Any, *, micro_steps: int, token_budget: int, ranks: int = 1,
                       gpu_of: Any = None, start: Optional[Tuple[Any, Any]] = None, max_passes: int = 8,
                       search_work: int = -1) -> MicroBatchPacking:
    """Packs ``S`` sequences (``lengths`` ``[S]`` tokens, ``histograms`` ``[S, L, E]`` routed tokens per expert,
    e.g. from :func:`sequence_histograms`) into ``micro_steps`` x ``ranks`` micro-batches of at most
    ``token_budget`` tokens, so that each micro-step's expert load (all ranks together) is as close as possible to
    the step's share. ``gpu_of`` ``[L, E]``: a placement (the GPU serving each expert), so the loads that count are
    per GPU; ``start``: the trainer's own packing ``(micro_step, rank)`` (default: :func:`pack_by_tokens`), which
    the result never does worse than. Deterministic. Errors name the value (``ValueError``)."""
    who = "pack_micro_batches"
    m, r, b = _shape(micro_steps, ranks, token_budget, who)
    lens = int_array(lengths, f"{who}: lengths")
    hist = int_array(histograms, f"{who}: histograms")
    if hist.ndim != 3:
        raise ValueError(f"{who}: histograms must be [sequences, layers, experts], got shape {list(hist.shape)}")
    if lens.ndim != 1:
        raise ValueError(f"{who}: lengths must be [sequences], got shape {list(lens.shape)}")
    g = None
    gpus = 0
    if gpu_of is not None:
        g = int_array(gpu_of, f"{who}: gpu_of", dtype=np.int32)
        if g.ndim != 2:
            raise ValueError(f"{who}: gpu_of must be [layers, experts], got shape {list(g.shape)}")
        gpus = int(g.max()) + 1 if g.size else 1
    sm = sr = None
    if start is not None:
        if len(start) != 2:
            raise ValueError(f"{who}: start must be (micro_step, rank), got {len(start)} items")
        sm = int_array(start[0], f"{who}: start micro_step", dtype=np.int32)
        sr = int_array(start[1], f"{who}: start rank", dtype=np.int32)
    ms, rk, before, after = _core.pack_micro_batches(
        lens, hist, m, r, b, g, gpus, sm, sr, integer(max_passes, f"{who}: max_passes", 0, 1000),
        integer(search_work, f"{who}: search_work", -1, (1 << 63) - 1))
    return MicroBatchPacking(ms, rk, before, after)
