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
/// copy whose range over `s`'s counts contains `i`. Copies given no tokens receive none. This is the `positional`
/// rule, the one the runtime's device mapping matches.
///
/// The `node_affine` rule (host only: ForeMoE knows each micro-step's ids before it runs) gives every copy exactly
/// the same number of tokens from every source, but chooses *which* of an expert's occurrences each copy takes so
/// that a token reaches few nodes: a token crosses to a remote node once however many of its top-k experts live
/// there, so the inter-node bytes of the hierarchical all-to-all are the distinct remote nodes per token. Per
/// source (one when the split is not by source), with each token's `home` its source GPU (source `s` is GPU `s`
/// under a split by source; with one source `TokenMapOptions::home_offsets` per token, else `source_gpu`, or none):
///   1. An expert with one copy given tokens from the source ("fixed") sends all its occurrences there. Every
///      token's visited nodes and GPUs start as its `home`'s and those of its fixed experts.
///   2. The occurrences of experts with several such copies ("flexible") take, while its count lasts, a copy on a
///      node the token already visits: first the occurrences with exactly one such copy (they have no other
///      choice), then the rest, preferring a copy on a GPU the token visits, then the one with the most tokens
///      left, then the lowest physical slot.
///   3. The occurrences left, token by token in `(token, k)` order, each take a copy on a node the token visits by
///      now if one has tokens left, else the copy on the node where most of the token's still unmapped
///      occurrences could also go (then most tokens left, then lowest slot); the node joins the token's set.
/// Every step takes an occurrence only into a copy with tokens left, and the occurrences of an expert equal the
/// copies' counts (checked, as for `positional`), so every copy ends with exactly its count. Finally, per source,
/// the result is kept only if its remote node hits (then remote GPU hits) are not above the positional map's for
/// the same tokens, else that source keeps the positional map: never more node hits than `positional` by
/// construction. Cost O(T k c) for `T` tokens, top-`k`, `c` copies per expert (visited sets are bit sets), plus
/// O(k c) for each occurrence that opens a node, plus the positional map; deterministic (no hashing, no
/// randomness, fixed tie-breaks). `bench_token_affinity`: 16,384 tokens x top-8 on 8 x 8 GPUs in about 1.2 ms by
/// source (positional 0.16 ms), 3.3 ms with one source (0.13 ms).
///
/// What bounds the cut is the split, not the greedy: each copy's count is fixed, and on the benchmark's micro-step
/// (one source, homes known) step 2 places within 1% of the most occurrences any assignment could place on visited
/// nodes (a max-flow per expert), yet a third of the flexible ones must still open a node. With one source and
/// `home_offsets` the map also chooses how each copy's total divides among the sources (`source_split` reads that
/// split back for the dispatch): on the default synthetic batch (`plan --ids --node-hits`, 8 x 8 GPUs x 3 slots)
/// the inter-node token copies fall 0.4% with `split_by_source`'s split and 7.5% with the map's own.

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/core/topology.hpp"
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

/// How `map_tokens` chooses among an expert's copies (see the file comment); every rule gives every copy exactly
/// its count from the split.
enum class TokenMapRule : std::uint8_t {
  positional,  ///< the copies in slot order take consecutive occurrence ranges (the runtime's device rule)
  node_affine, ///< a token goes to a copy on a node (then a GPU) it already visits
};

/// The names of `TokenMapRule`'s values, in order.
inline constexpr std::array<std::string_view, 2> token_map_rule_names{"positional", "node_affine"};

[[nodiscard]] inline std::string_view to_string(TokenMapRule r) noexcept {
  return token_map_rule_names[static_cast<std::size_t>(r)];
}

/// The rule named `name`; throws `Error` "`who` must be one of positional, node_affine, got 'name'".
[[nodiscard]] inline TokenMapRule parse_token_map_rule(std::string_view name, std::string_view who) {
  return detail::enum_from_name<TokenMapRule>(token_map_rule_names, name, who);
}

