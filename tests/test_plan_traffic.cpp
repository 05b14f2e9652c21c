// Traffic-aware owners (plan/traffic.hpp): the co-activation count against a direct count, the owner maps' rules
// (one owner per expert, every GPU its starting count, node loads within the tolerance, the cut never above the
// start's) on random instances, the remote node hits on instances with planted co-activation clusters, and bad
// input; `traffic_step_owners` (one RL step's owners, shared by `plan --ids` and the simulator) against its steps
// done by hand.

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/load_tensor.hpp"
#include "foremoe/plan/owners.hpp"
#include "foremoe/plan/planner.hpp"
#include "foremoe/plan/token_map.hpp"
#include "foremoe/plan/traffic.hpp"
#include "test_support.hpp"

using namespace foremoe;

namespace {

/// Routed ids `[T][L][K]`: with `clusters > 0` each token (per layer) has a cluster (in turn) and takes its experts
/// from it with probability `stay`, else any expert uniformly; `clusters == 0`: skewed draws. Some ids are -1 or
/// repeated.
struct Ids {
  std::vector<std::int32_t> ids;
  std::int64_t tokens = 0;
  int layers = 0, topk = 0, experts = 0;
  [[nodiscard]] RoutedView view() const { return RoutedView(std::span<const std::int32_t>(ids), tokens, layers, topk); }
};

Ids random_ids(std::mt19937_64 &rng, std::int64_t tokens, int layers, int topk, int experts, int clusters, double stay,
               bool holes) {
  Ids out{std::vector<std::int32_t>(static_cast<std::size_t>(tokens * layers * topk)), tokens, layers, topk, experts};
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<double> weight(static_cast<std::size_t>(experts));
  for (auto &w : weight)
    w = clusters > 0 ? 1.0 : 0.2 + u(rng) * u(rng) * 3.0; // planted clusters: balanced, so one per node fits
  std::discrete_distribution<int> skewed(weight.begin(), weight.end());
  const int size = clusters > 0 ? experts / clusters : experts;
  for (std::int64_t t = 0; t < tokens; ++t)
    for (int l = 0; l < layers; ++l) {
      const int c = clusters > 0 ? static_cast<int>((t + l) % clusters) : 0; // every cluster as many tokens
      for (int k = 0; k < topk; ++k) {
        int e = 0;
        if (clusters > 0 && u(rng) < stay)
          e = c * size + static_cast<int>(rng() % static_cast<std::uint64_t>(size));
        else
          e = skewed(rng);
        if (holes && rng() % 23 == 0) e = -1;
        out.ids[static_cast<std::size_t>((t * layers + l) * topk + k)] = e;
      }
    }
  return out;
}

/// The remote node hits of every token and layer when each expert's tokens all go to its owner (no source: every
/// node counts as remote).
std::int64_t owner_node_hits(const Ids &in, const OwnerMap &owners, const Topology &topo) {
  std::vector<std::int32_t> slots(static_cast<std::size_t>(in.tokens * in.topk));
  NodeHits h;
  for (int l = 0; l < in.layers; ++l) {
    for (std::int64_t t = 0; t < in.tokens; ++t)
      for (int k = 0; k < in.topk; ++k) {
        const std::int32_t e = in.ids[static_cast<std::size_t>((t * in.layers + l) * in.topk + k)];
        slots[static_cast<std::size_t>(t * in.topk + k)] = e < 0 ? -1 : owners[l][e] * topo.slots_per_gpu;
      }
    add_node_hits(h, slots, in.topk, topo);
  }
  return h.remote_nodes;
}

struct Checked {
  std::int64_t cut_before = 0, cut_after = 0;
};

/// Checks the rules of `traffic_aware_owners` on one instance and returns the cuts summed over layers.
Checked check_rules(const Ids &in, const Topology &topo, const TrafficOptions &opts, OwnerMap &start, OwnerMap &got) {
  const CoActivation co = count_coactivation(in.view(), in.experts);
  start = plan_owners(co.loads, in.layers, in.experts, topo);
  got = traffic_aware_owners(co.loads, co, topo, start, opts);
  CHECK(got == traffic_aware_owners(co.loads, co, topo, start, opts)); // deterministic
  Checked c;
  REQUIRE(got.size() == start.size());
  for (int l = 0; l < in.layers; ++l) {
    REQUIRE(static_cast<int>(got[l].size()) == in.experts);
    std::vector<int> count_start(static_cast<std::size_t>(topo.num_gpus()), 0), count_got = count_start;
    std::vector<std::int64_t> node_start(static_cast<std::size_t>(topo.num_nodes), 0), node_got = node_start;
    std::int64_t total = 0;
    for (int e = 0; e < in.experts; ++e) {
      const std::int64_t w = co.loads[static_cast<std::size_t>(l) * std::size_t(in.experts) + std::size_t(e)];
      REQUIRE(got[l][e] >= 0);
      REQUIRE(got[l][e] < topo.num_gpus());
      ++count_start[start[l][e]];
      ++count_got[got[l][e]];
      node_start[topo.node_of(start[l][e])] += w;
      node_got[topo.node_of(got[l][e])] += w;
      total += w;
    }
    CHECK(count_got == count_start); // every GPU keeps its owner count (so one owner per expert, within slots)
    const auto cap = std::max(*std::max_element(node_start.begin(), node_start.end()),
                              static_cast<std::int64_t>(opts.node_tolerance * double(total) / topo.num_nodes));
    CHECK(*std::max_element(node_got.begin(), node_got.end()) <= cap);
    const std::int64_t before = coactivation_cut(co, l, start[l], topo), after = coactivation_cut(co, l, got[l], topo);
    CHECK(after <= before);
    c.cut_before += before;
    c.cut_after += after;
  }
  return c;
}

} // namespace

