#pragma once
/// @file
/// The plan of a given placement: its exact token split and the moves from a resident placement.

#include <cstdint>
#include <span>

#include "foremoe/core/placement.hpp"
#include "foremoe/plan/plan.hpp"
#include "foremoe/plan/split.hpp"

namespace foremoe {
inline namespace v0 {

/// A plan for `placement`: exact split of `loads` (through the workspace `split`) and moves from `resident` (may be
/// null: the owner copies are in place); `owner_gpu` as given.
[[nodiscard]] inline LayerPlan plan_from_placement(const LayerPlacement &placement, std::span<const std::int64_t> loads,
                                                   std::span<const std::int32_t> owner_gpu,
                                                   const LayerPlacement *resident, int gpus_per_node,
                                                   SplitSolver &split) {
  LayerPlan plan;
  plan.placement = placement;
  plan.owner_gpu.assign(owner_gpu.begin(), owner_gpu.end());
  plan.slot_tokens.assign(static_cast<std::size_t>(placement.num_slots()), 0);
  plan.max_gpu_load = split.solve(placement, loads, plan.slot_tokens);
  plan.moves = compute_moves(placement, owner_gpu, resident, gpus_per_node);
  return plan;
}

} // namespace v0
} // namespace foremoe
