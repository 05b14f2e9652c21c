#pragma once
/// @file
/// Exact planners for tiny layers, by enumeration: the yardstick for the heuristics' optimality gap in tests
/// (test-only, not installed; it was `foremoe/plan/exact.hpp`).
///
/// A copy never hurts the exact split (it may receive zero tokens), so only maximal placements are enumerated:
/// in two-level mode every GPU fills its spare slots as far as candidates and the move budget allow; in free mode
/// every GPU holds `min(slots, experts)` distinct experts and GPUs are interchangeable (non-decreasing choices).

#include <bit>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/core/topology.hpp"
#include "foremoe/plan/split.hpp"

namespace foremoe {
inline namespace v0 {

/// The optimum of a tiny layer and one placement reaching it.
struct ExactResult {
  std::int64_t makespan = 0;
  LayerPlacement placement;
  std::int64_t num_evaluated = 0; ///< placements whose exact split was computed
};

/// Limits that keep enumeration tractable.
inline constexpr int exact_max_experts = 12;
inline constexpr int exact_max_gpus = 6;

/// Two-level optimum: owners fixed, replicas in spare slots, at most `move_budget` (< 0: unlimited) non-resident
/// replicas per GPU. With `maximal_only == false` every placement is enumerated (for cross-checks).
[[nodiscard]] inline ExactResult solve_exact_two_level(std::span<const std::int64_t> loads,
                                                       std::span<const std::int32_t> owner_gpu, const Topology &topo,
                                                       int move_budget = -1, const LayerPlacement *resident = nullptr,
                                                       bool maximal_only = true) {
  const int num_gpus = topo.num_gpus(), slots = topo.slots_per_gpu, num_experts = static_cast<int>(loads.size());
  detail::require(num_experts <= exact_max_experts && num_gpus <= exact_max_gpus,
                  "solve_exact_two_level: ", num_experts, " experts on ", num_gpus,
                  " GPUs is beyond the exact solver's ", exact_max_experts, " x ", exact_max_gpus);
  detail::require(static_cast<int>(owner_gpu.size()) == num_experts, "solve_exact_two_level: owner count mismatch");
  std::vector<std::uint32_t> owned(static_cast<std::size_t>(num_gpus), 0);
  for (int e = 0; e < num_experts; ++e)
    owned[owner_gpu[e]] |= 1u << e;
  const std::uint32_t all = (1u << num_experts) - 1;
  // Replica sets per GPU.
  std::vector<std::vector<std::uint32_t>> options(static_cast<std::size_t>(num_gpus));
  for (int g = 0; g < num_gpus; ++g) {
    const int spare = slots - std::popcount(owned[g]);
    detail::require(spare >= 0, "solve_exact_two_level: GPU ", g, " owns more experts than it has slots");
    std::uint32_t res = 0;
    if (resident != nullptr)
      for (std::int32_t e : resident->gpu_slots(g))
        if (e >= 0 && e < num_experts) res |= 1u << e;
    const std::uint32_t cand = all & ~owned[g];
    auto ok = [&](std::uint32_t m) {
      const int n = std::popcount(m);
      return n <= spare && (move_budget < 0 || std::popcount(m & ~res) <= move_budget);
    };
    for (std::uint32_t m = cand;; m = (m - 1) & cand) {
      if (ok(m)) {
        bool maximal = true;
        if (maximal_only)
          for (int e = 0; e < num_experts && maximal; ++e)
            if ((cand >> e & 1u) && !(m >> e & 1u) && ok(m | 1u << e)) maximal = false;
        if (maximal) options[g].push_back(m);
      }
      if (m == 0) break;
    }
  }
  ExactResult best;
  best.makespan = std::numeric_limits<std::int64_t>::max();
  LayerPlacement p(num_gpus, slots, num_experts);
  std::vector<std::uint32_t> pick(static_cast<std::size_t>(num_gpus), 0);
  std::vector<std::int64_t> tokens(static_cast<std::size_t>(p.num_slots()));
  SplitSolver solver;
  std::vector<std::size_t> idx(static_cast<std::size_t>(num_gpus), 0);
  for (;;) {
    for (int g = 0; g < num_gpus; ++g) {
      const std::uint32_t m = owned[g] | options[g][idx[g]];
      int s = 0;
      for (int e = 0; e < num_experts; ++e)
        if (m >> e & 1u) p.slot(g, s++) = e;
      for (; s < slots; ++s)
        p.slot(g, s) = empty_slot;
    }
    const std::int64_t ms = solver.solve(p, loads, tokens);
    ++best.num_evaluated;
    if (ms < best.makespan) {
      best.makespan = ms;
      best.placement = p;
    }
    int g = 0;
    while (g < num_gpus && ++idx[g] == options[g].size())
      idx[g++] = 0;
    if (g == num_gpus) break;
  }
  return best;
}

/// Free-mode optimum: any expert anywhere, every expert at least once, no duplicate per GPU.
[[nodiscard]] inline ExactResult solve_exact_free(std::span<const std::int64_t> loads, const Topology &topo) {
  const int num_gpus = topo.num_gpus(), slots = topo.slots_per_gpu, num_experts = static_cast<int>(loads.size());
  detail::require(num_experts <= exact_max_experts && num_gpus <= exact_max_gpus, "solve_exact_free: ", num_experts,
                  " experts on ", num_gpus, " GPUs is beyond the exact solver's ", exact_max_experts, " x ",
                  exact_max_gpus);
  topo.validate(num_experts);
  const int k = std::min(slots, num_experts);
  std::vector<std::uint32_t> subsets;
  for (std::uint32_t m = 0; m < (1u << num_experts); ++m)
    if (std::popcount(m) == k) subsets.push_back(m);
  const std::uint32_t all = (1u << num_experts) - 1;
  ExactResult best;
  best.makespan = std::numeric_limits<std::int64_t>::max();
  LayerPlacement p(num_gpus, slots, num_experts);
  std::vector<std::int64_t> tokens(static_cast<std::size_t>(p.num_slots()));
  SplitSolver solver;
  std::vector<std::size_t> idx(static_cast<std::size_t>(num_gpus), 0);
  for (;;) {
    std::uint32_t cover = 0;
    for (int g = 0; g < num_gpus; ++g)
      cover |= subsets[idx[g]];
    if (cover == all) {
      for (int g = 0; g < num_gpus; ++g) {
        int s = 0;
        for (int e = 0; e < num_experts; ++e)
          if (subsets[idx[g]] >> e & 1u) p.slot(g, s++) = e;
        for (; s < slots; ++s)
          p.slot(g, s) = empty_slot;
      }
      const std::int64_t ms = solver.solve(p, loads, tokens);
      ++best.num_evaluated;
      if (ms < best.makespan) {
        best.makespan = ms;
        best.placement = p;
      }
    }
    // Next non-decreasing index tuple.
    int g = num_gpus - 1;
    while (g >= 0 && idx[g] + 1 == subsets.size())
      --g;
    if (g < 0) break;
    ++idx[g];
    for (int h = g + 1; h < num_gpus; ++h)
      idx[h] = idx[g];
  }
  return best;
}

} // namespace v0
} // namespace foremoe
