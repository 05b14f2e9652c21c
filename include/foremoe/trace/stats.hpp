#pragma once
/// @file
/// Load statistics of a trace: how stable expert loads are from step to step versus micro-step to micro-step,
/// and how skewed they are over experts and over GPUs.
///
/// Definitions (all loads are routed (token, expert) assignments):
/// - share of expert `e` in layer `l` over a set of micro-steps = its load / the layer's total load there;
/// - step CV of `(l, e)` = sample standard deviation (n - 1) / mean of its shares over the steps, where a step's
///   load is the sum over its micro-steps; micro-step CV is the same over the micro-steps. Steps or micro-steps
///   in which the layer carries no load are left out; an `(l, e)` with fewer than 2 shares left, or with mean
///   share 0, has no CV. The summaries run over the `(l, e)` that have one; the load-weighted mean weights each
///   CV by the expert's total load;
/// - max/mean of a layer = its largest expert load / its mean expert load (over all experts, unused ones too),
///   summarised over (step, layer) or (micro-step, layer) pairs with a non-zero total;
/// - GPU max/mean: the same with experts placed contiguously, `num_experts / num_gpus` per GPU, GPU `g` holding
///   experts `[g * E / G, (g + 1) * E / G)`; 1.0 is perfect balance.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <iomanip>
#include <limits>
#include <ostream>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/load_tensor.hpp"

