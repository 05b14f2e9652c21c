#pragma once
/// @file
/// Not API: the receiver lists of the two-level shedding construction.

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

namespace foremoe {
inline namespace v0 {
namespace detail {

/// GPUs that may receive at some makespan T, in `hot_order` (owner load descending), with suffix sums of their
/// owner loads and receiving slots: at a given T the open GPUs are the suffix whose owner load is below T.
struct ReceiverOrder {
  std::vector<std::int32_t> gpus;
  std::vector<std::int64_t> load_suf, slots_suf;

  /// From the GPUs in `hot_order` with a spare slot and either move budget or a resident replica.
  void build(std::span<const std::int32_t> hot_order, std::span<const std::int32_t> spare,
             std::span<const std::int32_t> budget, std::span<const std::int32_t> res_cnt,
             std::span<const std::int64_t> owner_load) {
    gpus.clear();
    for (std::int32_t g : hot_order)
      if (spare[g] > 0 && (budget[g] > 0 || res_cnt[g] > 0)) gpus.push_back(g);
    const std::size_t n = gpus.size();
    load_suf.assign(n + 1, 0);
    slots_suf.assign(n + 1, 0);
    for (std::size_t k = n; k-- > 0;) {
      const std::int32_t g = gpus[k];
      load_suf[k] = load_suf[k + 1] + owner_load[g];
      slots_suf[k] = slots_suf[k + 1] + std::min(spare[g], budget[g] + res_cnt[g]);
    }
  }
  /// Index of the first receiver whose owner load is below `t` (the open ones start there).
  [[nodiscard]] std::size_t first_open(std::span<const std::int64_t> owner_load, std::int64_t t) const {
    return static_cast<std::size_t>(
        std::partition_point(gpus.begin(), gpus.end(), [&](std::int32_t g) { return owner_load[g] >= t; }) -
        gpus.begin());
  }
};

/// GPUs that may still receive in the current construction, kept sorted by (room, GPU) so that a receiver is
/// found by a search instead of a scan.
class OpenReceivers {
public:
  /// `gpus` in (room, GPU) order with their rooms `room[g]`; `num_gpus` sizes the position index.
  void reset(std::span<const std::int32_t> gpus, std::span<const std::int64_t> room, int num_gpus) {
    open_.assign(gpus.begin(), gpus.end());
    open_room_.resize(open_.size());
    open_pos_.resize(static_cast<std::size_t>(num_gpus));
    for (std::size_t k = 0; k < open_.size(); ++k) {
      open_room_[k] = room[open_[k]];
      open_pos_[open_[k]] = static_cast<std::int32_t>(k);
    }
  }
  [[nodiscard]] const std::vector<std::int32_t> &gpus() const noexcept { return open_; }
  /// First position with room >= `need`: a branchless search over the contiguous rooms.
  [[nodiscard]] std::size_t first_with_room(std::int64_t need) const noexcept {
    std::size_t len = open_room_.size();
    // The shedding asks mostly for more than the largest room (or less than the smallest): answer those without
    // the search's chain of dependent loads.
    if (len == 0 || open_room_.back() < need) return len;
    if (open_room_.front() >= need) return 0;
    const std::int64_t *base = open_room_.data();
    while (len > 1) {
      const std::size_t half = len / 2;
      base += static_cast<std::size_t>(base[half - 1] < need) * half; // a multiply, not a branch
      len -= half;
    }
    return static_cast<std::size_t>(base - open_room_.data()) + (len == 1 && *base < need);
  }
  /// Removes `h` (which is open).
  void close(std::int32_t h) {
    for (auto k = static_cast<std::size_t>(open_pos_[h]); k + 1 < open_.size(); ++k) {
      open_[k] = open_[k + 1];
      open_room_[k] = open_room_[k + 1];
      open_pos_[open_[k]] = static_cast<std::int32_t>(k);
    }
    open_.pop_back();
    open_room_.pop_back();
  }
  /// `h` (open) now has room `r`, at most its old one: moves it left to its sorted (room, GPU) position.
  void shrink(std::int32_t h, std::int64_t r) {
    auto k = static_cast<std::size_t>(open_pos_[h]);
    for (; k > 0; --k) {
      const std::int32_t prev = open_[k - 1];
      if (open_room_[k - 1] < r || (open_room_[k - 1] == r && prev < h)) break;
      open_[k] = prev;
      open_room_[k] = open_room_[k - 1];
      open_pos_[prev] = static_cast<std::int32_t>(k);
    }
    open_[k] = h;
    open_room_[k] = r;
    open_pos_[h] = static_cast<std::int32_t>(k);
  }

private:
  std::vector<std::int32_t> open_;      ///< by (room, GPU)
  std::vector<std::int64_t> open_room_; ///< their rooms, in the same order
  std::vector<std::int32_t> open_pos_;  ///< GPU -> its index in `open_` (while it is there)
};

} // namespace detail
} // namespace v0
} // namespace foremoe
