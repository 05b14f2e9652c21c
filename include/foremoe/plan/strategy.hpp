#pragma once
/// @file
/// Planning strategies are a registry: each one is a file in `foremoe/plan/strategies/` that registers a
/// `StrategyInfo` (name, help, options, factory) when included; `Planner` plans through whichever is named in
/// `PlannerOptions::strategy` and lists none by hand.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/limits.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/core/topology.hpp"
#include "foremoe/plan/detail/layer_checks.hpp"
#include "foremoe/plan/owners.hpp"
#include "foremoe/plan/plan.hpp"
#include "foremoe/plan/planner_options.hpp"
#include "foremoe/plan/replicate.hpp"

namespace foremoe {
inline namespace v0 {

using OwnerMap = std::vector<std::vector<std::int32_t>>; ///< `[layers][experts]` owner GPU

/// What a strategy plans for: the planner's shape and options, with the step-level helpers strategies share.
struct PlanShape {
  int num_layers = 0, num_experts = 0;
  const Topology &topo;
  const PlannerOptions &opts;

  /// Throws `Error` naming `who` unless `loads` is `[layers][experts]` of non-negative counts.
  void check_layer_loads(std::span<const std::int64_t> loads, const char *who) const {
    detail::require(loads.size() == static_cast<std::size_t>(num_layers) * num_experts, who, ": ", loads.size(),
                    " loads, expected ", num_layers, " layers x ", num_experts, " experts");
    const std::ptrdiff_t i = detail::first_negative(loads);
    detail::require(i < 0, who, ": negative load ", i < 0 ? 0 : loads[i], " at layer ", i / num_experts, ", expert ",
                    i % num_experts);
    for (int l = 0; l < num_layers; ++l) {
      std::int64_t s = 0;
      for (int e = 0; e < num_experts; ++e) {
        const std::int64_t v = loads[static_cast<std::size_t>(l) * num_experts + e];
        if (v > limits::max_load_total - s) [[unlikely]]
          detail::fail(who, ": the loads of layer ", l, " sum past ", limits::limit_text(limits::max_load_total),
                       " (by expert ", e, ", load ", v, "); the planner's sums must stay within int64");
        s += v;
      }
    }
  }
  /// Owners of every layer from step totals `[layers][experts]`, keeping `previous` (may be empty) where the
  /// options' tolerance allows.
  [[nodiscard]] OwnerMap plan_owners(std::span<const std::int64_t> step_totals, const OwnerMap &previous = {}) const {
    OwnerOptions o;
    o.hierarchical = opts.hierarchical_owners;
    o.keep_tolerance = opts.owner_keep_tolerance;
    return foremoe::plan_owners(step_totals, num_layers, num_experts, topo, o, previous);
  }
  /// Contiguous owners: expert `e` on GPU `e / owners_per_gpu` (Megatron-style EP), one layer.
  [[nodiscard]] std::vector<std::int32_t> static_owner_row() const {
    const int per_gpu = topo.owners_per_gpu(num_experts);
    std::vector<std::int32_t> row(static_cast<std::size_t>(num_experts));
    for (int e = 0; e < num_experts; ++e)
      row[e] = e / per_gpu;
    return row;
  }
  /// `static_owner_row()` for every layer.
  [[nodiscard]] OwnerMap static_owners() const {
    return OwnerMap(static_cast<std::size_t>(num_layers), static_owner_row());
  }
  /// The placement of `static_owner_row()`, no replicas.
  [[nodiscard]] LayerPlacement static_placement() const {
    const int per_gpu = topo.owners_per_gpu(num_experts);
    LayerPlacement p(topo.num_gpus(), topo.slots_per_gpu, num_experts);
    for (int e = 0; e < num_experts; ++e)
      p.slot(e / per_gpu, e % per_gpu) = e;
    return p;
  }
};

/// One layer to plan.
struct LayerRequest {
  const PlanShape &shape;
  int layer = 0;
  std::span<const std::int64_t> loads;      ///< `[experts]`
  const LayerPlacement *resident = nullptr; ///< the previous micro-step's placement of the layer, or null
  std::span<const std::int32_t> owners;     ///< the step's owners of the layer (empty when none are set)
  const ReplicaOptions &replica;            ///< replica options of the planner's options for this stage
};

/// A strategy's per-planner object: step-level state plus the per-layer plan. `Planner` makes one per planner.
class PlanStrategy {
public:
  PlanStrategy() = default;
  PlanStrategy(const PlanStrategy &) = default;
  PlanStrategy &operator=(const PlanStrategy &) = default;
  virtual ~PlanStrategy() = default;

  /// Fixes the step-level state from the step's totals and the previous step's, and may set the planner's `owners`
  /// (the ones `Planner::owners()` shows and `LayerRequest::owners` hands back). The contract on
  /// `previous_step_totals` (`[layers][experts]`, unchecked: a strategy that reads it checks it): the caller hands
  /// each finished RL step's totals once, to the first `begin_step` of the step after it, and empty otherwise: on
  /// the first step, and on further `begin_step`s of the same step (a stage planned again, e.g. the update after a
  /// recompute). A strategy that keeps a load history (`eplb`, `eplb-split`: the window of
  /// `PlannerOptions::eplb_interval` steps) counts each non-empty hand-over as one step and keeps its state across
  /// empty ones.
  virtual void begin_step(const PlanShape &shape, std::span<const std::int64_t> step_totals,
                          std::span<const std::int64_t> previous_step_totals, OwnerMap &owners) = 0;
  /// Before the layers of one micro-step: the step-level state `begin_step` did not set (plans of single
  /// micro-steps without one), from this micro-step's loads.
  virtual void begin_micro_step(const PlanShape & /*shape*/, std::span<const std::int64_t> /*loads*/,
                                OwnerMap & /*owners*/) {}
  /// One layer's plan. Called for different layers at once (one thread and workspace each), so it reads the
  /// strategy's state only.
  [[nodiscard]] virtual LayerPlan plan_layer(const LayerRequest &req, ReplicaPlanner &workspace) const = 0;
  /// Whether each micro-step's plans choose their own owners; `Planner::plan_step` then reports the first
  /// micro-step's instead of the step's owner map.
  [[nodiscard]] virtual bool plans_own_owners() const noexcept { return false; }
  /// Whether a replica already resident in its slot stays without a move. Strategies that answer false re-push
  /// every replica's weights each micro-step and layer (the published per-micro-batch baselines, UltraEP and MoonEP,
  /// run so): `Planner` then replaces each plan's moves with `full_push_moves`, so `foremoe plan`'s move counts and
  /// the simulator's move traffic and stalls charge a full push even where the same replica was resident.
  [[nodiscard]] virtual bool reuses_resident() const noexcept { return true; }
  /// Slots per GPU its plans use on `topo` for `num_experts` experts: `topo.slots_per_gpu`, or more for a strategy
  /// that ignores the slot limit (`ideal`); `Planner::topology()` is the topology with this many.
  [[nodiscard]] virtual int slots_per_gpu(const Topology &topo, int /*num_experts*/) const noexcept {
    return topo.slots_per_gpu;
  }
  /// Whether the strategy stands for the physical limit (`ideal`), which the simulator keeps a lower bound on every
  /// strategy: its plans (placement, owners, token split, memory, routes) are used as every plan is, its moves are
  /// listed as every plan's are, but the simulator charges none of its transfers (moves, gradient returns,
  /// re-owning), times a GPU's expert compute and all-to-all from its token count alone (its tokens over
  /// `ceil(E / G)` experts, its rows spread over all `E`) and counts `ceil(E / G)` owned experts per GPU in its
  /// memory: the least any placement with those tokens takes, where the plan itself needs a piece more on some
  /// GPUs (see `docs/simulator.md`, "ideal").
  [[nodiscard]] virtual bool physical_limit() const noexcept { return false; }
};

/// One planning strategy as registered.
struct StrategyInfo {
  std::string name;                 ///< as on the command line, e.g. "foremoe-free"
  std::string help;                 ///< one line for --help and `--strategy list`
  std::vector<std::string> options; ///< names of the PlannerOptions fields it reads besides `num_threads`
                                    ///< (schema keys, snake_case, e.g. "move_budget"); the front ends show them
  int order = 100;                  ///< listing order (built-ins 10, 20, ...), ties by name
  std::function<std::unique_ptr<PlanStrategy>()> make; ///< a fresh per-planner object
  /// A reference for `foremoe simulate` only (`ideal`): left out of `strategies()` and `strategy_names()` (so out
  /// of `foremoe plan`, the planner schema and Python's list) unless asked for; `find_strategy` still finds it.
  bool simulator_only = false;
};

namespace detail {

struct StrategyRegistry {
  std::mutex mutex;
  std::vector<std::unique_ptr<StrategyInfo>> entries; ///< sorted by (order, name); entries never move
};
/// Function-local, so registration from any translation unit's static initialisers finds it constructed.
inline StrategyRegistry &strategy_registry() {
  static StrategyRegistry r;
  return r;
}
/// `_` reads as `-`, so "eplb_oracle" and "foremoe_free" (schema-style spellings) name the same strategies.
[[nodiscard]] inline std::string normalized_strategy_name(std::string_view s) {
  std::string out(s);
  std::replace(out.begin(), out.end(), '_', '-');
  return out;
}
[[nodiscard]] inline std::string strategy_names_locked(const StrategyRegistry &r, std::string_view sep,
                                                       bool with_simulator_only) {
  std::string out;
  for (const auto &e : r.entries) {
    if (e->simulator_only && !with_simulator_only) continue;
    if (!out.empty()) out += sep;
    out += e->name;
  }
  return out;
}

} // namespace detail

/// Adds a strategy; throws `Error` on an empty or duplicate name, a name with characters other than `a-z`,
/// `0-9` and `-`, or no factory.
inline void register_strategy(StrategyInfo info) {
  detail::require(!info.name.empty(), "register_strategy: empty strategy name");
  for (char c : info.name)
    detail::require((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-', "register_strategy: strategy name '",
                    info.name, "' may hold only a-z, 0-9 and '-'");
  detail::require(static_cast<bool>(info.make), "register_strategy: strategy '", info.name, "' has no factory");
  auto &r = detail::strategy_registry();
  const std::lock_guard lock(r.mutex);
  for (const auto &e : r.entries)
    detail::require(e->name != info.name, "register_strategy: strategy '", info.name, "' is already registered");
  auto entry = std::make_unique<StrategyInfo>(std::move(info));
  const auto pos = std::find_if(r.entries.begin(), r.entries.end(), [&](const auto &e) {
    return std::tie(entry->order, entry->name) < std::tie(e->order, e->name);
  });
  r.entries.insert(pos, std::move(entry));
}

/// Every registered strategy, sorted by (order, name); the simulator-only ones (`StrategyInfo::simulator_only`)
/// only `with_simulator_only`.
[[nodiscard]] inline std::vector<const StrategyInfo *> strategies(bool with_simulator_only = false) {
  auto &r = detail::strategy_registry();
  const std::lock_guard lock(r.mutex);
  std::vector<const StrategyInfo *> out;
  out.reserve(r.entries.size());
  for (const auto &e : r.entries)
    if (!e->simulator_only || with_simulator_only) out.push_back(e.get());
  return out;
}

/// The registered strategy named `name` (`_` reads as `-`), or null.
[[nodiscard]] inline const StrategyInfo *lookup_strategy(std::string_view name) {
  const std::string n = detail::normalized_strategy_name(name);
  auto &r = detail::strategy_registry();
  const std::lock_guard lock(r.mutex);
  for (const auto &e : r.entries)
    if (e->name == n) return e.get();
  return nullptr;
}

/// The registered strategy named `name` (`_` reads as `-`); throws `Error` naming the value and the registered
/// names when there is none.
[[nodiscard]] inline const StrategyInfo &find_strategy(std::string_view name) {
  if (const StrategyInfo *s = lookup_strategy(name)) return *s;
  auto &r = detail::strategy_registry();
  const std::lock_guard lock(r.mutex);
  detail::fail("unknown strategy '", name, "' (registered: ", detail::strategy_names_locked(r, ", ", true), ")");
}

/// `find_strategy` for a plan a user asks for (`foremoe plan`, the planner schema, Python): throws `Error` naming the
/// value for a simulator-only strategy too.
[[nodiscard]] inline const StrategyInfo &find_plan_strategy(std::string_view name) {
  const StrategyInfo *s = lookup_strategy(name);
  if (s != nullptr && !s->simulator_only) return *s;
  auto &r = detail::strategy_registry();
  const std::lock_guard lock(r.mutex);
  if (s == nullptr)
    detail::fail("unknown strategy '", name, "' (registered: ", detail::strategy_names_locked(r, ", ", false), ")");
  detail::fail("strategy '", name, "' is a reference for foremoe simulate only, not a plan (plan strategies: ",
               detail::strategy_names_locked(r, ", ", false), ")");
}

/// The registered names in listing order, joined by `sep`; the simulator-only ones only `with_simulator_only`.
[[nodiscard]] inline std::string strategy_names(std::string_view sep = ", ", bool with_simulator_only = false) {
  auto &r = detail::strategy_registry();
  const std::lock_guard lock(r.mutex);
  return detail::strategy_names_locked(r, sep, with_simulator_only);
}

} // namespace v0
} // namespace foremoe
