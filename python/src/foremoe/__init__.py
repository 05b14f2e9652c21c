"""ForeMoE: per-micro-step expert load balancing for MoE RL post-training.

Python front end over the header-only C++ library (nanobind). The heavy work
(counting routed ids, planning, simulating) runs in C++ with the GIL released;
inputs are read in place where possible (routed ids of any supported integer
dtype and strides, NumPy or PyTorch CPU tensors through DLPack), outputs are
NumPy arrays over the buffers C++ filled.

Bad input raises ``ValueError`` with the C++ library's message, or, for an argument of the wrong type or an integer
that is not one (8.7, 2**32 where an int32 goes), ``TypeError``/``ValueError`` naming it (``foremoe._args``).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Union

import numpy as np

from . import _core
from ._args import describe, integer, int_array, int_list, to_numpy
from ._core import HeldGradients, Placement, Plan, Topology

__version__: str = _core.__version__

__all__ = [
    "HeldGradients",
    "Placement",
    "Plan",
    "Planner",
    "STRATEGIES",
    "SIM_STRATEGIES",
    "TRACE_FORMATS",
    "Topology",
    "TraceRecord",
    "MicroBatchPacking",
    "count_loads",
    "export_placement",
    "read_sglang",
    "read_trace",
    "read_verl",
    "rebalance_experts",
    "sequence_histograms",
    "options",
    "pack_by_tokens",
    "pack_micro_batches",
    "plan_document",
    "simulate",
    "simulate_config",
    "synthetic_loads",
    "synthetic_trace",
    "trace_formats",
    "__version__",
]

#: Planner strategies (as on the command line), from the C++ registry in listing order.
STRATEGIES = tuple(_core.strategy_names())
#: Simulator strategies: the planner's plus the simulator-only ``ideal`` (the physical limit), from the same registry.
SIM_STRATEGIES = tuple(_core.sim_strategy_names())
#: Trace input formats (``read_trace``, ``foremoe trace count --format``), from the C++ registry in listing order.
TRACE_FORMATS = tuple(f["name"] for f in _core.trace_formats())



def options(command: str = "simulate") -> List[Dict[str, Any]]:
    """The option schema of a front end, from the C++ library: ``simulate`` (the config of :func:`simulate`
    and ``foremoe simulate``), ``planner`` (the keywords of :class:`Planner`), ``plan`` (``foremoe plan``),
    ``synthetic`` (the keywords of :func:`synthetic_trace`, the generator flags of ``foremoe trace gen``),
    ``count`` or ``move`` (the keys of ``Plan.transfers(move=...)``, ``foremoe plan``'s ``cost.move_*`` settings).

    Each entry: ``key`` (JSON path, e.g. ``topology.slots``), ``flag`` (command-line name), ``type``
    (int, float, bool, string, enum), ``default``, ``min``/``max`` (numbers), ``choices`` (enums), ``help``.
    """
    return json.loads(_core.options(str(command)))


#: Deepest nesting of a config the C++ JSON reader takes (``foremoe::json``'s parser bound).
_MAX_DEPTH = 256


def _plain(x: Any, where: str = "config", depth: int = 0) -> Any:
    """Mappings, sequences and NumPy scalars as plain JSON-able Python values; ``ValueError`` naming the key
    (``where``: ``config.sim.seed``) of a value JSON cannot hold (NaN, infinity, bytes, other objects) and the
    depth of a config nested deeper than the C++ reader takes."""
    if depth > _MAX_DEPTH:
        raise ValueError(f"{where.split('.')[0].split('[')[0]}: nested deeper than {_MAX_DEPTH} levels (at "
                         f"{where[:80]}{'...' if len(where) > 80 else ''})")
    if isinstance(x, Mapping):
        return {str(k): _plain(v, f"{where}.{k}", depth + 1) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(x)]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not np.isfinite(x):
        raise ValueError(f"{where}: {x} is not a finite number (JSON has no NaN or infinity)")
    if x is None or isinstance(x, (str, bool, int, float)):
        return x
    raise ValueError(f"{where}: {type(x).__name__} {x!r:.60} is not a JSON value (a number, string, bool, None, "
                     f"list or dict)")


def _json(x: Any, where: str = "config") -> str:
    return json.dumps(_plain(x, where), allow_nan=False)


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
    return int_array(a, name)  # a uint64 past int64 is named, not wrapped negative


def _int64_loads(x: Any, name: str, lo: Optional[int] = None) -> np.ndarray:
    """Loads of any integer dtype, or floats holding whole counts, as C-contiguous int64 (a tensor that requires
    grad is read detached). Negative loads are refused by the C++ load tensor (naming micro-step, layer and
    expert), or here with ``lo=0`` where nothing else checks them."""
    return int_array(x, name, lo=lo)


def count_loads(
    routed_experts: Any,
    microbatch_offsets: Optional[Sequence[int]] = None,
    *,
    num_experts: int,
    layer_map: Optional[Sequence[int]] = None,
    num_sources: int = 0,
    source_offsets: Optional[Sequence[int]] = None,
    return_by_source: bool = False,
    mask: Any = None,
    format: str = "auto",
    num_layers: int = 0,
    topk: int = 0,
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
        mask: per-token mask, ``[T]`` (or ``[bs, seq]`` for verl's ``[bs, seq, L, K]`` ids), bool or
            integer: tokens where it is 0 (padding) are not counted. ``None`` counts every token.
            A 4-D ``routed_experts`` ``[bs, seq, L, K]`` is taken row by row (token ``b * seq + s``).
        format, num_layers, topk: when ``routed_experts`` is a path, it is read by :func:`read_trace` as
            ``format`` (one of :data:`TRACE_FORMATS` or ``auto``), with ``mask`` a path of the format's mask.

    Returns:
        ``[M, L, E]`` int64 loads (and the split when ``return_by_source``).
    """
    if isinstance(routed_experts, (str, os.PathLike)):
        rec = read_trace(routed_experts, format, mask=mask, num_layers=num_layers, topk=topk)
        routed_experts, mask = rec.ids, rec.mask
    ids = routed_experts if _is_tensor_like(routed_experts) else np.asarray(routed_experts)
    if isinstance(ids, np.ndarray) and ids.dtype == np.bool_:
        raise ValueError("count_loads: routed_experts must be an integer array, got dtype bool")
    if getattr(ids, "ndim", 3) == 4:  # verl's [bs, seq, L, K]
        shp = tuple(ids.shape)
        ids = ids.reshape(shp[0] * shp[1], shp[2], shp[3])
    m = None
    if mask is not None:
        m = to_numpy(mask)
        if m.dtype.kind not in "biu":
            raise ValueError(f"count_loads: mask must be bool or integer, got dtype {m.dtype}")
        m = np.ascontiguousarray(m.reshape(-1) != 0, dtype=np.uint8)
    lm = None if layer_map is None else int_list(layer_map, "count_loads: layer_map")
    totals, by_source = _core.count_loads(
        ids,
        _offsets(microbatch_offsets, "microbatch_offsets"),
        integer(num_experts, "count_loads: num_experts"),
        lm,
        integer(num_sources, "count_loads: num_sources"),
        _offsets(source_offsets, "source_offsets"),
        m,
    )
    return (totals, by_source) if return_by_source else totals


class TraceRecord(NamedTuple):
    """What :func:`read_trace` read: ``ids`` ``[T, L, K]`` (the file's dtype; -1 = no route), ``mask`` ``[T]``
    uint8 (0 = padding) or ``None``, ``request_offsets`` ``[R + 1]`` (SGLang) or ``None``, and the ``format``."""

    format: str
    ids: np.ndarray
    mask: Optional[np.ndarray]
    request_offsets: Optional[np.ndarray]


def trace_formats() -> List[Dict[str, Any]]:
    """The registered trace input formats, in listing order: ``name``, ``help``, ``detects`` (when ``auto`` picks
    it; empty: only when named), ``takes_mask``, ``needs_shape`` (``num_layers`` and ``topk``), ``reads_sidecars``."""
    return list(_core.trace_formats())


def _npy_bytes(x: Any) -> bytes:
    if _is_tensor_like(x) and hasattr(x, "cpu"):
        x = to_numpy(x)
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(x), allow_pickle=False)
    return buf.getvalue()


