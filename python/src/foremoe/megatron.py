"""ForeMoE inside Megatron-core's ``MoELayer`` (optional: needs torch >= 2.6 and megatron-core, pinned below).

With router replay the expert choices of every micro-step of a recompute or update stage are known before the stage
runs. :func:`install` turns every ``MoELayer`` of a model into a balanced one, in place, before or after the trainer
wraps the model in DDP (see the distributed optimizer below):

- each layer's local experts keep their parameters, whose storage becomes the owner rows of a
  :class:`foremoe.torch.ExpertStorage` (``[slots, ...]`` per weight kind; the spare rows hold the plan's replicas of
  hot experts and are never parameters, never in a ``state_dict``, never seen by an optimizer): a ``SequentialMLP``'s
  per-expert weights each alias one row; a ``GroupedMLP``'s fused ``weight1`` ``[H, n F1]`` and ``weight2``
  ``[n F, H]`` (``n`` local experts, ``F1`` = ``2 F`` with a gated linear unit) alias the ``n`` owner rows of the
  kinds ``weight1`` (rows ``[H, F1]``) and ``weight2`` (rows ``[F, H]``), the ``[n, H, F1]`` / ``[n, F, H]`` views
  ``GroupedMLP.forward`` hands to ``grouped_gemm.ops.gmm`` (expert ``i`` is the ``i``-th contiguous block): the
  public :meth:`ExpertStorage.bind_parameters` (per-expert) and :meth:`ExpertStorage.bind_fused` (fused) do it;
- each layer's ``MoEAlltoAllTokenDispatcher`` becomes a :class:`ForeMoEAlltoAllTokenDispatcher`, which sends every
  ``(token, k)`` to the physical slot the micro-step's plan gives it, with the plan's exact split, and runs the
  replica moves (:meth:`ExpertStorage.sync`) before the expert compute; a ``MoEAllGatherTokenDispatcher`` becomes a
  :class:`ForeMoEAllGatherTokenDispatcher`: Megatron's all-gather and reduce-scatter run unchanged, and each rank
  computes the routes the same plan and split give its slots, from every rank's gathered tokens (one
  :meth:`foremoe.Plan.dispatch` per source rank on the host), in the order the alltoall path receives them;
- ``SequentialMLP`` experts compute slot by slot with Megatron's own ``MLP`` code (the replica rows swapped in for
  the weights; for the plain MLP of Megatron's local spec, without tensor parallelism, biases, fusions, clamping or
  hooks, the same operations in the same order without the module calls around them: ``_MegatronLinear``), and in
  the backward every replica's weight gradient is added to its owner's gradient, in a fixed order, before autograd
  hands that gradient to the parameter (so Megatron's DDP hook that accumulates ``.grad`` into ``main_grad`` sees
  owner and replicas summed);
- ``GroupedMLP`` experts run ``GroupedMLP.forward``'s arithmetic (two calls of Megatron's ``grouped_gemm.ops.gmm``
  around its activation with the routing weight, its ``moe_act`` activation recompute included) over the whole slot
  storage at once: the dispatcher groups the received tokens by storage row and hands the per-row counts as
  ``tokens_per_expert`` (zero for a row without tokens). In the backward each replica row's weight gradient is
  added to its owner's part of the fused gradient in the same fixed order as for ``SequentialMLP``, before autograd
  hands ``weight1`` / ``weight2`` their gradient.

**Held replica gradients** (``hold_replica_gradients=True``, the default, the planner's rule of the same name; issue
30): in the update stage a replica that the next micro-steps' plans keep on its rank accumulates its weight gradient
in place and returns it once, in the backward of the first micro-step whose plan drops it (its slot is reused), and
every gradient still held returns in the backward of the update driver's last micro-step
(``driver.num_micro_steps - 1``, the stage's last backward), where it reaches the owner through autograd like any
other: Megatron's DDP hook, the bucket all-reduce (with ``overlap_grad_reduce`` too) and ``finalize_model_grads``
read the complete ``main_grad``. The signal is the driver, never a guess: one update-stage driver is one optimizer
step's micro-batches (as the planner assumes), run in micro-step order. A trainer that steps the optimizer at another
micro-step says so with ``set_micro_step(m, driver, last=True)`` (``last=False`` holds on). An optimizer step over the
model's expert parameters (a ``torch.optim`` optimizer or Megatron's, whose inner ``torch.optim`` step covers the
``main_param`` copies) while any replica gradient is still held raises ``RuntimeError`` naming the held gradients,
before any parameter changes. ``hold_replica_gradients=False`` returns every replica's gradient in every backward.

The micro-step is set by the trainer, never guessed: ``with balancer.micro_step(m, driver): ...`` (or
:meth:`MegatronBalancer.set_micro_step` inside Megatron's ``forward_step_func``) hands the driver's plan of
micro-step ``m`` to every MoE layer; the recompute forward, the update forward, the update backward and an activation
recompute inside that backward all run under it (with Megatron's ``forward_backward_no_pipelining`` the backward of
micro-batch ``m`` runs right after its forward, while micro-step ``m`` is set; with a pipelined schedule an
activation recompute that runs while another micro-step is set fails with the error below rather than use the
wrong plan; the backward without recompute keeps the plan its forward ran with). Outside any micro-step (a rollout that records the routing) the
layers run Megatron's own dispatcher path unchanged. The plan of micro-step ``m`` only fits that micro-step's routing:
any other raises ``ValueError`` naming the layer (Megatron's loads disagree with the plan's split).

Supported: megatron-core |SUPPORTED|, ``moe_token_dispatcher_type='alltoall'`` and ``'allgather'`` (the latter with
tensor parallelism 1 and, as Megatron's all-gather needs, the same token count on every rank), ``SequentialMLP``
experts and ``GroupedMLP`` experts (``moe_grouped_gemm=True`` without Transformer Engine), expert tensor
parallelism 1, dropless routing. Anything else raises ``ValueError`` naming the setting at :func:`install` (a
``GroupedMLP`` whose fused weights do not have the shapes above: naming both). Not supported: the flex (DeepEP /
HybridEP) dispatcher, ``TEGroupedMLP`` (Transformer Engine's grouped linear layers: not available here to test),
expert capacity (token dropping and padding), FP8/FP4, shared-expert overlap and ``moe_apply_probs_on_input``.

Megatron's distributed optimizer (``DistributedDataParallelConfig(use_distributed_optimizer=True)``) with
``overlap_param_gather=False``, the adapter installed on the DDP-wrapped model chunks or before the wrap: its DDP
gives every parameter a segment of its own parameter buffer as ``.data`` (distributed/param_and_grad_buffer.py:820-835
of 0.16.1), so such a parameter is *copy-bound*: :func:`install` binds it with ``copy=True`` (its ``.data`` already a
segment of a larger flat buffer), or the next balanced call rebinds a parameter DDP moved after :func:`install`
(:meth:`ExpertStorage.rebind_copies`); its owner rows hold a copy of its values. The optimizer writes the buffer
(optimizer/distrib_optimizer.py:2429-2474, then its all-gather, 2598-2620): torch's global optimizer step post-hook
(which fires for Megatron's inner ``torch.optim`` step too) marks the copies stale, as does a moved version counter,
and the next balanced call of each layer copies the parameters into the rows (:meth:`ExpertStorage.refresh_copies`),
re-sends the replicas and, with a host mirror, refreshes it on every rank together. Gradients flow as without it.
``overlap_param_gather=True`` raises ``ValueError`` (its forward pre-hooks gather each module's parameters after the
copy would read them); a bound parameter whose ``.data`` is replaced by anything but a flat buffer, or a copy-bound
one whose ``.data`` is replaced again, raises ``ValueError`` at the next call.
Megatron's ``DistributedDataParallel`` without it works: its hook adds each expert parameter's ``.grad`` (owner and
replica gradients summed) into ``main_grad``.
"""

from __future__ import annotations

import collections
import contextlib
import copy
from typing import Any, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

SUPPORTED_MEGATRON = ("0.16.1",)
MIN_TORCH = (2, 6)


