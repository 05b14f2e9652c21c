// The re-implemented per-micro-batch baselines (strategies "ultraep" and "moonep"): property tests on random
// instances against their published rules, the full push of every replica each micro-step (in `Planner`'s moves
// and in the simulator's moved bytes), and their registry entries. Also "eplb-split" (EPLB's placement, each
// micro-step's tokens split exactly over its copies) against "eplb".
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "foremoe/core/load_tensor.hpp"
#include "foremoe/plan/planner.hpp"
#include "foremoe/plan/strategies/moonep.hpp"
#include "foremoe/plan/strategies/ultraep.hpp"
#include "foremoe/sim/simulator.hpp"
#include "test_support.hpp"

using namespace foremoe;

namespace {

struct Instance {
  Topology topo;
  std::vector<std::int64_t> loads, other; ///< this layer's loads; other loads (for a resident plan)
  int spare = 0;                          ///< R, the spare slots per GPU
};

/// Random topology (1-3 nodes of 1-6 GPUs, 0-3 spare slots) and skewed loads, some layers below 1,024 tokens per
/// expert, some far above, with zeros.
Instance random_instance(std::mt19937_64 &rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Instance in;
  in.topo.num_nodes = pick(1, 3);
  in.topo.gpus_per_node = pick(1, 6);
  const int num_gpus = in.topo.num_gpus();
  const int num_experts = pick(1, 4 * num_gpus);
  in.spare = pick(0, 3);
  in.topo.slots_per_gpu = in.topo.owners_per_gpu(num_experts) + in.spare;
  const double scale = std::pow(10.0, std::uniform_real_distribution<double>(1.0, 5.0)(rng));
  const double alpha = std::uniform_real_distribution<double>(0.0, 2.5)(rng);
  auto draw = [&] {
    std::vector<std::int64_t> v(static_cast<std::size_t>(num_experts));
    for (auto &x : v) {
      const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
      x = pick(0, 9) == 0 ? 0 : static_cast<std::int64_t>(scale * std::pow(u, 1.0 + alpha * 2));
    }
    return v;
  };
  in.loads = draw();
  in.other = draw();
  return in;
}

std::int64_t static_max(const Instance &in) {
  const auto r = detail::static_rank_loads(in.loads, in.topo);
  return *std::max_element(r.begin(), r.end());
}

/// The rules both baselines share: validate(), static contiguous owners in their slots, replicas only on the owner's
/// node, at most R per GPU, no two copies of one expert on a GPU, never worse than static.
void check_baseline_plan(const LayerPlan &lp, const Instance &in, const LayerPlacement *resident) {
  const int num_experts = static_cast<int>(in.loads.size()), per_gpu = in.topo.owners_per_gpu(num_experts);
  REQUIRE_NOTHROW(validate(lp, in.loads, resident));
  for (int e = 0; e < num_experts; ++e) {
    CHECK(lp.owner_gpu[e] == e / per_gpu);
    CHECK(lp.placement.slot(e / per_gpu, e % per_gpu) == e);
  }
  for (int g = 0; g < in.topo.num_gpus(); ++g) {
    int replicas = 0;
    std::vector<std::int32_t> seen;
    for (int s = 0; s < in.topo.slots_per_gpu; ++s) {
      const std::int32_t e = lp.placement.slot(g, s);
      if (e == empty_slot) continue;
      CHECK(std::find(seen.begin(), seen.end(), e) == seen.end());
      seen.push_back(e);
      if (lp.owner_gpu[e] == g) continue;
      ++replicas;
      CHECK(in.topo.node_of(g) == in.topo.node_of(lp.owner_gpu[e]));
    }
    CHECK(replicas <= in.spare);
  }
  CHECK(lp.max_gpu_load <= static_max(in));
}

int seeds(int n) { return n * foremoe_test::seed_multiplier(); }

} // namespace

