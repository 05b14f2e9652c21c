#pragma once
/// @file
/// The bounds on products of sizes: each size has its own range where it is read, but a product of sizes that
/// are each in range can still ask for all memory or hours of work. Each bound below is checked before anything
/// is allocated or run, by `require_product`, whose message names the factors, their product and the limit.

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <string_view>
#include <utility>

#include "foremoe/core/error.hpp"

namespace foremoe {
inline namespace v0 {
namespace limits {

/// Cells of a load tensor, `micro_steps x layers x experts x (sources + 1)` int64: 2^28 (2 GiB). A step of
/// 1,000 micro-steps x 61 layers x 256 experts split over 16 source ranks fits.
inline constexpr std::int64_t max_load_cells = std::int64_t{1} << 28;

/// The planner's work per layer and micro-step grows with `slots x GPUs` (each replica looks at every GPU):
/// 2^28 is about 2 s on one core; 1,024 GPUs x 256 slots and 16,384 GPUs x 1 slot fit.
inline constexpr std::int64_t max_slot_gpu_work = std::int64_t{1} << 28;

/// The largest sum of loads the planner takes: one layer's loads summed over every micro-step of a step. 2^42
/// (4.4e12 routed tokens in one layer and step), far above any real step, and low enough that no sum or product
/// of sums with a GPU count (at most 2^20) leaves int64.
inline constexpr std::int64_t max_load_total = std::int64_t{1} << 42;

/// Routed-id work of the synthetic generator, `tokens x layers x topk` with the expected token count (each length
/// mean capped at its clip): 2^34, about 30 s on one core (the default batch is 6.3e9, the DeepSeek-V3 one 7.6e9).
inline constexpr std::int64_t max_generator_work = std::int64_t{1} << 34;

/// Work of the routing-aware packer without a placement, `sequences x micro_steps x layers x experts` (its greedy
/// pass; the search adds a few such passes at most): 2^34, about a minute on one core (`BM_Packing`: 2,048
/// sequences x 16 micro-steps x 48 x 128 take about a second). 4,096 sequences x 64 micro-steps x 61 x 256 fit.
inline constexpr std::int64_t max_packing_work = std::int64_t{1} << 34;

/// "2^28" for powers of two, else the number.
[[nodiscard]] inline std::string limit_text(std::int64_t limit) {
  for (int b = 1; b < 63; ++b)
    if (limit == (std::int64_t{1} << b)) return "2^" + std::to_string(b);
  return std::to_string(limit);
}

/// The product of `factors` (name, value), or the largest int64 when it would overflow (every value >= 0).
[[nodiscard]] inline std::int64_t
saturating_product(std::initializer_list<std::pair<std::string_view, std::int64_t>> factors) {
  std::int64_t p = 1;
  for (const auto &f : factors) {
    if (f.second == 0) return 0;
    if (p > std::numeric_limits<std::int64_t>::max() / f.second) return std::numeric_limits<std::int64_t>::max();
    p *= f.second;
  }
  return p;
}

/// Throws `Error` "who: a x b x c = P (what) is beyond the supported LIMIT" unless the product of `factors`
/// (each >= 0) is at most `limit`.
inline void require_product(std::string_view who,
                            std::initializer_list<std::pair<std::string_view, std::int64_t>> factors,
                            std::int64_t limit, std::string_view what) {
  const std::int64_t p = saturating_product(factors);
  if (p <= limit) return;
  std::string text;
  for (const auto &f : factors)
    text += (text.empty() ? "" : " x ") + std::to_string(f.second) + " " + std::string(f.first);
  detail::fail(who, ": ", text, " = ",
               p == std::numeric_limits<std::int64_t>::max() ? "more than 2^63" : std::to_string(p), " ", what,
               " is beyond the supported ", limit_text(limit));
}

} // namespace limits
} // namespace v0
} // namespace foremoe
