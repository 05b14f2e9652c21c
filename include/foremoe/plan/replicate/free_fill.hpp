#pragma once
/// @file
/// Free-mode sequential fill (any slot holds anything): GPUs filled to a makespan `T` with whole experts plus one
/// piece of an open "filler" expert that carries on to the next GPU, under a makespan search.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <numeric>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "foremoe/core/placement.hpp"
#include "foremoe/core/topology.hpp"
#include "foremoe/plan/detail/layer_checks.hpp"
#include "foremoe/plan/detail/makespan_search.hpp"
#include "foremoe/plan/detail/replica_solution.hpp"
#include "foremoe/plan/plan.hpp"

namespace foremoe {
inline namespace v0 {

/// The sequential fill of single layers; keeps its scratch between calls (one per thread), never results.
class FreeFill {
public:
  FreeFill(const Topology &topo, int num_experts)
      : num_experts_(num_experts), num_gpus_(topo.num_gpus()), slots_(topo.slots_per_gpu),
        gpus_per_node_(topo.gpus_per_node) {
    topo.validate(num_experts);
  }

  /// A makespan at which the fill succeeds when slots allow (every expert whole in its own slot): the total.
  [[nodiscard]] static std::int64_t upper_bound(std::span<const std::int64_t> loads) {
    std::int64_t total = 0;
    for (std::int64_t v : loads)
      total += v;
    return total;
  }

  /// The fill at the smallest makespan in `[lo, hi]` (to `resolution`) at which it succeeds, its pieces as the
  /// split, laid out around `resident` (may be null); none when no makespan in the range succeeds.
  [[nodiscard]] std::optional<LayerPlan> plan(std::span<const std::int64_t> loads, std::int64_t lo, std::int64_t hi,
                                              std::int64_t resolution, const LayerPlacement *resident) {
    if (!search_fill(loads, lo, hi, resolution)) return std::nullopt;
    return fill_plan(resident);
  }

private:
  /// Smallest makespan in `[lo, hi]` (to `tolerance`) at which `fill_free` succeeds: a gallop up from `lo`, then
  /// bisection. Leaves the best fill in `fill_best_` (read by `fill_plan` of the same `plan` call) and says whether
  /// any succeeded.
  bool search_fill(std::span<const std::int64_t> loads, std::int64_t lo, std::int64_t hi, std::int64_t tolerance) {
    if (lo > hi) return false;
    fill_order(loads);
    return detail::search_makespan(lo, hi, tolerance, tolerance, false,
                                   [&](std::int64_t t) {
                                     if (!fill_free(t)) return false;
                                     std::swap(fill_best_, fill_try_);
                                     std::swap(fill_amt_best_, fill_amt_try_);
                                     return true;
                                   })
        .first;
  }

  /// Experts by load descending (ties by id), for the fill.
  void fill_order(std::span<const std::int64_t> loads) {
    fill_ord_.resize(static_cast<std::size_t>(num_experts_));
    std::iota(fill_ord_.begin(), fill_ord_.end(), 0);
    std::sort(fill_ord_.begin(), fill_ord_.end(),
              [&](std::int32_t a, std::int32_t b) { return loads[a] > loads[b] || (loads[a] == loads[b] && a < b); });
    fill_sorted_.resize(fill_ord_.size());
    for (std::size_t i = 0; i < fill_ord_.size(); ++i)
      fill_sorted_[i] = loads[fill_ord_[i]];
  }

  /// Root of `i` in the skip links `link` (a link to itself is a root), compressing the path.
  static std::int32_t find_root(std::vector<std::int32_t> &link, std::int32_t i) {
    std::int32_t r = i;
    while (link[r] != r)
      r = link[r];
    while (link[i] != r) {
      const std::int32_t up = link[i];
      link[i] = r;
      i = up;
    }
    return r;
  }

  /// Sequential fill at makespan `t`: GPUs in turn are filled to `t` with whole experts ("finishers") and at most
  /// one partial piece of an open "filler" expert, which carries its rest to the next GPU; an expert above `t`
  /// stays the filler over several GPUs. Finishers come at the rate that empties the pool with the GPUs
  /// (ceil(experts left / GPUs left), at most slots - 1), alternately the largest that fits next to the smallest
  /// ones still needed and the smallest; the filler is the heaviest expert left, finished as soon as it fits. Every
  /// GPU gets at most one piece per expert and at most `slots` pieces, and the pieces are a split with maximum
  /// `t`. Fills `fill_try_` and the pieces' tokens `fill_amt_try_`.
  bool fill_free(std::int64_t t) {
    const int n = num_experts_;
    fill_try_.rep.assign(static_cast<std::size_t>(num_gpus_) * slots_, empty_slot);
    fill_amt_try_.assign(static_cast<std::size_t>(num_gpus_) * slots_, 0);
    fill_try_.cnt.assign(static_cast<std::size_t>(num_gpus_), 0);
    // Untaken positions in `fill_ord_`: `next_[i]` / `prev_[i]` skip forward / backward over taken ones.
    fill_next_.resize(static_cast<std::size_t>(n) + 1);
    fill_prev_.resize(static_cast<std::size_t>(n) + 1);
    std::iota(fill_next_.begin(), fill_next_.end(), 0);
    std::iota(fill_prev_.begin(), fill_prev_.end(), 0); // prev_[i + 1] is position i; prev_[0] means none
    auto find_next = [&](std::int32_t i) { return find_root(fill_next_, i); }; // n when none
    // i: position + 1; returns position + 1, 0 when none
    auto find_prev = [&](std::int32_t i) { return find_root(fill_prev_, i); };
    auto take = [&](std::int32_t pos) {
      fill_next_[pos] = pos + 1;
      fill_prev_[pos + 1] = pos;
    };
    // Largest untaken with load <= cap, as a position (n when none).
    auto largest_fit = [&](std::int64_t cap) {
      const auto first = std::lower_bound(fill_sorted_.begin(), fill_sorted_.end(), cap, std::greater<>());
      return find_next(static_cast<std::int32_t>(first - fill_sorted_.begin()));
    };
    // Sum of the `k` smallest untaken loads.
    auto smallest_sum = [&](int k) {
      std::int64_t s = 0;
      for (std::int32_t i = find_prev(n); k > 0 && i > 0; --k, i = find_prev(i - 1))
        s += fill_sorted_[i - 1];
      return s;
    };
    int left = n;             // experts not yet opened or finished
    std::int32_t filler = -1; // open expert, as a position
    std::int64_t filler_rest = 0;
    auto open_filler = [&]() {
      filler = find_next(0);
      if (filler >= n) {
        filler = -1;
        return;
      }
      take(filler);
      --left;
      filler_rest = fill_sorted_[filler];
    };
    for (int g = 0; g < num_gpus_ && (left > 0 || filler >= 0); ++g) {
      std::int64_t room = t;
      int used = 0;
      auto put = [&](std::int32_t pos, std::int64_t amount) {
        fill_amt_try_[g * slots_ + used] = amount;
        fill_try_.rep[g * slots_ + used++] = fill_ord_[pos];
        room -= amount;
      };
      if (filler < 0) open_filler();
      const int gpus_left = num_gpus_ - g;
      int finishers = std::min(slots_ - 1, (left + 1 + gpus_left - 1) / gpus_left);
      // The filler is finished here when it fits beside the smallest other finishers.
      if (filler >= 0 && finishers > 0 && filler_rest + smallest_sum(finishers - 1) < room) {
        put(filler, filler_rest);
        filler = -1;
        filler_rest = 0;
        --finishers;
      }
      for (int i = 0; i < finishers && room > 0 && left > 0; ++i) {
        const std::int32_t small = find_prev(n) - 1;
        std::int32_t pos = small;
        if (i % 2 == 0) {
          const std::int64_t cap = room - smallest_sum(finishers - i - 1) - 1;
          if (const std::int32_t f = largest_fit(cap); f < n) pos = f;
        }
        if (fill_sorted_[pos] > room || (fill_sorted_[pos] == room && filler >= 0)) break;
        take(pos);
        --left;
        put(pos, fill_sorted_[pos]);
      }
      if (used < slots_ && room > 0) {
        if (filler < 0) open_filler();
        if (filler >= 0) {
          const std::int64_t a = std::min(filler_rest, room);
          put(filler, a);
          filler_rest -= a;
          if (filler_rest == 0) filler = -1;
        }
      }
      fill_try_.cnt[g] = used;
    }
    return left == 0 && filler < 0;
  }

  /// The plan of `fill_best_` with its pieces as the split: each GPU list goes to the free physical GPU holding
  /// most of its experts in `resident` (lists in order, ties to the lowest GPU), laid out around the resident
  /// slots; owners at the first copy.
  LayerPlan fill_plan(const LayerPlacement *resident) {
    const detail::ReplicaSolution &s = fill_best_;
    fill_map_.assign(static_cast<std::size_t>(num_gpus_), -1);
    gpu_taken_.assign(static_cast<std::size_t>(num_gpus_), 0);
    if (resident != nullptr) {
      holders_off_.assign(static_cast<std::size_t>(num_experts_) + 1, 0);
      for (int q = 0; q < resident->num_slots(); ++q)
        if (const std::int32_t e = resident->phys_to_log()[q]; e >= 0 && e < num_experts_) ++holders_off_[e + 1];
      for (int e = 0; e < num_experts_; ++e)
        holders_off_[e + 1] += holders_off_[e];
      holders_.resize(static_cast<std::size_t>(holders_off_.back()));
      holders_fill_.assign(holders_off_.begin(), holders_off_.end() - 1);
      for (int q = 0; q < resident->num_slots(); ++q)
        if (const std::int32_t e = resident->phys_to_log()[q]; e >= 0 && e < num_experts_)
          holders_[holders_fill_[e]++] = q / slots_;
      shared_count_.assign(static_cast<std::size_t>(num_gpus_), 0);
      for (int b = 0; b < num_gpus_; ++b) {
        int pick = -1;
        for (int j = 0; j < s.cnt[b]; ++j) {
          const std::int32_t e = s.rep[b * slots_ + j];
          for (int k = holders_off_[e]; k < holders_off_[e + 1]; ++k)
            if (const int h = holders_[k]; !gpu_taken_[h]) ++shared_count_[h];
        }
        for (int j = 0; j < s.cnt[b]; ++j) {
          const std::int32_t e = s.rep[b * slots_ + j];
          for (int k = holders_off_[e]; k < holders_off_[e + 1]; ++k) {
            const int h = holders_[k];
            if (gpu_taken_[h] || shared_count_[h] == 0) continue;
            if (pick < 0 || shared_count_[h] > shared_count_[pick] ||
                (shared_count_[h] == shared_count_[pick] && h < pick))
              pick = h;
          }
        }
        for (int j = 0; j < s.cnt[b]; ++j) {
          const std::int32_t e = s.rep[b * slots_ + j];
          for (int k = holders_off_[e]; k < holders_off_[e + 1]; ++k)
            shared_count_[holders_[k]] = 0;
        }
        if (pick >= 0) {
          fill_map_[b] = pick;
          gpu_taken_[pick] = 1;
        }
      }
    }
    int next_gpu = 0;
    for (int b = 0; b < num_gpus_; ++b) {
      if (fill_map_[b] >= 0) continue;
      while (gpu_taken_[next_gpu])
        ++next_gpu;
      fill_map_[b] = next_gpu;
      gpu_taken_[next_gpu] = 1;
    }
    LayerPlan plan;
    plan.placement = LayerPlacement(num_gpus_, slots_, num_experts_);
    plan.slot_tokens.assign(static_cast<std::size_t>(num_gpus_) * slots_, 0);
    for (int b = 0; b < num_gpus_; ++b) {
      const int g = fill_map_[b];
      want_.assign(s.rep.begin() + b * slots_, s.rep.begin() + b * slots_ + s.cnt[b]);
      layout_gpu_slots(plan.placement, g, want_, resident);
      std::int64_t gpu_load = 0;
      for (int j = 0; j < slots_; ++j) {
        const std::int32_t e = plan.placement.slot(g, j);
        if (e == empty_slot) continue;
        for (int k = 0; k < s.cnt[b]; ++k)
          if (s.rep[b * slots_ + k] == e)
            plan.slot_tokens[static_cast<std::size_t>(g) * slots_ + j] = fill_amt_best_[b * slots_ + k];
        gpu_load += plan.slot_tokens[static_cast<std::size_t>(g) * slots_ + j];
      }
      plan.max_gpu_load = std::max(plan.max_gpu_load, gpu_load);
    }
    detail::first_copy_owners(plan.placement, plan.owner_gpu);
    plan.moves = compute_moves(plan.placement, plan.owner_gpu, resident, gpus_per_node_);
    return plan;
  }

  int num_experts_ = 0, num_gpus_ = 0, slots_ = 0, gpus_per_node_ = 1;
  detail::ReplicaSolution fill_try_, fill_best_;
  std::vector<std::int32_t> fill_ord_, fill_next_, fill_prev_, fill_map_, holders_off_, holders_, holders_fill_, want_;
  std::vector<std::int64_t> fill_sorted_, fill_amt_try_, fill_amt_best_;
  std::vector<int> shared_count_;
  std::vector<char> gpu_taken_;
};

} // namespace v0
} // namespace foremoe
