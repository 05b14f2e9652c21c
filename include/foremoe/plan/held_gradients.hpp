#pragma once
/// @file
/// Replica gradients held in place over the update stage (issue 30): the one rule the planner's byte objective,
/// the simulator and the trainer glue share.
///
/// A replica (a copy off its expert's owner GPU) that runs tokens in an update micro-step owes its weight
/// gradient to the owner. While the following plans of its layer keep the expert on the same GPU with the same
/// owner it accumulates the gradient in place; it returns it once, when a plan no longer holds it there (its
/// slot is about to be reused) or after the stage's last backward (before the optimizer step). With the rule off
/// (`PlannerOptions::hold_replica_gradients` false) every replica returns its gradient after every update
/// micro-step it ran tokens in. Either way a gradient is charged once per return: the planner charges it when a
/// plan starts a new one (a used replica that holds none yet), the simulator when it goes back.

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/plan/plan.hpp"

namespace foremoe {
inline namespace v0 {

/// Per layer and (GPU, expert): the owner GPU whose gradient the replica of that expert on that GPU holds (it ran
/// tokens since its last return), or -1.
class HeldGradients {
public:
  HeldGradients() = default;
  HeldGradients(int num_layers, int num_gpus, int num_experts)
      : num_gpus_(num_gpus), num_experts_(num_experts),
        owner_(static_cast<std::size_t>(num_layers),
               std::vector<std::int32_t>(static_cast<std::size_t>(num_gpus) * num_experts, -1)) {
    detail::require(num_layers >= 0 && num_gpus >= 0 && num_experts >= 0, "HeldGradients: negative shape [", num_layers,
                    ", ", num_gpus, ", ", num_experts, "]");
  }

  [[nodiscard]] int num_layers() const noexcept { return static_cast<int>(owner_.size()); }
  [[nodiscard]] int num_gpus() const noexcept { return num_gpus_; }
  [[nodiscard]] int num_experts() const noexcept { return num_experts_; }
  /// `[gpus * experts]` of layer `l`: the owner each replica's held gradient goes to, or -1.
  [[nodiscard]] std::span<const std::int32_t> layer(int l) const { return owner_.at(static_cast<std::size_t>(l)); }
  /// Gradients held in layer `l`.
  [[nodiscard]] int count(int l) const {
    int n = 0;
    for (const std::int32_t o : layer(l))
      n += o >= 0;
    return n;
  }

  /// Returns the gradients of layer `l` that `next` does not keep: a held gradient stays only when `hold` is true
  /// and `next` (null: nothing kept) holds its expert on the same GPU with the same owner. Calls
  /// `on_return(gpu, expert, owner)` for each one returned and forgets it.
  template <class F> void release(int l, const LayerPlan *next, bool hold, F &&on_return) {
    std::vector<std::int32_t> &owed = owner_.at(static_cast<std::size_t>(l));
    for (int g = 0; g < num_gpus_; ++g)
      for (int e = 0; e < num_experts_; ++e) {
        std::int32_t &o = owed[static_cast<std::size_t>(g) * num_experts_ + e];
        if (o < 0) continue;
        if (hold && next != nullptr && next->owner_gpu[e] == o && next->placement.holds(g, e)) continue;
        on_return(g, e, o);
        o = -1;
      }
  }
  /// Records the replicas of `plan` (layer `l`) that run tokens as holding their gradient.
  void hold(int l, const LayerPlan &plan) {
    std::vector<std::int32_t> &owed = owner_.at(static_cast<std::size_t>(l));
    const LayerPlacement &p = plan.placement;
    detail::require(p.num_gpus() == num_gpus_ && p.num_experts() == num_experts_, "HeldGradients: plan of ",
                    p.num_gpus(), " GPUs x ", p.num_experts(), " experts, expected ", num_gpus_, " x ", num_experts_);
    const int slots = p.slots_per_gpu();
    for (int q = 0; q < p.num_slots(); ++q)
      if (const std::int32_t e = p.phys_to_log()[q];
          e != empty_slot && plan.owner_gpu[e] != q / slots && plan.slot_tokens[static_cast<std::size_t>(q)] > 0)
        owed[static_cast<std::size_t>(q / slots) * num_experts_ + e] = plan.owner_gpu[e];
  }
  /// One update micro-step of layer `l`: the gradients `plan` does not keep return (counted), then its used
  /// replicas hold theirs. Returns how many returned.
  int advance(int l, const LayerPlan &plan, bool hold_rule) {
    int returned = 0;
    release(l, &plan, hold_rule, [&](int, int, std::int32_t) { ++returned; });
    this->hold(l, plan);
    return returned;
  }
  /// Forgets every held gradient (all returned: the stage ended).
  void clear() {
    for (auto &v : owner_)
      std::fill(v.begin(), v.end(), -1);
  }

private:
  int num_gpus_ = 0, num_experts_ = 0;
  std::vector<std::vector<std::int32_t>> owner_;
};

namespace detail {

/// Replicas of `plan` that run tokens and so owe a gradient, less those that already hold one for the same owner on
/// the same GPU (`held`: `[gpus * experts]` as `HeldGradients::layer`, empty: none held), which keep accumulating
/// into it: the gradient returns a plan starts.
[[nodiscard]] inline std::int64_t new_gradients(const LayerPlan &plan, std::span<const std::int32_t> held) {
  const LayerPlacement &p = plan.placement;
  const int slots = p.slots_per_gpu(), num_experts = p.num_experts();
  detail::require(held.empty() || held.size() == static_cast<std::size_t>(p.num_gpus()) * num_experts,
                  "held gradients: ", held.size(),
                  " entries, expected GPUs x experts = ", static_cast<std::size_t>(p.num_gpus()) * num_experts);
  std::int64_t used = 0;
  for (int q = 0; q < p.num_slots(); ++q) {
    const std::int32_t e = p.phys_to_log()[q];
    if (e == empty_slot || plan.owner_gpu[e] == q / slots || plan.slot_tokens[static_cast<std::size_t>(q)] <= 0)
      continue;
    if (!held.empty() && held[static_cast<std::size_t>(q / slots) * num_experts + e] == plan.owner_gpu[e]) continue;
    ++used;
  }
  return used;
}

} // namespace detail
} // namespace v0
} // namespace foremoe
