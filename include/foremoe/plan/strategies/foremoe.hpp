#pragma once
/// @file
/// Strategy "foremoe": two-level per-micro-step planning (step-level owners, replicas in the spare slots).

#include <cstdint>
#include <memory>
#include <span>

#include "foremoe/plan/strategy.hpp"

namespace foremoe {
inline namespace v0 {

/// Owners per RL step from its totals (kept from the previous step unless re-owning is free), replicas and the
/// token split per micro-step.
class ForemoeStrategy : public PlanStrategy {
public:
  void begin_step(const PlanShape &shape, std::span<const std::int64_t> step_totals, std::span<const std::int64_t>,
                  OwnerMap &owners) override {
    owners = shape.plan_owners(step_totals, shape.opts.reowning_free ? OwnerMap{} : owners);
  }
  void begin_micro_step(const PlanShape &shape, std::span<const std::int64_t> loads, OwnerMap &owners) override {
    if (owners.empty()) owners = shape.plan_owners(loads);
  }
  [[nodiscard]] LayerPlan plan_layer(const LayerRequest &req, ReplicaPlanner &ws) const override {
    return ws.plan_two_level(req.loads, req.owners, req.resident, req.replica);
  }
};

namespace detail {
inline const bool foremoe_strategy_registered =
    (register_strategy({"foremoe",
                        "per-micro-step replicas in the spare slots next to step-level owners (two-level)",
                        {"move_budget", "hierarchical_owners", "reowning_free", "owner_keep_tolerance",
                         "local_search_rounds", "exact_split", "tolerance", "min_tokens_per_replica"},
                        40,
                        [] { return std::make_unique<ForemoeStrategy>(); }}),
     true);
} // namespace detail

} // namespace v0
} // namespace foremoe
