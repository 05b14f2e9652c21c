#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "foremoe/config/documents.hpp"
#include "foremoe/plan/token_map.hpp"
#include "foremoe/sim/simulator.hpp"
#include "foremoe/trace/synthetic.hpp"
#include "foremoe/transfer/transfer_plan.hpp"
#include "test_support.hpp"

using namespace foremoe;

namespace {

struct Case {
  SimConfig cfg;
  LoadTensor loads;
  std::vector<std::int64_t> steps;
  SyntheticConfig batch; ///< what generated the loads
};

Case small_case(std::uint64_t seed, int num_steps = 2) {
  Case c;
  c.cfg.model = ModelSpec{4, 16, 2, 256, 128, WeightDtype::bf16};
  c.cfg.topo = Topology{2, 2, 5}; // 4 owners + 1 spare per GPU
  SyntheticConfig b;
  b.seed = seed;
  b.num_layers = 4;
  b.num_experts = 16;
  b.topk = 2;
  b.num_steps = num_steps;
  b.prompts_per_step = 8;
  b.responses_per_prompt = 4;
  b.prompt_length = {64, 0.5, 8, 512};
  b.response_length = {128, 0.5, 8, 512};
  b.num_gpus = 4;
  b.microbatch_tokens_per_gpu = 512;
  c.loads = generate_loads(b, &c.steps);
  c.batch = b;
  return c;
}

/// Every registered strategy, then "ideal".
std::vector<SimStrategy> all_strategies() {
  std::vector<SimStrategy> s;
  for (const StrategyInfo *info : strategies())
    s.push_back(parse_sim_strategy(info->name));
  s.push_back(parse_sim_strategy("ideal"));
  return s;
}

/// The result of strategy `name` (fails the test when it is missing).
const SimResult &result_of(const std::vector<SimResult> &res, std::string_view name) {
  const auto it = std::find_if(res.begin(), res.end(), [&](const SimResult &r) { return r.strategy == name; });
  REQUIRE_MESSAGE(it != res.end(), "no result for strategy ", name);
  return *it;
}

/// Two RL steps of `M` micro-steps (2 layers x 16 experts, 2 x 2 GPUs x 6 slots), skewed so that every expert is
/// loaded well past its copy count in every micro-step; one warm-up step, from whose totals eplb plans the other.
struct EplbCase {
  static constexpr int M = 4, L = 2, E = 16;
  SimConfig cfg;
  LoadTensor loads{2 * M, L, E};
  std::vector<std::int64_t> steps{0, M, 2 * M};

  explicit EplbCase(std::uint64_t seed) {
    cfg.model = ModelSpec{2, 16, 2, 256, 128, WeightDtype::bf16};
    cfg.topo = Topology{2, 2, 6}; // 4 owners + 2 spare slots per GPU
    cfg.warmup_steps = 1;         // eplb plans the counted step from the warm-up step's loads
    std::mt19937_64 rng(seed);
    for (int m = 0; m < 2 * M; ++m)
      for (int l = 0; l < L; ++l)
        for (int e = 0; e < E; ++e)
          loads.at(m, l, e) = (e < 3 ? 20000 : 600) + std::uniform_int_distribution<int>(0, 400)(rng);
  }
  /// EPLB's plans of the counted step, from the warm-up step's totals.
  [[nodiscard]] StepPlan eplb_plans() const {
    LoadTensor warm(M, L, E), counted(M, L, E);
    std::copy_n(loads.totals().begin(), warm.totals().size(), warm.totals().begin());
    std::copy_n(loads.totals().begin() + static_cast<std::ptrdiff_t>(warm.totals().size()), counted.totals().size(),
                counted.totals().begin());
    PlannerOptions opts;
    opts.strategy = "eplb";
    Planner planner(L, E, cfg.topo, opts);
    return planner.plan_step(counted, nullptr, planner.sum_steps(warm));
  }
};

} // namespace

TEST_CASE("simulate: physical limits and accounting hold on random traces (property)") {
  const int rounds = 6 * foremoe_test::seed_multiplier();
  for (int r = 0; r < rounds; ++r) {
    Case c = small_case(100 + r);
    const auto strategies = all_strategies();
    const auto res = simulate(c.cfg, c.loads, c.steps, strategies);
    REQUIRE(res.size() == strategies.size());
    const SimResult &stat = result_of(res, "static"), &ideal = result_of(res, "ideal");
    CHECK(stat.moved_gb == 0.0);
    CHECK(stat.stall_seconds == 0.0);
    // Whole tokens: ideal's pieces differ by one token at most, so its max/mean is ceil(T / G) G / T <= 1 + G / T.
    std::int64_t min_total = std::numeric_limits<std::int64_t>::max();
    for (int m = 0; m < c.loads.num_micro_steps(); ++m)
      for (int l = 0; l < c.loads.num_layers(); ++l)
        min_total = std::min(min_total, c.loads.layer_total(m, l));
    CHECK(ideal.imbalance_median >= 1.0);
    CHECK(ideal.imbalance_p99 <= 1.0 + double(c.cfg.topo.num_gpus()) / double(min_total));
    for (const std::vector<double> &row : ideal.gpu_loads) // its plans' pieces: whole tokens, one apart at most
      CHECK(*std::max_element(row.begin(), row.end()) - *std::min_element(row.begin(), row.end()) <= 1.0);
    // Its transfers are free, and its memory holds ceil(E / G) owners per GPU, no replica.
    CHECK(ideal.moved_gb == 0.0);
    CHECK(ideal.grad_gb == 0.0);
    CHECK(ideal.stall_seconds == 0.0);
    CHECK(ideal.memory.weights == double(c.cfg.topo.owners_per_gpu(c.cfg.model.num_experts)) * c.cfg.model.num_layers *
                                      double(c.cfg.model.bytes_per_expert()));
    for (const SimResult &x : res) {
      CHECK(x.step_seconds > 0);
      CHECK(x.step_seconds == doctest::Approx(x.recompute_seconds + x.update_seconds));
      CHECK(x.imbalance_median >= 1.0);
      CHECK(x.imbalance_p99 >= x.imbalance_median);
      CHECK(x.stall_seconds >= 0);
      // recompute + update of the counted steps (the first one is warm-up)
      CHECK(x.layer_seconds.size() == std::size_t(2 * (c.loads.num_micro_steps() - c.steps[1])));
      // Nothing beats perfect balance with free moves.
      CHECK(x.step_seconds >= ideal.step_seconds);
      // The breakdown accounts for the whole step, per step and per micro-step.
      CHECK(x.breakdown.total() == doctest::Approx(x.step_seconds));
      CHECK(x.breakdown.stall == doctest::Approx(x.stall_seconds));
      REQUIRE(x.step_breakdown.size() == c.steps.size() - 2);
      REQUIRE(x.micro_breakdown.size() == x.layer_seconds.size());
      for (std::size_t m = 0; m < x.layer_seconds.size(); ++m) {
        double layers = 0;
        for (double v : x.layer_seconds[m])
          layers += v;
        CHECK(x.micro_breakdown[m].total() ==
              doctest::Approx(layers + x.micro_breakdown[m].stall + x.micro_breakdown[m].lm_head));
        CHECK(x.micro_breakdown[m].expert_compute > 0);
      }
    }
    // Per-micro-step planning balances at least as well as the static layout.
    CHECK(result_of(res, "foremoe").imbalance_median <= stat.imbalance_median + 1e-12);
    CHECK(result_of(res, "foremoe-free").imbalance_median <= stat.imbalance_median + 1e-12);
    CHECK(result_of(res, "ultraep").imbalance_median <= stat.imbalance_median + 1e-12);
    CHECK(result_of(res, "moonep").imbalance_median <= stat.imbalance_median + 1e-12);
  }
}

TEST_CASE("simulate: slow move paths show up as stall, double buffering hides some of it") {
  Case c = small_case(7);
  c.cfg.model.hidden = 7168;
  c.cfg.model.expert_ffn = 4096;
  for (auto *p : {&c.cfg.cost.move.gpu_intra, &c.cfg.cost.move.gpu_inter, &c.cfg.cost.move.host})
    p->gb_per_s = 0.5;
  const std::vector<SimStrategy> fm{parse_sim_strategy("foremoe")};
  const auto slow = simulate(c.cfg, c.loads, c.steps, fm);
  CHECK(slow[0].stall_seconds > 0);
  c.cfg.double_buffer = true;
  const auto db = simulate(c.cfg, c.loads, c.steps, fm);
  CHECK(db[0].stall_seconds <= slow[0].stall_seconds);
  CHECK(db[0].moved_gb == doctest::Approx(slow[0].moved_gb));
}

TEST_CASE("simulate: re-owning costs time unless it is free") {
  Case c = small_case(9);
  const std::vector<SimStrategy> fm{parse_sim_strategy("foremoe")};
  const auto free_owners = simulate(c.cfg, c.loads, c.steps, fm);
  c.cfg.planner.reowning_free = false;
  const auto paid = simulate(c.cfg, c.loads, c.steps, fm);
  // Re-owning is charged as move time. The step time is not compared: when re-owning is paid the planner keeps
  // owners where it can, which changes the plans, and kept owners keep more replicas resident (fewer gradient
  // returns), so the step may end faster or slower (seed 9: 9.108 against 9.116 ms).
  CHECK(paid[0].breakdown.moves > free_owners[0].breakdown.moves);
  CHECK(paid[0].moved_gb >= free_owners[0].moved_gb);
}

TEST_CASE("simulate: every planner option reaches the planner (SimConfig::planner)") {
  // Options the simulator never copied before it held the planner's options whole: each must change what the
  // planner does. UltraEP with a replica floor above any micro-step's load makes no replicas, so it moves nothing;
  // with no floor it replicates (the small case's loads are below its published floor of 1,024 tokens).
  for (std::uint64_t seed : {13u, 14u, 15u}) {
    Case c = small_case(seed);
    const std::vector<SimStrategy> ue{parse_sim_strategy("ultraep")};
    c.cfg.planner.ultraep_min_tokens = 0;
    const auto floor_low = simulate(c.cfg, c.loads, c.steps, ue);
    c.cfg.planner.ultraep_min_tokens = std::int64_t{1} << 40;
    const auto floor_high = simulate(c.cfg, c.loads, c.steps, ue);
    CHECK(floor_low[0].moved_gb > 0);
    CHECK(floor_high[0].moved_gb == 0);
    CHECK(floor_high[0].imbalance_median >= floor_low[0].imbalance_median - 1e-12);
  }
}

TEST_CASE("breakdown: one table of the parts; sums, the JSON and the CSV follow it") {
  // A field added to SimBreakdown but not to the table would be left out of every sum and writer.
  static_assert(sizeof(SimBreakdown) == breakdown_parts.size() * sizeof(double));
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> u(0, 10);
  for (int trial = 0; trial < 50; ++trial) {
    SimBreakdown a, b;
    double sum_a = 0, sum_b = 0;
    for (const BreakdownPart &p : breakdown_parts) {
      sum_a += (a.*p.field = u(rng));
      sum_b += (b.*p.field = u(rng));
    }
    CHECK(a.total() == doctest::Approx(sum_a));
    const json::Value j = config::breakdown_json(a);
    for (const BreakdownPart &p : breakdown_parts)
      CHECK(j.find(std::string(p.name) + "_seconds")->as_double() == a.*p.field);
    CHECK(j.find("total_seconds")->as_double() == a.total());
    a += b;
    CHECK(a.total() == doctest::Approx(sum_a + sum_b));
  }
  std::set<std::string_view> names;
  for (const BreakdownPart &p : breakdown_parts) {
    CHECK(names.insert(p.name).second);
    CHECK_FALSE(p.label.empty());
  }
}

TEST_CASE("simulate: deterministic and independent of planner threads") {
  Case c = small_case(11);
  const auto strategies = all_strategies();
  const auto a = simulate(c.cfg, c.loads, c.steps, strategies);
  c.cfg.planner.num_threads = 3;
  const auto b = simulate(c.cfg, c.loads, c.steps, strategies);
  for (std::size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].step_seconds == b[i].step_seconds);
    CHECK(a[i].moved_gb == b[i].moved_gb);
    CHECK(a[i].layer_seconds == b[i].layer_seconds);
  }
}

