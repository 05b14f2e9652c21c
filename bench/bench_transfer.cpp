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
#include <array>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <span>
#include <thread>

#include "foremoe/runtime/testing.hpp"
#include "foremoe/runtime/transfer_engine.hpp"
#include "foremoe/runtime/transport.hpp"
namespace rt_bench = foremoe::runtime;
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

// The latency floor of a small batch between processes: two engines (one GPU each, as two trainer ranks), each
// submitting the same batch of `moves` experts each way of `range(0)` KiB, joined by a PeerBridge (`range(1)` =
// 1: an in-process bridge with a worker thread per engine, as foremoe.torch's process-group bridge has) or by a
// HostFabric (0). Wall time per batch, submit to both tickets done.
struct MiniBridge final : rt_bench::PeerBridge {
  // Messages per (source GPU, destination GPU) in send order: sends deposit, receives wait (10 s deadline).
  struct Board {
    std::mutex mu;
    std::condition_variable cv;
    std::map<std::pair<int, int>, std::deque<std::pair<std::vector<std::byte>, std::array<std::uint64_t, 2>>>> q;
  };
  explicit MiniBridge(std::shared_ptr<Board> b) : board(std::move(b)), worker([this] { work(); }) {}
  ~MiniBridge() override {
    {
      std::lock_guard lock(mu);
      stop = true;
    }
    cv.notify_all();
    worker.join();
  }
  void post(std::span<rt_bench::PeerOp> ops, Done done) override {
    {
      std::lock_guard lock(mu);
      groups.emplace_back(ops, std::move(done));
    }
    cv.notify_all();
  }
  void work() {
    std::unique_lock lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return stop || !groups.empty(); });
      if (groups.empty()) return;
      auto [ops, done] = std::move(groups.front());
      groups.pop_front();
      lock.unlock();
      done(run(ops));
      lock.lock();
    }
  }
  rt_bench::Status run(std::span<rt_bench::PeerOp> ops) {
    std::unique_lock lock(board->mu);
    for (const rt_bench::PeerOp &op : ops)
      if (op.send)
        board->q[{op.local_gpu, op.peer_gpu}].emplace_back(std::vector<std::byte>(op.buf, op.buf + op.num_bytes),
                                                           std::array<std::uint64_t, 2>{op.header[0], op.header[1]});
    board->cv.notify_all();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (rt_bench::PeerOp &op : ops) {
      if (op.send) continue;
      auto &q = board->q[{op.peer_gpu, op.local_gpu}];
      if (!board->cv.wait_until(lock, deadline, [&] { return !q.empty(); }))
        return {rt_bench::StatusCode::timed_out, "bench bridge: no message within 10 s"};
      auto m = std::move(q.front());
      q.pop_front();
      if (static_cast<std::int64_t>(m.first.size()) != op.num_bytes)
        return {rt_bench::StatusCode::device_error, "bench bridge: size mismatch"};
      std::copy(m.first.begin(), m.first.end(), op.buf);
      op.header[0] = m.second[0];
      op.header[1] = m.second[1];
    }
    return rt_bench::Status::success();
  }
  std::shared_ptr<Board> board;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<std::span<rt_bench::PeerOp>, Done>> groups;
  bool stop = false;
  std::thread worker; // last: starts once the rest is built
};

void BM_engine_small_batch_latency(benchmark::State &state) {
  namespace rt = foremoe::runtime;
  const std::int64_t bytes = state.range(0) << 10;
  const bool bridged = state.range(1) != 0;
  constexpr int moves = 4, slots = 2 * moves, experts = 2 * moves;
  const Topology topo{1, 2, slots};
  auto fabric = std::make_shared<rt::HostFabric>();
  auto board = std::make_shared<MiniBridge::Board>();
  std::vector<std::vector<std::byte>> gpus(2, std::vector<std::byte>(static_cast<std::size_t>(bytes * slots)));
  std::vector<std::unique_ptr<rt::TransferEngine>> engines(2);
  // Rank r owns experts r*moves .. r*moves+moves-1 in its first slots; each moves to the other rank's spare slots.
  LayerPlacement before(2, slots, experts);
  std::vector<Move> mv;
  for (int e = 0; e < experts; ++e) {
    const int owner = e / moves;
    before.slot(owner, e % moves) = e;
    mv.push_back({e, owner, 1 - owner, moves + e % moves});
  }
  for (int p = 0; p < 2; ++p) {
    rt::EngineOptions o;
    o.topology = topo;
    o.num_experts = experts;
    o.tensors = {{0, bytes}};
    o.host_threads_per_path = 1;
    o.planning.host_mirror = false; // GPU-direct only: every move is a paired transfer
    o.peers.local_gpus = {p};
    if (bridged)
      o.peers.bridge = std::make_shared<MiniBridge>(board);
    else
      o.peers.host_fabric = fabric;
    rt::Status st = rt::TransferEngine::create(o, engines[p]);
    if (st.ok()) st = engines[p]->register_slots(0, p, {gpus[p].data(), bytes, slots, 1, 0});
    if (!st.ok()) {
      state.SkipWithError(st.to_string().c_str());
      return;
    }
  }
  for (auto _ : state) {
    state.PauseTiming();
    bool ok = true;
    for (auto &e : engines)
      ok = ok && e->set_resident(0, before).ok();
    state.ResumeTiming();
    std::vector<rt::Ticket> tickets(engines.size());
    rt::MoveBatch mb;
    mb.moves = mv;
    mb.timeout = std::chrono::seconds(60);
    for (std::size_t p = 0; p < engines.size() && ok; ++p)
      ok = engines[p]->submit(mb, tickets[p]).ok();
    for (std::size_t p = 0; p < engines.size() && ok; ++p)
      ok = tickets[p].wait_for(std::chrono::seconds(60)).ok();
    if (!ok) {
      state.SkipWithError("batch failed");
      break;
    }
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * 2 * moves * bytes);
  state.counters["bridge"] = bridged ? 1 : 0;
}
BENCHMARK(BM_engine_small_batch_latency)
    ->Args({64, 1})
    ->Args({64, 0})
    ->Args({1024, 1})
    ->Args({1024, 0})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
#endif

} // namespace

BENCHMARK_MAIN();
