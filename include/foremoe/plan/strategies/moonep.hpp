#pragma once
/// @file
/// Strategy "moonep": a re-implementation of MoonEP's published per-micro-batch planner, as a baseline to compare
/// against (not ForeMoE's method).
///
/// The published algorithm (MoonshotAI/MoonEP, open source: a GPU planner inside dispatch/combine; its torch
/// planning reference in the repository's tests), in our words: the EP group sits inside one NVLink domain and
/// every rank must compute exactly `S * K` token-expert assignments (its `S` tokens times top-`K`, the group's
/// mean), with statically known shapes. A rank's own experts form its home group; a group's balance is its tokens
/// minus `S * K`. The planner repeatedly takes the most overloaded home group and the destination with the most
/// room and fills that destination completely from that group, so a destination takes replicas from at most one
/// home group (a group that gives more than its excess drops below `S * K` and becomes a destination itself). Each
/// group then splits its quotas over its experts: the largest open quota first, served by the expert with the most
/// tokens left. Remote experts' weights are prefetched over NVLink every layer and micro-batch (TMA push, no reuse),
/// and duplicated experts' gradients are reduced back to the home rank in backward. No minimum tokens per replica.
///
/// What this re-implementation does differently (every known difference):
/// - The NVLink domain is a node of `Topology::gpus_per_node` GPUs: balance is exact inside each node, to
///   `node tokens / node GPUs` per rank (the remainder of the division goes one token each to the ranks with the
///   most own tokens), and imbalance between nodes stays. That is `S * K` exactly when the EP group is one node and
///   the tokens divide.
/// - A destination takes at most `R` remote experts, `R` the topology's spare slots per GPU (`slots_per_gpu -
///   ceil(experts / GPUs)`); the published planner bounds them only through the one-home-group rule (at most the
///   group's experts; the Megatron integration reserves `E / EP` prefetch slots). Quota a destination cannot take
///   within `R` stays on the home rank, and the layer is then not exact (`MoonepLayerResult::exact`).
/// - Ties (equal balances, equal quotas, equal tokens left) go to the lowest index; the published planner's
///   argmax/argmin order is the same.
/// - Plans are integer token counts per physical expert copy (exact: each expert's copies sum to its load), not the
///   per-token destination offsets MoonEP builds; dispatch traffic is the simulator's all-to-all model.
/// - Planning runs on the CPU through `Planner`; MoonEP plans on the GPU inside dispatch, and its planner latency
///   and prefetch kernels are not modelled. The simulator charges the prefetch with its own move model: one
///   GPU-direct intra-node move per replica per micro-step and layer, from the home rank (`reuses_resident() ==
///   false`, see `full_push_moves`), in the same overlap windows as every strategy, and the gradient returns with
///   its gradient model.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/core/topology.hpp"
#include "foremoe/plan/detail/baseline_plan.hpp"
#include "foremoe/plan/plan.hpp"
#include "foremoe/plan/strategy.hpp"

