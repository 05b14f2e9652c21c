// The deployment search (foremoe/sim/deployment.hpp) and its part of `run_simulate` (tools/run_simulate.hpp).

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "foremoe/config/documents.hpp"
#include "foremoe/config/options.hpp"
#include "foremoe/sim/deployment.hpp"
#include "run_simulate.hpp" // tools/
#include "test_support.hpp"

using namespace foremoe;

namespace {

/// Settings from a JSON document over the defaults (as `--config` reads it).
config::SimulateSettings settings_of(const std::string &text) {
  const json::Value doc = json::parse(text, "test");
  const config::Schema<config::SimulateSettings>::Layer layers[] = {{&doc, "config"}};
  return config::simulate_settings(layers);
}

/// A small GRPO batch on `nodes` x `gpn` GPUs, 16 experts, cache off.
config::SimulateSettings small_settings(std::uint64_t seed, int nodes, int gpn, int slots,
                                        const std::string &extra = "") {
  return settings_of(R"({"model": {"layers": 3, "experts": 16, "topk": 2},
      "topology": {"nodes": )" +
                     std::to_string(nodes) + R"(, "gpus_per_node": )" + std::to_string(gpn) + R"(, "slots": )" +
                     std::to_string(slots) + R"(},
      "batch": {"steps": 2, "prompts": 8, "responses": 4, "prompt_mean": 64, "response_mean": 160,
                "microbatch_tokens": 512, "seed": )" +
                     std::to_string(seed) + R"(, "cache": "off"})" + extra + "}");
}

const json::Value *run_at(const json::Value &best, const std::string &strategy, std::int64_t ep, std::int64_t slots) {
  for (const json::Value &r : best.find("runs")->as_array())
    if (r.find("strategy")->as_string() == strategy && r.find("ep_size")->as_integer() == ep &&
        r.find("slots")->as_integer() == slots)
      return &r;
  return nullptr;
}

/// Each strategy's best in `best` (`best_deployment`) fits and is its fastest fitting run, and `ideal`'s is never
/// slower than any other's.
void check_best_is_fastest(const json::Value &best) {
  double ideal = 0;
  for (const json::Value &b : best.find("strategies")->as_array()) {
    const std::string name = b.find("strategy")->as_string();
    REQUIRE(b.find("fits")->as_bool());
    double fastest = INFINITY;
    for (const json::Value &r : best.find("runs")->as_array())
      if (r.find("strategy")->as_string() == name && r.find("fits")->as_bool())
        fastest = std::min(fastest, r.find("step_seconds")->as_double());
    CHECK(b.find("step_seconds")->as_double() == fastest);
    if (name == "ideal") ideal = fastest;
  }
  for (const json::Value &b : best.find("strategies")->as_array())
    CHECK(ideal <= b.find("step_seconds")->as_double() * (1 + 1e-12));
}

} // namespace

TEST_CASE("deployment space: whole-node EP sizes dividing the cluster, owners + spares, the configured one too") {
  SimConfig cfg;
  cfg.model = ModelSpec{4, 128, 8, 2048, 768, WeightDtype::bf16};
  cfg.topo = Topology{8, 8, 3};
  DeploymentSpace space;
  CHECK(deployment_ep_sizes(cfg, space) == std::vector<int>{8, 16, 32, 64});
  CHECK(deployment_slots(cfg, space, 16) == std::vector<int>{8, 9, 10, 12});
  CHECK(deployment_slots(cfg, space, 64) == std::vector<int>{2, 3, 4, 6}); // the configured 3 is among them
  cfg.ep_size = 4;                                                         // part of a node: searched as well
  cfg.topo.slots_per_gpu = 40;
  CHECK(deployment_ep_sizes(cfg, space) == std::vector<int>{4, 8, 16, 32, 64});
  CHECK(deployment_slots(cfg, space, 4) == std::vector<int>{32, 33, 34, 36, 40});
  space.ep_sizes = {16};
  space.microbatch_tokens = {4096, 1024};
  const std::vector<Deployment> c = deployment_candidates(cfg, space, 8192);
  REQUIRE(c.size() == 2 * (5 + 4));
  CHECK(c.front() == Deployment{4, 32, 1024}); // micro-batches ascending, then EP sizes, then slots
  CHECK(c.back() == Deployment{16, 12, 4096});
  // More GPUs than experts: no EP size above the experts.
  cfg.ep_size = 0;
  cfg.model.num_experts = 16;
  cfg.topo = Topology{4, 8, 1};
  CHECK(deployment_ep_sizes(cfg, {}) == std::vector<int>{8, 16});
}

