#pragma once
/// @file
/// The per-call index arrays of a trainer adapter whose own token dispatcher sends every routed `(token, k)` to
/// its plan slot (foremoe.megatron's dispatchers), beyond `DispatchLayout`: made in one pass each on the host, so
/// that the adapter's per-layer, per-micro-step path needs no index arithmetic of its own (issue 28,
/// "Performance"). Plain host code; the same on every rank for the same inputs.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/plan/dispatch.hpp"

namespace foremoe {
inline namespace v0 {

/// What the sending side of one layer call needs besides the `DispatchLayout` it is made from.
struct AdapterIndex {
  /// `[tokens * topk]` the sent row each route comes back from (`route_pos`), with a route that was not sent
  /// (`route_pos` -1) pointing at row `num_send`, one past the sent rows: the caller appends a zero row when
  /// `padded`, so combining the returned rows is one gather and a sum over `k`.
  std::vector<std::int64_t> gather;
  /// `[num_send]` `send_tokens[i] * prob_columns + send_experts[i]`: the flat index of each sent row's routing
  /// weight in a `[tokens, prob_columns]` probability matrix (Megatron's `[T, E]` probs).
  std::vector<std::int64_t> prob_index;
  bool padded = false; ///< some route was not sent (a token with fewer routes than top-k)
};

/// `AdapterIndex` of `layout` (a `DispatchLayout` of `prob_columns`-expert routing). Throws `Error` naming a
/// non-positive `prob_columns` or a sent row whose expert is outside `[0, prob_columns)`.
[[nodiscard]] inline AdapterIndex adapter_index(const DispatchLayout &layout, std::int64_t prob_columns) {
  using detail::require;
  require(prob_columns > 0, "adapter_index: prob_columns must be positive, got ", prob_columns);
  const std::size_t n_send = layout.send_tokens.size();
  require(layout.send_experts.size() == n_send, "adapter_index: ", layout.send_experts.size(), " sent experts for ",
          n_send, " sent rows");
  AdapterIndex out;
  out.gather.resize(layout.route_pos.size());
  const auto past = static_cast<std::int64_t>(n_send);
  for (std::size_t i = 0; i < layout.route_pos.size(); ++i) {
    const std::int64_t p = layout.route_pos[i];
    out.padded = out.padded || p < 0;
    out.gather[i] = p < 0 ? past : p;
  }
  out.prob_index.resize(n_send);
  for (std::size_t i = 0; i < n_send; ++i) {
    const std::int64_t e = layout.send_experts[i];
    require(e >= 0 && e < prob_columns, "adapter_index: sent row ", i, " has expert ", e, " outside [0, ", prob_columns,
            ")");
    out.prob_index[i] = layout.send_tokens[i] * prob_columns + e;
  }
  return out;
}

/// The received rows regrouped by storage row (a grouped GEMM over a whole slot storage, foremoe.megatron's
/// `GroupedMLP` path) instead of by plan slot.
struct RowGrouping {
  std::vector<std::int64_t> counts;       ///< `[rows_total]` rows each storage row computes (0 without tokens)
  std::vector<std::int64_t> recv_perm;    ///< the received row at each position grouped by storage row, ascending
  std::vector<std::int64_t> recv_inverse; ///< the inverse permutation of `recv_perm`
  bool reordered = false;                 ///< whether the slot blocks changed order (else `recv_perm` is the input)
};

/// Regroups the received rows of one layer call from local plan slot order (`slot_counts[j]` rows of slot `j`,
/// slot after slot, each block in order; `recv_perm` the `DispatchLayout`'s grouping of the received rows) into
/// ascending storage row order: `rows[j]` is slot `j`'s storage row (-1 for an empty slot), `rows_total` the
/// storage rows. The blocks keep their inner order; only whole blocks move. Throws `Error` naming the slot for a
/// slot with tokens and no row, a row outside `[0, rows_total)` or two slots with tokens on one row, and naming
/// the sizes when `slot_counts`, `rows` and `recv_perm` disagree.
[[nodiscard]] inline RowGrouping group_by_storage_row(std::span<const std::int64_t> slot_counts,
                                                      std::span<const std::int64_t> rows, std::int64_t rows_total,
                                                      std::span<const std::int64_t> recv_perm) {
  using detail::require;
  const std::size_t S = slot_counts.size();
  require(rows.size() == S, "group_by_storage_row: ", rows.size(), " storage rows for ", S, " slots");
  require(rows_total >= 0, "group_by_storage_row: rows_total must be >= 0, got ", rows_total);
  RowGrouping out;
  out.counts.assign(static_cast<std::size_t>(rows_total), 0);
  std::vector<std::int64_t> start(S + 1, 0); // slot j's first row in slot order
  std::vector<std::int64_t> slot_of_row(static_cast<std::size_t>(rows_total), -1);
  for (std::size_t j = 0; j < S; ++j) {
    const std::int64_t n = slot_counts[j];
    require(n >= 0, "group_by_storage_row: slot ", j, " has ", n, " rows");
    start[j + 1] = start[j] + n;
    if (n == 0) continue;
    const std::int64_t row = rows[j];
    require(row >= 0 && row < rows_total, "group_by_storage_row: slot ", j, " takes ", n,
            " rows but its storage row is ", row, " (outside [0, ", rows_total, "))");
    auto &owner = slot_of_row[static_cast<std::size_t>(row)];
    require(owner < 0, "group_by_storage_row: slots ", owner, " and ", j, " both take rows on storage row ", row);
    owner = static_cast<std::int64_t>(j);
    out.counts[static_cast<std::size_t>(row)] = n;
  }
  const auto total = static_cast<std::size_t>(start[S]);
  require(recv_perm.size() == total, "group_by_storage_row: recv_perm has ", recv_perm.size(),
          " entries, the slot counts sum to ", total);
  // Already in ascending row order when the rows of the slots with tokens ascend with the slot.
  std::int64_t last = -1;
  for (std::size_t j = 0; j < S && !out.reordered; ++j)
    if (slot_counts[j] > 0) {
      out.reordered = rows[j] < last;
      last = rows[j];
    }
  out.recv_perm.resize(total);
  out.recv_inverse.resize(total);
  if (!out.reordered) {
    std::copy(recv_perm.begin(), recv_perm.end(), out.recv_perm.begin());
  } else {
    std::size_t pos = 0;
    for (const std::int64_t j : slot_of_row) {
      if (j < 0) continue;
      const auto b = static_cast<std::size_t>(start[static_cast<std::size_t>(j)]);
      const auto e = static_cast<std::size_t>(start[static_cast<std::size_t>(j) + 1]);
      std::copy(recv_perm.begin() + static_cast<std::ptrdiff_t>(b), recv_perm.begin() + static_cast<std::ptrdiff_t>(e),
                out.recv_perm.begin() + static_cast<std::ptrdiff_t>(pos));
      pos += e - b;
    }
  }
  for (std::size_t i = 0; i < total; ++i) {
    const std::int64_t r = out.recv_perm[i];
    require(r >= 0 && static_cast<std::size_t>(r) < total, "group_by_storage_row: recv_perm[", i, "] = ", r,
            " outside [0, ", total, ")");
    out.recv_inverse[static_cast<std::size_t>(r)] = static_cast<std::int64_t>(i);
  }
  return out;
}

} // namespace v0
} // namespace foremoe
