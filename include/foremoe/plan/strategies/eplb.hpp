#pragma once
/// @file
/// Strategy "eplb": DeepSeek EPLB from the summed loads of the steps before (every `eplb_interval` steps),
/// unchanged for the whole step.

#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <vector>

#include "foremoe/plan/eplb.hpp"
#include "foremoe/plan/strategy.hpp"

namespace foremoe {
inline namespace v0 {

/// EPLB tables rebalanced every `PlannerOptions::eplb_interval` RL steps from the loads of the steps since the last
/// rebalance; the static placement before the first one. The strategy keeps the window itself: each non-empty
/// `previous_step_totals` handed to `begin_step` is one finished step (see `PlanStrategy::begin_step`); after the
/// `n`-th, with `n % eplb_interval == 0`, it rebalances from the sum of the last `eplb_interval` of them. So step
/// `s` (0-based, its previous step's totals handed from step 1 on) plans from steps `s - N .. s - 1` when
/// `s % N == 0`, and keeps the tables in between; with `N = 1` every step plans from the one before it.
class EplbStrategy : public PlanStrategy {
public:
  void begin_step(const PlanShape &shape, std::span<const std::int64_t>, std::span<const std::int64_t> previous,
                  OwnerMap &) override {
    if (previous.empty()) return; // no finished step to add: the first step, or another stage of the same step
    shape.check_layer_loads(previous, "begin_step (previous step)");
    if (window_.empty()) window_.assign(previous.size(), 0);
    // No overflow: each checked step's layer sums are within `limits::max_load_total` (2^42) and the window holds
    // at most `eplb_interval` (<= 2^16 in the schema; any int in code: the add is checked) of them.
    for (std::size_t i = 0; i < previous.size(); ++i) {
      detail::require(previous[i] <= std::numeric_limits<std::int64_t>::max() - window_[i],
                      "begin_step (previous step): the eplb window's load of layer ", i / shape.num_experts,
                      ", expert ", i % shape.num_experts, " overflows int64");
      window_[i] += previous[i];
    }
    if (++steps_in_window_ < shape.opts.eplb_interval) return;
    tables_ = rebalance(shape, window_);
    window_.assign(window_.size(), 0);
    steps_in_window_ = 0;
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
  std::vector<EplbLayer> tables_;    ///< per layer; empty: static placement
  std::vector<std::int64_t> window_; ///< `[layers][experts]` loads of the steps since the last rebalance
  int steps_in_window_ = 0;          ///< how many steps `window_` sums
};

namespace detail {
inline const bool eplb_strategy_registered =
    (register_strategy({"eplb",
                        "DeepSeek EPLB from the previous steps' loads (every eplb_interval steps), fixed for the step",
                        {"eplb_num_groups", "eplb_interval"},
                        20,
                        [] { return std::make_unique<EplbStrategy>(); }}),
     true);
} // namespace detail

} // namespace v0
} // namespace foremoe
