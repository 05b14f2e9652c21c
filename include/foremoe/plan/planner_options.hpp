#pragma once
/// @file
/// Planner configuration: the options every strategy reads from (see `StrategyInfo::options` for which).

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>

#include "foremoe/core/error.hpp"
#include "foremoe/plan/replicate/options.hpp"

namespace foremoe {
inline namespace v0 {

/// Training stage of a micro-step: the update stage also returns every replica's gradient to its owner.
enum class Stage : std::uint8_t { recompute, update };

/// Seconds a new replica costs in a stage (weights in; in the update stage also the gradient out).
using StageReplicaCostFn = std::function<double(int expert, int src_gpu, int dst_gpu, Stage stage)>;

/// Planner configuration.
struct PlannerOptions {
  /// Registered strategy name (see `strategies()`): "static", "eplb", "eplb-oracle", the re-implemented baselines
  /// "ultraep" and "moonep", "foremoe" (two-level: step-level owners, replicas in spare slots) or "foremoe-free"
  /// (any slot holds anything).
  std::string strategy = "foremoe";
  int move_budget = -1;            ///< new replicas per GPU per micro-step; < 0: the spare slots
  bool hierarchical_owners = true; ///< owners: nodes first, then GPUs in each node
  /// Whether a new owner map costs nothing (colocated trainers reload optimizer state after rollout). When not,
  /// `begin_step` keeps the previous step's owners unless their most loaded GPU is more than
  /// `owner_keep_tolerance` above a fresh plan's, and then changes as few as it can (see `OwnerOptions`).
  bool reowning_free = true;
  double owner_keep_tolerance = 0.05;
  int num_threads = 1;         ///< parallel over layers; plans are identical for every count
  int local_search_rounds = 0; ///< two-level exact-split local search per layer (see ReplicaOptions)
  int free_search_rounds = 4;  ///< free-mode placement swap rounds per layer
  bool exact_split = false;    ///< re-split every two-level plan exactly (see ReplicaOptions)
  int eplb_num_groups = 1;     ///< expert groups for EPLB (hierarchical when they divide over nodes)
  /// `eplb`, `eplb-split`: rebalance every N RL steps, from the loads summed over the N steps since the last
  /// rebalance; the static placement before the first one (the strategy keeps the window: see
  /// `PlanStrategy::begin_step` for the steps' totals it is handed). Serving systems rebalance periodically (vLLM:
  /// `EPLBConfig.step_interval`, vllm/config/parallel.py, default 3000 forward steps); 1: every step, from the
  /// previous one.
  int eplb_interval = 1;
  /// Largest accepted layer max/mean (0: as balanced as possible, today's plans); see `ReplicaOptions::tolerance`.
  double tolerance = 0.0;
  std::int64_t min_tokens_per_replica = 0; ///< fewest tokens a replica runs (0: any)
  /// Update stage with a tolerance: bytes of a used replica's gradient per byte of its weights, so that the pick
  /// within the tolerance counts gradients out beside weights in (fp32 gradients of bf16 weights: 2; 0: moves
  /// alone).
  double gradient_bytes_factor = 2.0;
  /// Update stage: a replica that stays resident over consecutive micro-steps accumulates its gradient in place and
  /// returns it once, when its slot is reused or before the optimizer step (`HeldGradients`), so with a tolerance
  /// a plan pays `gradient_bytes_factor` only for the used replicas that hold no gradient yet. false: every used
  /// replica returns its gradient every update micro-step (and is charged for it every time).
  bool hold_replica_gradients = true;
  /// `ultraep`: fewest tokens a replica runs (UltraEP, arXiv:2606.04101: at least 1,024 tokens per replica).
  std::int64_t ultraep_min_tokens = 1024;
  /// `ultraep`, `moonep`: GPUs per balancing domain, the scale-up domain their replicas stay in (0: a node, as the
  /// published systems run on one NVLink domain; -1: the whole EP group, replicas anywhere in it, moved over the
  /// network where they cross nodes).
  int peer_domain_gpus = 0;
  /// Optional cost gate (both must be set): a new replica stays only if its compute saving exceeds its cost.
  StageReplicaCostFn replica_cost;
  TokenTimeFn token_time;

  /// Throws `Error` naming the first option out of its range (the checks that need no loads or topology; the
  /// planner checks the rest).
  void validate() const {
    detail::require(num_threads >= 1, "Planner: num_threads must be >= 1, got ", num_threads);
    detail::require(eplb_num_groups >= 1, "Planner: eplb_num_groups must be >= 1, got ", eplb_num_groups);
    detail::require(eplb_interval >= 1, "Planner: eplb_interval must be >= 1, got ", eplb_interval);
    detail::require(owner_keep_tolerance >= 0, "Planner: owner_keep_tolerance must be >= 0, got ",
                    owner_keep_tolerance);
    detail::require(local_search_rounds >= 0 && free_search_rounds >= 0,
                    "Planner: local_search_rounds and free_search_rounds must be >= 0, got ", local_search_rounds,
                    " and ", free_search_rounds);
    detail::require(tolerance == 0 || tolerance >= 1, "Planner: tolerance must be 0 (as balanced as ",
                    "possible) or a max/mean >= 1, got ", tolerance);
    detail::require(gradient_bytes_factor >= 0 && std::isfinite(gradient_bytes_factor),
                    "Planner: gradient_bytes_factor must be finite and >= 0, got ", gradient_bytes_factor);
    detail::require(min_tokens_per_replica >= 0, "Planner: min_tokens_per_replica must be >= 0, got ",
                    min_tokens_per_replica);
    detail::require(ultraep_min_tokens >= 0, "Planner: ultraep_min_tokens must be >= 0, got ", ultraep_min_tokens);
    detail::require(peer_domain_gpus >= -1, "Planner: peer_domain_gpus must be >= -1, got ", peer_domain_gpus);
  }
};

} // namespace v0
} // namespace foremoe
