"""What one shared transfer engine per rank saves over one engine per MoE layer (foremoe.torch.mover, "One engine
for the layers"): OS threads per rank and the time of the first sync of every layer (each engine's creation is a
collective), for a model of L layers on 2 gloo ranks.

Per-layer engines are what every storage got before: here forced by giving each storage a fault injector that
never fires (``FaultSchedule`` with no probability set), which keeps a storage on an engine of its own.

Run: python python/bench/bench_shared_engine.py [L ...]     (default 4 16 48)
"""
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import foremoe
import foremoe.torch as ft


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def rank_main(rank: int, tmp: str, layers: list) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=2)
    E, G, S = 16, 2, 10
    own = np.repeat(np.arange(G), E // G).astype(np.int32)
    loads = np.exp(1.5 * np.random.default_rng(0).standard_normal(E))[None] * 1000
    plan = foremoe.Planner(foremoe.Topology(1, G, S)).plan(loads.astype(np.int64), owners=own)
    full = {"w1": torch.randn(E, 64, 128), "w2": torch.randn(E, 128, 64)}
    for L in layers:
        for private in (True, False):
            stores = [ft.ExpertStorage.from_full(full, own, S, rank=rank, world=G) for _ in range(L)]
            if private:
                for st in stores:
                    st.faults = ft.FaultSchedule(seed=1)  # fires never: an engine of its own
            before = threads()
            dist.barrier()
            t0 = time.perf_counter()
            for st in stores:
                st.sync(plan, 0, [], timeout=60.0)
            dt = time.perf_counter() - t0
            added = threads() - before
            for st in stores:
                st.close()
            if rank == 0:
                print(f"L={L:3d} {'engine per layer' if private else 'shared engine   '}: threads added per rank "
                      f"{added:4d}, first sync of every layer {dt * 1e3:8.1f} ms ({dt / L * 1e3:.2f} ms per layer)",
                      flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    layers = [int(a) for a in sys.argv[1:]] or [4, 16, 48]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(tmp, layers), nprocs=2)
