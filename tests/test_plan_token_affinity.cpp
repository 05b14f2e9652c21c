// The node-affine token map (plan/token_map.hpp, TokenMapRule::node_affine) against the positional one on random
// placements, splits and routings, with and without a split by source, on planner plans, through the dispatch
// layout, and the token-node hit count (count_node_hits) against a direct count.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/plan/dispatch.hpp"
#include "foremoe/plan/planner.hpp"
#include "foremoe/plan/split.hpp"
#include "foremoe/plan/token_map.hpp"
#include "foremoe/trace/count.hpp"
#include "test_support.hpp"

using namespace foremoe;

namespace {

/// One layer: a random placement (every expert an owner, hot ones more copies, never two on one GPU), skewed
/// routed ids `[T][1][K]` grouped by source GPU, and a random integer split of every (expert, source) count over
/// the expert's copies (some copies given nothing).
struct Instance {
  Topology topo;
  int num_experts = 0, topk = 0;
  std::int64_t num_tokens = 0;
  LayerPlacement placement;
  std::vector<std::int32_t> ids;            ///< `[T][K]`, -1 = no route
  std::vector<std::int64_t> source_offsets; ///< `[G + 1]`
  std::vector<std::int64_t> split;          ///< `[slots][G]`
  std::vector<std::int64_t> slot_tokens;    ///< `[slots]` the split summed over sources
};

Instance random_instance(std::mt19937_64 &rng) {
  Instance in;
  const int nodes = 1 + int(rng() % 4), gpn = 1 + int(rng() % 4), G = nodes * gpn;
  in.num_experts = 2 + int(rng() % 24);
  const int owners = (in.num_experts + G - 1) / G;
  in.topo = Topology{nodes, gpn, owners + 1 + int(rng() % 3)};
  in.topk = 1 + int(rng() % std::min(6, in.num_experts));
  in.placement = LayerPlacement(G, in.topo.slots_per_gpu, in.num_experts);
  for (int e = 0; e < in.num_experts; ++e) // owners round-robin over GPUs
    in.placement.slot(e % G, e / G) = e;
  // Replicas into the free slots: an expert at random, skipping GPUs that hold it already.
  for (int g = 0; g < G; ++g)
    for (int s = 0; s < in.topo.slots_per_gpu; ++s) {
      if (in.placement.slot(g, s) != empty_slot || rng() % 4 == 0) continue;
      const int e = int(rng() % std::uint64_t(in.num_experts));
      if (!in.placement.holds(g, e)) in.placement.slot(g, s) = e;
    }
  in.num_tokens = std::int64_t(rng() % 200);
  std::vector<double> weight(std::size_t(in.num_experts));
  for (auto &w : weight)
    w = std::pow(double(rng() % 100 + 1), 2.0);
  std::discrete_distribution<int> pick(weight.begin(), weight.end());
  in.ids.resize(std::size_t(in.num_tokens) * in.topk);
  for (auto &id : in.ids)
    id = rng() % 13 == 0 ? -1 : pick(rng); // duplicates within a token allowed: the map must not care
  in.source_offsets = {0};
  for (int g = 0; g + 1 < G; ++g)
    in.source_offsets.push_back(std::int64_t(rng() % std::uint64_t(in.num_tokens + 1)));
  in.source_offsets.push_back(in.num_tokens);
  std::sort(in.source_offsets.begin(), in.source_offsets.end());
  // Counts per (expert, source), cut at random points over the expert's copies.
  const int P = in.placement.num_slots();
  in.split.assign(std::size_t(P) * G, 0);
  for (int src = 0; src < G; ++src) {
    std::vector<std::int64_t> count(std::size_t(in.num_experts), 0);
    for (std::int64_t t = in.source_offsets[src]; t < in.source_offsets[src + 1]; ++t)
      for (int k = 0; k < in.topk; ++k)
        if (const auto e = in.ids[std::size_t(t) * in.topk + k]; e >= 0) ++count[std::size_t(e)];
    for (int e = 0; e < in.num_experts; ++e) {
      std::vector<int> copies;
      for (int p = 0; p < P; ++p)
        if (in.placement.phys_to_log()[p] == e) copies.push_back(p);
      std::vector<std::int64_t> cuts{0, count[e]};
      for (std::size_t c = 1; c < copies.size(); ++c)
        cuts.push_back(std::int64_t(rng() % std::uint64_t(count[e] + 1)));
      std::sort(cuts.begin(), cuts.end());
      for (std::size_t c = 0; c < copies.size(); ++c)
        in.split[std::size_t(copies[c]) * G + src] = cuts[c + 1] - cuts[c];
    }
  }
  in.slot_tokens.assign(std::size_t(P), 0);
  for (std::size_t i = 0; i < in.split.size(); ++i)
    in.slot_tokens[i / std::size_t(G)] += in.split[i];
  return in;
}

RoutedView view_of(const Instance &in) {
  return RoutedView(std::span<const std::int32_t>(in.ids), in.num_tokens, 1, in.topk);
}

/// The checks every map must pass: each routed `(t, k)` on a copy of its expert, no route -1, and every copy given
/// exactly its count from every source (`num_sources` 1: the column sums).
void check_valid(const Instance &in, const std::vector<std::int32_t> &got, int num_sources) {
  const int G = in.topo.num_gpus();
  std::vector<std::int64_t> per(in.split.size(), 0);
  for (int src = 0; src < G; ++src)
    for (std::int64_t t = in.source_offsets[src]; t < in.source_offsets[src + 1]; ++t)
      for (int k = 0; k < in.topk; ++k) {
        const std::size_t i = std::size_t(t) * in.topk + k;
        if (in.ids[i] < 0) {
          REQUIRE(got[i] == -1);
          continue;
        }
        REQUIRE(got[i] >= 0);
        REQUIRE(got[i] < in.placement.num_slots());
        REQUIRE(in.placement.phys_to_log()[got[i]] == in.ids[i]);
        ++per[std::size_t(got[i]) * G + src];
      }
  if (num_sources == G) {
    CHECK(per == in.split);
  } else {
    std::vector<std::int64_t> per_slot(in.slot_tokens.size(), 0);
    for (std::size_t i = 0; i < per.size(); ++i)
      per_slot[i / std::size_t(G)] += per[i];
    CHECK(per_slot == in.slot_tokens);
  }
}

/// Distinct remote nodes per token counted directly with sets (independent of count_node_hits).
std::int64_t remote_nodes_by_sets(const Instance &in, const std::vector<std::int32_t> &slots, bool homes) {
  std::int64_t n = 0;
  const int G = in.topo.num_gpus();
  for (int src = 0; src < G; ++src)
    for (std::int64_t t = in.source_offsets[src]; t < in.source_offsets[src + 1]; ++t) {
      std::set<int> nodes;
      for (int k = 0; k < in.topk; ++k)
        if (const auto p = slots[std::size_t(t) * in.topk + k]; p >= 0)
          nodes.insert(p / in.topo.slots_per_gpu / in.topo.gpus_per_node);
      if (homes) nodes.erase(src / in.topo.gpus_per_node);
      n += std::int64_t(nodes.size());
    }
  return n;
}

TokenMapOptions affine(const Topology &topo, int source_gpu = -1) {
  TokenMapOptions o;
  o.rule = TokenMapRule::node_affine;
  o.topo = topo;
  o.source_gpu = source_gpu;
  return o;
}

/// Remote node hits of both rules summed over instances; node_affine never above positional on any of them.
struct Tally {
  std::int64_t positional = 0, node_affine = 0;
  void add(std::int64_t pos, std::int64_t aff) {
    REQUIRE(aff <= pos);
    positional += pos;
    node_affine += aff;
  }
  void report(const char *what) const {
    MESSAGE(std::string(what), ": remote node hits ", positional, " positional, ", node_affine, " node_affine");
    CHECK(node_affine < positional);
  }
};

/// Runs `f`, which must throw `Error` with a message containing `want`.
template <class F> void throws_with(F f, const std::string &want) {
  try {
    f();
    FAIL("no Error thrown, expected one containing: " << want);
  } catch (const Error &e) {
    CHECK_MESSAGE(std::string(e.what()).find(want) != std::string::npos, e.what());
  }
}

} // namespace

