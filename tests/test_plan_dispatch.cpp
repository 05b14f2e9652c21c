// Owner-pinned step planning (Planner::plan_step_with_owners), one rank's dispatch layout (plan/dispatch.hpp)
// and the replica-row bookkeeping (plan/replica_sync.hpp), on random instances: the layouts of all ranks together
// must deliver every routed (token, k) to a slot holding its expert, and the bookkeeping must leave exactly the
// plan's replicas resident, moving only what was not there.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/plan/dispatch.hpp"
#include "foremoe/plan/planner.hpp"
#include "foremoe/plan/replica_sync.hpp"
#include "foremoe/plan/split.hpp"
#include "test_support.hpp"

using namespace foremoe;

namespace {

struct Instance {
  int G = 2, S = 2, E = 4, K = 2;
  std::vector<std::vector<std::int32_t>> ids; ///< per rank: [tokens * K], -1 = no route
  std::vector<std::int32_t> owners;           ///< [E] owner rank
};

Instance random_instance(std::mt19937 &rng) {
  Instance in;
  in.G = std::uniform_int_distribution<int>(2, 4)(rng);
  in.E = in.G * std::uniform_int_distribution<int>(1, 4)(rng);
  in.S = in.E / in.G + std::uniform_int_distribution<int>(1, 3)(rng);
  in.K = std::uniform_int_distribution<int>(1, std::min(3, in.E))(rng);
  in.owners.resize(static_cast<std::size_t>(in.E));
  for (int e = 0; e < in.E; ++e)
    in.owners[e] = e * in.G / in.E; // contiguous sharding, E / G per rank
  // Skewed routing: a few hot experts, so the plans replicate.
  std::vector<double> weight(static_cast<std::size_t>(in.E));
  for (double &w : weight)
    w = std::pow(std::uniform_real_distribution<double>(0.05, 1.0)(rng), 3.0);
  std::discrete_distribution<int> pick(weight.begin(), weight.end());
  for (int r = 0; r < in.G; ++r) {
    const int T = std::uniform_int_distribution<int>(0, 40)(rng);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(T) * in.K, -1);
    for (int t = 0; t < T; ++t) {
      std::set<int> chosen;
      for (int k = 0; k < in.K; ++k) {
        if (std::uniform_int_distribution<int>(0, 9)(rng) == 0) continue; // a dropped route
        int e = pick(rng);
        while (chosen.count(e))
          e = (e + 1) % in.E;
        chosen.insert(e);
        ids[static_cast<std::size_t>(t) * in.K + k] = e;
      }
    }
    in.ids.push_back(std::move(ids));
  }
  return in;
}

/// `n` micro-steps of one shape (ranks, slots, experts, top-k), each with its own routing.
std::vector<Instance> random_step(std::mt19937 &rng, int n) {
  std::vector<Instance> steps{random_instance(rng)};
  const Instance first = steps.front(); // a copy: push_back below may move the vector's elements
  while (static_cast<int>(steps.size()) < n) {
    Instance next = random_instance(rng);
    if (next.G == first.G && next.E == first.E && next.K == first.K && next.S == first.S) steps.push_back(next);
  }
  return steps;
}

/// `[E][G]` tokens of each expert from each source rank.
std::vector<std::int64_t> source_loads(const Instance &in) {
  std::vector<std::int64_t> out(static_cast<std::size_t>(in.E) * in.G, 0);
  for (int r = 0; r < in.G; ++r)
    for (std::int32_t e : in.ids[r])
      if (e >= 0) ++out[static_cast<std::size_t>(e) * in.G + r];
  return out;
}

LoadTensor micro_step_loads(const std::vector<Instance> &steps) {
  LoadTensor t(static_cast<int>(steps.size()), 1, steps.front().E);
  for (std::size_t m = 0; m < steps.size(); ++m) {
    const auto src = source_loads(steps[m]);
    for (int e = 0; e < steps[m].E; ++e)
      for (int r = 0; r < steps[m].G; ++r)
        t.at(static_cast<int>(m), 0, e) += src[static_cast<std::size_t>(e) * steps[m].G + r];
  }
  return t;
}

