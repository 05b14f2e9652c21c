#pragma once
/// @file
/// In-memory format "megatron": Megatron-core's per-layer router indices `[T, K]`, for the stage with token
/// offsets or one list per micro-batch.

#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/trace/batch_formats.hpp"

namespace foremoe {
inline namespace v0 {

namespace detail {
/// The parts of one micro-batch's (or the stage's) per-layer `[T, K]` arrays `arrays[first, first + n)`, cut at
/// `offsets` into micro-steps `step0, step0 + 1, ...`; `prefix` starts messages ("who: " or "who: micro-batch m: "),
/// `loc` starts a bad id's place ("" or "micro-batch m, ").
inline void megatron_parts(const BatchInput &in, std::size_t first, std::size_t n,
                           std::span<const std::int64_t> offsets, int step0, const std::string &prefix,
                           const std::string &loc, BatchLayout &out) {
  require(n > 0, prefix, "per_layer must be a non-empty list of [tokens, topk] tensors (one per MoE layer)");
  const ArrayRef &a0 = in.arrays[first];
  for (std::size_t l = 0; l < n; ++l) {
    const ArrayRef &a = in.arrays[first + l];
    check_id_array(a, 2, prefix.substr(0, prefix.size() - 2), concat("layer ", l, "'s indices [tokens, topk]"));
    require(a.shape == a0.shape, prefix, "layer ", l, " has indices ", a.shape_text(), ", layer 0 ", a0.shape_text(),
            " (every MoE layer routes the same tokens)");
  }
  const std::int64_t T = a0.shape[0];
  const std::vector<std::int64_t> whole = {0, T};
  if (offsets.empty()) offsets = whole;
  try {
    check_offsets(offsets, T, "microbatch_offsets");
  } catch (const Error &e) {
    fail(prefix, e.what());
  }
  for (std::size_t l = 0; l < n; ++l) {
    const ArrayRef &a = in.arrays[first + l];
    BatchPart p;
    p.array_idx = first + l;
    p.dtype = *a.id_dtype();
    p.num_tokens = T;
    p.topk = static_cast<int>(a.shape[1]);
    p.strides = {a.strides[0], std::int64_t{p.topk} * a.strides[1], a.strides[1]};
    p.offsets.assign(offsets.begin(), offsets.end());
    for (std::size_t s = 0; s + 1 < offsets.size(); ++s)
      p.micro_step.push_back(step0 + static_cast<int>(s));
    p.first_layer = static_cast<int>(l);
    p.where = [loc](std::int64_t t, int layer) { return concat(loc, "token ", t, ", layer ", layer); };
    out.parts.push_back(std::move(p));
  }
}
} // namespace detail

/// Megatron-core's router indices (what `RouterReplay.set_replay_data` takes): `arrays` one `[T, K]` per MoE layer
/// for the stage, cut at `offsets` (none: one micro-step); or, with `list_sizes`, one per-layer list per
/// micro-batch (no `offsets`: the lists are the boundaries), every list with the same number of layers.
[[nodiscard]] inline BatchLayout megatron_batch_layout(const BatchInput &in) {
  using detail::require;
  const std::string &who = in.who;
  require(in.micro_batches.kind == MicroBatches::Kind::one && !in.mask, who,
          ": megatron takes token offsets or per-micro-batch lists, no sample micro-batches or mask");
  BatchLayout out;
  if (!in.list_sizes) {
    const std::span<const std::int64_t> off = in.offsets.value_or(std::span<const std::int64_t>{});
    require(off.empty() || off.size() - 1 <= static_cast<std::size_t>(std::numeric_limits<int>::max()), who,
            ": too many micro-steps: ", off.size() - 1);
    out.num_layers = static_cast<int>(in.arrays.size());
    detail::megatron_parts(in, 0, in.arrays.size(), off, 0, who + ": ", "", out);
    out.num_micro_steps = off.empty() ? 1 : static_cast<int>(off.size() - 1);
    return out;
  }
  require(!in.offsets, who, ": per-micro-batch lists carry their own boundaries; leave microbatch_offsets out");
  const auto &sizes = *in.list_sizes;
  require(!sizes.empty(), who, ": per_layer must be a non-empty list of per-micro-batch lists");
  require(sizes.size() <= static_cast<std::size_t>(std::numeric_limits<int>::max()), who, ": ", sizes.size(),
          " micro-batches is too many");
  std::size_t first = 0;
  for (std::size_t m = 0; m < sizes.size(); ++m) {
    require(sizes[m] == sizes[0], who, ": micro-batch ", m, " has ", sizes[m], " MoE layers, micro-batch 0 has ",
            sizes[0]);
    require(sizes[m] >= 0 && first + static_cast<std::size_t>(sizes[m]) <= in.arrays.size(), who,
            ": list_sizes hold more arrays than the ", in.arrays.size(), " given");
    detail::megatron_parts(in, first, static_cast<std::size_t>(sizes[m]), {}, static_cast<int>(m),
                           detail::concat(who, ": micro-batch ", m, ": "), detail::concat("micro-batch ", m, ", "),
                           out);
    first += static_cast<std::size_t>(sizes[m]);
  }
  require(first == in.arrays.size(), who, ": list_sizes hold ", first, " arrays, ", in.arrays.size(), " given");
  out.num_layers = static_cast<int>(sizes[0]);
  out.num_micro_steps = static_cast<int>(sizes.size());
  return out;
}

namespace detail {
inline const bool megatron_batch_format_registered =
    (register_batch_format({"megatron",
                            "one [T, K] index tensor per MoE layer (RouterReplay's recorded_topk_idx) with token\n"
                            "offsets, or one such per-layer list per micro-batch.",
                            false, megatron_batch_layout}),
     true);
} // namespace detail

} // namespace v0
} // namespace foremoe
