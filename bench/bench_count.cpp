// Load counting throughput: routed ids per second on [tokens, 48 layers, top-8]
// uint16 traces, the header-only counter against a naive per-id loop, and the
// runtime's multi-threaded host backend.
//
//   bench_count --benchmark_format=json --benchmark_out=count.json

#include <benchmark/benchmark.h>

#include <cstdint>
#include <map>
#include <vector>

#include "foremoe/trace/count.hpp"
#if defined(FOREMOE_BENCH_RUNTIME)
#include "foremoe/runtime/runtime.hpp"
#endif

namespace {

constexpr int num_layers = 48, topk = 8, num_experts = 128;
constexpr std::int64_t microbatch_tokens = 16384;

struct Trace {
  std::vector<std::uint16_t> ids;
  std::vector<std::int64_t> offsets;
};

// Distinct experts per (token, layer), cheap to generate for billions of ids.
const Trace &trace(std::int64_t num_tokens) {
  static std::map<std::int64_t, Trace> cache;
  auto [it, fresh] = cache.try_emplace(num_tokens);
  if (fresh) {
    Trace &t = it->second;
    t.ids.resize(static_cast<std::size_t>(num_tokens) * num_layers * topk);
    std::uint64_t s = 0x9E3779B97F4A7C15ull;
    std::size_t i = 0;
    for (std::int64_t tok = 0; tok < num_tokens; ++tok)
      for (int l = 0; l < num_layers; ++l) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        const auto base = static_cast<std::uint16_t>(s % num_experts);
        const auto step = static_cast<std::uint16_t>(1 + 2 * ((s >> 20) % 8)); // odd: k distinct ids
        for (int k = 0; k < topk; ++k)
          t.ids[i++] = static_cast<std::uint16_t>((base + k * step) % num_experts);
      }
    for (std::int64_t o = 0; o < num_tokens; o += microbatch_tokens)
      t.offsets.push_back(o);
    t.offsets.push_back(num_tokens);
  }
  return it->second;
}

void set_counters(benchmark::State &state, std::int64_t num_tokens) {
  const double ids = static_cast<double>(num_tokens) * num_layers * topk;
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * ids));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * ids * sizeof(std::uint16_t)));
  state.counters["Gids_per_s"] = benchmark::Counter(ids * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_count_loads(benchmark::State &state) {
  const std::int64_t n = state.range(0);
  const Trace &t = trace(n);
  foremoe::CountOptions o;
  o.num_experts = num_experts;
  o.microbatch_offsets = t.offsets;
  const foremoe::RoutedView view(std::span<const std::uint16_t>(t.ids), n, num_layers, topk);
  for (auto _ : state) {
    auto loads = foremoe::count_loads(view, o);
    benchmark::DoNotOptimize(loads.totals().data());
  }
  set_counters(state, n);
}
BENCHMARK(BM_count_loads)->Arg(1 << 20)->Arg(4 << 20)->Unit(benchmark::kMillisecond)->UseRealTime();

// With a per-token mask (about 1/8 of tokens masked, as left padding): GB/s counts every id read or skipped.
void BM_count_loads_masked(benchmark::State &state) {
  const std::int64_t n = state.range(0);
  const Trace &t = trace(n);
  std::vector<std::uint8_t> mask(static_cast<std::size_t>(n), 1);
  for (std::int64_t i = 0; i < n; i += 1024)
    std::fill_n(mask.begin() + i, std::min<std::int64_t>(128, n - i), std::uint8_t{0});
  foremoe::CountOptions o;
  o.num_experts = num_experts;
  o.microbatch_offsets = t.offsets;
  o.mask = mask;
  const foremoe::RoutedView view(std::span<const std::uint16_t>(t.ids), n, num_layers, topk);
  for (auto _ : state) {
    auto loads = foremoe::count_loads(view, o);
    benchmark::DoNotOptimize(loads.totals().data());
  }
  set_counters(state, n);
}
BENCHMARK(BM_count_loads_masked)->Arg(1 << 20)->Arg(4 << 20)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_count_loads_by_source(benchmark::State &state) {
  const std::int64_t n = state.range(0);
  const Trace &t = trace(n);
  foremoe::CountOptions o;
  o.num_experts = num_experts;
  o.microbatch_offsets = t.offsets;
  o.num_sources = 64;
  const foremoe::RoutedView view(std::span<const std::uint16_t>(t.ids), n, num_layers, topk);
  for (auto _ : state) {
    auto loads = foremoe::count_loads(view, o);
    benchmark::DoNotOptimize(loads.totals().data());
  }
  set_counters(state, n);
}
BENCHMARK(BM_count_loads_by_source)->Arg(1 << 20)->Unit(benchmark::kMillisecond)->UseRealTime();

// The obvious loop a trainer would write: one checked id at a time.
void BM_count_naive(benchmark::State &state) {
  const std::int64_t n = state.range(0);
  const Trace &t = trace(n);
  const foremoe::RoutedView view(std::span<const std::uint16_t>(t.ids), n, num_layers, topk);
  const int M = static_cast<int>(t.offsets.size() - 1);
  for (auto _ : state) {
    std::vector<std::int64_t> out(static_cast<std::size_t>(M) * num_layers * num_experts, 0);
    for (int m = 0; m < M; ++m)
      for (std::int64_t tok = t.offsets[m]; tok < t.offsets[m + 1]; ++tok)
        for (int l = 0; l < num_layers; ++l)
          for (int k = 0; k < topk; ++k) {
            const std::int64_t e = view.at(tok, l, k, num_experts);
            if (e >= 0) ++out[(static_cast<std::size_t>(m) * num_layers + l) * num_experts + e];
          }
    benchmark::DoNotOptimize(out.data());
  }
  set_counters(state, n);
}
BENCHMARK(BM_count_naive)->Arg(1 << 20)->Unit(benchmark::kMillisecond)->UseRealTime();

#if defined(FOREMOE_BENCH_RUNTIME)
void BM_runtime_host_count(benchmark::State &state) {
  const std::int64_t n = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  const Trace &t = trace(n);
  foremoe::runtime::CountRequest req;
  req.ids = t.ids.data();
  req.dtype = foremoe::IdDtype::u16;
  req.num_tokens = n;
  req.num_layers = num_layers;
  req.topk = topk;
  req.num_experts = num_experts;
  req.microbatch_offsets = t.offsets;
  std::vector<std::int64_t> out((t.offsets.size() - 1) * num_layers * num_experts);
  for (auto _ : state) {
    auto st = foremoe::runtime::count_loads(foremoe::runtime::Backend::host, req, out, threads);
    if (!st.ok()) state.SkipWithError(st.to_string().c_str());
    benchmark::DoNotOptimize(out.data());
  }
  set_counters(state, n);
}
BENCHMARK(BM_runtime_host_count)
    ->Args({1 << 20, 1})
    ->Args({1 << 20, 2})
    ->Args({4 << 20, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
#endif

} // namespace

BENCHMARK_MAIN();
