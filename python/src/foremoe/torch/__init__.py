"""ForeMoE inside a PyTorch training step (optional: needs ``torch``).

The public names of every submodule listed in ``_SUBMODULES`` are re-exported here, so each part of the
package (transfer engine, router replay, balanced layer, distributed mover) lives in its own file and this
file does not change when one is added.
"""

from __future__ import annotations

import importlib

try:
    import torch as _torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised by a test that hides torch
    raise ImportError(
        "foremoe.torch needs PyTorch (torch >= 1.13): install it (for example Debian's python3-torch, or the "
        "torch wheel for your CUDA) in this environment; the rest of foremoe works without it"
    ) from exc

_SUBMODULES = ("engine", "replay", "distributed", "layer")

__all__: list[str] = []
for _name in _SUBMODULES:
    try:
        _mod = importlib.import_module(f".{_name}", __name__)
    except ModuleNotFoundError as _exc:
        if _exc.name == f"{__name__}.{_name}":
            continue  # that part is not in this build of the package
        raise
    for _public in getattr(_mod, "__all__", ()):
        globals()[_public] = getattr(_mod, _public)
        __all__.append(_public)
del _name
