"""The balanced MoE layer: expert slot storage, weight moves, dispatch, expert compute and gradient reduction.

Per MoE layer and rank, :class:`ExpertStorage` holds one contiguous tensor per weight kind, ``[slots, ...]``:
the rank's owned experts first (ascending expert id; these rows *are* the trainer's parameters, as views),
then the spare rows the plans' replicas go to (plain tensors: never parameters, never in a ``state_dict``,
never seen by an optimizer or DDP).

:func:`balanced_moe` (and the module :class:`BalancedMoE` around a plain experts module with weights
``[E, ...]``) runs one layer of one micro-step under that micro-step's :class:`foremoe.Plan`:

1. the per-rank expert counts are gathered (one small ``all_gather`` that also carries every rank's input
   check and whether its owner weights changed since the last sync);
2. replicas the plan wants and the rank does not hold (or holds stale) are copied from their owners, resident
   replicas are reused without a move. The moves run on the runtime's transfer engine (:mod:`foremoe.torch.mover`:
   every rank submits the same batch; CPU storage on its host backend, its paired transfers over the trainer's gloo
   group; CUDA storage on its CUDA backend, its paired transfers on an NCCL communicator of the engine's own made
   from a unique id sent over the trainer's group; the storages of a model share one engine per rank), and
   verification, retries, the fallback to the host mirror, the seeded fault injector, deadlines and telemetry are
   the engine's;
3. tokens go to physical slots with the plan's exact split (:mod:`foremoe.torch.distributed`), are exchanged
   with ``all_to_all_single`` and computed slot by slot on the local slots, then sent back and combined with the
   routing weights.

Moves are verified and can fall back to a host mirror: every received replica row comes with the sender's exact
checksum of its bytes (the engine's checksum in its transfer header); a row that is dropped, late, or fails its
checksum is copied from the host mirror (``mirror=True``: this rank's own copy;
``mirror="node"``: one copy per node in shared memory that the node's ranks map; refreshed by the trainer after
each optimizer step with :meth:`ExpertStorage.refresh_mirror`), and without a fresh mirror every rank
raises (a gathered flag): a wrong replica is never used. ``faults`` (a :class:`foremoe.FaultSchedule`) injects
faults into the received moves, replayably, for tests and drills.

:meth:`ExpertStorage.prefetch` (a collective) posts a layer's moves ahead of its call into staging buffers; the
call then waits for, verifies and installs them (bitwise the synchronous result). With ``double_buffer=True`` each
spare row has a second copy and a move writes the one the last call did not use, so micro-step ``m``'s replicas stay
intact through micro-step ``m + 1``'s forward.

The backward sends the gradients back the same way, and every replica's weight gradient is sent to the owner
and added to the owner's gradient (its ``.grad``, or whatever the trainer's gradient hooks accumulate into)
in a fixed order (owner's own first, then the replicas in ascending rank order) before autograd hands it on,
all or nothing: a failed or late transfer raises and no gradient of that layer reaches the parameters. The
transfer engine's reductions carry and add them (:class:`foremoe.torch.mover.GradReducer`, every rank agreeing over
the group whether they all landed).
With ``gradients="hold"`` (issue 30) a replica that later plans keep on its rank accumulates its gradient beside
its row and sends it once, in the backward of the first call whose plan drops it, or with ``gradients="flush"``
(the last micro-step before the optimizer step), in the same fixed order at the owner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import foremoe
from foremoe import _core
from foremoe._args import int_array, integer

from .distributed import DEFAULT_TIMEOUT, DispatchLayout, all_to_all, check_plan, dispatch_layout
from .distributed import gather_rows, gather_source_loads, group_rank, group_size, local_layout
from .moves import HostMirror, NodeMirror, resolve_local_world
from .mover import GRAD_DTYPES, EngineMover, GradReducer, check_cuda_engine, engine_rows, enroll

__all__ = [
    "BalancedMoE",
    "ExpertStorage",
    "MirrorStats",
    "SwiGLUExperts",
    "SyncStats",
    "balanced_moe",
    "contiguous_owners",
    "reference_moe",
]

ExpertFn = Callable[..., torch.Tensor]


def contiguous_owners(num_experts: int, world: int) -> np.ndarray:
    """Megatron's expert-parallel sharding: rank ``g`` owns experts ``[g * E / G, (g + 1) * E / G)``."""
    num_experts = integer(num_experts, "contiguous_owners: num_experts")
    world = integer(world, "contiguous_owners: world")
    if world <= 0 or num_experts % world:
        raise ValueError(f"contiguous_owners: {num_experts} experts do not split evenly over {world} ranks")
    return np.repeat(np.arange(world, dtype=np.int32), num_experts // world)


@dataclass
class SyncStats:
    """What one layer's replica sync did (the same numbers on every rank)."""

    moves: int  # replicas sent, all ranks
    bytes_moved: int  # their bytes, all ranks
    reused: int  # replicas the plan wants that were already resident and current
    refreshed_owners: Tuple[int, ...]  # ranks whose owner weights changed since the last sync
    # All ranks. faults: received moves that needed another copy (a copy failed or did not verify and was
    # retried); verify_failures:
    # received copies whose checksum did not match; fallbacks: moves that landed from the receiver's host mirror
    # after a failed copy.
    faults: int = 0
    verify_failures: int = 0
    fallbacks: int = 0
    prefetched: int = 0  # moves of this sync posted ahead by ExpertStorage.prefetch, all ranks


@dataclass
class MirrorStats:
    """This rank's view of its layer's host mirror (:meth:`ExpertStorage.mirror_stats`)."""

    mode: str  # "none", "rank" (mirror=True: one copy per rank) or "node" (mirror="node": one copy per node)
    local_world: int  # ranks per node
    node: int  # this rank's node (rank // local_world)
    payload_bytes: int  # one copy of the mirror: every expert's weights of the layer (0 without a mirror)
    bytes_per_node: int  # host memory the node pays for this layer's mirror: payload x local_world per rank, or
    #                      one shared segment per node (a header page plus the payload in whole pages)
    pinned: bool  # page-locked for the GPUs' copy engines
    stale: bool  # older than this rank's owner weights, or (node) not at this rank's last refresh generation
    generation: Optional[int] = None  # node: the segment's refresh generation (even: consistent, odd: being written)


_MIRROR_MODES = (False, True, "rank", "node")


class ExpertStorage:
    """One MoE layer's expert slots on this rank (see the module docstring).

    Args:
        weights: this rank's owned experts, ``{kind: [n_owned, ...]}`` (ascending expert id), any float dtype.
        owners: ``[E]`` owner rank of every expert (the same on every rank).
        slots: rows per weight kind (the plans' slots per rank): owned experts plus spare replica rows.
        rank, world: this rank and the group size.
        mirror: keep a host mirror of all experts' weights of the layer, gathered here from the owners over
            ``group`` (every rank constructs at once); failed moves fall back to it. ``True`` (or ``"rank"``): one
            copy per rank (:class:`foremoe.torch.moves.HostMirror`; pinned when the weights are on CUDA;
            :meth:`from_full` fills it without a collective), so a node pays the layer's weights once per local
            rank. ``"node"``: one copy per node in shared memory that every local rank maps
            (:class:`foremoe.torch.moves.NodeMirror`; pinned with ``cudaHostRegister`` on GPUs); constructing and
            refreshing it are collectives over ``group`` also with :meth:`from_full`, where each local rank writes
            a share of the experts. Call :meth:`refresh_mirror` after each optimizer step: a mirror older than
            the owner weights is an error at the next sync, never used. :meth:`mirror_stats` reports the host
            memory per node.
        local_world: ranks per node, for ``mirror="node"`` and the memory figures; default: the environment
            variable ``LOCAL_WORLD_SIZE`` (set by ``torchrun``) when there is a mirror, else 1. It must divide
            ``world``; node ``n`` holds the group's ranks ``[n * local_world, (n + 1) * local_world)``.
        verify: send an exact checksum with every replica move and check it on arrival (default on).
        faults: a :class:`foremoe.FaultSchedule`, the runtime's seeded fault injector, the transfer engine's
            (``fail_probability``, ``corrupt_probability``, ``delay_probability``/``delay_us`` act on its copies and
            paired transfers, keyed by the batch's transfers; never on the replica gradients). Assigning
            ``storage.faults`` or ``storage.verify`` later takes effect at the next sync on every rank.
        double_buffer: two storage rows per spare row (``slots + spare`` rows per weight kind): a move always
            writes the copy the last sync did not use, so micro-step ``m``'s replica rows stay intact while
            micro-step ``m + 1``'s land and run (its forward may come before ``m``'s backward, as in pipeline
            schedules). The bookkeeping, the moves and the numbers are those of the single buffer; without it a
            backward after a later micro-step rewrote one of its rows raises. Either way :meth:`prefetch` stages the
            received rows and installs them at the call.
    """

    def __init__(self, weights: Mapping[str, torch.Tensor], owners: Any, slots: int, *, rank: int, world: int,
                 mirror: Any = False, group: Any = None, verify: bool = True, faults: Any = None,
                 double_buffer: bool = False, timeout: float = DEFAULT_TIMEOUT, local_world: Optional[int] = None,
                 _full: Optional[Mapping[str, torch.Tensor]] = None):
        own = int_array(owners, "ExpertStorage: owners", dtype=np.int32)  # an owner past int32 never wraps
        slots, rank, world = (integer(v, f"ExpertStorage: {k}") for k, v in
                              (("slots", slots), ("rank", rank), ("world", world)))
        if own.ndim != 1 or own.size == 0:
            raise ValueError(f"ExpertStorage: owners must be [experts], got shape {list(own.shape)}")
        if own.min() < 0 or own.max() >= world:
            bad = int(np.flatnonzero((own < 0) | (own >= world))[0])
            raise ValueError(f"ExpertStorage: expert {bad} has owner rank {int(own[bad])}, outside [0, {world})")
        if not 0 <= rank < world:
            raise ValueError(f"ExpertStorage: rank {rank} outside [0, {world})")
        if not any(mirror is m or (isinstance(m, str) and mirror == m) for m in _MIRROR_MODES):
            raise ValueError(f"ExpertStorage: mirror must be False, True (one per rank), 'rank' or 'node' (one per "
                             f"node), got {mirror!r}")
        self.local_world = resolve_local_world(local_world, world, mirror)
        self.num_experts = int(own.size)
        self.rank, self.world, self.slots = int(rank), int(world), int(slots)
        if not 0 < self.slots <= self.num_experts:  # before any [world, slots] table or [slots, ...] buffer exists
            raise ValueError(f"ExpertStorage: slots {slots} must be in [1, {self.num_experts}]: a rank holds distinct "
                             f"experts, at most the {self.num_experts} there are")
        self.owners = own
        self._owners_bytes = own.tobytes()  # check_plan compares a plan's [E] int32 owners with these bytes
        self._owner_of = np.append(own, -1)  # indexed by a placement: an empty slot (-1) has owner -1
        self._ranks = np.arange(world)[:, None]
        self.owned = [np.flatnonzero(own == g).astype(np.int64) for g in range(world)]
        self.own_row = np.zeros(self.num_experts, dtype=np.int64)
        for g in range(world):
            self.own_row[self.owned[g]] = np.arange(self.owned[g].size)
        busiest = int(max(o.size for o in self.owned))
        if busiest > slots:
            g = int(np.argmax([o.size for o in self.owned]))
            raise ValueError(f"ExpertStorage: rank {g} owns {busiest} experts but has only {slots} slots")
        n_own = int(self.owned[rank].size)
        self.double_buffer = bool(double_buffer)
        # With double buffers every spare row r has a second copy r + spare; `copy[g, r]` is the one holding rank
        # g's replica (tracked for every rank alike: the engine's batch names every rank's destination rows).
        self.spare = self.slots - n_own
        self.num_owned_by = np.array([o.size for o in self.owned], dtype=np.int64)
        self._copy_all = np.zeros((world, self.slots), dtype=np.int64)
        self.copy = self._copy_all[rank]
        rows_total = self.slots + (self.spare if self.double_buffer else 0)
        if not weights:
            raise ValueError("ExpertStorage: no weights")
        devices = {str(w.device) for w in weights.values() if isinstance(w, torch.Tensor)}
        if len(devices) > 1:
            raise ValueError(f"ExpertStorage: the weight kinds lie on different devices ({sorted(devices)}); the "
                             f"transfer engine moves rows of one device")
        dtypes = {w.dtype for w in weights.values() if isinstance(w, torch.Tensor) and w.is_floating_point()}
        if len(dtypes) > 1 or not dtypes <= set(GRAD_DTYPES):
            raise ValueError(f"ExpertStorage: the weight kinds must share one dtype among float32, float64, bfloat16 "
                             f"and float16 (the transfer engine adds the replica gradients in it), got "
                             f"{sorted(str(d) for d in dtypes)}")
        if devices and next(iter(devices)).startswith("cuda"):
            check_cuda_engine(self.world)
        self._engine_rows, self._stage0 = engine_rows(self.slots, self.num_owned_by, self.double_buffer)
        alloc_rows = self._engine_rows
        self._mover: Optional[EngineMover] = None
        self._reducer: Optional[GradReducer] = None  # replica gradient reductions on the engine (made at first use)
        self.engine_reductions = 0  # reductions this storage ran on the engine so far (the same on every rank)
        self.reduction_retries = 0  # replica-gradient reductions run again after a checksum mismatch (every rank)
        self._alloc: Dict[str, torch.Tensor] = {}
        self.names: Tuple[str, ...] = tuple(weights)
        self.storage: Dict[str, torch.Tensor] = {}
        self.params: Dict[str, nn.Parameter] = {}
        for name, w in weights.items():
            if not isinstance(w, torch.Tensor) or not w.is_floating_point():
                raise ValueError(f"ExpertStorage: weight {name!r} must be a float tensor")
            if w.dim() < 1 or w.shape[0] != n_own:
                raise ValueError(f"ExpertStorage: weight {name!r} is {list(w.shape)}, expected [{n_own}, ...] "
                                 f"(the {n_own} experts rank {rank} owns)")
            buf = torch.zeros((alloc_rows,) + tuple(w.shape[1:]), dtype=w.dtype, device=w.device)
            with torch.no_grad():
                buf[:n_own].copy_(w.detach())
            self._alloc[name] = buf
            self.storage[name] = buf[:rows_total]
            self.params[name] = nn.Parameter(buf[:n_own])
        self.expert_bytes = sum(int(t[0].numel()) * t.element_size() for t in self.storage.values())
        # Storage rows of every rank, tracked identically on every rank: the expert of each replica row, -1 for a
        # free row (and for the owner rows, which hold the owned experts in `owned` order).
        self.resident_rows = np.full((world, self.slots), -1, dtype=np.int64)
        self.row_generation = np.zeros(rows_total, dtype=np.int64)  # bumped when a row of this rank is rewritten
        self._bound: List[Tuple[nn.Parameter, torch.Tensor]] = []  # (trainer parameter, its view): _bind
        self._bound_ptrs: List[int] = []
        self._bound_shapes: List[torch.Size] = []
        self._bound_rows: List[Tuple[str, int]] = []  # (kind, owner row) of every bound parameter's view
        # Copy-bound parameters (bind_*(copy=True), rebind_copies): the parameter keeps its own .data (e.g. a
        # segment of a distributed optimizer's parameter buffer) and its rows hold a copy, refreshed by
        # refresh_copies() when mark_copies_stale() (an optimizer step) or invalidate() was called or its version
        # moved since the last copy.
        self._bound_copy: List[bool] = []
        self.copy_bound = False  # any(self._bound_copy), kept by _rebound
        self._copies_stale = False
        self._copy_versions: List[int] = []
        self._checked: Optional[Tuple[Any, int, np.ndarray]] = None  # check_plan's last (plan, layer, placement)
        # Per-call work remembered across calls with the same layer plan (_layer_key: the last plan's key; the
        # held-gradient schedule's replicas; bookkeep's last fixed point (key, tracked rows, result)).
        self._key_memo: Optional[Tuple[Any, int, Tuple[int, bytes, bytes], np.ndarray]] = None
        self._replicas_memo: Optional[Tuple[Any, ...]] = None
        self._book_memo: Optional[Tuple[Any, ...]] = None
        self._row_views: Optional[List[List[torch.Tensor]]] = None
        self._versions = self._param_versions()
        self._ptrs = self._param_ptrs()
        self._invalid = False
        self.last_sync: Optional[SyncStats] = None
        self.verify, self.faults = bool(verify), faults
        self.num_syncs = 0  # syncs so far (the same on every rank): the fault injector's micro-step key
        self._pending: Optional[Dict[str, Any]] = None  # moves posted by prefetch(), installed at the next sync
        # Held replica gradients (``balanced_moe(..., gradients="hold")``): on every rank the same table of
        # (holder rank, expert) -> owner of the gradients held now, and on this rank the held tensors per expert.
        self._held: Dict[Tuple[int, int], int] = {}
        self._held_grads: Dict[int, List[torch.Tensor]] = {}
        self.mirror: Optional[HostMirror] = None
        if mirror == "node":
            self.mirror = NodeMirror(self, self.local_world, group, timeout)
        elif mirror:
            self.mirror = HostMirror(self, self.local_world)
        if self.mirror is not None and _full is not None:
            self.mirror.fill(_full, self, group, timeout)
        elif self.mirror is not None:
            self.mirror.refresh(self, group, timeout)
        self._share = enroll(self)  # its serial among storages like it: which engine it shares (foremoe.torch.mover)

    @classmethod
    def from_full(cls, weights: Mapping[str, torch.Tensor], owners: Any, slots: int, *, rank: int,
                  world: int, mirror: Any = False, **options: Any) -> "ExpertStorage":
        """Storage from the weights of all experts ``{kind: [E, ...]}``: this rank keeps its owned rows (and, with
        ``mirror``, all of them in its host mirror: without a collective for a per-rank mirror; with
        ``mirror="node"`` each local rank writes its share, a collective over ``group``). ``options``: the
        constructor's."""
        own = int_array(owners, "ExpertStorage: owners", dtype=np.int32)
        rank = integer(rank, "ExpertStorage: rank")
        mine = torch.from_numpy(np.flatnonzero(own == rank).astype(np.int64))
        picked = {}
        for name, w in weights.items():
            if w.dim() < 1 or w.shape[0] != own.size:
                raise ValueError(f"ExpertStorage: weight {name!r} is {list(w.shape)}, expected [{own.size}, ...]")
            picked[name] = w.detach().index_select(0, mine.to(w.device))
        return cls(picked, owners, slots, rank=rank, world=world, mirror=mirror, _full=weights, **options)

    # -- views ----------------------------------------------------------------------------------------------

    @property
    def num_owned(self) -> int:
        return int(self.owned[self.rank].size)

    @property
    def owned_experts(self) -> List[int]:
        """The experts this rank owns, in row order."""
        return [int(e) for e in self.owned[self.rank]]

    @property
    def engine_backend(self) -> str:
        """The transfer engine backend that moves this storage's rows and reduces its replica gradients (the one
        mover): ``"host"`` for CPU rows, ``"cuda"`` for CUDA rows."""
        return "cuda" if self._alloc[self.names[0]].device.type == "cuda" else "host"

    def replicas(self, name: str) -> torch.Tensor:
        """The spare replica rows of weight kind ``name`` (a view, not a parameter)."""
        return self.storage[name][self.num_owned:]

    def _views(self) -> List[List[torch.Tensor]]:
        """Every storage row of every weight kind as a view, ``[kind][row]`` (made once: the storage tensors are
        only ever written in place)."""
        if self._row_views is None:
            self._row_views = [list(self.storage[n].unbind(0)) for n in self.names]
        return self._row_views

    def replica_experts(self) -> Dict[int, int]:
        """Replicas resident on this rank: expert -> storage row."""
        rows = np.flatnonzero(self.resident_rows[self.rank] >= 0)
        return {int(self.resident_rows[self.rank, r]): int(self._physical(np.array([r]))[0]) for r in rows}

    def _physical(self, rows: np.ndarray) -> np.ndarray:
        """Storage rows of this rank's bookkeeping rows (the same without double buffers)."""
        rows = np.asarray(rows, dtype=np.int64)
        if not self.double_buffer:
            return rows
        spare = (rows >= self.num_owned) & (rows >= 0)
        return np.where(spare, rows + self.spare * self.copy[np.clip(rows, 0, self.slots - 1)], rows)

    # -- staleness --------------------------------------------------------------------------------------------

    def _param_versions(self) -> List[int]:
        return [int(p._version) for p in self.params.values()] + [int(p._version) for p, _ in self._bound]

    def _param_ptrs(self) -> List[int]:
        return [int(p.data_ptr()) for p in self.params.values()]

    def bind_parameters(self, params: Mapping[str, Sequence[nn.Parameter]], *, copy: bool = False) -> None:
        """Makes a trainer's own per-expert parameters the owner rows: ``params[name][i]`` (the ``i``-th owned
        expert's weight of kind ``name``, shaped like one row) gets the storage row as its ``.data``, keeping the
        parameter object (and whatever the trainer attached to it). Their in-place updates count as owner weight
        changes (:meth:`owners_changed`), and :meth:`check_aliasing` checks that they still share the rows.
        Copies their current values into the rows first. Raises ``ValueError`` naming the parameter (and binds
        nothing) for an unknown kind, a wrong count, shape, dtype or device, or a parameter or row bound twice.

        ``copy=True``: the parameters keep their own ``.data`` (a segment of a trainer's flat parameter buffer, e.g.
        Megatron's ``DistributedDataParallel`` with the distributed optimizer, whose optimizer writes the buffer)
        and the rows hold a copy of their values, refreshed by :meth:`refresh_copies` (see there)."""
        who = "ExpertStorage.bind_parameters"
        targets = []
        for name, ps in params.items():
            self._check_kind(who, name)
            if isinstance(ps, torch.Tensor):
                raise ValueError(f"{who}: {name!r} is one tensor {list(ps.shape)}, expected a list of the "
                                 f"{self.num_owned} owned experts' parameters (a fused parameter: bind_fused)")
            if len(ps) != self.num_owned:
                raise ValueError(f"{who}: {len(ps)} parameters of {name!r} for the {self.num_owned} experts rank "
                                 f"{self.rank} owns")
            for i, p in enumerate(ps):
                row = self.storage[name][i]
                if not isinstance(p, torch.Tensor):
                    raise ValueError(f"{who}: parameter {i} of {name!r} must be a tensor (a torch.nn.Parameter), "
                                     f"got {type(p).__name__}")
                if tuple(p.shape) != tuple(row.shape):
                    raise ValueError(f"{who}: parameter {i} of {name!r} is {list(p.shape)} {p.dtype}, a row is "
                                     f"{list(row.shape)} {row.dtype}")
                targets.append((f"parameter {i} of {name!r}", p, row, (name, i, i + 1)))
        self._bind(who, targets, copy)

    def bind_fused(self, params: Mapping[str, nn.Parameter], *, copy: bool = False) -> None:
        """Makes a trainer's fused parameter of each weight kind (all owned experts in one tensor of
        ``num_owned * row.numel()`` elements, any shape, contiguous, expert ``i``'s weight the ``i``-th contiguous
        block: e.g. Megatron's ``GroupedMLP`` ``weight1`` ``[H, n F1]`` for rows ``[H, F1]``) a view of that kind's
        owner rows ``[0, num_owned)``, keeping the parameter object and its shape. Otherwise as
        :meth:`bind_parameters` (values copied into the rows first; in-place updates tracked; a replaced ``.data``
        is an error at the next call; ``ValueError`` naming the parameter for an unknown kind, a wrong element
        count, dtype or device, a non-contiguous parameter, or a parameter or row bound twice; ``copy``: as there)."""
        who = "ExpertStorage.bind_fused"
        targets = []
        for name, p in params.items():
            self._check_kind(who, name)
            rows = self.storage[name][:self.num_owned]
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"{who}: {name!r} must be one fused parameter (a tensor), got {type(p).__name__}"
                                 f" (per-expert parameters: bind_parameters)")
            if p.numel() != rows.numel():
                raise ValueError(f"{who}: parameter {name!r} is {list(p.shape)} ({p.numel()} elements), its "
                                 f"{self.num_owned} owner rows {list(rows.shape)} ({rows.numel()} elements)")
            if not p.is_contiguous():
                raise ValueError(f"{who}: parameter {name!r} {list(p.shape)} is not contiguous (expert i must be "
                                 f"its i-th contiguous block)")
            targets.append((f"parameter {name!r}", p, rows.view(p.shape), (name, 0, self.num_owned)))
        self._bind(who, targets, copy)

    def _check_kind(self, who: str, name: str) -> None:
        if name not in self.storage:
            raise ValueError(f"{who}: no weight kind {name!r} (kinds: {list(self.names)})")

    def _bind(self, who: str, targets: Sequence[Tuple[str, Any, torch.Tensor, Tuple[str, int, int]]],
              copy: bool = False) -> None:
        """The one binding of :meth:`bind_parameters` and :meth:`bind_fused`: ``targets`` are (label, parameter,
        its view of the storage, (kind, first row, end row)). Checks them all (dtype, device, each parameter and
        row bound once), then copies each parameter's values into its view, makes the view its ``.data`` and
        records it for :meth:`check_aliasing` and :meth:`owners_changed` (``copy``: the parameter keeps its
        ``.data``; :meth:`refresh_copies` copies it again)."""
        if not isinstance(copy, bool):
            raise ValueError(f"{who}: copy must be True or False, got {copy!r}")
        seen = {id(p) for p, _ in self._bound}
        taken = set(self._bound_rows)
        for label, p, view, (name, lo, hi) in targets:
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"{who}: {label} must be a tensor (a torch.nn.Parameter), got {type(p).__name__}")
            if p.dtype != view.dtype:
                raise ValueError(f"{who}: {label} is {p.dtype}, the storage of {name!r} {view.dtype}")
            if p.device != view.device:
                raise ValueError(f"{who}: {label} is on {p.device}, the storage of {name!r} on {view.device}")
            if id(p) in seen:
                raise ValueError(f"{who}: {label} is bound twice (a parameter aliases one place of the storage)")
            rows = {(name, r) for r in range(lo, hi)}
            if rows & taken:
                r = min(r for _, r in rows & taken)
                raise ValueError(f"{who}: {label}: owner row {r} of {name!r} is already bound to another parameter")
            seen.add(id(p))
            taken |= rows
        with torch.no_grad():
            for _, p, view, _ in targets:
                view.copy_(p.detach())
                if not copy:
                    p.data = view
        self._bound.extend((p, view) for _, p, view, _ in targets)
        self._bound_copy.extend([copy] * len(targets))
        self._bound_rows.extend(r for _, _, _, (name, lo, hi) in targets for r in ((name, i) for i in range(lo, hi)))
        self._rebound()

    def _rebound(self) -> None:
        """What :meth:`check_aliasing` compares with: every bound parameter's storage address and shape now (its
        view's for an aliasing one, its own buffer's for a copy-bound one)."""
        self._bound_ptrs = [int(p.data_ptr()) for p, _ in self._bound]
        self._bound_shapes = [p.shape for p, _ in self._bound]
        self.copy_bound = any(self._bound_copy)  # whether any bound parameter is copy-bound (refresh_copies)
        self._copy_versions = self._copied_versions()
        self._versions = self._param_versions()

    def _copied_versions(self) -> List[int]:
        return [int(p._version) for (p, _), c in zip(self._bound, self._bound_copy) if c]

    def rebind_copies(self, params: Sequence[torch.Tensor]) -> None:
        """Makes bound parameters whose ``.data`` a trainer replaced since they were bound (e.g. Megatron's
        ``DistributedDataParallel`` with the distributed optimizer, which gives every parameter a segment of its
        parameter buffer) copy-bound: each keeps its new ``.data``, its values are copied into its rows now and by
        :meth:`refresh_copies` later. Raises ``ValueError`` (and changes nothing) for a parameter that is not bound
        here or whose shape, dtype or device no longer match its rows."""
        who = "ExpertStorage.rebind_copies"
        index = {id(p): i for i, (p, _) in enumerate(self._bound)}
        for p in params:
            i = index.get(id(p))
            if i is None:
                raise ValueError(f"{who}: a parameter {list(getattr(p, 'shape', []))} is not bound to this storage")
            view = self._bound[i][1]
            if p.shape != view.shape or p.dtype != view.dtype or p.device != view.device:
                raise ValueError(f"{who}: a bound parameter is now {list(p.shape)} {p.dtype} on {p.device}, its "
                                 f"rows {list(view.shape)} {view.dtype} on {view.device}")
        with torch.no_grad():
            for p in params:
                i = index[id(p)]
                self._bound[i][1].copy_(p.detach())
                self._bound_copy[i] = True
        self._rebound()
        self.invalidate()  # replicas re-sent, mirror stale: the rows were rewritten
        self._copies_stale = False

    def mark_copies_stale(self) -> None:
        """Notes that copy-bound parameters may have changed without their version moving (an optimizer that
        writes them through a buffer): the next :meth:`refresh_copies` copies them. Cheap (a flag), safe to call
        after any optimizer step."""
        if self.copy_bound:
            self._copies_stale = True

    def refresh_copies(self) -> bool:
        """Copies every copy-bound parameter into its rows when :meth:`mark_copies_stale` or :meth:`invalidate`
        was called or a parameter's version moved since the last copy; returns whether it copied. A copy makes
        the owner weights changed (replicas re-sent at the next sync) and the host mirror stale (refresh it on
        every rank). Local: no collective. :func:`balanced_moe`, :meth:`prefetch` and :meth:`refresh_mirror` call it
        first (they read the rows), as does :mod:`foremoe.megatron`'s layer call."""
        if not self.copy_bound:
            return False
        self.check_aliasing()  # a copy-bound parameter's .data replaced again: ValueError, not a copy of another tensor
        versions = self._copied_versions()
        if not self._copies_stale and versions == self._copy_versions:
            return False
        with torch.no_grad():
            for (p, view), c in zip(self._bound, self._bound_copy):
                if c:
                    view.copy_(p.detach())
        self._copies_stale = False
        self._copy_versions = versions
        self._invalid = True
        if self.mirror is not None:
            self.mirror.invalid = True
        return True

    def invalidate(self) -> None:
        """Marks this rank's owner weights as changed: every replica of them is re-sent at the next sync. Only
        needed when the weights change without an in-place update of the parameters (``p.data = ...``,
        a load through ``.data``); the optimizer's in-place steps are detected on their own. Copy-bound parameters
        are copied into their rows again at the next :meth:`refresh_copies`."""
        self._invalid = True
        self._copies_stale = self.copy_bound
        if self.mirror is not None:
            self.mirror.invalid = True

    def mirror_stats(self) -> MirrorStats:
        """The host mirror's mode, memory per node (:class:`MirrorStats`) and freshness on this rank."""
        m = self.mirror
        if m is None:
            return MirrorStats("none", self.local_world, self.rank // self.local_world, 0, 0, False, False)
        return MirrorStats(m.mode, self.local_world, self.rank // self.local_world, m.payload_bytes,
                           m.bytes_per_node, m.pinned, self.mirror_stale(), m.generation())

    def mirror_stale(self) -> bool:
        """Whether this rank has a host mirror older than its owner weights (False without a mirror)."""
        return self.mirror is not None and self.mirror.stale(self)

    def refresh_mirror(self, group: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Refreshes the host mirror from every owner's current weights (every rank of ``group`` calls it, after
        each optimizer step): :meth:`moves.HostMirror.refresh`, about the layer's whole weights received per rank;
        with ``mirror="node"`` each local rank receives and writes only its share of the node's mirror, then a
        barrier over ``group`` and the segment's generation moves on (:meth:`moves.NodeMirror.refresh`).
        Copy-bound owner rows are refreshed first (:meth:`refresh_copies`)."""
        if self.mirror is None:
            raise ValueError("refresh_mirror: this ExpertStorage has no host mirror (construct it with mirror=True or "
                             "mirror='node')")
        self.refresh_copies()  # copy-bound owner rows first: the mirror is taken from the rows
        self.mirror.refresh(self, group, timeout)

    def check_mirrors(self, stale: Sequence[int]) -> None:
        """Raises ``RuntimeError`` when ``stale`` (ranks whose host mirror is older than their owner weights,
        gathered so that every rank raises together) is not empty."""
        if len(stale):
            raise RuntimeError(f"foremoe.torch: the host mirror of rank(s) {list(stale)} is older than the owner "
                               f"weights (an optimizer step without refresh_mirror()): call refresh_mirror() on "
                               f"every rank after each optimizer step")

    def check_aliasing(self) -> None:
        """Raises when an owner parameter no longer shares the slot storage (its ``.data`` was replaced)."""
        for (name, p), ptr in zip(self.params.items(), self._ptrs):
            if int(p.data_ptr()) != ptr or p.shape[0] != self.num_owned:
                raise ValueError(f"ExpertStorage: owner parameter {name!r} no longer aliases the slot storage "
                                 f"(its .data was replaced); update it in place instead")
        if [p.data_ptr() for p, _ in self._bound] == self._bound_ptrs and \
                [p.shape for p, _ in self._bound] == self._bound_shapes:
            return
        for (p, row), copied, ptr, shape in zip(self._bound, self._bound_copy, self._bound_ptrs, self._bound_shapes):
            if copied and (int(p.data_ptr()) != ptr or p.shape != shape):
                raise ValueError("ExpertStorage: a copy-bound trainer parameter's .data was replaced since it was "
                                 "bound (its rows would copy another tensor than the one bound); bind it again")
            if not copied and (int(p.data_ptr()) != int(row.data_ptr()) or p.shape != row.shape):
                raise ValueError("ExpertStorage: a bound trainer parameter no longer aliases its slot storage row "
                                 "(its .data was replaced, e.g. by a distributed optimizer's parameter buffer); "
                                 "update it in place instead, or make it copy-bound (rebind_copies)")

    def owners_changed(self) -> bool:
        """Whether this rank's owner weights changed since the last sync (in-place updates or :meth:`invalidate`)."""
        return self._invalid or self._param_versions() != self._versions

    # -- plan checks and sync -----------------------------------------------------------------------------------

    def owner_plan(self, loads: Any) -> "foremoe.Plan":
        """The one-layer plan of plain expert parallelism for ``[E]`` loads: owners only, no replica."""
        if getattr(self, "_owner_planner", None) is None:
            topo = foremoe.Topology(1, self.world, self.slots)
            self._owner_planner = foremoe.Planner(topo, move_budget=0, threads=1)
        return self._owner_planner.plan(int_array(loads, "owner_plan: loads")[None], owners=self.owners)

    def check_plan(self, plan: "foremoe.Plan", layer: int) -> np.ndarray:
        """Checks that ``plan``'s layer ``layer`` fits this storage (ranks, slots, experts, owners; that it keeps
        every owned expert on its owner is checked by :meth:`bookkeep`); returns its ``[G, S]`` placement.
        The plan checked last is remembered (a plan is immutable): checking it again costs nothing."""
        memo = self._checked
        if memo is not None and memo[0] is plan and type(layer) is int and memo[1] == layer:
            return memo[2]
        if plan.num_gpus != self.world:
            raise ValueError(f"ExpertStorage: the plan is for {plan.num_gpus} ranks, the storage for {self.world}")
        if plan.slots != self.slots:
            raise ValueError(f"ExpertStorage: the plan has {plan.slots} slots per rank, the storage {self.slots}")
        if plan.num_experts != self.num_experts:
            raise ValueError(f"ExpertStorage: the plan has {plan.num_experts} experts, the storage "
                             f"{self.num_experts}")
        layer = integer(layer, "ExpertStorage: plan layer", 0, plan.num_layers - 1)  # -1 would be the last one
        owner = plan.owner_gpu[layer]
        if owner.tobytes() != self._owners_bytes:  # both [E] int32
            e = int(np.flatnonzero(owner != self.owners)[0])
            raise ValueError(f"ExpertStorage: plan layer {layer} makes GPU {int(owner[e])} the owner of expert {e}, "
                             f"the storage rank {int(self.owners[e])} (plan with owners=... the trainer's "
                             f"sharding)")
        placement = self._placement(plan, layer)
        self._checked = (plan, layer, placement)
        return placement

    def bookkeep(self, plan: "foremoe.Plan", layer: int, changed: Sequence[int]) -> Dict[str, Any]:
        """The bookkeeping of :meth:`sync` without the transfers (C++, the same on every rank): updates the
        tracked rows of every rank to the plan's replicas and returns ``moves`` (count), ``my_moves`` ``[n, 5]``
        (tag, expert, source, destination, row) naming this rank, ``reused``, ``rows`` ``[S]`` (storage row of
        each of this rank's plan slots, -1 empty) and ``grads`` ``[m, 4]`` (expert, holder, holder row, tag) of
        the replica gradient transfers naming this rank. A replica is reused when its rank holds it already and
        its owner is not in ``changed`` (ranks whose owner weights changed since the last sync)."""
        memo, self._book_memo = self._book_memo, None
        if (memo is not None and not len(changed) and type(layer) is int and isinstance(plan, foremoe.Plan)
                and 0 <= layer < plan.num_layers
                and memo[0] == self._layer_key(plan, layer) and np.array_equal(memo[1], self.resident_rows)):
            # The same placement and used replicas again (the micro-step's other passes over the layer, or a later
            # micro-step keeping its replicas), the tracked rows where that call left them and no owner changed:
            # the bookkeeping is a function of those alone (its owners are the storage's, check_plan).
            self._book_memo = memo
            return memo[2]
        flags = np.zeros(self.world, dtype=np.uint8)
        flags[int_array(list(changed), "bookkeep: changed", lo=0, hi=self.world - 1)] = 1
        before = self.resident_rows.copy()
        out = _core.replica_sync(plan, integer(layer, "bookkeep: layer"), self.owners, self.resident_rows, flags,
                                 self.rank)
        fixed = int(out["moves"]) == 0 and not flags.any() and np.array_equal(before, self.resident_rows)
        if self.double_buffer:  # a move goes to the other copy of its row: the one in use stays intact
            out = {k: np.array(v) if isinstance(v, np.ndarray) else v for k, v in out.items()}
            every = out["all_moves"]
            self._copy_all[every[:, 2], every[:, 3]] ^= 1  # every move's row is distinct: one flip each
            spare_of = self.slots - self.num_owned_by
            every[:, 3] += spare_of[every[:, 2]] * self._copy_all[every[:, 2], every[:, 3]]
            mine = out["my_moves"][:, 3] == self.rank
            out["my_moves"][mine, 4] = self._physical(out["my_moves"][mine, 4])
            out["rows"] = self._physical(out["rows"])
            held = out["grads"][:, 1] == self.rank
            out["grads"][held, 2] = self._physical(out["grads"][held, 2])
        out["changed"] = tuple(int(g) for g in np.flatnonzero(flags))
        if fixed:  # nothing moved and no row was freed: the same call again returns this
            self._book_memo = (self._layer_key(plan, int(layer)), before, out)
        return out

    def _layer_key(self, plan: "foremoe.Plan", layer: int) -> Tuple[int, bytes, bytes]:
        """What the bookkeeping and the held-gradient schedule read of ``plan``'s layer ``layer`` (a valid index):
        the layer, its placement and which slots take tokens, as bytes; remembered for the last (plan, layer)."""
        return self._layer_memo(plan, layer)[2]

    def _placement(self, plan: "foremoe.Plan", layer: int) -> np.ndarray:
        """``plan``'s ``[G, S]`` placement of layer ``layer`` (a valid index), remembered like :meth:`_layer_key`."""
        return self._layer_memo(plan, layer)[3]

    def _layer_memo(self, plan: "foremoe.Plan", layer: int) -> Tuple[Any, int, Tuple[int, bytes, bytes], np.ndarray]:
        memo = self._key_memo
        if memo is not None and memo[0] is plan and memo[1] == layer:
            return memo
        place = np.asarray(plan.gpu_slots[layer])
        key = (layer, place.tobytes(), (np.asarray(plan.slot_tokens[layer]) > 0).tobytes())
        self._key_memo = (plan, layer, key, place)
        return self._key_memo

    def sync(self, plan: "foremoe.Plan", layer: int, changed: Sequence[int], *, group: Any = None,
             timeout: float = DEFAULT_TIMEOUT, stale_mirrors: Sequence[int] = (),
             prefetch_state: Optional[np.ndarray] = None) -> Dict[str, Any]:
        """Brings this rank's replica rows to ``plan``'s layer ``layer`` (:meth:`bookkeep`, then the moves on the
        transfer engine from the owners, every wait within ``timeout``, each received row verified and, when it
        failed, replaced from the host mirror; see the module docstring). Every rank calls it with the same
        arguments; ``stale_mirrors``: ranks whose mirror is stale (gathered; :meth:`check_mirrors`). When a failed
        move cannot be replaced, every rank raises ``RuntimeError`` and every replica is re-sent at the next sync.

        After :meth:`prefetch` the moves are already posted: this waits for them (within ``timeout``), verifies and
        installs them. ``prefetch_state`` ``[G, 2]`` (every rank's :meth:`prefetch_flags`, gathered) makes every
        rank raise ``ValueError`` together when a rank's prefetch does not match this call (another placement or
        layer, owner weights changed since, or not every rank prefetched). Returns :meth:`bookkeep`'s result."""
        layer = integer(layer, "ExpertStorage.sync: layer")
        self.check_plan(plan, layer)
        self._check_prefetch(prefetch_state, plan, layer, timeout)
        self.check_mirrors(stale_mirrors)
        pending, self._pending = self._pending, None
        if pending is None:
            out = self.bookkeep(plan, layer, changed)
            self.num_syncs += 1
            pending = self._post(out, group, layer, timeout=timeout)
        out = pending["out"]
        counts = self._finish(pending, group, timeout, layer)
        self.last_sync = SyncStats(int(out["moves"]), int(out["moves"]) * self.expert_bytes, int(out["reused"]),
                                   out["changed"], *counts, prefetched=pending["prefetched"])
        self._versions = self._param_versions()
        self._invalid = False
        return out

    # -- prefetch -----------------------------------------------------------------------------------------------

    def prefetch(self, plan: "foremoe.Plan", layer: int, *, group: Any = None,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        """Starts the replica moves of ``plan``'s layer ``layer`` now, ahead of the layer's call: one small
        ``all_gather`` (whose owner weights changed, whose mirror is stale), the bookkeeping, then the sends and
        receives submitted to the transfer engine without waiting. The received rows land in staging buffers, never
        in the slot storage: the next call of the layer (:meth:`sync` inside :func:`balanced_moe`) waits for them
        within its deadline, verifies them and installs them, so a replica row the current micro-step's backward
        still reads is never overwritten and the result is bitwise that of the synchronous path.

        A collective: every rank of ``group`` calls it, in the same order relative to the layer's calls and the
        other collectives on ``group``. The next call of this layer must use the same placement of the same
        ``layer`` (the plan of the micro-step prefetched), and the owner weights must not change in between (no
        optimizer step): otherwise that call raises ``ValueError`` on every rank, drops the prefetched moves and
        every replica is re-sent at the following call. Prefetching twice without a call in between raises."""
        if self._pending is not None:
            raise ValueError(f"ExpertStorage.prefetch: layer {self._pending['layer']} already has prefetched moves "
                             f"that no call of the layer has used yet (prefetch once per call, in call order)")
        layer = integer(layer, "ExpertStorage.prefetch: layer")
        check_plan(plan, layer, self.world, "ExpertStorage.prefetch")
        self.check_plan(plan, layer)
        self.refresh_copies()  # copy-bound owner rows after an optimizer step: the moves read the rows
        _, flags = gather_source_loads(None, 0, group=group, flags=(int(self.owners_changed()),
                                                                    int(self.mirror_stale())),
                                       timeout=timeout, what=f"ExpertStorage.prefetch (layer {layer})")
        self.check_mirrors([g for g in range(self.world) if flags[g, 1]])
        out = self.bookkeep(plan, layer, [g for g in range(self.world) if flags[g, 0]])
        self.num_syncs += 1
        pending = self._post(out, group, layer, snapshot=True, timeout=timeout)
        pending.update(layer=int(layer), placement=np.array(plan.gpu_slots[layer]), versions=self._param_versions(),
                       prefetched=int(out["moves"]))
        self._versions, self._invalid = pending["versions"], False
        self._pending = pending

    def call_flags(self, plan: Optional["foremoe.Plan"], layer: int) -> Tuple[int, int, int, int]:
        """What a layer call gathers from every rank beside its counts: (owner weights changed since the last sync,
        host mirror stale, and :meth:`prefetch_flags` for ``plan``'s layer ``layer``)."""
        return (int(self.owners_changed()), int(self.mirror_stale())) + self.prefetch_flags(plan, layer)

    def prefetch_flags(self, plan: Optional["foremoe.Plan"], layer: int) -> Tuple[int, int]:
        """(has prefetched moves, 0 or the reason code why they do not fit a call with ``plan``'s layer
        ``layer``: 1 another layer, 2 another placement, 3 owner weights changed since the prefetch)."""
        p = self._pending
        if p is None:
            return (0, 0)
        if plan is None or p["layer"] != int(layer):
            return (1, 1)
        if not np.array_equal(np.asarray(plan.gpu_slots[layer]), p["placement"]):
            return (1, 2)
        return (1, 3) if (self._invalid or self._param_versions() != p["versions"]) else (1, 0)

    def _check_prefetch(self, state: Optional[np.ndarray], plan: Optional["foremoe.Plan"], layer: int,
                        timeout: float) -> None:
        if state is None:
            state = np.array([self.prefetch_flags(plan, layer)] * self.world, dtype=np.int64)
        state = np.asarray(state).reshape(self.world, 2)
        if not state.any():  # no rank prefetched (the common case)
            return
        bad = np.flatnonzero(state[:, 1] | (state[:, 0] != state[0, 0]))
        if not bad.size:
            return
        g = int(bad[0])
        why = {1: f"for another layer or a plain call (called: layer {layer})",
               2: f"for another placement of layer {layer} than the plan of this call",
               3: "but the owner weights changed since (an optimizer step between prefetch and the call)"}
        reason = why.get(int(state[g, 1]), "but not every rank prefetched (prefetch is a collective)")
        self.drop_prefetch(timeout)
        raise ValueError(f"foremoe.torch: layer {layer}: rank {g} prefetched replica moves {reason}; the prefetched "
                         f"moves are dropped and every replica is re-sent at the next call (prefetch the plan of the "
                         f"call that comes next on this layer)")

    def close(self) -> None:
        """Leaves this storage's transfer engine, e.g. before ``destroy_process_group``: an engine of its own ends
        (its threads and its exchanges over the group), an engine shared with the model's other storages
        (:mod:`foremoe.torch.mover`) ends when the last of them closes; a later sync with moves makes an engine of
        its own (every rank again). Refused while prefetched moves wait for their call (call the layer, or
        :meth:`drop_prefetch` on every rank, first)."""
        if self._pending is not None:
            raise ValueError(f"ExpertStorage.close: layer {self._pending['layer']} has prefetched moves in flight; call "
                             f"the layer or drop_prefetch() on every rank first")
        mover, self._mover, self._reducer = self._mover, None, None  # the reducer runs on the mover's engine
        if mover is not None:
            mover.close()

    def drop_prefetch(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Waits for prefetched moves (within ``timeout``) and discards them; every replica is re-sent at the next
        sync. Every rank calls it together (they are the other ranks' sends)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        self.resident_rows.fill(-1)
        self._invalid = True
        try:
            self._land(pending, timeout)
        except RuntimeError:
            pass

    # -- moves --------------------------------------------------------------------------------------------------

    def _post(self, out: Dict[str, Any], group: Any, layer: int, snapshot: bool = False,
              timeout: float = DEFAULT_TIMEOUT) -> Dict[str, Any]:
        """Submits the sync's moves (``out``: :meth:`bookkeep`'s) without waiting; ``snapshot`` (a prefetch): the
        received rows land in staging rows, installed at the call."""
        pending: Dict[str, Any] = {"out": out, "prefetched": 0}
        if int(out["moves"]) == 0:
            return pending
        return self._post_engine(pending, group, snapshot, timeout)

    def _engine_mover(self, group: Any, timeout: float) -> EngineMover:
        """This storage's transfer engine (moves and replica-gradient reductions), made at first use (a collective:
        every rank gets there at the same sync or backward) and remade when ``faults`` or ``verify`` changed since,
        which also drops the gradient reducer registered with the old one."""
        if self._mover is not None and not self._mover.fits(self):
            self._mover.close()
            self._mover, self._reducer = None, None
        if self._mover is None:
            self._mover = EngineMover(self, group, timeout)
        return self._mover

    def _post_engine(self, pending: Dict[str, Any], group: Any, staged: bool, timeout: float) -> Dict[str, Any]:
        """Submits the sync's moves to this storage's transfer engine (:mod:`foremoe.torch.mover`): every rank the
        same batch, each move from its owner's row into its destination row, or (``staged``, a prefetch) into the
        destination rank's staging rows, installed at the call."""
        mover = self._engine_mover(group, timeout)
        every = pending["out"]["all_moves"]
        batch = every.astype(np.int32)  # (expert, source rank, destination rank, destination row)
        if staged:  # the k-th move into a rank lands in its k-th staging row
            nth = np.zeros(len(batch), dtype=np.int64)
            for g in np.unique(batch[:, 2]):
                at = np.flatnonzero(batch[:, 2] == g)
                nth[at] = np.arange(at.size)
            batch[:, 3] = self._stage0 + nth
        mine = np.flatnonzero(batch[:, 2] == self.rank)
        # (expert, source rank, storage row, engine slot) of every move into this rank.
        pending["incoming"] = [(int(every[i, 0]), int(every[i, 1]), int(every[i, 3]), int(batch[i, 3])) for i in mine]
        pending["index"] = mine
        pending["ticket"] = mover.submit(batch, timeout)
        return pending

    def _land(self, pending: Dict[str, Any], timeout: float) -> Optional[str]:
        """Waits for the posted moves within ``timeout``; the first failure's message, or None."""
        if pending.get("ticket") is None:
            return None
        return self._mover.finish(pending["ticket"], timeout)[0]

    def _finish(self, pending: Dict[str, Any], group: Any, timeout: float, layer: int) -> Tuple[int, ...]:
        """Waits for, verifies and installs the posted moves; returns (faults, verify_failures, fallbacks) over all
        ranks."""
        if int(pending["out"]["moves"]) == 0:
            return (0, 0, 0)
        return self._finish_engine(pending, group, timeout, layer)

    def _agree(self, error: Optional[str], counts: Tuple[int, int, int], group: Any, timeout: float,
               layer: int) -> Tuple[int, ...]:
        """Gathers every rank's move status: all raise ``RuntimeError`` (this rank's ``error``, or one naming the
        first rank that failed) and forget every replica when any rank's moves failed; else the summed ``counts``."""
        status = gather_rows(torch.tensor([int(error is not None), *counts], dtype=torch.int64), group, timeout,
                             f"replica move status of layer {layer}")
        failed = torch.nonzero(status[:, 0]).reshape(-1).tolist()
        if failed:
            self.resident_rows.fill(-1)  # every rank forgets every replica: all are re-sent at the next sync
            raise RuntimeError(error or f"foremoe.torch: layer {layer}: a replica move to rank {failed[0]} failed "
                                        f"and could not be replaced (its error names the move); no replica of this "
                                        f"sync is used")
        return tuple(int(v) for v in status[:, 1:].sum(dim=0).tolist())

    def _finish_engine(self, pending: Dict[str, Any], group: Any, timeout: float, layer: int) -> Tuple[int, ...]:
        """The engine's batch: waits for it, installs staged rows, and agrees over ``group`` whether every rank's
        moves landed (all raise otherwise); returns (faults, verify_failures, fallbacks) over all ranks, from the
        engine's telemetry of the moves into this rank: moves that needed more copies than chunks (a failed or
        wrong copy, retried), copies whose checksum did not match, moves that landed from the host mirror after
        another path failed."""
        error, tel = self._mover.finish(pending["ticket"], timeout)
        faults = bad = fallbacks = 0
        for i in pending["index"]:
            m = tel[int(i)] if int(i) < len(tel) else {}
            faults += int(m.get("attempts", 0) > m.get("num_chunks", 0))
            bad += int(m.get("verify_failures", 0))
            fallbacks += int(bool(m.get("fallback", False)))
        message = None
        if error is not None:
            message = self._engine_error(pending, tel, error, layer)
        else:
            for e, src, row, slot in pending["incoming"]:
                if slot != row:  # staged by prefetch: installed now, after the rows' last readers
                    for name in self.names:
                        self._alloc[name].data[row].copy_(self._alloc[name][slot])
        for _, _, row, _ in pending["incoming"]:
            self.row_generation[row] += 1
        return self._agree(message, (faults, bad, fallbacks), group, timeout, layer)


    def _engine_error(self, pending: Dict[str, Any], tel: List[Dict[str, Any]], error: str, layer: int) -> str:
        """The message of this rank's failed move batch: its first incoming move that did not land, else (the batch
        failed on a move out of this rank, or the exchange with a peer) its first incoming move, else that it
        receives nothing."""
        incoming = pending["incoming"]  # (expert, source rank, storage row, engine slot)
        failed = [m for m, i in zip(incoming, pending["index"])
                  if int(i) >= len(tel) or not tel[int(i)].get("ok", False)]
        where = f"foremoe.torch: layer {layer}: rank {self.rank}"
        if failed:
            e, src, row, _ = failed[0]
            fix = (", also from the host mirror" if self.mirror is not None else
                   f", and rank {self.rank} has no host mirror to fall back to (ExpertStorage(..., mirror=True))")
            return (f"foremoe.torch: layer {layer}: the replica move of expert {e} from rank {src} to rank "
                    f"{self.rank} (row {row}) did not land ({error}){fix}; no replica of this sync is used")
        if incoming:
            e, src, row, _ = incoming[0]
            return (f"{where}: the replica move batch failed ({error}) although every move into rank {self.rank} "
                    f"landed (the first: expert {e} from rank {src} into row {row}; {len(incoming)} in all): a move "
                    f"out of it or an exchange with a peer failed; no replica of this sync is used")
        return (f"{where}: the replica move batch failed ({error}); no move goes into rank {self.rank} (it only "
                f"sends): a move out of it or an exchange with a peer failed; no replica of this sync is used")


def reference_moe(x: torch.Tensor, expert_ids: torch.Tensor, routing_weights: torch.Tensor,
                  weights: Mapping[str, torch.Tensor], expert_fn: ExpertFn) -> torch.Tensor:
    """The plain single-process MoE layer without replication: ``out[t] = sum_k w[t, k] * f(x[t]; W[ids[t, k]])``
    with ``weights`` ``{kind: [E, ...]}`` (the reference the balanced layer equals)."""
    T, K = expert_ids.shape
    flat = expert_ids.reshape(-1).to(torch.int64)
    tok = torch.arange(T * K, device=x.device) // K
    rows = []
    pos = []
    ws = list(weights.values())
    for e in torch.unique(flat[flat >= 0]).tolist():
        idx = (flat == e).nonzero().reshape(-1)
        rows.append(expert_fn(x.index_select(0, tok[idx]), *[w[e] for w in ws]))
        pos.append(idx)
    y = x.new_zeros((T * K, x.shape[1]))
    if rows:
        y = y.index_copy(0, torch.cat(pos), torch.cat(rows))
    return _combine(y, routing_weights, T, K)


def _combine(y_routes: torch.Tensor, routing_weights: torch.Tensor, T: int, K: int) -> torch.Tensor:
    return (routing_weights.to(y_routes.dtype).unsqueeze(-1) * y_routes.view(T, K, -1)).sum(dim=1)


class _Run:
    """What one layer call's expert compute and its backward need."""

    def __init__(self, storage: ExpertStorage, expert_fn: ExpertFn, book: Mapping[str, Any], layout: DispatchLayout,
                 layer: int, group: Any, timeout: float):
        self.storage, self.expert_fn, self.layout = storage, expert_fn, layout
        self.group, self.timeout, self.layer = group, timeout, layer
        self.rows = book["rows"]
        # (expert, holder rank, holder row, tag) of the replica gradient transfers naming this rank.
        self.grad_transfers = book["grads"].tolist()
        self.generations = storage.row_generation.copy()
        self.replica_slots = np.flatnonzero(self.rows >= storage.num_owned).tolist()
        self.need_grad = True
        # Held gradients: the (expert, holder) gradients this call's backward returns, ascending (None: every
        # replica's now, as `grad_transfers` says), and the expert of each of this rank's plan slots.
        self.hold: Optional[List[Tuple[int, int]]] = None
        self.slot_expert: Optional[np.ndarray] = None
        self.plan: Any = None  # the plan this call ran (the owner plan for plan=None) and its layer there
        self.plan_layer = 0


class _SlotExperts(torch.autograd.Function):
    """Expert compute on this rank's slots, with the replica gradients reduced into the owners in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: Optional[torch.Tensor], run: _Run,
                *owner_params: torch.Tensor) -> torch.Tensor:
        # scale: None, or one value per row handed to expert_fn as scale= (Megatron's per-token routing weight).
        st = run.storage
        counts = run.layout.slot_counts
        need = run.need_grad
        with torch.enable_grad() if need else torch.no_grad():
            xd = x.detach().requires_grad_(True)
            sd = None if scale is None else scale.detach().requires_grad_(scale.requires_grad)
            od = [p.detach().requires_grad_(True) for p in owner_params]
            rep = {j: [st.storage[n][int(run.rows[j])].detach().requires_grad_(True) for n in st.names]
                   for j in run.replica_slots if counts[j] > 0}
            outs = []
            # One split (its backward is one concatenation), not a slice per slot (each slice's backward would
            # zero-fill a gradient as large as all the slots' rows).
            xs = xd.split(counts)
            ss = None if sd is None else sd.split(counts)
            for j, n in enumerate(counts):
                if n == 0:
                    continue
                row = int(run.rows[j])
                ws = [w[row] for w in od] if row < st.num_owned else rep[j]
                if ss is None:
                    outs.append(run.expert_fn(xs[j], *ws))
                else:
                    outs.append(run.expert_fn(xs[j], *ws, scale=ss[j]))
            y = torch.cat(outs) if outs else x.new_zeros((0,) + tuple(x.shape[1:]))
        ctx.run = run
        ctx.inner = (xd, sd, od, rep, y) if need else None
        return y.detach()

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> Tuple[Any, ...]:
        run: _Run = ctx.run
        st = run.storage
        if ctx.inner is None:
            raise RuntimeError("foremoe.torch: backward of a balanced MoE layer that ran without autograd")
        _check_rows(run)
        xd, sd, od, rep, y = ctx.inner
        rep_slots = sorted(rep)
        ns = int(sd is not None and sd.requires_grad)
        leaves = [xd] + ([sd] if ns else []) + od + [t for j in rep_slots for t in rep[j]]
        if y.requires_grad:
            grads = list(torch.autograd.grad(y, leaves, gy, allow_unused=True))
        else:
            grads = [None] * len(leaves)
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
        nk = len(st.names)
        gx, gs = grads[0], (grads[1] if ns else None)
        grads = grads[1 + ns:]
        go = grads[:nk]
        rep_grad = {j: grads[nk + i * nk:nk + (i + 1) * nk] for i, j in enumerate(rep_slots)}
        row_slot = {int(run.rows[j]): j for j in rep_slots}
        if run.hold is not None:
            go = _return_held_grads(run, go, rep_grad)
        else:
            go = _reduce_replica_grads(run, go, rep_grad, row_slot)
        ctx.inner = None
        return (gx, gs, None, *go)


def _check_rows(run: _Run) -> None:
    """Raises when a replica row of ``run`` was rewritten (by a later micro-step's moves) before its backward."""
    st = run.storage
    for j in run.replica_slots:
        row = int(run.rows[j])
        if st.row_generation[row] != run.generations[row]:
            raise RuntimeError(f"foremoe.torch: layer {run.layer}: replica row {row} was rewritten by a later "
                               f"micro-step before this micro-step's backward")


class _SlotWeights(torch.autograd.Function):
    """The weights of every slot of ``run`` that takes tokens, as separate outputs (kind after kind, slot after
    slot; views of the storage rows, copying nothing), with the per-expert owner parameters (kind-major) as inputs:
    the slot compute then runs in the caller's autograd graph, without a nested one. Backward adds the replica
    gradients into the owners' as :class:`_SlotExperts` does and hands each parameter its gradient (zero for an
    owner row without tokens)."""

    @staticmethod
    def forward(ctx: Any, run: _Run, slots: List[int], *params: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        rows, views = run.rows.tolist(), run.storage._views()
        ctx.run, ctx.slots = run, slots
        return tuple(v[rows[j]].detach() for j in slots for v in views)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Tuple[Any, ...]:
        run: _Run = ctx.run
        st = run.storage
        _check_rows(run)
        n, nk = st.num_owned, len(st.names)
        rows: Dict[int, Sequence[Optional[torch.Tensor]]] = {}  # owner row -> its gradients, one per kind
        rep_grad: Dict[int, List[torch.Tensor]] = {}
        for i, j in enumerate(ctx.slots):
            row = int(run.rows[j])
            if row < n:
                rows[row] = grads[i * nk:(i + 1) * nk]
            else:
                rep_grad[j] = [torch.zeros_like(st.storage[name][row]) if g is None else g
                               for name, g in zip(st.names, grads[i * nk:(i + 1) * nk])]
        go = []  # [n, ...] per kind: an owner row without tokens gets zeros
        for k, name in enumerate(st.names):
            got = [rows[i][k] if i in rows else None for i in range(n)]
            zero = st.storage[name][0]
            go.append(torch.stack([torch.zeros_like(zero) if g is None else g for g in got]) if n else
                      torch.zeros_like(st.storage[name][:0]))
        if run.hold is not None:
            go = _return_held_grads(run, go, rep_grad)
        else:
            go = _reduce_replica_grads(run, go, rep_grad, {int(run.rows[j]): j for j in rep_grad})
        return (None, None, *[g for k in range(nk) for g in go[k].unbind(0)])


def _slot_compute(run: _Run, x: torch.Tensor, scale: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The expert compute of ``run``'s local slots on ``x`` (rows grouped by slot) with Megatron's per-row
    ``scale``, in the caller's autograd graph (:class:`_SlotWeights`); ``params``: the per-expert owner
    parameters, kind-major. The same numbers as :class:`_SlotExperts`."""
    counts = run.layout.slot_counts
    slots = [j for j, c in enumerate(counts) if c > 0]
    nk = len(run.storage.names)
    ws = _SlotWeights.apply(run, slots, *params)
    xs, ss = x.split(counts), scale.split(counts)
    return torch.cat([run.expert_fn(xs[j], *ws[i * nk:(i + 1) * nk], scale=ss[j]) for i, j in enumerate(slots)])


def _reduce_replica_grads(run: _Run, go: List[torch.Tensor], rep_grad: Dict[int, List[torch.Tensor]],
                          row_slot: Dict[int, int]) -> List[torch.Tensor]:
    st = run.storage
    r = st.rank
    what = f"replica gradient reduction of layer {run.layer}"
    # Every replica given tokens by the plan returns: (expert, holder), ascending.
    pairs = sorted((e, g) for g, e in _plan_replicas(st, run.plan, run.plan_layer)[1])
    mine = {e: rep_grad[row_slot[row]] for e, h, row, _ in run.grad_transfers if h == r}
    return _to_owners_engine(run, go, pairs, mine, what)


# Attempts at a layer's replica-gradient reductions when the only failures were checksum mismatches (a corrupted
# transfer, caught before anything was added): a design choice, as the engine's own max_attempts for copies; a
# transport failure is not retried (its gloo pair is closed, a retry would wait out the deadline again).
REDUCE_ATTEMPTS = 3


def _to_owners_engine(run: _Run, go: List[torch.Tensor], pairs: Sequence[Tuple[int, int]],
                      mine: Dict[int, Optional[List[torch.Tensor]]], what: str) -> List[torch.Tensor]:
    """:func:`_to_owners` on the storage's transfer engine (:class:`foremoe.torch.mover.GradReducer`): ``pairs``
    (expert, holder rank) return, ascending, the same on every rank; ``mine`` the gradients of those this rank holds.
    Every rank then agrees over the group whether every reduction succeeded. When the only failures were gradients
    whose checksum did not match on their owner (``verify``: nothing of their experts was added), every rank runs
    the reductions again from the same gradients, up to :data:`REDUCE_ATTEMPTS` times in all (counted in
    ``ExpertStorage.reduction_retries``); otherwise all raise ``RuntimeError`` naming the layer (no gradient of the
    layer reaches the parameters)."""
    if not pairs:
        return go
    st = run.storage
    if st._reducer is None:
        st._reducer = GradReducer(st, run.group, run.timeout)
    for attempt in range(1, REDUCE_ATTEMPTS + 1):
        before = st._reducer.reductions
        try:
            error, out = st._reducer.reduce(go, pairs, mine, run.timeout)
            code = 0 if error is None else 2 if st._reducer.unverified else 1
        except (ValueError, RuntimeError) as e:  # e.g. a gradient this rank holds of the wrong shape
            error, out, code = str(e), go, 1
        st.engine_reductions += st._reducer.reductions - before
        try:
            status = gather_rows(torch.tensor([code], dtype=torch.int64), run.group, run.timeout, f"{what}: status")
        except RuntimeError as exc:  # e.g. a peer's exchanges timed out and gloo closed the pair
            own = f" on rank {st.rank} ({error})" if error is not None else ""
            raise RuntimeError(f"foremoe.torch: the {what} failed{own}, and the ranks could not agree on it ({exc}); "
                               f"no gradient of this layer reaches the parameters") from exc
        codes = status[:, 0]
        if bool((codes == 2).any()) and bool(((codes == 0) | (codes == 2)).all()) and attempt < REDUCE_ATTEMPTS:
            st.reduction_retries += 1  # only checksum mismatches: every rank runs the reductions again
            continue
        break
    failed = torch.nonzero(status[:, 0]).reshape(-1).tolist()
    if failed:
        if error is not None:
            raise RuntimeError(f"foremoe.torch: the {what} failed on rank(s) {failed} (rank {st.rank}: {error}); no "
                               f"gradient of this layer reaches the parameters")
        raise RuntimeError(f"foremoe.torch: the {what} failed on rank(s) {failed} (their errors name the transfer); "
                           f"no gradient of this layer reaches the parameters")
    return out


def _plan_replicas(st: ExpertStorage, plan: "foremoe.Plan", layer: int
                   ) -> Tuple[Dict[Tuple[int, int], int], List[Tuple[int, int]]]:
    """``plan``'s replicas of layer ``layer``: ``{(holder, expert): owner}`` and the ``(holder, expert)`` of those the
    plan gives tokens, row-major. Remembered for the last placement and used slots (:meth:`ExpertStorage._layer_key`):
    the micro-step's other passes over the layer, and later micro-steps keeping the same replicas, reuse it."""
    key = st._layer_key(plan, layer)
    memo = st._replicas_memo
    if memo is not None and memo[0] == key:
        return memo[1], memo[2]
    place, taken = st._placement(plan, layer), np.asarray(plan.slot_tokens[layer])
    owner = st._owner_of[place]  # -1 for an empty slot
    gs, js = np.nonzero((owner != st._ranks) & (place >= 0))  # the replicas, row-major
    es, os_, ts = place[gs, js].tolist(), owner[gs, js].tolist(), taken[gs, js].tolist()
    gs = gs.tolist()
    present = {(g, e): o for g, e, o in zip(gs, es, os_)}
    used = [(g, e) for g, e, t in zip(gs, es, ts) if t > 0]
    st._replicas_memo = (key, present, used)
    return present, used


def _hold_schedule(st: ExpertStorage, plan: "foremoe.Plan", layer: int, gradients: str,
                   changed: Sequence[int]) -> List[Tuple[int, int]]:
    """Updates the held table for ``plan`` (the same on every rank) and returns the (expert, holder) gradients
    this call's backward sends to their owners, ascending: those held whose replica ``plan`` no longer keeps on
    the same rank (its slot is reused), and with ``gradients`` ``"flush"`` (or ``"reduce"`` with some still held)
    every held one, this call's included. This call's replicas that run tokens hold theirs from now on."""
    if st._held and changed:
        raise RuntimeError(f"foremoe.torch: layer {layer}: replica gradients are still held but the owner weights of "
                           f"ranks {list(changed)} changed (an optimizer step?): run the last micro-step before "
                           f"the optimizer step with gradients='flush'")
    present, used = _plan_replicas(st, plan, layer)
    sends = [(e, g) for (g, e), o in st._held.items() if present.get((g, e)) != o]
    for e, g in sends:
        del st._held[(g, e)]
    for key in used:
        st._held[key] = present[key]  # the expert's owner
    if gradients != "hold":
        sends += [(e, g) for (g, e) in st._held]
        st._held.clear()
    return sorted(set(sends))


def _return_held_grads(run: _Run, go: List[torch.Tensor],
                       rep_grad: Dict[int, List[torch.Tensor]]) -> List[torch.Tensor]:
    """Held mode's backward: this call's replica gradients accumulate into the held ones (per expert), then the
    gradients ``run.hold`` names go to their owners and are added there in ascending (expert, holder) order, after
    the owner's own."""
    st = run.storage
    r, nk = st.rank, len(st.names)
    for j, grads in rep_grad.items():
        e = int(run.slot_expert[j])
        held = st._held_grads.get(e)
        if held is None:
            # bfloat16 and float16 gradients are summed in float32 while held, and rounded once when they return:
            # the unheld run adds each micro-step's gradient to a float32 gradient buffer (Megatron's main_grad),
            # and a 16-bit sum over many micro-steps would drop the small ones (bfloat16 keeps 8 significant bits).
            acc = torch.float32 if grads[0].dtype in _SUM_IN_FLOAT32 else grads[0].dtype
            st._held_grads[e] = [t.detach().to(dtype=acc, copy=True) for t in grads]
        else:
            for k in range(nk):
                held[k].add_(grads[k])
    what = f"held replica gradient return of layer {run.layer}"
    # A held gradient with nothing accumulated returns zeros (the reducer writes them).
    mine = {e: st._held_grads.pop(e, None) for e, g in run.hold if g == r}
    dtype = go[0].dtype
    mine = {e: (None if v is None else [t.to(dtype) for t in v]) for e, v in mine.items()}
    return _to_owners_engine(run, go, run.hold, mine, what)


#: Gradient dtypes that a held gradient sums in float32 (:func:`_return_held_grads`).
_SUM_IN_FLOAT32 = (torch.bfloat16, torch.float16)


#: ``routing_weights`` of :func:`_prepare` for a caller that applies the routing weights itself (the Megatron
#: adapter: per row, inside the expert MLP).
_APPLIED_INSIDE = object()


def _input_error(x: Any, expert_ids: Any, routing_weights: Any, storage: ExpertStorage,
                 hidden: Optional[int]) -> Optional[str]:
    who = f"balanced_moe: rank {storage.rank}"
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        return f"{who}: x must be a [tokens, hidden] float tensor, got {getattr(x, 'shape', type(x).__name__)}"
    if not isinstance(expert_ids, torch.Tensor) or expert_ids.dim() != 2:
        return f"{who}: expert_ids must be [tokens, topk], got {getattr(expert_ids, 'shape', type(expert_ids).__name__)}"
    if expert_ids.shape[0] != x.shape[0]:
        return f"{who}: expert_ids has {expert_ids.shape[0]} tokens, x has {x.shape[0]}"
    if routing_weights is _APPLIED_INSIDE:
        pass
    elif not isinstance(routing_weights, torch.Tensor) or tuple(routing_weights.shape) != tuple(expert_ids.shape):
        return (f"{who}: routing_weights must be {list(expert_ids.shape)} like expert_ids, got "
                f"{list(getattr(routing_weights, 'shape', []))}")
    elif not routing_weights.is_floating_point():
        return f"{who}: routing_weights must be a float tensor, got dtype {routing_weights.dtype}"
    if hidden is not None and x.shape[1] != hidden:
        return f"{who}: x has hidden size {x.shape[1]}, the experts take {hidden}"
    if x.dtype != storage.storage[storage.names[0]].dtype:
        return f"{who}: x is {x.dtype}, the expert weights {storage.storage[storage.names[0]].dtype}"
    return None


def balanced_moe(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    routing_weights: torch.Tensor,
    plan: Optional["foremoe.Plan"],
    storage: ExpertStorage,
    expert_fn: ExpertFn,
    *,
    layer: int = 0,
    group: Any = None,
    hidden: Optional[int] = None,
    timeout: float = DEFAULT_TIMEOUT,
    gradients: str = "reduce",
) -> torch.Tensor:
    """One MoE layer of one micro-step under ``plan`` (its layer ``layer``), functional form.

    ``x`` ``[T, H]`` this rank's tokens, ``expert_ids`` ``[T, K]`` logical ids (-1 = no route),
    ``routing_weights`` ``[T, K]``; ``storage`` this layer's :class:`ExpertStorage`; ``expert_fn(x, *w)`` one
    expert's math on its rows with its weights in ``storage.names`` order. Every rank of ``group`` calls it.
    Returns ``[T, H]``: ``sum_k routing_weights[t, k] * expert_fn(x[t], W[expert_ids[t, k]])``.
    ``plan=None`` runs plain expert parallelism (every expert on its owner, no replica): the run without
    ForeMoE, and a rollout's forward before any routing is known.

    ``gradients`` (the same on every rank): ``"reduce"`` (default) reduces every replica's weight gradient into
    its owner's in this call's backward. ``"hold"``: a replica kept resident by the following calls' plans
    accumulates its gradient in place (in a buffer beside its row) and returns it once, in the backward of the
    first call whose plan no longer keeps it on that rank (its slot is reused), so each replica's gradient crosses
    the network once per residency (issue 30; the planner's ``hold_replica_gradients`` counts bytes the same way).
    ``"flush"``: as ``"hold"``, and this call's backward returns every held gradient: pass it on the last
    micro-step before the optimizer step (before anything reads the owners' gradients, e.g. DDP's last backward).
    Held gradients left at an optimizer step raise at the next call. Backwards must run in call order. Owner
    gradients then equal the unheld run's at each flush, summed in another order (float64: within 1e-12); bfloat16
    and float16 gradients are summed in float32 while held and rounded once when they return.
    """
    if gradients not in ("reduce", "hold", "flush"):
        raise ValueError(f"balanced_moe: gradients must be 'reduce', 'hold' or 'flush', got {gradients!r}")
    run = _prepare(x, expert_ids, routing_weights, plan, storage, expert_fn, layer, group, hidden, timeout)
    _schedule_gradients(run, gradients)
    layout = run.layout
    T, K = expert_ids.shape
    send = x.index_select(0, layout.send_tokens)
    recv = all_to_all(send, layout.output_splits, layout.input_splits, group=group, timeout=timeout)
    grouped = recv.index_select(0, layout.recv_perm)
    y = _SlotExperts.apply(grouped, None, run, *storage.params.values())
    y_recv = y.index_select(0, layout.recv_inverse)
    back = all_to_all(y_recv, layout.input_splits, layout.output_splits, group=group, timeout=timeout)
    y_routes = x.new_zeros((T * K, back.shape[1])).index_copy(0, layout.order, back)
    return _combine(y_routes, routing_weights, T, K)


def _schedule_gradients(run: _Run, gradients: str) -> None:
    """Sets which held replica gradients ``run``'s backward returns (``gradients``: :func:`balanced_moe`'s); a call
    without autograd holds and returns nothing. Every rank calls it after :func:`_prepare`, with the same mode."""
    storage = run.storage
    if run.need_grad and (gradients != "reduce" or storage._held):
        flags = run.layout.flags[:, 0]
        changed = np.flatnonzero(flags).tolist() if flags.any() else []
        run.hold = _hold_schedule(storage, run.plan, run.plan_layer, gradients, changed)
        run.slot_expert = storage._placement(run.plan, run.plan_layer)[storage.rank]


def _prepare(x: Any, expert_ids: Any, routing_weights: Any, plan: Optional["foremoe.Plan"], storage: ExpertStorage,
             expert_fn: ExpertFn, layer: int, group: Any, hidden: Optional[int], timeout: float,
             counts: Optional[np.ndarray] = None) -> _Run:
    """Everything of one balanced layer call before the token exchange (input checks gathered over the group,
    the dispatch layout, the replica sync): what the call's expert compute needs, with ``run.layout``.
    ``counts``: the ``[E]`` int64 counts of ``expert_ids`` when the caller made both (not counted again)."""
    layer = integer(layer, "balanced_moe: layer")
    G = group_size(group)
    if G != storage.world:
        raise ValueError(f"balanced_moe: the process group has {G} ranks, the storage was made for {storage.world}")
    if group_rank(group) != storage.rank:
        raise ValueError(f"balanced_moe: this process is rank {group_rank(group)} of the group, the storage "
                         f"belongs to rank {storage.rank}")
    storage.check_aliasing()
    storage.refresh_copies()  # copy-bound owner rows after an optimizer step (local; a flag test otherwise)
    error = _input_error(x, expert_ids, routing_weights, storage, hidden)
    flags = storage.call_flags(plan, layer)
    if plan is None:  # plain expert parallelism: every expert on its owner, no replica
        loads, got = gather_source_loads(expert_ids if error is None else None, storage.num_experts, group=group,
                                         flags=flags, error=error, timeout=timeout, what="balanced_moe")
        plan, layer = storage.owner_plan(loads.sum(axis=1)), 0
        layout = local_layout(plan, 0, expert_ids, loads, storage.rank, flags=got)
    else:
        check_plan(plan, layer, G, "balanced_moe")
        storage.check_plan(plan, layer)
        layout = dispatch_layout(plan, layer, expert_ids if error is None else None, group=group, flags=flags,
                                 timeout=timeout, error=error, counts=counts)
    return _synced_run(storage, expert_fn, plan, layer, layout, x, group, timeout)


def _synced_run(storage: ExpertStorage, expert_fn: ExpertFn, plan: "foremoe.Plan", layer: int,
                layout: DispatchLayout, x: torch.Tensor, group: Any, timeout: float) -> _Run:
    """The replica sync of a call whose ``layout`` carries the gathered :meth:`ExpertStorage.call_flags`, and the
    call's :class:`_Run` (the end of :func:`_prepare`, and of adapters that make the layout their own way)."""
    flags = layout.flags
    changed = np.flatnonzero(flags[:, 0]).tolist()
    stale = np.flatnonzero(flags[:, 1]).tolist()
    book = storage.sync(plan, layer, changed, group=group, timeout=timeout, stale_mirrors=stale,
                        prefetch_state=flags[:, 2:4])
    run = _Run(storage, expert_fn, book, layout, layer, group, timeout)
    run.plan, run.plan_layer = plan, layer
    run.need_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad
                                                                         for p in storage.params.values()))
    return run


class SwiGLUExperts(nn.Module):
    """A plain experts module: ``E`` SwiGLU experts, ``w_gate``/``w_up`` ``[E, H, F]``, ``w_down`` ``[E, F, H]``
    (the form :class:`BalancedMoE` wraps). Its own ``forward`` is the single-process layer."""

    weight_names = ("w_gate", "w_up", "w_down")

    def __init__(self, num_experts: int, hidden: int, ffn: int, *, dtype: torch.dtype = torch.float32,
                 generator: Optional[torch.Generator] = None):
        super().__init__()
        self.num_experts, self.hidden, self.ffn = num_experts, hidden, ffn

        def init(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=generator, dtype=dtype) / shape[-2] ** 0.5)

        self.w_gate = init(num_experts, hidden, ffn)
        self.w_up = init(num_experts, hidden, ffn)
        self.w_down = init(num_experts, ffn, hidden)

    @staticmethod
    def expert(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, routing_weights: torch.Tensor) -> torch.Tensor:
        return reference_moe(x, expert_ids, routing_weights,
                             {n: getattr(self, n) for n in self.weight_names}, self.expert)


class BalancedMoE(nn.Module):
    """A plain experts module (weights ``[E, ...]``, an ``expert(x, *w)`` function) run across the ranks of
    ``group`` under per-micro-step plans.

    On construction each rank keeps the rows of the experts it owns (``owners``, default
    :func:`contiguous_owners`) in an :class:`ExpertStorage` of ``slots`` rows and puts the owner rows back into
    ``experts`` as its parameters (``[n_owned, ...]``, views of the storage): ``module.parameters()`` is what the
    optimizer and DDP see, the replica rows never are. Plans must keep these owners:
    ``foremoe.Planner(...).plan(loads, owners=module.owners)``.

    ``forward(x [T, H], expert_ids [T, K], routing_weights [T, K], plan)`` -> ``[T, H]``; ``plan=None`` is plain
    expert parallelism (no replica).

    ``mirror``, ``local_world``, ``verify``, ``faults``, ``double_buffer``: :class:`ExpertStorage`'s (the mirror is
    filled from ``experts``' full weights; it is not a parameter, a buffer or in the ``state_dict``). With a mirror
    (``True``: one per rank, ``"node"``: one per node in shared memory) call :meth:`refresh_mirror` on every rank
    after each optimizer step.
    """

    def __init__(self, experts: nn.Module, slots: int, *, group: Any = None, owners: Any = None, layer: int = 0,
                 expert_fn: Optional[ExpertFn] = None, weight_names: Optional[Sequence[str]] = None,
                 timeout: float = DEFAULT_TIMEOUT, mirror: Any = False, verify: bool = True, faults: Any = None,
                 double_buffer: bool = False, local_world: Optional[int] = None):
        super().__init__()
        names = tuple(weight_names or getattr(experts, "weight_names", ()) or
                      [n for n, _ in experts.named_parameters(recurse=False)])
        if not names:
            raise ValueError("BalancedMoE: the experts module has no weights")
        full = {n: getattr(experts, n) for n in names}
        E = int(full[names[0]].shape[0])
        for n, w in full.items():
            if not isinstance(w, torch.Tensor) or w.dim() < 1 or w.shape[0] != E:
                raise ValueError(f"BalancedMoE: weight {n!r} is {list(getattr(w, 'shape', []))}, expected [{E}, ...]")
        fn = expert_fn or getattr(experts, "expert", None)
        if fn is None:
            raise ValueError("BalancedMoE: pass expert_fn or give the experts module an expert(x, *weights) method")
        G, r = group_size(group), group_rank(group)
        own = contiguous_owners(E, G) if owners is None else int_array(owners, "BalancedMoE: owners", dtype=np.int32)
        slots, layer = integer(slots, "BalancedMoE: slots"), integer(layer, "BalancedMoE: layer", 0)
        if own.shape != (E,):
            raise ValueError(f"BalancedMoE: owners must be [{E}], got shape {list(own.shape)}")
        self.storage = ExpertStorage.from_full(full, own, slots, rank=r, world=G, mirror=mirror, verify=verify,
                                               faults=faults, double_buffer=double_buffer, group=group,
                                               timeout=timeout, local_world=local_world)
        for n in names:
            delattr(experts, n)
            experts.register_parameter(n, self.storage.params[n])
        self.experts = experts
        self.expert_fn = fn
        self.group, self.layer, self.timeout = group, int(layer), float(timeout)
        self.hidden = getattr(experts, "hidden", None)

    @property
    def owners(self) -> np.ndarray:
        """``[E]`` owner rank of every expert (what the plans must keep)."""
        return self.storage.owners

    @property
    def last_sync(self) -> Optional[SyncStats]:
        return self.storage.last_sync

    def prefetch(self, plan: "foremoe.Plan") -> None:
        """Starts this layer's replica moves for ``plan`` now (:meth:`ExpertStorage.prefetch` over this module's
        group, a collective); the next ``forward`` with that plan waits for, verifies and installs them."""
        self.storage.prefetch(plan, self.layer, group=self.group, timeout=self.timeout)

    def refresh_mirror(self) -> None:
        """:meth:`ExpertStorage.refresh_mirror` over this module's group (after each optimizer step)."""
        self.storage.refresh_mirror(self.group, self.timeout)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, routing_weights: torch.Tensor,
                plan: Optional["foremoe.Plan"], gradients: str = "reduce") -> torch.Tensor:
        """``gradients``: :func:`balanced_moe`'s (``"reduce"``, ``"hold"`` or ``"flush"``)."""
        return balanced_moe(x, expert_ids, routing_weights, plan, self.storage, self.expert_fn, layer=self.layer,
                            group=self.group, hidden=self.hidden, timeout=self.timeout, gradients=gradients)
