// Transfer planning and the host-backend engine on a DeepSeek-V3-shaped layer (256 experts, 4 nodes x 8 GPUs x 9
// slots): moves come from the real planner between two skewed micro-steps.
//
//   bench_transfer --benchmark_format=json --benchmark_out=transfer.json

#include <benchmark/benchmark.h>

#include <memory>
#include <random>
#include <vector>

#include "foremoe/plan/planner.hpp"
#include "foremoe/transfer/transfer_plan.hpp"
#if defined(FOREMOE_BENCH_RUNTIME)
#include "foremoe/runtime/testing.hpp"
#include "foremoe/runtime/transfer_engine.hpp"
#endif

using namespace foremoe;

namespace {

constexpr int num_experts = 256;
const Topology deepseek_topo{4, 8, 9};
// One DeepSeek-V3 expert: gate, up and down projections 7168 x 2048 in fp8 plus 128 x 128 float scales.
constexpr std::int64_t deepseek_expert_bytes = 3 * (7168LL * 2048 + (7168 / 128) * (2048 / 128) * 4);

struct Layer {
  LayerPlacement before;
  std::vector<Move> moves;
};

// Two micro-steps of lognormal loads; the moves of the second from the placement of the first.
Layer deepseek_layer(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> pop(0.0, 1.0);
  Planner planner(1, num_experts, deepseek_topo);
  std::vector<std::int64_t> a(num_experts), b(num_experts);
  for (int e = 0; e < num_experts; ++e) {
    a[e] = static_cast<std::int64_t>(300 * pop(rng));
    b[e] = static_cast<std::int64_t>(300 * pop(rng));
  }
  const auto first = planner.plan(a);
  const Placement resident = to_placement(first);
  const auto second = planner.plan(b, Stage::update, &resident);
  return {resident.layer(0), second[0].moves};
}

void BM_plan_transfers_deepseek(benchmark::State &state) {
  const Layer layer = deepseek_layer(1);
  transfer::Options opt;
  opt.expert_bytes = deepseek_expert_bytes;
  opt.max_chunk_bytes = std::int64_t{8} << 20;
  transfer::TransferPlan tp;
  for (auto _ : state) {
    tp = transfer::plan_transfers(layer.moves, layer.before, deepseek_topo, opt);
    benchmark::DoNotOptimize(tp.chunks.data());
  }
  state.counters["moves"] = static_cast<double>(layer.moves.size());
  state.counters["chunks"] = static_cast<double>(tp.chunks.size());
  state.counters["rounds"] = tp.num_rounds;
  state.counters["modelled_ms"] = tp.est_seconds * 1e3;
  state.counters["link_bound_ms"] = tp.link_bound_seconds * 1e3;
  state.counters["nvlink_share"] = static_cast<double>(tp.path_bytes[0]) /
                                   static_cast<double>(opt.expert_bytes * std::max<std::size_t>(1, layer.moves.size()));
  // Modelled time of the same moves on one path only, for comparison.
  transfer::Options mirror_only = opt;
  mirror_only.split_paths = false;
  const Layer none{LayerPlacement(deepseek_topo.num_gpus(), deepseek_topo.slots_per_gpu, num_experts), layer.moves};
  state.counters["mirror_only_ms"] =
      transfer::plan_transfers(none.moves, none.before, deepseek_topo, mirror_only).est_seconds * 1e3;
}
BENCHMARK(BM_plan_transfers_deepseek)->Unit(benchmark::kMicrosecond);

#if defined(FOREMOE_BENCH_RUNTIME)
// Plans and executes one layer's moves on the host backend (memcpy workers), experts scaled to `range(0)` KiB so the
// 288 slots and four mirrors fit in host memory; `range(1)` = verification on.
void BM_engine_host_deepseek(benchmark::State &state) {
  const Layer layer = deepseek_layer(1);
  const std::int64_t bytes = state.range(0) << 10;
  namespace rt = foremoe::runtime;
  rt::EngineOptions o;
  o.topology = deepseek_topo;
  o.num_experts = num_experts;
  o.tensors = {{0, bytes / 3}, {bytes / 3, bytes / 3}, {2 * (bytes / 3), bytes - 2 * (bytes / 3)}};
  o.planning.max_chunk_bytes = std::max<std::int64_t>(4096, bytes / 4);
  o.verify = state.range(1) != 0;
  std::unique_ptr<rt::TransferEngine> engine;
  if (rt::Status st = rt::TransferEngine::create(o, engine); !st.ok()) {
    state.SkipWithError(st.to_string().c_str());
    return;
  }
  const int num_gpus = deepseek_topo.num_gpus(), slots = deepseek_topo.slots_per_gpu;
  std::vector<std::vector<std::byte>> gpus(num_gpus, std::vector<std::byte>(static_cast<std::size_t>(bytes * slots)));
  std::vector<std::vector<std::byte>> mirrors(deepseek_topo.num_nodes,
                                              std::vector<std::byte>(static_cast<std::size_t>(bytes * num_experts)));
  for (int g = 0; g < num_gpus; ++g)
    if (rt::Status st = engine->register_slots(0, g, {gpus[g].data(), bytes, slots, 1, 0}); !st.ok()) {
      state.SkipWithError(st.to_string().c_str());
      return;
    }
  for (int n = 0; n < deepseek_topo.num_nodes; ++n)
    if (rt::Status st = engine->register_mirror(0, n, {mirrors[n].data(), bytes, num_experts}); !st.ok()) {
      state.SkipWithError(st.to_string().c_str());
      return;
    }
  std::int64_t moved = 0;
  for (auto _ : state) {
    state.PauseTiming();
    const rt::Status reset = engine->set_resident(0, layer.before);
    state.ResumeTiming();
    if (!reset.ok()) {
      state.SkipWithError(reset.to_string().c_str());
      break;
    }
    rt::MoveBatch mb;
    mb.moves = layer.moves;
    rt::Ticket t;
    if (!engine->submit(mb, t).ok() || !t.wait_for(std::chrono::seconds(60)).ok()) {
      state.SkipWithError("batch failed");
      break;
    }
    moved += bytes * static_cast<std::int64_t>(layer.moves.size());
  }
  state.SetBytesProcessed(moved);
  state.counters["moves"] = static_cast<double>(layer.moves.size());
}
BENCHMARK(BM_engine_host_deepseek)
    ->Args({256, 0})
    ->Args({256, 1})
    ->Args({1024, 0})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// The same layer in multi-process use: one engine per node (`range(1)` = 0) or per GPU (1), joined by a HostFabric,
// each submitting the whole batch; in-node moves between processes become paired transfers. 256 KiB experts.
void BM_engine_host_deepseek_processes(benchmark::State &state) {
  const Layer layer = deepseek_layer(1);
  const std::int64_t bytes = state.range(0) << 10;
  const bool per_gpu = state.range(1) != 0;
  namespace rt = foremoe::runtime;
  const int num_gpus = deepseek_topo.num_gpus(), slots = deepseek_topo.slots_per_gpu;
  const int procs = per_gpu ? num_gpus : deepseek_topo.num_nodes;
  auto fabric = std::make_shared<rt::HostFabric>();
  std::vector<std::vector<std::byte>> gpus(num_gpus, std::vector<std::byte>(static_cast<std::size_t>(bytes * slots)));
  std::vector<std::vector<std::byte>> mirrors(deepseek_topo.num_nodes,
                                              std::vector<std::byte>(static_cast<std::size_t>(bytes * num_experts)));
  std::vector<std::unique_ptr<rt::TransferEngine>> engines(static_cast<std::size_t>(procs));
  for (int p = 0; p < procs; ++p) {
    rt::EngineOptions o;
    o.topology = deepseek_topo;
    o.num_experts = num_experts;
    o.tensors = {{0, bytes / 3}, {bytes / 3, bytes / 3}, {2 * (bytes / 3), bytes - 2 * (bytes / 3)}};
    o.planning.max_chunk_bytes = std::max<std::int64_t>(4096, bytes / 4);
    o.host_threads_per_path = 1;
    o.peers.host_fabric = fabric;
    for (int g = 0; g < num_gpus; ++g)
      if ((per_gpu ? g : deepseek_topo.node_of(g)) == p) o.peers.local_gpus.push_back(g);
    rt::Status st = rt::TransferEngine::create(o, engines[p]);
    for (int g : o.peers.local_gpus)
      if (st.ok()) st = engines[p]->register_slots(0, g, {gpus[g].data(), bytes, slots, 1, 0});
    const int node = deepseek_topo.node_of(o.peers.local_gpus.front());
    if (st.ok()) st = engines[p]->register_mirror(0, node, {mirrors[node].data(), bytes, num_experts});
    if (!st.ok()) {
      state.SkipWithError(st.to_string().c_str());
      return;
    }
  }
  std::int64_t moved = 0;
  for (auto _ : state) {
    state.PauseTiming();
    bool ok = true;
    for (auto &e : engines)
      ok = ok && e->set_resident(0, layer.before).ok();
    state.ResumeTiming();
    std::vector<rt::Ticket> tickets(engines.size());
    rt::MoveBatch mb;
    mb.moves = layer.moves;
    for (std::size_t p = 0; p < engines.size() && ok; ++p)
      ok = engines[p]->submit(mb, tickets[p]).ok();
    for (std::size_t p = 0; p < engines.size() && ok; ++p)
      ok = tickets[p].wait_for(std::chrono::seconds(60)).ok();
    if (!ok) {
      state.SkipWithError("batch failed");
      break;
    }
    moved += bytes * static_cast<std::int64_t>(layer.moves.size());
  }
  state.SetBytesProcessed(moved);
  state.counters["moves"] = static_cast<double>(layer.moves.size());
  state.counters["processes"] = procs;
}
BENCHMARK(BM_engine_host_deepseek_processes)
    ->Args({256, 0})
    ->Args({256, 1})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
#endif

} // namespace

BENCHMARK_MAIN();
