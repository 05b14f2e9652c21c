#pragma once
/// @file
/// Strategy "eplb-oracle": DeepSeek EPLB from the current step's summed loads (an upper bound for step-level
/// rebalancing).

#include <cstdint>
#include <memory>
#include <span>

#include "foremoe/plan/strategies/eplb.hpp"

namespace foremoe {
inline namespace v0 {

/// `EplbStrategy` planned from the step being run (or the micro-step, planned alone).
class EplbOracleStrategy : public EplbStrategy {
public:
  void begin_step(const PlanShape &shape, std::span<const std::int64_t> step_totals, std::span<const std::int64_t>,
                  OwnerMap &) override {
    tables_ = rebalance(shape, step_totals);
  }
  void begin_micro_step(const PlanShape &shape, std::span<const std::int64_t> loads, OwnerMap &) override {
    if (tables_.empty()) tables_ = rebalance(shape, loads);
  }
};

namespace detail {
inline const bool eplb_oracle_strategy_registered =
    (register_strategy({"eplb-oracle",
                        "DeepSeek EPLB from the current step's loads (knows the step in advance)",
                        {"eplb_num_groups"},
                        30,
                        [] { return std::make_unique<EplbOracleStrategy>(); }}),
     true);
} // namespace detail

} // namespace v0
} // namespace foremoe
