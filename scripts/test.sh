#!/usr/bin/env bash
# Builds everything (CUDA backend compiled for sm_90 when the toolkit is
# present) and runs the whole test suite with CTest.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/install-deps.sh
cmake --preset ci >/dev/null
cmake --build --preset ci
ctest --preset ci "$@"
