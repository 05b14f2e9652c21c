#!/usr/bin/env bash
# Bytes moved against simulated step time for planner imbalance tolerances (issue 15): the default main job and
# the DeepSeek-V3 preset, two-level strategy. Usage: bench/tolerance_curve.sh [path/to/foremoe] [extra simulate flags]
# (e.g. `--prompts 32 --steps 1` for a quick run). Prints: preset, tolerance, step seconds, moved GB per step.
set -euo pipefail
cli=${1:-build/release/tools/foremoe}
shift || true
for preset in qwen3-30b-a3b deepseek-v3; do
  for tol in 1.00 1.01 1.02 1.05 1.10; do
    row=$("$cli" simulate --preset "$preset" --strategies foremoe --tolerance "$tol" "$@" 2>/dev/null | grep '^foremoe ')
    # Columns: strategy, step, recompute, update, median, p99, moved GB, ...
    echo "$preset $tol $(echo "$row" | awk '{print "step_s=" $2, "median=" $5, "moved_gb=" $7}')"
  done
done
