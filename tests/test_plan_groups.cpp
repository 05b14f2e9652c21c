// EP groups: the default group size and planning each group on its own, in parallel.
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "foremoe/plan/ep_groups.hpp"

using namespace foremoe;

TEST_CASE("default_ep_size: every GPU up to the experts, else the largest divisor not above them") {
  for (int gpus = 1; gpus <= 300; ++gpus)
    for (int experts = 1; experts <= 300; experts += 7) {
      const int ep = default_ep_size(gpus, experts);
      CAPTURE(gpus);
      CAPTURE(experts);
      CHECK(gpus % ep == 0);
      if (gpus <= experts) {
        CHECK(ep == gpus);
        continue;
      }
      CHECK(ep <= experts);
      for (int d = ep + 1; d <= experts; ++d)
        CHECK(gpus % d != 0);
    }
  CHECK(default_ep_size(1024, 256) == 256);
  CHECK_THROWS_AS((void)default_ep_size(0, 8), Error);
}

TEST_CASE("GroupedPlanner: each group plans as its own planner, for any thread count") {
  std::mt19937_64 rng(3);
  const Topology topo{4, 4, 3}; // 16 GPUs; 8 experts -> groups of 8 GPUs (2 nodes)
  const int layers = 3, experts = 8;
  GroupedPlanner one(layers, experts, topo);
  PlannerOptions two_threads;
  two_threads.num_threads = 2;
  GroupedPlanner two(layers, experts, topo, two_threads);
  REQUIRE(one.num_groups() == 2);
  std::vector<std::vector<std::int64_t>> loads(2);
  for (auto &g : loads)
    for (int i = 0; i < layers * experts; ++i)
      g.push_back(static_cast<std::int64_t>(rng() % 1000));
  one.begin_step(loads);
  two.begin_step(loads);
  const auto a = one.plan(loads), b = two.plan(loads);
  for (int g = 0; g < 2; ++g) {
    Planner alone(layers, experts, ep_group_topology(topo, 8));
    alone.begin_step(loads[g]);
    const auto ref = alone.plan(loads[g]);
    for (int l = 0; l < layers; ++l) {
      CHECK(a[g][l].placement == ref[l].placement);
      CHECK(a[g][l].slot_tokens == ref[l].slot_tokens);
      CHECK(b[g][l].slot_tokens == ref[l].slot_tokens);
      CHECK_NOTHROW(
          validate(a[g][l], std::span(loads[g]).subspan(static_cast<std::size_t>(l) * experts, experts), nullptr));
    }
  }
  CHECK_THROWS_AS((void)ep_group_topology(topo, 3), Error);
}
