"""foremoe.torch given bad input or left in a bad state (issue 27, item 4): each test is named after the defect
it covers and failed before its fix.

1. A ReplayDriver still planning when the interpreter exits aborted the process (exit 134).
2. Integers silently truncated or wrapped.
3. Unclear messages: AttributeError for a list where a tensor goes, a NaN load reported as a negative one, a
   tensor that requires grad refused with RuntimeError.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch (torch) is not installed; foremoe.torch needs it")

import foremoe  # noqa: E402
import foremoe.torch as ft  # noqa: E402
from foremoe.torch import engine  # noqa: E402

# -- 1. the planning thread at interpreter exit ----------------------------------------------------------------------

# A stage long enough to plan (~0.2 s) that the thread is inside the C++ planner when the script ends.
EXIT_SCRIPT = textwrap.dedent("""
    import sys, time
    import numpy as np
    import foremoe, foremoe.torch as ft

    how, owners = sys.argv[1], sys.argv[2] == "owners"
    loads = np.random.default_rng(0).integers(0, 1000, size=(64, 48, 256)).astype(np.int64)
    planner = foremoe.Planner(foremoe.Topology(4, 8, 12))
    driver = ft.ReplayDriver(planner, loads, owners=np.repeat(np.arange(32), 8) if owners else None)
    time.sleep(0.02)  # the thread is planning now
    assert driver.running
    if how == "raise":
        raise RuntimeError("the trainer failed")
    if how == "exit3":
        sys.exit(3)
    if how == "del":
        del driver  # the thread holds the driver: it is collected at exit
    print("done")
""")


@pytest.mark.parametrize("how, code, owners", [("end", 0, "stage-owners"), ("raise", 1, "stage-owners"),
                                               ("raise", 1, "owners"), ("exit3", 3, "owners"),
                                               ("del", 0, "stage-owners")])
def test_replay_driver_planning_at_exit_aborts_with_134(tmp_path, how, code, owners):
    script = tmp_path / "trainer.py"
    script.write_text(EXIT_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, str(script), how, owners], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == code, r.stderr[-2000:]
    assert "terminate called" not in r.stderr
    if how == "raise":
        assert "RuntimeError: the trainer failed" in r.stderr


def test_replay_driver_del_while_planning_does_not_raise():
    loads = np.random.default_rng(1).integers(0, 1000, size=(16, 8, 64)).astype(np.int64)
    d = ft.ReplayDriver(foremoe.Planner(foremoe.Topology(2, 4, 10)), loads)
    d.__del__()  # as the collector would: stops and joins, never raises
    assert not d.running
    d.__del__()  # twice is fine
