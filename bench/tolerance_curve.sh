#!/usr/bin/env bash
# Bytes moved against simulated step time for planner imbalance tolerances (issue 15): the default main job and
# the DeepSeek-V3 preset, two-level strategy. Usage: bench/tolerance_curve.sh [path/to/foremoe] [extra simulate flags]
# (e.g. `--prompts 32 --steps 1` for a quick run). Prints per preset and tolerance ("0" = as balanced as possible,
# the default): step seconds, median layer max/mean, weights moved, replica gradients reduced and their sum (GB per
# RL step), from the simulate JSON.
set -euo pipefail
cli=${1:-build/release/tools/foremoe}
shift || true
printf '%-14s %9s %8s %7s %9s %8s %9s\n' preset tolerance step_s median moved_gb grad_gb total_gb
for preset in qwen3-30b-a3b deepseek-v3; do
  for tol in 0 1.00 1.01 1.02 1.05 1.10; do
    "$cli" simulate --quiet --preset "$preset" --strategies foremoe --tolerance "$tol" --json - "$@" 2>/dev/null |
      python3 -c '
import json, sys
r = json.load(sys.stdin)["strategies"][0]
m, g, t, med = r["moved_gb"], r["grad_gb"], r["step_seconds"], r["imbalance_median"]
print(f"{sys.argv[1]:<14} {sys.argv[2]:>9} {t:8.3f} {med:7.3f} {m:9.1f} {g:8.1f} {m + g:9.1f}")
' "$preset" "$tol"
  done
done
