#pragma once
/// @file
/// Replica selection jointly with the exact token split: the per-micro-step heart of the planner.
///
/// Two-level mode (owners fixed for the step, replicas in the spare slots): a binary search on the makespan `T`
/// whose feasibility test is a greedy "shedding" construction. Every GPU above `T` must shed `load - T`; it does
/// so through replicas of its own experts on GPUs with a free spare slot and headroom below `T`, taking its
/// heaviest remaining expert each time and the receiver whose headroom fits the need most tightly (a resident copy
/// first, since it costs no move). A last piece that would close its receiver with headroom left is chained to
/// the next GPU above `T` instead (into its otherwise unused spare slot), which then sheds that much more. The
/// transfers it records are a valid split with maximum `T`: plans from a resident placement use them as they are;
/// plans from scratch take the exact split. An optional local search driven by the exact split moves single
/// replicas while the maximum drops.
///
/// Free mode (any slot holds anything): the best of the resident placement kept, the two-level plan with the
/// step's owners (so never worse than two-level), and a sequential fill under a makespan search (GPUs filled to
/// `T` with whole experts plus one piece of an open "filler" expert that carries on to the next GPU), with the
/// earlier LPT construction (greedy replica counts, LPT of the copies, swaps, exact split) as a fallback.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <queue>
#include <span>
#include <utility>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/core/topology.hpp"
#include "foremoe/plan/bounds.hpp"
#include "foremoe/plan/plan.hpp"
#include "foremoe/plan/split.hpp"

namespace foremoe {
inline namespace v0 {

/// Seconds to bring a new replica of `expert` from `src_gpu` (or `host_mirror`) to `dst_gpu`, gradient return
/// included where the stage has one.
using ReplicaCostFn = std::function<double(int expert, int src_gpu, int dst_gpu)>;
/// Seconds a GPU needs for a token count (the layer's expert compute).
using TokenTimeFn = std::function<double(std::int64_t tokens)>;

/// Options of replica selection for one layer.
struct ReplicaOptions {
  int move_budget = -1; ///< new replicas per GPU per micro-step; < 0: the GPU's spare slots
  /// Exact-split local search rounds after the two-level construction (0: none). Off by default: on
  /// DeepSeek-V3-like loads it lowers the median max/mean by about 0.0005 for ~50% more planning time.
  int local_search_rounds = 0;
  int free_search_rounds = 4; ///< swap rounds (x8 swaps) of the free-mode placement on copy weights (0: none)
  /// Re-split every two-level plan exactly. Plans from a resident placement otherwise keep the construction's own
  /// split, whose maximum is the searched makespan (within 0.05% of the best one the construction met) rather than
  /// the exact optimum of the placement; on the benchmark shapes that is +0.0002 mean max/mean for ~9 us less
  /// planning per layer.
  bool exact_split = false;
  /// Optional cost gate: a new replica stays only if the compute time it saves exceeds `replica_cost`. Both
  /// callbacks must be set for the gate to act.
  ReplicaCostFn replica_cost;
  TokenTimeFn token_time;
};

namespace detail {

/// Sign of `a / b - c / d` for non-negative numerators and positive denominators, without overflow.
[[nodiscard]] constexpr int compare_fractions(std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) noexcept {
  const std::int64_t q1 = a / b, q2 = c / d;
  if (q1 != q2) return q1 < q2 ? -1 : 1;
  // Remainders are below their denominators (GPU counts), so the cross products stay small.
  const std::int64_t r1 = (a % b) * d, r2 = (c % d) * b;
  return r1 < r2 ? -1 : r1 > r2 ? 1 : 0;
}

/// The makespan search both modes run: gallop up from `lo` (first step `step`, doubling), then bisect until the
/// bracket is narrower than `tolerance`; `feasible(t)` builds a plan at `t` and keeps it when it succeeds. With
/// `hi_feasible` the top is known to work and is not tried first. Returns whether any `t` succeeded (always with
/// `hi_feasible`) and the bracket's top.
template <class Feasible>
[[nodiscard]] std::pair<bool, std::int64_t> search_makespan(std::int64_t lo, std::int64_t hi, std::int64_t step,
                                                           std::int64_t tolerance, bool hi_feasible,
                                                           Feasible &&feasible) {
  bool found = false;
  while (hi_feasible ? lo < hi : lo <= hi) {
    const std::int64_t t = std::min(hi, lo + step - 1);
    if (feasible(t)) {
      hi = t;
      found = true;
      break;
    }
    lo = t + 1;
    step *= 2;
  }
  if (!found && !hi_feasible) return {false, hi};
  while (hi - lo >= tolerance) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (feasible(mid)) hi = mid;
    else lo = mid + 1;
  }
  return {true, hi};
}

} // namespace detail

/// Plans replicas and token splits for single layers; keeps its scratch between calls (one per thread).
class ReplicaPlanner {
public:
  ReplicaPlanner(const Topology &topo, int num_experts) : topo_(topo), num_experts_(num_experts) {
    topo.validate(num_experts);
    num_gpus_ = topo.num_gpus();
    slots_ = topo.slots_per_gpu;
  }

  [[nodiscard]] const Topology &topology() const noexcept { return topo_; }
  [[nodiscard]] int num_experts() const noexcept { return num_experts_; }