Planner::OwnerMap owner_map(const Instance &in) { return {in.owners}; }

RoutedView view_of(const Instance &in, int rank) {
  const auto &ids = in.ids[rank];
  return {ids.data(), IdDtype::i32, static_cast<std::int64_t>(ids.size() / in.K), 1, in.K};
}

/// Runs every rank's dispatch layout and checks the exchange it describes end to end.
void check_dispatch(const Instance &in, const LayerPlan &lp) {
  const auto split = split_by_source(lp.placement, lp.slot_tokens, source_loads(in), in.G, in.G);
  const auto place = lp.placement.phys_to_log();
  std::vector<DispatchLayout> d;
  for (int r = 0; r < in.G; ++r)
    d.push_back(dispatch_layout(lp.placement, split, view_of(in, r), r));
  for (int r = 0; r < in.G; ++r) {
    const auto &ids = in.ids[r];
    const DispatchLayout &x = d[r];
    REQUIRE(x.slots.size() == ids.size());
    std::int64_t routed = 0;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      CHECK((x.slots[i] >= 0) == (ids[i] >= 0));
      if (ids[i] < 0) continue;
      ++routed;
      CHECK(place[static_cast<std::size_t>(x.slots[i])] == ids[i]); // the slot holds the expert
    }
    // The send order: every route once, by slot, token order inside a slot.
    REQUIRE(static_cast<std::int64_t>(x.order.size()) == routed);
    for (std::size_t i = 1; i < x.order.size(); ++i) {
      const auto a = x.order[i - 1], b = x.order[i];
      CHECK(std::make_pair(x.slots[a], a) < std::make_pair(x.slots[b], b));
    }
    std::vector<std::int64_t> to(static_cast<std::size_t>(in.G), 0);
    REQUIRE(x.send_experts.size() == x.order.size());
    REQUIRE(x.route_pos.size() == ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) // route_pos inverts order; -1 exactly where there is no route
      if (ids[i] < 0)
        CHECK(x.route_pos[i] == -1);
      else
        CHECK(x.order[static_cast<std::size_t>(x.route_pos[i])] == static_cast<std::int64_t>(i));
    for (std::size_t i = 0; i < x.order.size(); ++i) {
      CHECK(x.send_tokens[i] == x.order[i] / in.K);
      CHECK(x.send_experts[i] == ids[static_cast<std::size_t>(x.order[i])]);
      ++to[static_cast<std::size_t>(x.slots[x.order[i]] / in.S)];
    }
    CHECK(x.input_splits == to);
    for (int s = 0; s < in.G; ++s)
      CHECK(x.output_splits[s] == d[s].input_splits[r]); // what s sends to r is what r receives from s
  }
  // The exchange: rank r receives, source by source, the entries of each source's order bound for it; grouped by
  // recv_perm they must come slot by slot with slot_counts rows each, sources in rank order inside a slot.
  for (int r = 0; r < in.G; ++r) {
    std::vector<std::tuple<int, std::int64_t, int>> received; // (slot, entry, source)
    for (int s = 0; s < in.G; ++s)
      for (std::int64_t i : d[s].order)
        if (d[s].slots[i] / in.S == r) received.emplace_back(d[s].slots[i], i, s);
    const DispatchLayout &x = d[r];
    REQUIRE(x.recv_perm.size() == received.size());
    REQUIRE(x.recv_inverse.size() == received.size());
    std::size_t pos = 0;
    for (int j = 0; j < in.S; ++j) {
      int last_source = -1;
      for (std::int64_t c = 0; c < x.slot_counts[j]; ++c, ++pos) {
        REQUIRE(pos < x.recv_perm.size());
        const auto &[slot, entry, source] = received[static_cast<std::size_t>(x.recv_perm[pos])];
        CHECK(slot == r * in.S + j);
        CHECK(source >= last_source);
        last_source = source;
        CHECK(x.recv_inverse[static_cast<std::size_t>(x.recv_perm[pos])] == static_cast<std::int64_t>(pos));
      }
    }
    CHECK(pos == received.size());
  }
}

} // namespace

