// Traffic-aware owners (plan/traffic.hpp) on a Qwen3-30B-A3B-sized layer set: 48 layers x 128 experts, top-8, on
// 8 nodes x 8 GPUs x 4 slots (2 owners + 2 replica slots per GPU). One RL step of 8 micro-steps x 8,192 tokens whose
// ids are `skewed_ids` (bench_token_map's) with, per token and layer, half its experts drawn from one of 8 planted
// co-activation clusters of 16 experts (so there is something to find). Items: owner maps per second for the
// owner search, routed ids for the count.
//
//   BM_coactivation_count   count_coactivation over the step's 65,536 tokens
//   BM_count_loads          count_loads over the same tokens, for scale
//   BM_traffic_owners       traffic_aware_owners from plan_owners' map (counters: cut and owner-only remote node
//                           hits per token before and after)
//   BM_plan_step/0 and /1   the whole step's planning, traffic-aware off (plan_step) and on (co-activation count,
//                           plan_owners, traffic_aware_owners, plan_step_with_owners); counter per_micro_step_ms
//
//   bench_traffic --benchmark_format=json --benchmark_out=traffic.json

#include <benchmark/benchmark.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "foremoe/plan/planner.hpp"
#include "foremoe/plan/token_map.hpp"
#include "foremoe/plan/traffic.hpp"
#include "foremoe/trace/count.hpp"
#include "skewed_ids.hpp"

namespace {

constexpr int topk = 8, num_experts = 128, num_layers = 48, micro_steps = 8, clusters = 8;
constexpr std::int64_t tokens_per_micro_step = 8192, num_tokens = tokens_per_micro_step * micro_steps;
const foremoe::Topology topo{8, 8, 4};

struct Step {
  std::vector<std::uint16_t> ids; ///< `[T][L][K]`
  std::vector<std::int64_t> offsets;
  foremoe::LoadTensor loads; ///< `[M][L][E]`
  [[nodiscard]] foremoe::RoutedView view() const {
    return {std::span<const std::uint16_t>(ids), num_tokens, num_layers, topk};
  }
};

const Step &step() {
  static const Step s = [] {
    Step m;
    m.ids = foremoe_bench::skewed_ids(num_tokens, num_layers, topk, num_experts);
    // Half of each (token, layer)'s experts from its cluster (clusters are expert ranges permuted per layer).
    constexpr int size = num_experts / clusters;
    std::uint64_t x = 0x2545F4914F6CDD1Dull;
    for (std::int64_t t = 0; t < num_tokens; ++t)
      for (int l = 0; l < num_layers; ++l) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        const auto c = static_cast<int>(x % clusters);
        const int first = static_cast<int>((x >> 8) % size);
        for (int k = 0; k < topk / 2; ++k) {
          const int e = (c * size + (first + k) % size) * 5 + l; // distinct within the token's half
          m.ids[static_cast<std::size_t>((t * num_layers + l) * topk + k)] =
              static_cast<std::uint16_t>(e % num_experts);
        }
      }
    for (int i = 0; i <= micro_steps; ++i)
      m.offsets.push_back(tokens_per_micro_step * i);
    foremoe::CountOptions o;
    o.num_experts = num_experts;
    o.microbatch_offsets = m.offsets;
    m.loads = foremoe::count_loads(std::span<const std::uint16_t>(m.ids), num_tokens, num_layers, topk, o);
    return m;
  }();
  return s;
}

/// Owner-only remote node hits per token and layer: every expert's tokens on its owner, no source known.
double owner_hits_per_token(const Step &s, const foremoe::OwnerMap &owners) {
  std::vector<std::int32_t> slots(static_cast<std::size_t>(num_tokens) * topk);
  foremoe::NodeHits h;
  for (int l = 0; l < num_layers; ++l) {
    for (std::int64_t t = 0; t < num_tokens; ++t)
      for (int k = 0; k < topk; ++k)
        slots[static_cast<std::size_t>(t * topk + k)] =
            owners[l][s.ids[static_cast<std::size_t>((t * num_layers + l) * topk + k)]] * topo.slots_per_gpu;
    foremoe::add_node_hits(h, slots, topk, topo);
  }
  return static_cast<double>(h.remote_nodes) / static_cast<double>(num_tokens * num_layers);
}

void BM_coactivation_count(benchmark::State &state) {
  const Step &s = step();
  for (auto _ : state) {
    const foremoe::CoActivation co = foremoe::count_coactivation(s.view(), num_experts);
    benchmark::DoNotOptimize(co.pairs.data());
  }
  state.SetItemsProcessed(state.iterations() * num_tokens * num_layers * topk);
}

/// For scale: `count_loads` over the same tokens (what every step counts already).
void BM_count_loads(benchmark::State &state) {
  const Step &s = step();
  foremoe::CountOptions o;
  o.num_experts = num_experts;
  o.microbatch_offsets = s.offsets;
  for (auto _ : state) {
    const foremoe::LoadTensor t =
        foremoe::count_loads(std::span<const std::uint16_t>(s.ids), num_tokens, num_layers, topk, o);
    benchmark::DoNotOptimize(t.totals().data());
  }
  state.SetItemsProcessed(state.iterations() * num_tokens * num_layers * topk);
}

void BM_traffic_owners(benchmark::State &state) {
  const Step &s = step();
  const foremoe::CoActivation co = foremoe::count_coactivation(s.view(), num_experts);
  foremoe::Planner planner(num_layers, num_experts, topo);
  const std::vector<std::int64_t> totals = planner.sum_steps(s.loads);
  const foremoe::OwnerMap start = planner.plan_owners(totals);
  foremoe::OwnerMap got;
  for (auto _ : state) {
    got = foremoe::traffic_aware_owners(totals, co, topo, start);
    benchmark::DoNotOptimize(got.data());
  }
  state.SetItemsProcessed(state.iterations());
  std::int64_t before = 0, after = 0;
  for (int l = 0; l < num_layers; ++l) {
    before += foremoe::coactivation_cut(co, l, start[l], topo);
    after += foremoe::coactivation_cut(co, l, got[l], topo);
  }
  state.counters["cut_before"] = static_cast<double>(before);
  state.counters["cut_after"] = static_cast<double>(after);
  state.counters["remote_nodes_before"] = owner_hits_per_token(s, start);
  state.counters["remote_nodes_after"] = owner_hits_per_token(s, got);
}

void BM_plan_step(benchmark::State &state) {
  const Step &s = step();
  const bool traffic = state.range(0) != 0;
  foremoe::PlannerOptions opts;
  opts.num_threads = 1;
  for (auto _ : state) {
    foremoe::Planner planner(num_layers, num_experts, topo, opts);
    foremoe::StepPlan sp;
    if (traffic) {
      const foremoe::CoActivation co = foremoe::count_coactivation(s.view(), num_experts);
      const std::vector<std::int64_t> totals = planner.sum_steps(s.loads);
      sp = planner.plan_step_with_owners(s.loads,
                                         foremoe::traffic_aware_owners(totals, co, topo, planner.plan_owners(totals)));
    } else {
      sp = planner.plan_step(s.loads);
    }
    benchmark::DoNotOptimize(sp.micro_steps.data());
  }
  state.counters["per_micro_step_ms"] = benchmark::Counter(static_cast<double>(state.iterations()) * micro_steps * 1e-3,
                                                           benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

BENCHMARK(BM_coactivation_count)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_count_loads)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_traffic_owners)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_plan_step)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

} // namespace

BENCHMARK_MAIN();
