#pragma once
/// @file
/// A re-implementation of DeepSeek EPLB's `rebalance_experts`, written from the algorithm's description, as the
/// baseline.
///
/// EPLB, per layer: `replicate_experts` fills *all* `gpus * slots` physical slots by repeatedly giving one more
/// copy to the expert with the largest load per copy; `balanced_packing` is LPT with an equal item count per pack
/// (items by weight, descending, each to the lightest pack that still has room). The hierarchical policy (when the
/// expert groups divide evenly over the nodes) packs groups to nodes, replicates inside each node and packs the
/// node's physical experts to its GPUs; otherwise the global policy does the same with one group and one node.
/// Tokens are split evenly over an expert's copies.
///
/// Differences from ForeMoE's plans, kept visible here:
/// - EPLB may put two copies of one expert on one GPU. `EplbLayer` keeps that faithfully; `to_layer_plan` merges
///   such copies into one slot with their summed tokens (same per-GPU load, one slot left empty), because a
///   `LayerPlacement` never holds duplicates.
/// - EPLB has no owners; `to_layer_plan` reports the GPU of an expert's first physical copy as its owner.
/// - Ties: sorts are stable and the "max load per copy" pick takes the lowest expert id, where PyTorch leaves the
///   order of equal elements unspecified.

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/plan/plan.hpp"
#include "foremoe/plan/split.hpp"

namespace foremoe {
inline namespace v0 {

/// One layer of EPLB's result, as EPLB represents it.
struct EplbLayer {
  std::vector<std::int32_t> phys_to_log;   ///< `[gpus * slots]` logical expert of each physical slot
  std::vector<std::int32_t> replica_rank;  ///< `[gpus * slots]` index of that copy among its expert's copies
  std::vector<std::int32_t> replica_count; ///< `[experts]` copies of each expert
};

/// `balanced_packing`: pack index and rank inside the pack of every item (`weights.size() % num_packs == 0`).
inline void eplb_balanced_packing(std::span<const double> weights, int num_packs, std::vector<std::int32_t> &pack_index,
                                  std::vector<std::int32_t> &rank_in_pack) {
  const int n = static_cast<int>(weights.size());
  detail::require(num_packs > 0 && n % num_packs == 0, "eplb balanced_packing: ", n, " items do not divide into ",
                  num_packs, " packs");
  const int per_pack = n / num_packs;
  pack_index.assign(static_cast<std::size_t>(n), 0);
  rank_in_pack.assign(static_cast<std::size_t>(n), 0);
  if (per_pack == 1) {
    std::iota(pack_index.begin(), pack_index.end(), 0);
    return;
  }
  std::vector<std::int32_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return weights[a] > weights[b]; });
  std::vector<double> pack_weight(static_cast<std::size_t>(num_packs), 0.0);
  std::vector<int> pack_items(static_cast<std::size_t>(num_packs), 0);
  for (std::int32_t item : order) {
    int best = -1;
    for (int p = 0; p < num_packs; ++p)
      if (pack_items[p] < per_pack && (best < 0 || pack_weight[p] < pack_weight[best])) best = p;
    pack_index[item] = best;
    rank_in_pack[item] = pack_items[best]++;
    pack_weight[best] += weights[item];
  }
}

/// `replicate_experts`: `num_physical` copies of `weights.size()` experts; writes the expert and copy rank of
/// every physical copy and each expert's copy count.
inline void eplb_replicate_experts(std::span<const double> weights, int num_physical,
                                   std::vector<std::int32_t> &phys_to_log, std::vector<std::int32_t> &rank,
                                   std::vector<std::int32_t> &count) {
  const int n = static_cast<int>(weights.size());
  detail::require(num_physical >= n, "eplb replicate_experts: ", num_physical, " physical slots for ", n, " experts");
  phys_to_log.resize(static_cast<std::size_t>(num_physical));
  rank.assign(static_cast<std::size_t>(num_physical), 0);
  count.assign(static_cast<std::size_t>(n), 1);
  std::iota(phys_to_log.begin(), phys_to_log.begin() + n, 0);
  for (int p = n; p < num_physical; ++p) {
    int best = 0;
    for (int e = 1; e < n; ++e)
      if (weights[e] / count[e] > weights[best] / count[best]) best = e;
    phys_to_log[p] = best;
    rank[p] = count[best]++;
  }
}

