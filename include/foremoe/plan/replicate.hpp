#pragma once
/// @file
/// Replica selection jointly with the exact token split: the per-micro-step heart of the planner.
///
/// `ReplicaPlanner` is the per-thread workspace over the constructions, one file each: two-level mode
/// (`replicate/two_level.hpp`: owners fixed for the step, replicas in the spare slots), the free-mode sequential
/// fill (`replicate/free_fill.hpp`), the earlier LPT construction (`replicate/lpt.hpp`) and the plan of a given
/// placement (`replicate/from_placement.hpp`). Free mode (any slot holds anything) is here: the best of the
/// resident placement kept, the two-level plan with the step's owners (so never worse than two-level), the fill,
/// and the LPT construction as a fallback. What one construction hands another is a return value.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/core/topology.hpp"
#include "foremoe/plan/bounds.hpp"
#include "foremoe/plan/detail/layer_checks.hpp"
#include "foremoe/plan/detail/tolerance.hpp"
#include "foremoe/plan/plan.hpp"
#include "foremoe/plan/replicate/free_fill.hpp"
#include "foremoe/plan/replicate/from_placement.hpp"
#include "foremoe/plan/replicate/lpt.hpp"
#include "foremoe/plan/replicate/options.hpp"
#include "foremoe/plan/replicate/two_level.hpp"
#include "foremoe/plan/split.hpp"

