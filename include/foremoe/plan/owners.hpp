#pragma once
/// @file
/// Owner placement per RL step: every expert gets one owner GPU, balanced on the foreseen step totals.
///
/// LPT with cardinality limits (every GPU owns `floor` or `ceil(experts / gpus)` experts, never more than its
/// slots), hierarchical (experts to nodes, then each node's experts to its GPUs) or flat, followed by a bounded
/// local search that swaps experts between the most loaded bin and the others.

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/topology.hpp"

namespace foremoe {
inline namespace v0 {

/// How owners are planned.
struct OwnerOptions {
  bool hierarchical = true; ///< balance nodes first, then GPUs inside each node; else all GPUs at once
  int max_swap_rounds = 10; ///< bound on improving swaps per bin level of one layer
};

namespace detail {

/// Packs `items` (indices into `weights`) into `num_bins` bins: LPT, each bin gets `floor(n / bins)` or one more
/// item. Writes the bin of each item into `bin_of[item]` and improves by swaps from the heaviest bin. Returns
/// nothing; bin loads are recomputed by the caller when needed.
inline void pack_cardinality(std::span<const std::int32_t> items, std::span<const std::int64_t> weights, int num_bins,
                             int max_swap_rounds, std::vector<std::int32_t> &bin_of,
                             std::vector<std::int32_t> &scratch_order, std::vector<std::int64_t> &bin_load,
                             std::vector<std::int32_t> &bin_count) {
  const int n = static_cast<int>(items.size());
  const int base = n / num_bins, extra = n % num_bins;
  scratch_order.assign(items.begin(), items.end());
  std::stable_sort(scratch_order.begin(), scratch_order.end(),
                   [&](std::int32_t a, std::int32_t b) { return weights[a] > weights[b]; });
  bin_load.assign(static_cast<std::size_t>(num_bins), 0);
  bin_count.assign(static_cast<std::size_t>(num_bins), 0);
  int num_big = 0;
  for (std::int32_t it : scratch_order) {
    int best = -1;
    for (int b = 0; b < num_bins; ++b) {
      const bool room = bin_count[b] < base || (bin_count[b] == base && num_big < extra);
      if (room && (best < 0 || bin_load[b] < bin_load[best])) best = b;
    }
    if (bin_count[best] == base) ++num_big;
    ++bin_count[best];
    bin_load[best] += weights[it];
    bin_of[it] = best;
  }
  // Local search: the heaviest bin trades an item with another bin (or gives one away where counts allow) while
  // that lowers the pair's maximum. Members are listed in weight order, so the best partner for an item is found
  // by bisection.
  std::vector<std::int32_t> members_off(static_cast<std::size_t>(num_bins) + 1), members(items.size()), fill;
  for (int round = 0; round < max_swap_rounds; ++round) {
    std::fill(members_off.begin(), members_off.end(), 0);
    for (std::int32_t it : scratch_order)
      ++members_off[bin_of[it] + 1];
    for (int b = 0; b < num_bins; ++b)
      members_off[b + 1] += members_off[b];
    fill.assign(members_off.begin(), members_off.end() - 1);
    for (std::int32_t it : scratch_order)
      members[fill[bin_of[it]]++] = it; // descending weight within a bin
    int hot = 0;
    std::int64_t total = 0;
    for (int b = 0; b < num_bins; ++b) {
      total += bin_load[b];
      if (bin_load[b] > bin_load[hot]) hot = b;
    }
    // Within 0.05% of the mean the swaps no longer matter (micro-step replicas absorb far more).
    const std::int64_t mean = total / num_bins;
    if (bin_load[hot] <= mean + mean / 2000 + 1) break;
    std::int64_t best_pair_max = bin_load[hot];
    std::int32_t best_a = -1, best_b = -1;
    int best_bin = -1;
    for (int b = 0; b < num_bins; ++b) {
      if (b == hot) continue;
      const std::int64_t gap = bin_load[hot] - bin_load[b];
      if (gap <= 1) continue;
      const bool can_give = bin_count[hot] > bin_count[b];
      const auto first = members.begin() + members_off[b], last = members.begin() + members_off[b + 1];
      for (int ia = members_off[hot]; ia < members_off[hot + 1]; ++ia) {
        const std::int32_t a = members[ia];
        if (can_give) {
          const std::int64_t d = weights[a];
          const std::int64_t m = std::max(bin_load[hot] - d, bin_load[b] + d);
          if (d > 0 && m < best_pair_max) {
            best_pair_max = m;
            best_a = a;
            best_b = -1;
            best_bin = b;
          }
        }
        // Ideal partner weight: w_a - gap / 2; look at the two members around it.
        const std::int64_t target = weights[a] - gap / 2;
        const auto it =
            std::lower_bound(first, last, target, [&](std::int32_t c, std::int64_t t) { return weights[c] > t; });
        for (auto cand = it - (it != first ? 1 : 0); cand != last && cand <= it; ++cand) {
          const std::int32_t c = *cand;
          const std::int64_t d = weights[a] - weights[c];
          if (d <= 0 || d >= gap) continue;
          const std::int64_t m = std::max(bin_load[hot] - d, bin_load[b] + d);
          if (m < best_pair_max) {
            best_pair_max = m;
            best_a = a;
            best_b = c;
            best_bin = b;
          }
        }
      }
    }
    if (best_a < 0) break;
    bin_load[hot] -= weights[best_a];
    bin_load[best_bin] += weights[best_a];
    bin_of[best_a] = best_bin;
    if (best_b >= 0) {
      bin_load[best_bin] -= weights[best_b];
      bin_load[hot] += weights[best_b];
      bin_of[best_b] = hot;
    } else {
      --bin_count[hot];
      ++bin_count[best_bin];
    }
  }
}

} // namespace detail

/// Reusable owner planner for one topology (keeps its scratch between layers).
class OwnerPlanner {
public:
  OwnerPlanner(const Topology &topo, int num_experts, OwnerOptions opts = {})
      : topo_(topo), num_experts_(num_experts), opts_(opts) {
    topo.validate(num_experts);
  }

  /// Owner GPU of every expert of one layer from its step totals `[experts]`.
  [[nodiscard]] std::vector<std::int32_t> plan_layer(std::span<const std::int64_t> step_loads) {
    detail::require(static_cast<int>(step_loads.size()) == num_experts_, "plan_owners: ", step_loads.size(),
                    " loads for ", num_experts_, " experts");
    for (int e = 0; e < num_experts_; ++e)
      detail::require(step_loads[e] >= 0, "plan_owners: expert ", e, " has a negative load ", step_loads[e]);
    std::vector<std::int32_t> owner(static_cast<std::size_t>(num_experts_), 0);
    items_.resize(static_cast<std::size_t>(num_experts_));
    std::iota(items_.begin(), items_.end(), 0);
    const int num_gpus = topo_.num_gpus();
    if (!opts_.hierarchical || topo_.num_nodes == 1) {
      bin_of_.assign(static_cast<std::size_t>(num_experts_), 0);
      detail::pack_cardinality(items_, step_loads, num_gpus, opts_.max_swap_rounds, bin_of_, order_, load_, count_);
      owner.assign(bin_of_.begin(), bin_of_.end());
      return owner;
    }
    node_of_.assign(static_cast<std::size_t>(num_experts_), 0);
    detail::pack_cardinality(items_, step_loads, topo_.num_nodes, opts_.max_swap_rounds, node_of_, order_, load_,
                             count_);
    bin_of_.assign(static_cast<std::size_t>(num_experts_), 0);
    for (int n = 0; n < topo_.num_nodes; ++n) {
      node_items_.clear();
      for (int e = 0; e < num_experts_; ++e)
        if (node_of_[e] == n) node_items_.push_back(e);
      detail::pack_cardinality(node_items_, step_loads, topo_.gpus_per_node, opts_.max_swap_rounds, bin_of_, order_,
                               load_, count_);
      for (std::int32_t e : node_items_)
        owner[e] = n * topo_.gpus_per_node + bin_of_[e];
    }
    return owner;
  }

private:
  Topology topo_;
  int num_experts_;
  OwnerOptions opts_;
  std::vector<std::int32_t> items_, bin_of_, node_of_, node_items_, order_, count_;
  std::vector<std::int64_t> load_;
};

/// Owners of every layer from step totals `[layers][experts]` (C order): `[layers][experts]` owner GPUs.
[[nodiscard]] inline std::vector<std::vector<std::int32_t>> plan_owners(std::span<const std::int64_t> step_totals,
                                                                        int num_layers, int num_experts,
                                                                        const Topology &topo, OwnerOptions opts = {}) {
  detail::require(num_layers > 0, "plan_owners: num_layers must be positive, got ", num_layers);
  detail::require(step_totals.size() == static_cast<std::size_t>(num_layers) * num_experts,
                  "plan_owners: ", step_totals.size(), " step totals for ", num_layers, " layers x ", num_experts,
                  " experts");
  OwnerPlanner planner(topo, num_experts, opts);
  std::vector<std::vector<std::int32_t>> out(static_cast<std::size_t>(num_layers));
  for (int l = 0; l < num_layers; ++l)
    out[l] = planner.plan_layer(step_totals.subspan(static_cast<std::size_t>(l) * num_experts, num_experts));
  return out;
}

} // namespace v0
} // namespace foremoe
