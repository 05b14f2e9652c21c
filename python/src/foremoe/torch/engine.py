"""The runtime's transfer engine on torch tensors, without copies.

A :class:`TransferEngine` executes one layer's weight moves (from a :class:`foremoe.Plan`) into expert slot
storage that the trainer owns: CPU tensors with the ``host`` backend, CUDA tensors with the ``cuda`` backend (when
the extension was built with ``FOREMOE_PYTHON_CUDA=ON``). Tensors are registered by address through DLPack and
never copied; the engine keeps them alive until it is destroyed. Each submitted batch gives a :class:`Ticket`
(``poll``, ``wait(timeout)``, ``abort``, ``enqueue_wait(stream)``, ``telemetry``); every wait has a deadline.

Options are the C++ ``EngineOptions`` fields (``EngineOptions.fields()``), given as keywords::

    eng = TransferEngine(topology=foremoe.Topology(1, 4, 3), num_layers=2, num_experts=8,
                         expert_bytes=slots.shape[-1] * slots.element_size())
    eng.register_slots(layer, gpu, slots)        # [slots, ...] (or [2, slots, ...] double-buffered)
    eng.register_mirror(layer, node, mirror)     # [experts, ...]
    # or split, one tensor per EngineOptions.tensors entry (tensors=[bytes_a, bytes_b]; e.g. one per weight kind):
    #   eng.register_slots(layer, gpu, [w_a, w_b]) with w_a [slots, ...], w_b [slots, ...]; register_mirror with
    #   [m_a, m_b] ([experts, ...] each), views inside a node-shared segment with node_mirror=segment
    eng.set_resident(layer, placement)           # what the slots hold now
    eng.submit(plan, layer).wait(timeout=10.0)   # the plan's moves of that layer

Multi-process use (one engine per rank, every rank submitting the same batches in the same order): give
``group=`` a ``torch.distributed`` process group (gloo, CPU tensors, ``backend="host"``). Rank ``r`` of the group
drives GPUs ``r*k .. r*k+k-1`` of the topology (``k`` = GPUs / group size), and the engine's paired transfers
with other ranks' GPUs run as point-to-point ``send``/``recv`` on that group through a bridge the engine drives
(``PeerBridge`` in ``foremoe/runtime/transport.hpp``); pairing, headers, verification, deadlines and telemetry stay
the engine's. Every exchange waits at most ``bridge_timeout`` seconds; an exchange that failed (a rank that died,
a timeout) fails every later one at once, since the pairing with that rank is then unknown (gloo itself closes the
connection whose wait timed out, so the group is unusable afterwards, as an aborted NCCL communicator is). A rank that aborts a
batch (or whose batch timed out) still sends, marking its copies not valid, so the other ranks fail at once naming
its GPU. Close the engine (``close()``) before destroying the group.

With ``backend="cuda"`` and ``group=`` (gloo or nccl), each rank drives exactly one GPU (rank ``r``: GPU ``r``; the
topology's GPUs must equal the group's size) and the engine's paired transfers are ``ncclSend``/``ncclRecv`` on an
NCCL communicator of the engine's own: construction is a collective, in which rank 0 makes an NCCL unique id,
broadcasts it over ``group`` (a CPU tensor on gloo, a CUDA tensor on the current device on nccl) and every rank
creates its rank of a non-blocking communicator on its device (``cuda_device_of_gpu[r]`` if given, else
``torch.cuda.current_device()``), all within ``bridge_timeout`` seconds (past it the communicator is aborted and the
constructor raises :class:`TimeoutError` naming the rank). The trainer's own NCCL communicators are never used: an
NCCL communicator must not be used from two threads at once, and the engine's progress thread drives its own, so
every engine gets one of its own, and ``tag_space`` (which keeps engines sharing a gloo group apart) is accepted and
ignored. The engine owns the communicator and destroys it in ``close()``, after the engine itself.

A batch that ends without every move landing raises :class:`TransferError` (``code``: ``device_error``,
``timed_out`` or ``aborted``); a slot the engine calls valid (:meth:`TransferEngine.resident`) always holds its
expert's exact bytes.
"""

from __future__ import annotations

import atexit
import datetime
import time
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .. import _core
from .._args import INT64_MAX, describe, int_array, int_list, integer, optional_integer
from .._core import EngineOptions, FaultSchedule, HostEvent

__all__ = [
    "EngineOptions",
    "FaultSchedule",
    "HostEvent",
    "Ticket",
    "TransferEngine",
    "TransferError",
    "Workspace",
    "count_loads",
    "map_tokens",
    "runtime_build_info",
]

#: Seconds a batch may run before it ends ``timed_out`` (``submit``), and a ``wait`` blocks at most (``wait``).
DEFAULT_TIMEOUT = 10.0


def runtime_build_info() -> Dict[str, Any]:
    """How the runtime inside ``foremoe._core`` was built: ``cuda_compiled``, ``nccl_compiled``, ``num_devices``."""
    return _core.runtime_build_info()


class TransferError(RuntimeError):
    """A batch ended without every move landing.

    ``code`` is the runtime's status (``device_error``: a copy failed on every attempt; ``timed_out``: the batch's
    own deadline passed; ``aborted``); ``state`` the ticket's final state. Slots whose move did not land are not
    valid (:meth:`TransferEngine.resident`); the others hold their expert's exact bytes.
    """

    def __init__(self, code: str, message: str, state: str) -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.state = state


