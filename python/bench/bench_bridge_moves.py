"""Replica moves between 2 processes over gloo: the transfer engine over the process-group bridge
(``foremoe.torch.TransferEngine(group=...)``) alone and under ExpertStorage (the one mover since issue 29; the Python
moves it replaced were removed, their last figures are in CHANGELOG.md).

Each rank owns E/2 experts of ``size`` bytes; every round moves ``moves`` of rank 0's experts into rank 1's spare
slots and as many of rank 1's into rank 0's (``2 * moves * size`` bytes cross the group per round).
  engine   TransferEngine(group=WORLD).submit(moves).wait(): one engine per rank, the paired transfers run by the
           bridge (one gloo send/recv per chunk, each with a 16-byte header; max_chunk_bytes per the options)
  storage  ExpertStorage._post + _finish on CPU storage (foremoe/torch/layer.py, what ExpertStorage.sync runs after
           its bookkeeping): the same batch on the storage's own engine (foremoe.torch.mover), the status all_gather
Both with and without verification (the engine's C++ checksum in the header).
Reported per rank 0, median of the rounds: wall seconds, GB/s (bytes crossing the group / wall) and CPU
nanoseconds per byte (process CPU time of all its threads -- gloo's, the engine's, the bridge's -- / bytes).

With ``--grads``: the replica gradients of a backward returning to their owners instead (each rank holds a
replica of every expert the other owns, ``moves`` per rank, float32, ``size`` bytes each; every one returns):
  engine   foremoe.torch.layer._to_owners_engine on CPU storage (verify=False): the gradients written into the
           rows of the storage's engine (its gradient layer), its reductions (submit_reduce over the bridge, added at
           the owner in the fixed order), the owner rows read back, the status all_gather
  verified the same with verify=True (the default): each gradient checksummed at its source and on its owner
Reported as above (bytes: the gradients crossing the group).

Run: python python/bench/bench_bridge_moves.py [--quick] [--grads]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import foremoe
import foremoe.torch as ft
from foremoe.torch import engine as fe


def rounds_of(fn, reps):
    walls, cpus = [], []
    fn()  # warm-up
    for _ in range(reps):
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return float(np.median(walls)), float(np.median(cpus))


def rank_main(rank, tmp, sizes, moves, reps, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    E = 2 * moves
    S = moves + moves  # own experts, then spare slots for the other rank's
    owners = np.repeat(np.arange(2, dtype=np.int32), moves)
    results = []
    for size in sizes:
        for verify in (False, True):
            # The moves: rank g's experts to the other rank's spare slots moves .. 2*moves-1.
            mv = np.array([[e, int(owners[e]), 1 - int(owners[e]), moves + e % moves] for e in range(E)],
                          dtype=np.int32)
            # -- engine over the bridge
            slots = torch.zeros((S, size), dtype=torch.uint8)
            eng = fe.TransferEngine(topology=foremoe.Topology(1, 2, S), num_experts=E, expert_bytes=size,
                                    verify=verify, host_mirror=False, group=dist.group.WORLD)
            eng.register_slots(0, rank, slots)
            start = np.full((2, S), -1, dtype=np.int32)
            for e in range(E):
                start[owners[e], e % moves] = e

            def engine_round():
                eng.set_resident(0, start)  # the spare slots hold nothing again
                eng.submit(mv, 0, timeout=60.0).wait(timeout=120.0)

            ew, ec = rounds_of(engine_round, reps)
            eng.close()
            # -- ExpertStorage's moves (float32 rows of the same bytes) on its engine
            full = {"w": torch.randn(E, size // 4)}
            my = []
            for i, (e, src, dst, slot) in enumerate(mv.tolist()):
                my.append([i, e, src, dst, slot])
            out = {"moves": len(my), "my_moves": np.array(my, dtype=np.int64),
                   "all_moves": mv.astype(np.int64)}
            row = {"size": size, "verify": verify, "bytes": 2 * moves * size}
            nbytes = row["bytes"]
            row["engine"] = {"s": ew, "gbps": nbytes / ew / 1e9, "cpu_ns_per_byte": ec / nbytes * 1e9}
            st = ft.ExpertStorage.from_full(full, owners, S, rank=rank, world=2, verify=verify)

            def storage_round():
                pending = st._post(out, None, 0, timeout=60.0)
                st._finish(pending, None, 60.0, 0)

            w, c = rounds_of(storage_round, reps)
            row["storage"] = {"s": w, "gbps": nbytes / w / 1e9, "cpu_ns_per_byte": c / nbytes * 1e9}
            if st._mover is not None:
                st._mover.close()
            results.append(row)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def grads_main(rank, tmp, sizes, moves, reps, out_path):
    """``--grads``: one backward's replica gradient returns on the engine, checked against the sums made here."""
    from types import SimpleNamespace

    from foremoe.torch.layer import _to_owners_engine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    E, S = 2 * moves, 2 * moves
    owners = np.repeat(np.arange(2, dtype=np.int32), moves)
    pairs = sorted((e, 1 - int(owners[e])) for e in range(E))  # (expert, holder): every replica returns
    results = []
    for size in sizes:
        g = torch.Generator().manual_seed(rank)
        go = [torch.randn(moves, size // 4, generator=g)]
        mine = {e: [torch.randn(size // 4, generator=g)] for e, h in pairs if h == rank}
        row = {"size": size, "bytes": E * size}
        got = {}
        for kind, verify in (("engine", False), ("verified", True)):
            st = ft.ExpertStorage.from_full({"w": torch.zeros(E, size // 4)}, owners, S, rank=rank, world=2,
                                            verify=verify)
            run = SimpleNamespace(storage=st, group=None, timeout=60.0, layer=0)

            def fn():
                got[kind] = _to_owners_engine(run, go, pairs, mine, "bench")

            w, c = rounds_of(fn, reps)
            row[kind] = {"s": w, "gbps": row["bytes"] / w / 1e9, "cpu_ns_per_byte": c / row["bytes"] * 1e9}
            st.close()
        # Each owner row plus the other rank's replica gradient of it (every replica returns: one addition each),
        # the other rank's gradients drawn again from its seed.
        g_other = torch.Generator().manual_seed(1 - rank)
        torch.randn(moves, size // 4, generator=g_other)
        theirs = {e: torch.randn(size // 4, generator=g_other) for e, h in pairs if h == 1 - rank}
        want = go[0].clone()
        for e, t in theirs.items():
            want[e % moves] += t
        assert all(torch.equal(got[k][0], want) for k in got), "the sums differ from the owner's plus the replica's"
        results.append(row)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two sizes, 3 rounds")
    ap.add_argument("--moves", type=int, default=4, help="experts each rank sends per round")
    ap.add_argument("--grads", action="store_true", help="replica gradient returns (64 KiB, 1 MiB and 8 MiB experts)")
    args = ap.parse_args()
    if args.grads:
        sizes, reps = ([1 << 20] if args.quick else [1 << 16, 1 << 20, 8 << 20]), (3 if args.quick else 9)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out.json")
            mp.start_processes(grads_main, args=(tmp, sizes, args.moves, reps, out), nprocs=2, start_method="spawn")
            results = json.load(open(out))
        kinds = ("engine", "verified")
        print(f"{'bytes/expert':>12} | " + " | ".join(f"{k + ' s':>10} {'GB/s':>6} {'CPU ns/B':>8}" for k in kinds))
        for r in results:
            print(f"{r['size']:>12} | " + " | ".join(
                f"{r[k]['s']:>10.4f} {r[k]['gbps']:>6.2f} {r[k]['cpu_ns_per_byte']:>8.2f}" for k in kinds))
        return
    sizes = [1 << 16, 1 << 20] if args.quick else [1 << 16, 1 << 20, 8 << 20]
    reps = 3 if args.quick else 9
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.start_processes(rank_main, args=(tmp, sizes, args.moves, reps, out), nprocs=2, start_method="spawn")
        results = json.load(open(out))
    kinds = ("engine", "storage")
    print(f"{'bytes/expert':>12} {'verify':>6} | " + " | ".join(f"{k + ' s':>10} {'GB/s':>6} {'CPU ns/B':>8}"
                                                              for k in kinds))
    for r in results:
        print(f"{r['size']:>12} {str(r['verify']):>6} | " + " | ".join(
            f"{r[k]['s']:>10.4f} {r[k]['gbps']:>6.2f} {r[k]['cpu_ns_per_byte']:>8.2f}" for k in kinds))


if __name__ == "__main__":
    main()