TEST_CASE("token affinity: node_affine keeps every count and never adds node hits, by source (property)") {
  std::mt19937_64 rng(3030);
  const int rounds = 3000 * foremoe_test::seed_multiplier();
  int fewer = 0, multi_node = 0;
  for (int it = 0; it < rounds; ++it) {
    const Instance in = random_instance(rng);
    const int G = in.topo.num_gpus();
    const TokenRanges ranges = token_ranges(in.placement, in.split, G);
    const RoutedView view = view_of(in);
    std::vector<std::int32_t> pos(in.ids.size(), -7), aff(in.ids.size(), -7);
    map_tokens(ranges, view, 0, pos, in.source_offsets);
    map_tokens(ranges, view, 0, aff, in.source_offsets, affine(in.topo));
    check_valid(in, aff, G);
    const NodeHits hp = count_node_hits(pos, in.topk, in.topo, in.source_offsets);
    const NodeHits ha = count_node_hits(aff, in.topk, in.topo, in.source_offsets);
    REQUIRE(ha.remote_nodes <= hp.remote_nodes);
    CHECK(ha.remote_nodes == remote_nodes_by_sets(in, aff, true));
    CHECK(hp.remote_nodes == remote_nodes_by_sets(in, pos, true));
    CHECK(ha.routed == hp.routed);
    CHECK(ha.tokens == hp.tokens);
    fewer += ha.remote_nodes < hp.remote_nodes ? 1 : 0;
    multi_node += in.topo.num_nodes > 1 ? 1 : 0;
    std::vector<std::int32_t> again(in.ids.size(), -7);
    map_tokens(ranges, view, 0, again, in.source_offsets, affine(in.topo));
    CHECK(again == aff); // deterministic
  }
  MESSAGE("node_affine cut remote node hits on ", fewer, " of ", rounds, " instances (", multi_node,
          " with several nodes)");
  CHECK(fewer > rounds / 10); // it must actually cut something on a fair share of instances
}