TEST_CASE("plan_step_with_owners keeps the given owners on every micro-step") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 30; ++trial) {
    const std::vector<Instance> steps = random_step(rng, 3);
    const Instance &first = steps.front();
    Planner planner(1, first.E, Topology{1, first.G, first.S});
    const StepPlan sp = planner.plan_step_with_owners(micro_step_loads(steps), owner_map(first));
    REQUIRE(sp.micro_steps.size() == steps.size());
    CHECK(sp.owner_gpu == owner_map(first));
    for (const auto &ms : sp.micro_steps) {
      CHECK(ms[0].owner_gpu == first.owners);
      const auto place = ms[0].placement.phys_to_log();
      for (int e = 0; e < first.E; ++e) // the owner holds a copy
        CHECK(std::find(place.begin() + first.owners[e] * first.S, place.begin() + (first.owners[e] + 1) * first.S,
                        e) != place.begin() + (first.owners[e] + 1) * first.S);
    }
  }
  Planner planner(1, 4, Topology{1, 2, 2});
  LoadTensor t(1, 1, 4);
  CHECK_ERROR_CONTAINS((void)planner.plan_step_with_owners(t, {{0, 0, 0, 1}}), "owns more than its 2 slots");
  CHECK_ERROR_CONTAINS((void)planner.plan_step_with_owners(t, {{0, 0, 1, 2}}), "has owner GPU 2");
  CHECK_ERROR_CONTAINS((void)planner.plan_step_with_owners(t, {{0, 0, 1}}), "3 experts, expected 4");
}

TEST_CASE("dispatch_layout: the ranks' layouts deliver every route to its expert's slot, grouped by local slot") {
  std::mt19937 rng(11);
  int with_replicas = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const Instance in = random_instance(rng);
    Planner planner(1, in.E, Topology{1, in.G, in.S});
    const StepPlan sp = planner.plan_step_with_owners(micro_step_loads({in}), owner_map(in));
    const LayerPlan &lp = sp.micro_steps[0][0];
    with_replicas += lp.num_replicas() > 0;
    check_dispatch(in, lp);
  }
  CHECK(with_replicas > 50); // the property covered replicated experts, not only owners
}

TEST_CASE("dispatch_layout refuses a split of the wrong shape, a negative count, a bad rank and other ids") {
  std::mt19937 rng(3);
  Instance in = random_instance(rng);
  while (in.ids[0].empty() || std::count(in.ids[0].begin(), in.ids[0].end(), -1) == std::ssize(in.ids[0]))
    in = random_instance(rng);
  Planner planner(1, in.E, Topology{1, in.G, in.S});
  const LayerPlan lp = planner.plan_step_with_owners(micro_step_loads({in}), owner_map(in)).micro_steps[0][0];
  auto split = split_by_source(lp.placement, lp.slot_tokens, source_loads(in), in.G, in.G);
  CHECK_ERROR_CONTAINS((void)dispatch_layout(lp.placement, std::span(split).first(split.size() - 1), view_of(in, 0), 0),
                       "expected [");
  CHECK_ERROR_CONTAINS((void)dispatch_layout(lp.placement, split, view_of(in, 0), in.G), "outside [0, ");
  auto negative = split;
  negative[0] = -1;
  CHECK_ERROR_CONTAINS((void)dispatch_layout(lp.placement, negative, view_of(in, 0), 0), "takes -1 tokens");
  Instance other = in; // rank 0's ids no longer match the split's column for rank 0
  for (std::int32_t &e : other.ids[0])
    if (e >= 0) {
      e = -1;
      break;
    }
  CHECK_THROWS_AS((void)dispatch_layout(lp.placement, split, view_of(other, 0), 0), Error);
}

