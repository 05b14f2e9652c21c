#!/usr/bin/env bash
# Installs the Debian packages ForeMoE builds with, only those missing.
# Idempotent and silent when everything is present. `--ci` adds what CI's
# fuzzer and sanitizer runs need (clang with its runtime), the lint tools
# (clang-tidy-14, clang-format-14; scripts/lint.sh) and what the foremoe.torch
# tests run on (Debian's CPU PyTorch with gloo, a venv over it, headers to
# build the extension for that interpreter).
set -euo pipefail

pkgs=(cmake ninja-build g++ doctest-dev libbenchmark-dev)
if [[ "${1:-}" == "--ci" ]]; then
  pkgs+=(ccache clang libclang-rt-14-dev clang-tidy-14 clang-format-14 python3-torch python3-venv python3-dev)
fi

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

echo "foremoe: installing ${missing[*]}" >&2
sudo_cmd=()
[[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