  /// Two-level plan: `owner_gpu[e]` keeps a copy of `e`; replicas fill spare slots. `resident` (may be null) is the
  /// previous micro-step's placement of this layer: its replicas are kept where useful at no move cost.
  [[nodiscard]] LayerPlan plan_two_level(std::span<const std::int64_t> loads, std::span<const std::int32_t> owner_gpu,
                                         const LayerPlacement *resident, const ReplicaOptions &opts = {}) {
    check_loads(loads, "plan_two_level");
    check_resident(resident, "plan_two_level");
    setup_owners(loads, owner_gpu);
    for (int g = 0; g < num_gpus_; ++g)
      budget_[g] = opts.move_budget < 0 ? spare_[g] : std::min(spare_[g], opts.move_budget);

    // The plan from scratch ignores the resident placement, so its makespan depends on the loads and owners
    // alone. Every returned plan is at least that good, and the resident placement is kept whenever it is too:
    // planning the same loads again with the result as resident therefore moves nothing. The scratch plan is
    // within any budget (a GPU's new replicas are at most its replicas, which the scratch search caps).
    // With a resident placement the scratch plan is usually replaced, so its makespan is taken as the search's
    // (an upper bound on its exact split) instead of evaluating it.
    setup_resident(nullptr, owner_gpu);
    const bool gate = opts.replica_cost && opts.token_time;
    const bool exact_scratch = resident == nullptr || opts.local_search_rounds > 0 || gate;
    std::int64_t scratch_makespan = search_two_level(loads, owner_gpu, opts, exact_scratch);
    last_scratch_makespan_ = scratch_makespan;
    // Whether the split state of the last evaluation is that of `cur_` (a local search that stops on a failed
    // trial leaves the trial's state behind, so it is re-evaluated then).
    bool cur_evaluated = exact_scratch && (opts.local_search_rounds <= 0 || gate);
    if (resident == nullptr) return realize(cur_, loads, owner_gpu, nullptr, cur_evaluated ? scratch_makespan : -1);
    if (resident_compatible(*resident, owner_gpu)) {
      // The resident placement as a solution (its non-owner copies as replicas): same exact-split maximum as the
      // placement, through the cheaper owner-based evaluation.
      if (res_sol_.rep.size() != static_cast<std::size_t>(num_gpus_) * slots_) clear_solution(res_sol_);
      for (int g = 0; g < num_gpus_; ++g) {
        res_sol_.cnt[g] = 0;
        for (int j = 0; j < slots_; ++j)
          if (const std::int32_t e = resident->slot(g, j); e != empty_slot && owner_gpu[e] != g)
            res_sol_.rep[g * slots_ + res_sol_.cnt[g]++] = e;
      }
      // Cheap necessary test first: a GPU whose unreplicated owned experts alone exceed the scratch makespan
      // rules the resident placement out without an exact split.
      if (resident_fixed_load_fits(res_sol_, loads, scratch_makespan)) {
        const std::int64_t res_makespan = evaluate(res_sol_, loads, scratch_makespan);
        cur_evaluated = false;
        if (res_makespan <= scratch_makespan) return plan_from_placement(*resident, loads, owner_gpu, resident);
      }
    }
    scratch_ = cur_;
    // Resident-aware construction at the scratch makespan: reuses resident replicas where they fit, so it
    // usually moves less for the same maximum.
    setup_resident(resident, owner_gpu);
    const bool constructed = shed_greedy(scratch_makespan, loads);
    if (constructed) {
      cur_ = trial_;
      // Without the gate the construction's own transfers are the split (each GPU at most the scratch makespan).
      if (!gate) {
        keep_unused_residents(cur_);
        return realize(cur_, loads, owner_gpu, resident, -1, !opts.exact_split);
      }
      (void)apply_gate(loads, owner_gpu, evaluate(cur_, loads), opts);
      keep_unused_residents(cur_);
      if (const std::int64_t m = evaluate(cur_, loads); m <= scratch_makespan)
        return realize(cur_, loads, owner_gpu, resident, m);
    }
    cur_ = scratch_;
    // The last evaluation was of the scratch plan (the construction above does not evaluate when it fails), so
    // it still holds unless kept residents change the solution.
    const bool evaluated_scratch = !constructed && cur_evaluated;
    if (keep_unused_residents(cur_) || !evaluated_scratch) return realize(cur_, loads, owner_gpu, resident);
    return realize(cur_, loads, owner_gpu, resident, scratch_makespan);
  }

  /// Free plan: any slot may hold any expert (every expert at least once), no move budget, owners not pinned.
  ///
  /// Candidates, the best kept: the resident placement unchanged; the two-level plan with `owner_hint` (when
  /// given; a two-level plan is a valid free plan, so free mode is never worse than two-level with those owners);
  /// the sequential fill below under a makespan search, when the two-level plan is not within 0.1% of the bound;
  /// the earlier LPT construction when still nothing is. Among candidates within 0.1% of the best (and never
  /// above the two-level one) the one with the fewest moves wins, so resident copies stay put when they are as
  /// good. Owners are `owner_hint` for the two-level candidate, else the GPU of each expert's first copy.
  [[nodiscard]] LayerPlan plan_free(std::span<const std::int64_t> loads, const LayerPlacement *resident,
                                    const ReplicaOptions &opts = {}, std::span<const std::int32_t> owner_hint = {}) {
    check_loads(loads, "plan_free");
    check_resident(resident, "plan_free");
    detail::require(owner_hint.empty() || static_cast<int>(owner_hint.size()) == num_experts_, "plan_free: ",
                    owner_hint.size(), " owners for ", num_experts_, " experts");
    const std::int64_t lb = lower_bound_free(loads, topo_);
    // Candidates within 0.1% of the best count as equal (the one moving least wins); the fill's search resolves
    // the makespan more finely, since its pieces are used as they are.
    const std::int64_t tolerance = lb / 1000; // 0 below 1000 tokens: tiny layers keep the best plan exactly
    const std::int64_t resolution = std::max<std::int64_t>(1, lb / 16384);
    constexpr std::int64_t none = std::numeric_limits<std::int64_t>::max();
    cands_.clear();
    // `indep`: the best makespan of the candidates that do not depend on the resident placement (the fill, the
    // LPT plan, the two-level plan from scratch).
    std::int64_t two_level_makespan = none, scratch_makespan = none, indep = none, best = none;
    const bool keep_candidate = resident != nullptr && resident_hosts_all(*resident);
    if (keep_candidate) {
      first_copy_owners(*resident);
      cands_.push_back(plan_from_placement(*resident, loads, first_owner_, resident));
      best = cands_.back().max_gpu_load;
    }
    if (!owner_hint.empty()) {
      ReplicaOptions two = opts;
      two.move_budget = -1;
      two.replica_cost = nullptr;
      two.token_time = nullptr;
      cands_.push_back(plan_two_level(loads, owner_hint, resident, two));
      two_level_makespan = cands_.back().max_gpu_load;
      scratch_makespan = indep = last_scratch_makespan_;
      best = std::min(best, two_level_makespan);
    }
    // The fill only pays when it can beat the two-level plan by more than the tolerance. Whether it runs, and
    // its search range, depend on resident-independent values only, so the same loads give the same `indep`.
    if (indep > lb + tolerance &&
        search_fill(loads, lb, std::min(indep == none ? none : indep - tolerance, fill_upper_bound(loads)),
                    resolution)) {
      cands_.push_back(fill_plan(resident));
      best = std::min(best, cands_.back().max_gpu_load);
      indep = std::min(indep, cands_.back().max_gpu_load);
    }
    // The earlier construction as well when nothing is within the tolerance of the bound yet (small or
    // slot-starved layers, where the fill's sequential pieces fit worst).
    if (indep > lb + tolerance) {
      cands_.push_back(plan_free_lpt(loads, resident, opts));
      best = std::min(best, cands_.back().max_gpu_load);
      indep = std::min(indep, cands_.back().max_gpu_load);
    }
    // The others must be within the tolerance of the best and no worse than the two-level plan. The resident
    // placement is kept when within the tolerance of the resident-independent best and no worse than the
    // two-level plan from scratch: the plan of some loads, fed back as resident with the same loads, met both
    // limits when it was picked, so it is kept and nothing moves.
    const std::int64_t limit = std::min(best + tolerance, two_level_makespan);
    const std::int64_t keep_limit = std::min(indep == none ? none : indep + tolerance, scratch_makespan);
    std::size_t pick = cands_.size();
    for (std::size_t i = 0; i < cands_.size(); ++i) {
      const LayerPlan &c = cands_[i];
      if (c.max_gpu_load > (keep_candidate && i == 0 ? keep_limit : limit)) continue;
      if (pick == cands_.size() || c.moves.size() < cands_[pick].moves.size() ||
          (c.moves.size() == cands_[pick].moves.size() && c.max_gpu_load < cands_[pick].max_gpu_load))
        pick = i;
    }
    if (pick == cands_.size()) pick = 0; // unreachable: the best candidate meets its limit unless it is the kept one
    return std::move(cands_[pick]);
  }