TEST_CASE("ultraep: random instances keep its rules and meet the threshold it found") {
  std::mt19937_64 rng(1201);
  int improved = 0;
  for (int it = 0; it < seeds(400); ++it) {
    CAPTURE(it);
    const Instance in = random_instance(rng);
    UltraepOptions o;
    o.min_tokens_per_replica = std::uniform_int_distribution<int>(0, 3)(rng) == 0 ? 0 : 1024;
    const UltraepLayerResult prev = ultraep_plan_layer(in.other, in.topo, o);
    const bool with_resident = it % 2 == 1;
    const LayerPlacement *res = with_resident ? &prev.plan.placement : nullptr;
    const UltraepLayerResult r = ultraep_plan_layer(in.loads, in.topo, o, res);
    check_baseline_plan(r.plan, in, res);
    // Every rank at or below the threshold; the threshold between the node bound and static.
    for (const std::int64_t t : r.plan.gpu_loads())
      CHECK(t <= r.threshold);
    CHECK(r.plan.max_gpu_load <= r.threshold);
    CHECK(r.threshold >= r.lower_bound);
    CHECK(r.threshold <= static_max(in));
    // No replica below the minimum (and none without tokens).
    for (int p = 0; p < r.plan.placement.num_slots(); ++p) {
      const std::int32_t e = r.plan.placement.phys_to_log()[p];
      if (e == empty_slot || r.plan.owner_gpu[e] == p / in.topo.slots_per_gpu) continue;
      CHECK(r.plan.slot_tokens[p] > 0);
      CHECK(r.plan.slot_tokens[p] >= o.min_tokens_per_replica);
    }
    // Every replica is pushed: one move per replica, even those the resident placement held.
    CHECK(r.plan.moves.size() == static_cast<std::size_t>(r.plan.num_replicas()));
    improved += r.plan.max_gpu_load < static_max(in);
  }
  CHECK(improved > seeds(100)); // the property holds on instances where it balances, not only trivial ones
}

TEST_CASE("ultraep: without a minimum and with room for every replica, each node reaches its lower bound") {
  std::mt19937_64 rng(1202);
  for (int it = 0; it < seeds(200); ++it) {
    CAPTURE(it);
    Instance in = random_instance(rng);
    const int per_gpu = in.topo.owners_per_gpu(static_cast<int>(in.loads.size()));
    in.spare = per_gpu * in.topo.gpus_per_node; // a receiver can take every expert of its node
    in.topo.slots_per_gpu = per_gpu + in.spare;
    UltraepOptions o;
    o.min_tokens_per_replica = 0;
    const UltraepLayerResult r = ultraep_plan_layer(in.loads, in.topo, o);
    check_baseline_plan(r.plan, in, nullptr);
    CHECK(r.threshold == r.lower_bound);
    CHECK(r.plan.max_gpu_load == r.lower_bound);
  }
}

TEST_CASE("ultraep: no spare slot, or loads below the minimum, leave the static plan") {
  const Topology topo{1, 4, 2}; // 8 experts: 2 owners per GPU, R = 0
  const std::vector<std::int64_t> loads{5000, 10, 10, 10, 10, 10, 10, 10};
  const UltraepLayerResult none = ultraep_plan_layer(loads, topo);
  CHECK(none.plan.num_replicas() == 0);
  CHECK(none.plan.max_gpu_load == 5010);
  // R = 1, but the excess over the bound is small and the receivers' slack below 1,024 tokens.
  const Topology roomy{1, 4, 3};
  const std::vector<std::int64_t> small{900, 10, 10, 10, 10, 10, 10, 10};
  const UltraepLayerResult r = ultraep_plan_layer(small, roomy);
  CHECK(r.plan.num_replicas() == 0);
  UltraepOptions any;
  any.min_tokens_per_replica = 0;
  const UltraepLayerResult split = ultraep_plan_layer(small, roomy, any);
  CHECK(split.plan.num_replicas() == 3);
  CHECK(split.plan.max_gpu_load == split.lower_bound); // ceil(970 / 4) = 243
  CHECK(split.lower_bound == 243);
  CHECK_THROWS_WITH_AS((void)ultraep_plan_layer(std::vector<std::int64_t>{1, -2}, Topology{1, 2, 2}),
                       doctest::Contains("negative load -2"), Error);
}

