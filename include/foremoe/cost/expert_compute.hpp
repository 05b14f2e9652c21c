#pragma once
/// @file
/// Time of one GPU's grouped expert GEMMs (roofline with a small-batch efficiency curve), its least-squares
/// calibration, and a reader for the measured SGLang fused-MoE table (shared/data/h200-moe-latency.csv).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <fstream>
#include <istream>
#include <span>
#include <string>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/model_spec.hpp"
#include "foremoe/cost/csv.hpp"
#include "foremoe/cost/least_squares.hpp"
#include "foremoe/cost/params.hpp"

namespace foremoe {
inline namespace v0 {

/// Shape of one expert as resident on a GPU (FFN already split by tensor parallelism).
struct ExpertShape {
  int hidden = 2048;
  int ffn = 768; ///< intermediate size on this GPU (I / tp)
  int num_matrices = 3;
  WeightDtype dtype = WeightDtype::bf16;

  /// The routed-expert shape of `spec` with its FFN split `tp` ways.
  [[nodiscard]] static ExpertShape from(const ModelSpec &spec, int tp = 1) {
    detail::require(tp > 0 && spec.expert_ffn % tp == 0, "ExpertShape: tp=", tp,
                    " must divide expert_ffn=", spec.expert_ffn);
    return ExpertShape{spec.hidden, spec.expert_ffn / tp, spec.num_matrices, spec.dtype};
  }
  [[nodiscard]] double flops_per_token() const noexcept {
    return 2.0 * num_matrices * static_cast<double>(hidden) * ffn;
  }
  [[nodiscard]] double weight_bytes() const noexcept {
    return static_cast<double>(num_matrices) * hidden * ffn * static_cast<double>(dtype_bytes(dtype));
  }
};

/// Experts that actually run: a GPU holding `experts` experts and `tokens` token-expert assignments touches
/// at most one expert per assignment (balanced routing touches exactly min(experts, tokens)).
[[nodiscard]] inline double active_experts(double tokens, int experts) noexcept {
  if (tokens <= 0 || experts <= 0) return 0.0;
  return std::min(static_cast<double>(experts), std::max(1.0, tokens));
}

/// Peak dense tensor FLOP/s for `d`.
[[nodiscard]] inline double peak_flops(const ExpertGemmParams &p, WeightDtype d) noexcept {
  switch (d) {
  case WeightDtype::fp8: return p.peak_tflops_fp8 * 1e12;
  case WeightDtype::fp32: return p.peak_tflops_bf16 * 0.5e12;
  default: return p.peak_tflops_bf16 * 1e12;
  }
}

/// Forward seconds of one GPU's grouped expert GEMMs for `tokens` token-expert assignments spread evenly over
/// the active ones of its `experts` resident experts (0 when it has no tokens); `scanned` is the number of
/// token-expert rows the kernel visits (negative: `tokens`, a GPU that sees only its own tokens).
/// Non-decreasing in `tokens`.
[[nodiscard]] inline double expert_gemm_seconds(const ExpertGemmParams &p, const ExpertShape &s, double tokens,
                                                int experts, double scanned = -1) noexcept {
  const double act = active_experts(tokens, experts);
  if (act == 0) return 0.0;
  if (scanned < tokens) scanned = tokens;
  const double fpt = s.flops_per_token();
  const double compute = (tokens + p.n_half * act) * fpt / (peak_flops(p, s.dtype) * p.compute_efficiency);
  const double memory = act * s.weight_bytes() / (p.hbm_tb_per_s * 1e12 * p.hbm_efficiency);
  const double fixed =
      (p.launch_us + p.per_expert_us * act) * 1e-6 + p.scan_ps_per_element * 1e-12 * scanned * s.hidden;
  return fixed + (p.overlap ? std::max(memory, compute) : memory + compute);
}

/// One GPU's grouped expert GEMMs for a fixed expert shape: forward from the roofline, backward =
/// `backward_factor` x forward.
class ExpertComputeModel {
public:
  ExpertComputeModel() = default;
  /// Throws `Error` for invalid parameters or shape.
  ExpertComputeModel(const ExpertGemmParams &params, const ExpertShape &shape, double backward_factor = 2.0)
      : params_(params), shape_(shape), backward_factor_(backward_factor) {
    params_.validate();
    detail::require(shape.hidden > 0 && shape.ffn > 0 && shape.num_matrices > 0,
                    "ExpertComputeModel: shape sizes must be positive");
    detail::require(std::isfinite(backward_factor) && backward_factor > 0,
                    "ExpertComputeModel: backward_factor must be positive, got ", backward_factor);
  }
  ExpertComputeModel(const CostParams &params, const ExpertShape &shape)
      : ExpertComputeModel(params.gemm, shape, params.backward_factor) {}

  /// Forward seconds for `tokens` token-expert assignments on a GPU with `experts` resident experts.
  [[nodiscard]] double forward_seconds(double tokens, int experts) const noexcept {
    return expert_gemm_seconds(params_, shape_, tokens, experts);
  }
  /// Backward seconds: `backward_factor` x forward.
  [[nodiscard]] double backward_seconds(double tokens, int experts) const noexcept {
    return backward_factor_ * forward_seconds(tokens, experts);
  }
  [[nodiscard]] const ExpertGemmParams &params() const noexcept { return params_; }
  [[nodiscard]] const ExpertShape &shape() const noexcept { return shape_; }
  [[nodiscard]] double backward_factor() const noexcept { return backward_factor_; }

private:
  ExpertGemmParams params_{};
  ExpertShape shape_{};
  double backward_factor_ = 2.0;
};

/// One measured grouped-GEMM time.
struct ExpertComputeSample {
  ExpertShape shape{};
  double tokens = 0;   ///< token-expert assignments on the GPU
  double scanned = -1; ///< token-expert rows the kernel visits (num_tokens * topk in the SGLang table; <0: tokens)
  int experts = 1;     ///< resident (local) experts
  double seconds = 0;  ///< measured forward time
  int tp = 1, ep = 1;  ///< provenance (for hold-out splits); not used by the model
  int line = 0;        ///< source line (0 when synthetic)
};

/// Result of `fit_expert_compute`: fitted parameters and the relative error |model - measured| / measured
/// of every sample, in input order.
struct ExpertComputeFit {
  ExpertGemmParams params{};
  std::vector<double> rel_error;
  [[nodiscard]] double median() const { return detail::quantile(rel_error, 0.5); }
  [[nodiscard]] double p90() const { return detail::quantile(rel_error, 0.9); }
};

/// Relative errors of `params` on `samples`.
[[nodiscard]] inline std::vector<double> expert_compute_errors(const ExpertGemmParams &params,
                                                               std::span<const ExpertComputeSample> samples) {
  std::vector<double> err;
  err.reserve(samples.size());
  for (const auto &s : samples) {
    const double t = expert_gemm_seconds(params, s.shape, s.tokens, s.experts, s.scanned);
    err.push_back(std::abs(t - s.seconds) / s.seconds);
  }
  return err;
}

/// Fits launch, per-expert time, scan time, HBM efficiency and compute efficiency by non-negative least
/// squares on relative error (rows weighted by 1 / measured time). `n_half` comes from a small grid and the
/// combination (`overlap`: max or sum) is tried both ways; the max form is fitted by alternating between
/// assigning each sample to its bound (memory or compute) and a linear fit. The lowest weighted residual
/// wins. Peaks come from `base`. All samples should share one dtype. Throws `Error` for fewer than 5
/// samples or a non-positive measured time.
[[nodiscard]] inline ExpertComputeFit fit_expert_compute(std::span<const ExpertComputeSample> samples,
                                                         const ExpertGemmParams &base = {}) {
  constexpr std::size_t n = 5;
  detail::require(samples.size() >= n, "fit_expert_compute: need at least ", n, " samples, got ", samples.size());
  const std::size_t m = samples.size();
  std::vector<double> b(m), w(m);
  for (std::size_t i = 0; i < m; ++i) {
    const auto &s = samples[i];
    detail::require(std::isfinite(s.seconds) && s.seconds > 0, "fit_expert_compute: sample ", i, " (line ", s.line,
                    ") has non-positive time ", s.seconds);
    detail::require(s.tokens > 0 && s.experts > 0, "fit_expert_compute: sample ", i, " (line ", s.line,
                    ") needs tokens > 0 and experts > 0");
    b[i] = s.seconds;
    w[i] = 1.0 / s.seconds;
  }
  auto to_params = [&](const std::vector<double> &x, double n_half, bool overlap) {
    ExpertGemmParams p = base;
    p.n_half = n_half;
    p.overlap = overlap;
    p.launch_us = x[0] * 1e6;
    p.per_expert_us = x[1] * 1e6;
    p.scan_ps_per_element = x[2] * 1e12;
    // A coefficient of 0 means "no such cost": a huge efficiency keeps it representable.
    p.hbm_efficiency = x[3] > 0 ? 1.0 / (x[3] * base.hbm_tb_per_s * 1e12) : 1e30;
    p.compute_efficiency = x[4] > 0 ? 1.0 / x[4] : 1e30;
    return p;
  };
  auto weighted_residual = [&](const ExpertGemmParams &p) {
    double res = 0;
    for (std::size_t i = 0; i < m; ++i) {
      const auto &s = samples[i];
      const double r = (expert_gemm_seconds(p, s.shape, s.tokens, s.experts, s.scanned) - b[i]) * w[i];
      res += r * r;
    }
    return res;
  };
  ExpertComputeFit best;
  double best_res = -1;
  auto consider = [&](const ExpertGemmParams &p) {
    const double res = weighted_residual(p);
    if (best_res < 0 || res < best_res * (1 - 1e-12)) {
      best_res = res;
      best.params = p;
    }
  };
  std::vector<double> a(m * n), mem(m), comp(m);
  for (double n_half : {0.0, 4.0, 16.0, 64.0}) {
    for (std::size_t i = 0; i < m; ++i) {
      const auto &s = samples[i];
      const double act = active_experts(s.tokens, s.experts);
      a[i * n + 0] = 1.0;
      a[i * n + 1] = act;
      a[i * n + 2] = std::max(s.scanned, s.tokens) * s.shape.hidden;
      mem[i] = act * s.shape.weight_bytes();
      comp[i] = (s.tokens + n_half * act) * s.shape.flops_per_token() / peak_flops(base, s.shape.dtype);
    }
    // Sum form: one linear fit. There n_half's penalty has the form of weight streaming (not identifiable
    // within one dtype), so only n_half = 0 is offered to it.
    for (std::size_t i = 0; i < m; ++i) {
      a[i * n + 3] = mem[i];
      a[i * n + 4] = comp[i];
    }
    const auto xs = detail::nonneg_least_squares(a, b, w, n);
    if (n_half == 0) consider(to_params(xs, n_half, false));
    // Max form: alternate bound assignment and linear fit, starting from the sum fit.
    auto x = xs;
    for (int iter = 0; iter < 30; ++iter) {
      bool changed = false;
      for (std::size_t i = 0; i < m; ++i) {
        const bool memory_bound = mem[i] * x[3] >= comp[i] * x[4];
        const double am = memory_bound ? mem[i] : 0.0, ac = memory_bound ? 0.0 : comp[i];
        changed = changed || am != a[i * n + 3] || ac != a[i * n + 4];
        a[i * n + 3] = am;
        a[i * n + 4] = ac;
      }
      if (!changed && iter > 0) break;
      x = detail::nonneg_least_squares(a, b, w, n);
      consider(to_params(x, n_half, true));
    }
  }
  best.rel_error = expert_compute_errors(best.params, samples);
  return best;
}

/// Reads the SGLang fused-MoE latency table (columns by name: moe_dtype, num_tokens, hidden_size, inter_size,
/// topk, num_experts, moe_tp_size, moe_ep_size, distribution, latency_ms) and returns one sample per row with
/// distribution `balanced`: tokens = num_tokens * topk / ep, experts = num_experts / ep, ffn = inter_size / tp.
/// `source` names the input in messages. Throws `Error` naming the line of a malformed row.
[[nodiscard]] inline std::vector<ExpertComputeSample> read_moe_latency_csv(std::istream &in,
                                                                           const std::string &source = "<csv>") {
  const detail::CsvTable t(in, source);
  const auto c_dtype = t.column("moe_dtype"), c_tok = t.column("num_tokens"), c_h = t.column("hidden_size"),
             c_i = t.column("inter_size"), c_k = t.column("topk"), c_e = t.column("num_experts"),
             c_tp = t.column("moe_tp_size"), c_ep = t.column("moe_ep_size"), c_dist = t.column("distribution"),
             c_lat = t.column("latency_ms");
  std::vector<ExpertComputeSample> out;
  for (std::size_t r = 0; r < t.size(); ++r) {
    if (t.text(r, c_dist) != "balanced") continue;
    WeightDtype d{};
    try {
      d = parse_weight_dtype(t.text(r, c_dtype));
    } catch (const Error &e) {
      t.fail_at(r, e.what());
    }
    const long long tok = t.integer(r, c_tok), h = t.integer(r, c_h), inter = t.integer(r, c_i), k = t.integer(r, c_k),
                    e = t.integer(r, c_e), tp = t.integer(r, c_tp), ep = t.integer(r, c_ep);
    const double lat = t.number(r, c_lat);
    if (tok <= 0 || h <= 0 || inter <= 0 || k <= 0 || e <= 0 || tp <= 0 || ep <= 0 || h > (1 << 20) ||
        inter > (1 << 24) || e > (1 << 20) || tp > e * inter || ep > e)
      t.fail_at(r, "sizes must be positive and in range");
    if (inter % tp != 0) t.fail_at(r, "moe_tp_size ", tp, " does not divide inter_size ", inter);
    if (e % ep != 0) t.fail_at(r, "moe_ep_size ", ep, " does not divide num_experts ", e);
    if (!(lat > 0)) t.fail_at(r, "latency_ms must be positive, got ", lat);
    ExpertComputeSample s;
    s.shape = ExpertShape{static_cast<int>(h), static_cast<int>(inter / tp), 3, d};
    s.tokens = static_cast<double>(tok) * static_cast<double>(k) / static_cast<double>(ep);
    s.experts = static_cast<int>(e / ep);
    s.scanned = static_cast<double>(tok) * static_cast<double>(k);
    s.seconds = lat * 1e-3;
    s.tp = static_cast<int>(tp);
    s.ep = static_cast<int>(ep);
    s.line = t.line_of(r);
    out.push_back(s);
  }
  return out;
}

/// `read_moe_latency_csv` on the file at `path`.
[[nodiscard]] inline std::vector<ExpertComputeSample> read_moe_latency_csv(const std::string &path) {
  std::ifstream in(path);
  detail::require(static_cast<bool>(in), "cannot open '", path, "'");
  return read_moe_latency_csv(in, path);
}

} // namespace v0
} // namespace foremoe
