// Planner building blocks: plan validation, exact split, owners, bounds, EPLB and the planner facade.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "foremoe/plan/bounds.hpp"
#include "foremoe/plan/eplb.hpp"
#include "foremoe/plan/owners.hpp"
#include "foremoe/plan/plan.hpp"
#include "foremoe/plan/planner.hpp"
#include "foremoe/plan/split.hpp"
#include "test_support.hpp"

using namespace foremoe;

namespace {

/// Smallest max GPU load over every integer split, by enumeration (tiny loads only).
std::int64_t brute_force_split(const LayerPlacement &p, const std::vector<std::int64_t> &loads) {
  const auto l2p = p.log_to_phys();
  const int num_gpus = p.num_gpus(), slots = p.slots_per_gpu();
  std::vector<std::int64_t> gpu(static_cast<std::size_t>(num_gpus), 0);
  std::int64_t best = INT64_MAX;
  // Recursive over experts, then over compositions of its load into its copies.
  std::function<void(int)> rec_expert;
  std::function<void(int, int, std::int64_t)> rec_copy = [&](int e, int j, std::int64_t left) {
    const int first = l2p.offsets[e], last = l2p.offsets[e + 1];
    const int g = l2p.phys[first + j] / slots;
    if (first + j == last - 1) {
      gpu[g] += left;
      rec_expert(e + 1);
      gpu[g] -= left;
      return;
    }
    for (std::int64_t t = 0; t <= left; ++t) {
      gpu[g] += t;
      rec_copy(e, j + 1, left - t);
      gpu[g] -= t;
    }
  };
  rec_expert = [&](int e) {
    if (e == p.num_experts()) {
      best = std::min(best, *std::max_element(gpu.begin(), gpu.end()));
      return;
    }
    rec_copy(e, 0, loads[e]);
  };
  rec_expert(0);
  return best;
}

LayerPlacement random_placement(std::mt19937_64 &rng, int num_gpus, int slots, int num_experts) {
  LayerPlacement p(num_gpus, slots, num_experts);
  std::vector<int> order(static_cast<std::size_t>(num_gpus) * slots);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  // Every expert once, then random extra copies where they do not duplicate.
  std::size_t k = 0;
  for (int e = 0; e < num_experts; ++e)
    p.phys_to_log()[order[k++]] = e;
  for (; k < order.size(); ++k) {
    if (rng() % 3 == 0) continue;
    const int q = order[k];
    const auto e = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(num_experts));
    if (!p.holds(q / slots, e)) p.phys_to_log()[q] = e;
  }
  return p;
}

std::vector<std::int64_t> random_loads(std::mt19937_64 &rng, int n, std::int64_t max_load, double skew) {
  std::vector<std::int64_t> v(static_cast<std::size_t>(n));
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (auto &x : v)
    x = static_cast<std::int64_t>(std::pow(u(rng), skew) * static_cast<double>(max_load));
  return v;
}

} // namespace

TEST_CASE("exact split matches brute force on tiny placements") {
  std::mt19937_64 rng(11);
  SplitSolver solver;
  const int iters = 400 * foremoe_test::seed_multiplier();
  for (int it = 0; it < iters; ++it) {
    const int num_gpus = 2 + static_cast<int>(rng() % 3), slots = 1 + static_cast<int>(rng() % 2);
    const int num_experts = 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(num_gpus * slots));
    const LayerPlacement p = random_placement(rng, num_gpus, slots, num_experts);
    const auto loads = random_loads(rng, num_experts, 7, 1.0);
    std::vector<std::int64_t> tokens(static_cast<std::size_t>(p.num_slots()));
    const std::int64_t ms = solver.solve(p, loads, tokens);
    CHECK(ms == brute_force_split(p, loads));
    LayerPlan plan{p, {}, tokens, {}, ms};
    for (int e = 0; e < num_experts; ++e)
      for (int q = 0; q < p.num_slots(); ++q)
        if (p.phys_to_log()[q] == e) {
          plan.owner_gpu.push_back(q / slots);
          break;
        }
    plan.moves = compute_moves(p, plan.owner_gpu, nullptr, 2);
    CHECK_NOTHROW(validate(plan, loads, nullptr));
  }
}

