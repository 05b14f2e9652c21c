import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "python"


@pytest.mark.parametrize("name", ["verl_style.py", "slime_style.py", "megatron_dispatch.py"])
def test_example_runs(name):
    r = subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=EXAMPLES, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_module_usage():
    r = subprocess.run([sys.executable, "-m", "foremoe"], capture_output=True, text=True)
    assert r.returncode == 2 and "simulate" in r.stdout and "plan" in r.stdout


def test_bench_runs_quick():
    bench = Path(__file__).resolve().parents[1] / "bench" / "bench_plan_overhead.py"
    r = subprocess.run([sys.executable, str(bench), "--quick"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "overhead" in r.stdout
