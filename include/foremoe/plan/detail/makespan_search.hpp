#pragma once
/// @file
/// Not API: the makespan search both replica constructions run, and an exact fraction comparison.

#include <algorithm>
#include <cstdint>
#include <utility>

namespace foremoe {
inline namespace v0 {
namespace detail {

/// Sign of `a / b - c / d` for non-negative numerators and positive denominators, without overflow.
[[nodiscard]] constexpr int compare_fractions(std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) noexcept {
  const std::int64_t q1 = a / b, q2 = c / d;
  if (q1 != q2) return q1 < q2 ? -1 : 1;
  // Remainders are below their denominators (GPU counts), so the cross products stay small.
  const std::int64_t r1 = (a % b) * d, r2 = (c % d) * b;
  return r1 < r2 ? -1 : r1 > r2 ? 1 : 0;
}

/// The makespan search both modes run: gallop up from `lo` (first step `step`, doubling), then bisect until the
/// bracket is narrower than `tolerance`; `feasible(t)` builds a plan at `t` and keeps it when it succeeds. With
/// `hi_feasible` the top is known to work and is not tried first. Returns whether any `t` succeeded (always with
/// `hi_feasible`) and the bracket's top.
template <class Feasible>
[[nodiscard]] std::pair<bool, std::int64_t> search_makespan(std::int64_t lo, std::int64_t hi, std::int64_t step,
                                                            std::int64_t tolerance, bool hi_feasible,
                                                            Feasible &&feasible) {
  bool found = false;
  while (hi_feasible ? lo < hi : lo <= hi) {
    const std::int64_t t = std::min(hi, lo + step - 1);
    if (feasible(t)) {
      hi = t;
      found = true;
      break;
    }
    lo = t + 1;
    step *= 2;
  }
  if (!found && !hi_feasible) return {false, hi};
  while (hi - lo >= tolerance) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (feasible(mid))
      hi = mid;
    else
      lo = mid + 1;
  }
  return {true, hi};
}

} // namespace detail
} // namespace v0
} // namespace foremoe
