#pragma once
/// @file
/// Format "megatron": Megatron-core's router-replay record `[L, T, K]`.

#include "foremoe/core/error.hpp"
#include "foremoe/trace/formats.hpp"

namespace foremoe {
inline namespace v0 {

/// Megatron-core router replay: `[num_moe_layers, tokens, topk]` integer ids, the per-layer
/// `RouterReplay.recorded_topk_idx` tensors (`[tokens, topk]`, one router instance per MoE layer in layer
/// order) stacked on a new leading axis and saved as NPY. Viewed as `[tokens, layers, topk]` without a copy.
[[nodiscard]] inline RoutedRecord read_megatron(const TraceInput &in) {
  RoutedRecord r;
  r.array = in.npy();
  const NpyArray &a = r.array;
  detail::require(a.shape.size() == 3, in.path.string(),
                  ": Megatron router replay must be [layers, tokens, topk] (stacked recorded_topk_idx), got shape ",
                  detail::shape_text(a.shape));
  detail::require_int_dim(a.shape[0], in.path, "layers");
  detail::require_int_dim(a.shape[2], in.path, "topk");
  const auto st = a.strides_elements();
  r.view = RoutedView(a.data.data(), detail::npy_id_dtype(a, in.path), a.shape[1], static_cast<int>(a.shape[0]),
                      static_cast<int>(a.shape[2]), {st[1], st[0], st[2]});
  return r;
}

namespace detail {
inline const bool megatron_trace_format_registered =
    (register_trace_format(
         {"megatron",
          "NPY [L, T, K]: Megatron-core router replay's per-layer RouterReplay.recorded_topk_idx\n"
          "([T, K] per MoE layer, layer order) stacked on axis 0 (torch.stack(...).numpy()).",
          "", 40, false, false, false,
          // A 3-D NPY is [T, L, K] ids as often as [L, T, K]: only an explicit --format megatron reads it so.
          [](const TraceProbe &) { return 0; },
          [](const TraceInput &in, const TraceReadOptions &) { return read_megatron(in); }}),
     true);
} // namespace detail

} // namespace v0
} // namespace foremoe
