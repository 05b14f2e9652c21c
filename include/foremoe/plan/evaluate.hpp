#pragma once
/// @file
/// Measuring plans: balance statistics over layers and micro-steps, and semi-synthetic micro-steps drawn from a
/// step-level expert distribution (e.g. the published DeepSeek-V3 counts) with sequence-coherent bursts.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/load_tensor.hpp"
#include "foremoe/plan/plan.hpp"

namespace foremoe {
inline namespace v0 {

/// Median, p99 and extremes of per-layer `max / mean` GPU load.
struct BalanceStats {
  double median = 1.0, p99 = 1.0, max = 1.0, mean = 1.0;
  std::int64_t count = 0;
};

/// Statistics of a set of `max / mean` values (nearest-rank quantiles).
[[nodiscard]] inline BalanceStats balance_stats(std::vector<double> values) {
  BalanceStats s;
  if (values.empty()) return s;
  std::sort(values.begin(), values.end());
  const auto at = [&](double q) {
    const auto n = static_cast<double>(values.size());
    const auto i = static_cast<std::size_t>(std::clamp(std::ceil(q * n) - 1.0, 0.0, n - 1.0));
    return values[i];
  };
  s.median = at(0.5);
  s.p99 = at(0.99);
  s.max = values.back();
  double sum = 0;
  for (double v : values)
    sum += v;
  s.mean = sum / static_cast<double>(values.size());
  s.count = static_cast<std::int64_t>(values.size());
  return s;
}

/// `max / mean` of every layer of every micro-step of `plans` (`[micro_steps][layers]`).
[[nodiscard]] inline std::vector<double> imbalances(const std::vector<std::vector<LayerPlan>> &plans) {
  std::vector<double> out;
  for (const auto &step : plans)
    for (const LayerPlan &lp : step)
      out.push_back(lp.imbalance());
  return out;
}

/// How semi-synthetic micro-steps are drawn.
struct MicroStepSampling {
  int num_micro_steps = 8;
  std::int64_t min_tokens = 16384; ///< tokens per micro-step, uniform in [min, max]
  std::int64_t max_tokens = 65536;
  int topk = 8;
  /// Sequences per micro-step; each routes by its own re-weighting of the step distribution.
  int sequences_per_micro_step = 16;
  /// Gamma shape of a sequence's per-expert re-weighting: small = bursty, 0 = plain multinomial (no bursts).
  double burst_shape = 0.0;
  std::uint64_t seed = 1;
};

/// Draws `[micro_steps][layers][experts]` loads from step-level counts `weights` (`[layers][experts]`, any
/// non-negative scale). Counts are multinomial per sequence (top-k distinctness is not enforced: it changes the
/// counts negligibly at these sizes). Deterministic for a seed with one standard library.
[[nodiscard]] inline LoadTensor sample_micro_steps(std::span<const double> weights, int num_layers, int num_experts,
                                                   const MicroStepSampling &cfg) {
  detail::require(weights.size() == static_cast<std::size_t>(num_layers) * num_experts,
                  "sample_micro_steps: ", weights.size(), " weights for ", num_layers, " x ", num_experts);
  detail::require(cfg.num_micro_steps > 0 && cfg.min_tokens > 0 && cfg.max_tokens >= cfg.min_tokens &&
                      cfg.sequences_per_micro_step > 0 && cfg.topk > 0,
                  "sample_micro_steps: bad sampling configuration");
  LoadTensor out(cfg.num_micro_steps, num_layers, num_experts);
  std::mt19937_64 rng(cfg.seed);
  std::vector<double> p(static_cast<std::size_t>(num_experts));
  for (int m = 0; m < cfg.num_micro_steps; ++m) {
    const std::int64_t tokens = std::uniform_int_distribution<std::int64_t>(cfg.min_tokens, cfg.max_tokens)(rng);
    const int num_seq = cfg.burst_shape > 0 ? cfg.sequences_per_micro_step : 1;
    for (int s = 0; s < num_seq; ++s) {
      const std::int64_t seq_tokens = tokens / num_seq + (s < tokens % num_seq ? 1 : 0);
      for (int l = 0; l < num_layers; ++l) {
        double sum = 0;
        for (int e = 0; e < num_experts; ++e) {
          double w = weights[static_cast<std::size_t>(l) * num_experts + e];
          if (cfg.burst_shape > 0 && w > 0) w *= std::gamma_distribution<double>(cfg.burst_shape, 1.0)(rng);
          p[e] = w;
          sum += w;
        }
        if (sum <= 0) continue;
        // Multinomial by sequential binomials.
        std::int64_t left = seq_tokens * cfg.topk;
        double mass = sum;
        auto row = out.layer(m, l);
        for (int e = 0; e < num_experts && left > 0; ++e) {
          const double q = mass > 0 ? std::clamp(p[e] / mass, 0.0, 1.0) : 1.0;
          const std::int64_t c = e + 1 == num_experts ? left : std::binomial_distribution<std::int64_t>(left, q)(rng);
          row[e] += c;
          left -= c;
          mass -= p[e];
        }
      }
    }
  }
  return out;
}

} // namespace v0
} // namespace foremoe
