#pragma once
/// @file
/// What the re-implemented per-micro-batch baselines (`strategies/ultraep.hpp`, `strategies/moonep.hpp`) share: static
/// contiguous owners, rank loads, and the plan of token quotas exported from owners to replicas. Not API.

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/core/topology.hpp"
#include "foremoe/plan/detail/layer_checks.hpp"
#include "foremoe/plan/plan.hpp"

namespace foremoe {
inline namespace v0 {
namespace detail {

/// `tokens` of `expert` run on a replica on `dst_gpu` instead of on the expert's owner.
struct BaselineQuota {
  std::int32_t expert = 0;
  std::int32_t dst_gpu = 0;
  std::int64_t tokens = 0;
};

/// Static contiguous (Megatron-style) owner of expert `e`: GPU `e / owners_per_gpu`, slot `e % owners_per_gpu`.
[[nodiscard]] inline int static_owner_of(int expert, int owners_per_gpu) noexcept { return expert / owners_per_gpu; }

/// Tokens each GPU runs when every expert stays on its static owner.
[[nodiscard]] inline std::vector<std::int64_t> static_rank_loads(std::span<const std::int64_t> loads,
                                                                 const Topology &topo) {
  const int num_experts = static_cast<int>(loads.size()), per_gpu = topo.owners_per_gpu(num_experts);
  std::vector<std::int64_t> out(static_cast<std::size_t>(topo.num_gpus()), 0);
  for (int e = 0; e < num_experts; ++e)
    out[static_owner_of(e, per_gpu)] += loads[e];
  return out;
}

/// Checks one layer's loads and resident placement (may be null) for a baseline strategy named `who`.
/// GPUs per balancing domain of a per-micro-batch baseline: `domain` (0: a node of the topology; -1: the whole EP
/// group), which must divide the EP group's GPUs; throws `Error` naming it otherwise.
[[nodiscard]] inline int baseline_domain(const Topology &topo, int domain, const char *who) {
  const int n = domain == 0 ? topo.gpus_per_node : domain < 0 ? topo.num_gpus() : domain;
  require(domain >= -1 && topo.num_gpus() % n == 0, who, ": a balancing domain of ", domain,
          " GPUs does not divide the ", topo.num_gpus(), " GPUs of the EP group (0: a node, -1: the whole group)");
  return n;
}

inline void check_baseline_inputs(std::span<const std::int64_t> loads, const Topology &topo,
                                  const LayerPlacement *resident, const char *who) {
  const int num_experts = static_cast<int>(loads.size());
  topo.validate(num_experts);
  check_expert_loads(loads, num_experts, who);
  check_resident_shape(resident, topo, num_experts, who);
}

/// The plan of static owners plus one replica per distinct (expert, GPU) of `quotas` (quotas of the same pair add
/// up): owner copies in their static slots, replicas in the GPU's free slots in quota order, each owner copy runs
/// what its expert's quotas leave; moves are a full push from `resident` (see `full_push_moves`). Throws `Error` when
/// a quota targets the owner, asks for more tokens than the expert has, or a GPU runs out of slots.
[[nodiscard]] inline LayerPlan plan_from_quotas(std::span<const std::int64_t> loads, const Topology &topo,
                                                std::span<const BaselineQuota> quotas, const LayerPlacement *resident,
                                                const char *who) {
  const int num_experts = static_cast<int>(loads.size()), num_gpus = topo.num_gpus(), slots = topo.slots_per_gpu;
  const int per_gpu = topo.owners_per_gpu(num_experts);
  LayerPlan plan;
  plan.placement = LayerPlacement(num_gpus, slots, num_experts);
  plan.owner_gpu.resize(static_cast<std::size_t>(num_experts));
  plan.slot_tokens.assign(static_cast<std::size_t>(num_gpus) * slots, 0);
  std::vector<std::int64_t> owner_left(loads.begin(), loads.end());
  for (int e = 0; e < num_experts; ++e) {
    const int g = static_owner_of(e, per_gpu);
    plan.owner_gpu[e] = g;
    plan.placement.slot(g, e % per_gpu) = e;
  }
  for (const BaselineQuota &q : quotas) {
    require(q.expert >= 0 && q.expert < num_experts && q.dst_gpu >= 0 && q.dst_gpu < num_gpus && q.tokens >= 0, who,
            ": quota of expert ", q.expert, " for GPU ", q.dst_gpu, " (", q.tokens, " tokens) is out of range");
    require(q.dst_gpu != plan.owner_gpu[q.expert], who, ": quota of expert ", q.expert, " targets its owner GPU ",
            q.dst_gpu);
    owner_left[q.expert] -= q.tokens;
    require(owner_left[q.expert] >= 0, who, ": quotas of expert ", q.expert, " exceed its load ", loads[q.expert]);
    int slot = -1;
    for (int s = 0; s < slots; ++s)
      if (plan.placement.slot(q.dst_gpu, s) == q.expert) slot = s;
    if (slot < 0) {
      slot = plan.placement.free_slot(q.dst_gpu);
      require(slot >= 0, who, ": GPU ", q.dst_gpu, " has no free slot for a replica of expert ", q.expert);
      plan.placement.slot(q.dst_gpu, slot) = q.expert;
    }
    plan.slot_tokens[static_cast<std::size_t>(q.dst_gpu) * slots + slot] += q.tokens;
  }
  for (int e = 0; e < num_experts; ++e) {
    const int g = plan.owner_gpu[e];
    plan.slot_tokens[static_cast<std::size_t>(g) * slots + e % per_gpu] = owner_left[e];
  }
  for (const std::int64_t t : plan.gpu_loads())
    plan.max_gpu_load = std::max(plan.max_gpu_load, t);
  plan.moves = full_push_moves(plan.placement, plan.owner_gpu, resident, topo.gpus_per_node);
  return plan;
}

} // namespace detail
} // namespace v0
} // namespace foremoe