TEST_CASE("dispatch_from_loads: the layout of split_by_source's split, and its errors") {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 50; ++trial) {
    const Instance in = random_instance(rng);
    Planner planner(1, in.E, Topology{1, in.G, in.S});
    const LayerPlan lp = planner.plan_step_with_owners(micro_step_loads({in}), owner_map(in)).micro_steps[0][0];
    const auto loads = source_loads(in);
    const auto split = split_by_source(lp.placement, lp.slot_tokens, loads, in.G, in.G);
    for (int r = 0; r < in.G; ++r) {
      std::vector<std::int64_t> got_split;
      const DispatchLayout a = dispatch_layout(lp.placement, split, view_of(in, r), r);
      const DispatchLayout b = dispatch_from_loads(lp.placement, lp.slot_tokens, loads, view_of(in, r), r, in.G,
                                                   TokenMapRule::positional, &got_split);
      CHECK(got_split == split);
      CHECK(b.slots == a.slots);
      CHECK(b.order == a.order);
      CHECK(b.route_pos == a.route_pos);
      CHECK(b.send_experts == a.send_experts);
      CHECK(b.recv_perm == a.recv_perm);
      CHECK(b.slot_counts == a.slot_counts);
    }
  }
  Instance in = random_instance(rng);
  while (in.ids[0].empty() || std::count(in.ids[0].begin(), in.ids[0].end(), -1) == std::ssize(in.ids[0]))
    in = random_instance(rng);
  Planner planner(1, in.E, Topology{1, in.G, in.S});
  const LayerPlan lp = planner.plan_step_with_owners(micro_step_loads({in}), owner_map(in)).micro_steps[0][0];
  auto loads = source_loads(in);
  const auto e = static_cast<std::size_t>(*std::max_element(in.ids[0].begin(), in.ids[0].end()));
  loads[e * static_cast<std::size_t>(in.G)] += 1; // an expert with one token more than the plan splits
  CHECK_ERROR_CONTAINS((void)dispatch_from_loads(lp.placement, lp.slot_tokens, loads, view_of(in, 0), 0, in.G),
                       "split_by_source: expert");
}

TEST_CASE("routes_from_map: each token's experts ascending, -1 padded, the counts; bad maps are named") {
  std::mt19937 rng(8);
  for (int trial = 0; trial < 100; ++trial) {
    const int T = std::uniform_int_distribution<int>(0, 50)(rng), E = std::uniform_int_distribution<int>(1, 70)(rng);
    const int K = std::uniform_int_distribution<int>(1, std::min(E, 9))(rng);
    std::vector<std::uint8_t> map(static_cast<std::size_t>(T) * E, 0);
    std::vector<std::vector<std::int32_t>> want(static_cast<std::size_t>(T));
    std::vector<std::int64_t> want_counts(static_cast<std::size_t>(E), 0);
    std::int64_t want_short = 0;
    for (int t = 0; t < T; ++t) {
      const int n =
          std::uniform_int_distribution<int>(0, 4)(rng) == 0 ? std::uniform_int_distribution<int>(0, K)(rng) : K;
      want_short += n < K;
      std::set<int> chosen;
      while (static_cast<int>(chosen.size()) < n)
        chosen.insert(std::uniform_int_distribution<int>(0, E - 1)(rng));
      for (int e : chosen) {
        map[static_cast<std::size_t>(t) * E + e] = 1;
        want[static_cast<std::size_t>(t)].push_back(e);
        ++want_counts[static_cast<std::size_t>(e)];
      }
      want[static_cast<std::size_t>(t)].resize(static_cast<std::size_t>(K), -1);
    }
    std::vector<std::int32_t> ids(static_cast<std::size_t>(T) * K, 7);
    std::vector<std::int64_t> counts(static_cast<std::size_t>(E), 3);
    CHECK(routes_from_map(map, T, E, K, ids, counts) == want_short);
    CHECK(counts == want_counts);
    for (int t = 0; t < T; ++t)
      CHECK(std::vector<std::int32_t>(ids.begin() + t * K, ids.begin() + (t + 1) * K) ==
            want[static_cast<std::size_t>(t)]);
  }
  // 2 tokens over 20 experts (a full word, then a tail), top-2.
  std::vector<std::uint8_t> map(40, 0);
  std::vector<std::int32_t> ids(4);
  std::vector<std::int64_t> counts(20);
  map[20 + 17] = 2;
  CHECK_ERROR_CONTAINS((void)routes_from_map(map, 2, 20, 2, ids, counts),
                       "token 1, expert 17: the routing map holds 2");
  map[20 + 17] = 0;
  map[20 + 3] = 255;
  CHECK_ERROR_CONTAINS((void)routes_from_map(map, 2, 20, 2, ids, counts),
                       "token 1, expert 3: the routing map holds 255");
  map[20 + 3] = 1;
  map[20 + 9] = 1;
  map[20 + 19] = 1;
  CHECK_ERROR_CONTAINS((void)routes_from_map(map, 2, 20, 2, ids, counts), "token 1 is routed to more than top-k = 2");
  CHECK_ERROR_CONTAINS((void)routes_from_map(map, 2, 20, 3, ids, counts), "ids has 4 entries, expected 2 x 3");
  CHECK_ERROR_CONTAINS((void)routes_from_map(map, 3, 20, 2, ids, counts), "the map has 40 entries, expected 3 x 20");
}

