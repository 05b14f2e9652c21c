"""The refresh of copy-bound owner rows after an optimizer step (Megatron's distributed optimizer under
foremoe.megatron), per MoE layer, on 2 gloo ranks (CPU).

With ``DistributedDataParallelConfig(use_distributed_optimizer=True)`` the expert parameters live in DDP's parameter
buffer and the slot storage's owner rows hold a copy (``ExpertStorage.bind_parameters(..., copy=True)``). After
each optimizer step the next balanced call of every layer copies the parameters into the owner rows
(``ExpertStorage.refresh_copies``) and, with a host mirror, refreshes the mirror on every rank
(``ExpertStorage.refresh_mirror``: an all_gather of every owner's rows, about the layer's whole weights received
per rank). This times both, per layer, rank 0, median of the rounds:

  copy     refresh_copies after mark_copies_stale: this rank's owned experts, parameters -> rows
  mirror   refresh_mirror (mirror=True, one host copy per rank) over the 2-rank gloo group

Shapes (SwiGLU experts, Megatron's SequentialMLP: linear_fc1 [2F, H], linear_fc2 [H, F] per expert):
  test   16 experts, H 16, F 24, fp32 (python/tests/test_megatron_adapter.py's EP 2 cases)
  qwen3  128 experts, H 2048, F 768, bf16: one Qwen3-30B-A3B MoE layer (its config.json: hidden_size 2048,
         moe_intermediate_size 768, num_experts 128), 64 experts per rank, 4 spare rows

The parameters are views of one flat buffer per rank (as Megatron's DDP lays them out).

Run: python python/bench/bench_distopt_refresh.py [--quick]
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

import foremoe.torch as ft

SHAPES = {"test": (16, 16, 24, torch.float32), "qwen3": (128, 2048, 768, torch.bfloat16)}


def timed(fn, reps):
    fn()  # warm-up
    out = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return float(np.median(out))


def rank_main(rank, tmp, names, reps, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    results = []
    for name in names:
        E, H, F, dt = SHAPES[name]
        n = E // 2
        owners = np.repeat(np.arange(2, dtype=np.int32), n)
        per = [(2 * F, H), (H, F)]
        numel = n * sum(a * b for a, b in per)
        flat = torch.randn(numel, dtype=torch.float32).to(dt)  # DDP's parameter buffer of this rank's experts
        params, at = {"fc1": [], "fc2": []}, 0
        for i in range(n):
            for kind, (a, b) in zip(("fc1", "fc2"), per):
                params[kind].append(torch.nn.Parameter(flat[at:at + a * b].view(a, b)))
                at += a * b
        weights = {k: torch.stack([p.detach() for p in ps]) for k, ps in params.items()}
        st = ft.ExpertStorage(weights, owners, n + 4, rank=rank, world=2, mirror=True)
        st.bind_parameters(params, copy=True)
        del weights

        def copy():
            st.mark_copies_stale()
            assert st.refresh_copies()

        t_copy = timed(copy, reps)
        t_mirror = timed(lambda: st.refresh_mirror(), reps)
        nbytes = numel * flat.element_size()
        results.append({"shape": name, "experts": E, "hidden": H, "ffn": F, "dtype": str(dt).split(".")[-1],
                        "owned_bytes_per_rank": nbytes, "layer_bytes": 2 * nbytes,
                        "copy_s": t_copy, "mirror_s": t_mirror, "total_s": t_copy + t_mirror,
                        "copy_GBps": nbytes / t_copy / 1e9, "mirror_GBps_received": 2 * nbytes / t_mirror / 1e9})
        del params, flat
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the test shapes only")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    names = ["test"] if args.quick else ["test", "qwen3"]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(rank_main, args=(tmp, names, args.reps, out), nprocs=2)
        with open(out) as f:
            results = json.load(f)
    for r in results:
        print(f"{r['shape']:6s} E={r['experts']:3d} H={r['hidden']:4d} F={r['ffn']:4d} {r['dtype']:8s} "
              f"owned {r['owned_bytes_per_rank'] / 2**20:9.2f} MiB/rank  copy {r['copy_s'] * 1e3:9.3f} ms "
              f"({r['copy_GBps']:.2f} GB/s)  mirror {r['mirror_s'] * 1e3:9.3f} ms "
              f"({r['mirror_GBps_received']:.2f} GB/s received)  total {r['total_s'] * 1e3:9.3f} ms per layer and step")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