TEST_CASE("moonep: random instances keep its rules; exact per node whenever a rank may take a whole home group") {
  std::mt19937_64 rng(1203);
  int exact_cases = 0;
  for (int it = 0; it < seeds(400); ++it) {
    CAPTURE(it);
    const Instance in = random_instance(rng);
    const int num_experts = static_cast<int>(in.loads.size()), per_gpu = in.topo.owners_per_gpu(num_experts);
    const MoonepLayerResult prev = moonep_plan_layer(in.other, in.topo);
    const LayerPlacement *res = it % 2 == 1 ? &prev.plan.placement : nullptr;
    const MoonepLayerResult r = moonep_plan_layer(in.loads, in.topo, {}, res);
    check_baseline_plan(r.plan, in, res);
    CHECK(r.plan.moves.size() == static_cast<std::size_t>(r.plan.num_replicas()));
    // Targets: each node's tokens split as evenly as integers allow.
    const auto ranks = detail::static_rank_loads(in.loads, in.topo);
    for (int node = 0; node < in.topo.num_nodes; ++node) {
      std::int64_t total = 0, target_sum = 0, lo = r.targets[node * in.topo.gpus_per_node], hi = lo;
      for (int i = 0; i < in.topo.gpus_per_node; ++i) {
        const int g = node * in.topo.gpus_per_node + i;
        total += ranks[g];
        target_sum += r.targets[g];
        lo = std::min(lo, r.targets[g]);
        hi = std::max(hi, r.targets[g]);
      }
      CHECK(target_sum == total);
      CHECK(hi - lo <= 1);
    }
    // One home group per destination: all its replicas belong to one GPU's experts, named by `home_group`.
    for (int g = 0; g < in.topo.num_gpus(); ++g)
      for (int s = 0; s < in.topo.slots_per_gpu; ++s) {
        const std::int32_t e = r.plan.placement.slot(g, s);
        if (e == empty_slot || r.plan.owner_gpu[e] == g) continue;
        CHECK(r.plan.owner_gpu[e] == r.home_group[g]);
      }
    // A rank that starts at or below its share never ends above it, and no rank ends above its static load
    // unless it was below its share; exact when R covers a home group.
    const auto got = r.plan.gpu_loads();
    for (int g = 0; g < in.topo.num_gpus(); ++g) {
      if (ranks[g] <= r.targets[g])
        CHECK(got[g] <= r.targets[g]);
      else
        CHECK(got[g] <= ranks[g]);
    }
    CHECK(r.exact == (got == r.targets));
    if (in.spare >= per_gpu) {
      CHECK(r.exact);
      ++exact_cases;
    }
  }
  CHECK(exact_cases > seeds(50));
}

TEST_CASE("moonep: a worked case, two home groups and a group that gives more than its excess") {
  // One node of 4 GPUs, 8 experts (2 per GPU), R = 2: rank loads 70, 50, 0, 0 -> target 30 each.
  const Topology topo{1, 4, 4};
  const std::vector<std::int64_t> loads{40, 30, 30, 20, 0, 0, 0, 0};
  const MoonepLayerResult r = moonep_plan_layer(loads, topo);
  CHECK(r.exact);
  CHECK(r.plan.gpu_loads() == std::vector<std::int64_t>{30, 30, 30, 30});
  // Most overloaded group 0 (+40) fills GPU 2 (-30), then group 1 (+20) fills GPU 3 (-30) and drops to -10, so
  // group 0 (+10) fills GPU 1.
  CHECK(r.home_group == std::vector<int>{-1, 0, 0, 1});
}