  /// A plan for a given placement: exact split and moves from `resident`.
  [[nodiscard]] LayerPlan plan_from_placement(const LayerPlacement &placement, std::span<const std::int64_t> loads,
                                              std::span<const std::int32_t> owner_gpu, const LayerPlacement *resident) {
    LayerPlan plan;
    plan.placement = placement;
    plan.owner_gpu.assign(owner_gpu.begin(), owner_gpu.end());
    plan.slot_tokens.assign(static_cast<std::size_t>(placement.num_slots()), 0);
    plan.max_gpu_load = split_.solve(placement, loads, plan.slot_tokens);
    plan.moves = compute_moves(placement, owner_gpu, resident, topo_.gpus_per_node);
    return plan;
  }

private:
  /// Replicas per GPU: `rep[g * slots + j]` for `j < cnt[g]`.
  struct Solution {
    std::vector<std::int32_t> rep;
    std::vector<std::int32_t> cnt;
    std::vector<std::int64_t> amt; ///< tokens of each replica in the construction that made it (if any)
  };

  void check_loads(std::span<const std::int64_t> loads, const char *who) const {
    detail::require(static_cast<int>(loads.size()) == num_experts_, who, ": ", loads.size(), " loads for ",
                    num_experts_, " experts");
    for (int e = 0; e < num_experts_; ++e)
      detail::require(loads[e] >= 0, who, ": expert ", e, " has a negative load ", loads[e]);
  }
  void check_resident(const LayerPlacement *resident, const char *who) const {
    if (resident == nullptr) return;
    detail::require(resident->num_gpus() == num_gpus_ && resident->slots_per_gpu() == slots_ &&
                        resident->num_experts() == num_experts_,
                    who, ": resident placement is ", resident->num_gpus(), " GPUs x ", resident->slots_per_gpu(),
                    " slots x ", resident->num_experts(), " experts, the topology is ", num_gpus_, " x ", slots_, " x ",
                    num_experts_);
  }
  /// Whether `r` is a valid two-level placement for these owners: ids in range, no duplicate on a GPU, every
  /// owner holding its expert (which also hosts every expert).
  [[nodiscard]] bool resident_compatible(const LayerPlacement &r, std::span<const std::int32_t> owner_gpu) {
    mark_.assign(static_cast<std::size_t>(num_experts_), -1);
    int owners_found = 0;
    for (int g = 0; g < num_gpus_; ++g)
      for (int j = 0; j < slots_; ++j) {
        const std::int32_t e = r.slot(g, j);
        if (e == empty_slot) continue;
        if (e < 0 || e >= num_experts_ || mark_[e] == g) return false;
        mark_[e] = g;
        owners_found += owner_gpu[e] == g;
      }
    return owners_found == num_experts_;
  }
  /// Whether every GPU's owned experts without a replica in `s` fit under `limit` (a necessary condition for
  /// the exact split of `s` to be at most `limit`).
  [[nodiscard]] bool resident_fixed_load_fits(const Solution &s, std::span<const std::int64_t> loads,
                                              std::int64_t limit) {
    flag_.assign(static_cast<std::size_t>(num_experts_), 0);
    for (int g = 0; g < num_gpus_; ++g)
      for (int j = 0; j < s.cnt[g]; ++j)
        flag_[s.rep[g * slots_ + j]] = 1;
    for (int g = 0; g < num_gpus_; ++g) {
      std::int64_t fixed = 0;
      for (int j = own_off_[g]; j < own_off_[g + 1]; ++j)
        if (!flag_[own_list_[j]]) fixed += loads[own_list_[j]];
      if (fixed > limit) return false;
    }
    return true;
  }
  [[nodiscard]] bool resident_hosts_all(const LayerPlacement &r) const {
    try {
      r.validate();
    } catch (const Error &) {
      return false;
    }
    return true;
  }

  void setup_owners(std::span<const std::int64_t> loads, std::span<const std::int32_t> owner_gpu) {
    detail::require(static_cast<int>(owner_gpu.size()) == num_experts_, "plan_two_level: ", owner_gpu.size(),
                    " owners for ", num_experts_, " experts");
    owner_ = owner_gpu;
    own_off_.assign(static_cast<std::size_t>(num_gpus_) + 1, 0);
    for (int e = 0; e < num_experts_; ++e) {
      const std::int32_t o = owner_gpu[e];
      detail::require(o >= 0 && o < num_gpus_, "plan_two_level: expert ", e, " has owner GPU ", o, ", outside [0, ",
                      num_gpus_, ")");
      ++own_off_[o + 1];
    }
    for (int g = 0; g < num_gpus_; ++g) {
      detail::require(own_off_[g + 1] <= slots_, "plan_two_level: GPU ", g, " owns ", own_off_[g + 1],
                      " experts but has ", slots_, " slots");
      own_off_[g + 1] += own_off_[g];
    }
    own_list_.resize(static_cast<std::size_t>(num_experts_));
    fill_.assign(own_off_.begin(), own_off_.end() - 1);
    for (int e = 0; e < num_experts_; ++e)
      own_list_[fill_[owner_gpu[e]]++] = e;
    owner_load_.assign(static_cast<std::size_t>(num_gpus_), 0);
    spare_.assign(static_cast<std::size_t>(num_gpus_), 0);
    budget_.assign(static_cast<std::size_t>(num_gpus_), 0);
    for (int g = 0; g < num_gpus_; ++g) {
      // Insertion sort: a GPU owns a handful of experts, and it is stable.
      for (int j = own_off_[g] + 1; j < own_off_[g + 1]; ++j) {
        const std::int32_t x = own_list_[j];
        int k = j;
        for (; k > own_off_[g] && loads[own_list_[k - 1]] < loads[x]; --k)
          own_list_[k] = own_list_[k - 1];
        own_list_[k] = x;
      }
      for (int j = own_off_[g]; j < own_off_[g + 1]; ++j)
        owner_load_[g] += loads[own_list_[j]];
      spare_[g] = slots_ - (own_off_[g + 1] - own_off_[g]);
    }
    hot_order_.resize(static_cast<std::size_t>(num_gpus_));
    std::iota(hot_order_.begin(), hot_order_.end(), 0);
    // Owner load descending, ties by GPU: the order of a stable sort, without its buffer allocation.
    std::sort(hot_order_.begin(), hot_order_.end(), [&](std::int32_t a, std::int32_t b) {
      return owner_load_[a] > owner_load_[b] || (owner_load_[a] == owner_load_[b] && a < b);
    });
  }