namespace foremoe {
inline namespace v0 {

/// Order statistics of a sample; every field but `count` is NaN for an empty sample.
struct SummaryStats {
  std::int64_t count = 0;
  double min = std::numeric_limits<double>::quiet_NaN();
  double median = std::numeric_limits<double>::quiet_NaN();
  double mean = std::numeric_limits<double>::quiet_NaN();
  double p90 = std::numeric_limits<double>::quiet_NaN(); ///< 90th percentile, linear interpolation
  double max = std::numeric_limits<double>::quiet_NaN();
};

/// Skew of one `[layers][experts]` count matrix (e.g. the real DeepSeek-V3 histograms), summarised over layers.
struct LayerSkew {
  SummaryStats max_over_mean;     ///< per layer: max expert load / mean expert load
  SummaryStats gpu_max_over_mean; ///< per layer, contiguous placement on `num_gpus`; empty without GPUs
};

/// Statistics of a load tensor cut into RL steps; see the file comment for the definitions.
struct TraceStats {
  int num_steps = 0, num_micro_steps = 0, num_layers = 0, num_experts = 0;
  int num_gpus = 0; ///< 0: the GPU fields are empty
  int topk = 0;     ///< 0: `tokens_per_micro_step` is empty
  SummaryStats micro_steps_per_step;
  SummaryStats assignments_per_micro_step; ///< routed assignments of a micro-step, averaged over layers
  SummaryStats tokens_per_micro_step;      ///< the same divided by `topk`
  SummaryStats step_cv;                    ///< over (layer, expert): CV of the share across steps
  SummaryStats micro_cv;                   ///< over (layer, expert): CV of the share across micro-steps
  double step_cv_load_weighted = std::numeric_limits<double>::quiet_NaN();
  double micro_cv_load_weighted = std::numeric_limits<double>::quiet_NaN();
  SummaryStats step_max_over_mean;      ///< over (step, layer)
  SummaryStats micro_max_over_mean;     ///< over (micro-step, layer)
  SummaryStats step_gpu_max_over_mean;  ///< over (step, layer), contiguous placement
  SummaryStats micro_gpu_max_over_mean; ///< over (micro-step, layer), contiguous placement
};

namespace detail {

/// Linear-interpolation quantile of sorted values (NumPy's default).
[[nodiscard]] inline double sorted_quantile(const std::vector<double> &sorted, double q) noexcept {
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const auto lo = static_cast<std::size_t>(pos);
  const std::size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (pos - static_cast<double>(lo)) * (sorted[hi] - sorted[lo]);
}

[[nodiscard]] inline SummaryStats summarize(std::vector<double> values) {
  SummaryStats s;
  s.count = static_cast<std::int64_t>(values.size());
  if (values.empty()) return s;
  std::sort(values.begin(), values.end());
  double sum = 0;
  for (double v : values)
    sum += v;
  s.min = values.front();
  s.max = values.back();
  s.mean = sum / static_cast<double>(values.size());
  s.median = sorted_quantile(values, 0.5);
  s.p90 = sorted_quantile(values, 0.9);
  return s;
}

inline void check_gpus(int num_gpus, int num_experts, const char *who) {
  require(num_gpus >= 0, who, ": num_gpus must be >= 0, got ", num_gpus);
  if (num_gpus == 0) return;
  require(num_gpus <= num_experts && num_experts % num_gpus == 0, who, ": num_gpus ", num_gpus,
          " must divide num_experts ", num_experts, " for the contiguous placement");
}

/// max/mean of `loads` (size n); NaN for an all-zero row.
template <class T> [[nodiscard]] double max_over_mean(const T *loads, std::size_t n) noexcept {
  double sum = 0, mx = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const auto v = static_cast<double>(loads[i]);
    sum += v;
    mx = std::max(mx, v);
  }
  return sum > 0 ? mx * static_cast<double>(n) / sum : std::numeric_limits<double>::quiet_NaN();
}

/// max/mean over GPUs holding `num_experts / num_gpus` consecutive experts each.
template <class T>
[[nodiscard]] double gpu_max_over_mean(const T *loads, int num_experts, int num_gpus, std::vector<double> &scratch) {
  const auto ng = static_cast<std::size_t>(num_gpus);
  const std::size_t per_gpu = static_cast<std::size_t>(num_experts) / ng;
  scratch.assign(ng, 0.0);
  for (std::size_t e = 0; e < static_cast<std::size_t>(num_experts); ++e)
    scratch[e / per_gpu] += static_cast<double>(loads[e]);
  return max_over_mean(scratch.data(), ng);
}

/// Welford accumulators of shares per (layer, expert); exact zeros for constant shares.
struct ShareMoments {
  std::vector<double> mean, m2;
  std::vector<std::int64_t> count; ///< per layer: every expert of a layer sees the same samples
  int num_experts = 0;

  ShareMoments(int num_layers, int num_experts_in)
      : mean(static_cast<std::size_t>(num_layers) * static_cast<std::size_t>(num_experts_in), 0.0),
        m2(mean.size(), 0.0), count(static_cast<std::size_t>(num_layers), 0), num_experts(num_experts_in) {}

  template <class T> void add(int layer_idx, const T *loads) {
    const auto ne = static_cast<std::size_t>(num_experts);
    double total = 0;
    for (std::size_t e = 0; e < ne; ++e)
      total += static_cast<double>(loads[e]);
    if (!(total > 0)) return;
    const auto l = static_cast<std::size_t>(layer_idx);
    const auto n = static_cast<double>(++count[l]);
    for (std::size_t e = 0; e < ne; ++e) {
      const double x = static_cast<double>(loads[e]) / total;
      double &mu = mean[l * ne + e];
      const double delta = x - mu;
      mu += delta / n;
      m2[l * ne + e] += delta * (x - mu);
    }
  }

  /// CV summary and the load-weighted mean CV (weights: `weights[l * E + e]`).
  void finish(const std::vector<double> &weights, SummaryStats &out, double &weighted) const {
    const auto ne = static_cast<std::size_t>(num_experts);
    std::vector<double> cvs;
    double wsum = 0, wcv = 0;
    for (std::size_t l = 0; l < count.size(); ++l) {
      if (count[l] < 2) continue;
      for (std::size_t e = 0; e < ne; ++e) {
        const double mu = mean[l * ne + e];
        if (!(mu > 0)) continue;
        const double cv = std::sqrt(std::max(0.0, m2[l * ne + e]) / static_cast<double>(count[l] - 1)) / mu;
        cvs.push_back(cv);
        wsum += weights[l * ne + e];
        wcv += weights[l * ne + e] * cv;
      }
    }
    out = summarize(std::move(cvs));
    weighted = wsum > 0 ? wcv / wsum : std::numeric_limits<double>::quiet_NaN();
  }
};

} // namespace detail

/// Per-layer skew of a `[num_layers][num_experts]` C-order count matrix; layers summing to 0 are left out.
/// Throws `Error` for a size mismatch, a negative or non-finite count, or `num_gpus` not dividing the experts.
[[nodiscard]] inline LayerSkew layer_skew(std::span<const double> counts, int num_layers, int num_experts,
                                          int num_gpus = 0) {
  using detail::require;
  require(num_layers > 0, "layer_skew: num_layers must be positive, got ", num_layers);
  require(num_experts > 0, "layer_skew: num_experts must be positive, got ", num_experts);
  require(counts.size() == static_cast<std::size_t>(num_layers) * static_cast<std::size_t>(num_experts),
          "layer_skew: ", counts.size(), " counts for shape [", num_layers, ", ", num_experts, "]");
  detail::check_gpus(num_gpus, num_experts, "layer_skew");
  for (std::size_t i = 0; i < counts.size(); ++i)
    require(std::isfinite(counts[i]) && counts[i] >= 0, "layer_skew: count ", counts[i], " at layer ",
            i / static_cast<std::size_t>(num_experts), ", expert ", i % static_cast<std::size_t>(num_experts),
            " is negative or not finite");
  std::vector<double> ratios, gpu_ratios, scratch;
  const auto ne = static_cast<std::size_t>(num_experts);
  for (std::size_t l = 0; l < static_cast<std::size_t>(num_layers); ++l) {
    const double *row = counts.data() + l * ne;
    const double r = detail::max_over_mean(row, ne);
    if (std::isnan(r)) continue;
    ratios.push_back(r);
    if (num_gpus > 0) gpu_ratios.push_back(detail::gpu_max_over_mean(row, num_experts, num_gpus, scratch));
  }
  return {detail::summarize(std::move(ratios)), detail::summarize(std::move(gpu_ratios))};
}

/// Statistics of `loads` cut into steps by `step_offsets` (`[S + 1]` micro-step offsets from 0 to
/// `num_micro_steps`; empty = the whole tensor is one step). With `num_gpus > 0` (dividing the experts) also
/// the GPU max/mean of the contiguous placement; with `topk > 0` also tokens per micro-step.
[[nodiscard]] inline TraceStats compute_trace_stats(const LoadTensor &loads,
                                                    std::span<const std::int64_t> step_offsets = {}, int num_gpus = 0,
                                                    int topk = 0) {
  using detail::require;
  const int num_micro = loads.num_micro_steps(), num_layers = loads.num_layers(), num_experts = loads.num_experts();
  require(num_micro > 0, "compute_trace_stats: the load tensor has no micro-steps");
  detail::check_gpus(num_gpus, num_experts, "compute_trace_stats");
  require(topk >= 0, "compute_trace_stats: topk must be >= 0, got ", topk);
  std::vector<std::int64_t> whole;
  if (step_offsets.empty()) {
    whole = {0, num_micro};
    step_offsets = whole;
  }
  require(step_offsets.size() >= 2, "compute_trace_stats: need at least 2 step offsets, got ", step_offsets.size());
  require(step_offsets.front() == 0, "compute_trace_stats: step_offsets[0] must be 0, got ", step_offsets.front());
  for (std::size_t i = 1; i < step_offsets.size(); ++i)
    require(step_offsets[i] >= step_offsets[i - 1], "compute_trace_stats: step_offsets decrease at index ", i, ": ",
            step_offsets[i - 1], " then ", step_offsets[i]);
  require(step_offsets.back() == num_micro, "compute_trace_stats: step_offsets end at ", step_offsets.back(),
          " but the tensor has ", num_micro, " micro-steps");

  TraceStats st;
  st.num_steps = static_cast<int>(step_offsets.size() - 1);
  st.num_micro_steps = num_micro;
  st.num_layers = num_layers;
  st.num_experts = num_experts;
  st.num_gpus = num_gpus;
  st.topk = topk;
  const auto ne = static_cast<std::size_t>(num_experts);
  const auto nl = static_cast<std::size_t>(num_layers);

  std::vector<double> per_step, assignments, tokens;
  for (std::size_t s = 0; s + 1 < step_offsets.size(); ++s)
    per_step.push_back(static_cast<double>(step_offsets[s + 1] - step_offsets[s]));
  st.micro_steps_per_step = detail::summarize(std::move(per_step));

  detail::ShareMoments micro_moments(num_layers, num_experts), step_moments(num_layers, num_experts);
  std::vector<double> weights(nl * ne, 0.0), step_load(nl * ne), scratch;
  std::vector<double> micro_ratio, micro_gpu, step_ratio, step_gpu;
  for (std::size_t s = 0; s + 1 < step_offsets.size(); ++s) {
    std::fill(step_load.begin(), step_load.end(), 0.0);
    for (auto m = static_cast<int>(step_offsets[s]); m < static_cast<int>(step_offsets[s + 1]); ++m) {
      double sum = 0;
      for (int l = 0; l < num_layers; ++l) {
        const std::int64_t *row = loads.layer(m, l).data();
        micro_moments.add(l, row);
        double *acc = step_load.data() + static_cast<std::size_t>(l) * ne;
        double *w = weights.data() + static_cast<std::size_t>(l) * ne;
        for (std::size_t e = 0; e < ne; ++e) {
          acc[e] += static_cast<double>(row[e]);
          w[e] += static_cast<double>(row[e]);
          sum += static_cast<double>(row[e]);
        }
        const double r = detail::max_over_mean(row, ne);
        if (std::isnan(r)) continue;
        micro_ratio.push_back(r);
        if (num_gpus > 0) micro_gpu.push_back(detail::gpu_max_over_mean(row, num_experts, num_gpus, scratch));
      }
      assignments.push_back(sum / num_layers);
      if (topk > 0) tokens.push_back(sum / num_layers / topk);
    }
    for (int l = 0; l < num_layers; ++l) {
      const double *row = step_load.data() + static_cast<std::size_t>(l) * ne;
      step_moments.add(l, row);
      const double r = detail::max_over_mean(row, ne);
      if (std::isnan(r)) continue;
      step_ratio.push_back(r);
      if (num_gpus > 0) step_gpu.push_back(detail::gpu_max_over_mean(row, num_experts, num_gpus, scratch));
    }
  }
  st.assignments_per_micro_step = detail::summarize(std::move(assignments));
  st.tokens_per_micro_step = detail::summarize(std::move(tokens));
  step_moments.finish(weights, st.step_cv, st.step_cv_load_weighted);
  micro_moments.finish(weights, st.micro_cv, st.micro_cv_load_weighted);
  st.step_max_over_mean = detail::summarize(std::move(step_ratio));
  st.micro_max_over_mean = detail::summarize(std::move(micro_ratio));
  st.step_gpu_max_over_mean = detail::summarize(std::move(step_gpu));
  st.micro_gpu_max_over_mean = detail::summarize(std::move(micro_gpu));
  return st;
}

namespace detail {

[[nodiscard]] inline std::string format_stat(double v) {
  if (std::isnan(v)) return "-";
  std::ostringstream os;
  // Past 1e7 fixed notation outgrows the 10-character column (1e18 has 19 digits): switch to 4 significant digits.
  if (std::fabs(v) >= 1e7)
    os << std::scientific << std::setprecision(3) << v;
  else
    os << std::fixed << std::setprecision(std::fabs(v) >= 1000 ? 0 : 3) << v;
  return os.str();
}

inline void print_summary_row(std::ostream &os, const char *label, const SummaryStats &s) {
  os << "  " << std::left << std::setw(40) << label << std::right;
  // A space before every cell: columns stay apart even when a value fills its width.
  for (double v : {s.min, s.median, s.mean, s.p90, s.max})
    os << ' ' << std::setw(10) << format_stat(v);
  os << ' ' << std::setw(8) << s.count << '\n';
}

} // namespace detail

/// Writes `st` as an aligned table, one row per statistic (min, median, mean, p90, max and sample count).
inline void print_trace_stats(std::ostream &os, const TraceStats &st) {
  os << "trace: " << st.num_micro_steps << " micro-steps in " << st.num_steps << " steps, " << st.num_layers
     << " layers x " << st.num_experts << " experts";
  if (st.num_gpus > 0) os << ", " << st.num_gpus << " GPUs";
  os << '\n' << "  " << std::left << std::setw(40) << "statistic" << std::right;
  for (const char *h : {"min", "median", "mean", "p90", "max"})
    os << std::setw(11) << h;
  os << std::setw(9) << "n" << '\n';
  using detail::print_summary_row;
  print_summary_row(os, "micro-steps per step", st.micro_steps_per_step);
  if (st.topk > 0)
    print_summary_row(os, "tokens per micro-step", st.tokens_per_micro_step);
  else
    print_summary_row(os, "assignments per micro-step and layer", st.assignments_per_micro_step);
  print_summary_row(os, "expert share CV across steps", st.step_cv);
  print_summary_row(os, "expert share CV across micro-steps", st.micro_cv);
  print_summary_row(os, "expert max/mean per (step, layer)", st.step_max_over_mean);
  print_summary_row(os, "expert max/mean per (micro-step, layer)", st.micro_max_over_mean);
  if (st.num_gpus > 0) {
    print_summary_row(os, "GPU max/mean per (step, layer)", st.step_gpu_max_over_mean);
    print_summary_row(os, "GPU max/mean per (micro-step, layer)", st.micro_gpu_max_over_mean);
  }
  os << "  load-weighted mean CV: steps " << detail::format_stat(st.step_cv_load_weighted) << ", micro-steps "
     << detail::format_stat(st.micro_cv_load_weighted) << '\n';
}

} // namespace v0
} // namespace foremoe