TEST_CASE("exact split on larger placements is valid and meets the bounds") {
  std::mt19937_64 rng(12);
  SplitSolver solver;
  const int iters = 300 * foremoe_test::seed_multiplier();
  for (int it = 0; it < iters; ++it) {
    const int num_gpus = 2 + static_cast<int>(rng() % 40), slots = 1 + static_cast<int>(rng() % 4);
    const int num_experts = 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(num_gpus * slots));
    const LayerPlacement p = random_placement(rng, num_gpus, slots, num_experts);
    const auto loads = random_loads(rng, num_experts, 100000, 3.0);
    std::vector<std::int64_t> tokens(static_cast<std::size_t>(p.num_slots()));
    const std::int64_t ms = solver.solve(p, loads, tokens);
    CHECK(ms >= lower_bound_total(loads, num_gpus));
    // Never worse than the even split.
    CHECK(ms <= even_split(p, loads).max_gpu_load);
    std::vector<std::int64_t> sums(static_cast<std::size_t>(num_experts), 0);
    for (int q = 0; q < p.num_slots(); ++q) {
      REQUIRE(tokens[q] >= 0);
      if (p.phys_to_log()[q] >= 0) sums[p.phys_to_log()[q]] += tokens[q];
    }
    CHECK(sums == loads);
  }
}

TEST_CASE("exact split: hand-checked cases and errors") {
  // GPU 0 holds experts 0 and 1, GPU 1 holds 1: expert 1 (load 10) balances 4 + 10 over both GPUs -> 7.
  LayerPlacement p(2, 2, 2);
  p.slot(0, 0) = 0;
  p.slot(0, 1) = 1;
  p.slot(1, 0) = 1;
  const std::vector<std::int64_t> loads{4, 10};
  const SplitResult r = exact_split(p, loads);
  CHECK(r.max_gpu_load == 7);
  CHECK(r.slot_tokens[0] == 4);
  CHECK(r.slot_tokens[1] + r.slot_tokens[2] == 10);
  CHECK(even_split(p, loads).max_gpu_load == 9);
  CHECK_ERROR_CONTAINS((void)exact_split(p, std::vector<std::int64_t>{1}), "expert loads");
  LayerPlacement missing(2, 1, 2);
  missing.slot(0, 0) = 0;
  CHECK_ERROR_CONTAINS((void)exact_split(missing, std::vector<std::int64_t>{1, 3}), "no copy");
  CHECK_ERROR_CONTAINS((void)exact_split(p, std::vector<std::int64_t>{1, -3}), "negative");
}

TEST_CASE("split_by_source keeps copy totals and prefers local copies") {
  // 4 GPUs in 2 nodes; expert 0 on GPUs 0 and 2, expert 1 on GPU 1.
  LayerPlacement p(4, 1, 2);
  p.slot(0, 0) = 0;
  p.slot(1, 0) = 1;
  p.slot(2, 0) = 0;
  const std::vector<std::int64_t> tokens{6, 3, 4, 0};
  // [expert][source]: expert 0 gets 5 from GPU 0, 5 from GPU 3; expert 1 gets 3 from GPU 2.
  const std::vector<std::int64_t> src{5, 0, 0, 5, 0, 0, 3, 0};
  const auto out = split_by_source(p, tokens, src, 4, 2);
  // Slot 0 (GPU 0, expert 0): its own 5, plus 1 from GPU 3; slot 2 (GPU 2) takes the rest of GPU 3's (same node).
  CHECK(out[0 * 4 + 0] == 5);
  CHECK(out[0 * 4 + 3] == 1);
  CHECK(out[2 * 4 + 3] == 4);
  CHECK(out[1 * 4 + 2] == 3);
  CHECK_ERROR_CONTAINS((void)split_by_source(p, tokens, std::vector<std::int64_t>(8, 0), 4, 2), "copies get");
}

