#pragma once
// Test helper shared by the transfer-engine suites: every expert of every layer has its own byte pattern across
// its tensors, so a misplaced, stale or partial byte shows.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "foremoe/runtime/transfer_engine.hpp"

namespace foremoe_test {

/// Byte `i` of the packed bytes (tensors concatenated) of expert `e` in layer `l`.
inline std::byte expert_byte(int l, int e, std::int64_t i) {
  return static_cast<std::byte>((l * 131 + e * 31 + i * 7 + (i >> 9)) & 0xff);
}

/// Writes expert `e`'s bytes into the slot or mirror entry at `base`.
inline void fill_expert(std::byte *base, std::span<const foremoe::runtime::TensorSpan> tensors, int l, int e) {
  std::int64_t k = 0;
  for (const auto &t : tensors)
    for (std::int64_t i = 0; i < t.num_bytes; ++i)
      base[t.offset_bytes + i] = expert_byte(l, e, k++);
}

/// Whether the slot or mirror entry at `base` holds exactly expert `e`'s bytes.
inline bool holds_expert(const std::byte *base, std::span<const foremoe::runtime::TensorSpan> tensors, int l, int e) {
  std::int64_t k = 0;
  for (const auto &t : tensors)
    for (std::int64_t i = 0; i < t.num_bytes; ++i)
      if (base[t.offset_bytes + i] != expert_byte(l, e, k++)) return false;
  return true;
}

} // namespace foremoe_test

namespace foremoe_test {

/// Writes expert `e`'s bytes with tensor `ti` starting at `at(ti)` (any layout).
template <class At> void fill_expert_at(At &&at, std::span<const foremoe::runtime::TensorSpan> tensors, int l, int e) {
  std::int64_t k = 0;
  for (std::size_t ti = 0; ti < tensors.size(); ++ti) {
    std::byte *p = at(static_cast<int>(ti));
    for (std::int64_t i = 0; i < tensors[ti].num_bytes; ++i)
      p[i] = expert_byte(l, e, k++);
  }
}

/// Whether tensor `ti` at `at(ti)` holds expert `e`'s bytes for every tensor (any layout).
template <class At> bool holds_expert_at(At &&at, std::span<const foremoe::runtime::TensorSpan> tensors, int l, int e) {
  std::int64_t k = 0;
  for (std::size_t ti = 0; ti < tensors.size(); ++ti) {
    const std::byte *p = at(static_cast<int>(ti));
    for (std::int64_t i = 0; i < tensors[ti].num_bytes; ++i)
      if (p[i] != expert_byte(l, e, k++)) return false;
  }
  return true;
}

/// The memory of one split region (`SlotRegion::tensors` or `MirrorRegion::tensors`) in a random layout: `rows`
/// rows (slots, or experts) in `buffers` buffers of every tensor, either one block per tensor with its own padded
/// row stride, or every tensor interleaved in one block in a shuffled order (a packed layout described tensor by
/// tensor). Bytes outside the rows keep `guard`, so a write outside a row shows (`guards_intact`).
struct SplitMemory {
  static constexpr std::byte guard{0xee};
  std::vector<std::vector<std::byte>> blocks;
  std::vector<int> block_of;
  std::vector<std::int64_t> offset, stride, buffer_stride, bytes; // per tensor
  int rows = 0, buffers = 1;

  void build(std::mt19937_64 &rng, std::span<const foremoe::runtime::TensorSpan> tensors, int num_rows,
             int num_buffers) {
    rows = num_rows;
    buffers = num_buffers;
    const std::size_t n = tensors.size();
    block_of.assign(n, 0), offset.assign(n, 0), stride.assign(n, 0), buffer_stride.assign(n, 0), bytes.assign(n, 0);
    for (std::size_t i = 0; i < n; ++i)
      bytes[i] = tensors[i].num_bytes;
    auto pad = [&](int hi) { return std::int64_t{std::uniform_int_distribution<int>(0, hi)(rng)}; };
    if (rng() % 3 == 0) { // interleaved
      std::vector<std::size_t> order(n);
      std::iota(order.begin(), order.end(), std::size_t{0});
      std::shuffle(order.begin(), order.end(), rng);
      std::int64_t row = pad(40);
      for (std::size_t i : order) {
        offset[i] = row;
        row += bytes[i] + pad(40);
      }
      const std::int64_t bstride = row * rows + pad(100);
      for (std::size_t i = 0; i < n; ++i)
        stride[i] = row, buffer_stride[i] = bstride;
      blocks.emplace_back(static_cast<std::size_t>(bstride * buffers + pad(64)), guard);
    } else {
      for (std::size_t i = 0; i < n; ++i) {
        block_of[i] = static_cast<int>(i);
        offset[i] = pad(64);
        stride[i] = bytes[i] + pad(80);
        buffer_stride[i] = stride[i] * rows + pad(100);
        blocks.emplace_back(static_cast<std::size_t>(offset[i] + buffer_stride[i] * buffers + pad(64)), guard);
      }
    }
  }
  std::byte *at(int ti, int row, int buffer = 0) {
    return blocks[block_of[ti]].data() + offset[ti] + buffer * buffer_stride[ti] + row * stride[ti];
  }
  std::vector<foremoe::runtime::SlotTensor> slot_tensors() {
    std::vector<foremoe::runtime::SlotTensor> out;
    for (std::size_t i = 0; i < bytes.size(); ++i)
      out.push_back({at(static_cast<int>(i), 0), stride[i], buffers == 2 ? buffer_stride[i] : 0});
    return out;
  }
  std::vector<foremoe::runtime::MirrorTensor> mirror_tensors() {
    std::vector<foremoe::runtime::MirrorTensor> out;
    for (std::size_t i = 0; i < bytes.size(); ++i)
      out.push_back({at(static_cast<int>(i), 0), stride[i]});
    return out;
  }
  /// Whether every byte outside the rows still holds `guard`.
  bool guards_intact() {
    for (std::size_t b = 0; b < blocks.size(); ++b) {
      std::vector<char> in_row(blocks[b].size(), 0);
      for (std::size_t i = 0; i < bytes.size(); ++i)
        if (block_of[i] == static_cast<int>(b))
          for (int buf = 0; buf < buffers; ++buf)
            for (int r = 0; r < rows; ++r) {
              const std::int64_t lo = offset[i] + buf * buffer_stride[i] + r * stride[i];
              std::fill(in_row.begin() + lo, in_row.begin() + lo + bytes[i], 1);
            }
      for (std::size_t k = 0; k < blocks[b].size(); ++k)
        if (!in_row[k] && blocks[b][k] != guard) return false;
    }
    return true;
  }
};

} // namespace foremoe_test
