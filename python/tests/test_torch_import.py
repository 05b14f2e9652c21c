"""Importing foremoe.torch without PyTorch gives a clear message (runs whether or not torch is installed)."""

import subprocess
import sys


def test_import_without_torch_says_what_to_install():
    code = "import sys; sys.modules['torch'] = None; import foremoe.torch"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "foremoe.torch needs PyTorch" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-c", "import sys; sys.modules['torch'] = None; import foremoe"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr  # the rest of foremoe does not need it