/// What `map_tokens` needs beyond the ranges for a rule other than `positional`.
struct TokenMapOptions {
  TokenMapRule rule = TokenMapRule::positional;
  /// `node_affine`: where the slots sit (slot `p` on GPU `p / slots_per_gpu`, GPU `g` on node `g / gpus_per_node`);
  /// its slot count must be the ranges'.
  Topology topo{};
  /// `node_affine` with one source: the GPU all tokens come from (a rank's own dispatch), or -1 for none known.
  /// With a split by source, source `s` is GPU `s` and this is not read.
  int source_gpu = -1;
  /// `node_affine` with one source (the plan's split, not by source): `[G + 1]` token offsets grouping the tokens
  /// by source GPU, so that every token counts its own node as visited; overrides `source_gpu`. The map then also
  /// decides how each copy's count divides among the sources (`source_split` reads it back). Empty: not used.
  std::span<const std::int64_t> home_offsets;
};

/// Token-node hits of a token -> slot map: what the hierarchical all-to-all sends. Sums over tokens.
struct NodeHits {
  std::int64_t tokens = 0;       ///< tokens with at least one route
  std::int64_t routed = 0;       ///< routed `(token, k)` pairs
  std::int64_t nodes = 0;        ///< distinct nodes each token reaches
  std::int64_t remote_nodes = 0; ///< of those, other than its source GPU's node: the inter-node token copies
  std::int64_t gpus = 0;         ///< distinct GPUs each token reaches
  std::int64_t remote_gpus = 0;  ///< of those, other than its source GPU: the token copies that leave the GPU
  friend bool operator==(const NodeHits &, const NodeHits &) = default;
};

namespace detail {

/// The GPU and node of every physical slot of a topology, and per-token hit counting: O(k) per token through
/// stamps (the token's number in the node and GPU seen by it), no O(k^2) scan and no bit-width limit.
class HitCounter {
public:
  explicit HitCounter(const Topology &topo)
      : gpus_per_node_(topo.gpus_per_node), node_seen_(static_cast<std::size_t>(topo.num_nodes), 0),
        gpu_seen_(static_cast<std::size_t>(topo.num_gpus()), 0) {
    const auto n = static_cast<std::size_t>(topo.num_slots());
    gpu.resize(n);
    node.resize(n);
    for (std::size_t p = 0; p < n; ++p) {
      gpu[p] = static_cast<std::int32_t>(p / static_cast<std::size_t>(topo.slots_per_gpu));
      node[p] = gpu[p] / topo.gpus_per_node;
    }
  }
  std::vector<std::int32_t> gpu, node; ///< `[slots]` the GPU and node of each physical slot