TEST_CASE("count_coactivation equals a direct count, with dense layers skipped, ranges and samples") {
  std::mt19937_64 rng(0x7a11c);
  for (int it = 0; it < 60 * foremoe_test::seed_multiplier(); ++it) {
    const int experts = 2 + int(rng() % 20), layers = 1 + int(rng() % 3), topk = 1 + int(rng() % 6);
    const Ids in = random_ids(rng, std::int64_t(rng() % 80), layers, topk, experts, 0, 0.0, true);
    const std::int64_t b = in.tokens == 0 ? 0 : std::int64_t(rng() % std::uint64_t(in.tokens + 1));
    const std::int64_t e = b + (in.tokens == b ? 0 : std::int64_t(rng() % std::uint64_t(in.tokens - b + 1)));
    const bool dense = layers > 1 && rng() % 2 == 0;
    const LayerMap map = dense ? LayerMap::dense_prefix(layers, 1) : LayerMap{};
    const std::int64_t every = 1 + std::int64_t(rng() % 3);
    const CoActivation co = count_coactivation(in.view(), experts, b, e, map, every);
    const int first = dense ? 1 : 0;
    REQUIRE(co.num_layers == layers - first);
    for (int l = first; l < layers; ++l) {
      std::vector<std::int64_t> pairs(std::size_t(experts * experts), 0), loads(std::size_t(experts), 0);
      for (std::int64_t t = b; t < e; t += every) {
        std::set<int> distinct;
        for (int k = 0; k < topk; ++k) {
          const int x = in.ids[std::size_t((t * layers + l) * topk + k)];
          if (x < 0) continue;
          ++loads[std::size_t(x)];
          distinct.insert(x);
        }
        for (int x : distinct)
          for (int y : distinct)
            if (x != y) ++pairs[std::size_t(x) * std::size_t(experts) + std::size_t(y)];
      }
      const int ml = l - first;
      for (int x = 0; x < experts; ++x) {
        CHECK(co.loads[std::size_t(ml) * std::size_t(experts) + std::size_t(x)] == loads[std::size_t(x)]);
        for (int y = 0; y < experts; ++y)
          CHECK(co.pair(ml, x, y) == pairs[std::size_t(x) * std::size_t(experts) + std::size_t(y)]);
      }
    }
  }
}

TEST_CASE("traffic_aware_owners keeps counts and node balance and never raises the cut") {
  std::mt19937_64 rng(0x0f7a);
  std::int64_t before = 0, after = 0, hits_before = 0, hits_after = 0;
  for (int it = 0; it < 80 * foremoe_test::seed_multiplier(); ++it) {
    const int nodes = 1 + int(rng() % 5), gpn = 1 + int(rng() % 4), G = nodes * gpn;
    const int experts = 2 + int(rng() % 40);
    const Topology topo{nodes, gpn, (experts + G - 1) / G + int(rng() % 2)};
    TrafficOptions opts;
    opts.node_tolerance = 1.0 + double(rng() % 20) / 100.0;
    opts.max_passes = int(rng() % 20);
    const bool clustered = rng() % 2 == 0;
    const Ids in =
        random_ids(rng, 20 + std::int64_t(rng() % 300), 1 + int(rng() % 3), 1 + int(rng() % std::min(8, experts)),
                   experts, clustered ? std::min(nodes, experts) : 0, 0.8, rng() % 3 == 0);
    OwnerMap start, got;
    const Checked c = check_rules(in, topo, opts, start, got);
    before += c.cut_before;
    after += c.cut_after;
    hits_before += owner_node_hits(in, start, topo);
    hits_after += owner_node_hits(in, got, topo);
  }
  MESSAGE("random instances: cut ", before, " -> ", after, ", owner-only remote node hits ", hits_before, " -> ",
          hits_after);
  CHECK(after <= before);
}