def read_trace(source: Any, format: str = "auto", *, mask: Any = None, num_layers: int = 0,
               topk: int = 0) -> TraceRecord:
    """Reads a routed-id file through the C++ format registry (the readers of ``foremoe trace count``).

    ``source``: a path; ``format``: one of :data:`TRACE_FORMATS`, or ``auto`` (detected from the file as
    ``trace count`` does). ``mask``: a path of the format's mask (verl's attention mask); ``num_layers`` and
    ``topk``: the payload's shape for formats whose files do not carry it (SGLang). Bad files raise
    ``ValueError`` naming the file."""
    name, ids, m, offsets = _core.read_trace(os.fspath(source), str(format), None,
                                             None if mask is None else os.fspath(mask), None,
                                             integer(num_layers, "read_trace: num_layers"),
                                             integer(topk, "read_trace: topk"))
    return TraceRecord(name, ids, m, offsets)


def read_verl(routed_experts: Any, attention_mask: Any = None):
    """verl's padded routing record as ``(ids [bs * seq, L, K], mask [bs * seq] uint8)`` for :func:`count_loads`.

    ``routed_experts`` is ``[bs, seq, L, K]`` (a NumPy array, a PyTorch tensor or a path to an ``.npy``),
    ``attention_mask`` ``[bs, seq]`` (same; bool or integer, 0 = padding; verl pads prompts on the left, and
    the padded positions hold expert 0, which must not be counted). Tokens run row by row. Read by the
    registry's ``verl`` format (arrays as their NPY images)."""
    path = isinstance(routed_experts, (str, os.PathLike))
    mpath = isinstance(attention_mask, (str, os.PathLike))
    _, ids, m, _ = _core.read_trace(
        os.fspath(routed_experts) if path else "routed_experts", "verl",
        None if path else _npy_bytes(routed_experts),
        os.fspath(attention_mask) if mpath else (None if attention_mask is None else "attention_mask"),
        None if attention_mask is None or mpath else _npy_bytes(attention_mask), 0, 0)
    return ids, m