/// `rebalance_experts` for one layer: hierarchical when `num_groups % num_nodes == 0`, else global.
[[nodiscard]] inline EplbLayer eplb_rebalance_layer(std::span<const double> weights, int num_physical, int num_groups,
                                                    int num_nodes, int num_gpus) {
  const int num_experts = static_cast<int>(weights.size());
  detail::require(num_groups > 0 && num_nodes > 0 && num_gpus > 0, "eplb: groups, nodes and GPUs must be positive");
  if (num_groups % num_nodes != 0) {
    num_groups = 1;
    num_nodes = 1;
  }
  detail::require(num_experts % num_groups == 0, "eplb: ", num_experts, " experts do not divide into ", num_groups,
                  " groups");
  detail::require(num_gpus % num_nodes == 0, "eplb: ", num_gpus, " GPUs do not divide into ", num_nodes, " nodes");
  detail::require(num_physical % num_gpus == 0, "eplb: ", num_physical, " physical slots do not divide over ", num_gpus,
                  " GPUs");
  detail::require(num_physical >= num_experts, "eplb: ", num_physical, " physical slots for ", num_experts, " experts");
  const int group_size = num_experts / num_groups, groups_per_node = num_groups / num_nodes;
  const int phys_per_gpu = num_physical / num_gpus, phys_per_node = num_physical / num_nodes;
  const int experts_per_node = num_experts / num_nodes, gpus_per_node = num_gpus / num_nodes;

  // Step 1: groups to nodes.
  std::vector<double> group_tokens(static_cast<std::size_t>(num_groups), 0.0);
  for (int e = 0; e < num_experts; ++e)
    group_tokens[e / group_size] += weights[e];
  std::vector<std::int32_t> group_pack, group_rank;
  eplb_balanced_packing(group_tokens, num_nodes, group_pack, group_rank);
  std::vector<std::int32_t> log2mlog(static_cast<std::size_t>(num_experts)), mlog2log(log2mlog.size());
  for (int e = 0; e < num_experts; ++e) {
    const int gi = e / group_size;
    log2mlog[e] = (group_pack[gi] * groups_per_node + group_rank[gi]) * group_size + e % group_size;
    mlog2log[log2mlog[e]] = e;
  }

  EplbLayer out;
  out.phys_to_log.assign(static_cast<std::size_t>(num_physical), 0);
  out.replica_rank.assign(static_cast<std::size_t>(num_physical), 0);
  out.replica_count.assign(static_cast<std::size_t>(num_experts), 0);
  std::vector<double> node_tokens(static_cast<std::size_t>(experts_per_node)), phys_tokens;
  std::vector<std::int32_t> phy2mlog, phy_rank, mlog_count, pack_index, rank_in_pack;
  for (int node = 0; node < num_nodes; ++node) {
    // Step 2: replicas inside the node.
    for (int j = 0; j < experts_per_node; ++j)
      node_tokens[j] = weights[mlog2log[node * experts_per_node + j]];
    eplb_replicate_experts(node_tokens, phys_per_node, phy2mlog, phy_rank, mlog_count);
    // Step 3: the node's physical experts to its GPUs.
    phys_tokens.resize(static_cast<std::size_t>(phys_per_node));
    for (int p = 0; p < phys_per_node; ++p)
      phys_tokens[p] = node_tokens[phy2mlog[p]] / mlog_count[phy2mlog[p]];
    eplb_balanced_packing(phys_tokens, gpus_per_node, pack_index, rank_in_pack);
    for (int p = 0; p < phys_per_node; ++p) {
      const int pphy = node * phys_per_node + pack_index[p] * phys_per_gpu + rank_in_pack[p];
      const int log = mlog2log[node * experts_per_node + phy2mlog[p]];
      out.phys_to_log[pphy] = log;
      out.replica_rank[pphy] = phy_rank[p];
    }
    for (int j = 0; j < experts_per_node; ++j)
      out.replica_count[mlog2log[node * experts_per_node + j]] = mlog_count[j];
  }
  return out;
}

/// EPLB for every layer of `weights` (`[layers][experts]`, C order), `gpus * slots` physical slots.
[[nodiscard]] inline std::vector<EplbLayer> eplb_rebalance(std::span<const double> weights, int num_layers,
                                                           int num_experts, int num_groups, const Topology &topo) {
  detail::require(weights.size() == static_cast<std::size_t>(num_layers) * num_experts, "eplb: ", weights.size(),
                  " weights for ", num_layers, " layers x ", num_experts, " experts");
  std::vector<EplbLayer> out(static_cast<std::size_t>(num_layers));
  for (int l = 0; l < num_layers; ++l)
    out[l] = eplb_rebalance_layer(weights.subspan(static_cast<std::size_t>(l) * num_experts, num_experts),
                                  static_cast<int>(topo.num_slots()), num_groups, topo.num_nodes, topo.num_gpus());
  return out;
}

