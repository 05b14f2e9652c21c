#pragma once
// Test helper shared by the transfer-engine suites: every expert of every layer has its own byte pattern across
// its tensors, so a misplaced, stale or partial byte shows.

#include <cstddef>
#include <cstdint>
#include <span>

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