  /// Adds token `slots[0, topk)`'s hits from `home_gpu` (-1: none, every node and GPU is remote) to `h`.
  void add(NodeHits &h, const std::int32_t *slots, int topk, int home_gpu) noexcept {
    const std::int32_t home_node = home_gpu < 0 ? -1 : home_gpu / gpus_per_node_;
    ++stamp_;
    bool any = false;
    for (int k = 0; k < topk; ++k) {
      if (slots[k] < 0) continue;
      ++h.routed;
      any = true;
      const std::int32_t g = gpu[static_cast<std::size_t>(slots[k])], n = node[static_cast<std::size_t>(slots[k])];
      if (gpu_seen_[static_cast<std::size_t>(g)] != stamp_) {
        gpu_seen_[static_cast<std::size_t>(g)] = stamp_;
        ++h.gpus;
        h.remote_gpus += g != home_gpu ? 1 : 0;
      }
      if (node_seen_[static_cast<std::size_t>(n)] != stamp_) {
        node_seen_[static_cast<std::size_t>(n)] = stamp_;
        ++h.nodes;
        h.remote_nodes += n != home_node ? 1 : 0;
      }
    }
    h.tokens += any ? 1 : 0;
  }

private:
  int gpus_per_node_ = 1;
  std::uint64_t stamp_ = 0;
  std::vector<std::uint64_t> node_seen_, gpu_seen_;
};

/// Checks that `topo` describes the `num_slots` slots of a map; `who` names the caller.
inline void check_slot_topology(const Topology &topo, std::int64_t num_slots, const char *who) {
  require(topo.slots_per_gpu > 0 && topo.gpus_per_node > 0 && topo.num_nodes > 0, who, ": the topology needs ",
          "positive nodes, GPUs per node and slots per GPU, got ", topo.num_nodes, " x ", topo.gpus_per_node, " x ",
          topo.slots_per_gpu);
  require(topo.num_slots() == num_slots, who, ": the topology has ", topo.num_nodes, " x ", topo.gpus_per_node,
          " GPUs x ", topo.slots_per_gpu, " slots = ", topo.num_slots(), " slots, the map ", num_slots);
}

/// The node-affine assignment of one source's tokens `[b, e)` (see the file comment), rewriting the positional
/// map `pos` (already checked against the ranges) into `out`; both are `[tokens][topk]` over the whole layer.
class NodeAffineMapper {
public:
  NodeAffineMapper(const TokenRanges &r, const HitCounter &at, const Topology &topo)
      : r_(r), gpus_per_node_(topo.gpus_per_node), node_words_((static_cast<std::size_t>(topo.num_nodes) + 63) / 64),
        gpu_words_((static_cast<std::size_t>(topo.num_gpus()) + 63) / 64),
        share_(static_cast<std::size_t>(topo.num_nodes), 0), seen_(static_cast<std::size_t>(topo.num_nodes), 0) {
    const std::size_t nc = r.copy_slot.size();
    copy_of_slot_.assign(static_cast<std::size_t>(r.num_slots), -1);
    copy_expert_.resize(nc);
    copy_gpu_.resize(nc);
    copy_node_.resize(nc);
    for (int e = 0; e < r.num_experts; ++e)
      for (std::int32_t c = r.copy_offsets[e]; c < r.copy_offsets[e + 1]; ++c) {
        copy_of_slot_[static_cast<std::size_t>(r.copy_slot[c])] = c;
        copy_expert_[c] = e;
        copy_gpu_[c] = at.gpu[static_cast<std::size_t>(r.copy_slot[c])];
        copy_node_[c] = at.node[static_cast<std::size_t>(r.copy_slot[c])];
      }
    rem_.resize(nc);
    quota_.resize(nc);
    live_.resize(static_cast<std::size_t>(r.num_experts));
  }

  /// `homes[t - b]` is token `t`'s source GPU (-1: none).
  void map_source(int src, const std::int32_t *homes, std::int64_t b, std::int64_t e, int topk, const std::int32_t *pos,
                  std::int32_t *out) {
    const std::size_t nc = r_.copy_slot.size();
    const std::int64_t *end = r_.copy_end.data() + static_cast<std::size_t>(src) * nc;
    for (int x = 0; x < r_.num_experts; ++x) {
      live_[x] = 0;
      for (std::int32_t c = r_.copy_offsets[x]; c < r_.copy_offsets[x + 1]; ++c) {
        quota_[c] = rem_[c] = end[c] - (c > r_.copy_offsets[x] ? end[c - 1] : 0);
        live_[x] += rem_[c] > 0 ? 1 : 0;
      }
    }
    const auto num_tokens = static_cast<std::size_t>(e - b);
    topk_ = topk;
    flex_.clear();
    vnode_.assign(num_tokens * node_words_, 0);
    vgpu_.assign(num_tokens * gpu_words_, 0);
    const std::int32_t *p = pos + b * topk;
    std::int32_t *o = out + b * topk;
    // Pass 1: fixed experts; flexible occurrences are marked -2.
    for (std::size_t t = 0; t < num_tokens; ++t) {
      if (homes[t] >= 0) visit(t, homes[t], homes[t] / gpus_per_node_);
      for (int k = 0; k < topk; ++k) {
        const std::size_t i = t * static_cast<std::size_t>(topk) + k;
        if (p[i] < 0) {
          o[i] = -1;
          continue;
        }
        const std::int32_t c = copy_of_slot_[static_cast<std::size_t>(p[i])];
        if (live_[copy_expert_[c]] > 1) {
          o[i] = -2;
          flex_.push_back(i);
          continue;
        }
        o[i] = p[i];
        --rem_[c];
        visit(t, copy_gpu_[c], copy_node_[c]);
      }
    }
    // Pass 2: flexible occurrences into copies on visited nodes; those with one such copy first.
    const auto K = static_cast<std::size_t>(topk);
    for (int round = 0; round < 2; ++round)
      for (const std::size_t i : flex_) {
        if (o[i] != -2) continue;
        const std::size_t t = i / K;
        const int x = copy_expert_[copy_of_slot_[static_cast<std::size_t>(p[i])]];
        if (round == 0 && visited_options(t, x) != 1) continue;
        if (const std::int32_t c = pick_visited(t, x); c >= 0) {
          take(o[i], c);
          visit(t, copy_gpu_[c], copy_node_[c]); // the node is visited already; the GPU may be new
        }
      }
    // Pass 3: the rest, token by token; each may open a node for the token's later occurrences.
    for (const std::size_t i : flex_) {
      if (o[i] != -2) continue;
      const std::size_t t = i / K;
      const int x = copy_expert_[copy_of_slot_[static_cast<std::size_t>(p[i])]];
      std::int32_t c = pick_visited(t, x);
      if (c < 0) c = pick_new_node(x, static_cast<int>(i % K), p + t * K, o + t * K);
      take(o[i], c);
      visit(t, copy_gpu_[c], copy_node_[c]);
    }
  }

