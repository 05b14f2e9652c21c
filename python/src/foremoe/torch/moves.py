"""The host mirrors of :class:`foremoe.torch.ExpertStorage`: the copies of a layer's weights that the transfer engine
falls back to when a replica move fails (verification, retries, the fallback itself and the seeded fault injector are
the engine's: :mod:`foremoe.torch.mover`).

- :class:`HostMirror`: per rank, every expert's weights of one layer (``{kind: [E, ...]}``), in pinned memory when
  the slots are CUDA tensors (plain CPU memory otherwise). Never a parameter, never in a ``state_dict``. It is
  filled at construction and refreshed by the trainer after each optimizer step; a mirror older than the owner
  weights is refused, never used.
- :class:`NodeMirror`: the same mirror once per node, in shared memory that every local rank maps, refreshed
  collectively (each local rank writes a share); the node pays the layer's weights once instead of once per rank.
"""

from __future__ import annotations

import os
import secrets
from typing import Any, Callable, Dict, Mapping, Optional

import numpy as np
import torch
import torch.distributed as dist

from foremoe import _core
from foremoe._args import integer

from .distributed import DEFAULT_TIMEOUT, _a2a, gather_checked, gather_rows, group_size, wait

__all__ = ["HostMirror", "NodeMirror", "resolve_local_world"]


def resolve_local_world(local_world: Optional[int], world: int, mirror: Any) -> int:
    """Ranks per node: ``local_world`` when given, else the ``LOCAL_WORLD_SIZE`` environment variable (what
    ``torchrun`` sets) when the storage keeps a mirror, else 1. It must divide ``world`` (the group's ranks are
    numbered node by node: node ``n`` holds ranks ``[n * local_world, (n + 1) * local_world)``)."""
    if local_world is not None:
        value, source = integer(local_world, "ExpertStorage: local_world"), "local_world"
    elif mirror and os.environ.get("LOCAL_WORLD_SIZE"):
        text = os.environ["LOCAL_WORLD_SIZE"]
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"ExpertStorage: the environment variable LOCAL_WORLD_SIZE={text!r} is not an integer "
                             f"(ranks per node); pass local_world= instead") from None
        source = f"LOCAL_WORLD_SIZE={text}"
    else:
        return 1
    if value < 1 or world % value:
        raise ValueError(f"ExpertStorage: {source} ranks per node must be positive and divide the group's {world} "
                         f"ranks")
    return value


def group_of(storage: Any, group: Any, who: str) -> int:
    """The size of ``group``, which must be the storage's."""
    G = group_size(group)
    if G != storage.world:
        raise ValueError(f"{who}: the process group has {G} ranks, the storage was made for {storage.world}")
    return G


