"""``python -m foremoe``: the ``foremoe`` program itself, compiled into the extension.

Every command, option, default, message and exit status is the C++ program's (``tools/``, whose options come
from the library's one schema), so ``python -m foremoe X`` behaves as ``foremoe X``: errors are printed, not
raised as tracebacks.

The one addition is drawing: ``simulate --plot DIR`` and ``plan --plot FILE`` (with ``--plot-micro-step`` and
``--plot-layer``) are taken off the arguments here, the destination is checked before any work, the program runs
with the hidden ``--plot-document`` (the results it writes as ``--json`` / ``--out``, to a temporary file, so its
output is unchanged), and :mod:`foremoe.plot` draws from that document (matplotlib, the ``plot`` extra).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from foremoe import _core

#: The options this front end takes off, per command: name -> takes an integer (else a path).
_PLOT_OPTIONS = {
    "simulate": {"plot": False},
    "plan": {"plot": False, "plot-micro-step": True, "plot-layer": True},
}


def _usage(command: str, message: str) -> int:
    sys.stderr.write(f"foremoe {command}: {message}\n")
    return 2


def _split_plot(command: str, args: List[str]) -> Tuple[List[str], Dict[str, str]]:
    """Takes the plot options (``--name VALUE`` or ``--name=VALUE``) off ``args``; the rest is the program's."""
    names = _PLOT_OPTIONS[command]
    rest: List[str] = []
    found: Dict[str, str] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            rest.extend(args[i:])
            break
        name, eq, value = a[2:].partition("=") if a.startswith("--") else ("", "", "")
        if name in names:
            if name in found:
                raise ValueError(f"option --{name} given twice")
            if not eq:
                if i + 1 >= len(args):
                    raise ValueError(f"option --{name} needs a value")
                i += 1
                value = args[i]
            found[name] = value
        else:
            rest.append(a)
        i += 1
    return rest, found


def _run(args: List[str]) -> int:
    # Python's buffered output first, so the program's own output (written by C++) follows it in order.
    sys.stdout.flush()
    sys.stderr.flush()
    return int(_core.cli(args))


def _plot(command: str, args: List[str]) -> int:
    """``command`` with its plot options: check, run the program with ``--plot-document``, draw."""
    try:
        rest, opts = _split_plot(command, args)
    except ValueError as e:
        return _usage(command, str(e))
    if not opts or any(a in ("-h", "--help") for a in rest):
        if opts and "plot" not in opts:
            return _usage(command, "--plot-micro-step and --plot-layer choose what --plot draws: give --plot FILE")
        return _run([command] + rest)
    if "plot" not in opts:
        return _usage(command, "--plot-micro-step and --plot-layer choose what --plot draws: give --plot FILE")
    if "--print-config" in rest:
        return _usage(command, "--print-config simulates nothing to draw; leave out --plot")
    choice: Dict[str, Optional[int]] = {}
    for name in ("plot-micro-step", "plot-layer"):
        value = opts.get(name)
        try:
            choice[name] = None if value is None else int(value)
        except ValueError:
            return _usage(command, f"--{name} must be an integer, got '{value}'")
    from foremoe import plot  # needs no matplotlib to import

    try:
        plot.pyplot()
        dest = plot.check_plot_dir(opts["plot"]) if command == "simulate" else plot.check_plot_file(opts["plot"])
    except plot.PlotError as e:
        return _usage(command, str(e))
    quiet = "--quiet" in rest
    with tempfile.TemporaryDirectory(prefix="foremoe-plot-") as tmp:
        doc_path = Path(tmp) / "document.json"
        status = _run([command] + rest + ["--plot-document", str(doc_path)])
        if status != 0:
            return status
        if not doc_path.is_file():  # e.g. `plan --strategy list`: nothing was planned
            return _usage(command, "--plot: this run produced nothing to draw")
        doc = json.loads(doc_path.read_text())
    try:
        if command == "simulate":
            written = plot.simulate_figures(doc, dest)
        else:
            path, m, layer = plot.plan_figure(doc, dest, choice["plot-micro-step"], choice["plot-layer"])
            written = [path]
    except plot.PlotError as e:
        return _usage(command, str(e))
    except OSError as e:
        sys.stderr.write(f"foremoe {command}: --plot: {e}\n")
        return 1
    if not quiet:
        for p in written:
            sys.stderr.write(f"wrote {p}\n")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Runs ``foremoe`` on ``argv`` (default: ``sys.argv[1:]``) and returns its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in _PLOT_OPTIONS and any(a.startswith("--plot") for a in args[1:]):
        return _plot(args[0], args[1:])
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