TEST_CASE("simulate: bad input is an error naming the value") {
  Case c = small_case(3);
  const std::vector<SimStrategy> st{parse_sim_strategy("static")};
  SimConfig bad = c.cfg;
  bad.topo.slots_per_gpu = 3;
  CHECK_THROWS_WITH_AS((void)simulate(bad, c.loads, c.steps, st), doctest::Contains("cannot hold all 16 experts"),
                       Error);
  bad = c.cfg;
  bad.model.num_layers = 5;
  CHECK_THROWS_WITH_AS((void)simulate(bad, c.loads, c.steps, st), doctest::Contains("the model has 5 x 16"), Error);
  std::vector<std::int64_t> steps{0, 1};
  CHECK_THROWS_WITH_AS((void)simulate(c.cfg, c.loads, steps, st), doctest::Contains("must run from 0 to"), Error);
  bad = c.cfg;
  bad.cost.move.host.gb_per_s = -1;
  CHECK_THROWS_WITH_AS((void)simulate(bad, c.loads, c.steps, st), doctest::Contains("move.host.gb_per_s"), Error);
  CHECK_THROWS_WITH_AS((void)parse_sim_strategy("fastest"), doctest::Contains("unknown strategy 'fastest'"), Error);
  CHECK_THROWS_WITH_AS((void)parse_sim_strategy("fastest"), doctest::Contains(sim_strategy_names().c_str()), Error);
}

TEST_CASE("simulate: strategies are the registered ones, the simulator-only ideal last") {
  CHECK(sim_strategy_names() == strategy_names() + ", ideal");
  CHECK(sim_strategy_names(",").rfind("static,eplb,eplb-split,eplb-oracle,ultraep,moonep,foremoe,foremoe-free,", 0) ==
        0);
  CHECK(parse_sim_strategy("eplb_oracle").name == "eplb-oracle");
  CHECK(parse_sim_strategy("ideal").name == "ideal");
  CHECK_THROWS_WITH_AS((void)parse_sim_strategy("idea"), doctest::Contains("unknown strategy 'idea'"), Error);
  // Planned like the others: its plans hold its pieces, moves listed, and only its transfers are free.
  PlannerOptions opts;
  opts.strategy = "ideal";
  const Planner ideal(2, 16, Topology{1, 4, 4}, opts);
  CHECK(ideal.physical_limit());
  CHECK(ideal.topology().slots_per_gpu == 16); // one slot per expert: the lower bound ignores the slot limit
  for (const StrategyInfo *info : strategies()) {
    opts.strategy = info->name;
    const Planner p(2, 16, Topology{1, 4, 4}, opts);
    CHECK(!p.physical_limit());
    CHECK(p.topology().slots_per_gpu == 4);
  }
}

TEST_CASE("simulate: a hand-computed tiny case (2 GPUs, 2 experts, one layer, static)") {
  for (const A2aModel model : {A2aModel::flat, A2aModel::hierarchical}) {
    CAPTURE(to_string(model));
    SimConfig cfg;
    cfg.cost.a2a.model = model;
    cfg.model = ModelSpec{1, 2, 1, 1024, 512, WeightDtype::bf16};
    cfg.topo = Topology{1, 2, 1};
    cfg.recompute_passes = 1;
    cfg.warmup_steps = 0;         // one step, counted
    cfg.dense_from_shape = false; // the constant per-token dense time (the shape's is checked below)
    // Two micro-steps: expert loads (300, 100) then (50, 150); top-1, so tokens = assignments.
    LoadTensor loads(2, 1, 2);
    loads.at(0, 0, 0) = 300;
    loads.at(0, 0, 1) = 100;
    loads.at(1, 0, 0) = 50;
    loads.at(1, 0, 1) = 150;
    const std::vector<SimStrategy> st{parse_sim_strategy("static")};
    const auto r = simulate(cfg, loads, {}, st);
    const CostParams &c = cfg.cost;
    const ExpertComputeModel ec(c, ExpertShape::from(cfg.model));
    const double row = 1024.0 * 2;
    // Uniform sources: GPU g receives half of its load from the other GPU and sends half of the other's. Top-1
    // on one node: the hierarchical model moves the same rows (tokens q_g (P - 1) / P = load_g / 2), plus the
    // cost of its one peer message.
    auto a2a = [&](double g0, double g1) {
      const double bytes = std::max(g0, g1) / 2 * row;
      return c.a2a.intra_latency_us * 1e-6 + (model == A2aModel::hierarchical ? c.a2a.per_message_us * 1e-6 : 0.0) +
             bytes / (c.a2a.intra_gb_per_s * 1e9);
    };
    auto attn = [&](double tokens) { return c.dense.launch_us * 1e-6 + c.dense.per_token_us * 1e-6 * tokens / 2; };
    auto fwd = [&](double g0, double g1, double tokens) {
      return attn(tokens) + 2 * a2a(g0, g1) + std::max(ec.forward_seconds(g0, 1), ec.forward_seconds(g1, 1));
    };
    auto bwd = [&](double g0, double g1, double tokens) {
      return c.backward_factor * attn(tokens) + 2 * a2a(g0, g1) +
             std::max(ec.backward_seconds(g0, 1), ec.backward_seconds(g1, 1));
    };
    // The LM head: V x H weights streamed once, 2 V H FLOPs per token at the dense efficiency, per GPU's tokens.
    const double vh = 151936.0 * 1024;
    const double hbm = c.gemm.hbm_tb_per_s * 1e12 * c.gemm.hbm_efficiency;
    auto head = [&](double tokens) {
      return vh * 2 / hbm + tokens / 2 * 2 * vh / (c.gemm.peak_tflops_bf16 * 1e12 * 0.40);
    };
    // The optimizer: 30 bytes per parameter of the GPU (its one expert, the layer's dense part, embedding and head).
    const double params = 3.0 * 1024 * 512 + 19136512 + 2 * vh;
    const double recompute = fwd(300, 100, 400) + fwd(50, 150, 200) + head(400) + head(200);
    const double update = recompute + bwd(300, 100, 400) + bwd(50, 150, 200) +
                          c.backward_factor * (head(400) + head(200)) + params * 30 / hbm;
    CHECK(r[0].recompute_seconds == doctest::Approx(recompute).epsilon(1e-12));
    CHECK(r[0].update_seconds == doctest::Approx(update).epsilon(1e-12));
    CHECK(r[0].imbalance_median == doctest::Approx(1.5)); // (300, 100): 300 / 200 and (50, 150): 150 / 100
  }
}

TEST_CASE("simulate: more bandwidth is never slower (property)") {
  const int rounds = 3 * foremoe_test::seed_multiplier();
  for (int r = 0; r < rounds; ++r) {
    Case c = small_case(200 + r);
    c.cfg.model.hidden = 4096;
    c.cfg.model.expert_ffn = 2048;
    const auto strategies = all_strategies();
    const auto slow = simulate(c.cfg, c.loads, c.steps, strategies);
    SimConfig fast = c.cfg;
    for (auto *p : {&fast.cost.move.gpu_intra, &fast.cost.move.gpu_inter, &fast.cost.move.host})
      p->gb_per_s *= 2;
    fast.cost.a2a.intra_gb_per_s *= 2;
    fast.cost.a2a.inter_gb_per_s *= 2;
    const auto quick = simulate(fast, c.loads, c.steps, strategies);
    for (std::size_t i = 0; i < slow.size(); ++i) {
      CHECK(quick[i].step_seconds <= slow[i].step_seconds);
      CHECK(quick[i].stall_seconds <= slow[i].stall_seconds);
    }
  }
}

TEST_CASE("simulate: warm-up steps are simulated as before and only dropped from the figures (property)") {
  const int rounds = 2 * foremoe_test::seed_multiplier();
  for (int r = 0; r < rounds; ++r) {
    Case c = small_case(300 + r, 4);
    const auto strategies = all_strategies();
    c.cfg.warmup_steps = 0;
    const auto all = simulate(c.cfg, c.loads, c.steps, strategies);
    for (int warm : {1, 2}) {
      c.cfg.warmup_steps = warm;
      const auto res = simulate(c.cfg, c.loads, c.steps, strategies);
      for (std::size_t i = 0; i < res.size(); ++i) {
        CAPTURE(res[i].strategy);
        CAPTURE(warm);
        REQUIRE(res[i].step_breakdown.size() == std::size_t(4 - warm));
        double sum = 0;
        for (int s = warm; s < 4; ++s) {
          CHECK(res[i].step_breakdown[s - warm].total() == doctest::Approx(all[i].step_breakdown[s].total()));
          sum += all[i].step_breakdown[s].total();
        }
        CHECK(res[i].step_seconds == doctest::Approx(sum / (4 - warm)));
        const auto counted_micro = static_cast<std::size_t>(2 * (c.steps[4] - c.steps[warm]));
        CHECK(res[i].layer_seconds.size() == counted_micro);
      }
    }
  }
  Case c = small_case(5);
  c.cfg.warmup_steps = 2;
  const std::vector<SimStrategy> st{parse_sim_strategy("static")};
  CHECK_THROWS_WITH_AS((void)simulate(c.cfg, c.loads, c.steps, st),
                       "simulate: 2 RL steps leave no counted step after 2 warm-up steps (sim.warmup_steps): give at "
                       "least 3 steps or fewer warm-up steps",
                       Error);
  c.cfg.warmup_steps = -1;
  CHECK_THROWS_WITH_AS((void)simulate(c.cfg, c.loads, c.steps, st),
                       doctest::Contains("warmup_steps must be >= 0, got -1"), Error);
}

TEST_CASE("simulate: eplb rebalances every eplb_interval steps, static until its first rebalance") {
  Case c = small_case(21, 4);
  c.cfg.warmup_steps = 0;
  const std::vector<SimStrategy> st{parse_sim_strategy("static"), parse_sim_strategy("eplb")};
  const auto every = simulate(c.cfg, c.loads, c.steps, st);
  c.cfg.planner.eplb_interval = 2;
  const auto two = simulate(c.cfg, c.loads, c.steps, st);
  c.cfg.planner.eplb_interval = 4; // never within 4 steps
  const auto never = simulate(c.cfg, c.loads, c.steps, st);
  auto step = [](const std::vector<SimResult> &r, int who, int s) { return r[who].step_breakdown[s].total(); };
  for (int s = 0; s < 4; ++s)
    CHECK(step(never, 1, s) == doctest::Approx(step(never, 0, s)).epsilon(1e-12)); // eplb == static
  // Interval 2: static for steps 0 and 1, then tables from steps 0 + 1; interval 1 rebalances from step 1 on.
  CHECK(step(two, 1, 0) == doctest::Approx(step(two, 0, 0)).epsilon(1e-12));
  CHECK(step(two, 1, 1) == doctest::Approx(step(two, 0, 1)).epsilon(1e-12));
  // A rebalance changes the placement (tiny GPUs: not necessarily for the better, moves are not free).
  CHECK(step(two, 1, 2) != doctest::Approx(step(two, 0, 2)).epsilon(1e-9));
  CHECK(step(every, 1, 1) != doctest::Approx(step(every, 0, 1)).epsilon(1e-9));
  // Steps 2 and 3 of interval 2 share one table from steps 0 + 1; interval 1 re-plans step 3 from step 2.
  CHECK(two[1].step_breakdown[3].total() != doctest::Approx(every[1].step_breakdown[3].total()).epsilon(1e-9));
  CHECK(step(every, 1, 0) == doctest::Approx(step(every, 0, 0)).epsilon(1e-12));
  c.cfg.planner.eplb_interval = 0;
  CHECK_THROWS_WITH_AS((void)simulate(c.cfg, c.loads, c.steps, st),
                       doctest::Contains("eplb_interval must be >= 1, got 0"), Error);
}

