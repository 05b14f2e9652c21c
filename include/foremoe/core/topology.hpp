#pragma once
/// @file
/// The expert-parallel group: nodes x GPUs, expert slots per GPU. What a move costs on each link is not part of
/// the shape: it is `MoveParams` (`cost/move.hpp`), the one model the transfer planner and the simulator share.

#include <cmath>
#include <cstdint>

#include "foremoe/core/error.hpp"
#include "foremoe/core/limits.hpp"

namespace foremoe {
inline namespace v0 {

/// `num_nodes x gpus_per_node` GPUs forming one EP group; GPU `g` sits on node
/// `g / gpus_per_node`. Every GPU has `slots_per_gpu` expert slots per MoE layer.
struct Topology {
  int num_nodes = 1;
  int gpus_per_node = 8;
  int slots_per_gpu = 1;

  [[nodiscard]] int num_gpus() const noexcept { return num_nodes * gpus_per_node; }
  [[nodiscard]] int node_of(int gpu_idx) const noexcept { return gpu_idx / gpus_per_node; }
  [[nodiscard]] std::int64_t num_slots() const noexcept {
    return static_cast<std::int64_t>(num_gpus()) * slots_per_gpu;
  }
  /// Owner slots per GPU when `num_experts` owners are spread evenly (rounded up).
  [[nodiscard]] int owners_per_gpu(int num_experts) const noexcept {
    return (num_experts + num_gpus() - 1) / num_gpus();
  }
  /// Slots per GPU left for replicas once owners are placed evenly (may be 0).
  [[nodiscard]] int spare_slots_per_gpu(int num_experts) const noexcept {
    const int s = slots_per_gpu - owners_per_gpu(num_experts);
    return s > 0 ? s : 0;
  }

  /// Checks the shape alone: positive counts, no int overflow.
  void validate() const {
    detail::require(num_nodes > 0, "Topology: num_nodes must be positive, got ", num_nodes);
    detail::require(gpus_per_node > 0, "Topology: gpus_per_node must be positive, got ", gpus_per_node);
    detail::require(slots_per_gpu > 0, "Topology: slots_per_gpu must be positive, got ", slots_per_gpu);
    detail::require(static_cast<std::int64_t>(num_nodes) * gpus_per_node <= (1 << 20), "Topology: ", num_nodes, " x ",
                    gpus_per_node, " GPUs is beyond the supported 2^20");
    detail::require(slots_per_gpu <= (1 << 16), "Topology: slots_per_gpu ", slots_per_gpu,
                    " is beyond the supported 65536");
    limits::require_product("Topology", {{"slots", num_slots()}, {"GPUs", num_gpus()}}, limits::max_slot_gpu_work,
                            "(the planner's work per layer and micro-step)");
  }

  /// Also checks that every one of `num_experts` experts has room for its owner copy.
  void validate(int num_experts) const {
    validate();
    detail::require(num_experts > 0, "Topology: num_experts must be positive, got ", num_experts);
    detail::require(num_slots() >= num_experts, "Topology: ", num_gpus(), " GPUs x ", slots_per_gpu,
                    " slots = ", num_slots(), " slots cannot hold all ", num_experts, " experts");
  }
};

} // namespace v0
} // namespace foremoe
