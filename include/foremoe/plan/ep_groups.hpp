#pragma once
/// @file
/// Expert-parallel groups: a cluster of GPUs split into groups of `ep_size` consecutive GPUs, each holding every
/// expert and routing its own tokens, so each group is planned on its own (and groups in parallel).

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/core/thread_pool.hpp"
#include "foremoe/core/topology.hpp"
#include "foremoe/plan/plan.hpp"
#include "foremoe/plan/planner.hpp"

namespace foremoe {
inline namespace v0 {

/// The default EP group size, the one place it is defined: every GPU when they do not outnumber the experts,
/// else the largest divisor of the GPU count not above the expert count (each group then holds every expert).
[[nodiscard]] inline int default_ep_size(int num_gpus, int num_experts) {
  detail::require(num_gpus > 0 && num_experts > 0, "default_ep_size: ", num_gpus, " GPUs and ", num_experts,
                  " experts must be positive");
  if (num_gpus <= num_experts) return num_gpus;
  for (int d = num_experts; d > 1; --d)
    if (num_gpus % d == 0) return d;
  return 1;
}

/// The topology of one EP group of `ep_size` GPUs of `topo` (whole nodes, or part of one node).
[[nodiscard]] inline Topology ep_group_topology(const Topology &topo, int ep_size) {
  const int gpn = topo.gpus_per_node;
  detail::require(ep_size > 0 && topo.num_gpus() % ep_size == 0, "EP group size ", ep_size, " does not divide ",
                  topo.num_gpus(), " GPUs");
  detail::require(ep_size % gpn == 0 || gpn % ep_size == 0, "EP group size ", ep_size,
                  " must be whole nodes or divide a node of ", gpn, " GPUs");
  Topology g = topo;
  g.num_nodes = ep_size >= gpn ? ep_size / gpn : 1;
  g.gpus_per_node = ep_size >= gpn ? gpn : ep_size;
  return g;
}

/// One `Planner` per EP group (`ep_size <= 0`: `default_ep_size`), each with its own owners and loads; a micro-step
/// plans every group, groups in parallel over `PlannerOptions::num_threads` (each group's planner then runs on one
/// thread; with one group the threads go to its layers). Plans do not depend on the thread count.
class GroupedPlanner {
public:
  GroupedPlanner(int num_layers, int num_experts, const Topology &topo, PlannerOptions opts = {}, int ep_size = 0)
      : num_threads_(opts.num_threads) {
    const int ep = ep_size > 0 ? ep_size : default_ep_size(topo.num_gpus(), num_experts);
    const Topology group = ep_group_topology(topo, ep);
    const int num_groups = topo.num_gpus() / ep;
    if (num_groups > 1) opts.num_threads = 1;
    groups_.reserve(static_cast<std::size_t>(num_groups));
    for (int i = 0; i < num_groups; ++i)
      groups_.emplace_back(num_layers, num_experts, group, opts);
  }

  [[nodiscard]] int num_groups() const noexcept { return static_cast<int>(groups_.size()); }
  [[nodiscard]] Planner &group(int i) { return groups_.at(static_cast<std::size_t>(i)); }

  /// Step-level state of every group from its own step totals (`[groups]` of `[layers][experts]`).
  void begin_step(std::span<const std::vector<std::int64_t>> step_totals) {
    check_groups(step_totals.size(), "begin_step");
    for_groups([&](int i) { groups_[i].begin_step(step_totals[i]); });
  }

  /// Plans one micro-step of every group: `loads[i]` and `resident[i]` (null, or one per group) as `Planner::plan`.
  [[nodiscard]] std::vector<std::vector<LayerPlan>> plan(std::span<const std::vector<std::int64_t>> loads,
                                                         Stage stage = Stage::update,
                                                         std::span<const Placement *const> resident = {}) {
    check_groups(loads.size(), "plan");
    detail::require(resident.empty() || resident.size() == groups_.size(), "GroupedPlanner::plan: ", resident.size(),
                    " resident placements for ", groups_.size(), " groups");
    std::vector<std::vector<LayerPlan>> out(groups_.size());
    for_groups([&](int i) { out[i] = groups_[i].plan(loads[i], stage, resident.empty() ? nullptr : resident[i]); });
    return out;
  }

private:
  void check_groups(std::size_t n, const char *who) const {
    detail::require(n == groups_.size(), "GroupedPlanner::", who, ": ", n, " groups of loads for ", groups_.size(),
                    " EP groups");
  }
  template <class F> void for_groups(F &&f) {
    const int n = num_groups(), threads = std::min(num_threads_, n);
    lazy_pool(pool_, threads).parallel_for(static_cast<std::size_t>(n), [&](std::size_t i, int) {
      f(static_cast<int>(i));
    });
  }

  int num_threads_ = 1;
  std::vector<Planner> groups_;
  // Its own pool, as `Planner`'s: with several groups each group's planner runs on one thread (no pool of its
  // own), so the threads are these, started once and reused by every micro-step.
  std::unique_ptr<ThreadPool> pool_;
};

} // namespace v0
} // namespace foremoe
