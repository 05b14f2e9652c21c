"""Thread CPU time of foremoe.megatron's pieces per layer call, in bench_megatron_overhead.py's setting (2 ranks, gloo).

Each listed function is wrapped with a ``time.thread_time`` accumulator (no profiler: cProfile's per-call cost
would swamp functions of a few µs); rank 0's totals over both modes (resident, changing) are divided by the calls of
the adapter's layer. Nested pieces are included in their callers. Megatron's own dispatcher steps and expert
forward (labelled ``megatron``) are timed the same way in its layer's calls, for a side-by-side reading. Megatron's
own layer runs beside it as in the benchmark, whose ``added`` figures are printed first.

Run: python python/bench/bench_megatron_pieces.py E [--grouped]     (E: 16, 32 or 64, the benchmark's shapes)
"""
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_megatron_overhead as bench  # noqa: E402

SHAPES = {16: (16, 2, 512, 8, 2), 32: (32, 4, 2048, 8, 2), 64: (64, 8, 4096, 8, 2)}  # the benchmark's defaults
REPEATS = 41
ACC = {}


def wrap(owner, name, label):
    f = getattr(owner, name, None)
    if f is None:  # a piece an older version does not have (comparing versions)
        return

    def timed(*a, **k):
        c = time.thread_time()
        try:
            return f(*a, **k)
        finally:
            t = ACC.setdefault(label, [0.0, 0, []])
            d = time.thread_time() - c
            t[0] += d
            t[1] += 1
            t[2].append(d)

    setattr(owner, name, timed)


def rank(r, world, shapes, repeats, tmp, grouped):
    import foremoe.megatron as M
    import foremoe.torch.layer as L

    for n in ("_routes", "_prepare_call", "_schedule_gradients", "_return_held_grads", "gather_source_loads",
              "_adapter_layout", "_remembered_layout", "_make_call"):
        wrap(M, n, n)
    for n in ("_hold_schedule", "_to_owners_engine", "_check_rows"):
        wrap(L, n, n)
    disp = M.ForeMoEAlltoAllTokenDispatcher
    for cls, meth in ((L.ExpertStorage, "sync"), (L.ExpertStorage, "check_plan"), (L.ExpertStorage, "call_flags"),
                      (L.ExpertStorage, "bookkeep"), (M._GroupedWeights, "backward"), (L._SlotWeights, "backward"),
                      (M._LayerState, "check_bound"), (M._BalancedGroupedMLP, "forward"),
                      (M._BalancedSequentialMLP, "forward"), (disp, "dispatch_preprocess"), (disp, "token_dispatch"),
                      (disp, "dispatch_postprocess"), (disp, "combine_preprocess"), (disp, "token_combine"),
                      (disp, "combine_postprocess")):
        wrap(cls, meth, f"{cls.__name__}.{meth}")
    # Megatron's own pieces (its layer's calls; the adapter's dispatcher and experts override these while balanced,
    # which every adapter call of the benchmark is), for a side-by-side reading.
    from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    for cls, meth in [(MoEAlltoAllTokenDispatcher, m) for m in ("dispatch_preprocess", "token_dispatch",
                                                                 "dispatch_postprocess", "combine_preprocess",
                                                                 "token_combine", "combine_postprocess")] + [
            (GroupedMLP, "forward"), (SequentialMLP, "forward")]:
        wrap(cls, meth, f"megatron {cls.__name__}.{meth}")
    bench.rank_main(r, world, shapes, repeats, tmp, False, grouped)
    if r == 0:
        Path(tmp, "acc.json").write_text(json.dumps(ACC))


def main():
    if len(sys.argv) < 2 or int(sys.argv[1]) not in SHAPES:
        sys.exit(f"usage: {sys.argv[0]} E [--grouped]   (E: one of {sorted(SHAPES)})")
    grouped = "--grouped" in sys.argv[2:]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank, args=(2, [SHAPES[int(sys.argv[1])]], REPEATS, tmp, grouped), nprocs=2)
        acc = json.loads(Path(tmp, "acc.json").read_text())
        res = json.loads(Path(tmp, "out.json").read_text())[0]
    print({k: round(v) for k, v in res.items() if k.endswith("_us") and "wall" not in k})
    calls = 2 * REPEATS  # both modes, every micro-step (the first ones included here)
    print("  mean per layer call   median per piece call  (calls per layer call)  piece")
    for k, (t, n, each) in sorted(acc.items(), key=lambda kv: -kv[1][0]):
        print(f"{t / calls * 1e6:8.1f} us {float(np.median(each)) * 1e6:8.1f} us ({n / calls:.1f})  {k}")


if __name__ == "__main__":
    main()