  /// Remote nodes and GPUs of the last `map_source`'s tokens: every token's visited sets hold exactly its home and
  /// the nodes and GPUs of its slots.
  void add_remote_hits(NodeHits &h, const std::int32_t *homes, std::int64_t num_tokens) const {
    for (std::size_t t = 0; t < static_cast<std::size_t>(num_tokens); ++t) {
      const std::int64_t at_home = homes[t] >= 0 ? 1 : 0;
      h.remote_nodes += count_bits(vnode_.data() + t * node_words_, node_words_) - at_home;
      h.remote_gpus += count_bits(vgpu_.data() + t * gpu_words_, gpu_words_) - at_home;
    }
  }

private:
  [[nodiscard]] static std::int64_t count_bits(const std::uint64_t *w, std::size_t n) noexcept {
    std::int64_t c = 0;
    for (std::size_t j = 0; j < n; ++j)
      c += std::popcount(w[j]);
    return c;
  }
  static void set_bit(std::uint64_t *w, int i) noexcept { w[i >> 6] |= std::uint64_t{1} << (i & 63); }
  [[nodiscard]] static bool has_bit(const std::uint64_t *w, int i) noexcept { return (w[i >> 6] >> (i & 63)) & 1u; }
  void visit(std::size_t t, int gpu, int node) {
    set_bit(vnode_.data() + t * node_words_, node);
    set_bit(vgpu_.data() + t * gpu_words_, gpu);
  }
  [[nodiscard]] bool node_visited(std::size_t t, int node) const {
    return has_bit(vnode_.data() + t * node_words_, node);
  }
  [[nodiscard]] bool gpu_visited(std::size_t t, int gpu) const { return has_bit(vgpu_.data() + t * gpu_words_, gpu); }
  /// Copies of `x` given tokens by the source that sit on a node token `t` visits.
  [[nodiscard]] int visited_options(std::size_t t, int x) const {
    int n = 0;
    for (std::int32_t c = r_.copy_offsets[x]; c < r_.copy_offsets[x + 1]; ++c)
      n += quota_[c] > 0 && node_visited(t, copy_node_[c]) ? 1 : 0;
    return n;
  }
  /// The copy of `x` on a visited node with tokens left: a visited GPU first, then most left, then lowest slot.
  [[nodiscard]] std::int32_t pick_visited(std::size_t t, int x) const {
    std::int32_t best = -1;
    bool best_gpu = false;
    for (std::int32_t c = r_.copy_offsets[x]; c < r_.copy_offsets[x + 1]; ++c) {
      if (rem_[c] <= 0 || !node_visited(t, copy_node_[c])) continue;
      const bool g = gpu_visited(t, copy_gpu_[c]);
      if (best < 0 || (g && !best_gpu) || (g == best_gpu && rem_[c] > rem_[best])) best = c, best_gpu = g;
    }
    return best;
  }
  /// A copy of `x` with tokens left on a node the token does not visit yet: the node most of its other unmapped
  /// occurrences (`-2` in `o`) could also use, then most tokens left, then lowest slot.
  /// O(k c): each later unmapped occurrence counts once on every node where its expert has tokens left (a node's
  /// last counting occurrence in `seen_`), then each candidate reads its node's count.
  [[nodiscard]] std::int32_t pick_new_node(int x, int k, const std::int32_t *p, const std::int32_t *o) {
    for (int j = k + 1; j < topk_; ++j) {
      if (o[j] != -2) continue;
      const int y = copy_expert_[copy_of_slot_[static_cast<std::size_t>(p[j])]];
      for (std::int32_t d = r_.copy_offsets[y]; d < r_.copy_offsets[y + 1]; ++d) {
        const auto n = static_cast<std::size_t>(copy_node_[d]);
        if (rem_[d] <= 0 || seen_[n] == stamp_ + static_cast<std::uint64_t>(j)) continue;
        if (seen_[n] <= stamp_) share_[n] = 0; // first count of this call
        seen_[n] = stamp_ + static_cast<std::uint64_t>(j);
        ++share_[n];
      }
    }
    std::int32_t best = -1;
    int best_share = -1;
    for (std::int32_t c = r_.copy_offsets[x]; c < r_.copy_offsets[x + 1]; ++c) {
      if (rem_[c] <= 0) continue;
      const auto n = static_cast<std::size_t>(copy_node_[c]);
      const int share = seen_[n] > stamp_ ? share_[n] : 0;
      if (best < 0 || share > best_share || (share == best_share && rem_[c] > rem_[best])) best = c, best_share = share;
    }
    stamp_ += static_cast<std::uint64_t>(topk_); // past every stamp this call wrote
    return best; // never -1: the expert's unmapped occurrences equal its copies' tokens left
  }
  void take(std::int32_t &slot, std::int32_t c) {
    slot = r_.copy_slot[c];
    --rem_[c];
  }

