"""Token dispatch across processes: the calls a trainer's own MoE dispatcher makes, on torch.distributed.

For one MoE layer and one micro-step, a :class:`foremoe.Plan` places expert copies in physical slots
``p = rank * slots + j`` and gives each copy its exact token count. Every rank holds its own tokens; the
plan's per-copy totals are split by source rank (the C++ ``split_by_source``: a copy on the token's own rank
first, then on its node, then anywhere), and each rank maps its ``[T, K]`` logical ids to physical slots with its
own column of that split (the C++ token map). What comes out is what ``torch.distributed.all_to_all_single``
needs: the send order, the split sizes per rank in both directions, and the order that groups the received
rows by local slot.

:func:`dispatch_layout` does all of it, with one small ``all_gather`` of per-rank expert counts (which also
carries every rank's input check, so a bad input on one rank fails every rank with a clear error instead of
leaving the others waiting). :func:`local_layout` is the same without any collective, for a trainer that already
holds the per-source loads (``foremoe.count_loads(..., return_by_source=True)``). Every wait has a timeout.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

import foremoe
from foremoe import _core
from foremoe._args import INT64_MAX, int_array, int_list, integer

__all__ = [
    "DispatchLayout",
    "all_to_all",
    "dispatch_layout",
    "gather_source_loads",
    "group_rank",
    "group_size",
    "local_layout",
]

#: Seconds a collective or point-to-point transfer may take before it is reported as failed.
DEFAULT_TIMEOUT = 120.0


def group_size(group: Any = None) -> int:
    """Ranks in ``group`` (``None``: the default group); 1 when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("foremoe.torch: a process group was passed but torch.distributed is not initialised")
        return 1
    return dist.get_world_size(group)


def group_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (0 without torch.distributed)."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def global_rank(group: Any, rank: int) -> int:
    """The default-group rank of ``rank`` in ``group`` (what point-to-point calls take as the peer)."""
    if group is None:
        return rank
    if hasattr(dist, "get_global_rank"):  # torch >= 2.0
        return dist.get_global_rank(group, rank)
    from torch.distributed import distributed_c10d as c10d  # torch 1.13

    return c10d._get_global_rank(group, rank)


def wait(work: Any, timeout: float, what: str) -> None:
    """Waits for ``work`` at most ``timeout`` seconds; a failure or a timeout raises naming ``what``."""
    try:
        ok = work.wait(datetime.timedelta(seconds=float(timeout)))
    except RuntimeError as e:
        raise RuntimeError(f"foremoe.torch: {what} failed or did not finish within {timeout:g} s: {e}") from e
    if ok is False:
        raise RuntimeError(f"foremoe.torch: {what} did not finish within {timeout:g} s")


def gather_rows(row: torch.Tensor, group: Any, timeout: float, what: str) -> torch.Tensor:
    """``[G, n]``: every rank's 1-D int64 ``row`` (the same length on every rank), rank order; one ``all_gather``
    with a deadline (none at all in a group of one)."""
    G = group_size(group)
    if G == 1:
        return row[None]
    if row.device.type == "cpu" and _cuda_only(group):  # e.g. Megatron's NCCL expert group: gathered on the GPU
        return gather_rows(row.to(torch.device("cuda", torch.cuda.current_device())), group, timeout, what).cpu()
    if _GATHER_INTO_TENSOR:  # one output tensor, no per-rank buffers and no stack (the same values)
        out = row.new_empty(G * row.numel())
        wait(dist.all_gather_into_tensor(out, row, group=group, async_op=True), timeout, what)
        return out.view(G, row.numel())
    parts = [torch.empty_like(row) for _ in range(G)]
    wait(dist.all_gather(parts, row, group=group, async_op=True), timeout, what)
    return torch.stack(parts)


def _cuda_only(group: Any) -> bool:
    """Whether ``group``'s backend takes CUDA tensors only (``nccl``; a ``"cpu:gloo,cuda:nccl"`` group takes both):
    the layer's small CPU collectives then travel as CUDA tensors on the current device."""
    try:
        backend = str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return False
    return "nccl" in backend and "gloo" not in backend


# ``all_gather_into_tensor`` with gloo needs torch >= 2 (torch 1.13's gloo raises "no support for _allgather_base").
_GATHER_INTO_TENSOR = hasattr(dist, "all_gather_into_tensor") and int(torch.__version__.split(".")[0]) >= 2


