#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "foremoe/trace/baseline_workloads.hpp"
#include "test_support.hpp"

using namespace foremoe;

namespace {

SyntheticConfig small_batch(std::uint64_t seed, int experts, int gpus) {
  SyntheticConfig b;
  b.seed = seed;
  b.num_layers = 3;
  b.num_experts = experts;
  b.topk = 4;
  b.num_steps = 2;
  b.prompts_per_step = 16;
  b.responses_per_prompt = 4;
  b.prompt_length = {64, 0.5, 8, 512};
  b.response_length = {128, 0.5, 8, 512};
  b.num_gpus = gpus;
  b.microbatch_tokens_per_gpu = 512;
  return b;
}

std::vector<double> as_double(std::span<const std::int64_t> v) { return {v.begin(), v.end()}; }

} // namespace

TEST_CASE("parse_workload: accepted specs round-trip, malformed ones name the value") {
  CHECK(parse_workload("grpo").kind == WorkloadKind::grpo);
  const WorkloadSpec u = parse_workload("ultraep:1.5");
  CHECK(u.kind == WorkloadKind::ultraep);
  CHECK(u.param == 1.5);
  CHECK(to_string(u) == "ultraep:1.5");
  CHECK(to_string(parse_workload("moonep:20")) == "moonep:20");
  CHECK(to_string(parse_workload("grpo")) == "grpo");
  CHECK_THROWS_WITH_AS((void)parse_workload("ultraep:"), doctest::Contains("'ultraep:' needs a parameter"), Error);
  CHECK_THROWS_WITH_AS((void)parse_workload("ultraep"), doctest::Contains("'ultraep' needs a parameter"), Error);
  CHECK_THROWS_WITH_AS((void)parse_workload("moonep:-1"),
                       doctest::Contains("'moonep:-1': the maxvio V must be >= 0, got -1"), Error);
  CHECK_THROWS_WITH_AS((void)parse_workload("ultraep:0.5"),
                       doctest::Contains("the rank max/mean A must be >= 1, got 0.5"), Error);
  CHECK_THROWS_WITH_AS((void)parse_workload("foo:1"),
                       doctest::Contains("'foo:1' is not a workload (expected grpo, ultraep:A or moonep:V)"), Error);
  CHECK_THROWS_WITH_AS((void)parse_workload("moonep:x1"), doctest::Contains("parameter 'x1' is not a number"), Error);
  CHECK_THROWS_WITH_AS((void)parse_workload("grpo:2"), doctest::Contains("grpo takes no parameter"), Error);
}

TEST_CASE("ultraep_alpha and moonep_sigma: the bisection hits its target (property, random targets)") {
  std::mt19937_64 rng(12);
  for (int trial = 0; trial < 200; ++trial) {
    const int ranks = 2 + static_cast<int>(rng() % 255);
    const double target = 1.0 + std::uniform_real_distribution<double>(0, 0.99)(rng) * (ranks - 1);
    const double alpha = ultraep_alpha(ranks, target);
    CHECK(alpha >= 0);
    const auto w = ultraep_rank_weights(ranks, alpha);
    CHECK(max_over_mean(w) == doctest::Approx(target).epsilon(1e-9));
  }
  for (int trial = 0; trial < 200; ++trial) {
    const int experts = 8 + static_cast<int>(rng() % 500);
    std::vector<double> z(static_cast<std::size_t>(experts));
    std::normal_distribution<double> n01;
    for (double &v : z)
      v = n01(rng);
    const double target = std::uniform_real_distribution<double>(0, 0.95)(rng) * (experts - 1);
    const double sigma = moonep_sigma(z, target);
    std::vector<double> w(z.size());
    for (std::size_t i = 0; i < z.size(); ++i)
      w[i] = std::exp(sigma * z[i]);
    CHECK(max_over_mean(w) - 1 == doctest::Approx(target).epsilon(1e-9));
  }
  CHECK_THROWS_WITH_AS((void)ultraep_alpha(4, 4), doctest::Contains("the rank max/mean of 4 ranks"), Error);
  CHECK_THROWS_WITH_AS((void)moonep_sigma(std::vector<double>{0.1, 0.2}, 1),
                       doctest::Contains("the maxvio of 2 experts"), Error);
}