namespace {

/// 128 experts on `nodes` x 8 GPUs x 3 slots, 2 layers, a small batch whose loads are counted per EP group of
/// `ep` ranks (sources).
Case grouped_case(std::uint64_t seed, int nodes, int ep) {
  Case c;
  c.cfg.model = ModelSpec{2, 128, 8, 256, 128, WeightDtype::bf16};
  c.cfg.topo = Topology{nodes, 8, 3};
  SyntheticConfig b;
  b.seed = seed;
  b.num_layers = 2;
  b.num_experts = 128;
  b.topk = 8;
  b.num_steps = 2;
  b.prompts_per_step = 16;
  b.responses_per_prompt = 4;
  b.prompt_length = {64, 0.5, 8, 512};
  b.response_length = {128, 0.5, 8, 512};
  b.num_gpus = c.cfg.topo.num_gpus();
  b.microbatch_tokens_per_gpu = 64;
  GeneratorOptions gen;
  gen.ranks_per_source = ep;
  c.loads = generate_loads(b, &c.steps, true, gen);
  return c;
}

} // namespace

TEST_CASE("simulate: beyond the experts' count the cluster is data-parallel EP groups; no GPU is left empty") {
  // 256 GPUs, 128 experts: two EP groups of 128 GPUs (default_ep_size), one expert per GPU under static.
  Case c = grouped_case(31, 32, 64); // 4 sources of 64 ranks: sources 0-1 are group 0's tokens, 2-3 group 1's
  CHECK(c.cfg.effective_ep_size() == 128);
  const auto strategies = all_strategies();
  const auto res = simulate(c.cfg, c.loads, c.steps, strategies);
  for (const SimResult &r : res) {
    CAPTURE(r.strategy);
    CHECK(r.min_experts_per_gpu >= 1);
  }
  CHECK(result_of(res, "static").min_experts_per_gpu == 1);
  // Each group is balanced alone on its own tokens: the grouped run's step is its slowest group's, each group
  // simulated as a cluster of its own (one counted step).
  std::vector<double> alone;
  for (int g = 0; g < 2; ++g) {
    SimConfig one = c.cfg;
    one.topo = Topology{16, 8, 3};
    LoadTensor mine(c.loads.num_micro_steps(), 2, 128);
    for (int m = 0; m < mine.num_micro_steps(); ++m)
      for (int l = 0; l < 2; ++l)
        for (int e = 0; e < 128; ++e)
          mine.at(m, l, e) = c.loads.at(m, l, e, 2 * g) + c.loads.at(m, l, e, 2 * g + 1);
    alone.push_back(simulate(one, mine, c.steps, strategies).back().step_seconds); // ideal
    const auto st = simulate(one, mine, c.steps, std::vector<SimStrategy>{parse_sim_strategy("static")});
    alone.push_back(st[0].step_seconds);
  }
  // ... plus the all-reduce of the expert gradients across the two copies (alone, a group has none): a ring over
  // the NIC, 2 (n - 1) / n of each GPU's owned gradients (one fp32 expert per layer) and 2 (n - 1) latencies per
  // layer's bucket, none of it under the backward by default.
  const PathParams &nic = c.cfg.cost.move.gpu_inter;
  const double sync = 2 * (2 * nic.latency_us * 1e-6 + 2.0 * 1 / 2 * (3.0 * 256 * 128 * 4) / (nic.gb_per_s * 1e9));
  for (const SimResult &r : res) {
    CAPTURE(r.strategy);
    CHECK(r.breakdown.dp_grad_sync == doctest::Approx(sync).epsilon(1e-12));
  }
  CHECK(result_of(res, "ideal").step_seconds == doctest::Approx(std::max(alone[0], alone[2]) + sync).epsilon(1e-12));
  CHECK(result_of(res, "static").step_seconds == doctest::Approx(std::max(alone[1], alone[3]) + sync).epsilon(1e-12));
  // An explicit group size: 4 groups of 64, one source each.
  SimConfig four = c.cfg;
  four.ep_size = 64;
  const auto r4 = simulate(four, c.loads, c.steps, std::vector<SimStrategy>{parse_sim_strategy("static")});
  CHECK(r4[0].min_experts_per_gpu == 2);
  // Bad group sizes name the values.
  SimConfig bad = c.cfg;
  bad.ep_size = 256;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("an EP group of 256 GPUs for 128 experts would leave GPUs"),
                       Error);
  bad.ep_size = 96;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("EP group size 96 does not divide 256 GPUs"), Error);
  bad.ep_size = 12;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("EP group size 12 does not divide 256 GPUs"), Error);
}

TEST_CASE("split_loads_by_group: sources go to their group; without sources every count splits evenly (property)") {
  std::mt19937_64 rng(77);
  for (int round = 0; round < 20 * foremoe_test::seed_multiplier(); ++round) {
    const int groups = 1 + static_cast<int>(rng() % 5);
    LoadTensor t(3, 2, 7);
    for (auto &v : t.totals())
      v = static_cast<std::int64_t>(rng() % 50);
    const auto parts = detail::split_loads_by_group(t, groups);
    REQUIRE(parts.size() == std::size_t(groups));
    for (int m = 0; m < 3; ++m)
      for (int l = 0; l < 2; ++l)
        for (int e = 0; e < 7; ++e) {
          std::int64_t sum = 0, lo = t.at(m, l, e), hi = 0;
          for (const auto &p : parts) {
            sum += p.at(m, l, e);
            lo = std::min(lo, p.at(m, l, e));
            hi = std::max(hi, p.at(m, l, e));
          }
          CHECK(sum == t.at(m, l, e));
          CHECK(hi - lo <= 1);
        }
  }
  LoadTensor src(1, 1, 2, 4); // 4 sources over 2 groups: sources 0-1 and 2-3
  for (int k = 0; k < 4; ++k) {
    src.at(0, 0, 0, k) = k + 1;
    src.at(0, 0, 1, k) = 10 * (k + 1);
  }
  src.at(0, 0, 0) = 10;
  src.at(0, 0, 1) = 100;
  const auto two = detail::split_loads_by_group(src, 2);
  CHECK(two[0].at(0, 0, 0) == 3);
  CHECK(two[1].at(0, 0, 0) == 7);
  CHECK(two[0].at(0, 0, 1) == 30);
  CHECK(two[1].at(0, 0, 1) == 70);
  CHECK_THROWS_WITH_AS((void)detail::split_loads_by_group(src, 3),
                       doctest::Contains("loads carry 4 sources, which do not split over 3 EP groups"), Error);
}

TEST_CASE("simulate: gradient dtype scales the gradient volume; the last micro-step's gradients are charged") {
  for (std::uint64_t seed : {3u, 17u, 91u}) {
    Case c = small_case(seed, 3);
    const std::vector<SimStrategy> st = {parse_sim_strategy("static"), parse_sim_strategy("foremoe")};
    c.cfg.grad_dtype = WeightDtype::bf16;
    const auto bf = simulate(c.cfg, c.loads, c.steps, st);
    c.cfg.grad_dtype = WeightDtype::fp32;
    const auto fp = simulate(c.cfg, c.loads, c.steps, st);
    // bf16 weights: fp32 gradients are twice the bytes; plans do not depend on it (no cost gate).
    CHECK(result_of(fp, "foremoe").grad_gb == doctest::Approx(2 * result_of(bf, "foremoe").grad_gb));
    CHECK(result_of(fp, "foremoe").grad_gb > 0);
    CHECK(result_of(fp, "foremoe").stall_seconds >= result_of(bf, "foremoe").stall_seconds);
    CHECK(result_of(fp, "foremoe").grad_tail_seconds >= result_of(bf, "foremoe").grad_tail_seconds);
    // static holds no replicas: nothing to return.
    CHECK(result_of(fp, "static").grad_gb == 0);
    CHECK(result_of(fp, "static").grad_tail_seconds == 0);
    // The tail is part of the stall, which is part of the step.
    for (const SimResult &r : fp) {
      CHECK(r.grad_tail_seconds >= 0);
      CHECK(r.grad_tail_seconds <= r.stall_seconds + 1e-12);
      CHECK(r.breakdown.total() == doctest::Approx(r.step_seconds));
    }
    // A slower gradient path makes the tail no shorter.
    Case slow = c;
    slow.cfg.cost.move.gpu_intra.gb_per_s /= 10;
    slow.cfg.cost.move.gpu_inter.gb_per_s /= 10;
    const auto sl = simulate(slow.cfg, slow.loads, slow.steps, st);
    CHECK(result_of(sl, "foremoe").grad_tail_seconds >= result_of(fp, "foremoe").grad_tail_seconds);
  }
}

TEST_CASE("simulate: eplb's replicas, resident for the whole step, return their fp32 gradients once per step") {
  const EplbCase c(29);
  const SimConfig &cfg = c.cfg;
  const int M = EplbCase::M, L = EplbCase::L;
  const std::vector<SimStrategy> st{parse_sim_strategy("eplb"), parse_sim_strategy("eplb-split"),
                                    parse_sim_strategy("ultraep")};
  const std::vector<SimResult> res = simulate(cfg, c.loads, c.steps, st);
  const StepPlan sp = c.eplb_plans();
  int replicas = 0;
  for (int l = 0; l < L; ++l) {
    replicas += sp.micro_steps[0][l].num_replicas();
    for (int m = 1; m < M; ++m)
      CHECK(sp.micro_steps[m][l].placement == sp.micro_steps[0][l].placement); // resident for the whole step
  }
  REQUIRE(replicas > 0);
  const ModelSpec &spec = cfg.model;
  const double grad_bytes = 3.0 * spec.hidden * spec.expert_ffn * 4; // fp32 gradient of one expert
  // Once per step (they accumulate in place), not once per micro-step.
  CHECK(res[0].grad_gb * 1e9 == doctest::Approx(replicas * grad_bytes));
  // eplb-split keeps the same replicas; one that ran no token in the whole step owes nothing.
  CHECK(res[1].grad_gb * 1e9 <= doctest::Approx(replicas * grad_bytes));
  CHECK(res[1].grad_gb > 0);
  // UltraEP re-pushes its replicas every micro-step, so each returns its gradient every micro-step.
  CHECK(res[2].grad_gb * 1e9 > (M - 1) * grad_bytes);
  for (const SimResult &r : res)
    CHECK(r.breakdown.total() == doctest::Approx(r.step_seconds));
}

TEST_CASE("simulate: with hold_replica_gradients off every used replica returns every update micro-step") {
  // eplb's plans do not depend on the rule, so its gradient volume off is the used replicas summed over the update
  // micro-steps, counted here from its plans; on, at most that.
  EplbCase c(30);
  const std::vector<SimStrategy> st{parse_sim_strategy("eplb"), parse_sim_strategy("foremoe")};
  const std::vector<SimResult> on = simulate(c.cfg, c.loads, c.steps, st);
  c.cfg.planner.hold_replica_gradients = false;
  const std::vector<SimResult> off = simulate(c.cfg, c.loads, c.steps, st);
  const SimConfig &cfg = c.cfg;
  const StepPlan sp = c.eplb_plans();
  std::int64_t used = 0;
  for (const auto &plans : sp.micro_steps)
    for (const LayerPlan &lp : plans)
      used += detail::new_gradients(lp, {});
  REQUIRE(used > 0);
  const double grad_bytes = 3.0 * cfg.model.hidden * cfg.model.expert_ffn * 4;
  CHECK(off[0].grad_gb * 1e9 == doctest::Approx(static_cast<double>(used) * grad_bytes));
  CHECK(on[0].grad_gb < off[0].grad_gb);
  CHECK(on[0].moved_gb == off[0].moved_gb);
  // foremoe (tolerance 0: plans independent of the rule) returns no more held than off.
  CHECK(on[1].moved_gb == off[1].moved_gb);
  CHECK(on[1].grad_gb <= off[1].grad_gb);
  for (const SimResult &r : off)
    CHECK(r.breakdown.total() == doctest::Approx(r.step_seconds));
}

