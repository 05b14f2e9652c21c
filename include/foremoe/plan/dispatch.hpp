#pragma once
/// @file
/// One source rank's token dispatch under a layer plan: every `(token, k)`'s physical slot and everything an
/// all-to-all exchange needs to send the tokens to their slots and gather the results back (what
/// `foremoe.torch.dispatch_layout` and a trainer's own dispatcher use). Plain host code over the plan's split by
/// source rank (`split_by_source`); the same on every rank for the same plan.

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/plan/split.hpp"
#include "foremoe/plan/token_map.hpp"
#include "foremoe/trace/routed_view.hpp"

namespace foremoe {
inline namespace v0 {

/// Rank `rank`'s side of one layer's dispatch (`G` ranks of `S` slots each, `P = G * S` physical slots).
struct DispatchLayout {
  std::vector<std::int32_t> slots;        ///< `[tokens * topk]` physical slot of each `(t, k)`, -1 = no route
  std::vector<std::int64_t> order;        ///< routed `t * topk + k` sorted by physical slot (token order inside one)
  std::vector<std::int64_t> send_tokens;  ///< the token of each entry of `order`: the rows to send, in send order
  std::vector<std::int32_t> send_experts; ///< the logical expert of each entry of `order`
  /// `[tokens * topk]` the position in `order` of each `(t, k)` (the inverse of `order`), -1 = no route: the rows
  /// of the send order that come back to token `t` are `route_pos[t * topk + k]`, `k` ascending.
  std::vector<std::int64_t> route_pos;
  std::vector<std::int64_t> input_splits;  ///< `[G]` rows this rank sends to each rank
  std::vector<std::int64_t> output_splits; ///< `[G]` rows this rank receives from each rank
  std::vector<std::int64_t> slot_counts;   ///< `[S]` rows each local slot computes (the grouped GEMM's sizes)
  /// `[received]` the received row at each position when grouped by local slot (sources in rank order inside a
  /// slot); `recv_inverse` is its inverse permutation.
  std::vector<std::int64_t> recv_perm;
  std::vector<std::int64_t> recv_inverse;
};

/// The dispatch of trace layer 0 of `ids` (`[tokens, 1, topk]`, rank `rank`'s tokens) under `placement` with the
/// split `split` (`[G * S][G]` C order: tokens each physical slot takes from each source rank, as `split_by_source`
/// returns). The received rows arrive source by source, each source's rows in slot order, as `all_to_all_single`
/// delivers them with `output_splits`. Throws `Error` naming a split of the wrong shape, a negative count, a rank
/// outside `[0, G)`, or routed ids whose counts differ from the split's column for `rank` (through `map_tokens`).
/// `rule` chooses which of an expert's occurrences each copy takes (`map_tokens`); `node_affine` needs
/// `gpus_per_node` (dividing `G`) and treats `rank` as the tokens' source GPU. Every rule gives the same counts, so
/// the splits and the receive side are the same for both.
[[nodiscard]] inline DispatchLayout dispatch_layout(const LayerPlacement &placement,
                                                    std::span<const std::int64_t> split, const RoutedView &ids,
                                                    int rank, TokenMapRule rule = TokenMapRule::positional,
                                                    int gpus_per_node = 0) {
  using detail::require;
  const int num_gpus = placement.num_gpus(), num_slots = placement.slots_per_gpu();
  require(ids.num_layers() == 1, "dispatch: routed ids must be [tokens, 1, topk], got ", ids.num_layers(), " layers");
  require(rank >= 0 && rank < num_gpus, "dispatch: rank ", rank, " outside [0, ", num_gpus, ")");
  const std::size_t G = static_cast<std::size_t>(num_gpus), S = static_cast<std::size_t>(num_slots), P = G * S;
  require(split.size() == P * G, "dispatch: the split has ", split.size(), " entries, expected [", P, ", ", G,
          "] (slots x source ranks, from source_split)");
  for (std::size_t i = 0; i < split.size(); ++i)
    require(split[i] >= 0, "dispatch: the split's slot ", i / G, " takes ", split[i], " tokens from rank ", i % G);
  const std::size_t r = static_cast<std::size_t>(rank), topk = static_cast<std::size_t>(ids.topk());
  const std::size_t n = static_cast<std::size_t>(ids.num_tokens()) * topk;
  DispatchLayout out;
  out.slots.resize(n);
  out.input_splits.assign(G, 0);
  out.output_splits.assign(G, 0);
  out.slot_counts.assign(S, 0);
  std::vector<std::int64_t> column(P);
  for (std::size_t q = 0; q < P; ++q)
    column[q] = split[q * G + r];
  const TokenRanges ranges = token_ranges(placement.phys_to_log(), placement.num_experts(), column);
  TokenMapOptions mopts;
  mopts.rule = rule;
  if (rule == TokenMapRule::node_affine) {
    require(gpus_per_node > 0 && num_gpus % gpus_per_node == 0, "dispatch: node_affine needs the GPUs per node, ",
            "a divisor of the ", num_gpus, " ranks, got ", gpus_per_node);
    mopts.topo = Topology{num_gpus / gpus_per_node, gpus_per_node, num_slots};
    mopts.source_gpu = rank;
  }
  map_tokens(ranges, ids, 0, out.slots, {}, mopts);
  // A counting sort over the exact per-slot counts: `next[q]` is the next free position of slot q's rows.
  std::vector<std::int64_t> next(P + 1, 0);
  for (std::size_t q = 0; q < P; ++q) {
    next[q + 1] = next[q] + column[q];
    out.input_splits[q / S] += column[q];
  }
  out.order.resize(static_cast<std::size_t>(next[P]));
  for (std::size_t i = 0; i < n; ++i)
    if (out.slots[i] >= 0) out.order[static_cast<std::size_t>(next[out.slots[i]]++)] = static_cast<std::int64_t>(i);
  out.send_tokens.resize(out.order.size());
  out.send_experts.resize(out.order.size());
  out.route_pos.assign(n, -1);
  const std::span<const std::int32_t> expert_of = placement.phys_to_log();
  for (std::size_t i = 0; i < out.order.size(); ++i) {
    const auto route = static_cast<std::size_t>(out.order[i]);
    out.send_tokens[i] = out.order[i] / static_cast<std::int64_t>(topk);
    out.send_experts[i] = expert_of[static_cast<std::size_t>(out.slots[route])];
    out.route_pos[route] = static_cast<std::int64_t>(i);
  }
  // Received rows come source by source, each source's rows in slot order; group them slot by slot.
  const std::int64_t *mine = split.data() + r * S * G; // [S][G]: rows local slot j takes from source s
  for (std::size_t j = 0; j < S; ++j)
    for (std::size_t s = 0; s < G; ++s) {
      out.output_splits[s] += mine[j * G + s];
      out.slot_counts[j] += mine[j * G + s];
    }
  std::vector<std::int64_t> at(G, 0); // next received row of each source's chunk
  for (std::size_t s = 1; s < G; ++s)
    at[s] = at[s - 1] + out.output_splits[s - 1];
  const std::int64_t total = at[G - 1] + out.output_splits[G - 1];
  out.recv_perm.resize(static_cast<std::size_t>(total));
  out.recv_inverse.resize(static_cast<std::size_t>(total));
  std::size_t pos = 0;
  for (std::size_t j = 0; j < S; ++j)
    for (std::size_t s = 0; s < G; ++s)
      for (std::int64_t t = 0; t < mine[j * G + s]; ++t, ++pos) {
        out.recv_perm[pos] = at[s]++;
        out.recv_inverse[static_cast<std::size_t>(out.recv_perm[pos])] = static_cast<std::int64_t>(pos);
      }
  return out;
}

/// `dispatch_layout` with the split computed here from `source_loads` (`[E][G]` C order: every rank's routed count
/// of each expert, what the ranks gather before the exchange), as `split_by_source` does: one call from the
/// gathered counts to the layout. Throws `Error` as `split_by_source` does for loads the plan's split cannot take
/// (a plan of another layer or micro-step) and as `dispatch_layout` does. `split_out`, when not null, receives
/// the `[G * S][G]` split.
[[nodiscard]] inline DispatchLayout
dispatch_from_loads(const LayerPlacement &placement, std::span<const std::int64_t> slot_tokens,
                    std::span<const std::int64_t> source_loads, const RoutedView &ids, int rank, int gpus_per_node,
                    TokenMapRule rule = TokenMapRule::positional, std::vector<std::int64_t> *split_out = nullptr) {
  std::vector<std::int64_t> split =
      split_by_source(placement, slot_tokens, source_loads, placement.num_gpus(), gpus_per_node);
  DispatchLayout out = dispatch_layout(placement, split, ids, rank, rule, gpus_per_node);
  if (split_out != nullptr) *split_out = std::move(split);
  return out;
}

/// The routes of a dense `[tokens][experts]` routing map (C order, one byte per entry, 0 or 1; Megatron's
/// `routing_map`): `ids` (`[tokens * topk]`) receives each token's routed experts in ascending id, -1 after the
/// last when a token has fewer than `topk`; `counts` (`[experts]`) receives each expert's routed count. Returns
/// how many tokens have fewer than `topk` routes. Throws `Error` naming the token and the expert for an entry
/// other than 0 or 1 and naming the token for one with more than `topk` routes; `ids` and `counts` must have
/// the sizes above.
inline std::int64_t routes_from_map(std::span<const std::uint8_t> map, std::int64_t tokens, int experts, int topk,
                                    std::span<std::int32_t> ids, std::span<std::int64_t> counts) {
  using detail::require;
  require(tokens >= 0 && experts > 0 && topk > 0, "routes_from_map: bad shape [", tokens, ", ", experts,
          "] with top-k ", topk);
  const auto T = static_cast<std::size_t>(tokens), E = static_cast<std::size_t>(experts),
             K = static_cast<std::size_t>(topk);
  require(map.size() == T * E, "routes_from_map: the map has ", map.size(), " entries, expected ", T, " x ", E);
  require(ids.size() == T * K, "routes_from_map: ids has ", ids.size(), " entries, expected ", T, " x ", K);
  require(counts.size() == E, "routes_from_map: counts has ", counts.size(), " entries, expected ", E);
  std::fill(counts.begin(), counts.end(), 0);
  std::int64_t short_tokens = 0;
  constexpr std::size_t W = sizeof(std::uint64_t);
  constexpr std::uint64_t high_bits = 0xfefefefefefefefeULL; // any bit but the lowest of each byte
  for (std::size_t t = 0; t < T; ++t) {
    const std::uint8_t *row = map.data() + t * E;
    std::int32_t *out = ids.data() + t * K;
    std::size_t found = 0;
    auto take = [&](std::size_t e) {
      require(row[e] == 1, "routes_from_map: token ", t, ", expert ", e, ": the routing map holds ",
              static_cast<int>(row[e]), ", expected 0 or 1");
      require(found < K, "routes_from_map: token ", t, " is routed to more than top-k = ", K, " experts");
      out[found++] = static_cast<std::int32_t>(e);
      ++counts[e];
    };
    std::size_t e = 0;
    if constexpr (std::endian::native == std::endian::little) {
      for (; e + W <= E; e += W) { // a word at a time: most of a row is zeros, and a hit costs no byte branch
        std::uint64_t word = 0;
        std::memcpy(&word, row + e, W);
        if ((word & high_bits) != 0) // some byte is not 0 or 1: name it
          for (std::size_t b = 0; b < W; ++b)
            if (row[e + b] > 1) take(e + b);
        while (word != 0) {
          const auto bit = static_cast<std::size_t>(std::countr_zero(word)); // lowest set byte: byte bit / 8
          take(e + bit / 8);
          word &= word - 1; // the byte held 1: its only set bit
        }
      }
    }
    for (; e < E; ++e)
      if (row[e] != 0) take(e);
    if (found < K) {
      ++short_tokens;
      std::fill(out + found, out + K, -1);
    }
  }
  return short_tokens;
}

} // namespace v0
} // namespace foremoe