  void setup_resident(const LayerPlacement *resident, std::span<const std::int32_t> owner_gpu) {
    res_.assign(static_cast<std::size_t>(num_gpus_) * slots_, empty_slot);
    res_cnt_.assign(static_cast<std::size_t>(num_gpus_), 0);
    if (resident == nullptr) {
      res_off_.assign(static_cast<std::size_t>(num_experts_) + 1, 0);
      res_gpu_.clear();
      setup_receivers();
      return;
    }
    for (int g = 0; g < num_gpus_; ++g)
      for (std::int32_t e : resident->gpu_slots(g)) {
        if (e < 0 || e >= num_experts_ || owner_gpu[e] == g || res_cnt_[g] >= spare_[g]) continue;
        bool dup = false;
        for (int j = 0; j < res_cnt_[g]; ++j)
          dup = dup || res_[g * slots_ + j] == e;
        if (!dup) res_[g * slots_ + res_cnt_[g]++] = e;
      }
    // Expert -> GPUs holding it as a resident replica, ascending.
    res_off_.assign(static_cast<std::size_t>(num_experts_) + 1, 0);
    for (int g = 0; g < num_gpus_; ++g)
      for (int j = 0; j < res_cnt_[g]; ++j)
        ++res_off_[res_[g * slots_ + j] + 1];
    for (int e = 0; e < num_experts_; ++e)
      res_off_[e + 1] += res_off_[e];
    res_gpu_.resize(static_cast<std::size_t>(res_off_.back()));
    fill_.assign(res_off_.begin(), res_off_.end() - 1);
    for (int g = 0; g < num_gpus_; ++g)
      for (int j = 0; j < res_cnt_[g]; ++j)
        res_gpu_[fill_[res_[g * slots_ + j]]++] = g;
    setup_receivers();
  }
  /// GPUs that may receive at some T, in `hot_order_` (owner load descending), with suffix sums of their owner
  /// loads and receiving slots: at a given T the open GPUs are the suffix whose owner load is below T.
  void setup_receivers() {
    recv_all_.clear();
    for (std::int32_t g : hot_order_)
      if (spare_[g] > 0 && (budget_[g] > 0 || res_cnt_[g] > 0)) recv_all_.push_back(g);
    const std::size_t n = recv_all_.size();
    recv_load_suf_.assign(n + 1, 0);
    recv_slots_suf_.assign(n + 1, 0);
    for (std::size_t k = n; k-- > 0;) {
      const std::int32_t g = recv_all_[k];
      recv_load_suf_[k] = recv_load_suf_[k + 1] + owner_load_[g];
      recv_slots_suf_[k] = recv_slots_suf_[k + 1] + std::min(spare_[g], budget_[g] + res_cnt_[g]);
    }
  }
  [[nodiscard]] bool is_resident(int g, std::int32_t e) const noexcept {
    for (int j = 0; j < res_cnt_[g]; ++j)
      if (res_[g * slots_ + j] == e) return true;
    return false;
  }
  [[nodiscard]] bool holds(const Solution &s, int g, std::int32_t e) const noexcept {
    if (owner_[e] == g) return true;
    for (int j = 0; j < s.cnt[g]; ++j)
      if (s.rep[g * slots_ + j] == e) return true;
    return false;
  }
  [[nodiscard]] int num_new(const Solution &s, int g) const noexcept {
    int n = 0;
    for (int j = 0; j < s.cnt[g]; ++j)
      n += !is_resident(g, s.rep[g * slots_ + j]);
    return n;
  }
  void clear_solution(Solution &s) const {
    s.rep.assign(static_cast<std::size_t>(num_gpus_) * slots_, empty_slot);
    s.cnt.assign(static_cast<std::size_t>(num_gpus_), 0);
    s.amt.assign(static_cast<std::size_t>(num_gpus_) * slots_, 0);
  }

  /// Binary search on T over the greedy construction, then local search and the optional gate; leaves the
  /// solution in `cur_` and returns its exact makespan (without `exact`, and without local search and gate: the
  /// smallest T the construction met, at least the exact makespan).
  std::int64_t search_two_level(std::span<const std::int64_t> loads, std::span<const std::int32_t> owner_gpu,
                                const ReplicaOptions &opts, bool exact = true) {
    std::int64_t hi = 0;
    for (int g = 0; g < num_gpus_; ++g)
      hi = std::max(hi, owner_load_[g]);
    std::int64_t lo = std::min(hi, lower_bound_two_level(loads, owner_gpu, topo_, opts.move_budget, nullptr, bound_ws_));
    clear_solution(best_);
    // Good plans sit just above the bound, so gallop up from it, then bisect down to a 0.05% bracket. With a
    // resident placement the final plan keeps the construction's own split, which sits at the bracket's top, so
    // the bracket is the plan's distance from the best T the construction meets (0.2% costs the same time here
    // for about 0.0015 higher mean max/mean; below 0.05% it gains nothing measurable).
    const std::int64_t tolerance = std::max<std::int64_t>(1, lo / 2000);
    hi = detail::search_makespan(lo, hi, 4 * tolerance, tolerance, true, [&](std::int64_t t) {
           if (!shed_greedy(t, loads)) return false;
           best_ = trial_;
           return true;
         }).second;
    cur_ = best_;
    if (!exact && opts.local_search_rounds <= 0 && !(opts.replica_cost && opts.token_time)) return hi;
    std::int64_t makespan = evaluate(cur_, loads);
    if (opts.local_search_rounds > 0) makespan = local_search_two_level(loads, makespan, opts);
    if (opts.replica_cost && opts.token_time) makespan = apply_gate(loads, owner_gpu, makespan, opts);
    return makespan;
  }

