#pragma once
/// @file
/// The reduction a C++ trainer submits after each update micro-step's backward under the held-gradient rule
/// (issue 30): `HeldGradients` (`plan/held_gradients.hpp`) decides which replica gradients return, this turns its
/// decision into a `ReduceBatch` selection for `TransferEngine::submit_reduce`.
///
/// Per layer `l` and update micro-step `k` (plan `P_k`, the stage's `n` micro-steps):
///
///     HeldReduction red;                       // one per layer (its spans live until its next prepare)
///     ... forward and backward with P_k: replica gradients accumulate in place ...
///     ReduceBatch b = red.prepare(held, l, P_k, k + 1 < n ? &P_(k+1) : nullptr, hold_rule);
///     b.grads_ready = ...;                     // the backward wrote the gradients
///     engine.submit_reduce(b, ticket);         // then the moves of P_(k+1), which never overwrite a held slot
///
/// `prepare` records `P_k`'s used replicas as holding (`HeldGradients::hold`) and returns what `P_(k+1)` does not
/// keep (`HeldGradients::release`; no next plan: everything, before the optimizer step). The returns over a stage
/// are those of `HeldGradients::advance` over the same plans followed by a final release. With `hold_rule` false
/// every used replica returns every micro-step.

#include <cstdint>
#include <span>
#include <vector>

#include "foremoe/plan/held_gradients.hpp"
#include "foremoe/plan/plan.hpp"
#include "foremoe/runtime/transfer_engine.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime {

class HeldReduction {
public:
  /// The reduction of layer `l` after the backward of the micro-step planned by `ran` (see the file comment).
  /// The batch's spans point into this object and `ran`, valid until the next `prepare` and while `ran` lives.
  /// Throws `foremoe::Error` (as `HeldGradients::hold`) when `ran` does not have `held`'s shape.
  [[nodiscard]] ReduceBatch prepare(HeldGradients &held, int l, const LayerPlan &ran, const LayerPlan *next,
                                    bool hold_rule) {
    held.hold(l, ran);
    returns_.clear();
    held.release(l, next, hold_rule, [&](int g, int e, std::int32_t) {
      returns_.push_back({static_cast<std::int32_t>(g), static_cast<std::int32_t>(e)});
    });
    const std::span<const std::int32_t> still = held.layer(l);
    held_.assign(still.begin(), still.end());
    ReduceBatch b;
    b.layer = l;
    b.owner_gpu = ran.owner_gpu;
    b.select = true;
    b.returns = returns_;
    b.held = held_;
    return b;
  }
  /// The replicas the last `prepare` returns, GPU-major.
  [[nodiscard]] std::span<const ReplicaRef> returns() const noexcept { return returns_; }

private:
  std::vector<ReplicaRef> returns_;
  std::vector<std::int32_t> held_;
};

} // namespace runtime
} // namespace v0
} // namespace foremoe
