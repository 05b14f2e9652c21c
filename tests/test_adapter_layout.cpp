// The adapter's per-call index arrays (plan/adapter_layout.hpp) on random instances, against a direct
// computation: the combine gather and the flat probability index of a dispatch layout, and the received rows
// regrouped by storage row.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/plan/adapter_layout.hpp"
#include "foremoe/plan/dispatch.hpp"
#include "test_support.hpp"

using namespace foremoe;

TEST_CASE("adapter_index: the gather inverts the send order, with unsent routes on the zero row past the end") {
  std::mt19937 rng(5);
  int padded = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int T = std::uniform_int_distribution<int>(0, 30)(rng), K = std::uniform_int_distribution<int>(1, 4)(rng);
    const int E = std::uniform_int_distribution<int>(K, 12)(rng);
    const bool drop = trial % 2 == 0;
    // A random send order of the routes that are sent (each route unsent with probability 1/8 when `drop`).
    std::vector<std::int64_t> routes;
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(T) * K; ++i)
      if (!drop || std::uniform_int_distribution<int>(0, 7)(rng) != 0) routes.push_back(i);
    std::shuffle(routes.begin(), routes.end(), rng);
    DispatchLayout d;
    d.route_pos.assign(static_cast<std::size_t>(T) * K, -1);
    for (std::size_t i = 0; i < routes.size(); ++i) {
      d.route_pos[static_cast<std::size_t>(routes[i])] = static_cast<std::int64_t>(i);
      d.send_tokens.push_back(routes[i] / K);
      d.send_experts.push_back(std::uniform_int_distribution<std::int32_t>(0, E - 1)(rng));
    }
    const AdapterIndex a = adapter_index(d, E);
    const bool any_unsent = routes.size() < static_cast<std::size_t>(T) * K;
    CHECK(a.padded == any_unsent);
    padded += a.padded;
    REQUIRE(a.gather.size() == d.route_pos.size());
    for (std::size_t i = 0; i < a.gather.size(); ++i)
      CHECK(a.gather[i] == (d.route_pos[i] < 0 ? static_cast<std::int64_t>(routes.size()) : d.route_pos[i]));
    REQUIRE(a.prob_index.size() == routes.size());
    for (std::size_t i = 0; i < routes.size(); ++i) {
      CHECK(a.prob_index[i] / E == routes[i] / K); // the row of the sent token
      CHECK(a.prob_index[i] % E == d.send_experts[i]);
    }
  }
  CHECK(padded > 50);
  DispatchLayout d;
  d.send_tokens = {0};
  d.send_experts = {3};
  d.route_pos = {0};
  CHECK_ERROR_CONTAINS((void)adapter_index(d, 3), "sent row 0 has expert 3 outside [0, 3)");
  CHECK_ERROR_CONTAINS((void)adapter_index(d, 0), "prob_columns must be positive, got 0");
}

TEST_CASE("group_by_storage_row: the slot blocks in ascending storage row, each block's rows in order") {
  std::mt19937 rng(9);
  int reordered = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int S = std::uniform_int_distribution<int>(1, 10)(rng);
    const int total_rows = S + std::uniform_int_distribution<int>(0, 4)(rng);
    std::vector<std::int64_t> free_rows(static_cast<std::size_t>(total_rows));
    std::iota(free_rows.begin(), free_rows.end(), 0);
    std::shuffle(free_rows.begin(), free_rows.end(), rng);
    std::vector<std::int64_t> counts(static_cast<std::size_t>(S)), rows(static_cast<std::size_t>(S));
    for (int j = 0; j < S; ++j) {
      counts[j] =
          std::uniform_int_distribution<int>(0, 3)(rng) == 0 ? 0 : std::uniform_int_distribution<int>(1, 6)(rng);
      rows[j] = (counts[j] == 0 && j % 2 == 0) ? -1 : free_rows[static_cast<std::size_t>(j)];
    }
    const std::int64_t n = std::accumulate(counts.begin(), counts.end(), std::int64_t{0});
    std::vector<std::int64_t> perm(static_cast<std::size_t>(n));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    const RowGrouping g = group_by_storage_row(counts, rows, total_rows, perm);
    // Direct: each slot's block of perm, keyed by its storage row, concatenated in row order.
    std::map<std::int64_t, std::vector<std::int64_t>> by_row;
    std::vector<std::int64_t> want_counts(static_cast<std::size_t>(total_rows), 0);
    std::size_t at = 0;
    for (int j = 0; j < S; ++j) {
      for (std::int64_t c = 0; c < counts[j]; ++c)
        by_row[rows[j]].push_back(perm[at++]);
      if (counts[j] > 0) want_counts[static_cast<std::size_t>(rows[j])] = counts[j];
    }
    std::vector<std::int64_t> want;
    for (const auto &[row, block] : by_row)
      want.insert(want.end(), block.begin(), block.end());
    CHECK(g.counts == want_counts);
    CHECK(g.recv_perm == want);
    CHECK(g.reordered == (want != perm));
    reordered += g.reordered;
    REQUIRE(g.recv_inverse.size() == want.size());
    for (std::size_t i = 0; i < want.size(); ++i)
      CHECK(g.recv_inverse[static_cast<std::size_t>(want[i])] == static_cast<std::int64_t>(i));
  }
  CHECK(reordered > 50);
  const std::vector<std::int64_t> perm{0, 1, 2};
  CHECK_ERROR_CONTAINS(
      (void)group_by_storage_row(std::vector<std::int64_t>{2, 1}, std::vector<std::int64_t>{1, 1}, 3, perm),
      "slots 0 and 1 both take rows on storage row 1");
  CHECK_ERROR_CONTAINS(
      (void)group_by_storage_row(std::vector<std::int64_t>{2, 1}, std::vector<std::int64_t>{0, -1}, 3, perm),
      "slot 1 takes 1 rows but its storage row is -1");
  CHECK_ERROR_CONTAINS(
      (void)group_by_storage_row(std::vector<std::int64_t>{2, 2}, std::vector<std::int64_t>{0, 1}, 3, perm),
      "recv_perm has 3 entries, the slot counts sum to 4");
}
