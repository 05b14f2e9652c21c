#pragma once
/// @file
/// Not API: the replicas of a two-level solution and its exact split next to fixed owners.

#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "foremoe/core/placement.hpp"
#include "foremoe/plan/split.hpp"

namespace foremoe {
inline namespace v0 {
namespace detail {

/// Replicas per GPU: `rep[g * slots + j]` for `j < cnt[g]`.
struct ReplicaSolution {
  std::vector<std::int32_t> rep;
  std::vector<std::int32_t> cnt;
  std::vector<std::int64_t> amt; ///< tokens of each replica in the construction that made it (if any)

  /// Empty, sized for `num_gpus` x `slots`.
  void clear(int num_gpus, int slots) {
    rep.assign(static_cast<std::size_t>(num_gpus) * slots, empty_slot);
    cnt.assign(static_cast<std::size_t>(num_gpus), 0);
    amt.assign(static_cast<std::size_t>(num_gpus) * slots, 0);
  }
};

/// Workspace of the exact split of a `ReplicaSolution`; the last evaluation's split stays readable.
class SolutionSplit {
public:
  SolutionSplit(int num_experts, int num_gpus, int slots)
      : num_experts_(num_experts), num_gpus_(num_gpus), slots_(slots) {}

  std::int64_t evaluate(const ReplicaSolution &s, std::span<const std::int64_t> loads,
                        std::span<const std::int32_t> owner, std::span<const std::int64_t> owner_load,
                        SplitSolver &split, std::int64_t limit = std::numeric_limits<std::int64_t>::max()) {
    // O(replicas + GPUs): `shared_idx_` stays -1 except for the experts of the last evaluation, reset here.
    if (shared_idx_.size() != static_cast<std::size_t>(num_experts_))
      shared_idx_.assign(static_cast<std::size_t>(num_experts_), -1);
    for (std::int32_t e : shared_exp_)
      shared_idx_[e] = -1;
    shared_loads_.clear();
    shared_exp_.clear();
    copies_.clear();
    for (int g = 0; g < num_gpus_; ++g)
      for (int j = 0; j < s.cnt[g]; ++j) {
        const std::int32_t e = s.rep[g * slots_ + j];
        if (shared_idx_[e] < 0) {
          shared_idx_[e] = static_cast<std::int32_t>(shared_exp_.size());
          shared_exp_.push_back(e);
          shared_loads_.push_back(loads[e]);
          copies_.push_back(1); // the owner copy
        }
        ++copies_[shared_idx_[e]];
      }
    const int num_shared = static_cast<int>(shared_loads_.size());
    offsets_.assign(static_cast<std::size_t>(num_shared) + 1, 0);
    for (int i = 0; i < num_shared; ++i)
      offsets_[i + 1] = offsets_[i] + copies_[i];
    copy_gpu_.resize(offsets_.back());
    fill_.assign(offsets_.begin(), offsets_.end() - 1);
    for (int i = 0; i < num_shared; ++i)
      copy_gpu_[fill_[i]++] = owner[shared_exp_[i]];
    for (int g = 0; g < num_gpus_; ++g)
      for (int j = 0; j < s.cnt[g]; ++j) {
        const std::int32_t i = shared_idx_[s.rep[g * slots_ + j]];
        copy_gpu_[fill_[i]++] = g;
      }
    base_.assign(owner_load.begin(), owner_load.end());
    for (int i = 0; i < num_shared; ++i)
      base_[owner[shared_exp_[i]]] -= shared_loads_[i];
    copy_tokens_.resize(copy_gpu_.size());
    gpu_loads_.resize(static_cast<std::size_t>(num_gpus_));
    return split.solve_core(base_, shared_loads_, offsets_, copy_gpu_, copy_tokens_, gpu_loads_, limit);
  }

  /// Tokens that copy of `e` on `g` receives in the last evaluation (0 if none).
  [[nodiscard]] std::int64_t tokens_on(std::int32_t e, int g, std::span<const std::int64_t> loads,
                                       std::span<const std::int32_t> owner) const {
    const std::int32_t i = shared_idx_[e];
    if (i < 0) return owner[e] == g ? loads[e] : 0;
    for (int c = offsets_[i]; c < offsets_[i + 1]; ++c)
      if (copy_gpu_[c] == g) return copy_tokens_[c];
    return 0;
  }

  /// Improving single-replica moves: a replica (or a free spare) on a cool GPU is re-pointed at a heavy expert of

  /// Per-GPU loads of the last evaluation (a local search restores them after failed trials).
  [[nodiscard]] std::vector<std::int64_t> &gpu_loads() noexcept { return gpu_loads_; }

private:
  int num_experts_ = 0, num_gpus_ = 0, slots_ = 0;
  std::vector<int> copies_;
  std::vector<std::int32_t> shared_idx_, shared_exp_, offsets_, copy_gpu_, fill_;
  std::vector<std::int64_t> shared_loads_, base_, copy_tokens_, gpu_loads_;
};

} // namespace detail
} // namespace v0
} // namespace foremoe
