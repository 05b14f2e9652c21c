// GPU tests of the CUDA hot path: a steady state of moves, reductions, asynchronous counting and token mapping
// creates no CUDA resources after warm-up (counted by the engine's `EngineStats::allocations`, which includes the
// CUDA transport's events, pinned blocks and device buffers, and by `Workspace::allocations`), and the asynchronous
// forms return while the stream is still blocked. Compiled always, run only where a CUDA device is present
// (elsewhere exit 77, reported as skipped).

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "foremoe/runtime/runtime.hpp"
#include "foremoe/runtime/token_map.hpp"
#include "foremoe/runtime/transfer_engine.hpp"
#include "gpu_main.hpp"

#if defined(FOREMOE_TEST_HAVE_CUDART)
#include <cuda_runtime_api.h>
#endif

using namespace foremoe;
namespace rt = foremoe::runtime;
using namespace std::chrono_literals;

#if defined(FOREMOE_TEST_HAVE_CUDART)
namespace {

// 1 node x 2 logical GPUs (on device 0) x 2 slots, 3 experts of 64 KiB; GPU 0 owns 0 and 1, GPU 1 owns 2.
struct Engine {
  static constexpr std::int64_t bytes = 64 << 10, grad_bytes = 4096;
  void *slots[2] = {nullptr, nullptr}, *grads[2] = {nullptr, nullptr}, *mirror = nullptr;
  std::unique_ptr<rt::TransferEngine> engine;