TEST_CASE("replica_sync: the plan's replicas end resident, kept ones are not moved, every rank agrees") {
  std::mt19937 rng(5);
  int moved = 0, kept = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const std::vector<Instance> steps = random_step(rng, 4);
    const Instance &first = steps.front();
    const int G = first.G, S = first.S, E = first.E;
    Planner planner(1, E, Topology{1, G, S});
    const StepPlan sp = planner.plan_step_with_owners(micro_step_loads(steps), owner_map(first));
    std::vector<int> num_owned(static_cast<std::size_t>(G), 0), own_row(static_cast<std::size_t>(E), 0);
    for (int e = 0; e < E; ++e)
      own_row[e] = num_owned[first.owners[e]]++;
    // One resident table per rank: each rank runs the bookkeeping on its own copy, as the storage does.
    std::vector<std::vector<std::int64_t>> resident(static_cast<std::size_t>(G),
                                                    std::vector<std::int64_t>(static_cast<std::size_t>(G) * S, -1));
    for (std::size_t m = 0; m < sp.micro_steps.size(); ++m) {
      const LayerPlan &lp = sp.micro_steps[m][0];
      const auto place = lp.placement.phys_to_log();
      const bool refresh = m == 2; // the owners' weights changed (an optimizer step): every replica is re-sent
      const std::vector<std::uint8_t> changed(static_cast<std::size_t>(G), refresh ? 1 : 0);
      const std::vector<std::int64_t> before = resident[0];
      std::vector<ReplicaSync> out;
      for (int r = 0; r < G; ++r)
        out.push_back(replica_sync(lp, 0, first.owners, resident[r], changed, r));
      for (int r = 1; r < G; ++r) {
        CHECK(resident[r] == resident[0]);
        CHECK(out[r].moves == out[0].moves);
        CHECK(out[r].reused == out[0].reused);
      }
      // Exactly the plan's replicas are resident, in spare rows; the owner rows are marked free.
      std::int64_t wanted = 0, new_copies = 0;
      for (int g = 0; g < G; ++g) {
        std::multiset<std::int64_t> want, have;
        for (int j = 0; j < S; ++j) {
          const std::int32_t e = place[static_cast<std::size_t>(g) * S + j];
          if (e >= 0 && first.owners[e] != g) want.insert(e);
          const std::int64_t row = resident[0][static_cast<std::size_t>(g) * S + j];
          if (j < num_owned[g]) CHECK(row == -1);
          if (row >= 0) have.insert(row);
        }
        CHECK(want == have);
        wanted += static_cast<std::int64_t>(want.size());
        for (std::int64_t e : want) {
          const bool was_there =
              std::find(before.begin() + g * S, before.begin() + (g + 1) * S, e) != before.begin() + (g + 1) * S;
          new_copies += refresh || !was_there;
        }
      }
      CHECK(out[0].moves == new_copies);
      CHECK(out[0].reused + out[0].moves == wanted);
      moved += static_cast<int>(out[0].moves);
      kept += static_cast<int>(out[0].reused);
      // Every move appears at its source and its destination with the same tag, from the owner into the row now
      // holding the expert; the tags number all moves once.
      std::map<std::int64_t, std::vector<std::int64_t>> by_tag;
      for (int r = 0; r < G; ++r) {
        const auto &mv = out[r].my_moves;
        REQUIRE(mv.size() % 5 == 0);
        for (std::size_t i = 0; i < mv.size(); i += 5) {
          const std::vector<std::int64_t> row(mv.begin() + static_cast<std::ptrdiff_t>(i),
                                              mv.begin() + static_cast<std::ptrdiff_t>(i + 5));
          CHECK((row[2] == r || row[3] == r));
          CHECK(row[2] == first.owners[row[1]]);
          CHECK(resident[0][static_cast<std::size_t>(row[3]) * S + row[4]] == row[1]);
          if (by_tag.count(row[0])) CHECK(by_tag[row[0]] == row);
          by_tag[row[0]] = row;
        }
      }
      CHECK(static_cast<std::int64_t>(by_tag.size()) == out[0].moves);
      // `all_moves` is every rank's same list of every move, in tag order: the rows the ranks name, without tags.
      for (int r = 0; r < G; ++r) {
        REQUIRE(out[r].all_moves.size() == static_cast<std::size_t>(out[0].moves) * 4);
        CHECK(out[r].all_moves == out[0].all_moves);
      }
      for (const auto &[tag, row] : by_tag)
        CHECK(std::vector<std::int64_t>(out[0].all_moves.begin() + tag * 4, out[0].all_moves.begin() + tag * 4 + 4) ==
              std::vector<std::int64_t>(row.begin() + 1, row.end()));
      // Each plan slot maps to the storage row holding its expert.
      for (int r = 0; r < G; ++r)
        for (int j = 0; j < S; ++j) {
          const std::int32_t e = place[static_cast<std::size_t>(r) * S + j];
          const std::int64_t row = out[r].rows[j];
          if (e < 0) {
            CHECK(row == -1);
          } else if (first.owners[e] == r) {
            CHECK(row == own_row[e]);
          } else {
            CHECK(resident[0][static_cast<std::size_t>(r) * S + row] == e);
          }
        }
      // Gradients: every replica given tokens goes back to its owner once; each rank lists those it holds or owns.
      std::set<std::pair<std::int64_t, std::int64_t>> expect_grads, got_grads;
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < S; ++j) {
          const std::size_t q = static_cast<std::size_t>(g) * S + j;
          if (place[q] >= 0 && first.owners[place[q]] != g && lp.slot_tokens[q] > 0) expect_grads.insert({place[q], g});
        }
      for (int r = 0; r < G; ++r)
        for (std::size_t i = 0; i < out[r].grads.size(); i += 4) {
          const std::int64_t e = out[r].grads[i], holder = out[r].grads[i + 1];
          CHECK((holder == r || first.owners[e] == r));
          got_grads.insert({e, holder});
        }
      CHECK(got_grads == expect_grads);
    }
  }
  CHECK(moved > 0);
  CHECK(kept > 0); // resident reuse happened somewhere
}