def _sglang_text(x: Any, where: str) -> str:
    """A line or a base64 payload given as ``bytes``, ``bytearray`` or ``memoryview`` (a file read in binary mode,
    what ``base64.b64encode`` returns) as text. Bytes that are neither a JSON line nor base64 (a raw int32 payload)
    are refused saying so, not reported as malformed base64."""
    raw = bytes(x)
    try:
        text = raw.decode("ascii")
        if not text.lstrip().startswith("{"):
            base64.b64decode(text.strip(), validate=True)
        return text
    except (UnicodeDecodeError, binascii.Error) as e:
        raise ValueError(f"read_sglang: {where}: got {len(raw)} bytes that are neither a JSON line nor base64 "
                         f"({e}); a raw int32 payload must be base64-encoded (base64.b64encode)") from None


def _sglang_payloads(d: Any, where: str) -> Any:
    """A request dict with its ``routed_experts`` (top level or under ``meta_info``) given as bytes decoded."""
    if not isinstance(d, Mapping):
        return d
    out = dict(d)
    if isinstance(out.get("routed_experts"), (bytes, bytearray, memoryview)):
        out["routed_experts"] = _sglang_text(out["routed_experts"], f"{where}: routed_experts")
    if isinstance(out.get("meta_info"), Mapping):
        out["meta_info"] = _sglang_payloads(out["meta_info"], f"{where}: meta_info")
    return out


