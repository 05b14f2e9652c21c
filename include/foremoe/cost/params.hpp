#pragma once
/// @file
/// Every cost-model parameter in one struct, with defaults for an H200 SXM cluster of 8-GPU nodes and one
/// 400 Gb/s NIC per GPU. Units: seconds inside the models; the struct stores human units (us, GB/s,
/// TFLOP/s, TB/s; 1 GB = 1e9 bytes). The move paths and their parameters are in `move.hpp`.

#include <cmath>
#include <cstdint>
#include <string_view>

#include "foremoe/core/error.hpp"
#include "foremoe/cost/move.hpp"

namespace foremoe {
inline namespace v0 {

/// Grouped expert GEMM on one GPU (see `expert_compute.hpp` for the formula):
/// `t = launch + per_expert * active + scan * scanned_rows * hidden
///      + max(active * expert_bytes / (hbm * hbm_eff),
///            (sum_e pad(n_e) + n_half * active) * flops_per_token / (peak(dtype) * compute_eff))`,
/// `n_e` the tokens of active expert e, `pad(n)` = n rounded up to a multiple of `tile_m` (`+` instead of
/// `max` when `overlap` is false).
/// Efficiencies, launch, per-expert and scan terms are the fit on the measured SGLang fused-MoE latencies
/// (shared/data/h200-moe-latency.csv, Qwen3-30B-A3B shape, bf16, all 3,078 rows: balanced and power-law, the
/// latter with rank 0's expected per-expert counts from `power_law_rank0_counts`; median relative error
/// 12.3%, p90 25.5%; with 9 of 38 (tp, ep) pairs held out: held-out median 12.8%, p90 28.8%, see
/// tests/test_cost.cpp); the fit's grids chose the sum form, n_half 0 and no tile padding, so a GPU's
/// small-batch penalty is its per-active-expert weight streaming and per-expert time. Peaks are datasheet
/// figures.
struct ExpertGemmParams {
  double peak_tflops_bf16 = 989.0;   ///< H200 SXM dense bf16/fp16 tensor peak (NVIDIA datasheet)
  double peak_tflops_fp8 = 1979.0;   ///< H200 SXM dense fp8 tensor peak (datasheet); fp32 uses bf16 / 2 (TF32)
  double hbm_tb_per_s = 4.8;         ///< H200 HBM3e bandwidth (datasheet)
  double compute_efficiency = 0.577; ///< achieved fraction of the tensor peak at large token counts (fit)
  double hbm_efficiency = 0.996;     ///< achieved fraction of HBM bandwidth streaming expert weights (fit)
  double launch_us = 25.8;           ///< fixed time of one grouped-GEMM call (kernel launches, routing) (fit)
  double per_expert_us = 0.147;      ///< fixed time per active expert (tile scheduling) (fit)
  /// Time per hidden element of every token-expert row the kernel scans, in picoseconds (routing, gather,
  /// top-k weighted sum); SGLang's Triton EP path visits the rows routed to non-local experts too, which
  /// is how the fit separates it. (fit)
  double scan_ps_per_element = 2.22;
  /// true: weight streaming and math overlap (`max`), false: they add (`+`). (chosen by the fit)
  bool overlap = false;
  /// Tokens per expert at which the GEMM reaches half its large-batch efficiency. Its penalty,
  /// n_half * flops_per_token per active expert, has the same form as weight streaming, so a fit on one
  /// dtype cannot tell them apart; kept 0 by default (folded into `hbm_efficiency`).
  double n_half = 0.0;
  /// Rows per tile of the grouped GEMM: every expert's token count is padded up to a multiple of it (SGLang's
  /// fused MoE aligns each expert's rows to BLOCK_SIZE_M, `moe_align_block_size`), the small-M inefficiency of
  /// a GPU whose experts get few tokens each. 0: no padding. (the fit tried 0, 16, 32, 64, 128 and chose 0)
  double tile_m = 0.0;

  void validate() const {
    auto pos = [](double v, const char *name) {
      detail::require(std::isfinite(v) && v > 0, "CostParams.gemm: ", name, " must be positive and finite, got ", v);
    };
    auto nonneg = [](double v, const char *name) {
      detail::require(std::isfinite(v) && v >= 0, "CostParams.gemm: ", name, " must be >= 0 and finite, got ", v);
    };
    pos(peak_tflops_bf16, "peak_tflops_bf16");
    pos(peak_tflops_fp8, "peak_tflops_fp8");
    pos(hbm_tb_per_s, "hbm_tb_per_s");
    pos(compute_efficiency, "compute_efficiency");
    pos(hbm_efficiency, "hbm_efficiency");
    nonneg(launch_us, "launch_us");
    nonneg(per_expert_us, "per_expert_us");
    nonneg(n_half, "n_half");
    nonneg(scan_ps_per_element, "scan_ps_per_element");
    nonneg(tile_m, "tile_m");
  }
};

/// Attention and the dense (non-routed) parts of a layer: per-token time, balanced across GPUs.
struct DenseParams {
  /// Forward seconds-per-token in us of attention + dense parts of one layer on one GPU. Default: a
  /// Qwen3-30B-A3B layer (~0.4 GFLOP/token for QKV/O projections, router and attention at 4k context) at
  /// ~40% of the bf16 peak ~ 1 us per token.
  double per_token_us = 1.0;
  double launch_us = 30.0; ///< fixed time of the dense part of one layer (kernel launches)

  void validate() const {
    detail::require(std::isfinite(per_token_us) && per_token_us >= 0,
                    "CostParams.dense: per_token_us must be >= 0 and finite, got ", per_token_us);
    detail::require(std::isfinite(launch_us) && launch_us >= 0,
                    "CostParams.dense: launch_us must be >= 0 and finite, got ", launch_us);
  }
};

/// How dispatch and combine are timed (see `comm.hpp`).
enum class A2aModel : std::uint8_t {
  /// DeepEP-style: a token crosses to each remote node that holds one of its experts once (over the
  /// sending GPU's NIC, to the GPU of the same local index), then fans out over NVLink; per-GPU
  /// deduplication inside a node; latency per peer message.
  hierarchical,
  /// The earlier per-GPU model: every received token-expert row comes evenly from every GPU, no
  /// deduplication, no per-message latency.
  flat,
};

[[nodiscard]] inline const char *to_string(A2aModel m) noexcept {
  return m == A2aModel::flat ? "flat" : "hierarchical";
}

/// Parses "hierarchical" or "flat"; throws `Error` naming the value.
[[nodiscard]] inline A2aModel parse_a2a_model(std::string_view s) {
  if (s == "hierarchical") return A2aModel::hierarchical;
  if (s == "flat") return A2aModel::flat;
  detail::fail("unknown all-to-all model '", s, "' (expected hierarchical or flat)");
}

/// All-to-all dispatch and combine. Intra-node traffic rides NVLink, inter-node traffic the GPU's NIC;
/// both run concurrently (DeepEP pipelines RDMA and NVLink forwarding).
///
/// Sources. NVLink: `fit_nccl_all_to_all` on shared/data/h200-nccl.csv (all 126 alltoall rows: 2, 4 and 8
/// H200 GPUs of one node, NCCL 2.29.2: t = latency + per_message * (n - 1) + S (n - 1) / n / bw; see
/// tests/test_cost.cpp: median relative error 15%, p90 30%; the 8-GPU rows held out of a 2 + 4 GPU fit:
/// median 15%, p90 31%). NIC: the table has no inter-node rows,
/// so the bandwidth is DeepEP's published figure (deepseek-ai/DeepEP README, "Normal kernels with NVLink
/// and RDMA forwarding": H800 with one CX7 400 Gb/s NIC per GPU, internode dispatch/combine bottleneck RDMA
/// bandwidth 43/43 GB/s at EP 16, 58/57 at EP 32, 51/50 at EP 64; mean 50 GB/s, counted on deduplicated
/// token bytes exactly as `hierarchical` counts them). The inter-node latencies are assumptions (no
/// measurement at hand): 20 us fixed (an RDMA round trip plus proxy/signal) and the NVLink fit's per-peer
/// cost per remote node.
struct AllToAllParams {
  A2aModel model = A2aModel::hierarchical;
  double intra_gb_per_s = 268.0;      ///< per-GPU NVLink bandwidth achieved by NCCL alltoall (fit: 267.9 GB/s)
  double inter_gb_per_s = 50.0;       ///< per-GPU NIC bandwidth (DeepEP internode normal kernels, mean of 6 figures)
  double intra_latency_us = 7.6;      ///< fixed cost of an intra-node exchange (fit: 7.65 us)
  double inter_latency_us = 20.0;     ///< fixed cost of an inter-node exchange (assumption)
  double per_message_us = 0.27;       ///< per NVLink peer with traffic (fit: 0.272 us per peer); flat: unused
  double inter_per_message_us = 0.27; ///< per remote node with traffic (assumption: the NVLink fit); flat: unused

  void validate() const {
    detail::require(model == A2aModel::hierarchical || model == A2aModel::flat, "CostParams.a2a: unknown model ",
                    static_cast<int>(model));
    detail::require(std::isfinite(intra_gb_per_s) && intra_gb_per_s > 0,
                    "CostParams.a2a: intra_gb_per_s must be positive and finite, got ", intra_gb_per_s);
    detail::require(std::isfinite(inter_gb_per_s) && inter_gb_per_s > 0,
                    "CostParams.a2a: inter_gb_per_s must be positive and finite, got ", inter_gb_per_s);
    detail::require(std::isfinite(intra_latency_us) && intra_latency_us >= 0,
                    "CostParams.a2a: intra_latency_us must be >= 0, got ", intra_latency_us);
    detail::require(std::isfinite(inter_latency_us) && inter_latency_us >= 0,
                    "CostParams.a2a: inter_latency_us must be >= 0, got ", inter_latency_us);
    detail::require(std::isfinite(per_message_us) && per_message_us >= 0,
                    "CostParams.a2a: per_message_us must be >= 0, got ", per_message_us);
    detail::require(std::isfinite(inter_per_message_us) && inter_per_message_us >= 0,
                    "CostParams.a2a: inter_per_message_us must be >= 0, got ", inter_per_message_us);
  }
};

/// Reduction of a replica's gradient into its owner in the update stage: the gradient (in `grad_bytes_factor`
/// x the weight bytes, e.g. 2 for bf16 grads of fp8 weights, 1 by default) travels on the GPU-direct path
/// and is added into the owner's gradient at HBM speed.
struct GradReduceParams {
  double grad_bytes_factor = 1.0; ///< gradient bytes per weight byte
  double add_gb_per_s = 1500.0;   ///< elementwise accumulate (reads 2, writes 1) at ~1/3 of HBM bandwidth
  double latency_us = 5.0;        ///< fixed overhead of one reduction (launch + event)

  void validate() const {
    detail::require(std::isfinite(grad_bytes_factor) && grad_bytes_factor > 0,
                    "CostParams.grad: grad_bytes_factor must be positive, got ", grad_bytes_factor);
    detail::require(std::isfinite(add_gb_per_s) && add_gb_per_s > 0,
                    "CostParams.grad: add_gb_per_s must be positive, got ", add_gb_per_s);
    detail::require(std::isfinite(latency_us) && latency_us >= 0, "CostParams.grad: latency_us must be >= 0, got ",
                    latency_us);
  }
};

/// All cost-model parameters. Defaults: H200 SXM, 8 GPUs per node (NVLink 4), one 400 Gb/s NIC per GPU.
struct CostParams {
  ExpertGemmParams gemm{};
  double backward_factor = 2.0; ///< backward time = factor x forward (dgrad + wgrad GEMMs)
  DenseParams dense{};
  AllToAllParams a2a{};
  MoveParams move{};
  GradReduceParams grad{};
  /// CPU Adam throughput of one node's CPUs, billions of parameters per second, for the optimizer step with the
  /// state offloaded (`SimConfig::optimizer_offload`). 3.9: ZeRO-Offload's CPU-Adam stepped 10B parameters in
  /// 2.57 s (Ren et al. 2021, "ZeRO-Offload", arXiv:2101.06840, sec. 6, the CPU-Adam against PyTorch CPU Adam
  /// latency table; one DGX-2 node's CPUs). An older node's CPUs than an H200 node's: the figure is a cited
  /// measurement, not this cluster's.
  double cpu_adam_gparams_per_s = 3.9;

  /// Throws `Error` naming the first invalid field.
  void validate() const {
    gemm.validate();
    detail::require(std::isfinite(backward_factor) && backward_factor > 0,
                    "CostParams: backward_factor must be positive and finite, got ", backward_factor);
    dense.validate();
    a2a.validate();
    move.validate();
    grad.validate();
    detail::require(std::isfinite(cpu_adam_gparams_per_s) && cpu_adam_gparams_per_s > 0,
                    "CostParams: cpu_adam_gparams_per_s must be positive and finite, got ", cpu_adam_gparams_per_s);
  }
};

} // namespace v0
} // namespace foremoe
