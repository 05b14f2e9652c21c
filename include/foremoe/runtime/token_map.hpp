#pragma once
/// @file
/// Token -> physical slot mapping in the compiled runtime: each routed `(token, k)` of one layer goes to the copy
/// of its expert whose prefix range of the plan's split contains its rank (see `foremoe/plan/token_map.hpp`, the
/// CPU reference every backend matches exactly). CUDA handles cross this API as opaque pointers.

#include <cstdint>
#include <span>

#include "foremoe/runtime/runtime.hpp"
#include "foremoe/runtime/status.hpp"
#include "foremoe/trace/routed_view.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime {

/// Mapping request for one layer of one micro-step: contiguous `[tokens][layers][topk]` ids plus the layer's plan.
struct MapRequest {
  const void *ids = nullptr; ///< host memory (host backend) or device memory (CUDA)
  IdDtype dtype = IdDtype::i32;
  std::int64_t num_tokens = 0;
  int num_layers = 0; ///< trace layers in `ids`
  int topk = 0;
  int layer_idx = 0; ///< the trace layer to map
  int num_experts = 0;
  /// Host memory, `[gpus * slots]`: logical expert of each physical slot or -1 (`LayerPlacement::phys_to_log()`).
  std::span<const std::int32_t> slot_expert{};
  /// Host memory: tokens of each physical slot, `[gpus * slots]` (`LayerPlan::slot_tokens`) for one source, or
  /// `[gpus * slots][num_sources]` (`split_by_source`).
  std::span<const std::int64_t> slot_tokens{};
  int num_sources = 1;
  /// Host memory, `[num_sources + 1]` token offsets grouping the tokens by source rank; empty = equal ranges.
  std::span<const std::int64_t> source_offsets{};
};

/// Writes the physical slot (`gpu * slots + slot`) of every `(token, k)` of `req.layer_idx` into
/// `out_slots[token * topk + k]` (int32, -1 for no route; host memory for the host backend, device memory for
/// CUDA; `out_slots.size()` must be `num_tokens * topk`, or `invalid_argument` names both sizes). The CUDA
/// backend enqueues on `stream` (a `cudaStream_t`, null = legacy default) and waits for it, at most `timeout_ms`,
/// to check the ids and counts. An id outside `[0, num_experts)` or an expert whose routed count differs from the
/// plan's total gives `invalid_argument` naming it; a backend not built or without a device gives `unavailable`;
/// a late device `timed_out`, in which case the enqueued work may still write `out_slots` later (its scratch
/// memory is left to it rather than freed under it). The hot-path form is `map_tokens_async`.
[[nodiscard]] Status map_tokens(Backend backend, const MapRequest &req, std::span<std::int32_t> out_slots,
                                void *stream = nullptr, int timeout_ms = 60000);

/// Enqueues the mapping of `req` into `out_slots` (as `map_tokens`) on `stream` without waiting for it: the plan's
/// ranges go up from the workspace's pinned staging, ids and counts are checked on the device and reported by
/// `ws.check()`. Returns at once with `invalid_argument` for a bad request or output size, `unavailable` for a
/// missing backend or device, `device_error` for a launch that failed.
[[nodiscard]] Status map_tokens_async(Workspace &ws, const MapRequest &req, std::span<std::int32_t> out_slots,
                                      void *stream = nullptr);

} // namespace runtime
} // namespace v0
} // namespace foremoe
