"""The router replay driver: a stage's recorded routing in, one plan per micro-step out, planned ahead.

With routing replay, the recompute and update stages reuse the expert choices the rollout recorded, so the
loads of every micro-step are known before the stage runs. :class:`ReplayDriver` takes them in the shapes
trainers hand over, counts them, and plans every micro-step of the stage with a :class:`foremoe.Planner` in a
background thread while the trainer executes the earlier micro-steps:

- verl: ``routed_experts`` ``[bs, seq, L, K]`` with its ``attention_mask`` ``[bs, seq]`` (prompts are left
  padded and the padded positions hold expert 0, so the mask decides what counts), micro-batches as a number
  of samples each or as lists of sample indices (dynamic batch sizing): :func:`loads_from_verl`;
- Megatron-core: per MoE layer one ``[T, K]`` tensor (what ``RouterReplay.set_replay_data`` takes), for the
  whole stage with token offsets, or one such list per micro-batch: :func:`loads_from_megatron`;
- slime: per micro-batch a list of per-sample ``[len, L, K]`` arrays (or sample indices into a list of them):
  :func:`loads_from_slime`;
- plain ``[T, L, K]`` ids with token offsets: :func:`loads_from_ids`;
- a routed-id file of any registered trace format (``foremoe.TRACE_FORMATS``: verl, SGLang, Megatron, NPY ids;
  the C++ readers of ``foremoe trace count``): :func:`loads_from_file`.

Every form becomes the ``[M, L, E]`` load tensor (CPU counting in C++, in place; ids on a GPU are counted there
when a device counter is bound, see :func:`loads_from_ids`). With ``group``, the ranks' loads are summed over the
process group first (in the caller's thread: collectives never run in the background thread), so every rank plans
the same placement.

**Packing before the stage.** Which samples form which micro-batch does not change the update when the loss is
normalised over the mini-batch, so the micro-batches can be chosen from the routing: :func:`pack_from_verl` (and
:func:`pack_from_ids`, :func:`pack_from_slime`) packs the step's samples into the trainer's micro-steps, ranks and
token budget so that each micro-step's expert load is close to the step's share, and returns a
:class:`StepPacking`: per rank, the sample indices of each micro-batch (what verl's ``rearrange_micro_batches``
returns) and the micro-steps' loads, which :meth:`ReplayDriver.from_packing` plans. What the trainer must keep is
in :class:`StepPacking`'s docstring.

**One placement per micro-step.** The driver plans each micro-step once and keeps the :class:`foremoe.Plan`:
:meth:`ReplayDriver.plan` returns the *same* object for every call with the same micro-step, so the recompute
forward, the update forward and the update backward (which keeps the plan its forward ran with, and re-asks the
driver if activations are recomputed) all see one placement. A plan's arrays are read-only views. The plan is what
:func:`foremoe.torch.balanced_moe` and :class:`foremoe.torch.BalancedMoE` take for every MoE layer of the
micro-step (the layer picks its own ``layer`` index).

**Weight moves** are issued by the layer when it runs (:meth:`foremoe.torch.ExpertStorage.sync` inside
:func:`~foremoe.torch.balanced_moe`), or ahead of it with :meth:`ReplayDriver.prefetch` (a collective: every rank
calls it in the same order), which posts them asynchronously into staging buffers; the layer's next call waits
for them within its deadline, verifies them and installs them. A replica row of micro-step ``m`` stays in use until
that micro-step's backward, so the staged rows are only written into the slots at the call: the next micro-step
may be prefetched during this one, and the result is bitwise that of the synchronous path.

**Never a hang.** Every wait has a deadline (``timeout``); an exception in the planning thread is re-raised in the
caller by the :meth:`~ReplayDriver.plan` call that needs it, as :class:`ReplayError` naming the micro-step and
chained to the original; :meth:`~ReplayDriver.close` (or leaving a ``with`` block) stops the thread and joins it.
A driver never closed (the trainer raised first, no ``with``) is stopped and joined when the interpreter exits,
before it finalizes, and when it is collected, so the process ends with its own exit status.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterator, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

import foremoe
from foremoe._args import int_array, int_list, integer, optional_integer, to_numpy

from .distributed import DEFAULT_TIMEOUT, gather_checked, group_rank, group_size, wait

__all__ = [
    "ReplayDriver",
    "ReplayError",
    "loads_from_file",
    "loads_from_ids",
    "loads_from_megatron",
    "loads_from_slime",
    "loads_from_verl",
    "pack_from_ids",
    "pack_from_slime",
    "pack_from_verl",
    "StepPacking",
]

#: A device load counter: ``counter(ids [T, L, K] on the device, microbatch_offsets, *, num_experts, layer_map,
#: mask)`` -> ``[M, L, E]`` (NumPy or a tensor), the contract of :func:`foremoe.count_loads`.
Counter = Callable[..., Any]


class ReplayError(RuntimeError):
    """Planning a micro-step in the driver's background thread failed (the original exception is the cause)."""


# -- counting ------------------------------------------------------------------------------------------------------


def _device_counter() -> Optional[Counter]:
    """The bound device ``count_loads`` (the transfer engine's binding), when this build has one."""
    try:
        from . import engine  # type: ignore[attr-defined]
    except ImportError:
        return None
    fn = getattr(engine, "count_loads", None)
    if not callable(fn) or not engine.runtime_build_info().get("cuda_compiled", False):
        return None  # a CPU-only runtime cannot count CUDA tensors

    def count(ids: Any, offsets: Any, *, num_experts: int, layer_map: Any, mask: Any) -> Any:
        # The runtime's counter has no mask: masked-out tokens become "no route" (-1) on the device first.
        if mask is not None:
            keep = torch.as_tensor(mask, device=ids.device).to(torch.bool).reshape(-1)
            if keep.numel() != ids.shape[0]:
                raise ValueError(f"mask has {keep.numel()} entries for {ids.shape[0]} tokens")
            ids = ids.masked_fill(~keep.view(-1, 1, 1), -1)
        lmap = None if layer_map is None else np.asarray(layer_map).reshape(-1).tolist()
        return fn(ids, offsets, num_experts=num_experts, layer_map=lmap)

    return count