TEST_CASE("baselines through Planner: every replica is re-pushed each micro-step, also when the loads repeat") {
  const int num_layers = 3, num_experts = 16;
  const Topology topo{2, 2, 6}; // 4 owners + 2 spare per GPU
  LoadTensor loads(3, num_layers, num_experts);
  for (int m = 0; m < 3; ++m)
    for (int l = 0; l < num_layers; ++l)
      for (int e = 0; e < num_experts; ++e)
        loads.at(m, l, e) = e < 4 ? 20000 + 1000 * l : 500 + 10 * e; // the same loads every micro-step
  for (const char *name : {"ultraep", "moonep"}) {
    CAPTURE(name);
    PlannerOptions opts;
    opts.strategy = name;
    Planner planner(num_layers, num_experts, topo, opts);
    CHECK_FALSE(planner.reuses_resident());
    const StepPlan sp = planner.plan_step(loads);
    std::size_t replicas = 0;
    for (int m = 0; m < 3; ++m)
      for (int l = 0; l < num_layers; ++l) {
        const LayerPlan &lp = sp.micro_steps[m][l];
        const LayerPlacement *res = m == 0 ? nullptr : &sp.micro_steps[m - 1][l].placement;
        REQUIRE_NOTHROW(validate(lp, loads.layer(m, l), res));
        CHECK(lp.moves.size() == static_cast<std::size_t>(lp.num_replicas()));
        for (const Move &mv : lp.moves)
          CHECK(mv.src_gpu == lp.owner_gpu[mv.expert]); // pushed from the owner, inside the node
        if (m > 0) CHECK(lp.placement == sp.micro_steps[m - 1][l].placement);
        replicas += static_cast<std::size_t>(lp.num_replicas());
      }
    CHECK(replicas > 0);
  }
  PlannerOptions fm;
  fm.strategy = "foremoe";
  CHECK(Planner(num_layers, num_experts, topo, fm).reuses_resident());
}

TEST_CASE("baselines in the simulator: a full push of every replica per micro-step and layer is charged") {
  SimConfig cfg;
  cfg.model = ModelSpec{2, 16, 2, 256, 128, WeightDtype::bf16};
  cfg.topo = Topology{2, 2, 6};
  cfg.warmup_steps = 0; // one RL step, all of it counted
  const int M = 4;
  LoadTensor loads(M, 2, 16);
  for (int m = 0; m < M; ++m)
    for (int l = 0; l < 2; ++l)
      for (int e = 0; e < 16; ++e)
        loads.at(m, l, e) = e < 4 ? 20000 : 600; // identical micro-steps
  const std::vector<SimStrategy> strats{parse_sim_strategy("ultraep"), parse_sim_strategy("moonep"),
                                        parse_sim_strategy("foremoe")};
  const std::vector<SimResult> res = simulate(cfg, loads, {}, strats);
  const double bytes = static_cast<double>(cfg.model.bytes_per_expert());
  const int passes = cfg.recompute_passes + 1;
  for (int i = 0; i < 2; ++i) {
    CAPTURE(strats[i].name);
    double replicas = 0;
    for (int l = 0; l < 2; ++l) {
      const auto layer = loads.layer(0, l);
      replicas += i == 0 ? ultraep_plan_layer(layer, cfg.topo).plan.num_replicas()
                         : moonep_plan_layer(layer, cfg.topo).plan.num_replicas();
    }
    REQUIRE(replicas > 0);
    CHECK(res[i].moved_gb * 1e9 == doctest::Approx(passes * M * replicas * bytes));
  }
  // ForeMoE keeps resident replicas: after the first micro-step of the step the same plan moves nothing.
  CHECK(res[2].moved_gb < res[0].moved_gb / 2);
}