TEST_CASE("simulate: static's peak memory matches the hand count; too little memory is an error naming it") {
  Case c = small_case(5);
  const std::vector<SimStrategy> st = {parse_sim_strategy("static")};
  const SimResult r = simulate(c.cfg, c.loads, c.steps, st)[0];
  const ModelSpec &m = c.cfg.model;
  const double params = 3.0 * m.hidden * m.expert_ffn, owned = 4.0 * m.num_layers; // 16 experts on 4 GPUs
  CHECK(r.memory.weights == doctest::Approx(owned * static_cast<double>(m.bytes_per_expert())));
  CHECK(r.memory.grads == doctest::Approx(owned * params * 4));      // fp32 gradients
  CHECK(r.memory.optimizer == doctest::Approx(owned * params * 12)); // Adam, 12 bytes per parameter
  CHECK(r.memory.activations > 0);
  Case off = c;
  off.cfg.optimizer_offload = true;
  CHECK(simulate(off.cfg, off.loads, off.steps, st)[0].memory.optimizer == 0);
  // Replica strategies hold at least the owners' memory and, with double buffers, no less than without.
  const std::vector<SimStrategy> fm = {parse_sim_strategy("foremoe")};
  const SimResult single = simulate(c.cfg, c.loads, c.steps, fm)[0];
  Case dbl = c;
  dbl.cfg.double_buffer = true;
  CHECK(simulate(dbl.cfg, dbl.loads, dbl.steps, fm)[0].memory.weights >= single.memory.weights);
  CHECK(single.memory.optimizer == doctest::Approx(r.memory.optimizer)); // same owned count per GPU
  Case tight = c;
  tight.cfg.gpu_memory_gb = r.memory.total() * 1e-9 * 0.99;
  CHECK_THROWS_WITH_AS((void)simulate(tight.cfg, tight.loads, tight.steps, st),
                       doctest::Contains("simulate: strategy static needs"), Error);
  CHECK_THROWS_WITH_AS((void)simulate(tight.cfg, tight.loads, tight.steps, st),
                       doctest::Contains("more than sim.gpu_memory_gb"), Error);
}

TEST_CASE("simulate: the dense parameters' memory matches the hand count, split by TP and PP, the optimizer state "
          "sharded over DP") {
  Case c = small_case(5); // 4 layers, H 256, 16 experts, 2 nodes x 2 GPUs
  c.cfg.dense.params = 1000;
  c.cfg.dense.vocab = 50;
  c.cfg.ep_size = 2;            // 2 EP-group copies: the experts' optimizer state is sharded over them
  c.cfg.topo.slots_per_gpu = 9; // 8 owners + 1 spare
  const std::vector<SimStrategy> st = {parse_sim_strategy("static")};
  const ModelSpec &m = c.cfg.model;
  const double expert_params = 3.0 * m.hidden * m.expert_ffn, owned = 8.0 * m.num_layers; // 16 experts on 2 GPUs
  const double vh = 50.0 * 256;
  struct Want {
    int pp, tp;
    double params, dp; // per GPU of the peak stage; data-parallel ranks of the dense part
  };
  // PP 1: all 4 layers, embedding and head; PP 2: 2 layers and one of them; over TP.
  for (const Want w : {Want{1, 1, 4000 + 2 * vh, 4}, Want{1, 2, (4000 + 2 * vh) / 2, 2}, Want{2, 1, 2000 + vh, 2},
                       Want{2, 2, (2000 + vh) / 2, 1}}) {
    CAPTURE(w.pp);
    CAPTURE(w.tp);
    SimConfig cfg = c.cfg;
    cfg.pipeline_stages = w.pp;
    cfg.tensor_parallel = w.tp;
    for (const bool dist : {true, false}) {
      CAPTURE(dist);
      cfg.distributed_optimizer = dist;
      const SimResult r = simulate(cfg, c.loads, c.steps, st)[0];
      CHECK(r.memory.dense_weights == doctest::Approx(w.params * 2)); // bf16
      CHECK(r.memory.dense_grads == doctest::Approx(w.params * 4));   // fp32
      CHECK(r.memory.dense_optimizer == doctest::Approx(w.params * 12 / (dist ? w.dp : 1.0)));
      const double copies = (4.0 / w.pp) / 2; // EP groups of 2 in a stage
      CHECK(r.memory.optimizer == doctest::Approx(owned / w.pp * expert_params * 12 / (dist ? copies : 1.0)));
      double sum = 0;
      for (const MemoryPart &p : memory_parts)
        sum += r.memory.*p.field;
      CHECK(r.memory.total() == sum);
      CHECK(sum == doctest::Approx(r.memory.weights + r.memory.grads + r.memory.optimizer + r.memory.activations +
                                   w.params * (6 + 12 / (dist ? w.dp : 1.0))));
    }
    cfg.optimizer_offload = true;
    CHECK(simulate(cfg, c.loads, c.steps, st)[0].memory.dense_optimizer == 0);
  }
  // The refusal names the dense parts.
  Case tight = c;
  tight.cfg.gpu_memory_gb = 1e-6;
  CHECK_THROWS_WITH_AS((void)simulate(tight.cfg, tight.loads, tight.steps, st),
                       doctest::Contains("dense weights 5.92e-05 GB"), Error);
}

TEST_CASE("SimConfig::dense_memory: more TP or more PP never raises a GPU's dense memory (property)") {
  const int rounds = 300 * foremoe_test::seed_multiplier();
  std::mt19937_64 rng(4242);
  // The largest per-GPU dense memory over the stages (the GPU the peak is taken on).
  struct Peak {
    double weights = 0, grads = 0, optimizer = 0, total = 0;
  };
  auto peak = [](const SimConfig &cfg) {
    Peak worst;
    for (int s = 0; s < cfg.pipeline_stages; ++s) {
      const DenseMemory d = cfg.dense_memory(s);
      worst.weights = std::max(worst.weights, d.weights);
      worst.grads = std::max(worst.grads, d.grads);
      worst.optimizer = std::max(worst.optimizer, d.optimizer);
      worst.total = std::max(worst.total, d.total());
    }
    return worst;
  };
  const WeightDtype dtypes[] = {WeightDtype::bf16, WeightDtype::fp8, WeightDtype::fp32};
  for (int r = 0; r < rounds; ++r) {
    SimConfig cfg;
    cfg.model.num_layers = 1 + static_cast<int>(rng() % 64);
    cfg.model.hidden = 64 * (1 + static_cast<int>(rng() % 128));
    cfg.model.dtype = dtypes[rng() % 3];
    cfg.grad_dtype = dtypes[rng() % 3];
    cfg.dense.params = static_cast<double>(rng() % 400'000'000);
    cfg.dense.vocab = rng() % 4 == 0 ? 0.0 : static_cast<double>(rng() % 300'000);
    cfg.optimizer_offload = rng() % 4 == 0;
    cfg.distributed_optimizer = rng() % 2 == 0;
    const int gpn = std::array{1, 2, 4, 8}[rng() % 4];
    cfg.topo = Topology{1 + static_cast<int>(rng() % 16), gpn, 3};
    const int G = cfg.topo.num_gpus();
    CAPTURE(r);
    // Every (PP, TP) the cluster allows, against every one with at least as much of both.
    std::vector<std::pair<int, int>> shapes;
    for (int pp = 1; pp <= std::min(G, cfg.model.num_layers); ++pp)
      for (int tp = 1; tp <= gpn; ++tp)
        if (G % pp == 0 && gpn % tp == 0 && (G / pp) % tp == 0) shapes.emplace_back(pp, tp);
    for (const auto &s1 : shapes)
      for (const auto &s2 : shapes) {
        // Plain copies, not structured bindings: doctest's CAPTURE takes them in a lambda (clang 14 cannot).
        const int pp = s1.first, tp = s1.second, pp2 = s2.first, tp2 = s2.second;
        if (pp2 < pp || tp2 < tp) continue;
        SimConfig a = cfg, b = cfg;
        a.pipeline_stages = pp;
        a.tensor_parallel = tp;
        b.pipeline_stages = pp2;
        b.tensor_parallel = tp2;
        CAPTURE(pp);
        CAPTURE(tp);
        CAPTURE(pp2);
        CAPTURE(tp2);
        const Peak da = peak(a), db = peak(b);
        const double eps = 1e-9 * (1 + da.total);
        CHECK(db.weights <= da.weights + eps);
        CHECK(db.grads <= da.grads + eps);
        // The distributed optimizer's shard is over the data-parallel ranks, G / (PP x TP): TP takes a T-th of the
        // parameters and of the ranks (the shard stays), but PP at a fixed cluster takes ranks away, so only the
        // undistributed state, or PP with the data-parallel ranks kept, never rises with it.
        if (!cfg.distributed_optimizer || pp2 == pp) {
          CHECK(db.optimizer <= da.optimizer + eps);
          CHECK(db.total <= da.total + eps);
        }
        if (cfg.distributed_optimizer && pp2 > pp) {
          SimConfig wide = b; // the same data-parallel ranks: pp2 / pp times the GPUs
          wide.topo.num_nodes = cfg.topo.num_nodes * pp2 / pp;
          if (wide.topo.num_nodes * pp == cfg.topo.num_nodes * pp2) {
            const Peak dw = peak(wide);
            CHECK(dw.optimizer <= da.optimizer + eps);
            CHECK(dw.total <= da.total + eps);
          }
        }
      }
  }
  // At a fixed cluster the distributed optimizer's shard can rise with PP: one layer per stage, all embedding.
  SimConfig one;
  one.model.num_layers = 8;
  one.topo = Topology{1, 8, 3};
  one.dense.params = 0;
  one.pipeline_stages = 8; // 1 DP rank, against 8 at PP 1
  const double vh = one.dense.vocab * one.model.hidden;
  const double shard8 = one.dense_memory(0).optimizer;
  CHECK(shard8 == doctest::Approx(vh * 12));
  one.pipeline_stages = 1;
  CHECK(one.dense_memory(0).optimizer == doctest::Approx(2 * vh * 12 / 8));
  CHECK(one.dense_memory(0).optimizer < shard8);
}

TEST_CASE("simulate: the node-shared host mirror holds every expert of every layer once, for strategies reading it") {
  Case c = small_case(5);
  const ModelSpec &m = c.cfg.model;
  const double all = 16.0 * m.num_layers * static_cast<double>(m.bytes_per_expert());
  int readers = 0, others = 0;
  for (const SimResult &r : simulate(c.cfg, c.loads, c.steps, all_strategies())) {
    CAPTURE(r.strategy);
    CHECK(r.memory.host_mirror_per_node == (r.mirror_seconds > 0 ? all : 0.0));
    (r.mirror_seconds > 0 ? readers : others) += 1;
  }
  CHECK(readers > 0); // both kinds are among the strategies, so the check above sees both branches
  CHECK(others > 0);
}

TEST_CASE("simulate: planning on the critical path is at most the planning time, all of it without overlap") {
  Case c = small_case(11, 3);
  const std::vector<SimStrategy> st = {parse_sim_strategy("foremoe"), parse_sim_strategy("ideal")};
  const auto hidden = simulate(c.cfg, c.loads, c.steps, st);
  const int counted = static_cast<int>(c.steps.size()) - 1 - c.cfg.warmup_steps;
  const SimResult &h = result_of(hidden, "foremoe");
  CHECK(h.planner_critical_seconds >= 0);
  CHECK(h.planner_critical_seconds * counted <= h.planner_seconds * (1 + 1e-9));
  const SimResult &i = result_of(hidden, "ideal"); // planned like the others, its planning timed alike
  CHECK(i.planner_critical_seconds >= 0);
  CHECK(i.planner_critical_seconds * counted <= i.planner_seconds * (1 + 1e-9));
  c.cfg.planner_overlap = false;
  const SimResult e = result_of(simulate(c.cfg, c.loads, c.steps, st), "foremoe");
  CHECK(e.planner_critical_seconds * counted == doctest::Approx(e.planner_seconds));
}

TEST_CASE("dense part from the model shape: FLOPs at the cited efficiency plus weight streaming, by hand") {
  SimConfig cfg;
  cfg.dense.context = 1006; // (512 + 1500) / 2, the default batch
  const double peak = cfg.cost.gemm.peak_tflops_bf16 * 1e12 * 0.40;
  const double flops = 2.0 * 19136512 + 4.0 * 1006 * 4096; // Qwen3-30B-A3B: 2 x params + 4 x context x width
  const double stream = 19136512 * 2.0 / (cfg.cost.gemm.hbm_tb_per_s * 1e12 * cfg.cost.gemm.hbm_efficiency);
  for (double tokens : {0.0, 1.0, 6600.0, 1e5})
    CHECK(cfg.dense_forward_seconds(tokens) ==
          doctest::Approx(cfg.cost.dense.launch_us * 1e-6 + stream + tokens * flops / peak).epsilon(1e-12));
  // About 0.14 us per token for Qwen3-30B-A3B, DeepSeek-V3's ten times more parameters about 1.4 us.
  CHECK((cfg.dense_forward_seconds(1e5) - cfg.dense_forward_seconds(0)) / 1e5 ==
        doctest::Approx(0.1385e-6).epsilon(0.01));
  SimConfig ds = cfg;
  ds.dense = DenseShape::deepseek_v3();
  ds.dense.context = 1006;
  CHECK((ds.dense_forward_seconds(1e5) - ds.dense_forward_seconds(0)) / 1e5 == doctest::Approx(1.386e-6).epsilon(0.01));
  // A higher efficiency is never slower; the constant model ignores the shape.
  SimConfig fast = cfg;
  fast.dense_efficiency = 0.8;
  CHECK(fast.dense_forward_seconds(6600) < cfg.dense_forward_seconds(6600));
  cfg.dense_from_shape = false;
  CHECK(cfg.dense_forward_seconds(1000) ==
        doctest::Approx((cfg.cost.dense.launch_us + 1000 * cfg.cost.dense.per_token_us) * 1e-6));
  SimConfig bad;
  bad.dense_efficiency = 0;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("dense_efficiency must be in (0, 1], got 0"), Error);
}