namespace foremoe {
inline namespace v0 {

/// Plans replicas and token splits for single layers; keeps its scratch between calls (one per thread), and no
/// result of one call is read by another.
class ReplicaPlanner {
public:
  ReplicaPlanner(const Topology &topo, int num_experts)
      : topo_((topo.validate(num_experts), topo)), num_experts_(num_experts), two_level_(topo, num_experts),
        fill_(topo, num_experts), lpt_(topo, num_experts) {}

  [[nodiscard]] const Topology &topology() const noexcept { return topo_; }
  [[nodiscard]] int num_experts() const noexcept { return num_experts_; }

  /// Two-level plan: `owner_gpu[e]` keeps a copy of `e`; replicas fill spare slots. `resident` (may be null) is the
  /// previous micro-step's placement of this layer: its replicas are kept where useful at no move cost.
  [[nodiscard]] LayerPlan plan_two_level(std::span<const std::int64_t> loads, std::span<const std::int32_t> owner_gpu,
                                         const LayerPlacement *resident, const ReplicaOptions &opts = {}) {
    return two_level_.plan(loads, owner_gpu, resident, opts).plan;
  }

  /// Free plan: any slot may hold any expert (every expert at least once), owners not pinned. A move budget
  /// (`opts.move_budget >= 0`, which needs `owner_hint`) holds for every candidate: the two-level one plans within
  /// it and the others are dropped when they exceed it.
  ///
  /// Candidates, the best kept: the resident placement unchanged; the two-level plan with `owner_hint` (when
  /// given; a two-level plan is a valid free plan, so the pick is never worse than the two-level plan with those
  /// owners and this resident, except that the resident placement is kept within 0.1% of the best);
  /// the sequential fill below under a makespan search, when the two-level plan is not within 0.1% of the bound;
  /// the earlier LPT construction when still nothing is. Among candidates within 0.1% of the best (and never
  /// above the two-level one) the one with the fewest moves wins, so resident copies stay put when they are as
  /// good. Owners are `owner_hint` for the two-level candidate, else the GPU of each expert's first copy.
  [[nodiscard]] LayerPlan plan_free(std::span<const std::int64_t> loads, const LayerPlacement *resident,
                                    const ReplicaOptions &opts = {}, std::span<const std::int32_t> owner_hint = {}) {
    detail::check_expert_loads(loads, num_experts_, "plan_free");
    detail::check_resident_shape(resident, topo_, num_experts_, "plan_free");
    detail::require(owner_hint.empty() || static_cast<int>(owner_hint.size()) == num_experts_,
                    "plan_free: ", owner_hint.size(), " owners for ", num_experts_, " experts");
    const std::int64_t lb = lower_bound_free(loads, topo_);
    // Candidates within 0.1% of the best count as equal (the one moving least wins); the fill's search resolves
    // the makespan more finely, since its pieces are used as they are.
    const std::int64_t tolerance = lb / 1000; // 0 below 1000 tokens: tiny layers keep the best plan exactly
    const std::int64_t resolution = std::max<std::int64_t>(1, lb / 16384);
    constexpr std::int64_t none = std::numeric_limits<std::int64_t>::max();
    cands_.clear();
    // `indep`: the best makespan of the candidates that do not depend on the resident placement (the fill, the
    // LPT plan, the two-level plan from scratch).
    std::int64_t two_level_makespan = none, scratch_makespan = none, indep = none, best = none;
    const bool keep_candidate = resident != nullptr && detail::hosts_all_experts(*resident);
    if (keep_candidate) {
      detail::first_copy_owners(*resident, first_owner_);
      cands_.push_back(plan_from_placement(*resident, loads, first_owner_, resident));
      best = cands_.back().max_gpu_load;
    }
    detail::require(opts.move_budget < 0 || !owner_hint.empty(), "plan_free: a move budget (", opts.move_budget,
                    ") needs the step's owners (owner_hint)");
    if (!owner_hint.empty()) {
      ReplicaOptions two = opts;
      two.min_tokens_per_replica = 0; // applied to the pick below
      two.replica_cost = nullptr;
      two.token_time = nullptr;
      TwoLevelResult r = two_level_.plan(loads, owner_hint, resident, two);
      cands_.push_back(std::move(r.plan));
      two_level_makespan = cands_.back().max_gpu_load;
      scratch_makespan = indep = r.scratch_makespan;
      best = std::min(best, two_level_makespan);
    }
    // The fill only pays when it can beat the two-level plan by more than the tolerance. Whether it runs, and
    // its search range, depend on resident-independent values only, so the same loads give the same `indep`.
    if (indep > lb + tolerance)
      if (std::optional<LayerPlan> fill =
              fill_.plan(loads, lb, std::min(indep == none ? none : indep - tolerance, FreeFill::upper_bound(loads)),
                         resolution, resident)) {
        if (within_budget(*fill, opts.move_budget, owner_hint)) {
          cands_.push_back(std::move(*fill));
          best = std::min(best, cands_.back().max_gpu_load);
          indep = std::min(indep, cands_.back().max_gpu_load);
        }
      }
    // The earlier construction as well when nothing is within the tolerance of the bound yet (small or
    // slot-starved layers, where the fill's sequential pieces fit worst).
    if (indep > lb + tolerance) {
      LayerPlan lpt = lpt_.plan(loads, resident, opts);
      if (within_budget(lpt, opts.move_budget, owner_hint)) {
        cands_.push_back(std::move(lpt));
        best = std::min(best, cands_.back().max_gpu_load);
        indep = std::min(indep, cands_.back().max_gpu_load);
      }
    }
    // The others must be within the tolerance of the best and no worse than the two-level plan. The resident
    // placement is kept when within the tolerance of the resident-independent best and no worse than the
    // two-level plan from scratch: the plan of some loads, fed back as resident with the same loads, met both
    // limits when it was picked, so it is kept and nothing moves.
    const std::int64_t limit = std::min(best + tolerance, two_level_makespan);
    const std::int64_t keep_limit = std::min(indep == none ? none : indep + tolerance, scratch_makespan);
    std::size_t pick = cands_.size();
    for (std::size_t i = 0; i < cands_.size(); ++i) {
      const LayerPlan &c = cands_[i];
      if (c.max_gpu_load > (keep_candidate && i == 0 ? keep_limit : limit)) continue;
      if (pick == cands_.size() || c.moves.size() < cands_[pick].moves.size() ||
          (c.moves.size() == cands_[pick].moves.size() && c.max_gpu_load < cands_[pick].max_gpu_load))
        pick = i;
    }
    if (pick == cands_.size()) pick = 0; // unreachable: the best candidate meets its limit unless it is the kept one
    if (opts.tolerance > 0)
      pick = pick_within_tolerance(loads, opts.tolerance, opts.gradient_weight, opts.held_gradients, pick);
    LayerPlan out = std::move(cands_[pick]);
    if (opts.min_tokens_per_replica > 0) {
      detail::enforce_min_tokens(out, resident, opts.min_tokens_per_replica, topo_.gpus_per_node);
      if (opts.tolerance > 0)
        out.tolerance_met = out.max_gpu_load <= tolerance_limit(total_of(loads), topo_.num_gpus(), opts.tolerance);
    }
    return out;
  }

  /// A plan for a given placement: exact split and moves from `resident`.
  [[nodiscard]] LayerPlan plan_from_placement(const LayerPlacement &placement, std::span<const std::int64_t> loads,
                                              std::span<const std::int32_t> owner_gpu, const LayerPlacement *resident) {
    return foremoe::plan_from_placement(placement, loads, owner_gpu, resident, topo_.gpus_per_node, split_);
  }

private:
  [[nodiscard]] static std::int64_t total_of(std::span<const std::int64_t> loads) {
    std::int64_t t = 0;
    for (std::int64_t x : loads)
      t += x;
    return t;
  }
  /// Whether `plan` brings at most `budget` new copies to each GPU (`budget < 0`: always), counting every move
  /// except that of an expert's copy on the GPU that owns it both in the plan and in `owner_hint`, so at least
  /// what `validate` counts.
  [[nodiscard]] static bool within_budget(const LayerPlan &plan, int budget, std::span<const std::int32_t> owner_hint) {
    if (budget < 0) return true;
    std::vector<int> per_gpu(static_cast<std::size_t>(plan.placement.num_gpus()), 0);
    for (const Move &m : plan.moves) {
      const bool owner_copy =
          plan.owner_gpu[m.expert] == m.dst_gpu && !owner_hint.empty() && owner_hint[m.expert] == m.dst_gpu;
      if (!owner_copy && ++per_gpu[m.dst_gpu] > budget) return false;
    }
    return true;
  }
  /// With a tolerance: the candidate with the fewest bytes within it (`detail::tolerance_bytes`; ties: lower
  /// maximum, then the earlier), else the most balanced one (`fallback` where it is as balanced), marked as not
  /// meeting it.
  [[nodiscard]] std::size_t pick_within_tolerance(std::span<const std::int64_t> loads, double tol,
                                                  double gradient_weight, std::span<const std::int32_t> held,
                                                  std::size_t fallback) {
    const std::int64_t limit = tolerance_limit(total_of(loads), topo_.num_gpus(), tol);
    std::size_t pick = cands_.size(), most = fallback;
    double pick_bytes = 0;
    for (std::size_t i = 0; i < cands_.size(); ++i) {
      const LayerPlan &c = cands_[i];
      if (c.max_gpu_load < cands_[most].max_gpu_load) most = i;
      if (c.max_gpu_load > limit) continue;
      const double b = detail::tolerance_bytes(c, gradient_weight, held);
      if (pick == cands_.size() || b < pick_bytes || (b == pick_bytes && c.max_gpu_load < cands_[pick].max_gpu_load)) {
        pick = i;
        pick_bytes = b;
      }
    }
    if (pick == cands_.size()) pick = most;
    cands_[pick].tolerance_met = cands_[pick].max_gpu_load <= limit;
    return pick;
  }

  Topology topo_;
  int num_experts_ = 0;
  SplitSolver split_;
  TwoLevelPlanner two_level_;
  FreeFill fill_;
  FreeLpt lpt_;
  std::vector<LayerPlan> cands_;
  std::vector<std::int32_t> first_owner_;
};

/// Two-level plan of one layer (allocates a workspace; reuse a `ReplicaPlanner` in loops).
[[nodiscard]] inline LayerPlan plan_two_level(std::span<const std::int64_t> loads,
                                              std::span<const std::int32_t> owner_gpu, const Topology &topo,
                                              const LayerPlacement *resident = nullptr,
                                              const ReplicaOptions &opts = {}) {
  ReplicaPlanner planner(topo, static_cast<int>(loads.size()));
  return planner.plan_two_level(loads, owner_gpu, resident, opts);
}

/// Free-mode plan of one layer (allocates a workspace; reuse a `ReplicaPlanner` in loops).
[[nodiscard]] inline LayerPlan plan_free(std::span<const std::int64_t> loads, const Topology &topo,
                                         const LayerPlacement *resident = nullptr, const ReplicaOptions &opts = {}) {
  ReplicaPlanner planner(topo, static_cast<int>(loads.size()));
  return planner.plan_free(loads, resident, opts);
}

} // namespace v0
} // namespace foremoe
