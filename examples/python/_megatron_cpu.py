"""TEST / CPU ONLY. The examples run Megatron-core on a CPU over gloo; the patches that make that possible live in
the test suite (python/tests/megatron_cpu.py) and are re-exported here. On GPUs leave this file out: foremoe.megatron
itself needs no patch."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python" / "tests"))

from megatron_cpu import TinyMoE, apply_cpu_patches, init_megatron, make_config, set_action, set_targets  # noqa: E402,F401