TEST_CASE("simulate: more overlap is never slower; ideal is never slower than any strategy (property)") {
  const int rounds = 3 * foremoe_test::seed_multiplier();
  std::mt19937_64 rng(4242);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (int r = 0; r < rounds; ++r) {
    // Random traces, shapes and deployments: one EP group of 2 x 2 GPUs, or two copies of an EP group of 2 GPUs.
    Case c = small_case(500 + r);
    c.cfg.model.hidden = 256 << (rng() % 4);
    c.cfg.model.expert_ffn = 128 << (rng() % 4);
    if (rng() % 2 == 1) {
      c.cfg.ep_size = 2;
      c.cfg.topo.slots_per_gpu = 9; // 8 owners + 1 spare
    }
    c.cfg.double_buffer = rng() % 2 == 1;
    const double lo = unit(rng), hi = lo + (1 - lo) * unit(rng);
    const double dp_lo = unit(rng), dp_hi = dp_lo + (1 - dp_lo) * unit(rng);
    CAPTURE(r);
    CAPTURE(lo);
    CAPTURE(hi);
    const auto strategies = all_strategies();
    std::vector<std::vector<SimResult>> runs;
    for (const auto &[f, dp] : {std::pair{0.0, 0.0}, std::pair{lo, dp_lo}, std::pair{hi, dp_hi}, std::pair{1.0, 1.0}}) {
      SimConfig cfg = c.cfg;
      cfg.a2a_overlap = f;
      cfg.dp_grad_overlap = dp;
      runs.push_back(simulate(cfg, c.loads, c.steps, strategies));
      const SimResult &ideal = result_of(runs.back(), "ideal");
      for (const SimResult &x : runs.back()) {
        CAPTURE(x.strategy);
        CHECK(x.step_seconds >= ideal.step_seconds);
        CHECK(x.breakdown.total() == doctest::Approx(x.step_seconds));
        CHECK(x.a2a_hidden_seconds >= 0);
        if (f == 0.0) CHECK(x.a2a_hidden_seconds == 0.0);
        CHECK((c.cfg.ep_size == 2) == (x.breakdown.dp_grad_sync > 0)); // only with copies to synchronise
      }
    }
    for (std::size_t k = 1; k < runs.size(); ++k)
      for (std::size_t i = 0; i < strategies.size(); ++i) {
        CAPTURE(runs[k][i].strategy);
        CAPTURE(k);
        CHECK(runs[k][i].step_seconds <= runs[k - 1][i].step_seconds * (1 + 1e-12));
        CHECK(runs[k][i].breakdown.all_to_all <= runs[k - 1][i].breakdown.all_to_all * (1 + 1e-12));
        CHECK(runs[k][i].a2a_hidden_seconds >= runs[k - 1][i].a2a_hidden_seconds * (1 - 1e-12));
      }
    // The sync's exposed part alone shrinks with its own overlap; with more all-to-all overlap it may grow (a
    // shorter backward hides less of it), so it is compared at one all-to-all overlap.
    std::vector<SimResult> prev;
    for (const double dp : {0.0, dp_lo, dp_hi, 1.0}) {
      SimConfig cfg = c.cfg;
      cfg.a2a_overlap = lo;
      cfg.dp_grad_overlap = dp;
      std::vector<SimResult> cur = simulate(cfg, c.loads, c.steps, strategies);
      for (std::size_t i = 0; i < prev.size(); ++i) {
        CAPTURE(cur[i].strategy);
        CHECK(cur[i].breakdown.dp_grad_sync <= prev[i].breakdown.dp_grad_sync * (1 + 1e-12));
        CHECK(cur[i].step_seconds <= prev[i].step_seconds * (1 + 1e-12));
      }
      prev = std::move(cur);
    }
  }
}

TEST_CASE("simulate: links shared both ways slow only strategies that move; one PCIe ingress budget (property)") {
  const int rounds = 3 * foremoe_test::seed_multiplier();
  std::mt19937_64 rng(777);
  const auto strategies = all_strategies();
  bool some_yield = false, some_pcie = false;
  for (int r = 0; r < rounds; ++r) {
    Case c = small_case(900 + r);
    c.cfg.model.hidden = 512 << (rng() % 3); // weights large enough for moves to matter
    c.cfg.model.expert_ffn = 256 << (rng() % 3);
    c.cfg.planner.reowning_free = rng() % 2 == 1;
    CAPTURE(r);
    SimConfig one_way = c.cfg;
    one_way.two_way_link_sharing = false;
    SimConfig narrow = c.cfg;
    narrow.cost.move.pcie_ingress_gb_per_s = 1.0; // far below the NIC's and the mirror's own rates
    SimConfig wide = c.cfg;
    wide.cost.move.pcie_ingress_gb_per_s = 1e6;
    const auto both = simulate(c.cfg, c.loads, c.steps, strategies);
    const auto moves_only = simulate(one_way, c.loads, c.steps, strategies);
    const auto slow = simulate(narrow, c.loads, c.steps, strategies);
    const auto fast = simulate(wide, c.loads, c.steps, strategies);
    for (std::size_t i = 0; i < strategies.size(); ++i) {
      CAPTURE(both[i].strategy);
      // The all-to-all only ever yields: never faster both ways; the same where nothing moves or returns.
      CHECK(both[i].breakdown.all_to_all >= moves_only[i].breakdown.all_to_all * (1 - 1e-12));
      CHECK(both[i].step_seconds >= moves_only[i].step_seconds * (1 - 1e-12));
      CHECK(both[i].breakdown.total() == doctest::Approx(both[i].step_seconds));
      if (both[i].moved_gb == 0 && both[i].grad_gb == 0) {
        CHECK(both[i].step_seconds == moves_only[i].step_seconds);
      }
      some_yield = some_yield || both[i].breakdown.all_to_all > moves_only[i].breakdown.all_to_all * (1 + 1e-9);
      // A narrower PCIe link is never faster, and a wide one changes nothing against the paths' own rates (each
      // below 1e6 GB/s); strategies that move nothing do not see it.
      CHECK(slow[i].step_seconds >= both[i].step_seconds * (1 - 1e-12));
      CHECK(fast[i].step_seconds == both[i].step_seconds);
      if (both[i].moved_gb == 0) CHECK(slow[i].step_seconds == both[i].step_seconds);
      some_pcie = some_pcie || slow[i].step_seconds > both[i].step_seconds * (1 + 1e-9);
    }
    CHECK(result_of(both, "static").step_seconds == result_of(moves_only, "static").step_seconds);
  }
  CHECK(some_yield); // the instances do move weights, so the properties above were tested on real sharing
  CHECK(some_pcie);
  SimConfig bad;
  bad.cost.move.pcie_ingress_gb_per_s = 0;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("pcie_ingress_gb_per_s must be positive and finite, got 0"),
                       Error);
}

TEST_CASE("simulate: fp8 dispatch sends one byte per element plus a scale per 128, the rest stays bf16") {
  Case c = small_case(21);
  c.cfg.model.hidden = 1024;
  c.cfg.recompute_passes = 0; // update only: forward dispatch fp8; combine, and both backward exchanges, bf16
  const std::vector<SimStrategy> st{parse_sim_strategy("static"), parse_sim_strategy("ideal")};
  SimConfig fp8 = c.cfg;
  fp8.dispatch_dtype = WeightDtype::fp8;
  CHECK(c.cfg.dispatch_row_bytes() == c.cfg.row_bytes());
  CHECK(fp8.dispatch_row_bytes() == 1024 + 8 * 4); // 8 fp32 scales of 128 elements
  const auto bf = simulate(c.cfg, c.loads, c.steps, st), f8 = simulate(fp8, c.loads, c.steps, st);
  for (std::size_t i = 0; i < st.size(); ++i) {
    CAPTURE(st[i].name);
    // The same placement and rows: the inter-node bytes scale by (dispatch + 3 x bf16) / (4 x bf16).
    CHECK(bf[i].inter_node_gb > 0);
    CHECK(f8[i].inter_node_gb == doctest::Approx(bf[i].inter_node_gb * (1056.0 + 3 * 2048.0) / (4 * 2048.0)));
    CHECK(f8[i].breakdown.all_to_all < bf[i].breakdown.all_to_all);
    CHECK(f8[i].breakdown.expert_compute == bf[i].breakdown.expert_compute);
  }
  // One exchange's time at each row size: the dispatch's own, or the combine's when they match.
  const std::vector<std::int32_t> slot_expert{0, 1, 2, 3};
  const std::vector<std::int64_t> slot_rows{300, 200, 100, 400};
  const std::vector<double> gpu_rows{300, 200, 100, 400};
  const AllToAllParams p;
  const LayerA2a same = layer_a2a(p, slot_expert, slot_rows, gpu_rows, 1, 2, 4, 500, 2048);
  CHECK(same.dispatch_seconds == same.seconds);
  const LayerA2a half = layer_a2a(p, slot_expert, slot_rows, gpu_rows, 1, 2, 4, 500, 2048, 1024);
  CHECK(half.seconds == same.seconds);
  CHECK(half.dispatch_seconds < same.seconds);
  CHECK(half.inter_node_rows == same.inter_node_rows);
  CHECK_THROWS_WITH_AS((void)layer_a2a(p, slot_expert, slot_rows, gpu_rows, 1, 2, 4, 500, 2048, -1),
                       doctest::Contains("dispatch row bytes must be >= 0"), Error);
  SimConfig bad = c.cfg;
  bad.dispatch_dtype = WeightDtype::fp32;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("dispatch_dtype must be bf16 or fp8, got fp32"), Error);
}

