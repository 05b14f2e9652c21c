"""``python -m foremoe``: the ``foremoe`` program itself, compiled into the extension.

Every command, option, default, message and exit status is the C++ program's (``tools/``, whose options come
from the library's one schema), so ``python -m foremoe X`` behaves as ``foremoe X``: errors are printed, not
raised as tracebacks.
"""

from __future__ import annotations

import sys
from typing import List, Optional

from foremoe import _core


def main(argv: Optional[List[str]] = None) -> int:
    """Runs ``foremoe`` on ``argv`` (default: ``sys.argv[1:]``) and returns its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    # Python's buffered output first, so the program's own output (written by C++) follows it in order.
    sys.stdout.flush()
    sys.stderr.flush()
    return int(_core.cli(args))


if __name__ == "__main__":
    sys.exit(main())
