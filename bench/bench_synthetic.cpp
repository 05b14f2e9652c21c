// Synthetic GRPO generator throughput: routed ids per second and prompts per second of generate_loads (the
// counting path `foremoe simulate` uses) and generate_trace (ids stored), on the Qwen3-30B-A3B shape (48 layers x
// 128 experts, top-8) with simulate's default lengths and 64 ranks, over 1 RL step of 32 prompts x 8 responses.
// The argument is the thread count (the output does not depend on it). The context records the stream version
// (foremoe::synthetic_stream_version), since each version draws the same model from other random bits.
//
//   bench_synthetic --benchmark_format=json --benchmark_out=synthetic.json

#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>

#include "foremoe/trace/synthetic.hpp"

namespace {

foremoe::SyntheticConfig bench_config() {
  foremoe::SyntheticConfig c;
  c.num_steps = 1;
  c.prompts_per_step = 32;
  c.microbatch_tokens_per_gpu = 8192;
  return c;
}

/// Routed ids of the config: its loads count every (token, layer, slot) once.
std::int64_t ids_of(const foremoe::SyntheticConfig &c) {
  std::int64_t ids = 0;
  for (const auto &t : foremoe::generate_loads(c).totals())
    ids += t;
  return ids;
}

void set_counters(benchmark::State &state, const foremoe::SyntheticConfig &c, std::int64_t ids) {
  state.counters["ids/s"] = benchmark::Counter(static_cast<double>(ids), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["prompts/s"] = benchmark::Counter(static_cast<double>(c.num_steps) * c.prompts_per_step,
                                                   benchmark::Counter::kIsIterationInvariantRate);
}

void BM_generate_loads(benchmark::State &state) {
  const foremoe::SyntheticConfig c = bench_config();
  foremoe::GeneratorOptions opts;
  opts.num_threads = static_cast<int>(state.range(0));
  for (auto _ : state)
    benchmark::DoNotOptimize(foremoe::generate_loads(c, nullptr, false, opts));
  set_counters(state, c, ids_of(c));
}
BENCHMARK(BM_generate_loads)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_generate_trace(benchmark::State &state) {
  foremoe::SyntheticConfig c = bench_config();
  c.prompts_per_step = 8;
  foremoe::GeneratorOptions opts;
  opts.num_threads = static_cast<int>(state.range(0));
  std::int64_t ids = 0;
  for (auto _ : state) {
    const foremoe::SyntheticTrace t = foremoe::generate_trace(c, opts);
    ids = static_cast<std::int64_t>(t.routed_ids.size());
    benchmark::DoNotOptimize(t.routed_ids.data());
  }
  set_counters(state, c, ids);
}
BENCHMARK(BM_generate_trace)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

/// DeepSeek-V3's shape (58 layers x 256 experts, top-8; `SyntheticConfig::deepseek_v3`), the same batch; the argument
/// is 0 without its group limit, 1 with it (8 groups, at most 4 per token). One thread.
void BM_generate_loads_deepseek(benchmark::State &state) {
  foremoe::SyntheticConfig c = foremoe::SyntheticConfig::deepseek_v3();
  const foremoe::SyntheticConfig b = bench_config();
  c.num_steps = b.num_steps;
  c.prompts_per_step = b.prompts_per_step;
  c.microbatch_tokens_per_gpu = b.microbatch_tokens_per_gpu;
  if (state.range(0) == 0) c.route_max_groups = 0;
  foremoe::GeneratorOptions opts;
  opts.num_threads = 1;
  for (auto _ : state)
    benchmark::DoNotOptimize(foremoe::generate_loads(c, nullptr, false, opts));
  set_counters(state, c, ids_of(c));
}
BENCHMARK(BM_generate_loads_deepseek)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

} // namespace

int main(int argc, char **argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("synthetic_stream_version", std::to_string(foremoe::synthetic_stream_version));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