TEST_CASE("simulate: the rollout is sim.rollout_seconds, else its share of the static step, the same for all") {
  Case c = small_case(23);
  const auto strategies = all_strategies();
  const auto def = simulate(c.cfg, c.loads, c.steps, strategies);
  const double st = result_of(def, "static").step_seconds;
  for (const SimResult &r : def) {
    CAPTURE(r.strategy);
    CHECK(r.rollout_seconds == doctest::Approx(0.7 / 0.3 * st)); // the default share, 0.7
    CHECK(r.end_to_end_seconds == doctest::Approx(r.step_seconds + r.rollout_seconds));
  }
  // Static's step is 30% of its whole RL step.
  CHECK(st / result_of(def, "static").end_to_end_seconds == doctest::Approx(0.3));
  SimConfig fixed = c.cfg;
  fixed.rollout_seconds = 2.5;
  for (const SimResult &r : simulate(fixed, c.loads, c.steps, strategies))
    CHECK(r.rollout_seconds == 2.5);
  SimConfig none = c.cfg;
  none.rollout_share = 0;
  for (const SimResult &r : simulate(none, c.loads, c.steps, strategies))
    CHECK(r.end_to_end_seconds == r.step_seconds);
  // Without static the slowest strategy is the reference.
  const std::vector<SimStrategy> two{parse_sim_strategy("eplb"), parse_sim_strategy("foremoe")};
  const auto pair = simulate(c.cfg, c.loads, c.steps, two);
  const double slowest = std::max(pair[0].step_seconds, pair[1].step_seconds);
  CHECK(pair[1].rollout_seconds == doctest::Approx(0.7 / 0.3 * slowest));
  SimConfig bad = c.cfg;
  bad.rollout_share = 1.0;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("rollout_share must be in [0, 1), got 1"), Error);
}

TEST_CASE("simulate: the all-to-all hides under compute up to a2a_overlap of it, never more than the compute") {
  Case c = small_case(11);
  c.cfg.dense_from_shape = false;
  const std::vector<SimStrategy> st{parse_sim_strategy("static")};
  const SimResult none = simulate(c.cfg, c.loads, c.steps, st)[0];
  CHECK(none.a2a_hidden_seconds == 0.0);
  const double a2a = none.breakdown.all_to_all, compute = none.breakdown.expert_compute + none.breakdown.dense;
  for (double f : {0.25, 0.5, 1.0}) {
    CAPTURE(f);
    SimConfig cfg = c.cfg;
    cfg.a2a_overlap = f;
    const SimResult r = simulate(cfg, c.loads, c.steps, st)[0];
    // Static has no moves, so its layer times are its whole step: what hides is exactly what leaves the total.
    CHECK(r.breakdown.all_to_all + r.a2a_hidden_seconds == doctest::Approx(a2a).epsilon(1e-12));
    CHECK(r.a2a_hidden_seconds <= f * a2a * (1 + 1e-12));
    CHECK(r.a2a_hidden_seconds <= compute * (1 + 1e-12));
    CHECK(r.step_seconds == doctest::Approx(none.step_seconds - r.a2a_hidden_seconds).epsilon(1e-12));
    CHECK(r.breakdown.expert_compute == doctest::Approx(none.breakdown.expert_compute).epsilon(1e-12));
  }
  // A slow network: full overlap hides at most the compute, the rest stays.
  SimConfig slow = c.cfg;
  slow.cost.a2a.intra_gb_per_s = slow.cost.a2a.inter_gb_per_s = 0.01;
  slow.a2a_overlap = 1.0;
  const SimResult s = simulate(slow, c.loads, c.steps, st)[0];
  CHECK(s.a2a_hidden_seconds > 0);
  CHECK(s.a2a_hidden_seconds == doctest::Approx(s.breakdown.expert_compute + s.breakdown.dense).epsilon(1e-12));
  CHECK(s.breakdown.all_to_all > 0);
  SimConfig bad = c.cfg;
  bad.a2a_overlap = 1.5;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("a2a_overlap must be in [0, 1], got 1.5"), Error);
  bad = c.cfg;
  bad.dp_grad_overlap = -0.1;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("dp_grad_overlap must be in [0, 1], got -0.1"), Error);
}

TEST_CASE("simulate: expert-gradient sync across EP-group copies: none for one group, hidden only under the "
          "last backward") {
  Case c = small_case(13);
  const std::vector<SimStrategy> st{parse_sim_strategy("static"), parse_sim_strategy("ideal")};
  for (const SimResult &r : simulate(c.cfg, c.loads, c.steps, st))
    CHECK(r.breakdown.dp_grad_sync == 0.0); // one EP group: nothing to synchronise
  c.cfg.ep_size = 2;                        // two copies of 2 GPUs (one node each: the ring crosses the NIC)
  c.cfg.topo.slots_per_gpu = 9;
  c.cfg.model.hidden = 2048; // gradients large enough to outlast a backward
  const auto serial = simulate(c.cfg, c.loads, c.steps, st);
  const PathParams &nic = c.cfg.cost.move.gpu_inter;
  const double owned = 8 * 3.0 * 2048 * 128 * 4; // 8 experts per GPU per layer, fp32 gradients
  const double bucket = 2 * nic.latency_us * 1e-6 + owned / (nic.gb_per_s * 1e9);
  for (const SimResult &r : serial)
    CHECK(r.breakdown.dp_grad_sync == doctest::Approx(4 * bucket).epsilon(1e-12));
  // Two optimizer steps per RL step synchronise twice.
  SimConfig two = c.cfg;
  two.minibatches_per_step = 2;
  CHECK(simulate(two, c.loads, c.steps, st)[0].breakdown.dp_grad_sync == doctest::Approx(8 * bucket).epsilon(1e-12));
  // With overlap, at most the last micro-step's backward hides (each bucket once its layer's backward is over).
  SimConfig over = c.cfg;
  over.dp_grad_overlap = 1.0;
  const auto hidden = simulate(over, c.loads, c.steps, st);
  for (std::size_t i = 0; i < st.size(); ++i) {
    CHECK(hidden[i].breakdown.dp_grad_sync < serial[i].breakdown.dp_grad_sync);
    CHECK(hidden[i].breakdown.dp_grad_sync >= bucket); // the first layer's bucket starts after the last backward
    CHECK(hidden[i].step_seconds < serial[i].step_seconds);
  }
  // bf16 gradients halve the bytes.
  SimConfig half = c.cfg;
  half.grad_dtype = WeightDtype::bf16;
  CHECK(simulate(half, c.loads, c.steps, st)[0].breakdown.dp_grad_sync ==
        doctest::Approx(4 * (2 * nic.latency_us * 1e-6 + owned / 2 / (nic.gb_per_s * 1e9))).epsilon(1e-12));
}

TEST_CASE("simulate: the LM head and the optimizer step follow the model shape and parameter count") {
  Case c = small_case(17);
  const std::vector<SimStrategy> st{parse_sim_strategy("static")};
  const SimResult base = simulate(c.cfg, c.loads, c.steps, st)[0];
  CHECK(base.breakdown.lm_head > 0);
  CHECK(base.breakdown.optimizer > 0);
  // Without a vocabulary there is no LM head, and the step is that much shorter.
  SimConfig none = c.cfg;
  none.dense.vocab = 0;
  none.optimizer_traffic_bytes_per_param = 0;
  const SimResult bare = simulate(none, c.loads, c.steps, st)[0];
  CHECK(bare.breakdown.lm_head == 0.0);
  CHECK(bare.breakdown.optimizer == 0.0);
  CHECK(bare.step_seconds ==
        doctest::Approx(base.step_seconds - base.breakdown.lm_head - base.breakdown.optimizer).epsilon(1e-12));
  // The optimizer: a fixed part plus bytes per parameter at the HBM bandwidth; 4 GPUs of 4 experts per layer each.
  SimConfig fixed = none;
  fixed.optimizer_seconds = 0.125;
  CHECK(simulate(fixed, c.loads, c.steps, st)[0].breakdown.optimizer == doctest::Approx(0.125));
  const double params = 4.0 * 4 * 3 * 256 * 128 + 4 * 19136512.0 + 2 * 151936.0 * 256;
  CHECK(base.breakdown.optimizer ==
        doctest::Approx(params * 30 / (c.cfg.cost.gemm.hbm_tb_per_s * 1e12 * c.cfg.cost.gemm.hbm_efficiency))
            .epsilon(1e-12));
  // The head's GEMM is 2 V H FLOPs per token: DeepSeek-V3's (129,280 x 7,168) is 2.98x Qwen3-30B-A3B's
  // (151,936 x 2,048) at large token counts.
  SimConfig qwen, ds;
  qwen.model.hidden = 2048;
  ds.model.hidden = 7168;
  ds.dense = DenseShape::deepseek_v3();
  CHECK(ds.lm_head_forward_seconds(1e6) / qwen.lm_head_forward_seconds(1e6) ==
        doctest::Approx(129280.0 * 7168 / (151936.0 * 2048)).epsilon(1e-3));
  CHECK(qwen.lm_head_forward_seconds(0) == 0.0);
  SimConfig bad;
  bad.dense.vocab = -1;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("vocab -1"), Error);
  bad = SimConfig{};
  bad.optimizer_traffic_bytes_per_param = -2;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("optimizer_traffic_bytes_per_param must be >= 0, got -2"),
                       Error);
}

TEST_CASE("SyntheticMicroSteps: each micro-step's ids are generate_trace's, layer-major") {
  const Case c = small_case(11, 2);
  const SyntheticMicroSteps ms(c.batch);
  const SyntheticTrace tr = generate_trace(c.batch);
  REQUIRE(ms.num_micro_steps() == c.loads.num_micro_steps());
  CHECK(ms.step_offsets() == c.steps);
  const int L = c.batch.num_layers, K = c.batch.topk, G = c.batch.num_gpus;
  std::vector<std::int16_t> ids;
  std::vector<std::int64_t> so;
  for (int m = 0; m < ms.num_micro_steps(); ++m) {
    ms.route(m, ids, so);
    const std::int64_t t0 = tr.microbatch_offsets[m], T = tr.microbatch_offsets[m + 1] - t0;
    REQUIRE(so.size() == static_cast<std::size_t>(G) + 1);
    REQUIRE(so.back() == T);
    for (int r = 0; r <= G; ++r)
      CHECK(so[r] == tr.source_offsets[static_cast<std::size_t>(m) * G + r] - t0);
    REQUIRE(ids.size() == static_cast<std::size_t>(T) * L * K);
    std::int64_t differ = 0;
    for (int l = 0; l < L; ++l)
      for (std::int64_t t = 0; t < T; ++t)
        for (int k = 0; k < K; ++k)
          differ += ids[(static_cast<std::size_t>(l) * T + t) * K + k] !=
                    tr.routed_ids[(static_cast<std::size_t>(t0 + t) * L + l) * K + k];
    CHECK(differ == 0);
  }
  CHECK_THROWS_WITH_AS(ms.route(ms.num_micro_steps(), ids, so), doctest::Contains("outside [0, "), Error);
}