def gather_checked(values: Sequence[int], error: Optional[str], group: Any, timeout: float, what: str,
                   rejected: str) -> np.ndarray:
    """``[G, len(values)]`` int64: every rank's ``values``, gathered with whether its input was good, so that one
    bad rank fails every rank instead of leaving the others waiting in a later collective. ``error`` (this rank's
    message) makes this rank raise ``ValueError`` with it; every other rank raises ``ValueError`` with
    ``rejected`` formatted with ``rank``, the first rank that failed. Used wherever ranks check their own input
    before a collective that needs every rank's (counts, shapes, move status)."""
    row = torch.from_numpy(np.concatenate(([0 if error is None else 1], np.asarray(values, dtype=np.int64))))
    rows = gather_rows(row, group, timeout, what).numpy()
    if error is not None:
        raise ValueError(error) from None
    failed = np.flatnonzero(rows[:, 0])
    if failed.size:
        raise ValueError(rejected.format(rank=int(failed[0])))
    return np.ascontiguousarray(rows[:, 1:])


def local_counts(expert_ids: torch.Tensor, num_experts: int, who: str) -> np.ndarray:
    """``[E]`` int64 routed count of every expert in ``[T, K]`` ids (one C++ pass, read in place), raising
    ``ValueError`` naming the first id outside ``[-1, num_experts)`` and its token."""
    if not isinstance(expert_ids, torch.Tensor):
        raise ValueError(f"{who}: expert_ids must be a torch.Tensor, got {type(expert_ids).__name__}")
    if expert_ids.dim() != 2:
        raise ValueError(f"{who}: expert_ids must be [tokens, topk], got shape {list(expert_ids.shape)}")
    if expert_ids.device.type != "cpu":
        raise ValueError(f"{who}: expert_ids must be on the CPU on this path, got device {expert_ids.device}")
    if expert_ids.dtype not in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        raise ValueError(f"{who}: expert_ids must be an integer tensor, got dtype {expert_ids.dtype}")
    T, K = expert_ids.shape
    if K == 0:
        raise ValueError(f"{who}: expert_ids has top-k 0")
    try:
        totals, _ = _core.count_loads(expert_ids.reshape(T, 1, K), None, integer(num_experts, f"{who}: num_experts"),
                                      None, 0, None, None)
    except ValueError as e:  # the ids are [T, 1, K] here: drop the trace-layer index from the message
        raise ValueError(f"{who}: {str(e).replace('count_loads: ', '').replace(', layer 0, k ', ', k ')}") from None
    return np.asarray(totals).reshape(-1)


def gather_source_loads(
    expert_ids: Optional[torch.Tensor],
    num_experts: int,
    *,
    group: Any = None,
    flags: Sequence[int] = (),
    error: Optional[str] = None,
    timeout: float = DEFAULT_TIMEOUT,
    what: str = "gather_source_loads",
    counts: Optional[np.ndarray] = None,
) -> Tuple[np.ndarray, np.ndarray]:
    """Every rank's expert counts of its ``[T, K]`` ids as ``[E, G]`` int64 (expert, source rank), plus the
    ``[G, len(flags)]`` flags each rank contributed. One ``all_gather`` of ``E + 1 + len(flags)`` int64 per rank
    (:func:`gather_checked`).

    ``error`` (a message) marks this rank's input as bad: every rank then raises ``ValueError``, this one with
    the message, the others naming the rank, so no rank is left waiting in a later collective. ``counts``: this
    rank's ``[E]`` int64 counts when the caller has them already (made with the ids, e.g. by
    ``foremoe._core.routes_from_map``): the ids are then not counted again.
    """
    if error is not None or (counts is None and expert_ids is None):
        counts = np.zeros(num_experts, dtype=np.int64)
    elif counts is None:
        try:
            counts = local_counts(expert_ids, num_experts, f"{what}: rank {group_rank(group)}")
        except ValueError as e:
            error, counts = str(e), np.zeros(num_experts, dtype=np.int64)
    a = gather_checked(np.concatenate((counts, np.asarray(flags, dtype=np.int64))), error, group, timeout,
                       f"{what}: all_gather of expert counts",
                       f"{what}: rank {{rank}} of the group rejected its input (its error names the value)")
    return np.ascontiguousarray(a[:, :num_experts].T), np.ascontiguousarray(a[:, num_experts:])


