import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session", autouse=True)
def _load_cache(tmp_path_factory):
    """simulate's load cache ("auto": $FOREMOE_CACHE_DIR first) stays inside this test session, for this process
    and the processes it starts."""
    os.environ["FOREMOE_CACHE_DIR"] = str(tmp_path_factory.mktemp("load-cache"))
    yield


@pytest.fixture(scope="session")
def cli():
    """The C++ `foremoe` program: $FOREMOE_CLI, build/release/tools/foremoe, or on PATH; skip when absent."""
    for cand in (os.environ.get("FOREMOE_CLI"), REPO / "build/release/tools/foremoe", shutil.which("foremoe")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return str(cand)
    pytest.skip("C++ foremoe binary not built (set FOREMOE_CLI or build build/release)")
