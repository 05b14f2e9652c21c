"""ForeMoE inside HuggingFace transformers' expert parallelism (optional: needs ``transformers`` 5.23 and torch >= 2.7).

transformers 5.23 runs the experts of an MoE block through an *expert-parallel implementation* chosen by
``DistributedConfig(ep_implementation=name)`` among those registered in
``transformers.distributed.expert_parallel.EPImplementationInterface``: it receives every token's hidden state, its
global top-k expert ids and routing weights, and does the dispatch and the combine itself. Importing this module
registers :class:`ForeMoEEP` there as ``"foremoe"``; it runs each MoE layer with
:func:`foremoe.torch.balanced_moe` under the plan of the current micro-step (plain expert parallelism without one).

Supported (tested on the CPU over gloo): Qwen3-MoE, Mixtral and OLMoE (fused experts ``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``, no bias, a top-k router returning ``(router_logits, topk_weights, topk_indices)``),
loaded with ``DistributedConfig(tp_size=N, ep_size=N, ep_implementation="foremoe")``: the ranks of the expert
group hold the same batch (transformers' tensor parallelism of the dense modules), each rank dispatches its slice of
it (as transformers' own ``"all_to_all"`` does) and owns ``E / N`` experts. Not supported, with an error naming the
setting: ``fsdp_size > 1`` or ``dp_replicate_size > 1`` (refused when the model is loaded, see *FSDP2* below),
``ep_size != tp_size``, pipeline parallelism, other expert layouts (biases, transposed weights), Mixtral's router
jitter.

**FSDP2.** FSDP2 over the dense modules with the experts left to ForeMoE is not possible with transformers 5.23:
whenever ``fsdp_size * dp_replicate_size > 1`` its ``apply_fully_sharded_data_parallelism``
(``transformers/distributed/fsdp.py`` lines 195-213, called from ``distributed/mixin.py`` 340-341) wraps every
``ep_dispatch_experts`` module in an FSDP2 unit of its own over the ``efsdp`` mesh, even when that mesh has one rank,
and no ``DistributedConfig`` field or plan rule leaves them out; the decoder layers' and the root's ``fully_shard``
(lines 222-238) pass no ``ignored_params``. FSDP2 then re-gathers the expert parameters into buffers of its own for
every forward and reduce-scatters their gradients itself, so they cannot be the owner rows of an
:class:`~foremoe.torch.ExpertStorage`. FSDP2 applied by the trainer after loading is no way round it either: the mesh
must cover the world (``distributed/utils.py`` 312-317), so without ``fsdp_size`` there are no data-parallel ranks
besides the tensor-parallel ones, and ``ep_size`` must divide ``fsdp_size * tp_size``
(``distributed/configuration_utils.py`` 184-185). Loading with ``ep_implementation="foremoe"`` and ``fsdp_size > 1``
or ``dp_replicate_size > 1`` raises ``ValueError`` naming this (before FSDP2 wraps anything).

Use, on every rank (see ``examples/python/transformers_train.py``)::

    import foremoe, foremoe.transformers as fmt
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager",
        distributed_config=DistributedConfig(tp_size=4, ep_size=4, ep_implementation="foremoe"))
    moe = fmt.ForeMoE(model, spare_slots=2)           # expert weights -> ExpertStorage owner rows
    opt = torch.optim.AdamW(model.parameters())        # after ForeMoE: it replaced the expert parameters
    planner = foremoe.Planner(moe.topology())
    with torch.no_grad(), moe.record() as rollout:     # rollout: record every MoE layer's top-k ids
        for mb in micro_batches:
            model(input_ids=mb)
    driver = moe.replay_driver(planner, rollout.ids(), rollout.offsets())  # one plan per micro-step, ahead
    for m, mb in enumerate(micro_batches):             # recompute / update: replayed routing, balanced
        with moe.micro_step(driver.plan(m), rollout.ids(m)):   # forward and backward inside
            model(input_ids=mb, labels=mb).loss.backward()
    opt.step()                                         # after the last micro-step: no replica gradient held

**Parameters.** :class:`ForeMoE` replaces each experts module's ``gate_up_proj`` and ``down_proj`` (transformers'
``Shard(0)`` DTensors) by the owner rows of an :class:`~foremoe.torch.ExpertStorage` (plain ``nn.Parameter`` views
``[E / N, ...]``): the optimizer (create it after :class:`ForeMoE`) sees exactly the experts the rank owns; the spare
rows the replicas go to are never parameters. A replica's weight gradient is added to its owner's in the backward
(``balanced_moe``).

**Held replica gradients** (``ForeMoE(..., hold_replica_gradients=True)``, the default, the planner's rule of the
same name; issue 30). In the update stage a replica that the next micro-steps' plans keep on its rank accumulates its
weight gradient in place and returns it once: in the backward of the first micro-step whose plan drops it (its slot
is reused), and every gradient still held in the backward of the stage's last micro-step, through autograd into the
owner's ``.grad`` (and any hook on it), before anything after that backward reads ``.grad`` (gradient clipping, the
optimizer step). The last micro-step is known from the plan: :meth:`ForeMoE.micro_step` with the plan of micro-step
``num_micro_steps - 1`` of an update-stage :class:`~foremoe.torch.ReplayDriver` (``driver.plan(m)``, the same object)
returns them all; with a recompute-stage driver's plans nothing is held. With plans made another way, say which
micro-step is the last before the optimizer step: ``moe.micro_step(plan, ids, last=True)`` (``last=False`` holds on
at a driver's last micro-step). An optimizer step (any ``torch.optim`` optimizer, through torch's global step
pre-hook) over the expert parameters while a replica gradient is still held raises ``RuntimeError`` naming the held
gradients, before any parameter changes. ``hold_replica_gradients=False`` returns every replica's gradient in every
backward. Activation checkpointing reruns a layer under the same plan: the rerun holds and returns nothing twice.

**Routing replay.** :meth:`ForeMoE.record` records each router's top-k ids (a forward hook on the router).
:meth:`ForeMoE.micro_step` replays them: each router's output is replaced by the recorded ids and routing weights
recomputed from the *current* router logits at those ids (softmax in float32 over all experts, gathered, normalised
as the router does): Megatron-core's router replay. Both the balanced run and the unbalanced one (``plan=None``, or
transformers' ``"all_to_all"`` with the same replay) compute the same math; the plan only decides where each
(token, expert) pair is computed.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import foremoe
import foremoe.torch as ft
from foremoe._args import integer
from foremoe.torch.distributed import DEFAULT_TIMEOUT, group_rank, group_size
from foremoe.torch.held import describe, driver_position, gradients_mode, guard_optimizer_steps, held_gradients

__all__ = [
    "SUPPORTED_TRANSFORMERS",
    "ForeMoE",
    "ForeMoEEP",
    "Recording",
    "RoutingReplay",
    "check_transformers_version",
    "expert_forward",
]

#: The transformers releases this adapter is tested with (``major.minor``): the expert-parallel seam moves quickly.
SUPPORTED_TRANSFORMERS = ("5.23",)
#: Router classes whose routing weights :meth:`ForeMoE.micro_step` recomputes at replayed ids.
SUPPORTED_ROUTERS = ("Qwen3MoeTopKRouter", "MixtralTopKRouter", "OlmoeTopKRouter")
_NAME = "foremoe"


def check_transformers_version(version: Optional[str] = None) -> str:
    """The installed transformers version (or ``version``); ``ImportError`` naming it when it is not supported."""
    if version is None:
        try:
            import transformers
        except ImportError as exc:
            raise ImportError(f"foremoe.transformers needs transformers {SUPPORTED_TRANSFORMERS[0]}.x "
                              f"(pip install 'foremoe[transformers]'); transformers is not installed") from exc
        version = str(transformers.__version__)
    minor = ".".join(version.split(".")[:2])
    if minor not in SUPPORTED_TRANSFORMERS:
        tested = ", ".join(v + ".x" for v in SUPPORTED_TRANSFORMERS)
        raise ImportError(f"foremoe.transformers supports transformers {tested}"
                          f" (its expert-parallel registry EPImplementationInterface); found transformers {version}")
    torch_version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if torch_version < (2, 7):
        raise ImportError(f"foremoe.transformers needs torch >= 2.7 (transformers' expert-parallel token dispatch); "
                          f"found torch {torch.__version__}")
    return version


check_transformers_version()

from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402 - after the version check
from transformers.distributed.expert_parallel import EPImplementation, EPImplementationInterface  # noqa: E402


def _fsdp_error(cfg: Any) -> Optional[str]:
    """The reason ``ep_implementation="foremoe"`` cannot run under ``DistributedConfig`` ``cfg`` because of FSDP2
    (``fsdp_size > 1`` or ``dp_replicate_size > 1``), or ``None``."""
    sizes = {n: int(getattr(cfg, n, 1) or 1) for n in ("fsdp_size", "dp_replicate_size")}
    bad = [f"{n}={v}" for n, v in sizes.items() if v != 1]
    if not bad:
        return None
    layout = ", ".join(f"{n}={int(getattr(cfg, n, 1) or 1)}" for n in ("tp_size", "fsdp_size", "dp_replicate_size",
                                                                        "ep_size"))
    return (f"ep_implementation='foremoe' does not run with {' and '.join(bad)} (DistributedConfig({layout})): "
            f"transformers {SUPPORTED_TRANSFORMERS[0]} wraps every expert-parallel experts module in an FSDP2 unit of "
            f"its own over the 'efsdp' mesh whenever fsdp_size * dp_replicate_size > 1 "
            f"(transformers/distributed/fsdp.py, apply_fully_sharded_data_parallelism), with no setting that leaves "
            f"the experts out of FSDP2; FSDP2 re-gathers their parameters into buffers of its own, so they cannot be "
            f"the owner rows of an ExpertStorage. Load with DistributedConfig(tp_size=N, ep_size=N, "
            f"ep_implementation='foremoe') (dense modules tensor-parallel), or keep FSDP2 with transformers' own "
            f"ep_implementation='all_to_all'")


def expert_forward(act_fn: Any) -> Any:
    """One expert's math of the fused layout, ``expert(x, gate_up [2I, H], down [H, I])``: the eager experts
    forward of Qwen3-MoE, Mixtral and OLMoE without the routing weight (``balanced_moe`` applies it)."""

    def expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(act_fn(gate) * up, down)

    return expert


class ForeMoEEP(EPImplementation):
    """The ``"foremoe"`` expert-parallel implementation: one per experts module, built by transformers when the
    model is loaded with ``DistributedConfig(tp_size=N, ep_size=N, ep_implementation="foremoe")``.

    Each call takes this rank's slice of the batch the expert group shares, runs
    :func:`foremoe.torch.balanced_moe` over the expert group with the plan of the current
    :meth:`ForeMoE.micro_step` (``None`` outside one: plain expert parallelism) and gathers the slices back. It
    needs the :class:`ForeMoE` attachment (the expert storage) before its first call."""

    def __init__(self, experts: nn.Module, ep_mesh: Any, tp_mesh: Any):
        # The model's DistributedConfig is set on its config before transformers builds the EP implementations
        # (distributed/mixin.py maybe_distribute_model) and FSDP2 wraps the experts only after: refuse FSDP2 here, at
        # load time, rather than after the whole model was sharded.
        cfg = getattr(getattr(experts, "config", None), "distributed_config", None)
        reason = _fsdp_error(cfg) if cfg is not None else None
        if reason is not None:
            raise ValueError(reason)
        super().__init__(experts, ep_mesh, tp_mesh)
        if not self.shares_batch:
            raise ValueError(f"ep_implementation='foremoe' needs the expert-parallel group to be the tensor-parallel "
                             f"group (DistributedConfig(tp_size=N, ep_size=N)): got ep_size={ep_mesh.size()}, "
                             f"tp_size={tp_mesh.size()}")
        self.experts = experts
        self.group = ep_mesh.get_group()
        self.attachment: Optional["ForeMoE"] = None
        self.layer = -1
        self.storage: Optional[ft.ExpertStorage] = None
        experts._foremoe_ep = self

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.storage is None or self.attachment is None:
            raise RuntimeError(f"foremoe.transformers: the experts of MoE layer {type(self.experts).__name__} ran "
                               f"before foremoe.transformers.ForeMoE(model, spare_slots=...) attached the expert "
                               f"storage (call it once on every rank after from_pretrained)")
        num_tokens, hidden = hidden_states.shape
        sliced = self.tp_mesh.size() > 1
        if sliced:  # Replicate -> Shard(0): this rank's rows (a local chunk); backward all-gathers the gradients
            hidden_states, top_k_index, top_k_weights = (
                DTensor.from_local(t, self.tp_mesh, [Replicate()], run_check=False)
                .redistribute(self.tp_mesh, [Shard(0)]).to_local()
                for t in (hidden_states, top_k_index, top_k_weights))
        st = self.storage
        out = ft.balanced_moe(hidden_states.contiguous(), top_k_index, top_k_weights, self.attachment.current_plan,
                              st, self.attachment.expert_fns[self.layer], layer=self.layer, group=self.group,
                              hidden=hidden, timeout=self.attachment.timeout, gradients=self.attachment.gradients)
        if not sliced:
            return out
        return DTensor.from_local(out.contiguous(), self.tp_mesh, [Shard(0)], shape=(num_tokens, hidden),
                                  stride=(hidden, 1)).full_tensor()

    def prefetch(self, plan: "foremoe.Plan") -> None:
        """Posts this layer's replica moves for ``plan`` now (:meth:`foremoe.torch.ExpertStorage.prefetch`, a
        collective of the expert group); the layer's next call, which must run under ``plan``, installs them. What
        :meth:`foremoe.torch.ReplayDriver.prefetch` calls: ``driver.prefetch(m, moe.layers)``."""
        if self.storage is None or self.attachment is None:
            raise RuntimeError("foremoe.transformers: prefetch before foremoe.transformers.ForeMoE(model, ...)")
        self.storage.prefetch(plan, self.layer, group=self.group, timeout=self.attachment.timeout)


EPImplementationInterface.register(_NAME, ForeMoEEP)


class Recording:
    """The top-k ids every MoE router chose during :meth:`ForeMoE.record`, one ``[T, L, K]`` tensor per forward
    (``T`` the forward's tokens, batch and sequence flattened; ``L`` the MoE layers in model order)."""

    def __init__(self, num_layers: int):
        self._layers: List[List[torch.Tensor]] = [[] for _ in range(num_layers)]

    def _add(self, layer: int, ids: torch.Tensor) -> None:
        self._layers[layer].append(ids.detach().to("cpu", torch.int64).clone())

    def __len__(self) -> int:
        return min((len(b) for b in self._layers), default=0)

    def ids(self, forward: Optional[int] = None) -> Any:
        """``[T, L, K]`` of forward ``forward`` (0-based), or all of them concatenated along tokens (``None``)."""
        counts = {len(b) for b in self._layers}
        if len(counts) != 1:
            raise ValueError(f"Recording: the MoE layers recorded different numbers of forwards {sorted(counts)} "
                             f"(a forward that stopped part-way through the model)")
        n = counts.pop()
        if forward is None:
            if n == 0:
                raise ValueError("Recording: nothing recorded (no forward ran inside ForeMoE.record())")
            return torch.cat([torch.stack([b[i] for b in self._layers], dim=1) for i in range(n)])
        f = integer(forward, "Recording.ids: forward")
        if not 0 <= f < n:
            raise ValueError(f"Recording.ids: forward {f} outside the [0, {n}) recorded forwards")
        return torch.stack([b[f] for b in self._layers], dim=1)

    def offsets(self) -> np.ndarray:
        """``[forwards + 1]`` token offsets of the forwards in :meth:`ids` ``()`` (the micro-batch boundaries)."""
        return np.concatenate([[0], np.cumsum([int(t.shape[0]) for t in self._layers[0]])]).astype(np.int64)


def _router(modules: Dict[str, nn.Module], parent_name: str) -> nn.Module:
    """The router of MoE block ``parent_name`` (its ``gate``), checked."""
    block = modules.get(parent_name)
    router = getattr(block, "gate", None)
    if router is None or type(router).__name__ not in SUPPORTED_ROUTERS:
        raise ValueError(f"foremoe.transformers: the MoE block {parent_name!r} has router {type(router).__name__} "
                         f"(supported: {', '.join(SUPPORTED_ROUTERS)}: Qwen3-MoE, Mixtral, OLMoE)")
    jitter = float(getattr(block, "jitter_noise", 0.0) or 0.0)
    if jitter > 0:
        raise ValueError(f"foremoe.transformers: {parent_name!r} has router_jitter_noise={jitter}: random jitter of "
                         f"the hidden states is not supported with routing replay (set it to 0)")
    return router


class RoutingReplay:
    """Router replay for the MoE blocks of a transformers model (any ``ep_implementation``, or none): forward hooks
    on the routers that record their top-k ids (:meth:`record`) or replace them by recorded ones (:meth:`replay`),
    with the routing weights recomputed from the current router logits at the replayed ids: a softmax over all
    experts in float32 (as the routers compute it), gathered at the ids, normalised over the top-k when the router
    normalises (Mixtral always; Qwen3-MoE and OLMoE with ``norm_topk_prob``), in the dtype the router returns.
    Without replay the hooks change nothing.

    ``model``: a Qwen3-MoE, Mixtral or OLMoE model; its MoE blocks (modules with a ``gate`` router and ``experts``)
    are the layers ``0 .. L - 1`` in model order.
    """

    def __init__(self, model: nn.Module, *, _blocks: Optional[Sequence[str]] = None):
        modules = dict(model.named_modules())
        if _blocks is None:
            _blocks = [n for n, m in modules.items() if isinstance(getattr(m, "gate", None), nn.Module)
                       and isinstance(getattr(m, "experts", None), nn.Module)]
        if not _blocks:
            raise ValueError(f"RoutingReplay: {type(model).__name__} has no MoE block (a module with a gate router "
                             f"and experts)")
        self.names = list(_blocks)
        self.routers = [_router(modules, n) for n in self.names]
        tops = {int(getattr(r, "top_k", 0)) for r in self.routers}
        experts = {int(getattr(r, "num_experts", 0)) for r in self.routers}
        if len(tops) != 1 or len(experts) != 1:
            raise ValueError(f"RoutingReplay: the MoE layers differ in top_k {sorted(tops)} or experts "
                             f"{sorted(experts)}")
        self.top_k, self.num_experts = tops.pop(), experts.pop()
        self.num_layers = len(self.routers)
        self._replay: Optional[torch.Tensor] = None
        self._recording: Optional[Recording] = None
        self._hooks = [r.register_forward_hook(self._router_hook(l)) for l, r in enumerate(self.routers)]

    # -- routing ------------------------------------------------------------------------------------------------

    def _router_hook(self, layer: int) -> Any:
        def hook(router: nn.Module, args: Any, output: Any) -> Any:
            if self._recording is not None:
                self._recording._add(layer, output[2])
            if self._replay is None:
                return output
            logits, weights, _ = output
            ids = self._replay[:, layer]
            if ids.shape[0] != logits.shape[0]:
                raise ValueError(f"RoutingReplay.replay: the replayed ids have {ids.shape[0]} tokens, MoE layer "
                                 f"{layer} ({self.names[layer]}) routes {logits.shape[0]} (replay the ids recorded "
                                 f"for this micro-batch)")
            ids = ids.to(logits.device)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            w = probs.gather(1, ids)
            if getattr(router, "norm_topk_prob", True):  # Mixtral always normalises
                w = w / w.sum(dim=-1, keepdim=True)
            return logits, w.to(weights.dtype), ids

        return hook

    @contextlib.contextmanager
    def record(self) -> Iterator[Recording]:
        """Records every MoE router's top-k ids during the block (the rollout): yields a :class:`Recording`."""
        if self._recording is not None:
            raise RuntimeError("RoutingReplay.record: already recording")
        rec = Recording(self.num_layers)
        self._recording = rec
        try:
            yield rec
        finally:
            self._recording = None

    def checked_ids(self, ids: Any, who: str) -> torch.Tensor:
        """``ids`` as int64 ``[T, L, K]``, or ``ValueError`` naming what is wrong."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 3:
            raise ValueError(f"{who}: ids must be a [tokens, {self.num_layers}, {self.top_k}] tensor "
                             f"(Recording.ids(m)), got {getattr(ids, 'shape', type(ids).__name__)}")
        if tuple(ids.shape[1:]) != (self.num_layers, self.top_k):
            raise ValueError(f"{who}: ids are {list(ids.shape)}, the model has {self.num_layers} MoE "
                             f"layers of top-{self.top_k}: expected [tokens, {self.num_layers}, {self.top_k}]")
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"{who}: ids must hold integer expert ids, got dtype {ids.dtype}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_experts):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise ValueError(f"{who}: expert id {bad} outside [0, {self.num_experts})")
        return ids.to(torch.int64)

    @contextlib.contextmanager
    def replay(self, ids: torch.Tensor) -> Iterator[None]:
        """Every router replays ``ids`` (``[T, L, K]``: :meth:`Recording.ids` of the micro-batch) during the block."""
        if self._replay is not None:
            raise RuntimeError("RoutingReplay.replay: already replaying (they do not nest)")
        self._replay = self.checked_ids(ids, "RoutingReplay.replay")
        try:
            yield
        finally:
            self._replay = None

    def detach(self) -> None:
        """Removes the router hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


class ForeMoE:
    """Attaches ForeMoE to a transformers model loaded with ``ep_implementation="foremoe"`` (every rank, once,
    after ``from_pretrained`` and before the optimizer is created: the expert parameters are replaced).

    Args:
        model: the model (Qwen3-MoE, Mixtral or OLMoE family).
        spare_slots: replica rows per rank and MoE layer beyond the ``E / N`` owned experts (the plans' slots
            per rank are ``E / N + spare_slots``, at most ``E``).
        timeout: seconds every collective of a layer call may take.
        double_buffer: :class:`foremoe.torch.ExpertStorage`'s.
        hold_replica_gradients: hold a resident replica's weight gradient until its slot is reused or the update
            stage's last backward (see the module docstring); ``False``: return it in every backward.

    Attributes: ``layers`` (the :class:`ForeMoEEP` of every MoE layer, model order: ``ReplayDriver.prefetch(m,
    moe.layers)`` posts micro-step ``m``'s replica moves ahead), ``storages`` (their
    :class:`~foremoe.torch.ExpertStorage`), ``owners``
    (``[E]`` owner rank of every expert: the plans must keep it), ``slots``, ``num_layers``, ``num_experts``,
    ``top_k``, ``current_plan`` (the plan of the active :meth:`micro_step`, else ``None``), ``gradients`` (the
    layer calls' ``balanced_moe`` mode: ``"reduce"``, ``"hold"`` or ``"flush"``), ``hold_replica_gradients``.
    """

    def __init__(self, model: nn.Module, spare_slots: int, *, timeout: float = DEFAULT_TIMEOUT,
                 double_buffer: bool = False, hold_replica_gradients: bool = True):
        check_transformers_version()
        if not isinstance(hold_replica_gradients, bool):
            raise ValueError(f"ForeMoE: hold_replica_gradients must be True or False, got {hold_replica_gradients!r}")
        self.hold_replica_gradients = hold_replica_gradients
        spare_slots = integer(spare_slots, "ForeMoE: spare_slots")
        if spare_slots < 0:
            raise ValueError(f"ForeMoE: spare_slots must be >= 0, got {spare_slots}")
        self.timeout = float(timeout)
        cfg = getattr(getattr(model, "config", None), "distributed_config", None)
        if cfg is not None:
            reason = _fsdp_error(cfg)
            if reason is not None:
                raise ValueError(f"ForeMoE: {reason}")
            if int(getattr(cfg, "pp_size", 1) or 1) != 1:
                raise ValueError(f"ForeMoE: pp_size={cfg.pp_size} is not supported: ep_implementation='foremoe' runs "
                                 f"with DistributedConfig(tp_size=N, ep_size=N) only")
        modules = dict(model.named_modules())
        found = [(n, m) for n, m in modules.items() if getattr(m, "_foremoe_ep", None) is not None]
        if not found:
            impl = getattr(cfg, "ep_implementation", None)
            raise ValueError(f"ForeMoE: no MoE layer of {type(model).__name__} runs ep_implementation='foremoe' (the "
                             f"model's ep_implementation is {impl!r}): load it with DistributedConfig(tp_size=N, "
                             f"ep_size=N, ep_implementation='foremoe') after importing foremoe.transformers")
        self.layers: List[ForeMoEEP] = []
        self.storages: List[ft.ExpertStorage] = []
        self.expert_fns: List[Any] = []
        self.names: List[str] = []
        shapes = set()
        for layer, (name, experts) in enumerate(found):
            ep: ForeMoEEP = experts._foremoe_ep
            if ep.attachment is not None:
                raise ValueError(f"ForeMoE: {name} already has a ForeMoE attachment (attach once per model)")
            router = _router(modules, name.rpartition(".")[0])
            weights = self._local_weights(experts, name)
            G, r = group_size(ep.group), group_rank(ep.group)
            E = int(weights["gate_up_proj"].shape[0]) * G
            owners = ft.contiguous_owners(E, G)  # transformers' Shard(0): rank g owns [g E / G, (g + 1) E / G)
            slots = E // G + spare_slots
            if slots > E:
                raise ValueError(f"ForeMoE: spare_slots {spare_slots} gives {slots} slots per rank, more than the "
                                 f"{E} experts of {name} (at most {E - E // G} spare slots)")
            st = ft.ExpertStorage(weights, owners, slots, rank=r, world=G, group=ep.group, timeout=self.timeout,
                                  double_buffer=double_buffer)
            for n in st.names:  # the owner rows become the module's parameters (the optimizer's)
                st.params[n].requires_grad_(experts._parameters[n].requires_grad)
                experts._parameters[n] = st.params[n]
            experts.num_experts = E // G
            ep.storage, ep.layer, ep.attachment = st, layer, self
            shapes.add((E, G, slots, int(getattr(router, "top_k", 0))))
            self.layers.append(ep)
            self.storages.append(st)
            self.expert_fns.append(expert_forward(experts.act_fn))
            self.names.append(name)
        if len(shapes) != 1:
            raise ValueError(f"ForeMoE: the MoE layers differ in (experts, ranks, slots, top_k): {sorted(shapes)}")
        self.num_experts, self.world, self.slots, self.top_k = shapes.pop()
        self.owners = self.storages[0].owners
        self.num_layers = len(self.layers)
        self.current_plan: Optional[foremoe.Plan] = None
        self.gradients = "reduce"  # outside a micro-step: every replica gradient (and any still held) returns
        self._active = False
        self.routing = RoutingReplay(model, _blocks=[n.rpartition(".")[0] for n in self.names])
        guard_optimizer_steps(self)

    # -- set-up -------------------------------------------------------------------------------------------------

    @staticmethod
    def _local_weights(experts: nn.Module, name: str) -> Dict[str, torch.Tensor]:
        params = dict(experts.named_parameters(recurse=False))
        if set(params) != {"gate_up_proj", "down_proj"} or getattr(experts, "is_transposed", False):
            raise ValueError(f"ForeMoE: experts {name!r} ({type(experts).__name__}) have parameters {sorted(params)}"
                             f"{' (transposed)' if getattr(experts, 'is_transposed', False) else ''}; supported is "
                             f"the fused layout gate_up_proj [E, 2I, H], down_proj [E, H, I] without bias")
        from torch.distributed.fsdp import FSDPModule
        if isinstance(experts, FSDPModule) or hasattr(experts, "_get_fsdp_state"):
            raise ValueError(f"ForeMoE: experts {name!r} are managed by FSDP2 ({type(experts).__name__}): FSDP2 "
                             f"re-gathers their parameters into buffers of its own, so they cannot be the owner rows "
                             f"of an ExpertStorage (FSDP2 over the experts is not supported)")
        out = {}
        for n in ("gate_up_proj", "down_proj"):
            p = params[n]
            local = p.to_local() if isinstance(p, DTensor) else p
            if local.is_meta:
                raise ValueError(f"ForeMoE: {name}.{n} is on the meta device (attach after the weights are loaded)")
            out[n] = local.detach()
        gu, dn = out["gate_up_proj"], out["down_proj"]
        if gu.dim() != 3 or dn.dim() != 3 or gu.shape[1] != 2 * dn.shape[2] or gu.shape[2] != dn.shape[1]:
            raise ValueError(f"ForeMoE: experts {name!r} have gate_up_proj {list(gu.shape)} and down_proj "
                             f"{list(dn.shape)}; expected [E, 2I, H] and [E, H, I]")
        return out

    # -- micro-steps ----------------------------------------------------------------------------------------------

    def record(self) -> Any:
        """:meth:`RoutingReplay.record` of this model's routers (the rollout)."""
        return self.routing.record()

    @contextlib.contextmanager
    def micro_step(self, plan: Optional["foremoe.Plan"], ids: Optional[torch.Tensor] = None, *,
                   last: Optional[bool] = None) -> Iterator[None]:
        """Runs the block as one micro-step: every MoE layer under ``plan`` (a :class:`foremoe.Plan` with one layer
        per MoE layer, e.g. ``ReplayDriver.plan(m)``; ``None``: plain expert parallelism) and, with ``ids``
        (``[T, L, K]``, :meth:`Recording.ids`), every router replaying them (:meth:`RoutingReplay.replay`). Run the
        micro-step's forward *and* backward inside it (activation recomputation reruns the layers). A plan whose
        loads are not those of the replayed ids (another micro-step's, another layer's) fails every rank with a
        ``ValueError`` at the first MoE layer.

        ``last`` (with ``hold_replica_gradients``): whether this is the last micro-step before the optimizer step,
        whose backward returns every held replica gradient. ``None`` (default): it is when ``plan`` is the last
        micro-step's plan of an update-stage :class:`~foremoe.torch.ReplayDriver` (every micro-step of a
        recompute-stage driver returns them too); a plan that no driver handed out holds, and the optimizer step
        is refused until a ``last=True`` micro-step has run. The same on every rank."""
        if self._active:
            raise RuntimeError("ForeMoE.micro_step: a micro-step is already active (they do not nest)")
        if last is not None and not isinstance(last, bool):
            raise ValueError(f"ForeMoE.micro_step: last must be True, False or None, got {last!r}")
        if plan is not None:
            if not isinstance(plan, foremoe.Plan):
                raise ValueError(f"ForeMoE.micro_step: plan must be a foremoe.Plan or None, got "
                                 f"{type(plan).__name__}")
            if plan.num_layers != self.num_layers:
                raise ValueError(f"ForeMoE.micro_step: the plan has {plan.num_layers} layers, the model "
                                 f"{self.num_layers} MoE layers (plan every MoE layer of the micro-step)")
            if plan.num_experts != self.num_experts or plan.num_gpus != self.world or plan.slots != self.slots:
                raise ValueError(f"ForeMoE.micro_step: the plan is for {plan.num_experts} experts on {plan.num_gpus} "
                                 f"ranks x {plan.slots} slots, the model has {self.num_experts} experts on "
                                 f"{self.world} ranks x {self.slots} slots")
        if last is None:
            where = driver_position(plan)
            last = where is not None and (where[0] != "update" or where[1])
        with self.routing.replay(ids) if ids is not None else contextlib.nullcontext():
            self._active, self.current_plan = True, plan
            self.gradients = gradients_mode(self.hold_replica_gradients, last)
            try:
                yield
            finally:
                self._active, self.current_plan, self.gradients = False, None, "reduce"

    # -- held replica gradients -----------------------------------------------------------------------------------

    def held_gradients(self) -> List[Any]:
        """``(layer, holder rank, expert)`` of the replica gradients held now (empty after the last micro-step's
        backward, and always with ``hold_replica_gradients=False``)."""
        return held_gradients(self.storages)

    def guarded_parameters(self) -> List[torch.Tensor]:
        """The expert parameters an optimizer step must not touch while replica gradients are held."""
        return [p for st in self.storages for p in st.params.values()]

    def held_error(self, held: Sequence[Any]) -> str:
        return (f"foremoe.transformers: optimizer step while {len(held)} replica gradient(s) are still held "
                f"({describe(held)}): their owners' gradients are incomplete. Run the update stage's last "
                f"micro-step (the last plan of its ReplayDriver) before the optimizer step, mark the last one with "
                f"moe.micro_step(plan, ids, last=True), or attach with ForeMoE(..., hold_replica_gradients=False)")

    # -- planning -------------------------------------------------------------------------------------------------

    def topology(self, nodes: int = 1) -> "foremoe.Topology":
        """The :class:`foremoe.Topology` of the expert group (``nodes`` x ``N / nodes`` ranks x :attr:`slots`)."""
        nodes = integer(nodes, "ForeMoE.topology: nodes")
        if nodes <= 0 or self.world % nodes:
            raise ValueError(f"ForeMoE.topology: {self.world} ranks do not split over {nodes} nodes")
        return foremoe.Topology(nodes, self.world // nodes, self.slots)

    def replay_driver(self, planner: "foremoe.Planner", ids: Any, microbatch_offsets: Any,
                      **driver: Any) -> ft.ReplayDriver:
        """A :class:`foremoe.torch.ReplayDriver` over the recorded ``[T, L, K]`` ids of a stage cut at the
        ``[M + 1]`` token ``microbatch_offsets`` (:meth:`Recording.ids` ``()`` and :meth:`Recording.offsets`), with
        this model's owners and layer count. The ranks of the expert group hold the same batch, so the ids are the
        stage's totals (no ``group``). ``driver``: the constructor's keywords (``resident``, ``stage``, ...)."""
        return ft.ReplayDriver.from_ids(planner, ids, microbatch_offsets, num_experts=self.num_experts,
                                        owners=self.owners, num_layers=self.num_layers, **driver)

    def pack(self, ids: Any, lengths: Any, *, micro_steps: int, token_budget: int, ranks: int = 1,
             start: Any = None) -> ft.StepPacking:
        """The routing-aware packing of one optimizer step's sequences, before the stage runs
        (:func:`foremoe.torch.pack_from_ids` under this model's owners): ``ids`` the recorded ``[T, L, K]`` routing of
        the sequences laid end to end (:meth:`Recording.ids` ``()``), ``lengths`` ``[S]`` their tokens. The trainer
        runs :meth:`StepPacking.micro_batches`, keeps the loss normalised over the mini-batch and the same
        micro-batches in recompute and update (see :class:`foremoe.torch.StepPacking`)."""
        return ft.pack_from_ids(ids, lengths, num_experts=self.num_experts, micro_steps=micro_steps,
                                token_budget=token_budget, ranks=ranks, gpu_of=self.owners, start=start)

    def tokens_per_rank(self, ids: torch.Tensor, plan: Optional["foremoe.Plan"] = None) -> np.ndarray:
        """``[L, N]`` (token, expert) pairs each rank computes in each MoE layer for ``[T, L, K]`` ids: on the
        owners (``plan=None``) or as ``plan`` places them."""
        ids = self.routing.checked_ids(ids, "ForeMoE.tokens_per_rank")
        out = np.zeros((self.num_layers, self.world), dtype=np.int64)
        for l in range(self.num_layers):
            if plan is None:
                loads = np.bincount(ids[:, l].reshape(-1).numpy(), minlength=self.num_experts)
                out[l] = np.bincount(self.owners, weights=loads, minlength=self.world).astype(np.int64)
            else:
                out[l] = np.asarray(plan.slot_tokens[l]).sum(axis=1)
        return out

    def replica_tokens(self, plan: "foremoe.Plan") -> int:
        """(token, expert) pairs ``plan`` gives to replicas (slots of a rank that does not own the expert)."""
        n = 0
        for l in range(plan.num_layers):
            taken, place = np.asarray(plan.slot_tokens[l]), np.asarray(plan.gpu_slots[l])
            for g in range(place.shape[0]):
                for j in range(place.shape[1]):
                    if place[g, j] >= 0 and self.owners[place[g, j]] != g:
                        n += int(taken[g, j])
        return n

    def detach(self) -> None:
        """Removes the router hooks (the expert storage stays the parameters)."""
        self.routing.detach()
