// The node-affine token map against the positional one on one layer of a realistic micro-step: 16,384 tokens x
// top-8 over 128 experts, planned by foremoe for 8 nodes x 8 GPUs x 4 slots (2 owners + 2 replica slots per GPU),
// tokens grouped by source GPU and split by source. Items are routed ids mapped; the counters give each rule's
// remote node hits per token (the inter-node token copies of the hierarchical all-to-all). `by_source`: the
// split_by_source split, each source mapped within its counts; `one_source`: the plan's per-copy totals alone
// (positional then ignores where tokens come from); `one_source_homes`: node_affine told each token's source GPU,
// so it also chooses how each copy's count divides among the sources.
//
//   bench_token_affinity --benchmark_format=json --benchmark_out=token_affinity.json

#include <benchmark/benchmark.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "foremoe/plan/planner.hpp"
#include "foremoe/plan/split.hpp"
#include "foremoe/plan/token_map.hpp"
#include "foremoe/trace/count.hpp"
#include "skewed_ids.hpp"

namespace {

constexpr int topk = 8, num_experts = 128;
constexpr std::int64_t num_tokens = 16384;
const foremoe::Topology topo{8, 8, 4};

struct Layer {
  std::vector<std::uint16_t> ids; ///< `[T][1][K]`
  std::vector<std::int64_t> source_offsets;
  foremoe::TokenRanges by_source, one_source;
};

// Skewed, distinct top-8 experts per token (skewed_ids, as bench_token_map), so the plan replicates hot experts.
const Layer &layer() {
  static const Layer ly = [] {
    Layer m;
    const int num_gpus = topo.num_gpus();
    foremoe_bench::SkewedStep step = foremoe_bench::skewed_step(num_tokens, 1, topk, num_experts, num_gpus);
    m.ids = std::move(step.ids);
    m.source_offsets = std::move(step.source_offsets);
    const foremoe::LoadTensor &loads = step.loads;
    foremoe::Planner planner(1, num_experts, topo);
    const foremoe::LayerPlan p = planner.plan(loads, 0).front();
    const auto split =
        foremoe::split_by_source(p.placement, p.slot_tokens, loads.layer_by_source(0, 0), num_gpus, topo.gpus_per_node);
    m.by_source = foremoe::token_ranges(p.placement, split, num_gpus);
    m.one_source = foremoe::token_ranges(p);
    return m;
  }();
  return ly;
}

/// `homes`: one source with each token's source GPU known (`home_offsets`), the map choosing the split by source.
void run(benchmark::State &state, foremoe::TokenMapRule rule, bool by_source, bool homes = false) {
  const Layer &m = layer();
  const foremoe::RoutedView view(std::span<const std::uint16_t>(m.ids), num_tokens, 1, topk);
  foremoe::TokenMapOptions opts;
  opts.rule = rule;
  opts.topo = topo;
  if (homes) opts.home_offsets = m.source_offsets;
  const auto &ranges = by_source ? m.by_source : m.one_source;
  const std::span<const std::int64_t> so =
      by_source ? std::span<const std::int64_t>(m.source_offsets) : std::span<const std::int64_t>();
  std::vector<std::int32_t> out(static_cast<std::size_t>(num_tokens) * topk);
  for (auto _ : state) {
    foremoe::map_tokens(ranges, view, 0, out, so, opts);
    benchmark::DoNotOptimize(out.data());
  }
  const double ids = static_cast<double>(num_tokens) * topk;
  state.SetItemsProcessed(static_cast<std::int64_t>(static_cast<double>(state.iterations()) * ids));
  // Hits counted from each token's source GPU (the micro-step's grouping) under both splits.
  const foremoe::NodeHits h = foremoe::count_node_hits(out, topk, topo, m.source_offsets);
  state.counters["remote_nodes_per_token"] = static_cast<double>(h.remote_nodes) / static_cast<double>(num_tokens);
  state.counters["remote_gpus_per_token"] = static_cast<double>(h.remote_gpus) / static_cast<double>(num_tokens);
}

void BM_positional_by_source(benchmark::State &state) { run(state, foremoe::TokenMapRule::positional, true); }
void BM_node_affine_by_source(benchmark::State &state) { run(state, foremoe::TokenMapRule::node_affine, true); }
void BM_positional_one_source(benchmark::State &state) { run(state, foremoe::TokenMapRule::positional, false); }
void BM_node_affine_one_source(benchmark::State &state) { run(state, foremoe::TokenMapRule::node_affine, false); }
void BM_node_affine_one_source_homes(benchmark::State &state) {
  run(state, foremoe::TokenMapRule::node_affine, false, true);
}
BENCHMARK(BM_positional_by_source)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_node_affine_by_source)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_positional_one_source)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_node_affine_one_source)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_node_affine_one_source_homes)->Unit(benchmark::kMicrosecond)->UseRealTime();

} // namespace

BENCHMARK_MAIN();
