#pragma once
/// @file
/// Strategy "ideal": the physical limit the simulator compares against. Every layer's tokens are cut into equal
/// pieces, one per GPU; `physical_limit()` makes the simulator charge none of its transfers and time and size it
/// from each GPU's tokens alone (see `PlanStrategy::physical_limit`). A reference, not a deployable plan: it ignores
/// the slot limit and is offered by `foremoe simulate` only (`StrategyInfo::simulator_only`).

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "foremoe/plan/strategy.hpp"

namespace foremoe {
inline namespace v0 {

/// The even split of one layer: its experts' loads concatenated in expert order and cut into `num_gpus` pieces of
/// `floor(T / G)` or `ceil(T / G)` tokens, so an expert's copies sit on consecutive GPUs. The `T % G` pieces with a
/// token more go to local GPU 0 of every node, then local GPU 1 of every node, and so on, so nodes too differ by at
/// most one token. `experts_of_gpu[g]` lists GPU g's experts in increasing order with their tokens; an expert without
/// tokens sits (with 0) on the GPU whose piece holds its place in the concatenation (the last GPU at its end), every
/// expert on `static_owner[e]` when the layer has no token. `owner[e]` is the GPU of its first copy.
struct EvenSplitLayer {
  std::vector<std::vector<std::pair<std::int32_t, std::int64_t>>> experts_of_gpu;
  std::vector<std::int32_t> owner;
};

/// See `EvenSplitLayer`. `static_owner` (`[experts]`) places the experts of a layer without tokens.
[[nodiscard]] inline EvenSplitLayer even_split_layer(std::span<const std::int64_t> loads, int num_gpus,
                                                     int gpus_per_node, std::span<const std::int32_t> static_owner) {
  const int E = static_cast<int>(loads.size()), G = num_gpus, P = gpus_per_node, N = G / P;
  EvenSplitLayer out;
  out.experts_of_gpu.resize(static_cast<std::size_t>(G));
  out.owner.assign(static_cast<std::size_t>(E), -1);
  std::int64_t total = 0;
  for (const std::int64_t v : loads)
    total += v;
  const auto add = [&](int g, int e, std::int64_t t) {
    out.experts_of_gpu[g].emplace_back(e, t);
    if (out.owner[e] < 0) out.owner[e] = g;
  };
  if (total == 0) {
    for (int e = 0; e < E; ++e)
      add(static_owner[e], e, 0);
    return out;
  }
  const std::int64_t q = total / G, r = total % G;
  std::vector<std::int64_t> starts(static_cast<std::size_t>(G) + 1, 0); // GPU g's piece starts at starts[g]
  for (int g = 0; g < G; ++g)
    starts[g + 1] = starts[g] + q + ((g % P) * N + g / P < r ? 1 : 0);
  const auto start_of = [&](int g) { return starts[g]; };
  std::int64_t pos = 0;
  int g = 0; // the GPU whose piece holds `pos` (the last one at the end)
  for (int e = 0; e < E; ++e) {
    while (g + 1 < G && start_of(g + 1) <= pos)
      ++g;
    const std::int64_t end = pos + loads[e];
    if (loads[e] == 0) add(g, e, 0);
    for (int h = g; h < G && start_of(h) < end; ++h) {
      const std::int64_t piece = std::min(end, start_of(h + 1)) - std::max(pos, start_of(h));
      if (piece > 0) add(h, e, piece);
    }
    pos = end;
  }
  return out;
}

/// Plans every layer as `even_split_layer`; owners are each expert's first copy (so they change with the loads).
class IdealStrategy : public PlanStrategy {
public:
  void begin_step(const PlanShape &, std::span<const std::int64_t>, std::span<const std::int64_t>,
                  OwnerMap &owners) override {
    owners.clear(); // each layer plan picks its own
  }
  [[nodiscard]] LayerPlan plan_layer(const LayerRequest &req, ReplicaPlanner &) const override {
    const Topology &topo = req.shape.topo;
    const int G = topo.num_gpus(), S = topo.slots_per_gpu, E = req.shape.num_experts;
    const EvenSplitLayer split = even_split_layer(req.loads, G, topo.gpus_per_node, req.shape.static_owner_row());
    std::vector<std::vector<std::int32_t>> experts(static_cast<std::size_t>(G));
    for (int g = 0; g < G; ++g)
      for (const auto &[e, t] : split.experts_of_gpu[g])
        experts[g].push_back(e);
    LayerPlan lp;
    // Copies already resident keep their slots, so the listed moves are the real ones (free, see below).
    lp.placement = layout_slots(G, S, E, experts, req.resident);
    lp.owner_gpu = split.owner;
    lp.slot_tokens.assign(static_cast<std::size_t>(G) * S, 0);
    for (int g = 0; g < G; ++g) {
      std::int64_t gpu_load = 0;
      for (int s = 0; s < S; ++s) {
        const std::int32_t e = lp.placement.slot(g, s);
        if (e == empty_slot) continue;
        const auto &list = split.experts_of_gpu[g];
        const auto it = std::find_if(list.begin(), list.end(), [e](const auto &x) { return x.first == e; });
        lp.slot_tokens[static_cast<std::size_t>(g) * S + s] = it->second;
        gpu_load += it->second;
      }
      lp.max_gpu_load = std::max(lp.max_gpu_load, gpu_load);
    }
    lp.moves = compute_moves(lp.placement, lp.owner_gpu, req.resident, topo.gpus_per_node);
    return lp;
  }
  [[nodiscard]] bool plans_own_owners() const noexcept override { return true; }
  /// A GPU's piece may span any number of light experts: one slot per expert, so no load needs more.
  [[nodiscard]] int slots_per_gpu(const Topology &topo, int num_experts) const noexcept override {
    return std::max(topo.slots_per_gpu, num_experts);
  }
  [[nodiscard]] bool physical_limit() const noexcept override { return true; }
};

namespace detail {
inline const bool ideal_strategy_registered =
    (register_strategy({"ideal",
                        "the physical limit, for comparison in foremoe simulate: each layer's tokens cut into equal "
                        "pieces per GPU (experts in order, copies on consecutive GPUs), any number of experts per GPU, "
                        "moves and gradient returns free",
                        {},
                        1000,
                        [] { return std::make_unique<IdealStrategy>(); },
                        true}),
     true);
} // namespace detail

} // namespace v0
} // namespace foremoe
