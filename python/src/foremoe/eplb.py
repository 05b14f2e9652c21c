"""A drop-in for DeepSeek EPLB's ``rebalance_experts`` and placement export for SGLang and vLLM.

``rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus, split="even")`` takes EPLB's
arguments and returns EPLB's contract. ``split`` says how the caller divides an expert's tokens over its copies,
and so what is optimised:

* ``split="even"`` (default; EPLB's contract, what vLLM and SGLang do with EPLB's tables): every copy of expert
  ``e`` gets ``weight[e] / logcnt[e]`` tokens and a GPU's load is the sum over its slots. Per layer the largest
  GPU load under that split is minimised (C++ ``foremoe::even_split_rebalance``): EPLB's replica counts capped at
  one copy per GPU, packed largest load per copy first, each copy to the lightest GPU that has a free slot and
  does not hold its expert; then a local search that lowers the most loaded GPU while every GPU it changes stays
  below the peak (swap two copies; give an expert on that GPU one more copy, taken from an expert with several;
  give one of its copies' slots to another expert). Where that stays above DeepSeek EPLB's peak on the same
  input, EPLB's own placement (its algorithm re-implemented in C++, hierarchical when ``num_groups`` divides
  over ``num_nodes``) is the second start: its duplicate copies removed by moves that do not raise its peak, then
  the same search. So wherever EPLB's placement has no GPU with two copies of an expert (or those can be removed
  without raising its peak), the result's peak is at most EPLB's. What a placement without duplicates cannot
  always match: two copies of one expert on a GPU split that expert unevenly over GPUs (2/3 here, 1/3 there), and
  on small shapes (few GPUs, or slots per GPU near the expert count) that can reach a peak no duplicate-free
  placement reaches (e.g. 8 experts on 2 GPUs x 7 slots, or 12 experts on 8 GPUs x 2 slots, checked
  exhaustively); there a bounded number of random restarts of the search runs and the best is returned (in
  24,000 random test layers at most 5.4 % above EPLB, on a layer where that is the duplicate-free optimum).
  In random tests with at least 16 experts and at most half of them per GPU (DeepSeek-V3's 256 experts on 32-64
  GPUs are far inside) the result was never above EPLB. Groups and nodes shape only EPLB's start: copies move
  across nodes freely.
* ``split="exact"``: for callers that apply ForeMoE's own token split (an LPLB-like dispatcher). Each layer is
  planned by ForeMoE's ``foremoe`` strategy (owners + replicas in spare slots, exact token split) and by its EPLB
  re-implementation (strategy ``eplb``, with ``num_groups`` and ``num_nodes`` as given); per layer the plan with
  the lower peak GPU load under the planner's token split is kept, and an ``eplb`` layer that would hold two copies
  on one GPU is never taken. The ``foremoe`` candidate places owners nodes first, then GPUs within each node,
  without expert groups. Float weights are scaled to integers (each layer by ``2**40 / max(layer total)``, one
  scale for all layers, relative resolution about ``1e-12`` of the heaviest layer's total); integer weights are
  used as they are.

Common to both:

* **Never two copies of an expert on one GPU.** EPLB's packing may put two replicas of a hot expert on the same
  GPU; here every GPU holds distinct experts, so ``num_replicas / num_gpus`` (slots per GPU) must not exceed the
  number of experts.
* ``num_nodes`` must divide ``num_gpus``. Negative, NaN or infinite weights raise ``ValueError``.
* **Spare slots** (``exact``): if the plan leaves a slot empty, it is filled with the expert of largest
  ``weight / count`` not yet on that GPU, so that ``phy2log`` has no ``-1`` (EPLB's contract).
* **Replica order.** ``log2phy[l, e]`` lists an expert's physical ids in increasing order, ``-1`` padded.
* **Types.** NumPy in, NumPy out (int64); a torch tensor in gives int64 torch tensors on its device
  (torch is imported only then).

Export (``export_placement``) writes a placement as JSON:

* ``sglang``: ``{"physical_to_logical_map": [[...] * R] * L}``, what SGLang's ``--init-expert-location
  FILE.json`` reads (``ExpertLocationMetadata.init_by_mapping``; physical id ``p`` lives on GPU
  ``p // (R / num_gpus)``).
* ``vllm``: ``{"physical_to_logical_map": [L][R], "logical_to_physical_map": [L][E][maxcnt] (-1 padded),
  "logical_replica_count": [L][E]}``: the three tensors of vLLM's ``EplbState`` under their attribute
  names, to be loaded into that state (``torch.tensor(...)``) by the caller.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Tuple

import numpy as np

from ._args import int_array, integer, optional_integer

_SCALE_BITS = 40


def _to_numpy(x: Any) -> Tuple[np.ndarray, Any]:
    """``x`` as NumPy and, for a torch tensor, the tensor (to return results of its kind)."""
    if type(x).__module__.startswith("torch"):
        return x.detach().cpu().numpy(), x
    return np.asarray(x), None


def _integral(w: np.ndarray) -> np.ndarray:
    if w.dtype.kind in "iu":
        if (w < 0).any():
            i = tuple(int(v) for v in np.argwhere(w < 0)[0])
            raise ValueError(f"rebalance_experts: weight{list(i)} = {w[i]} is not a finite non-negative number")
        return np.ascontiguousarray(w, dtype=np.int64)
    w = _checked_float(w)
    top = float(w.sum(axis=1).max()) if w.size else 0.0
    if top <= 0:
        return np.zeros(w.shape, dtype=np.int64)
    return np.rint(w * (float(2**_SCALE_BITS) / top)).astype(np.int64)


def _checked_float(w: np.ndarray) -> np.ndarray:
    """``w`` as C-contiguous float64 after the checks of :func:`_integral` (finite, non-negative)."""
    if w.dtype.kind in "iu" and (w < 0).any():  # named as given, before the float conversion
        i = tuple(int(v) for v in np.argwhere(w < 0)[0])
        raise ValueError(f"rebalance_experts: weight{list(i)} = {w[i]} is not a finite non-negative number")
    if w.dtype.kind not in "iufb":
        raise ValueError(f"rebalance_experts: weight must be a float or integer array, got dtype {w.dtype}")
    w = np.ascontiguousarray(w, dtype=np.float64)
    bad = ~np.isfinite(w) | (w < 0)
    if bad.any():
        i = tuple(int(v) for v in np.argwhere(bad)[0])
        raise ValueError(f"rebalance_experts: weight{list(i)} = {w[i]} is not a finite non-negative number")
    return w


def _fill_and_index(phy2log: np.ndarray, weight: np.ndarray, num_gpus: int, num_experts: int):
    """Fills empty (-1) slots with distinct experts and derives log2phy and logcnt."""
    L, R = phy2log.shape
    S = R // num_gpus
    for l in np.flatnonzero((phy2log < 0).any(axis=1)):
        cnt = np.bincount(phy2log[l][phy2log[l] >= 0], minlength=num_experts).astype(np.float64)
        for g in range(num_gpus):
            row = phy2log[l, g * S:(g + 1) * S]
            for s in np.flatnonzero(row < 0):
                score = weight[l] / np.maximum(cnt, 1.0) + 1.0  # unplaced experts first (+1 keeps zeros > -inf)
                score[cnt == 0] = np.inf
                score[row[row >= 0]] = -np.inf
                e = int(np.argmax(score))
                row[s] = e
                cnt[e] += 1
    phy2log = phy2log.astype(np.int64)
    rows = np.arange(L)[:, None]
    logcnt = np.bincount((phy2log + rows * num_experts).ravel(), minlength=L * num_experts)
    logcnt = logcnt.reshape(L, num_experts).astype(np.int64)
    maxcnt = int(logcnt.max()) if logcnt.size else 1
    log2phy = np.full((L, num_experts, maxcnt), -1, dtype=np.int64)
    order = np.argsort(phy2log, axis=1, kind="stable")  # physical ids grouped by expert, increasing within each
    expert = np.take_along_axis(phy2log, order, axis=1)
    starts = np.cumsum(logcnt, axis=1) - logcnt
    rank = np.arange(R)[None, :] - np.take_along_axis(starts, expert, axis=1)
    log2phy[rows, expert, rank] = order
    return phy2log, log2phy, logcnt


def _has_duplicate(row: np.ndarray, S: int) -> bool:
    for g in range(row.size // S):
        r = row[g * S:(g + 1) * S]
        r = r[r >= 0]
        if np.unique(r).size != r.size:
            return True
    return False


def rebalance_experts(weight: Any, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
                      split: str = "even"):
    """DeepSeek EPLB's call, planned by ForeMoE (see the module docstring for every difference).

    Args:
        weight: ``[L, E]`` expert loads (float or integer; NumPy, a sequence or a torch tensor).
        num_replicas: physical experts ``R`` per layer (a multiple of ``num_gpus``, at least ``E``).
        num_groups: expert groups (for the EPLB candidate's hierarchical packing).
        num_nodes: nodes (dividing ``num_gpus``).
        num_gpus: GPUs.
        split: how the caller splits an expert's tokens over its copies, which decides what is optimised.
            ``"even"`` (default, EPLB's contract, what vLLM and SGLang do): each copy of expert ``e`` gets
            ``weight[e] / logcnt[e]``; per layer the largest GPU load under that split is minimised, and is never
            higher than DeepSeek EPLB's on the same input except where EPLB's two copies of one expert on a GPU
            reach a load that no placement without such pairs can (small shapes; module docstring). ``"exact"``:
            for callers that apply ForeMoE's own token split (an LPLB-like dispatcher); the largest GPU load under
            the planner's split is minimised, never higher than EPLB's under that split.

    Returns:
        ``(phy2log [L, R], log2phy [L, E, maxcnt] padded with -1, logcnt [L, E])``, int64, of the input's kind.
    """
    from . import Planner, Topology, _core  # the package's own, imported late (this module is imported by it)

    if split not in ("even", "exact"):
        raise ValueError(f"rebalance_experts: split must be 'even' or 'exact', got {split!r}")
    w, tensor = _to_numpy(weight)
    if w.ndim != 2:
        raise ValueError(f"rebalance_experts: weight must be [layers, experts], got shape {list(w.shape)}")
    L, E = (int(v) for v in w.shape)
    R, G, N = (integer(v, f"rebalance_experts: {k}") for k, v in
               (("num_replicas", num_replicas), ("num_gpus", num_gpus), ("num_nodes", num_nodes)))
    num_groups = integer(num_groups, "rebalance_experts: num_groups")
    if G <= 0 or N <= 0 or int(num_groups) <= 0:
        raise ValueError(f"rebalance_experts: num_groups, num_nodes and num_gpus must be positive, got "
                         f"{num_groups}, {num_nodes}, {num_gpus}")
    if G % N:
        raise ValueError(f"rebalance_experts: num_gpus {G} does not divide into num_nodes {N}")
    if R % G:
        raise ValueError(f"rebalance_experts: num_replicas {R} is not a multiple of num_gpus {G}")
    if R < E:
        raise ValueError(f"rebalance_experts: num_replicas {R} is fewer than the {E} experts")
    S = R // G
    if S > E:
        raise ValueError(f"rebalance_experts: {S} slots per GPU exceed the {E} experts (no GPU holds two copies)")
    if split == "even":
        wf = _checked_float(w)
        phy2log = np.asarray(_core.even_split_rebalance(wf, R, int(num_groups), N, G))
        return _returned(_fill_and_index(phy2log, wf, G, E), tensor)
    loads = _integral(w)
    topo = Topology(N, G // N, S)
    ours = Planner(topo, strategy="foremoe").plan(loads)
    phy2log = np.array(ours.phys_to_log, dtype=np.int64)
    peak = np.array(ours.max_gpu_load, dtype=np.float64)
    groups = int(num_groups) if E % int(num_groups) == 0 else 1
    try:
        theirs = Planner(topo, strategy="eplb", eplb_num_groups=groups).plan(loads, previous_loads=loads)
    except ValueError:
        theirs = None  # EPLB's shape rules (e.g. experts per group) do not fit: ours stands alone
    if theirs is not None:
        p2 = np.array(theirs.phys_to_log, dtype=np.int64)
        peak2 = np.array(theirs.max_gpu_load, dtype=np.float64)
        for l in range(L):
            if peak2[l] < peak[l] and not _has_duplicate(p2[l], S):
                phy2log[l] = p2[l]
    return _returned(_fill_and_index(phy2log, w.astype(np.float64), G, E), tensor)


def _returned(out: Tuple[np.ndarray, np.ndarray, np.ndarray], tensor: Any):
    """``out`` as NumPy, or as int64 torch tensors on ``tensor``'s device when the input was a tensor."""
    if tensor is None:
        return out
    import torch

    dev = tensor.device
    return tuple(torch.from_numpy(a).to(dev) for a in out)


def export_placement(placement: Any, path: Any, format: str = "sglang", num_experts: Optional[int] = None) -> None:
    """Writes a placement as SGLang's ``--init-expert-location`` JSON or vLLM's EPLB state (module docstring).

    ``placement`` is a :class:`foremoe.Plan`, a :class:`foremoe.Placement`, or ``phy2log`` ``[L, R]``
    (NumPy/torch/sequence, as :func:`rebalance_experts` returns it). Empty slots (-1) are refused: SGLang
    and vLLM need an expert in every physical slot. ``path`` ``-`` writes to stdout."""
    if format not in ("sglang", "vllm"):
        raise ValueError(f"export_placement: format must be sglang or vllm, got {format!r}")
    src = placement
    if hasattr(src, "phys_to_log"):
        p = np.asarray(src.phys_to_log)
    elif hasattr(src, "to_array"):
        a = np.asarray(src.to_array())
        p = a.reshape(a.shape[0], -1)
    else:
        p, _ = _to_numpy(src)
    p = int_array(p, "export_placement: phy2log")  # no NaN or 1.7 truncated, no 2**64 wrapped
    if p.ndim != 2:
        raise ValueError(f"export_placement: phy2log must be [layers, physical], got shape {list(p.shape)}")
    if (p < 0).any():
        l, s = (int(v) for v in np.argwhere(p < 0)[0])
        raise ValueError(f"export_placement: physical slot {s} of layer {l} is empty; SGLang and vLLM need an "
                         f"expert in every slot (use rebalance_experts, which fills spare slots)")
    E = optional_integer(num_experts, "export_placement: num_experts", 1) or int(p.max()) + 1
    if not 0 < E <= p.shape[1]:  # before the [L, E, maxcnt] map is built
        raise ValueError(f"export_placement: num_experts {num_experts} must be in [1, {p.shape[1]}], the physical "
                         f"slots per layer: every expert needs one")
    if int(p.max()) >= E:
        raise ValueError(f"export_placement: expert id {int(p.max())} is outside [0, {E})")
    doc: dict = {"physical_to_logical_map": p.tolist()}
    if format == "vllm":
        logcnt = np.stack([np.bincount(r, minlength=E) for r in p])
        maxcnt = int(logcnt.max())
        l2p = np.full((p.shape[0], E, maxcnt), -1, dtype=np.int64)
        for l in range(p.shape[0]):
            fill = np.zeros(E, dtype=np.int64)
            for s, e in enumerate(p[l]):
                l2p[l, e, fill[e]] = s
                fill[e] += 1
        doc["logical_to_physical_map"] = l2p.tolist()
        doc["logical_replica_count"] = logcnt.tolist()
    text = json.dumps(doc, separators=(",", ":")) + "\n"
    if str(path) == "-":
        import sys

        sys.stdout.write(text)
        return
    with open(os.fspath(path), "w", encoding="utf-8") as f:
        f.write(text)