  /// The greedy shedding construction at makespan `t`; fills `trial_` and says whether every GPU got under `t`.
  bool shed_greedy(std::int64_t t, std::span<const std::int64_t> loads) {
    // Only the counts need clearing: entries past a GPU's count are never read.
    if (trial_.rep.size() != static_cast<std::size_t>(num_gpus_) * slots_) clear_solution(trial_);
    std::fill(trial_.cnt.begin(), trial_.cnt.end(), 0);
    room_.resize(static_cast<std::size_t>(num_gpus_));
    new_left_.resize(static_cast<std::size_t>(num_gpus_));
    for (int g = 0; g < num_gpus_; ++g) {
      room_[g] = t - owner_load_[g];
      new_left_[g] = budget_[g];
    }
    // Kept sorted by (room, GPU) so that receivers are found by a search instead of a scan. Rooms start at
    // `t - owner load`, so `hot_order_` (owner load descending, stable) is already that order, and the open GPUs
    // (room > 0) are a suffix of the receivers in that order.
    const auto first_open = static_cast<std::size_t>(
        std::partition_point(recv_all_.begin(), recv_all_.end(), [&](std::int32_t g) { return owner_load_[g] >= t; }) -
        recv_all_.begin());
    open_.assign(recv_all_.begin() + static_cast<std::ptrdiff_t>(first_open), recv_all_.end());
    open_room_.resize(open_.size());
    open_pos_.resize(static_cast<std::size_t>(num_gpus_));
    for (std::size_t k = 0; k < open_.size(); ++k) {
      open_room_[k] = room_[open_[k]];
      open_pos_[open_[k]] = static_cast<std::int32_t>(k);
    }
    std::int64_t room_left = 0, slots_left = 0, excess_left = 0;
    {
      // Necessary conditions: the rooms hold the total excess, and the slots the fewest transfers (each moves at
      // most the largest room).
      const auto num_open = static_cast<std::int64_t>(open_.size());
      const std::int64_t total_room = num_open * t - recv_load_suf_[first_open];
      const std::int64_t max_room = open_.empty() ? 0 : room_[open_.back()];
      const std::int64_t slots_free = recv_slots_suf_[first_open];
      std::int64_t total_excess = 0;
      for (std::int32_t g : hot_order_) {
        const std::int64_t excess = owner_load_[g] - t;
        if (excess <= 0) break;
        total_excess += excess;
      }
      // Chaining lets hot GPUs share receivers' pieces, so only the total number of transfers is bounded.
      const std::int64_t transfers = max_room > 0 ? (total_excess + max_room - 1) / max_room : 1;
      if (total_excess > total_room || transfers > slots_free) return false;
      room_left = total_room;
      slots_left = slots_free;
      excess_left = total_excess;
    }
    // Only the experts of GPUs above t are read, each by its owner alone: set them when their owner starts.
    remaining_.resize(loads.size());
    chained_.assign(static_cast<std::size_t>(num_gpus_), 0);
    for (std::size_t hi_idx = 0; hi_idx < hot_order_.size(); ++hi_idx) {
      const std::int32_t g = hot_order_[hi_idx];
      std::int64_t excess = owner_load_[g] + chained_[g] - t;
      if (owner_load_[g] <= t) break;
      // The same necessary conditions on what is left: room lost in receivers that closed early (out of slots or
      // budget) usually makes a construction fail late, and this sees it one GPU at a time.
      if (excess_left > room_left || (excess_left > 0 && slots_left <= 0)) return false;
      for (int j = own_off_[g]; j < own_off_[g + 1]; ++j)
        remaining_[own_list_[j]] = loads[own_list_[j]];
      while (excess > 0) {
        // Heaviest remaining expert of g first; the others only when it cannot move all it could.
        std::int32_t pick_e = -1, pick_h = -1;
        std::int64_t pick_t = 0;
        std::int32_t top = -1;
        for (int j = own_off_[g]; j < own_off_[g + 1]; ++j)
          if (top < 0 || remaining_[own_list_[j]] > remaining_[top]) top = own_list_[j];
        if (top >= 0 && remaining_[top] > 0) {
          const std::int64_t need = std::min(excess, remaining_[top]);
          if (const std::int32_t h = pick_receiver(top, need); h >= 0) {
            pick_t = std::min(need, room_[h]);
            pick_e = top;
            pick_h = h;
          }
          // Another expert can only do better when no GPU could take this one: the transfer is capped by the
          // receiver's room or by the heaviest remaining load, and neither grows with a lighter expert.
          if (pick_e < 0)
            for (int j = own_off_[g]; j < own_off_[g + 1]; ++j) {
              const std::int32_t e = own_list_[j];
              const std::int64_t a = remaining_[e];
              if (e == top || a <= pick_t) continue; // cannot beat the transfer already found
              const std::int64_t need_e = std::min(excess, a);
              const std::int32_t h = pick_receiver(e, need_e);
              if (h < 0) continue;
              const std::int64_t tr = std::min(need_e, room_[h]);
              if (tr > pick_t) {
                pick_t = tr;
                pick_e = e;
                pick_h = h;
                if (tr == excess) break;
              }
            }
        }
        if (pick_e < 0) return false;
        // Chaining: a last piece that would close its receiver (no slot or budget left) with room to spare goes to
        // the next hot GPU's spare slot instead, which sheds that much more in its turn. A hot GPU's spare slot is
        // of no other use, and the receiver's room stays open for a later piece; otherwise every hot GPU wastes
        // the room its last piece leaves (about 12% of the mean at 1024 GPUs x 2 slots with budget 1).
        if (pick_t == excess && room_[pick_h] > pick_t && hi_idx + 1 < hot_order_.size()) {
          const std::int32_t g2 = hot_order_[hi_idx + 1];
          const bool closes = trial_.cnt[pick_h] + 1 >= spare_[pick_h] ||
                              (!is_resident(pick_h, pick_e) && new_left_[pick_h] <= 1);
          if (closes && owner_load_[g2] > t && trial_.cnt[g2] < spare_[g2] && !holds(trial_, g2, pick_e) &&
              (new_left_[g2] > 0 || is_resident(g2, pick_e))) {
            trial_.amt[g2 * slots_ + trial_.cnt[g2]] = excess;
            trial_.rep[g2 * slots_ + trial_.cnt[g2]++] = pick_e;
            if (!is_resident(g2, pick_e)) --new_left_[g2];
            chained_[g2] += excess;
            remaining_[pick_e] -= excess;
            excess = 0;
            continue;
          }
        }
        trial_.amt[pick_h * slots_ + trial_.cnt[pick_h]] = pick_t;
        trial_.rep[pick_h * slots_ + trial_.cnt[pick_h]++] = pick_e;
        if (!is_resident(pick_h, pick_e)) --new_left_[pick_h];
        // A receiver always sits in `open_` (only open GPUs are eligible), at `open_pos_`.
        std::size_t k = static_cast<std::size_t>(open_pos_[pick_h]);
        room_[pick_h] -= pick_t;
        room_left -= pick_t;
        excess_left -= pick_t;
        --slots_left;
        const std::int64_t r = room_[pick_h];
        if (r <= 0 || trial_.cnt[pick_h] >= spare_[pick_h] || (new_left_[pick_h] <= 0 && res_cnt_[pick_h] == 0)) {
          room_left -= std::max<std::int64_t>(r, 0);
          slots_left -= std::min(spare_[pick_h], budget_[pick_h] + res_cnt_[pick_h]) - trial_.cnt[pick_h];
          if (excess_left > room_left || (excess_left > 0 && slots_left <= 0)) return false;
          for (; k + 1 < open_.size(); ++k) {
            open_[k] = open_[k + 1];
            open_room_[k] = open_room_[k + 1];
            open_pos_[open_[k]] = static_cast<std::int32_t>(k);
          }
          open_.pop_back();
          open_room_.pop_back();
        } else {
          // Room only shrinks: move pick_h left to its sorted (room, GPU) position.
          for (; k > 0; --k) {
            const std::int32_t prev = open_[k - 1];
            if (open_room_[k - 1] < r || (open_room_[k - 1] == r && prev < pick_h)) break;
            open_[k] = prev;
            open_room_[k] = open_room_[k - 1];
            open_pos_[prev] = static_cast<std::int32_t>(k);
          }
          open_[k] = pick_h;
          open_room_[k] = r;
          open_pos_[pick_h] = static_cast<std::int32_t>(k);
        }
        remaining_[pick_e] -= pick_t;
        excess -= pick_t;
      }
    }
    return true;
  }

