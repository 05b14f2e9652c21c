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


def test_transformers_example_runs():
    """examples/python/transformers_train.py: 4 ranks over gloo, equal losses with and without ForeMoE."""
    pytest.importorskip("torch", minversion="2.7", reason="the transformers example needs torch >= 2.7")
    pytest.importorskip("transformers", minversion="5.0", reason="the transformers example needs transformers 5.23 "
                        "(pip install 'foremoe[transformers]')")
    r = subprocess.run([sys.executable, str(EXAMPLES / "transformers_train.py")], cwd=EXAMPLES, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "largest relative loss difference with and without ForeMoE" in r.stdout and "done" in r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line[:1] == " " and "->" in line]
    assert len(rows) == 6, r.stdout
    for row in rows:  # step micro before -> after replicas loss loss
        before, after, replicas = float(row[2]), float(row[4]), int(row[5])
        assert after < before and replicas > 0 and abs(float(row[6]) - float(row[7])) <= 1e-9, row


def test_megatron_train_example():
    """The Megatron-core example (CPU, 2 ranks over gloo): equal losses with and without ForeMoE, balanced ranks."""
    pytest.importorskip("megatron.core", reason="the example needs megatron-core 0.16.1 and torch >= 2.6")
    r = subprocess.run([sys.executable, str(EXAMPLES / "megatron_train.py")], cwd=EXAMPLES, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("step ")]
    assert len(lines) == 6 and "equal losses" in r.stdout
    for ln in lines:  # "... max/mean 1.45 without ForeMoE, 1.00 with (layer 0); loss A vs B"
        without, with_ = ln.split("max/mean ")[1].split(" without ForeMoE, ")
        assert float(with_.split()[0]) <= float(without), ln
        a, b = ln.split("loss ")[1].split(" vs ")
        assert a == b, ln


@pytest.mark.parametrize("experts", ["sequential", "grouped"])
def test_megatron_bench_runs_quick(experts, tmp_path):
    pytest.importorskip("megatron.core", reason="the benchmark needs megatron-core 0.16.1 and torch >= 2.6")
    bench = Path(__file__).resolve().parents[1] / "bench" / "bench_megatron_overhead.py"
    extra = ["--grouped"] if experts == "grouped" else ["--profile", str(tmp_path / "p.prof")]
    r = subprocess.run([sys.executable, str(bench), "--quick"] + extra, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    if experts == "sequential":  # --profile: rank 0's adapter calls and Megatron's own layer, pstats files
        import pstats

        for name in ("p.prof", "p.prof.megatron"):
            assert pstats.Stats(str(tmp_path / name)).total_calls > 0
    import json

    row = json.loads(r.stdout.splitlines()[0])
    assert row["replica_tokens"] > 0 and row["resident_megatron_us"] > 0 and "resident_added_us" in row
    assert row["experts"] == ("GroupedMLP" if experts == "grouped" else "SequentialMLP")
