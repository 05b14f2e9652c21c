#pragma once
/// @file
/// Not API: fixed sorting networks for 8 and 16 unsigned keys (ascending). Their compare-exchanges are
/// branchless, so short lists in random order sort without mispredicted compares.

#include <cstdint>
#include <utility>

namespace foremoe {
inline namespace v0 {
namespace detail {

/// Orders `a[i] <= a[j]` (a conditional move, not a branch).
inline void compare_exchange(std::uint64_t *a, int i, int j) noexcept {
  const std::uint64_t x = a[i], y = a[j];
  a[i] = x < y ? x : y;
  a[j] = x < y ? y : x;
}

/// Sorts `a[0..8)` ascending: the optimal 19-comparator network (depth 6), checked on all 0/1 inputs.
inline void sorting_network_8(std::uint64_t *a) noexcept {
  static constexpr std::pair<int, int> net[] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}, {0, 4}, {1, 5}, {2, 6},
                                                {3, 7}, {0, 1}, {2, 3}, {4, 5}, {6, 7}, {2, 4}, {3, 5},
                                                {1, 4}, {3, 6}, {1, 2}, {3, 4}, {5, 6}};
  for (const auto &[i, j] : net)
    compare_exchange(a, i, j);
}

/// Sorts `a[0..16)` ascending: Green's 60-comparator network (depth 10), checked on all 0/1 inputs.
inline void sorting_network_16(std::uint64_t *a) noexcept {
  static constexpr std::pair<int, int> net[] = {
      {0, 13},  {1, 12},  {2, 15},  {3, 14},  {4, 8},   {5, 6},   {7, 11}, {9, 10},  {0, 5},   {1, 7},
      {2, 9},   {3, 4},   {6, 13},  {8, 14},  {10, 15}, {11, 12}, {0, 1},  {2, 3},   {4, 5},   {6, 8},
      {7, 9},   {10, 11}, {12, 13}, {14, 15}, {0, 2},   {1, 3},   {4, 10}, {5, 11},  {6, 7},   {8, 9},
      {12, 14}, {13, 15}, {1, 2},   {3, 12},  {4, 6},   {5, 7},   {8, 10}, {9, 11},  {13, 14}, {1, 4},
      {2, 6},   {5, 8},   {7, 10},  {9, 13},  {11, 14}, {2, 4},   {3, 6},  {9, 12},  {11, 13}, {3, 5},
      {6, 8},   {7, 9},   {10, 12}, {3, 4},   {5, 6},   {7, 8},   {9, 10}, {11, 12}, {6, 7},   {8, 9}};
  for (const auto &[i, j] : net)
    compare_exchange(a, i, j);
}

} // namespace detail
} // namespace v0
} // namespace foremoe