namespace foremoe {
inline namespace v0 {

/// Options of `moonep_plan_layer`.
struct MoonepOptions {
  int max_replicas_per_gpu = -1; ///< remote experts per destination; < 0: the topology's spare slots per GPU
  /// GPUs per balancing domain (MoonEP's NVLink domain, where replicas may go), consecutive GPUs from 0; 0: a node
  /// of the topology; -1: the whole EP group. It must divide the EP group's GPUs.
  int domain_gpus = 0;
};

/// One layer planned as MoonEP plans it.
struct MoonepLayerResult {
  LayerPlan plan;
  /// Whether every GPU runs exactly its node's share (`targets`); false only when some destination needed more
  /// than the allowed remote experts.
  bool exact = true;
  std::vector<std::int64_t> targets; ///< `[gpus]`: the tokens each GPU should run (its node's exact share)
  std::vector<int> home_group;       ///< `[gpus]`: the GPU whose experts it took replicas from, or -1
};

/// Plans one layer as MoonEP does (see the file comment): static owners, per node each destination filled from one
/// home group to the node's exact share, replicas in the spare slots, moves a full push from `resident`.
[[nodiscard]] inline MoonepLayerResult moonep_plan_layer(std::span<const std::int64_t> loads, const Topology &topo,
                                                         const MoonepOptions &opts = {},
                                                         const LayerPlacement *resident = nullptr) {
  detail::check_baseline_inputs(loads, topo, resident, "moonep");
  const int num_experts = static_cast<int>(loads.size()), per_gpu = topo.owners_per_gpu(num_experts);
  const int R = opts.max_replicas_per_gpu < 0 ? topo.spare_slots_per_gpu(num_experts)
                                              : std::min(opts.max_replicas_per_gpu, topo.slots_per_gpu - per_gpu);
  const int n = detail::baseline_domain(topo, opts.domain_gpus, "moonep");
  const std::vector<std::int64_t> rank = detail::static_rank_loads(loads, topo);
  MoonepLayerResult res;
  res.targets.assign(static_cast<std::size_t>(topo.num_gpus()), 0);
  res.home_group.assign(static_cast<std::size_t>(topo.num_gpus()), -1);
  std::vector<detail::BaselineQuota> quotas;
  std::vector<std::int64_t> balance(static_cast<std::size_t>(n)), z(static_cast<std::size_t>(n) * n), left, open;
  std::vector<int> order(static_cast<std::size_t>(n)), remote(static_cast<std::size_t>(n));
  std::vector<std::int32_t> remote_experts(static_cast<std::size_t>(n) * std::max(R, 1));
  for (int first = 0; first < topo.num_gpus(); first += n) {
    std::int64_t total = 0;
    for (int i = 0; i < n; ++i)
      total += rank[first + i];
    // Exact shares: floor for all, one more for the `total % n` ranks with the most own tokens.
    for (int i = 0; i < n; ++i)
      order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return rank[first + a] > rank[first + b]; });
    for (int k = 0; k < n; ++k)
      res.targets[first + order[k]] = total / n + (k < total % n ? 1 : 0);
    for (int i = 0; i < n; ++i)
      balance[i] = rank[first + i] - res.targets[first + i];
    // Receive quotas z[h][u]: fill the roomiest destination completely from the most overloaded home group.
    std::fill(z.begin(), z.end(), 0);
    for (;;) {
      const int h = static_cast<int>(std::max_element(balance.begin(), balance.end()) - balance.begin());
      const int u = static_cast<int>(std::min_element(balance.begin(), balance.end()) - balance.begin());
      if (balance[h] <= 0) break;
      const std::int64_t move = -balance[u];
      z[static_cast<std::size_t>(h) * n + u] = move;
      balance[h] -= move;
      balance[u] = 0;
      res.home_group[first + u] = first + h;
    }
    // Per home group: the largest open quota first, from the expert with the most tokens left.
    std::fill(remote.begin(), remote.end(), 0);
    for (int h = 0; h < n; ++h) {
      const int g = first + h;
      const int e0 = g * per_gpu, e1 = std::min(num_experts, (g + 1) * per_gpu);
      if (e0 >= e1) continue;
      left.assign(loads.begin() + e0, loads.begin() + e1);
      open.assign(z.begin() + static_cast<std::ptrdiff_t>(h) * n, z.begin() + static_cast<std::ptrdiff_t>(h + 1) * n);
      for (;;) {
        const int d = static_cast<int>(std::max_element(open.begin(), open.end()) - open.begin());
        if (open[d] <= 0) break;
        // The hottest expert left that the destination may still take: one it already holds, or any while it
        // has a free remote slot.
        const auto held = [&](int e) {
          const auto *b = remote_experts.data() + static_cast<std::size_t>(d) * std::max(R, 1);
          return std::find(b, b + remote[d], e) != b + remote[d];
        };
        int pick = -1;
        for (int k = 0; k < e1 - e0; ++k) {
          if (left[k] <= 0 || (remote[d] >= R && !held(e0 + k))) continue;
          if (pick < 0 || left[k] > left[pick]) pick = k;
        }
        if (pick < 0) { // within R nothing more fits: the rest stays home
          open[d] = 0;
          continue;
        }
        const std::int64_t take = std::min(left[pick], open[d]);
        if (!held(e0 + pick)) remote_experts[static_cast<std::size_t>(d) * std::max(R, 1) + remote[d]++] = e0 + pick;
        quotas.push_back({static_cast<std::int32_t>(e0 + pick), static_cast<std::int32_t>(first + d), take});
        left[pick] -= take;
        open[d] -= take;
      }
    }
  }
  res.plan = detail::plan_from_quotas(loads, topo, quotas, resident, "moonep");
  const std::vector<std::int64_t> got = res.plan.gpu_loads();
  res.exact = std::equal(got.begin(), got.end(), res.targets.begin());
  return res;
}

/// MoonEP per micro-step and layer, static owners, every replica re-pushed each micro-step.
class MoonepStrategy : public PlanStrategy {
public:
  void begin_step(const PlanShape &shape, std::span<const std::int64_t>, std::span<const std::int64_t>,
                  OwnerMap &owners) override {
    owners = shape.static_owners();
  }
  void begin_micro_step(const PlanShape &shape, std::span<const std::int64_t>, OwnerMap &owners) override {
    if (owners.empty()) owners = shape.static_owners();
  }
  [[nodiscard]] LayerPlan plan_layer(const LayerRequest &req, ReplicaPlanner &) const override {
    MoonepOptions o;
    o.domain_gpus = req.shape.opts.peer_domain_gpus;
    return moonep_plan_layer(req.loads, req.shape.topo, o, req.resident).plan;
  }
  [[nodiscard]] bool reuses_resident() const noexcept override { return false; }
};

namespace detail {
inline const bool moonep_strategy_registered =
    (register_strategy({"moonep",
                        "baseline, re-implemented: MoonEP's exact per-micro-batch balance (one home group per rank, "
                        "replicas in the node, weights re-pushed every micro-step)",
                        {"peer_domain_gpus"},
                        36,
                        [] { return std::make_unique<MoonepStrategy>(); }}),
     true);
} // namespace detail

} // namespace v0
} // namespace foremoe