  /// Receiver for a new copy of `e` needing `need` tokens of room: a resident holder with enough room, else the
  /// tightest room >= need, else the largest room; -1 when no GPU can take it.
  std::int32_t pick_receiver(std::int32_t e, std::int64_t need) const {
    // Same choice as a scan of the open GPUs in GPU order: the first eligible resident holder with enough room,
    // else the tightest room >= need (ties: lowest GPU), else the largest room (ties: lowest GPU).
    for (int k = res_off_[e]; k < res_off_[e + 1]; ++k) {
      const std::int32_t h = res_gpu_[k];
      if (room_[h] >= need && eligible(h, e)) return h;
    }
    // First position with room >= need: a branchless search over the contiguous rooms.
    const std::int64_t *base = open_room_.data();
    std::size_t len = open_room_.size();
    while (len > 1) {
      const std::size_t half = len / 2;
      base = base[half - 1] < need ? base + half : base;
      len -= half;
    }
    const std::size_t first = static_cast<std::size_t>(base - open_room_.data()) + (len == 1 && *base < need);
    const auto pos = open_.begin() + static_cast<std::ptrdiff_t>(first);
    for (auto it = pos; it != open_.end(); ++it)
      if (eligible(*it, e)) return *it;
    std::int32_t big = -1;
    for (auto it = pos; it != open_.begin();) {
      const std::int32_t h = *--it;
      if (big >= 0 && room_[h] < room_[big]) break;
      if (eligible(h, e)) big = h;
    }
    return big;
  }
  [[nodiscard]] bool eligible(std::int32_t h, std::int32_t e) const noexcept {
    if (room_[h] <= 0 || trial_.cnt[h] >= spare_[h] || owner_[e] == h) return false;
    if (new_left_[h] <= 0 && !is_resident(h, e)) return false;
    for (int j = 0; j < trial_.cnt[h]; ++j)
      if (trial_.rep[h * slots_ + j] == e) return false;
    return true;
  }

  /// Exact split of a solution; leaves per-GPU loads in `gpu_loads_` and per-copy tokens in `copy_tokens_`.
  /// With `limit`, may stop early with a value above it once the maximum provably exceeds it (the split state
  /// is then unusable).
  std::int64_t evaluate(const Solution &s, std::span<const std::int64_t> loads,
                        std::int64_t limit = std::numeric_limits<std::int64_t>::max()) {
    // O(replicas + GPUs): `shared_idx_` stays -1 except for the experts of the last evaluation, reset here.
    if (shared_idx_.size() != static_cast<std::size_t>(num_experts_))
      shared_idx_.assign(static_cast<std::size_t>(num_experts_), -1);
    for (std::int32_t e : shared_exp_)
      shared_idx_[e] = -1;
    shared_loads_.clear();
    shared_exp_.clear();
    copies_.clear();
    for (int g = 0; g < num_gpus_; ++g)
      for (int j = 0; j < s.cnt[g]; ++j) {
        const std::int32_t e = s.rep[g * slots_ + j];
        if (shared_idx_[e] < 0) {
          shared_idx_[e] = static_cast<std::int32_t>(shared_exp_.size());
          shared_exp_.push_back(e);
          shared_loads_.push_back(loads[e]);
          copies_.push_back(1); // the owner copy
        }
        ++copies_[shared_idx_[e]];
      }
    const int num_shared = static_cast<int>(shared_loads_.size());
    offsets_.assign(static_cast<std::size_t>(num_shared) + 1, 0);
    for (int i = 0; i < num_shared; ++i)
      offsets_[i + 1] = offsets_[i] + copies_[i];
    copy_gpu_.resize(offsets_.back());
    fill_.assign(offsets_.begin(), offsets_.end() - 1);
    for (int i = 0; i < num_shared; ++i)
      copy_gpu_[fill_[i]++] = owner_[shared_exp_[i]];
    for (int g = 0; g < num_gpus_; ++g)
      for (int j = 0; j < s.cnt[g]; ++j) {
        const std::int32_t i = shared_idx_[s.rep[g * slots_ + j]];
        copy_gpu_[fill_[i]++] = g;
      }
    base_.assign(owner_load_.begin(), owner_load_.end());
    for (int i = 0; i < num_shared; ++i)
      base_[owner_[shared_exp_[i]]] -= shared_loads_[i];
    copy_tokens_.resize(copy_gpu_.size());
    gpu_loads_.resize(static_cast<std::size_t>(num_gpus_));
    return split_.solve_core(base_, shared_loads_, offsets_, copy_gpu_, copy_tokens_, gpu_loads_, limit);
  }

  /// Tokens that copy of `e` on `g` receives in the last evaluation (0 if none).
  [[nodiscard]] std::int64_t tokens_on(std::int32_t e, int g, std::span<const std::int64_t> loads) const {
    const std::int32_t i = shared_idx_[e];
    if (i < 0) return owner_[e] == g ? loads[e] : 0;
    for (int c = offsets_[i]; c < offsets_[i + 1]; ++c)
      if (copy_gpu_[c] == g) return copy_tokens_[c];
    return 0;
  }

