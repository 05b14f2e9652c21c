#!/usr/bin/env bash
# Makes a virtual environment with PyTorch 2.x from PyPI and the trainers the adapters are tested with
# (the `megatron`, `transformers` and `test` extras of python/pyproject.toml, torch pinned by
# python/constraints-torch2.txt), for foremoe.torch's tests on torch 2.x and the foremoe.megatron /
# foremoe.transformers tests. PyPI has no CPU-only torch wheel: this downloads about 3 GB of CUDA libraries and
# takes about 5.5 GB of disk; torch then runs on the CPU (gloo) where there is no GPU.
#   bash scripts/torch2-env.sh [DIR]      (default build/venv-torch2; rebuilt from scratch)
# Then: DIR/bin/python -m pip install --no-deps ./python (or a built wheel), and run pytest with DIR/bin/python.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-$root/build/venv-torch2}
py=${PYTHON:-python3}
# The requirement strings of the three extras, read from pyproject.toml (the one place they are written).
mapfile -t reqs < <("$py" - "$root/python/pyproject.toml" <<'PY'
import sys, tomllib
extras = tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
seen = []
for req in deps + extras["megatron"] + extras["transformers"] + extras["test"]:
    if req not in seen:
        seen.append(req)
print("\n".join(seen))
PY
)
"$py" -m venv --clear "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$root/python/constraints-torch2.txt" "${reqs[@]}"
"$venv/bin/python" -c "import torch, megatron.core, transformers; print('torch', torch.__version__, \
'megatron-core', megatron.core.__version__, 'transformers', transformers.__version__)"