def _sglang_line(item: Any, n: int = 1) -> str:
    """One request (the ``n``-th, from 1) as the JSON line the ``sglang`` format reads: a bare base64 payload is
    wrapped, bytes are decoded, anything but a line, a payload or a dict is refused naming the request."""
    where = f"requests:{n}"
    if isinstance(item, (bytes, bytearray, memoryview)):
        item = _sglang_text(item, where)
    if isinstance(item, str):
        if not item.lstrip().startswith("{"):
            return json.dumps({"routed_experts": item.strip()})
        return json.dumps(json.loads(item)) if "\n" in item.strip() else item.strip()
    if not isinstance(item, Mapping):
        raise TypeError(f"read_sglang: {where} is {describe(item)}; a request is a JSON line (str or bytes), a dict "
                        f"(as /generate returns it) or a base64 payload")
    return json.dumps(_sglang_payloads(item, where), default=str)


def read_sglang(source: Any, num_layers: int, topk: int):
    """SGLang's ``routed_experts`` payloads as ``(ids [T, num_layers, topk] int32, request_offsets [R + 1])``.

    ``source`` is a path to a JSON-lines file (one request per line), an iterable of lines, dicts (as
    ``/generate`` returns them: ``routed_experts`` at the top level or under ``meta_info``) or base64
    strings. Each payload is base64 of little-endian int32 ``[tokens, num_layers, topk]``; requests are
    concatenated in order. Malformed base64 or a payload that is not whole tokens raises ``ValueError``
    naming the request (the file's line, or ``requests:N`` for the N-th item, from 1). Read by the registry's
    ``sglang`` format."""
    num_layers, topk = integer(num_layers, "read_sglang: num_layers"), integer(topk, "read_sglang: topk")
    if isinstance(source, (str, os.PathLike)):
        name, data = os.fspath(source), None
    else:
        if isinstance(source, (bytes, bytearray, memoryview, Mapping)):
            source = [source]  # one request
        try:
            items = iter(source)
        except TypeError:
            raise TypeError(f"read_sglang: source must be a path or an iterable of requests, got "
                            f"{type(source).__name__}") from None
        lines = [_sglang_line(it, n) for n, it in enumerate(items, 1)]
        if not lines:
            return np.zeros((0, num_layers, topk), np.int32), np.zeros(1, np.int64)
        name, data = "read_sglang: requests", "\n".join(lines).encode("utf-8")
    _, ids, _, offsets = _core.read_trace(name, "sglang", data, None, None, num_layers, topk)
    return ids, offsets


def _as_resident(resident: Any, topology: Topology, num_experts: int) -> Optional[Placement]:
    if resident is None:
        return None
    if isinstance(resident, Plan):
        return resident.placement
    if isinstance(resident, Placement):
        return resident
    # -1 (an empty slot) .. E - 1: an id past int32 would wrap onto another expert in the int32 placement.
    a = int_array(resident, "plan: resident", dtype=np.int32, lo=-1, hi=int(num_experts) - 1)
    return Placement.from_array(topology, a, int(num_experts))


