"""``python -m foremoe`` runs the C++ program: same output, status and messages as the ``foremoe`` binary."""

import re
import subprocess
import sys

import numpy as np
import pytest


def _both(cli, args, **kw):
    a = subprocess.run([cli, *args], capture_output=True, text=True, timeout=300, **kw)
    b = subprocess.run([sys.executable, "-m", "foremoe", *args], capture_output=True, text=True, timeout=300, **kw)
    return a, b


@pytest.mark.parametrize("args", [[], ["--help"], ["--version"], ["trace"], ["trace", "--help"], ["simulate", "--help"],
                                  ["plan", "--help"], ["trace", "count", "--help"], ["trace", "gen", "--help"],
                                  ["plan", "--strategy", "list"], ["nosuch"]])
def test_help_and_listings_match_the_program(cli, args):
    a, b = _both(cli, args)
    assert (b.returncode, b.stdout, b.stderr) == (a.returncode, a.stdout, a.stderr)


def test_bad_input_is_a_message_not_a_traceback(cli, tmp_path):
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"not an npy file")
    for args in (["plan", "--loads", str(tmp_path / "missing.npy")], ["plan", "--loads", str(bad)],
                 ["simulate", "--slots", "0"], ["trace", "count", str(bad)], ["simulate", "--no-such-flag"]):
        a, b = _both(cli, args)
        assert b.returncode == a.returncode and b.returncode in (1, 2), args
        assert "Traceback" not in b.stderr and b.stderr == a.stderr, args


def test_plan_output_matches_the_program(cli, tmp_path):
    rng = np.random.default_rng(7)
    loads = rng.poisson(np.exp(rng.standard_normal((1, 3, 16))) * 100, size=(2, 3, 16)).astype(np.int64)
    np.save(tmp_path / "l.npy", loads)
    args = ["plan", "--loads", str(tmp_path / "l.npy"), "--nodes", "2", "--gpus-per-node", "2", "--slots", "5"]
    a, b = _both(cli, args)
    assert a.returncode == b.returncode == 0
    # The planner's own time (" in 0.06 ms") differs between runs; everything else is the same text.
    strip = lambda s: re.sub(r"in [0-9.]+ ms", "in T ms", s)  # noqa: E731
    assert a.stdout and strip(a.stdout) == strip(b.stdout)
