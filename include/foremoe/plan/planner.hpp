#pragma once
/// @file
/// The planner: owners per RL step, replicas and token splits per micro-step, for every strategy.

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <span>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/load_tensor.hpp"
#include "foremoe/core/model_spec.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/core/topology.hpp"
#include "foremoe/plan/eplb.hpp"
#include "foremoe/plan/owners.hpp"
#include "foremoe/plan/plan.hpp"
#include "foremoe/plan/replicate.hpp"

namespace foremoe {
inline namespace v0 {

/// Which planner produces the micro-step plans.
enum class Strategy : std::uint8_t {
  static_placement, ///< contiguous experts, no replicas (Megatron-style EP)
  eplb,             ///< DeepSeek EPLB from the previous step's summed loads, unchanged for the whole step
  eplb_oracle,      ///< DeepSeek EPLB from the current step's summed loads
  foremoe,          ///< per-micro-step planning in `PlannerOptions::mode`
  foremoe_free,     ///< per-micro-step planning in free mode
};

/// Name as on the command line: "static", "eplb", "eplb-oracle", "foremoe", "foremoe-free".
[[nodiscard]] inline std::string_view to_string(Strategy s) noexcept {
  switch (s) {
  case Strategy::static_placement: return "static";
  case Strategy::eplb: return "eplb";
  case Strategy::eplb_oracle: return "eplb-oracle";
  case Strategy::foremoe: return "foremoe";
  case Strategy::foremoe_free: return "foremoe-free";
  }
  return "?";
}

/// Parses a strategy name; throws `Error` naming the unknown value.
[[nodiscard]] inline Strategy parse_strategy(std::string_view s) {
  if (s == "static") return Strategy::static_placement;
  if (s == "eplb") return Strategy::eplb;
  if (s == "eplb-oracle" || s == "eplb_oracle") return Strategy::eplb_oracle;
  if (s == "foremoe") return Strategy::foremoe;
  if (s == "foremoe-free" || s == "foremoe_free") return Strategy::foremoe_free;
  detail::fail("unknown strategy '", s, "' (expected static, eplb, eplb-oracle, foremoe or foremoe-free)");
}

/// Replicas in spare slots next to step-level owners, or anything anywhere.
enum class PlanMode : std::uint8_t { two_level, free };

/// Name as on the command line: "two-level" or "free".
[[nodiscard]] inline std::string_view to_string(PlanMode m) noexcept {
  return m == PlanMode::two_level ? "two-level" : "free";
}

/// Parses a mode name; throws `Error` naming the unknown value.
[[nodiscard]] inline PlanMode parse_plan_mode(std::string_view s) {
  if (s == "two-level" || s == "two_level") return PlanMode::two_level;
  if (s == "free") return PlanMode::free;
  detail::fail("unknown plan mode '", s, "' (expected two-level or free)");
}

/// Training stage of a micro-step: the update stage also returns every replica's gradient to its owner.
enum class Stage : std::uint8_t { recompute, update };

/// Seconds a new replica costs in a stage (weights in; in the update stage also the gradient out).
using StageReplicaCostFn = std::function<double(int expert, int src_gpu, int dst_gpu, Stage stage)>;

/// Planner configuration.
struct PlannerOptions {
  Strategy strategy = Strategy::foremoe;
  PlanMode mode = PlanMode::two_level; ///< for `Strategy::foremoe`
  int move_budget = -1;                ///< new replicas per GPU per micro-step; < 0: the spare slots
  bool hierarchical_owners = true;     ///< owners: nodes first, then GPUs in each node
  /// Whether a new owner map costs nothing (colocated trainers reload optimizer state after rollout). When not,
  /// `begin_step` keeps the previous step's owners unless their most loaded GPU is more than
  /// `owner_keep_tolerance` above a fresh plan's, and then changes as few as it can (see `OwnerOptions`).
  bool reowning_free = true;
  double owner_keep_tolerance = 0.05;
  int num_threads = 1;                 ///< parallel over layers; plans are identical for every count
  int local_search_rounds = 0;         ///< two-level exact-split local search per layer (see ReplicaOptions)
  int free_search_rounds = 4;          ///< free-mode placement swap rounds per layer
  bool exact_split = false;            ///< re-split every two-level plan exactly (see ReplicaOptions)
  int eplb_num_groups = 1;             ///< expert groups for EPLB (hierarchical when they divide over nodes)
  /// Optional cost gate (both must be set): a new replica stays only if its compute saving exceeds its cost.
  StageReplicaCostFn replica_cost;
  TokenTimeFn token_time;
};

/// Plans owners per RL step and replicas plus token splits per micro-step. Not safe for concurrent calls on one
/// object (it keeps per-thread workspaces); use one planner per calling thread.
class Planner {
public:
  using OwnerMap = std::vector<std::vector<std::int32_t>>; ///< `[layers][experts]` owner GPU

  Planner(int num_layers, int num_experts, const Topology &topo, PlannerOptions opts = {})
      : num_layers_(num_layers), num_experts_(num_experts), topo_(topo), opts_(std::move(opts)) {
    detail::require(num_layers > 0, "Planner: num_layers must be positive, got ", num_layers);
    topo.validate(num_experts);
    detail::require(opts_.num_threads >= 1, "Planner: num_threads must be >= 1, got ", opts_.num_threads);
    detail::require(opts_.eplb_num_groups >= 1 && num_experts % opts_.eplb_num_groups == 0, "Planner: ", num_experts,
                    " experts do not divide into eplb_num_groups = ", opts_.eplb_num_groups);
    detail::require(opts_.owner_keep_tolerance >= 0, "Planner: owner_keep_tolerance must be >= 0, got ",
                    opts_.owner_keep_tolerance);
    detail::require(opts_.local_search_rounds >= 0 && opts_.free_search_rounds >= 0,
                    "Planner: local_search_rounds and free_search_rounds must be >= 0, got ", opts_.local_search_rounds,
                    " and ", opts_.free_search_rounds);
  }
  Planner(const ModelSpec &spec, const Topology &topo, PlannerOptions opts = {})
      : Planner((spec.validate(), spec.num_layers), spec.num_experts, topo, std::move(opts)) {}

  [[nodiscard]] int num_layers() const noexcept { return num_layers_; }
  [[nodiscard]] int num_experts() const noexcept { return num_experts_; }
  [[nodiscard]] const Topology &topology() const noexcept { return topo_; }
  [[nodiscard]] const PlannerOptions &options() const noexcept { return opts_; }

  /// Owners of every layer from step totals `[layers][experts]` (C order); `previous` (may be empty): owners to
  /// keep where the tolerance allows.
  [[nodiscard]] OwnerMap plan_owners(std::span<const std::int64_t> step_totals, const OwnerMap &previous = {}) const {
    check_layer_loads(step_totals, "plan_owners");
    OwnerOptions o;
    o.hierarchical = opts_.hierarchical_owners;
    o.keep_tolerance = opts_.owner_keep_tolerance;
    return foremoe::plan_owners(step_totals, num_layers_, num_experts_, topo_, o, previous);
  }
  /// Owners from the sum of all micro-steps of `micro_steps`.
  [[nodiscard]] OwnerMap plan_owners(const LoadTensor &micro_steps) const {
    return plan_owners(sum_steps(micro_steps));
  }

  /// Fixes the step-level state: owners from `step_totals` (two-level), the EPLB tables (from
  /// `previous_step_totals` for `eplb`, static placement when that is empty; from `step_totals` for `eplb-oracle`).
  void begin_step(std::span<const std::int64_t> step_totals, std::span<const std::int64_t> previous_step_totals = {}) {
    check_layer_loads(step_totals, "begin_step");
    switch (opts_.strategy) {
    case Strategy::static_placement: owners_ = static_owners(); break;
    case Strategy::foremoe:
    case Strategy::foremoe_free: owners_ = plan_owners(step_totals, opts_.reowning_free ? OwnerMap{} : owners_); break;
    case Strategy::eplb:
      if (previous_step_totals.empty()) {
        eplb_.clear();
      } else {
        check_layer_loads(previous_step_totals, "begin_step (previous step)");
        eplb_ = run_eplb(previous_step_totals);
      }
      break;
    case Strategy::eplb_oracle: eplb_ = run_eplb(step_totals); break;
    }
  }

  /// Replaces the owners used by two-level planning.
  void set_owners(OwnerMap owners) {
    detail::require(static_cast<int>(owners.size()) == num_layers_, "Planner: owner map has ", owners.size(),
                    " layers, expected ", num_layers_);
    for (int l = 0; l < num_layers_; ++l) {
      detail::require(static_cast<int>(owners[l].size()) == num_experts_, "Planner: owner map layer ", l, " has ",
                      owners[l].size(), " experts, expected ", num_experts_);
      std::vector<int> per_gpu(static_cast<std::size_t>(topo_.num_gpus()), 0);
      for (int e = 0; e < num_experts_; ++e) {
        const std::int32_t o = owners[l][e];
        detail::require(o >= 0 && o < topo_.num_gpus(), "Planner: layer ", l, " expert ", e, " has owner GPU ", o,
                        ", outside [0, ", topo_.num_gpus(), ")");
        detail::require(++per_gpu[o] <= topo_.slots_per_gpu, "Planner: layer ", l, " GPU ", o, " owns more than its ",
                        topo_.slots_per_gpu, " slots");
      }
    }
    owners_ = std::move(owners);
  }
  /// The owners in use (empty before `begin_step` / `set_owners`).
  [[nodiscard]] const OwnerMap &owners() const noexcept { return owners_; }

  /// Plans one micro-step, `loads` `[layers][experts]` (C order). `resident` (may be null) is the placement left
  /// by the previous micro-step. Two-level planning without owners set plans them from `loads`; `eplb` without
  /// history uses the static placement.
  [[nodiscard]] std::vector<LayerPlan> plan(std::span<const std::int64_t> loads, Stage stage = Stage::update,
                                            const Placement *resident = nullptr) {
    check_layer_loads(loads, "plan");
    if (resident != nullptr)
      detail::require(resident->num_layers() == num_layers_, "plan: resident placement has ", resident->num_layers(),
                      " layers, expected ", num_layers_);
    const Strategy s = opts_.strategy;
    const bool two_level = s == Strategy::foremoe && opts_.mode == PlanMode::two_level;
    const bool free = (s == Strategy::foremoe && opts_.mode == PlanMode::free) || s == Strategy::foremoe_free;
    // Free mode takes the two-level plan with these owners as one of its candidates, so it is never worse.
    if ((two_level || free) && owners_.empty()) owners_ = plan_owners(loads);
    if (s == Strategy::static_placement && owners_.empty()) owners_ = static_owners();
    if (s == Strategy::eplb_oracle && eplb_.empty()) eplb_ = run_eplb(loads);
    std::vector<LayerPlan> out(static_cast<std::size_t>(num_layers_));
    const int num_threads = std::min(opts_.num_threads, num_layers_);
    while (static_cast<int>(workers_.size()) < num_threads)
      workers_.emplace_back(topo_, num_experts_);
    ReplicaOptions ropts;
    ropts.move_budget = opts_.move_budget;
    ropts.local_search_rounds = opts_.local_search_rounds;
    ropts.free_search_rounds = opts_.free_search_rounds;
    ropts.exact_split = opts_.exact_split;
    if (opts_.replica_cost && opts_.token_time) {
      ropts.replica_cost = [f = opts_.replica_cost, stage](int e, int src, int dst) { return f(e, src, dst, stage); };
      ropts.token_time = opts_.token_time;
    }
    auto run = [&](int worker, int l) {
      ReplicaPlanner &rp = workers_[worker];
      const auto layer_loads = loads.subspan(static_cast<std::size_t>(l) * num_experts_, num_experts_);
      const LayerPlacement *res = resident != nullptr ? &resident->layer(l) : nullptr;
      switch (s) {
      case Strategy::static_placement:
        out[l] = rp.plan_from_placement(static_placement(l), layer_loads, owners_[l], res);
        break;
      case Strategy::eplb:
      case Strategy::eplb_oracle:
        if (eplb_.empty())
          out[l] = rp.plan_from_placement(static_placement(l), layer_loads, static_owner_row(), res);
        else
          out[l] = eplb_to_layer_plan(eplb_[l], layer_loads, topo_, res);
        break;
      case Strategy::foremoe:
      case Strategy::foremoe_free:
        if (two_level)
          out[l] = rp.plan_two_level(layer_loads, owners_[l], res, ropts);
        else
          out[l] = rp.plan_free(layer_loads, res, ropts, owners_[l]);
        break;
      }
    };
    if (num_threads == 1) {
      for (int l = 0; l < num_layers_; ++l)
        run(0, l);
      return out;
    }
    // Layers are independent and each is planned by one worker alone, so the result does not depend on the count.
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(num_threads));
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(num_threads));
    for (int t = 0; t < num_threads; ++t)
      threads.emplace_back([&, t] {
        try {
          for (int l = t; l < num_layers_; l += num_threads)
            run(t, l);
        } catch (...) {
          errors[t] = std::current_exception();
        }
      });
    for (auto &th : threads)
      th.join();
    for (auto &err : errors)
      if (err) std::rethrow_exception(err);
    return out;
  }

