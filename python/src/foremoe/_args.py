"""Argument checks shared by every entry point of the package (internal).

One source of truth for what an integer argument is: the Python wrappers call these, and so do the C++
bindings users call directly (``Topology``, ``Placement.from_array``, ``Plan.source_split`` ...), through
``foremoe._core``. Nothing is truncated or wrapped silently: ``int(8.7)`` would be 8 and ``np.int32(2**32 + 3)``
would be 3, so an integer is an ``int``, a NumPy integer or a float holding a whole number, and it must fit the
range it is stored in; an array of integers is checked before any narrowing cast. A tensor that requires grad is
read detached (its values, not its graph, are what these functions take). Messages name the argument (``name``,
e.g. ``"count_loads: num_experts"``), the position in an array and the value: ``TypeError`` for a value of the
wrong type, ``ValueError`` for a wrong value.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Dict, List, Optional

import numpy as np

INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def describe(value: Any) -> str:
    """``value`` for a message: its type and a short repr (``float 8.7``, ``str '2'``)."""
    r = repr(value)
    if len(r) > 60:
        r = r[:57] + "..."
    return f"{type(value).__name__} {r}"


def _range(name: str, v: Any, lo: int, hi: int, typed: str = "") -> str:
    return f"{name} = {v} is outside {typed + ' ' if typed else ''}[{lo}, {hi}]"


def integer(value: Any, name: str, lo: int = INT32_MIN, hi: int = INT32_MAX) -> int:
    """``value`` as an ``int`` in ``[lo, hi]`` (the default: a C++ ``int``). Accepts ``int``, NumPy integers and
    anything with ``__index__``, and floats holding a whole number (``8.0``); refuses ``bool`` and other types
    (``TypeError``), non-integral or non-finite floats and values outside the range (``ValueError``)."""
    if type(value) is int and lo <= value <= hi:  # the common case, before any other test
        return value
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {describe(value)}")
    try:
        v = operator.index(value)
    except TypeError:
        if not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be an integer, got {describe(value)}") from None
        f = float(value)
        if not math.isfinite(f) or f != math.floor(f):
            raise ValueError(f"{name} must be an integer, got {value!r}") from None
        v = int(f)
    if not lo <= v <= hi:
        typed = "int32" if (lo, hi) == (INT32_MIN, INT32_MAX) else "int64" if (lo, hi) == (INT64_MIN, INT64_MAX) \
            else ""
        raise ValueError(_range(name, v, lo, hi, typed))
    return v


def optional_integer(value: Any, name: str, lo: int = INT32_MIN, hi: int = INT32_MAX) -> Optional[int]:
    """:func:`integer`, with ``None`` passed through."""
    return None if value is None else integer(value, name, lo, hi)


def number(value: Any, name: str) -> float:
    """``value`` as a ``float``: any real number (``int``, ``float``, NumPy scalars); ``TypeError`` otherwise (a
    string, a complex number, ``bool``). Its range is the caller's to check."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {describe(value)}")
    return float(value)


def to_numpy(x: Any) -> np.ndarray:
    """``x`` as a NumPy array: arrays as they are, tensors detached and on the host (a tensor that requires grad
    is read for its values), anything else through ``np.asarray``."""
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("torch") and hasattr(x, "detach"):
        t = x.detach().cpu()
        try:
            return t.numpy()
        except (RuntimeError, TypeError):  # a torch built against another NumPy: through DLPack
            return np.from_dlpack(t.contiguous())
    return np.asarray(x)


def _at(idx: Any) -> str:
    return "[" + ", ".join(str(int(i)) for i in idx) + "]" if len(idx) else ""


_IINFO: Dict[Any, Any] = {}


def _iinfo(dtype: Any) -> Any:
    """``np.iinfo(dtype)``, made once per dtype (making one costs more than the checks that read it)."""
    info = _IINFO.get(dtype)
    if info is None:
        info = _IINFO[dtype] = np.iinfo(dtype)
    return info


def int_array(value: Any, name: str, *, dtype: Any = np.int64, lo: Optional[int] = None,
              hi: Optional[int] = None) -> np.ndarray:
    """``value`` (an array, a tensor or nested sequences) as a C-contiguous array of ``dtype`` whose every
    element is in ``[lo, hi]`` (default: ``dtype``'s range). Integer dtypes are taken as they are, floats only
    where they hold whole numbers, Python objects (huge ints) one by one; anything else is refused naming the
    dtype, a bad element naming its index and value (``ValueError``)."""
    try:
        a = to_numpy(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be an array of integers: {e}") from None
    info = _iinfo(dtype)
    lo_, hi_ = (info.min if lo is None else lo), (info.max if hi is None else hi)
    typed = info.dtype.name if (lo, hi) == (None, None) else ""
    if a.size == 0:
        return np.ascontiguousarray(a, dtype=dtype)
    kind = a.dtype.kind
    if kind == "O":  # Python ints too large for NumPy's integers, mixed objects
        flat = a.reshape(-1)
        for i, v in enumerate(flat.tolist()):
            integer(v, f"{name}{_at(np.unravel_index(i, a.shape))}", lo_, hi_)
        return np.ascontiguousarray(a.astype(object).astype(dtype))
    if kind == "f":
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(a) | (a != np.floor(a))
        if bad.any():
            idx = tuple(np.argwhere(bad)[0]) if a.ndim else ()
            raise ValueError(f"{name}{_at(idx)} = {a[idx].item()!r} is not an integer")
    elif kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {a.dtype}")
    if a.min() < lo_ or a.max() > hi_:
        out = (a < lo_) | (a > hi_)
        idx = tuple(np.argwhere(out)[0]) if a.ndim else ()
        v = int(a[idx].item())  # floats here hold whole numbers
        if lo == 0 and hi is None and v < 0:
            raise ValueError(f"{name}{_at(idx)} = {v} is negative")
        raise ValueError(_range(f"{name}{_at(idx)}", v, lo_, hi_, typed))
    return np.ascontiguousarray(a, dtype=dtype)


def int_list(value: Any, name: str, lo: int = INT32_MIN, hi: int = INT32_MAX) -> List[int]:
    """A 1-D sequence of integers (``layer_map``) as a list of ``int``, as :func:`int_array` checks them."""
    a = int_array(value, name, lo=lo, hi=hi)
    if a.ndim != 1:
        raise ValueError(f"{name} must be a 1-D list of integers, got shape {list(a.shape)}")
    return a.tolist()