def _raise_status(code: str, message: str, state: str) -> None:
    if code == "ok":
        return
    if code == "invalid_argument":
        raise ValueError(message)
    raise TransferError(code, message, state)


class Ticket:
    """One submitted batch. ``state`` is ``pending``, ``done``, ``failed``, ``timed_out`` or ``aborted``."""

    __slots__ = ("_t",)

    def __init__(self, core_ticket: Any) -> None:
        self._t = core_ticket

    @property
    def state(self) -> str:
        return self._t.state

    def poll(self) -> bool:
        """False while the batch runs, True when every move landed; raises :class:`TransferError` if it failed."""
        code, message = self._t.status()
        if code == "in_progress":
            return False
        _raise_status(code, message, self._t.state)
        return True

    def wait(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Blocks until the batch ends, at most ``timeout`` seconds.

        Raises :class:`TimeoutError` if the batch still runs then (it keeps running: wait again or :meth:`abort`),
        :class:`TransferError` if it ended without every move landing.
        """
        code, message = self._t.wait(float(timeout))
        if code == "timed_out":
            code, message = self._t.status()  # the wait's deadline, or the batch's own?
            if code == "in_progress":
                raise TimeoutError(f"wait: the batch is still running after {timeout} s (it keeps running: wait "
                                   "again or abort())")
        _raise_status(code, message, self._t.state)

    def abort(self) -> None:
        """Stops issuing copies; the batch ends ``aborted`` (moves that did not land leave their slots invalid)."""
        self._t.abort()

    def enqueue_wait(self, stream: Any = None) -> None:
        """CUDA backend: makes ``stream`` (a ``torch.cuda.Stream``, a raw ``cudaStream_t`` int, or None for the
        current stream) wait for the end of the batch without blocking the host. The stream is released also when
        the batch fails; check :meth:`poll` afterwards."""
        if self._t.backend != "cuda":
            raise RuntimeError("enqueue_wait: the engine runs the host backend, which has no streams (use wait() or "
                               "poll(), or create the engine with backend='cuda')")
        if stream is None:
            stream = torch.cuda.current_stream()
        handle = stream if isinstance(stream, int) else getattr(stream, "cuda_stream", None)
        if not isinstance(handle, int):
            raise TypeError(f"enqueue_wait: stream must be a torch.cuda.Stream or an int handle, got "
                            f"{type(stream).__name__}")
        code, message = self._t.enqueue_wait(handle)
        _raise_status(code, message, self._t.state)

    def telemetry(self) -> List[Dict[str, Any]]:
        """Per move: ``path``, ``num_bytes``, ``start_seconds``/``end_seconds`` since submit, ``gb_per_s``,
        ``num_chunks``, ``attempts`` (more than ``num_chunks``: retried), ``ok``, ``verified``, ``remote`` (the
        destination is another rank's GPU), ``verify_failures`` (landed copies whose checksum did not match, each
        copied again) and ``fallback`` (the move landed from the host mirror after an attempt on another path failed
        or did not verify); the last two are counted by the destination's rank."""
        return self._t.telemetry()

    def __repr__(self) -> str:
        return f"Ticket(state={self.state!r})"


def _borrow(t: Any, what: str, device: str) -> Any:
    """``t`` as an object DLPack reads in place (a tensor that requires grad is detached, which shares memory)."""
    if isinstance(t, np.ndarray):
        if device != "cpu":
            raise ValueError(f"{what} must be a CUDA tensor (CUDA backend), got a NumPy array")
        return t
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != device:
        raise ValueError(f"{what} must be a {device} tensor ({'host' if device == 'cpu' else 'CUDA'} backend), "
                         f"got a tensor on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous (shape {tuple(t.shape)}, strides {t.stride()}): registering a "
                         "copy would leave the engine writing memory nobody reads; pass .contiguous() and keep it")
    return t.detach() if t.requires_grad else t


def _gate(g: Any, name: str) -> Any:
    if g is None or isinstance(g, (HostEvent, int)):
        return g
    handle = getattr(g, "cuda_event", None)  # torch.cuda.Event
    if isinstance(handle, int):
        if handle == 0:
            raise ValueError(f"submit: {name} is a torch.cuda.Event that was never recorded")
        return handle
    raise TypeError(f"submit: {name} must be None, a HostEvent or a torch.cuda.Event, got {type(g).__name__}")


def _numpy(t: torch.Tensor) -> np.ndarray:
    # Through DLPack, not Tensor.numpy(): a torch built against NumPy 1.x cannot hand arrays to NumPy 2.
    return np.from_dlpack(t.detach().cpu().contiguous())


def _int_array(x: Any, what: str) -> np.ndarray:
    return int_array(_numpy(x) if isinstance(x, torch.Tensor) else x, what, dtype=np.int32)


#: Seconds one exchange of the process-group bridge may wait for its peer (``TransferEngine(bridge_timeout=)``).
DEFAULT_BRIDGE_TIMEOUT = 60.0

#: Bytes of an NCCL unique id (``NCCL_UNIQUE_ID_BYTES``; the runtime refuses any other size).
_NCCL_UNIQUE_ID_BYTES = 128

# Point-to-point tags of the bridge on the group: TAG_BASE + source GPU * GPUs + destination GPU, so that messages
# between two GPUs pair up in posting order (the engine's rule) and stay apart from the trainer's own traffic.
_TAG_BASE = 1 << 24


class _GroupBridge:
    """Runs the engine's paired transfers over a ``torch.distributed`` group, called on the bridge's worker thread
    with the GIL held (``Work.wait`` releases it). ``post`` posts one group's sends and receives without waiting
    (the worker posts every queued group before it waits for the oldest, so the engine's rounds overlap);
    ``finish`` waits for them within the deadline and returns the receives' headers, in order, or raises naming
    the peer. Bytes go from and into the engine's memory without a copy; each operation's 16-byte header travels
    as its own message on a tag of its own. ``finish`` waits for every operation of the group, also after one
    failed, so nothing writes into the engine's memory after the group ended (a failed or timed-out gloo wait
    closes its connection)."""

    def __init__(self, pg: Any, num_gpus: int, timeout: float, tag_space: int = 0) -> None:
        self.pg = pg
        self.tag_base = _TAG_BASE + 2 * num_gpus * num_gpus * tag_space
        self.rank = pg.rank()
        self.per_rank = num_gpus // pg.size()
        self.num_gpus = num_gpus
        self.timeout = timeout
        self.failed: Optional[str] = None

    def post(self, ops: List[Any]) -> Any:
        if self.failed is not None:
            raise RuntimeError(f"rank {self.rank}: an earlier exchange failed, so the pairing with its peer is "
                               f"unknown: {self.failed}")
        deadline = time.monotonic() + self.timeout
        G = self.num_gpus
        posted, heads = [], []
        for send, local, peer, buf, h0, h1 in ops:
            rank = peer // self.per_rank
            tag = self.tag_base + (local * G + peer if send else peer * G + local)
            data = torch.from_numpy(buf)
            works = []
            try:
                if send:
                    head = torch.from_numpy(np.array([h0, h1], dtype=np.uint64).view(np.uint8))
                    works.append(self.pg.send([head], rank, tag + G * G))
                    works.append(self.pg.send([data], rank, tag))
                else:
                    head = torch.empty(16, dtype=torch.uint8)
                    works.append(self.pg.recv([head], rank, tag + G * G))
                    works.append(self.pg.recv([data], rank, tag))
                    heads.append(head)
            except RuntimeError as e:  # e.g. the peer's connection is closed: end what was posted, then fail
                posted.append((works, rank, local, peer, send))
                error = self._failure(e, rank, local, peer, send)
                self._wait_all(deadline, posted)
                raise error from None
            posted.append((works, rank, local, peer, send))
        return deadline, posted, heads

    def finish(self, state: Any) -> List[Tuple[int, int]]:
        deadline, posted, heads = state
        error = self._wait_all(deadline, posted)
        if error is not None:
            raise error
        return [tuple(int(v) for v in h.numpy().view(np.uint64)) for h in heads]

    def _wait_all(self, deadline: float, posted: List[Any]) -> Optional[BaseException]:
        """Waits for every posted operation (also after one failed); the first failure, or None."""
        error: Optional[BaseException] = None
        for works, rank, local, peer, send in posted:
            for work in works:
                try:
                    work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
                except RuntimeError as e:
                    error = error or self._failure(e, rank, local, peer, send)
        return error

    def _failure(self, e: BaseException, rank: int, local: int, peer: int, send: bool) -> BaseException:
        """The error naming the exchange; later groups fail at once with it."""
        where = (f"rank {self.rank}: {'send to' if send else 'receive from'} rank {rank} (GPU {local} "
                 f"{'->' if send else '<-'} GPU {peer})")
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "timed out" in text.lower() or "timeout" in text.lower():
            self.failed = self.failed or f"{where}: no answer within the bridge's {self.timeout:g} s deadline ({text})"
            return TimeoutError(self.failed)
        self.failed = self.failed or f"{where} failed: {text}"
        return RuntimeError(self.failed)


def _bridge_of(group: Any, options: EngineOptions, timeout: float, tag_space: int = 0) -> _GroupBridge:
    """Checks ``group`` against the options and sets ``local_gpus``; returns the bridge's runner."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("TransferEngine: group= needs an initialised torch.distributed (init_process_group)")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"TransferEngine: group must be a torch.distributed ProcessGroup, got {describe(group)}")
    backend = dist.get_backend(group)
    if backend == "nccl":
        raise ValueError("TransferEngine: an nccl group carries CUDA tensors: give backend='cuda' (the engine then "
                         "makes an NCCL communicator of its own), or a gloo group for the host backend")
    if backend != "gloo":
        raise ValueError(f"TransferEngine: group= runs CPU tensors over gloo; this group's backend is {backend!r}")
    if options.backend != "host":
        raise ValueError(f"TransferEngine: group= runs on the host backend (CPU tensors); backend is "
                         f"{options.backend!r}")
    if not (timeout > 0 and timeout < 1e7):
        raise ValueError(f"TransferEngine: bridge_timeout must be positive seconds, got {timeout!r}")
    gpus, size, rank = options.topology.num_gpus, group.size(), group.rank()
    if gpus % size != 0 or gpus < size:
        raise ValueError(f"TransferEngine: the group has {size} ranks but the topology {gpus} GPUs; each rank "
                         f"drives the same number of GPUs, so the group's size must divide the topology's GPUs")
    k = gpus // size
    mine = list(range(rank * k, rank * k + k))
    if options.local_gpus and list(options.local_gpus) != mine:
        raise ValueError(f"TransferEngine: local_gpus {list(options.local_gpus)} disagrees with rank {rank} of a "
                         f"{size}-rank group over {gpus} GPUs, which drives GPUs {mine}")
    tag_space = integer(tag_space, "TransferEngine: tag_space", 0)
    if _TAG_BASE + 2 * gpus * gpus * (tag_space + 1) > 2**31 - 1:
        raise ValueError(f"TransferEngine: tag_space {tag_space} puts the bridge's point-to-point tags of {gpus} GPUs "
                         f"past 2**31 - 1 (at most {(2**31 - 1 - _TAG_BASE) // (2 * gpus * gpus) - 1})")
    options.local_gpus = mine
    return _GroupBridge(group, gpus, float(timeout), tag_space)


_CUDA_REBUILD = ("rebuild it with the CUDA backend: "
                 "pip install ./python --config-settings=cmake.define.FOREMOE_PYTHON_CUDA=ON")


def cuda_build_gap(ranks: int, *, communicator: bool = False) -> Optional[str]:
    """Why this ``foremoe._core`` cannot run the transfer engine's CUDA backend for ``ranks`` processes that exchange
    rows, or None when it can: NCCL is needed when there is more than one, or when the engine makes its NCCL
    communicator anyway (``communicator``: ``TransferEngine(backend="cuda", group=...)`` does, also for a group of
    one). The one build check behind ``ExpertStorage``'s refusal of CUDA weights and that ``TransferEngine``'s."""
    info = runtime_build_info()
    if not info.get("cuda_compiled"):
        return (f"this foremoe._core was built without the runtime's CUDA backend (FOREMOE_PYTHON_CUDA=ON); "
                f"{_CUDA_REBUILD}")
    if (ranks > 1 or communicator) and not info.get("nccl_compiled"):
        who = f"{ranks} ranks exchange CUDA rows" if ranks > 1 else "a group of one rank still exchanges CUDA rows"
        return (f"{who} over the transfer engine's NCCL communicator, and this foremoe._core was built without "
                f"NCCL; {_CUDA_REBUILD} on a machine where CMake finds NCCL (cmake/FindNCCL.cmake)")
    return None


def _nccl_comms_of(group: Any, options: EngineOptions, timeout: float, tag_space: int = 0) -> List[Any]:
    """The CUDA backend over ``group``: checks the group against the options, makes this rank's NCCL communicator
    from a unique id rank 0 broadcasts over ``group``, and sets ``local_gpus``, ``cuda_device_of_gpu`` and
    ``nccl_rank_of_gpu``; returns the communicators per GPU (this rank's, None for the others) for the engine."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("TransferEngine: group= needs an initialised torch.distributed (init_process_group)")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"TransferEngine: group must be a torch.distributed ProcessGroup, got {describe(group)}")
    backend = str(dist.get_backend(group))
    if "gloo" not in backend and "nccl" not in backend:
        raise ValueError(f"TransferEngine: backend='cuda' with group= broadcasts the NCCL unique id over a gloo or "
                         f"nccl group; this group's backend is {backend!r}")
    if not (timeout > 0 and timeout < 1e7):
        raise ValueError(f"TransferEngine: bridge_timeout must be positive seconds, got {timeout!r}")
    integer(tag_space, "TransferEngine: tag_space", 0)  # accepted and unused: the communicator is the engine's own
    gpus, size, rank = options.topology.num_gpus, group.size(), group.rank()
    if gpus != size:
        raise ValueError(f"TransferEngine: backend='cuda' with group= drives one GPU per rank, so the topology's GPUs "
                         f"must equal the group's ranks; the topology has {gpus} GPUs and the group {size} ranks")
    if options.local_gpus and list(options.local_gpus) != [rank]:
        raise ValueError(f"TransferEngine: local_gpus {list(options.local_gpus)} disagrees with rank {rank} of the "
                         f"group, which drives GPU {rank} (backend='cuda': one GPU per rank)")
    devices = list(options.cuda_device_of_gpu)
    if devices and len(devices) != gpus:
        raise ValueError(f"TransferEngine: cuda_device_of_gpu has {len(devices)} entries for {gpus} GPUs")
    if devices and devices[rank] < 0:
        raise ValueError(f"TransferEngine: cuda_device_of_gpu[{rank}] is {devices[rank]}, but rank {rank} drives GPU "
                         f"{rank}: give its device ordinal")
    gap = cuda_build_gap(gpus, communicator=True)
    if gap is not None:
        raise RuntimeError(f"TransferEngine: backend='cuda' with group=: {gap}")
    if runtime_build_info()["num_devices"] == 0 or not torch.cuda.is_available():
        raise RuntimeError(f"TransferEngine: backend='cuda' with group=: rank {rank} sees no CUDA device")
    device = devices[rank] if devices else torch.cuda.current_device()
    # Rank 0's unique id to every rank, over the trainer's group (on nccl groups a CUDA tensor).
    uid = _core.nccl_unique_id() if rank == 0 else bytes(_NCCL_UNIQUE_ID_BYTES)
    on = torch.device("cpu") if "gloo" in backend else torch.device("cuda", torch.cuda.current_device())
    buf = torch.tensor(list(uid), dtype=torch.uint8, device=on)
    try:
        group.broadcast(buf, 0).wait(datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        kind = TimeoutError if "timed out" in text.lower() or "timeout" in text.lower() else RuntimeError
        raise kind(f"TransferEngine: rank {rank}: broadcasting the NCCL unique id over the group failed: "
                   f"{text}") from None
    uid = _numpy(buf).tobytes()
    comm = _core.NcclCommunicator(uid, size, rank, device, float(timeout))
    options.local_gpus = [rank]
    options.cuda_device_of_gpu = [device if g == rank else -1 for g in range(gpus)]
    options.nccl_rank_of_gpu = list(range(gpus))
    return [comm if g == rank else None for g in range(gpus)]


# Engines with a group bridge or an NCCL communicator still open: closed at interpreter exit, while the bridge's
# worker thread can still take the GIL (after finalization began it could not, and the engine's destruction would
# wait for it) and while CUDA and NCCL can still destroy the communicator.
_BRIDGED: "weakref.WeakSet[TransferEngine]" = weakref.WeakSet()


@atexit.register
def _close_bridged() -> None:
    for e in list(_BRIDGED):
        e.close()


class TransferEngine:
    """The runtime's transfer engine over torch tensors (see the module's documentation).

    Args:
        options: an :class:`EngineOptions`, or None to build one from ``fields``.
        group: a ``torch.distributed`` process group: one engine per rank (see the module's documentation). Host
            backend: a gloo group, the paired transfers over it; ``backend="cuda"``: a gloo or nccl group, one GPU
            per rank, the paired transfers over an NCCL communicator of the engine's own made over the group (a
            collective). None: one engine drives every GPU.
        bridge_timeout: seconds one exchange over ``group`` waits for its peer before it fails ``timed_out``
            (``backend="cuda"``: the bound of the communicator's creation and of its destruction).
        tag_space: with ``group`` and the host backend, the block of point-to-point tags this engine's exchanges
            use (0, 1, ...): engines on one group with batches in flight at once need different ones, the same on
            every rank. Accepted and ignored with ``backend="cuda"``, where each engine has its own communicator.
        **fields: ``EngineOptions`` fields (``EngineOptions.fields()``): ``topology``, ``num_layers``,
            ``num_experts``, ``expert_bytes`` or ``tensors``, ``backend`` (``host``/``cuda``), ``verify``,
            ``max_attempts``, ``faults`` (a :class:`FaultSchedule`: the seeded fault injector),
            ``cuda_device_of_gpu`` (None: not given), ...
    """

    def __init__(self, options: Optional[EngineOptions] = None, *, group: Any = None,
                 bridge_timeout: float = DEFAULT_BRIDGE_TIMEOUT, tag_space: int = 0, **fields: Any) -> None:
        if options is None:
            if "cuda_device_of_gpu" in fields and fields["cuda_device_of_gpu"] is None:
                del fields["cuda_device_of_gpu"]  # None: not given, so that callers pass an optional map through
            options = EngineOptions(**fields)
        elif fields:
            raise ValueError(f"TransferEngine: give options or fields, not both (got {sorted(fields)})")
        runner, comms = None, None
        if group is not None and options.backend == "cuda":
            comms = _nccl_comms_of(group, options, bridge_timeout, tag_space)
        elif group is not None:
            runner = _bridge_of(group, options, bridge_timeout, tag_space)
        self._e = _core.TransferEngine(options, runner, comms)  # owns the communicator, closed after the engine
        if runner is not None or comms is not None:
            _BRIDGED.add(self)
        self._device = "cuda" if options.backend == "cuda" else "cpu"
        # Gate objects of running batches: the engine reads a torch.cuda.Event's handle until the batch starts,
        # so the event must outlive that even if the caller drops it (host events are kept by the engine itself).
        self._gates: List[Any] = []

    @property
    def options(self) -> EngineOptions:
        return self._e.options

    def close(self) -> None:
        """Ends the engine: running batches end (bounded by their deadlines) and, with ``group=``, every exchange
        it handed the group ends (bounded by ``bridge_timeout``); with ``backend="cuda"`` its NCCL communicator is
        then destroyed (aborted if that takes longer than ``bridge_timeout``). Later calls raise; closing twice is
        allowed."""
        self._e.close()

    @property
    def backend(self) -> str:
        return self._e.options.backend

    # -- registration -------------------------------------------------------------------------------------------

    def register_slots(self, layer: int, gpu: int, slots: Any, *, num_buffers: int = 1) -> None:
        """GPU ``gpu``'s expert slots of ``layer``: a contiguous tensor ``[slots, ...]`` (``[2, slots, ...]`` with
        ``num_buffers=2``), one row per slot holding an expert's ``tensors`` at their offsets (the packed layout);
        or a list (tuple) of contiguous tensors, one per ``EngineOptions.tensors`` entry, each ``[slots, ...]``
        (``[2, slots, ...]``) with one row per slot holding that tensor's bytes (the split layout, e.g. one tensor
        per weight kind; the entries' offsets are not used). Any dtype: moves copy bytes."""
        layer, gpu = integer(layer, "register_slots: layer"), integer(gpu, "register_slots: gpu")
        what = f"register_slots: layer {layer} GPU {gpu} slots"
        num_buffers = integer(num_buffers, "register_slots: num_buffers")
        if isinstance(slots, (list, tuple)):
            parts = [_borrow(t, f"{what} tensor {i}", self._device) for i, t in enumerate(slots)]
            self._e.register_slots_split(layer, gpu, parts, num_buffers)
            return
        self._e.register_slots(layer, gpu, _borrow(slots, what, self._device), num_buffers)

    def register_mirror(self, layer: int, node: int, mirror: Any, *, node_mirror: Any = None) -> None:
        """Node ``node``'s host mirror of ``layer``: a contiguous CPU tensor ``[experts, ...]`` (pinned for CUDA),
        or a list (tuple) of them, one per ``EngineOptions.tensors`` entry (the split layout, as
        :meth:`register_slots`).

        ``node_mirror``: the node-shared segment (a ``foremoe._core.NodeMirror``, or a
        ``foremoe.torch.moves.NodeMirror``) the tensors are views of; every tensor must lie inside its payload
        (checked), and the engine checks the segment's generation at each submit and never reads it stale, as
        :meth:`register_node_mirror`. The engine keeps the tensors and the segment alive."""
        layer, node = integer(layer, "register_mirror: layer"), integer(node, "register_mirror: node")
        what = f"register_mirror: layer {layer} node {node} mirror"
        if node_mirror is not None and not isinstance(node_mirror, _core.NodeMirror):
            inner = getattr(node_mirror, "_m", None)  # foremoe.torch.moves.NodeMirror wraps the segment
            if not isinstance(inner, _core.NodeMirror):
                raise ValueError(f"{what}: node_mirror must be a foremoe._core.NodeMirror or a "
                                 f"foremoe.torch.moves.NodeMirror, got {describe(node_mirror)}")
            node_mirror = inner
        if isinstance(mirror, (list, tuple)):
            parts = [_borrow(t, f"{what} tensor {i}", "cpu") for i, t in enumerate(mirror)]
            self._e.register_mirror_split(layer, node, parts, node_mirror)
            return
        self._e.register_mirror(layer, node, _borrow(mirror, what, "cpu"), node_mirror)

    def register_node_mirror(self, layer: int, node: int, mirror: Any) -> None:
        """Node ``node``'s mirror of ``layer`` as a node-shared segment (``foremoe._core.NodeMirror``) whose payload
        holds one equal row per expert, expert-major like :meth:`register_mirror`'s tensor. The engine checks the
        segment's generation at each submit and never reads it stale: while a refresh is under way (or was missed
        by this rank) moves take GPU-direct sources only, or are refused with multi-process engines. (The mirror
        of ``ExpertStorage(mirror="node")`` is laid out by weight kind, not by expert, so it is not such a
        segment.)"""
        layer, node = integer(layer, "register_node_mirror: layer"), integer(node, "register_node_mirror: node")
        self._e.register_node_mirror(layer, node, mirror)

    def register_grads(self, layer: int, gpu: int, grads: Any, grad_bytes: Optional[int] = None) -> None:
        """GPU ``gpu``'s gradient slots of ``layer`` (for :meth:`submit_reduce`), float32, float64, bfloat16 or
        float16 (one dtype per layer, the same on every GPU and rank). Packed: one ``[slots, ...]`` tensor, an
        expert's gradient its row's first ``grad_bytes`` bytes (default: the whole row). Split: a list of
        ``[slots, ...]`` tensors, one per weight kind (``tensors=`` of the engine, in order), an expert's gradient of
        kind ``i`` the whole row of tensor ``i`` (``grad_bytes`` must be None). Additions are element-wise in the
        dtype; bfloat16 / float16 add in float32 and round to nearest even, as ``torch.add`` does."""
        layer, gpu = integer(layer, "register_grads: layer"), integer(gpu, "register_grads: gpu")
        what = f"register_grads: layer {layer} GPU {gpu} gradients"
        if isinstance(grads, (list, tuple)):
            if grad_bytes is not None:
                raise ValueError(f"{what}: grad_bytes applies to one packed tensor, not to a list of "
                                 f"{len(grads)} per-kind tensors (each row is that kind's whole gradient)")
            parts = [_borrow(t, f"{what} tensor {i}", self._device) for i, t in enumerate(grads)]
            self._e.register_grads_split(layer, gpu, parts)
            return
        self._e.register_grads(layer, gpu, _borrow(grads, what, self._device),
                               optional_integer(grad_bytes, "register_grads: grad_bytes", 0, INT64_MAX))

    def set_resident(self, layer: int, placement: Any) -> None:
        """Declares what the slots of ``layer`` validly hold now: a :class:`foremoe.Placement` or :class:`foremoe.Plan`
        (its layer ``layer``) or a ``[gpus, slots]`` array of expert ids (-1 empty)."""
        if isinstance(placement, (_core.Placement, _core.Plan)):
            placement = placement.gpu_slots[layer]
        layer = integer(layer, "set_resident: layer")
        self._e.set_resident(layer, _int_array(placement, f"set_resident: layer {layer} placement"))

    def resident(self, layer: int) -> np.ndarray:
        """``[gpus, slots]``: the expert each slot of ``layer`` validly holds (-1: none, e.g. after a failed move)."""
        return self._e.resident(integer(layer, "resident: layer"))

    # -- batches ------------------------------------------------------------------------------------------------

    def submit(
        self,
        moves: Any,
        layer: int,
        *,
        plan_layer: Optional[int] = None,
        sources_ready: Any = None,
        slots_free: Any = None,
        dst_buffer: int = 0,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> Ticket:
        """Starts the moves of ``layer``: a :class:`foremoe.Plan` (its moves of ``plan_layer``, default ``layer``)
        or an ``[N, 4]`` integer array of (expert, src_gpu, dst_gpu, dst_slot) rows.

        ``sources_ready`` and ``slots_free`` gate the batch (a :class:`HostEvent` on the host backend, a recorded
        ``torch.cuda.Event`` on the CUDA backend); ``dst_buffer`` picks the buffer of double-buffered slots; the
        batch ends ``timed_out`` after ``timeout`` seconds.
        """
        layer = integer(layer, "submit: layer")
        if isinstance(moves, _core.Plan):
            moves = self._plan_moves(moves, layer if plan_layer is None else integer(plan_layer, "submit: plan_layer"))
        elif plan_layer is not None:
            raise ValueError("submit: plan_layer needs a foremoe.Plan")
        m = _int_array(moves, f"submit: layer {layer} moves")
        if m.size == 0:
            m = m.reshape(0, 4)
        if m.ndim != 2 or m.shape[1] != 4:
            raise ValueError(f"submit: moves must be a foremoe.Plan or [N, 4] (expert, src_gpu, dst_gpu, dst_slot), "
                             f"got shape {m.shape}")
        t = self._e.submit(layer, m, _gate(sources_ready, "sources_ready"), _gate(slots_free, "slots_free"),
                           integer(dst_buffer, "submit: dst_buffer"), float(timeout))
        return self._ticket(t, sources_ready, slots_free)

    def submit_reduce(self, layer: int, owner_gpu: Any, *, grads_ready: Any = None,
                      timeout: float = DEFAULT_TIMEOUT, returns: Any = None, held: Any = None) -> Ticket:
        """Adds every replica's gradient of ``layer`` into its owner's (``owner_gpu``: ``[experts]``, e.g.
        ``plan.owner_gpu[layer]``), in a fixed order (experts ascending, an expert's replicas by GPU).

        Held-gradient rule (issue 30), given ``returns`` or ``held``: only the replicas in ``returns`` (``[n, 2]``
        (gpu, expert) pairs, each a resident replica, none twice) are added, each replica's gradient row then zeroed;
        ``held`` (``[gpus, experts]``: the owner GPU each replica's gradient stays held for, -1 none; default none)
        names those left in place, whose slots moves may not overwrite until a later reduction returns them.
        Without either every replica returns and its gradient is left as it is."""
        pairs = None
        if returns is not None:
            pairs = _int_array(returns, "submit_reduce: returns")
            if pairs.size == 0:
                pairs = pairs.reshape(0, 2)
            if pairs.ndim != 2 or pairs.shape[1] != 2:
                raise ValueError(f"submit_reduce: returns must be [n, 2] (gpu, expert) pairs, got shape "
                                 f"{tuple(pairs.shape)}")
            pairs = np.ascontiguousarray(pairs.reshape(-1))
        table = None
        if held is not None:
            table = np.ascontiguousarray(_int_array(held, "submit_reduce: held").reshape(-1))
        t = self._e.submit_reduce(integer(layer, "submit_reduce: layer"),
                                  _int_array(owner_gpu, "submit_reduce: owner_gpu"),
                                  _gate(grads_ready, "grads_ready"), float(timeout), pairs, table)
        return self._ticket(t, grads_ready)

    def _ticket(self, t: Any, *gates: Any) -> Ticket:
        self._gates = [(u, g) for u, g in self._gates if u.state == "pending"]
        held = tuple(g for g in gates if g is not None and not isinstance(g, (int, HostEvent)))
        if held:
            self._gates.append((t, held))
        return Ticket(t)

    def _plan_moves(self, plan: Any, plan_layer: int) -> np.ndarray:
        o = self._e.options
        topo = o.topology
        if (plan.num_gpus, plan.slots, plan.num_experts) != (topo.num_gpus, topo.slots, o.num_experts):
            raise ValueError(f"submit: the plan is {plan.num_gpus} GPUs x {plan.slots} slots x {plan.num_experts} "
                             f"experts, the engine {topo.num_gpus} x {topo.slots} x {o.num_experts}")
        if not 0 <= plan_layer < plan.num_layers:
            raise ValueError(f"submit: plan layer {plan_layer} outside [0, {plan.num_layers})")
        mv = np.asarray(plan.moves)
        return mv[mv[:, 0] == plan_layer, 1:]

    # -- queries ------------------------------------------------------------------------------------------------

    def valid_expert(self, layer: int, gpu: int, slot: int) -> int:
        return self._e.valid_expert(integer(layer, "valid_expert: layer"), integer(gpu, "valid_expert: gpu"),
                                    integer(slot, "valid_expert: slot"))

    def last_plan(self, layer: int) -> Dict[str, Any]:
        """Transfer plan of the last batch of ``layer``: chunks, rounds, estimated seconds, bytes per path."""
        return self._e.last_plan(integer(layer, "last_plan: layer"))

    def stats(self) -> Dict[str, int]:
        """``allocations`` (transport resources created so far) and ``batches`` submitted."""
        return self._e.stats()

    def __repr__(self) -> str:
        o = self._e.options
        t = o.topology
        return (f"TransferEngine(backend={o.backend!r}, Topology({t.nodes}, {t.gpus_per_node}, {t.slots}), "
                f"num_layers={o.num_layers}, num_experts={o.num_experts}, expert_bytes={o.expert_bytes})")


# -- the runtime's counting and token mapping on tensors ------------------------------------------------------------

_TIMEOUT_MS = 60000


def _stream_of(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if t.device.type == "cuda" else 0


def _workspace(w: Optional[Workspace]) -> Any:
    if w is not None and not isinstance(w, Workspace):
        raise TypeError(f"workspace must be a foremoe.torch.engine.Workspace, got {type(w).__name__}")
    return None if w is None else w._w


def _host_i64(x: Any, what: str) -> Optional[np.ndarray]:
    if x is None:
        return None
    return int_array(_numpy(x) if isinstance(x, torch.Tensor) else x, what)


class Workspace:
    """Reused state of :func:`count_loads` and :func:`map_tokens` on one stream of ``device`` (``cpu`` or
    ``cuda``). Given one, those calls only enqueue their work (no host synchronisation on the CUDA path) and report
    bad ids or counts at :meth:`check`. One thread and one stream per workspace."""

    def __init__(self, device: Union[str, torch.device] = "cpu") -> None:
        kind = torch.device(device).type
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"Workspace: device must be cpu or cuda, got {device}")
        self._w = _core.Workspace("cuda" if kind == "cuda" else "host")

    @property
    def allocations(self) -> int:
        """Scratch, staging and event allocations so far (a steady state adds none)."""
        return self._w.allocations

    def check(self, timeout: float = 0.0) -> bool:
        """False while enqueued calls still run after waiting ``timeout`` seconds; True when they all succeeded;
        raises ``ValueError`` naming the first bad id or count, ``RuntimeError`` for a device failure."""
        code, message = self._w.check(int(round(float(timeout) * 1000)))
        if code == "in_progress":
            return False
        _raise_status(code, message, "")
        return True


def count_loads(
    routed_experts: torch.Tensor,
    microbatch_offsets: Any = None,
    *,
    num_experts: int,
    layer_map: Optional[Sequence[int]] = None,
    out: Optional[torch.Tensor] = None,
    threads: int = 1,
    workspace: Optional[Workspace] = None,
) -> torch.Tensor:
    """The runtime's load counting on a ``[tokens, layers, topk]`` integer tensor, on the tensor's device (CPU:
    host backend; CUDA: on the current stream, CUDA build only). Returns (or fills ``out``) int64
    ``[micro_steps, moe_layers, experts]``. Without ``workspace`` the call checks the ids before it returns
    (on CUDA it waits for the stream); with one it only enqueues, and ``workspace.check()`` reports."""
    if not isinstance(routed_experts, torch.Tensor):
        raise TypeError(f"count_loads: routed_experts must be a torch.Tensor, got {describe(routed_experts)} (for "
                        f"NumPy arrays and lists: foremoe.count_loads)")
    num_experts = integer(num_experts, "count_loads: num_experts")
    device = routed_experts.device.type
    ids = _borrow(routed_experts, "count_loads: routed_experts", device)
    offs = _host_i64(microbatch_offsets, "count_loads: microbatch_offsets")
    if ids.dim() != 3:
        raise ValueError(f"count_loads: routed_experts must be [tokens, layers, topk], got shape {tuple(ids.shape)}")
    num_micro = 1 if offs is None else max(len(offs) - 1, 0)
    lmap = None if layer_map is None else int_list(layer_map, "count_loads: layer_map")
    num_moe = ids.shape[1] if lmap is None else max([v + 1 for v in lmap] + [0])
    if out is None:
        out = torch.empty((num_micro, num_moe, num_experts), dtype=torch.int64, device=routed_experts.device)
    _core.runtime_count_loads(ids, _borrow(out, "count_loads: out", device), num_experts, offs, lmap,
                              integer(threads, "count_loads: threads"), _stream_of(ids), _TIMEOUT_MS,
                              _workspace(workspace))
    return out


def map_tokens(
    plan: Any,
    layer: int,
    routed_experts: torch.Tensor,
    *,
    trace_layer: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    workspace: Optional[Workspace] = None,
) -> torch.Tensor:
    """The runtime's token mapping: the physical slot (``gpu * slots + slot``) of every routed id of
    ``routed_experts[:, trace_layer]`` (default ``layer``) under ``plan``'s split of MoE layer ``layer``; int32
    ``[tokens, topk]``, -1 for no route. On the tensor's device, with or without ``workspace`` as
    :func:`count_loads`."""
    if not isinstance(plan, _core.Plan):
        raise TypeError(f"map_tokens: plan must be a foremoe.Plan, got {type(plan).__name__}")
    layer = integer(layer, "map_tokens: layer")
    trace_layer = layer if trace_layer is None else integer(trace_layer, "map_tokens: trace_layer")
    if not isinstance(routed_experts, torch.Tensor):
        raise TypeError(f"map_tokens: routed_experts must be a torch.Tensor, got {describe(routed_experts)} (for "
                        f"NumPy arrays and lists: foremoe.Plan.map_tokens)")
    if not 0 <= layer < plan.num_layers:
        raise ValueError(f"map_tokens: layer {layer} outside [0, {plan.num_layers})")
    device = routed_experts.device.type
    ids = _borrow(routed_experts, "map_tokens: routed_experts", device)
    if ids.dim() != 3:
        raise ValueError(f"map_tokens: routed_experts must be [tokens, layers, topk], got shape {tuple(ids.shape)}")
    if out is None:
        out = torch.empty((ids.shape[0], ids.shape[2]), dtype=torch.int32, device=routed_experts.device)
    slot_expert = np.ascontiguousarray(plan.phys_to_log[layer])
    slot_tokens = np.ascontiguousarray(plan.slot_tokens[layer]).reshape(-1)
    _core.runtime_map_tokens(ids, _borrow(out, "map_tokens: out", device),
                             trace_layer, plan.num_experts, slot_expert,
                             slot_tokens, 1, None, _stream_of(ids), _TIMEOUT_MS, _workspace(workspace))
    return out
