#pragma once
/// @file
/// Counting routed ids into per-micro-step loads.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/load_tensor.hpp"
#include "foremoe/trace/routed_view.hpp"

namespace foremoe {
inline namespace v0 {

/// What to count and how to cut the token stream.
struct CountOptions {
  int num_experts = 0; ///< routed experts per MoE layer; ids must lie in [0, num_experts)
  /// Trace layer -> MoE layer; empty means every trace layer is an MoE layer.
  LayerMap layer_map{};
  /// `[M + 1]` token offsets in execution order: micro-step `m` is tokens
  /// `[offsets[m], offsets[m+1])`. Must start at 0, never decrease and end at
  /// `num_tokens`. Empty means one micro-step holding every token.
  std::span<const std::int64_t> microbatch_offsets{};
  /// > 0 to also split loads by source EP rank.
  int num_sources = 0;
  /// `[M * num_sources + 1]` token offsets refining `microbatch_offsets`: tokens
  /// of micro-step `m` held by rank `r` are `[so[m*S + r], so[m*S + r + 1])`.
  /// Empty with `num_sources > 0` splits each micro-step into equal ranges.
  std::span<const std::int64_t> source_offsets{};
  /// `[num_tokens]` per-token mask: tokens with `mask[t] == 0` are not counted
  /// (padding, e.g. verl's left-padded `routed_experts` under its attention
  /// mask). Empty counts every token. Offsets still index the unmasked stream.
  std::span<const std::uint8_t> mask{};
};

namespace detail {

// Token ranges are counted into 32-bit bins; this bounds a range so that no
// bin can overflow even if every id of every token hits one expert.
[[nodiscard]] constexpr std::int64_t count_chunk_tokens(int topk) noexcept {
  return (std::int64_t{1} << 31) / (topk > 0 ? topk : 1);
}

inline void check_offsets(std::span<const std::int64_t> offsets, std::int64_t num_tokens, const char *what) {
  require(offsets.size() >= 2, what, ": need at least 2 offsets (start and end), got ", offsets.size());
  require(offsets.front() == 0, what, "[0] must be 0, got ", offsets.front());
  for (std::size_t i = 1; i < offsets.size(); ++i)
    require(offsets[i] >= offsets[i - 1], what, " decrease at index ", i, ": ", offsets[i - 1], " then ", offsets[i]);
  require(offsets.back() == num_tokens, what, " end at ", offsets.back(), " but the trace has ", num_tokens, " tokens");
}

/// Bins per MoE layer: `[0]` no route, `[1 + e]` expert `e`, `[E + 1]` out of range.
[[nodiscard]] constexpr std::size_t count_row(int num_experts) noexcept {
  return static_cast<std::size_t>(num_experts) + 2;
}

/// Counts tokens `[t0, t1)` into `bins[moe_layer * count_row(E) + 1 + id]`.
/// Each id is shifted by one so that "no route" lands in bin 0 and clamped so
/// that anything out of range lands in the last bin: two instructions per id
/// and no branch; the caller checks the last bins once per range.
template <class T, bool Contiguous>
void count_range(const RoutedView &v, std::int64_t t0, std::int64_t t1, const int *moe_of, int num_experts,
                 std::uint32_t *bins, const std::uint8_t *mask) {
  const T *ids = static_cast<const T *>(v.data());
  const int num_layers = v.num_layers(), topk = v.topk();
  const auto [s0, s1, s2] = v.strides();
  const std::uint64_t overflow_bin = static_cast<std::uint64_t>(num_experts) + 1;
  // Unsigned all-ones means "no route" only when it is not a valid expert id.
  constexpr bool unsigned_ids = std::is_unsigned_v<T>;
  const bool wrap = unsigned_ids && num_experts <= static_cast<int>(std::numeric_limits<T>::max());
  const std::size_t row = count_row(num_experts);
  for (std::int64_t t = t0; t < t1; ++t) {
    if (mask != nullptr && mask[t] == 0) continue; // one predictable byte load per token, not per id
    for (int l = 0; l < num_layers; ++l) {
      const int ml = moe_of[l];
      if (ml < 0) continue;
      std::uint32_t *b = bins + static_cast<std::size_t>(ml) * row;
      const T *p = Contiguous ? ids + (t * num_layers + l) * topk : ids + t * s0 + l * s1;
      for (int k = 0; k < topk; ++k) {
        const T x = Contiguous ? p[k] : p[k * s2];
        std::uint64_t u;
        if constexpr (unsigned_ids) {
          u = static_cast<std::uint64_t>(x) + 1;
          if (wrap) u = static_cast<T>(u); // all-ones + 1 wraps to bin 0
        } else {
          u = static_cast<std::uint64_t>(static_cast<std::int64_t>(x)) + 1; // -1 -> 0
        }
        ++b[u < overflow_bin ? u : overflow_bin];
      }
    }
  }
}

[[noreturn]] inline void report_bad_id(const RoutedView &v, std::int64_t t0, std::int64_t t1, const int *moe_of,
                                       int num_experts, const std::uint8_t *mask) {
  for (std::int64_t t = t0; t < t1; ++t)
    if (mask == nullptr || mask[t] != 0)
      for (int l = 0; l < v.num_layers(); ++l) {
        if (moe_of[l] < 0) continue;
        for (int k = 0; k < v.topk(); ++k) {
          const std::int64_t id = v.at(t, l, k, num_experts);
          if (id != -1 && (id < 0 || id >= num_experts))
            fail("count_loads: expert id ", id, " at token ", t, ", layer ", l, ", k ", k, " is outside [0, ",
                 num_experts, ") (", to_string(v.dtype()), " ids, -1 = no route)");
        }
      }
  fail("count_loads: internal error: bad id flagged in tokens [", t0, ", ", t1, ") but not found");
}

} // namespace detail

/// Counts `ids` into a `LoadTensor [M][moe_layers][E]` (with `[src]` split when
/// `opts.num_sources > 0`). Throws `Error` for an id outside `[0, E)` other
/// than "no route", for offsets that do not cover the trace exactly, and for a
/// layer map that does not match the trace. Contiguous traces take a
/// branch-free path that counts over a billion ids per second on one core.
[[nodiscard]] inline LoadTensor count_loads(const RoutedView &ids, const CountOptions &opts) {
  using detail::require;
  require(opts.num_experts > 0, "count_loads: num_experts must be positive, got ", opts.num_experts);
  require(opts.num_experts < (1 << 30), "count_loads: num_experts ", opts.num_experts, " is too large");
  const LayerMap lmap = opts.layer_map.empty() ? LayerMap::identity(ids.num_layers()) : opts.layer_map;
  require(lmap.num_trace_layers() == ids.num_layers(), "count_loads: layer map covers ", lmap.num_trace_layers(),
          " trace layers but the trace has ", ids.num_layers());
  const std::int64_t num_tokens = ids.num_tokens();

  std::vector<std::int64_t> whole;
  std::span<const std::int64_t> mb = opts.microbatch_offsets;
  if (mb.empty()) {
    whole = {0, num_tokens};
    mb = whole;
  }
  detail::check_offsets(mb, num_tokens, "microbatch_offsets");
  require(mb.size() - 1 <= static_cast<std::size_t>(std::numeric_limits<int>::max()),
          "count_loads: too many micro-steps: ", mb.size() - 1);
  const int num_micro_steps = static_cast<int>(mb.size() - 1);

  const int num_sources = opts.num_sources;
  require(num_sources >= 0, "count_loads: num_sources must be >= 0, got ", num_sources);
  // The output's shape first: the even source offsets below take micro-steps x sources entries.
  LoadTensor::require_shape(num_micro_steps, lmap.num_moe_layers(), opts.num_experts, num_sources);
  std::vector<std::int64_t> even;
  std::span<const std::int64_t> so = opts.source_offsets;
  if (num_sources > 0) {
    if (so.empty()) {
      even.reserve(static_cast<std::size_t>(num_micro_steps) * num_sources + 1);
      for (int m = 0; m < num_micro_steps; ++m) {
        const std::int64_t n = mb[m + 1] - mb[m];
        for (int r = 0; r < num_sources; ++r)
          even.push_back(mb[m] + n * r / num_sources);
      }
      even.push_back(num_tokens);
      so = even;
    }
    require(so.size() == static_cast<std::size_t>(num_micro_steps) * num_sources + 1, "count_loads: ", so.size(),
            " source_offsets for ", num_micro_steps, " micro-steps x ", num_sources, " sources, expected ",
            static_cast<std::size_t>(num_micro_steps) * num_sources + 1);
    detail::check_offsets(so, num_tokens, "source_offsets");
    for (int m = 0; m < num_micro_steps; ++m)
      require(so[static_cast<std::size_t>(m) * num_sources] == mb[m], "source_offsets[", m * num_sources,
              "] = ", so[static_cast<std::size_t>(m) * num_sources], " does not start micro-step ", m, " at token ",
              mb[m]);
  } else {
    require(so.empty(), "count_loads: source_offsets given but num_sources is 0");
  }

  const int num_moe = lmap.num_moe_layers();
  const int num_experts = opts.num_experts;
  LoadTensor out(num_micro_steps, num_moe, num_experts, num_sources);
  const std::size_t row = detail::count_row(num_experts);
  std::vector<std::uint32_t> bins(static_cast<std::size_t>(num_moe) * row);
  const int *moe_of = lmap.map().data();
  const bool contiguous = ids.is_contiguous();
  require(opts.mask.empty() || static_cast<std::int64_t>(opts.mask.size()) == num_tokens, "count_loads: mask has ",
          opts.mask.size(), " entries but the trace has ", num_tokens, " tokens");
  const std::uint8_t *mask = opts.mask.empty() ? nullptr : opts.mask.data();

  // Counts `[t0, t1)`, at most `count_chunk_tokens()` long, into fresh bins.
  auto count_into_bins = [&](std::int64_t t0, std::int64_t t1) {
    std::fill(bins.begin(), bins.end(), 0u);
    visit_id_dtype(ids.dtype(), [&](auto tag) {
      using T = decltype(tag);
      // A top-k fixed at compile time (fully unrolled) measured slower than this loop.
      if (contiguous)
        detail::count_range<T, true>(ids, t0, t1, moe_of, num_experts, bins.data(), mask);
      else
        detail::count_range<T, false>(ids, t0, t1, moe_of, num_experts, bins.data(), mask);
    });
    for (int l = 0; l < num_moe; ++l)
      if (bins[static_cast<std::size_t>(l) * row + row - 1] != 0) [[unlikely]]
        detail::report_bad_id(ids, t0, t1, moe_of, num_experts, mask);
  };

  // Per-source counts of the current micro-step, `[src][layer][expert]`, so
  // that every range adds into contiguous memory; transposed into the
  // tensor's `[layer][expert][src]` once per micro-step, a layer at a time
  // (scattering each range straight into the split missed cache on every id).
  std::vector<std::int64_t> staged(num_sources > 0 ? static_cast<std::size_t>(num_sources) * num_moe * num_experts : 0);
  const std::size_t layer_cells = static_cast<std::size_t>(num_moe) * num_experts;

  // Adds `[t0, t1)` to micro-step m (and to source r's staging when r >= 0).
  auto add_range = [&](int m, int r, std::int64_t t0, std::int64_t t1) {
    const std::int64_t chunk = detail::count_chunk_tokens(ids.topk());
    for (std::int64_t c0 = t0; c0 < t1; c0 += chunk) {
      const std::int64_t c1 = std::min(t1, c0 + chunk);
      count_into_bins(c0, c1);
      for (int l = 0; l < num_moe; ++l) {
        const std::uint32_t *b = bins.data() + static_cast<std::size_t>(l) * row + 1;
        auto tot = out.layer(m, l);
        for (int e = 0; e < num_experts; ++e)
          tot[e] += b[e];
        if (r >= 0) {
          std::int64_t *st =
              staged.data() + static_cast<std::size_t>(r) * layer_cells + static_cast<std::size_t>(l) * num_experts;
          for (int e = 0; e < num_experts; ++e)
            st[e] += b[e];
        }
      }
    }
  };

  for (int m = 0; m < num_micro_steps; ++m) {
    if (num_sources == 0) {
      add_range(m, -1, mb[m], mb[m + 1]);
      continue;
    }
    std::fill(staged.begin(), staged.end(), 0);
    for (int r = 0; r < num_sources; ++r) {
      const std::size_t i = static_cast<std::size_t>(m) * num_sources + r;
      if (so[i] < so[i + 1]) add_range(m, r, so[i], so[i + 1]);
    }
    for (int l = 0; l < num_moe; ++l) {
      auto src = out.layer_by_source(m, l);
      for (int r = 0; r < num_sources; ++r) {
        const std::int64_t *st =
            staged.data() + static_cast<std::size_t>(r) * layer_cells + static_cast<std::size_t>(l) * num_experts;
        for (int e = 0; e < num_experts; ++e)
          src[static_cast<std::size_t>(e) * num_sources + r] = st[e];
      }
    }
  }
  return out;
}

/// Convenience: contiguous `[T][L][K]` ids of any supported integer type.
template <class T>
[[nodiscard]] LoadTensor count_loads(std::span<const T> ids, std::int64_t num_tokens, int num_layers, int topk,
                                     const CountOptions &opts) {
  return count_loads(RoutedView(ids, num_tokens, num_layers, topk), opts);
}

} // namespace v0
} // namespace foremoe