TEST_CASE("simulate: the all-to-all counted from the routed ids (sim.a2a_hits = ids)") {
  const Case c = small_case(5, 3);
  const SyntheticMicroSteps ms(c.batch);
  const MicroStepRoutes routes = [&](int m, RoutedMicroStep &out) { ms.route(m, out.ids, out.source_offsets); };
  SimConfig ids_cfg = c.cfg;
  ids_cfg.a2a_hits = A2aHitsSource::ids;
  ids_cfg.traffic.aware = false; // the same plans as the estimate's (traffic-aware foremoe: its own test below)
  const std::vector<SimStrategy> st = all_strategies();
  const std::vector<SimResult> ind = simulate(c.cfg, c.loads, c.steps, st);
  const std::vector<SimResult> rou = simulate(ids_cfg, c.loads, c.steps, st, {}, true, routes);
  for (const SimStrategy &s : st) {
    CAPTURE(s.name);
    const SimResult &a = result_of(ind, s.name), &b = result_of(rou, s.name);
    // The same plans: only the all-to-all (and what waits on it) changes.
    CHECK(a.imbalance_median == b.imbalance_median);
    CHECK(a.moved_gb == b.moved_gb);
    CHECK(a.grad_gb == b.grad_gb);
    CHECK(a.breakdown.expert_compute == b.breakdown.expert_compute);
    CHECK(b.inter_node_gb > 0);
  }
  // static has one copy per expert: the inter-node bytes are every counted token's distinct remote nodes under its
  // placement, counted here with count_node_hits, for dispatch and combine of each pass (recompute: forward only).
  PlannerOptions po;
  po.strategy = "static";
  Planner planner(c.cfg.model.num_layers, c.cfg.model.num_experts, c.cfg.topo, po);
  LoadTensor first(1, c.cfg.model.num_layers, c.cfg.model.num_experts);
  std::copy_n(c.loads.totals().begin(), first.totals().size(), first.totals().begin());
  const StepPlan sp = planner.plan_step(first);
  const int L = c.cfg.model.num_layers, K = c.cfg.model.topk;
  std::vector<std::int16_t> ids;
  std::vector<std::int64_t> so;
  double rows = 0;
  for (std::int64_t m = c.steps[static_cast<std::size_t>(c.cfg.warmup_steps)]; m < c.steps.back(); ++m) {
    ms.route(static_cast<int>(m), ids, so);
    const std::int64_t T = so.back();
    std::vector<std::int32_t> slots(static_cast<std::size_t>(T) * K);
    for (int l = 0; l < L; ++l) {
      const auto l2p = sp.micro_steps[0][static_cast<std::size_t>(l)].placement.log_to_phys();
      for (std::int64_t x = 0; x < T * K; ++x)
        slots[static_cast<std::size_t>(x)] =
            l2p.phys[static_cast<std::size_t>(l2p.offsets[ids[static_cast<std::size_t>(l) * T * K + x]])];
      rows += static_cast<double>(count_node_hits(slots, K, c.cfg.topo, so).remote_nodes);
    }
  }
  const int counted = static_cast<int>(c.steps.size()) - 1 - c.cfg.warmup_steps;
  const double row_bytes = c.cfg.model.hidden * c.cfg.activation_bytes;
  CHECK(result_of(rou, "static").inter_node_gb ==
        doctest::Approx(rows * row_bytes * (2.0 * c.cfg.recompute_passes + 4.0) / counted * 1e-9).epsilon(1e-12));

  // Bad input names what is wrong.
  const std::vector<SimStrategy> one{parse_sim_strategy("foremoe")};
  CHECK_THROWS_WITH_AS((void)simulate(ids_cfg, c.loads, c.steps, one), doctest::Contains("none were given"), Error);
  CHECK_THROWS_WITH_AS((void)simulate(c.cfg, c.loads, c.steps, one, {}, true, routes),
                       doctest::Contains("sim.a2a_hits is independent"), Error);
  const Case other = small_case(6, 3); // another batch's routes
  const SyntheticMicroSteps other_ms(other.batch);
  const MicroStepRoutes wrong = [&](int m, RoutedMicroStep &out) {
    other_ms.route(std::min(m, other_ms.num_micro_steps() - 1), out.ids, out.source_offsets);
  };
  CHECK_THROWS_WITH_AS((void)simulate(ids_cfg, c.loads, c.steps, one, {}, true, wrong), doctest::Contains("routes"),
                       Error);
  SimConfig two_groups = ids_cfg;
  two_groups.ep_size = 2;
  two_groups.topo.slots_per_gpu = 9; // 2 GPUs per group hold all 16 experts
  CHECK_THROWS_WITH_AS((void)simulate(two_groups, c.loads, c.steps, one, {}, true, routes),
                       doctest::Contains("one EP group over all 4 GPUs"), Error);
  CHECK(parse_a2a_hits_source("ids", "sim.a2a_hits") == A2aHitsSource::ids);
  CHECK_THROWS_WITH_AS((void)parse_a2a_hits_source("exact", "sim.a2a_hits"),
                       doctest::Contains("sim.a2a_hits must be one of independent, ids, got 'exact'"), Error);
}

TEST_CASE("simulate: counted all-to-alls route each micro-step once, and strategies side by side equal each alone") {
  // The counted mode runs every strategy together and routes each micro-step once for all strategies and stages;
  // each strategy's results must be those of running it alone, to the bit (random batches).
  const std::vector<SimStrategy> st = all_strategies();
  for (const std::uint64_t seed : {5u, 17u}) {
    CAPTURE(seed);
    const Case c = small_case(seed, 3);
    const SyntheticMicroSteps ms(c.batch);
    std::vector<int> calls(static_cast<std::size_t>(ms.num_micro_steps()), 0);
    const MicroStepRoutes routes = [&](int m, RoutedMicroStep &out) {
      ++calls[static_cast<std::size_t>(m)];
      ms.route(m, out.ids, out.source_offsets);
    };
    SimConfig cfg = c.cfg;
    cfg.a2a_hits = A2aHitsSource::ids;
    cfg.recompute_passes = 1;
    const std::vector<SimResult> together = simulate(cfg, c.loads, c.steps, st, {}, true, routes);
    for (const int n : calls)
      CHECK(n == 1);
    for (const SimStrategy &s : st) {
      CAPTURE(s.name);
      const std::vector<SimStrategy> one{s};
      const std::vector<SimResult> alone = simulate(cfg, c.loads, c.steps, one, {}, true, routes);
      const SimResult &a = result_of(alone, s.name);
      const SimResult &b = result_of(together, s.name);
      CHECK(a.step_seconds == b.step_seconds);
      CHECK(a.inter_node_gb == b.inter_node_gb);
      CHECK(a.breakdown.all_to_all == b.breakdown.all_to_all);
      CHECK(a.layer_seconds == b.layer_seconds);
      CHECK(a.moved_gb == b.moved_gb);
    }
  }
}

/// Routed ids with planted co-activation: per layer, the experts fall into `N` clusters of `E / N` (a random
/// permutation, so load-only owners scatter them over nodes); a token picks a cluster (weights skewed so that loads
/// differ) and each of its top-k distinct experts from it with probability `p_in`, else from all experts. Micro-steps
/// of `G` ranks with 40-160 tokens each; `loads` are the ids' counts.
struct PlantedCase {
  SimConfig cfg;
  LoadTensor loads{1, 1, 1};
  std::vector<std::int64_t> steps;
  std::vector<RoutedMicroStep> routes;
};

PlantedCase planted_case(std::uint64_t seed, int nodes, int experts, double p_in) {
  std::mt19937_64 rng(seed);
  PlantedCase c;
  const int L = 2, K = 4, P = 2, G = nodes * P, E = experts, M = 3, steps = 2;
  c.cfg.model = ModelSpec{L, E, K, 256, 128, WeightDtype::bf16};
  c.cfg.topo = Topology{nodes, P, E / G + 1};
  c.cfg.a2a_hits = A2aHitsSource::ids;
  c.cfg.warmup_steps = 1;
  std::vector<std::vector<int>> member(L); // per layer, expert of (cluster slot)
  for (auto &perm : member) {
    perm.resize(static_cast<std::size_t>(E));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
  }
  const int per = E / nodes;
  std::vector<double> weight(static_cast<std::size_t>(nodes));
  for (double &w : weight)
    w = std::uniform_real_distribution<double>(0.5, 2.0)(rng);
  std::discrete_distribution<int> cluster(weight.begin(), weight.end());
  std::uniform_int_distribution<int> in(0, per - 1), any(0, E - 1), tokens(40, 160);
  std::bernoulli_distribution inside(p_in);
  c.loads = LoadTensor(M * steps, L, E);
  for (int s = 0; s <= steps; ++s)
    c.steps.push_back(static_cast<std::int64_t>(s) * M);
  for (int m = 0; m < M * steps; ++m) {
    RoutedMicroStep r;
    r.source_offsets = {0};
    for (int g = 0; g < G; ++g)
      r.source_offsets.push_back(r.source_offsets.back() + tokens(rng));
    const std::int64_t T = r.source_offsets.back();
    r.ids.assign(static_cast<std::size_t>(T) * L * K, 0);
    for (int l = 0; l < L; ++l)
      for (std::int64_t t = 0; t < T; ++t) {
        const int cl = cluster(rng);
        std::int16_t *row = r.ids.data() + (static_cast<std::size_t>(l) * T + t) * K;
        for (int k = 0; k < K; ++k) {
          int e = 0;
          do {
            if (inside(rng)) {
              const int i = cl * per + in(rng);
              e = member[l][static_cast<std::size_t>(i)];
            } else {
              e = any(rng);
            }
          } while (std::find(row, row + k, e) != row + k);
          row[k] = static_cast<std::int16_t>(e);
          ++c.loads.layer(m, l)[e];
        }
      }
    c.routes.push_back(std::move(r));
  }
  return c;
}

TEST_CASE("simulate: traffic-aware foremoe counts no more inter-node bytes on planted co-activation (property)") {
  // With sim.traffic aware, foremoe and foremoe-free choose each step's owners from the step's co-activation and
  // map their tokens node-affinely. On instances whose tokens route within planted clusters of one node's size,
  // the counted inter-node bytes with it on must never exceed those with it off, and over all instances they must
  // fall clearly (the load-only owners scatter the clusters; the traffic-aware ones gather them): a simulator that
  // ignored the option, or planned owners from the wrong step's routes, fails here. The other strategies are
  // untouched, to the bit.
  const std::vector<SimStrategy> st{parse_sim_strategy("static"), parse_sim_strategy("eplb-split"),
                                    parse_sim_strategy("foremoe"), parse_sim_strategy("foremoe-free")};
  const int rounds = 4 * foremoe_test::seed_multiplier();
  double on_sum = 0, off_sum = 0;
  for (int r = 0; r < rounds; ++r) {
    const int nodes = r % 2 == 0 ? 2 : 4, experts = r % 4 < 2 ? 16 : 32;
    const PlantedCase c = planted_case(900 + r, nodes, experts, 0.9);
    CAPTURE(r);
    int calls = 0;
    const MicroStepRoutes routes = [&](int m, RoutedMicroStep &out) {
      ++calls;
      out = c.routes[static_cast<std::size_t>(m)];
    };
    SimConfig off_cfg = c.cfg;
    off_cfg.traffic.aware = false;
    const std::vector<SimResult> on = simulate(c.cfg, c.loads, c.steps, st, {}, true, routes);
    CHECK(calls == c.loads.num_micro_steps()); // routed once, though the step's routes are held to plan owners
    const std::vector<SimResult> off = simulate(off_cfg, c.loads, c.steps, st, {}, true, routes);
    for (const char *name : {"static", "eplb-split"}) {
      CAPTURE(name);
      CHECK(result_of(on, name).inter_node_gb == result_of(off, name).inter_node_gb);
      CHECK(result_of(on, name).step_seconds == result_of(off, name).step_seconds);
    }
    for (const char *name : {"foremoe", "foremoe-free"}) {
      CAPTURE(name);
      const SimResult &a = result_of(on, name), &b = result_of(off, name);
      CHECK(a.inter_node_gb <= b.inter_node_gb * (1 + 1e-12));
    }
    on_sum += result_of(on, "foremoe").inter_node_gb;
    off_sum += result_of(off, "foremoe").inter_node_gb;
  }
  // Measured at 0.76 over the four default instances (2 and 4 nodes, 16 and 32 experts); 1.0 if the option
  // were ignored. The bound leaves room for other instances (FOREMOE_TEST_SEED_MULTIPLIER), not for no effect.
  CHECK(on_sum < 0.9 * off_sum);
  // The option's bad values are refused, naming them.
  SimConfig bad;
  bad.traffic.tolerance = 0.5;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("traffic.tolerance must be a finite number >= 1, got 0.5"),
                       Error);
  bad = SimConfig{};
  bad.traffic.tokens = -3;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("traffic.tokens must be >= 0 (0: all), got -3"), Error);
}

