"""Held replica gradients in the trainer adapters (issue 30): which mode a layer call runs and the optimizer guard.

The rule is :func:`foremoe.torch.balanced_moe`'s ``gradients="hold"``: a replica that the following update
micro-steps' plans keep on its rank accumulates its weight gradient in place and returns it once, in the backward of
the first call whose plan drops it, or in the backward of the stage's last micro-step (``"flush"``), before the
optimizer step. The adapters (:mod:`foremoe.megatron`, :mod:`foremoe.transformers`) pick the mode of each call with
:func:`gradients_mode` and register themselves with :func:`guard_optimizer_steps`: a ``torch.optim`` step (any
optimizer, through torch's global step pre-hook) over parameters of an adapter that still holds replica gradients
raises ``RuntimeError`` naming them, before a parameter changes, instead of stepping with incomplete gradients. The
same registry calls each adapter's ``optimizer_stepped()`` (where it has one) after every such step (torch's global
step post-hook): one weak set and one pair of hooks for every adapter.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import torch

__all__ = ["driver_position", "gradients_mode", "guard_optimizer_steps", "held_gradients"]

_HOLDERS: "weakref.WeakSet[Any]" = weakref.WeakSet()
_HOOKS: Optional[Tuple[Any, Any]] = None  # torch's handles of the step pre-hook and post-hook, registered once


def gradients_mode(hold: bool, last: bool) -> str:
    """``balanced_moe``'s ``gradients`` for one call: ``"reduce"`` with the rule off, else ``"flush"`` on the last
    update micro-step before the optimizer step and ``"hold"`` on the others."""
    if not hold:
        return "reduce"
    return "flush" if last else "hold"


def held_gradients(storages: Sequence[Any]) -> List[Tuple[int, int, int]]:
    """``(layer, holder rank, expert)`` of every replica gradient held now (the same on every rank), and this rank's
    held tensors not yet returned (their backward ran, the flush's did not)."""
    out = set()
    for layer, st in enumerate(storages):
        out.update((layer, int(g), int(e)) for g, e in st._held)
        out.update((layer, int(st.rank), int(e)) for e in st._held_grads)
    return sorted(out)


def describe(held: Sequence[Tuple[int, int, int]], limit: int = 6) -> str:
    """``held`` (:func:`held_gradients`) as words: the first ``limit`` of them and how many more."""
    words = [f"layer {l} expert {e} on rank {g}" for l, g, e in held[:limit]]
    more = f" and {len(held) - limit} more" if len(held) > limit else ""
    return ", ".join(words) + more


def guard_optimizer_steps(holder: Any) -> None:
    """Refuses optimizer steps while ``holder`` holds replica gradients, and calls ``holder.optimizer_stepped()``
    (when it has one) after every optimizer step. ``holder`` (kept by a weak reference) has ``storages`` (its
    :class:`~foremoe.torch.ExpertStorage` per layer), ``guarded_parameters()`` (the trainer parameters whose
    gradients the held ones belong to) and ``held_error(held)`` (the message)."""
    global _HOOKS
    _HOLDERS.add(holder)
    if _HOOKS is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _HOOKS = (register_optimizer_step_pre_hook(_refuse_held), register_optimizer_step_post_hook(_after_step))


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    for holder in list(_HOLDERS):
        stepped = getattr(holder, "optimizer_stepped", None)
        if stepped is not None:
            stepped()


def _stepped(optimizer: Any) -> set:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


def _span(t: torch.Tensor) -> Tuple[int, int]:
    start = int(t.data_ptr())
    return start, start + int(t.numel()) * t.element_size()


def _touches(params: set, guarded: Iterable[torch.Tensor], tensors: Sequence[torch.Tensor] = ()) -> bool:
    spans = []
    for p in guarded:
        # A mixed-precision optimizer (Megatron's Float16Optimizer) steps fp32 copies, kept as `param.main_param`.
        if id(p) in params or id(getattr(p, "main_param", p)) in params:
            return True
        if p.device.type != "meta" and p.numel():
            spans.append(_span(p))
    # Megatron's distributed optimizer steps fp32 parameters as shards: views of DDP's parameter buffer, where the
    # parameters' .data live (distrib_optimizer.py:420-425 of 0.16.1), so a stepped tensor overlapping a guarded
    # parameter's memory touches it.
    for t in tensors:
        if not isinstance(t, torch.Tensor) or not t.numel():
            continue
        lo, hi = _span(t)
        if any(lo < b and a < hi for a, b in spans):
            return True
    return False


def _refuse_held(optimizer: Any, args: Any, kwargs: Any) -> None:
    params: Optional[set] = None
    for holder in list(_HOLDERS):
        held = held_gradients(holder.storages)
        if not held:
            continue
        if params is None:
            params = _stepped(optimizer)
        tensors = [p for group in optimizer.param_groups for p in group["params"]]
        if _touches(params, holder.guarded_parameters(), tensors):
            raise RuntimeError(holder.held_error(held))


def driver_position(plan: Any) -> Optional[Tuple[str, bool]]:
    """``(stage, whether it is the stage's last micro-step)`` of the running or finished
    :class:`~foremoe.torch.ReplayDriver` whose :meth:`~foremoe.torch.ReplayDriver.plan` handed out ``plan`` (the
    same object), or ``None`` when no driver did (a plan made another way, or ``None``)."""
    if plan is None:
        return None
    from .replay import _DRIVERS

    for driver in list(_DRIVERS):
        plans = driver._plans
        for m, p in enumerate(plans):
            if p is plan:
                return str(driver.stage), m == len(plans) - 1
    return None