TEST_CASE("deployment space: bad lists and EP sizes are errors naming the value") {
  CHECK_THROWS_WITH_AS(settings_of(R"({"search": {"ep_sizes": "8,x"}})"), doctest::Contains("'x' in '8,x'"), Error);
  CHECK_THROWS_WITH_AS(settings_of(R"({"search": {"spare_slots": "1,,2"}})"), doctest::Contains("'' in '1,,2'"), Error);
  CHECK_THROWS_WITH_AS(settings_of(R"({"search": {"spare_slots": "-1"}})"), doctest::Contains("outside"), Error);
  CHECK_THROWS_WITH_AS(settings_of(R"({"search": {"microbatches": ""}})"), doctest::Contains("lists no value"), Error);
  CHECK_THROWS_WITH_AS(settings_of(R"({"search": {"microbatches": "99999999999999"}})"), doctest::Contains("outside"),
                       Error);
  SimConfig cfg;
  cfg.topo = Topology{8, 8, 3};
  DeploymentSpace space;
  space.ep_sizes = {24};
  CHECK_THROWS_WITH_AS((void)deployment_ep_sizes(cfg, space), doctest::Contains("EP size 24"), Error);
  space.ep_sizes = {12};
  CHECK_THROWS_WITH_AS((void)deployment_ep_sizes(cfg, space), doctest::Contains("EP size 12"), Error);
  // The settings write what they read.
  const config::SimulateSettings s =
      settings_of(R"({"search": {"ep_sizes": "16,8", "spare_slots": "0,3", "microbatches": "2048"}})");
  const json::Value w = config::simulate_schema().write(s);
  CHECK(w.find("search")->find("ep_sizes")->as_string() == "16,8");
  CHECK(w.find("search")->find("spare_slots")->as_string() == "0,3");
  CHECK(w.find("search")->find("microbatches")->as_string() == "2048");
}

TEST_CASE("deployment search: each best is its strategy's fastest fitting run; the configured deployment's runs "
          "equal the fixed simulation; ideal's best is never slower (property)") {
  for (std::uint64_t seed = 1; seed <= 4; ++seed) {
    CAPTURE(seed);
    // 2 x 4 GPUs, 16 experts: EP 4 (counted from per-source loads: sums of 4-rank sources) and EP 8 (the
    // configured one, from its own batch without sources).
    const config::SimulateSettings s = small_settings(seed, 2, 4, 3);
    const json::Value doc = cli::run_simulate(s, nullptr, {});
    const json::Value &best = *doc.find("best_deployment");
    const std::int64_t ep = doc.find("ep_size")->as_integer(), slots = doc.find("slots")->as_integer();
    REQUIRE(ep == 8);
    for (const json::Value &r : doc.find("strategies")->as_array()) {
      const std::string name = r.find("strategy")->as_string();
      const json::Value *same = run_at(best, name, ep, slots);
      REQUIRE(same != nullptr);
      // Bit for bit: the search simulates the same deployment on the same loads.
      CHECK(same->find("step_seconds")->as_double() == r.find("step_seconds")->as_double());
    }
    check_best_is_fastest(best);
  }
}

TEST_CASE("deployment search: the EP groups' loads summed from finer sources equal each group size's own batch") {
  // 4 x 2 GPUs: the search counts one batch by 2-rank sources for EP 2, 4 and 8; EP 4's runs must equal a fixed
  // simulation at EP 4, whose batch is counted by 4-rank sources.
  config::SimulateSettings s = small_settings(7, 4, 2, 5, R"(, "search": {"spare_slots": "1"})");
  const json::Value doc = cli::run_simulate(s, nullptr, {});
  s.sim.ep_size = 4;
  s.best_deployment = false;
  const json::Value fixed = cli::run_simulate(s, nullptr, {});
  CHECK(fixed.find("best_deployment") == nullptr);
  for (const json::Value &r : fixed.find("strategies")->as_array()) {
    const json::Value *same = run_at(*doc.find("best_deployment"), r.find("strategy")->as_string(), 4, 5);
    REQUIRE(same != nullptr);
    CHECK(same->find("step_seconds")->as_double() == r.find("step_seconds")->as_double());
  }
}