TEST_CASE("eplb-split: EPLB's placement, never less balanced than eplb, every expert's tokens conserved") {
  std::mt19937_64 rng(3301);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  int better = 0, with_replicas = 0;
  for (int it = 0; it < seeds(150); ++it) {
    CAPTURE(it);
    Topology topo;
    topo.num_nodes = pick(1, 3);
    topo.gpus_per_node = pick(1, 4);
    const int num_gpus = topo.num_gpus(), num_layers = pick(1, 3), num_micro = pick(1, 4);
    const int num_experts = num_gpus * pick(1, 4) + (pick(0, 1) == 0 ? 0 : pick(0, num_gpus - 1));
    topo.slots_per_gpu = topo.owners_per_gpu(num_experts) + pick(0, 3);
    CAPTURE(num_gpus);
    CAPTURE(num_experts);
    CAPTURE(topo.slots_per_gpu);
    PlannerOptions opts;
    opts.eplb_num_groups = num_experts % 2 == 0 && pick(0, 1) == 1 ? 2 : 1; // hierarchical where 2 | nodes
    const double scale = std::pow(10.0, std::uniform_real_distribution<double>(1.0, 4.5)(rng));
    const double alpha = std::uniform_real_distribution<double>(0.0, 2.5)(rng);
    auto draw = [&] {
      const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
      return pick(0, 7) == 0 ? std::int64_t{0} : static_cast<std::int64_t>(scale * std::pow(u, 1.0 + 2 * alpha));
    };
    LoadTensor loads(num_micro, num_layers, num_experts);
    for (int m = 0; m < num_micro; ++m)
      for (int l = 0; l < num_layers; ++l)
        for (int e = 0; e < num_experts; ++e)
          loads.at(m, l, e) = draw();
    // EPLB's history: another draw (the previous step), or none (the static placement, nothing to split).
    std::vector<std::int64_t> previous;
    if (it % 5 != 0) {
      previous.resize(static_cast<std::size_t>(num_layers) * num_experts);
      for (auto &x : previous)
        x = draw();
    }
    opts.strategy = "eplb";
    Planner eplb(num_layers, num_experts, topo, opts);
    opts.strategy = "eplb-split";
    Planner split(num_layers, num_experts, topo, opts);
    const StepPlan a = eplb.plan_step(loads, nullptr, previous);
    const StepPlan b = split.plan_step(loads, nullptr, previous);
    REQUIRE(a.micro_steps.size() == b.micro_steps.size());
    CHECK(a.owner_gpu == b.owner_gpu);
    for (int m = 0; m < num_micro; ++m)
      for (int l = 0; l < num_layers; ++l) {
        CAPTURE(m);
        CAPTURE(l);
        const LayerPlan &pa = a.micro_steps[m][l], &pb = b.micro_steps[m][l];
        const auto layer = loads.layer(m, l);
        const LayerPlacement *res = m == 0 ? nullptr : &b.micro_steps[m - 1][l].placement;
        REQUIRE_NOTHROW(validate(pb, layer, res));
        // The same copies in the same slots, the same owners and moves: only the token split differs.
        CHECK(pb.placement == pa.placement);
        CHECK(pb.owner_gpu == pa.owner_gpu);
        CHECK(pb.moves.size() == pa.moves.size());
        if (m > 0) CHECK(pb.moves.empty()); // no moves during the step
        // Every expert's tokens, exactly, over its copies.
        std::vector<std::int64_t> sums(static_cast<std::size_t>(num_experts), 0);
        for (int p = 0; p < pb.placement.num_slots(); ++p)
          if (const std::int32_t e = pb.placement.phys_to_log()[p]; e != empty_slot) sums[e] += pb.slot_tokens[p];
        for (int e = 0; e < num_experts; ++e)
          CHECK(sums[e] == layer[e]);
        // Never less balanced: EPLB's even split is one of the splits the exact one minimises over.
        const auto ga = pa.gpu_loads(), gb = pb.gpu_loads();
        CHECK(*std::max_element(gb.begin(), gb.end()) == pb.max_gpu_load);
        CHECK(pb.max_gpu_load <= pa.max_gpu_load);
        CHECK(pb.imbalance() <= pa.imbalance() + 1e-12);
        better += pb.max_gpu_load < pa.max_gpu_load;
        with_replicas += pb.num_replicas() > 0;
      }
  }
  CHECK(with_replicas > seeds(50));
  CHECK(better > seeds(20)); // the property is exercised where the split matters, not only on ties
}

