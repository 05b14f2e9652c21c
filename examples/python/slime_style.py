"""slime-style integration: per-sample `rollout_routed_experts` and micro-batch index lists.

slime keeps, per rollout sample, the routed experts the inference engine recorded, `[len - 1, L, K]` (no
route for the last generated token), and the trainer groups samples into micro-batches by index. Loads are
counted per sample in place and summed per micro-batch; consecutive RL steps carry the placement over.

Run: python examples/python/slime_style.py   (NumPy only)
"""

import numpy as np

import foremoe
from _data import routed_ids

rng = np.random.default_rng(1)
L, E, K = 6, 32, 4
topo = foremoe.Topology(2, 4, 6)  # 2 nodes x 4 GPUs, 4 owners + 2 spare slots
planner = foremoe.Planner(topo, strategy="foremoe", move_budget=2)

resident = None
for step in range(3):
    # --- what the trainer hands over: one RL step's rollout samples ------------------------------------------
    lengths = rng.integers(16, 400, size=24)
    samples = [{"rollout_routed_experts": routed_ids(rng, int(n) - 1, L, E, K, skew=1.0, dtype=np.int16)}
               for n in lengths]
    order = rng.permutation(len(samples))
    micro_batches = [order[i:i + 6].tolist() for i in range(0, len(order), 6)]

    # --- ForeMoE ---------------------------------------------------------------------------------------------
    loads = np.stack([
        sum(foremoe.count_loads(samples[i]["rollout_routed_experts"], num_experts=E)[0] for i in mb)
        for mb in micro_batches
    ])
    plans = planner.plan(loads, resident=resident)
    resident = plans[-1]
    moves = sum(p.num_moves for p in plans)
    print(f"step {step}: {len(micro_batches)} micro-steps, mean max/mean GPU load "
          f"{np.mean([p.imbalance.mean() for p in plans]):.3f}, {moves} weight moves")
    assert loads.sum() == sum((len(s["rollout_routed_experts"]) * L * K) for s in samples)