  const TokenRanges &r_;
  int gpus_per_node_ = 1;
  std::size_t node_words_ = 1, gpu_words_ = 1; ///< 64-bit words of a token's node and GPU sets
  int topk_ = 1;
  std::vector<std::int32_t> copy_of_slot_, copy_expert_, copy_gpu_, copy_node_;
  std::vector<std::int64_t> rem_, quota_; ///< tokens left and given of each copy from the source
  std::vector<int> live_;                 ///< copies of each expert given tokens from the source
  std::vector<int> share_;                ///< `[nodes]` pick_new_node's counts, valid where `seen_` > `stamp_`
  std::vector<std::uint64_t> seen_;       ///< `[nodes]` stamp of the last occurrence counted on each node
  std::uint64_t stamp_ = 0;
  std::vector<std::size_t> flex_;           ///< entries of the source's `[tokens][topk]` of flexible experts
  std::vector<std::uint64_t> vnode_, vgpu_; ///< `[tokens][words]` bit sets: the nodes and GPUs each token visits
};

} // namespace detail

/// Adds the token-node hits of `slots` (`[tokens][topk]` physical slots, -1 = no route, as `map_tokens` writes
/// them) on `topo` to `hits`. `source_offsets` (`[G + 1]` token offsets, G = `topo.num_gpus()`) groups the tokens
/// by source GPU (source `s` is GPU `s`, as in `split_by_source`); empty means no source is known and every node
/// and GPU counts as remote. Throws `Error` naming a slot outside the topology or malformed offsets.
inline void add_node_hits(NodeHits &hits, std::span<const std::int32_t> slots, int topk, const Topology &topo,
                          std::span<const std::int64_t> source_offsets = {}) {
  using detail::require;
  require(topk > 0, "count_node_hits: topk must be positive, got ", topk);
  require(slots.size() % static_cast<std::size_t>(topk) == 0, "count_node_hits: ", slots.size(),
          " slots are not whole tokens of top-", topk);
  detail::check_slot_topology(topo, topo.num_slots(), "count_node_hits");
  const auto num_tokens = static_cast<std::int64_t>(slots.size() / static_cast<std::size_t>(topk));
  for (std::size_t i = 0; i < slots.size(); ++i)
    require(slots[i] >= -1 && slots[i] < topo.num_slots(), "count_node_hits: slot ", slots[i], " at token ",
            i / static_cast<std::size_t>(topk), ", k ", i % static_cast<std::size_t>(topk), " is outside [0, ",
            topo.num_slots(), ") and not -1 (no route)");
  detail::HitCounter at(topo);
  if (source_offsets.empty()) {
    for (std::int64_t t = 0; t < num_tokens; ++t)
      at.add(hits, slots.data() + t * topk, topk, -1);
    return;
  }
  require(static_cast<int>(source_offsets.size()) == topo.num_gpus() + 1, "count_node_hits: ", source_offsets.size(),
          " source offsets for ", topo.num_gpus(), " GPUs, expected ", topo.num_gpus() + 1);
  detail::check_offsets(source_offsets, num_tokens, "count_node_hits: source_offsets");
  for (int s = 0; s < topo.num_gpus(); ++s)
    for (std::int64_t t = source_offsets[s]; t < source_offsets[s + 1]; ++t)
      at.add(hits, slots.data() + t * topk, topk, s);
}

