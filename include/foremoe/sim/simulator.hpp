#pragma once
/// @file
/// Replays RL steps on a modelled cluster: recompute (forward-only) and policy
/// update (forward + backward) micro-steps, layer by layer, with the expert
/// placement and token split of a planning strategy, weight moves in the
/// windows where their slots are free, and replica gradient reductions.
///
/// Per layer and micro-step: attention and dense parts (balanced), dispatch,
/// expert compute (a barrier: the slowest GPU ends the layer), combine; the
/// backward pass runs the layers in reverse with `backward_factor` x compute
/// and the two all-to-alls again. A new replica of layer `l` for micro-step
/// `m` may be written once its slot's last use in micro-step `m - 1` is over
/// (end of that layer's backward, or forward in recompute) and must land before
/// layer `l`'s forward in `m`; with double buffering it may start one micro-step
/// earlier. A GPU's moves and gradient returns of all layers queue on one link (earliest deadline first,
/// `edf_max_lateness`), sharing it fairly with the all-to-all (`shared_link_seconds`); the largest lateness
/// is stall time. In the update stage
/// a replica accumulates its gradient in place while it stays resident and returns it to its owner on the
/// GPU-direct path in the window before its slot is reused, or after the stage's last backward (so a replica
/// resident for the whole step, as EPLB's are, returns its gradient once per step).
///
/// Strategies come from `Planner` (`static`, `eplb`, `eplb-split`, `eplb-oracle`, the baselines `ultraep` and
/// `moonep`, `foremoe`, `foremoe-free`, and the simulator-only reference `ideal`: every layer's tokens cut into
/// equal pieces per GPU, any number of experts per GPU), every one simulated by the same code from its plans. One
/// trait, `PlanStrategy::physical_limit` (`ideal`), keeps the limit a lower bound: no transfer of its is charged,
/// a GPU's expert compute and all-to-all are timed from its tokens alone (spread over `ceil(E / G)` experts and,
/// for the hits, over all `E`) rather than from its pieces, and a GPU's memory holds `ceil(E / G)` owners only.
///
/// Steady state: the first `warmup_steps` RL steps are planned and timed like the others (every strategy
/// builds its history and residents on them) but left out of every reported figure. `eplb` rebalances every
/// `planner.eplb_interval` steps from the loads accumulated since its last rebalance; the strategy keeps that
/// window, the simulator hands it each finished step's totals (`PlanStrategy::begin_step`).
///
/// EP groups: the cluster is `num_gpus / ep_size` data-parallel copies of one EP group of `ep_size` GPUs
/// (`default_ep_size` unless set); each copy holds every expert, routes only its own tokens and is planned and
/// timed alone; an RL step takes as long as its slowest copy (the copies meet at the optimizer step). A copy's
/// tokens are those of its ranks when the loads carry per-source counts (`[m][l][e][src]`, sources being
/// consecutive blocks of ranks); without them every expert's count is split evenly across the copies.

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/load_tensor.hpp"
#include "foremoe/core/model_spec.hpp"
#include "foremoe/core/thread_pool.hpp"
#include "foremoe/core/topology.hpp"
#include "foremoe/cost/comm.hpp"
#include "foremoe/cost/expert_compute.hpp"
#include "foremoe/cost/params.hpp"
#include "foremoe/plan/ep_groups.hpp"
#include "foremoe/plan/evaluate.hpp"
#include "foremoe/plan/planner.hpp"
#include "foremoe/plan/split.hpp"
#include "foremoe/plan/token_map.hpp"
#include "foremoe/plan/traffic.hpp"
#include "foremoe/trace/routed_view.hpp"