@dataclass
class DispatchLayout:
    """Where every routed ``(token, k)`` of this rank goes for one layer and micro-step, and what comes back.

    Send side (``all_to_all_single``'s input): row ``i`` is route ``order[i]`` (flat ``token * K + k``) of token
    ``send_tokens[i]``, grouped by destination rank and, within it, by physical slot (token order inside a slot);
    ``input_splits[g]`` rows go to rank ``g``. Receive side: ``output_splits[s]`` rows come from rank ``s``;
    ``recv[recv_perm]`` groups them by local slot ``j`` (``slot_counts[j]`` rows each, sources in rank order).
    ``send_experts[i]`` is the logical expert of sent row ``i``; ``route_pos`` inverts ``order``: route
    ``t * K + k`` is sent row ``route_pos[t * K + k]`` (-1: no route), so the rows coming back are combined with a
    gather instead of a scatter.
    """

    rank: int
    world: int
    layer: int
    num_experts: int
    slots_per_rank: int
    slots: torch.Tensor  # [T, K] int32 physical slot of every route, -1 = no route
    order: torch.Tensor  # [N_send] int64
    send_tokens: torch.Tensor  # [N_send] int64
    input_splits: List[int]
    output_splits: List[int]
    recv_perm: torch.Tensor  # [N_recv] int64
    recv_inverse: torch.Tensor  # [N_recv] int64: grouped position of each received row
    slot_counts: List[int]  # [S] rows per local slot
    source_split: np.ndarray  # [P, G] tokens each physical slot takes from each source rank
    flags: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))  # [G, F] gathered flags
    send_experts: Optional[torch.Tensor] = None  # [N_send] int32 logical expert of each sent row
    route_pos: Optional[torch.Tensor] = None  # [T * K] int64 send position of each route, -1 = no route

    @property
    def num_send(self) -> int:
        return int(self.order.numel())

    @property
    def num_recv(self) -> int:
        return int(self.recv_perm.numel())


def check_plan(plan: Any, layer: int, world: int, who: str) -> None:
    """Raises ``ValueError`` unless ``plan`` is a :class:`foremoe.Plan` with layer ``layer`` for ``world`` ranks."""
    if not isinstance(plan, foremoe.Plan):
        raise ValueError(f"{who}: plan must be a foremoe.Plan, got {type(plan).__name__}")
    if not 0 <= integer(layer, f"{who}: layer") < plan.num_layers:
        raise ValueError(f"{who}: layer {layer} outside the plan's [0, {plan.num_layers}) MoE layers")
    if plan.num_gpus != world:
        raise ValueError(f"{who}: the plan is for {plan.num_gpus} ranks but the process group has {world}")


def local_layout(
    plan: "foremoe.Plan",
    layer: int,
    expert_ids: torch.Tensor,
    source_loads: Any,
    rank: int,
    *,
    flags: Optional[np.ndarray] = None,
) -> DispatchLayout:
    """The :class:`DispatchLayout` of rank ``rank`` from the ``[E, G]`` per-source loads of this layer and
    micro-step, without any collective (the same on every rank for the same inputs).

    Raises ``ValueError`` naming the expert when the loads disagree with the plan's split (a plan of another
    layer or micro-step) and naming the token when an id is out of range or the ids disagree with the loads.
    """
    who = "local_layout"
    G, S, E = plan.num_gpus, plan.slots, plan.num_experts
    check_plan(plan, layer, G, who)
    layer, rank = integer(layer, f"{who}: layer"), integer(rank, f"{who}: rank")
    d = None
    loads = source_loads
    if (isinstance(expert_ids, torch.Tensor) and expert_ids.dim() == 2 and 0 <= rank < G
            and type(loads) is np.ndarray and loads.dtype == np.int64 and loads.shape == (E, G)
            and loads.flags.c_contiguous):
        # One C++ call from the gathered counts to the layout; on any error the checked steps below name it.
        T, K = expert_ids.shape
        ids = expert_ids.reshape(T, 1, K)
        if ids.device.type == "cpu" and not ids.requires_grad:
            ids = ids.numpy()  # a numpy view reaches C++ faster than the tensor's DLPack export (same memory)
        try:
            d = plan.dispatch_loads(layer, ids, loads, rank)
            split = d["split"]
        except ValueError:
            d = None
    if d is None:
        d, split = _checked_layout(plan, layer, expert_ids, source_loads, rank)
    return DispatchLayout(
        rank=rank,
        world=G,
        layer=int(layer),
        num_experts=E,
        slots_per_rank=S,
        slots=torch.from_numpy(d["slots"]),
        order=torch.from_numpy(d["order"]),
        send_tokens=torch.from_numpy(d["send_tokens"]),
        input_splits=d["input_splits"].tolist(),
        output_splits=d["output_splits"].tolist(),
        recv_perm=torch.from_numpy(d["recv_perm"]),
        recv_inverse=torch.from_numpy(d["recv_inverse"]),
        slot_counts=d["slot_counts"].tolist(),
        source_split=split,
        flags=np.zeros((G, 0), np.int64) if flags is None else flags,
        send_experts=torch.from_numpy(d["send_experts"]),
        route_pos=torch.from_numpy(d["route_pos"]),
    )