class HostMirror:
    """Every expert's weights of one layer on this rank, ``{kind: [E, ...]}`` in host memory (pinned when the slot
    storage is on CUDA), with the owner parameter versions it was taken at: ``ExpertStorage(..., mirror=True)``.
    Each local rank pays the layer's whole weights of host memory."""

    mode = "rank"

    def __init__(self, storage: Any, local_world: int = 1):
        self.tensors: Dict[str, torch.Tensor] = {}
        self.local_world = int(local_world)
        self.lo, self.hi = 0, storage.num_experts  # the experts this rank writes at a refresh
        for name in storage.names:
            t = storage.storage[name]
            pin = t.is_cuda and torch.cuda.is_available()
            self.tensors[name] = torch.zeros((storage.num_experts,) + tuple(t.shape[1:]), dtype=t.dtype,
                                             pin_memory=pin)
        self.versions = None  # owner parameter versions at the last fill; None: never filled
        self.invalid = False

    @property
    def payload_bytes(self) -> int:
        """Bytes of one copy of the mirror: every expert's weights of the layer."""
        return sum(int(m.numel()) * m.element_size() for m in self.tensors.values())

    @property
    def bytes_per_node(self) -> int:
        """Host memory the node pays for this layer's mirror: one copy per local rank."""
        return self.payload_bytes * self.local_world

    @property
    def pinned(self) -> bool:
        return all(m.is_pinned() for m in self.tensors.values())

    def fill(self, full: Mapping[str, torch.Tensor], storage: Any, group: Any = None,
             timeout: float = DEFAULT_TIMEOUT) -> None:
        """From the weights of all experts ``{kind: [E, ...]}`` (no collective for a per-rank mirror)."""
        self._write(storage, group, timeout, lambda name, lo, hi: full[name][lo:hi].detach())

    def refresh(self, storage: Any, group: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Gathers every owner's current rows over ``group`` (every rank calls it, after each optimizer step): one
        ``all_gather`` per weight kind of ``max owned experts`` rows per rank, so each rank receives about the
        layer's whole weights (``E x expert bytes``) and copies them into the mirror (device to host on CUDA)."""
        G = group_of(storage, group, "refresh_mirror")
        busiest = int(storage.num_owned_by.max())
        n_own = storage.num_owned
        gathered = {}
        for name in self.tensors:
            t = storage.storage[name]
            mine = t.new_zeros((busiest,) + tuple(t.shape[1:]))
            mine[:n_own] = t[:n_own].detach()
            parts = t.new_empty((G, busiest) + tuple(t.shape[1:]))
            if G == 1:
                parts[0] = mine
            else:
                wait(dist.all_gather(list(parts.unbind(0)), mine, group=group, async_op=True), timeout,
                     f"refresh_mirror: all_gather of the owner rows of {name!r}")
            gathered[name] = parts
        owner = torch.from_numpy(storage.owners.astype(np.int64))
        row = torch.from_numpy(storage.own_row)
        self._write(storage, group, timeout,
                    lambda name, lo, hi: gathered[name][owner[lo:hi].to(gathered[name].device),
                                                        row[lo:hi].to(gathered[name].device)])

    def _write(self, storage: Any, group: Any, timeout: float, rows: Callable[[str, int, int], torch.Tensor]) -> None:
        """Writes experts ``[lo, hi)`` of every kind from ``rows(name, lo, hi)`` and records the owner versions."""
        for name, m in self.tensors.items():
            m[self.lo:self.hi].copy_(rows(name, self.lo, self.hi))
        self._taken(storage)

    def _taken(self, storage: Any) -> None:
        self.versions = storage._param_versions()
        self.invalid = False

    def stale(self, storage: Any) -> bool:
        """Whether this rank's owner weights changed since the mirror was taken (an optimizer step without a
        refresh, or :meth:`ExpertStorage.invalidate`)."""
        return self.invalid or self.versions != storage._param_versions()

    def generation(self) -> Optional[int]:
        """The shared refresh generation (node mirrors only)."""
        return None


class NodeMirror(HostMirror):
    """One mirror per node (``ExpertStorage(..., mirror="node")``): every expert's weights of one layer in a POSIX
    shared-memory segment (:class:`foremoe._core.NodeMirror`, the runtime's ``foremoe::runtime::NodeMirror``) that
    every local rank of the node maps; ``tensors`` are views of that mapping. Pinned with ``cudaHostRegister`` when
    the slots are CUDA tensors and the runtime was built with CUDA.

    Construction is a collective over ``group``: the ranks agree on a key, the node's first local rank creates the
    segment, the others open it (a segment of another size is refused, naming both sizes), and the name is removed
    at once (the mappings stay), so that nothing is left in ``/dev/shm`` when a process dies. A refresh is
    collective too: each local rank receives its contiguous share of the experts from their owners (an
    ``all_to_all``, ``1 / local_world`` of the layer per rank) and writes it, all ranks pass a barrier, then the
    segment's generation moves on; a rank whose mirror is not at the generation of its last refresh (a refresh
    without it, or one that was interrupted) sees it stale."""

    mode = "node"

    def __init__(self, storage: Any, local_world: int, group: Any = None, timeout: float = DEFAULT_TIMEOUT):
        G = group_of(storage, group, "ExpertStorage: mirror='node'")
        self.local_world = int(local_world)
        self.node, local = divmod(storage.rank, self.local_world)
        E = storage.num_experts
        self.lo, self.hi = E * local // self.local_world, E * (local + 1) // self.local_world
        layout, offset = [], 0
        for name in storage.names:
            t = storage.storage[name]
            nbytes = E * int(t[0].numel()) * t.element_size()
            layout.append((name, offset, nbytes, t.dtype, (E,) + tuple(t.shape[1:])))
            offset = (offset + nbytes + 63) // 64 * 64  # every kind starts 64-byte aligned
        payload = layout[-1][1] + layout[-1][2]
        pin = (any(t.is_cuda for t in storage.storage.values()) and torch.cuda.is_available()
               and bool(_core.runtime_build_info()["cuda_compiled"]))
        # A key of this storage, the same on every rank: group rank 0's process id and a random number.
        mine = torch.tensor([os.getpid(), secrets.randbits(48)], dtype=torch.int64)
        pid, token = (int(v) for v in gather_rows(mine, group, timeout, "ExpertStorage: the node mirror's key")[0])
        key = f"{pid}-{token:012x}"
        what = f"ExpertStorage: mirror='node' (node {self.node}, local rank {local} of {self.local_world})"
        rejected = ("ExpertStorage: mirror='node': rank {rank} could not map its node's mirror (its error names "
                    "why); no node mirror was made")
        self._m = None
        for creating in (True, False):  # the node's first local rank creates the segment, then the others open it
            error = None
            if (local == 0) == creating:
                try:
                    # The creator has finished before this round began, so opening does not wait: a segment that
                    # is not there means this rank is on another host than its node's first rank.
                    self._m = (_core.NodeMirror.create(key, self.node, 0, payload, pin) if creating else
                               _core.NodeMirror.open(key, self.node, 0, payload, pin))
                except (ValueError, RuntimeError, TimeoutError) as e:
                    first = self.node * self.local_world
                    error = (f"{what}: {e}" if creating or "does not exist" not in str(e) else
                             f"{what}: {e}; is rank {first} on this host? (local_world={self.local_world}: ranks "
                             f"[{first}, {first + self.local_world}) must share one host)")
            gather_checked([], error, group, timeout, f"{what}: {'creating' if creating else 'opening'}",
                           rejected)
        self._m.unlink()  # every local rank has mapped it
        base = torch.from_numpy(self._m.array())
        self.tensors = {name: base[off:off + n].view(dtype).view(shape) for name, off, n, dtype, shape in layout}
        self.versions = None
        self.invalid = False

    @property
    def payload_bytes(self) -> int:
        return int(self._m.payload_bytes)

    @property
    def bytes_per_node(self) -> int:
        """Host memory the node pays for this layer's mirror: one segment (a header page and the payload in whole
        pages), whatever the number of local ranks."""
        return int(self._m.segment_bytes)

    @property
    def pinned(self) -> bool:
        return bool(self._m.pinned)

    def refresh(self, storage: Any, group: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Every rank receives only the rows of its share of its node's mirror from their owners: one
        ``all_to_all_single`` per weight kind (about ``E / local_world`` experts' bytes per rank, where a per-rank
        mirror's ``all_gather`` brings ``E``), then writes them (:meth:`_write`)."""
        G = group_of(storage, group, "refresh_mirror")
        if any(t.is_cuda for t in storage.storage.values()):
            # This rank's earlier copies out of the shared mirror are done before another local rank rewrites it
            # (only after the exchange below, which this rank enters after this point).
            torch.cuda.synchronize()
        E, L = storage.num_experts, self.local_world
        mine = storage.owned[storage.rank]  # ascending: owner row i holds expert mine[i]
        send = [np.flatnonzero((mine >= E * (r % L) // L) & (mine < E * (r % L + 1) // L)) for r in range(G)]
        recv = [o[(o >= self.lo) & (o < self.hi)] for o in storage.owned]
        send_rows = torch.from_numpy(np.concatenate(send))
        place = torch.from_numpy(np.concatenate(recv) - self.lo)  # where each received row goes in the share
        in_splits, out_splits = [int(i.size) for i in send], [int(e.size) for e in recv]
        got = {}
        for name in self.tensors:
            t = storage.storage[name]
            rows = t.detach().index_select(0, send_rows.to(t.device)).reshape(len(send_rows), t[0].numel())
            # Sent as raw bytes, so every dtype travels (gloo lacks some, such as bfloat16).
            got[name] = _a2a(rows.view(torch.uint8), out_splits, in_splits, group, timeout,
                             f"refresh_mirror: all_to_all of the owner rows of {name!r}")

        def share(name: str, lo: int, hi: int) -> torch.Tensor:
            m = self.tensors[name]
            out = torch.empty((hi - lo,) + tuple(m.shape[1:]), dtype=m.dtype)
            received = got[name].cpu().view(m.dtype).reshape((len(place),) + tuple(m.shape[1:]))
            out[place] = received
            return out

        self._write(storage, group, timeout, share)

    def _write(self, storage: Any, group: Any, timeout: float, rows: Callable[[str, int, int], torch.Tensor]) -> None:
        """Writes this rank's share between the runtime's begin and end of a refresh, with a barrier over ``group``
        in between (every local rank's share is written before the generation moves on)."""
        error = None
        try:
            self._m.begin_refresh()
            super()._write(storage, group, timeout, rows)
        except (ValueError, RuntimeError) as e:
            error = f"refresh_mirror: rank {storage.rank}: {e}"
        gather_checked([], error, group, timeout, "refresh_mirror: the node mirror's barrier",
                       "refresh_mirror: rank {rank} could not write its share of its node's mirror (its error names "
                       "why); the node mirrors stay stale")
        self._m.end_refresh()

    def stale(self, storage: Any) -> bool:
        """Also stale when the segment is not at the generation of this rank's last refresh."""
        return super().stale(storage) or bool(self._m.stale())

    def generation(self) -> Optional[int]:
        return int(self._m.generation)
