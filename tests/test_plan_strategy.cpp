// Strategy registry: built-ins listed in order, clear lookup errors, and a strategy defined in this file alone
// that plans through `Planner` (a new strategy is one file), with nothing but the lean `foremoe/plan.hpp`.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "foremoe/plan.hpp" // the lean include alone is enough to write and run a strategy
#include "test_support.hpp"

using namespace foremoe;

namespace {

/// Expert `e` on GPU `e % G`, no replicas: a trivial strategy that exercises every hook.
class RoundRobinStrategy : public PlanStrategy {
public:
  static inline int steps_begun = 0;

  void begin_step(const PlanShape &, std::span<const std::int64_t>, std::span<const std::int64_t>,
                  OwnerMap &) override {
    ++steps_begun;
  }
  [[nodiscard]] LayerPlan plan_layer(const LayerRequest &req, ReplicaPlanner &ws) const override {
    const Topology &topo = req.shape.topo;
    const int num_gpus = topo.num_gpus();
    LayerPlacement p(num_gpus, topo.slots_per_gpu, req.shape.num_experts);
    std::vector<std::int32_t> owners(static_cast<std::size_t>(req.shape.num_experts));
    for (int e = 0; e < req.shape.num_experts; ++e) {
      p.slot(e % num_gpus, e / num_gpus) = e;
      owners[e] = e % num_gpus;
    }
    return ws.plan_from_placement(p, req.loads, owners, req.resident);
  }
  [[nodiscard]] bool plans_own_owners() const noexcept override { return true; }
};

const bool round_robin_registered = (register_strategy({"test-round-robin",
                                                        "expert e on GPU e % G (test only)",
                                                        {},
                                                        1000,
                                                        [] { return std::make_unique<RoundRobinStrategy>(); }}),
                                     true);

} // namespace

TEST_CASE("strategy registry: the built-ins come first, in order, with help and options") {
  REQUIRE(round_robin_registered);
  const auto all = strategies();
  REQUIRE(all.size() == 9);
  const char *expected[] = {"static", "eplb",    "eplb-split",   "eplb-oracle",     "ultraep",
                            "moonep", "foremoe", "foremoe-free", "test-round-robin"};
  for (std::size_t i = 0; i < all.size(); ++i) {
    CAPTURE(i);
    CHECK(all[i]->name == expected[i]);
    CHECK(!all[i]->help.empty());
    CHECK(static_cast<bool>(all[i]->make));
  }
  CHECK(strategy_names() ==
        "static, eplb, eplb-split, eplb-oracle, ultraep, moonep, foremoe, foremoe-free, test-round-robin");
  CHECK(strategy_names("|") ==
        "static|eplb|eplb-split|eplb-oracle|ultraep|moonep|foremoe|foremoe-free|test-round-robin");
  CHECK(find_strategy("ultraep").options == std::vector<std::string>{"ultraep_min_tokens", "peer_domain_gpus"});
  CHECK(find_strategy("moonep").options == std::vector<std::string>{"peer_domain_gpus"});
  CHECK(find_strategy("foremoe").options.front() == "move_budget");
  CHECK(find_strategy("eplb-oracle").options == std::vector<std::string>{"eplb_num_groups"});
  CHECK(find_strategy("eplb-split").options == std::vector<std::string>{"eplb_num_groups", "eplb_interval"});
  CHECK(find_strategy("eplb").options == std::vector<std::string>{"eplb_num_groups", "eplb_interval"});
  // Schema-style spellings name the same strategy.
  CHECK(&find_strategy("foremoe_free") == &find_strategy("foremoe-free"));
  CHECK(lookup_strategy("nope") == nullptr);
}