TEST_CASE("token affinity: one source with and without a home GPU (property)") {
  std::mt19937_64 rng(17);
  const int rounds = 2000 * foremoe_test::seed_multiplier();
  int fewer = 0;
  for (int it = 0; it < rounds; ++it) {
    const Instance in = random_instance(rng);
    const int G = in.topo.num_gpus();
    const int home = int(rng() % std::uint64_t(G + 1)) - 1; // -1: no home
    // All tokens from `home` (or from nowhere): offsets that put them all in that source, for counting.
    std::vector<std::int64_t> so(std::size_t(G) + 1, 0);
    for (int g = std::max(home, 0) + 1; g <= G; ++g)
      so[std::size_t(g)] = in.num_tokens;
    const std::span<const std::int64_t> count_so =
        home >= 0 ? std::span<const std::int64_t>(so) : std::span<const std::int64_t>();
    const TokenRanges ranges = token_ranges(in.placement, in.slot_tokens);
    const RoutedView view = view_of(in);
    std::vector<std::int32_t> pos(in.ids.size()), aff(in.ids.size());
    map_tokens(ranges, view, 0, pos);
    map_tokens(ranges, view, 0, aff, {}, affine(in.topo, home));
    check_valid(in, aff, 1);
    const NodeHits hp = count_node_hits(pos, in.topk, in.topo, count_so);
    const NodeHits ha = count_node_hits(aff, in.topk, in.topo, count_so);
    REQUIRE(ha.remote_nodes <= hp.remote_nodes);
    if (home < 0) CHECK(ha.remote_nodes == ha.nodes);
    fewer += ha.remote_nodes < hp.remote_nodes ? 1 : 0;
  }
  MESSAGE("one source: fewer remote node hits on ", fewer, " of ", rounds);
  CHECK(fewer > rounds / 10);
}

TEST_CASE("token affinity: one source with every token's home chooses the split by source (property)") {
  std::mt19937_64 rng(5150);
  const int rounds = 2000 * foremoe_test::seed_multiplier();
  Tally tally;
  for (int it = 0; it < rounds; ++it) {
    const Instance in = random_instance(rng);
    const int G = in.topo.num_gpus();
    const TokenRanges ranges = token_ranges(in.placement, in.slot_tokens);
    const RoutedView view = view_of(in);
    std::vector<std::int32_t> pos(in.ids.size()), aff(in.ids.size());
    map_tokens(ranges, view, 0, pos);
    TokenMapOptions o = affine(in.topo);
    o.home_offsets = in.source_offsets;
    map_tokens(ranges, view, 0, aff, {}, o);
    check_valid(in, aff, 1);
    tally.add(count_node_hits(pos, in.topk, in.topo, in.source_offsets).remote_nodes,
              count_node_hits(aff, in.topk, in.topo, in.source_offsets).remote_nodes);
    // The split it chose keeps every copy's total, and mapping by it (any rule) reproduces its counts.
    const auto split = source_split(aff, in.topk, in.topo, in.source_offsets);
    std::vector<std::int64_t> per_slot(in.slot_tokens.size(), 0);
    for (std::size_t i = 0; i < split.size(); ++i)
      per_slot[i / std::size_t(G)] += split[i];
    REQUIRE(per_slot == in.slot_tokens);
    std::vector<std::int32_t> again(in.ids.size());
    map_tokens(token_ranges(in.placement, split, G), view, 0, again, in.source_offsets, affine(in.topo));
    CHECK(source_split(again, in.topk, in.topo, in.source_offsets) == split);
  }
  tally.report("one source with homes");
}