def _on_device(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type != "cpu"


def _count(ids: Any, offsets: Any, num_experts: int, layer_map: Any, mask: Any, counter: Optional[Counter],
           who: str) -> np.ndarray:
    """``[M, L, E]`` int64 loads of ``[T, L, K]`` ids: on the device with a device counter, else on the CPU."""
    num_experts = integer(num_experts, f"{who}: num_experts")
    if _on_device(ids):
        fn = counter or _device_counter()
        if fn is not None:
            out = fn(ids, offsets, num_experts=num_experts, layer_map=layer_map, mask=mask)
            out = out.cpu().numpy() if isinstance(out, torch.Tensor) else np.asarray(out)
            return np.ascontiguousarray(out, dtype=np.int64)
        ids = ids.cpu()  # no device counter in this build: one copy to the host
    if isinstance(mask, torch.Tensor):
        mask = mask.cpu()
    try:
        return foremoe.count_loads(ids, offsets, num_experts=num_experts, layer_map=layer_map, mask=mask)
    except ValueError as e:
        raise ValueError(f"{who}: {e}") from None


def _array(x: Any, who: str, what: str) -> Any:
    """A tensor or an array as it is (read in place), anything else as a NumPy array."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return x
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{who}: {what} is not an array: {e}") from None


def _check_ids(ids: Any, ndim: int, who: str, what: str) -> None:
    if ids.ndim != ndim:
        raise ValueError(f"{who}: {what} must have {ndim} dimensions, got shape {list(ids.shape)}")
    dt = ids.dtype
    integer = (not dt.is_floating_point and not dt.is_complex and dt != torch.bool) if isinstance(dt, torch.dtype) \
        else np.dtype(dt).kind in "iu"
    if not integer:
        raise ValueError(f"{who}: {what} must hold integer expert ids, got dtype {dt}")


def _token_offsets(offsets: Any, who: str) -> Optional[np.ndarray]:
    """``[M + 1]`` token offsets as int64 (``None`` is one micro-step). Their values are checked where they are
    used, by the C++ counter (the host's and the device's alike: from 0, non-decreasing, ending at the trace's
    tokens), whose error names the offending index."""
    if offsets is None:
        return None
    a = np.asarray(offsets.cpu() if isinstance(offsets, torch.Tensor) else offsets)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise ValueError(f"{who}: microbatch_offsets must be [micro_steps + 1] integers, got shape {list(a.shape)}, "
                         f"dtype {a.dtype}")
    return int_array(a, f"{who}: microbatch_offsets")  # a uint64 past int64 is named, not wrapped negative


def _buffer(x: Any, who: str, what: str) -> Any:
    """An array as the C++ format registry reads it: NumPy arrays and CPU tensors in place, a tensor on a device as
    its layout ``(kind, bits, shape, strides)`` (its values are counted on the device), anything else as NumPy."""
    if isinstance(x, torch.Tensor):
        if x.device.type == "cpu":
            # torch 1.13's DLPack has no bool: a bool tensor goes over as the NumPy array it shares memory with.
            return x.detach().numpy() if x.dtype == torch.bool else x.detach()
        dt = x.dtype
        kind = "b" if dt == torch.bool else "f" if dt.is_floating_point else "?" if dt.is_complex else \
            "i" if torch.iinfo(dt).min < 0 else "u"
        return (kind, x.element_size() * 8, tuple(x.shape), tuple(x.stride()))
    a = np.asarray(x)
    if a.dtype.kind not in "biuf":
        raise ValueError(f"{who}: {what} must be an array of numbers, got dtype {a.dtype}")
    return a


def _host(x: Any) -> Any:
    """Masks and index lists are read on the host (they are small)."""
    return x.detach().cpu() if isinstance(x, torch.Tensor) else x


def _micro_batches(micro_batches: Any, who: str) -> Any:
    """``None``, a size, or one index array per micro-batch, as the C++ registry takes them (it checks them)."""
    if micro_batches is None:
        return None
    if isinstance(micro_batches, (int, float, np.integer, np.floating)):
        return integer(micro_batches, f"{who}: micro_batches")
    out = []
    for m, idx in enumerate(micro_batches):
        a = _host(idx)
        out.append(_buffer(a.reshape(-1) if isinstance(a, torch.Tensor) else np.asarray(a).reshape(-1), who,
                           f"micro-batch {m}"))
    return out


def _count_batch(fmt: str, who: str, arrays: List[Any], *, num_experts: int, list_sizes: Optional[List[int]] = None,
                 mask: Any = None, micro_batches: Any = None, offsets: Any = None,
                 layer_map: Optional[Sequence[int]] = None, counter: Optional[Counter] = None) -> np.ndarray:
    """``[M, L, E]`` loads of a trainer's arrays laid out by the C++ in-memory format ``fmt`` (which checks the
    layout: shapes, dtypes, masks, micro-batch partitions, offsets, ids). Ids on a device are counted there, part
    by part, by ``counter`` or the bound device counter (else copied to the host once)."""
    num_experts = integer(num_experts, f"{who}: num_experts")
    lm = None if layer_map is None else int_list(layer_map, f"{who}: layer_map")
    arrays = [_array(a, who, f"array {i}") for i, a in enumerate(arrays)]
    fn = None
    if any(_on_device(a) for a in arrays):
        fn = counter or _device_counter()
        if fn is None:  # no device counter in this build: one copy to the host
            arrays = [a.cpu() if _on_device(a) else a for a in arrays]
    bufs = [_buffer(a, who, f"array {i}") for i, a in enumerate(arrays)]
    off = _token_offsets(offsets, who)
    loads, parts, M, L = foremoe._core.count_batch(fmt, who, bufs, list_sizes,
                                                   None if mask is None else _buffer(_host(mask), who, "mask"),
                                                   _micro_batches(micro_batches, who), off, num_experts, lm)
    if loads is not None:
        return loads
    out = np.zeros((M, L if lm is None else sum(x >= 0 for x in lm), num_experts), dtype=np.int64)
    for i, row, T, layers, K, offs, steps, first, pmask in parts:
        t = arrays[i] if row < 0 else arrays[i][row]
        t = t.reshape(T, layers, K)
        whole = first == 0 and layers == L
        if _on_device(t):
            c = fn(t, offs, num_experts=num_experts, layer_map=lm if whole else None, mask=pmask)
            c = np.asarray(c.cpu() if isinstance(c, torch.Tensor) else c, dtype=np.int64)
        else:
            c = foremoe.count_loads(t, offs, num_experts=num_experts, layer_map=lm if whole else None, mask=pmask)
        for s, m in enumerate(steps):
            if whole:
                out[m] += c[s]
            else:
                out[m, first:first + layers] += c[s]
    return out


def loads_from_ids(
    routed_experts: Any,
    microbatch_offsets: Any = None,
    *,
    num_experts: int,
    layer_map: Optional[Sequence[int]] = None,
    mask: Any = None,
    counter: Optional[Counter] = None,
) -> np.ndarray:
    """``[M, L, E]`` loads of ``[T, L, K]`` ids (tokens in execution order, -1 = no route) cut at the ``[M + 1]``
    token ``microbatch_offsets`` (0 .. T; ``None``: one micro-step). ``layer_map`` maps trace layers to MoE layers
    (-1: a dense layer, ignored); ``mask`` ``[T]`` (0 = padding, not counted).

    NumPy arrays and CPU tensors are counted in place in C++. Ids on a GPU are counted there by ``counter`` (or the
    device ``count_loads`` of :mod:`foremoe.torch.engine` when this build binds one, with the arguments of
    :func:`foremoe.count_loads`); otherwise they are copied to the host once."""
    who = "loads_from_ids"
    ids = _array(routed_experts, who, "routed_experts")
    _check_ids(ids, 3, who, "routed_experts [tokens, layers, topk]")
    if mask is not None:
        m = _array(mask, who, "mask")
        if tuple(m.shape) != (ids.shape[0],):
            raise ValueError(f"{who}: mask must be [{ids.shape[0]}] (one per token), got {list(m.shape)}")
    off = _token_offsets(microbatch_offsets, who)
    return _count(ids, off, num_experts, layer_map, mask, counter, who)


def loads_from_file(
    path: Any,
    microbatch_offsets: Any = None,
    *,
    num_experts: int,
    format: str = "auto",
    mask: Any = None,
    num_layers: int = 0,
    topk: int = 0,
    layer_map: Optional[Sequence[int]] = None,
    counter: Optional[Counter] = None,
) -> np.ndarray:
    """``[M, L, E]`` loads of a routed-id file read by :func:`foremoe.read_trace` (the C++ format registry):
    ``format`` one of ``foremoe.TRACE_FORMATS`` or ``auto``, ``mask`` a path of the format's mask (verl's
    attention mask), ``num_layers`` and ``topk`` the payload's shape where the file does not carry it (SGLang).
    Then as :func:`loads_from_ids` over the file's ``[T, L, K]`` token stream."""
    rec = foremoe.read_trace(path, format, mask=mask, num_layers=num_layers, topk=topk)
    return loads_from_ids(rec.ids, microbatch_offsets, num_experts=num_experts, layer_map=layer_map, mask=rec.mask,
                          counter=counter)


