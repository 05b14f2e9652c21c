#pragma once
/// @file
/// Two-level replica selection (owners fixed for the step, replicas in the spare slots) jointly with the token
/// split.
///
/// A binary search on the makespan `T` whose feasibility test is a greedy "shedding" construction. Every GPU above
/// `T` must shed `load - T`; it does so through replicas of its own experts on GPUs with a free spare slot and
/// headroom below `T`, taking its heaviest remaining expert each time and the receiver whose headroom fits the need
/// most tightly (a resident copy first, since it costs no move). A last piece that would close its receiver with
/// headroom left is chained to the next GPU above `T` instead (into its otherwise unused spare slot), which then
/// sheds that much more. The transfers it records are a valid split with maximum `T`: plans from a resident
/// placement use them as they are; plans from scratch take the exact split. An optional local search driven by the
/// exact split moves single replicas while the maximum drops.

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/core/topology.hpp"
#include "foremoe/plan/bounds.hpp"
#include "foremoe/plan/detail/layer_checks.hpp"
#include "foremoe/plan/detail/makespan_search.hpp"
#include "foremoe/plan/detail/receivers.hpp"
#include "foremoe/plan/detail/replica_solution.hpp"
#include "foremoe/plan/detail/sorting_network.hpp"
#include "foremoe/plan/detail/tolerance.hpp"
#include "foremoe/plan/plan.hpp"
#include "foremoe/plan/replicate/from_placement.hpp"
#include "foremoe/plan/replicate/options.hpp"
#include "foremoe/plan/split.hpp"