TEST_CASE("token affinity: planner plans split by source (property)") {
  std::mt19937_64 rng(99);
  const int rounds = 200 * foremoe_test::seed_multiplier();
  Tally tally;
  for (int it = 0; it < rounds; ++it) {
    const int nodes = 2 + int(rng() % 3), gpn = 1 + int(rng() % 4), G = nodes * gpn;
    const int E = G * (1 + int(rng() % 3)), K = 1 + int(rng() % 4);
    const Topology topo{nodes, gpn, E / G + 1 + int(rng() % 2)};
    const std::int64_t T = 50 + std::int64_t(rng() % 400);
    std::vector<double> weight(static_cast<std::size_t>(E));
    for (auto &w : weight)
      w = std::pow(double(rng() % 1000 + 1), 1.5);
    std::discrete_distribution<int> pick(weight.begin(), weight.end());
    std::vector<std::int32_t> ids(std::size_t(T) * K);
    for (auto &id : ids)
      id = pick(rng);
    std::vector<std::int64_t> so;
    for (int g = 0; g <= G; ++g)
      so.push_back(T * g / G);
    CountOptions o;
    o.num_experts = E;
    o.num_sources = G;
    o.source_offsets = so;
    const LoadTensor loads = count_loads(std::span<const std::int32_t>(ids), T, 1, K, o);
    Planner planner(1, E, topo);
    const LayerPlan plan = planner.plan(loads, 0).front();
    const auto split = split_by_source(plan.placement, plan.slot_tokens, loads.layer_by_source(0, 0), G, gpn);
    const TokenRanges ranges = token_ranges(plan.placement, split, G);
    const RoutedView view(std::span<const std::int32_t>(ids), T, 1, K);
    std::vector<std::int32_t> pos(ids.size()), aff(ids.size());
    map_tokens(ranges, view, 0, pos, so);
    map_tokens(ranges, view, 0, aff, so, affine(topo));
    std::vector<std::int64_t> per(split.size(), 0);
    for (int src = 0; src < G; ++src)
      for (std::int64_t t = so[src]; t < so[src + 1]; ++t)
        for (int k = 0; k < K; ++k) {
          const std::size_t i = std::size_t(t) * K + k;
          REQUIRE(plan.placement.phys_to_log()[aff[i]] == ids[i]);
          ++per[std::size_t(aff[i]) * G + src];
        }
    CHECK(per == split);
    tally.add(count_node_hits(pos, K, topo, so).remote_nodes, count_node_hits(aff, K, topo, so).remote_nodes);
  }
  tally.report("planner plans");
}

TEST_CASE("token affinity: a hand-worked instance") {
  // 2 nodes x 1 GPU x 2 slots. Expert 0 on both GPUs (one token each), expert 1 on GPU 1 only, expert 2 on GPU 0
  // only. Token 0 routes {0, 1}, token 1 routes {0, 2}. Positional gives expert 0's first occurrence (token 0) to
  // GPU 0 and the second to GPU 1: both tokens reach both nodes. Node-affine sends token 0's expert 0 to GPU 1
  // (where its expert 1 is) and token 1's to GPU 0: one node each.
  LayerPlacement p(2, 2, 3);
  p.slot(0, 0) = 0;
  p.slot(0, 1) = 2;
  p.slot(1, 0) = 0;
  p.slot(1, 1) = 1;
  const std::vector<std::int64_t> slot_tokens{1, 1, 1, 1};
  const std::vector<std::int32_t> ids{0, 1, 0, 2};
  const RoutedView view(std::span<const std::int32_t>(ids), 2, 1, 2);
  const Topology topo{2, 1, 2};
  std::vector<std::int32_t> pos(4), aff(4);
  map_tokens(token_ranges(p, slot_tokens), view, 0, pos);
  map_tokens(token_ranges(p, slot_tokens), view, 0, aff, {}, affine(topo));
  CHECK(pos == std::vector<std::int32_t>{0, 3, 2, 1});
  CHECK(aff == std::vector<std::int32_t>{2, 3, 0, 1});
  const NodeHits hp = count_node_hits(pos, 2, topo), ha = count_node_hits(aff, 2, topo);
  CHECK(hp.nodes == 4);
  CHECK(hp.gpus == 4);
  CHECK(ha.nodes == 2);
  CHECK(ha.gpus == 2);
  CHECK(ha.remote_nodes == 2); // no source known: every node is remote
  // Token 0 from GPU 1, token 1 from GPU 0: node-affine keeps both tokens at home.
  const std::vector<std::int64_t> so{0, 1, 2}; // GPU 0's token first: token 0 on GPU 0, token 1 on GPU 1
  const NodeHits at_home = count_node_hits(aff, 2, topo, so);
  CHECK(at_home.remote_nodes == 2);
  CHECK(at_home.tokens == 2);
  CHECK(at_home.routed == 4);
}