TEST_CASE("replica_sync refuses a plan for other owners and tables of the wrong size") {
  Planner planner(1, 4, Topology{1, 2, 3});
  LoadTensor t(1, 1, 4);
  t.at(0, 0, 0) = 100;
  t.at(0, 0, 1) = 1;
  t.at(0, 0, 2) = 1;
  t.at(0, 0, 3) = 1;
  const LayerPlan lp = planner.plan_step_with_owners(t, {{0, 0, 1, 1}}).micro_steps[0][0];
  std::vector<std::int64_t> resident(6, -1);
  const std::vector<std::uint8_t> changed(2, 0);
  CHECK_ERROR_CONTAINS((void)replica_sync(lp, 0, std::vector<std::int32_t>{0, 1, 0, 1}, resident, changed, 0),
                       "the owner of expert 1");
  CHECK_ERROR_CONTAINS((void)replica_sync(lp, 0, std::vector<std::int32_t>{0, 0, 1}, resident, changed, 0),
                       "3 owners for 4 experts");
  std::vector<std::int64_t> short_rows(5, -1);
  CHECK_ERROR_CONTAINS((void)replica_sync(lp, 0, std::vector<std::int32_t>{0, 0, 1, 1}, short_rows, changed, 0),
                       "expected [2, 3]");
  CHECK_ERROR_CONTAINS((void)replica_sync(lp, 0, std::vector<std::int32_t>{0, 0, 1, 1}, resident, changed, 2),
                       "rank 2 outside");
}