def loads_from_verl(
    routed_experts: Any,
    attention_mask: Any,
    micro_batches: Any = None,
    *,
    num_experts: int,
    layer_map: Optional[Sequence[int]] = None,
    counter: Optional[Counter] = None,
) -> np.ndarray:
    """``[M, L, E]`` loads of verl's padded batch: ``routed_experts`` ``[bs, seq, L, K]`` and ``attention_mask``
    ``[bs, seq]`` (bool or integer 0/1; 0 = padding, which holds expert 0 and is not counted). ``micro_batches``:
    ``None`` (one), the samples per micro-batch (consecutive rows, as a fixed micro-batch size splits them) or one
    list of sample indices per micro-batch in execution order (dynamic batch sizing); every sample in exactly one.

    Laid out and counted in place by the C++ in-memory format ``verl`` (one pass over the whole batch)."""
    who = "loads_from_verl"
    return _count_batch("verl", who, [routed_experts], mask=attention_mask, micro_batches=micro_batches,
                        num_experts=num_experts, layer_map=layer_map, counter=counter)


def loads_from_megatron(
    per_layer: Sequence[Any],
    microbatch_offsets: Any = None,
    *,
    num_experts: int,
    counter: Optional[Counter] = None,
) -> np.ndarray:
    """``[M, L, E]`` loads of Megatron-core's per-layer top-k indices (what ``RouterReplay.set_replay_data``
    takes and ``RouterReplay.get_recorded_data`` returns): either one ``[T, K]`` tensor per MoE layer for the whole
    stage with ``[M + 1]`` token ``microbatch_offsets``, or a list with one such per-layer list per micro-batch
    (``microbatch_offsets`` then left out). Each layer is counted in place by the C++ in-memory format
    ``megatron``. A path is the per-layer indices stacked as NPY ``[L, T, K]``, read by the registry's ``megatron``
    file format (:func:`loads_from_file`)."""
    who = "loads_from_megatron"
    if isinstance(per_layer, (str, os.PathLike)):
        return loads_from_file(per_layer, microbatch_offsets, num_experts=num_experts, format="megatron",
                               counter=counter)
    if not isinstance(per_layer, (list, tuple)) or not per_layer:
        raise ValueError(f"{who}: per_layer must be a non-empty list of [tokens, topk] tensors (one per MoE layer)")
    sizes = None
    arrays = list(per_layer)
    if isinstance(per_layer[0], (list, tuple)):  # one per-layer list per micro-batch
        sizes, arrays = [], []
        for m, layers in enumerate(per_layer):
            if not isinstance(layers, (list, tuple)):
                raise ValueError(f"{who}: micro-batch {m} must be a list of per-layer tensors, got "
                                 f"{type(layers).__name__}")
            sizes.append(len(layers))
            arrays.extend(layers)
    return _count_batch("megatron", who, arrays, list_sizes=sizes, offsets=microbatch_offsets,
                        num_experts=num_experts, counter=counter)


def loads_from_slime(
    micro_batches: Sequence[Sequence[Any]],
    *,
    num_experts: int,
    samples: Optional[Sequence[Any]] = None,
    layer_map: Optional[Sequence[int]] = None,
    counter: Optional[Counter] = None,
) -> np.ndarray:
    """``[M, L, E]`` loads of slime's per-sample ``rollout_routed_experts`` ``[len, L, K]``: ``micro_batches`` is
    one list per micro-batch of the samples' arrays (or dicts holding ``rollout_routed_experts``), or, with
    ``samples``, of indices into ``samples`` (every sample in exactly one micro-batch). Each sample is counted in
    place by the C++ in-memory format ``slime``."""
    who = "loads_from_slime"

    def ids(s: Any, where: str) -> Any:
        if isinstance(s, dict):
            if "rollout_routed_experts" not in s:
                raise ValueError(f"{who}: {where}: no rollout_routed_experts")
            return s["rollout_routed_experts"]
        return s

    if samples is not None:
        return _count_batch("slime", who, [ids(s, f"samples[{j}]") for j, s in enumerate(samples)],
                            micro_batches=micro_batches, num_experts=num_experts, layer_map=layer_map,
                            counter=counter)
    if not isinstance(micro_batches, (list, tuple)) or not micro_batches:
        raise ValueError(f"{who}: micro_batches must be a non-empty list of per-sample lists")
    sizes, arrays = [], []
    for m, mb in enumerate(micro_batches):
        if not isinstance(mb, (list, tuple)):
            raise ValueError(f"{who}: micro-batch {m} must be a list of samples, got {type(mb).__name__}")
        sizes.append(len(mb))
        arrays.extend(ids(s, f"micro-batch {m}, sample {i}") for i, s in enumerate(mb))
    return _count_batch("slime", who, arrays, list_sizes=sizes, num_experts=num_experts, layer_map=layer_map,
                        counter=counter)