TEST_CASE("baselines' balancing domain: a node by default; the whole EP group lets replicas cross nodes and balances "
          "between them (property)") {
  std::mt19937_64 rng(4242);
  int crossed = 0, group_exact = 0;
  for (int it = 0; it < seeds(300); ++it) {
    CAPTURE(it);
    const Instance in = random_instance(rng);
    const int G = in.topo.num_gpus(), per_gpu = in.topo.owners_per_gpu(static_cast<int>(in.loads.size()));
    // A node given explicitly is the default, plan for plan.
    UltraepOptions un;
    un.domain_gpus = in.topo.gpus_per_node;
    CHECK(ultraep_plan_layer(in.loads, in.topo, un).plan.placement ==
          ultraep_plan_layer(in.loads, in.topo).plan.placement);
    MoonepOptions mn;
    mn.domain_gpus = in.topo.gpus_per_node;
    CHECK(moonep_plan_layer(in.loads, in.topo, mn).plan.placement ==
          moonep_plan_layer(in.loads, in.topo).plan.placement);
    // The whole group: valid plans, static owners, every expert's tokens conserved, at most R replicas per GPU.
    UltraepOptions ug;
    ug.domain_gpus = -1;
    MoonepOptions mg;
    mg.domain_gpus = -1;
    const UltraepLayerResult u = ultraep_plan_layer(in.loads, in.topo, ug);
    const MoonepLayerResult m = moonep_plan_layer(in.loads, in.topo, mg);
    for (const LayerPlan *lp : {&u.plan, &m.plan}) {
      REQUIRE_NOTHROW(validate(*lp, in.loads, nullptr));
      CHECK(lp->max_gpu_load <= static_max(in));
      for (int g = 0; g < G; ++g) {
        int replicas = 0;
        for (int s = 0; s < in.topo.slots_per_gpu; ++s) {
          const std::int32_t e = lp->placement.slot(g, s);
          if (e == empty_slot || lp->owner_gpu[e] == g) continue;
          ++replicas;
          crossed += in.topo.node_of(g) != in.topo.node_of(lp->owner_gpu[e]) ? 1 : 0;
        }
        CHECK(replicas <= in.spare);
      }
    }
    // MoonEP over the group: its exact share is the group's, so when exact no GPU runs more than ceil(mean).
    std::int64_t total = 0;
    for (const std::int64_t x : in.loads)
      total += x;
    if (m.exact) CHECK(m.plan.max_gpu_load <= (total + G - 1) / G);
    if (m.exact && in.spare >= per_gpu) ++group_exact;
    // A domain that does not divide the group is an error naming it.
    if (G > 1) {
      UltraepOptions bad;
      bad.domain_gpus = G + 1;
      const std::string want = "domain of " + std::to_string(G + 1) + " GPUs";
      CHECK_THROWS_WITH_AS((void)ultraep_plan_layer(in.loads, in.topo, bad), doctest::Contains(want.c_str()), Error);
    }
  }
  CHECK(crossed > 0);
  CHECK(group_exact > seeds(30));
}