TEST_CASE("deployment search: a deployment over GPU memory is never chosen; none fitting is reported") {
  config::SimulateSettings s = small_settings(3, 2, 4, 3, R"(, "search": {"spare_slots": "0,2,6"})");
  s.strategies = "static,foremoe";
  s.best_deployment = false;
  const json::Value probe = cli::run_simulate(s, nullptr, {});
  // A memory between the smallest and the largest deployment's peak.
  const double peak = probe.find("strategies")->as_array()[1].find("peak_memory")->find("total_gb")->as_double();
  s.best_deployment = true;
  s.sim.gpu_memory_gb = peak * 1.0000001;
  const json::Value doc = cli::run_simulate(s, nullptr, {});
  const json::Value &best = *doc.find("best_deployment");
  int over = 0;
  for (const json::Value &r : best.find("runs")->as_array()) {
    const bool fits = r.find("peak_memory_gb")->as_double() <= s.sim.gpu_memory_gb;
    CHECK(r.find("fits")->as_bool() == fits);
    over += fits ? 0 : 1;
  }
  CHECK(over > 0);
  for (const json::Value &b : best.find("strategies")->as_array())
    if (b.find("fits")->as_bool()) CHECK(b.find("peak_memory_gb")->as_double() <= s.sim.gpu_memory_gb);
  // Nothing fits: the fixed run refuses (an error naming the memory), the search is never reached.
  s.sim.gpu_memory_gb = 1e-3;
  CHECK_THROWS_WITH_AS((void)cli::run_simulate(s, nullptr, {}), doctest::Contains("sim.gpu_memory_gb"), Error);
  // The search alone, given a deployment space none of whose candidates fits: each strategy reports no deployment.
  std::vector<std::int64_t> steps;
  const LoadTensor loads = generate_loads(cli::simulate_batch(s).config, &steps);
  const std::vector<SimStrategy> strategies = s.strategy_list();
  const std::vector<Deployment> candidates = deployment_candidates(s.sim, s.search, 0);
  const DeploymentSearch none =
      search_deployments(s.sim, strategies, candidates,
                         std::vector<DeploymentLoads>(candidates.size(), DeploymentLoads{&loads, steps}), 1);
  CHECK(std::all_of(none.best.begin(), none.best.end(), [](int b) { return b < 0; }));
  const std::string table = config::best_deployment_table(config::best_deployment_json(s, none));
  CHECK(table.find("no deployment of the space fits") != std::string::npos);
}

TEST_CASE("deployment space: pipeline stages and tensor-parallel sizes are optional dimensions, off by default") {
  SimConfig cfg;
  cfg.model = ModelSpec{4, 128, 8, 2048, 768, WeightDtype::bf16};
  cfg.topo = Topology{8, 8, 3};
  DeploymentSpace space;
  const std::vector<Deployment> plain = deployment_candidates(cfg, space, 8192);
  for (const Deployment &d : plain)
    CHECK((d.pipeline_stages == 1 && d.tensor_parallel == 1));
  space.pipeline_stages = {1, 4};
  space.tensor_parallel = {1, 4};
  const std::vector<Deployment> c = deployment_candidates(cfg, space, 8192);
  std::size_t unchanged = 0;
  for (const Deployment &d : c) {
    CAPTURE(d.ep_size);
    CAPTURE(d.pipeline_stages);
    unchanged += d.pipeline_stages == 1 && d.tensor_parallel == 1;
    if (d.pipeline_stages == 4) CHECK((d.ep_size == 8 || d.ep_size == 16)); // EP groups of a 16-GPU stage
    CHECK_NOTHROW(deployed(cfg, d).validate());
  }
  CHECK(unchanged == plain.size());
  space.pipeline_stages = {1, 5};
  CHECK_THROWS_WITH_AS((void)deployment_candidates(cfg, space, 8192),
                       doctest::Contains("5 pipeline stages do not divide 64 GPUs"), Error);
  space.pipeline_stages = {};
  space.tensor_parallel = {3};
  CHECK_THROWS_WITH_AS((void)deployment_candidates(cfg, space, 8192),
                       doctest::Contains("tensor-parallel size 3 does not divide the 8 GPUs"), Error);
}