TEST_CASE("owners: cardinality, balance and hierarchy") {
  std::mt19937_64 rng(21);
  const int iters = 60 * foremoe_test::seed_multiplier();
  for (int it = 0; it < iters; ++it) {
    Topology topo{1 + static_cast<int>(rng() % 4), 1 + static_cast<int>(rng() % 8), 1};
    const int num_gpus = topo.num_gpus();
    const int num_experts = 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(num_gpus * 5));
    topo.slots_per_gpu = topo.owners_per_gpu(num_experts) + static_cast<int>(rng() % 2);
    const auto loads = random_loads(rng, num_experts, 10000, 2.0);
    for (bool hier : {false, true}) {
      OwnerPlanner planner(topo, num_experts, {hier});
      const auto owner = planner.plan_layer(loads);
      std::vector<int> count(static_cast<std::size_t>(num_gpus), 0);
      std::vector<std::int64_t> load(static_cast<std::size_t>(num_gpus), 0);
      for (int e = 0; e < num_experts; ++e) {
        REQUIRE(owner[e] >= 0);
        REQUIRE(owner[e] < num_gpus);
        ++count[owner[e]];
        load[owner[e]] += loads[e];
      }
      const auto [lo, hi] = std::minmax_element(count.begin(), count.end());
      CHECK(*hi <= topo.owners_per_gpu(num_experts));
      CHECK(*hi <= topo.slots_per_gpu);
      if (!hier) CHECK(*hi - *lo <= 1);
      // LPT bound: no GPU above mean + the largest item.
      const std::int64_t total = std::accumulate(loads.begin(), loads.end(), std::int64_t{0});
      const std::int64_t biggest = *std::max_element(loads.begin(), loads.end());
      if (!hier) CHECK(*std::max_element(load.begin(), load.end()) <= total / num_gpus + biggest + 1);
    }
  }
  // Four equal pairs on two GPUs: perfectly balanced.
  const std::vector<std::int64_t> loads{8, 7, 6, 5, 4, 3, 2, 1};
  OwnerPlanner flat(Topology{1, 2, 4}, 8, {false});
  const auto owner = flat.plan_layer(loads);
  std::int64_t g0 = 0;
  for (int e = 0; e < 8; ++e)
    g0 += owner[e] == 0 ? loads[e] : 0;
  CHECK(g0 == 18);
  CHECK_ERROR_CONTAINS((void)flat.plan_layer(std::vector<std::int64_t>{1, 2}), "loads for 8 experts");
}

TEST_CASE("owner planning speed shape: 58 x 256 on 32 GPUs is balanced") {
  std::mt19937_64 rng(22);
  const Topology topo{4, 8, 9};
  std::vector<std::int64_t> totals;
  for (int l = 0; l < 58; ++l) {
    const auto row = random_loads(rng, 256, 200000, 4.0);
    totals.insert(totals.end(), row.begin(), row.end());
  }
  const auto owners = plan_owners(totals, 58, 256, topo);
  REQUIRE(owners.size() == 58);
  for (int l = 0; l < 58; ++l) {
    std::vector<std::int64_t> load(32, 0);
    std::vector<int> count(32, 0);
    for (int e = 0; e < 256; ++e) {
      load[owners[l][e]] += totals[l * 256 + e];
      ++count[owners[l][e]];
    }
    for (int c : count)
      CHECK(c == 8);
    const std::int64_t total = std::accumulate(load.begin(), load.end(), std::int64_t{0});
    const std::int64_t biggest = *std::max_element(totals.begin() + l * 256, totals.begin() + (l + 1) * 256);
    CHECK(*std::max_element(load.begin(), load.end()) <= std::max(total / 32 * 105 / 100, biggest));
  }
}