TEST_CASE("strategy registry: unknown names, duplicates and bad entries are errors naming the value") {
  CHECK_ERROR_CONTAINS(
      (void)find_strategy("greedy"),
      "unknown strategy 'greedy' (registered: static, eplb, eplb-split, eplb-oracle, ultraep, moonep, foremoe, "
      "foremoe-free, ideal, test-round-robin)");
  auto make = [] { return std::make_unique<RoundRobinStrategy>(); };
  CHECK_ERROR_CONTAINS(register_strategy({"static", "again", {}, 1, make}), "strategy 'static' is already registered");
  CHECK_ERROR_CONTAINS(register_strategy({"Bad Name", "x", {}, 1, make}), "'Bad Name' may hold only");
  CHECK_ERROR_CONTAINS(register_strategy({"", "x", {}, 1, make}), "empty strategy name");
  CHECK_ERROR_CONTAINS(register_strategy({"no-factory", "x", {}, 1, {}}), "'no-factory' has no factory");
  CHECK(strategies().size() == 9); // nothing was added
  PlannerOptions opts;
  opts.strategy = "fastest";
  CHECK_ERROR_CONTAINS(Planner(2, 16, Topology{1, 4, 5}, opts), "unknown strategy 'fastest'");
}

TEST_CASE("strategy registry: a strategy registered in this file plans through Planner") {
  const int num_layers = 3, num_experts = 16;
  const Topology topo{1, 4, 5};
  LoadTensor loads(2, num_layers, num_experts);
  for (int m = 0; m < 2; ++m)
    for (int l = 0; l < num_layers; ++l)
      for (int e = 0; e < num_experts; ++e)
        loads.at(m, l, e) = 1 + (e * 7 + l * 3 + m) % 11;
  PlannerOptions opts;
  opts.strategy = "test_round_robin";
  opts.num_threads = 2;
  Planner planner(num_layers, num_experts, topo, opts);
  CHECK(planner.options().strategy == "test-round-robin");
  const int before = RoundRobinStrategy::steps_begun;
  const StepPlan sp = planner.plan_step(loads);
  CHECK(RoundRobinStrategy::steps_begun == before + 1);
  REQUIRE(sp.micro_steps.size() == 2);
  for (int m = 0; m < 2; ++m)
    for (int l = 0; l < num_layers; ++l) {
      const LayerPlan &lp = sp.micro_steps[m][l];
      std::int64_t total = 0;
      for (int e = 0; e < num_experts; ++e) {
        CHECK(lp.placement.slot(e % 4, e / 4) == e);
        CHECK(lp.owner_gpu[e] == e % 4);
        total += loads.at(m, l, e);
      }
      std::int64_t planned = 0;
      for (std::int64_t t : lp.slot_tokens)
        planned += t;
      CHECK(planned == total);
      CHECK(lp.moves.empty()); // every copy is an owner: in place at the start, then resident
    }
  // The plans choose their owners, so the step reports the first micro-step's.
  REQUIRE(sp.owner_gpu.size() == std::size_t(num_layers));
  CHECK(sp.owner_gpu[1] == sp.micro_steps[0][1].owner_gpu);
}

TEST_CASE("strategy registry: ideal is the simulator's reference, left out of the plan strategies") {
  const auto with = strategies(true);
  REQUIRE(with.size() == 10);
  CHECK(with[8]->name == "ideal"); // order 1000, before test-round-robin by name
  CHECK(with[8]->simulator_only);
  const auto plan_ones = strategies();
  CHECK(plan_ones.size() == 9);
  CHECK(std::none_of(plan_ones.begin(), plan_ones.end(), [](const StrategyInfo *s) { return s->simulator_only; }));
  CHECK(strategy_names(", ", true) == "static, eplb, eplb-split, eplb-oracle, ultraep, moonep, foremoe, foremoe-free, "
                                      "ideal, test-round-robin");
  CHECK(find_strategy("ideal").name == "ideal");
  CHECK(&find_plan_strategy("foremoe_free") == &find_strategy("foremoe-free"));
  CHECK_ERROR_CONTAINS((void)find_plan_strategy("ideal"),
                       "strategy 'ideal' is a reference for foremoe simulate only, not a plan (plan strategies: "
                       "static, eplb, eplb-split, eplb-oracle, ultraep, moonep, foremoe, foremoe-free, "
                       "test-round-robin)");
  // A user picking a plan is offered the plan strategies only.
  CHECK_ERROR_CONTAINS((void)find_plan_strategy("nope"),
                       "unknown strategy 'nope' (registered: static, eplb, eplb-split, eplb-oracle, ultraep, moonep, "
                       "foremoe, foremoe-free, test-round-robin)");
}

