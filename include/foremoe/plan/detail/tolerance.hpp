#pragma once
/// @file
/// The imbalance tolerance's token limit and the minimum tokens per replica, shared by the replica constructions.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "foremoe/core/placement.hpp"
#include "foremoe/plan/held_gradients.hpp"
#include "foremoe/plan/plan.hpp"

namespace foremoe {
inline namespace v0 {

/// The largest GPU load whose max/mean is within `tolerance` for a layer of `total` tokens on `num_gpus` GPUs
/// (a relative 1e-12 of slack so that a ratio printed as the tolerance counts as within it).
[[nodiscard]] inline std::int64_t tolerance_limit(std::int64_t total, int num_gpus, double tolerance) {
  const long double mean = static_cast<long double>(total) / num_gpus;
  return static_cast<std::int64_t>(std::floor(mean * static_cast<long double>(tolerance) * (1 + 1e-12L)));
}

namespace detail {

/// What a plan costs the imbalance tolerance, in expert weights: its moves, plus `gradient_weight` for every
/// replica (a copy off its owner GPU) that runs tokens, whose gradient the update stage returns to the owner,
/// except those that already hold a gradient for that owner there (`held`, see `HeldGradients`; empty: none), which
/// accumulate into it and return it once.
[[nodiscard]] inline double tolerance_bytes(const LayerPlan &plan, double gradient_weight,
                                            std::span<const std::int32_t> held = {}) {
  const auto moves = static_cast<double>(plan.moves.size());
  if (gradient_weight <= 0) return moves;
  // The same expression as the two-level planner's `construction_cost`, so that equal plans compare equal.
  return moves + gradient_weight * static_cast<double>(new_gradients(plan, held));
}

/// Gives every replica piece below `min_tokens` (copies off their owner GPU) to the expert's copy on the least
/// loaded GPU among its copies that keep theirs (the owner's at worst), and empties new copies left with no
/// tokens; then recomputes the maximum and the moves. The plan stays valid: token sums and owner copies are
/// unchanged and slots only empty.
inline void enforce_min_tokens(LayerPlan &plan, const LayerPlacement *resident, std::int64_t min_tokens,
                               int gpus_per_node) {
  LayerPlacement &p = plan.placement;
  const int num_gpus = p.num_gpus(), slots = p.slots_per_gpu();
  std::vector<std::int64_t> gpu_load = plan.gpu_loads();
  bool changed = false;
  for (int g = 0; g < num_gpus; ++g)
    for (int s = 0; s < slots; ++s) {
      const std::int32_t e = p.slot(g, s);
      const std::size_t i = static_cast<std::size_t>(g) * slots + s;
      const std::int64_t t = plan.slot_tokens[i];
      if (e == empty_slot || plan.owner_gpu[e] == g || t <= 0 || t >= min_tokens) continue;
      // Receiver: the owner, or a lighter GPU whose copy already has at least the minimum.
      std::size_t to = 0;
      int to_gpu = -1;
      for (int h = 0; h < num_gpus; ++h) {
        if (h == g) continue;
        for (int k = 0; k < slots; ++k) {
          const std::size_t j = static_cast<std::size_t>(h) * slots + k;
          if (p.slot(h, k) != e || (plan.owner_gpu[e] != h && plan.slot_tokens[j] < min_tokens)) continue;
          if (to_gpu < 0 || gpu_load[h] < gpu_load[to_gpu]) {
            to = j;
            to_gpu = h;
          }
        }
      }
      plan.slot_tokens[to] += t;
      plan.slot_tokens[i] = 0;
      gpu_load[to_gpu] += t;
      gpu_load[g] -= t;
      changed = true;
    }
  // New copies (not resident there) without tokens cost a move for nothing.
  for (int g = 0; g < num_gpus; ++g)
    for (int s = 0; s < slots; ++s) {
      const std::int32_t e = p.slot(g, s);
      if (e == empty_slot || plan.owner_gpu[e] == g || plan.slot_tokens[static_cast<std::size_t>(g) * slots + s] > 0)
        continue;
      if (resident != nullptr && resident->slot(g, s) == e) continue;
      p.slot(g, s) = empty_slot;
      changed = true;
    }
  if (!changed) return;
  plan.max_gpu_load = 0;
  for (std::int64_t x : gpu_load)
    plan.max_gpu_load = std::max(plan.max_gpu_load, x);
  plan.moves = compute_moves(p, plan.owner_gpu, resident, gpus_per_node);
}

} // namespace detail
} // namespace v0
} // namespace foremoe