TEST_CASE("owners: previous owners are kept when re-owning costs something") {
  std::mt19937_64 rng(23);
  const Topology topo{2, 4, 5};
  const int num_experts = 32, num_gpus = 8;
  int kept_changes = 0, fresh_changes = 0;
  for (int it = 0; it < 200 * foremoe_test::seed_multiplier(); ++it) {
    const auto step1 = random_loads(rng, num_experts, 50000, 2.0);
    OwnerPlanner op(topo, num_experts);
    const auto prev = op.plan_layer(step1);
    // The same totals keep every owner.
    CHECK(op.plan_layer(step1, prev) == prev);
    // Next step's totals drift; sometimes they change completely.
    auto step2 = step1;
    const bool reshuffle = it % 5 == 0;
    for (auto &x : step2)
      x = reshuffle ? static_cast<std::int64_t>(rng() % 100000)
                    : std::max<std::int64_t>(0, x + static_cast<std::int64_t>(rng() % 8000) - 4000);
    const auto fresh = op.plan_layer(step2);
    const auto kept = op.plan_layer(step2, prev);
    auto max_load = [&](const std::vector<std::int32_t> &owner) {
      std::vector<std::int64_t> load(num_gpus, 0);
      std::vector<int> count(num_gpus, 0);
      for (int e = 0; e < num_experts; ++e) {
        load[owner[e]] += step2[e];
        CHECK(++count[owner[e]] <= topo.slots_per_gpu);
      }
      return *std::max_element(load.begin(), load.end());
    };
    const std::int64_t fresh_max = max_load(fresh);
    CHECK(max_load(kept) <= fresh_max + static_cast<std::int64_t>(static_cast<double>(fresh_max) * 0.05));
    for (int e = 0; e < num_experts; ++e) {
      kept_changes += kept[e] != prev[e];
      fresh_changes += fresh[e] != prev[e];
    }
  }
  MESSAGE("owners changed from the previous step: ", kept_changes, " kept-owner planning, ", fresh_changes, " fresh");
  CHECK(kept_changes < fresh_changes);
  OwnerPlanner op(topo, num_experts);
  const std::vector<std::int64_t> loads(num_experts, 1);
  CHECK_ERROR_CONTAINS((void)op.plan_layer(loads, std::vector<std::int32_t>(num_experts, 9)), "outside [0, 8)");
  CHECK_ERROR_CONTAINS((void)op.plan_layer(loads, std::vector<std::int32_t>(num_experts, 0)), "which has 5 slots");
}

TEST_CASE("planner keeps owners across steps unless re-owning is free") {
  std::mt19937_64 rng(24);
  const Topology topo{2, 4, 5};
  std::vector<std::int64_t> a, b;
  for (int l = 0; l < 3; ++l) {
    const auto row = random_loads(rng, 32, 50000, 2.0);
    a.insert(a.end(), row.begin(), row.end());
    for (std::int64_t x : row)
      b.push_back(std::max<std::int64_t>(0, x + static_cast<std::int64_t>(rng() % 6000) - 3000));
  }
  PlannerOptions paid;
  paid.reowning_free = false;
  Planner keep(3, 32, topo, paid), fresh(3, 32, topo);
  keep.begin_step(a);
  fresh.begin_step(a);
  CHECK(keep.owners() == fresh.owners());
  const auto first = keep.owners();
  keep.begin_step(b);
  fresh.begin_step(b);
  int kept_changes = 0, fresh_changes = 0;
  for (int l = 0; l < 3; ++l)
    for (int e = 0; e < 32; ++e) {
      kept_changes += keep.owners()[l][e] != first[l][e];
      fresh_changes += fresh.owners()[l][e] != first[l][e];
    }
  CHECK(kept_changes <= fresh_changes);
  PlannerOptions bad;
  bad.owner_keep_tolerance = -1;
  CHECK_ERROR_CONTAINS(Planner(3, 32, topo, bad), "owner_keep_tolerance");
}