TEST_CASE("generate_baseline_loads: realised loads hit the target on random seeds, keep the GRPO micro-steps") {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 12; ++trial) {
    const std::uint64_t seed = rng();
    const int experts = trial % 2 == 0 ? 64 : 48, gpus = trial % 3 == 0 ? 32 : 16;
    const SyntheticConfig b = small_batch(seed, experts, gpus);
    std::vector<std::int64_t> grpo_steps, steps;
    const LoadTensor grpo = generate_loads(b, &grpo_steps);
    const int per = (experts + gpus - 1) / gpus, used = (experts + per - 1) / per;
    const double A = 1.0 + std::uniform_real_distribution<double>(0.1, 1.0)(rng); // top-4 feasible at 16+ ranks
    const LoadTensor u = generate_baseline_loads(parse_workload("ultraep:" + std::to_string(A)), b, gpus, &steps);
    CHECK(steps == grpo_steps);
    REQUIRE(u.num_micro_steps() == grpo.num_micro_steps());
    const double V = std::uniform_real_distribution<double>(0.1, 3.0)(rng);
    const LoadTensor mo = generate_baseline_loads(parse_workload("moonep:" + std::to_string(V)), b, gpus);
    for (int m = 0; m < u.num_micro_steps(); ++m)
      for (int l = 0; l < b.num_layers; ++l) {
        // Same tokens as the GRPO batch, routed differently.
        CHECK(u.layer_total(m, l) == grpo.layer_total(m, l));
        CHECK(mo.layer_total(m, l) == grpo.layer_total(m, l));
        const auto v = u.layer(m, l);
        std::vector<double> rank(static_cast<std::size_t>(used), 0.0);
        for (int e = 0; e < experts; ++e)
          rank[e / per] += static_cast<double>(v[e]);
        // Rounding moves at most one assignment per expert: a relative error of per * used / total.
        const double tol = 2.0 * per * used / static_cast<double>(u.layer_total(m, l));
        CHECK(std::abs(max_over_mean(rank) - A) <= tol * A + 1e-12);
        const auto w = mo.layer(m, l);
        CHECK(std::abs(max_over_mean(as_double(w)) - 1 - V) <=
              2.0 * experts / static_cast<double>(mo.layer_total(m, l)) * (1 + V) + 1e-12);
      }
    // Deterministic for a seed; another seed routes differently.
    const LoadTensor again = generate_baseline_loads(parse_workload("moonep:" + std::to_string(V)), b, gpus);
    REQUIRE(again.totals().size() == mo.totals().size());
    CHECK(std::equal(again.totals().begin(), again.totals().end(), mo.totals().begin()));
    const LoadTensor other = generate_baseline_loads(parse_workload("moonep:" + std::to_string(V)),
                                                     small_batch(seed + 1, experts, gpus), gpus);
    // Another seed may also cut another number of micro-steps: compare sizes before contents.
    CHECK_FALSE((other.totals().size() == mo.totals().size() &&
                 std::equal(other.totals().begin(), other.totals().end(), mo.totals().begin())));
  }
}

TEST_CASE("generate_baseline_loads: a skew a token's distinct experts cannot carry is an error naming it") {
  // top-4 of 64 experts caps an expert at 1/4 of the assignments: max/mean 16, maxvio 15.
  const SyntheticConfig b = small_batch(3, 64, 8);
  CHECK_THROWS_WITH_AS((void)generate_baseline_loads(parse_workload("moonep:20"), b, 8),
                       doctest::Contains("workload 'moonep:20' puts"), Error);
  CHECK_THROWS_WITH_AS((void)generate_baseline_loads(parse_workload("ultraep:9"), b, 8),
                       doctest::Contains("the rank max/mean of 8 ranks"), Error);
  CHECK_THROWS_WITH_AS((void)generate_baseline_loads(parse_workload("grpo"), b, 8),
                       doctest::Contains("grpo is generated by generate_loads"), Error);
}
