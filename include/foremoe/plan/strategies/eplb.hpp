#pragma once
/// @file
/// Strategy "eplb": DeepSeek EPLB from the previous step's summed loads, unchanged for the whole step.

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "foremoe/plan/eplb.hpp"
#include "foremoe/plan/strategy.hpp"

namespace foremoe {
inline namespace v0 {

/// EPLB tables from the previous step's totals; the static placement while there is no history.
class EplbStrategy : public PlanStrategy {
public:
  void begin_step(const PlanShape &shape, std::span<const std::int64_t>, std::span<const std::int64_t> previous,
                  OwnerMap &) override {
    if (previous.empty()) {
      tables_.clear();
      return;
    }
    shape.check_layer_loads(previous, "begin_step (previous step)");
    tables_ = rebalance(shape, previous);
  }
  [[nodiscard]] LayerPlan plan_layer(const LayerRequest &req, ReplicaPlanner &ws) const override {
    if (tables_.empty())
      return ws.plan_from_placement(req.shape.static_placement(), req.loads, req.shape.static_owner_row(),
                                    req.resident);
    return eplb_to_layer_plan(tables_[req.layer], req.loads, req.shape.topo, req.resident);
  }
  /// EPLB places every copy itself; its owners are each expert's first copy in the first micro-step.
  [[nodiscard]] bool plans_own_owners() const noexcept override { return true; }

protected:
  [[nodiscard]] static std::vector<EplbLayer> rebalance(const PlanShape &shape, std::span<const std::int64_t> totals) {
    std::vector<double> w(totals.begin(), totals.end());
    return eplb_rebalance(w, shape.num_layers, shape.num_experts, shape.opts.eplb_num_groups, shape.topo);
  }
  std::vector<EplbLayer> tables_; ///< per layer; empty: static placement
};

namespace detail {
inline const bool eplb_strategy_registered =
    (register_strategy({"eplb",
                        "DeepSeek EPLB from the previous step's loads, fixed for the step",
                        {"eplb_num_groups"},
                        20,
                        [] { return std::make_unique<EplbStrategy>(); }}),
     true);
} // namespace detail

} // namespace v0
} // namespace foremoe
