#pragma once
/// @file
/// Strategy "eplb-split": EPLB's placement from the previous steps' loads (as "eplb", every `eplb_interval` steps),
/// no moves during the step, but each micro-step's tokens split exactly over the copies in place (what SGLang's LPLB
/// does per batch).

#include <memory>

#include "foremoe/plan/plan.hpp"
#include "foremoe/plan/strategies/eplb.hpp"
#include "foremoe/plan/strategy.hpp"

namespace foremoe {
inline namespace v0 {

/// `EplbStrategy`'s tables and placement; every layer's tokens re-split by `SplitSolver` for the least GPU peak.
/// Never less balanced than "eplb": EPLB's even split is one of the splits the exact one chooses from.
class EplbSplitStrategy : public EplbStrategy {
public:
  [[nodiscard]] LayerPlan plan_layer(const LayerRequest &req, ReplicaPlanner &ws) const override {
    LayerPlan even = EplbStrategy::plan_layer(req, ws);
    return ws.plan_from_placement(even.placement, req.loads, even.owner_gpu, req.resident);
  }
};

namespace detail {
inline const bool eplb_split_strategy_registered =
    (register_strategy({"eplb-split",
                        "EPLB's placement from the previous steps' loads, each micro-step's tokens split exactly over "
                        "its copies (SGLang LPLB-style), no moves",
                        {"eplb_num_groups", "eplb_interval"},
                        25,
                        [] { return std::make_unique<EplbSplitStrategy>(); }}),
     true);
} // namespace detail

} // namespace v0
} // namespace foremoe