/// The token-node hits of `slots` alone (see `add_node_hits`).
[[nodiscard]] inline NodeHits count_node_hits(std::span<const std::int32_t> slots, int topk, const Topology &topo,
                                              std::span<const std::int64_t> source_offsets = {}) {
  NodeHits h;
  add_node_hits(h, slots, topk, topo, source_offsets);
  return h;
}

/// `map_tokens` under `opts.rule`: `positional` as above; `node_affine` (see the file comment) gives every copy
/// the same counts per source and never more remote node hits than `positional` on the same tokens (from the
/// same homes). Throws `Error` as the positional map does, and for a `node_affine` topology whose slot count is
/// not the ranges', a source count other than 1 or the topology's GPUs, a `source_gpu` outside `[-1, G)` or
/// malformed `home_offsets`.
inline void map_tokens(const TokenRanges &ranges, const RoutedView &ids, int layer_idx, std::span<std::int32_t> out,
                       std::span<const std::int64_t> source_offsets, const TokenMapOptions &opts) {
  using detail::require;
  if (opts.rule == TokenMapRule::positional) {
    map_tokens(ranges, ids, layer_idx, out, source_offsets);
    return;
  }
  require(opts.rule == TokenMapRule::node_affine, "map_tokens: unknown token map rule ", static_cast<int>(opts.rule));
  detail::check_slot_topology(opts.topo, ranges.num_slots, "map_tokens: node_affine");
  const int num_gpus = opts.topo.num_gpus();
  require(ranges.num_sources == 1 || ranges.num_sources == num_gpus, "map_tokens: node_affine needs one source or ",
          "one per GPU (source s = GPU s), got ", ranges.num_sources, " sources for ", num_gpus, " GPUs");
  require(opts.source_gpu >= -1 && opts.source_gpu < num_gpus, "map_tokens: node_affine source_gpu ", opts.source_gpu,
          " outside [-1, ", num_gpus, ")");
  const std::int64_t num_tokens = ids.num_tokens();
  // Every token's source GPU: its source's, or `home_offsets`', or `source_gpu`.
  std::vector<std::int32_t> homes(static_cast<std::size_t>(num_tokens), static_cast<std::int32_t>(opts.source_gpu));
  if (!opts.home_offsets.empty()) {
    require(ranges.num_sources == 1, "map_tokens: node_affine home_offsets are for one source; with ",
            ranges.num_sources, " sources the source offsets give the homes");
    require(static_cast<int>(opts.home_offsets.size()) == num_gpus + 1,
            "map_tokens: node_affine: ", opts.home_offsets.size(), " home offsets for ", num_gpus, " GPUs, expected ",
            num_gpus + 1);
    detail::check_offsets(opts.home_offsets, num_tokens, "map_tokens: node_affine home_offsets");
    for (int g = 0; g < num_gpus; ++g)
      std::fill(homes.begin() + opts.home_offsets[g], homes.begin() + opts.home_offsets[g + 1], g);
  }
  std::vector<std::int32_t> pos(out.size());
  map_tokens(ranges, ids, layer_idx, pos, source_offsets); // checks everything and gives each occurrence's expert
  const auto so = detail::source_ranges(source_offsets, ranges.num_sources, num_tokens);
  if (ranges.num_sources > 1)
    for (int s = 0; s < ranges.num_sources; ++s)
      std::fill(homes.begin() + so[s], homes.begin() + so[s + 1], s);
  const int topk = ids.topk();
  detail::HitCounter at(opts.topo);
  detail::NodeAffineMapper mapper(ranges, at, opts.topo);
  for (int s = 0; s < ranges.num_sources; ++s) {
    mapper.map_source(s, homes.data() + so[s], so[s], so[s + 1], topk, pos.data(), out.data());
    NodeHits mine, theirs;
    mapper.add_remote_hits(mine, homes.data() + so[s], so[s + 1] - so[s]);
    for (std::int64_t t = so[s]; t < so[s + 1]; ++t)
      at.add(theirs, pos.data() + t * topk, topk, homes[static_cast<std::size_t>(t)]);
    const bool worse = mine.remote_nodes > theirs.remote_nodes ||
                       (mine.remote_nodes == theirs.remote_nodes && mine.remote_gpus > theirs.remote_gpus);
    if (worse) std::copy(pos.begin() + so[s] * topk, pos.begin() + so[s + 1] * topk, out.begin() + so[s] * topk);
  }
}

