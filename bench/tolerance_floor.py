"""Issue 15's byte goal against a floor: for the measured step of a preset's default batch (the step after the
warm-up step), plans each micro-step with the two-level planner at several tolerances and prints, in expert
weights summed over micro-steps and layers, the moves, the replicas that run tokens (each returns a gradient of
`gradient_bytes_factor` weights in the update stage), their bytes, and a floor on the gradient bytes of any
two-level plan with these owners: every token a GPU sheds above the limit lands in a replica slot of another GPU,
so a layer needs at least max(GPUs above the limit, fewest receivers whose rooms hold the total excess) replicas.

Usage: PYTHONPATH=python/src python3 bench/tolerance_floor.py [preset] (default qwen3-30b-a3b; needs the built
Python package). Every micro-step counts weights in and gradients out once, as an update micro-step does.
"""
import sys

import numpy as np

import foremoe

preset = sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b-a3b"
cfg = foremoe.simulate_config({"preset": preset})
topo_cfg = cfg["topology"]
gpus = topo_cfg["nodes"] * topo_cfg["gpus_per_node"]
topo = foremoe.Topology(topo_cfg["nodes"], topo_cfg["gpus_per_node"], topo_cfg["slots"])
gw = 2.0  # fp32 gradients of bf16 weights, the planner's default gradient_bytes_factor
batch = {k: v for k, v in cfg["batch"].items() if k not in ("workload", "cache")}
data = foremoe.synthetic_loads(preset=preset, **batch)
loads, offsets = data["loads"], data["step_offsets"]
step = loads[int(offsets[1]):int(offsets[2])]
_, num_layers, num_experts = step.shape
slots = topo_cfg["slots"]

print(f"{'tolerance':>9} {'moves':>7} {'used':>7} {'bytes':>8} {'floor':>8}")
base = None
for tol in (1.0, 1.01, 1.02, 1.05, 1.10):
    plans = foremoe.Planner(topo, strategy="foremoe", tolerance=tol, gradient_bytes_factor=gw).plan(step)
    moves = used = need = 0
    for m, plan in enumerate(plans):
        owner = np.asarray(plan.owner_gpu)
        placed = np.asarray(plan.phys_to_log).reshape(num_layers, gpus, slots)
        tokens = np.asarray(plan.slot_tokens).reshape(num_layers, gpus, slots)
        moves += int(np.sum(plan.num_moves))
        for layer in range(num_layers):
            e = placed[layer]
            off_owner = (e >= 0) & (owner[layer][np.clip(e, 0, None)] != np.arange(gpus)[:, None])
            used += int(np.sum(off_owner & (tokens[layer] > 0)))
            gpu_load = np.bincount(owner[layer], weights=step[m, layer], minlength=gpus)
            limit = np.floor(step[m, layer].sum() / gpus * tol * (1 + 1e-12))
            excess = np.clip(gpu_load - limit, 0, None)
            if excess.sum() <= 0:
                continue
            rooms = np.sort(np.clip(limit - gpu_load, 0, None))[::-1]
            receivers = int(np.searchsorted(np.cumsum(rooms), excess.sum())) + 1
            need += max(int(np.sum(excess > 0)), receivers)
    total = moves + gw * used
    base = base or total
    print(f"{tol:>9} {moves:>7} {used:>7} {total:>8.0f} {gw * need:>8.0f}   (1.00 / bytes: {base / total:.2f}x, "
          f"1.00 / floor: {base / (gw * need):.2f}x)")
