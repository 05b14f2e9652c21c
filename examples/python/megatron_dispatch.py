"""Megatron-style dispatcher remapping: logical expert ids -> physical slots with the plan's token split.

For one micro-step and one layer, the plan says how many tokens each physical slot takes (`slot_tokens`);
the copies of expert `e` are `log_to_phys[l, off[e]:off[e+1]]` in slot order. The i-th token routed to `e`
(in token order) goes to the copy whose prefix range of `slot_tokens` contains i. This is the reference a
token dispatcher (e.g. Megatron's alltoall dispatcher) would implement on the GPU; here in NumPy.

Run: python examples/python/megatron_dispatch.py   (NumPy only)
"""

import numpy as np

import foremoe
from _data import routed_ids


def remap_to_physical(ids: np.ndarray, plan: "foremoe.Plan", layer: int) -> np.ndarray:
    """[T, K] logical expert ids (-1 = no route) of one layer -> [T, K] physical slot ids (-1 stays -1)."""
    flat = ids.reshape(-1).astype(np.int64)
    valid = flat >= 0
    e = flat[valid]
    # Rank of each assignment among the assignments to its expert, in token order (stable sort).
    order = np.argsort(e, kind="stable")
    counts = np.bincount(e, minlength=plan.num_experts)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.empty_like(e)
    rank[order] = np.arange(e.size) - np.repeat(starts, counts)
    # Copies of all experts in CSR order with their token shares; a global prefix sum over them.
    off = plan.log_to_phys_offsets[layer].astype(np.int64)
    phys = plan.log_to_phys[layer, :off[-1]].astype(np.int64)
    share = plan.slot_tokens[layer].reshape(-1)[phys]
    cum = np.cumsum(share)
    base = np.concatenate([[0], cum])[off[:-1]]  # tokens before expert e's first copy
    assert np.array_equal(cum[off[1:] - 1] - base, counts), "plan split does not cover the loads"
    copy = np.searchsorted(cum, base[e] + rank, side="right")
    out = np.full(flat.shape, -1, dtype=np.int64)
    out[valid] = phys[copy]
    return out.reshape(ids.shape)


rng = np.random.default_rng(2)
T, L, E, K = 4096, 4, 64, 6
topo = foremoe.Topology(1, 8, 10)
ids = routed_ids(rng, T, L, E, K, skew=1.3)
ids[rng.random((T, L, K)) < 0.01] = -1  # a few dropped routes
loads = foremoe.count_loads(ids, num_experts=E)[0]  # one micro-step
plan = foremoe.Planner(topo).plan(loads)

S = topo.slots
for l in range(L):
    p = remap_to_physical(ids[:, l, :], plan, l)
    # Every slot receives exactly the tokens the plan gave it, and each slot holds the token's expert.
    got = np.bincount(p[p >= 0], minlength=topo.num_gpus * S)
    assert np.array_equal(got, plan.slot_tokens[l].reshape(-1))
    assert np.array_equal(plan.phys_to_log[l][p[p >= 0]], ids[:, l, :][p >= 0])
    gpu_tokens = np.bincount(p[p >= 0] // S, minlength=topo.num_gpus)
    naive = np.bincount(ids[:, l, :][ids[:, l, :] >= 0] // (E // topo.num_gpus), minlength=topo.num_gpus)
    print(f"layer {l}: tokens per GPU max/mean {gpu_tokens.max() / gpu_tokens.mean():.3f} "
          f"(contiguous EP without replicas: {naive.max() / naive.mean():.3f})")
print("remapped", T, "tokens x", K, "routes per layer to physical slots")