TEST_CASE("traffic_aware_owners cuts remote node hits on planted co-activation clusters") {
  std::mt19937_64 rng(0xc1a5);
  const int runs = 12 * foremoe_test::seed_multiplier();
  double sum_start = 0, sum_got = 0;
  for (int it = 0; it < runs; ++it) {
    const int nodes = 2 + int(rng() % 4), gpn = 1 + int(rng() % 3), G = nodes * gpn;
    const int experts = nodes * (2 + int(rng() % 6)) * gpn;
    const Topology topo{nodes, gpn, experts / G + 1};
    const int topk = std::min(4 + int(rng() % 5), experts / nodes);
    // Clusters of size experts / nodes, one per node: a perfect placement puts each on one node.
    const Ids in = random_ids(rng, 400 + std::int64_t(rng() % 400), 2, topk, experts, nodes, 0.9, false);
    OwnerMap start, got;
    TrafficOptions opts;
    opts.node_tolerance = 1.10;
    const Checked c = check_rules(in, topo, opts, start, got);
    const std::int64_t hb = owner_node_hits(in, start, topo), ha = owner_node_hits(in, got, topo);
    INFO("nodes ", nodes, " x ", gpn, ", experts ", experts, ", top-", topk, ": cut ", c.cut_before, " -> ",
         c.cut_after, ", remote node hits ", hb, " -> ", ha);
    // The clusters placed one per node: what the search should find when that placement is within the node cap.
    OwnerMap ideal = start;
    for (auto &row : ideal)
      for (int e = 0; e < experts; ++e)
        row[e] = (e / (experts / nodes)) * gpn + e % gpn;
    const std::int64_t hi = owner_node_hits(in, ideal, topo);
    const CoActivation co = count_coactivation(in.view(), in.experts);
    double ideal_ratio = 0; // the worst layer's max/mean node load of the planted placement
    for (int l = 0; l < in.layers; ++l) {
      std::vector<std::int64_t> node_load(std::size_t(nodes), 0);
      std::int64_t total = 0;
      for (int e = 0; e < experts; ++e) {
        node_load[std::size_t(e / (experts / nodes))] +=
            co.loads[std::size_t(l) * std::size_t(experts) + std::size_t(e)];
        total += co.loads[std::size_t(l) * std::size_t(experts) + std::size_t(e)];
      }
      ideal_ratio = std::max(ideal_ratio, double(*std::max_element(node_load.begin(), node_load.end())) * nodes /
                                              double(std::max<std::int64_t>(total, 1)));
    }
    INFO("planted placement: ", hi, " hits, node max/mean ", ideal_ratio);
    CHECK((ha < hb || double(hb) <= 1.05 * double(hi))); // only a start near the planted optimum may stay
    if (ideal_ratio <= opts.node_tolerance) CHECK(double(ha) <= 1.02 * double(hi));
    sum_start += double(hb) / double(hi);
    sum_got += double(ha) / double(hi);
  }
  MESSAGE("planted clusters: remote node hits over the planted placement's, mean ", sum_start / runs,
          " (load-only) -> ", sum_got / runs, " (traffic-aware)");
}

