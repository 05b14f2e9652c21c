#pragma once
/// @file
/// Strategy "foremoe-free": per-micro-step planning in which any slot holds any expert.

#include <memory>

#include "foremoe/plan/strategies/foremoe.hpp"

namespace foremoe {
inline namespace v0 {

/// Owners as `ForemoeStrategy` (the two-level plan with them and the same resident placement is one of the
/// candidates); each micro-step's plan then places copies anywhere, within the move budget when one is set.
class ForemoeFreeStrategy : public ForemoeStrategy {
public:
  [[nodiscard]] LayerPlan plan_layer(const LayerRequest &req, ReplicaPlanner &ws) const override {
    return ws.plan_free(req.loads, req.resident, req.replica, req.owners);
  }
  [[nodiscard]] bool plans_own_owners() const noexcept override { return true; }
};

namespace detail {
inline const bool foremoe_free_strategy_registered =
    (register_strategy(
         {"foremoe-free",
          "per-micro-step planning where any slot holds any expert (free mode)",
          {"move_budget", "hierarchical_owners", "reowning_free", "owner_keep_tolerance", "local_search_rounds",
           "free_search_rounds", "exact_split", "tolerance", "min_tokens_per_replica"},
          50,
          [] { return std::make_unique<ForemoeFreeStrategy>(); }}),
     true);
} // namespace detail

} // namespace v0
} // namespace foremoe