  /// Improving single-replica moves: a replica (or a free spare) on a cool GPU is re-pointed at a heavy expert of
  /// the hottest GPU whenever that lowers the exact-split maximum (ties: fewer GPUs at the maximum).
  std::int64_t local_search_two_level(std::span<const std::int64_t> loads, std::int64_t makespan,
                                      const ReplicaOptions &opts) {
    // Within 0.2% of the bound there is little to gain for the evaluations it costs.
    const std::int64_t bound = lower_bound_total(loads, num_gpus_);
    const std::int64_t floor = bound + bound / 500;
    for (int round = 0; round < opts.local_search_rounds && makespan > floor; ++round) {
      // Hottest GPU and its heaviest experts by tokens it actually runs.
      int hot = 0;
      for (int g = 1; g < num_gpus_; ++g)
        if (gpu_loads_[g] > gpu_loads_[hot]) hot = g;
      cand_e_.clear();
      for (int j = own_off_[hot]; j < own_off_[hot + 1]; ++j)
        cand_e_.push_back(own_list_[j]);
      for (int j = 0; j < cur_.cnt[hot]; ++j)
        cand_e_.push_back(cur_.rep[hot * slots_ + j]);
      cand_tok_.resize(cand_e_.size());
      for (std::size_t k = 0; k < cand_e_.size(); ++k)
        cand_tok_[k] = tokens_on(cand_e_[k], hot, loads);
      // Top 3 experts by tokens on the hot GPU.
      order_.resize(cand_e_.size());
      std::iota(order_.begin(), order_.end(), 0);
      const std::size_t top = std::min<std::size_t>(2, order_.size());
      std::partial_sort(order_.begin(), order_.begin() + static_cast<std::ptrdiff_t>(top), order_.end(),
                        [&](std::int32_t a, std::int32_t b) { return cand_tok_[a] > cand_tok_[b]; });
      // Receivers: the coolest GPUs with a spare slot and budget.
      recv_.clear();
      for (int g = 0; g < num_gpus_; ++g)
        if (g != hot && spare_[g] > 0) recv_.push_back(g);
      const std::size_t num_recv = std::min<std::size_t>(3, recv_.size());
      std::partial_sort(recv_.begin(), recv_.begin() + static_cast<std::ptrdiff_t>(num_recv), recv_.end(),
                        [&](std::int32_t a, std::int32_t b) { return gpu_loads_[a] < gpu_loads_[b]; });
      std::int64_t best = makespan;
      Solution best_sol;
      bool found = false;
      saved_loads_ = gpu_loads_;
      for (std::size_t k = 0; k < top && !found; ++k) {
        const std::int32_t e = cand_e_[order_[k]];
        if (cand_tok_[order_[k]] <= 0) break;
        for (std::size_t r = 0; r < num_recv && !found; ++r) {
          const std::int32_t h = recv_[r];
          if (holds(cur_, h, e)) continue;
          // Where h has a free spare, add; otherwise replace each of its replicas in turn.
          const int options = cur_.cnt[h] < spare_[h] ? 1 : cur_.cnt[h];
          for (int slot = 0; slot < options; ++slot) {
            trial_ = cur_;
            if (cur_.cnt[h] < spare_[h])
              trial_.rep[h * slots_ + trial_.cnt[h]++] = e;
            else
              trial_.rep[h * slots_ + slot] = e;
            if (!is_resident(h, e) && num_new(trial_, h) > budget_[h]) continue;
            const std::int64_t m = evaluate(trial_, loads);
            if (m < best) {
              best = m;
              best_sol = trial_;
              found = true;
            }
          }
        }
      }
      if (!found) {
        gpu_loads_ = saved_loads_;
        break;
      }
      cur_ = best_sol;
      makespan = evaluate(cur_, loads);
    }
    return makespan;
  }

  /// Drops new replicas whose saving in compute time does not pay for their move.
  std::int64_t apply_gate(std::span<const std::int64_t> loads, std::span<const std::int32_t> owner_gpu,
                          std::int64_t makespan, const ReplicaOptions &opts) {
    for (int g = num_gpus_ - 1; g >= 0; --g)
      for (int j = cur_.cnt[g] - 1; j >= 0; --j) {
        const std::int32_t e = cur_.rep[g * slots_ + j];
        if (is_resident(g, e)) continue;
        trial_ = cur_;
        for (int k = j; k + 1 < trial_.cnt[g]; ++k)
          trial_.rep[g * slots_ + k] = trial_.rep[g * slots_ + k + 1];
        trial_.rep[g * slots_ + --trial_.cnt[g]] = empty_slot;
        const std::int64_t without = evaluate(trial_, loads);
        const int src = owner_gpu[e] / topo_.gpus_per_node == g / topo_.gpus_per_node ? owner_gpu[e] : host_mirror;
        const double saving = opts.token_time(without) - opts.token_time(makespan);
        if (saving <= opts.replica_cost(e, src, g)) {
          cur_ = trial_;
          makespan = without;
        }
      }
    return evaluate(cur_, loads);
  }

  /// Spare slots left unused keep their resident replica: it costs nothing and can only help the split.
  bool keep_unused_residents(Solution &s) const {
    bool added = false;
    for (int g = 0; g < num_gpus_; ++g)
      for (int j = 0; j < res_cnt_[g] && s.cnt[g] < spare_[g]; ++j) {
        const std::int32_t e = res_[g * slots_ + j];
        if (!holds(s, g, e)) {
          if (!s.amt.empty()) s.amt[g * slots_ + s.cnt[g]] = 0;
          s.rep[g * slots_ + s.cnt[g]++] = e;
          added = true;
        }
      }
    return added;
  }

