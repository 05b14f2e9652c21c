"""Host time of ExpertStorage's per-call plan work alone: one process, rank 0 of 2, no collective, no transfer.

Per layer call, as ``foremoe.megatron`` runs them: ``check_plan`` (twice: the call and the sync; the second is
remembered), ``bookkeep`` (the replica bookkeeping of the sync) and ``_hold_schedule`` (the held-gradient schedule,
``gradients="hold"``), each on a new plan object per micro-step as a replay driver hands them out. ``resident``
plans one skewed routing again and again (the same placement: replicas stay); ``changing`` alternates two (replicas
move every micro-step). The shapes of ``bench_megatron_overhead.py`` (2 ranks, 2 spare rows per rank). Thread CPU
per call: min and median of 7 rounds of 200 micro-steps.

Run: python python/bench/bench_storage_calls.py [E ...]     (default 16 32 64)
"""

import sys
import time

import numpy as np
import torch

import foremoe
from foremoe.torch import ExpertStorage
from foremoe.torch import layer as L


def case(E: int, K: int, T: int, spare: int = 2, G: int = 2) -> None:
    S = E // G + spare
    rng = np.random.default_rng(0)
    own = np.repeat(np.arange(G), E // G).astype(np.int32)
    loads = []
    for k in range(2):  # two skewed routings, as the overhead benchmark's
        pop = np.exp(1.5 * np.random.default_rng(k).standard_normal(E))
        ids = np.stack([rng.choice(E, size=K, replace=False, p=pop / pop.sum()) for _ in range(T * G)])
        loads.append(np.bincount(ids.reshape(-1), minlength=E)[None].astype(np.int64))
    planner = foremoe.Planner(foremoe.Topology(1, G, S))
    st = ExpertStorage({"w1": torch.zeros(E // G, 8, 8), "w2": torch.zeros(E // G, 8, 8)}, own, S, rank=0, world=G)
    for mode, seq in (("resident", [0] * 200), ("changing", [m % 2 for m in range(200)])):
        times = {"check_plan": [], "bookkeep": [], "hold_schedule": []}
        for _ in range(7):
            t = dict.fromkeys(times, 0.0)
            for k in seq:
                p = planner.plan(loads[k], owners=own)  # a new plan object per micro-step
                c = time.thread_time()
                st.check_plan(p, 0)
                st.check_plan(p, 0)
                t["check_plan"] += time.thread_time() - c
                c = time.thread_time()
                st.bookkeep(p, 0, [])
                t["bookkeep"] += time.thread_time() - c
                c = time.thread_time()
                L._hold_schedule(st, p, 0, "hold", [])
                t["hold_schedule"] += time.thread_time() - c
            for name in times:
                times[name].append(t[name] / len(seq) * 1e6)
        print(f"E={E} K={K} T={T} {mode}: " + ", ".join(f"{n} min {min(v):.1f} med {np.median(v):.1f} us"
                                                      for n, v in times.items()))


if __name__ == "__main__":
    shapes = {16: (16, 2, 512), 32: (32, 4, 2048), 64: (64, 8, 4096)}
    for e in [int(a) for a in sys.argv[1:]] or sorted(shapes):
        case(*shapes[e])
