#pragma once
/// @file
/// The planner: owners per RL step, replicas and token splits per micro-step, through the registered strategy
/// named in `PlannerOptions::strategy` (see `foremoe/plan/strategy.hpp`).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/limits.hpp"
#include "foremoe/core/load_tensor.hpp"
#include "foremoe/core/model_spec.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/core/thread_pool.hpp"
#include "foremoe/core/topology.hpp"
#include "foremoe/plan/held_gradients.hpp"
#include "foremoe/plan/owners.hpp"
#include "foremoe/plan/plan.hpp"
#include "foremoe/plan/planner_options.hpp"
#include "foremoe/plan/replicate.hpp"
#include "foremoe/plan/strategies/builtin.hpp"
#include "foremoe/plan/strategy.hpp"

namespace foremoe {
inline namespace v0 {

/// Plans owners per RL step and replicas plus token splits per micro-step. Not safe for concurrent calls on one
/// object (it keeps per-thread workspaces); use one planner per calling thread. Movable, not copyable (it owns
/// the strategy's step-level state).
class Planner {
public:
  using OwnerMap = foremoe::OwnerMap; ///< `[layers][experts]` owner GPU

  Planner(int num_layers, int num_experts, const Topology &topo, PlannerOptions opts = {})
      : num_layers_(num_layers), num_experts_(num_experts), topo_(topo), opts_(std::move(opts)),
        strategy_(find_strategy(opts_.strategy).make()) {
    opts_.strategy = find_strategy(opts_.strategy).name; // the registered spelling
    detail::require(num_layers > 0, "Planner: num_layers must be positive, got ", num_layers);
    topo.validate(num_experts);
    topo_.slots_per_gpu = strategy_->slots_per_gpu(topo, num_experts); // more for a strategy past the slot limit
    topo_.validate(num_experts);
    opts_.validate();
    detail::require(opts_.eplb_num_groups >= 1 && num_experts % opts_.eplb_num_groups == 0, "Planner: ", num_experts,
                    " experts do not divide into eplb_num_groups = ", opts_.eplb_num_groups);
  }
  Planner(const ModelSpec &spec, const Topology &topo, PlannerOptions opts = {})
      : Planner((spec.validate(), spec.num_layers), spec.num_experts, topo, std::move(opts)) {}

  [[nodiscard]] int num_layers() const noexcept { return num_layers_; }
  [[nodiscard]] int num_experts() const noexcept { return num_experts_; }
  /// The topology its plans use: the one given, with `PlanStrategy::slots_per_gpu` slots per GPU.
  [[nodiscard]] const Topology &topology() const noexcept { return topo_; }
  [[nodiscard]] const PlannerOptions &options() const noexcept { return opts_; }
  /// Whether the strategy keeps resident replicas without a move (false: every replica is re-pushed each
  /// micro-step and layer; see `PlanStrategy::reuses_resident`).
  [[nodiscard]] bool reuses_resident() const noexcept { return strategy_->reuses_resident(); }
  /// Whether the strategy stands for the physical limit (`PlanStrategy::physical_limit`, `ideal`).
  [[nodiscard]] bool physical_limit() const noexcept { return strategy_->physical_limit(); }

  /// Owners of every layer from step totals `[layers][experts]` (C order); `previous` (may be empty): owners to
  /// keep where the tolerance allows.
  [[nodiscard]] OwnerMap plan_owners(std::span<const std::int64_t> step_totals, const OwnerMap &previous = {}) const {
    check_layer_loads(step_totals, "plan_owners");
    return shape().plan_owners(step_totals, previous);
  }
  /// Owners from the sum of all micro-steps of `micro_steps`.
  [[nodiscard]] OwnerMap plan_owners(const LoadTensor &micro_steps) const {
    return plan_owners(sum_steps(micro_steps));
  }

  /// Fixes the step-level state through the strategy: owners from `step_totals` (two-level and free), the EPLB
  /// tables (`eplb`, `eplb-split`: from the window of the last `eplb_interval` steps handed as
  /// `previous_step_totals`, rebalanced after every `eplb_interval`-th hand-over, static placement before the first;
  /// from `step_totals` for `eplb-oracle`). Hand each finished step's totals once, on the next step's first call,
  /// and empty otherwise (see `PlanStrategy::begin_step`).
  void begin_step(std::span<const std::int64_t> step_totals, std::span<const std::int64_t> previous_step_totals = {}) {
    check_layer_loads(step_totals, "begin_step");
    strategy_->begin_step(shape(), step_totals, previous_step_totals, owners_);
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
  /// by the previous micro-step. Two-level planning without owners set plans them from `loads`; `eplb` before
  /// its first rebalance uses the static placement. `held` (may be null: none; read only in the update stage with
  /// `hold_replica_gradients`): the gradients the resident replicas hold from the stage's earlier micro-steps,
  /// which the tolerance's byte count does not charge again (see `HeldGradients::advance` to chain it).
  [[nodiscard]] std::vector<LayerPlan> plan(std::span<const std::int64_t> loads, Stage stage = Stage::update,
                                            const Placement *resident = nullptr, const HeldGradients *held = nullptr) {
    check_layer_loads(loads, "plan");
    if (resident != nullptr)
      detail::require(resident->num_layers() == num_layers_, "plan: resident placement has ", resident->num_layers(),
                      " layers, expected ", num_layers_);
    // Strategies that re-push every replica return every gradient every micro-step: nothing stays held.
    if (stage != Stage::update || !opts_.hold_replica_gradients || !strategy_->reuses_resident()) held = nullptr;
    if (held != nullptr)
      detail::require(held->num_layers() == num_layers_, "plan: held gradients of ", held->num_layers(),
                      " layers, expected ", num_layers_);
    const PlanShape sh = shape();
    strategy_->begin_micro_step(sh, loads, owners_);
    std::vector<LayerPlan> out(static_cast<std::size_t>(num_layers_));
    const int num_threads = std::min(opts_.num_threads, num_layers_);
    while (static_cast<int>(workers_.size()) < num_threads)
      workers_.emplace_back(topo_, num_experts_);
    ReplicaOptions ropts;
    ropts.move_budget = opts_.move_budget;
    ropts.local_search_rounds = opts_.local_search_rounds;
    ropts.free_search_rounds = opts_.free_search_rounds;
    ropts.exact_split = opts_.exact_split;
    ropts.tolerance = opts_.tolerance;
    ropts.min_tokens_per_replica = opts_.min_tokens_per_replica;
    ropts.gradient_weight = stage == Stage::update ? opts_.gradient_bytes_factor : 0.0;
    if (opts_.replica_cost && opts_.token_time) {
      ropts.replica_cost = [f = opts_.replica_cost, stage](int e, int src, int dst) { return f(e, src, dst, stage); };
      ropts.token_time = opts_.token_time;
    }
    const bool reuses_resident = strategy_->reuses_resident();
    auto run = [&](int worker, int l) {
      ReplicaPlanner &rp = workers_[worker];
      const auto layer_loads = loads.subspan(static_cast<std::size_t>(l) * num_experts_, num_experts_);
      const LayerPlacement *res = resident != nullptr ? &resident->layer(l) : nullptr;
      const LayerRequest req{sh,
                             l,
                             layer_loads,
                             res,
                             owners_.empty() ? std::span<const std::int32_t>{}
                                             : std::span<const std::int32_t>(owners_[l]),
                             ropts};
      if (held != nullptr && ropts.gradient_weight > 0 && ropts.tolerance > 0) {
        ReplicaOptions with_held = ropts;
        with_held.held_gradients = held->layer(l);
        out[l] = strategy_->plan_layer(
            LayerRequest{req.shape, req.layer, req.loads, req.resident, req.owners, with_held}, rp);
      } else {
        out[l] = strategy_->plan_layer(req, rp);
      }
      if (!reuses_resident)
        out[l].moves = full_push_moves(out[l].placement, out[l].owner_gpu, res, topo_.gpus_per_node);
    };
    // Layers are independent and each is planned by one worker alone, so the result does not depend on the count.
    lazy_pool(pool_, num_threads).parallel_for(static_cast<std::size_t>(num_layers_), [&](std::size_t l, int worker) {
      run(worker, static_cast<int>(l));
    });
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

  /// Plans every micro-step of one RL step: step-level state from their sum (and `previous_step_totals`, the
  /// previous step's totals handed once per step as `begin_step` takes them, for `eplb`), then each micro-step in
  /// order with the previous one's placement as resident (the first one starts
  /// from `resident`, which may be null).
  [[nodiscard]] StepPlan plan_step(const LoadTensor &micro_steps, const Placement *resident = nullptr,
                                   std::span<const std::int64_t> previous_step_totals = {},
                                   Stage stage = Stage::update) {
    check_tensor(micro_steps, "plan_step");
    const auto start = std::chrono::steady_clock::now();
    const auto totals = sum_steps(micro_steps);
    begin_step(totals, previous_step_totals);
    StepPlan sp = plan_micro_steps(micro_steps, resident, stage);
    if (strategy_->plans_own_owners() && !sp.micro_steps.empty()) {
      sp.owner_gpu.clear();
      for (const LayerPlan &lp : sp.micro_steps.front())
        sp.owner_gpu.push_back(lp.owner_gpu);
    }
    sp.planner_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return sp;
  }

  /// `plan_step` with the owners fixed to `owners` (`[layers][experts]` owner GPU, checked as `set_owners` checks
  /// them) instead of the strategy's step-level choice: for a trainer whose expert sharding is given (each rank's
  /// optimizer state is where it is). The micro-steps chain as in `plan_step`. `held` (may be null: none before
  /// the first micro-step): the gradients held before the first micro-step, updated in place to those held after
  /// the last, so that a stage planned a few micro-steps per call (a replay driver publishing each as soon as it is
  /// planned) gets the plans of one call over all of them.
  [[nodiscard]] StepPlan plan_step_with_owners(const LoadTensor &micro_steps, OwnerMap owners,
                                               const Placement *resident = nullptr, Stage stage = Stage::update,
                                               HeldGradients *held = nullptr) {
    check_tensor(micro_steps, "plan_step_with_owners");
    const auto start = std::chrono::steady_clock::now();
    set_owners(std::move(owners));
    StepPlan sp = plan_micro_steps(micro_steps, resident, stage, held);
    sp.planner_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return sp;
  }

  /// Sum over micro-steps: `[layers][experts]`.
  [[nodiscard]] std::vector<std::int64_t> sum_steps(const LoadTensor &t) const {
    check_tensor(t, "sum_steps");
    std::vector<std::int64_t> out(static_cast<std::size_t>(num_layers_) * num_experts_, 0);
    const auto v = t.totals();
    for (std::size_t i = 0; i < v.size(); ++i) {
      std::int64_t &o = out[i % out.size()];
      if (v[i] < 0 || v[i] > limits::max_load_total - o) [[unlikely]]
        detail::fail("sum_steps: ",
                     v[i] < 0 ? "negative load " : "a load summing past the supported total over the micro-steps: ",
                     v[i], " at micro-step ", i / out.size(), ", layer ", (i % out.size()) / num_experts_, ", expert ",
                     i % num_experts_);
      o += v[i];
    }
    return out;
  }

private:
  /// Every micro-step in order under the current owners, each from the previous one's placement (the first from
  /// `resident`, which may be null). In the update stage with `hold_replica_gradients` the held gradients chain too
  /// (none at the start: the stage before returned them all).
  [[nodiscard]] StepPlan plan_micro_steps(const LoadTensor &micro_steps, const Placement *resident, Stage stage,
                                          HeldGradients *chain = nullptr) {
    StepPlan sp;
    sp.owner_gpu = owners_;
    Placement prev;
    const bool hold = stage == Stage::update && opts_.hold_replica_gradients && strategy_->reuses_resident();
    if (chain != nullptr)
      detail::require(chain->num_layers() == num_layers_ && chain->num_gpus() == topo_.num_gpus() &&
                          chain->num_experts() == num_experts_,
                      "plan: held gradients are [", chain->num_layers(), ", ", chain->num_gpus(), ", ",
                      chain->num_experts(), "], expected [layers, GPUs, experts] = [", num_layers_, ", ",
                      topo_.num_gpus(), ", ", num_experts_, "]");
    HeldGradients local =
        hold && chain == nullptr ? HeldGradients(num_layers_, topo_.num_gpus(), num_experts_) : HeldGradients{};
    HeldGradients &held = chain != nullptr ? *chain : local;
    for (int m = 0; m < micro_steps.num_micro_steps(); ++m) {
      sp.micro_steps.push_back(
          plan(step_span(micro_steps, m), stage, m == 0 ? resident : &prev, hold ? &held : nullptr));
      prev = to_placement(sp.micro_steps.back());
      if (hold)
        for (int l = 0; l < num_layers_; ++l)
          (void)held.advance(l, sp.micro_steps.back()[l], true);
    }
    return sp;
  }
  [[nodiscard]] PlanShape shape() const noexcept { return PlanShape{num_layers_, num_experts_, topo_, opts_}; }
  void check_layer_loads(std::span<const std::int64_t> loads, const char *who) const {
    shape().check_layer_loads(loads, who);
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
  int num_layers_, num_experts_;
  Topology topo_;
  PlannerOptions opts_;
  std::unique_ptr<PlanStrategy> strategy_;
  OwnerMap owners_;
  std::vector<ReplicaPlanner> workers_;
  // The planner owns its pool rather than sharing a process-wide one: `num_threads` is this planner's own knob,
  // the threads start on the first parallel micro-step and are reused by every later one, and they end with the
  // planner, so a vendored header starts no threads nobody asked for and planners on different threads never
  // queue behind each other.
  std::unique_ptr<ThreadPool> pool_;
};

} // namespace v0
} // namespace foremoe