# -- packing: which sequences form which micro-batch, before the stage runs -------------------------------------------


class StepPacking:
    """The routing-aware packing of one optimizer step's sequences (:func:`foremoe.pack_micro_batches`), in the
    trainer's terms, and the loads of the micro-steps it makes.

    ``micro_step`` and ``rank`` (int32 ``[S]``): where every sequence runs; ``lengths`` (int64 ``[S]``): its tokens;
    ``loads`` (int64 ``[M, L, E]``, read-only): each micro-step's routed tokens per expert, all ranks together (what
    :meth:`ReplayDriver.from_packing` plans); ``start_deviation`` and ``deviation``: the packer's objective for the
    start (the trainer's token-balanced packing unless one was given) and for this packing (never higher).

    :meth:`micro_batches` of a rank is what verl's ``rearrange_micro_batches`` returns on that rank: one list of
    sample indices per micro-batch, in execution order. **The trainer must keep two things** for the update to stay
    the same (up to floating-point summation order): the loss is normalised over the whole mini-batch (e.g. the sum
    of token losses divided by the mini-batch's token count, not a mean per micro-batch, whose weights would change
    with the packing), and the recompute (old log-probs) and the update run the same micro-batches, so their plans,
    placements and the ``ReplayDriver``'s micro-steps agree. Outputs gathered per micro-batch go back to the batch's
    order by :meth:`order` (verl's ``get_reverse_idx``). A micro-batch may be empty when there are fewer sequences
    than micro-batches or the budget leaves room: the rank still runs that micro-step (its collectives) on no
    tokens."""

    __slots__ = ("micro_step", "rank", "lengths", "loads", "token_budget", "start_deviation", "deviation", "_ranks")

    def __init__(self, packing: Any, lengths: np.ndarray, loads: np.ndarray, ranks: int, token_budget: int):
        self.micro_step = packing.micro_step
        self.rank = packing.rank
        self.lengths = np.array(lengths, dtype=np.int64)  # a copy: the caller's array stays writable
        self.loads = loads
        self.token_budget = token_budget
        self.start_deviation = float(packing.start_deviation)
        self.deviation = float(packing.deviation)
        self._ranks = ranks
        for a in (self.micro_step, self.rank, self.lengths, self.loads):
            a.setflags(write=False)

    @property
    def num_micro_steps(self) -> int:
        return int(self.loads.shape[0])

    @property
    def num_ranks(self) -> int:
        return self._ranks

    @property
    def num_sequences(self) -> int:
        return int(self.lengths.shape[0])

    def micro_batches(self, rank: Optional[int] = None) -> List[Any]:
        """``rank`` given: that rank's micro-batches, ``[micro_step] -> sample indices`` (ascending), the shape of
        verl's ``micro_bsz_idx``; ``None``: every rank's, ``[micro_step][rank] -> sample indices``."""
        out: List[List[List[int]]] = [[[] for _ in range(self._ranks)] for _ in range(self.num_micro_steps)]
        for s, (m, r) in enumerate(zip(self.micro_step.tolist(), self.rank.tolist())):
            out[m][r].append(s)
        if rank is None:
            return out
        r = integer(rank, "StepPacking.micro_batches: rank", 0, self._ranks - 1)
        return [mb[r] for mb in out]

    def order(self, rank: Optional[int] = None) -> np.ndarray:
        """The permutation that puts per-sample outputs gathered micro-batch by micro-batch back in the batch's order
        (verl's ``get_reverse_idx``): ``torch.cat(outputs)[order]``, where ``outputs[i]`` is micro-batch ``i``'s
        ``[samples, ...]`` result (e.g. padded log-probs). ``rank`` given: that rank's micro-batches, back in the
        ascending order of its samples; ``None``: every micro-batch, micro-step by micro-step, rank by rank."""
        mbs = self.micro_batches(rank)
        flat = [s for mb in mbs for s in mb] if rank is not None else [s for step in mbs for mb in step for s in mb]
        return np.argsort(np.asarray(flat, dtype=np.int64), kind="stable")

    def __repr__(self) -> str:
        return (f"StepPacking(sequences={self.num_sequences}, micro_steps={self.num_micro_steps}, "
                f"ranks={self._ranks}, token_budget={self.token_budget}, deviation {self.start_deviation:.6g} -> "
                f"{self.deviation:.6g})")


def _pack(who: str, lengths: np.ndarray, histograms: np.ndarray, micro_steps: Any, token_budget: Any, ranks: Any,
          gpu_of: Any, start: Any) -> StepPacking:
    """Packs counted sequences (``[S]`` lengths, ``[S, L, E]`` histograms) and sums the micro-steps' loads."""
    g = None
    if gpu_of is not None:
        g = to_numpy(gpu_of)
        if g.ndim == 1 and g.shape[0] == histograms.shape[2]:
            g = np.broadcast_to(g, histograms.shape[1:])  # [E] owners: the same in every layer
        if g.ndim != 2 or tuple(g.shape) != histograms.shape[1:]:
            raise ValueError(f"{who}: gpu_of must be [{histograms.shape[2]}] or {list(histograms.shape[1:])} (the GPU "
                             f"serving each expert), got shape {list(g.shape)}")
        g = int_array(g, f"{who}: gpu_of", dtype=np.int32, lo=0)
    try:
        p = foremoe.pack_micro_batches(lengths, histograms, micro_steps=micro_steps, token_budget=token_budget,
                                       ranks=ranks, gpu_of=g, start=start)
    except ValueError as e:
        raise ValueError(f"{who}: {e}") from None
    M = int(micro_steps)
    loads = np.zeros((M,) + histograms.shape[1:], dtype=np.int64)
    np.add.at(loads, p.micro_step, histograms)
    return StepPacking(p, lengths, loads, int(ranks), int(token_budget))