TEST_CASE("validate catches every broken invariant") {
  const Topology topo{1, 2, 2};
  const std::vector<std::int64_t> loads{4, 10};
  const std::vector<std::int32_t> owner{0, 1};
  LayerPlan good = plan_two_level(loads, owner, topo);
  REQUIRE_NOTHROW(validate(good, loads, nullptr, 1));
  CHECK(good.max_gpu_load == 7);
  CHECK(good.moves.size() == 1);

  LayerPlan bad = good;
  bad.max_gpu_load = 6;
  CHECK_ERROR_CONTAINS(validate(bad, loads, nullptr), "max_gpu_load");
  bad = good;
  bad.slot_tokens[0] += 1;
  CHECK_ERROR_CONTAINS(validate(bad, loads, nullptr), "sum to");
  bad = good;
  bad.owner_gpu[0] = 1;
  CHECK_ERROR_CONTAINS(validate(bad, loads, nullptr), "does not hold");
  bad = good;
  bad.moves.clear();
  CHECK_ERROR_CONTAINS(validate(bad, loads, nullptr), "moves leave");
  bad = good;
  bad.moves[0].src_gpu = bad.moves[0].dst_gpu == 0 ? 0 : 1;
  CHECK_ERROR_CONTAINS(validate(bad, loads, nullptr), "onto itself");
  CHECK_ERROR_CONTAINS(validate(good, loads, nullptr, 0), "move budget");
  bad = good;
  bad.placement.slot(1, 1) = 1;
  CHECK_ERROR_CONTAINS(validate(bad, loads, nullptr), "two copies");
  bad = good;
  for (int q = 0; q < 4; ++q)
    if (bad.placement.phys_to_log()[q] == empty_slot) bad.slot_tokens[q] = 1;
  CHECK_ERROR_CONTAINS(validate(bad, loads, nullptr), "empty");
  bad = good;
  bad.slot_tokens[0] = -1;
  CHECK_ERROR_CONTAINS(validate(bad, loads, nullptr), "negative");
  // A source that does not hold the expert.
  LayerPlacement resident(2, 2, 2);
  resident.slot(0, 0) = 0;
  resident.slot(1, 0) = 1;
  bad = good;
  for (auto &m : bad.moves)
    m.src_gpu = m.dst_gpu == 0 ? 1 : 0;
  bad.moves[0].expert = 1 - bad.moves[0].expert;
  CHECK_THROWS_AS(validate(bad, loads, &resident), Error);
}

TEST_CASE("readable_copy: a copy on the GPU in a slot no move writes, against the slots listed by hand") {
  std::mt19937_64 rng(0x4eadc0);
  for (int it = 0; it < 200 * foremoe_test::seed_multiplier(); ++it) {
    const int G = 1 + int(rng() % 6), S = 1 + int(rng() % 5), E = 1 + int(rng() % 12);
    LayerPlacement base(G, S, E);
    for (int g = 0; g < G; ++g)
      for (int s = 0; s < S; ++s)
        base.slot(g, s) = rng() % 4 == 0 ? empty_slot : std::int32_t(rng() % std::uint64_t(E)); // repeats too
    std::vector<char> written(std::size_t(G) * std::size_t(S), 0);
    for (auto &w : written)
      w = rng() % 3 == 0 ? 1 : 0;
    // By hand: the (GPU, expert) pairs of every slot, and of every slot the moves leave alone.
    std::vector<char> held(std::size_t(G) * std::size_t(E), 0), kept = held;
    for (int q = 0; q < G * S; ++q)
      if (const std::int32_t e = base.phys_to_log()[std::size_t(q)]; e != empty_slot) {
        held[std::size_t(q / S) * std::size_t(E) + std::size_t(e)] = 1;
        if (!written[std::size_t(q)]) kept[std::size_t(q / S) * std::size_t(E) + std::size_t(e)] = 1;
      }
    for (int g = 0; g < G; ++g)
      for (int e = 0; e < E; ++e) {
        CHECK(detail::readable_copy(base, e, g, written) ==
              bool(kept[std::size_t(g) * std::size_t(E) + std::size_t(e)]));
        CHECK(detail::readable_copy(base, e, g) == bool(held[std::size_t(g) * std::size_t(E) + std::size_t(e)]));
      }
  }
  // Validation refuses a move whose source copy another move of the batch overwrites: GPU 1's replica of expert 0
  // is replaced by expert 2 while it is read for GPU 2's new copy of expert 0; read from the owner, it is fine.
  LayerPlacement resident(3, 2, 3);
  resident.slot(0, 0) = 0;
  resident.slot(1, 0) = 1;
  resident.slot(1, 1) = 0;
  resident.slot(2, 0) = 2;
  LayerPlan lp;
  lp.placement = LayerPlacement(3, 2, 3);
  lp.placement.slot(0, 0) = 0;
  lp.placement.slot(1, 0) = 1;
  lp.placement.slot(1, 1) = 2;
  lp.placement.slot(2, 0) = 2;
  lp.placement.slot(2, 1) = 0;
  lp.owner_gpu = {0, 1, 2};
  lp.slot_tokens = {1, 0, 2, 1, 1, 1};
  lp.max_gpu_load = 3;
  lp.moves = {{2, 2, 1, 1}, {0, 0, 2, 1}};
  const std::vector<std::int64_t> loads{2, 2, 2};
  REQUIRE_NOTHROW(validate(lp, loads, &resident));
  lp.moves[1].src_gpu = 1;
  CHECK_ERROR_CONTAINS(validate(lp, loads, &resident),
                       "move 1 reads expert 0 from GPU 1, whose copy a move of the same micro-step overwrites");
}