TEST_CASE("token affinity: count_node_hits counts distinct nodes and GPUs from the source") {
  // 2 nodes x 2 GPUs x 1 slot; token 0 from GPU 0 goes to GPUs 0, 1, 3 (nodes 0, 0, 1) and twice to GPU 3;
  // token 1 from GPU 3 has no route.
  const Topology topo{2, 2, 1};
  const std::vector<std::int32_t> slots{0, 1, 3, 3, -1, -1, -1, -1};
  const std::vector<std::int64_t> so{0, 1, 1, 1, 2};
  const NodeHits h = count_node_hits(slots, 4, topo, so);
  CHECK(h.tokens == 1);
  CHECK(h.routed == 4);
  CHECK(h.nodes == 2);
  CHECK(h.remote_nodes == 1);
  CHECK(h.gpus == 3);
  CHECK(h.remote_gpus == 2);
}

TEST_CASE("token affinity: the dispatch layout under node_affine sends the same rows (property)") {
  std::mt19937_64 rng(404);
  const int rounds = 500 * foremoe_test::seed_multiplier();
  Tally tally;
  for (int it = 0; it < rounds; ++it) {
    const Instance in = random_instance(rng);
    const int G = in.topo.num_gpus();
    for (int rank = 0; rank < G; ++rank) {
      const std::int64_t b = in.source_offsets[rank], e = in.source_offsets[rank + 1];
      const std::vector<std::int32_t> mine(in.ids.begin() + b * in.topk, in.ids.begin() + e * in.topk);
      const RoutedView view(std::span<const std::int32_t>(mine), e - b, 1, in.topk);
      const DispatchLayout dp = dispatch_layout(in.placement, in.split, view, rank);
      const DispatchLayout da =
          dispatch_layout(in.placement, in.split, view, rank, TokenMapRule::node_affine, in.topo.gpus_per_node);
      CHECK(da.input_splits == dp.input_splits);
      CHECK(da.output_splits == dp.output_splits);
      CHECK(da.slot_counts == dp.slot_counts);
      CHECK(da.recv_perm == dp.recv_perm);
      REQUIRE(da.order.size() == dp.order.size());
      for (std::size_t i = 0; i < da.slots.size(); ++i)
        if (mine[i] >= 0) REQUIRE(in.placement.phys_to_log()[da.slots[i]] == mine[i]);
      for (std::size_t i = 0; i < da.order.size(); ++i) { // send order grouped by slot, each slot its count
        const auto slot = da.slots[std::size_t(da.order[i])];
        if (i > 0) REQUIRE(da.slots[std::size_t(da.order[i - 1])] <= slot);
      }
      std::vector<std::int64_t> so(std::size_t(G) + 1, 0);
      for (int g = rank + 1; g <= G; ++g)
        so[std::size_t(g)] = e - b;
      tally.add(count_node_hits(dp.slots, in.topk, in.topo, so).remote_nodes,
                count_node_hits(da.slots, in.topk, in.topo, so).remote_nodes);
    }
  }
  tally.report("dispatch");
}