TEST_CASE("traffic_step_owners: the step's totals summed by hand, the planner's owners of them, improved for traffic") {
  std::mt19937_64 rng(0x5732);
  for (int it = 0; it < 40 * foremoe_test::seed_multiplier(); ++it) {
    const int nodes = 1 + int(rng() % 4), gpn = 1 + int(rng() % 3), G = nodes * gpn;
    const int experts = 2 + int(rng() % 30), layers = 1 + int(rng() % 3), M = 1 + int(rng() % 4);
    const Topology topo{nodes, gpn, (experts + G - 1) / G + int(rng() % 2)};
    const Planner planner(layers, experts, topo);
    std::vector<std::int64_t> counts(std::size_t(M) * std::size_t(layers) * std::size_t(experts));
    for (auto &c : counts)
      c = rng() % 5 == 0 ? 0 : std::int64_t(rng() % 200);
    const LoadTensor step = LoadTensor::from_counts(counts, M, layers, experts);
    const Ids in = random_ids(rng, 20 + std::int64_t(rng() % 200), layers, 1 + int(rng() % std::min(6, experts)),
                              experts, rng() % 2 == 0 ? std::min(nodes, experts) : 0, 0.8, rng() % 3 == 0);
    const CoActivation co = count_coactivation(in.view(), experts);
    TrafficSettings settings;
    settings.aware = true;
    settings.tolerance = 1.0 + double(rng() % 30) / 100.0;
    // Previous owners (kept where the planner's tolerance allows) half the time: those of other random totals.
    OwnerMap previous;
    if (rng() % 2 == 0) {
      std::vector<std::int64_t> other(std::size_t(layers) * std::size_t(experts));
      for (auto &c : other)
        c = std::int64_t(rng() % 300);
      previous = planner.plan_owners(other);
    }
    const TrafficStepOwners got = traffic_step_owners(planner, step, co, settings, previous);
    std::vector<std::int64_t> totals(std::size_t(layers) * std::size_t(experts), 0);
    for (int m = 0; m < M; ++m)
      for (std::size_t i = 0; i < totals.size(); ++i)
        totals[i] += counts[std::size_t(m) * totals.size() + i];
    CHECK(got.totals == totals);
    CHECK(got.start == planner.plan_owners(totals, previous));
    TrafficOptions opts;
    opts.node_tolerance = settings.tolerance;
    CHECK(got.owners == traffic_aware_owners(totals, co, planner.topology(), got.start, opts));
    REQUIRE(static_cast<int>(got.owners.size()) == layers);
    for (int l = 0; l < layers; ++l) {
      std::vector<int> count_start(std::size_t(G), 0), count_got = count_start;
      for (int e = 0; e < experts; ++e) {
        ++count_start[std::size_t(got.start[l][e])];
        ++count_got[std::size_t(got.owners[l][e])];
      }
      CHECK(count_got == count_start);
      CHECK(coactivation_cut(co, l, got.owners[l], topo) <= coactivation_cut(co, l, got.start[l], topo));
    }
  }
}

TEST_CASE("traffic-aware owners refuse bad input, naming the value") {
  const std::vector<std::int32_t> ids{0, 1, 2, 3, 1, 7};
  const RoutedView v(std::span<const std::int32_t>(ids), 3, 1, 2);
  CHECK_ERROR_CONTAINS((void)count_coactivation(v, 4), "id 7 at token 2, layer 0, k 1");
  CHECK_ERROR_CONTAINS((void)count_coactivation(v, 8, 2, 5), "token range [2, 5)");
  CHECK_ERROR_CONTAINS((void)count_coactivation(v, 0), "num_experts must be positive, got 0");
  CHECK_ERROR_CONTAINS((void)count_coactivation(v, 8, 0, -1, {}, 0), "every must be >= 1, got 0");
  CHECK_ERROR_CONTAINS((void)count_coactivation(v, 8, 0, -1, LayerMap::identity(2)), "covers 2 trace layers");
  const CoActivation co = count_coactivation(v, 8);
  const Topology topo{2, 2, 2};
  const std::vector<std::int64_t> totals(8, 1);
  const OwnerMap start = plan_owners(totals, 1, 8, topo);
  CHECK_ERROR_CONTAINS((void)traffic_aware_owners(std::vector<std::int64_t>(7, 1), co, topo, start),
                       "7 step totals for 1 layers x 8 experts");
  std::vector<std::int64_t> neg = totals;
  neg[5] = -3;
  CHECK_ERROR_CONTAINS((void)traffic_aware_owners(neg, co, topo, start), "expert 5 has a negative load -3");
  OwnerMap bad = start;
  bad[0][2] = 9;
  CHECK_ERROR_CONTAINS((void)traffic_aware_owners(totals, co, topo, bad), "expert 2 has owner GPU 9");
  bad = start;
  bad[0][0] = bad[0][1] = bad[0][2] = 0;
  CHECK_ERROR_CONTAINS((void)traffic_aware_owners(totals, co, topo, bad), "owns more than its 2 slots");
  CHECK_ERROR_CONTAINS((void)traffic_aware_owners(totals, co, topo, OwnerMap{}), "have 0 layers, expected 1");
  TrafficOptions o;
  o.node_tolerance = 0.9;
  CHECK_ERROR_CONTAINS((void)traffic_aware_owners(totals, co, topo, start, o), "node_tolerance must be");
  o = {};
  o.max_passes = -1;
  CHECK_ERROR_CONTAINS((void)traffic_aware_owners(totals, co, topo, start, o), "max_passes must be >= 0, got -1");
  CHECK_ERROR_CONTAINS((void)traffic_aware_owners(totals, co, Topology{2, 2, 1}, start), "Topology");
  CHECK_ERROR_CONTAINS((void)coactivation_cut(co, 1, start[0], topo), "layer 1 outside [0, 1)");
}
