"""Host-side cost foremoe.torch adds per MoE layer and micro-step, on one rank, without the transfers.

Measured per call (fastest of the repeats), for one rank of G:
  cpp      the C++ calls: Plan.source_split (split of the plan's per-copy totals by source rank) and
           Plan.dispatch (token map, counting sort into the send order, split sizes, receive permutation)
  layout   local_layout: the C++ calls plus their checks and the wrapping into torch tensors
  book     the replica bookkeeping of one micro-step: plan checks, ExpertStorage.bookkeep (C++: rows of
           every rank, moves, the gradient-transfer list) and the state the backward keeps
  plain    what a plain all-to-all MoE layer of the same shape does on the host: a stable sort of the routes by
           expert, counts per expert and the split sizes per rank
Reported: ``glue = layout - cpp + book``, the Python/NumPy cost on top of the C++ calls, and
``added = layout + book - plain``, what the balanced layer's host side costs over the plain layer's.

Run: python python/bench/bench_torch_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import foremoe
import foremoe.torch as ft
from foremoe.torch.layer import _Run


def best_us(fn, repeats: int) -> float:
    """Fastest of ``repeats`` calls in microseconds (the least disturbed by other work on a shared machine)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.min(times) * 1e6)


def routed(rng, G, T, E, K, skew=1.5):
    pop = np.exp(skew * rng.standard_normal(E))
    pop /= pop.sum()
    # K distinct experts per token (Gumbel top-k).
    keys = np.log(pop)[None, :] - np.log(-np.log(rng.random((G * T, E))))
    return np.argsort(-keys, axis=1)[:, :K].astype(np.int64).reshape(G, T, K)


def bench(G: int, E: int, K: int, T: int, spare: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    S = E // G + spare
    owners = ft.contiguous_owners(E, G)
    topo = foremoe.Topology(max(1, G // 8), min(G, 8), S)
    ids = [routed(rng, G, T, E, K) for _ in range(2)]  # two micro-steps, so the replicas change
    src = [np.stack([np.bincount(i[g].reshape(-1), minlength=E) for g in range(G)], axis=1) for i in ids]
    plans = foremoe.Planner(topo).plan(np.stack([s.sum(axis=1) for s in src])[:, None, :], owners=owners)
    mine = [torch.from_numpy(i[0]) for i in ids]
    storage = ft.ExpertStorage.from_full({"w": torch.zeros(E, 1)}, owners, S, rank=0, world=G)

    def cpp(m=0):
        split = plans[m].source_split(0, src[m])
        plans[m].dispatch(0, mine[m].reshape(T, 1, K), split, 0)

    def layout(m=0):
        return ft.local_layout(plans[m], 0, mine[m], src[m], 0)

    lays = [layout(0), layout(1)]
    step = [0]

    def book():
        m = step[0] = 1 - step[0]
        storage.check_plan(plans[m], 0)
        _Run(storage, None, storage.bookkeep(plans[m], 0, ()), lays[m], 0, None, 60.0)

    def plain():
        flat = mine[0].reshape(-1)
        order = torch.sort(flat, stable=True).indices
        counts = torch.bincount(flat, minlength=E)
        splits = counts.view(G, E // G).sum(dim=1).tolist()
        return order, splits

    out = dict(G=G, E=E, K=K, T=T, S=S)
    out["cpp"] = best_us(cpp, repeats)
    out["layout"] = best_us(layout, repeats)
    out["book"] = best_us(book, repeats)
    out["plain"] = best_us(plain, repeats)
    out["moves"] = int(storage.bookkeep(plans[0], 0, ())["moves"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repeats, smaller shapes (for the test suite)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    shapes = [(8, 128, 8, 4096, 2), (64, 128, 8, 4096, 2), (8, 64, 4, 1024, 2)]
    if a.quick:
        shapes = [(8, 64, 4, 512, 2)]
    repeats = 20 if a.quick else 200
    print(f"{'G':>3} {'E':>4} {'K':>2} {'T':>5} {'S':>3} | {'cpp':>7} {'layout':>7} {'book':>7} {'plain':>7} | "
          f"{'glue':>7} {'added':>7}  (us per layer and micro-step, one rank)")
    for G, E, K, T, spare in shapes:
        r = bench(G, E, K, T, spare, repeats)
        added = r["layout"] + r["book"] - r["plain"]
        glue = r["layout"] - r["cpp"] + r["book"]
        print(f"{G:3d} {E:4d} {K:2d} {T:5d} {r['S']:3d} | {r['cpp']:7.1f} {r['layout']:7.1f} {r['book']:7.1f} "
              f"{r['plain']:7.1f} | {glue:7.1f} {added:7.1f}")
    print("glue = layout - cpp + book (Python on top of the C++ calls); added = layout + book - plain (host cost "
          "over a plain all-to-all layer; negative: cheaper)")


if __name__ == "__main__":
    main()
