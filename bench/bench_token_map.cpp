// Token -> physical slot mapping throughput on a DeepSeek-V3-shaped micro-step: 16k tokens x 58 MoE layers x
// top-8 over 256 experts, planned for 4 nodes x 8 GPUs x 9 slots. Items are routed ids mapped.
//
//   bench_token_map --benchmark_format=json --benchmark_out=token_map.json

#include <benchmark/benchmark.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "foremoe/plan/planner.hpp"
#include "foremoe/plan/split.hpp"
#include "foremoe/plan/token_map.hpp"
#include "foremoe/trace/count.hpp"
#include "skewed_ids.hpp"
#if defined(FOREMOE_BENCH_RUNTIME)
#include "foremoe/runtime/token_map.hpp"
#endif

namespace {

constexpr int num_layers = 58, topk = 8, num_experts = 256;
constexpr std::int64_t num_tokens = 16384;
const foremoe::Topology topo{4, 8, 9};

struct MicroStep {
  std::vector<std::uint16_t> ids; ///< `[T][L][K]`
  std::vector<std::int64_t> source_offsets;
  foremoe::LoadTensor loads;
  std::vector<foremoe::LayerPlan> plans;
  std::vector<foremoe::TokenRanges> ranges, source_ranges;
  std::vector<std::vector<std::int64_t>> source_splits;
};

// Skewed, distinct top-8 experts per (token, layer) (skewed_ids), so the plan replicates.
const MicroStep &micro_step() {
  static const MicroStep ms = [] {
    MicroStep m;
    const int num_gpus = topo.num_gpus();
    foremoe_bench::SkewedStep step = foremoe_bench::skewed_step(num_tokens, num_layers, topk, num_experts, num_gpus);
    m.ids = std::move(step.ids);
    m.source_offsets = std::move(step.source_offsets);
    m.loads = std::move(step.loads);
    foremoe::Planner planner(num_layers, num_experts, topo);
    m.plans = planner.plan(m.loads, 0);
    for (int l = 0; l < num_layers; ++l) {
      const foremoe::LayerPlan &p = m.plans[l];
      m.ranges.push_back(foremoe::token_ranges(p));
      m.source_splits.push_back(foremoe::split_by_source(p.placement, p.slot_tokens, m.loads.layer_by_source(0, l),
                                                         num_gpus, topo.gpus_per_node));
      m.source_ranges.push_back(foremoe::token_ranges(p.placement, m.source_splits.back(), num_gpus));
    }
    return m;
  }();
  return ms;
}

void set_counters(benchmark::State &state) {
  const double ids = static_cast<double>(num_tokens) * num_layers * topk;
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * ids));
  state.counters["Gids_per_s"] = benchmark::Counter(ids * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

foremoe::RoutedView view_of(const MicroStep &m) {
  return foremoe::RoutedView(std::span<const std::uint16_t>(m.ids), num_tokens, num_layers, topk);
}

// The reference, one layer at a time with prebuilt ranges, `[T][K]` output per layer (what a dispatcher reads).
void BM_map_tokens_layers(benchmark::State &state) {
  const MicroStep &m = micro_step();
  const auto view = view_of(m);
  std::vector<std::int32_t> out(static_cast<std::size_t>(num_tokens) * topk);
  for (auto _ : state)
    for (int l = 0; l < num_layers; ++l) {
      foremoe::map_tokens(m.ranges[l], view, l, out);
      benchmark::DoNotOptimize(out.data());
    }
  set_counters(state);
}
BENCHMARK(BM_map_tokens_layers)->Unit(benchmark::kMillisecond)->UseRealTime();

// Per-source ranks and ranges (32 source ranks).
void BM_map_tokens_layers_by_source(benchmark::State &state) {
  const MicroStep &m = micro_step();
  const auto view = view_of(m);
  std::vector<std::int32_t> out(static_cast<std::size_t>(num_tokens) * topk);
  for (auto _ : state)
    for (int l = 0; l < num_layers; ++l) {
      foremoe::map_tokens(m.source_ranges[l], view, l, out, m.source_offsets);
      benchmark::DoNotOptimize(out.data());
    }
  set_counters(state);
}
BENCHMARK(BM_map_tokens_layers_by_source)->Unit(benchmark::kMillisecond)->UseRealTime();

// The whole micro-step from the plans: ranges built every time, output in the ids' `[T][L][K]` shape.
void BM_map_tokens_step(benchmark::State &state) {
  const MicroStep &m = micro_step();
  const auto view = view_of(m);
  for (auto _ : state) {
    auto out = foremoe::map_tokens(std::span<const foremoe::LayerPlan>(m.plans), view);
    benchmark::DoNotOptimize(out.data());
  }
  set_counters(state);
}
BENCHMARK(BM_map_tokens_step)->Unit(benchmark::kMillisecond)->UseRealTime();

#if defined(FOREMOE_BENCH_RUNTIME)
// The runtime's host backend, one call per layer (request checks and range building included).
void BM_runtime_host_map_tokens(benchmark::State &state) {
  const MicroStep &m = micro_step();
  foremoe::runtime::MapRequest req;
  req.ids = m.ids.data();
  req.dtype = foremoe::IdDtype::u16;
  req.num_tokens = num_tokens;
  req.num_layers = num_layers;
  req.topk = topk;
  req.num_experts = num_experts;
  std::vector<std::int32_t> out(static_cast<std::size_t>(num_tokens) * topk);
  for (auto _ : state)
    for (int l = 0; l < num_layers; ++l) {
      req.layer_idx = l;
      req.slot_expert = m.plans[l].placement.phys_to_log();
      req.slot_tokens = m.plans[l].slot_tokens;
      const auto st = foremoe::runtime::map_tokens(foremoe::runtime::Backend::host, req, out);
      if (!st.ok()) {
        state.SkipWithError(st.to_string().c_str());
        return;
      }
      benchmark::DoNotOptimize(out.data());
    }
  set_counters(state);
}
BENCHMARK(BM_runtime_host_map_tokens)->Unit(benchmark::kMillisecond)->UseRealTime();
#endif

} // namespace

BENCHMARK_MAIN();
