#pragma once
/// @file
/// The load generators that the baselines' authors publish, next to our GRPO generator (`synthetic.hpp`), selectable as
/// `--workload NAME:PARAM` in `foremoe simulate`:
///
/// - `grpo`: the synthetic GRPO batch (the default; `generate_loads`).
/// - `ultraep:A`: UltraEP's generator. Ranks are the static EP layout's (expert `e` on rank `e / per`, `per` =
///   experts per GPU, as `PlanShape::static_placement`); rank `r` (1-based, in a random order) has weight
///   `1 / r^alpha`, `alpha` bisected so that the rank max/mean is `A`; inside a rank expert `j` (1-based, in a
///   random order) has weight `1 / j^4`.
/// - `moonep:V`: MoonEP's generator. Expert `e` has weight `exp(sigma z_e)`, `z_e ~ N(0, 1)`, `sigma` bisected so
///   that the expert maxvio = max/mean - 1 is `V`.
///
/// Both baselines describe one batch of one layer. Here every (micro-step, layer) draws its own order (UltraEP) or
/// its own `z` (MoonEP) from the seed, independently: there is no correlation across layers, micro-steps or
/// steps, so history and foresight carry no information beyond the marginal skew. The micro-steps and their
/// token counts are those of the GRPO batch with the same settings (same sequence lengths and packing), so a
/// baseline workload differs from `grpo` only in how the tokens route. A micro-step of `T` tokens makes `T * topk`
/// assignments; an expert's count is its weight's share of them, rounded by largest remainder (so the rounded
/// counts sum exactly to `T * topk`). A token takes an expert at most once, so no expert may get more than `T`:
/// a target that would need more is an error naming the figures.

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/load_tensor.hpp"
#include "foremoe/trace/synthetic.hpp"

