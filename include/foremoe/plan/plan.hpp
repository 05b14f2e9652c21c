#pragma once
/// @file
/// One MoE layer's plan for one micro-step (placement, token split, weight moves) and the checks every plan passes.

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/placement.hpp"

namespace foremoe {
inline namespace v0 {

/// Source of a move that copies from the node's pinned host mirror instead of a GPU.
inline constexpr std::int32_t host_mirror = -1;

/// One expert weight copy into a slot: from a GPU that holds it, or from the host mirror.
struct Move {
  std::int32_t expert = 0;
  std::int32_t src_gpu = host_mirror; ///< GPU holding the expert before the move, or `host_mirror`
  std::int32_t dst_gpu = 0;
  std::int32_t dst_slot = 0;

  friend bool operator==(const Move &, const Move &) = default;
};

/// The plan of one MoE layer for one micro-step.
struct LayerPlan {
  LayerPlacement placement;
  std::vector<std::int32_t> owner_gpu;   ///< `[experts]`: the GPU holding the expert's optimizer state
  std::vector<std::int64_t> slot_tokens; ///< `[gpus * slots]`: tokens sent to each physical slot
  std::vector<Move> moves;               ///< turn the resident placement into `placement`
  std::int64_t max_gpu_load = 0;         ///< the largest per-GPU token count
  /// False when an imbalance tolerance was asked for and could not be met (the plan is then the best found).
  bool tolerance_met = true;

  /// Tokens per GPU.
  [[nodiscard]] std::vector<std::int64_t> gpu_loads() const {
    const int num_gpus = placement.num_gpus(), slots = placement.slots_per_gpu();
    std::vector<std::int64_t> out(static_cast<std::size_t>(num_gpus), 0);
    for (std::size_t p = 0; p < slot_tokens.size() && slots > 0; ++p)
      out[p / static_cast<std::size_t>(slots)] += slot_tokens[p];
    return out;
  }
  /// Copies beyond the owner copy, over all experts.
  [[nodiscard]] int num_replicas() const noexcept {
    int n = 0;
    for (std::int32_t e : placement.phys_to_log())
      n += e != empty_slot;
    return n - static_cast<int>(owner_gpu.size());
  }
  /// `max / mean` GPU load (1.0 is perfect; 1.0 for an empty layer).
  [[nodiscard]] double imbalance() const {
    std::int64_t total = 0;
    for (std::int64_t t : slot_tokens)
      total += t;
    if (total == 0) return 1.0;
    return static_cast<double>(max_gpu_load) * placement.num_gpus() / static_cast<double>(total);
  }
};

/// The plans of every micro-step of one RL step.
struct StepPlan {
  std::vector<std::vector<std::int32_t>> owner_gpu; ///< `[layers][experts]` owners used for the step
  std::vector<std::vector<LayerPlan>> micro_steps;  ///< `[micro_steps][layers]`
  double planner_seconds = 0.0;                     ///< wall time of planning only

  /// The placement after the last micro-step (the next step's resident placement); empty without micro-steps.
  [[nodiscard]] Placement final_placement() const;
};

/// The placement of every layer of one micro-step's plans.
[[nodiscard]] inline Placement to_placement(std::span<const LayerPlan> layers) {
  Placement p;
  if (layers.empty()) return p;
  const LayerPlacement &first = layers.front().placement;
  Topology topo{1, first.num_gpus(), first.slots_per_gpu()};
  p = Placement(topo, static_cast<int>(layers.size()), first.num_experts());
  for (std::size_t l = 0; l < layers.size(); ++l)
    p.layer(static_cast<int>(l)) = layers[l].placement;
  return p;
}

inline Placement StepPlan::final_placement() const {
  if (micro_steps.empty()) return {};
  return to_placement(micro_steps.back());
}

namespace detail {

/// The GPU a new copy of `expert` is read from: a holder in `base` on `dst_gpu`'s node (the owner first), else the
/// host mirror. Cross-node GPU copies would compete with the token all-to-all on the network; PCIe does not. A holder
/// whose slot a move of the same batch writes (`written`, `[gpus * slots]` of the layer; empty: none) does not
/// count: it would be read while written. This is where a move's source is decided; transfer planning keeps it
/// unless it cannot be read (`transfer::SourceReason`).
[[nodiscard]] inline std::int32_t move_source(const LayerPlacement &base, std::span<const std::int32_t> owner_gpu,
                                              std::int32_t expert, int dst_gpu, int gpus_per_node,
                                              std::span<const char> written = {}) {
  const int slots = base.slots_per_gpu();
  const int first = dst_gpu / gpus_per_node * gpus_per_node, last = std::min(base.num_gpus(), first + gpus_per_node);
  const std::int32_t *slot = base.phys_to_log().data();
  const int lo = first * slots, hi = last * slots;
  // Most new copies have no holder on the node: a branch-free count over the node's slots, which are contiguous
  // (the compiler vectorises it), answers those without the search below.
  int hits = 0;
  for (int q = lo; q < hi; ++q)
    hits += slot[q] == expert;
  if (hits == 0) return host_mirror;
  // One pass in GPU order: the owner as soon as it shows up, else the first other holder.
  const std::int32_t owner = owner_gpu.empty() ? -1 : owner_gpu[expert];
  std::int32_t holder = host_mirror;
  for (int q = lo; q < hi; ++q)
    if (slot[q] == expert) {
      const std::int32_t g = q / slots;
      if (g == dst_gpu || (!written.empty() && written[static_cast<std::size_t>(q)])) continue;
      if (g == owner) return owner;
      if (holder == host_mirror) holder = g;
    }
  return holder;
}

/// Whether GPU `gpu` of `base` holds `expert` in a slot that no move of the batch writes (`written`, `[gpus * slots]`
/// of the layer; empty: none): a copy a move of the batch may read, as `move_source` chooses them. O(slots).
[[nodiscard]] inline bool readable_copy(const LayerPlacement &base, std::int32_t expert, int gpu,
                                        std::span<const char> written = {}) {
  const int slots = base.slots_per_gpu();
  for (int s = 0; s < slots; ++s)
    if (base.slot(gpu, s) == expert && (written.empty() || !written[static_cast<std::size_t>(gpu) * slots + s]))
      return true;
  return false;
}

} // namespace detail

/// Lays out the distinct experts `want` (at most `slots_per_gpu`) on GPU `gpu_idx` of `p`, keeping every expert
/// that `resident` already holds on that GPU in its resident slot, so kept copies never move. The GPU's slots must
/// be empty; `resident` must have `p`'s shape or be null.
inline void layout_gpu_slots(LayerPlacement &p, int gpu_idx, std::span<const std::int32_t> want,
                             const LayerPlacement *resident) {
  const int slots = p.slots_per_gpu();
  detail::require(static_cast<int>(want.size()) <= slots, "layout_slots: GPU ", gpu_idx, " gets ", want.size(),
                  " experts but has ", slots, " slots");
  std::uint64_t placed = 0; // bit i: want[i] sits in its resident slot (only tracked for the first 64)
  if (resident != nullptr)
    for (int s = 0; s < slots; ++s) {
      const std::int32_t e = resident->slot(gpu_idx, s);
      if (e == empty_slot) continue;
      for (std::size_t i = 0; i < want.size() && i < 64; ++i)
        if (!(placed >> i & 1u) && want[i] == e) {
          p.slot(gpu_idx, s) = e;
          placed |= std::uint64_t{1} << i;
          break;
        }
    }
  int s = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (i < 64 && (placed >> i & 1u)) continue;
    while (p.slot(gpu_idx, s) != empty_slot)
      ++s;
    p.slot(gpu_idx, s) = want[i];
  }
}

/// Lays out `experts_of_gpu` (per GPU, at most `slots_per_gpu` distinct experts each) into slots, keeping every
/// expert that `resident` already holds on that GPU in its resident slot, so kept copies never move.
[[nodiscard]] inline LayerPlacement layout_slots(int num_gpus, int slots_per_gpu, int num_experts,
                                                 const std::vector<std::vector<std::int32_t>> &experts_of_gpu,
                                                 const LayerPlacement *resident) {
  detail::require(static_cast<int>(experts_of_gpu.size()) == num_gpus, "layout_slots: ", experts_of_gpu.size(),
                  " GPU lists for ", num_gpus, " GPUs");
  LayerPlacement p(num_gpus, slots_per_gpu, num_experts);
  const bool use_resident = resident != nullptr && resident->num_gpus() == num_gpus &&
                            resident->slots_per_gpu() == slots_per_gpu && resident->num_experts() == num_experts;
  for (int g = 0; g < num_gpus; ++g)
    layout_gpu_slots(p, g, experts_of_gpu[g], use_resident ? resident : nullptr);
  return p;
}

/// The moves that turn `resident` (or, without one, the owner copies alone) into `target`: one per slot whose
/// expert is new there. Emptied slots need no move (eviction is free).
[[nodiscard]] inline std::vector<Move> compute_moves(const LayerPlacement &target,
                                                     std::span<const std::int32_t> owner_gpu,
                                                     const LayerPlacement *resident, int gpus_per_node) {
  std::vector<Move> moves;
  const int num_gpus = target.num_gpus(), slots = target.slots_per_gpu();
  LayerPlacement owners_only;
  if (resident == nullptr) {
    // Without a resident placement the owner copies are the state we start from, wherever they sit.
    owners_only = LayerPlacement(num_gpus, slots, target.num_experts());
    for (int g = 0; g < num_gpus; ++g)
      for (int s = 0; s < slots; ++s)
        if (const std::int32_t e = target.slot(g, s); e != empty_slot && !owner_gpu.empty() && owner_gpu[e] == g)
          owners_only.slot(g, s) = e;
  }
  const LayerPlacement &base = resident != nullptr ? *resident : owners_only;
  std::vector<char> written(static_cast<std::size_t>(num_gpus) * slots, 0);
  for (int g = 0; g < num_gpus; ++g)
    for (int s = 0; s < slots; ++s) {
      const std::int32_t e = target.slot(g, s);
      written[static_cast<std::size_t>(g) * slots + s] = e != empty_slot && base.slot(g, s) != e;
    }
  for (int g = 0; g < num_gpus; ++g)
    for (int s = 0; s < slots; ++s)
      if (written[static_cast<std::size_t>(g) * slots + s]) {
        const std::int32_t e = target.slot(g, s);
        moves.push_back({e, detail::move_source(base, owner_gpu, e, g, gpus_per_node, written), g, s});
      }
  return moves;
}

/// The moves of a strategy that re-pushes every replica's weights each micro-step and layer (UltraEP, MoonEP: no
/// resident reuse, see `PlanStrategy::reuses_resident`): one per replica slot of `target`, also where `resident`
/// already held that expert in that slot, plus one per owner copy not already in its slot. Sources as
/// `compute_moves`: a holder in `resident` (or in the owner copies alone when null) on the destination's node,
/// the owner first, else the host mirror.
[[nodiscard]] inline std::vector<Move> full_push_moves(const LayerPlacement &target,
                                                       std::span<const std::int32_t> owner_gpu,
                                                       const LayerPlacement *resident, int gpus_per_node) {
  std::vector<Move> moves;
  const int num_gpus = target.num_gpus(), slots = target.slots_per_gpu();
  LayerPlacement owners_only;
  if (resident == nullptr) {
    owners_only = LayerPlacement(num_gpus, slots, target.num_experts());
    for (int g = 0; g < num_gpus; ++g)
      for (int s = 0; s < slots; ++s)
        if (const std::int32_t e = target.slot(g, s); e != empty_slot && !owner_gpu.empty() && owner_gpu[e] == g)
          owners_only.slot(g, s) = e;
  }
  const LayerPlacement &base = resident != nullptr ? *resident : owners_only;
  std::vector<char> written(static_cast<std::size_t>(num_gpus) * slots, 0);
  for (int g = 0; g < num_gpus; ++g)
    for (int s = 0; s < slots; ++s) {
      const std::int32_t e = target.slot(g, s);
      const bool owner_copy = e != empty_slot && !owner_gpu.empty() && owner_gpu[e] == g;
      written[static_cast<std::size_t>(g) * slots + s] = e != empty_slot && !(owner_copy && base.slot(g, s) == e);
    }
  for (int g = 0; g < num_gpus; ++g)
    for (int s = 0; s < slots; ++s)
      if (written[static_cast<std::size_t>(g) * slots + s]) {
        const std::int32_t e = target.slot(g, s);
        moves.push_back({e, detail::move_source(base, owner_gpu, e, g, gpus_per_node, written), g, s});
      }
  return moves;
}

/// Checks every invariant of `plan` for `expert_loads`, throwing `Error` with a message naming the first violation:
/// the placement's shape and validity (every expert hosted, no duplicate copy on a GPU), owners hosted by their
/// owner GPU, token counts (non-negative, only on slots hosting the expert, summing exactly to each expert's load),
/// `max_gpu_load`, and that `moves` turn `resident` (or the owner copies alone when null) into the placement, each
/// from a real holder or the host mirror, with at most `move_budget` new replicas per GPU (`move_budget < 0`: none).
inline void validate(const LayerPlan &plan, std::span<const std::int64_t> expert_loads, const LayerPlacement *resident,
                     int move_budget = -1) {
  const LayerPlacement &p = plan.placement;
  const int num_gpus = p.num_gpus(), slots = p.slots_per_gpu(), num_experts = p.num_experts();
  detail::require(num_gpus > 0 && slots > 0 && num_experts > 0, "LayerPlan: empty placement");
  detail::require(static_cast<int>(expert_loads.size()) == num_experts, "LayerPlan: ", expert_loads.size(),
                  " expert loads for a placement of ", num_experts, " experts");
  try {
    p.validate();
  } catch (const Error &err) {
    detail::fail("LayerPlan: ", err.what());
  }
  detail::require(static_cast<int>(plan.owner_gpu.size()) == num_experts, "LayerPlan: owner_gpu has ",
                  plan.owner_gpu.size(), " entries for ", num_experts, " experts");
  for (int e = 0; e < num_experts; ++e) {
    const std::int32_t o = plan.owner_gpu[e];
    detail::require(o >= 0 && o < num_gpus, "LayerPlan: expert ", e, " has owner GPU ", o, ", outside [0, ", num_gpus,
                    ")");
    detail::require(p.holds(o, e), "LayerPlan: owner GPU ", o, " of expert ", e, " does not hold it");
  }
  detail::require(static_cast<int>(plan.slot_tokens.size()) == p.num_slots(), "LayerPlan: slot_tokens has ",
                  plan.slot_tokens.size(), " entries for ", p.num_slots(), " slots");
  std::vector<std::int64_t> sums(static_cast<std::size_t>(num_experts), 0);
  std::int64_t max_load = 0;
  for (int g = 0; g < num_gpus; ++g) {
    std::int64_t gpu_load = 0;
    for (int s = 0; s < slots; ++s) {
      const std::int64_t t = plan.slot_tokens[static_cast<std::size_t>(g) * slots + s];
      const std::int32_t e = p.slot(g, s);
      detail::require(t >= 0, "LayerPlan: GPU ", g, " slot ", s, " gets a negative token count ", t);
      if (e == empty_slot) {
        detail::require(t == 0, "LayerPlan: empty GPU ", g, " slot ", s, " gets ", t, " tokens");
        continue;
      }
      sums[e] += t;
      gpu_load += t;
    }
    max_load = std::max(max_load, gpu_load);
  }
  for (int e = 0; e < num_experts; ++e) {
    detail::require(expert_loads[e] >= 0, "LayerPlan: expert ", e, " has a negative load ", expert_loads[e]);
    detail::require(sums[e] == expert_loads[e], "LayerPlan: tokens of expert ", e, " sum to ", sums[e],
                    " over its copies, but its load is ", expert_loads[e]);
  }
  detail::require(plan.max_gpu_load == max_load, "LayerPlan: max_gpu_load is ", plan.max_gpu_load,
                  " but the largest GPU load is ", max_load);

  // Replay the moves on the starting placement.
  LayerPlacement state;
  if (resident != nullptr) {
    detail::require(resident->num_gpus() == num_gpus && resident->slots_per_gpu() == slots &&
                        resident->num_experts() == num_experts,
                    "LayerPlan: resident placement is ", resident->num_gpus(), " GPUs x ", resident->slots_per_gpu(),
                    " slots x ", resident->num_experts(), " experts, plan is ", num_gpus, " x ", slots, " x ",
                    num_experts);
    state = *resident;
  } else {
    state = LayerPlacement(num_gpus, slots, num_experts);
    for (int g = 0; g < num_gpus; ++g)
      for (int s = 0; s < slots; ++s)
        if (const std::int32_t e = p.slot(g, s); e != empty_slot && plan.owner_gpu[e] == g) state.slot(g, s) = e;
  }
  const LayerPlacement before = state;
  std::vector<char> written(static_cast<std::size_t>(p.num_slots()), 0);
  std::vector<int> new_replicas(static_cast<std::size_t>(num_gpus), 0);
  for (std::size_t i = 0; i < plan.moves.size(); ++i) {
    const Move &m = plan.moves[i];
    detail::require(m.expert >= 0 && m.expert < num_experts, "LayerPlan: move ", i, " copies expert ", m.expert,
                    ", outside [0, ", num_experts, ")");
    detail::require(m.dst_gpu >= 0 && m.dst_gpu < num_gpus && m.dst_slot >= 0 && m.dst_slot < slots, "LayerPlan: move ",
                    i, " targets GPU ", m.dst_gpu, " slot ", m.dst_slot, ", outside ", num_gpus, " GPUs x ", slots,
                    " slots");
    detail::require(m.src_gpu == host_mirror || (m.src_gpu >= 0 && m.src_gpu < num_gpus), "LayerPlan: move ", i,
                    " reads from GPU ", m.src_gpu, ", neither a GPU nor the host mirror (-1)");
    detail::require(m.src_gpu != m.dst_gpu, "LayerPlan: move ", i, " copies expert ", m.expert, " from GPU ", m.src_gpu,
                    " onto itself");
    detail::require(m.src_gpu == host_mirror || before.holds(m.src_gpu, m.expert), "LayerPlan: move ", i,
                    " reads expert ", m.expert, " from GPU ", m.src_gpu, ", which does not hold it");
    const std::size_t phys = static_cast<std::size_t>(m.dst_gpu) * slots + m.dst_slot;
    detail::require(!written[phys], "LayerPlan: two moves write GPU ", m.dst_gpu, " slot ", m.dst_slot);
    detail::require(p.slot(m.dst_gpu, m.dst_slot) == m.expert, "LayerPlan: move ", i, " puts expert ", m.expert,
                    " in GPU ", m.dst_gpu, " slot ", m.dst_slot, ", which the plan gives expert ",
                    p.slot(m.dst_gpu, m.dst_slot));
    written[phys] = 1;
    state.slot(m.dst_gpu, m.dst_slot) = m.expert;
    if (plan.owner_gpu[m.expert] != m.dst_gpu) ++new_replicas[m.dst_gpu];
  }
  // A GPU source is read while the batch runs: one of its copies must survive it (`detail::readable_copy`, as
  // `detail::move_source` chooses sources).
  for (std::size_t i = 0; i < plan.moves.size(); ++i) {
    const Move &m = plan.moves[i];
    if (m.src_gpu == host_mirror) continue;
    detail::require(detail::readable_copy(before, m.expert, m.src_gpu, written), "LayerPlan: move ", i,
                    " reads expert ", m.expert, " from GPU ", m.src_gpu,
                    ", whose copy a move of the same micro-step overwrites");
  }
  for (int g = 0; g < num_gpus; ++g)
    for (int s = 0; s < slots; ++s) {
      const std::int32_t want = p.slot(g, s);
      if (want != empty_slot)
        detail::require(state.slot(g, s) == want, "LayerPlan: GPU ", g, " slot ", s, " should hold expert ", want,
                        " but the moves leave ", state.slot(g, s), " there");
    }
  if (move_budget >= 0)
    for (int g = 0; g < num_gpus; ++g)
      detail::require(new_replicas[g] <= move_budget, "LayerPlan: GPU ", g, " receives ", new_replicas[g],
                      " new replicas, above the move budget ", move_budget);
}

} // namespace v0
} // namespace foremoe