class Planner:
    """Plans expert replicas, placement, token split and weight moves per micro-step.

    Args:
        topology: a :func:`Topology`.
        strategy, move_budget, threads and the keyword options: the planner options of
        ``foremoe.options("planner")`` (the same keys, defaults, ranges and messages as ``foremoe plan``):
        ``strategy`` (one of :data:`STRATEGIES`: ``foremoe``, the default, is two-level: step-level owners +
        replicas in spare slots; ``foremoe-free`` lets any slot hold anything), ``move_budget`` (new replicas per GPU per micro-step; ``None``: the spare
        slots), ``threads``, ``hierarchical_owners``, ``reowning_free``, ``owner_keep_tolerance``,
        ``local_search_rounds``, ``free_search_rounds``, ``exact_split``, ``tolerance``,
        ``gradient_bytes_factor``, ``hold_replica_gradients``, ``min_tokens_per_replica``, ``ultraep_min_tokens``,
        ``peer_domain_gpus``, ``eplb_num_groups``, ``eplb_interval``.
        ``None`` (or leaving one out) takes the library's default.

    One planner object is not safe for concurrent calls; use one per thread.
    """

    def __init__(
        self,
        topology: Topology,
        strategy: Optional[str] = None,
        move_budget: Optional[int] = None,
        threads: Optional[int] = None,
        **options: Any,
    ) -> None:
        if not isinstance(topology, Topology):
            raise ValueError(f"Planner: topology must be a foremoe.Topology, got {type(topology).__name__}")
        given = dict(strategy=strategy, move_budget=move_budget, threads=threads, **options)
        self._core = _core.Planner(topology, _json({k: v for k, v in given.items() if v is not None}, "Planner"))
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
        owners: Any = None,
        held: Optional[HeldGradients] = None,
    ) -> Union[Plan, List[Plan]]:
        """Plans one micro-step (``loads`` ``[L, E]``) or the micro-steps of one RL step (``[M, L, E]``).

        As ``foremoe plan``: owners (two-level mode) come from the sum over the
        micro-steps; each micro-step starts from the previous one's placement,
        the first from ``resident`` (a :class:`Plan`, :class:`Placement` or a
        ``[L, G, S]`` array of expert ids, -1 empty), or none.
        ``previous_loads`` (``[L, E]`` or ``[M, L, E]``): the previous RL step's
        loads, handed once per step (on its first call; none on the first step
        and on further calls for the same step, e.g. the update after a
        recompute). ``eplb`` and ``eplb-split`` keep the window of the planner
        (stateful): they rebalance after every ``eplb_interval``-th step handed,
        from the loads handed since the last rebalance, and keep their placement
        in between (static before the first). ``stage`` is ``update`` or ``recompute``.
        ``owners`` (``[L, E]`` or ``[E]`` for every layer: the owner GPU of every
        expert, e.g. a trainer's expert-parallel sharding) fixes the owners
        instead of planning them from the step totals (two-level strategies).
        ``held`` (with ``owners``): a :class:`HeldGradients` ``(layers, gpus, experts)`` made for the update stage,
        the replica gradients held before these micro-steps, updated to those held after them; pass the same one to
        every call of a stage planned a few micro-steps at a time, so the tolerance's byte count charges a resident
        replica's gradient once, as one call over the whole stage does (``hold_replica_gradients``).

        Returns a :class:`Plan` for ``[L, E]`` loads, a list of them for ``[M, L, E]``.
        """
        a = _int64_loads(loads, "plan: loads")
        if a.ndim not in (2, 3):
            raise ValueError(f"plan: loads must be [layers, experts] or [micro_steps, layers, experts], got shape {a.shape}")
        single = a.ndim == 2
        if single:
            a = a[None]
        prev = None
        if previous_loads is not None:
            prev = _int64_loads(previous_loads, "plan: previous_loads", lo=0)
            if prev.ndim == 3:
                prev = np.ascontiguousarray(prev.sum(axis=0))
            if prev.ndim != 2:
                raise ValueError(f"plan: previous_loads must be [L, E] or [M, L, E], got shape {prev.shape}")
        res = _as_resident(resident, self.topology, a.shape[2])
        own = None
        if owners is not None:
            o = to_numpy(owners)
            if o.size and o.dtype.kind not in "iu":
                raise ValueError(f"plan: owners must hold integer GPU indices, got dtype {o.dtype}")
            o = int_array(o, "plan: owners", dtype=np.int32)  # no wrap: the planner names a GPU out of range
            if o.ndim == 1:
                o = np.broadcast_to(o, (a.shape[1],) + o.shape)
            own = np.ascontiguousarray(o)
        plans = self._core.plan_step(a, res, prev, str(stage), own, held)
        return plans[0] if single else plans

    def __repr__(self) -> str:
        t = self.topology
        return (f"Planner(Topology({t.nodes}, {t.gpus_per_node}, {t.slots}), strategy={self.strategy!r}, "
                f"move_budget={self.move_budget!r}, threads={self.threads})")


def _simulate_config(config: Optional[Mapping[str, Any]], strategies: Union[None, str, Sequence[str]]) -> Optional[str]:
    if config is not None and not isinstance(config, Mapping):
        raise ValueError(f"simulate: config must be a dict or None, got {type(config).__name__}")
    cfg = {} if config is None else _plain(config)
    if strategies is not None:
        cfg["strategies"] = strategies if isinstance(strategies, str) else ",".join(str(s) for s in strategies)
    return _json(cfg)