def _checked_layout(plan: "foremoe.Plan", layer: int, expert_ids: Any, source_loads: Any,
                    rank: int) -> Tuple[dict, np.ndarray]:
    """:func:`local_layout`'s split and layout, each argument checked and every error named (``Plan.source_split``
    then ``Plan.dispatch``)."""
    who = "local_layout"
    G, E = plan.num_gpus, plan.num_experts
    if not 0 <= rank < G:
        raise ValueError(f"{who}: rank {rank} outside [0, {G})")
    if not isinstance(expert_ids, torch.Tensor) or expert_ids.dim() != 2:
        raise ValueError(f"{who}: expert_ids must be a [tokens, topk] torch.Tensor, got "
                         f"{list(getattr(expert_ids, 'shape', [])) or type(expert_ids).__name__}")
    loads = int_array(source_loads, f"{who}: source_loads", lo=0)  # a NaN is named here, not as a negative load
    if loads.shape != (E, G):
        raise ValueError(f"{who}: source_loads must be [experts, ranks] = [{E}, {G}], got {list(loads.shape)}")
    try:
        split = plan.source_split(int(layer), loads)  # [P, G]
    except ValueError as e:
        raise ValueError(f"{who}: plan layer {layer}: {e} (is this the plan of this layer and micro-step?)") from None
    T, K = expert_ids.shape
    try:
        d = plan.dispatch(int(layer), expert_ids.reshape(T, 1, K), split, int(rank))
    except ValueError as e:
        msg = str(e).replace("map_tokens: layer 0: ", "").replace(", layer 0, k ", ", k ")
        raise ValueError(f"{who}: rank {rank}, plan layer {layer}: {msg}") from None
    return d, split


def dispatch_layout(
    plan: "foremoe.Plan",
    layer: int,
    expert_ids: torch.Tensor,
    *,
    group: Any = None,
    source_loads: Any = None,
    flags: Sequence[int] = (),
    error: Optional[str] = None,
    timeout: float = DEFAULT_TIMEOUT,
    counts: Optional[np.ndarray] = None,
) -> DispatchLayout:
    """This rank's :class:`DispatchLayout` for ``expert_ids`` (``[T, K]`` logical ids, -1 = no route) under
    ``plan``'s layer ``layer``, over ``group`` (``None``: the default group; its size must be the plan's rank
    count). Without ``source_loads`` (``[E, G]``), one ``all_gather`` collects them; ``flags`` (small ints) ride
    along and come back as ``layout.flags`` ``[G, len(flags)]``.

    A bad input on any rank (an id out of range, a wrong shape) raises ``ValueError`` on every rank; ``error``
    (a message) reports a bad input the caller found on this rank the same way. ``counts``: this rank's ``[E]``
    int64 counts of ``expert_ids`` when the caller has them (:func:`gather_source_loads`).
    """
    who = "dispatch_layout"
    G = group_size(group)
    check_plan(plan, layer, G, who)
    rank = group_rank(group)
    if source_loads is not None and not flags and error is None:
        return local_layout(plan, layer, expert_ids, source_loads, rank)
    loads, got_flags = gather_source_loads(expert_ids, plan.num_experts, group=group, flags=flags, error=error,
                                           timeout=timeout, what=f"{who} (layer {layer})", counts=counts)
    if source_loads is not None:
        loads = source_loads
    return local_layout(plan, layer, expert_ids, loads, rank, flags=got_flags)


def _a2a(x: torch.Tensor, out_splits: List[int], in_splits: List[int], group: Any, timeout: float,
         what: str) -> torch.Tensor:
    x = x.contiguous()
    if x.shape[0] != sum(in_splits):
        raise ValueError(f"{what}: input has {x.shape[0]} rows, the split sizes {in_splits} sum to {sum(in_splits)}")
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    if group_size(group) == 1:
        out.copy_(x)
        return out
    work = dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)
    wait(work, timeout, what)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: List[int], in_splits: List[int], group: Any,
                timeout: float) -> torch.Tensor:
        ctx.args = (out_splits, in_splits, group, timeout)
        return _a2a(x, out_splits, in_splits, group, timeout, "all_to_all_single (forward)")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Any, ...]:
        out_splits, in_splits, group, timeout = ctx.args
        return _a2a(grad, in_splits, out_splits, group, timeout, "all_to_all_single (backward)"), None, None, None, None


def all_to_all(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], *, group: Any = None,
               timeout: float = DEFAULT_TIMEOUT) -> torch.Tensor:
    """``all_to_all_single`` of the rows of ``x`` with autograd (the backward sends the gradients back the same
    way) and a timeout on the wait."""
    return _AllToAll.apply(x, _splits(output_splits, "all_to_all: output_splits"),
                           _splits(input_splits, "all_to_all: input_splits"), group, float(timeout))


def _splits(sizes: Sequence[int], name: str) -> List[int]:
    """Split sizes as a new list of ints (a list of non-negative ints, such as a layout's, is copied as it is)."""
    if type(sizes) is list and all(type(n) is int and 0 <= n <= INT64_MAX for n in sizes):
        return list(sizes)
    return int_list(sizes, name, 0, INT64_MAX)