  /// The plan of solution `s`: slots laid out around the resident ones, tokens from one exact split of `s`, or
  /// with `construction_split` from the construction's transfers `s.amt` (owners keep the rest).
  LayerPlan realize(const Solution &s, std::span<const std::int64_t> loads, std::span<const std::int32_t> owner_gpu,
                    const LayerPlacement *resident, std::int64_t evaluated_makespan = -1,
                    bool construction_split = false) {
    LayerPlan plan;
    if (construction_split) {
      owner_tokens_.assign(loads.begin(), loads.end());
      for (int g = 0; g < num_gpus_; ++g)
        for (int j = 0; j < s.cnt[g]; ++j)
          owner_tokens_[s.rep[g * slots_ + j]] -= s.amt[g * slots_ + j];
    } else {
      plan.max_gpu_load = evaluated_makespan >= 0 ? evaluated_makespan : evaluate(s, loads);
    }
    plan.placement = LayerPlacement(num_gpus_, slots_, num_experts_);
    for (int g = 0; g < num_gpus_; ++g) {
      want_.assign(own_list_.begin() + own_off_[g], own_list_.begin() + own_off_[g + 1]);
      std::sort(want_.begin(), want_.end());
      for (int j = 0; j < s.cnt[g]; ++j)
        want_.push_back(s.rep[g * slots_ + j]);
      layout_gpu_slots(plan.placement, g, want_, resident);
    }
    plan.owner_gpu.assign(owner_gpu.begin(), owner_gpu.end());
    plan.slot_tokens.assign(static_cast<std::size_t>(num_gpus_) * slots_, 0);
    if (construction_split) {
      for (int g = 0; g < num_gpus_; ++g) {
        std::int64_t gpu_load = 0;
        for (int j = 0; j < slots_; ++j) {
          const std::int32_t e = plan.placement.slot(g, j);
          if (e == empty_slot) continue;
          std::int64_t t = owner_tokens_[e];
          if (owner_gpu[e] != g)
            for (int k = 0; k < s.cnt[g]; ++k)
              if (s.rep[g * slots_ + k] == e) t = s.amt[g * slots_ + k];
          plan.slot_tokens[static_cast<std::size_t>(g) * slots_ + j] = t;
          gpu_load += t;
        }
        plan.max_gpu_load = std::max(plan.max_gpu_load, gpu_load);
      }
    } else {
      for (int g = 0; g < num_gpus_; ++g)
        for (int j = 0; j < slots_; ++j)
          if (const std::int32_t e = plan.placement.slot(g, j); e != empty_slot)
            plan.slot_tokens[static_cast<std::size_t>(g) * slots_ + j] = tokens_on(e, g, loads);
    }
    plan.moves = compute_moves(plan.placement, owner_gpu, resident, topo_.gpus_per_node);
    return plan;
  }

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
      recv_.resize(static_cast<std::size_t>(num_gpus_));
      std::iota(recv_.begin(), recv_.end(), 0);
      const std::size_t num_recv = std::min<std::size_t>(4, recv_.size());
      std::partial_sort(recv_.begin(), recv_.begin() + static_cast<std::ptrdiff_t>(num_recv), recv_.end(),
                        [&](std::int32_t a, std::int32_t b) { return free_gpu_load_[a] < free_gpu_load_[b]; });
      for (std::size_t r = 0; r < num_recv; ++r) {
        const int h = recv_[r];
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

  /// `first_owner_[e]`: the GPU of the first copy of `e` in `p`, or -1.
  void first_copy_owners(const LayerPlacement &p) {
    first_owner_.assign(static_cast<std::size_t>(num_experts_), -1);
    for (int q = 0; q < p.num_slots(); ++q)
      if (const std::int32_t e = p.phys_to_log()[q]; e != empty_slot && first_owner_[e] < 0) first_owner_[e] = q / slots_;
  }

  /// A makespan at which the fill succeeds when slots allow (every expert whole in its own slot): the total.
  [[nodiscard]] static std::int64_t fill_upper_bound(std::span<const std::int64_t> loads) {
    std::int64_t total = 0;
    for (std::int64_t v : loads)
      total += v;
    return total;
  }

  /// Smallest makespan in `[lo, hi]` (to `tolerance`) at which `fill_free` succeeds: a gallop up from `lo`, then
  /// bisection. Leaves the best fill in `fill_best_` and says whether any succeeded.
  bool search_fill(std::span<const std::int64_t> loads, std::int64_t lo, std::int64_t hi, std::int64_t tolerance) {
    if (lo > hi) return false;
    fill_order(loads);
    return detail::search_makespan(lo, hi, tolerance, tolerance, false, [&](std::int64_t t) {
             if (!fill_free(t)) return false;
             std::swap(fill_best_, fill_try_);
             std::swap(fill_amt_best_, fill_amt_try_);
             return true;
           }).first;
  }

  /// Experts by load descending (ties by id), for the fill.
  void fill_order(std::span<const std::int64_t> loads) {
    fill_ord_.resize(static_cast<std::size_t>(num_experts_));
    std::iota(fill_ord_.begin(), fill_ord_.end(), 0);
    std::sort(fill_ord_.begin(), fill_ord_.end(), [&](std::int32_t a, std::int32_t b) {
      return loads[a] > loads[b] || (loads[a] == loads[b] && a < b);
    });
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
    const Solution &s = fill_best_;
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
          if (s.rep[b * slots_ + k] == e) plan.slot_tokens[static_cast<std::size_t>(g) * slots_ + j] = fill_amt_best_[b * slots_ + k];
        gpu_load += plan.slot_tokens[static_cast<std::size_t>(g) * slots_ + j];
      }
      plan.max_gpu_load = std::max(plan.max_gpu_load, gpu_load);
    }
    first_copy_owners(plan.placement);
    plan.owner_gpu = first_owner_;
    plan.moves = compute_moves(plan.placement, plan.owner_gpu, resident, topo_.gpus_per_node);
    return plan;
  }

  /// The earlier free construction, a candidate where the fill does not reach the bound's tolerance: counts by
  /// greedy max load per copy, LPT of the copies, a swap search, the exact split.
  LayerPlan plan_free_lpt(std::span<const std::int64_t> loads, const LayerPlacement *resident,
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
    return plan_from_placement(laid, loads, owner, resident);
  }

  Topology topo_;
  int num_experts_ = 0, num_gpus_ = 0, slots_ = 0;
  SplitSolver split_;
  TwoLevelBoundWorkspace bound_ws_;
  std::span<const std::int32_t> owner_;
  std::vector<std::int32_t> own_off_, own_list_, fill_, spare_, budget_, hot_order_, res_, res_cnt_, new_left_;
  std::vector<std::int64_t> owner_load_, room_, remaining_, chained_;
  std::vector<std::int64_t> owner_tokens_;
  std::vector<std::int32_t> want_, mark_;
  std::vector<char> flag_;
  std::vector<std::int64_t> res_tokens_;
  std::vector<std::int32_t> open_; ///< GPUs that may still receive in the current construction, by (room, GPU)
  std::vector<std::int64_t> open_room_; ///< their rooms, in the same order
  std::vector<std::int32_t> open_pos_;  ///< GPU -> its index in `open_` (while it is there)
  std::vector<std::int32_t> res_off_, res_gpu_, recv_all_;
  std::vector<std::int64_t> recv_load_suf_, recv_slots_suf_;
  Solution best_, trial_, cur_, scratch_, res_sol_;
  std::vector<int> copies_;
  std::vector<std::int32_t> shared_idx_, shared_exp_, offsets_, copy_gpu_, cand_e_, order_, recv_;
  std::vector<std::int64_t> shared_loads_, base_, copy_tokens_, gpu_loads_, saved_loads_, cand_tok_;
  std::vector<int> counts_, free_cnt_;
  std::vector<std::int32_t> heap_, items_;
  std::vector<std::int64_t> free_gpu_load_;
  std::vector<LayerPlan> cands_;
  std::int64_t last_scratch_makespan_ = 0; ///< the last two-level call's makespan from scratch
  Solution fill_try_, fill_best_;
  std::vector<std::int32_t> fill_ord_, fill_next_, fill_prev_, fill_map_, first_owner_, holders_off_, holders_,
      holders_fill_;
  std::vector<std::int64_t> fill_sorted_, fill_amt_try_, fill_amt_best_;
  std::vector<int> shared_count_;
  std::vector<char> gpu_taken_;
};

/// Two-level plan of one layer (allocates a workspace; reuse a `ReplicaPlanner` in loops).
[[nodiscard]] inline LayerPlan plan_two_level(std::span<const std::int64_t> loads,
                                              std::span<const std::int32_t> owner_gpu, const Topology &topo,
                                              const LayerPlacement *resident = nullptr,
                                              const ReplicaOptions &opts = {}) {
  ReplicaPlanner planner(topo, static_cast<int>(loads.size()));
  return planner.plan_two_level(loads, owner_gpu, resident, opts);
}

/// Free-mode plan of one layer (allocates a workspace; reuse a `ReplicaPlanner` in loops).
[[nodiscard]] inline LayerPlan plan_free(std::span<const std::int64_t> loads, const Topology &topo,
                                         const LayerPlacement *resident = nullptr, const ReplicaOptions &opts = {}) {
  ReplicaPlanner planner(topo, static_cast<int>(loads.size()));
  return planner.plan_free(loads, resident, opts);
}

} // namespace v0
} // namespace foremoe
