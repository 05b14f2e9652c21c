"""Time and balance of ``foremoe.rebalance_experts`` on DeepSeek-V3's 58 x 256 expert-load profiles.

For each profile (FOREMOE_DATA_DIR, else ../shared/data next to the repository) and shape (32 GPUs x 9 slots on
4 nodes, 64 GPUs x 5 slots on 8 nodes, 8 expert groups): seconds per call for ``split="even"`` and
``split="exact"`` (best of --iters), and the median over layers of max/mean GPU load under the even split (what
vLLM and SGLang dispatch) for both splits and for DeepSeek EPLB's algorithm (the re-implementation in
python/tests/test_eplb_split.py, timed once).

Run: python python/bench/bench_rebalance_experts.py [--iters N]
"""

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

import foremoe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_eplb_split import even_split_gpu_loads, ref_eplb  # noqa: E402  (the test's EPLB reference)


def _best_seconds(fn, iters):
    best = float("inf")
    for _ in range(iters):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    root = Path(os.environ.get("FOREMOE_DATA_DIR") or Path(__file__).resolve().parents[3] / "shared" / "data")
    files = sorted((root / "deepseek-v3-sglang").glob("*.npy"))
    if not files:
        print(f"skipped: no DeepSeek-V3 profiles under {root} (set FOREMOE_DATA_DIR)")
        return 0
    for f in files:
        w = np.load(f)
        for G, S, N in ((32, 9, 4), (64, 5, 8)):
            R, mean = G * S, w.sum(axis=1) / G

            def ratio(phy2log):
                return float(np.median(even_split_gpu_loads(w, phy2log, G).max(axis=1) / mean))

            t_even, even = _best_seconds(lambda: foremoe.rebalance_experts(w, R, 8, N, G), a.iters)
            t_exact, exact = _best_seconds(lambda: foremoe.rebalance_experts(w, R, 8, N, G, split="exact"), a.iters)
            t_eplb, eplb = _best_seconds(lambda: ref_eplb(w, R, 8, N, G), 1)
            print(f"{f.stem:22s} {G} GPUs x {S} slots, {N} nodes: median max/mean (even split) "
                  f"even {ratio(even[0]):.4f}  exact {ratio(exact[0]):.4f}  eplb {ratio(eplb):.4f}; "
                  f"seconds even {t_even:.4f}  exact {t_exact:.4f}  eplb (Python reference) {t_eplb:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