/// Maps trace layer `layer_idx` of `ids` through `plan`'s split (one source) under `opts`; returns `[tokens][topk]`
/// slots.
[[nodiscard]] inline std::vector<std::int32_t> map_tokens(const LayerPlan &plan, const RoutedView &ids, int layer_idx,
                                                          const TokenMapOptions &opts) {
  std::vector<std::int32_t> out(static_cast<std::size_t>(ids.num_tokens()) * ids.topk());
  map_tokens(token_ranges(plan), ids, layer_idx, out, {}, opts);
  return out;
}

/// The split a map realises: `[slots][G]` tokens each physical slot takes from each source GPU, for `slots`
/// (`[tokens][topk]`, -1 = no route) whose tokens `source_offsets` (`[G + 1]`) groups by source GPU, on `topo`.
/// What a one-source `node_affine` map with `home_offsets` chose, in `split_by_source`'s form (the dispatch's input).
[[nodiscard]] inline std::vector<std::int64_t> source_split(std::span<const std::int32_t> slots, int topk,
                                                            const Topology &topo,
                                                            std::span<const std::int64_t> source_offsets) {
  using detail::require;
  const int num_gpus = topo.num_gpus();
  require(topk > 0 && slots.size() % static_cast<std::size_t>(topk) == 0, "source_split: ", slots.size(),
          " slots are not whole tokens of top-", topk);
  require(static_cast<int>(source_offsets.size()) == num_gpus + 1, "source_split: ", source_offsets.size(),
          " source offsets for ", num_gpus, " GPUs, expected ", num_gpus + 1);
  const auto num_tokens = static_cast<std::int64_t>(slots.size() / static_cast<std::size_t>(topk));
  detail::check_offsets(source_offsets, num_tokens, "source_split: source_offsets");
  std::vector<std::int64_t> split(static_cast<std::size_t>(topo.num_slots()) * num_gpus, 0);
  for (int g = 0; g < num_gpus; ++g)
    for (std::int64_t i = source_offsets[g] * topk; i < source_offsets[g + 1] * topk; ++i) {
      const std::int32_t p = slots[static_cast<std::size_t>(i)];
      require(p >= -1 && p < topo.num_slots(), "source_split: slot ", p, " at token ", i / topk, " is outside [0, ",
              topo.num_slots(), ") and not -1 (no route)");
      if (p >= 0) ++split[static_cast<std::size_t>(p) * num_gpus + g];
    }
  return split;
}

} // namespace v0
} // namespace foremoe
