"""The moves of :class:`foremoe.torch.ExpertStorage` on the runtime's transfer engine (issue 29: one mover).

Every replica move of a sync runs on :class:`foremoe.torch.engine.TransferEngine` (the C++
``foremoe::runtime::TransferEngine``), one engine per rank shared by the storages of a model (see "One engine for
the layers" below). CPU slot storage takes its host backend, its
paired transfers over the trainer's gloo group through the engine's bridge. CUDA slot storage takes its CUDA backend:
copies on its own copy streams (from the pinned host mirror, or within the GPU), paired transfers with other ranks on
an NCCL communicator of the engine's own, made from a unique id sent over the trainer's group; each batch starts
after the work queued so far on the current stream (a recorded ``torch.cuda.Event``: the owner rows' writes and the
replica rows' readers), and the host waits for it before the rows are used. Python keeps only the tensor handles and
the process group, and says which bytes travel: the batch every rank submits is ``replica_sync``'s ``all_moves``,
each move from its owner's row (the storage's bookkeeping reuses resident replicas and copies the others from their
owners; the engine sees only the owner rows as readable, so it keeps that source or, recording why, takes the node's
host mirror). The transfer
plan (chunks, rounds, a split of a move between the owner and the host mirror when both end sooner), verification
(the engine's checksum in every paired transfer's header), retries and the fallback to the host mirror, the seeded
fault injector (``EngineOptions.faults``: a :class:`foremoe.FaultSchedule`), deadlines and telemetry are the
engine's.

The engine addresses each weight kind's storage tensor ``[rows, ...]`` and each kind's mirror tensor ``[E, ...]``
where they lie (per-tensor regions): nothing is copied or laid out again. Its slots are the storage's rows, the same
count on every rank: the rows of the storage (owned experts first, then the spare rows and, with double buffers,
their second copies) padded to the busiest rank's, then one staging row per spare row of the rank with the most
spare rows, into which :meth:`ExpertStorage.prefetch` lands its moves until the call installs them.

Replica gradients go back on the same engine (:class:`GradReducer`, the storage's second engine layer, its fault
injector sparing reductions): the backward writes the owner gradients and the returning replica gradients into
per-kind gradient tensors registered with it, every rank that sends or receives one submits the same
``submit_reduce`` and the engine adds each expert's replicas into its owner's in the fixed order (the owner's own
first, then by rank, experts ascending). Which gradients return when is the layer's (``gradients="hold"``:
:func:`foremoe.torch.layer._hold_schedule`); held gradients wait in Python tensors, since the layer returns one in
the backward of the call whose plan drops it, after that call's moves may have reused its row, which the engine's
own held-slot records refuse.

One engine for the layers: the storages of a model share one engine per rank (each its own pair of engine layers:
moves, gradients), so a model of ``L`` MoE layers runs one progress thread, one set of copy workers, one bridge
and, on GPUs, one NCCL communicator per rank instead of ``L`` of each. Which storages share is decided without a
collective and the same on every rank: each storage gets a serial at construction among the storages of its kind
(the same rows, bytes per row, experts, ranks, mirror and device; every rank constructs the same storages in the
same order), and the first of them to sync makes an engine covering every serial constructed so far that no earlier
engine covers. A storage joins its range's engine when that engine was made on the same group with the same
``verify``; a storage with a fault injector (``faults``, which keys its decisions on the engine's batch serials),
one constructed after the engine of its range was made, or one that closed its engine and syncs again gets an
engine of its own, as every storage did before. The shared engine closes when every storage of its range has closed
or been collected. The batches of every storage then post in one order on an engine, so every rank must run its
layers' syncs, prefetches and backward reductions in the same order (program order does; a batch that differs
between ranks fails on its tags, never lands the wrong expert).
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch
import torch.distributed as dist

import foremoe

from .distributed import gather_rows
from .engine import TransferEngine, TransferError, cuda_build_gap

__all__ = ["EngineMover", "GradReducer", "backend_fields", "check_cuda_engine", "engine_rows", "enroll",
           "shared_engines"]

# The next tag space this process may give an engine: each engine takes its own on the group (the largest
# of every rank's, agreed at creation, after which every rank moves past it), so that the batches of several layers
# in flight at once never pair across engines.
_next_space = [0]


def engine_rows(slots: int, num_owned_by: np.ndarray, double_buffer: bool) -> Tuple[int, int]:
    """(engine slots per rank, first staging row): every rank's storage rows padded to the busiest rank's, then
    ``max spare`` staging rows."""
    spare = int(slots - int(np.min(num_owned_by)))
    stage0 = slots + (spare if double_buffer else 0)
    return stage0 + spare, stage0


def _row_bytes(st: Any) -> List[int]:
    """Bytes of one storage row of each weight kind (the engine's ``tensors``)."""
    return [int(st._alloc[n][0].numel()) * st._alloc[n].element_size() for n in st.names]


def _kind(storage: Any) -> Tuple[Any, ...]:
    """What storages sharing an engine must have in common (the engine's options but the group, ``verify`` and
    ``faults``): ranks, ranks per node, engine rows, bytes per row of each weight kind, experts, mirror, device."""
    st = storage
    first = st._alloc[st.names[0]]
    return (st.world, st.local_world, st.rank, int(st._engine_rows), st.num_experts,
            tuple(_row_bytes(st)), st.mirror is not None, str(first.device))


class _Range:
    """One shared engine: the storage serials ``[lo, hi]`` of one kind it serves (engine layers ``2 (s - lo)`` and
    ``2 (s - lo) + 1`` for serial ``s``), the group and ``verify`` it was made with, and the serials still using it
    (constructed, neither closed nor collected)."""

    __slots__ = ("engine", "lo", "hi", "group", "verify", "users")

    def __init__(self, engine: Any, lo: int, hi: int, group: Any, verify: bool, users: Set[int]) -> None:
        self.engine, self.lo, self.hi, self.group, self.verify, self.users = engine, lo, hi, group, verify, users


# Per storage kind (``_kind``): storages constructed so far, the serials not yet closed or collected, and the
# shared engines made, in serial order.
_SERIALS: Dict[Tuple[Any, ...], int] = {}
_LIVE: Dict[Tuple[Any, ...], Set[int]] = {}
_RANGES: Dict[Tuple[Any, ...], List[_Range]] = {}
_COVERED: Dict[Tuple[Any, ...], int] = {}  # the last serial any shared engine covered (closed ones included)


def enroll(storage: Any) -> Tuple[Tuple[Any, ...], int]:
    """Gives a newly constructed storage its serial among the storages of its kind (the module documentation's
    "One engine for the layers"); returns ``(kind, serial)``. Local: no collective."""
    _close_idle()
    kind = _kind(storage)
    serial = _SERIALS.get(kind, 0)
    _SERIALS[kind] = serial + 1
    _LIVE.setdefault(kind, set()).add(serial)
    weakref.finalize(storage, _release, kind, serial, False)
    return kind, serial


# Shared engines whose last storage was collected: closed at the next enroll, sync or close on a trainer thread
# (a collection may run on the engine's own bridge thread, which closing the engine joins), or at exit.
_IDLE: List[Any] = []


def _close_idle() -> None:
    while _IDLE:
        _IDLE.pop().close()


def _release(kind: Tuple[Any, ...], serial: int, now: bool = True) -> None:
    """Serial ``serial`` of ``kind`` no longer uses a shared engine (its storage closed its engine, ``now``, or was
    collected); the engine of its range closes when it was the last (``now``: at once, else at the next
    :func:`_close_idle`). Idempotent."""
    live = _LIVE.get(kind)
    if live is not None:
        live.discard(serial)
    for r in _RANGES.get(kind, ()):
        if r.lo <= serial <= r.hi and serial in r.users:
            r.users.discard(serial)
            if not r.users:
                _RANGES[kind].remove(r)
                _IDLE.append(r.engine)
                if now:
                    _close_idle()
            return


@atexit.register
def _close_at_exit() -> None:
    _close_idle()


def shared_engines() -> List[Dict[str, Any]]:
    """The shared engines open in this process: per engine the storage serials it serves (``lo``, ``hi``) and how
    many storages still use it (``users``). For tests and telemetry."""
    return [{"lo": r.lo, "hi": r.hi, "users": len(r.users)} for rs in _RANGES.values() for r in rs]


def _new_engine(st: Any, group: Any, timeout: float, num_layers: int, faults: Any) -> Any:
    """A transfer engine for storages like ``st`` with ``num_layers`` engine layers (a collective over ``group``:
    the tag space)."""
    pg = group if group is not None else dist.group.WORLD
    mine = torch.tensor([_next_space[0]], dtype=torch.int64)
    space = int(gather_rows(mine, pg, timeout, "ExpertStorage: the transfer engine's tag space").max())
    _next_space[0] = space + 1
    topo = foremoe.Topology(st.world // st.local_world, st.local_world, st._engine_rows)
    cuda = backend_fields(st)
    if cuda and st.world == 1:
        pg = None  # nothing to pair: the engine drives the one GPU
    return TransferEngine(topology=topo, num_layers=num_layers, num_experts=st.num_experts, tensors=_row_bytes(st),
                          verify=st.verify, faults=faults, host_mirror=st.mirror is not None,
                          host_threads_per_path=1, group=pg, bridge_timeout=timeout, tag_space=space, **cuda)


def _shared(st: Any, group: Any, timeout: float) -> Optional[Tuple[_Range, int]]:
    """The shared engine of ``st``'s range and ``st``'s first engine layer on it, making the engine when ``st`` is
    the first of its range to sync; None when ``st`` gets an engine of its own (the module documentation). The
    decision reads only what every rank has alike (serials, group, ``verify``, ``faults``)."""
    _close_idle()
    share = getattr(st, "_share", None)
    if share is None or st.faults is not None:
        return None
    kind, serial = share
    ranges = _RANGES.setdefault(kind, [])
    for r in ranges:
        if r.lo <= serial <= r.hi:
            if r.group is not group or r.verify != st.verify or serial not in r.users:
                return None
            return r, 2 * (serial - r.lo)
    covered = _COVERED.get(kind, -1)
    if serial <= covered:  # its range's engine has closed since (every storage of it closed or was collected)
        return None
    lo, hi = covered + 1, _SERIALS[kind] - 1
    engine = _new_engine(st, group, timeout, 2 * (hi - lo + 1), None)
    users = {s for s in _LIVE.get(kind, ()) if lo <= s <= hi}
    r = _Range(engine, lo, hi, group, st.verify, users)
    ranges.append(r)
    _COVERED[kind] = hi
    return r, 2 * (serial - lo)


class EngineMover:
    """One storage's engine layers on this rank's transfer engine (see the module documentation): a shared engine's
    pair, or an engine of its own. Made at the first sync with moves (a collective over ``group`` when it makes an
    engine: every rank gets there at the same sync, since the bookkeeping is the same everywhere)."""

    def __init__(self, storage: Any, group: Any, timeout: float) -> None:
        st = storage
        self.faults, self.verify = st.faults, st.verify
        rows = st._engine_rows
        first = st._alloc[st.names[0]]
        self._share = st._share
        shared = _shared(st, group, timeout)
        self._range: Optional[_Range] = None
        if shared is not None:
            self._range, self.layer = shared
            self.engine = self._range.engine
        else:
            # Engine layer 0: the weights (moves); layer 1: the gradients (GradReducer's reductions), whose resident
            # table changes per reduction while a prefetch's moves may still run on layer 0.
            self.layer = 0
            self.engine = _new_engine(st, group, timeout, 2, _sparing(st.faults))
        self.grad_layer = self.layer + 1
        self.engine.register_slots(self.layer, st.rank, [st._alloc[n] for n in st.names])
        self.storage_rows = first
        if st.mirror is not None:
            views = [st.mirror.tensors[n] for n in st.names]
            node = st.rank // st.local_world
            self.engine.register_mirror(self.layer, node, views, node_mirror=getattr(st.mirror, "_m", None))
        # The owner rows of every rank: the only copies the engine may read at the start of a batch.
        self.owner_table = np.full((st.world, rows), -1, dtype=np.int32)
        for g in range(st.world):
            self.owner_table[g, :st.owned[g].size] = st.owned[g]

    def fits(self, storage: Any) -> bool:
        """Whether the engine was made with the storage's current ``faults`` and ``verify`` (the same on every
        rank: the storage remakes it otherwise)."""
        return self.faults is storage.faults and self.verify == storage.verify

    @property
    def shared(self) -> bool:
        """Whether this storage's engine layers lie on an engine shared with other storages."""
        return self._range is not None

    def close(self) -> None:
        """Leaves the engine: an own engine closes; a shared one when this storage was the last of its range."""
        if self._range is None:
            self.engine.close()
        else:
            _release(*self._share)

    def submit(self, moves: np.ndarray, timeout: float) -> Any:
        """Starts the batch ``moves`` ``[n, 4]`` (expert, source rank, destination rank, destination engine slot),
        the same on every rank, reading only owner rows; returns the ticket."""
        self.engine.set_resident(self.layer, self.owner_table)
        ready = _ready_event(self.storage_rows)  # CUDA: the owner rows' writes and the rows' readers queued so far
        return self.engine.submit(np.ascontiguousarray(moves, dtype=np.int32), self.layer, sources_ready=ready,
                                  slots_free=ready, timeout=timeout)

    def finish(self, ticket: Any, timeout: float) -> Tuple[Optional[str], List[Dict[str, Any]]]:
        """Waits for ``ticket`` (at most ``timeout`` seconds past its own deadline, then aborts it); returns the
        failure's message (None when every move landed) and the per-move telemetry."""
        return _finish(ticket, timeout)


def _sparing(faults: Any) -> Any:
    """A copy of ``faults`` (a :class:`foremoe.FaultSchedule` or None) with ``spare_reductions`` set: the injector acts
    on the moves alone, with the decisions it takes on an engine without reductions, and never on the replica
    gradients the same engine reduces (a corrupted one is caught with ``verify`` but, from another rank, fails the
    step instead of being retried)."""
    if faults is None:
        return None
    out = type(faults)(**{f: getattr(faults, f) for f in type(faults).fields()})
    out.spare_reductions = True
    return out


def _finish(ticket: Any, timeout: float) -> Tuple[Optional[str], List[Dict[str, Any]]]:
    """:meth:`EngineMover.finish` for any ticket (moves or a reduction)."""
    error = None
    try:
        ticket.wait(timeout=timeout)
    except TimeoutError:
        ticket.abort()
        try:
            ticket.wait(timeout=timeout)
        except (TransferError, TimeoutError) as e:
            error = str(e)
        error = error or "the batch did not end within its deadline"
    except TransferError as e:
        error = str(e)
    try:
        tel = ticket.telemetry()
    except RuntimeError:
        tel = []
    return error, tel


#: Gradient dtypes the engine's reductions add (``GradType``): the weight kinds of a storage share one of them.
GRAD_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_cuda_engine(world: int) -> None:
    """Raises ``ValueError`` unless this ``foremoe._core`` can move CUDA slot storage (``engine.cuda_build_gap``)."""
    gap = cuda_build_gap(world)
    if gap is not None:
        raise ValueError(f"ExpertStorage: the weights are CUDA tensors, which move on the transfer engine's CUDA "
                         f"backend; {gap}")


def backend_fields(storage: Any) -> Dict[str, Any]:
    """The ``EngineOptions`` fields that pick the backend of ``storage``'s engine: none for CPU rows (the host
    backend); for CUDA rows the CUDA backend, this rank driving its one GPU (its rows' device) and the other ranks'
    GPUs belonging to other processes (``-1``)."""
    device = storage._alloc[storage.names[0]].device
    if device.type != "cuda":
        return {}
    device_of = [-1] * storage.world
    device_of[storage.rank] = device.index if device.index is not None else torch.cuda.current_device()
    return dict(backend="cuda", cuda_device_of_gpu=device_of)


def _ready_event(t: torch.Tensor) -> Any:
    """A ``torch.cuda.Event`` recorded now on the current stream of ``t``'s device (the work queued so far that
    writes or reads the rows a batch touches), None for CPU tensors (the host backend's batches start at once)."""
    if t.device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(t.device))
    return ev


class GradReducer:
    """One storage's replica-gradient reductions on this rank, on the storage's transfer engine (:class:`EngineMover`'s,
    made if there is none yet: a collective over ``group``), its second engine layer. The engine's fault injector spares
    reductions (``FaultSchedule.spare_reductions``, set by :class:`EngineMover`), so faults meant for the moves never
    fail a step (with ``verify`` a corrupted gradient is caught, never added, but one from another rank can only be
    sent again by running the reductions again) and the moves keep the decisions of an engine without
    reductions.

    Each gradient kind has a ``[engine rows, ...]`` tensor registered with the engine (split layout, the storage's
    dtype). A reduction writes this rank's owner gradients that receive additions into their owner rows (all owner
    rows in one copy when most receive) and the replica gradients it returns into rows after them, declares with
    ``set_resident`` which row of every rank holds which returning expert (the owner rows hold the owned experts;
    nothing else is resident, so exactly the returning pairs are read, without a ``returns`` selection, whose
    zeroing of the returned rows the next reduction's writes make useless), submits ``submit_reduce`` and waits: the
    engine adds each expert's replicas into its owner's row in a fixed order, the owner's own first, then the
    replicas by rank ascending, experts ascending: the order of the Python path. A rank that neither sends nor
    receives in a reduction does not submit it (the injector spares reductions, so their serials decide nothing).
    When more gradients return from a rank than it has rows after its owner rows, the returns are split into
    several reductions by expert (all replicas of an expert in one), one after another."""

    def __init__(self, storage: Any, group: Any, timeout: float) -> None:
        st = storage
        self.mover = st._engine_mover(group, timeout)
        self.engine = self.mover.engine
        rows = st._engine_rows
        self.grads = [torch.zeros_like(st._alloc[n]) for n in st.names]
        self.layer = self.mover.grad_layer
        self.engine.register_grads(self.layer, st.rank, self.grads)
        self.first_free = st.num_owned_by.astype(np.int64)  # a rank's first row after its owner rows
        self.room = rows - self.first_free  # rows a reduction may use per rank for returning replicas
        self.owner_gpu = st.owners.astype(np.int32)
        self.own_row = st.own_row  # an owned expert's row on its owner
        self.rank = st.rank
        self.reductions = 0  # reductions run (the same count on every rank, submitted or skipped)
        self.unverified = False  # the last reduce's failures were all checksum mismatches (see reduce)

    def batches(self, pairs: Sequence[Tuple[int, int]]) -> List[List[Tuple[int, int]]]:
        """``pairs`` (expert, holder rank), ascending, in reductions that fit every rank's rows, each expert's
        replicas in one reduction, experts ascending over the reductions."""
        out: List[List[Tuple[int, int]]] = []
        used = np.zeros_like(self.room)
        i = 0
        while i < len(pairs):
            j = i
            while j < len(pairs) and pairs[j][0] == pairs[i][0]:
                j += 1
            holders = [g for _, g in pairs[i:j]]
            if not out or np.any(used[holders] + 1 > self.room[holders]):
                out.append([])
                used[:] = 0
            used[holders] += 1
            out[-1].extend(pairs[i:j])
            i = j
        return out

    def reduce(self, owner_grads: Sequence[torch.Tensor], pairs: Sequence[Tuple[int, int]],
               mine: Dict[int, Optional[Sequence[torch.Tensor]]], timeout: float) -> Tuple[Optional[str],
                                                                                          List[torch.Tensor]]:
        """Adds the returning replica gradients ``pairs`` (expert, holder rank), ascending and the same on every
        rank, into the owners': ``owner_grads`` this rank's ``[owned, ...]`` per kind, ``mine`` expert -> the
        gradients per kind of the pairs this rank holds (None: zeros). Every rank calls it with the same ``pairs``.
        Returns (this rank's first failure or None, this rank's owner gradients with the replicas added: new tensors
        where some row received an addition, ``owner_grads``' own otherwise). :attr:`unverified` says whether the
        failures were all gradients whose checksum did not match (nothing of their experts was added; calling again
        with the same arguments, on every rank, starts over from ``owner_grads``)."""
        grads, nk = self.grads, len(self.grads)
        rank, owner_gpu = self.rank, self.owner_gpu
        # Only the owner rows that receive an addition travel through the engine's rows and back; when most do,
        # all of them in one copy each way.
        rows = sorted({int(self.own_row[e]) for e, _ in pairs if owner_gpu[e] == rank})
        n = int(owner_grads[0].shape[0]) if nk else 0
        bulk = 2 * len(rows) > n
        for k in range(nk):
            if bulk:
                grads[k][:n].copy_(owner_grads[k])
            else:
                for r in rows:
                    grads[k][r].copy_(owner_grads[k][r])
        error = None
        self.unverified = True
        for batch in self.batches(pairs):
            self.reductions += 1
            if not any(g == rank or owner_gpu[e] == rank for e, g in batch):
                continue  # nothing to send or receive here
            table = self.mover.owner_table.copy()  # the owner rows hold the owned experts
            free = self.first_free.copy()
            for e, g in batch:
                row = int(free[g])
                free[g] += 1
                table[g, row] = e
                if g == rank:
                    src = mine.get(e)
                    for k in range(nk):
                        if src is None:
                            grads[k][row].zero_()
                        else:
                            grads[k][row].copy_(src[k])
            try:
                self.engine.set_resident(self.layer, table)
                ticket = self.engine.submit_reduce(self.layer, owner_gpu, grads_ready=_ready_event(grads[0]),
                                                   timeout=timeout)
            except (ValueError, RuntimeError) as e:
                error = error or str(e)
                self.unverified = False
                continue
            err, tel = _finish(ticket, timeout)
            if err is not None:  # retryable when every unadded gradient did not verify or waited on one that did not
                bad = [m for m in tel if not m.get("ok", False) and not m.get("remote", False)]
                self.unverified = (self.unverified and any(m.get("verify_failures", 0) > 0 for m in bad)
                                   and all(m.get("verify_failures", 0) > 0 or m.get("verified", False) for m in bad))
            error = error or err
        if not rows:
            return error, list(owner_grads)
        if bulk:
            return error, [grads[k][:n].clone() for k in range(nk)]
        out = [t.clone() for t in owner_grads]
        for k in range(nk):
            for r in rows:
                out[k][r].copy_(grads[k][r])
        return error, out
