"""TEST / CPU ONLY: the patches that let megatron-core 0.16.1 run its MoE layer on a CPU over gloo, and a tiny
MoE model built from Megatron's own modules. Never part of foremoe.megatron (which runs Megatron unpatched on a GPU).

Patches (each applied once per process, by :func:`apply_cpu_patches`):

- ``MoEAlltoAllTokenDispatcher.__init__`` creates a ``torch.cuda.Stream()`` for its device-to-host copies, and
  ``_maybe_dtoh_and_synchronize`` uses CUDA streams: the class stream is set to a placeholder and the method is
  replaced by a CPU one that turns the split sizes into lists (``all_to_all_single`` on gloo takes lists of ints,
  not the tensors Megatron leaves there on a CPU);
- router gating and Megatron's ``all_to_all`` allocate on ``torch.cuda.current_device()``: it returns ``"cpu"``;
- ``moe_utils.te_general_gemm`` is undefined without Transformer Engine (fixed upstream after 0.16.1): ``None``;
- activation recompute saves and restores the CUDA RNG state: the CPU generator's state stands in;
- ``GroupedMLP`` (``moe_grouped_gemm=True`` without Transformer Engine) calls ``grouped_gemm.ops.gmm``, a CUDA
  kernel: :func:`cpu_gmm` stands in (one matmul per group, the same arithmetic), and its activation is built with
  ``megatron.core.jit.jit_fuser`` (``torch.compile`` on torch >= 2.2, which would compile C++ here on first use):
  the plain function is used instead. Its forward asserts ``config.bf16`` (experts.py:225 of 0.16.1), which
  :func:`make_config` sets for a grouped model (only that assertion reads it in these layers).
- GroupedMLP's activation recompute (``recompute_modules`` with ``"moe_act"``) uses ``CheckpointWithoutOutput``, whose
  ``__init__`` sets ``self.fp8 = fp8 is not None`` (random.py:636 of 0.16.1: true for the default ``fp8=False``) and
  then needs Transformer Engine's ``FP8GlobalStateManager``: ``fp8`` is what the caller passed (``False``).
- Megatron's optimizers (``get_megatron_optimizer``: ``Float16OptimizerWithFloat16Params``, ``FP32Optimizer``,
  ``DistributedOptimizer``, their grad scaler and gradient clipping) allocate their flags and scales with
  ``device='cuda'`` and sort the parameters by ``param.type()`` against ``'torch.cuda.FloatTensor'`` /
  ``'torch.cuda.HalfTensor'`` / ``'torch.cuda.BFloat16Tensor'`` (optimizer.py:473-485, 671-700, 907;
  distrib_optimizer.py:361-435, 582; the grad norm's ``local_multi_tensor_l2_norm``, utils.py:1207 of 0.16.1): in
  those modules ``torch`` is a stand-in whose factories put a
  ``'cuda'`` device on the CPU, and while their methods run a CPU tensor's ``type()`` names the CUDA type.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

_PATCHED = False


def apply_cpu_patches() -> None:
    global _PATCHED
    if _PATCHED:
        return
    _PATCHED = True
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: None  # type: ignore[assignment]
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    cls = token_dispatcher.MoEAlltoAllTokenDispatcher
    cls.cuda_dtoh_stream = object()  # never used on the CPU path below

    def cpu_dtoh(self: Any, point: str, tokens_per_expert: Optional[torch.Tensor] = None) -> Any:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            v = getattr(self, name, None)
            if isinstance(v, torch.Tensor):
                setattr(self, name, v.tolist())
        return tokens_per_expert

    cls._maybe_dtoh_and_synchronize = cpu_dtoh
    from megatron.core.tensor_parallel import random as mrandom

    from megatron.core.transformer.moe import experts, grouped_gemm_util

    experts.jit_fuser = lambda fn: fn
    grouped_gemm_util.grouped_gemm = SimpleNamespace(ops=SimpleNamespace(gmm=cpu_gmm))
    grouped_gemm_util.ops = grouped_gemm_util.grouped_gemm.ops
    plain_init = mrandom.CheckpointWithoutOutput.__init__

    def checkpoint_init(self: Any, fp8: bool = False) -> None:
        plain_init(self, fp8)
        self.fp8 = bool(fp8)

    mrandom.CheckpointWithoutOutput.__init__ = checkpoint_init
    mrandom._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: torch.set_rng_state(state)
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    _patch_optimizers()


class _TorchOnCpu(ModuleType):
    """``torch`` for Megatron's optimizer modules: tensor factories given ``device='cuda'`` (or a CUDA device) make
    CPU tensors; everything else is torch's own."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in ("tensor", "zeros", "ones", "empty", "full", "zeros_like", "ones_like", "empty_like"):
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _cpu_factory(fn: Any) -> Any:
    def make(*args: Any, **kwargs: Any) -> Any:
        dev = kwargs.get("device")
        if dev is not None and str(dev).startswith("cuda"):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return make


_PLAIN_TYPE = torch.Tensor.type
_CUDA_TYPES = 0  # nesting depth of Megatron optimizer methods running (their type() checks see CUDA types)


