#pragma once
/// @file
/// Time of one GPU's grouped expert GEMMs (roofline with a small-batch efficiency curve), its least-squares
/// calibration, and a reader for the measured SGLang fused-MoE table (shared/data/h200-moe-latency.csv).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <istream>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/files.hpp"
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

/// `rows` padded up to a multiple of `tile` (0 or less: no padding).
[[nodiscard]] inline double padded_rows(double rows, double tile) noexcept {
  return tile > 0 && rows > 0 ? std::ceil(rows / tile - 1e-9) * tile : std::max(rows, 0.0);
}

namespace detail {
/// The roofline of `expert_gemm_seconds` for `tokens` rows over `act` active experts, `padded` rows after
/// tile padding, `scanned` rows visited.
[[nodiscard]] inline double gemm_roofline(const ExpertGemmParams &p, const ExpertShape &s, double tokens, double act,
                                          double padded, double scanned) noexcept {
  if (act == 0) return 0.0;
  if (scanned < tokens) scanned = tokens;
  const double fpt = s.flops_per_token();
  const double compute = (padded + p.n_half * act) * fpt / (peak_flops(p, s.dtype) * p.compute_efficiency);
  const double memory = act * s.weight_bytes() / (p.hbm_tb_per_s * 1e12 * p.hbm_efficiency);
  const double fixed =
      (p.launch_us + p.per_expert_us * act) * 1e-6 + p.scan_ps_per_element * 1e-12 * scanned * s.hidden;
  return fixed + (p.overlap ? std::max(memory, compute) : memory + compute);
}
} // namespace detail

/// Forward seconds of one GPU's grouped expert GEMMs for `tokens` token-expert assignments spread evenly over
/// the active ones of its `experts` resident experts (0 when it has no tokens); `scanned` is the number of
/// token-expert rows the kernel visits (negative: `tokens`, a GPU that sees only its own tokens).
/// Non-decreasing in `tokens`.
[[nodiscard]] inline double expert_gemm_seconds(const ExpertGemmParams &p, const ExpertShape &s, double tokens,
                                                int experts, double scanned = -1) noexcept {
  const double act = active_experts(tokens, experts);
  if (act == 0) return 0.0;
  return detail::gemm_roofline(p, s, tokens, act, act * padded_rows(tokens / act, p.tile_m), scanned);
}