  Engine() {
    rt::EngineOptions o;
    o.backend = rt::Backend::cuda;
    o.topology = {1, 2, 2};
    o.num_experts = 3;
    o.tensors = {{0, bytes}};
    o.planning.max_chunk_bytes = bytes / 4;
    o.verify = true;
    o.cuda_device_of_gpu = {0, 0};
    const rt::Status st = rt::TransferEngine::create(o, engine);
    REQUIRE_MESSAGE(st.ok(), st.to_string());
    REQUIRE(cudaMallocHost(&mirror, 3 * bytes) == cudaSuccess);
    std::vector<std::byte> host(3 * bytes);
    for (std::size_t i = 0; i < host.size(); ++i)
      host[i] = static_cast<std::byte>((i * 7 + i / bytes) & 0xff);
    std::memcpy(mirror, host.data(), host.size());
    REQUIRE(engine->register_mirror(0, 0, {mirror, bytes, 3}).ok());
    for (int g = 0; g < 2; ++g) {
      REQUIRE(cudaMalloc(&slots[g], 2 * bytes) == cudaSuccess);
      REQUIRE(cudaMalloc(&grads[g], 2 * grad_bytes) == cudaSuccess);
      REQUIRE(cudaMemset(grads[g], 0, 2 * grad_bytes) == cudaSuccess);
      REQUIRE(engine->register_slots(0, g, {slots[g], bytes, 2, 1, 0}).ok());
      REQUIRE(engine->register_grads(0, g, {grads[g], grad_bytes, 2, 1, 0}, grad_bytes).ok());
    }
    LayerPlacement p(2, 2, 3);
    p.slot(0, 0) = 0, p.slot(0, 1) = 1, p.slot(1, 0) = 2;
    for (auto [g, s, e] : {std::array{0, 0, 0}, {0, 1, 1}, {1, 0, 2}})
      REQUIRE(cudaMemcpy(static_cast<std::byte *>(slots[g]) + s * bytes, host.data() + e * bytes, bytes,
                         cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(engine->set_resident(0, p).ok());
  }
  ~Engine() {
    engine.reset();
    for (int g = 0; g < 2; ++g)
      cudaFree(slots[g]), cudaFree(grads[g]);
    cudaFreeHost(mirror);
  }
  // Moves expert `e` into GPU 1's second slot, the compute stream waiting on the device, then reduces its gradient.
  void micro_step(int e, cudaStream_t stream) {
    const std::vector<Move> moves{{e, host_mirror, 1, 1}};
    rt::MoveBatch mb;
    mb.moves = moves;
    rt::Ticket t;
    REQUIRE(engine->submit(mb, t).ok());
    REQUIRE(t.enqueue_wait(stream).ok());
    REQUIRE(t.wait_for(10s).ok());
    const std::vector<std::int32_t> owner{0, 0, 1};
    rt::ReduceBatch rb;
    rb.owner_gpu = owner;
    rt::Ticket r;
    REQUIRE(engine->submit_reduce(rb, r).ok());
    REQUIRE(r.wait_for(10s).ok());
  }
};

// A one-layer routing of 4096 tokens x top-2 over 8 experts, on the device, with its plan (one copy per expert).
struct Routing {
  static constexpr int T = 4096, K = 2, E = 8;
  std::vector<std::int32_t> ids;
  std::vector<std::int32_t> slot_expert;
  std::vector<std::int64_t> slot_tokens;
  void *d_ids = nullptr, *d_slots = nullptr, *d_loads = nullptr;
  Routing() : ids(T * K), slot_expert(E), slot_tokens(E, 0) {
    for (int i = 0; i < T * K; ++i) {
      ids[i] = (i * 5 + i / 3) % E;
      ++slot_tokens[ids[i]];
    }
    for (int e = 0; e < E; ++e)
      slot_expert[e] = e;
    REQUIRE(cudaMalloc(&d_ids, ids.size() * 4) == cudaSuccess);
    REQUIRE(cudaMalloc(&d_slots, ids.size() * 4) == cudaSuccess);
    REQUIRE(cudaMalloc(&d_loads, E * 8) == cudaSuccess);
    REQUIRE(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
  }
  ~Routing() { cudaFree(d_ids), cudaFree(d_slots), cudaFree(d_loads); }
  rt::CountRequest count() const {
    rt::CountRequest c;
    c.ids = d_ids, c.num_tokens = T, c.num_layers = 1, c.topk = K, c.num_experts = E;
    return c;
  }
  rt::MapRequest map() const {
    rt::MapRequest m;
    m.ids = d_ids, m.num_tokens = T, m.num_layers = 1, m.topk = K, m.num_experts = E;
    m.slot_expert = slot_expert, m.slot_tokens = slot_tokens;
    return m;
  }
  std::span<std::int64_t> loads() const { return {static_cast<std::int64_t *>(d_loads), E}; }
  std::span<std::int32_t> slots() const { return {static_cast<std::int32_t *>(d_slots), ids.size()}; }
};

} // namespace

TEST_CASE("steady micro-steps of moves and reductions create no CUDA resources after warm-up") {
  Engine x;
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  for (int i = 0; i < 4; ++i)
    x.micro_step(i % 2, stream);
  const rt::EngineStats warm = x.engine->stats();
  CHECK(warm.allocations > 0);
  for (int i = 4; i < 40; ++i)
    x.micro_step(i % 2, stream);
  REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
  const rt::EngineStats steady = x.engine->stats();
  CHECK(steady.batches == 80);
  CHECK_MESSAGE(steady.allocations == warm.allocations, "36 steady micro-steps created ",
                steady.allocations - warm.allocations, " CUDA resources");
  cudaStreamDestroy(stream);
}

TEST_CASE("asynchronous counting and mapping: no allocation after warm-up, errors read later") {
  Routing r;
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  rt::Workspace ws(rt::Backend::cuda);
  auto step = [&] {
    REQUIRE(rt::count_loads_async(ws, r.count(), r.loads(), stream).ok());
    REQUIRE(rt::map_tokens_async(ws, r.map(), r.slots(), stream).ok());
    REQUIRE(ws.check(10000).ok());
  };
  for (int i = 0; i < 3; ++i)
    step();
  const std::int64_t warm = ws.allocations();
  CHECK(warm > 0);
  for (int i = 0; i < 50; ++i)
    step();
  CHECK(ws.allocations() == warm);
  std::vector<std::int64_t> loads(Routing::E);
  REQUIRE(cudaMemcpy(loads.data(), r.d_loads, loads.size() * 8, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(std::vector<std::int64_t>(r.slot_tokens.begin(), r.slot_tokens.end()) == loads);

  // A bad id is found on the device and reported by the next check, named as the synchronous form names it.
  std::vector<std::int32_t> bad = r.ids;
  bad[2 * 100 + 1] = 99;
  REQUIRE(cudaMemcpy(r.d_ids, bad.data(), bad.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(rt::count_loads_async(ws, r.count(), r.loads(), stream).ok());
  const rt::Status st = ws.check(10000);
  CHECK(st.code() == rt::StatusCode::invalid_argument);
  CHECK_MESSAGE(st.message().find("expert id 99 at token 100, layer 0, k 1") != std::string::npos, st.message());
  CHECK(ws.check().ok()); // reported once
  CHECK(ws.allocations() == warm);
  cudaStreamDestroy(stream);
}

TEST_CASE("the asynchronous forms return while the stream is blocked") {
  Engine x;
  Routing r;
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  // The stream waits on a move batch whose gate the host has not opened yet.
  rt::HostEvent open;
  const std::vector<Move> moves{{0, host_mirror, 1, 1}};
  rt::MoveBatch mb;
  mb.moves = moves;
  mb.sources_ready.host = &open;
  rt::Ticket t;
  REQUIRE(x.engine->submit(mb, t).ok());
  REQUIRE(t.enqueue_wait(stream).ok());
  rt::Workspace ws(rt::Backend::cuda);
  REQUIRE(rt::count_loads_async(ws, r.count(), r.loads(), stream).ok());
  REQUIRE(rt::map_tokens_async(ws, r.map(), r.slots(), stream).ok());
  CHECK(ws.check(0).code() == rt::StatusCode::in_progress);
  CHECK(ws.check(20).code() == rt::StatusCode::in_progress);
  open.set();
  REQUIRE(t.wait_for(10s).ok());
  CHECK(ws.check(10000).ok());
  cudaStreamDestroy(stream);
}
#endif

int main(int argc, char **argv) { return foremoe_test::gpu_test_main(argc, argv); }
