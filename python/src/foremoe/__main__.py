"""``python -m foremoe``: the ``simulate`` and ``plan`` commands of the ``foremoe`` program over the bound C++.

Options and output files match the C++ command line (``foremoe simulate --json``, ``foremoe plan --out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

import foremoe


def plan_layer_json(plan: "foremoe.Plan", layer: int) -> Dict[str, Any]:
    """One layer of a plan in the shape ``foremoe plan --out`` writes."""
    mv = plan.moves
    mv = mv[mv[:, 0] == layer]
    return {
        "owner_gpu": plan.owner_gpu[layer].tolist(),
        "gpu_slots": plan.gpu_slots[layer].tolist(),
        "slot_tokens": plan.slot_tokens[layer].tolist(),
        "moves": mv[:, 1:].tolist(),
        "max_gpu_load": int(plan.max_gpu_load[layer]),
        "imbalance": float(plan.imbalance[layer]),
    }


def plan_json(planner: "foremoe.Planner", plans: Sequence["foremoe.Plan"]) -> Dict[str, Any]:
    """The document ``foremoe plan --out PLAN.json`` writes."""
    t = planner.topology
    first = plans[0]
    return {
        "strategy": planner.strategy,
        "nodes": t.nodes,
        "gpus_per_node": t.gpus_per_node,
        "slots": t.slots,
        "num_layers": first.num_layers,
        "num_experts": first.num_experts,
        "planner_seconds": planner.last_planner_seconds,
        "micro_steps": [{"layers": [plan_layer_json(p, l) for l in range(p.num_layers)]} for p in plans],
    }


def _simulate(a: argparse.Namespace) -> int:
    cfg: Dict[str, Any] = {}
    if a.config:
        with open(a.config) as f:
            cfg.update(json.load(f))
    cfg["preset"] = a.preset
    for key in ("steps", "nodes", "gpus_per_node", "slots"):
        if getattr(a, key) is not None:
            cfg[key] = getattr(a, key)
    cfg["seed"] = a.seed
    cfg["threads"] = a.threads
    if a.double_buffer:
        cfg["double_buffer"] = True
    loads = steps = None
    if a.loads:
        loads = np.load(a.loads)
        sp = os.path.splitext(a.loads)[0] + ".steps.npy"
        if os.path.exists(sp):
            steps = np.load(sp)
    res = foremoe.simulate(cfg, loads, steps, a.strategies)
    print(f"simulated {res['num_steps']} RL steps ({res['num_micro_steps']} micro-steps) of {res['num_layers']} MoE "
          f"layers x {res['num_experts']} experts on {res['nodes']} x {res['gpus_per_node']} GPUs with {res['slots']} "
          "slots per GPU per layer")
    print(f"{'strategy':<14}{'step s':>10}{'recompute s':>13}{'update s':>10}{'median':>9}{'p99':>9}{'moved GB':>11}"
          f"{'stall ms':>10}{'vs static':>11}{'vs eplb':>9}")
    for r in res["strategies"]:
        def ratio(v: float) -> str:
            return f"{v:.3f}x" if v > 0 else "n/a"
        print(f"{r['strategy']:<14}{r['step_seconds']:>10.3f}{r['recompute_seconds']:>13.3f}{r['update_seconds']:>10.3f}"
              f"{r['imbalance_median']:>9.3f}{r['imbalance_p99']:>9.3f}{r['moved_gb']:>11.1f}"
              f"{r['stall_seconds'] * 1e3:>10.1f}{ratio(r['speedup_over_static']):>11}{ratio(r['speedup_over_eplb']):>9}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def _plan(a: argparse.Namespace) -> int:
    loads = np.load(a.loads)
    topo = foremoe.Topology(a.nodes, a.gpus_per_node, a.slots)
    planner = foremoe.Planner(topo, a.strategy, a.move_budget, a.threads,
                              hierarchical_owners=a.owners == "hierarchical")
    prev = np.load(a.previous_loads) if a.previous_loads else None
    plans = planner.plan(loads if loads.ndim == 3 else loads[None], previous_loads=prev, stage=a.stage)
    imb = np.sort(np.concatenate([p.imbalance for p in plans]))
    moves = sum(p.num_moves for p in plans)
    q = lambda f: imb[int(f * (imb.size - 1))]  # noqa: E731
    print(f"planned {len(plans)} micro-steps x {plans[0].num_layers} layers x {plans[0].num_experts} experts "
          f"({planner.strategy}): layer max/mean GPU load median {q(0.5):.4f}, p99 {q(0.99):.4f}, "
          f"max {imb[-1]:.4f}; {moves / len(plans):.1f} moves per micro-step; "
          f"planner {planner.last_planner_seconds * 1e3:.2f} ms")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(plan_json(planner, plans), f)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m foremoe", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command")
    s = sub.add_parser("simulate", help="replay RL steps on a modelled cluster and compare balancing strategies")
    s.add_argument("--config", metavar="FILE.json", help="model, topology, batch, sim and cost settings")
    s.add_argument("--preset", default="qwen3-30b-a3b", choices=["qwen3-30b-a3b", "deepseek-v3"])
    s.add_argument("--loads", metavar="FILE.npy", help="per-micro-step loads [M, L, E] (steps from FILE.steps.npy)")
    s.add_argument("--strategies", default=",".join(foremoe.SIM_STRATEGIES), help="comma-separated strategies")
    s.add_argument("--steps", type=int)
    s.add_argument("--nodes", type=int)
    s.add_argument("--gpus-per-node", dest="gpus_per_node", type=int)
    s.add_argument("--slots", type=int)
    s.add_argument("--seed", type=int, default=1)
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--double-buffer", dest="double_buffer", action="store_true")
    s.add_argument("--json", metavar="OUT.json", help="write machine-readable results")
    s.set_defaults(func=_simulate)
    q = sub.add_parser("plan", help="plan replicas, placement, token split and moves for one RL step's micro-steps")
    q.add_argument("--loads", required=True, metavar="LOADS.npy", help="[L, E] or [M, L, E] loads")
    q.add_argument("--nodes", type=int, default=1)
    q.add_argument("--gpus-per-node", dest="gpus_per_node", type=int, default=8)
    q.add_argument("--slots", type=int, required=True)
    q.add_argument("--strategy", default="foremoe", choices=list(foremoe.STRATEGIES))
    q.add_argument("--move-budget", dest="move_budget", type=int)
    q.add_argument("--owners", default="hierarchical", choices=["hierarchical", "flat"])
    q.add_argument("--stage", default="update", choices=["update", "recompute"])
    q.add_argument("--previous-loads", dest="previous_loads", metavar="FILE.npy")
    q.add_argument("--threads", type=int, default=1)
    q.add_argument("--out", metavar="PLAN.json", help="write the plan (same shape as `foremoe plan --out`)")
    q.set_defaults(func=_plan)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.command is None:
        p.print_help()
        return 2
    try:
        return a.func(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