def simulate(
    config: Optional[Mapping[str, Any]] = None,
    loads: Any = None,
    step_offsets: Optional[Sequence[int]] = None,
    strategies: Union[None, str, Sequence[str]] = None,
) -> Dict[str, Any]:
    """Replays RL steps on a modelled cluster and compares strategies, as ``foremoe simulate --json``.

    Args:
        config: the document ``foremoe simulate --config FILE.json`` reads (any subset of what
            ``foremoe simulate --print-config`` or :func:`simulate_config` writes: ``preset``, ``strategies``,
            ``model``, ``topology``, ``batch``, ``sim``, ``cost``, ``search``; keys in :func:`options`). Read by the same C++
            reader, so a config is accepted or refused with the same message. ``None``: the defaults.
        loads: ``[M, L, E]`` per-micro-step loads instead of the synthetic batch.
        step_offsets: ``[S + 1]`` micro-step offsets of the RL steps in ``loads``.
        strategies: names (list or comma-separated), overriding ``config["strategies"]``.

    Returns:
        The JSON document ``foremoe simulate --json`` writes, parsed. Unless ``config["search"]["best_deployment"]``
        is false it holds ``best_deployment``: every strategy simulated in every deployment of the search space
        (EP sizes, slots, micro-batch sizes: ``search.ep_sizes``, ``search.spare_slots``, ``search.microbatches``)
        and each one's fastest that fits GPU memory (docs/simulator.md, "Each strategy in its best deployment").
    """
    cfg = _simulate_config(config, strategies)
    arr = None
    if loads is not None:
        arr = _int64_loads(loads, "simulate: loads")
        if arr.ndim != 3:
            raise ValueError(f"simulate: loads must be [micro_steps, layers, experts], got shape {arr.shape}")
    return json.loads(_core.simulate(cfg, [], arr, _offsets(step_offsets, "step_offsets")))


def simulate_config(config: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """The full effective settings of :func:`simulate` for ``config`` (``foremoe simulate --print-config``)."""
    return json.loads(_core.simulate_settings(_simulate_config(config, None), []))


def plan_document(plans: Union[Plan, Sequence[Plan]]) -> Dict[str, Any]:
    """The PLAN.json document (``foremoe plan --out``) of the plans of one :meth:`Planner.plan` call."""
    ps = [plans] if isinstance(plans, Plan) else list(plans)
    return json.loads(_core.plan_document(ps))


def synthetic_trace(**config: Any) -> Dict[str, Any]:
    """A deterministic synthetic GRPO routing trace, as ``foremoe trace gen --ids``.

    Keyword arguments are the generator's options (``options("synthetic")``: ``preset``, ``seed``,
    ``layers``, ``experts``, ``topk``, ``steps``, ``prompts``, ``responses``, ``prompt_mean``, ...), the
    flags of ``foremoe trace gen`` with ``_`` for ``-``. Read by the same C++ reader, so they are accepted
    or refused as the flags are; unknown keys are refused naming them.

    Returns:
        dict with ``routed_ids`` ``[T, L, K]`` int16, ``microbatch_offsets``,
        ``source_offsets``, ``step_offsets`` (in micro-steps),
        ``sequence_offsets``, ``num_experts`` and ``num_sources``.
    """
    return _core.synthetic_trace(_json(config, "synthetic_trace"))


def synthetic_loads(*, by_source: bool = False, **config: Any) -> Dict[str, Any]:
    """The loads of :func:`synthetic_trace` with the same config, counted without storing ids
    (``foremoe trace gen --loads``, with ``--by-source`` for ``by_source``).

    Returns:
        dict with ``loads`` ``[M, L, E]`` int64, ``loads_by_source``
        (``[M, L, E, num_gpus]`` when ``by_source``, else None) and ``step_offsets``.
    """
    return _core.synthetic_loads(_json(config, "synthetic_loads"), bool(by_source))


from .eplb import export_placement, rebalance_experts  # noqa: E402  (uses Planner above)
from .packing import MicroBatchPacking, pack_by_tokens, pack_micro_batches, sequence_histograms  # noqa: E402