namespace foremoe {
inline namespace v0 {

/// A two-level plan and the makespan of the plan from scratch (resident ignored) for the same loads and owners,
/// which free mode uses as its resident-independent reference.
struct TwoLevelResult {
  LayerPlan plan;
  std::int64_t scratch_makespan = 0;
};

/// Two-level planning of single layers; keeps its scratch between calls (one per thread), never results.
class TwoLevelPlanner {
public:
  TwoLevelPlanner(const Topology &topo, int num_experts)
      : topo_(topo), num_experts_(num_experts), num_gpus_(topo.num_gpus()), slots_(topo.slots_per_gpu),
        eval_(num_experts, topo.num_gpus(), topo.slots_per_gpu) {
    topo.validate(num_experts);
  }

  /// Two-level plan: `owner_gpu[e]` keeps a copy of `e`; replicas fill spare slots. `resident` (may be null) is the
  /// previous micro-step's placement of this layer: its replicas are kept where useful at no move cost. With
  /// `opts.tolerance` the plan with the fewest bytes whose max/mean is within it (see `apply_tolerance`); with
  /// `opts.min_tokens_per_replica` no replica runs fewer tokens (see `enforce_min_tokens`).
  [[nodiscard]] TwoLevelResult plan(std::span<const std::int64_t> loads, std::span<const std::int32_t> owner_gpu,
                                    const LayerPlacement *resident, const ReplicaOptions &opts = {}) {
    TwoLevelResult r = plan_balanced(loads, owner_gpu, resident, opts);
    if (opts.replica_cost && opts.token_time) {
      // The gate drops replicas one at a time from its own starting plan, which need not be the plan without it;
      // so the plan without the gate stays when the model says it is faster (see `gate_model_seconds`).
      ReplicaOptions plain = opts;
      plain.replica_cost = nullptr;
      plain.token_time = nullptr;
      TwoLevelResult u = plan_balanced(loads, owner_gpu, resident, plain);
      if (gate_model_seconds(u.plan, opts) < gate_model_seconds(r.plan, opts)) r.plan = std::move(u.plan);
    }
    if (opts.tolerance > 0) apply_tolerance(r.plan, loads, owner_gpu, resident, opts);
    if (opts.min_tokens_per_replica > 0) {
      detail::enforce_min_tokens(r.plan, resident, opts.min_tokens_per_replica, topo_.gpus_per_node);
      if (opts.tolerance > 0) r.plan.tolerance_met = r.plan.max_gpu_load <= tolerance_limit(loads, opts.tolerance);
    }
    return r;
  }

  /// The gate's model of a plan's time: the expert compute of its most loaded GPU plus the cost of every new
  /// replica (a move onto a GPU that does not own the expert).
  [[nodiscard]] static double gate_model_seconds(const LayerPlan &plan, const ReplicaOptions &opts) {
    double t = opts.token_time(plan.max_gpu_load);
    for (const Move &m : plan.moves)
      if (plan.owner_gpu[m.expert] != m.dst_gpu) t += opts.replica_cost(m.expert, m.src_gpu, m.dst_gpu);
    return t;
  }

private:
  /// Today's plan: as balanced as the construction gets, fewest moves among equally good ones.
  [[nodiscard]] TwoLevelResult plan_balanced(std::span<const std::int64_t> loads,
                                             std::span<const std::int32_t> owner_gpu, const LayerPlacement *resident,
                                             const ReplicaOptions &opts) {
    detail::check_expert_loads(loads, num_experts_, "plan_two_level");
    detail::check_resident_shape(resident, topo_, num_experts_, "plan_two_level");
    setup_owners(loads, owner_gpu, opts.reference_owner_sort);
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
    const std::int64_t scratch_makespan = search_two_level(loads, owner_gpu, opts, exact_scratch);
    // Whether the split state of the last evaluation is that of `cur_` (a local search that stops on a failed
    // trial leaves the trial's state behind, so it is re-evaluated then).
    bool cur_evaluated = exact_scratch && (opts.local_search_rounds <= 0 || gate);
    auto result = [&](LayerPlan plan) { return TwoLevelResult{std::move(plan), scratch_makespan}; };
    if (resident == nullptr)
      return result(realize(cur_, loads, owner_gpu, nullptr, cur_evaluated ? scratch_makespan : -1));
    // The resident placement as a solution (its non-owner copies as replicas): same exact-split maximum as the
    // placement, through the cheaper owner-based evaluation.
    if (resident_compatible(*resident, owner_gpu, &res_sol_)) {
      // Cheap necessary test first: a GPU whose unreplicated owned experts alone exceed the scratch makespan
      // rules the resident placement out without an exact split.
      if (resident_fixed_load_fits(res_sol_, loads, scratch_makespan)) {
        const std::int64_t res_makespan =
            eval_.evaluate(res_sol_, loads, owner_, owner_load_, split_, scratch_makespan);
        cur_evaluated = false;
        if (res_makespan <= scratch_makespan)
          return result(plan_from_placement(*resident, loads, owner_gpu, resident, topo_.gpus_per_node, split_));
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
        return result(realize(cur_, loads, owner_gpu, resident, -1, !opts.exact_split));
      }
      (void)apply_gate(loads, owner_gpu, eval_.evaluate(cur_, loads, owner_, owner_load_, split_), opts);
      keep_unused_residents(cur_);
      if (const std::int64_t m = eval_.evaluate(cur_, loads, owner_, owner_load_, split_); m <= scratch_makespan)
        return result(realize(cur_, loads, owner_gpu, resident, m));
    }
    cur_ = scratch_;
    // The last evaluation was of the scratch plan (the construction above does not evaluate when it fails), so
    // it still holds unless kept residents change the solution.
    const bool evaluated_scratch = !constructed && cur_evaluated;
    if (keep_unused_residents(cur_) || !evaluated_scratch) return result(realize(cur_, loads, owner_gpu, resident));
    return result(realize(cur_, loads, owner_gpu, resident, scratch_makespan));
  }

  [[nodiscard]] std::int64_t tolerance_limit(std::span<const std::int64_t> loads, double tolerance) const {
    std::int64_t total = 0;
    for (std::int64_t x : loads)
      total += x;
    return foremoe::tolerance_limit(total, num_gpus_, tolerance);
  }

  /// Replaces `plan` (today's plan, P) by the candidate with the fewest bytes (moves, plus `opts.gradient_weight`
  /// per replica that runs tokens) whose largest GPU load is within
  /// `tolerance_limit` (ties: lower maximum, then ladder order), or, when none is, by the most balanced one, with
  /// `tolerance_met` false. Candidates: P, the resident placement kept, and the construction at each ladder
  /// makespan `ceil(r * mean)` (and at the owners' peak: no new replica) up to the larger of the limit and P's
  /// maximum. The candidate sets grow with the tolerance and the unmet pick lies in every larger set within it, so
  /// bytes never grow as the tolerance loosens.
  void apply_tolerance(LayerPlan &plan, std::span<const std::int64_t> loads, std::span<const std::int32_t> owner_gpu,
                       const LayerPlacement *resident, const ReplicaOptions &opts) {
    static constexpr double ladder[] = {1.0,  1.001, 1.0025, 1.005, 1.0075, 1.01, 1.015, 1.02, 1.03, 1.04,
                                        1.05, 1.075, 1.1,    1.15,  1.2,    1.3,  1.5,   2.0,  3.0};
    std::int64_t total = 0;
    for (std::int64_t x : loads)
      total += x;
    const std::int64_t limit = foremoe::tolerance_limit(total, num_gpus_, opts.tolerance);
    plan.tolerance_met = plan.max_gpu_load <= limit;
    auto bytes_of = [&](const LayerPlan &c) {
      return detail::tolerance_bytes(c, opts.gradient_weight, opts.held_gradients);
    };
    if (plan.tolerance_met && bytes_of(plan) == 0) return;
    const std::int64_t reach = std::max(limit, plan.max_gpu_load);
    // Best feasible (fewest bytes) and most balanced candidate so far, each a plan or, for the constructions, a
    // solution realized only if it wins (its bytes and maximum are those of its plan; see `construction_cost`).
    // P is both where it qualifies.
    struct Pick {
      double bytes = 0;
      std::int64_t max_load = 0;
      bool is_solution = false;
    };
    LayerPlan feasible, balanced;
    Pick fp, bp{bytes_of(plan), plan.max_gpu_load, false};
    bool has_feasible = false;
    // Whether a candidate of `bytes` and `max_load` replaces the best feasible and the most balanced ones.
    auto rank = [&](double bytes, std::int64_t max_load) {
      const bool more_balanced = max_load < bp.max_load || (max_load == bp.max_load && bytes < bp.bytes);
      const bool better_feasible =
          max_load <= limit && (!has_feasible || bytes < fp.bytes || (bytes == fp.bytes && max_load < fp.max_load));
      return std::pair{better_feasible, more_balanced};
    };
    auto consider = [&](LayerPlan &&c) {
      const double b = bytes_of(c);
      const auto [better_feasible, more_balanced] = rank(b, c.max_gpu_load);
      if (more_balanced) bp = {b, c.max_gpu_load, false};
      if (better_feasible) {
        if (more_balanced) balanced = c;
        fp = {b, c.max_gpu_load, false};
        feasible = std::move(c);
        has_feasible = true;
      } else if (more_balanced) {
        balanced = std::move(c);
      }
    };
    auto consider_solution = [&](const detail::ReplicaSolution &s) {
      const auto [b, m] = construction_cost(s, loads, resident, opts.gradient_weight, opts.held_gradients);
      const auto [better_feasible, more_balanced] = rank(b, m);
      if (more_balanced) {
        bp = {b, m, true};
        tol_balanced_ = s;
      }
      if (better_feasible) {
        fp = {b, m, true};
        tol_feasible_ = s;
        has_feasible = true;
      }
    };
    balanced = plan;
    if (plan.tolerance_met) {
      feasible = plan;
      fp = bp;
      has_feasible = true;
    }
    if (resident != nullptr && resident_compatible(*resident, owner_gpu))
      consider(plan_from_placement(*resident, loads, owner_gpu, resident, topo_.gpus_per_node, split_));
    std::int64_t peak = 0;
    for (int g = 0; g < num_gpus_; ++g)
      peak = std::max(peak, owner_load_[g]);
    setup_resident(resident, owner_gpu);
    std::int64_t last = -1;
    auto construct = [&](std::int64_t t) {
      if (t > reach || t == last || (has_feasible && fp.bytes == 0)) return;
      last = t;
      // The constructions at t: the plain one, and with a resident placement two resident-first ones (1: a
      // resident copy of the expert being shed takes a partial piece before any new copy; 2: also, each hot GPU
      // first sheds whatever resident copies of any of its experts can take), which often reach t with fewer
      // moves. Each with chaining and without: chaining saves rooms for balance, but every chained piece is one
      // more replica (a move and a gradient), so below the tightest makespans the plain shedding costs fewer
      // bytes (bench/tolerance_curve.sh, 1.02: 730 -> 624 GB per step on the default job).
      for (int chain = 1; chain >= 0; --chain)
        for (int variant = 0; variant < (resident != nullptr ? 3 : 1); ++variant) {
          resident_first_ = variant;
          no_chain_ = chain == 0;
          const bool ok = shed_greedy(t, loads);
          resident_first_ = 0;
          no_chain_ = false;
          if (!ok) continue;
          keep_unused_residents(trial_);
          consider_solution(trial_);
        }
    };
    for (double r : ladder) {
      const std::int64_t t = foremoe::tolerance_limit(total, num_gpus_, r);
      if (t >= peak) break;
      construct(t);
    }
    construct(peak);
    const Pick &won = has_feasible ? fp : bp;
    if (won.is_solution)
      plan = realize(has_feasible ? tol_feasible_ : tol_balanced_, loads, owner_gpu, resident, -1, true);
    else
      plan = has_feasible ? std::move(feasible) : std::move(balanced);
    assert(bytes_of(plan) == won.bytes && plan.max_gpu_load == won.max_load);
    plan.tolerance_met = has_feasible;
  }

  /// Bytes (`detail::tolerance_bytes` with `gradient_weight`) and largest GPU load of the plan `realize(s, loads,
  /// owner_, resident, -1, true)` would build, without building it: the construction's tokens, and a move for every
  /// expert a GPU wants that its row of `resident` does not hold (each replica without a resident placement).
  [[nodiscard]] std::pair<double, std::int64_t>
  construction_cost(const detail::ReplicaSolution &s, std::span<const std::int64_t> loads,
                    const LayerPlacement *resident, double gradient_weight, std::span<const std::int32_t> held = {}) {
    owner_tokens_.assign(loads.begin(), loads.end());
    for (int g = 0; g < num_gpus_; ++g)
      for (int j = 0; j < s.cnt[g]; ++j)
        owner_tokens_[s.rep[g * slots_ + j]] -= s.amt[g * slots_ + j];
    if (resident != nullptr) want_mark_.assign(static_cast<std::size_t>(num_experts_), -1);
    std::int64_t peak = 0, moves = 0, used = 0;
    for (int g = 0; g < num_gpus_; ++g) {
      std::int64_t load = 0;
      for (int j = own_off_[g]; j < own_off_[g + 1]; ++j)
        load += owner_tokens_[own_list_[j]];
      for (int j = 0; j < s.cnt[g]; ++j) {
        load += s.amt[g * slots_ + j];
        // A replica already holding a gradient for its owner there accumulates into it (`new_gradients`).
        used += s.amt[g * slots_ + j] > 0 &&
                (held.empty() || held[static_cast<std::size_t>(g) * num_experts_ + s.rep[g * slots_ + j]] !=
                                     owner_[s.rep[g * slots_ + j]]);
      }
      peak = std::max(peak, load);
      if (resident == nullptr) {
        moves += s.cnt[g];
        continue;
      }
      // Each wanted expert keeps a slot its resident row holds (at most one), as `realize` lays them out.
      for (int j = own_off_[g]; j < own_off_[g + 1]; ++j)
        want_mark_[own_list_[j]] = g;
      for (int j = 0; j < s.cnt[g]; ++j)
        want_mark_[s.rep[g * slots_ + j]] = g;
      std::int64_t kept = 0;
      for (const std::int32_t e : resident->gpu_slots(g))
        if (e >= 0 && e < num_experts_ && want_mark_[e] == g) {
          want_mark_[e] = -1;
          ++kept;
        }
      moves += own_off_[g + 1] - own_off_[g] + s.cnt[g] - kept;
    }
    // The same expression as `detail::tolerance_bytes`, so that a solution and its plan compare equal.
    const auto m = static_cast<double>(moves);
    return {gradient_weight <= 0 ? m : m + gradient_weight * static_cast<double>(used), peak};
  }
  /// Whether `r` is a valid two-level placement for these owners: ids in range, no duplicate on a GPU, every
  /// owner holding its expert (which also hosts every expert). With `replicas`, also writes there the non-owner
  /// copies of `r` (complete only when `r` is valid).
  [[nodiscard]] bool resident_compatible(const LayerPlacement &r, std::span<const std::int32_t> owner_gpu,
                                         detail::ReplicaSolution *replicas = nullptr) {
    if (replicas != nullptr && replicas->rep.size() != static_cast<std::size_t>(num_gpus_) * slots_)
      replicas->clear(num_gpus_, slots_);
    mark_.assign(static_cast<std::size_t>(num_experts_), -1);
    int owners_found = 0;
    for (int g = 0; g < num_gpus_; ++g) {
      int cnt = 0;
      for (int j = 0; j < slots_; ++j) {
        const std::int32_t e = r.slot(g, j);
        if (e == empty_slot) continue;
        if (e < 0 || e >= num_experts_ || mark_[e] == g) return false;
        mark_[e] = g;
        if (owner_gpu[e] == g)
          ++owners_found;
        else if (replicas != nullptr)
          replicas->rep[g * slots_ + cnt++] = e;
      }
      if (replicas != nullptr) replicas->cnt[g] = cnt;
    }
    return owners_found == num_experts_;
  }
  /// Whether every GPU's owned experts without a replica in `s` fit under `limit` (a necessary condition for
  /// the exact split of `s` to be at most `limit`).
  [[nodiscard]] bool resident_fixed_load_fits(const detail::ReplicaSolution &s, std::span<const std::int64_t> loads,
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
  void setup_owners(std::span<const std::int64_t> loads, std::span<const std::int32_t> owner_gpu, bool reference_sort) {
    detail::require(static_cast<int>(owner_gpu.size()) == num_experts_, "plan_two_level: ", owner_gpu.size(),
                    " owners for ", num_experts_, " experts");
    owner_ = owner_gpu;
    // A branch-free range check first (it vectorizes); the naming loop runs only when some owner is out of range.
    std::uint32_t out_of_range = 0;
    for (int e = 0; e < num_experts_; ++e)
      out_of_range |= static_cast<std::uint32_t>(owner_gpu[e]) >= static_cast<std::uint32_t>(num_gpus_);
    if (out_of_range != 0) [[unlikely]]
      for (int e = 0; e < num_experts_; ++e) {
        const std::int32_t o = owner_gpu[e];
        detail::require(o >= 0 && o < num_gpus_, "plan_two_level: expert ", e, " has owner GPU ", o, ", outside [0, ",
                        num_gpus_, ")");
      }
    // Owned counts and loads per GPU in one pass over the experts.
    own_off_.assign(static_cast<std::size_t>(num_gpus_) + 1, 0);
    owner_load_.assign(static_cast<std::size_t>(num_gpus_), 0);
    for (int e = 0; e < num_experts_; ++e) {
      const std::int32_t o = owner_gpu[e];
      ++own_off_[o + 1];
      owner_load_[o] += loads[e];
    }
    spare_.resize(static_cast<std::size_t>(num_gpus_));
    for (int g = 0; g < num_gpus_; ++g) {
      detail::require(own_off_[g + 1] <= slots_, "plan_two_level: GPU ", g, " owns ", own_off_[g + 1],
                      " experts but has ", slots_, " slots");
      spare_[g] = slots_ - own_off_[g + 1];
      own_off_[g + 1] += own_off_[g];
    }
    own_list_.resize(static_cast<std::size_t>(num_experts_));
    fill_.assign(own_off_.begin(), own_off_.end() - 1);
    for (int e = 0; e < num_experts_; ++e)
      own_list_[fill_[owner_gpu[e]]++] = e;
    own_by_id_ = own_list_; // each GPU's owned experts in expert order (the slot layout's order)
    budget_.resize(static_cast<std::size_t>(num_gpus_));
    // Only the GPUs that shed read their owned experts by load, so each is sorted when it first sheds.
    owned_sorted_.assign(static_cast<std::size_t>(num_gpus_), 0);
    hot_order_.resize(static_cast<std::size_t>(num_gpus_));
    std::iota(hot_order_.begin(), hot_order_.end(), 0);
    // Owner load descending, ties by GPU: the order of a stable sort, without its buffer allocation. Where the
    // loads fit, as one sort of packed (peak - load, GPU) keys: the same order, without the indirect compares.
    std::int64_t peak = 0;
    for (int g = 0; g < num_gpus_; ++g)
      peak = std::max(peak, owner_load_[g]);
    constexpr int gpu_bits = 21;
    if (!reference_sort && peak < (std::int64_t{1} << (63 - gpu_bits)) && num_gpus_ <= (1 << gpu_bits)) {
      hot_keys_.resize(static_cast<std::size_t>(num_gpus_));
      for (int g = 0; g < num_gpus_; ++g)
        hot_keys_[g] = static_cast<std::uint64_t>(peak - owner_load_[g]) << gpu_bits | static_cast<std::uint64_t>(g);
      std::sort(hot_keys_.begin(), hot_keys_.end());
      for (int g = 0; g < num_gpus_; ++g)
        hot_order_[g] = static_cast<std::int32_t>(hot_keys_[g] & ((std::uint64_t{1} << gpu_bits) - 1));
    } else {
      std::sort(hot_order_.begin(), hot_order_.end(), [&](std::int32_t a, std::int32_t b) {
        return owner_load_[a] > owner_load_[b] || (owner_load_[a] == owner_load_[b] && a < b);
      });
    }
  }

  /// Sorts GPU `g`'s owned experts by load (descending, stable) unless this call already did.
  void ensure_owned_sorted(int g, std::span<const std::int64_t> loads) {
    if (owned_sorted_[g] != 0) return;
    sort_owned(g, loads);
    owned_sorted_[g] = 1;
  }
  /// Sorts GPU `g`'s owned experts (in expert order on entry) by load, descending and stable. A GPU owns a
  /// handful of experts: up to 16 are sorted as packed (load, position) keys by a fixed sorting network, whose
  /// branchless compare-exchanges avoid both the mispredicted compares of an insertion sort on loads in random
  /// order and the n^2 compares of a rank count.
  void sort_owned(int g, std::span<const std::int64_t> loads) {
    const int lo = own_off_[g], n = own_off_[g + 1] - own_off_[g];
    if (n <= 1) return;
    constexpr int small = 16;
    // Key: (max_load - load) above 4 bits of position, so ascending keys are descending loads, ties in expert
    // order; padding keys (all ones) sort last.
    constexpr std::int64_t max_load = (std::int64_t{1} << 59) - 1;
    bool packable = n <= small;
    std::uint64_t key[small];
    for (int i = 0; i < n && packable; ++i) {
      const std::int64_t v = loads[own_list_[lo + i]];
      packable = v <= max_load;
      key[i] = static_cast<std::uint64_t>(max_load - v) << 4 | static_cast<std::uint64_t>(i);
    }
    if (!packable) {
      std::stable_sort(own_list_.begin() + lo, own_list_.begin() + lo + n,
                       [&](std::int32_t a, std::int32_t b) { return loads[a] > loads[b]; });
      return;
    }
    const int width = n <= 8 ? 8 : 16;
    for (int i = n; i < width; ++i)
      key[i] = ~std::uint64_t{0};
    if (width == 8)
      detail::sorting_network_8(key);
    else
      detail::sorting_network_16(key);
    std::int32_t x[small];
    std::copy_n(own_list_.begin() + lo, n, x);
    for (int i = 0; i < n; ++i)
      own_list_[lo + i] = x[key[i] & 15u];
  }

  void setup_resident(const LayerPlacement *resident, std::span<const std::int32_t> owner_gpu) {
    res_.resize(static_cast<std::size_t>(num_gpus_) * slots_); // entries past a GPU's count are never read
    res_cnt_.assign(static_cast<std::size_t>(num_gpus_), 0);
    if (resident == nullptr) {
      res_off_.assign(static_cast<std::size_t>(num_experts_) + 1, 0);
      res_gpu_.clear();
      recv_.build(hot_order_, spare_, budget_, res_cnt_, owner_load_);
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
    recv_.build(hot_order_, spare_, budget_, res_cnt_, owner_load_);
  }
  [[nodiscard]] bool is_resident(int g, std::int32_t e) const noexcept {
    for (int j = 0; j < res_cnt_[g]; ++j)
      if (res_[g * slots_ + j] == e) return true;
    return false;
  }
  [[nodiscard]] bool holds(const detail::ReplicaSolution &s, int g, std::int32_t e) const noexcept {
    if (owner_[e] == g) return true;
    for (int j = 0; j < s.cnt[g]; ++j)
      if (s.rep[g * slots_ + j] == e) return true;
    return false;
  }
  [[nodiscard]] int num_new(const detail::ReplicaSolution &s, int g) const noexcept {
    int n = 0;
    for (int j = 0; j < s.cnt[g]; ++j)
      n += !is_resident(g, s.rep[g * slots_ + j]);
    return n;
  }

  /// Binary search on T over the greedy construction, then local search and the optional gate; leaves the
  /// solution in `cur_` and returns its exact makespan (without `exact`, and without local search and gate: the
  /// smallest T the construction met, at least the exact makespan).
  std::int64_t search_two_level(std::span<const std::int64_t> loads, std::span<const std::int32_t> owner_gpu,
                                const ReplicaOptions &opts, bool exact = true) {
    std::int64_t hi = 0;
    for (int g = 0; g < num_gpus_; ++g)
      hi = std::max(hi, owner_load_[g]);
    std::int64_t lo =
        std::min(hi, lower_bound_two_level(loads, owner_gpu, topo_, opts.move_budget, nullptr, bound_ws_));
    best_.clear(num_gpus_, slots_);
    // Good plans sit just above the bound, so gallop up from it, then bisect down to a 0.05% bracket. With a
    // resident placement the final plan keeps the construction's own split, which sits at the bracket's top, so
    // the bracket is the plan's distance from the best T the construction meets (0.2% costs the same time here
    // for about 0.0015 higher mean max/mean; below 0.05% it gains nothing measurable).
    const std::int64_t tolerance = std::max<std::int64_t>(1, lo / 2000);
    hi = detail::search_makespan(lo, hi, 4 * tolerance, tolerance, true, [&](std::int64_t t) {
           if (!shed_greedy(t, loads)) return false;
           // A swap, not a copy: the next construction overwrites every entry of `trial_` it reads.
           std::swap(best_, trial_);
           return true;
         }).second;
    cur_ = best_;
    if (!exact && opts.local_search_rounds <= 0 && !(opts.replica_cost && opts.token_time)) return hi;
    std::int64_t makespan = eval_.evaluate(cur_, loads, owner_, owner_load_, split_);
    if (opts.local_search_rounds > 0) makespan = local_search_two_level(loads, makespan, opts);
    if (opts.replica_cost && opts.token_time) makespan = apply_gate(loads, owner_gpu, makespan, opts);
    return makespan;
  }

  /// The greedy shedding construction at makespan `t`; fills `trial_` and says whether every GPU got under `t`.
  bool shed_greedy(std::int64_t t, std::span<const std::int64_t> loads) {
    // Only the counts need clearing: entries past a GPU's count are never read.
    if (trial_.rep.size() != static_cast<std::size_t>(num_gpus_) * slots_) trial_.clear(num_gpus_, slots_);
    std::fill(trial_.cnt.begin(), trial_.cnt.end(), 0);
    room_.resize(static_cast<std::size_t>(num_gpus_));
    new_left_.resize(static_cast<std::size_t>(num_gpus_));
    // Two loops, so that each vectorises.
    for (int g = 0; g < num_gpus_; ++g)
      room_[g] = t - owner_load_[g];
    std::copy(budget_.begin(), budget_.end(), new_left_.begin());
    // Kept sorted by (room, GPU) so that receivers are found by a search instead of a scan. Rooms start at
    // `t - owner load`, so `hot_order_` (owner load descending, stable) is already that order, and the open GPUs
    // (room > 0) are a suffix of the receivers in that order.
    const std::size_t first_open = recv_.first_open(owner_load_, t);
    open_.reset(std::span(recv_.gpus).subspan(first_open), room_, num_gpus_);
    std::int64_t room_left = 0, slots_left = 0, excess_left = 0;
    {
      // Necessary conditions: the rooms hold the total excess, and the slots the fewest transfers (each moves at
      // most the largest room).
      const auto num_open = static_cast<std::int64_t>(open_.gpus().size());
      const std::int64_t total_room = num_open * t - recv_.load_suf[first_open];
      const std::int64_t max_room = open_.gpus().empty() ? 0 : room_[open_.gpus().back()];
      const std::int64_t slots_free = recv_.slots_suf[first_open];
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
      ensure_owned_sorted(g, loads);
      for (int j = own_off_[g]; j < own_off_[g + 1]; ++j)
        remaining_[own_list_[j]] = loads[own_list_[j]];
      while (excess > 0) {
        // Heaviest remaining expert of g first; the others only when it cannot move all it could.
        std::int32_t pick_e = -1, pick_h = -1;
        std::int64_t pick_t = 0;
        // The first of the largest (conditional moves: which one wins is hard to predict).
        std::int32_t top = -1;
        if (own_off_[g] < own_off_[g + 1]) {
          top = own_list_[own_off_[g]];
          std::int64_t top_left = remaining_[top];
          for (int j = own_off_[g] + 1; j < own_off_[g + 1]; ++j) {
            const std::int32_t e = own_list_[j];
            const std::int64_t left = remaining_[e];
            top = left > top_left ? e : top;
            top_left = left > top_left ? left : top_left;
          }
        }
        if (resident_first_ == 2) [[unlikely]]
          // Resident pieces first: the largest piece any resident copy of g's experts can take (no move).
          for (int j = own_off_[g]; j < own_off_[g + 1]; ++j) {
            const std::int32_t e = own_list_[j];
            if (remaining_[e] <= 0) continue;
            for (int k = res_off_[e]; k < res_off_[e + 1]; ++k)
              if (const std::int32_t h = res_gpu_[k]; eligible(h, e)) {
                const std::int64_t tr = std::min({excess, remaining_[e], room_[h]});
                if (tr > pick_t) {
                  pick_t = tr;
                  pick_e = e;
                  pick_h = h;
                }
              }
          }
        if (pick_e < 0 && top >= 0 && remaining_[top] > 0) {
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
        if (!no_chain_ && pick_t == excess && room_[pick_h] > pick_t && hi_idx + 1 < hot_order_.size()) {
          const std::int32_t g2 = hot_order_[hi_idx + 1];
          const bool closes =
              trial_.cnt[pick_h] + 1 >= spare_[pick_h] || (!is_resident(pick_h, pick_e) && new_left_[pick_h] <= 1);
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
        // A receiver is always open (only open GPUs are eligible).
        room_[pick_h] -= pick_t;
        room_left -= pick_t;
        excess_left -= pick_t;
        --slots_left;
        const std::int64_t r = room_[pick_h];
        if (r <= 0 || trial_.cnt[pick_h] >= spare_[pick_h] || (new_left_[pick_h] <= 0 && res_cnt_[pick_h] == 0)) {
          room_left -= std::max<std::int64_t>(r, 0);
          slots_left -= std::min(spare_[pick_h], budget_[pick_h] + res_cnt_[pick_h]) - trial_.cnt[pick_h];
          if (excess_left > room_left || (excess_left > 0 && slots_left <= 0)) return false;
          open_.close(pick_h);
        } else {
          open_.shrink(pick_h, r); // room only shrinks
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
    if (resident_first_ > 0) [[unlikely]] {
      // Resident-first variants: a resident holder takes what its room allows (the largest room; ties: lowest
      // GPU) before any new copy is considered.
      std::int32_t best = -1;
      for (int k = res_off_[e]; k < res_off_[e + 1]; ++k)
        if (const std::int32_t h = res_gpu_[k]; eligible(h, e) && (best < 0 || room_[h] > room_[best])) best = h;
      if (best >= 0) return best;
    }
    const std::vector<std::int32_t> &open = open_.gpus();
    const auto pos = open.begin() + static_cast<std::ptrdiff_t>(open_.first_with_room(need));
    for (auto it = pos; it != open.end(); ++it)
      if (eligible(*it, e)) return *it;
    std::int32_t big = -1;
    for (auto it = pos; it != open.begin();) {
      const std::int32_t h = *--it;
      if (big >= 0 && room_[h] < room_[big]) break;
      if (eligible(h, e)) big = h;
    }
    return big;
  }
  /// Inlined always: it is called once per candidate receiver, and out of line the call costs about as much as the
  /// test.
  [[nodiscard, gnu::always_inline]] bool eligible(std::int32_t h, std::int32_t e) const noexcept {
    if (room_[h] <= 0 || trial_.cnt[h] >= spare_[h] || owner_[e] == h) return false;
    if (new_left_[h] <= 0 && !is_resident(h, e)) return false;
    for (int j = 0; j < trial_.cnt[h]; ++j)
      if (trial_.rep[h * slots_ + j] == e) return false;
    return true;
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
        if (eval_.gpu_loads()[g] > eval_.gpu_loads()[hot]) hot = g;
      cand_e_.clear();
      ensure_owned_sorted(hot, loads);
      for (int j = own_off_[hot]; j < own_off_[hot + 1]; ++j)
        cand_e_.push_back(own_list_[j]);
      for (int j = 0; j < cur_.cnt[hot]; ++j)
        cand_e_.push_back(cur_.rep[hot * slots_ + j]);
      cand_tok_.resize(cand_e_.size());
      for (std::size_t k = 0; k < cand_e_.size(); ++k)
        cand_tok_[k] = eval_.tokens_on(cand_e_[k], hot, loads, owner_);
      // Top 3 experts by tokens on the hot GPU.
      order_.resize(cand_e_.size());
      std::iota(order_.begin(), order_.end(), 0);
      const std::size_t top = std::min<std::size_t>(2, order_.size());
      std::partial_sort(order_.begin(), order_.begin() + static_cast<std::ptrdiff_t>(top), order_.end(),
                        [&](std::int32_t a, std::int32_t b) { return cand_tok_[a] > cand_tok_[b]; });
      // Receivers: the coolest GPUs with a spare slot and budget.
      cool_.clear();
      for (int g = 0; g < num_gpus_; ++g)
        if (g != hot && spare_[g] > 0) cool_.push_back(g);
      const std::size_t num_recv = std::min<std::size_t>(3, cool_.size());
      std::partial_sort(cool_.begin(), cool_.begin() + static_cast<std::ptrdiff_t>(num_recv), cool_.end(),
                        [&](std::int32_t a, std::int32_t b) { return eval_.gpu_loads()[a] < eval_.gpu_loads()[b]; });
      std::int64_t best = makespan;
      detail::ReplicaSolution best_sol;
      bool found = false;
      saved_loads_ = eval_.gpu_loads();
      for (std::size_t k = 0; k < top && !found; ++k) {
        const std::int32_t e = cand_e_[order_[k]];
        if (cand_tok_[order_[k]] <= 0) break;
        for (std::size_t r = 0; r < num_recv && !found; ++r) {
          const std::int32_t h = cool_[r];
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
            const std::int64_t m = eval_.evaluate(trial_, loads, owner_, owner_load_, split_);
            if (m < best) {
              best = m;
              best_sol = trial_;
              found = true;
            }
          }
        }
      }
      if (!found) {
        eval_.gpu_loads() = saved_loads_;
        break;
      }
      cur_ = best_sol;
      makespan = eval_.evaluate(cur_, loads, owner_, owner_load_, split_);
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
        const std::int64_t without = eval_.evaluate(trial_, loads, owner_, owner_load_, split_);
        const int src = owner_gpu[e] / topo_.gpus_per_node == g / topo_.gpus_per_node ? owner_gpu[e] : host_mirror;
        const double saving = opts.token_time(without) - opts.token_time(makespan);
        if (saving <= opts.replica_cost(e, src, g)) {
          cur_ = trial_;
          makespan = without;
        }
      }
    return eval_.evaluate(cur_, loads, owner_, owner_load_, split_);
  }

  /// Spare slots left unused keep their resident replica: it costs nothing and can only help the split.
  bool keep_unused_residents(detail::ReplicaSolution &s) const {
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
  LayerPlan realize(const detail::ReplicaSolution &s, std::span<const std::int64_t> loads,
                    std::span<const std::int32_t> owner_gpu, const LayerPlacement *resident,
                    std::int64_t evaluated_makespan = -1, bool construction_split = false) {
    LayerPlan plan;
    if (construction_split) {
      owner_tokens_.assign(loads.begin(), loads.end());
      for (int g = 0; g < num_gpus_; ++g)
        for (int j = 0; j < s.cnt[g]; ++j)
          owner_tokens_[s.rep[g * slots_ + j]] -= s.amt[g * slots_ + j];
    } else {
      plan.max_gpu_load =
          evaluated_makespan >= 0 ? evaluated_makespan : eval_.evaluate(s, loads, owner_, owner_load_, split_);
    }
    plan.placement = LayerPlacement(num_gpus_, slots_, num_experts_);
    plan.owner_gpu.assign(owner_gpu.begin(), owner_gpu.end());
    plan.slot_tokens.assign(static_cast<std::size_t>(num_gpus_) * slots_, 0);
    moves_.clear();
    // Per GPU the experts it wants (owned ones in expert order, then its replicas), laid out as
    // `layout_gpu_slots` does: an expert the resident placement holds on the GPU keeps that slot, the others fill
    // the free slots in order, each a move (what `compute_moves` finds: no free slot held its new expert before,
    // or the matching would have kept it).
    if (resident == nullptr) {
      // Every slot is free: the list is the layout, and only replicas move (the owned experts are where every GPU
      // starts), from the owner when it is on the node, else the host mirror.
      const int gpn = topo_.gpus_per_node;
      for (int g = 0; g < num_gpus_; ++g) {
        const int num_owned = own_off_[g + 1] - own_off_[g];
        check_layout_fits(g, num_owned + s.cnt[g]);
        std::int32_t *out = &plan.placement.slot(g, 0);
        std::int64_t *tokens = plan.slot_tokens.data() + static_cast<std::size_t>(g) * slots_;
        std::copy_n(own_by_id_.begin() + own_off_[g], num_owned, out);
        std::copy_n(s.rep.begin() + static_cast<std::ptrdiff_t>(g) * slots_, s.cnt[g], out + num_owned);
        for (int j = num_owned; j < num_owned + s.cnt[g]; ++j) {
          const std::int32_t e = out[j], owner = owner_[e];
          const bool owner_on_node = owner / gpn == g / gpn && owner != g;
          moves_.push_back({e, owner_on_node ? owner : host_mirror, g, static_cast<std::int32_t>(j)});
        }
        if (construction_split) {
          std::int64_t gpu_load = 0;
          for (int j = 0; j < num_owned; ++j)
            gpu_load += tokens[j] = owner_tokens_[out[j]];
          for (int k = 0; k < s.cnt[g]; ++k)
            gpu_load += tokens[num_owned + k] = s.amt[g * slots_ + k];
          plan.max_gpu_load = std::max(plan.max_gpu_load, gpu_load);
        }
      }
    } else {
      // `kept_[e] == stamp` marks the experts of the current GPU that kept their resident slot (a new stamp per
      // GPU, so the marks need no clearing).
      kept_.resize(static_cast<std::size_t>(num_experts_), 0);
      for (int g = 0; g < num_gpus_; ++g) {
        const int num_owned = own_off_[g + 1] - own_off_[g], num_rep = s.cnt[g];
        check_layout_fits(g, num_owned + num_rep);
        if (++stamp_ == 0) { // wrapped: old marks could collide with new stamps
          std::fill(kept_.begin(), kept_.end(), 0);
          stamp_ = 1;
        }
        std::int32_t *out = &plan.placement.slot(g, 0);
        std::int64_t *tokens = plan.slot_tokens.data() + static_cast<std::size_t>(g) * slots_;
        const std::int32_t *rep = s.rep.data() + static_cast<std::ptrdiff_t>(g) * slots_;
        const std::int64_t *amt = construction_split ? s.amt.data() + static_cast<std::ptrdiff_t>(g) * slots_ : nullptr;
        std::int64_t gpu_load = 0;
        // Resident slots whose expert g still wants (the first such slot of each) keep it.
        for (int j = 0; j < slots_; ++j) {
          const std::int32_t e = resident->slot(g, j);
          if (e < 0 || e >= num_experts_ || kept_[e] == stamp_) continue;
          std::int64_t t = 0;
          if (owner_[e] == g) {
            if (construction_split) t = owner_tokens_[e];
          } else {
            int k = 0;
            while (k < num_rep && rep[k] != e)
              ++k;
            if (k == num_rep) continue;
            if (construction_split) t = amt[k];
          }
          kept_[e] = stamp_;
          out[j] = e;
          tokens[j] = t;
          gpu_load += t;
        }
        // The others fill the free slots in order, each a move.
        int j = 0;
        auto place = [&](std::int32_t e, std::int64_t t) {
          while (out[j] != empty_slot)
            ++j;
          out[j] = e;
          tokens[j] = t;
          gpu_load += t;
          moves_.push_back({e, detail::move_source(*resident, owner_gpu, e, g, topo_.gpus_per_node), g,
                            static_cast<std::int32_t>(j)});
        };
        for (int i = own_off_[g]; i < own_off_[g + 1]; ++i)
          if (const std::int32_t e = own_by_id_[i]; kept_[e] != stamp_)
            place(e, construction_split ? owner_tokens_[e] : 0);
        for (int k = 0; k < num_rep; ++k)
          if (kept_[rep[k]] != stamp_) place(rep[k], construction_split ? amt[k] : 0);
        if (construction_split) plan.max_gpu_load = std::max(plan.max_gpu_load, gpu_load);
      }
      // A source chosen above may be a slot that a later GPU's layout overwrote: choose again for those (rare),
      // now that every written slot is known (`move_source` with them, as `compute_moves` does).
      written_.assign(static_cast<std::size_t>(num_gpus_) * slots_, 0);
      for (const Move &m : moves_)
        written_[static_cast<std::size_t>(m.dst_gpu) * slots_ + m.dst_slot] = 1;
      for (Move &m : moves_)
        if (m.src_gpu != host_mirror && !detail::readable_copy(*resident, m.expert, m.src_gpu, written_))
          m.src_gpu = detail::move_source(*resident, owner_gpu, m.expert, m.dst_gpu, topo_.gpus_per_node, written_);
    }
    if (!construction_split) {
      for (int g = 0; g < num_gpus_; ++g)
        for (int j = 0; j < slots_; ++j)
          if (const std::int32_t e = plan.placement.slot(g, j); e != empty_slot)
            plan.slot_tokens[static_cast<std::size_t>(g) * slots_ + j] = eval_.tokens_on(e, g, loads, owner_);
    }
    plan.moves.assign(moves_.begin(), moves_.end());
    return plan;
  }
  void check_layout_fits(int g, int n) const {
    if (n > slots_) [[unlikely]]
      detail::fail("layout_slots: GPU ", g, " gets ", n, " experts but has ", slots_, " slots");
  }

  Topology topo_;
  int num_experts_ = 0, num_gpus_ = 0, slots_ = 0;
  SplitSolver split_;
  detail::SolutionSplit eval_;
  TwoLevelBoundWorkspace bound_ws_;
  std::span<const std::int32_t> owner_; ///< the current call's owners
  std::vector<std::int32_t> own_off_, own_list_, fill_, spare_, budget_, hot_order_, res_, res_cnt_, new_left_;
  std::vector<std::int64_t> owner_load_, room_, remaining_, chained_;
  std::vector<std::int64_t> owner_tokens_;
  std::vector<Move> moves_;   ///< realize's moves, copied into the plan at their final size
  std::vector<char> written_; ///< realize: the slots its moves write, `[gpus * slots]`
  std::vector<std::int32_t> own_by_id_, mark_;
  std::vector<std::uint32_t> kept_; ///< realize's marks of kept resident slots
  std::uint32_t stamp_ = 0;         ///< the current GPU's mark in `kept_`
  std::vector<char> flag_, owned_sorted_;
  detail::ReceiverOrder recv_;
  detail::OpenReceivers open_;
  std::vector<std::int32_t> res_off_, res_gpu_;
  detail::ReplicaSolution best_, trial_, cur_, scratch_, res_sol_;
  detail::ReplicaSolution tol_feasible_, tol_balanced_; ///< `apply_tolerance`'s best constructions so far
  std::vector<std::int32_t> want_mark_;                 ///< `construction_cost`: expert -> GPU that wants it
  std::vector<std::int32_t> cand_e_, order_, cool_;
  std::vector<std::int64_t> saved_loads_, cand_tok_;
  std::vector<std::uint64_t> hot_keys_;
  int resident_first_ = 0; ///< construction variant of the tolerance candidates (see `apply_tolerance`)
  bool no_chain_ = false;  ///< tolerance candidates: the construction without chaining (fewer replicas)
};

} // namespace v0
} // namespace foremoe