TEST_CASE("token affinity: rule names and bad input are named") {
  CHECK(parse_token_map_rule("node_affine", "--rule") == TokenMapRule::node_affine);
  CHECK(parse_token_map_rule("positional", "--rule") == TokenMapRule::positional);
  for (const auto name : token_map_rule_names)
    CHECK(to_string(parse_token_map_rule(name, "x")) == name);
  throws_with([] { static_cast<void>(parse_token_map_rule("affine", "--token-map")); },
              "--token-map must be one of positional, node_affine, got 'affine'");

  LayerPlacement p(2, 2, 2);
  p.slot(0, 0) = 0;
  p.slot(1, 0) = 1;
  p.slot(1, 1) = 0;
  const std::vector<std::int64_t> slot_tokens{1, 0, 1, 1};
  const std::vector<std::int32_t> ids{0, 1, 0, -1};
  const RoutedView view(std::span<const std::int32_t>(ids), 2, 1, 2);
  const TokenRanges r = token_ranges(p, slot_tokens);
  std::vector<std::int32_t> out(4);
  throws_with(
      [&] {
        map_tokens(r, view, 0, out, {}, affine(Topology{1, 2, 3}));
      },
      "map_tokens: node_affine: the topology has 1 x 2 GPUs x 3 slots = 6 slots, the map 4");
  throws_with(
      [&] {
        map_tokens(r, view, 0, out, {}, affine(Topology{2, 1, 2}, 2));
      },
      "map_tokens: node_affine source_gpu 2 outside [-1, 2)");
  throws_with([&] { map_tokens(r, view, 0, out, {}, affine(Topology{2, 1, 0})); }, "got 2 x 1 x 0");
  // Three sources on two GPUs.
  const std::vector<std::int64_t> split3(12, 0);
  throws_with(
      [&] {
        const std::vector<std::int32_t> none{-1, -1, -1, -1};
        map_tokens(token_ranges(p, split3, 3), RoutedView(std::span<const std::int32_t>(none), 2, 1, 2), 0, out, {},
                   affine(Topology{2, 1, 2}));
      },
      "got 3 sources for 2 GPUs");
  // Homes per token with a split by source (the source offsets give them).
  throws_with(
      [&] {
        const std::vector<std::int32_t> none{-1, -1, -1, -1};
        const std::vector<std::int64_t> split2(8, 0), so{0, 1, 2};
        TokenMapOptions o = affine(Topology{2, 1, 2});
        o.home_offsets = so;
        map_tokens(token_ranges(p, split2, 2), RoutedView(std::span<const std::int32_t>(none), 2, 1, 2), 0, out, so, o);
      },
      "home_offsets are for one source; with 2 sources the source offsets give the homes");
  // Counts that differ from the routing fail as in the positional map, naming both.
  const std::vector<std::int64_t> wrong{2, 0, 1, 1};
  throws_with(
      [&] {
        map_tokens(token_ranges(p, wrong), view, 0, out, {}, affine(Topology{2, 1, 2}));
      },
      "expert 0 has 2 routed tokens but the plan gives its 2 copies 3");
  const std::vector<std::int32_t> bad{0, 4, -1, -1};
  throws_with(
      [&] {
        static_cast<void>(count_node_hits(bad, 2, Topology{2, 1, 2}));
      },
      "count_node_hits: slot 4 at token 0, k 1 is outside [0, 4)");
  throws_with(
      [&] {
        static_cast<void>(count_node_hits(bad, 3, Topology{2, 1, 2}));
      },
      "4 slots are not whole tokens of top-3");
  const std::vector<std::int64_t> so_bad{0, 3, 2};
  throws_with(
      [&] {
        static_cast<void>(count_node_hits(ids, 2, Topology{2, 1, 2}, so_bad));
      },
      "source_offsets decrease at index 2");
  TokenMapOptions two_sources = affine(Topology{2, 1, 2});
  const std::vector<std::int64_t> homes_short{0, 2};
  two_sources.home_offsets = homes_short;
  throws_with([&] { map_tokens(r, view, 0, out, {}, two_sources); },
              "map_tokens: node_affine: 2 home offsets for 2 GPUs, expected 3");
  throws_with(
      [&] {
        static_cast<void>(source_split(ids, 2, Topology{2, 1, 2}, homes_short));
      },
      "source_split: 2 source offsets for 2 GPUs, expected 3");
  const std::vector<std::int64_t> split(8, 0);
  throws_with(
      [&] {
        const std::vector<std::int32_t> none{-1, -1};
        static_cast<void>(dispatch_layout(p, split, RoutedView(std::span<const std::int32_t>(none), 1, 1, 2), 0,
                                          TokenMapRule::node_affine, 3));
      },
      "dispatch: node_affine needs the GPUs per node, a divisor of the 2 ranks, got 3");
}
