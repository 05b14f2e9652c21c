#pragma once
/// @file
/// The earlier free-mode construction (greedy replica counts, LPT of the copies, a swap search, the exact split),
/// free mode's fallback for small or slot-starved layers.

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/core/topology.hpp"
#include "foremoe/plan/detail/makespan_search.hpp"
#include "foremoe/plan/plan.hpp"
#include "foremoe/plan/replicate/from_placement.hpp"
#include "foremoe/plan/replicate/options.hpp"
#include "foremoe/plan/split.hpp"

namespace foremoe {
inline namespace v0 {

/// The LPT construction of single layers; keeps its scratch between calls (one per thread), never results.
class FreeLpt {
public:
  FreeLpt(const Topology &topo, int num_experts)
      : num_experts_(num_experts), num_gpus_(topo.num_gpus()), slots_(topo.slots_per_gpu),
        gpus_per_node_(topo.gpus_per_node) {
    topo.validate(num_experts);
  }

  /// The earlier free construction, a candidate where the fill does not reach the bound's tolerance: counts by
  /// greedy max load per copy, LPT of the copies, a swap search, the exact split.
  [[nodiscard]] LayerPlan plan(std::span<const std::int64_t> loads, const LayerPlacement *resident,
                               const ReplicaOptions &opts) {
    const int num_slots = num_gpus_ * slots_;
    // Replica counts: one copy each, then greedily to the expert with the largest load per copy.
    counts_.assign(static_cast<std::size_t>(num_experts_), 1);
    auto less = [&](std::int32_t a, std::int32_t b) {
      const int c = detail::compare_fractions(loads[a], counts_[a], loads[b], counts_[b]);
      return c < 0 || (c == 0 && a > b);
    };
    heap_.resize(static_cast<std::size_t>(num_experts_));
    std::iota(heap_.begin(), heap_.end(), 0);
    std::make_heap(heap_.begin(), heap_.end(), less);
    for (int extra = num_slots - num_experts_; extra > 0 && !heap_.empty(); --extra) {
      std::pop_heap(heap_.begin(), heap_.end(), less);
      const std::int32_t e = heap_.back();
      if (loads[e] == 0) break;
      ++counts_[e];
      if (counts_[e] >= num_gpus_ || counts_[e] >= loads[e])
        heap_.pop_back();
      else
        std::push_heap(heap_.begin(), heap_.end(), less);
    }
    // LPT of the copies (weight load / count) under exactly `slots` per GPU and no duplicate per GPU.
    items_.clear();
    for (int e = 0; e < num_experts_; ++e)
      for (int c = 0; c < counts_[e]; ++c)
        items_.push_back(e);
    std::stable_sort(items_.begin(), items_.end(), [&](std::int32_t a, std::int32_t b) {
      return detail::compare_fractions(loads[a], counts_[a], loads[b], counts_[b]) > 0;
    });
    free_gpu_load_.assign(static_cast<std::size_t>(num_gpus_), 0);
    free_cnt_.assign(static_cast<std::size_t>(num_gpus_), 0);
    LayerPlacement p(num_gpus_, slots_, num_experts_);
    std::vector<int> left(counts_.begin(), counts_.end());
    for (std::size_t k = 0; k < items_.size(); ++k) {
      const std::int32_t e = items_[k];
      const std::int64_t w = loads[e] / counts_[e];
      int best = -1;
      for (int g = 0; g < num_gpus_; ++g) {
        if (free_cnt_[g] >= slots_ || p.holds(g, e)) continue;
        if (best < 0 || free_gpu_load_[g] < free_gpu_load_[best]) best = g;
      }
      // Only an extra copy can find no GPU (every one with room holds e already): items never outnumber slots.
      if (best < 0) continue;
      p.slot(best, free_cnt_[best]++) = e;
      free_gpu_load_[best] += w;
      --left[e];
    }
    // Defensive: every expert keeps a copy even if the LPT above ever dropped one.
    auto counts_now = p.replica_counts();
    for (int e = 0; e < num_experts_; ++e) {
      if (counts_now[e] > 0) continue;
      bool done = false;
      for (int q = 0; q < num_slots && !done; ++q) {
        const std::int32_t x = p.phys_to_log()[q];
        const int g = q / slots_;
        if (x != empty_slot && counts_now[x] > 1 && !p.holds(g, e)) {
          --counts_now[x];
          p.phys_to_log()[q] = e;
          ++counts_now[e];
          done = true;
        }
      }
      detail::require(done, "plan_free: cannot give expert ", e, " a copy");
    }
    if (opts.free_search_rounds > 0) local_search_free(p, loads, opts.free_search_rounds);
    // Keep copies in their resident slots where the same GPU keeps them.
    std::vector<std::vector<std::int32_t>> per_gpu(static_cast<std::size_t>(num_gpus_));
    for (int g = 0; g < num_gpus_; ++g)
      for (std::int32_t e : p.gpu_slots(g))
        if (e != empty_slot) per_gpu[g].push_back(e);
    LayerPlacement laid = layout_slots(num_gpus_, slots_, num_experts_, per_gpu, resident);
    std::vector<std::int32_t> owner(static_cast<std::size_t>(num_experts_), -1);
    for (int q = 0; q < num_slots; ++q)
      if (const std::int32_t e = laid.phys_to_log()[q]; e != empty_slot && owner[e] < 0) owner[e] = q / slots_;
    return plan_from_placement(laid, loads, owner, resident, gpus_per_node_, split_);
  }

private:
  /// Free-mode local search on the copies' even-split weights (`load / copies`): the heaviest GPU swaps one copy
  /// with a copy (or an empty slot) of another GPU while that lowers the pair's maximum and creates no duplicate.
  /// Cheap O(1) moves; the exact split that follows balances what the weights cannot.
  void local_search_free(LayerPlacement &p, std::span<const std::int64_t> loads, int rounds) {
    const auto counts = p.replica_counts();
    auto weight = [&](std::int32_t e) { return e == empty_slot ? std::int64_t{0} : loads[e] / counts[e]; };
    free_gpu_load_.assign(static_cast<std::size_t>(num_gpus_), 0);
    for (int q = 0; q < p.num_slots(); ++q)
      free_gpu_load_[q / slots_] += weight(p.phys_to_log()[q]);
    for (int round = 0; round < rounds * 8; ++round) {
      int hot = 0;
      for (int g = 1; g < num_gpus_; ++g)
        if (free_gpu_load_[g] > free_gpu_load_[hot]) hot = g;
      std::int64_t best_pair = free_gpu_load_[hot];
      int best_a = -1, best_q = -1;
      // Partners: the four lightest GPUs (the pair maximum can only drop much against a light one).
      light_.resize(static_cast<std::size_t>(num_gpus_));
      std::iota(light_.begin(), light_.end(), 0);
      const std::size_t num_recv = std::min<std::size_t>(4, light_.size());
      std::partial_sort(light_.begin(), light_.begin() + static_cast<std::ptrdiff_t>(num_recv), light_.end(),
                        [&](std::int32_t a, std::int32_t b) { return free_gpu_load_[a] < free_gpu_load_[b]; });
      for (std::size_t r = 0; r < num_recv; ++r) {
        const int h = light_[r];
        const std::int64_t gap = free_gpu_load_[hot] - free_gpu_load_[h];
        if (h == hot || gap <= 1) continue;
        for (int sa = 0; sa < slots_; ++sa) {
          const std::int32_t ea = p.slot(hot, sa);
          if (ea == empty_slot || p.holds(h, ea)) continue;
          const std::int64_t wa = weight(ea);
          for (int sb = 0; sb < slots_; ++sb) {
            const std::int32_t eb = p.slot(h, sb);
            if (eb != empty_slot && p.holds(hot, eb)) continue;
            const std::int64_t d = wa - weight(eb);
            if (d <= 0 || d >= gap) continue;
            const std::int64_t m = std::max(free_gpu_load_[hot] - d, free_gpu_load_[h] + d);
            if (m < best_pair) {
              best_pair = m;
              best_a = sa;
              best_q = h * slots_ + sb;
            }
          }
        }
      }
      if (best_a < 0) break;
      const int h = best_q / slots_;
      const std::int32_t ea = p.slot(hot, best_a), eb = p.phys_to_log()[best_q];
      const std::int64_t d = weight(ea) - weight(eb);
      p.slot(hot, best_a) = eb;
      p.phys_to_log()[best_q] = ea;
      free_gpu_load_[hot] -= d;
      free_gpu_load_[h] += d;
    }
  }

  int num_experts_ = 0, num_gpus_ = 0, slots_ = 0, gpus_per_node_ = 1;
  SplitSolver split_;
  std::vector<int> counts_, free_cnt_;
  std::vector<std::int32_t> heap_, items_, light_;
  std::vector<std::int64_t> free_gpu_load_;
};

} // namespace v0
} // namespace foremoe