TEST_CASE("deployment search: with pipeline and tensor parallelism searched, each best is still its strategy's "
          "fastest run and ideal's best is never slower") {
  const config::SimulateSettings s = small_settings(3, 2, 4, 3,
                                                    R"(, "search": {"pipeline_stages": "1,2", "tensor_parallel": "1,2",
                                                       "ep_sizes": "4"})");
  const json::Value doc = cli::run_simulate(s, nullptr, {});
  const json::Value &best = *doc.find("best_deployment");
  bool piped = false, split = false;
  for (const json::Value &r : best.find("runs")->as_array()) {
    piped = piped || r.find("pipeline_stages")->as_integer() == 2;
    split = split || r.find("tensor_parallel")->as_integer() == 2;
  }
  CHECK(piped);
  CHECK(split);
  check_best_is_fastest(best);
}

TEST_CASE("deployment search: the dense parameters count against GPU memory, so TP can be what makes a deployment "
          "fit") {
  // A vocabulary large enough that the embedding and LM head dominate a GPU's memory.
  config::SimulateSettings s =
      small_settings(5, 2, 4, 4, R"(, "search": {"tensor_parallel": "1,2", "ep_sizes": "4", "spare_slots": "0"})");
  s.sim.dense.vocab = 4e6;
  s.sim.dense.params = 1e6;
  s.strategies = "static,foremoe";
  const double H = s.sim.model.hidden;
  const double params = 3 * 1e6 + 2 * 4e6 * H; // every layer, the embedding and the head (no pipeline)
  // Weights bf16, fp32 gradients, Adam's 12 bytes over the dense part's data-parallel ranks (8 GPUs / TP).
  auto dense_gb = [&](double tp) { return params / tp * (2 + 4 + 12 / (8 / tp)) * 1e-9; };
  s.best_deployment = false;
  s.sim.ep_size = 4;
  s.sim.tensor_parallel = 1;
  const json::Value one = cli::run_simulate(s, nullptr, {});
  s.sim.tensor_parallel = 2;
  const json::Value two = cli::run_simulate(s, nullptr, {});
  const json::Value &m1 = *one.find("strategies")->as_array()[0].find("peak_memory");
  const json::Value &m2 = *two.find("strategies")->as_array()[0].find("peak_memory");
  // static holds the same experts either way; the dense part is a TP-th (the activations follow the batch, whose
  // data-parallel ranks are G / TP).
  auto dense_of = [](const json::Value &m) {
    return m.find("dense_weights_gb")->as_double() + m.find("dense_grads_gb")->as_double() +
           m.find("dense_optimizer_gb")->as_double();
  };
  CHECK(dense_of(m1) == doctest::Approx(dense_gb(1)));
  CHECK(dense_of(m2) == doctest::Approx(dense_gb(2)));
  for (const char *k : {"weights_gb", "grads_gb", "optimizer_gb"})
    CHECK(m1.find(k)->as_double() == m2.find(k)->as_double());
  CHECK(m1.find("dense_weights_gb")->as_double() == doctest::Approx(params * 2e-9));
  CHECK(m2.find("dense_optimizer_gb")->as_double() == doctest::Approx(params / 2 * 12 / 4 * 1e-9));
  // A GPU between the two: every TP 1 run is refused, and each best is at TP 2 (the configured deployment, which
  // must fit, is TP 2).
  s.best_deployment = true;
  s.sim.gpu_memory_gb = m1.find("total_gb")->as_double() - 0.5 * (dense_gb(1) - dense_gb(2));
  const json::Value doc = cli::run_simulate(s, nullptr, {});
  const json::Value &best = *doc.find("best_deployment");
  int refused = 0;
  for (const json::Value &r : best.find("runs")->as_array()) {
    CAPTURE(r.find("strategy")->as_string());
    const bool tp1 = r.find("tensor_parallel")->as_integer() == 1;
    CHECK(r.find("fits")->as_bool() == !tp1);
    CHECK((r.find("peak_memory_gb")->as_double() > s.sim.gpu_memory_gb) == tp1);
    refused += tp1 ? 1 : 0;
  }
  CHECK(refused == 2);
  for (const json::Value &b : best.find("strategies")->as_array()) {
    REQUIRE(b.find("fits")->as_bool());
    CHECK(b.find("tensor_parallel")->as_integer() == 2);
  }
}
