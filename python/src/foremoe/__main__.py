"""``python -m foremoe``: the ``simulate`` and ``plan`` commands of the ``foremoe`` program over the bound C++.

The options, defaults, ranges and messages come from the library's schema (``foremoe.options()``), the output
documents from the library's writers, so the output files match ``foremoe simulate --json`` and
``foremoe plan --out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

import foremoe
from foremoe import _core


def _add_schema_options(p: argparse.ArgumentParser, command: str, skip: Tuple[str, ...] = ()) -> None:
    """One flag per schema option (bools as ``--x`` / ``--no-x``); values stay text for the C++ parser."""
    for o in foremoe.options(command):
        if o["key"] in skip:
            continue
        rng = f" [{o['min']}, {o['max']}]" if "min" in o else ""
        if "choices" in o:
            rng = ": " + ", ".join(o["choices"])
        help_ = f"{o['help']}{rng} (default: {o['default']}) [{o['key']}]"
        if o["type"] == "bool":
            p.add_argument(f"--{o['flag']}", dest=f"flag:{o['flag']}", action="store_const", const="true",
                           help=help_)
            p.add_argument(f"--no-{o['flag']}", dest=f"flag:no-{o['flag']}", action="store_const", const="",
                           help=argparse.SUPPRESS)
        else:
            p.add_argument(f"--{o['flag']}", dest=f"flag:{o['flag']}", metavar=o["type"].upper(), help=help_)


def _flags(a: argparse.Namespace) -> List[Tuple[str, str]]:
    return [(k[5:], v) for k, v in vars(a).items() if k.startswith("flag:") and v is not None]


def _simulate(a: argparse.Namespace) -> int:
    cfg = None
    if a.config:
        with open(a.config) as f:
            cfg = f.read()
    flags = _flags(a)
    if a.print_config:
        print(_core.simulate_settings(cfg, flags))
        return 0
    loads = steps = None
    if a.loads:
        loads = np.ascontiguousarray(np.load(a.loads), dtype=np.int64)
        sp = os.path.splitext(a.loads)[0] + ".steps.npy"
        if os.path.exists(sp):
            steps = np.ascontiguousarray(np.load(sp), dtype=np.int64)
    doc = _core.simulate(cfg, flags, loads, steps)
    summary, body = _core.simulate_text(cfg, flags, doc, bool(a.csv))
    print(summary, end="", file=sys.stderr if a.csv else sys.stdout)
    print(body, end="")
    if a.json:
        with open(a.json, "w") as f:
            f.write(doc + "\n")
    return 0


def _plan(a: argparse.Namespace) -> int:
    s: Dict[str, Any] = json.loads(_core.plan_settings(_flags(a)))
    loads = np.load(a.loads)
    t = s["topology"]
    topo = foremoe.Topology(t["nodes"], t["gpus_per_node"], t["slots"])
    planner = foremoe.Planner(topo, **s["planner"])
    prev = np.load(a.previous_loads) if a.previous_loads else None
    plans = planner.plan(loads if loads.ndim == 3 else loads[None], previous_loads=prev, stage=s["stage"])
    imb = np.sort(np.concatenate([p.imbalance for p in plans]))
    moves = sum(p.num_moves for p in plans)
    q = lambda f: imb[int(f * (imb.size - 1))]  # noqa: E731
    print(f"planned {len(plans)} micro-steps x {plans[0].num_layers} layers x {plans[0].num_experts} experts "
          f"({planner.strategy}): layer max/mean GPU load median {q(0.5):.4f}, p99 {q(0.99):.4f}, "
          f"max {imb[-1]:.4f}; {moves / len(plans):.1f} moves per micro-step; "
          f"planner {planner.last_planner_seconds * 1e3:.2f} ms")
    if a.out:
        with open(a.out, "w") as f:
            f.write(_core.plan_document(plans) + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m foremoe", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command")
    s = sub.add_parser("simulate", help="replay RL steps on a modelled cluster and compare balancing strategies")
    s.add_argument("--config", metavar="FILE.json", help="settings file (what --print-config writes, any subset)")
    s.add_argument("--print-config", dest="print_config", action="store_true",
                   help="print the effective settings as JSON and exit")
    s.add_argument("--loads", metavar="FILE.npy", help="per-micro-step loads [M, L, E] (steps from FILE.steps.npy)")
    s.add_argument("--json", metavar="OUT.json", help="write machine-readable results")
    s.add_argument("--csv", action="store_true", help="print the table as CSV (summary line on stderr)")
    _add_schema_options(s, "simulate")
    s.set_defaults(func=_simulate)
    q = sub.add_parser("plan", help="plan replicas, placement, token split and moves for one RL step's micro-steps")
    q.add_argument("--loads", required=True, metavar="LOADS.npy", help="[L, E] or [M, L, E] loads")
    q.add_argument("--previous-loads", dest="previous_loads", metavar="FILE.npy")
    q.add_argument("--out", metavar="PLAN.json", help="write the plan (same document as `foremoe plan --out`)")
    _add_schema_options(q, "plan")
    q.set_defaults(func=_plan)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.command is None:
        p.print_help()
        return 2
    if a.command == "plan" and getattr(a, "flag:slots") is None:
        p.error("--slots S is required")
    try:
        return a.func(a)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
