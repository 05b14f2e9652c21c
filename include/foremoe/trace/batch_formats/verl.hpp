#pragma once
/// @file
/// In-memory format "verl": `routed_experts [bs, seq, L, K]` with its `attention_mask [bs, seq]`, micro-batches
/// of samples (rows).

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/trace/batch_formats.hpp"

namespace foremoe {
inline namespace v0 {

/// verl's padded batch: `arrays = {routed_experts [bs, seq, L, K]}` (any strides) and `mask` `[bs, seq]` (bool or
/// integer, 0/1; verl pads prompts on the left and the padded positions hold expert 0, so the mask is required).
/// `micro_batches` are over the samples (rows). Tokens run row by row; one part when the rows are evenly spaced
/// (`t = b * seq + s`), else one part per row.
[[nodiscard]] inline BatchLayout verl_batch_layout(const BatchInput &in) {
  using detail::require;
  const std::string &who = in.who;
  require(in.arrays.size() == 1 && !in.list_sizes, who, ": verl takes one routed_experts array, got ", in.arrays.size(),
          in.list_sizes ? " in lists" : "");
  require(!in.offsets, who, ": verl cuts micro-batches by samples (micro_batches), not by token offsets");
  const ArrayRef &a = in.arrays[0];
  detail::check_id_array(a, 4, who, "routed_experts [batch, seq, layers, topk]");
  require(in.mask.has_value(), who, ": attention_mask is required (verl's padded positions hold expert 0)");
  const ArrayRef &m = *in.mask;
  const std::int64_t bs = a.shape[0], seq = a.shape[1];
  require(m.ndim() == 2 && m.shape[0] == bs && m.shape[1] == seq, who, ": attention_mask must be [", bs, ", ", seq,
          "] to match routed_experts ", a.shape_text(), ", got ", m.shape_text());
  require(m.is_integer() || m.kind == ElemKind::bool_, who, ": attention_mask must be bool or integer, got dtype ",
          m.dtype_name());
  require(m.data != nullptr || m.size() == 0, who, ": attention_mask must be readable here (on the CPU)");

  const auto groups = micro_batch_groups(in.micro_batches, bs, who, "sample");
  require(groups.size() <= static_cast<std::size_t>(std::numeric_limits<int>::max()), who, ": ", groups.size(),
          " micro-batches is too many");
  std::vector<int> step_of(static_cast<std::size_t>(bs), 0);
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (const std::int64_t b : groups[g])
      step_of[static_cast<std::size_t>(b)] = static_cast<int>(g);

  BatchLayout out;
  out.num_micro_steps = static_cast<int>(groups.size());
  out.num_layers = static_cast<int>(a.shape[2]);
  const auto row_mask = [&](std::int64_t b) {
    return detail::mask_values(m, b * m.strides[0], m.strides[1], seq, [&](std::int64_t s) {
      return detail::concat(who, ": attention_mask[", b, ", ", s, "]");
    });
  };
  const auto part = [&](std::int64_t row, std::int64_t tokens) {
    BatchPart p;
    p.row = row;
    p.dtype = *a.id_dtype();
    p.num_tokens = tokens;
    p.num_layers = out.num_layers;
    p.topk = static_cast<int>(a.shape[3]);
    p.strides = {a.strides[1], a.strides[2], a.strides[3]};
    p.data_offset = row < 0 ? 0 : row * a.strides[0];
    const std::int64_t b0 = row < 0 ? 0 : row;
    p.where = [seq, b0](std::int64_t t, int l) {
      return detail::concat("sample ", b0 + t / seq, ", position ", t % seq, ", layer ", l);
    };
    return p;
  };
  // One stream `t = b * seq + s` when row b starts `seq` tokens after row b - 1 (a C-ordered batch).
  if (bs <= 1 || a.strides[0] == seq * a.strides[1]) {
    BatchPart p = part(-1, bs * seq);
    for (std::int64_t b = 0; b < bs; ++b) {
      const auto mb = row_mask(b);
      p.mask.insert(p.mask.end(), mb.begin(), mb.end());
      p.offsets.push_back(b * seq);
      p.micro_step.push_back(step_of[static_cast<std::size_t>(b)]);
    }
    p.offsets.push_back(bs * seq);
    if (bs == 0) p.micro_step.push_back(0), p.offsets.insert(p.offsets.begin(), 0);
    out.parts.push_back(std::move(p));
    return out;
  }
  for (std::int64_t b = 0; b < bs; ++b) {
    BatchPart p = part(b, seq);
    p.mask = row_mask(b);
    p.offsets = {0, seq};
    p.micro_step = {step_of[static_cast<std::size_t>(b)]};
    out.parts.push_back(std::move(p));
  }
  return out;
}

namespace detail {
inline const bool verl_batch_format_registered =
    (register_batch_format({"verl",
                            "routed_experts [bs, seq, L, K] with attention_mask [bs, seq] (0/1, 0 = padding);\n"
                            "micro-batches: a number of samples each, or one list of sample indices each.",
                            true, verl_batch_layout}),
     true);
} // namespace detail

} // namespace v0
} // namespace foremoe