  /// Plans micro-step `micro_step` of `loads`.
  [[nodiscard]] std::vector<LayerPlan> plan(const LoadTensor &loads, int micro_step, Stage stage = Stage::update,
                                            const Placement *resident = nullptr) {
    check_tensor(loads, "plan");
    detail::require(micro_step >= 0 && micro_step < loads.num_micro_steps(), "plan: micro-step ", micro_step,
                    " outside [0, ", loads.num_micro_steps(), ")");
    return plan(step_span(loads, micro_step), stage, resident);
  }

  /// Plans every micro-step of one RL step: step-level state from their sum (and `previous_step_totals` for
  /// `eplb`), then each micro-step in order with the previous one's placement as resident (the first one starts
  /// from `resident`, which may be null).
  [[nodiscard]] StepPlan plan_step(const LoadTensor &micro_steps, const Placement *resident = nullptr,
                                   std::span<const std::int64_t> previous_step_totals = {},
                                   Stage stage = Stage::update) {
    check_tensor(micro_steps, "plan_step");
    const auto start = std::chrono::steady_clock::now();
    const auto totals = sum_steps(micro_steps);
    begin_step(totals, previous_step_totals);
    StepPlan sp;
    sp.owner_gpu = owners_;
    Placement prev;
    for (int m = 0; m < micro_steps.num_micro_steps(); ++m) {
      sp.micro_steps.push_back(plan(step_span(micro_steps, m), stage, m == 0 ? resident : &prev));
      prev = to_placement(sp.micro_steps.back());
    }
    if (opts_.strategy == Strategy::foremoe_free || opts_.strategy == Strategy::eplb ||
        opts_.strategy == Strategy::eplb_oracle ||
        (opts_.strategy == Strategy::foremoe && opts_.mode == PlanMode::free))
      if (!sp.micro_steps.empty()) {
        sp.owner_gpu.clear();
        for (const LayerPlan &lp : sp.micro_steps.front())
          sp.owner_gpu.push_back(lp.owner_gpu);
      }
    sp.planner_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return sp;
  }

