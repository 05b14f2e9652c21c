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
  /// With previous owners (re-owning not free): they stay if their most loaded GPU is within this fraction of
  /// the fresh plan's; else swaps from them try to get there, and only if that fails the fresh plan is taken.
  double keep_tolerance = 0.05;
};

namespace detail {

/// Local search on a packing: the heaviest bin trades an item with another bin (or gives one away to a bin with
/// fewer items) while that lowers the pair's maximum, at most `max_rounds` times, until the heaviest bin is at
/// most `stop_at` (< 0: within 0.05% of the mean). `sorted_items` lists the items by weight, descending.
inline void improve_bins(std::span<const std::int32_t> sorted_items, std::span<const std::int64_t> weights,
                         int num_bins, int max_rounds, std::int64_t stop_at, std::vector<std::int32_t> &bin_of,
                         std::vector<std::int64_t> &bin_load, std::vector<std::int32_t> &bin_count) {
  // Members are listed in weight order, so the best partner for an item is found by bisection.
  std::vector<std::int32_t> members_off(static_cast<std::size_t>(num_bins) + 1), members(sorted_items.size()), fill;
  for (int round = 0; round < max_rounds; ++round) {
    std::fill(members_off.begin(), members_off.end(), 0);
    for (std::int32_t it : sorted_items)
      ++members_off[bin_of[it] + 1];
    for (int b = 0; b < num_bins; ++b)
      members_off[b + 1] += members_off[b];
    fill.assign(members_off.begin(), members_off.end() - 1);
    for (std::int32_t it : sorted_items)
      members[fill[bin_of[it]]++] = it; // descending weight within a bin
    int hot = 0;
    std::int64_t total = 0;
    for (int b = 0; b < num_bins; ++b) {
      total += bin_load[b];
      if (bin_load[b] > bin_load[hot]) hot = b;
    }
    // Within 0.05% of the mean the swaps no longer matter (micro-step replicas absorb far more).
    const std::int64_t mean = total / num_bins;
    if (bin_load[hot] <= (stop_at >= 0 ? stop_at : mean + mean / 2000 + 1)) break;
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
  improve_bins(scratch_order, weights, num_bins, max_swap_rounds, -1, bin_of, bin_load, bin_count);
}

} // namespace detail

/// Reusable owner planner for one topology (keeps its scratch between layers).
class OwnerPlanner {
public:
  OwnerPlanner(const Topology &topo, int num_experts, OwnerOptions opts = {})
      : topo_(topo), num_experts_(num_experts), opts_(opts) {
    topo.validate(num_experts);
  }

  /// Owner GPU of every expert of one layer from its step totals `[experts]`, preferring `previous` (the last
  /// step's owners, when re-owning costs something; empty: none) as `OwnerOptions::keep_tolerance` says: kept as
  /// they are, else improved by the fewest swaps found, else replaced by the fresh plan.
  [[nodiscard]] std::vector<std::int32_t> plan_layer(std::span<const std::int64_t> step_loads,
                                                     std::span<const std::int32_t> previous) {
    std::vector<std::int32_t> fresh = plan_layer(step_loads);
    if (previous.empty()) return fresh;
    const int num_gpus = topo_.num_gpus();
    detail::require(static_cast<int>(previous.size()) == num_experts_, "plan_owners: ", previous.size(),
                    " previous owners for ", num_experts_, " experts");
    auto fill_bins = [&](std::span<const std::int32_t> owner) {
      load_.assign(static_cast<std::size_t>(num_gpus), 0);
      count_.assign(static_cast<std::size_t>(num_gpus), 0);
      for (int e = 0; e < num_experts_; ++e) {
        load_[owner[e]] += step_loads[e];
        ++count_[owner[e]];
      }
      return *std::max_element(load_.begin(), load_.end());
    };
    for (int e = 0; e < num_experts_; ++e)
      detail::require(previous[e] >= 0 && previous[e] < num_gpus, "plan_owners: previous owner GPU ", previous[e],
                      " of expert ", e, " is outside [0, ", num_gpus, ")");
    const std::int64_t fresh_max = fill_bins(fresh);
    const auto limit =
        fresh_max + static_cast<std::int64_t>(static_cast<double>(fresh_max) * std::max(0.0, opts_.keep_tolerance));
    const std::int64_t prev_max = fill_bins(previous);
    for (int g = 0; g < num_gpus; ++g)
      detail::require(count_[g] <= topo_.slots_per_gpu, "plan_owners: previous owners put ", count_[g],
                      " experts on GPU ", g, ", which has ", topo_.slots_per_gpu, " slots");
    if (prev_max <= limit) return {previous.begin(), previous.end()};
    // Swaps from the previous owners (counts per GPU never grow past the largest), flat over all GPUs.
    bin_of_.assign(previous.begin(), previous.end());
    order_.resize(static_cast<std::size_t>(num_experts_));
    std::iota(order_.begin(), order_.end(), 0);
    std::stable_sort(order_.begin(), order_.end(),
                     [&](std::int32_t a, std::int32_t b) { return step_loads[a] > step_loads[b]; });
    detail::improve_bins(order_, step_loads, num_gpus, 4 * opts_.max_swap_rounds, limit, bin_of_, load_, count_);
    if (*std::max_element(load_.begin(), load_.end()) <= limit) return bin_of_;
    return fresh;
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
/// `previous` (`[layers][experts]`, or empty): the last step's owners, kept where `OwnerOptions::keep_tolerance`
/// allows (for trainers where re-owning an expert moves its optimizer state).
[[nodiscard]] inline std::vector<std::vector<std::int32_t>>
plan_owners(std::span<const std::int64_t> step_totals, int num_layers, int num_experts, const Topology &topo,
            OwnerOptions opts = {}, std::span<const std::vector<std::int32_t>> previous = {}) {
  detail::require(num_layers > 0, "plan_owners: num_layers must be positive, got ", num_layers);
  detail::require(step_totals.size() == static_cast<std::size_t>(num_layers) * num_experts,
                  "plan_owners: ", step_totals.size(), " step totals for ", num_layers, " layers x ", num_experts,
                  " experts");
  detail::require(previous.empty() || static_cast<int>(previous.size()) == num_layers,
                  "plan_owners: previous owners have ", previous.size(), " layers, expected ", num_layers);
  OwnerPlanner planner(topo, num_experts, opts);
  std::vector<std::vector<std::int32_t>> out(static_cast<std::size_t>(num_layers));
  for (int l = 0; l < num_layers; ++l)
    out[l] = planner.plan_layer(step_totals.subspan(static_cast<std::size_t>(l) * num_experts, num_experts),
                                previous.empty() ? std::span<const std::int32_t>() : previous[l]);
  return out;
}

} // namespace v0
} // namespace foremoe
