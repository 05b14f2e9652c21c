#pragma once
/// @file
/// Not API: input checks and small placement helpers the replica constructions share.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/core/topology.hpp"

namespace foremoe {
inline namespace v0 {
namespace detail {

/// Index of the first negative count in `loads`, or -1. A branch-free scan for any sign bit runs first (it
/// vectorizes), so the search for the index runs only when one is set.
[[nodiscard]] inline std::ptrdiff_t first_negative(std::span<const std::int64_t> loads) noexcept {
  std::uint64_t sign = 0;
  for (const std::int64_t x : loads)
    sign |= static_cast<std::uint64_t>(x);
  if (sign >> 63 == 0) return -1;
  for (std::size_t i = 0; i < loads.size(); ++i)
    if (loads[i] < 0) return static_cast<std::ptrdiff_t>(i);
  return -1;
}

/// Throws `Error` naming `who` unless `loads` holds one non-negative count per expert.
inline void check_expert_loads(std::span<const std::int64_t> loads, int num_experts, const char *who) {
  detail::require(static_cast<int>(loads.size()) == num_experts, who, ": ", loads.size(), " loads for ", num_experts,
                  " experts");
  const std::ptrdiff_t e = first_negative(loads);
  detail::require(e < 0, who, ": expert ", e, " has a negative load ", e < 0 ? 0 : loads[e]);
}

/// Throws `Error` naming `who` unless `resident` (may be null) has the topology's shape.
inline void check_resident_shape(const LayerPlacement *resident, const Topology &topo, int num_experts,
                                 const char *who) {
  if (resident == nullptr) return;
  const int num_gpus = topo.num_gpus(), slots = topo.slots_per_gpu;
  detail::require(
      resident->num_gpus() == num_gpus && resident->slots_per_gpu() == slots && resident->num_experts() == num_experts,
      who, ": resident placement is ", resident->num_gpus(), " GPUs x ", resident->slots_per_gpu(), " slots x ",
      resident->num_experts(), " experts, the topology is ", num_gpus, " x ", slots, " x ", num_experts);
}

/// Whether `r` is a valid placement (ids in range, no duplicate on a GPU, every expert hosted).
[[nodiscard]] inline bool hosts_all_experts(const LayerPlacement &r) {
  try {
    r.validate();
  } catch (const Error &) {
    return false;
  }
  return true;
}

/// `out[e]`: the GPU of the first copy of `e` in `p`, or -1.
inline void first_copy_owners(const LayerPlacement &p, std::vector<std::int32_t> &out) {
  const int slots = p.slots_per_gpu();
  out.assign(static_cast<std::size_t>(p.num_experts()), -1);
  for (int q = 0; q < p.num_slots(); ++q)
    if (const std::int32_t e = p.phys_to_log()[q]; e != empty_slot && out[e] < 0) out[e] = q / slots;
}

} // namespace detail
} // namespace v0
} // namespace foremoe
