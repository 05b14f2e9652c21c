#pragma once
/// @file
/// Expert-parallel groups: a cluster of GPUs split into groups of `ep_size` consecutive GPUs, each holding every
/// expert and routing its own tokens, so each group is planned on its own (the simulator runs one `Planner` per
/// group: `simulate` in sim/simulator.hpp).

#include "foremoe/core/error.hpp"
#include "foremoe/core/topology.hpp"

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

} // namespace v0
} // namespace foremoe