namespace foremoe {
inline namespace v0 {

/// The non-routed part of one MoE layer, for timing attention and the dense parts from the model shape.
/// Defaults: Qwen3-30B-A3B (its public config: 32 query heads, 4 KV heads, head dim 128, hidden 2048, no shared
/// expert): QKV 2048 x (32 + 2 x 4) x 128 + O 4096 x 2048 + router 2048 x 128 = 19,136,512 parameters.
struct DenseShape {
  double params = 19136512.0;  ///< non-routed parameters per MoE layer: attention projections, shared experts, router
  double attention_dim = 4096; ///< width of QK^T and PV per token: query heads x head dim (their mean under MLA)
  double context = 0; ///< mean attended context per token (`simulate` front ends: half the batch's mean sequence)
  /// Vocabulary of the LM head (and the input embedding), for its GEMM and the optimizer's parameter count:
  /// Qwen3-30B-A3B's `vocab_size` 151,936 (its public config.json; `tie_word_embeddings` false, so the embedding
  /// is a second V x H matrix). 0: no LM head.
  double vocab = 151936.0;

  /// DeepSeek-V3 (its public config: MLA with q_lora_rank 1536, kv_lora_rank 512, 128 heads, qk 128 + 64 rope,
  /// v 128; one shared expert of 3 x 7168 x 2048; router 7168 x 256): 232,980,480 parameters; QK^T is 128 x 192
  /// wide and PV 128 x 128, mean 20,480.
  /// Vocabulary 129,280 (its config.json `vocab_size`; embedding and head untied).
  [[nodiscard]] static DenseShape deepseek_v3() { return {232980480.0, 20480.0, 0.0, 129280.0}; }
  /// Kimi K2 (moonshotai/Kimi-K2-Instruct config.json: DeepSeek-V3's MLA with 64 heads instead of 128, q_lora_rank
  /// 1536, kv_lora_rank 512, qk 128 + 64 rope, v 128; one shared expert of 3 x 7168 x 2048; router 7168 x 384):
  /// 147,914,752 parameters; QK^T 64 x 192 and PV 64 x 128 wide, mean 10,240; `vocab_size` 163,840.
  [[nodiscard]] static DenseShape kimi_k2() { return {147914752.0, 10240.0, 0.0, 163840.0}; }
};

/// Per-GPU bytes of the non-routed parameters (`SimConfig::dense_memory`).
struct DenseMemory {
  double weights = 0, grads = 0, optimizer = 0;
  [[nodiscard]] double total() const noexcept { return weights + grads + optimizer; }
};

/// Where the hierarchical all-to-all's hits come from (`SimConfig::a2a_hits`).
enum class A2aHitsSource : std::uint8_t {
  /// Estimated from each slot's rows, a token picking experts independently (`a2a_hits_from_slots`).
  independent,
  /// Counted from every token's routed ids (`simulate`'s `routes`): each token's experts mapped to copies as the
  /// runtime dispatches them (`split_by_source`, then the positional map by source) and its distinct nodes and
  /// GPUs counted (`a2a_volumes_from_routes`).
  ids,
};

inline constexpr std::string_view a2a_hits_source_names[] = {"independent", "ids"};

[[nodiscard]] inline std::string_view to_string(A2aHitsSource s) noexcept {
  return a2a_hits_source_names[static_cast<std::size_t>(s)];
}

/// The source named `name`; throws `Error` "`who` must be one of independent, ids, got 'name'".
[[nodiscard]] inline A2aHitsSource parse_a2a_hits_source(std::string_view name, std::string_view who) {
  return detail::enum_from_name<A2aHitsSource>(a2a_hits_source_names, name, who);
}

/// What is simulated besides the loads.
struct SimConfig {
  ModelSpec model{};
  Topology topo{8, 8, 3};
  CostParams cost{};
  int recompute_passes = 1;       ///< forward-only passes over the batch (old policy, reference model, ...)
  int minibatches_per_step = 1;   ///< optimizer steps per RL step (the update micro-steps split evenly)
  double optimizer_seconds = 0.0; ///< fixed time of one optimizer step, added to the traffic model's (below)
  double rollout_seconds = 0.0;   ///< rollout time, only for the end-to-end figure (0: from `rollout_share`)
  /// Without `rollout_seconds`, the rollout's share of an RL step run unbalanced: rollout seconds =
  /// `share / (1 - share)` x the static strategy's training step (the slowest strategy's when static is not
  /// simulated), the same for every strategy. Default 0.7: "the rollout stage, which accounts for approximately
  /// 70% of total training time" in synchronous veRL RL post-training of Qwen2.5 models on H800 (Gao et al. 2025,
  /// RollPacker, arXiv:2509.21009, sec. 1); APRIL (Zhou et al. 2025, arXiv:2509.18521) reports more than 90% for
  /// long reasoning rollouts. 0: training only.
  double rollout_share = 0.7;
  bool double_buffer = false; ///< a second buffer per replica slot: moves may start a micro-step early
  int activation_bytes = 2;   ///< bytes per hidden element in the combine and the backward exchanges (bf16)
  /// Dtype of the forward dispatch's token rows: bf16 (`activation_bytes` per element, as the combine) or fp8 (1 B
  /// per element plus one fp32 scale per 128 elements: DeepEP's normal and low-latency kernels dispatch fp8 and
  /// combine bf16, deepseek-ai/DeepEP README; DeepSeek-V3 trains with fp8 dispatch, arXiv:2412.19437 sec. 3.3.2).
  /// The backward pass's exchanges carry bf16 gradients either way.
  WeightDtype dispatch_dtype = WeightDtype::bf16;
  /// HBM bytes the optimizer step moves per parameter a GPU holds (its owned experts, the dense parts of every
  /// layer, the embedding and LM head), timed at `cost.gemm.hbm_tb_per_s x cost.gemm.hbm_efficiency`. Default: a
  /// fused Adam step with fp32 master weights (Apex / Transformer Engine FusedAdam, as Megatron-LM runs it) reads
  /// the fp32 main gradient, master weight and both moments (16 B) and writes master and moments (12 B) and the
  /// bf16 model weight (2 B): 30 B. The state it streams is ZeRO's 2 + 2 + 12 bytes per parameter (Rajbhandari et
  /// al. 2020, sec. 3.1) with fp32 gradients. 0: only `optimizer_seconds`.
  double optimizer_traffic_bytes_per_param = 30.0;
  /// Fraction in [0, 1] of each layer's all-to-all (dispatch and combine, each pass) that may hide under the same
  /// layer's compute (attention, dense parts and expert GEMM), at most all of it: `layer = compute + a2a -
  /// min(a2a_overlap x a2a, compute)`. Real stacks hide it across micro-batches: Megatron-core's batch-level EP
  /// overlap (`overlap_moe_expert_parallel_comm`, MCore v0.14; one micro-batch's all-to-all under another's
  /// compute in 1F1B) and DeepEP's hook-based receive (communication without SMs). Default 0: both are opt-in
  /// (Megatron-core's `overlap_moe_expert_parallel_comm` defaults to False, model_parallel_config.py), and the
  /// RL trainers run Megatron's defaults unless told otherwise; 1 is the upper bound of full overlap.
  double a2a_overlap = 0.0;
  /// Hits of the hierarchical all-to-all: `independent` (default; needs only the loads) or counted from the routed
  /// ids (`ids`; `simulate` then needs them for every micro-step and one EP group over every GPU; every strategy,
  /// `ideal` included, is then timed from its plans and the ids).
  A2aHitsSource a2a_hits = A2aHitsSource::independent;
  /// Traffic-aware foremoe (`sim.traffic_*`; issue 30): with `a2a_hits` ids, `foremoe` and `foremoe-free` choose
  /// each RL step's owners with `traffic_aware_owners` from the step's co-activation (counted from its routed ids
  /// as they are routed) and their tokens are mapped by the node-affine rule (`TokenMapRule::node_affine`, as their
  /// dispatch would map them). On by default, as the issue asks where the ids are known; no effect on the estimate
  /// (`a2a_hits` independent), which has no per-token sets.
  TrafficSettings traffic = {.aware = true};
  /// Links shared both ways: the all-to-all also yields to a GPU's moves and gradient returns (it gets half the
  /// link while they run, as they get half while it runs). false: only the moves yield (the earlier model).
  bool two_way_link_sharing = true;
  /// Fraction in [0, 1] of the data-parallel expert-gradient synchronisation across EP-group copies that may
  /// overlap the last update micro-step's backward (per-layer buckets reduced as soon as that layer's backward is
  /// over, Megatron DDP's `overlap_grad_reduce`). Default 0: Megatron-core's `DistributedDataParallelConfig`
  /// defaults `overlap_grad_reduce` to False (distributed_data_parallel_config.py).
  double dp_grad_overlap = 0.0;
  /// The planner's options (`config::planner_schema()`, the `sim.` keys of the same names), one set for every
  /// simulated strategy: `strategy` is each strategy's own, `gradient_bytes_factor` follows `grad_dtype`, and the
  /// cost gate's functions come from `cost_gate`. The simulator follows two of them itself: `reowning_free`
  /// (colocated trainers reload optimizer state after rollout, so a new owner map is free; otherwise every expert
  /// whose owner changes moves its weights plus `optimizer_state_factor` x their size) and
  /// `hold_replica_gradients` (update stage: resident replicas accumulate their gradients in place and return them
  /// once, `HeldGradients`, in the simulated traffic and the planner's byte count alike; false: every used replica
  /// returns its gradient every update micro-step).
  PlannerOptions planner{};
  double optimizer_state_factor = 6.0; ///< fp32 master + Adam moments over bf16 weights
  /// The planner's cost gate: a new replica only when the expert compute it saves on the slowest GPU (this
  /// model's grouped-GEMM time, forward plus backward) exceeds its move plus, in the update
  /// stage, its gradient reduction (all counted as unhidden).
  bool cost_gate = false;
  /// RL steps at the start that are planned and simulated but not counted (EPLB's cold start, first residents).
  int warmup_steps = 1;
  int ep_size = 0;        ///< GPUs per EP group (0: `default_ep_size`); the cluster is data-parallel copies of it
  int gpu_load_layer = 0; ///< the MoE layer whose per-GPU loads `SimResult::gpu_loads` records
  /// Dtype of the expert gradients (replica gradient returns, gradient buffers). fp32 by default: mixed-precision
  /// training keeps fp32 main gradients (Megatron-LM accumulates into fp32 `main_grad`; Micikevicius et al. 2018,
  /// "Mixed Precision Training"), so gradient bytes are 2x bf16 weight bytes. Replaces `cost.grad.grad_bytes_factor`
  /// in the simulator: factor = gradient bytes / weight bytes of an expert.
  WeightDtype grad_dtype = WeightDtype::fp32;
  /// Optimizer state bytes per parameter of the owned experts: Adam's fp32 master weights and two fp32 moments,
  /// K = 12 (Rajbhandari et al. 2020, ZeRO, sec. 3.1; mixed-precision Adam is 2 + 2 + K bytes per parameter).
  double optimizer_bytes_per_param = 12.0;
  bool optimizer_offload = false; ///< optimizer state in host memory (ZeRO-Offload), not counted on the GPU
  /// Megatron's distributed optimizer (`--use-distributed-optimizer`, ZeRO stage 1: Rajbhandari et al. 2020, sec.
  /// 5.1, P_os): the optimizer state in GPU memory is sharded over the data-parallel ranks that hold the same
  /// parameters, the dense part's over its `stage_gpus() / tensor_parallel` DP ranks and the experts' over the
  /// `stage_gpus() / ep` EP-group copies (expert-DP); weights and the gradient buffer stay whole (Megatron-LM
  /// docs/source/api-guide/dist_optimizer.md: bf16 parameters with fp32 gradients take 6 + 12 / d bytes per
  /// parameter against 18). Default on: verl's Megatron engine sets `use_distributed_optimizer: True`
  /// (volcengine/verl, verl/trainer/config/engine/megatron.yaml); Megatron-LM's own default is off. Memory only:
  /// the optimizer step's time (`optimizer_step_seconds`) still counts every parameter a GPU holds.
  bool distributed_optimizer = true;
  /// Pipeline-parallel stages (PP): each GPU runs the MoE layers of one stage, split as evenly as possible (the
  /// first `L % PP` stages one layer more; the slowest stage sets the time), with the 1F1B bubble `(PP - 1) / m` of
  /// the pipeline's ideal time for `m` micro-batches (Narayanan et al. 2021, arXiv:2104.04473, sec. 2.2) and the
  /// activations sent point-to-point between stages. 1: no pipeline (`docs/simulator.md`).
  int pipeline_stages = 1;
  /// Tensor parallelism (TP) of the attention and dense part (Megatron sequence parallel: the dense weights split
  /// over TP GPUs, 2 all-gathers + 2 reduce-scatters of the activations per layer and pass); experts stay EP
  /// (expert-TP 1, Megatron-core's MoE parallel folding). 1: none.
  int tensor_parallel = 1;
  /// Memory per GPU in GB (1e9 bytes): an H200 SXM's 141 GB of HBM3e (NVIDIA H200 datasheet). A strategy whose
  /// peak (`SimMemory`) exceeds it is an error naming the parts.
  double gpu_memory_gb = 141.0;
  /// With foresight the planner plans micro-step m + 1 while m runs: only what exceeds micro-step m's time (and
  /// the first micro-step's plan) is on the critical path. false: all planning time is.
  bool planner_overlap = true;
  /// Time attention and the dense parts from `dense` (FLOPs at `dense_efficiency` of the bf16 peak, weights
  /// streamed at the GEMM fit's HBM efficiency) instead of the constant `cost.dense.per_token_us`.
  bool dense_from_shape = true;
  DenseShape dense{};
  /// Achieved fraction of the bf16 tensor peak in the dense part: cited, not fitted (no dense measurement in
  /// shared/data): Llama 3 405B pre-training ran at 38-43% BF16 MFU on H100 (Dubey et al. 2024, "The Llama 3 Herd
  /// of Models", Table 4); a whole-model figure, so a conservative one for the dense kernels.
  double dense_efficiency = 0.40;

  /// Forward seconds of one layer's attention and dense parts on a GPU processing `tokens_per_gpu` tokens.
  /// From the shape: `launch + params x 2 B / (hbm x hbm_eff) + tokens x (2 params + 4 context attention_dim) /
  /// (peak_bf16 x dense_efficiency)`; else `launch + tokens x per_token_us`.
  /// With `tensor_parallel` T > 1 a TP group of T GPUs runs the layer on its T x `tokens_per_gpu` tokens, each GPU
  /// one T-th of the FLOPs and of the weights: the per-token term is the same per GPU, the weight stream / T.
  [[nodiscard]] double dense_forward_seconds(double tokens_per_gpu) const {
    const double launch = cost.dense.launch_us * 1e-6;
    if (!dense_from_shape) return launch + cost.dense.per_token_us * 1e-6 * tokens_per_gpu;
    const double flops = 2.0 * dense.params + 4.0 * dense.context * dense.attention_dim;
    double weights = dense.params * 2.0 / (cost.gemm.hbm_tb_per_s * 1e12 * cost.gemm.hbm_efficiency);
    if (tensor_parallel > 1) weights /= tensor_parallel;
    return launch + weights + tokens_per_gpu * flops / (cost.gemm.peak_tflops_bf16 * 1e12 * dense_efficiency);
  }

  /// Seconds of one layer pass's tensor-parallel collectives on a GPU holding `tokens_per_gpu` tokens (0 without
  /// TP): Megatron's sequence parallelism runs 2 all-gathers and 2 reduce-scatters of the TP group's activations
  /// (T x tokens_per_gpu x hidden x activation_bytes) per layer and pass (Korthikanti et al. 2022, arXiv:2205.05198,
  /// sec. 4.2.2), each timed by the NCCL NVLink fit of the all-to-all (`cost.a2a`: latency + per_message (T - 1) +
  /// S (T - 1) / T / bw, fitted on shared/data/h200-nccl.csv's alltoall rows; the all-gather and reduce-scatter rows
  /// are not fitted separately: an assumption). TP stays inside a node (NVLink).
  [[nodiscard]] double tp_collectives_seconds(double tokens_per_gpu) const {
    if (tensor_parallel <= 1 || tokens_per_gpu <= 0) return 0.0;
    const double T = tensor_parallel;
    const double bytes = T * tokens_per_gpu * static_cast<double>(model.hidden) * activation_bytes;
    const double one = cost.a2a.intra_latency_us * 1e-6 + cost.a2a.per_message_us * 1e-6 * (T - 1) +
                       bytes * (T - 1) / T / (cost.a2a.intra_gb_per_s * 1e9);
    return 4.0 * one;
  }

  /// GPUs of one pipeline stage: the cluster's over `pipeline_stages`.
  [[nodiscard]] int stage_gpus() const { return topo.num_gpus() / std::max(1, pipeline_stages); }

  /// Non-routed parameters one GPU of pipeline stage `s` holds: `dense.params` (per MoE layer) for each of the
  /// stage's layers, plus the input embedding on the first stage and the LM head on the last (`dense.vocab x
  /// hidden` each; both on the one stage without a pipeline, none without a vocabulary), all divided over the
  /// `tensor_parallel` GPUs of a TP group (Megatron's column/row-parallel linears and its vocabulary-parallel
  /// embedding and output layer: Shoeybi et al. 2019, arXiv:1909.08053, sec. 3). Leading dense (non-MoE) layers
  /// are not in the model (`ModelSpec` counts MoE layers), so they are not counted.
  [[nodiscard]] double dense_params_per_gpu(int s) const {
    const int P = std::max(1, pipeline_stages);
    const double layers = stage_first_layer(s + 1) - stage_first_layer(s);
    const double vh = dense.vocab * static_cast<double>(model.hidden);
    const double embed_head = (s == 0 ? vh : 0.0) + (s == P - 1 ? vh : 0.0);
    return (layers * dense.params + embed_head) / std::max(1, tensor_parallel);
  }

  /// Bytes one GPU of pipeline stage `s` holds for its non-routed parameters (`dense_params_per_gpu`): weights in
  /// the model's weight dtype (`model.dtype`; fp8 block scales left out), gradients in `grad_dtype`, and
  /// `optimizer_bytes_per_param` of optimizer state (0 with `optimizer_offload`; over the `stage_gpus() /
  /// tensor_parallel` data-parallel ranks with `distributed_optimizer`).
  [[nodiscard]] DenseMemory dense_memory(int s) const {
    const double n = dense_params_per_gpu(s);
    const double dp = std::max(1.0, static_cast<double>(stage_gpus()) / std::max(1, tensor_parallel));
    DenseMemory m;
    m.weights = n * static_cast<double>(dtype_bytes(model.dtype));
    m.grads = n * static_cast<double>(dtype_bytes(grad_dtype));
    m.optimizer = optimizer_offload ? 0.0 : n * optimizer_bytes_per_param / (distributed_optimizer ? dp : 1.0);
    return m;
  }

  /// First layer of pipeline stage `s` (`s = pipeline_stages`: the layer count): the layers split as evenly as
  /// possible, the first `L % PP` stages holding one more.
  [[nodiscard]] int stage_first_layer(int s) const {
    const int P = std::max(1, pipeline_stages), L = model.num_layers;
    return s * (L / P) + std::min(s, L % P);
  }

  /// Seconds of one point-to-point send of a micro-batch's activations between pipeline stages, per GPU
  /// (`tokens_per_gpu x hidden x activation_bytes`): over the NIC (`cost.move.gpu_inter`) when a stage fills a node
  /// or more (neighbouring stages are on different nodes), else NVLink (`cost.move.gpu_intra`). 0 without PP.
  [[nodiscard]] double pipeline_p2p_seconds(double tokens_per_gpu) const {
    if (pipeline_stages <= 1 || tokens_per_gpu <= 0) return 0.0;
    const PathParams &link = stage_gpus() >= topo.gpus_per_node ? cost.move.gpu_inter : cost.move.gpu_intra;
    return link.latency_us * 1e-6 +
           tokens_per_gpu * static_cast<double>(model.hidden) * activation_bytes / (link.gb_per_s * 1e9);
  }

  /// Forward seconds of the LM head (a vocab x hidden GEMM per token: 2 V H FLOPs at `dense_efficiency` of the
  /// bf16 peak, its bf16 weights streamed once) on a GPU processing `tokens_per_gpu` tokens; 0 without a vocab.
  [[nodiscard]] double lm_head_forward_seconds(double tokens_per_gpu) const {
    if (dense.vocab <= 0 || tokens_per_gpu <= 0) return 0.0;
    const double vh = dense.vocab * model.hidden;
    double weights = vh * 2.0 / (cost.gemm.hbm_tb_per_s * 1e12 * cost.gemm.hbm_efficiency);
    if (tensor_parallel > 1) weights /= tensor_parallel; // vocabulary-parallel head: a T-th of the weights per GPU
    return weights + tokens_per_gpu * 2.0 * vh / (cost.gemm.peak_tflops_bf16 * 1e12 * dense_efficiency);
  }

  /// The rollout seconds of an RL step whose unbalanced training step takes `reference_step_seconds`.
  [[nodiscard]] double rollout_time(double reference_step_seconds) const {
    if (rollout_seconds > 0) return rollout_seconds;
    return rollout_share / (1.0 - rollout_share) * reference_step_seconds;
  }

  /// Seconds of one optimizer step on a GPU holding `params` parameters (`optimizer_seconds` plus their
  /// `optimizer_traffic_bytes_per_param` at the HBM bandwidth).
  [[nodiscard]] double optimizer_step_seconds(double params) const {
    return optimizer_seconds +
           params * optimizer_traffic_bytes_per_param / (cost.gemm.hbm_tb_per_s * 1e12 * cost.gemm.hbm_efficiency);
  }

  /// Seconds of one optimizer step with the state in host memory (`optimizer_offload`, ZeRO-Offload: Ren et al.
  /// 2021, arXiv:2101.06840, sec. 4): the GPU's `params` gradients go down over its PCIe link (`cost.move.host`, in
  /// `grad_dtype`), the node's CPU steps them with CPU Adam at `cost.cpu_adam_gparams_per_s` per node, shared by
  /// the node's `gpus_per_node` GPUs stepping as many each, and the updated bf16 weights come back up; the three
  /// one after another (no overlap: Megatron-core's `--overlap-cpu-optimizer-d2h-h2d` is opt-in). Plus
  /// `optimizer_seconds`.
  [[nodiscard]] double offloaded_optimizer_step_seconds(double params) const {
    const PathParams &pcie = cost.move.host;
    const double down =
        pcie.latency_us * 1e-6 + params * static_cast<double>(dtype_bytes(grad_dtype)) / (pcie.gb_per_s * 1e9);
    const double up = pcie.latency_us * 1e-6 + params * 2.0 / (pcie.gb_per_s * 1e9);
    const double cpu = params * topo.gpus_per_node / (cost.cpu_adam_gparams_per_s * 1e9);
    return optimizer_seconds + down + cpu + up;
  }

  /// Bytes of one token row in the combine and the backward exchanges: `hidden x activation_bytes`.
  [[nodiscard]] double row_bytes() const { return static_cast<double>(model.hidden) * activation_bytes; }

  /// Bytes of one token row in the forward dispatch: `row_bytes()`, or for fp8 one byte per element plus an fp32
  /// scale per 128 elements (rounded up).
  [[nodiscard]] double dispatch_row_bytes() const {
    if (dispatch_dtype != WeightDtype::fp8) return row_bytes();
    const auto h = static_cast<double>(model.hidden);
    return h + 4.0 * std::ceil(h / 128.0);
  }

  /// The EP group size in use: `ep_size`, or `default_ep_size` of the cluster and the experts.
  [[nodiscard]] int effective_ep_size() const {
    if (ep_size > 0) return ep_size;
    if (pipeline_stages > 1 && pipeline_stages <= topo.num_gpus() && topo.num_gpus() % pipeline_stages == 0)
      return default_ep_size(stage_gpus(), model.num_experts); // the EP groups of one stage
    return default_ep_size(topo.num_gpus(), model.num_experts);
  }

  void validate() const {
    model.validate();
    topo.validate(model.num_experts);
    cost.validate();
    detail::require(ep_size >= 0, "SimConfig: ep_size must be >= 0 (0: the default), got ", ep_size);
    detail::require(std::isfinite(traffic.tolerance) && traffic.tolerance >= 1.0,
                    "SimConfig: traffic.tolerance must be a finite number >= 1, got ", traffic.tolerance);
    detail::require(traffic.tokens >= 0, "SimConfig: traffic.tokens must be >= 0 (0: all), got ", traffic.tokens);
    detail::require(ep_size <= model.num_experts, "SimConfig: an EP group of ", ep_size, " GPUs for ",
                    model.num_experts, " experts would leave GPUs without an expert (ep_size <= experts)");
    detail::require(pipeline_stages >= 1 && pipeline_stages <= model.num_layers,
                    "SimConfig: pipeline_stages must be in [1, ", model.num_layers,
                    "] (one MoE layer per stage at least), got ", pipeline_stages);
    detail::require(topo.num_gpus() % pipeline_stages == 0, "SimConfig: pipeline_stages ", pipeline_stages,
                    " does not divide ", topo.num_gpus(), " GPUs (every stage has as many GPUs)");
    detail::require(tensor_parallel >= 1 && tensor_parallel <= topo.gpus_per_node &&
                        topo.gpus_per_node % tensor_parallel == 0,
                    "SimConfig: tensor_parallel ", tensor_parallel, " must divide the ", topo.gpus_per_node,
                    " GPUs of a node (TP stays on NVLink)");
    detail::require(stage_gpus() % tensor_parallel == 0, "SimConfig: tensor_parallel ", tensor_parallel,
                    " does not divide the ", stage_gpus(), " GPUs of a pipeline stage");
    const int ep = effective_ep_size();
    detail::require(stage_gpus() % ep == 0, "SimConfig: EP group size ", ep, " does not divide ", stage_gpus(),
                    pipeline_stages > 1 ? " GPUs of a pipeline stage" : " GPUs");
    ep_group_topology(topo, ep).validate(model.num_experts);
    detail::require(warmup_steps >= 0, "SimConfig: warmup_steps must be >= 0, got ", warmup_steps);
    detail::require(gpu_load_layer >= 0 && gpu_load_layer < model.num_layers, "SimConfig: gpu_load_layer ",
                    gpu_load_layer, " is not a layer of the model (0 .. ", model.num_layers - 1, ")");
    detail::require(recompute_passes >= 0, "SimConfig: recompute_passes must be >= 0, got ", recompute_passes);
    detail::require(minibatches_per_step >= 1, "SimConfig: minibatches_per_step must be >= 1, got ",
                    minibatches_per_step);
    detail::require(std::isfinite(optimizer_seconds) && optimizer_seconds >= 0,
                    "SimConfig: optimizer_seconds must be >= 0, got ", optimizer_seconds);
    detail::require(std::isfinite(rollout_seconds) && rollout_seconds >= 0,
                    "SimConfig: rollout_seconds must be >= 0, got ", rollout_seconds);
    detail::require(std::isfinite(rollout_share) && rollout_share >= 0 && rollout_share < 1,
                    "SimConfig: rollout_share must be in [0, 1), got ", rollout_share);
    detail::require(std::isfinite(optimizer_traffic_bytes_per_param) && optimizer_traffic_bytes_per_param >= 0,
                    "SimConfig: optimizer_traffic_bytes_per_param must be >= 0, got ",
                    optimizer_traffic_bytes_per_param);
    detail::require(std::isfinite(a2a_overlap) && a2a_overlap >= 0 && a2a_overlap <= 1,
                    "SimConfig: a2a_overlap must be in [0, 1], got ", a2a_overlap);
    detail::require(std::isfinite(dp_grad_overlap) && dp_grad_overlap >= 0 && dp_grad_overlap <= 1,
                    "SimConfig: dp_grad_overlap must be in [0, 1], got ", dp_grad_overlap);
    detail::require(activation_bytes > 0, "SimConfig: activation_bytes must be positive, got ", activation_bytes);
    detail::require(dispatch_dtype == WeightDtype::bf16 || dispatch_dtype == WeightDtype::fp8,
                    "SimConfig: dispatch_dtype must be bf16 or fp8, got ", to_string(dispatch_dtype));
    planner.validate();
    detail::require(std::isfinite(optimizer_bytes_per_param) && optimizer_bytes_per_param >= 0,
                    "SimConfig: optimizer_bytes_per_param must be >= 0, got ", optimizer_bytes_per_param);
    detail::require(std::isfinite(gpu_memory_gb) && gpu_memory_gb > 0,
                    "SimConfig: gpu_memory_gb must be positive, got ", gpu_memory_gb);
    detail::require(std::isfinite(dense_efficiency) && dense_efficiency > 0 && dense_efficiency <= 1,
                    "SimConfig: dense_efficiency must be in (0, 1], got ", dense_efficiency);
    detail::require(std::isfinite(dense.params) && dense.params >= 0 && std::isfinite(dense.attention_dim) &&
                        dense.attention_dim >= 0 && std::isfinite(dense.context) && dense.context >= 0 &&
                        std::isfinite(dense.vocab) && dense.vocab >= 0,
                    "SimConfig: dense shape must be >= 0, got params ", dense.params, ", attention_dim ",
                    dense.attention_dim, ", context ", dense.context, ", vocab ", dense.vocab);
  }
};

/// A simulated strategy: a registered planner strategy, the simulator-only ones (`ideal`) included.
struct SimStrategy {
  std::string name; ///< the registered name
};

/// Registered strategy names in listing order, the simulator-only ones (`ideal`, last) included, joined by `sep`.
[[nodiscard]] inline std::string sim_strategy_names(std::string_view sep = ", ") { return strategy_names(sep, true); }

/// Parses a registered strategy name (`_` reads as `-`); throws `Error` naming the value and the accepted ones.
[[nodiscard]] inline SimStrategy parse_sim_strategy(std::string_view s) {
  if (const StrategyInfo *info = lookup_strategy(s)) return {info->name};
  detail::fail("unknown strategy '", s, "' (registered: ", sim_strategy_names(), ")");
}

/// Where time goes: parts that add up to a step (or micro-step) time, in seconds. `breakdown_parts` lists them:
/// every sum, writer (JSON, CSV, tables) and plot iterates it, so a part added there is added everywhere.
struct SimBreakdown {
  double expert_compute = 0; ///< grouped-GEMM time of the busiest GPU per layer, forward and backward
  double all_to_all = 0;     ///< dispatch and combine, forward and backward, less what hides under compute
  double dense = 0;          ///< attention and dense layers, forward and backward
  double lm_head = 0;        ///< the LM head's GEMM, forward (and backward in the update stage)
  double moves = 0;          ///< weight moves outside the overlap windows: re-owning and host-mirror refreshes
  double stall = 0;          ///< layers waiting for replica weights or gradient returns
  double dp_grad_sync = 0;   ///< expert gradients all-reduced across EP-group copies, not under the backward
  double optimizer = 0;      ///< optimizer steps
  double tp_comm = 0;        ///< tensor-parallel all-gathers and reduce-scatters of the dense part
  double pipeline = 0;       ///< pipeline bubble and the activations sent between stages
  [[nodiscard]] double total() const noexcept;
  SimBreakdown &operator+=(const SimBreakdown &o) noexcept;
};

/// One part of a record of parts (`SimBreakdown`, `SimMemory`): its field, its name (JSON and CSV keys) and its
/// label (plots, messages).
template <class Record> struct RecordPart {
  double Record::*field;
  std::string_view name;
  std::string_view label;
};

/// The sum of `r`'s fields listed in `parts`.
template <class Record, std::size_t N>
[[nodiscard]] constexpr double sum_of_parts(const Record &r, const std::array<RecordPart<Record>, N> &parts) noexcept {
  double t = 0;
  for (const RecordPart<Record> &p : parts)
    t += r.*p.field;
  return t;
}

/// One part of `SimBreakdown` (JSON `<name>_seconds`, CSV `<name>_s`, plots' label).
using BreakdownPart = RecordPart<SimBreakdown>;

/// The parts of a breakdown, in the order they add up and are written and stacked (bottom to top).
inline constexpr std::array<BreakdownPart, 10> breakdown_parts{{
    {&SimBreakdown::expert_compute, "expert_compute", "expert compute (slowest GPU)"},
    {&SimBreakdown::all_to_all, "all_to_all", "all-to-all"},
    {&SimBreakdown::dense, "dense", "dense (attention etc.)"},
    {&SimBreakdown::lm_head, "lm_head", "LM head"},
    {&SimBreakdown::moves, "moves", "moves (re-owning, mirror refresh)"},
    {&SimBreakdown::stall, "stall", "stall (waiting for weights/gradients)"},
    {&SimBreakdown::dp_grad_sync, "dp_grad_sync", "expert-gradient sync across EP-group copies"},
    {&SimBreakdown::optimizer, "optimizer", "optimizer"},
    {&SimBreakdown::tp_comm, "tp_comm", "tensor-parallel collectives"},
    {&SimBreakdown::pipeline, "pipeline", "pipeline bubble and stage sends"},
}};

inline double SimBreakdown::total() const noexcept { return sum_of_parts(*this, breakdown_parts); }

inline SimBreakdown &SimBreakdown::operator+=(const SimBreakdown &o) noexcept {
  for (const BreakdownPart &p : breakdown_parts)
    this->*p.field += o.*p.field;
  return *this;
}

/// Peak memory of one GPU, in bytes: expert weights (owned experts and replica slots, doubled with
/// `double_buffer`), gradient buffers (owned experts and replicas, in `grad_dtype`), optimizer state of the owned
/// experts, the non-routed parameters' weights, gradients and optimizer state (`SimConfig::dense_memory`), and
/// activations (see `docs/simulator.md`). `memory_parts` lists the parts: every sum and writer iterates it.
struct SimMemory {
  double weights = 0, grads = 0, optimizer = 0; ///< the experts'
  double dense_weights = 0, dense_grads = 0, dense_optimizer = 0;
  double activations = 0;
  int gpu = 0;   ///< which GPU of its EP group peaks
  int stage = 0; ///< which pipeline stage (0 without a pipeline)
  /// Host memory (not in `total`) of the node-shared mirror: every expert's weights of every layer once per node,
  /// for strategies that read the mirror (0 for the others).
  double host_mirror_per_node = 0;
  [[nodiscard]] double total() const noexcept;
};

/// One part of `SimMemory` (JSON `peak_memory.<name>_gb`, messages' label).
using MemoryPart = RecordPart<SimMemory>;

/// The parts of a GPU's memory, in the order they add up and are written.
inline constexpr std::array<MemoryPart, 7> memory_parts{{
    {&SimMemory::weights, "weights", "expert weights"},
    {&SimMemory::grads, "grads", "expert gradients"},
    {&SimMemory::optimizer, "optimizer", "expert optimizer state"},
    {&SimMemory::dense_weights, "dense_weights", "dense weights"},
    {&SimMemory::dense_grads, "dense_grads", "dense gradients"},
    {&SimMemory::dense_optimizer, "dense_optimizer", "dense optimizer state"},
    {&SimMemory::activations, "activations", "activations"},
}};

inline double SimMemory::total() const noexcept { return sum_of_parts(*this, memory_parts); }

/// Results of one strategy over all simulated steps.
struct SimResult {
  std::string strategy;
  double step_seconds = 0;       ///< mean per RL step: recompute + update (+ optimizer, re-owning)
  double recompute_seconds = 0;  ///< mean per step
  double update_seconds = 0;     ///< mean per step, optimizer steps included
  double end_to_end_seconds = 0; ///< step + rollout
  double rollout_seconds = 0;    ///< the rollout in `end_to_end_seconds` (`SimConfig::rollout_time`), same for all
  double imbalance_median = 1, imbalance_p99 = 1; ///< per (micro-step, layer) max/mean GPU load, both stages
  double moved_gb = 0;                            ///< weights moved per step (replicas in, re-owning), GB
  double grad_gb = 0;                             ///< replica gradients reduced per step, GB
  double stall_seconds = 0;                       ///< per step: time layers waited for weights
  double mirror_seconds = 0;  ///< per step: host-mirror refreshes after optimizer steps (strategies reading it)
  double planner_seconds = 0; ///< wall time of planning, the counted steps (every EP group)
  /// Per step: the planning time on the critical path (of the slowest EP group), see `SimConfig::planner_overlap`.
  /// Wall time, so not part of `step_seconds` (which stays a deterministic function of the inputs).
  double planner_critical_seconds = 0;
  double grad_tail_seconds = 0; ///< per step: the last update micro-step's replica gradients not hidden (in stall)
  SimMemory memory;             ///< the peak over every GPU and simulated micro-step (warm-up included)
  int min_experts_per_gpu = 0;  ///< fewest experts any GPU held in any counted (micro-step, layer)
  /// Per counted micro-step (recompute then update, per counted step), of the step's slowest EP group: layer
  /// forward(+backward) times.
  std::vector<std::vector<double>> layer_seconds;
  /// The same rows: each layer's max/mean GPU load (`ideal`: `ceil(T / G) G / T`, 1 when G divides the tokens T).
  std::vector<std::vector<double>> layer_imbalance;
  /// The same rows: tokens per GPU of its EP group in layer `SimConfig::gpu_load_layer`.
  std::vector<std::vector<double>> gpu_loads;
  SimBreakdown breakdown;                    ///< mean per counted RL step; its total is `step_seconds`
  std::vector<SimBreakdown> step_breakdown;  ///< per counted RL step (its slowest EP group)
  std::vector<SimBreakdown> micro_breakdown; ///< per counted micro-step (the rows of `layer_seconds`)
  /// Per step: the all-to-all hidden under compute (`SimConfig::a2a_overlap`), not in `breakdown.all_to_all`.
  double a2a_hidden_seconds = 0;
  /// Per step: token bytes the all-to-all sends between nodes (dispatch and combine, every pass, every EP group), GB.
  double inter_node_gb = 0;
};

/// Whether strategy `strategy` plans traffic-aware under `cfg` (`SimConfig::traffic`): the ids counted
/// (`a2a_hits` ids), the option on, and `foremoe` or `foremoe-free`, the strategies whose owners the planner chooses
/// per RL step (`traffic_aware_owners` improves those; the others keep their published owners or none).
[[nodiscard]] inline bool plans_traffic_aware(const SimConfig &cfg, std::string_view strategy) noexcept {
  return cfg.a2a_hits == A2aHitsSource::ids && cfg.traffic.aware &&
         (strategy == "foremoe" || strategy == "foremoe-free");
}

/// One micro-step's routing, for counting its all-to-all from the tokens (`SimConfig::a2a_hits`).
struct RoutedMicroStep {
  std::vector<std::int16_t> ids;            ///< layer-major `[layers][tokens][topk]`
  std::vector<std::int64_t> source_offsets; ///< `[num_gpus + 1]`: the tokens each rank holds
};

/// Fills `out` with the routing of micro-step `m` (an index into the loads' micro-steps).
using MicroStepRoutes = std::function<void(int m, RoutedMicroStep &out)>;

namespace detail {

/// Per-layer timing of one micro-step under one plan.
struct LayerTiming {
  double forward = 0, backward = 0;
  double expert = 0, a2a = 0, dense = 0; ///< the parts of forward + backward (`a2a`: the part not hidden)
  double tp = 0;                         ///< tensor-parallel collectives, forward + backward
  double a2a_link = 0;                   ///< the whole all-to-all: how long it occupies the links
  double a2a_hidden = 0;                 ///< the part of `a2a_link` hidden under compute
  std::vector<double> move_demand;       ///< per GPU: seconds of incoming moves (max over paths)
  std::vector<double> grad_demand;       ///< per GPU: seconds of gradient reductions it sends
  double moved_bytes = 0, grad_bytes = 0;
  double inter_node_bytes = 0; ///< all-to-all token bytes between nodes (dispatch and combine, both directions)
  bool host_moves = false;     ///< some move read the host mirror
};

/// What one EP group did in one RL step.
struct GroupStep {
  double recompute = 0, update = 0, extra = 0, stall = 0, mirror = 0, moved = 0, grad = 0, planner = 0;
  double planner_critical = 0, grad_tail = 0, a2a_hidden = 0, inter_node = 0;
  SimMemory memory;
  int min_experts = std::numeric_limits<int>::max(); ///< fewest experts on a GPU in any (micro-step, layer)
  SimBreakdown parts;
  std::vector<SimBreakdown> micro;
  std::vector<std::vector<double>> layers;
  std::vector<std::vector<double>> imbalance; ///< per micro-step, per layer
  std::vector<std::vector<double>> gpu_loads; ///< per micro-step, per GPU: layer `SimConfig::gpu_load_layer`
  [[nodiscard]] double seconds() const noexcept { return recompute + update + extra; }
};

/// The loads of each of `num_groups` data-parallel EP groups. With per-source counts (sources: consecutive blocks
/// of ranks, `num_sources` a multiple of `num_groups`) group `i` gets the tokens of its own sources; without them
/// every count `v` is split evenly: `v / n` each, the `v % n` leftover tokens to consecutive groups starting at one
/// that rotates with expert, layer and micro-step (so no group is always the heavier one).
[[nodiscard]] inline std::vector<LoadTensor> split_loads_by_group(const LoadTensor &loads, int num_groups) {
  const int M = loads.num_micro_steps(), L = loads.num_layers(), E = loads.num_experts();
  std::vector<LoadTensor> out;
  out.reserve(static_cast<std::size_t>(num_groups));
  for (int i = 0; i < num_groups; ++i)
    out.emplace_back(M, L, E);
  if (loads.has_sources()) {
    const int ns = loads.num_sources();
    require(ns % num_groups == 0, "simulate: loads carry ", ns, " sources, which do not split over ", num_groups,
            " EP groups (give a multiple of the group count, or loads without sources)");
    const int per = ns / num_groups;
    for (int m = 0; m < M; ++m)
      for (int l = 0; l < L; ++l) {
        const auto src = loads.layer_by_source(m, l);
        for (int i = 0; i < num_groups; ++i) {
          auto dst = out[i].layer(m, l);
          for (int e = 0; e < E; ++e)
            for (int k = i * per; k < (i + 1) * per; ++k)
              dst[e] += src[static_cast<std::size_t>(e) * ns + k];
        }
      }
    return out;
  }
  for (int m = 0; m < M; ++m)
    for (int l = 0; l < L; ++l) {
      const auto v = loads.layer(m, l);
      for (int e = 0; e < E; ++e) {
        const std::int64_t each = v[e] / num_groups, rem = v[e] % num_groups;
        const int start = (e + 7 * l + 13 * m) % num_groups;
        for (int i = 0; i < num_groups; ++i)
          out[i].layer(m, l)[e] = each + ((i - start + num_groups) % num_groups < rem ? 1 : 0);
      }
    }
  return out;
}

/// One EP group's simulation under one strategy (`simulate_group`): the run's constants, its planner and the state
/// one RL step hands the next, with a member function per piece of a step's timing.
class GroupSim {
public:
  /// Sets up the group's costs, held-gradient tracker and planner.
  GroupSim(const SimConfig &config, const Topology &group_topo, const LoadTensor &group_loads,
           const SimStrategy &strategy)
      : cfg(config), topo(group_topo), loads(group_loads), strat(strategy), spec(config.model),
        G(group_topo.num_gpus()), L(spec.num_layers), E(spec.num_experts),
        compute(config.cost, ExpertShape::from(spec)), expert_bytes(static_cast<double>(spec.bytes_per_expert())),
        row_bytes(config.row_bytes()), dispatch_row_bytes(config.dispatch_row_bytes()),
        expert_params(static_cast<double>(spec.num_matrices) * spec.hidden * spec.expert_ffn),
        grad_bytes_per_expert(expert_params * static_cast<double>(dtype_bytes(config.grad_dtype))),
        cost(grad_cost_params(config, grad_bytes_per_expert / expert_bytes)), num_copies(config.stage_gpus() / G),
        PP(config.pipeline_stages), stage_layers(config.stage_first_layer(1) - config.stage_first_layer(0)),
        owners_per_gpu(group_topo.owners_per_gpu(E)), K(spec.topk), P(group_topo.gpus_per_node), held(L, G, E),
        planner(L, E, group_topo, planner_options()), S(planner.topology().slots_per_gpu),
        keeps_residents(planner.reuses_resident()), limit(planner.physical_limit()) {}
  GroupSim(const GroupSim &) = delete;
  GroupSim &operator=(const GroupSim &) = delete;

  /// Whether this strategy plans traffic-aware (`plans_traffic_aware`).
  [[nodiscard]] bool traffic_aware() const noexcept { return plans_traffic_aware(cfg, strat.name); }
  /// The co-activation of the next step's routed ids (for `traffic_aware()`; read by `begin_step`, which must
  /// follow) and the seconds it took to count, charged to the step's planner time.
  void set_coactivation(const CoActivation *co, double count_seconds) {
    step_co = co;
    step_co_seconds = count_seconds;
  }

  /// Simulates the next RL step (steps run in order, each once), the loads' micro-steps `m0` to `m1`: its recompute
  /// stages, then its update stage.
  [[nodiscard]] GroupStep run_step(int m0, int m1) {
    begin_step(m0, m1);
    return finish_step();
  }

  /// Plans every stage of the next RL step (the loads' micro-steps `m0` to `m1`) in order: a stage's plan depends
  /// on the plans before it (the resident placement it starts from), not on their timing, so the stages are
  /// planned first and timed by `finish_step`. In between, `counted_a2a` takes each micro-step's counted
  /// all-to-all under the stages' plans (`SimConfig::a2a_hits` ids).
  void begin_step(int m0, int m1) {
    pending = Pending{}; // not emplace(): clang 14 finds the nested struct not default-constructible there
    Pending &pd = *pending;
    pd.m0 = m0;
    pd.step = LoadTensor(m1 - m0, L, E);
    std::copy(loads.totals().begin() + static_cast<std::ptrdiff_t>(m0) * L * E,
              loads.totals().begin() + static_cast<std::ptrdiff_t>(m1) * L * E, pd.step.totals().begin());
    // Stages: `recompute_passes` forward-only passes, then the update pass.
    pd.stages.resize(static_cast<std::size_t>(cfg.recompute_passes) + 1);
    for (int pass = 0; pass <= cfg.recompute_passes; ++pass) {
      StageRun &sr = pd.stages[static_cast<std::size_t>(pass)];
      sr.update = pass == cfg.recompute_passes;
      plan_stage(pd.step, pass, sr, pd.rec);
      // The stage's final placement stays resident for the next stage's plan.
      if (!sr.sp.micro_steps.empty()) {
        resident = sr.sp.final_placement();
        has_resident = true;
      }
    }
  }

  /// Stages of the step `begin_step` planned.
  [[nodiscard]] int num_stages() const noexcept { return static_cast<int>(pending->stages.size()); }
  /// The plan of layer `l` of the step's micro-step `m` (from the step's first) in stage `pass`.
  [[nodiscard]] const LayerPlan &stage_plan(int pass, int m, int l) const {
    return pending->stages[static_cast<std::size_t>(pass)]
        .sp.micro_steps[static_cast<std::size_t>(m)][static_cast<std::size_t>(l)];
  }
  /// Makes room for the step's counted all-to-alls (`counted_a2a`); without it `finish_step` times the estimate.
  void expect_counted() {
    for (StageRun &sr : pending->stages)
      sr.routed_cost.assign(static_cast<std::size_t>(pending->step.num_micro_steps()),
                            std::vector<LayerA2a>(static_cast<std::size_t>(L)));
  }
  /// Where the counted all-to-all of the step's micro-step `m` in stage `pass` goes (one entry per layer; the
  /// layers may be written from different threads).
  [[nodiscard]] std::vector<LayerA2a> &counted_a2a(int pass, int m) {
    return pending->stages[static_cast<std::size_t>(pass)].routed_cost[static_cast<std::size_t>(m)];
  }

  /// The all-to-all of one layer counted from its routed ids under plan `lp` (`SimConfig::a2a_hits`): `ids` is the
  /// layer's `[tokens][topk]`, grouped by rank by `source_offsets`, and `source_loads` its `[E][G]` tokens per
  /// (expert, source rank). The plan's copies take each source's tokens as the runtime dispatches them
  /// (`split_by_source`, then the positional map), and each token's distinct nodes and GPUs are counted.
  [[nodiscard]] LayerA2a count_layer(const LayerPlan &lp, std::span<const std::int16_t> ids,
                                     std::span<const std::int64_t> source_offsets,
                                     std::span<const std::int64_t> source_loads,
                                     std::vector<std::int32_t> &slots) const {
    const std::int64_t T = source_offsets.back();
    const std::vector<std::int64_t> split = split_by_source(lp.placement, lp.slot_tokens, source_loads, G, P);
    slots.resize(static_cast<std::size_t>(T) * K);
    // The layer alone, as a one-layer view; traffic-aware strategies map each rank's tokens by the node-affine rule,
    // as `dispatch_from_loads` with it maps them (the same split by source, every source apart).
    TokenMapOptions rule;
    if (traffic_aware()) {
      rule.rule = TokenMapRule::node_affine;
      rule.topo = planner.topology();
    }
    map_tokens(token_ranges(lp.placement, split, G), RoutedView(ids, T, 1, K), 0, slots, source_offsets, rule);
    const A2aVolumes v = a2a_volumes_from_routes(slots, K, S, P, G, source_offsets);
    return layer_a2a_of(cfg.cost.a2a, v, row_bytes, dispatch_row_bytes);
  }

  /// Times the stages `begin_step` planned (with the counted all-to-alls, if given) and returns the step's record.
  [[nodiscard]] GroupStep finish_step() {
    Pending &pd = *pending;
    const int M = pd.step.num_micro_steps();
    for (StageRun &sr : pd.stages) {
      detail::require(sr.routed_cost.empty() || static_cast<int>(sr.routed_cost.size()) == M,
                      "simulate: a stage has counted all-to-alls for ", sr.routed_cost.size(), " of ", M,
                      " micro-steps");
      for (int m = 0; m < M; ++m)
        run_micro_step(sr, pd.step, m, pd.m0, pd.rec);
      close_stage(sr, M, pd.rec);
    }
    previous_totals = planner.sum_steps(pd.step);
    GroupStep rec = std::move(pd.rec);
    pending.reset();
    return rec;
  }

private:
  /// One stage of a step: its plan, and what each micro-step hands the next and the stage's closing terms.
  struct StageRun {
    bool update = false;        ///< the update stage (else a forward-only recompute)
    StepPlan sp;                ///< the stage's plan
    double planner_seconds = 0; ///< the stage's planner time
    bool used_mirror = false;   ///< some move read the host mirror
    std::vector<LayerTiming> prev_t;
    const std::vector<LayerPlan> *prev_plans = nullptr;
    double time = 0, last_a2a_share = 0;
    /// Per micro-step, per layer: the all-to-all counted from the routed ids (empty: the estimate).
    std::vector<std::vector<LayerA2a>> routed_cost;
  };
  /// The step between `begin_step` and `finish_step`.
  struct Pending {
    LoadTensor step{1, 1, 1};
    int m0 = 0;
    GroupStep rec;
    std::vector<StageRun> stages;
  };

  const SimConfig &cfg;
  const Topology &topo;    ///< the group's topology
  const LoadTensor &loads; ///< the group's own tokens
  const SimStrategy &strat;
  const ModelSpec &spec;
  const int G, L, E;
  const ExpertComputeModel compute;
  const double expert_bytes, row_bytes, dispatch_row_bytes, expert_params, grad_bytes_per_expert;
  const CostParams cost; ///< gradients in `grad_dtype`
  const int num_copies;  ///< data-parallel copies of this EP group (in one pipeline stage)
  const int PP;
  const int stage_layers; ///< layers of the largest pipeline stage (the first); L without a pipeline
  const int owners_per_gpu, K, P;
  // Replica gradients in the update stage (DESIGN: a replica that stays resident over several micro-steps
  // accumulates its gradient in place and returns it once; `HeldGradients` is the rule the planner counts by too).
  // A replica that ran tokens holds a gradient for its owner. It returns it when the next plan of its layer no
  // longer holds it there (its slot is reused; strategies that re-push every replica each micro-step, and every
  // strategy with `hold_replica_gradients` off, return every micro-step) and, for those still resident, once after
  // the stage's last backward. A resident copy that ran no token owes nothing.
  HeldGradients held;
  Planner planner;
  const int S; ///< slots per GPU of the strategy's plans (`Planner::topology`)
  const bool keeps_residents;
  /// `PlanStrategy::physical_limit` (`ideal`): no move, gradient return or re-owning is charged, its layers are
  /// timed from each GPU's tokens alone (`expert_seconds`, `time_layer`) and its memory holds owners only
  /// (`memory_of`)
  const bool limit;
  Placement resident;
  bool has_resident = false;
  std::optional<Pending> pending;
  std::vector<std::int32_t> prev_owner_flat;
  // Traffic-aware planning (`traffic_aware()`): the step's co-activation (not owned), the seconds it took to count,
  // the step's owners and the previous step's (kept where `reowning_free` is off, as the strategy keeps them).
  const CoActivation *step_co = nullptr;
  double step_co_seconds = 0;
  Planner::OwnerMap step_owners, prev_owners;
  // The previous step's totals (empty before the first step ends), handed to the planner once per step, with the
  // step's first stage (`PlanStrategy::begin_step`'s contract): `eplb` keeps its rebalance window from them.
  std::vector<std::int64_t> previous_totals;

  /// `config.cost` with the gradients' bytes per weight byte set to `factor`.
  static CostParams grad_cost_params(const SimConfig &config, double factor) {
    CostParams c = config.cost;
    c.grad.grad_bytes_factor = factor;
    return c;
  }

  /// The planner's options: the strategy, the gradients' size and, with `cost_gate`, the replica cost model.
  [[nodiscard]] PlannerOptions planner_options() const {
    PlannerOptions popts = cfg.planner; // without reowning_free the planner keeps owners where it can
    popts.strategy = strat.name;
    popts.gradient_bytes_factor = cost.grad.grad_bytes_factor; // from `grad_dtype` and the model's weight dtype
    if (cfg.cost_gate) {
      // The slowest GPU's expert compute for its token count, on a GPU with every slot in use.
      popts.token_time = [this](std::int64_t t) {
        const auto x = static_cast<double>(t);
        return compute.forward_seconds(x, S) + compute.backward_seconds(x, S);
      };
      popts.replica_cost = [this](int, int src, int dst, Stage stage) {
        const bool same_node = src >= 0 && topo.node_of(src) == topo.node_of(dst);
        const MovePath path = src < 0 ? MovePath::pcie : same_node ? MovePath::nvlink : MovePath::network;
        const MovePath grad = same_node ? MovePath::nvlink : MovePath::network;
        return move_seconds(cfg.cost.move, path, expert_bytes) +
               (stage == Stage::update ? grad_reduce_seconds(cost, grad, expert_bytes) : 0.0);
      };
    }
    return popts;
  }

  /// Tokens of micro-step `m` (before routing): its assignments over top-k, from layer 0.
  [[nodiscard]] double tokens_of(int m) const { return static_cast<double>(loads.layer_total(m, 0)) / spec.topk; }

  /// Adds to `demand` (per GPU) the seconds of returning, GPU-direct, the gradients layer `l`'s replicas hold that
  /// `keep` does not keep (`keep` null: all of them); returns their bytes.
  double return_gradients(int l, const LayerPlan *keep, std::vector<double> &demand) {
    double bytes = 0;
    held.release(l, keep, cfg.planner.hold_replica_gradients && keeps_residents, [&](int g, int, std::int32_t owner) {
      const MovePath path = topo.node_of(owner) == topo.node_of(g) ? MovePath::nvlink : MovePath::network;
      demand[g] += grad_reduce_seconds(cost, path, expert_bytes);
      bytes += grad_bytes_per_expert;
    });
    return bytes;
  }

  /// Peak memory of one micro-step under its `plans`, over its GPUs.
  [[nodiscard]] SimMemory memory_of(const std::vector<LayerPlan> &plans, double tokens) const {
    SimMemory peak;
    const double per_gpu_tokens = tokens / G;
    for (int g = 0; g < G; ++g)
      for (int st = 0; st < PP; ++st) {
        // A GPU holds the layers of its pipeline stage (all of them without a pipeline).
        double owned = 0, replicas = 0, recv_max = 0;
        for (int l = cfg.stage_first_layer(st); l < cfg.stage_first_layer(st + 1); ++l) {
          const LayerPlan &lp = plans[l];
          double recv = 0;
          for (int s = 0; s < S; ++s) {
            const std::int32_t e = lp.placement.slot(g, s);
            if (e == empty_slot) continue;
            if (!limit) (lp.owner_gpu[e] == g ? owned : replicas) += 1;
            recv += static_cast<double>(lp.slot_tokens[static_cast<std::size_t>(g) * S + s]);
          }
          // The physical limit holds the fewest experts any placement does, `ceil(E / G)` owners per GPU and no
          // replica (its pieces would hold more and could leave it not fitting where a plan fits).
          if (limit) owned += owners_per_gpu;
          recv_max = std::max(recv_max, recv);
        }
        SimMemory m;
        m.gpu = g;
        m.stage = st;
        m.weights = (owned + replicas * (cfg.double_buffer ? 2 : 1)) * expert_bytes;
        m.grads = (owned + replicas) * grad_bytes_per_expert;
        // The distributed optimizer shards the owned experts' state over their EP-group copies (expert-DP).
        m.optimizer = cfg.optimizer_offload ? 0.0
                                            : owned * expert_params * cfg.optimizer_bytes_per_param /
                                                  (cfg.distributed_optimizer ? num_copies : 1);
        const DenseMemory dm = cfg.dense_memory(st);
        m.dense_weights = dm.weights;
        m.dense_grads = dm.grads;
        m.dense_optimizer = dm.optimizer;
        // Checkpointed layer inputs (full recomputation keeps one H-vector per token and layer: Korthikanti et al.
        // 2022, "Reducing Activation Recomputation", sec. 4) plus one layer's expert working set for the rows the
        // GPU receives: dispatched input (H), gate and up outputs (2 I), their product (I), output (H). Under 1F1B
        // stage s holds PP - s micro-batches in flight (Narayanan et al. 2021, sec. 2.2): PP x the first stage's
        // layers at most, L without a pipeline.
        m.activations = (per_gpu_tokens * (PP * stage_layers) * spec.hidden +
                         recv_max * (2.0 * spec.hidden + 3.0 * spec.expert_ffn)) *
                        cfg.activation_bytes;
        if (m.total() > peak.total()) peak = m;
      }
    return peak;
  }

  /// Each GPU's tokens and experts in one layer under `lp`; lowers `min_experts` to the fewest experts on a GPU.
  void gpu_shares(const LayerPlan &lp, std::vector<double> &gpu_tokens, std::vector<int> &gpu_experts,
                  int &min_experts) const {
    for (int p = 0; p < G * S; ++p) {
      gpu_tokens[p / S] += static_cast<double>(lp.slot_tokens[p]);
      gpu_experts[p / S] += lp.placement.phys_to_log()[p] != empty_slot;
    }
    min_experts = std::min(min_experts, *std::min_element(gpu_experts.begin(), gpu_experts.end()));
  }

  /// The slowest GPU's expert forward and backward seconds in one layer, from its slots' token counts under `lp`;
  /// for the physical limit from its `gpu_tokens` spread evenly over `ceil(E / G)` experts (the fewest any placement
  /// gives its busiest GPU: an exact split needs a piece more on some GPUs, which the limit does not charge).
  [[nodiscard]] std::pair<double, double> expert_seconds(const LayerPlan &lp,
                                                         const std::vector<double> &gpu_tokens) const {
    double fwd_expert = 0, bwd_expert = 0;
    std::vector<double> counts(static_cast<std::size_t>(S));
    for (int g = 0; g < G; ++g) {
      for (int s = 0; s < S && !limit; ++s)
        counts[s] = static_cast<double>(lp.slot_tokens[static_cast<std::size_t>(g) * S + s]);
      const double fwd =
          limit ? compute.forward_seconds(gpu_tokens[g], owners_per_gpu) : compute.forward_seconds(counts);
      fwd_expert = std::max(fwd_expert, fwd);
      bwd_expert = std::max(bwd_expert, compute.backward_factor() * fwd);
    }
    return {fwd_expert, bwd_expert};
  }

  /// Times one layer under plan `lp`; `routed`, if set, is its all-to-all counted from the routed ids.
  [[nodiscard]] LayerTiming time_layer(const LayerPlan &lp, double tokens, bool update, int &min_experts,
                                       const LayerA2a *routed) const {
    LayerTiming t;
    std::vector<double> gpu_tokens(static_cast<std::size_t>(G), 0.0);
    std::vector<int> gpu_experts(static_cast<std::size_t>(G), 0);
    gpu_shares(lp, gpu_tokens, gpu_experts, min_experts);
    const auto [fwd_expert, bwd_expert] = expert_seconds(lp, gpu_tokens);
    const double attn = cfg.dense_forward_seconds(tokens / G);
    // Dispatch (= combine): hierarchical from the slots' experts and rows or from the routed ids; the physical
    // limit's from each GPU's rows spread over all experts (empty slot spans: `a2a_hits_spread`, the fewest hits).
    const LayerA2a layer_a2a_cost =
        routed != nullptr
            ? *routed
            : layer_a2a(cfg.cost.a2a, limit ? std::span<const std::int32_t>{} : lp.placement.phys_to_log(),
                        limit ? std::span<const std::int64_t>{} : std::span(lp.slot_tokens), gpu_tokens, S,
                        topo.gpus_per_node, E, tokens, row_bytes, dispatch_row_bytes);
    const double a2a = layer_a2a_cost.seconds, fwd_a2a = layer_a2a_cost.dispatch_seconds + a2a;
    // Dispatch and combine each pass: forward (the dispatch at its own row size), and backward in the update stage.
    t.inter_node_bytes = layer_a2a_cost.inter_node_rows * (dispatch_row_bytes + (update ? 3.0 : 1.0) * row_bytes);
    // Each pass's dispatch and combine may hide under its compute, `a2a_overlap` of it at most.
    const double fwd_hidden = std::min(cfg.a2a_overlap * fwd_a2a, attn + fwd_expert);
    t.forward = attn + layer_a2a_cost.dispatch_seconds + fwd_expert + a2a - fwd_hidden;
    t.expert = fwd_expert;
    t.a2a = fwd_a2a - fwd_hidden;
    t.a2a_link = fwd_a2a;
    t.a2a_hidden = fwd_hidden;
    t.dense = attn;
    if (update) {
      const double bwd_hidden = std::min(cfg.a2a_overlap * 2 * a2a, cfg.cost.backward_factor * attn + bwd_expert);
      t.backward = cfg.cost.backward_factor * attn + a2a + bwd_expert + a2a - bwd_hidden;
      t.expert += bwd_expert;
      t.a2a += 2 * a2a - bwd_hidden;
      t.a2a_link += 2 * a2a;
      t.a2a_hidden += bwd_hidden;
      t.dense += cfg.cost.backward_factor * attn;
    }
    if (cfg.tensor_parallel > 1) { // not hidden: Megatron's TP communication overlap is opt-in (tp_comm_overlap)
      const double tp = cfg.tp_collectives_seconds(tokens / G);
      t.forward += tp;
      t.tp = tp;
      if (update) {
        t.backward += tp;
        t.tp += tp;
      }
    }
    t.move_demand.assign(static_cast<std::size_t>(G), 0.0);
    t.grad_demand.assign(static_cast<std::size_t>(G), 0.0);
    if (!limit) add_move_demand(lp, t);
    return t;
  }

  /// Sets `t.move_demand` (per GPU: when its incoming moves of plan `lp` end) and the moved bytes and mirror use.
  // Inlined into `time_layer`: out of line, GCC 12 at -O3 misreports -Wfree-nonheap-object on its vectors.
  [[gnu::always_inline]] void add_move_demand(const LayerPlan &lp, LayerTiming &t) const {
    // Paths run concurrently; on one path a GPU receives its moves one after another, and a source GPU
    // sends its moves one after another (its copy engine and port are shared), so a move ends no earlier
    // than both queues have drained.
    std::vector<double> path_in(static_cast<std::size_t>(G) * 3, 0.0), path_out(static_cast<std::size_t>(G) * 3, 0.0);
    auto path_of = [&](const Move &mv) {
      if (mv.src_gpu < 0) return MovePath::pcie;
      return topo.node_of(mv.src_gpu) == topo.node_of(mv.dst_gpu) ? MovePath::nvlink : MovePath::network;
    };
    // The NIC and the host mirror reach a GPU over its one PCIe link: what it receives on the two paths together
    // takes at least their bytes at the PCIe ingress rate (after the first move's latency).
    std::vector<double> pcie_bytes(static_cast<std::size_t>(G), 0.0), pcie_latency(static_cast<std::size_t>(G), 0.0);
    for (const Move &mv : lp.moves) {
      const MovePath path = path_of(mv);
      const double sec = move_seconds(cfg.cost.move, path, expert_bytes);
      path_in[static_cast<std::size_t>(mv.dst_gpu) * 3 + static_cast<int>(path)] += sec;
      if (mv.src_gpu >= 0) path_out[static_cast<std::size_t>(mv.src_gpu) * 3 + static_cast<int>(path)] += sec;
      t.moved_bytes += expert_bytes;
      if (path == MovePath::pcie) t.host_moves = true;
      if (path != MovePath::nvlink) {
        const double lat = path_params(cfg.cost.move, path).latency_us * 1e-6;
        const auto d = static_cast<std::size_t>(mv.dst_gpu);
        pcie_latency[d] = pcie_bytes[d] > 0 ? std::min(pcie_latency[d], lat) : lat;
        pcie_bytes[d] += expert_bytes;
      }
    }
    for (const Move &mv : lp.moves) {
      const int p = static_cast<int>(path_of(mv));
      double finish = path_in[static_cast<std::size_t>(mv.dst_gpu) * 3 + p];
      if (mv.src_gpu >= 0) finish = std::max(finish, path_out[static_cast<std::size_t>(mv.src_gpu) * 3 + p]);
      t.move_demand[mv.dst_gpu] = std::max(t.move_demand[mv.dst_gpu], finish);
    }
    for (int g = 0; g < G; ++g)
      if (pcie_bytes[g] > 0)
        t.move_demand[g] =
            std::max(t.move_demand[g], pcie_latency[g] + pcie_bytes[g] / (cfg.cost.move.pcie_ingress_gb_per_s * 1e9));
  }

  /// Plans stage `pass` of `step` into `sr`, charging its planner time and, in the first stage, any re-owning
  /// (none where transfers are free) to `rec`.
  void plan_stage(const LoadTensor &step, int pass, StageRun &sr, GroupStep &rec) {
    const auto t0 = std::chrono::steady_clock::now();
    if (traffic_aware()) {
      detail::require(step_co != nullptr, "simulate: strategy ", strat.name, " plans traffic-aware owners but was ",
                      "given no co-activation for the step");
      // The owners of the step, once (every stage uses them): the load-only owners the strategy would choose (the
      // previous step's kept where it keeps them), improved for the step's co-activation.
      if (pass == 0)
        step_owners = traffic_step_owners(planner, step, *step_co, cfg.traffic,
                                          cfg.planner.reowning_free ? Planner::OwnerMap{} : prev_owners)
                          .owners;
      sr.sp = planner.plan_step_with_owners(step, step_owners, has_resident ? &resident : nullptr,
                                            sr.update ? Stage::update : Stage::recompute);
      sr.sp.owner_gpu = step_owners;
      prev_owners = step_owners;
    } else {
      // The previous step's totals go with the first stage only: later stages of the step hand none (one hand-over
      // per finished step).
      sr.sp = planner.plan_step(step, has_resident ? &resident : nullptr,
                                pass == 0 ? std::span<const std::int64_t>(previous_totals)
                                          : std::span<const std::int64_t>{},
                                sr.update ? Stage::update : Stage::recompute);
    }
    sr.planner_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (traffic_aware() && pass == 0) sr.planner_seconds += step_co_seconds; // the count is planning work too
    rec.planner += sr.planner_seconds;
    // Re-owning costs weights plus optimizer state unless the reload after rollout makes it free.
    if (pass == 0 && !cfg.planner.reowning_free && !limit && !prev_owner_flat.empty()) charge_reowning(sr.sp, rec);
    if (pass == 0 && !sr.sp.owner_gpu.empty()) {
      prev_owner_flat.clear();
      for (const auto &row : sr.sp.owner_gpu)
        prev_owner_flat.insert(prev_owner_flat.end(), row.begin(), row.end());
    }
  }

  /// Charges to `rec` the slowest GPU's seconds of receiving the experts whose owner `sp` changed (weights plus
  /// optimizer state over the network).
  void charge_reowning(const StepPlan &sp, GroupStep &rec) const {
    std::vector<double> per_gpu(static_cast<std::size_t>(G), 0.0);
    for (int l = 0; l < L; ++l)
      for (int e = 0; e < E; ++e) {
        const std::int32_t o = sp.owner_gpu.empty() ? -1 : sp.owner_gpu[l][e];
        if (o >= 0 && o != prev_owner_flat[static_cast<std::size_t>(l) * E + e]) {
          per_gpu[o] += move_seconds(cfg.cost.move, MovePath::network, expert_bytes * (1 + cfg.optimizer_state_factor));
          rec.moved += expert_bytes * (1 + cfg.optimizer_state_factor);
        }
      }
    const double reown = *std::max_element(per_gpu.begin(), per_gpu.end());
    rec.extra += reown;
    rec.parts.moves += reown;
  }

  /// Times micro-step `m`'s layers under its plans, trading replica gradients, and records their bytes, imbalance
  /// and the GPU loads of `SimConfig::gpu_load_layer` in `rec`.
  [[nodiscard]] std::vector<LayerTiming> time_layers(StageRun &sr, int m, double tokens, GroupStep &rec) {
    std::vector<LayerTiming> cur(static_cast<std::size_t>(L));
    std::vector<double> &imbalance = rec.imbalance.emplace_back(static_cast<std::size_t>(L), 1.0);
    for (int l = 0; l < L; ++l) {
      const LayerPlan &lp = sr.sp.micro_steps[m][l];
      cur[l] = time_layer(
          lp, tokens, sr.update, rec.min_experts,
          sr.routed_cost.empty() ? nullptr : &sr.routed_cost[static_cast<std::size_t>(m)][static_cast<std::size_t>(l)]);
      // The gradients owed by replicas this plan drops return before their slots are reused, in the window
      // before layer l's forward; this plan's replicas then owe theirs (nothing is owed where transfers are free).
      if (sr.update && !limit) {
        cur[l].grad_bytes += return_gradients(l, &lp, cur[l].grad_demand);
        held.hold(l, lp);
      }
      imbalance[l] = lp.imbalance();
      if (l == cfg.gpu_load_layer) record_gpu_loads(lp, rec);
      rec.moved += cur[l].moved_bytes;
      rec.inter_node += cur[l].inter_node_bytes;
      sr.used_mirror = sr.used_mirror || cur[l].host_moves;
      rec.grad += cur[l].grad_bytes;
    }
    return cur;
  }

  /// Appends to `rec.gpu_loads` each GPU's tokens in a layer under `lp`.
  void record_gpu_loads(const LayerPlan &lp, GroupStep &rec) const {
    std::vector<double> &per_gpu = rec.gpu_loads.emplace_back();
    for (const std::int64_t t : lp.gpu_loads())
      per_gpu.push_back(static_cast<double>(t));
  }

  /// The micro-step's stall: the largest lateness of any GPU's queue of moves and gradient returns; fills `work`
  /// (per GPU and layer: the link seconds they take while the all-to-all holds `a2a_share` of the link).
  [[nodiscard]] double stall_of(const std::vector<LayerTiming> &cur, const StageRun &sr,
                                const std::vector<double> &fwd_prefix, double a2a_share,
                                std::vector<double> &work) const {
    // Each GPU's link serves the moves and gradient returns of all layers (one queue, earliest deadline
    // first): layer l's are released when its slot is free, `window` before its forward at fwd_prefix[l].
    std::vector<double> release(static_cast<std::size_t>(L));
    for (int l = 0; l < L; ++l) {
      double window = fwd_prefix[l];
      if (!sr.prev_t.empty()) {
        if (sr.update)
          for (int k = 0; k < l; ++k)
            window += sr.prev_t[k].backward; // backward runs L-1 .. 0
        else
          for (int k = l + 1; k < L; ++k)
            window += sr.prev_t[k].forward;
        if (cfg.double_buffer)
          for (int k = 0; k < L; ++k)
            window += sr.prev_t[k].forward + sr.prev_t[k].backward;
      }
      release[l] = fwd_prefix[l] - window;
      for (int g = 0; g < G; ++g)
        work[static_cast<std::size_t>(g) * L + l] =
            shared_link_seconds(cur[l].move_demand[g] + cur[l].grad_demand[g], a2a_share);
    }
    // A late layer delays the rest of the micro-step (and the later deadlines) by its lateness, so the
    // stall is the largest lateness of any GPU's queue.
    double stall = 0;
    for (int g = 0; g < G; ++g)
      stall =
          std::max(stall, edf_max_lateness(release, std::span<const double>(fwd_prefix).first(L),
                                           std::span<const double>(work).subspan(static_cast<std::size_t>(g) * L, L)));
    return stall;
  }

  /// Extra all-to-all seconds per second of it while the busiest GPU's link also carries its moves and gradient
  /// returns (`work`), with two-way link sharing.
  [[nodiscard]] double a2a_yield_of(const std::vector<double> &work, double layer_time, double a2a_time) const {
    // Both ways: while a GPU's link carries its moves and gradient returns the all-to-all gets half of it, so
    // it needs `a2a / (1 - sigma / 2)`, `sigma` the share of the micro-step the busiest GPU's link carries them
    // (the same fair-share rule as `shared_link_seconds`; the all-to-all ends with its slowest GPU).
    double a2a_yield = 0; // extra all-to-all seconds per second of it
    if (cfg.two_way_link_sharing && layer_time > 0 && a2a_time > 0) {
      double sigma = 0;
      for (int g = 0; g < G; ++g) {
        double busy = 0;
        for (int l = 0; l < L; ++l)
          busy += work[static_cast<std::size_t>(g) * L + l];
        sigma = std::max(sigma, std::min(1.0, busy / layer_time));
      }
      a2a_yield = sigma / (2.0 - sigma);
    }
    return a2a_yield;
  }

  /// Fills `layer_times` (each layer's time, its all-to-all's yield added) and the layers' `parts`; returns their sum.
  double sum_layers(const std::vector<LayerTiming> &cur, double a2a_yield, std::vector<double> &layer_times,
                    SimBreakdown &parts, GroupStep &rec) const {
    double micro = 0;
    for (int l = 0; l < L; ++l) {
      const double yield = cur[l].a2a_link * a2a_yield;
      layer_times[l] = cur[l].forward + cur[l].backward + yield;
      micro += layer_times[l];
      parts.expert_compute += cur[l].expert;
      parts.all_to_all += cur[l].a2a + yield;
      parts.dense += cur[l].dense;
      parts.tp_comm += cur[l].tp;
      rec.a2a_hidden += cur[l].a2a_hidden;
    }
    return micro;
  }

  /// With a pipeline: scales the micro-step's `parts`, `stall` and `micro` to its slowest stage's share of the
  /// chain, then adds the activations' sends between stages.
  void pipeline_share(const std::vector<double> &layer_times, double head, double tokens, bool update,
                      SimBreakdown &parts, double &stall, double &micro) const {
    // Pipeline: each stage runs its own layers (the LM head on the last); the slowest stage sets the
    // micro-step. Its share of the whole chain scales every part, stall included (an approximation: the move
    // windows were timed over the whole chain). Then the stage receives the activations from the previous
    // stage (and, in the update stage, sends their gradients back).
    double whole = head, slowest = 0;
    for (int l = 0; l < L; ++l)
      whole += layer_times[l];
    for (int st = 0; st < PP; ++st) {
      double t_st = st == PP - 1 ? head : 0.0;
      for (int l = cfg.stage_first_layer(st); l < cfg.stage_first_layer(st + 1); ++l)
        t_st += layer_times[l];
      slowest = std::max(slowest, t_st);
    }
    const double f = whole > 0 ? slowest / whole : 1.0;
    for (double *part :
         {&parts.expert_compute, &parts.all_to_all, &parts.dense, &parts.lm_head, &parts.stall, &parts.tp_comm})
      *part *= f;
    stall *= f;
    micro *= f;
    const double p2p = cfg.pipeline_p2p_seconds(tokens / G) * (update ? 2.0 : 1.0);
    parts.pipeline += p2p;
    micro += p2p;
  }

  /// Simulates the stage's micro-step `m` (the loads' `m0 + m`): routes, layers, memory, stall, parts, pipeline
  /// share and planner time, charged to `rec`; hands its timings to the next micro-step.
  void run_micro_step(StageRun &sr, const LoadTensor &step, int m, int m0, GroupStep &rec) {
    const double tokens = tokens_of(m0 + m);
    std::vector<LayerTiming> cur = time_layers(sr, m, tokens, rec);
    const SimMemory mem = memory_of(sr.sp.micro_steps[m], tokens);
    if (mem.total() > rec.memory.total()) rec.memory = mem;
    // Windows: from the slot's last use in m - 1 to layer l's forward in m.
    std::vector<double> fwd_prefix(static_cast<std::size_t>(L) + 1, 0.0);
    for (int l = 0; l < L; ++l)
      fwd_prefix[l + 1] = fwd_prefix[l] + cur[l].forward;
    // The all-to-all's share of the micro-step's time: moves share NVLink, the NIC and PCIe with it.
    double a2a_time = 0, layer_time = 0;
    for (const LayerTiming &lt : cur) {
      a2a_time += lt.a2a_link;
      layer_time += lt.forward + lt.backward;
    }
    const double a2a_share = layer_time > 0 ? std::min(1.0, a2a_time / layer_time) : 0.0;
    std::vector<double> work(static_cast<std::size_t>(L) * G);
    double stall = stall_of(cur, sr, fwd_prefix, a2a_share, work);
    const double a2a_yield = a2a_yield_of(work, layer_time, a2a_time);
    std::vector<double> layer_times(static_cast<std::size_t>(L));
    SimBreakdown parts;
    double micro = sum_layers(cur, a2a_yield, layer_times, parts, rec);
    parts.stall = stall;
    // The LM head after the last layer's forward (and its backward before the first layer's backward); the
    // move windows do not count it.
    const double head = cfg.lm_head_forward_seconds(tokens / G) * (sr.update ? 1 + cfg.cost.backward_factor : 1.0);
    parts.lm_head = head;
    sr.last_a2a_share = a2a_share;
    micro += stall + head;
    if (PP > 1) pipeline_share(layer_times, head, tokens, sr.update, parts, stall, micro);
    rec.parts += parts;
    rec.micro.push_back(parts);
    rec.stall += stall;
    sr.time += micro;
    // Planning: an equal share of the stage's planner time per micro-step. The first micro-step's plan is on
    // the critical path; with overlap, micro-step m + 1's plan runs while m executes (`micro`), so only what
    // exceeds it is; without, every share is.
    const int M = step.num_micro_steps();
    const double share = sr.planner_seconds / M;
    if (m == 0) rec.planner_critical += share;
    if (m + 1 < M) rec.planner_critical += cfg.planner_overlap ? std::max(0.0, share - micro) : share;
    rec.layers.push_back(std::move(layer_times));
    sr.prev_t = std::move(cur);
    sr.prev_plans = &sr.sp.micro_steps[m];
  }

  /// Closes a stage of `M` micro-steps: pipeline bubble, held gradients, dp gradient sync, optimizer and mirror
  /// refresh (update stage); adds its time to `rec` (its final placement was kept resident by `begin_step`).
  void close_stage(StageRun &sr, int M, GroupStep &rec) {
    if (PP > 1 && M > 0) add_bubble(sr, M, rec);
    if (sr.update && sr.prev_plans != nullptr && !sr.prev_t.empty()) return_held_gradients(sr, rec);
    if (sr.update && num_copies > 1 && !sr.prev_t.empty()) dp_grad_sync(sr, rec);
    if (sr.update) {
      const double opt = optimizer_seconds();
      sr.time += opt;
      rec.parts.optimizer += opt;
      // After each optimizer step every GPU copies its owned experts' new weights to the node's pinned
      // mirror over its PCIe link, before the next mini-batch may read them; only strategies that read
      // the mirror pay it.
      if (sr.used_mirror) {
        const double owned = static_cast<double>(topo.owners_per_gpu(E)) * stage_layers * expert_bytes;
        const double refresh = cfg.minibatches_per_step * move_seconds(cfg.cost.move, MovePath::pcie, owned);
        sr.time += refresh;
        rec.mirror += refresh;
        rec.parts.moves += refresh;
      }
      rec.update += sr.time;
    } else {
      rec.recompute += sr.time;
    }
  }

  /// Adds the stage's 1F1B pipeline bubble over `M` micro-steps to its time and `rec`.
  void add_bubble(StageRun &sr, int M, GroupStep &rec) const {
    // The 1F1B bubble: (PP - 1) / m of the pipeline's ideal time for m micro-batches per pipeline flush (one
    // flush per optimizer step in the update stage, one per forward pass in the recompute; Narayanan et al.
    // 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
    // arXiv:2104.04473, sec. 2.2).
    const double m_per_flush = sr.update ? static_cast<double>(M) / cfg.minibatches_per_step : M;
    const double bubble = sr.time * (PP - 1) / m_per_flush;
    sr.time += bubble;
    rec.parts.pipeline += bubble;
  }

  /// Returns the gradients still owed at the end of the update stage; adds what outlasts the backward as stall.
  void return_held_gradients(StageRun &sr, GroupStep &rec) {
    // The gradients still owed (the replicas resident at the end of the stage, whichever micro-steps they ran)
    // return before the optimizer step: layer l's once its last backward is over (backward runs L-1 .. 0), queued
    // per GPU; what outlasts the backward pass is stall.
    double tail = 0;
    std::vector<std::vector<double>> demand(static_cast<std::size_t>(L), std::vector<double>(G, 0.0));
    for (int l = 0; l < L; ++l)
      rec.grad += return_gradients(l, nullptr, demand[l]);
    for (int g = 0; g < G; ++g) {
      double ready = 0, finish = 0;
      for (int l = L - 1; l >= 0; --l) {
        ready += sr.prev_t[l].backward;
        finish = std::max(finish, ready) + demand[l][g];
      }
      tail = std::max(tail, finish - ready);
    }
    rec.grad_tail += tail;
    rec.stall += tail;
    rec.parts.stall += tail;
    rec.micro.back().stall += tail;
    sr.time += tail;
  }

  /// Adds the exposed part of the data-parallel copies' gradient all-reduce to the stage's time and `rec`.
  void dp_grad_sync(StageRun &sr, GroupStep &rec) const {
    // Before each optimizer step the copies all-reduce their owned experts' gradients (ring: 2 (n - 1) / n of
    // the bytes each way per GPU, 2 (n - 1) steps; the copies of a GPU's experts sit on other nodes unless
    // the cluster is one node), one bucket per layer. `dp_grad_overlap` of it may run under the last
    // micro-step's backward: layer l's bucket once its backward is over (L-1 .. 0), queued on the link it
    // shares with that micro-step's all-to-all; what outlasts the backward is exposed.
    const MovePath path = cfg.stage_gpus() > cfg.topo.gpus_per_node ? MovePath::network : MovePath::nvlink;
    const PathParams &link = path_params(cfg.cost.move, path);
    const double n = num_copies;
    const double bucket = 2.0 * (n - 1) * link.latency_us * 1e-6 +
                          2.0 * (n - 1) / n * owners_per_gpu * grad_bytes_per_expert / (link.gb_per_s * 1e9);
    const double serial = stage_layers * bucket; // a stage's layers (the largest stage's)
    double ready = 0, finish = 0;
    for (int l = stage_layers - 1; l >= 0; --l) {
      ready += sr.prev_t[l].backward;
      finish = std::max(finish, ready) + shared_link_seconds(bucket, sr.last_a2a_share);
    }
    const double overlapped = std::min(serial, finish - ready);
    const double exposed =
        cfg.minibatches_per_step * ((1 - cfg.dp_grad_overlap) * serial + cfg.dp_grad_overlap * overlapped);
    sr.time += exposed;
    rec.parts.dp_grad_sync += exposed;
  }

  /// Seconds of the optimizer steps of one RL step on a GPU (its owned experts, dense parts, embedding and head).
  [[nodiscard]] double optimizer_seconds() const {
    // Every GPU steps its parameters: owned experts, the dense parts of every layer, embedding and LM head;
    // with a pipeline those of its stage (the largest; the embedding on the first stage, the head on the last),
    // the dense part, embedding and head split over the TP group.
    const double T = cfg.tensor_parallel;
    const double params = static_cast<double>(owners_per_gpu) * stage_layers * expert_params +
                          stage_layers * cfg.dense.params / T +
                          (PP > 1 ? 1.0 : 2.0) * cfg.dense.vocab * spec.hidden / T;
    // Offloaded, ZeRO-Offload partitions the optimizer state and gradients over the data-parallel ranks (it
    // builds on ZeRO-2: Ren et al. 2021, sec. 4): a GPU steps a `num_copies`-th of its owned experts (their
    // EP-group copies) and a `stage_gpus / T`-th (the attention DP ranks) of the dense part, embedding and head.
    const double dense_dp = static_cast<double>(cfg.stage_gpus()) / T;
    const double offload_params =
        static_cast<double>(owners_per_gpu) * stage_layers * expert_params / num_copies +
        (stage_layers * cfg.dense.params / T + (PP > 1 ? 1.0 : 2.0) * cfg.dense.vocab * spec.hidden / T) / dense_dp;
    return (cfg.optimizer_offload ? cfg.offloaded_optimizer_step_seconds(offload_params)
                                  : cfg.optimizer_step_seconds(params)) *
           cfg.minibatches_per_step;
  }
};

/// Simulates one EP group (`topo` is the group's topology, `loads` its own tokens) under `strat`, every RL step
/// cut by `step_offsets`; `step_done` is called after each step.
[[nodiscard]] inline std::vector<GroupStep> simulate_group(const SimConfig &cfg, const Topology &topo,
                                                           const LoadTensor &loads,
                                                           std::span<const std::int64_t> step_offsets,
                                                           const SimStrategy &strat,
                                                           const std::function<void()> &step_done) {
  GroupSim sim(cfg, topo, loads, strat);
  const int num_steps = static_cast<int>(step_offsets.size() - 1);
  std::vector<GroupStep> out;
  out.reserve(static_cast<std::size_t>(num_steps));
  for (int s = 0; s < num_steps; ++s) {
    out.push_back(sim.run_step(static_cast<int>(step_offsets[s]), static_cast<int>(step_offsets[s + 1])));
    if (step_done) step_done();
  }
  return out;
}

/// Simulates one EP group over all GPUs (`topo`, `loads`) under every strategy with the all-to-all counted from the
/// routed ids (`SimConfig::a2a_hits` ids): each micro-step is routed once (`routes`) and counted under every
/// strategy's plan of every stage, so the strategies run side by side, a step at a time (each strategy's own
/// state is its `GroupSim`'s, as in `simulate_group`; the results are the same). Memory: one micro-step's routed
/// ids (`tokens x layers x topk` int16, at most 2^31 ids: `SyntheticMicroSteps::route` refuses more, naming the
/// size), its `layers x experts x GPUs` counts per source rank, one `[tokens][topk]` slot buffer per thread, and
/// each strategy's plans of one step. A layer's plans that are equal (same copies, same rows per slot: e.g. a
/// strategy whose recompute and update plans agree) are counted once.
[[nodiscard]] inline std::vector<std::vector<GroupStep>>
simulate_counted(const SimConfig &cfg, const Topology &topo, const LoadTensor &loads,
                 std::span<const std::int64_t> step_offsets, std::span<const SimStrategy> strategies,
                 const std::function<void()> &step_done, const MicroStepRoutes &routes) {
  const int G = topo.num_gpus(), L = loads.num_layers(), E = loads.num_experts(), K = cfg.model.topk;
  std::vector<std::unique_ptr<GroupSim>> sims;
  for (const SimStrategy &strat : strategies)
    sims.push_back(std::make_unique<GroupSim>(cfg, topo, loads, strat));
  ThreadPool pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  struct Scratch {
    std::vector<std::int32_t> slots;
  };
  std::vector<Scratch> scratch(static_cast<std::size_t>(pool.num_threads()));
  std::vector<std::vector<std::int64_t>> source_loads(static_cast<std::size_t>(L));
  RoutedMicroStep rm;
  // Routes micro-step `m` into `dst` and checks its shape.
  const auto route = [&](int m, RoutedMicroStep &dst) {
    routes(m, dst);
    const double tokens = static_cast<double>(loads.layer_total(m, 0)) / K;
    require(dst.source_offsets.size() == static_cast<std::size_t>(G) + 1 && dst.source_offsets.front() == 0 &&
                static_cast<double>(dst.source_offsets.back()) == tokens &&
                dst.ids.size() == static_cast<std::size_t>(dst.source_offsets.back()) * L * K,
            "simulate: the routes of micro-step ", m, " hold ", dst.ids.size(), " ids over ", dst.source_offsets.size(),
            " source offsets; expected ", tokens, " tokens x ", L, " layers x top-", K, " over ", G + 1);
    for (int r = 0; r < G; ++r)
      require(dst.source_offsets[r + 1] >= dst.source_offsets[r], "simulate: the routes of micro-step ", m,
              ": source offsets decrease at rank ", r);
  };
  // Traffic-aware strategies (`SimConfig::traffic`) plan a step's owners from its co-activation, which is known
  // only once the step is routed: then the step's micro-steps are routed first (once each, the co-activation
  // counted as they are) and held until every strategy has planned and counted them.
  const bool any_traffic = std::any_of(sims.begin(), sims.end(), [](const auto &sim) { return sim->traffic_aware(); });
  std::vector<RoutedMicroStep> step_routes;
  CoActivation co;
  const int num_steps = static_cast<int>(step_offsets.size() - 1);
  std::vector<std::vector<GroupStep>> out(sims.size());
  for (int s = 0; s < num_steps; ++s) {
    const int m0 = static_cast<int>(step_offsets[s]), m1 = static_cast<int>(step_offsets[s + 1]);
    double co_seconds = 0;
    if (any_traffic) {
      step_routes.assign(static_cast<std::size_t>(m1 - m0), RoutedMicroStep{});
      std::int64_t step_tokens = 0;
      for (int m = m0; m < m1; ++m)
        step_tokens += loads.layer_total(m, 0) / K;
      const std::int64_t every = cfg.traffic.every(step_tokens);
      co.num_layers = L;
      co.num_experts = E;
      co.pairs.assign(static_cast<std::size_t>(L) * E * E, 0);
      co.loads.assign(static_cast<std::size_t>(L) * E, 0);
      for (int m = m0; m < m1; ++m) {
        RoutedMicroStep &r = step_routes[static_cast<std::size_t>(m - m0)];
        route(m, r);
        // Every `every`-th token of each micro-step's layers, each layer on a thread (timed: planning work).
        const auto t0 = std::chrono::steady_clock::now();
        const std::int64_t T = r.source_offsets.back();
        pool.parallel_for(static_cast<std::size_t>(L), [&](std::size_t li, int) {
          const std::span<const std::int16_t> ids(r.ids.data() + li * static_cast<std::size_t>(T) * K,
                                                  static_cast<std::size_t>(T) * K);
          const CoActivation one = count_coactivation(RoutedView(ids, T, 1, K), E, 0, -1, {}, every);
          std::int64_t *pairs = co.pairs.data() + li * static_cast<std::size_t>(E) * E;
          for (std::size_t i = 0; i < one.pairs.size(); ++i)
            pairs[i] += one.pairs[i];
          std::int64_t *ld = co.loads.data() + li * static_cast<std::size_t>(E);
          for (std::size_t i = 0; i < one.loads.size(); ++i)
            ld[i] += one.loads[i];
        });
        co_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
    }
    for (auto &sim : sims) {
      if (sim->traffic_aware()) sim->set_coactivation(&co, co_seconds);
      sim->begin_step(m0, m1);
      sim->expect_counted();
    }
    for (int m = m0; m < m1; ++m) {
      if (!any_traffic) route(m, rm);
      const RoutedMicroStep &rs = any_traffic ? step_routes[static_cast<std::size_t>(m - m0)] : rm;
      const std::int64_t T = rs.source_offsets.back();
      pool.parallel_for(static_cast<std::size_t>(L), [&](std::size_t li, int w) {
        const int l = static_cast<int>(li);
        const std::span<const std::int16_t> ids(rs.ids.data() + li * static_cast<std::size_t>(T) * K,
                                                static_cast<std::size_t>(T) * K);
        // The layer's tokens per (expert, source rank), once for every strategy; they must be the loads'.
        std::vector<std::int64_t> &sl = source_loads[li];
        sl.assign(static_cast<std::size_t>(E) * G, 0);
        for (int r = 0; r < G; ++r)
          for (std::int64_t t = rs.source_offsets[r]; t < rs.source_offsets[r + 1]; ++t)
            for (int k = 0; k < K; ++k) {
              const int e = ids[static_cast<std::size_t>(t) * K + k];
              require(e >= 0 && e < E, "simulate: routed id ", e, " of micro-step ", m, " layer ", l, " token ", t,
                      " is not an expert of ", E);
              ++sl[static_cast<std::size_t>(e) * G + r];
            }
        const auto expert_loads = loads.layer(m, l);
        for (int e = 0; e < E; ++e) {
          std::int64_t n = 0;
          for (int r = 0; r < G; ++r)
            n += sl[static_cast<std::size_t>(e) * G + r];
          require(n == expert_loads[e], "simulate: the routed ids of micro-step ", m, " layer ", l, " give expert ", e,
                  " ", n, " tokens, the loads ", expert_loads[e], " (routes and loads of different batches)");
        }
        // Every (strategy, stage) plan of the layer, an equal plan counted once.
        std::vector<std::pair<const LayerPlan *, LayerA2a>> done;
        for (auto &sim : sims)
          for (int pass = 0; pass < sim->num_stages(); ++pass) {
            const LayerPlan &lp = sim->stage_plan(pass, m - m0, l);
            std::vector<LayerA2a> &dst = sim->counted_a2a(pass, m - m0);
            const auto same = std::find_if(done.begin(), done.end(), [&](const auto &d) {
              const LayerPlacement &a = d.first->placement, &b = lp.placement;
              return a.num_gpus() == b.num_gpus() && a.slots_per_gpu() == b.slots_per_gpu() &&
                     a.num_experts() == b.num_experts() && std::ranges::equal(a.phys_to_log(), b.phys_to_log()) &&
                     d.first->slot_tokens == lp.slot_tokens;
            });
            LayerA2a cost;
            if (same != done.end()) {
              cost = same->second;
            } else {
              cost = sim->count_layer(lp, ids, rs.source_offsets, sl, scratch[static_cast<std::size_t>(w)].slots);
              done.emplace_back(&lp, cost);
            }
            dst[li] = cost;
          }
      });
    }
    for (std::size_t i = 0; i < sims.size(); ++i) {
      out[i].push_back(sims[i]->finish_step());
      if (step_done) step_done();
    }
  }
  return out;
}

} // namespace detail

/// Whether a strategy's peak memory fits one GPU (`SimConfig::gpu_memory_gb`).
[[nodiscard]] inline bool memory_fits(const SimConfig &cfg, const SimMemory &peak) noexcept {
  return peak.total() <= cfg.gpu_memory_gb * 1e9;
}

/// Why `res` does not fit: its peak, part by part, against `SimConfig::gpu_memory_gb`.
[[nodiscard]] inline std::string memory_refusal(const SimConfig &cfg, const SimResult &res) {
  const SimMemory &pk = res.memory;
  std::string parts;
  for (const MemoryPart &p : memory_parts)
    parts += detail::concat(parts.empty() ? "" : ", ", p.label, " ", pk.*p.field * 1e-9, " GB");
  return detail::concat("simulate: strategy ", res.strategy, " needs ", pk.total() * 1e-9, " GB on GPU ", pk.gpu,
                        " of its EP group",
                        cfg.pipeline_stages > 1 ? detail::concat(" in pipeline stage ", pk.stage) : "", " (", parts,
                        "), more than sim.gpu_memory_gb = ", cfg.gpu_memory_gb,
                        " GB; use more GPUs, fewer slots, sim.optimizer_offload, more sim.tensor_parallel or "
                        "sim.pipeline_stages, or a larger sim.gpu_memory_gb");
}

/// Simulates `loads` (micro-steps of consecutive RL steps cut by `step_offsets`, `[S + 1]` micro-step offsets;
/// empty = one step) under each strategy. The first `cfg.warmup_steps` steps are simulated but not counted, so
/// there must be at least one more step than that. `progress`, if set, is called with (done, total) planning
/// units (strategy x EP group x step). A strategy whose peak memory exceeds one GPU's is an error naming its parts
/// unless `check_memory` is false (the deployment search, which reports it as not fitting, `memory_fits`).
/// `routes` gives each micro-step's routed ids when `cfg.a2a_hits` is `ids` (and must be empty otherwise); their
/// counts must equal the loads'.
[[nodiscard]] inline std::vector<SimResult> simulate(const SimConfig &cfg, const LoadTensor &loads,
                                                     std::span<const std::int64_t> step_offsets,
                                                     std::span<const SimStrategy> strategies,
                                                     const std::function<void(int, int)> &progress = {},
                                                     bool check_memory = true, const MicroStepRoutes &routes = {}) {
  cfg.validate();
  loads.validate();
  const ModelSpec &spec = cfg.model;
  detail::require(loads.num_layers() == spec.num_layers && loads.num_experts() == spec.num_experts,
                  "simulate: loads are ", loads.num_layers(), " layers x ", loads.num_experts(),
                  " experts, the model has ", spec.num_layers, " x ", spec.num_experts);
  detail::require(loads.num_micro_steps() > 0, "simulate: no micro-steps to simulate");
  std::vector<std::int64_t> whole;
  if (step_offsets.empty()) {
    whole = {0, loads.num_micro_steps()};
    step_offsets = whole;
  }
  detail::require(step_offsets.size() >= 2 && step_offsets.front() == 0 &&
                      step_offsets.back() == loads.num_micro_steps(),
                  "simulate: step offsets must run from 0 to ", loads.num_micro_steps());
  for (std::size_t s = 1; s < step_offsets.size(); ++s)
    detail::require(step_offsets[s] > step_offsets[s - 1], "simulate: step ", s - 1, " has no micro-steps");
  const int num_steps = static_cast<int>(step_offsets.size() - 1);
  detail::require(num_steps > cfg.warmup_steps, "simulate: ", num_steps,
                  num_steps == 1 ? " RL step leaves" : " RL steps leave", " no counted step after ", cfg.warmup_steps,
                  " warm-up step", cfg.warmup_steps == 1 ? "" : "s", " (sim.warmup_steps): give at least ",
                  cfg.warmup_steps + 1, " steps or fewer warm-up steps");
  const int counted = num_steps - cfg.warmup_steps;
  const int ep = cfg.effective_ep_size();
  const Topology group_topo = ep_group_topology(cfg.topo, ep);
  // The EP groups of one pipeline stage (every stage runs every micro-batch; the stages are timed together, see
  // `simulate_group`): the whole cluster without a pipeline.
  const int num_groups = cfg.stage_gpus() / ep;
  if (cfg.a2a_hits == A2aHitsSource::ids) {
    detail::require(cfg.pipeline_stages == 1 && cfg.tensor_parallel == 1,
                    "simulate: sim.a2a_hits = ids needs sim.pipeline_stages 1 and sim.tensor_parallel 1, got ",
                    cfg.pipeline_stages, " and ", cfg.tensor_parallel);
    detail::require(static_cast<bool>(routes), "simulate: sim.a2a_hits = ids counts the all-to-all from the routed ids "
                                               "of every micro-step, and none were given (a synthetic batch has them)");
    detail::require(num_groups == 1, "simulate: sim.a2a_hits = ids needs one EP group over all ", cfg.topo.num_gpus(),
                    " GPUs, got EP size ", ep);
    detail::require(cfg.cost.a2a.model == A2aModel::hierarchical,
                    "simulate: sim.a2a_hits = ids counts the hierarchical all-to-all; cost.a2a_model is ",
                    to_string(cfg.cost.a2a.model));
  } else {
    detail::require(!routes, "simulate: routed ids were given but sim.a2a_hits is independent");
  }
  std::vector<LoadTensor> split;
  if (num_groups > 1) split = detail::split_loads_by_group(loads, num_groups);
  auto group_loads = [&](int i) -> const LoadTensor & { return num_groups > 1 ? split[i] : loads; };

  const int total_units = static_cast<int>(strategies.size()) * num_groups * num_steps;
  int done_units = 0;
  const std::function<void()> step_done = [&] {
    if (progress) progress(++done_units, total_units);
  };

  // Counted all-to-alls: every strategy side by side, each micro-step routed once (one EP group).
  std::vector<std::vector<detail::GroupStep>> counted_runs;
  if (routes)
    counted_runs = detail::simulate_counted(cfg, group_topo, loads, step_offsets, strategies, step_done, routes);
  std::vector<SimResult> results;
  for (std::size_t si = 0; si < strategies.size(); ++si) {
    const SimStrategy &strat = strategies[si];
    std::vector<std::vector<detail::GroupStep>> runs;
    runs.reserve(static_cast<std::size_t>(num_groups));
    if (routes)
      runs.push_back(std::move(counted_runs[si]));
    else
      for (int i = 0; i < num_groups; ++i)
        runs.push_back(detail::simulate_group(cfg, group_topo, group_loads(i), step_offsets, strat, step_done));
    SimResult res;
    res.strategy = strat.name;
    res.min_experts_per_gpu = std::numeric_limits<int>::max();
    std::vector<double> imbalance;
    double total_recompute = 0, total_update = 0, total_extra = 0, total_stall = 0, total_moved = 0, total_grad = 0,
           total_mirror = 0, total_planner_critical = 0, total_grad_tail = 0, total_a2a_hidden = 0, total_inter = 0;
    for (int i = 0; i < num_groups; ++i)
      for (const detail::GroupStep &g : runs[i])
        if (g.memory.total() > res.memory.total()) res.memory = g.memory;
    for (int s = cfg.warmup_steps; s < num_steps; ++s) {
      // The copies meet at the optimizer step: the step takes as long as its slowest copy.
      int slow = 0;
      for (int i = 1; i < num_groups; ++i)
        if (runs[i][s].seconds() > runs[slow][s].seconds()) slow = i;
      const detail::GroupStep &w = runs[slow][s];
      total_recompute += w.recompute;
      total_update += w.update;
      total_extra += w.extra;
      total_stall += w.stall;
      total_mirror += w.mirror;
      total_planner_critical += w.planner_critical;
      total_grad_tail += w.grad_tail;
      total_a2a_hidden += w.a2a_hidden;
      res.step_breakdown.push_back(w.parts);
      res.breakdown += w.parts;
      res.micro_breakdown.insert(res.micro_breakdown.end(), w.micro.begin(), w.micro.end());
      res.layer_seconds.insert(res.layer_seconds.end(), w.layers.begin(), w.layers.end());
      res.layer_imbalance.insert(res.layer_imbalance.end(), w.imbalance.begin(), w.imbalance.end());
      res.gpu_loads.insert(res.gpu_loads.end(), w.gpu_loads.begin(), w.gpu_loads.end());
      for (int i = 0; i < num_groups; ++i) {
        const detail::GroupStep &g = runs[i][s];
        total_moved += g.moved; // volumes: the whole cluster
        total_grad += g.grad;
        total_inter += g.inter_node;
        res.planner_seconds += g.planner;
        res.min_experts_per_gpu = std::min(res.min_experts_per_gpu, g.min_experts);
        for (const std::vector<double> &row : g.imbalance)
          imbalance.insert(imbalance.end(), row.begin(), row.end());
      }
    }
    const BalanceStats balance = balance_stats(std::move(imbalance));
    res.imbalance_median = balance.median;
    res.imbalance_p99 = balance.p99;
    res.recompute_seconds = total_recompute / counted;
    res.update_seconds = total_update / counted;
    res.step_seconds = (total_recompute + total_update + total_extra) / counted;
    res.moved_gb = total_moved / counted * 1e-9;
    res.grad_gb = total_grad / counted * 1e-9;
    res.inter_node_gb = total_inter / counted * 1e-9;
    res.stall_seconds = total_stall / counted;
    res.mirror_seconds = total_mirror / counted;
    const double all_experts = static_cast<double>(cfg.model.num_experts) * cfg.model.num_layers;
    res.memory.host_mirror_per_node =
        total_mirror > 0 ? all_experts * static_cast<double>(cfg.model.bytes_per_expert()) : 0.0;
    res.planner_critical_seconds = total_planner_critical / counted;
    res.grad_tail_seconds = total_grad_tail / counted;
    res.a2a_hidden_seconds = total_a2a_hidden / counted;
    if (check_memory && !memory_fits(cfg, res.memory)) throw Error(memory_refusal(cfg, res)); // built only then
    for (double *part :
         {&res.breakdown.expert_compute, &res.breakdown.all_to_all, &res.breakdown.dense, &res.breakdown.lm_head,
          &res.breakdown.moves, &res.breakdown.stall, &res.breakdown.dp_grad_sync, &res.breakdown.optimizer,
          &res.breakdown.tp_comm, &res.breakdown.pipeline})
      *part /= counted;
    results.push_back(std::move(res));
  }
  // The rollout, the same for every strategy: `rollout_seconds`, or its share of the unbalanced (static) step.
  double reference = 0;
  for (const SimResult &r : results)
    reference = std::max(reference, r.step_seconds);
  for (const SimResult &r : results)
    if (r.strategy == "static") reference = r.step_seconds;
  for (SimResult &r : results) {
    r.rollout_seconds = cfg.rollout_time(reference);
    r.end_to_end_seconds = r.step_seconds + r.rollout_seconds;
  }
  return results;
}

} // namespace v0
} // namespace foremoe
