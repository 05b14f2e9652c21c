#pragma once
/// @file
/// Format "npy": routed ids `[tokens, layers, topk]` in execution order, as `foremoe trace gen --ids` writes them.

#include <cstdint>
#include <utility>

#include "foremoe/core/error.hpp"
#include "foremoe/trace/formats.hpp"

namespace foremoe {
inline namespace v0 {

/// Routed ids `[T, L, K]` (int8/uint8/int16/uint16/int32/int64, -1 = no route) of an NPY file or image.
[[nodiscard]] inline RoutedRecord read_ids_npy(const TraceInput &in) {
  RoutedIdsFile f = routed_ids_from_npy(in.npy(), in.path);
  RoutedRecord r;
  r.view = f.view();
  r.array = std::move(f.array); // a vector's buffer moves with it: the view stays valid
  return r;
}

namespace detail {
inline const bool npy_trace_format_registered =
    (register_trace_format(
         {"npy",
          "routed ids [T, L, K] (int8/uint8/int16/uint16/int32/int64, -1 = no route), tokens in\n"
          "execution order; FILE.microbatches.npy ([M+1] token offsets) and FILE.sources.npy\n"
          "([M*S+1]) are picked up when present, as trace gen writes them.",
          "a file no other format claims", 10, false, false, true,
          // The fallback: a file nothing else claims is read as ids, whose reader then names what is wrong.
          [](const TraceProbe &) { return 1; },
          [](const TraceInput &in, const TraceReadOptions &) { return read_ids_npy(in); }}),
     true);
} // namespace detail

} // namespace v0
} // namespace foremoe