TEST_CASE("ideal: each layer cut into equal pieces in expert order, a valid plan with its moves listed (property)") {
  std::mt19937_64 rng(77);
  for (int round = 0; round < 40 * foremoe_test::seed_multiplier(); ++round) {
    const int nodes = 1 + static_cast<int>(rng() % 2), per_node = 1 + static_cast<int>(rng() % 4);
    const int G = nodes * per_node, E = G + static_cast<int>(rng() % 20), L = 2;
    const int slots = (E + G - 1) / G + static_cast<int>(rng() % 2); // owners + 0 or 1 spare: ideal needs more
    const Topology topo{nodes, per_node, slots};
    CAPTURE(round);
    CAPTURE(G);
    CAPTURE(E);
    LoadTensor loads(3, L, E);
    const int kind = static_cast<int>(rng() % 4); // uniform, one hot expert, with zeros, fewer tokens than GPUs
    for (int m = 0; m < 3; ++m)
      for (int l = 0; l < L; ++l)
        for (int e = 0; e < E; ++e) {
          std::int64_t v = static_cast<std::int64_t>(rng() % 1000);
          if (kind == 1) v = e == static_cast<int>(m + l) % E ? 100000 : static_cast<std::int64_t>(rng() % 5);
          if (kind == 2 && rng() % 3 == 0) v = 0;
          if (kind == 3) v = rng() % (2 * E) == 0 ? 1 : 0;
          loads.at(m, l, e) = v;
        }
    PlannerOptions opts;
    opts.strategy = "ideal";
    Planner planner(L, E, topo, opts);
    CHECK(planner.physical_limit());
    REQUIRE(planner.topology().slots_per_gpu == std::max(slots, E));
    const StepPlan sp = planner.plan_step(loads);
    REQUIRE(sp.micro_steps.size() == 3);
    for (int m = 0; m < 3; ++m)
      for (int l = 0; l < L; ++l) {
        CAPTURE(m);
        CAPTURE(l);
        const LayerPlan &lp = sp.micro_steps[m][l];
        const std::span<const std::int64_t> w = loads.layer(m, l);
        // Every invariant of a plan, the moves from the previous micro-step's placement included.
        const LayerPlacement *resident = m == 0 ? nullptr : &sp.micro_steps[m - 1][l].placement;
        CHECK_NOTHROW(validate(lp, w, resident));
        std::int64_t total = 0;
        for (const std::int64_t v : w)
          total += v;
        const std::vector<std::int64_t> per_gpu = lp.gpu_loads();
        // The T % G pieces with a token more: local GPU 0 of every node, then local GPU 1, ...; so nodes differ by
        // one token at most too.
        std::vector<std::int64_t> node_load(static_cast<std::size_t>(nodes), 0);
        for (int g = 0; g < G; ++g) {
          CHECK(per_gpu[g] == total / G + ((g % per_node) * nodes + g / per_node < total % G ? 1 : 0));
          node_load[g / per_node] += per_gpu[g];
        }
        const auto [lo, hi] = std::minmax_element(node_load.begin(), node_load.end());
        CHECK(*hi - *lo <= 1);
        // Expert order: a GPU's experts all come after the previous GPU's last one (the one piece they may share);
        // each expert's copies are on consecutive GPUs, its owner the first of them.
        int last = -1;
        for (int g = 0; g < G; ++g) {
          int first_here = E, last_here = -1;
          for (int s = 0; s < planner.topology().slots_per_gpu; ++s) {
            const std::int32_t e = lp.placement.slot(g, s);
            if (e == empty_slot) continue;
            first_here = std::min(first_here, static_cast<int>(e));
            last_here = std::max(last_here, static_cast<int>(e));
          }
          if (total > 0 && last_here >= 0) {
            CHECK(first_here >= last);
            last = last_here;
          }
        }
        for (int e = 0; e < E; ++e) {
          std::vector<int> on;
          for (int g = 0; g < G; ++g)
            if (lp.placement.holds(g, e)) on.push_back(g);
          REQUIRE(!on.empty());
          CHECK(on.back() - on.front() + 1 == static_cast<int>(on.size()));
          CHECK(lp.owner_gpu[e] == on.front());
          if (w[e] == 0) CHECK(on.size() == 1);
        }
      }
  }
}