/// Forward seconds of one GPU's grouped expert GEMMs from its per-expert token counts `counts` (one entry
/// per resident expert or slot; zeros are idle experts): each active expert's rows are padded to `tile_m`.
/// Non-decreasing in every count.
[[nodiscard]] inline double expert_gemm_seconds(const ExpertGemmParams &p, const ExpertShape &s,
                                                std::span<const double> counts, double scanned = -1) noexcept {
  double tokens = 0, act = 0, padded = 0;
  for (double c : counts)
    if (c > 0) {
      tokens += c;
      act += 1;
      padded += padded_rows(c, p.tile_m);
    }
  return detail::gemm_roofline(p, s, tokens, act, padded, scanned);
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
  /// Forward seconds from a GPU's per-expert (per-slot) token counts.
  [[nodiscard]] double forward_seconds(std::span<const double> counts) const noexcept {
    return expert_gemm_seconds(params_, shape_, counts);
  }
  [[nodiscard]] double backward_seconds(std::span<const double> counts) const noexcept {
    return backward_factor_ * forward_seconds(counts);
  }
  /// What a new replica saves, forward plus backward (`update`) or forward only: `moved` of the tokens of
  /// `src`'s expert `slot` go to a new copy on a GPU whose per-expert counts are `dst`; the pair's slower GPU
  /// before minus after. Negative when the replica costs more than it saves (a small share: weight streaming,
  /// the per-expert time and tile padding of one more active expert). Throws `Error` for a bad slot or a
  /// `moved` outside [0, count].
  [[nodiscard]] double replica_saving_seconds(std::span<const double> src, std::size_t slot, double moved,
                                              std::span<const double> dst, bool update = true) const {
    detail::require(slot < src.size(), "replica_saving_seconds: slot ", slot, " of ", src.size());
    detail::require(moved >= 0 && moved <= src[slot], "replica_saving_seconds: moved ", moved, " must be in [0, ",
                    src[slot], "]");
    std::vector<double> a(src.begin(), src.end()), b(dst.begin(), dst.end());
    const double before = std::max(forward_seconds(a), forward_seconds(b));
    a[slot] -= moved;
    b.push_back(moved);
    const double after = std::max(forward_seconds(a), forward_seconds(b));
    return (before - after) * (update ? 1 + backward_factor_ : 1.0);
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
  /// Per local expert token counts (empty: `tokens` spread evenly over the active experts). For the table's
  /// power-law rows: `power_law_rank0_counts`.
  std::vector<double> counts;
  double seconds = 0; ///< measured forward time
  int tp = 1, ep = 1; ///< provenance (for hold-out splits); not used by the model
  int line = 0;       ///< source line (0 when synthetic)
};

/// Result of `fit_expert_compute`: fitted parameters and the relative error |model - measured| / measured
/// of every sample, in input order.
struct ExpertComputeFit {
  ExpertGemmParams params{};
  std::vector<double> rel_error;
  [[nodiscard]] double median() const { return detail::quantile(rel_error, 0.5); }
  [[nodiscard]] double p90() const { return detail::quantile(rel_error, 0.9); }
};

/// The model's forward seconds for `s` under `p` (its counts when it has them).
[[nodiscard]] inline double sample_seconds(const ExpertGemmParams &p, const ExpertComputeSample &s) noexcept {
  return s.counts.empty() ? expert_gemm_seconds(p, s.shape, s.tokens, s.experts, s.scanned)
                          : expert_gemm_seconds(p, s.shape, s.counts, s.scanned);
}

/// Relative errors of `params` on `samples`.
[[nodiscard]] inline std::vector<double> expert_compute_errors(const ExpertGemmParams &params,
                                                               std::span<const ExpertComputeSample> samples) {
  std::vector<double> err;
  err.reserve(samples.size());
  for (const auto &s : samples) {
    err.push_back(std::abs(sample_seconds(params, s) - s.seconds) / s.seconds);
  }
  return err;
}

/// Which terms `fit_expert_compute` fits.
struct ExpertFitOptions {
  /// Fit `scan_ps_per_element`; false holds it at 0 (for checking what the term buys: tests/test_cost.cpp).
  bool scan = true;
};

/// Fits launch, per-expert time, scan time, HBM efficiency and compute efficiency by non-negative least
/// squares on relative error (rows weighted by 1 / measured time). `n_half` comes from a small grid and the
/// combination (`overlap`: max or sum) is tried both ways; the max form is fitted by alternating between
/// assigning each sample to its bound (memory or compute) and a linear fit. The lowest weighted residual
/// wins. Peaks come from `base`. All samples should share one dtype. Throws `Error` for fewer than 5
/// samples or a non-positive measured time.
[[nodiscard]] inline ExpertComputeFit fit_expert_compute(std::span<const ExpertComputeSample> samples,
                                                         const ExpertGemmParams &base = {},
                                                         const ExpertFitOptions &options = {}) {
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
    detail::require(s.counts.empty() || std::any_of(s.counts.begin(), s.counts.end(), [](double c) { return c > 0; }),
                    "fit_expert_compute: sample ", i, " (line ", s.line, ") has counts but no active expert");
    b[i] = s.seconds;
    w[i] = 1.0 / s.seconds;
  }
  double tile = 0; // the tile_m being fitted
  auto to_params = [&](const std::vector<double> &x, double n_half, bool overlap) {
    ExpertGemmParams p = base;
    p.n_half = n_half;
    p.tile_m = tile;
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
      const double r = (sample_seconds(p, s) - b[i]) * w[i];
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
  std::vector<double> a(m * n), mem(m), comp(m), act(m), padded(m);
  for (double tile_m : {0.0, 16.0, 32.0, 64.0, 128.0}) {
    tile = tile_m;
    for (std::size_t i = 0; i < m; ++i) {
      const auto &s = samples[i];
      if (s.counts.empty()) {
        act[i] = active_experts(s.tokens, s.experts);
        padded[i] = act[i] * padded_rows(s.tokens / act[i], tile);
      } else {
        act[i] = padded[i] = 0;
        for (double c : s.counts)
          if (c > 0) {
            act[i] += 1;
            padded[i] += padded_rows(c, tile);
          }
      }
    }
    for (double n_half : {0.0, 4.0, 16.0, 64.0}) {
      for (std::size_t i = 0; i < m; ++i) {
        const auto &s = samples[i];
        a[i * n + 0] = 1.0;
        a[i * n + 1] = act[i];
        a[i * n + 2] = options.scan ? std::max(s.scanned, s.tokens) * s.shape.hidden : 0.0;
        mem[i] = act[i] * s.shape.weight_bytes();
        comp[i] = (padded[i] + n_half * act[i]) * s.shape.flops_per_token() / peak_flops(base, s.shape.dtype);
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
  }
  best.rel_error = expert_compute_errors(best.params, samples);
  return best;
}

/// The expected per-expert token counts, sorted descending, of EP rank 0 in a power-law row of the SGLang
/// table: `draws` draws of the published generator (ai-dynamo/aiconfigurator, collector helper
/// `_generate_power_law_distribution`: per-expert weights from a power law with exponent `alpha` on
/// [1, 0.8 num_tokens] (on [0.01, 2] when num_tokens * topk <= num_experts), scaled to num_tokens * topk
/// and rounded, the rounding remainder put on the largest (or taken from the smallest) counts, and the
/// contiguous block of num_experts / ep experts with the largest sum swapped to rank 0), each sorted and
/// then averaged position by position. The measured row was one unseeded draw that cannot be reproduced,
/// so this expectation stands in for it (its spread is part of the fit's error). Deterministic in its
/// arguments. Throws `Error` for non-positive sizes, `ep` not dividing the experts, or alpha == 1.
[[nodiscard]] inline std::vector<double> power_law_rank0_counts(long long num_tokens, int num_experts, int topk, int ep,
                                                                double alpha, int draws = 16) {
  detail::require(num_tokens > 0 && num_experts > 0 && topk > 0 && ep > 0 && num_experts % ep == 0 && draws > 0,
                  "power_law_rank0_counts: bad sizes (tokens ", num_tokens, ", experts ", num_experts, ", topk ", topk,
                  ", ep ", ep, ", draws ", draws, ")");
  detail::require(std::isfinite(alpha) && alpha > 0 && alpha != 1,
                  "power_law_rank0_counts: alpha must be > 0 and "
                  "not 1, got ",
                  alpha);
  const auto E = static_cast<std::size_t>(num_experts), local = E / static_cast<std::size_t>(ep);
  const double target = static_cast<double>(num_tokens) * topk;
  const bool many = target > num_experts;
  const double lo = many ? 1.0 : 0.01, hi = many ? 0.8 * static_cast<double>(num_tokens) : 2.0;
  const double a = 1 - alpha, lo_a = std::pow(lo, a), hi_a = std::pow(std::max(hi, lo), a);
  std::mt19937_64 rng(static_cast<std::uint64_t>(num_tokens) * 1000003u +
                      static_cast<std::uint64_t>(num_experts) * 7919u + static_cast<std::uint64_t>(topk) * 131u +
                      static_cast<std::uint64_t>(ep) * 17u + static_cast<std::uint64_t>(alpha * 1000));
  std::uniform_real_distribution<double> uni(0, 1);
  std::vector<double> mean(local, 0.0), x(E);
  std::vector<long long> c(E);
  std::vector<std::size_t> order(E);
  for (int d = 0; d < draws; ++d) {
    double sum = 0;
    for (auto &v : x)
      sum += (v = std::pow((hi_a - lo_a) * uni(rng) + lo_a, 1 / a));
    long long total = 0;
    for (std::size_t e = 0; e < E; ++e)
      total += (c[e] = std::llround(x[e] / sum * target));
    for (std::size_t e = 0; e < E; ++e)
      order[e] = e;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t i, std::size_t j) { return c[i] > c[j]; });
    const auto want = static_cast<long long>(target);
    for (long long i = 0; total < want; ++i, ++total)
      ++c[order[static_cast<std::size_t>(i) % E]];
    for (long long i = 0; total > want; ++i) {
      const std::size_t e = order[E - 1 - static_cast<std::size_t>(i) % E];
      if (c[e] > 0) {
        --c[e];
        --total;
      }
    }
    std::size_t best = 0;
    long long best_sum = -1;
    for (std::size_t r = 0; r < E / local; ++r) {
      long long b = 0;
      for (std::size_t e = r * local; e < (r + 1) * local; ++e)
        b += c[e];
      if (b > best_sum) {
        best_sum = b;
        best = r;
      }
    }
    std::vector<long long> block(c.begin() + static_cast<std::ptrdiff_t>(best * local),
                                 c.begin() + static_cast<std::ptrdiff_t>((best + 1) * local));
    std::sort(block.rbegin(), block.rend());
    for (std::size_t e = 0; e < local; ++e)
      mean[e] += static_cast<double>(block[e]) / draws;
  }
  return mean;
}

/// Reads the SGLang fused-MoE latency table (columns by name: moe_dtype, num_tokens, hidden_size, inter_size,
/// topk, num_experts, moe_tp_size, moe_ep_size, distribution, latency_ms) and returns one sample per row with
/// distribution `balanced`: tokens = num_tokens * topk / ep, experts = num_experts / ep, ffn = inter_size / tp.
/// With `power_law`, also the `power_law_<alpha>` rows, with rank 0's counts from `power_law_rank0_counts`
/// (tokens = their sum). `source` names the input in messages. Throws `Error` naming the line of a malformed
/// row.
[[nodiscard]] inline std::vector<ExpertComputeSample>
read_moe_latency_csv(std::istream &in, const std::string &source = "<csv>", bool power_law = false) {
  const detail::CsvTable t(in, source);
  const auto c_dtype = t.column("moe_dtype"), c_tok = t.column("num_tokens"), c_h = t.column("hidden_size"),
             c_i = t.column("inter_size"), c_k = t.column("topk"), c_e = t.column("num_experts"),
             c_tp = t.column("moe_tp_size"), c_ep = t.column("moe_ep_size"), c_dist = t.column("distribution"),
             c_lat = t.column("latency_ms");
  std::vector<ExpertComputeSample> out;
  for (std::size_t r = 0; r < t.size(); ++r) {
    const std::string &dist = t.text(r, c_dist);
    const bool balanced = dist == "balanced";
    if (!balanced && !power_law) continue;
    double alpha = 0;
    if (!balanced) {
      std::size_t used = 0;
      try {
        if (dist.rfind("power_law_", 0) == 0) alpha = std::stod(dist.substr(10), &used);
      } catch (const std::exception &) {
        used = 0;
      }
      if (used == 0 || used != dist.size() - 10 || !(alpha > 0) || alpha == 1)
        t.fail_at(r, "unknown distribution '", dist, "' (expected balanced or power_law_<alpha>, alpha > 0, != 1)");
    }
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
    if (!balanced) {
      s.counts = power_law_rank0_counts(tok, static_cast<int>(e), static_cast<int>(k), static_cast<int>(ep), alpha);
      s.tokens = 0;
      for (double c : s.counts)
        s.tokens += c;
      if (!(s.tokens > 0)) t.fail_at(r, "no tokens on rank 0");
    }
    s.seconds = lat * 1e-3;
    s.tp = static_cast<int>(tp);
    s.ep = static_cast<int>(ep);
    s.line = t.line_of(r);
    out.push_back(s);
  }
  return out;
}

/// `read_moe_latency_csv` on the file at `path`.
[[nodiscard]] inline std::vector<ExpertComputeSample> read_moe_latency_csv(const std::string &path,
                                                                           bool power_law = false) {
  std::istringstream in(files::read_file(path, files::max_document_bytes, "a CSV file")); // a regular file only
  return read_moe_latency_csv(in, path, power_law);
}

} // namespace v0
} // namespace foremoe