def _version_tuple(v: str) -> Tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def check_versions(torch_version: Optional[str] = None, megatron_version: Optional[str] = None) -> None:
    """Raises ``ImportError`` naming the found and the supported versions unless torch >= 2.6 and a supported
    megatron-core are installed (the versions found are looked up when not given)."""
    if torch_version is None:
        try:
            import torch
        except ImportError as exc:
            raise ImportError("foremoe.megatron needs PyTorch >= 2.6 and megatron-core "
                              f"{' or '.join(SUPPORTED_MEGATRON)}: torch is not installed") from exc
        torch_version = torch.__version__
    if _version_tuple(str(torch_version))[:2] < MIN_TORCH:
        raise ImportError(f"foremoe.megatron needs torch >= {'.'.join(map(str, MIN_TORCH))} (megatron-core "
                          f"{' or '.join(SUPPORTED_MEGATRON)} does), found torch {torch_version}")
    if megatron_version is None:
        try:
            import megatron.core as mcore
        except ImportError as exc:
            raise ImportError(f"foremoe.megatron needs megatron-core {' or '.join(SUPPORTED_MEGATRON)} "
                              f"(pip install 'megatron-core=={SUPPORTED_MEGATRON[-1]}'): {exc}") from exc
        megatron_version = getattr(mcore, "__version__", "unknown")
    if str(megatron_version) not in SUPPORTED_MEGATRON:
        raise ImportError(f"foremoe.megatron supports megatron-core {', '.join(SUPPORTED_MEGATRON)}, found "
                          f"megatron-core {megatron_version} (its MoE dispatcher internals change between releases)")


check_versions()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from megatron.core.transformer.moe import grouped_gemm_util as _gg  # noqa: E402
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher  # noqa: E402
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher  # noqa: E402

import foremoe  # noqa: E402
from foremoe import _core  # noqa: E402
from foremoe._args import integer  # noqa: E402
from foremoe.torch.distributed import DEFAULT_TIMEOUT, DispatchLayout, all_to_all, gather_source_loads  # noqa: E402
from foremoe.torch.distributed import group_rank, group_size, local_layout  # noqa: E402
from foremoe.torch.held import describe, gradients_mode, guard_optimizer_steps, held_gradients  # noqa: E402
from foremoe.torch.layer import _APPLIED_INSIDE, ExpertStorage, _input_error, _Run, _schedule_gradients  # noqa: E402
from foremoe.torch.layer import _check_rows, _reduce_replica_grads, _return_held_grads, _synced_run  # noqa: E402
from foremoe.torch.layer import _slot_compute, _SlotExperts, contiguous_owners  # noqa: E402
from foremoe.torch.replay import ReplayDriver, StepPacking, pack_from_slime  # noqa: E402

__doc__ = __doc__.replace("|SUPPORTED|", " / ".join(SUPPORTED_MEGATRON))

__all__ = [
    "ForeMoEAllGatherTokenDispatcher",
    "ForeMoEAlltoAllTokenDispatcher",
    "MegatronBalancer",
    "SUPPORTED_MEGATRON",
    "check_config",
    "check_versions",
    "install",
]


def check_config(config: Any) -> None:
    """Raises ``ValueError`` naming the first setting of a Megatron ``TransformerConfig`` the adapter does not
    support (see the module docstring)."""
    def get(name: str, default: Any = None) -> Any:
        return getattr(config, name, default)

    kind = get("moe_token_dispatcher_type")
    if kind not in ("alltoall", "allgather"):
        raise ValueError(f"foremoe.megatron: moe_token_dispatcher_type={kind!r} is not supported (only 'alltoall' "
                         f"and 'allgather'; the flex dispatcher's DeepEP/HybridEP kernels are not)")
    tp = get("tensor_model_parallel_size", 1)
    if kind == "allgather" and tp not in (None, 1):
        raise ValueError(f"foremoe.megatron: tensor_model_parallel_size={tp!r} with moe_token_dispatcher_type="
                         f"'allgather' is not supported (its all-gather spans TP x EP; the plan covers the EP ranks)")
    for name, ok, why in [
        ("expert_tensor_parallel_size", lambda v: v in (None, 1), "expert tensor parallelism must be 1"),
        ("moe_expert_capacity_factor", lambda v: v is None, "token dropping is not supported (dropless only)"),
        ("moe_pad_expert_input_to_capacity", lambda v: not v, "padding to capacity is not supported"),
        ("moe_router_padding_for_quantization", lambda v: not v, "router padding is not supported"),
        ("moe_shared_expert_overlap", lambda v: not v, "shared-expert overlap hooks the dispatcher"),
        ("moe_apply_probs_on_input", lambda v: not v, "the routing weight is applied after the activation only"),
        ("fp8", lambda v: not v, "FP8 expert compute is not supported"),
        ("fp4", lambda v: not v, "FP4 expert compute is not supported"),
    ]:
        v = get(name)
        if not ok(v):
            raise ValueError(f"foremoe.megatron: {name}={v!r} is not supported ({why})")