def pack_from_verl(routed_experts: Any, attention_mask: Any, *, num_experts: int, micro_steps: int,
                   token_budget: int, ranks: int = 1, gpu_of: Any = None, start: Any = None,
                   layer_map: Optional[Sequence[int]] = None, counter: Optional[Counter] = None) -> StepPacking:
    """Packs verl's padded batch (``routed_experts`` ``[bs, seq, L, K]``, ``attention_mask`` ``[bs, seq]``, as
    :func:`loads_from_verl` reads them) into ``micro_steps`` x ``ranks`` micro-batches of at most ``token_budget``
    valid tokens each, so that every micro-step's expert load is close to the step's share
    (:func:`foremoe.pack_micro_batches`). Call it before the stage runs, where verl calls
    ``rearrange_micro_batches``: :meth:`StepPacking.micro_batches` goes where its indices go.

    ``ranks`` > 1 packs the whole mini-batch over the data-parallel ranks (the controller then sends each rank its
    samples); ``ranks`` = 1 packs one rank's own samples (pass ``group`` to :meth:`ReplayDriver.from_packing` then).
    ``gpu_of``: the placement (``[E]`` or ``[L, E]``, e.g. ``BalancedMoE.owners``) whose per-GPU loads should be
    even in every micro-step; ``None``: every expert on its own. ``start``: the trainer's own packing
    ``(micro_step, rank)`` (default: longest first to the micro-batch with the fewest tokens), never done worse than.
    Each sample's routing is counted in place in C++ (masked positions not counted); its length is its count of
    valid positions. Errors name the value (``ValueError``)."""
    who = "pack_from_verl"
    hist = _count_batch("verl", who, [routed_experts], mask=attention_mask, micro_batches=1,
                        num_experts=num_experts, layer_map=layer_map, counter=counter)
    mask = to_numpy(_host(attention_mask))  # checked by the count: [bs, seq] of 0/1
    return _pack(who, (mask != 0).sum(axis=1).astype(np.int64), hist, micro_steps, token_budget, ranks, gpu_of,
                 start)


def pack_from_ids(routed_experts: Any, lengths: Any, *, num_experts: int, micro_steps: int, token_budget: int,
                  ranks: int = 1, gpu_of: Any = None, start: Any = None, layer_map: Optional[Sequence[int]] = None,
                  mask: Any = None, counter: Optional[Counter] = None) -> StepPacking:
    """:func:`pack_from_verl` for sequences laid end to end: ``routed_experts`` ``[T, L, K]`` (-1 = no route) and
    ``lengths`` ``[S]`` tokens each, in order (Megatron's packed sequences, slime's concatenated samples); ``mask``
    ``[T]`` (0: not counted; the lengths still count every token, they are what the budget limits)."""
    who = "pack_from_ids"
    lens = int_array(lengths, f"{who}: lengths", lo=0)
    if lens.ndim != 1 or lens.size == 0:
        raise ValueError(f"{who}: lengths must be [sequences] with at least one sequence, got shape "
                         f"{list(lens.shape)}")
    hist = loads_from_ids(routed_experts, np.concatenate([[0], np.cumsum(lens)]), num_experts=num_experts,
                          layer_map=layer_map, mask=mask, counter=counter)
    return _pack(who, lens, hist, micro_steps, token_budget, ranks, gpu_of, start)


def pack_from_slime(samples: Sequence[Any], *, num_experts: int, micro_steps: int, token_budget: int, ranks: int = 1,
                    gpu_of: Any = None, start: Any = None, layer_map: Optional[Sequence[int]] = None,
                    counter: Optional[Counter] = None) -> StepPacking:
    """:func:`pack_from_verl` for slime's samples: one ``[len, L, K]`` array (or a dict holding
    ``rollout_routed_experts``) per sample, ``len`` its tokens."""
    who = "pack_from_slime"
    if not isinstance(samples, (list, tuple)) or not samples:
        raise ValueError(f"{who}: samples must be a non-empty list of per-sample [len, L, K] arrays")
    hist = loads_from_slime([[s] for s in samples], num_experts=num_experts, layer_map=layer_map, counter=counter)
    lens = [(s["rollout_routed_experts"] if isinstance(s, dict) else s).shape[0] for s in samples]
    return _pack(who, np.asarray(lens, dtype=np.int64), hist, micro_steps, token_budget, ranks, gpu_of, start)


# -- the driver -------------------------------------------------------------------------------------------------------

# One planner object is not safe for concurrent calls: drivers sharing a planner take turns.
_PLANNER_LOCKS: "weakref.WeakKeyDictionary[Any, threading.Lock]" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _planner_lock(planner: Any) -> threading.Lock:
    with _LOCKS_GUARD:
        try:
            lock = _PLANNER_LOCKS.get(planner)
            if lock is None:
                lock = _PLANNER_LOCKS[planner] = threading.Lock()
        except TypeError:  # not weak-referenceable: a lock of its own
            lock = threading.Lock()
        return lock


def _sum_over_group(loads: Optional[np.ndarray], group: Any, timeout: float,
                    error: Optional[str] = None) -> np.ndarray:
    """The loads summed over the ranks of ``group``. The ranks first gather their shapes and whether their input was
    good (``error``: this rank's message), so a bad input or a disagreeing shape on one rank fails every rank with a
    clear error instead of leaving the others waiting."""
    if group_size(group) == 1:
        if error is not None:
            raise ValueError(error) from None
        return loads
    who = f"ReplayDriver: rank {group_rank(group)}"
    mine = [0, 0, 0] if error is not None else list(loads.shape)
    rows = gather_checked(mine, error, group, timeout, "ReplayDriver: all_gather of shapes",
                          f"{who}: rank {{rank}} of the group rejected its routing (its error names the value)")
    for r, row in enumerate(rows.tolist()):
        if row != mine:
            raise ValueError(f"{who}: rank {r} has loads of shape {row} [micro_steps, layers, experts], this rank "
                             f"{mine} (every rank must replay the same micro-steps)")
    t = torch.from_numpy(np.ascontiguousarray(loads, dtype=np.int64)).clone()
    wait(dist.all_reduce(t, group=group, async_op=True), timeout, "ReplayDriver: all_reduce of the loads")
    return t.numpy()


