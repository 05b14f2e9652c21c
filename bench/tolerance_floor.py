"""Issue 15's and issue 30's byte goal against floors: for the measured step of a preset's default batch (the step
after the warm-up step), plans each micro-step with the two-level planner at several tolerances, once with the
held-gradient rule off (every replica that runs tokens returns its gradient every update micro-step, as issue 15
measured) and once on (a replica kept resident accumulates its gradient and returns it once: when a later plan
drops it, or after the last micro-step; `HeldGradients` in the library). Prints, in expert weights summed over
micro-steps and layers, the moves, the gradient returns under each rule (each `gradient_bytes_factor` weights),
their bytes, and two floors on the gradient bytes of any two-level plan with these owners: every token a GPU sheds
above the limit lands in a replica slot of another GPU, so micro-step m of layer l needs at least need(l, m) =
max(GPUs above the limit, fewest receivers whose rooms hold the total excess) replicas that run tokens. Returning
every micro-step, each returns a gradient: floor gw * sum(need). Held, those of one micro-step are distinct returns,
and nothing else is forced: floor gw * sum_l max_m need(l, m) (loose: the same replicas would have to serve every
micro-step). Both floors add sum_l max_m need(l, m) moves: the stage starts with no replica resident here, so the
replicas of a layer's neediest micro-step each came in by a move.

Usage: PYTHONPATH=python/src python3 bench/tolerance_floor.py [preset] (default qwen3-30b-a3b; needs the built
Python package). Every micro-step counts as an update micro-step; the first plans from no resident placement.
"""
import sys

import numpy as np

import foremoe

preset = sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b-a3b"
cfg = foremoe.simulate_config({"preset": preset})
topo_cfg = cfg["topology"]
gpus = topo_cfg["nodes"] * topo_cfg["gpus_per_node"]
topo = foremoe.Topology(topo_cfg["nodes"], topo_cfg["gpus_per_node"], topo_cfg["slots"])
# Gradient bytes per weight byte, as the simulator derives the planner's gradient_bytes_factor from the dtypes
# (fp32 gradients: 2 for bf16 weights, 4 for DeepSeek-V3's fp8).
size = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
gw = size[cfg["sim"]["grad_dtype"]] / size[cfg["model"]["dtype"]]
batch = {k: v for k, v in cfg["batch"].items() if k not in ("workload", "cache")}
data = foremoe.synthetic_loads(preset=preset, **batch)
loads, offsets = data["loads"], data["step_offsets"]
step = loads[int(offsets[1]):int(offsets[2])]
num_micro, num_layers, num_experts = step.shape
slots = topo_cfg["slots"]


def count(plans):
    """Moves, replicas that run tokens summed over micro-steps, and the held rule's gradient returns."""
    moves = used = returns = 0
    owes = np.full((num_layers, gpus, num_experts), -1)  # owner each held gradient goes to, or -1
    for plan in plans:
        owner = np.asarray(plan.owner_gpu)
        placed = np.asarray(plan.phys_to_log).reshape(num_layers, gpus, slots)
        tokens = np.asarray(plan.slot_tokens).reshape(num_layers, gpus, slots)
        moves += int(np.sum(plan.num_moves))
        for layer in range(num_layers):
            e = placed[layer]
            own = owner[layer][np.clip(e, 0, None)]
            replica = (e >= 0) & (own != np.arange(gpus)[:, None])
            run = replica & (tokens[layer] > 0)
            used += int(np.sum(run))
            holder = np.full((gpus, num_experts), -1)  # owner of each replica (GPU, expert) this plan keeps
            g_idx, s_idx = np.nonzero(replica)
            holder[g_idx, e[g_idx, s_idx]] = own[g_idx, s_idx]
            held = owes[layer]
            kept = (held >= 0) & (held == holder)
            returns += int(np.sum((held >= 0) & ~kept))
            held[~kept] = -1
            g_idx, s_idx = np.nonzero(run)
            held[g_idx, e[g_idx, s_idx]] = own[g_idx, s_idx]
    return moves, used, returns + int(np.sum(owes >= 0))


def needs(owner, tol):
    """need(l, m) of the docstring for the owners of `owner` ([layers][experts])."""
    out = np.zeros((num_micro, num_layers), dtype=np.int64)
    for m in range(num_micro):
        for layer in range(num_layers):
            gpu_load = np.bincount(owner[layer], weights=step[m, layer], minlength=gpus)
            limit = np.floor(step[m, layer].sum() / gpus * tol * (1 + 1e-12))
            excess = np.clip(gpu_load - limit, 0, None)
            if excess.sum() <= 0:
                continue
            rooms = np.sort(np.clip(limit - gpu_load, 0, None))[::-1]
            receivers = int(np.searchsorted(np.cumsum(rooms), excess.sum())) + 1
            out[m, layer] = max(int(np.sum(excess > 0)), receivers)
    return out


print(f"{preset}: {num_micro} micro-steps x {num_layers} layers; bytes in expert weights (gradient = {gw:g})")
print(f"{'tolerance':>9} | {'every micro-step: moves':>23} {'returns':>7} {'bytes':>7} {'floor':>7} | "
      f"{'held: moves':>11} {'returns':>7} {'bytes':>7} {'floor':>7}")
base = {}
for tol in (1.0, 1.01, 1.02, 1.05, 1.10):
    row = {}
    for hold in (False, True):
        plans = foremoe.Planner(topo, strategy="foremoe", tolerance=tol, gradient_bytes_factor=gw,
                                hold_replica_gradients=hold).plan(step)
        moves, used, returns = count(plans)
        need = needs(np.asarray(plans[0].owner_gpu), tol)
        peak = need.max(axis=0).sum()
        grads, floor = (returns, peak) if hold else (used, need.sum())
        row[hold] = (moves, grads, moves + gw * grads, peak + gw * floor)
        base.setdefault(hold, moves + gw * grads)
    (m0, r0, b0, f0), (m1, r1, b1, f1) = row[False], row[True]
    print(f"{tol:>9} | {m0:>23} {r0:>7} {b0:>7.0f} {f0:>7.0f} | {m1:>11} {r1:>7} {b1:>7.0f} {f1:>7.0f}   "
          f"1.00 / bytes: {base[False] / b0:.2f}x every, {base[True] / b1:.2f}x held; 1.00 / floor: "
          f"{base[False] / f0 if f0 else float('inf'):.2f}x every, {base[True] / f1 if f1 else float('inf'):.2f}x held")