class _OwnerRows(torch.autograd.Function):
    """The owner rows of every weight kind as ``[n_owned, ...]`` tensors (views of the slot storage, which the
    per-expert parameters alias): forward copies nothing, backward hands row ``i`` of each gradient to parameter
    ``i``, so the parameters' own autograd hooks (Megatron's DDP) fire with the summed owner + replica gradient."""

    @staticmethod
    def forward(ctx: Any, storage: ExpertStorage, *params: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.n, ctx.nk = storage.num_owned, len(storage.names)
        return tuple(storage.storage[n][:storage.num_owned].detach() for n in storage.names)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
        out: List[Optional[torch.Tensor]] = [None]
        for g in grads:
            out.extend([None] * ctx.n if g is None else list(g.unbind(0)))
        return tuple(out)


class _MegatronLinear(torch.autograd.Function):
    """The arithmetic of Megatron's linear layer with one tensor-parallel rank and no gradient-accumulation fusion
    (``LinearWithGradAccumulationAndAsyncCommunication``): forward ``x @ w.T``; backward ``g @ w`` and ``g.T @ x``,
    the same operations in the same order, so the same numbers, without the module call around them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return torch.matmul(x, w.t())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return grad.matmul(w), grad.t().matmul(x)


def _plain_mlp(template: torch.nn.Module, names: Sequence[str], config: Any) -> Optional[Any]:
    """``expert_fn(x, w_fc1, w_fc2, scale=...)`` doing what Megatron's ``MLP.forward`` does for ``template``
    (``linear_fc1``, the activation, the per-token scale, ``linear_fc2``: the same operations in the same order),
    or ``None`` unless ``template`` is the plain MLP of Megatron's local spec: ``ColumnParallelLinear`` and
    ``RowParallelLinear`` without bias, one tensor-parallel rank, no sequence parallelism, no gradient-accumulation
    fusion, no fused or Transformer Engine activation, no clamp, no module hooks."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP

    if type(template) is not MLP or list(names) != ["linear_fc1.weight", "linear_fc2.weight"]:
        return None
    fc1, fc2 = template.linear_fc1, template.linear_fc2
    if type(fc1) is not ColumnParallelLinear or type(fc2) is not RowParallelLinear:
        return None
    for lin in (fc1, fc2):
        if (getattr(lin, "bias", None) is not None or getattr(lin, "tp_size", 1) != 1
                or getattr(lin, "sequence_parallel", False) or getattr(lin, "gradient_accumulation_fusion", False)):
            return None
    for name, ok in [("bias_activation_fusion", False), ("use_te_activation_func", False),
                     ("activation_func_clamp_value", None), ("gradient_accumulation_fusion", False),
                     ("delay_wgrad_compute", False), ("moe_apply_probs_on_input", False)]:
        if getattr(config, name, ok) != ok:
            return None
    if any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or getattr(m, "_backward_pre_hooks", None)
           for m in template.modules()):
        return None
    glu, offset = bool(config.gated_linear_unit), config.glu_linear_offset
    act = config.activation_func if glu else template.activation_func  # as MLP.forward picks them

    def expert(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
               scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = _MegatronLinear.apply(x, w1)
        if glu:
            a, b = torch.chunk(h, 2, dim=-1)
            h = act(a) * (b + offset)
        else:
            h = act(h)
        if scale is not None:
            dtype = h.dtype
            h = (h * scale.unsqueeze(-1)).to(dtype)
        return _MegatronLinear.apply(h, w2)

    return expert


def _swap_call(template: torch.nn.Module, slots: Sequence[Tuple[torch.nn.Module, str]], weights: Sequence[Any],
               x: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """Megatron's ``MLP.forward`` of ``template`` with ``weights`` in place of its parameters (restored after)."""
    saved = [mod._parameters[name] for mod, name in slots]
    try:
        for (mod, name), w in zip(slots, weights):
            mod._parameters[name] = w
        out, bias = template(x, scale)
    finally:
        for (mod, name), p in zip(slots, saved):
            mod._parameters[name] = p
    if bias is not None:  # an expert MLP with a per-token scale adds its bias itself
        out = out + bias
    return out


def _routes(routing_map: torch.Tensor, topk: int, layer: int) -> Tuple[torch.Tensor, np.ndarray, int]:
    """``[T, K]`` int32 routed experts of every token in ascending id (-1 where a token has fewer routes, e.g.
    padding), the ``[E]`` int64 counts and how many tokens have fewer routes, from Megatron's ``[T, E]`` routing
    map in one C++ pass over the map's bytes (on the host: a device map is copied once)."""
    rm = routing_map.detach()
    if rm.device.type != "cpu":
        rm = rm.cpu()
    rm = rm.contiguous()
    rm = rm.view(torch.uint8) if rm.dtype == torch.bool else rm.to(torch.uint8)
    ids = torch.empty((rm.shape[0], topk), dtype=torch.int32)
    counts = np.empty(rm.shape[1], dtype=np.int64)
    try:
        short = _core.routes_from_map(rm.numpy(), topk, ids.numpy(), counts)  # numpy views: no DLPack export
    except ValueError as e:
        raise ValueError(f"foremoe.megatron: MoE layer {layer}: {e}") from None
    return ids, counts, int(short)


class _Rows(torch.autograd.Function):
    """``x[index]`` (rows) of each tensor ``x`` of ``xs`` for a permutation ``index`` with its ``inverse`` (the
    tokens and their routing weights move together: one autograd node); the backward is the gather
    ``grad[inverse]`` (the same numbers as ``index_select``'s scatter, at a gather's cost)."""

    @staticmethod
    def forward(ctx: Any, index: torch.Tensor, inverse: torch.Tensor, *xs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.inverse = inverse
        return tuple(x.index_select(0, index) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        return (None, None, *(g.index_select(0, ctx.inverse) for g in grads))


def _sum_routes(rows: torch.Tensor, gather: torch.Tensor, pad: bool, T: int, K: int) -> torch.Tensor:
    """``[T, ...]``: ``sum_k rows[gather[t * K + k]]``, ``k`` ascending; with ``pad`` the index ``len(rows)`` (a
    route that was not sent) reads a row of zeros."""
    if pad:
        rows = torch.cat([rows, rows.new_zeros((1,) + tuple(rows.shape[1:]))])
    return rows.index_select(0, gather).view((T, K) + tuple(rows.shape[1:])).sum(dim=1)


class _Spread(torch.autograd.Function):
    """The rows to send: token ``send_tokens[i]`` for sent row ``i``. Backward: each token's gradient is the sum of
    its routes' (``k`` ascending), a gather; the adjoint of :class:`_Collect`. With ``probs`` (Megatron's ``[T, E]``
    routing weights) also each sent row's weight ``probs.flatten()[prob_index[i]]``, in the same autograd node; its
    backward is ``index_select``'s (the gradient added into zeros at ``prob_index``: the same numbers)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send_tokens: torch.Tensor, gather: torch.Tensor, pad: bool, K: int,
                probs: Optional[torch.Tensor] = None, prob_index: Optional[torch.Tensor] = None) -> Any:
        ctx.args = (gather, pad, x.shape[0], K)
        if probs is None:
            return x.index_select(0, send_tokens)
        ctx.probs = (probs.shape, prob_index)
        return x.index_select(0, send_tokens), probs.reshape(-1).index_select(0, prob_index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, grad_probs: Optional[torch.Tensor] = None
                 ) -> Tuple[Optional[torch.Tensor], ...]:
        gx = _sum_routes(grad, *ctx.args)
        if grad_probs is None:
            return gx, None, None, None, None, None, None
        shape, prob_index = ctx.probs
        gp = grad_probs.new_zeros(shape.numel()).index_add_(0, prob_index, grad_probs).view(shape)
        return gx, None, None, None, None, gp, None


class _Collect(torch.autograd.Function):
    """Rows back to tokens: ``out[t] = sum_k back[route_pos[t, k]]`` (``k`` ascending, the routing weights were
    applied in the experts). Backward: sent row ``i`` gets token ``send_tokens[i]``'s gradient, a gather."""

    @staticmethod
    def forward(ctx: Any, back: torch.Tensor, send_tokens: torch.Tensor, gather: torch.Tensor, pad: bool,
                T: int, K: int) -> torch.Tensor:
        ctx.send_tokens = send_tokens
        return _sum_routes(back, gather, pad, T, K)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        return grad.index_select(0, ctx.send_tokens), None, None, None, None, None


class _Call:
    """The index tensors of one balanced layer call, on the tokens' device (:func:`_prepare_call` makes them).

    ``send_tokens`` the token of each sent row; ``gather`` ``[T K]`` the sent row each route comes back from (with
    ``pad``: a route not sent reads the zero row past the sent ones); ``prob_index`` the flat index of each sent
    row's routing weight in Megatron's ``[T, E]`` probs; ``recv_perm`` / ``recv_inverse`` the received rows grouped
    as the expert module computes them and back; ``counts`` its ``tokens_per_expert`` (CPU int64). GroupedMLP
    (``rows_total``: the storage rows per weight kind): the received rows are grouped by storage row (ascending)
    instead of by plan slot, and ``counts`` has one entry per storage row (zero for a row without tokens), the
    ``batch_sizes`` of a grouped GEMM over the whole slot storage."""

    __slots__ = ("shape", "T", "send_tokens", "gather", "pad", "prob_index", "recv_perm", "recv_inverse", "counts")


def _by_row(run: _Run, rows_total: Optional[int]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The expert module's ``tokens_per_expert`` (CPU int64) for rows grouped by plan slot (``run.layout``'s
    ``slot_counts``), and the permutation of those rows that the expert module needs (``None``: as they are).
    ``rows_total`` ``None`` (SequentialMLP): the slot counts, slot order kept. Otherwise (GroupedMLP): one count
    per storage row, zero for a row without tokens, and the slot blocks reordered by storage row, ascending
    (``_core.group_by_storage_row`` over the identity)."""
    counts = np.asarray(run.layout.slot_counts, dtype=np.int64)
    if rows_total is None:
        return torch.from_numpy(counts), None
    row_counts, perm, _, reordered = _core.group_by_storage_row(
        counts, np.ascontiguousarray(run.rows, dtype=np.int64), rows_total, np.arange(int(counts.sum())))
    return torch.from_numpy(row_counts), (torch.from_numpy(perm) if reordered else None)


def _prepare_call(st: "_LayerState", x: torch.Tensor, ids: torch.Tensor, counts: np.ndarray, short: int,
                  plan: Any, shape: torch.Size) -> Tuple[_Run, _Call]:
    """Everything of one balanced layer call before the token exchange: ``foremoe.torch.layer._prepare``'s checks,
    its one ``all_gather`` (counts and flags), the dispatch layout and the replica sync (:meth:`ExpertStorage.sync`),
    in the same order with the same errors, for the adapter's fixed group and the micro-step plan
    :meth:`MegatronBalancer.set_micro_step` checked; the layout and the adapter's index arrays come from one C++
    call (``_core.adapter_dispatch``), the regrouping by storage row (GroupedMLP) from a second one after the sync
    (``_core.group_by_storage_row``): no index arithmetic in Python. Returns the run and its :class:`_Call`."""
    storage, layer, group, timeout = st.storage, st.index, st.group, st.balancer.timeout
    st.check_bound()
    if storage.copy_bound and storage.refresh_copies():  # after an optimizer step: the parameters into the rows
        st.check_param_gather()
    error = _input_error(x, ids, _APPLIED_INSIDE, storage, None)
    flags = storage.call_flags(plan, layer)
    storage.check_plan(plan, layer)  # remembered per plan: costs nothing on the micro-step's other passes
    loads, got = gather_source_loads(ids if error is None else None, st.num_experts, group=group, flags=flags,
                                     error=error, timeout=timeout, what=f"dispatch_layout (layer {layer})",
                                     counts=counts)
    if storage.copy_bound and storage.mirror is not None and got[:, 1].any():
        # Copy-bound owner rows were refreshed after an optimizer step on some rank: the host mirror follows
        # them here, on every rank together (the gathered flags are the same everywhere).
        storage.refresh_mirror(group, timeout)
        got = got.copy()
        got[:, 1] = 0
    layout, extra, memo = _remembered_layout(st, plan, layer, ids, loads, short, got)
    run = _synced_run(storage, st.expert_fn, plan, layer, layout, x, group, timeout)
    # The call tensors (on the tokens' device) follow from the layout, the storage rows of the slots and the shape.
    rows_key = (run.rows.tobytes(), shape, x.device)
    if memo[4] is None or memo[4][0] != rows_key:
        memo[4] = (rows_key, _make_call(run, extra, shape, short, st.rows_total, x.device))
    return run, memo[4][1]


def _remembered_layout(st: Any, plan: Any, layer: int, ids: torch.Tensor, loads: np.ndarray, short: int,
                       flags: np.ndarray) -> Tuple[DispatchLayout, Tuple[Any, ...], List[Any]]:
    """:func:`_adapter_layout` of a layer call (``st``: its :class:`_LayerState`), and the layer's memo entry. The
    layout is a function of the plan's layer, the gathered loads and the routed ids alone: a layer called again with
    equal ones (compared by content: activation recompute, a replay of the same routing, another pass of the same
    micro-step) reuses the last call's index arrays, in a copy of its layout carrying this call's gathered
    ``flags``, instead of making them again. The entry is ``[key, ids, layout, extra, call]`` (``call``: the last
    :class:`_Call` made from it and what it was made for, or ``None``)."""
    key = _plan_layer_key(st, plan, layer) + (loads.tobytes(), int(short))
    memo = st.memo
    if memo is not None and memo[0] == key and torch.equal(memo[1], ids):
        layout = copy.copy(memo[2])
        layout.flags = flags  # this call's gathered flags (the sync reads them)
        return layout, memo[3], memo
    try:
        layout, extra = _adapter_layout(plan, layer, ids, loads, st.rank, flags, st.storage.slots)
    except ValueError:
        local_layout(plan, layer, ids, loads, st.rank, flags=flags)  # the checked path names what does not fit
        raise
    st.memo = [key, ids, layout, extra, None]
    return layout, extra, st.memo


def _plan_layer_key(st: Any, plan: Any, layer: int) -> Tuple[Any, ...]:
    """What :func:`_adapter_layout` reads of ``plan``'s layer ``layer`` (placement, tokens per slot, GPUs per node),
    as bytes; made once per plan object (kept with it, so its id is not reused while remembered; a plan is
    immutable)."""
    m = st.plan_key
    if m is not None and m[0] is plan and m[1] == layer:
        return m[2]
    key = (layer, plan.gpu_slots[layer].tobytes(), plan.slot_tokens[layer].tobytes(),
           int(plan.topology.gpus_per_node))
    st.plan_key = (plan, layer, key)
    return key


def _adapter_layout(plan: Any, layer: int, ids: torch.Tensor, loads: np.ndarray, rank: int, flags: np.ndarray,
                    S: int) -> Tuple[DispatchLayout, Tuple[Any, ...]]:
    """The :class:`DispatchLayout` of ``ids`` (``[T, K]`` int32 on the CPU) under ``plan``'s layer ``layer`` for the
    gathered ``[E, G]`` ``loads`` (``flags``: the gathered flags), and ``(gather, prob_index, padded, counts)``: one
    C++ call (``_core.adapter_dispatch``; the large arrays handed over without a copy, the small ones packed)."""
    T, K = ids.shape
    E, G = loads.shape
    (small, order, send_tokens, prob_index, route_pos, gather, recv_perm, recv_inverse, slots,
     send_experts) = _core.adapter_dispatch(plan, layer, ids.numpy().reshape(T, 1, K), loads, rank, E)
    padded = bool(small[0])
    counts = small[1 + 2 * G:1 + 2 * G + S]
    route_pos = torch.from_numpy(route_pos)
    gather = route_pos if gather is None else torch.from_numpy(gather)
    layout = DispatchLayout(
        rank=rank, world=G, layer=layer, num_experts=E, slots_per_rank=S, slots=torch.from_numpy(slots),
        order=torch.from_numpy(order), send_tokens=torch.from_numpy(send_tokens),
        input_splits=small[1:1 + G].tolist(), output_splits=small[1 + G:1 + 2 * G].tolist(),
        recv_perm=torch.from_numpy(recv_perm), recv_inverse=torch.from_numpy(recv_inverse),
        slot_counts=counts.tolist(), source_split=small[1 + 2 * G + S:].reshape(G * S, G), flags=flags,
        send_experts=torch.from_numpy(send_experts), route_pos=route_pos)
    prob_index = torch.from_numpy(prob_index)
    return layout, (gather, prob_index, padded, counts)


def _make_call(run: _Run, extra: Tuple[Any, ...], shape: torch.Size, short: int, rows_total: Optional[int],
               device: torch.device) -> _Call:
    """The :class:`_Call` of ``run`` (``extra``: :func:`_adapter_layout`'s), on ``device``; with ``rows_total``
    (GroupedMLP) the received rows regrouped by storage row (``_core.group_by_storage_row``, one C++ call)."""
    gather, prob_index, padded, counts = extra
    lay = run.layout
    c = _Call()
    c.shape, c.T, c.pad = shape, lay.slots.shape[0], padded or short > 0
    recv_perm, recv_inverse = lay.recv_perm, lay.recv_inverse
    if rows_total is None:
        c.counts = torch.from_numpy(counts)
    else:
        row_counts, perm, inverse, _ = _core.group_by_storage_row(
            counts, np.ascontiguousarray(run.rows, dtype=np.int64), rows_total, recv_perm.numpy())
        c.counts = torch.from_numpy(row_counts)
        recv_perm, recv_inverse = torch.from_numpy(perm), torch.from_numpy(inverse)
    send_tokens = lay.send_tokens
    if device.type != "cpu":
        send_tokens, gather, prob_index = send_tokens.to(device), gather.to(device), prob_index.to(device)
        recv_perm, recv_inverse = recv_perm.to(device), recv_inverse.to(device)
    c.send_tokens, c.gather, c.prob_index = send_tokens, gather, prob_index
    c.recv_perm, c.recv_inverse = recv_perm, recv_inverse
    return c


def _grouped_rows(experts: GroupedMLP, config: Any, index: int) -> Dict[str, Tuple[int, ...]]:
    """The storage row shape of each fused ``GroupedMLP`` weight, ``{"weight1": (n, H, F1), "weight2": (n, F, H)}``
    (``F`` = ``moe_ffn_hidden_size``, ``F1`` = ``2 F`` with a gated linear unit), after checking the parameters'
    shapes: ``weight1`` ``[H, n F1]`` and ``weight2`` ``[n F, H]``, which ``GroupedMLP.forward`` views as
    ``[n, H, F1]`` and ``[n, F, H]`` for ``grouped_gemm.ops.gmm`` (megatron-core 0.16.1, experts.py:144-154 and
    243-244): expert ``i``'s weights are the ``i``-th contiguous block of each parameter."""
    n = int(experts.num_local_experts)
    H, F = int(config.hidden_size), int(config.moe_ffn_hidden_size)
    F1 = 2 * F if config.gated_linear_unit else F
    want = {"weight1": (H, n * F1), "weight2": (n * F, H)}
    for name, shape in want.items():
        p = getattr(experts, name, None)
        if not isinstance(p, torch.Tensor) or tuple(p.shape) != shape or not p.is_contiguous():
            got = list(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(
                f"foremoe.megatron: MoE layer {index}: GroupedMLP {name} is {got}"
                f"{'' if not isinstance(p, torch.Tensor) or p.is_contiguous() else ' (not contiguous)'}, expected "
                f"{list(shape)} (hidden {H}, {n} local experts, moe_ffn_hidden_size {F}"
                f"{', gated' if config.gated_linear_unit else ''}; expert tensor parallelism 1)")
    return {"weight1": (n, H, F1), "weight2": (n, F, H)}


class _GroupedWeights(torch.autograd.Function):
    """The whole slot storage of every weight kind (``[rows, ...]``: owner rows, then spare rows; views, copying
    nothing) for a grouped GEMM over the plan's slots, with the fused ``GroupedMLP`` parameters as inputs.
    Backward: the owner rows' gradient goes to the fused parameter (reshaped to it), after every replica's
    gradient (rows of the slots with tokens) was added to its owner's part in the fixed order of the
    SequentialMLP path (:class:`foremoe.torch.layer._SlotWeights`): ascending (expert, holder) after the owner's
    own, or held and returned later (``hold_replica_gradients``)."""

    @staticmethod
    def forward(ctx: Any, run: _Run, slots: List[int], *params: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.run, ctx.slots, ctx.shapes = run, slots, [p.shape for p in params]
        st = run.storage
        return tuple(st.storage[n].detach() for n in st.names)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Tuple[Any, ...]:
        run: _Run = ctx.run
        st = run.storage
        _check_rows(run)
        n = st.num_owned
        full = [torch.zeros_like(st.storage[name]) if g is None else g for name, g in zip(st.names, grads)]
        go = [g[:n] for g in full]
        rep_grad = {j: [g[int(run.rows[j])] for g in full] for j in ctx.slots if int(run.rows[j]) >= n}
        if run.hold is not None:
            go = _return_held_grads(run, go, rep_grad)
        else:
            go = _reduce_replica_grads(run, go, rep_grad, {int(run.rows[j]): j for j in rep_grad})
        return (None, None, *[g.reshape(shape) for g, shape in zip(go, ctx.shapes)])


def _in_flat_buffer(p: torch.Tensor) -> bool:
    """Whether ``p``'s ``.data`` is a segment of a larger storage (a flat parameter buffer, e.g. Megatron DDP's with
    the distributed optimizer, distributed/param_and_grad_buffer.py:820-835 of 0.16.1), not a tensor of its own."""
    return int(p.untyped_storage().nbytes()) > int(p.numel()) * p.element_size()


class _LayerState:
    """What one balanced MoE layer keeps: its index, storage, expert function and the call in flight."""

    def __init__(self, balancer: "MegatronBalancer", index: int, layer: MoELayer, slots: int, options: Dict[str, Any]):
        experts = layer.experts
        disp = layer.token_dispatcher
        self.balancer, self.index, self.module = balancer, index, layer
        self.group = disp.ep_group
        self.world, self.rank = group_size(self.group), group_rank(self.group)
        self.num_experts = int(layer.config.num_moe_experts)
        self.topk = int(layer.config.moe_router_topk)
        self.owners = contiguous_owners(self.num_experts, self.world)
        if list(np.flatnonzero(self.owners == self.rank)) != list(layer.local_expert_indices):
            raise ValueError(f"foremoe.megatron: MoE layer {index}: local experts {layer.local_expert_indices} are not "
                             f"rank {self.rank}'s contiguous share of {self.num_experts} experts over {self.world}")
        self.grouped = type(experts) is GroupedMLP
        self.rows_total: Optional[int] = None
        self.run: Optional[_Run] = None  # the balanced call in flight (None: Megatron's own path)
        self.call: Optional[_Call] = None
        # The last layout and call tensors (:func:`_prepare_call`), the last plan's layer key (:func:`_plan_layer_key`).
        self.memo: Optional[List[Any]] = None
        self.plan_key: Optional[Tuple[Any, int, Tuple[Any, ...]]] = None
        if self.grouped:
            fused = {"weight1": experts.weight1, "weight2": experts.weight2}
            rows = _grouped_rows(experts, layer.config, index)
            weights = {n: p.detach().view(rows[n]) for n, p in fused.items()}
            self.storage = ExpertStorage(weights, self.owners, slots, rank=self.rank, world=self.world,
                                         group=self.group, **options)
            # The fused parameters become views of the owner rows, or (in a distributed optimizer's parameter
            # buffer already) keep their .data and the rows hold a copy.
            self.storage.bind_fused(fused, copy=any(_in_flat_buffer(p) for p in fused.values()))
            self.check_param_gather()
            self.rows_total = int(self.storage.storage["weight1"].shape[0])
            self.params = list(fused.values())
            self.template, self.swap, self.plain = None, [], None
            return
        local = list(experts.local_experts)
        names = [n for n, _ in local[0].named_parameters()]
        for i, e in enumerate(local):
            got = [n for n, _ in e.named_parameters()]
            if got != names:
                raise ValueError(f"foremoe.megatron: MoE layer {index}: local expert {i} has parameters {got}, "
                                 f"expert 0 {names}")
        by_name = [dict(e.named_parameters()) for e in local]
        weights = {n: torch.stack([p[n].detach() for p in by_name]) for n in names}
        self.storage = ExpertStorage(weights, self.owners, slots, rank=self.rank, world=self.world,
                                     group=self.group, **options)
        self.storage.bind_parameters({n: [p[n] for p in by_name] for n in names},
                                     copy=any(_in_flat_buffer(p[n]) for p in by_name for n in names))
        self.check_param_gather()
        self.params = [p[n] for n in names for p in by_name]  # kind-major, like _OwnerRows' outputs
        template = local[0]
        self.swap = []
        for n in names:
            mod_name, _, attr = n.rpartition(".")
            self.swap.append((template.get_submodule(mod_name) if mod_name else template, attr))
        self.template = template
        self.plain = _plain_mlp(template, names, layer.config)  # None: Megatron's MLP module, weights swapped in

    def check_bound(self) -> None:
        """:meth:`ExpertStorage.check_aliasing`, after making copy-bound the aliasing parameters that Megatron's
        ``DistributedDataParallel`` moved into its parameter buffer since :func:`install` (the distributed
        optimizer: each ``.data`` now a segment of a larger flat buffer). A parameter whose ``.data`` was replaced
        by anything else still raises ``ValueError``."""
        storage = self.storage
        try:
            storage.check_aliasing()
            return
        except ValueError:
            moved = [p for (p, view), c in zip(storage._bound, storage._bound_copy)
                     if not c and int(p.data_ptr()) != int(view.data_ptr()) and _in_flat_buffer(p)]
            if not moved:
                raise
        storage.rebind_copies(moved)
        self.check_param_gather()
        storage.check_aliasing()

    def check_param_gather(self) -> None:
        """Raises ``ValueError`` when the layer's parameters are copied from a distributed optimizer's buffer that
        Megatron's DDP all-gathers lazily (``overlap_param_gather=True``: its forward pre-hooks wait for each
        module's parameters as that module runs, after the copy here would read them)."""
        if not self.storage.copy_bound:
            return
        for m in self.module.modules():
            for h in m._forward_pre_hooks.values():
                if "_make_forward_pre_hook" in getattr(h, "__qualname__", ""):
                    raise ValueError(
                        f"foremoe.megatron: MoE layer {self.index}: Megatron's DistributedDataParallel gathers the "
                        f"parameters lazily in forward pre-hooks (DistributedDataParallelConfig("
                        f"overlap_param_gather=True)); the adapter copies the expert parameters into its slot "
                        f"storage before the layer's modules run, so it needs overlap_param_gather=False")

    def expert_fn(self, x: torch.Tensor, *weights: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.grouped:  # GroupedMLP computes all slots at once (_BalancedGroupedMLP), never one expert
            raise RuntimeError(f"foremoe.megatron: MoE layer {self.index}: GroupedMLP has no per-expert function")
        if self.plain is not None:
            return self.plain(x, *weights, scale=scale)
        return _swap_call(self.template, self.swap, weights, x, scale)


def _start_call(st: _LayerState, hidden_states: torch.Tensor, routing_map: torch.Tensor) -> Optional[tuple]:
    """The start of a layer call shared by both dispatchers: ``None`` (and ``st.run`` cleared) outside a balanced
    micro-step, else ``(x, plan, run, short)`` with ``st.run`` and ``st.call`` set: the tokens as ``[T, H]``, the
    micro-step's plan, its run of this layer (:func:`_prepare_call`; a plan that does not fit the routing raises
    ``ValueError`` naming the layer and micro-step) and how many tokens have fewer routes than top-k
    (:func:`_routes`)."""
    plan = st.balancer._plan_for(st.index)
    if plan is None:
        st.run = None
        return None
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    ids, counts, short = _routes(routing_map, st.topk, st.index)
    try:
        run, call = _prepare_call(st, x, ids, counts, short, plan, hidden_states.shape)
    except ValueError as e:
        raise ValueError(f"foremoe.megatron: MoE layer {st.index}, micro-step {st.balancer.current_micro_step}: "
                         f"{e}") from None
    st.run, st.call = run, call
    return x, plan, run, short


class ForeMoEAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """Megatron's alltoall dispatcher, sending tokens to the micro-step plan's physical slots.

    Made from an existing ``MoEAlltoAllTokenDispatcher`` by :func:`install` (the instance changes class and keeps
    its state). While its balancer has a micro-step set, the six dispatcher steps run the plan's layout; otherwise
    they are Megatron's own."""

    _foremoe: _LayerState

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        st = self._foremoe
        started = _start_call(st, hidden_states, routing_map)
        if started is None:
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        x, plan, run, _ = started
        call = st.call
        st.balancer._record(st, plan, run)
        if probs.shape[-1] != st.num_experts:
            raise ValueError(f"foremoe.megatron: MoE layer {st.index}: probs have {probs.shape[-1]} columns, the "
                             f"layer {st.num_experts} experts")
        # probs [T, E]: sent row i takes probs[send_tokens[i], send_experts[i]] (one gather, index made in C++)
        return _Spread.apply(x, call.send_tokens, call.gather, call.pad, st.topk, probs, call.prob_index)

    def token_dispatch(self, permutated_local_input_tokens: torch.Tensor, permuted_probs: torch.Tensor):
        st = self._foremoe
        if st.run is None:
            return super().token_dispatch(permutated_local_input_tokens, permuted_probs)
        lay, t = st.run.layout, st.balancer.timeout
        tokens = all_to_all(permutated_local_input_tokens, lay.output_splits, lay.input_splits, group=st.group,
                            timeout=t)
        probs = all_to_all(permuted_probs, lay.output_splits, lay.input_splits, group=st.group, timeout=t)
        return tokens, probs

    def dispatch_postprocess(self, global_input_tokens: torch.Tensor, global_probs: torch.Tensor):
        st = self._foremoe
        if st.run is None:
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        c = st.call
        tokens, probs = _Rows.apply(c.recv_perm, c.recv_inverse, global_input_tokens, global_probs)
        return tokens, c.counts, probs

    def combine_preprocess(self, hidden_states: torch.Tensor):
        st = self._foremoe
        if st.run is None:
            return super().combine_preprocess(hidden_states)
        return _Rows.apply(st.call.recv_inverse, st.call.recv_perm, hidden_states)[0]

    def token_combine(self, hidden_states: torch.Tensor, async_finish: bool = True,
                      allocate_on_comm_stream: bool = True):
        st = self._foremoe
        if st.run is None:
            return super().token_combine(hidden_states, async_finish, allocate_on_comm_stream)
        lay = st.run.layout
        return all_to_all(hidden_states, lay.input_splits, lay.output_splits, group=st.group,
                          timeout=st.balancer.timeout)

    def combine_postprocess(self, permutated_local_input_tokens: torch.Tensor):
        st = self._foremoe
        if st.run is None:
            return super().combine_postprocess(permutated_local_input_tokens)
        c = st.call
        out = _Collect.apply(permutated_local_input_tokens, c.send_tokens, c.gather, c.pad, c.T, st.topk)
        st.run, st.call = None, None
        return out.view(c.shape)


class ForeMoEAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
    """Megatron's allgather dispatcher under the micro-step's plan.

    Made from an existing ``MoEAllGatherTokenDispatcher`` by :func:`install`. Megatron's own all-gather of every
    rank's tokens, routing map and probabilities and its reduce-scatter of the outputs run unchanged; in between,
    each rank computes the routes the plan gives its slots, from every source rank's tokens: each source's
    :meth:`foremoe.Plan.dispatch` with the split the layer call's loads give (the same on every rank, the one the
    alltoall dispatcher sends with), grouped by slot with sources in rank order and tokens in order, as the
    alltoall path receives them. The outputs are summed per token (``k`` ascending) into the ``[G T, H]`` buffer
    Megatron reduce-scatters. Every rank must hold the same number of tokens (Megatron's all-gather needs it)."""

    _foremoe: _LayerState

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        st = self._foremoe
        started = _start_call(st, hidden_states, routing_map)
        if started is None:
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        x, plan, run, _ = started
        st.call = None
        st.balancer._record(st, plan, run)
        self.hidden_shape = hidden_states.shape
        self.routing_map = routing_map
        return x, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        st = self._foremoe
        run = st.run
        if run is None:
            return super().dispatch_postprocess(hidden_states, probs)
        K, G, rank = st.topk, st.world, st.rank
        gmap, self.routing_map = self.routing_map, None
        N = int(gmap.shape[0])
        T = N // G
        if T * G != N or T != run.layout.slots.shape[0]:
            raise ValueError(f"foremoe.megatron: MoE layer {st.index}: the all-gather holds {N} tokens over {G} "
                             f"ranks, this rank {run.layout.slots.shape[0]} (every rank needs the same count)")
        gids = _routes(gmap, K, st.index)[0]  # [G T, K] every rank's routes, in rank order
        split = run.layout.source_split
        S = st.storage.slots
        slots = np.empty((N, K), dtype=np.int64)
        for g in range(G):  # each source's physical slots under the plan's split: the alltoall path's dispatch
            d = run.plan.dispatch(run.plan_layer, gids[g * T:(g + 1) * T].reshape(T, 1, K), split, g)
            slots[g * T:(g + 1) * T] = np.asarray(d["slots"]).reshape(T, K)
        mine = (slots >= rank * S) & (slots < (rank + 1) * S)
        tok, k = np.nonzero(mine)  # global token ascending, then k
        j = slots[tok, k] - rank * S
        order = np.argsort(j, kind="stable")  # by slot; sources in rank order and tokens in order inside
        tok, k, j = tok[order], k[order], j[order]
        if not np.array_equal(np.bincount(j, minlength=S), np.asarray(run.layout.slot_counts)):
            raise RuntimeError(f"foremoe.megatron: MoE layer {st.index}: the all-gathered routes disagree with this "
                               f"rank's slot counts (ranks with different plans?)")
        counts, perm = _by_row(run, st.rows_total)
        if perm is not None:
            perm_np = perm.numpy()
            tok, k = tok[perm_np], k[perm_np]
        E = gmap.shape[1]
        experts = gids.numpy()[tok, k].astype(np.int64)
        pos = np.full(N * K, len(tok), dtype=np.int64)  # route (t, k) -> its row here; past the end: none
        pos[tok * K + k] = np.arange(len(tok))
        dev = hidden_states.device
        rows = torch.from_numpy(tok).to(dev)
        st.call = _Call()
        c = st.call
        c.shape, c.T, c.send_tokens, c.gather, c.pad = self.hidden_shape, N, rows, torch.from_numpy(pos).to(dev), True
        c.counts = counts
        x = _Spread.apply(hidden_states, rows, c.gather, True, K)
        local_probs = probs.reshape(-1).index_select(0, torch.from_numpy(tok * E + experts).to(probs.device))
        self.local_probs = local_probs
        return x, counts, local_probs

    def combine_preprocess(self, hidden_states: torch.Tensor):
        st = self._foremoe
        if st.run is None:
            return super().combine_preprocess(hidden_states)
        c = st.call
        return _Collect.apply(hidden_states, c.send_tokens, c.gather, True, c.T, st.topk)

    def combine_postprocess(self, hidden_states: torch.Tensor):
        st = self._foremoe
        if st.run is not None:
            st.run, st.call = None, None
        return super().combine_postprocess(hidden_states)


def _experts_run(st: _LayerState) -> Optional[_Run]:
    """The balanced call's run as its local experts' forward starts (None outside a balanced call: Megatron's own
    forward runs): notes whether autograd records this forward and schedules the replica gradients' return. One
    preamble for both expert modules."""
    run = st.run
    if run is not None:
        run.need_grad = torch.is_grad_enabled()
        _schedule_gradients(run, st.balancer._gradients_mode())
    return run


class _BalancedSequentialMLP(SequentialMLP):
    """``SequentialMLP`` whose forward, during a balanced call, computes the plan's slots (owner rows and replica
    rows) with the replica gradients reduced into the owners; otherwise Megatron's own forward."""

    _foremoe: _LayerState

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        st = self._foremoe
        run = _experts_run(st)
        if run is None:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        if any(run.layout.slot_counts):  # the slots compute in Megatron's graph
            return _slot_compute(run, permuted_local_hidden_states, permuted_probs, st.params), None
        blocks = _OwnerRows.apply(st.storage, *st.params)  # no tokens here: the parameters' gradients are zeros
        y = _SlotExperts.apply(permuted_local_hidden_states, permuted_probs, run, *blocks)
        return y, None


class _BalancedGroupedMLP(GroupedMLP):
    """``GroupedMLP`` whose forward, during a balanced call, runs one grouped GEMM (Megatron's
    ``grouped_gemm.ops.gmm``) per weight over the whole slot storage (owner rows and spare rows; the dispatcher
    grouped the received tokens by storage row and made ``tokens_per_expert`` the per-row counts), with the
    activation, routing weight and activation recompute of ``GroupedMLP.forward``; otherwise Megatron's own
    forward. The replica gradients reach the fused parameters through :class:`_GroupedWeights`."""

    _foremoe: _LayerState

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        st = self._foremoe
        run = _experts_run(st)
        if run is None:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        slots = [j for j, c in enumerate(run.layout.slot_counts) if c > 0]
        w1, w2 = _GroupedWeights.apply(run, slots, self.weight1, self.weight2)
        x, probs = permuted_local_hidden_states, permuted_probs.unsqueeze(-1)
        act = self.activation_func_with_probs
        if self.activation_recompute:
            from megatron.core import tensor_parallel

            self.activation_checkpoint = tensor_parallel.CheckpointWithoutOutput()
        if x.nelement() != 0:
            h = _gg.ops.gmm(x, w1, tokens_per_expert, trans_b=False)
        else:  # no tokens here: plain matmuls keep the weights in the graph (their gradients are zeros)
            h = torch.matmul(x, w1.view(self.config.hidden_size, -1))
        if self.activation_recompute:
            h = self.activation_checkpoint.checkpoint(act, h, probs)
        else:
            h = act(h, probs)
        if x.nelement() != 0:
            y = _gg.ops.gmm(h, w2, tokens_per_expert, trans_b=False)
        else:
            y = torch.matmul(h, w2.view(-1, self.config.hidden_size))
        if self.activation_recompute:
            self.activation_checkpoint.discard_output_and_register_recompute(y)
        return y, None


class MegatronBalancer:
    """The balanced MoE layers of a model (made by :func:`install`) and the micro-step their plans come from.

    Attributes: ``layers`` (the ``MoELayer`` modules, in the order of their routers: the order of
    ``RouterReplay.get_recorded_data()``), ``storages`` (their :class:`ExpertStorage`), ``owners`` (``[E]`` owner
    rank of every expert: the plans must keep them), ``group`` (the expert-parallel process group), ``slots``,
    ``hold_replica_gradients`` (see the module docstring).
    ``stats``: one dict per balanced layer call, the last ``stats_limit`` (see :attr:`stats`)."""

    def __init__(self, layers: Sequence[MoELayer], slots: int, *, timeout: float = DEFAULT_TIMEOUT,
                 stats_limit: int = 10000, hold_replica_gradients: bool = True, **storage_options: Any):
        if not layers:
            raise ValueError("foremoe.megatron.install: the model has no MoELayer")
        if not isinstance(hold_replica_gradients, bool):
            raise ValueError(f"foremoe.megatron.install: hold_replica_gradients must be True or False, got "
                             f"{hold_replica_gradients!r}")
        self.hold_replica_gradients = hold_replica_gradients
        self.timeout = float(timeout)
        self.slots = integer(slots, "foremoe.megatron.install: slots")
        self.layers = list(layers)
        self._states: List[_LayerState] = []
        for i, layer in enumerate(self.layers):
            self._states.append(_LayerState(self, i, layer, self.slots, storage_options))
        first = self._states[0]
        for s in self._states[1:]:
            if s.num_experts != first.num_experts or s.world != first.world:
                raise ValueError(f"foremoe.megatron: MoE layer {s.index} has {s.num_experts} experts over {s.world} "
                                 f"ranks, layer 0 {first.num_experts} over {first.world}")
        self.group, self.num_experts, self.world = first.group, first.num_experts, first.world
        self.owners = first.owners
        self.storages = [s.storage for s in self._states]
        self._driver: Optional[ReplayDriver] = None
        self._micro: Optional[int] = None
        self._plan: Any = None
        self._last: Optional[bool] = None  # set_micro_step's `last` (None: the update driver's last micro-step)
        self._calls: Deque[Tuple[Any, ...]] = collections.deque(maxlen=stats_limit)
        guard_optimizer_steps(self)  # refuses steps while gradients are held; calls optimizer_stepped after each

    # -- drivers and micro-steps ------------------------------------------------------------------------------

    def topology(self) -> "foremoe.Topology":
        """A one-node topology of the expert-parallel ranks with this balancer's slots (for a ``Planner``)."""
        return foremoe.Topology(1, self.world, self.slots)

    def driver(self, planner: Any, per_layer: Sequence[Any], microbatch_offsets: Any = None, *,
               stage: str = "update", **options: Any) -> ReplayDriver:
        """A :class:`ReplayDriver` over router replay's recorded per-layer ``[T, K]`` indices of this rank's tokens
        (one list per micro-batch, or one per layer with ``microbatch_offsets``; what ``RouterReplay`` records),
        summed over the expert-parallel group, planned with this balancer's owners. Every rank calls it."""
        return ReplayDriver.from_megatron(planner, per_layer, microbatch_offsets, num_experts=self.num_experts,
                                          owners=self.owners, group=self.group, stage=stage,
                                          num_layers=len(self.layers), timeout=self.timeout, **options)

    def pack(self, samples: Sequence[Sequence[Any]], *, micro_steps: int, token_budget: int, ranks: int = 1,
             start: Any = None) -> StepPacking:
        """The routing-aware packing of one optimizer step's samples, before the stage runs
        (:func:`foremoe.torch.pack_from_slime` under this balancer's owners: each micro-step's load per rank close to
        the step's share). ``samples``: per sample, router replay's recorded per-layer ``[len, K]`` indices (what
        ``RouterReplay`` records for a micro-batch holding that sample alone), in the batch's order. The micro-batches
        of :meth:`StepPacking.micro_batches` go where the trainer's own ones go; record or slice the routing of each
        packed micro-batch (its samples' indices, concatenated in that order) for :meth:`driver`. The trainer keeps
        the loss normalised over the mini-batch and the same micro-batches in recompute and update (see
        :class:`foremoe.torch.StepPacking`)."""
        who = "MegatronBalancer.pack"
        if not isinstance(samples, (list, tuple)) or not samples:
            raise ValueError(f"{who}: samples must be a non-empty list of per-sample lists of per-layer [len, K] indices")
        stacked = []
        for i, layers in enumerate(samples):
            if not isinstance(layers, (list, tuple)) or len(layers) != len(self.layers):
                got = len(layers) if isinstance(layers, (list, tuple)) else type(layers).__name__
                raise ValueError(f"{who}: sample {i} has {got} per-layer arrays, the model {len(self.layers)} MoE layers")
            arrays = [np.asarray(x.detach().cpu() if isinstance(x, torch.Tensor) else x) for x in layers]
            for l, a in enumerate(arrays):
                if a.ndim != 2 or a.shape != arrays[0].shape:
                    raise ValueError(f"{who}: sample {i}, layer {l}: recorded indices have shape {list(a.shape)}, "
                                     f"layer 0 {list(arrays[0].shape)} (each layer routes the sample's [len, K])")
            stacked.append(np.stack(arrays, axis=1))
        return pack_from_slime(stacked, num_experts=self.num_experts, micro_steps=micro_steps,
                               token_budget=token_budget, ranks=ranks, gpu_of=self.owners, start=start)

    def set_micro_step(self, micro_step: Optional[int], driver: Optional[ReplayDriver] = None, *,
                       last: Optional[bool] = None) -> Any:
        """Makes ``driver.plan(micro_step)`` the plan of every MoE layer until the next call (``None``: Megatron's
        own path). ``driver`` is kept for later calls. Returns the plan.

        ``last`` (with ``hold_replica_gradients``): whether this is the last micro-step before the optimizer step,
        whose backward returns every held replica gradient. ``None`` (default): the update-stage driver's last
        micro-step is (``micro_step == driver.num_micro_steps - 1``; every micro-step of a recompute-stage driver
        returns them too). Pass it when the optimizer steps elsewhere; the same on every rank."""
        if last is not None and not isinstance(last, bool):
            raise ValueError(f"foremoe.megatron: set_micro_step: last must be True, False or None, got {last!r}")
        if driver is not None:
            if not isinstance(driver, ReplayDriver):
                raise ValueError(f"foremoe.megatron: driver must be a foremoe.torch.ReplayDriver, got "
                                 f"{type(driver).__name__}")
            self._driver = driver
        if micro_step is None:
            self._micro, self._plan, self._last = None, None, None
            return None
        if self._driver is None:
            raise ValueError("foremoe.megatron: set_micro_step without a driver (pass driver=...)")
        plan = self._driver.plan(micro_step)
        self._check_plan(plan, micro_step)
        self._micro, self._plan, self._last = int(micro_step), plan, last
        return plan

    @contextlib.contextmanager
    def micro_step(self, micro_step: int, driver: Optional[ReplayDriver] = None, *,
                   last: Optional[bool] = None) -> Iterator[Any]:
        """``with balancer.micro_step(m, driver):`` runs the forward and backward inside under the plan of
        micro-step ``m`` (yielded); the micro-step set before is restored after. ``last``: :meth:`set_micro_step`'s."""
        before = (self._micro, self._plan, self._driver, self._last)
        try:
            yield self.set_micro_step(micro_step, driver, last=last)
        finally:
            self._micro, self._plan, self._driver, self._last = before

    @property
    def current_micro_step(self) -> Optional[int]:
        return self._micro

    # -- held replica gradients -------------------------------------------------------------------------------

    def _gradients_mode(self) -> str:
        """``balanced_moe``'s ``gradients`` for the layer calls of the current micro-step."""
        last = self._last
        if last is None:
            d = self._driver
            last = d is None or d.stage != "update" or self._micro == d.num_micro_steps - 1
        return gradients_mode(self.hold_replica_gradients, last)

    def held_gradients(self) -> List[Tuple[int, int, int]]:
        """``(layer, holder rank, expert)`` of the replica gradients held now (empty after the last micro-step's
        backward, and always with ``hold_replica_gradients=False``)."""
        return held_gradients(self.storages)

    def optimizer_stepped(self) -> None:
        """Called after every ``torch.optim`` step (torch's global optimizer step post-hook, through
        :func:`foremoe.torch.held.guard_optimizer_steps`; it also fires for the inner ``torch.optim`` step of
        Megatron's optimizers, before they write the parameters): copy-bound owner rows are stale from now on; the
        next balanced call of each layer copies the parameters again (:meth:`ExpertStorage.refresh_copies`). Aliased
        owner rows may change without their parameters' version moving: Megatron's mixed-precision optimizer without
        the distributed one (``Float16OptimizerWithFloat16Params``, bf16/fp16 parameters) copies its fp32 main
        parameters into each ``model_param.data`` (optimizer.py:745-779 of 0.16.1), which autograd's version counter
        does not see; so every storage's owner weights count as changed (:meth:`ExpertStorage.invalidate`: replicas
        re-sent at the next sync, once per optimizer step)."""
        for storage in self.storages:
            storage.invalidate()

    def guarded_parameters(self) -> List[torch.Tensor]:
        """The expert parameters an optimizer step must not touch while replica gradients are held."""
        return [p for st in self._states for p in st.params]

    def held_error(self, held: Sequence[Tuple[int, int, int]]) -> str:
        return (f"foremoe.megatron: optimizer step while {len(held)} replica gradient(s) are still held "
                f"({describe(held)}): their owners' gradients are incomplete. "
                f"Run the update driver's last micro-step (driver.num_micro_steps - 1) before the optimizer step, "
                f"mark the last one with set_micro_step(m, driver, last=True), or install with "
                f"hold_replica_gradients=False")

    def _check_plan(self, plan: Any, m: int) -> None:
        if not isinstance(plan, foremoe.Plan):
            raise ValueError(f"foremoe.megatron: the driver returned {type(plan).__name__}, not a foremoe.Plan")
        for what, got, want in [("MoE layers", plan.num_layers, len(self.layers)), ("ranks", plan.num_gpus,
                                 self.world), ("experts", plan.num_experts, self.num_experts),
                                ("slots per rank", plan.slots, self.slots)]:
            if int(got) != int(want):
                raise ValueError(f"foremoe.megatron: the plan of micro-step {m} has {got} {what}, the model "
                                 f"{want}")

    def _plan_for(self, index: int) -> Any:
        return self._plan

    def _record(self, st: _LayerState, plan: Any, run: _Run) -> None:
        # Kept raw (a few ints and the shared plan object); :attr:`stats` makes the dicts when it is read.
        counts = run.layout.slot_counts
        used = [int(counts[j]) for j in run.replica_slots if counts[j] > 0]
        self._calls.append((self._micro, st.index, plan, sum(used), len(used)))

    @property
    def stats(self) -> List[Dict[str, Any]]:
        """One dict per balanced layer call (the last ``stats_limit``): ``micro_step``, ``layer``, ``max`` and
        ``mean`` tokens per rank under the plan, ``max_plain`` and ``mean_plain`` under Megatron's sharding (every
        token on its expert's owner), ``replica_tokens`` and ``replica_rows``: tokens this rank computed on replica
        rows, and how many replica rows took any."""
        out = []
        for micro, layer, plan, replica_tokens, replica_rows in self._calls:
            taken = np.asarray(plan.slot_tokens[layer])
            place = np.asarray(plan.gpu_slots[layer])
            used = place >= 0
            per_expert = np.zeros(self.num_experts, dtype=np.int64)
            np.add.at(per_expert, place[used], taken[used])
            loads = taken.sum(axis=1)
            plain = np.bincount(self.owners, weights=per_expert, minlength=self.world)
            out.append({"micro_step": micro, "layer": layer, "max": int(loads.max()), "mean": float(loads.mean()),
                        "max_plain": int(plain.max()), "mean_plain": float(plain.mean()),
                        "replica_tokens": replica_tokens, "replica_rows": replica_rows})
        return out


def _moe_layers(model: Any) -> List[MoELayer]:
    chunks = model if isinstance(model, (list, tuple)) else [model]
    out: List[MoELayer] = []
    for chunk in chunks:
        if not isinstance(chunk, torch.nn.Module):
            raise ValueError(f"foremoe.megatron.install: expected a torch.nn.Module (or a list of model chunks), "
                             f"got {type(chunk).__name__}")
        out.extend(m for m in chunk.modules() if isinstance(m, MoELayer))
    return out


def install(model: Any, slots: int, *, timeout: float = DEFAULT_TIMEOUT, stats_limit: int = 10000,
            hold_replica_gradients: bool = True, **storage_options: Any) -> MegatronBalancer:
    """Makes every ``MoELayer`` of ``model`` (a module or a list of model chunks) balanced per micro-step, in
    place, and returns their :class:`MegatronBalancer`. Call it on every rank after building the model, before or
    after wrapping it in Megatron's DDP (with the distributed optimizer the expert parameters are then copy-bound:
    see the module docstring). ``slots``: expert rows per rank (the local experts plus spare replica rows);
    ``timeout``: seconds any collective or transfer of a layer call may take; ``stats_limit``: calls kept in
    :attr:`MegatronBalancer.stats`; ``hold_replica_gradients``: hold a resident replica's gradient until its slot is
    reused or the update stage's last backward (see the module docstring; ``False``: return it every micro-step).
    ``storage_options``: :class:`ExpertStorage`'s ``verify``, ``mirror``, ``faults``, ``double_buffer``.

    Raises ``ValueError`` naming the setting for a configuration the adapter does not support."""
    if not isinstance(hold_replica_gradients, bool):
        raise ValueError(f"foremoe.megatron.install: hold_replica_gradients must be True or False, got "
                         f"{hold_replica_gradients!r}")
    layers = _moe_layers(model)
    if not layers:
        raise ValueError("foremoe.megatron.install: the model has no MoELayer")
    for i, layer in enumerate(layers):
        check_config(layer.config)
        disp = layer.token_dispatcher
        if isinstance(disp, (ForeMoEAlltoAllTokenDispatcher, ForeMoEAllGatherTokenDispatcher)):
            raise ValueError(f"foremoe.megatron: MoE layer {i} is already balanced (install once per model)")
        if type(disp) not in (MoEAlltoAllTokenDispatcher, MoEAllGatherTokenDispatcher):
            raise ValueError(f"foremoe.megatron: MoE layer {i} uses {type(disp).__name__}; only "
                             f"MoEAlltoAllTokenDispatcher (moe_token_dispatcher_type='alltoall') and "
                             f"MoEAllGatherTokenDispatcher ('allgather') are supported")
        if type(disp) is MoEAllGatherTokenDispatcher:
            import torch.distributed as dist

            if dist.get_process_group_ranks(disp.tp_ep_group) != dist.get_process_group_ranks(disp.ep_group):
                raise ValueError(f"foremoe.megatron: MoE layer {i}: the allgather dispatcher's TP x EP group is not "
                                 f"its expert-parallel group (tensor parallelism is not supported with it)")
        if type(layer.experts) not in (SequentialMLP, GroupedMLP):
            raise ValueError(f"foremoe.megatron: MoE layer {i} uses {type(layer.experts).__name__} experts; only "
                             f"SequentialMLP (moe_grouped_gemm=False) and GroupedMLP (moe_grouped_gemm=True "
                             f"without Transformer Engine) are supported")
        if type(layer.experts) is GroupedMLP:
            _grouped_rows(layer.experts, layer.config, i)  # the fused shapes, before any layer is changed
    balancer = MegatronBalancer(layers, slots, timeout=timeout, stats_limit=stats_limit,
                                hold_replica_gradients=hold_replica_gradients, **storage_options)
    for st in balancer._states:
        layer = st.module
        alltoall = type(layer.token_dispatcher) is MoEAlltoAllTokenDispatcher
        layer.token_dispatcher.__class__ = (ForeMoEAlltoAllTokenDispatcher if alltoall else
                                            ForeMoEAllGatherTokenDispatcher)
        layer.token_dispatcher._foremoe = st
        layer.experts.__class__ = _BalancedGroupedMLP if st.grouped else _BalancedSequentialMLP
        layer.experts._foremoe = st
    return balancer