TEST_CASE("simulate: a host-mirror refresh costs what the transfer planner gives the same move (property)") {
  // After the optimizer step a GPU copies its owned experts to the host mirror: one PCIe move of
  // owners x layers x expert bytes, which the simulator prices with `CostParams::move`. The transfer planner, given
  // the same parameters, must estimate the same move (alone, one chunk) at the same seconds, to the bit, for random
  // rates and latencies; a planner or simulator with a link table of its own would not.
  std::mt19937_64 rng(2718);
  std::uniform_real_distribution<double> rate(1.0, 900.0), lat(0.0, 50.0);
  const int rounds = 2 * foremoe_test::seed_multiplier();
  int compared = 0;
  for (int r = 0; r < rounds; ++r) {
    Case c = small_case(60 + r);
    c.cfg.warmup_steps = 1; // one counted step: its refresh is the result's mirror_seconds
    c.cfg.minibatches_per_step = 1;
    for (PathParams *p : {&c.cfg.cost.move.gpu_intra, &c.cfg.cost.move.gpu_inter, &c.cfg.cost.move.host})
      *p = {rate(rng), lat(rng)};
    CAPTURE(r);
    const auto res = simulate(c.cfg, c.loads, c.steps, all_strategies());
    const std::int64_t owned = std::int64_t{c.cfg.topo.owners_per_gpu(c.cfg.model.num_experts)} *
                               c.cfg.model.num_layers * c.cfg.model.bytes_per_expert();
    transfer::Options opt;
    opt.move = c.cfg.cost.move;
    opt.expert_bytes = owned;
    opt.max_chunk_bytes = owned;
    const std::vector<Move> to_mirror{{0, host_mirror, 1, 0}};
    const auto tp = transfer::plan_transfers(to_mirror, LayerPlacement(2, 1, 1), Topology{1, 2, 1}, opt);
    REQUIRE(tp.chunks.size() == 1);
    REQUIRE(tp.chunks[0].path == transfer::Path::pcie);
    for (const SimResult &x : res) {
      if (x.mirror_seconds == 0) continue;
      CAPTURE(x.strategy);
      CHECK(x.mirror_seconds == tp.est_seconds);
      CHECK(x.mirror_seconds == move_seconds(c.cfg.cost.move, MovePath::pcie, static_cast<double>(owned)));
      ++compared;
    }
  }
  CHECK(compared > 0); // some strategy did read the mirror
}

TEST_CASE("simulate: the offloaded optimizer step is gradients down, CPU Adam shared by the node, weights up") {
  Case c = small_case(17);
  const std::vector<SimStrategy> st{parse_sim_strategy("static")};
  const SimResult gpu = simulate(c.cfg, c.loads, c.steps, st)[0];
  SimConfig off = c.cfg;
  off.optimizer_offload = true;
  const SimResult cpu = simulate(off, c.loads, c.steps, st)[0];
  // 4 GPUs of 4 experts per layer each (one EP group: no copies to partition them over), and a quarter (ZeRO's
  // partition over the 4 data-parallel ranks) of the dense parts of 4 layers, embedding and head.
  const double params = 4.0 * 4 * 3 * 256 * 128 + (4 * 19136512.0 + 2 * 151936.0 * 256) / 4;
  const double pcie = off.cost.move.host.gb_per_s * 1e9, lat = off.cost.move.host.latency_us * 1e-6;
  const double expected = lat + params * 4 / pcie + params * 2 / off.cost.move.host.gb_per_s / 1e9 + lat +
                          params * 2 /* GPUs per node */ / (off.cost.cpu_adam_gparams_per_s * 1e9);
  CHECK(cpu.breakdown.optimizer == doctest::Approx(expected).epsilon(1e-12));
  CHECK(cpu.breakdown.optimizer > gpu.breakdown.optimizer); // the HBM step was an undercount
  CHECK(cpu.step_seconds - cpu.breakdown.optimizer ==
        doctest::Approx(gpu.step_seconds - gpu.breakdown.optimizer).epsilon(1e-12));
  // A slower CPU or a narrower PCIe link is never faster.
  SimConfig slow = off;
  slow.cost.cpu_adam_gparams_per_s /= 2;
  CHECK(simulate(slow, c.loads, c.steps, st)[0].step_seconds > cpu.step_seconds);
  slow = off;
  slow.cost.move.host.gb_per_s /= 2;
  CHECK(simulate(slow, c.loads, c.steps, st)[0].step_seconds > cpu.step_seconds);
  slow.cost.cpu_adam_gparams_per_s = 0;
  CHECK_THROWS_WITH_AS((void)simulate(slow, c.loads, c.steps, st),
                       doctest::Contains("cpu_adam_gparams_per_s must be positive and finite, got 0"), Error);
}

namespace {
/// `small_case` with room for every expert on one GPU pair (a pipeline stage of 2 GPUs holds 8 owners each).
Case parallel_case(std::uint64_t seed) {
  Case c = small_case(seed, 3); // two counted steps: the figures are means over them
  c.cfg.topo.slots_per_gpu = 10;
  return c;
}
} // namespace

TEST_CASE("simulate: pipeline and tensor parallelism keep ideal the lower bound and the breakdown whole (property)") {
  const int rounds = 4 * foremoe_test::seed_multiplier();
  const auto strategies = all_strategies();
  for (int r = 0; r < rounds; ++r) {
    Case c = parallel_case(300 + r);
    std::mt19937_64 rng(300 + r);
    c.cfg.pipeline_stages = std::array{1, 2, 4}[rng() % 3];
    // 4 stages of 2 GPUs (of one GPU, EP 1, `ideal` charges all 16 experts active while a plan skips idle ones).
    if (c.cfg.pipeline_stages == 4) c.cfg.topo = Topology{2, 4, 10};
    c.cfg.tensor_parallel = 1 + static_cast<int>(rng() % 2);
    c.cfg.minibatches_per_step = 1 + static_cast<int>(rng() % 2);
    c.cfg.a2a_overlap = static_cast<double>(rng() % 3) * 0.5;
    CAPTURE(r);
    CAPTURE(c.cfg.pipeline_stages);
    CAPTURE(c.cfg.tensor_parallel);
    const auto res = simulate(c.cfg, c.loads, c.steps, strategies);
    const SimResult &ideal = result_of(res, "ideal");
    for (const SimResult &x : res) {
      CAPTURE(x.strategy);
      CHECK(x.step_seconds >= ideal.step_seconds * (1 - 1e-12));
      CHECK(x.breakdown.total() == doctest::Approx(x.step_seconds));
      CHECK((x.breakdown.pipeline > 0) == (c.cfg.pipeline_stages > 1));
      CHECK((x.breakdown.tp_comm > 0) == (c.cfg.tensor_parallel > 1));
    }
  }
}

TEST_CASE("simulate: a pipeline's bubble grows with fewer micro-batches per flush, and never makes a step faster") {
  for (int r = 0; r < 3 * foremoe_test::seed_multiplier(); ++r) {
    Case c = parallel_case(400 + r);
    c.cfg.pipeline_stages = 2;
    c.cfg.optimizer_traffic_bytes_per_param = 0; // the optimizer grows with the mini-batches too: leave it out
    const std::vector<SimStrategy> st{parse_sim_strategy("static"), parse_sim_strategy("foremoe"),
                                      parse_sim_strategy("ideal")};
    const auto one = simulate(c.cfg, c.loads, c.steps, st);
    SimConfig more = c.cfg;
    more.minibatches_per_step = 2; // half the micro-batches per pipeline flush in the update stage
    const auto two = simulate(more, c.loads, c.steps, st);
    for (std::size_t i = 0; i < st.size(); ++i) {
      CAPTURE(st[i].name);
      CHECK(two[i].breakdown.pipeline > one[i].breakdown.pipeline);
      CHECK(two[i].step_seconds > one[i].step_seconds);
    }
    // The bubble is (PP - 1) / m of the pipeline's time: for `ideal` (no stall) at 2 even stages of 2 layers,
    // the update stage's part is (PP - 1) / M x its micro-steps' time.
    const SimResult &id = one[2];
    CHECK(id.breakdown.pipeline > 0);
  }
  // Without a pipeline nothing changes: PP 1 is the model without it, to the bit.
  Case c = parallel_case(7);
  const auto strategies = all_strategies();
  SimConfig explicit_one = c.cfg;
  explicit_one.pipeline_stages = 1;
  explicit_one.tensor_parallel = 1;
  const auto a = simulate(c.cfg, c.loads, c.steps, strategies),
             b = simulate(explicit_one, c.loads, c.steps, strategies);
  for (std::size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].step_seconds == b[i].step_seconds);
    CHECK(a[i].breakdown.pipeline == 0.0);
    CHECK(a[i].breakdown.tp_comm == 0.0);
  }
}

TEST_CASE("simulate: a pipeline stage holds its own layers' experts; TP splits the dense weights and adds its "
          "collectives") {
  Case c = parallel_case(9);
  const std::vector<SimStrategy> st{parse_sim_strategy("static")};
  SimConfig ep2 = c.cfg;
  ep2.ep_size = 2; // the same EP group with and without the pipeline
  const SimResult flat = simulate(ep2, c.loads, c.steps, st)[0];
  SimConfig pp = ep2;
  pp.pipeline_stages = 2;
  const SimResult piped = simulate(pp, c.loads, c.steps, st)[0];
  // Half the layers per GPU: half the expert weights, gradients and optimizer state (the distributed optimizer's
  // shard stays: half the layers over half the EP-group copies).
  CHECK(piped.memory.weights == doctest::Approx(flat.memory.weights / 2));
  CHECK(piped.memory.optimizer == doctest::Approx(flat.memory.optimizer));
  SimConfig whole_flat = ep2, whole_pp = pp;
  whole_flat.distributed_optimizer = whole_pp.distributed_optimizer = false;
  CHECK(simulate(whole_pp, c.loads, c.steps, st)[0].memory.optimizer ==
        doctest::Approx(simulate(whole_flat, c.loads, c.steps, st)[0].memory.optimizer / 2));
  // TP: the dense weight stream over T, plus 4 collectives per layer and pass.
  SimConfig tp = c.cfg;
  tp.tensor_parallel = 2;
  const SimResult t2 = simulate(tp, c.loads, c.steps, st)[0], t1 = simulate(c.cfg, c.loads, c.steps, st)[0];
  CHECK(t2.breakdown.dense < t1.breakdown.dense);
  CHECK(t2.breakdown.tp_comm > 0);
  CHECK(tp.tp_collectives_seconds(100) ==
        doctest::Approx(4 * (tp.cost.a2a.intra_latency_us * 1e-6 + tp.cost.a2a.per_message_us * 1e-6 +
                             2 * 100.0 * 256 * 2 / 2 / (tp.cost.a2a.intra_gb_per_s * 1e9))));
  // Layers split as evenly as possible: the first L % PP stages one more.
  SimConfig five = c.cfg;
  five.model.num_layers = 11;
  five.pipeline_stages = 4;
  CHECK(std::vector<int>{five.stage_first_layer(0), five.stage_first_layer(1), five.stage_first_layer(2),
                         five.stage_first_layer(3), five.stage_first_layer(4)} == std::vector<int>{0, 3, 6, 9, 11});
}

TEST_CASE("simulate: bad pipeline and tensor-parallel sizes are errors naming the value") {
  Case c = parallel_case(3);
  const std::vector<SimStrategy> st{parse_sim_strategy("static")};
  auto err = [&](int pp, int tp) {
    SimConfig x = c.cfg;
    x.pipeline_stages = pp;
    x.tensor_parallel = tp;
    try {
      (void)simulate(x, c.loads, c.steps, st);
    } catch (const Error &e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(err(3, 1).find("pipeline_stages 3 does not divide 4 GPUs") != std::string::npos);
  CHECK(err(0, 1).find("pipeline_stages must be in [1, 4] (one MoE layer per stage at least), got 0") !=
        std::string::npos);
  CHECK(err(8, 1).find("got 8") != std::string::npos);
  CHECK(err(1, 3).find("tensor_parallel 3 must divide the 2 GPUs of a node") != std::string::npos);
  CHECK(err(1, 4).find("tensor_parallel 4 must divide") != std::string::npos);
  CHECK(err(1, 0).find("tensor_parallel 0") != std::string::npos);
  CHECK(err(4, 2).find("tensor_parallel 2 does not divide the 1 GPUs of a pipeline stage") != std::string::npos);
  CHECK(err(2, 2).empty());
}
