"""What makes the balanced layer's replica moves safe: the host mirror, exact row checksums and the seeded fault
injector (used by :class:`foremoe.torch.ExpertStorage`).

- :class:`HostMirror`: per rank, every expert's weights of one layer (``{kind: [E, ...]}``), in pinned memory when
  the slots are CUDA tensors (plain CPU memory otherwise). Never a parameter, never in a ``state_dict``. It is
  filled at construction and refreshed by the trainer after each optimizer step; a mirror older than the owner
  weights is refused, never used.
- :func:`row_checksum`: an exact hash of a row's raw bytes, computed identically by sender and receiver.
- :func:`injected_fault`: the decision of a :class:`foremoe.FaultSchedule` (the runtime's seeded fault injector)
  for one received replica move, replayable from its seed.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import torch
import torch.distributed as dist

from .distributed import DEFAULT_TIMEOUT, group_size, wait

__all__ = ["HostMirror", "injected_fault", "row_checksum"]

_weights: Dict[Any, torch.Tensor] = {}


def row_checksum(t: torch.Tensor) -> torch.Tensor:
    """An exact hash of ``t``'s raw bytes as a 0-dim int64 tensor on ``t``'s device: the bytes read as int32 words
    (single bytes when the size is not a multiple of 4), each times its own odd weight, summed with int64
    wraparound. Any change of one word changes it (an odd weight is invertible modulo 2**64). Costs a temporary of
    twice the row's bytes."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    words = b.view(torch.int32) if b.numel() % 4 == 0 else b
    n = int(words.numel())
    key = (n, str(t.device))
    w = _weights.get(key)
    if w is None:
        w = ((torch.arange(n, dtype=torch.int64) * 0x9E3779B1) % (1 << 31)) | 1
        w = _weights.setdefault(key, w.to(t.device))
    return (words.to(torch.int64) * w).sum()


def injected_fault(faults: Any, sync_index: int, layer: int, tag: int, timeout: float) -> Optional[str]:
    """What a :class:`foremoe.FaultSchedule` does to the received replica move ``tag`` of ``layer`` in the storage's
    ``sync_index``-th sync: ``"dropped"`` (``fail_probability``), ``"corrupted"`` (``corrupt_probability``: one byte
    flipped after it landed, which only verification sees), ``"late"`` (``delay_probability`` with a ``delay_us``
    at least the move's deadline; a shorter delay is harmless here) or ``None``. The draws are the runtime's own
    (``FaultSchedule.draw``: a hash of ``seed`` and the move's identity), so a schedule replays exactly on every
    rank. ``fail_paths`` does not apply (the moves take one path, torch.distributed)."""
    if faults is None:
        return None
    identity = [int(sync_index), int(layer), int(tag)]

    def draw(decision: str) -> float:
        return float(faults.draw(identity, decision))

    if draw("fail") < faults.fail_probability:
        return "dropped"
    if draw("corrupt") < faults.corrupt_probability:
        return "corrupted"
    if draw("delay") < faults.delay_probability and faults.delay_us * 1e-6 >= timeout:
        return "late"
    return None


def corrupt_(rows: Any) -> None:
    """Flips one byte of the last received row (what the runtime's injector does to received host bytes)."""
    last = rows[-1].view(-1).view(torch.uint8)
    last[-1] ^= 0x5A


class HostMirror:
    """Every expert's weights of one layer on this rank, ``{kind: [E, ...]}`` in host memory (pinned when the slot
    storage is on CUDA), with the owner parameter versions it was taken at."""

    def __init__(self, storage: Any):
        self.tensors: Dict[str, torch.Tensor] = {}
        for name in storage.names:
            t = storage.storage[name]
            pin = t.is_cuda and torch.cuda.is_available()
            self.tensors[name] = torch.zeros((storage.num_experts,) + tuple(t.shape[1:]), dtype=t.dtype,
                                             pin_memory=pin)
        self.versions = None  # owner parameter versions at the last fill; None: never filled
        self.invalid = False

    def fill(self, full: Mapping[str, torch.Tensor], storage: Any) -> None:
        """From the weights of all experts ``{kind: [E, ...]}`` (no collective)."""
        for name, m in self.tensors.items():
            m.copy_(full[name].detach())
        self._taken(storage)

    def refresh(self, storage: Any, group: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Gathers every owner's current rows over ``group`` (every rank calls it, after each optimizer step): one
        ``all_gather`` per weight kind of ``max owned experts`` rows per rank, so each rank receives about the
        layer's whole weights (``E x expert bytes``) and copies them into the mirror (device to host on CUDA)."""
        G = group_size(group)
        if G != storage.world:
            raise ValueError(f"refresh_mirror: the process group has {G} ranks, the storage was made for "
                             f"{storage.world}")
        busiest = int(storage.num_owned_by.max())
        n_own = storage.num_owned
        for name, m in self.tensors.items():
            t = storage.storage[name]
            mine = t.new_zeros((busiest,) + tuple(t.shape[1:]))
            mine[:n_own] = t[:n_own].detach()
            if G == 1:
                parts = [mine]
            else:
                parts = [torch.empty_like(mine) for _ in range(G)]
                wait(dist.all_gather(parts, mine, group=group, async_op=True), timeout,
                     f"refresh_mirror: all_gather of the owner rows of {name!r}")
            for g, experts in enumerate(storage.owned):
                if experts.size:
                    m.index_copy_(0, torch.from_numpy(experts), parts[g][:experts.size].to(m.device))
        self._taken(storage)

    def _taken(self, storage: Any) -> None:
        self.versions = storage._param_versions()
        self.invalid = False

    def stale(self, storage: Any) -> bool:
        """Whether this rank's owner weights changed since the mirror was taken (an optimizer step without a
        refresh, or :meth:`ExpertStorage.invalidate`)."""
        return self.invalid or self.versions != storage._param_versions()

    def copy_into(self, storage: Any, expert: int, row: int) -> None:
        """Writes ``expert``'s mirrored weights into storage row ``row`` (without bumping the owner parameters'
        version counter, which the row's storage shares)."""
        for name, m in self.tensors.items():
            storage.storage[name].data[row].copy_(m[expert], non_blocking=True)

