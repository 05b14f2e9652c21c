#!/usr/bin/env bash
# Quick start: installs what is missing, builds the `foremoe` program in
# release mode and runs the project's main job on its embedded default.
# Extra arguments go to the main job.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/install-deps.sh
cmake --preset release >/dev/null
cmake --build --preset release --target foremoe_cli
# The reference data, when present beside the checkout, is compared against.
if [[ -z "${FOREMOE_DATA_DIR:-}" && -d "$root/../shared/data" ]]; then
  export FOREMOE_DATA_DIR="$root/../shared/data"
fi
exec ./build/release/tools/foremoe simulate "$@"
