"""Time foremoe.megatron adds per MoE layer and micro-step over Megatron-core's own alltoall dispatcher (CPU, gloo).

Two ranks (expert parallelism 2) run one Megatron ``MoELayer`` (SequentialMLP experts, or with ``--grouped``
GroupedMLP experts: ``moe_grouped_gemm=True`` with the tests' CPU stand-in for ``grouped_gemm.ops.gmm``, one matmul
per group, the same on both sides) on the same replayed routing, twice per micro-step: Megatron's own path and the
adapter's, forward and backward. The hidden and FFN sizes are tiny, so the expert math and the token exchange cost little and the difference is what the adapter adds on
the host: the routed ids out of the routing map, the gathered counts and the plan's dispatch layout, the replica
bookkeeping (and the replica moves when the plan changes), the slot loop (Megatron's MLP arithmetic on each
computing slot's weight rows, where Megatron loops over its local experts) and the replica gradient reduction.
A negative figure: the adapter's layer took less host time than Megatron's own (README, "Host overhead").
Reported per layer and micro-step, the median over the micro-steps (on rank 0; both ranks run the same calls), as
CPU time of the calling thread (``time.thread_time``: the host work, without the time spent waiting for the other
rank in a collective, which on a shared two-core machine swamps it) and as wall time (``*_wall_us`` in the JSON):

  megatron   Megatron's layer, forward + backward
  foremoe    the adapter's layer, forward + backward
  added      foremoe - megatron   (target <= 50 us; ``*_added_paired_us`` in the JSON: the median of the
             per-micro-step differences, steadier on a loaded machine)

With ``--grouped`` both layers compute their experts with the stand-in ``gmm`` (Megatron's layer over its ``n``
local experts, the adapter's over all ``S`` storage rows, rows without tokens included), and the adapter's
per-slot loop and plain-MLP path are not involved: the figure is the dispatch, the replica bookkeeping, the
storage-row grouping and the fused gradient assembly.

``--module-mlp`` runs the slots through Megatron's MLP module (the weights swapped in) instead of the plain-MLP
path, which computes the same operations without the module calls: the figure is then what the dispatch, the
replica bookkeeping and the gradient reduction add, without the saving of the cheaper expert calls.

Modes: ``resident`` plans one micro-step's routing again and again (replicas stay resident, no move);
``changing`` alternates two routings (replicas move every micro-step). The CPU patches of the tests make Megatron
run without a GPU. One JSON object per shape on stdout, then a table.

Run: python python/bench/bench_megatron_overhead.py [--quick] [--module-mlp | --grouped] [--shape E,K,T,H,SPARE]
     [--repeats N] [--json out.json] [--profile out.prof]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # megatron_cpu: TEST / CPU-ONLY patches


def rank_main(rank: int, world: int, shapes: list, repeats: int, tmp: str, module_mlp: bool = False,
              grouped: bool = False, profile: str = "") -> None:
    import megatron_cpu as mc
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    import foremoe
    import foremoe.megatron as fmeg

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    mc.init_megatron(world)
    results = []
    prof = None
    if profile and rank == 0:  # rank 0's adapter calls under cProfile, thread CPU time per function
        import cProfile

        prof = cProfile.Profile(time.thread_time)
        prof_ref = cProfile.Profile(time.thread_time)  # Megatron's own layer, for comparison (FILE.megatron)
    for E, K, T, H, spare in shapes:
        cfg = mc.make_config(layers=1, hidden=H, ffn=H, experts=E, topk=K, ep=world, dtype=torch.float32,
                             grouped=grouped)
        ref, bal = mc.TinyMoE(cfg), mc.TinyMoE(cfg)
        bal.load_state_dict(ref.state_dict())
        fm = fmeg.install(bal, E // world + spare, timeout=60.0)
        if module_mlp:  # the slots through Megatron's MLP module, as Megatron's own loop: the dispatch's cost alone
            for st in fm._states:
                st.plain = None
        planner = foremoe.Planner(fm.topology())
        g = torch.Generator().manual_seed(rank)
        routes = []
        for k in range(2):  # two skewed routings
            pop = torch.exp(1.5 * torch.randn(E, generator=torch.Generator().manual_seed(k)))
            routes.append([torch.multinomial(pop.expand(T, -1), K, replacement=False, generator=g)])
        x = torch.randn(T, H, generator=g)
        row = {"G": world, "E": E, "K": K, "T": T, "H": H, "S": E // world + spare,
               "experts": "GroupedMLP" if grouped else "SequentialMLP"}
        for mode, order in (("resident", [0] * repeats), ("changing", [m % 2 for m in range(repeats)])):
            recorded = [routes[k] for k in order]
            times = {"megatron": [], "foremoe": []}
            cpu = {"megatron": [], "foremoe": []}
            with fm.driver(planner, recorded) as drv:
                for m, k in enumerate(order):
                    for model in (ref, bal):
                        mc.set_action(model, RouterReplayAction.REPLAY_FORWARD)
                        mc.set_targets(model, routes[k])
                    for name, model in (("megatron", ref), ("foremoe", bal)):
                        xi = x.clone().requires_grad_(True)
                        dist.barrier()
                        t0, c0 = time.perf_counter(), time.thread_time()
                        if name == "foremoe":
                            if prof is not None and m > 0:
                                prof.enable()
                            with fm.micro_step(m, drv):
                                model(xi).sum().backward()
                            if prof is not None and m > 0:
                                prof.disable()
                        else:
                            if prof is not None and m > 0:
                                prof_ref.enable()
                            model(xi).sum().backward()
                            if prof is not None and m > 0:
                                prof_ref.disable()
                        cpu[name].append(time.thread_time() - c0)
                        times[name].append(time.perf_counter() - t0)
            for name in times:
                row[f"{mode}_{name}_us"] = float(np.median(cpu[name][1:]) * 1e6)
                row[f"{mode}_{name}_wall_us"] = float(np.median(times[name][1:]) * 1e6)
            row[f"{mode}_added_us"] = row[f"{mode}_foremoe_us"] - row[f"{mode}_megatron_us"]
            # Paired: the median over micro-steps of each micro-step's difference (the two layers run back to back,
            # so a slow stretch of a loaded machine hits both): steadier than the difference of the medians.
            paired = np.subtract(cpu["foremoe"][1:], cpu["megatron"][1:])
            row[f"{mode}_added_paired_us"] = float(np.median(paired) * 1e6)
            row[f"{mode}_added_wall_us"] = row[f"{mode}_foremoe_wall_us"] - row[f"{mode}_megatron_wall_us"]
        row["replica_tokens"] = int(sum(s["replica_tokens"] for s in fm.stats))
        results.append(row)
    if rank == 0:
        Path(tmp, "out.json").write_text(json.dumps(results))
        if prof is not None:
            prof.dump_stats(profile)
            prof_ref.dump_stats(profile + ".megatron")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one small shape, few micro-steps (for the test suite)")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--module-mlp", action="store_true",
                    help="the slots through Megatron's MLP module instead of the plain-MLP path (what the adapter "
                         "adds besides the cheaper expert calls)")
    ap.add_argument("--grouped", action="store_true",
                    help="GroupedMLP experts (moe_grouped_gemm=True, the tests' CPU stand-in for grouped_gemm's gmm)")
    ap.add_argument("--shape", action="append", metavar="E,K,T,H,SPARE",
                    help="experts, top-k, tokens per rank, hidden = ffn, spare rows per rank (repeatable; default: "
                         "16,2,512,8,2 32,4,2048,8,2 64,8,4096,8,2)")
    ap.add_argument("--profile", metavar="FILE", default="",
                    help="write a cProfile of rank 0's adapter calls (thread CPU time, all shapes and modes) to FILE "
                         "and of Megatron's own layer to FILE.megatron (pstats format)")
    ap.add_argument("--repeats", type=int, default=21, help="micro-steps per mode (the first is not counted)")
    a = ap.parse_args()
    if a.grouped and a.module_mlp:
        ap.error("--module-mlp is for SequentialMLP experts (GroupedMLP has no per-expert MLP module)")
    # (experts, top-k, tokens per rank, hidden = ffn, spare rows per rank)
    shapes = [(16, 2, 512, 8, 2), (32, 4, 2048, 8, 2), (64, 8, 4096, 8, 2)]
    repeats = a.repeats
    if a.shape:
        try:
            shapes = [tuple(int(v) for v in sh.split(",")) for sh in a.shape]
        except ValueError:
            ap.error(f"--shape takes five integers E,K,T,H,SPARE, got {a.shape}")
        if any(len(sh) != 5 for sh in shapes):
            ap.error(f"--shape takes five integers E,K,T,H,SPARE, got {a.shape}")
    if repeats < 2:
        ap.error(f"--repeats must be at least 2, got {repeats}")
    if a.quick:
        shapes, repeats = [(16, 2, 256, 8, 2)], 5
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(2, shapes, repeats, tmp, a.module_mlp, a.grouped,
                                         os.path.abspath(a.profile) if a.profile else ""), nprocs=2)
        results = json.loads(Path(tmp, "out.json").read_text())
    for r in results:
        print(json.dumps(r))
    print(f"{'G':>2} {'E':>3} {'K':>2} {'T':>5} {'S':>3} | {'megatron':>9} {'foremoe':>9} {'added':>8} | "
          f"{'megatron':>9} {'foremoe':>9} {'added':>8}   (us per layer and micro-step, fwd + bwd, "
          f"host CPU time of rank 0; wall times in the JSON; "
          f"{'GroupedMLP' if a.grouped else 'SequentialMLP'} experts)")
    print(f"{'':>19} | {'resident replicas':^28} | {'changing plans (moves)':^28}")
    for r in results:
        print(f"{r['G']:2d} {r['E']:3d} {r['K']:2d} {r['T']:5d} {r['S']:3d} | {r['resident_megatron_us']:9.0f} "
              f"{r['resident_foremoe_us']:9.0f} {r['resident_added_us']:8.0f} | {r['changing_megatron_us']:9.0f} "
              f"{r['changing_foremoe_us']:9.0f} {r['changing_added_us']:8.0f}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
