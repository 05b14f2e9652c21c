#pragma once
/// @file
/// Token -> physical slot mapping from a plan's token split: the CPU reference that the runtime's device mapping
/// matches exactly.
///
/// Rule: the copies of expert `e` in ascending physical-slot order (`gpu * slots + slot`) get consecutive token
/// ranges `[0, n0), [n0, n0 + n1), ...` of the sizes the plan gives them; the `i`-th occurrence of `e` in
/// `(token, k)` order goes to the copy whose range contains `i`. With a split by source rank (see
/// `split_by_source`), the tokens of one micro-step are grouped by source rank (`source_offsets`), and ranks and
/// ranges are kept per (source, expert): the `i`-th occurrence of `e` among the tokens of source `s` goes to the
/// copy whose range over `s`'s counts contains `i`. Copies given no tokens receive none.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/plan/plan.hpp"
#include "foremoe/trace/count.hpp"
#include "foremoe/trace/routed_view.hpp"

namespace foremoe {
inline namespace v0 {

/// The token ranges of one layer's copies, per source rank, in the form both the CPU and the device mapping read.
struct TokenRanges {
  int num_experts = 0;
  int num_sources = 1;
  int num_slots = 0;                      ///< physical slots (`gpus * slots`)
  std::vector<std::int32_t> copy_offsets; ///< `[experts + 1]`: copies of `e` are `[copy_offsets[e], copy_offsets[e+1])`
  std::vector<std::int32_t> copy_slot;    ///< `[copies]` physical slot of each copy, ascending per expert
  /// `[sources][copies]`: end of each copy's range, the inclusive prefix sum over the expert's copies of the tokens
  /// the copy takes from the source.
  std::vector<std::int64_t> copy_end;

  [[nodiscard]] int num_copies() const noexcept { return static_cast<int>(copy_slot.size()); }
  /// Tokens of expert `e` from source `src` summed over its copies.
  [[nodiscard]] std::int64_t expert_tokens(int e, int src = 0) const noexcept {
    const std::int32_t first = copy_offsets[e], last = copy_offsets[e + 1];
    return first == last ? 0 : copy_end[static_cast<std::size_t>(src) * copy_slot.size() + last - 1];
  }
};

/// Token ranges from a physical -> logical table (`empty_slot` for an empty slot) and the tokens of every slot:
/// `slot_tokens` is `[slots]` for `num_sources == 1`, `[slots][num_sources]` otherwise (what `split_by_source`
/// returns). Throws `Error` naming a bad expert id, a negative count or tokens sent to an empty slot.
[[nodiscard]] inline TokenRanges token_ranges(std::span<const std::int32_t> slot_expert, int num_experts,
                                              std::span<const std::int64_t> slot_tokens, int num_sources = 1) {
  using detail::require;
  require(num_experts > 0, "token_ranges: num_experts must be positive, got ", num_experts);
  require(num_sources > 0, "token_ranges: num_sources must be positive, got ", num_sources);
  const auto num_slots = static_cast<std::int64_t>(slot_expert.size());
  require(num_slots > 0 && num_slots < (std::int64_t{1} << 31), "token_ranges: ", num_slots, " slots");
  require(static_cast<std::int64_t>(slot_tokens.size()) == num_slots * num_sources,
          "token_ranges: ", slot_tokens.size(), " slot token counts for ", num_slots, " slots x ", num_sources,
          " sources, expected ", num_slots * num_sources);
  TokenRanges r;
  r.num_experts = num_experts;
  r.num_sources = num_sources;
  r.num_slots = static_cast<int>(num_slots);
  r.copy_offsets.assign(static_cast<std::size_t>(num_experts) + 1, 0);
  for (std::int64_t p = 0; p < num_slots; ++p) {
    const std::int32_t e = slot_expert[p];
    require(e == empty_slot || (e >= 0 && e < num_experts), "token_ranges: slot ", p, " holds expert id ", e,
            ", outside [0, ", num_experts, ") and not empty (", empty_slot, ")");
    for (int s = 0; s < num_sources; ++s) {
      const std::int64_t t = slot_tokens[p * num_sources + s];
      require(t >= 0, "token_ranges: slot ", p, " source ", s, " gets a negative token count ", t);
      require(t == 0 || e != empty_slot, "token_ranges: empty slot ", p, " gets ", t, " tokens from source ", s);
    }
    if (e != empty_slot) ++r.copy_offsets[e + 1];
  }
  for (int e = 0; e < num_experts; ++e)
    r.copy_offsets[e + 1] += r.copy_offsets[e];
  const std::size_t num_copies = static_cast<std::size_t>(r.copy_offsets.back());
  r.copy_slot.resize(num_copies);
  std::vector<std::int32_t> fill(r.copy_offsets.begin(), r.copy_offsets.end() - 1);
  for (std::int64_t p = 0; p < num_slots; ++p)
    if (const std::int32_t e = slot_expert[p]; e != empty_slot) r.copy_slot[fill[e]++] = static_cast<std::int32_t>(p);
  r.copy_end.resize(num_copies * num_sources);
  for (int s = 0; s < num_sources; ++s) {
    std::int64_t *end = r.copy_end.data() + static_cast<std::size_t>(s) * num_copies;
    for (int e = 0; e < num_experts; ++e) {
      std::int64_t sum = 0;
      for (std::int32_t c = r.copy_offsets[e]; c < r.copy_offsets[e + 1]; ++c)
        end[c] = sum += slot_tokens[static_cast<std::size_t>(r.copy_slot[c]) * num_sources + s];
    }
  }
  return r;
}

/// Token ranges of a placement and its per-slot tokens (`[slots]`, or `[slots][num_sources]`).
[[nodiscard]] inline TokenRanges token_ranges(const LayerPlacement &placement,
                                              std::span<const std::int64_t> slot_tokens, int num_sources = 1) {
  return token_ranges(placement.phys_to_log(), placement.num_experts(), slot_tokens, num_sources);
}

/// Token ranges of a layer plan's split (one source: the plan's `slot_tokens`).
[[nodiscard]] inline TokenRanges token_ranges(const LayerPlan &plan) {
  return token_ranges(plan.placement, plan.slot_tokens, 1);
}

namespace detail {

/// `[num_sources + 1]` token offsets: `given` checked against `num_tokens`, or equal ranges when empty (as
/// `count_loads` splits a micro-step without source offsets).
[[nodiscard]] inline std::vector<std::int64_t> source_ranges(std::span<const std::int64_t> given, int num_sources,
                                                             std::int64_t num_tokens) {
  std::vector<std::int64_t> so;
  if (given.empty()) {
    for (int s = 0; s <= num_sources; ++s)
      so.push_back(num_tokens * s / num_sources);
    return so;
  }
  require(static_cast<int>(given.size()) == num_sources + 1, "map_tokens: ", given.size(), " source offsets for ",
          num_sources, " sources, expected ", num_sources + 1);
  check_offsets(given, num_tokens, "map_tokens: source_offsets");
  so.assign(given.begin(), given.end());
  return so;
}

[[noreturn]] inline void fail_count_mismatch(const TokenRanges &r, int layer_idx, std::int64_t key,
                                             std::int64_t routed) {
  const int e = static_cast<int>(key % r.num_experts), s = static_cast<int>(key / r.num_experts);
  if (r.num_sources == 1)
    fail("map_tokens: layer ", layer_idx, ": expert ", e, " has ", routed, " routed tokens but the plan gives its ",
         r.copy_offsets[e + 1] - r.copy_offsets[e], " copies ", r.expert_tokens(e, s));
  fail("map_tokens: layer ", layer_idx, ": expert ", e, " has ", routed, " routed tokens from source ", s,
       " but the plan gives its ", r.copy_offsets[e + 1] - r.copy_offsets[e], " copies ", r.expert_tokens(e, s),
       " from that source");
}

/// Mapping state of one (source, expert): the rank of its next occurrence and the copy that rank falls in.
struct MapCursor {
  std::int64_t rank = 0;  ///< occurrences seen so far
  std::int64_t bound = 0; ///< end of the current copy's range (INT64_MAX past the last copy)
  std::int32_t slot = -1; ///< physical slot of the current copy (-1 past the last copy)
  std::int32_t copy = 0;  ///< index of the current copy in `TokenRanges::copy_slot`
};

/// Moves `c` to the first copy of `e` whose range end exceeds its rank (skipping copies given no tokens).
inline void advance(MapCursor &c, const TokenRanges &r, const std::int64_t *end, int e) noexcept {
  const std::int32_t last = r.copy_offsets[e + 1];
  while (c.copy < last && end[c.copy] <= c.rank)
    ++c.copy;
  c.bound = c.copy < last ? end[c.copy] : std::numeric_limits<std::int64_t>::max();
  c.slot = c.copy < last ? r.copy_slot[c.copy] : -1; // past the plan's total: reported after the pass
}

template <class T, bool Contiguous>
void map_layer(const TokenRanges &r, const RoutedView &ids, int layer_idx, std::span<const std::int64_t> so,
               std::int32_t *out, std::vector<MapCursor> &cursors) {
  const T *data = static_cast<const T *>(ids.data());
  const auto [s0, s1, s2] = ids.strides();
  const int topk = ids.topk(), num_experts = r.num_experts;
  const std::size_t num_copies = r.copy_slot.size();
  for (int s = 0; s < r.num_sources; ++s) {
    const std::int64_t *end = r.copy_end.data() + static_cast<std::size_t>(s) * num_copies;
    MapCursor *cur = cursors.data() + static_cast<std::size_t>(s) * num_experts;
    for (int e = 0; e < num_experts; ++e) {
      cur[e].copy = r.copy_offsets[e];
      advance(cur[e], r, end, e);
    }
    for (std::int64_t t = so[s]; t < so[s + 1]; ++t) {
      const T *p = data + t * s0 + layer_idx * s1;
      std::int32_t *o = out + t * topk;
      for (int k = 0; k < topk; ++k) {
        const std::int64_t e = RoutedView::widen(Contiguous ? p[k] : p[k * s2], num_experts);
        if (static_cast<std::uint64_t>(e) >= static_cast<std::uint64_t>(num_experts)) [[unlikely]] {
          if (e == -1) {
            o[k] = -1;
            continue;
          }
          fail("map_tokens: expert id ", e, " at token ", t, ", layer ", layer_idx, ", k ", k, " is outside [0, ",
               num_experts, ") (", to_string(ids.dtype()), " ids, -1 = no route)");
        }
        // Ranks only grow, so each (source, expert) walks its copies once: amortised O(1) per id.
        MapCursor &c = cur[e];
        if (c.rank >= c.bound) [[unlikely]]
          advance(c, r, end, static_cast<int>(e));
        o[k] = c.slot;
        ++c.rank;
      }
    }
  }
}

} // namespace detail

/// Maps trace layer `layer_idx` of `ids` (`[tokens, layers, topk]`, any dtype and strides) through `ranges`:
/// `out[t * topk + k]` is the physical slot of `(t, k)`, -1 for no route. `source_offsets` (`[sources + 1]` token
/// offsets, start 0, end `num_tokens`) groups the tokens by source rank; empty means equal ranges (and is the
/// only choice that matters for one source). Throws `Error` for an id outside `[0, experts)`, naming it and its
/// place, and for an expert (and source) whose routed count differs from the plan's total, naming both counts.
inline void map_tokens(const TokenRanges &ranges, const RoutedView &ids, int layer_idx, std::span<std::int32_t> out,
                       std::span<const std::int64_t> source_offsets = {}) {
  using detail::require;
  require(layer_idx >= 0 && layer_idx < ids.num_layers(), "map_tokens: layer ", layer_idx, " outside [0, ",
          ids.num_layers(), ")");
  require(ranges.num_experts > 0 && ranges.num_sources > 0 &&
              ranges.copy_offsets.size() == static_cast<std::size_t>(ranges.num_experts) + 1 &&
              ranges.copy_end.size() == ranges.copy_slot.size() * ranges.num_sources,
          "map_tokens: malformed token ranges (build them with token_ranges)");
  require(static_cast<std::int64_t>(out.size()) == ids.num_tokens() * ids.topk(), "map_tokens: output has ", out.size(),
          " entries for ", ids.num_tokens(), " tokens x top-", ids.topk());
  const auto so = detail::source_ranges(source_offsets, ranges.num_sources, ids.num_tokens());
  const std::size_t num_keys = static_cast<std::size_t>(ranges.num_sources) * ranges.num_experts;
  std::vector<detail::MapCursor> cursors(num_keys);
  const bool contiguous = ids.strides()[2] == 1;
  visit_id_dtype(ids.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if (contiguous)
      detail::map_layer<T, true>(ranges, ids, layer_idx, so, out.data(), cursors);
    else
      detail::map_layer<T, false>(ranges, ids, layer_idx, so, out.data(), cursors);
  });
  for (std::size_t key = 0; key < num_keys; ++key) {
    const auto e = static_cast<int>(key % ranges.num_experts), s = static_cast<int>(key / ranges.num_experts);
    if (cursors[key].rank != ranges.expert_tokens(e, s)) [[unlikely]]
      detail::fail_count_mismatch(ranges, layer_idx, static_cast<std::int64_t>(key), cursors[key].rank);
  }
}

/// Maps trace layer `layer_idx` of `ids` through `plan`'s split (one source); returns `[tokens][topk]` slots.
[[nodiscard]] inline std::vector<std::int32_t> map_tokens(const LayerPlan &plan, const RoutedView &ids, int layer_idx) {
  std::vector<std::int32_t> out(static_cast<std::size_t>(ids.num_tokens()) * ids.topk());
  map_tokens(token_ranges(plan), ids, layer_idx, out);
  return out;
}

/// Maps every MoE layer of one micro-step: `ranges[moe_layer]` for each trace layer that `layer_map` (empty:
/// identity) makes an MoE layer. `out` has the shape of `ids`, C order `[tokens][trace layers][topk]`; dense
/// layers get -1.
inline void map_tokens(std::span<const TokenRanges> ranges, const RoutedView &ids, const LayerMap &layer_map,
                       std::span<std::int32_t> out, std::span<const std::int64_t> source_offsets = {}) {
  using detail::require;
  const LayerMap lmap = layer_map.empty() ? LayerMap::identity(ids.num_layers()) : layer_map;
  require(lmap.num_trace_layers() == ids.num_layers(), "map_tokens: layer map covers ", lmap.num_trace_layers(),
          " trace layers but the trace has ", ids.num_layers());
  require(static_cast<int>(ranges.size()) == lmap.num_moe_layers(), "map_tokens: ", ranges.size(), " layer plans for ",
          lmap.num_moe_layers(), " MoE layers");
  const std::int64_t num_tokens = ids.num_tokens();
  const int num_layers = ids.num_layers(), topk = ids.topk();
  require(static_cast<std::int64_t>(out.size()) == num_tokens * num_layers * topk, "map_tokens: output has ",
          out.size(), " entries for shape [", num_tokens, ", ", num_layers, ", ", topk, "]");
  std::vector<std::int32_t> layer_out(static_cast<std::size_t>(num_tokens) * topk);
  for (int l = 0; l < num_layers; ++l) {
    const int ml = lmap.moe_layer(l);
    if (ml >= 0)
      map_tokens(ranges[ml], ids, l, layer_out, source_offsets);
    else
      std::fill(layer_out.begin(), layer_out.end(), -1);
    for (std::int64_t t = 0; t < num_tokens; ++t)
      std::copy_n(layer_out.data() + t * topk, topk, out.data() + (t * num_layers + l) * topk);
  }
}

/// Maps every MoE layer of one micro-step through its plan (`plans[moe_layer]`, one source); returns
/// `[tokens][trace layers][topk]` slots, -1 for no route and for dense layers.
[[nodiscard]] inline std::vector<std::int32_t> map_tokens(std::span<const LayerPlan> plans, const RoutedView &ids,
                                                          const LayerMap &layer_map = {}) {
  std::vector<TokenRanges> ranges;
  ranges.reserve(plans.size());
  for (const LayerPlan &p : plans)
    ranges.push_back(token_ranges(p));
  std::vector<std::int32_t> out(static_cast<std::size_t>(ids.num_tokens()) * ids.num_layers() * ids.topk());
  map_tokens(ranges, ids, layer_map, out);
  return out;
}

} // namespace v0
} // namespace foremoe