def _checked_loads(loads: Any, num_layers: Optional[int], owners: Any) -> Any:
    """``([M, L, E] int64 loads, [L, E] int32 owners or None)``, or ``ValueError`` naming what is wrong."""
    a = to_numpy(loads)  # a tensor that requires grad: its values
    if a.ndim != 3 or a.shape[0] == 0:
        raise ValueError(f"ReplayDriver: loads must be [micro_steps, layers, experts] with at least one micro-step, "
                         f"got shape {list(a.shape)}")
    if a.size and a.dtype.kind not in "iu":
        raise ValueError(f"ReplayDriver: loads must hold integer counts, got dtype {a.dtype}")
    a = int_array(a, "ReplayDriver: loads")  # a uint64 past int64 is named, not wrapped to a negative load
    if a.size and a.min() < 0:
        raise ValueError(f"ReplayDriver: negative load {int(a.min())} at "
                         f"[micro_step, layer, expert] {np.argwhere(a < 0)[0].tolist()}")
    num_layers = optional_integer(num_layers, "ReplayDriver: num_layers")
    if num_layers is not None and num_layers != a.shape[1]:
        raise ValueError(f"ReplayDriver: the recorded routing has {a.shape[1]} MoE layers, the model "
                         f"{int(num_layers)} (pass layer_map to drop dense layers from the trace)")
    if owners is None:
        return a, None
    o = to_numpy(owners)
    if o.dtype.kind not in "iu" or o.shape not in ((a.shape[2],), a.shape[1:]):
        raise ValueError(f"ReplayDriver: owners must be [{a.shape[2]}] or {list(a.shape[1:])} integer ranks, "
                         f"got shape {list(o.shape)}, dtype {o.dtype}")
    o = int_array(o, "ReplayDriver: owners", dtype=np.int32)  # an owner past int32 never wraps onto another rank
    return a, np.ascontiguousarray(np.broadcast_to(o, a.shape[1:]))


# Every driver whose thread was started, until it is collected: joined at interpreter exit (see _join_at_exit).
_DRIVERS: "weakref.WeakSet[ReplayDriver]" = weakref.WeakSet()


def _join_at_exit() -> None:
    """Stops and joins every driver's planning thread while the interpreter can still run threads.

    The thread is a daemon (it never keeps a process alive by itself), but a daemon thread still inside a C++
    planner call when finalization starts is ended by the interpreter when that call retakes the GIL; the unwind
    crosses the binding's noexcept frames and the process aborts ("terminate called without an active exception",
    exit 134) instead of exiting with its own status. atexit handlers run before finalization starts."""
    for driver in list(_DRIVERS):
        driver._shutdown(driver.timeout, "at interpreter exit")


atexit.register(_join_at_exit)