/// Tokens per physical slot under EPLB's even split: `load / copies` each, the remainder one token each to the
/// lowest-ranked copies.
[[nodiscard]] inline std::vector<std::int64_t> eplb_slot_tokens(const EplbLayer &layer,
                                                                std::span<const std::int64_t> expert_loads) {
  std::vector<std::int64_t> out(layer.phys_to_log.size(), 0);
  for (std::size_t p = 0; p < out.size(); ++p) {
    const std::int32_t e = layer.phys_to_log[p];
    const std::int64_t c = layer.replica_count[e];
    out[p] = expert_loads[e] / c + (layer.replica_rank[p] < expert_loads[e] % c ? 1 : 0);
  }
  return out;
}

/// Per-GPU load of EPLB's layer for `expert_loads` (the sum over the GPU's physical experts).
[[nodiscard]] inline std::vector<std::int64_t>
eplb_gpu_loads(const EplbLayer &layer, std::span<const std::int64_t> expert_loads, int num_gpus) {
  const auto tokens = eplb_slot_tokens(layer, expert_loads);
  const std::size_t per_gpu = tokens.size() / static_cast<std::size_t>(num_gpus);
  std::vector<std::int64_t> out(static_cast<std::size_t>(num_gpus), 0);
  for (std::size_t p = 0; p < tokens.size(); ++p)
    out[p / per_gpu] += tokens[p];
  return out;
}

/// EPLB's layer as a `LayerPlan` (see the file comment for how duplicates and owners are represented).
[[nodiscard]] inline LayerPlan eplb_to_layer_plan(const EplbLayer &layer, std::span<const std::int64_t> expert_loads,
                                                  const Topology &topo, const LayerPlacement *resident) {
  const int num_gpus = topo.num_gpus(), slots = topo.slots_per_gpu;
  const int num_experts = static_cast<int>(layer.replica_count.size());
  detail::require(static_cast<int>(expert_loads.size()) == num_experts, "eplb_to_layer_plan: ", expert_loads.size(),
                  " loads for ", num_experts, " experts");
  detail::require(static_cast<std::int64_t>(layer.phys_to_log.size()) == topo.num_slots(),
                  "eplb_to_layer_plan: ", layer.phys_to_log.size(), " physical slots for a topology of ",
                  topo.num_slots());
  const auto tokens = eplb_slot_tokens(layer, expert_loads);
  std::vector<std::vector<std::int32_t>> per_gpu(static_cast<std::size_t>(num_gpus));
  std::vector<std::int64_t> merged(static_cast<std::size_t>(num_gpus) * num_experts, 0);
  std::vector<std::int32_t> owner(static_cast<std::size_t>(num_experts), -1);
  for (int p = 0; p < num_gpus * slots; ++p) {
    const int g = p / slots;
    const std::int32_t e = layer.phys_to_log[p];
    auto &list = per_gpu[g];
    if (std::find(list.begin(), list.end(), e) == list.end()) list.push_back(e);
    merged[static_cast<std::size_t>(g) * num_experts + e] += tokens[p];
    if (owner[e] < 0) owner[e] = g;
  }
  LayerPlan plan;
  plan.placement = layout_slots(num_gpus, slots, num_experts, per_gpu, resident);
  plan.owner_gpu = owner;
  plan.slot_tokens.assign(static_cast<std::size_t>(num_gpus) * slots, 0);
  std::int64_t max_load = 0;
  for (int g = 0; g < num_gpus; ++g) {
    std::int64_t load = 0;
    for (int s = 0; s < slots; ++s)
      if (const std::int32_t e = plan.placement.slot(g, s); e != empty_slot) {
        const std::int64_t t = merged[static_cast<std::size_t>(g) * num_experts + e];
        plan.slot_tokens[static_cast<std::size_t>(g) * slots + s] = t;
        load += t;
      }
    max_load = std::max(max_load, load);
  }
  plan.max_gpu_load = max_load;
  plan.moves = compute_moves(plan.placement, plan.owner_gpu, resident, topo.gpus_per_node);
  return plan;
}

} // namespace v0
} // namespace foremoe
