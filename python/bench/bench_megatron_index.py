"""Host time of foremoe.megatron's per-call index work alone: one process, no collective, no Megatron layer.

What one balanced layer call computes from the gathered counts before the token exchange, apart from the checks,
the counts' ``all_gather`` and the replica sync: the dispatch layout, the combine gather, the flat index of each
sent row's routing weight and, for GroupedMLP, the received rows regrouped by storage row (``_adapter_layout`` and
``_make_call``: ``_core.adapter_dispatch`` and ``_core.group_by_storage_row``). Two ranks' worth of skewed routing
(the shapes of ``bench_megatron_overhead.py``), rank 0's side, storage rows in reverse slot order so that the
GroupedMLP regrouping moves every block. Process CPU time per call: min and median of 7 rounds of 300 calls.

Run: python python/bench/bench_megatron_index.py
"""

from __future__ import annotations

import time
import warnings
from types import SimpleNamespace

import numpy as np
import torch

warnings.filterwarnings("ignore")

import foremoe  # noqa: E402
import foremoe.megatron as fmeg  # noqa: E402


def case(E: int, K: int, T: int, spare: int, grouped: bool, rounds: int = 7, calls: int = 300):
    G = 2
    S = E // G + spare
    planner = foremoe.Planner(foremoe.Topology(1, G, S))
    g = torch.Generator().manual_seed(0)
    pop = torch.exp(1.5 * torch.randn(E, generator=torch.Generator().manual_seed(0)))
    ids = [torch.multinomial(pop.expand(T, -1), K, replacement=False, generator=g).to(torch.int32) for _ in range(G)]
    loads = np.zeros((E, G), np.int64)
    for r in range(G):
        loads[:, r] = np.bincount(ids[r].reshape(-1).numpy(), minlength=E)
    owners = np.repeat(np.arange(G), E // G).astype(np.int32)
    plan = planner.plan(loads.sum(1)[None], owners=owners)
    rows = np.arange(S, dtype=np.int64)[::-1].copy()
    flags = np.zeros((G, 4), np.int64)
    shape, dev, rows_total = torch.Size([T, 8]), torch.device("cpu"), (S if grouped else None)

    def call():
        layout, extra = fmeg._adapter_layout(plan, 0, ids[0], loads, 0, flags, S)
        return fmeg._make_call(SimpleNamespace(layout=layout, rows=rows), extra, shape, 0, rows_total, dev)

    per = []
    for _ in range(rounds):
        call()
        t0 = time.process_time()
        for _ in range(calls):
            call()
        per.append((time.process_time() - t0) / calls * 1e6)
    return min(per), float(np.median(per))


def main() -> None:
    torch.set_num_threads(1)
    for E, K, T in [(16, 2, 512), (32, 4, 2048), (64, 8, 4096)]:
        for grouped in (False, True):
            lo, med = case(E, K, T, 2, grouped)
            print(f"E={E} K={K} T={T} {'GroupedMLP' if grouped else 'SequentialMLP'}: min {lo:.1f} us, "
                  f"median {med:.1f} us per call")


if __name__ == "__main__":
    main()