class ReplayDriver:
    """Plans every micro-step of one stage ahead, in a background thread, and hands out one plan per micro-step.

    Args:
        planner: a :class:`foremoe.Planner` (calls on one planner from several threads take turns, so the trainer
            may keep planning with it while the driver's thread does; drivers sharing it take turns).
        loads: ``[M, L, E]`` loads of the stage (see the ``loads_from_*`` functions and the ``from_*``
            constructors, which count them from the recorded routing).
        owners: ``[E]`` or ``[L, E]`` owner rank of every expert (e.g. ``BalancedMoE.owners``; the balanced layer
            requires its owners). With owners, each micro-step is planned on its own as soon as the previous one
            is done, and :meth:`plan` returns it then. Without, the owners come from the stage's total (two-level
            strategies) and the whole stage is planned in one call.
        resident: the placement before the stage (a :class:`foremoe.Plan`, e.g. the previous stage's
            :attr:`last_plan`, a :class:`foremoe.Placement` or a ``[L, G, S]`` array); ``None``: none.
        stage: ``"update"`` or ``"recompute"`` (the planner's cost of a replica: the update stage also returns its
            gradient).
        num_layers: the model's MoE layer count; the loads must have as many layers (else ``ValueError`` naming
            both).
        group: a ``torch.distributed`` process group: each rank's loads (of its own tokens) are summed over it before
            planning, so every rank plans the same (one ``all_gather`` of the shape and one ``all_reduce``, in the
            constructor, every rank calling it). ``None``: ``loads`` are already the stage's totals.
        timeout: seconds a :meth:`plan` call, a collective or :meth:`close` waits at most.
        start: start planning now (else at :meth:`start`).
    """

    def __init__(self, planner: Any, loads: Any, *, owners: Any = None, resident: Any = None, stage: str = "update",
                 num_layers: Optional[int] = None, group: Any = None, timeout: float = DEFAULT_TIMEOUT,
                 start: bool = True):
        if not callable(getattr(planner, "plan", None)):
            raise ValueError(f"ReplayDriver: planner must be a foremoe.Planner, got {type(planner).__name__}")
        if stage not in ("update", "recompute"):
            raise ValueError(f"ReplayDriver: stage must be 'update' or 'recompute', got {stage!r}")
        if not timeout > 0:
            raise ValueError(f"ReplayDriver: timeout must be positive, got {timeout}")
        self.timeout = float(timeout)
        try:
            a, self.owners = _checked_loads(loads, num_layers, owners)
        except ValueError as e:
            if group is None:
                raise
            _sum_over_group(None, group, self.timeout, str(e))  # fails every rank
            raise
        self.loads = _sum_over_group(a, group, self.timeout) if group is not None else a
        self.loads.setflags(write=False)
        self.stage = stage
        self.planner = planner
        self.resident = resident
        self._plans: List[Any] = [None] * self.num_micro_steps
        self._error: Optional[BaseException] = None
        self._failed_at = -1
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self.planner_seconds = 0.0  # wall time the thread spent planning
        if start:
            self.start()

    # -- constructors from the trainers' shapes ------------------------------------------------------------------

    @classmethod
    def from_ids(cls, planner: Any, routed_experts: Any, microbatch_offsets: Any = None, *, num_experts: int,
                 layer_map: Optional[Sequence[int]] = None, mask: Any = None, counter: Optional[Counter] = None,
                 **driver: Any) -> "ReplayDriver":
        """A driver over ``[T, L, K]`` ids (:func:`loads_from_ids`); ``driver`` are the constructor's keywords. With
        ``group``, a bad input on one rank (an id out of range, ...) fails every rank, this one naming the value."""
        return cls._counted(planner, lambda: loads_from_ids(routed_experts, microbatch_offsets, num_experts=num_experts,
                                                            layer_map=layer_map, mask=mask, counter=counter), driver,
                           num_experts)

    @classmethod
    def from_verl(cls, planner: Any, routed_experts: Any, attention_mask: Any, micro_batches: Any = None, *,
                  num_experts: int, layer_map: Optional[Sequence[int]] = None, counter: Optional[Counter] = None,
                  **driver: Any) -> "ReplayDriver":
        """A driver over verl's ``routed_experts`` + ``attention_mask`` (:func:`loads_from_verl`)."""
        return cls._counted(planner, lambda: loads_from_verl(routed_experts, attention_mask, micro_batches,
                                                             num_experts=num_experts, layer_map=layer_map,
                                                             counter=counter), driver, num_experts)

    @classmethod
    def from_megatron(cls, planner: Any, per_layer: Sequence[Any], microbatch_offsets: Any = None, *,
                      num_experts: int, counter: Optional[Counter] = None, **driver: Any) -> "ReplayDriver":
        """A driver over Megatron-core's per-layer ``[T, K]`` indices (:func:`loads_from_megatron`)."""
        return cls._counted(planner, lambda: loads_from_megatron(per_layer, microbatch_offsets, num_experts=num_experts,
                                                                 counter=counter), driver, num_experts)

    @classmethod
    def from_file(cls, planner: Any, path: Any, microbatch_offsets: Any = None, *, num_experts: int,
                  format: str = "auto", mask: Any = None, num_layers: int = 0, topk: int = 0,
                  layer_map: Optional[Sequence[int]] = None, counter: Optional[Counter] = None,
                  **driver: Any) -> "ReplayDriver":
        """A driver over a routed-id file of any registered format (:func:`loads_from_file`)."""
        return cls._counted(planner, lambda: loads_from_file(path, microbatch_offsets, num_experts=num_experts,
                                                             format=format, mask=mask, num_layers=num_layers,
                                                             topk=topk, layer_map=layer_map, counter=counter), driver,
                           num_experts)

    @classmethod
    def from_slime(cls, planner: Any, micro_batches: Sequence[Sequence[Any]], *, num_experts: int,
                   samples: Optional[Sequence[Any]] = None, layer_map: Optional[Sequence[int]] = None,
                   counter: Optional[Counter] = None, **driver: Any) -> "ReplayDriver":
        """A driver over slime's per-micro-batch sample lists (:func:`loads_from_slime`)."""
        return cls._counted(planner, lambda: loads_from_slime(micro_batches, num_experts=num_experts, samples=samples,
                                                              layer_map=layer_map, counter=counter), driver,
                           num_experts)

    @classmethod
    def from_packing(cls, planner: Any, packing: StepPacking, **driver: Any) -> "ReplayDriver":
        """A driver over the micro-steps of a :class:`StepPacking` (:func:`pack_from_verl` and its siblings): its
        micro-step ``m`` is the packing's, so plan ``m`` goes with every rank's ``packing.micro_batches(rank)[m]``.
        With ``group``, each rank passes the packing of its own samples (``ranks`` = 1) and the loads are summed
        over the group; a packing over several ranks already holds the whole mini-batch's loads."""
        if not isinstance(packing, StepPacking):
            raise ValueError(f"ReplayDriver.from_packing: packing must be a StepPacking (foremoe.torch.pack_from_*), "
                             f"got {type(packing).__name__}")
        if driver.get("group") is not None and packing.num_ranks != 1:
            raise ValueError(f"ReplayDriver.from_packing: the packing spans {packing.num_ranks} ranks, so its loads "
                             f"are the whole mini-batch's already; with group, each rank passes the packing of its "
                             f"own samples (ranks=1)")
        return cls(planner, packing.loads, **driver)

    @classmethod
    def _counted(cls, planner: Any, count: Callable[[], np.ndarray], driver: Any,
                 num_experts: Any = None) -> "ReplayDriver":
        # Before counting: an expert count the planner cannot place would only be refused after [M, L, E] loads
        # were built (2^28 experts: gigabytes).
        topo = getattr(planner, "topology", None)
        if num_experts is not None and topo is not None:
            cap = int(topo.nodes) * int(topo.gpus_per_node) * int(topo.slots)
            if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) or \
                    not 0 < int(num_experts) <= cap:
                raise ValueError(f"ReplayDriver: num_experts {num_experts!r} must be an integer in [1, {cap}]: the "
                                 f"planner's {topo.nodes} x {topo.gpus_per_node} GPUs x {topo.slots} slots hold "
                                 f"{cap} experts at most (each needs its owner's slot)")
        try:
            loads = count()
        except ValueError as e:
            if driver.get("group") is None:
                raise
            _sum_over_group(None, driver["group"], float(driver.get("timeout", DEFAULT_TIMEOUT)), str(e))
            raise
        return cls(planner, loads, **driver)

    # -- shape ----------------------------------------------------------------------------------------------------

    @property
    def num_micro_steps(self) -> int:
        return int(self.loads.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.loads.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.loads.shape[2])

    def __len__(self) -> int:
        return self.num_micro_steps

    @property
    def running(self) -> bool:
        """Whether the planning thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    # -- the thread ------------------------------------------------------------------------------------------------

    def start(self) -> "ReplayDriver":
        """Starts the planning thread (once)."""
        if self._closed:
            raise RuntimeError("ReplayDriver: start after close")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"foremoe-replay-{self.stage}", daemon=True)
            _DRIVERS.add(self)
            self._thread.start()
        return self

    def _publish(self, m: int, plans: Sequence[Any]) -> None:
        with self._cond:
            for i, p in enumerate(plans):
                self._plans[m + i] = p
            self._cond.notify_all()

    def _run(self) -> None:
        m = 0
        lock = _planner_lock(self.planner)
        t0 = time.perf_counter()
        try:
            if self.owners is None:  # owners from the stage total: the whole stage in one call
                with lock:
                    plans = self.planner.plan(self.loads, resident=self.resident, stage=self.stage)
                if len(plans) != self.num_micro_steps:
                    raise RuntimeError(f"the planner returned {len(plans)} plans for {self.num_micro_steps} "
                                       f"micro-steps")
                self._publish(0, plans)
            else:  # each micro-step from the previous one's placement, published as soon as it is planned
                prev = self.resident
                # foremoe's planner also chains the replica gradients held so far, so the plans are those of one
                # call over the stage (other planners are called as before).
                extra = {}
                if isinstance(self.planner, foremoe.Planner):
                    extra["held"] = foremoe.HeldGradients(self.loads.shape[1], self.planner.topology.num_gpus,
                                                          self.loads.shape[2])
                for m in range(self.num_micro_steps):
                    if self._stop.is_set():
                        return
                    with lock:
                        p = self.planner.plan(self.loads[m], resident=prev, stage=self.stage, owners=self.owners,
                                              **extra)
                    self._publish(m, [p])
                    prev = p
        except BaseException as e:  # noqa: BLE001 - handed to the caller by plan()
            with self._cond:
                self._error, self._failed_at = e, m
                self._cond.notify_all()
        finally:
            self.planner_seconds = time.perf_counter() - t0

    # -- what the trainer calls -------------------------------------------------------------------------------------

    def plan(self, micro_step: int, *, layer: Optional[int] = None, timeout: Optional[float] = None) -> Any:
        """The :class:`foremoe.Plan` of micro-step ``micro_step`` (every MoE layer), waiting at most ``timeout``
        seconds (default: the driver's) for the thread to plan it. The same object on every call: hand it to every
        pass of the micro-step (recompute forward, update forward, recomputation in the update backward).
        ``layer`` (optional) checks that the plan has that MoE layer.

        Raises ``ValueError`` for a micro-step or layer outside the stage, :class:`ReplayError` when planning it
        failed (chained to the planner's exception), ``TimeoutError`` when it is not planned in time, and
        ``RuntimeError`` after :meth:`close` for a micro-step that was not planned."""
        if isinstance(micro_step, bool) or not isinstance(micro_step, (int, np.integer)):
            raise ValueError(f"ReplayDriver.plan: micro_step must be an int, got {type(micro_step).__name__}")
        m = int(micro_step)
        if not 0 <= m < self.num_micro_steps:
            raise ValueError(f"ReplayDriver.plan: micro-step {m} outside the {self.stage} stage's "
                             f"[0, {self.num_micro_steps}) micro-steps")
        layer = optional_integer(layer, "ReplayDriver.plan: layer")
        if layer is not None and not 0 <= layer < self.num_layers:
            raise ValueError(f"ReplayDriver.plan: layer {layer} outside the recorded routing's "
                             f"[0, {self.num_layers}) MoE layers")
        limit = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + limit
        with self._cond:
            while self._plans[m] is None:
                if self._error is not None and m >= self._failed_at:
                    e = self._error
                    raise ReplayError(f"ReplayDriver: planning micro-step {self._failed_at} of the {self.stage} stage "
                                      f"failed in the planning thread: {type(e).__name__}: {e}") from e
                if self._closed or (self._thread is not None and not self._thread.is_alive()):
                    raise RuntimeError(f"ReplayDriver: micro-step {m} was not planned: the driver was closed")
                if self._thread is None:
                    raise RuntimeError("ReplayDriver: plan() before start()")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"ReplayDriver: micro-step {m} of the {self.stage} stage was not planned "
                                       f"within {limit:g} s")
                self._cond.wait(left)
            return self._plans[m]

    def prefetch(self, micro_step: int, modules: Sequence[Any], *, timeout: Optional[float] = None) -> Any:
        """Starts the replica moves of micro-step ``micro_step`` for each of ``modules`` (balanced MoE layers:
        anything with ``prefetch(plan)``, e.g. :class:`foremoe.torch.BalancedMoE`), in the order given, and returns
        the plan (waited for as :meth:`plan` does). A collective: every rank calls it with the same micro-step and
        modules in the same order. Call it where the moves should overlap compute, e.g. for layer ``l + 1`` right
        after layer ``l``'s forward, or for micro-step ``m + 1`` during micro-step ``m``; the module's next call must
        then be micro-step ``micro_step``'s (see :meth:`foremoe.torch.ExpertStorage.prefetch`)."""
        plan = self.plan(micro_step, timeout=timeout)
        for module in modules:
            fn = getattr(module, "prefetch", None)
            if not callable(fn):
                raise ValueError(f"ReplayDriver.prefetch: {type(module).__name__} has no prefetch(plan) method "
                                 f"(pass foremoe.torch.BalancedMoE modules)")
            fn(plan)
        return plan

    def __iter__(self) -> Iterator[Any]:
        """The plans of the micro-steps in order (each waited for as :meth:`plan` does)."""
        for m in range(self.num_micro_steps):
            yield self.plan(m)

    @property
    def last_plan(self) -> Any:
        """The last micro-step's plan: the resident placement of the next stage."""
        return self.plan(self.num_micro_steps - 1)

    def ready(self, micro_step: int) -> bool:
        """Whether micro-step ``micro_step`` is planned (never waits)."""
        return self._plans[integer(micro_step, "ReplayDriver.ready: micro_step", 0, self.num_micro_steps - 1)] \
            is not None

    def close(self, timeout: Optional[float] = None) -> None:
        """Stops planning after the micro-step in progress and joins the thread (at most ``timeout`` seconds,
        default the driver's; ``RuntimeError`` when it does not end by then). Plans already made stay available."""
        limit = self.timeout if timeout is None else float(timeout)
        if not self._shutdown(limit):
            raise RuntimeError(f"ReplayDriver: the planning thread did not stop within {limit:g} s (a planner "
                               f"call still running)")

    def _shutdown(self, limit: float, when: str = "") -> bool:
        """Stops the thread after the micro-step in progress and joins it for at most ``limit`` seconds; whether
        it ended (or never ran). Never raises: it also runs from ``__del__`` and at interpreter exit (``when``: the
        warning on stderr when the thread outlives the wait there)."""
        self._stop.set()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        t = self._thread
        if t is None or t is threading.current_thread():
            return True
        t.join(limit)
        if not t.is_alive():
            return True
        if when and sys.stderr is not None:
            try:
                sys.stderr.write(f"foremoe.torch.ReplayDriver: the planning thread did not stop within {limit:g} s "
                                 f"{when} (a planner call still running)\n")
            except Exception:  # noqa: BLE001 - a closed stderr at exit
                pass
        return False

    def __enter__(self) -> "ReplayDriver":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        # The thread holds the driver (its target is a bound method), so a driver is collected with its thread
        # finished or never started, or during finalization: stop and join it without raising.
        if getattr(self, "_cond", None) is None:
            return  # __init__ failed before the thread's state existed
        try:
            self._shutdown(self.timeout, "when the driver was collected")
        except Exception:  # noqa: BLE001 - never raise from __del__
            pass

    def __repr__(self) -> str:
        done = sum(p is not None for p in self._plans)
        return (f"ReplayDriver(stage={self.stage!r}, micro_steps={self.num_micro_steps}, layers={self.num_layers}, "
                f"experts={self.num_experts}, planned={done})")
