#!/usr/bin/env bash
# On a machine with one GPU: builds the runtime, GPU tests and device benchmark for sm_90, runs the GPU tests
# (device counting, token mapping, the CUDA transfer engine) and the transfer benchmark (both move paths against
# plain cudaMemcpyAsync, GEMM slowdown beside moves), and prints a short table. Figures go to $OUT when set.
# Meant to finish well under 8 minutes.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
out=${OUT:-$root/build/device}
mkdir -p "$out"
start=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - start ))s] $*"; }

if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null || [[ ! -e /usr/include/doctest/doctest.h ]]; then
  stamp "dependencies"
  bash scripts/install-deps.sh >/dev/null
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

stamp "configure and build (sm_90)"
cmake -S . -B build/device -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DFOREMOE_BUILD_TOOLS=OFF -DFOREMOE_BUILD_EXAMPLES=OFF -DFOREMOE_INSTALL=OFF >"$out/configure.log" 2>&1 ||
  { tail -n 30 "$out/configure.log"; exit 1; }
targets=(device_bench_transfer)
for src in tests/gpu_test_*.cpp; do targets+=("$(basename "$src" .cpp)"); done
cmake --build build/device -j"$(nproc)" --target "${targets[@]}" >"$out/build.log" 2>&1 ||
  { tail -n 40 "$out/build.log"; exit 1; }

stamp "GPU tests"
declare -A result
for src in tests/gpu_test_*.cpp; do
  t=$(basename "$src" .cpp)
  timeout 180 "build/device/tests/$t" >"$out/$t.log" 2>&1
  rc=$?
  case $rc in 0) result[$t]=passed ;; 77) result[$t]=skipped ;; 124) result[$t]="TIMED OUT" ;; *) result[$t]="FAILED ($rc)" ;; esac
  tail -n 3 "$out/$t.log"
done

stamp "transfer benchmark"
timeout 240 build/device/bench/device_bench_transfer --json "$out/device_bench.json" | tee "$out/device_bench.txt"
bench_rc=${PIPESTATUS[0]}

echo
echo "== summary"
for t in "${!result[@]}"; do printf '%-28s %s\n' "$t" "${result[$t]}"; done
printf '%-28s %s\n' device_bench_transfer "$([[ $bench_rc == 0 ]] && echo ran || echo "FAILED ($bench_rc)")"
stamp "done"
# A skip is a failure here (there is a GPU), except for tests that need more devices than this machine has.
for t in "${!result[@]}"; do
  [[ ${result[$t]} == passed ]] || { [[ ${result[$t]} == skipped ]] && grep -q "needs two" "$out/$t.log"; } || exit 1
done
[[ $bench_rc == 0 ]]