TEST_CASE("EPLB re-implementation: hand-checked cases") {
  SUBCASE("replicate_experts gives copies by max load per copy") {
    const std::vector<double> w{10, 6, 1};
    std::vector<std::int32_t> p2l, rank, count;
    eplb_replicate_experts(w, 6, p2l, rank, count);
    // 10 -> (5), 6 -> (3), 5 -> expert 0 again (10/3=3.33), then 3.33 vs 3 -> expert 0 (2.5).
    CHECK(p2l == std::vector<std::int32_t>{0, 1, 2, 0, 1, 0});
    CHECK(count == std::vector<std::int32_t>{3, 2, 1});
    CHECK(rank == std::vector<std::int32_t>{0, 0, 0, 1, 1, 2});
  }
  SUBCASE("balanced_packing is LPT with equal counts") {
    const std::vector<double> w{9, 1, 8, 2, 5, 5};
    std::vector<std::int32_t> pack, rank;
    eplb_balanced_packing(w, 2, pack, rank);
    // 9 -> A, 8 -> B, 5 -> B(13), 5 -> A(14), 2 -> B(15), 1 -> A(15).
    CHECK(pack == std::vector<std::int32_t>{0, 0, 1, 1, 1, 0});
    CHECK(rank == std::vector<std::int32_t>{0, 2, 0, 2, 1, 1});
  }
  SUBCASE("global policy with a duplicate on one GPU") {
    // 2 experts, 1 GPU... 2 GPUs x 2 slots: expert 0 is 10x hotter and gets 3 copies.
    const std::vector<double> w{100, 10};
    const EplbLayer layer = eplb_rebalance_layer(w, 4, 1, 1, 2);
    CHECK(layer.replica_count == std::vector<std::int32_t>{3, 1});
    const auto loads = eplb_gpu_loads(layer, std::vector<std::int64_t>{100, 10}, 2);
    // Copies 34/33/33 (rank 0 takes the remainder) and 10: LPT packs two copies of expert 0 together (34 + 33).
    CHECK(loads[0] + loads[1] == 110);
    CHECK(std::max(loads[0], loads[1]) == 67);
    // One GPU holds two copies of expert 0: the LayerPlan merges them.
    const LayerPlan lp = eplb_to_layer_plan(layer, std::vector<std::int64_t>{100, 10}, Topology{1, 2, 2}, nullptr);
    CHECK(lp.max_gpu_load == 67);
    CHECK_NOTHROW(validate(lp, std::vector<std::int64_t>{100, 10}, nullptr));
  }
  SUBCASE("hierarchical policy keeps groups on nodes") {
    // 8 experts in 4 groups of 2, 2 nodes x 2 GPUs x 3 slots.
    const std::vector<double> w{40, 30, 1, 1, 20, 20, 2, 2};
    const EplbLayer layer = eplb_rebalance_layer(w, 12, 4, 2, 4);
    int total = 0;
    for (int c : layer.replica_count)
      total += c;
    CHECK(total == 12);
    // Each group's experts live on one node only.
    for (int grp = 0; grp < 4; ++grp) {
      int node = -1;
      for (int q = 0; q < 12; ++q)
        if (layer.phys_to_log[q] / 2 == grp) {
          if (node < 0) node = q / 6;
          CHECK(node == q / 6);
        }
    }
    // Groups {0: 70}, {2: 40}, {3: 4}, {1: 2}: nodes get {70, 2} and {40, 4}.
    int node_of_e0 = -1, node_of_e4 = -1;
    for (int q = 0; q < 12; ++q) {
      if (layer.phys_to_log[q] == 0) node_of_e0 = q / 6;
      if (layer.phys_to_log[q] == 4) node_of_e4 = q / 6;
    }
    CHECK(node_of_e0 != node_of_e4);
  }
}
