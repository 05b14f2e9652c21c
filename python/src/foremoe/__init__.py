"""ForeMoE: per-micro-step expert load balancing for MoE RL post-training.

Python front end over the header-only C++ library (nanobind). The heavy work
(counting routed ids, planning, simulating) runs in C++ with the GIL released;
inputs are read in place where possible (routed ids of any supported integer
dtype and strides, NumPy or PyTorch CPU tensors through DLPack), outputs are
NumPy arrays over the buffers C++ filled.

Bad input raises ``ValueError`` with the C++ library's message.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np

from . import _core
from ._core import Placement, Plan, Topology

__version__: str = _core.__version__

__all__ = [
    "Placement",
    "Plan",
    "Planner",
    "STRATEGIES",
    "SIM_STRATEGIES",
    "Topology",
    "count_loads",
    "simulate",
    "synthetic_loads",
    "synthetic_trace",
    "__version__",
]

#: Planner strategies (as on the command line), from the C++ registry in listing order.
STRATEGIES = tuple(_core.strategy_names())
#: Simulator strategies: the planner's plus ``ideal`` (every layer perfectly balanced, moves free).
SIM_STRATEGIES = STRATEGIES + ("ideal",)

_ID_DTYPES = (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.int64)


def _is_tensor_like(x: Any) -> bool:
    """NumPy arrays and DLPack producers (PyTorch CPU tensors) go to C++ as they are."""
    return isinstance(x, np.ndarray) or hasattr(x, "__dlpack__")


def _offsets(x: Any, name: str) -> Optional[np.ndarray]:
    if x is None:
        return None
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.int64)


def _int64_loads(x: Any, name: str) -> np.ndarray:
    """Loads of any integer dtype, or floats holding whole non-negative counts, as C-contiguous int64."""
    a = np.asarray(x)
    if a.dtype == np.int64 and a.flags.c_contiguous:
        return a
    if a.dtype.kind == "f":
        if not np.all(np.isfinite(a)):
            raise ValueError(f"{name}: non-finite load at index {np.argwhere(~np.isfinite(a))[0].tolist()}")
        if not np.all(a == np.floor(a)):
            raise ValueError(f"{name}: non-integral load at index {np.argwhere(a != np.floor(a))[0].tolist()}")
    elif a.dtype.kind not in "iu" and a.size:
        raise ValueError(f"{name} must hold integer counts, got dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.int64)


def count_loads(
    routed_experts: Any,
    microbatch_offsets: Optional[Sequence[int]] = None,
    *,
    num_experts: int,
    layer_map: Optional[Sequence[int]] = None,
    num_sources: int = 0,
    source_offsets: Optional[Sequence[int]] = None,
    return_by_source: bool = False,
):
    """Counts routed expert ids into per-micro-step loads.

    Args:
        routed_experts: ``[T, L, K]`` expert ids (tokens in execution order,
            trace layers, top-k) of dtype int8/uint8/int16/uint16/int32/int64;
            ``-1`` (all-ones for unsigned dtypes) means "no route". Any strides;
            NumPy arrays and PyTorch CPU tensors are read in place (no copy).
        microbatch_offsets: ``[M + 1]`` token offsets of the micro-steps
            (starting at 0, ending at ``T``); ``None`` is one micro-step.
        num_experts: routed experts per MoE layer.
        layer_map: trace layer -> MoE layer index, ``-1`` for dense layers whose
            ids are ignored; ``None`` means every trace layer is an MoE layer.
        num_sources: > 0 to also split the loads by source EP rank.
        source_offsets: ``[M * num_sources + 1]`` token offsets of the ranks'
            tokens within each micro-step; ``None`` splits evenly.
        return_by_source: also return the ``[M, L, E, num_sources]`` split.

    Returns:
        ``[M, L, E]`` int64 loads (and the split when ``return_by_source``).
    """
    ids = routed_experts if _is_tensor_like(routed_experts) else np.asarray(routed_experts)
    if isinstance(ids, np.ndarray) and ids.dtype == np.bool_:
        raise ValueError("count_loads: routed_experts must be an integer array, got dtype bool")
    lm = None if layer_map is None else [int(v) for v in layer_map]
    totals, by_source = _core.count_loads(
        ids,
        _offsets(microbatch_offsets, "microbatch_offsets"),
        int(num_experts),
        lm,
        int(num_sources),
        _offsets(source_offsets, "source_offsets"),
    )
    return (totals, by_source) if return_by_source else totals




def _as_resident(resident: Any, topology: Topology, num_experts: int) -> Optional[Placement]:
    if resident is None:
        return None
    if isinstance(resident, Plan):
        return resident.placement
    if isinstance(resident, Placement):
        return resident
    a = np.asarray(resident)
    if a.dtype.kind not in "iu":
        raise ValueError(f"resident must be a Plan, a Placement or a [L, G, S] integer array, got dtype {a.dtype}")
    return Placement.from_array(topology, np.ascontiguousarray(a, dtype=np.int32), int(num_experts))


class Planner:
    """Plans expert replicas, placement, token split and weight moves per micro-step.

    Args:
        topology: a :func:`Topology`.
        strategy: one of :data:`STRATEGIES`: ``foremoe`` (default; two-level: step-level owners + replicas in
            spare slots), ``foremoe-free`` (any slot holds anything), ``eplb``, ``eplb-oracle`` or ``static``.
        move_budget: new replicas per GPU per micro-step; ``None``: the spare slots.
        threads: planning threads over layers (plans do not depend on the count).
        hierarchical_owners: owners placed nodes first, then GPUs in each node.
        local_search_rounds: replica local-search rounds per layer.
        eplb_num_groups: expert groups for EPLB.
        exact_split: re-split every two-level plan exactly (plans from a resident placement otherwise keep the
            search's own split, at most 0.05% above the best makespan it met).
        reowning_free: a new owner map costs nothing (colocated trainers); ``False`` keeps the previous step's
            owners unless they are more than 5% worse than a fresh plan.

    One planner object is not safe for concurrent calls; use one per thread.
    """

    def __init__(
        self,
        topology: Topology,
        strategy: str = "foremoe",
        move_budget: Optional[int] = None,
        threads: int = 1,
        *,
        hierarchical_owners: bool = True,
        local_search_rounds: int = 4,
        eplb_num_groups: int = 1,
        exact_split: bool = False,
        reowning_free: bool = True,
    ) -> None:
        if not isinstance(topology, Topology):
            raise ValueError(f"Planner: topology must be a foremoe.Topology, got {type(topology).__name__}")
        self._core = _core.Planner(
            topology, str(strategy), None if move_budget is None else int(move_budget), int(threads),
            bool(hierarchical_owners), int(local_search_rounds), int(eplb_num_groups), bool(exact_split),
            bool(reowning_free),
        )
        self.topology = topology

    strategy = property(lambda self: self._core.strategy, doc="Strategy name.")
    move_budget = property(lambda self: self._core.move_budget, doc="New replicas per GPU per micro-step or None.")
    threads = property(lambda self: self._core.threads, doc="Planning threads.")
    last_planner_seconds = property(lambda self: self._core.last_planner_seconds,
                                    doc="Wall time of the last call's planning (C++ side).")

    def plan(
        self,
        loads: Any,
        resident: Any = None,
        *,
        previous_loads: Any = None,
        stage: str = "update",
    ) -> Union[Plan, List[Plan]]:
        """Plans one micro-step (``loads`` ``[L, E]``) or the micro-steps of one RL step (``[M, L, E]``).

        As ``foremoe plan``: owners (two-level mode) come from the sum over the
        micro-steps; each micro-step starts from the previous one's placement,
        the first from ``resident`` (a :class:`Plan`, :class:`Placement` or a
        ``[L, G, S]`` array of expert ids, -1 empty), or none.
        ``previous_loads`` (``[L, E]`` or ``[M, L, E]``) is the history
        ``eplb`` plans from. ``stage`` is ``update`` or ``recompute``.

        Returns a :class:`Plan` for ``[L, E]`` loads, a list of them for ``[M, L, E]``.
        """
        a = _int64_loads(loads, "loads")
        if a.ndim not in (2, 3):
            raise ValueError(f"plan: loads must be [layers, experts] or [micro_steps, layers, experts], got shape {a.shape}")
        single = a.ndim == 2
        if single:
            a = a[None]
        prev = None
        if previous_loads is not None:
            prev = _int64_loads(previous_loads, "previous_loads")
            if prev.ndim == 3:
                prev = np.ascontiguousarray(prev.sum(axis=0))
            if prev.ndim != 2:
                raise ValueError(f"plan: previous_loads must be [L, E] or [M, L, E], got shape {prev.shape}")
        res = _as_resident(resident, self.topology, a.shape[2])
        plans = self._core.plan_step(a, res, prev, str(stage))
        return plans[0] if single else plans

    def __repr__(self) -> str:
        t = self.topology
        return (f"Planner(Topology({t.nodes}, {t.gpus_per_node}, {t.slots}), strategy={self.strategy!r}, "
                f"move_budget={self.move_budget!r}, threads={self.threads})")


def simulate(
    config: Optional[Mapping[str, Any]] = None,
    loads: Any = None,
    step_offsets: Optional[Sequence[int]] = None,
    strategies: Union[None, str, Sequence[str]] = None,
) -> Dict[str, Any]:
    """Replays RL steps on a modelled cluster and compares strategies, as ``foremoe simulate --json``.

    Args:
        config: the keys of ``foremoe simulate --config FILE.json`` (``model``,
            ``topology``, ``batch``, ``sim``, ``cost``) plus the command-line
            settings ``preset`` (``qwen3-30b-a3b`` or ``deepseek-v3``), ``steps``,
            ``nodes``, ``gpus_per_node``, ``slots``, ``seed``, ``threads``,
            ``double_buffer``. ``None``: the command's defaults.
        loads: ``[M, L, E]`` per-micro-step loads instead of the synthetic batch.
        step_offsets: ``[S + 1]`` micro-step offsets of the RL steps in ``loads``.
        strategies: names (list or comma-separated); default all of :data:`SIM_STRATEGIES`.

    Returns:
        The JSON document ``foremoe simulate --json`` writes, as a dict.
    """
    if strategies is None:
        names = list(SIM_STRATEGIES)
    elif isinstance(strategies, str):
        names = [s for s in strategies.split(",") if s]
    else:
        names = [str(s) for s in strategies]
    if config is not None and not isinstance(config, Mapping):
        raise ValueError(f"simulate: config must be a dict or None, got {type(config).__name__}")
    cfg = None if config is None else _plain_dict(config)
    arr = None
    if loads is not None:
        arr = _int64_loads(loads, "loads")
        if arr.ndim != 3:
            raise ValueError(f"simulate: loads must be [micro_steps, layers, experts], got shape {arr.shape}")
    return _core.simulate(cfg, arr, _offsets(step_offsets, "step_offsets"), names)


def _plain_dict(m: Mapping[str, Any]) -> Dict[str, Any]:
    return {k: (_plain_dict(v) if isinstance(v, Mapping) else v) for k, v in m.items()}


def synthetic_trace(**config: Any) -> Dict[str, Any]:
    """A deterministic synthetic GRPO routing trace.

    Keyword arguments are :cpp:`SyntheticConfig` fields (``seed``,
    ``num_layers``, ``num_experts``, ``topk``, ``num_steps``,
    ``prompts_per_step``, ``responses_per_prompt``, ``prompt_length`` /
    ``response_length`` as dicts of ``mean, sigma, min_tokens, max_tokens``,
    ``num_topics``, ``topics_per_prompt``, ``topic_concentration``,
    ``topic_mix_concentration``, ``response_topic_weight``, ``popularity``
    (``lognormal``/``zipf``), ``skew``, ``skew_layer_sigma``, ``persistence``,
    ``num_gpus``, ``microbatch_tokens_per_gpu``) plus ``preset``
    (``qwen3-30b-a3b`` default or ``deepseek-v3``).

    Returns:
        dict with ``routed_ids`` ``[T, L, K]`` int16, ``microbatch_offsets``,
        ``source_offsets``, ``step_offsets`` (in micro-steps),
        ``sequence_offsets``, ``num_experts`` and ``num_sources``.
    """
    return _core.synthetic_trace(_plain_dict(config))


def synthetic_loads(*, by_source: bool = False, **config: Any) -> Dict[str, Any]:
    """The loads of :func:`synthetic_trace` with the same config, counted without storing ids.

    Returns:
        dict with ``loads`` ``[M, L, E]`` int64, ``loads_by_source``
        (``[M, L, E, num_gpus]`` when ``by_source``, else None) and ``step_offsets``.
    """
    return _core.synthetic_loads(_plain_dict(config), bool(by_source))
