#pragma once
/// @file
/// Strategy "static": contiguous experts, no replicas (Megatron-style expert parallelism).

#include <cstdint>
#include <memory>
#include <span>

#include "foremoe/plan/strategy.hpp"

namespace foremoe {
inline namespace v0 {

/// Expert `e` on GPU `e / owners_per_gpu` in every micro-step; the owner map is the planner's (static unless set).
class StaticStrategy : public PlanStrategy {
public:
  void begin_step(const PlanShape &shape, std::span<const std::int64_t>, std::span<const std::int64_t>,
                  OwnerMap &owners) override {
    owners = shape.static_owners();
  }
  void begin_micro_step(const PlanShape &shape, std::span<const std::int64_t>, OwnerMap &owners) override {
    if (owners.empty()) owners = shape.static_owners();
  }
  [[nodiscard]] LayerPlan plan_layer(const LayerRequest &req, ReplicaPlanner &ws) const override {
    return ws.plan_from_placement(req.shape.static_placement(), req.loads, req.owners, req.resident);
  }
};

namespace detail {
inline const bool static_strategy_registered =
    (register_strategy({"static",
                        "contiguous experts, no replicas (Megatron-style EP)",
                        {},
                        10,
                        [] { return std::make_unique<StaticStrategy>(); }}),
     true);
} // namespace detail

} // namespace v0
} // namespace foremoe
