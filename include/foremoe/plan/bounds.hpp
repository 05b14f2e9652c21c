#pragma once
/// @file
/// Lower bounds on a layer's maximum GPU load, for any plan of the given mode.

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/core/topology.hpp"

namespace foremoe {
inline namespace v0 {

/// `ceil(total / num_gpus)`: no plan beats a perfect split.
[[nodiscard]] inline std::int64_t lower_bound_total(std::span<const std::int64_t> loads, int num_gpus) {
  detail::require(num_gpus > 0, "lower_bound_total: num_gpus must be positive, got ", num_gpus);
  std::int64_t total = 0;
  for (std::int64_t v : loads)
    total += v;
  return (total + num_gpus - 1) / num_gpus;
}

/// Free mode: the total bound and, per expert, its load over the most copies it can have (one per GPU, and no
/// more than the slots left once every other expert has one).
[[nodiscard]] inline std::int64_t lower_bound_free(std::span<const std::int64_t> loads, const Topology &topo) {
  const auto num_experts = static_cast<std::int64_t>(loads.size());
  const std::int64_t max_copies =
      std::max<std::int64_t>(1, std::min<std::int64_t>(topo.num_gpus(), topo.num_slots() - num_experts + 1));
  std::int64_t lb = lower_bound_total(loads, topo.num_gpus());
  for (std::int64_t v : loads)
    lb = std::max(lb, (v + max_copies - 1) / max_copies);
  return lb;
}

/// Two-level mode with fixed owners: the total bound; per expert, its load over 1 + the GPUs that may take a
/// replica of it (a spare slot and budget, or the replica already resident); per GPU, the experts it owns that
/// cannot all get a replica elsewhere (at most one per usable spare slot of the other GPUs) stay whole on it.
/// Scratch vectors of `lower_bound_two_level`, reusable across calls.
struct TwoLevelBoundWorkspace {
  std::vector<int> owned, usable, resident_hosts, off, fill;
  std::vector<std::int64_t> grouped;
};

/// As below, with caller-owned scratch (no allocation once warm).
[[nodiscard]] inline std::int64_t lower_bound_two_level(std::span<const std::int64_t> loads,
                                                        std::span<const std::int32_t> owner_gpu, const Topology &topo,
                                                        int move_budget, const LayerPlacement *resident,
                                                        TwoLevelBoundWorkspace &ws) {
  const int num_gpus = topo.num_gpus(), num_experts = static_cast<int>(loads.size());
  detail::require(static_cast<int>(owner_gpu.size()) == num_experts, "lower_bound_two_level: ", owner_gpu.size(),
                  " owners for ", num_experts, " experts");
  std::vector<int> &owned = ws.owned;
  owned.assign(static_cast<std::size_t>(num_gpus), 0);
  // A branch-free range check first (it vectorizes); the naming loop runs only when some owner is out of range.
  std::uint32_t out_of_range = 0;
  for (std::int32_t o : owner_gpu)
    out_of_range |= static_cast<std::uint32_t>(o) >= static_cast<std::uint32_t>(num_gpus);
  if (out_of_range != 0) [[unlikely]]
    for (std::int32_t o : owner_gpu)
      detail::require(o >= 0 && o < num_gpus, "lower_bound_two_level: owner GPU ", o, " outside [0, ", num_gpus, ")");
  for (std::int32_t o : owner_gpu)
    ++owned[o];
  // Usable spare slots per GPU: any spare with budget left; with a zero budget only resident replicas count.
  std::vector<int> &usable = ws.usable;
  usable.assign(static_cast<std::size_t>(num_gpus), 0);
  std::int64_t total_usable = 0;
  for (int g = 0; g < num_gpus; ++g) {
    const int spare = std::max(0, topo.slots_per_gpu - owned[g]);
    usable[g] = move_budget < 0 ? spare : std::min(spare, move_budget);
    if (resident != nullptr && usable[g] < spare) {
      int kept = 0;
      for (std::int32_t e : resident->gpu_slots(g))
        if (e >= 0 && e < num_experts && owner_gpu[e] != g) ++kept;
      usable[g] = std::min(spare, usable[g] + kept);
    }
    total_usable += usable[g];
  }
  std::int64_t lb = lower_bound_total(loads, num_gpus);
  int open = 0;
  for (int g = 0; g < num_gpus; ++g)
    open += topo.slots_per_gpu > owned[g];
  // With a zero budget only resident replicas can host a second copy.
  std::vector<int> &resident_hosts = ws.resident_hosts;
  if (move_budget == 0) {
    resident_hosts.assign(static_cast<std::size_t>(num_experts), 0);
    if (resident != nullptr)
      for (int g = 0; g < num_gpus; ++g)
        for (std::int32_t e : resident->gpu_slots(g))
          if (e >= 0 && e < num_experts && owner_gpu[e] != g && topo.slots_per_gpu > owned[g]) ++resident_hosts[e];
  }
  for (int e = 0; e < num_experts; ++e) {
    // ceil(load / hosts) <= load, so only a load above the bound can raise it: the hosts and the division (tens
    // of cycles) are worked out for the few heavy experts only.
    if (loads[e] <= lb) continue;
    const int o = owner_gpu[e];
    std::int64_t hosts = 1 + (move_budget == 0 ? resident_hosts[e] : open - (topo.slots_per_gpu > owned[o] ? 1 : 0));
    hosts = std::min<std::int64_t>(hosts, 1 + total_usable - usable[o]);
    lb = std::max(lb, (loads[e] + hosts - 1) / hosts);
  }
  // Per GPU, grouped by owner in one pass; only GPUs owning more experts than the others' usable spare slots
  // have any that must stay, and usually none does.
  bool any_stays = false;
  for (int g = 0; g < num_gpus && !any_stays; ++g)
    any_stays = owned[g] > total_usable - usable[g];
  if (!any_stays) return lb;
  std::vector<int> &off = ws.off;
  off.assign(static_cast<std::size_t>(num_gpus) + 1, 0);
  for (std::int32_t o : owner_gpu)
    ++off[o + 1];
  for (int g = 0; g < num_gpus; ++g)
    off[g + 1] += off[g];
  std::vector<std::int64_t> &grouped = ws.grouped;
  grouped.resize(static_cast<std::size_t>(num_experts));
  std::vector<int> &fill = ws.fill;
  fill.assign(off.begin(), off.end() - 1);
  for (int e = 0; e < num_experts; ++e)
    grouped[fill[owner_gpu[e]]++] = loads[e];
  for (int g = 0; g < num_gpus; ++g) {
    const std::int64_t outlets = total_usable - usable[g];
    const int n = off[g + 1] - off[g];
    if (n <= outlets) continue;
    std::sort(grouped.begin() + off[g], grouped.begin() + off[g + 1]);
    std::int64_t stay = 0;
    for (int i = 0; i < n - outlets; ++i)
      stay += grouped[off[g] + i];
    lb = std::max(lb, stay);
  }
  return lb;
}

/// Two-level mode with fixed owners: the total bound; per expert, its load over 1 + the GPUs that may take a
/// replica of it (a spare slot and budget, or the replica already resident); per GPU, the experts it owns that
/// cannot all get a replica elsewhere (at most one per usable spare slot of the other GPUs) stay whole on it.
[[nodiscard]] inline std::int64_t lower_bound_two_level(std::span<const std::int64_t> loads,
                                                        std::span<const std::int32_t> owner_gpu, const Topology &topo,
                                                        int move_budget = -1,
                                                        const LayerPlacement *resident = nullptr) {
  TwoLevelBoundWorkspace ws;
  return lower_bound_two_level(loads, owner_gpu, topo, move_budget, resident, ws);
}

} // namespace v0
} // namespace foremoe
