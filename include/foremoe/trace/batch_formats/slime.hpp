#pragma once
/// @file
/// In-memory format "slime": per-sample `rollout_routed_experts [len, L, K]`, grouped into micro-batches.

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/trace/batch_formats.hpp"

namespace foremoe {
inline namespace v0 {

/// slime's samples: `arrays` the per-sample `[len, L, K]` ids, every sample with the same `[L, K]`. With
/// `list_sizes`, one list of samples per micro-batch (`arrays` their concatenation); without, `micro_batches`
/// over the samples (index lists: every sample in exactly one). Each sample is one part.
[[nodiscard]] inline BatchLayout slime_batch_layout(const BatchInput &in) {
  using detail::require;
  const std::string &who = in.who;
  require(!in.mask && !in.offsets, who, ": slime takes samples grouped into micro-batches, no mask or token offsets");
  std::vector<std::vector<std::int64_t>> groups;
  if (in.list_sizes) {
    require(in.micro_batches.kind == MicroBatches::Kind::one, who,
            ": per-micro-batch sample lists are the micro-batches; give no other");
    require(!in.list_sizes->empty(), who, ": micro_batches must be a non-empty list of per-sample lists");
    std::int64_t next = 0;
    for (const std::int64_t n : *in.list_sizes) {
      require(n >= 0 && next + n <= static_cast<std::int64_t>(in.arrays.size()), who,
              ": list_sizes hold more than the ", in.arrays.size(), " samples given");
      auto &g = groups.emplace_back();
      for (std::int64_t i = 0; i < n; ++i)
        g.push_back(next++);
    }
    require(next == static_cast<std::int64_t>(in.arrays.size()), who, ": list_sizes hold ", next, " samples, ",
            in.arrays.size(), " given");
  } else {
    groups = micro_batch_groups(in.micro_batches, static_cast<std::int64_t>(in.arrays.size()), who, "sample");
  }
  require(groups.size() <= static_cast<std::size_t>(std::numeric_limits<int>::max()), who, ": ", groups.size(),
          " micro-batches is too many");

  BatchLayout out;
  out.num_micro_steps = static_cast<int>(groups.size());
  const ArrayRef *first = nullptr;
  for (std::size_t m = 0; m < groups.size(); ++m)
    for (std::size_t i = 0; i < groups[m].size(); ++i) {
      const auto j = static_cast<std::size_t>(groups[m][i]);
      const ArrayRef &a = in.arrays[j];
      const std::string name = in.list_sizes ? detail::concat("micro-batch ", m, ", sample ", i)
                                             : detail::concat("micro-batch ", m, ", sample ", i, " (samples[", j, "])");
      detail::check_id_array(a, 3, who, name + " [len, layers, topk]");
      if (first == nullptr) first = &a;
      require(a.shape[1] == first->shape[1] && a.shape[2] == first->shape[2], who, ": ", name, " has [layers, topk] [",
              a.shape[1], ", ", a.shape[2], "], the first sample [", first->shape[1], ", ", first->shape[2], "]");
      BatchPart p;
      p.array_idx = j;
      p.dtype = *a.id_dtype();
      p.num_tokens = a.shape[0];
      p.num_layers = static_cast<int>(a.shape[1]);
      p.topk = static_cast<int>(a.shape[2]);
      p.strides = {a.strides[0], a.strides[1], a.strides[2]};
      p.offsets = {0, a.shape[0]};
      p.micro_step = {static_cast<int>(m)};
      p.where = [name](std::int64_t t, int l) { return detail::concat(name, ", token ", t, ", layer ", l); };
      out.parts.push_back(std::move(p));
    }
  require(first != nullptr, who, ": no sample in any micro-batch (the layer count is unknown)");
  out.num_layers = static_cast<int>(first->shape[1]);
  return out;
}

namespace detail {
inline const bool slime_batch_format_registered =
    (register_batch_format({"slime",
                            "per-sample rollout_routed_experts [len, L, K]: one list of samples per micro-batch, or\n"
                            "the samples with one list of sample indices per micro-batch.",
                            true, slime_batch_layout}),
     true);
} // namespace detail

} // namespace v0
} // namespace foremoe