namespace foremoe {
inline namespace v0 {

/// Which load generator.
enum class WorkloadKind : std::uint8_t { grpo, ultraep, moonep };

/// A workload: the generator and its parameter (UltraEP's target rank max/mean, MoonEP's target maxvio).
struct WorkloadSpec {
  WorkloadKind kind = WorkloadKind::grpo;
  double param = 0;
};

/// "grpo", "ultraep:A" or "moonep:V" as written on the command line (the shortest round-trip number).
[[nodiscard]] inline std::string to_string(const WorkloadSpec &w) {
  if (w.kind == WorkloadKind::grpo) return "grpo";
  char buf[64];
  const auto [p, ec] = std::to_chars(buf, buf + sizeof buf, w.param);
  (void)ec;
  return std::string(w.kind == WorkloadKind::ultraep ? "ultraep:" : "moonep:") + std::string(buf, p);
}

/// Parses a workload spec; throws `Error` naming the value for an unknown name, a missing, non-numeric or
/// out-of-range parameter.
[[nodiscard]] inline WorkloadSpec parse_workload(std::string_view s) {
  const auto colon = s.find(':');
  const std::string_view name = s.substr(0, colon);
  const bool has_param = colon != std::string_view::npos;
  const std::string_view text = has_param ? s.substr(colon + 1) : std::string_view{};
  if (name == "grpo") {
    detail::require(!has_param, "'", s, "': grpo takes no parameter (write grpo)");
    return {};
  }
  WorkloadSpec w;
  if (name == "ultraep")
    w.kind = WorkloadKind::ultraep;
  else if (name == "moonep")
    w.kind = WorkloadKind::moonep;
  else
    detail::fail("'", s, "' is not a workload (expected grpo, ultraep:A or moonep:V)");
  const char *what = w.kind == WorkloadKind::ultraep ? "A, the target rank max/mean (e.g. ultraep:2)"
                                                     : "V, the target expert maxvio = max/mean - 1 (e.g. moonep:1)";
  detail::require(has_param && !text.empty(), "'", s, "' needs a parameter: ", what);
  double v = 0;
  const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  detail::require(ec == std::errc() && p == text.data() + text.size() && std::isfinite(v), "'", s, "': parameter '",
                  text, "' is not a number; expected ", what);
  if (w.kind == WorkloadKind::ultraep)
    detail::require(v >= 1, "'", s, "': the rank max/mean A must be >= 1, got ", v);
  else
    detail::require(v >= 0, "'", s, "': the maxvio V must be >= 0, got ", v);
  w.param = v;
  return w;
}

namespace detail {

/// Bisects the increasing function `f` on [0, inf) for `f(x) = target`, `f(0) <= target`: doubles an upper
/// bracket, then halves it 200 times (or until the bracket stops shrinking).
template <class F> [[nodiscard]] double bisect_increasing(F &&f, double target) {
  double lo = 0, hi = 1;
  for (int i = 0; i < 2000 && f(hi) < target; ++i)
    hi *= 2;
  require(f(hi) >= target, "bisect: target ", target, " not reachable");
  for (int i = 0; i < 200; ++i) {
    const double mid = 0.5 * (lo + hi);
    if (mid <= lo || mid >= hi) break;
    (f(mid) < target ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

/// Counts of `total` assignments by the weights `w` (largest remainder: they sum to `total`).
[[nodiscard]] inline std::vector<std::int64_t> apportion(std::span<const double> w, std::int64_t total) {
  const double sum = std::accumulate(w.begin(), w.end(), 0.0);
  std::vector<std::int64_t> out(w.size());
  std::vector<std::pair<double, std::size_t>> frac(w.size());
  std::int64_t given = 0;
  for (std::size_t i = 0; i < w.size(); ++i) {
    const double exact = static_cast<double>(total) * w[i] / sum;
    out[i] = static_cast<std::int64_t>(std::floor(exact));
    given += out[i];
    frac[i] = {exact - static_cast<double>(out[i]), i};
  }
  std::sort(frac.begin(), frac.end(),
            [](const auto &a, const auto &b) { return a.first != b.first ? a.first > b.first : a.second < b.second; });
  for (std::size_t k = 0; given < total; k = (k + 1) % frac.size(), ++given)
    ++out[frac[k].second];
  return out;
}

inline constexpr std::uint64_t tag_baseline_ultraep = 101, tag_baseline_moonep = 102;

} // namespace detail

/// max/mean of `v`.
[[nodiscard]] inline double max_over_mean(std::span<const double> v) {
  const double sum = std::accumulate(v.begin(), v.end(), 0.0);
  return sum > 0 ? *std::max_element(v.begin(), v.end()) * static_cast<double>(v.size()) / sum : 1.0;
}

/// UltraEP's rank weights `1 / r^alpha`, r = 1..ranks.
[[nodiscard]] inline std::vector<double> ultraep_rank_weights(int ranks, double alpha) {
  std::vector<double> w(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r)
    w[r] = std::pow(static_cast<double>(r + 1), -alpha);
  return w;
}

/// The `alpha` whose rank weights have max/mean `target` over `ranks` ranks (bisected; `1 <= target < ranks`,
/// or `target == 1` for one rank). Throws `Error` naming both when the target is out of reach.
[[nodiscard]] inline double ultraep_alpha(int ranks, double target) {
  detail::require(ranks >= 1, "ultraep: ranks must be >= 1, got ", ranks);
  detail::require(target >= 1 && (target < ranks || target == 1), "ultraep:", target, ": the rank max/mean of ", ranks,
                  " ranks under 1/r^alpha is below ", ranks, " (all load on one rank); got ", target);
  if (target == 1) return 0.0;
  return detail::bisect_increasing(
      [ranks](double a) {
        const auto w = ultraep_rank_weights(ranks, a);
        return max_over_mean(w);
      },
      target);
}

/// MoonEP's `sigma`: the scale of `exp(sigma z)` whose max/mean - 1 is `target` (bisected). Throws `Error` when
/// `target` is out of reach (at least E - 1 for E experts, or the largest `z` is not unique).
[[nodiscard]] inline double moonep_sigma(std::span<const double> z, double target) {
  detail::require(!z.empty(), "moonep: no experts");
  detail::require(target >= 0 && target < static_cast<double>(z.size()) - 1, "moonep:", target, ": the maxvio of ",
                  z.size(), " experts is below ", z.size() - 1, "; got ", target);
  if (target == 0) return 0.0;
  std::vector<double> w(z.size());
  auto maxvio = [&](double sigma) {
    const double zmax = *std::max_element(z.begin(), z.end());
    for (std::size_t i = 0; i < z.size(); ++i)
      w[i] = std::exp(sigma * (z[i] - zmax)); // shifted: no overflow, same ratio
    return max_over_mean(w) - 1;
  };
  return detail::bisect_increasing(maxvio, target);
}

/// The ranks of UltraEP's generator for `num_experts` experts on an EP group of `ranks` GPUs (those the static
/// layout gives experts) and their weights `1 / r^alpha` for the target `A`.
[[nodiscard]] inline std::vector<double> ultraep_weights_of_ranks(int num_experts, int ranks, double A) {
  detail::require(num_experts >= 1 && ranks >= 1, "ultraep: needs experts and ranks, got ", num_experts, " and ",
                  ranks);
  const int per = (num_experts + ranks - 1) / ranks, used = (num_experts + per - 1) / per;
  return ultraep_rank_weights(used, ultraep_alpha(used, A));
}

/// The expert weights of one (micro-step, layer) of a baseline workload for `num_experts` experts on an EP group of
/// `ranks` GPUs, drawn from `rng`; `rank_w` (UltraEP only): `ultraep_weights_of_ranks(num_experts, ranks, A)`,
/// computed once.
[[nodiscard]] inline std::vector<double> baseline_expert_weights(const WorkloadSpec &w, int num_experts, int ranks,
                                                                 std::span<const double> rank_w,
                                                                 detail::Xoshiro256 &rng) {
  const auto E = static_cast<std::size_t>(num_experts);
  std::vector<double> out(E);
  if (w.kind == WorkloadKind::moonep) {
    std::vector<double> z(E);
    for (double &v : z)
      v = detail::sample_normal(rng);
    const double sigma = moonep_sigma(z, w.param);
    const double zmax = *std::max_element(z.begin(), z.end());
    for (std::size_t e = 0; e < E; ++e)
      out[e] = std::exp(sigma * (z[e] - zmax));
    return out;
  }
  detail::require(w.kind == WorkloadKind::ultraep, "baseline_expert_weights: grpo has no closed-form weights");
  const int per = (num_experts + ranks - 1) / ranks, used = (num_experts + per - 1) / per;
  detail::require(static_cast<int>(rank_w.size()) == used, "baseline_expert_weights: ", rank_w.size(),
                  " rank weights for ", used, " ranks");
  std::vector<int> order(static_cast<std::size_t>(used));
  std::iota(order.begin(), order.end(), 0);
  for (std::size_t i = order.size(); i > 1; --i) // Fisher-Yates: which rank is the r-th hottest
    std::swap(order[i - 1], order[rng.below(i)]);
  for (int r = 0; r < used; ++r) {
    const int first = r * per, n = std::min(per, num_experts - first);
    std::vector<int> inner(static_cast<std::size_t>(n));
    std::iota(inner.begin(), inner.end(), 0);
    for (std::size_t i = inner.size(); i > 1; --i)
      std::swap(inner[i - 1], inner[rng.below(i)]);
    double norm = 0;
    for (int j = 1; j <= n; ++j)
      norm += std::pow(static_cast<double>(j), -4.0);
    for (int j = 0; j < n; ++j) {
      const int e = first + inner[static_cast<std::size_t>(j)];
      out[static_cast<std::size_t>(e)] = rank_w[static_cast<std::size_t>(order[static_cast<std::size_t>(r)])] *
                                         std::pow(static_cast<double>(j + 1), -4.0) / norm;
    }
  }
  return out;
}

/// The loads of a baseline workload, `[M][L][E]`: the micro-steps (and `step_offsets`, if given) of the GRPO batch
/// `batch`, each of `T` tokens routing `T * topk` assignments by `baseline_expert_weights` on an EP group of
/// `ranks` GPUs. Deterministic for `batch.seed`. Throws `Error` for a grpo spec, an unreachable target, or one
/// that puts more than `T` assignments on an expert.
[[nodiscard]] inline LoadTensor generate_baseline_loads(const WorkloadSpec &w, const SyntheticConfig &batch, int ranks,
                                                        std::vector<std::int64_t> *step_offsets = nullptr) {
  batch.validate();
  detail::require(w.kind != WorkloadKind::grpo, "generate_baseline_loads: grpo is generated by generate_loads");
  detail::require(ranks >= 1, "generate_baseline_loads: ranks must be >= 1, got ", ranks);
  detail::require(
      batch.packing != BatchPacking::routing,
      "generate_baseline_loads: packing 'routing' needs the grpo workload: a baseline workload routes every "
      "micro-step's tokens independently, so its sequences have no routing to pack by");
  std::vector<std::int64_t> steps;
  std::int64_t num_tokens = 0;
  const auto plans = detail::plan_steps(batch, steps, num_tokens);
  const int L = batch.num_layers, E = batch.num_experts, k = batch.topk;
  LoadTensor out(static_cast<int>(steps.back()), L, E);
  const std::uint64_t tag =
      w.kind == WorkloadKind::ultraep ? detail::tag_baseline_ultraep : detail::tag_baseline_moonep;
  const std::vector<double> rank_w =
      w.kind == WorkloadKind::ultraep ? ultraep_weights_of_ranks(E, ranks, w.param) : std::vector<double>{};
  int m = 0;
  for (const auto &plan : plans)
    for (int mi = 0; mi < plan.num_micro_steps; ++mi, ++m) {
      std::int64_t tokens = 0;
      const auto G = static_cast<std::size_t>(batch.num_gpus);
      for (std::size_t b = static_cast<std::size_t>(mi) * G; b < (static_cast<std::size_t>(mi) + 1) * G; ++b)
        for (std::int64_t i = plan.block_offsets[b]; i < plan.block_offsets[b + 1]; ++i) {
          const auto &seq = plan.sequences[static_cast<std::size_t>(plan.order[static_cast<std::size_t>(i)])];
          tokens += seq.prompt_tokens + seq.response_tokens;
        }
      for (int l = 0; l < L; ++l) {
        detail::Xoshiro256 rng(
            detail::stream_seed(batch.seed, tag, static_cast<std::uint64_t>(m), static_cast<std::uint64_t>(l)));
        const std::vector<double> wt = baseline_expert_weights(w, E, ranks, rank_w, rng);
        const std::vector<std::int64_t> counts = detail::apportion(wt, tokens * k);
        const std::int64_t top = *std::max_element(counts.begin(), counts.end());
        detail::require(top <= tokens, "workload '", to_string(w), "' puts ", top, " of the ", tokens * k,
                        " assignments of a ", tokens,
                        "-token micro-step on one expert, but a token takes an expert "
                        "once (top-",
                        k, " over ", E, " experts caps an expert's max/mean at ", E / static_cast<double>(k),
                        "); ask for less skew");
        std::copy(counts.begin(), counts.end(), out.layer(m, l).begin());
      }
    }
  if (step_offsets != nullptr) *step_offsets = std::move(steps);
  return out;
}

} // namespace v0
} // namespace foremoe