  /// Sum over micro-steps: `[layers][experts]`.
  [[nodiscard]] std::vector<std::int64_t> sum_steps(const LoadTensor &t) const {
    check_tensor(t, "sum_steps");
    std::vector<std::int64_t> out(static_cast<std::size_t>(num_layers_) * num_experts_, 0);
    const auto v = t.totals();
    for (std::size_t i = 0; i < v.size(); ++i)
      out[i % out.size()] += v[i];
    return out;
  }

private:
  void check_layer_loads(std::span<const std::int64_t> loads, const char *who) const {
    detail::require(loads.size() == static_cast<std::size_t>(num_layers_) * num_experts_, who, ": ", loads.size(),
                    " loads, expected ", num_layers_, " layers x ", num_experts_, " experts");
    for (std::size_t i = 0; i < loads.size(); ++i)
      detail::require(loads[i] >= 0, who, ": negative load ", loads[i], " at layer ", i / num_experts_, ", expert ",
                      i % num_experts_);
  }
  void check_tensor(const LoadTensor &t, const char *who) const {
    detail::require(t.num_layers() == num_layers_ && t.num_experts() == num_experts_, who, ": load tensor is [",
                    t.num_micro_steps(), ", ", t.num_layers(), ", ", t.num_experts(), "], planner expects [*, ",
                    num_layers_, ", ", num_experts_, "]");
  }
  [[nodiscard]] std::span<const std::int64_t> step_span(const LoadTensor &t, int m) const {
    return t.totals().subspan(static_cast<std::size_t>(m) * num_layers_ * num_experts_,
                              static_cast<std::size_t>(num_layers_) * num_experts_);
  }
  [[nodiscard]] std::vector<std::int32_t> static_owner_row() const {
    const int per_gpu = topo_.owners_per_gpu(num_experts_);
    std::vector<std::int32_t> row(static_cast<std::size_t>(num_experts_));
    for (int e = 0; e < num_experts_; ++e)
      row[e] = e / per_gpu;
    return row;
  }
  [[nodiscard]] OwnerMap static_owners() const {
    return OwnerMap(static_cast<std::size_t>(num_layers_), static_owner_row());
  }
  [[nodiscard]] LayerPlacement static_placement(int) const {
    const int per_gpu = topo_.owners_per_gpu(num_experts_);
    LayerPlacement p(topo_.num_gpus(), topo_.slots_per_gpu, num_experts_);
    for (int e = 0; e < num_experts_; ++e)
      p.slot(e / per_gpu, e % per_gpu) = e;
    return p;
  }
  [[nodiscard]] std::vector<EplbLayer> run_eplb(std::span<const std::int64_t> totals) const {
    std::vector<double> w(totals.begin(), totals.end());
    return eplb_rebalance(w, num_layers_, num_experts_, opts_.eplb_num_groups, topo_);
  }

  int num_layers_, num_experts_;
  Topology topo_;
  PlannerOptions opts_;
  OwnerMap owners_;
  std::vector<EplbLayer> eplb_;
  std::vector<ReplicaPlanner> workers_;
};

} // namespace v0
} // namespace foremoe
