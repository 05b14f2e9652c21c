"""The moves of :class:`foremoe.torch.ExpertStorage` on the runtime's transfer engine (issue 29: one mover).

For CPU slot storage every replica move of a sync runs on :class:`foremoe.torch.engine.TransferEngine` (the C++
``foremoe::runtime::TransferEngine``, host backend), one engine per storage and rank, its paired transfers over the
trainer's gloo group through the engine's bridge. Python keeps only the tensor handles and the process group, and
says which bytes travel: the batch every rank submits is ``replica_sync``'s ``all_moves``, each move from its owner's
row (the storage's bookkeeping reuses resident replicas and copies the others from their owners; the engine sees only
the owner rows as readable, so it keeps that source or, recording why, takes the node's host mirror). The transfer
plan (chunks, rounds, a split of a move between the owner and the host mirror when both end sooner), verification
(the engine's checksum in every paired transfer's header), retries and the fallback to the host mirror, the seeded
fault injector (``EngineOptions.faults``: a :class:`foremoe.FaultSchedule`), deadlines and telemetry are the
engine's.

The engine addresses each weight kind's storage tensor ``[rows, ...]`` and each kind's mirror tensor ``[E, ...]``
where they lie (per-tensor regions): nothing is copied or laid out again. Its slots are the storage's rows, the same
count on every rank: the rows of the storage (owned experts first, then the spare rows and, with double buffers,
their second copies) padded to the busiest rank's, then one staging row per spare row of the rank with the most
spare rows, into which :meth:`ExpertStorage.prefetch` lands its moves until the call installs them.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

import foremoe

from .distributed import gather_rows
from .engine import TransferEngine, TransferError

__all__ = ["EngineMover", "engine_rows"]

# The next tag space this process may give an engine: each storage's engine takes its own on the group (the largest
# of every rank's, agreed at creation, after which every rank moves past it), so that the batches of several layers
# in flight at once never pair across engines.
_next_space = [0]


def engine_rows(slots: int, num_owned_by: np.ndarray, double_buffer: bool) -> Tuple[int, int]:
    """(engine slots per rank, first staging row): every rank's storage rows padded to the busiest rank's, then
    ``max spare`` staging rows."""
    spare = int(slots - int(np.min(num_owned_by)))
    stage0 = slots + (spare if double_buffer else 0)
    return stage0 + spare, stage0


class EngineMover:
    """One storage's transfer engine on this rank (see the module documentation). Made at the first sync with
    moves (a collective over ``group``: every rank gets there at the same sync, since the bookkeeping is the same
    everywhere)."""

    def __init__(self, storage: Any, group: Any, timeout: float) -> None:
        pg = group if group is not None else dist.group.WORLD
        mine = torch.tensor([_next_space[0]], dtype=torch.int64)
        space = int(gather_rows(mine, pg, timeout, "ExpertStorage: the transfer engine's tag space").max())
        _next_space[0] = space + 1
        st = storage
        self.faults, self.verify = st.faults, st.verify
        rows = st._engine_rows
        tensors = [int(st._alloc[n][0].numel()) * st._alloc[n].element_size() for n in st.names]  # bytes per kind
        topo = foremoe.Topology(st.world // st.local_world, st.local_world, rows)
        self.engine = TransferEngine(topology=topo, num_layers=1, num_experts=st.num_experts, tensors=tensors,
                                     verify=st.verify, faults=st.faults, host_mirror=st.mirror is not None,
                                     host_threads_per_path=1, group=pg, bridge_timeout=timeout, tag_space=space)
        self.engine.register_slots(0, st.rank, [st._alloc[n] for n in st.names])
        if st.mirror is not None:
            views = [st.mirror.tensors[n] for n in st.names]
            node = st.rank // st.local_world
            self.engine.register_mirror(0, node, views, node_mirror=getattr(st.mirror, "_m", None))
        # The owner rows of every rank: the only copies the engine may read at the start of a batch.
        self.owner_table = np.full((st.world, rows), -1, dtype=np.int32)
        for g in range(st.world):
            self.owner_table[g, :st.owned[g].size] = st.owned[g]

    def fits(self, storage: Any) -> bool:
        """Whether the engine was made with the storage's current ``faults`` and ``verify`` (the same on every
        rank: the storage remakes it otherwise)."""
        return self.faults is storage.faults and self.verify == storage.verify

    def close(self) -> None:
        self.engine.close()

    def submit(self, moves: np.ndarray, timeout: float) -> Any:
        """Starts the batch ``moves`` ``[n, 4]`` (expert, source rank, destination rank, destination engine slot),
        the same on every rank, reading only owner rows; returns the ticket."""
        self.engine.set_resident(0, self.owner_table)
        return self.engine.submit(np.ascontiguousarray(moves, dtype=np.int32), 0, timeout=timeout)

    def finish(self, ticket: Any, timeout: float) -> Tuple[Optional[str], List[Dict[str, Any]]]:
        """Waits for ``ticket`` (at most ``timeout`` seconds past its own deadline, then aborts it); returns the
        failure's message (None when every move landed) and the per-move telemetry."""
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
