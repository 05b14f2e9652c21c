#pragma once
/// @file
/// The storage-row bookkeeping of a rank group's expert slots for one layer plan (what `foremoe.torch`'s
/// `ExpertStorage` runs at each sync): which replica rows stay, which rows receive a copy and from whom, which
/// storage row serves each plan slot, and which replica gradients go back to their owners. Every rank computes the
/// same tables from the same plan, so the moves need no negotiation.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/plan/plan.hpp"

namespace foremoe {
inline namespace v0 {

/// What `replica_sync` decided, from one rank's point of view.
struct ReplicaSync {
  std::int64_t moves = 0;  ///< replica copies sent at this sync, over all ranks
  std::int64_t reused = 0; ///< replicas already resident and kept, over all ranks
  /// `[n][5]` (tag, expert, source, destination, destination row) of the moves naming this rank, sorted by expert
  /// then destination; `tag` is the move's index in that order over all ranks (the same on every rank).
  std::vector<std::int64_t> my_moves;
  /// `[moves][4]` (expert, source, destination, destination row) of every move, in tag order (the same on every
  /// rank): the batch every rank hands the transfer engine.
  std::vector<std::int64_t> all_moves;
  std::vector<std::int64_t> rows; ///< `[S]` the storage row of each of this rank's plan slots (-1 empty)
  /// `[m][4]` (expert, holder, holder row, tag) of the replica-gradient transfers naming this rank (as holder or
  /// owner): every replica given tokens, sorted by expert then holder; `tag` its index over all ranks.
  std::vector<std::int64_t> grads;
};

/// The bookkeeping of layer `layer`'s plan `lp` for rank `rank` of `G = lp.placement.num_gpus()` ranks of
/// `S` rows each. `owners` `[E]` is the owner rank of every expert (the storage's sharding; it must equal
/// the plan's `lp.owner_gpu`); `resident` `[G][S]` holds the expert in each storage row of every
/// rank (-1 free; rows below a rank's owned count are its owner rows) and is updated in place to the plan's
/// replicas: a replica already resident stays unless its owner's weights `changed` (`[G]` flags), the others take
/// the lowest free rows in expert order, each copied from its owner. Throws `Error` naming a plan that drops an
/// owned expert, puts more replicas on a rank than it has spare rows, or disagrees with `owners`.
[[nodiscard]] inline ReplicaSync replica_sync(const LayerPlan &lp, int layer, std::span<const std::int32_t> owners,
                                              std::span<std::int64_t> resident, std::span<const std::uint8_t> changed,
                                              int rank) {
  using detail::fail;
  using detail::require;
  const int G = lp.placement.num_gpus(), S = lp.placement.slots_per_gpu(), E = lp.placement.num_experts();
  require(static_cast<int>(owners.size()) == E, "replica_sync: ", owners.size(), " owners for ", E, " experts");
  const std::span<const std::int32_t> plan_owner = lp.owner_gpu;
  require(static_cast<int>(plan_owner.size()) == E, "replica_sync: the plan has ", plan_owner.size(), " owners for ", E,
          " experts");
  require(resident.size() == static_cast<std::size_t>(G) * S, "replica_sync: resident rows have ", resident.size(),
          " entries, expected [", G, ", ", S, "]");
  require(static_cast<int>(changed.size()) == G, "replica_sync: ", changed.size(), " flags for ", G, " ranks");
  require(rank >= 0 && rank < G, "replica_sync: rank ", rank, " outside [0, ", G, ")");
  const auto place = lp.placement.phys_to_log();
  require(lp.slot_tokens.size() == place.size(), "replica_sync: the plan has ", lp.slot_tokens.size(),
          " slot token counts for ", place.size(), " slots");
  ReplicaSync out;
  out.rows.assign(static_cast<std::size_t>(S), -1);
  std::vector<int> num_owned(static_cast<std::size_t>(G), 0), own_row(static_cast<std::size_t>(E), 0);
  for (int e = 0; e < E; ++e) {
    require(owners[e] >= 0 && owners[e] < G, "replica_sync: expert ", e, " has owner rank ", owners[e]);
    require(plan_owner[e] == owners[e], "ExpertStorage: plan layer ", layer, " makes GPU ", plan_owner[e],
            " the owner of expert ", e, ", the storage rank ", owners[e],
            " (plan with owners=... the trainer's sharding)");
    own_row[e] = num_owned[owners[e]]++;
  }
  std::vector<char> want(static_cast<std::size_t>(G) * E, 0); // [G][E]: the plan puts a replica of e on g
  for (int g = 0; g < G; ++g) {
    int owner_copies = 0, replicas = 0;
    for (int j = 0; j < S; ++j) {
      const std::int32_t e = place[static_cast<std::size_t>(g) * S + j];
      if (e < 0) continue;
      if (owners[e] == g) {
        ++owner_copies;
      } else {
        want[static_cast<std::size_t>(g) * E + e] = 1;
        ++replicas;
      }
    }
    if (owner_copies != num_owned[g]) { // one copy of an expert per GPU: equal counts mean all owners are there
      for (int e = 0; e < E; ++e)
        if (owners[e] == g &&
            std::find(place.begin() + g * S, place.begin() + (g + 1) * S, e) == place.begin() + (g + 1) * S)
          fail("ExpertStorage: plan layer ", layer, " does not keep rank ", g, "'s owned expert ", e, " on rank ", g);
    }
    require(replicas <= S - num_owned[g], "ExpertStorage: plan layer ", layer, " puts ", replicas, " replicas on rank ",
            g, ", which has ", S - num_owned[g], " spare slots");
  }
  struct MoveRow {
    std::int64_t e, src, dst, row;
  };
  std::vector<MoveRow> all;
  std::vector<char> kept(static_cast<std::size_t>(E));
  for (int g = 0; g < G; ++g) {
    std::int64_t *rr = resident.data() + static_cast<std::size_t>(g) * S;
    std::fill(kept.begin(), kept.end(), 0);
    for (int j = num_owned[g]; j < S; ++j) {
      const std::int64_t e = rr[j];
      if (e >= 0 && e < E && want[static_cast<std::size_t>(g) * E + e] && !changed[owners[e]]) {
        kept[e] = 1;
        ++out.reused;
      } else {
        rr[j] = -1;
      }
    }
    for (int j = 0; j < num_owned[g]; ++j)
      rr[j] = -1;
    int free_row = num_owned[g];
    for (int e = 0; e < E; ++e) {
      if (!want[static_cast<std::size_t>(g) * E + e] || kept[e]) continue;
      while (rr[free_row] >= 0)
        ++free_row;
      rr[free_row] = e;
      all.push_back({e, owners[e], g, free_row});
    }
  }
  std::sort(all.begin(), all.end(),
            [](const MoveRow &a, const MoveRow &b) { return a.e != b.e ? a.e < b.e : a.dst < b.dst; });
  out.moves = static_cast<std::int64_t>(all.size());
  out.all_moves.reserve(all.size() * 4);
  for (const MoveRow &m : all)
    out.all_moves.insert(out.all_moves.end(), {m.e, m.src, m.dst, m.row});
  for (std::size_t i = 0; i < all.size(); ++i)
    if (all[i].src == rank || all[i].dst == rank)
      out.my_moves.insert(out.my_moves.end(),
                          {static_cast<std::int64_t>(i), all[i].e, all[i].src, all[i].dst, all[i].row});
  auto row_of = [&](int g, std::int32_t e) -> std::int64_t {
    if (owners[e] == g) return own_row[e];
    const std::int64_t *rr = resident.data() + static_cast<std::size_t>(g) * S;
    return std::find(rr, rr + S, e) - rr;
  };
  for (int j = 0; j < S; ++j)
    if (const std::int32_t e = place[static_cast<std::size_t>(rank) * S + j]; e >= 0) out.rows[j] = row_of(rank, e);
  std::vector<MoveRow> gr; // replica gradients: (expert, holder, -, holder row)
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < S; ++j) {
      const std::size_t q = static_cast<std::size_t>(g) * S + j;
      const std::int32_t e = place[q];
      if (e >= 0 && owners[e] != g && lp.slot_tokens[q] > 0) gr.push_back({e, g, 0, row_of(g, e)});
    }
  std::sort(gr.begin(), gr.end(),
            [](const MoveRow &a, const MoveRow &b) { return a.e != b.e ? a.e < b.e : a.src < b.src; });
  for (std::size_t i = 0; i < gr.size(); ++i)
    if (gr[i].src == rank || owners[gr[i].e] == rank)
      out.grads.insert(out.grads.end(), {gr[i].e, gr[i].src, gr[i].row, static_cast<std::int64_t>(i)});
  return out;
}

} // namespace v0
} // namespace foremoe