TEST_CASE("eplb, eplb-split: the strategy's window rebalances every eplb_interval steps (property)") {
  // The definition (PlannerOptions::eplb_interval): step s plans from the tables of its last rebalance, made at
  // step r = (s / N) * N from the summed totals of steps r - N .. r - 1; before the first (r = 0) the static
  // placement. Reference: a fresh interval-1 planner handed that window once (or nothing), per step. The stateful
  // planner is handed only each finished step's totals, once per step (its later stages hand none).
  std::mt19937_64 rng(5521);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  int stale = 0, checked = 0;
  for (int it = 0; it < seeds(40); ++it) {
    CAPTURE(it);
    Topology topo;
    topo.num_nodes = pick(1, 2);
    topo.gpus_per_node = pick(1, 4);
    const int num_gpus = topo.num_gpus(), L = pick(1, 3), E = num_gpus * pick(1, 3);
    topo.slots_per_gpu = topo.owners_per_gpu(E) + pick(1, 2);
    const int N = pick(1, 5), steps = pick(1, 3 * N + 2);
    CAPTURE(N);
    CAPTURE(steps);
    PlannerOptions opts;
    opts.strategy = pick(0, 1) == 0 ? "eplb" : "eplb-split";
    opts.eplb_interval = N;
    // Each step its own hot experts, so windows of different steps give different tables.
    std::vector<LoadTensor> step;
    std::vector<std::vector<std::int64_t>> totals;
    Planner stateful(L, E, topo, opts);
    for (int s = 0; s < steps; ++s) {
      step.emplace_back(pick(1, 3), L, E);
      for (int m = 0; m < step.back().num_micro_steps(); ++m)
        for (int l = 0; l < L; ++l)
          for (int e = 0; e < E; ++e)
            step.back().at(m, l, e) = pick(0, 7) == 0 ? 0 : pick(1, pick(0, 2) == 0 ? 5000 : 200);
      totals.push_back(stateful.sum_steps(step.back()));
    }
    PlannerOptions ref_opts = opts;
    ref_opts.eplb_interval = 1;
    for (int s = 0; s < steps; ++s) {
      CAPTURE(s);
      const int r = (s / N) * N;
      std::vector<std::int64_t> window;
      if (r > 0) {
        window.assign(totals[0].size(), 0);
        for (int t = r - N; t < r; ++t)
          for (std::size_t i = 0; i < window.size(); ++i)
            window[i] += totals[t][i];
      }
      const int stages = pick(1, 3); // recompute passes, then the update: one hand-over per step
      for (int k = 0; k < stages; ++k) {
        CAPTURE(k);
        const Stage stage = k + 1 == stages ? Stage::update : Stage::recompute;
        const StepPlan got = stateful.plan_step(
            step[s], nullptr,
            k == 0 && s > 0 ? std::span<const std::int64_t>(totals[s - 1]) : std::span<const std::int64_t>{}, stage);
        Planner fresh(L, E, topo, ref_opts);
        const StepPlan want = fresh.plan_step(step[s], nullptr, window, stage);
        REQUIRE(got.micro_steps.size() == want.micro_steps.size());
        CHECK(got.owner_gpu == want.owner_gpu);
        for (std::size_t m = 0; m < got.micro_steps.size(); ++m)
          for (int l = 0; l < L; ++l) {
            const LayerPlan &a = got.micro_steps[m][l], &b = want.micro_steps[m][l];
            CHECK(a.placement == b.placement);
            CHECK(a.slot_tokens == b.slot_tokens);
            CHECK(a.owner_gpu == b.owner_gpu);
            CHECK(a.moves == b.moves);
          }
        ++checked;
        // Teeth: where the schedule keeps older tables, planning from the previous step alone differs.
        if (k == 0 && s > 0 && s - 1 >= r) {
          Planner last(L, E, topo, ref_opts);
          const StepPlan from_last = last.plan_step(step[s], nullptr, totals[s - 1], stage);
          bool same = true;
          for (std::size_t m = 0; m < got.micro_steps.size(); ++m)
            for (int l = 0; l < L; ++l)
              same = same && got.micro_steps[m][l].placement == from_last.micro_steps[m][l].placement;
          stale += same ? 0 : 1;
        }
      }
    }
  }
  CHECK(checked > seeds(100));
  CHECK(stale > seeds(10)); // the window is not the previous step's totals in disguise
}

TEST_CASE("eplb: eplb_interval 0 or negative is an error naming the value") {
  for (int bad : {0, -1, -7}) {
    PlannerOptions opts;
    opts.strategy = "eplb";
    opts.eplb_interval = bad;
    CHECK_ERROR_CONTAINS(Planner(1, 4, Topology{1, 2, 3}, opts),
                         ("Planner: eplb_interval must be >= 1, got " + std::to_string(bad)).c_str());
  }
}