def _type_as_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    out = _PLAIN_TYPE(self, *args, **kwargs)
    if _CUDA_TYPES and not args and not kwargs and isinstance(out, str) and out.startswith("torch.") \
            and not out.startswith("torch.cuda."):
        return "torch.cuda." + out[len("torch."):]
    return out


def _with_cuda_types(fn: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        global _CUDA_TYPES
        _CUDA_TYPES += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _CUDA_TYPES -= 1

    run.__wrapped__ = fn  # type: ignore[attr-defined]
    return run


def _patch_optimizers() -> None:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer, grad_scaler, optimizer

    shim = _TorchOnCpu()
    for mod in (clip_grads, distrib_optimizer, grad_scaler, optimizer, utils):
        mod.torch = shim
    torch.Tensor.type = _type_as_cuda  # type: ignore[method-assign]
    for cls in (optimizer.MixedPrecisionOptimizer, optimizer.Float16OptimizerWithFloat16Params,
                optimizer.FP32Optimizer, distrib_optimizer.DistributedOptimizer):
        for name, fn in list(vars(cls).items()):
            if callable(fn) and not isinstance(fn, (staticmethod, classmethod, type)):
                setattr(cls, name, _with_cuda_types(fn))
            elif isinstance(fn, staticmethod):
                setattr(cls, name, staticmethod(_with_cuda_types(fn.__func__)))
            elif isinstance(fn, classmethod):
                setattr(cls, name, classmethod(_with_cuda_types(fn.__func__)))


def cpu_gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_a: bool = False,
            trans_b: bool = False) -> torch.Tensor:
    """TEST / CPU ONLY: ``grouped_gemm.ops.gmm`` (fanshiqing/grouped_gemm, the call GroupedMLP makes): group ``i``'s
    ``batch_sizes[i]`` consecutive rows of ``a`` ``[sum, K]`` times ``b[i]`` ``[K, N]`` (``b[i].T`` with
    ``trans_b``), concatenated; autograd gives the backward. ``batch_sizes`` must be a CPU int64 tensor with one
    entry per group, as the kernel requires."""
    if trans_a:
        raise NotImplementedError("cpu_gmm: trans_a (only the backward kernel uses it; autograd replaces it here)")
    if batch_sizes.device.type != "cpu" or batch_sizes.dtype != torch.int64 or batch_sizes.numel() != b.shape[0]:
        raise ValueError(f"cpu_gmm: batch_sizes must be a CPU int64 tensor of {b.shape[0]} groups, got "
                         f"{batch_sizes.dtype} {list(batch_sizes.shape)} on {batch_sizes.device}")
    sizes = batch_sizes.tolist()
    if sum(sizes) != a.shape[0]:
        raise ValueError(f"cpu_gmm: batch_sizes sum to {sum(sizes)}, a has {a.shape[0]} rows")
    outs = [x @ (w.t() if trans_b else w) for x, w in zip(a.split(sizes), b.unbind(0))]
    return torch.cat(outs) if outs else a.new_zeros((0, b.shape[1] if trans_b else b.shape[2]))


def init_megatron(ep: int, seed: int = 1234) -> None:
    """Megatron's model-parallel state over the initialised (gloo) default group: expert parallelism ``ep``."""
    apply_cpu_patches()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)


def make_config(*, layers: int, hidden: int, ffn: int, experts: int, topk: int, ep: int, dtype: torch.dtype,
                dispatcher: str = "alltoall", recompute: bool = False, grouped: bool = False) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = dict(recompute_granularity="selective", recompute_modules=["moe"]) if recompute else {}
    return TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=1, ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn,
        num_moe_experts=experts, moe_router_topk=topk, expert_model_parallel_size=ep,
        moe_token_dispatcher_type=dispatcher, moe_enable_routing_replay=True, moe_grouped_gemm=grouped,
        bf16=grouped or dtype == torch.bfloat16,  # GroupedMLP.forward asserts it; the weights stay params_dtype
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, use_cpu_initialization=True,
        gradient_accumulation_fusion=False, moe_permute_fusion=False, bias_activation_fusion=False,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, params_dtype=dtype,
        pipeline_dtype=dtype, init_method_std=0.3, **extra)


class TinyMoE(nn.Module):
    """``layers`` Megatron ``MoELayer`` blocks (local spec: SequentialMLP experts, or GroupedMLP with
    ``config.moe_grouped_gemm``; TopKRouter) with residuals and a tanh in between, on ``[tokens, 1, hidden]``
    inputs."""

    def __init__(self, config: Any):
        super().__init__()
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.transformer.spec_utils import build_module

        spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts,
                                   moe_grouped_gemm=bool(config.moe_grouped_gemm))
        self.layers = nn.ModuleList([build_module(spec, config=config, layer_number=i + 1)
                                     for i in range(config.num_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.unsqueeze(1)
        for layer in self.layers:
            out, _ = layer(torch.tanh(h))
            h = h + out
        return h.squeeze(1)

    def routers(self) -> List[Any]:
        return [layer.router.router_replay for layer in self.layers]


def set_action(model: TinyMoE, action: Any) -> None:
    for r in model.routers():
        r.set_router_replay_action(action)


def set_targets(model: TinyMoE, per_layer: List[torch.Tensor]) -> None:
    for r, idx in zip(model.routers(), per_layer):
        r.clear_indices()
        r.set_target_indices(idx)
