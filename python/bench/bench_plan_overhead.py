"""Python-call overhead of `Planner.plan` over the C++ `Planner::plan_step` call.

DeepSeek-V3 shape: 58 MoE layers x 256 experts, 4 nodes x 8 GPUs, 9 slots per GPU (8 owners + 1 spare).
The C++ figure times `plan_step` in a loop inside the extension (no Python); the Python figure times
`foremoe.Planner.plan(loads)` end to end: argument checks, the int64 load tensor, planning, and the
flattened Plan arrays. Target: < 10 % overhead.

Run: python python/bench/bench_plan_overhead.py [--iters N] [--micro-steps M] [--quick]
"""

import argparse
import statistics
import time

import numpy as np

import foremoe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--micro-steps", type=int, default=1, help="1: loads [L, E]; > 1: [M, L, E]")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="3 iterations (for the test suite)")
    a = ap.parse_args()
    iters = 3 if a.quick else a.iters

    L, E = 58, 256
    rng = np.random.default_rng(0)
    w = np.exp(0.85 * rng.standard_normal((1, L, E)))
    loads = rng.poisson(w / w.sum(axis=-1, keepdims=True) * 16384 * 32 * 8, size=(a.micro_steps, L, E))
    loads = loads.astype(np.int64)
    arg = loads[0] if a.micro_steps == 1 else loads
    planner = foremoe.Planner(foremoe.Topology(4, 8, 9), threads=a.threads)
    planner.plan(arg)  # warm-up (workspaces)

    cpp, py = [], []
    for _ in range(iters):  # interleaved, so that drift affects both alike
        cpp.append(planner._core._bench_cpp_plan(loads, None, 1))
        t0 = time.perf_counter()
        planner.plan(arg)
        py.append(time.perf_counter() - t0)
    c, p = statistics.median(cpp), statistics.median(py)
    print(f"DeepSeek-V3 shape {a.micro_steps} x {L} x {E}, 4 x 8 GPUs x 9 slots, {a.threads} thread(s), {iters} iters")
    print(f"C++ plan_step:        median {c * 1e3:8.3f} ms (min {min(cpp) * 1e3:.3f})")
    print(f"Python Planner.plan:  median {p * 1e3:8.3f} ms (min {min(py) * 1e3:.3f})")
    print(f"overhead: {(p - c) * 1e6:.1f} us per call = {100 * (p - c) / c:+.2f} % (target < 10 %)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
