#pragma once
/// @file
/// Options of replica selection for one layer (two-level and free mode).

#include <cstdint>
#include <functional>
#include <span>

namespace foremoe {
inline namespace v0 {

/// Seconds to bring a new replica of `expert` from `src_gpu` (or `host_mirror`) to `dst_gpu`, gradient return
/// included where the stage has one.
using ReplicaCostFn = std::function<double(int expert, int src_gpu, int dst_gpu)>;
/// Seconds a GPU needs for a token count (the layer's expert compute).
using TokenTimeFn = std::function<double(std::int64_t tokens)>;

/// Options of replica selection for one layer.
struct ReplicaOptions {
  int move_budget = -1; ///< new replicas per GPU per micro-step; < 0: the GPU's spare slots
  /// Exact-split local search rounds after the two-level construction (0: none). Off by default: on
  /// DeepSeek-V3-like loads it lowers the median max/mean by about 0.0005 for ~50% more planning time.
  int local_search_rounds = 0;
  int free_search_rounds = 4; ///< swap rounds (x8 swaps) of the free-mode placement on copy weights (0: none)
  /// Re-split every two-level plan exactly. Plans from a resident placement otherwise keep the construction's own
  /// split, whose maximum is the searched makespan (within 0.05% of the best one the construction met) rather than
  /// the exact optimum of the placement; on the benchmark shapes that is +0.0002 mean max/mean for ~9 us less
  /// planning per layer.
  bool exact_split = false;
  /// Largest accepted layer max/mean (0: as balanced as the planner gets, today's plans). Within it the plan with
  /// the fewest bytes (moves, and `gradient_weight` per used replica) wins among a fixed ladder of constructions
  /// (see `TwoLevelPlanner`), so bytes never grow as it loosens; `LayerPlan::tolerance_met` says whether it was met.
  double tolerance = 0.0;
  /// Fewest tokens a replica may run (0: any): lighter pieces go back to another copy and new copies that end up
  /// with none are not made.
  std::int64_t min_tokens_per_replica = 0;
  /// With a tolerance: what a replica that runs tokens costs for its gradient, in weight moves (the update stage
  /// returns its gradient to the owner; `PlannerOptions::gradient_bytes_factor` there, 0 elsewhere). The pick
  /// within the tolerance is then the fewest moves plus this per used replica.
  double gradient_weight = 0.0;
  /// With `gradient_weight`: `[gpus * experts]`, the owner GPU whose gradient the replica of each expert on each
  /// GPU already holds from earlier update micro-steps, or -1 (`HeldGradients::layer`; empty: none held). A used
  /// replica that holds one for its owner accumulates into it and costs no new gradient.
  std::span<const std::int32_t> held_gradients;
  /// Optional cost gate: a new replica stays only if the compute time it saves exceeds `replica_cost`. Both
  /// callbacks must be set for the gate to act.
  ReplicaCostFn replica_cost;
  TokenTimeFn token_time;
  /// Order GPUs by owner load with the plain indirect sort instead of packed keys: the same order, only slower.
  /// For tests, which compare the two (plans must not change).
  bool reference_owner_sort = false;
};

} // namespace v0
} // namespace foremoe
