// Load counting throughput: routed ids per second on [tokens, 48 layers, top-8]
// uint16 traces, the header-only counter against a naive per-id loop, and the
// runtime's multi-threaded host backend. Also the simulator's counted all-to-all
// kernel (a2a_volumes_from_routes: one layer's mapped slots, 8 x 8 GPUs x 3 slots)
// against its first, token-by-token version.
//
//   bench_count --benchmark_format=json --benchmark_out=count.json

#include <benchmark/benchmark.h>

#include <cstdint>
#include <map>
#include <vector>

#include "foremoe/cost/comm.hpp"
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

// One layer of one micro-step as the simulator counts it: [tokens][top-8] physical slots of 8 x 8 GPUs x 3 slots
// (the default job's), 8192 tokens per rank; a token's slots are distinct experts' copies (its node more often).
struct LayerSlots {
  std::vector<std::int32_t> slots;
  std::vector<std::int64_t> offsets;
};
constexpr int a2a_nodes = 8, a2a_gpus_per_node = 8, a2a_slots = 3;

const LayerSlots &layer_slots(std::int64_t tokens_per_rank) {
  static std::map<std::int64_t, LayerSlots> cache;
  auto [it, fresh] = cache.try_emplace(tokens_per_rank);
  if (fresh) {
    LayerSlots &t = it->second;
    const int G = a2a_nodes * a2a_gpus_per_node, num_slots = G * a2a_slots;
    std::uint64_t s = 0x2545F4914F6CDD1Dull;
    auto next = [&s] {
      s ^= s << 13;
      s ^= s >> 7;
      s ^= s << 17;
      return s;
    };
    t.offsets.push_back(0);
    for (int r = 0; r < G; ++r) {
      for (std::int64_t tok = 0; tok < tokens_per_rank; ++tok)
        for (int k = 0; k < topk; ++k) {
          const std::uint64_t x = next();
          // Half the routes on the rank's own node, the rest anywhere.
          const int node = x % 2 == 0 ? r / a2a_gpus_per_node : static_cast<int>((x >> 8) % a2a_nodes);
          const int slot = static_cast<int>((x >> 16) % (a2a_gpus_per_node * a2a_slots));
          t.slots.push_back((node * a2a_gpus_per_node * a2a_slots + slot) % num_slots);
        }
      t.offsets.push_back(t.offsets.back() + tokens_per_rank);
    }
  }
  return it->second;
}

template <bool marks> void a2a_volumes_bench(benchmark::State &state) {
  const LayerSlots &t = layer_slots(state.range(0));
  const int G = a2a_nodes * a2a_gpus_per_node;
  for (auto _ : state) {
    const foremoe::A2aVolumes v =
        marks
            ? foremoe::detail::a2a_volumes_from_routes_marks(t.slots, topk, a2a_slots, a2a_gpus_per_node, G, t.offsets)
            : foremoe::a2a_volumes_from_routes(t.slots, topk, a2a_slots, a2a_gpus_per_node, G, t.offsets);
    benchmark::DoNotOptimize(v.nic_send.data());
  }
  const double tokens = static_cast<double>(t.offsets.back());
  state.counters["Mtokens_per_s"] = benchmark::Counter(tokens * 1e-6, benchmark::Counter::kIsIterationInvariantRate);
}
void BM_a2a_volumes_from_routes(benchmark::State &state) { a2a_volumes_bench<false>(state); }
void BM_a2a_volumes_from_routes_marks(benchmark::State &state) { a2a_volumes_bench<true>(state); }
BENCHMARK(BM_a2a_volumes_from_routes)->Arg(8192)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_a2a_volumes_from_routes_marks)->Arg(8192)->Unit(benchmark::kMillisecond)->UseRealTime();

} // namespace

BENCHMARK_MAIN();
