// GPU tests of the transfer engine's CUDA backend: compiled always, run only where a CUDA device is present
// (elsewhere exit 77, reported as skipped). Several logical GPUs may map onto one device, so one GPU exercises both
// paths: pinned host mirror -> device, and device -> device.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "foremoe/runtime/grad_add.hpp"
#include "foremoe/runtime/runtime.hpp"
#include "foremoe/runtime/testing.hpp"
#include "foremoe/runtime/transfer_engine.hpp"

#if defined(FOREMOE_TEST_HAVE_CUDART)
#include <cuda_runtime_api.h>
#endif

using namespace foremoe;
namespace rt = foremoe::runtime;
using namespace std::chrono_literals;

#if defined(FOREMOE_TEST_HAVE_CUDART)
namespace {

std::byte pattern(int e, std::int64_t i) { return static_cast<std::byte>((e * 37 + i * 11 + (i >> 10)) & 0xff); }

// `num_gpus` logical GPUs on the devices in `dev`, each with `slots` device slots, and one pinned mirror.
struct DeviceCluster {
  int num_gpus, slots, num_experts;
  std::int64_t bytes;
  std::vector<void *> mem;
  void *mirror = nullptr;
  std::unique_ptr<rt::TransferEngine> engine;

  DeviceCluster(int g, int s, int e, std::int64_t b, std::shared_ptr<rt::FaultSchedule> faults = nullptr)
      : num_gpus(g), slots(s), num_experts(e), bytes(b) {
    int n = 0;
    REQUIRE(cudaGetDeviceCount(&n) == cudaSuccess);
    rt::EngineOptions o;
    o.backend = rt::Backend::cuda;
    o.topology = {1, g, s};
    o.num_experts = e;
    o.tensors = {{0, b / 2}, {b / 2 + 256, b - b / 2}};
    o.planning.max_chunk_bytes = std::max<std::int64_t>(4096, b / 3);
    o.verify = true;
    o.faults = std::move(faults);
    for (int i = 0; i < g; ++i)
      o.cuda_device_of_gpu.push_back(i % n);
    const rt::Status st = rt::TransferEngine::create(o, engine);
    REQUIRE_MESSAGE(st.ok(), st.to_string());
    const std::int64_t stride = b + 256;
    REQUIRE(cudaMallocHost(&mirror, static_cast<std::size_t>(stride * e)) == cudaSuccess);
    auto *m = static_cast<std::byte *>(mirror);
    for (int x = 0; x < e; ++x)
      for (const auto &t : o.tensors)
        for (std::int64_t i = 0; i < t.num_bytes; ++i)
          m[x * stride + t.offset_bytes + i] = pattern(x, t.offset_bytes + i);
    REQUIRE(engine->register_mirror(0, 0, {mirror, stride, e}).ok());
    LayerPlacement p(g, s, e);
    for (int i = 0; i < g; ++i) {
      REQUIRE(cudaSetDevice(i % n) == cudaSuccess);
      void *d = nullptr;
      REQUIRE(cudaMalloc(&d, static_cast<std::size_t>(stride * s)) == cudaSuccess);
      mem.push_back(d);
      REQUIRE(engine->register_slots(0, i, {d, stride, s, 1, 0}).ok());
      // Slot 0 of GPU i holds expert i (copied from the mirror with a plain copy).
      REQUIRE(cudaMemcpy(d, m + i * stride, static_cast<std::size_t>(stride), cudaMemcpyHostToDevice) == cudaSuccess);
      p.slot(i, 0) = i;
    }
    REQUIRE(engine->set_resident(0, p).ok());
  }
  ~DeviceCluster() {
    engine.reset();
    for (void *d : mem)
      cudaFree(d);
    cudaFreeHost(mirror);
  }
  bool holds(int g, int s, int e) {
    std::vector<std::byte> host(static_cast<std::size_t>(bytes + 256));
    if (cudaMemcpy(host.data(), static_cast<std::byte *>(mem[g]) + s * (bytes + 256), host.size(),
                   cudaMemcpyDeviceToHost) != cudaSuccess)
      return false;
    for (std::int64_t i = 0; i < bytes / 2; ++i)
      if (host[i] != pattern(e, i)) return false;
    for (std::int64_t i = bytes / 2 + 256; i < bytes + 256; ++i)
      if (host[i] != pattern(e, i)) return false;
    return true;
  }
};

} // namespace

TEST_CASE("CUDA engine: random moves over both paths land verified") {
  std::mt19937_64 rng(3);
  for (int run = 0; run < 10; ++run) {
    const int g = 2 + int(rng() % 3), s = 3;
    DeviceCluster c(g, s, g + 4, 1 + std::int64_t(rng() % (4 << 20)));
    std::vector<Move> moves;
    LayerPlacement target = c.engine->resident(0);
    for (int i = 0; i < g; ++i)
      for (int sl = 1; sl < s; ++sl) {
        const int e = int(rng() % c.num_experts);
        if (target.holds(i, e)) continue;
        target.slot(i, sl) = e;
        moves.push_back({e, host_mirror, i, sl});
      }
    rt::MoveBatch mb;
    mb.moves = moves;
    rt::Ticket t;
    REQUIRE(c.engine->submit(mb, t).ok());
    const rt::Status st = t.wait_for(30s);
    REQUIRE_MESSAGE(st.ok(), st.to_string());
    bool used_gpu_path = false;
    for (const auto &x : t.telemetry()) {
      CHECK(x.verified);
      used_gpu_path = used_gpu_path || x.path == transfer::Path::nvlink;
    }
    for (const Move &m : moves)
      CHECK(c.holds(m.dst_gpu, m.dst_slot, m.expert));
    (void)used_gpu_path;
  }
}

TEST_CASE("CUDA engine: a failing path falls back to the other one; device checksums catch truncation") {
  auto f = std::make_shared<rt::FaultSchedule>();
  f->fail_path[static_cast<int>(transfer::Path::pcie)] = true;
  f->corrupt_probability = 0.3;
  f->seed = 11;
  DeviceCluster c(2, 2, 4, 3 << 20, f);
  const std::vector<Move> moves{{0, 0, 1, 1}, {1, 1, 0, 1}};
  rt::MoveBatch mb;
  mb.moves = moves;
  rt::Ticket t;
  REQUIRE(c.engine->submit(mb, t).ok());
  const rt::Status st = t.wait_for(30s);
  const auto tel = t.telemetry();
  for (std::size_t i = 0; i < moves.size(); ++i)
    if (tel[i].ok) CHECK(c.holds(moves[i].dst_gpu, moves[i].dst_slot, moves[i].expert));
  CHECK(st.ok() == (tel[0].ok && tel[1].ok));
}

TEST_CASE("CUDA engine: moves wait for the producer event; a compute stream waits for the moves") {
  DeviceCluster c(2, 2, 4, 8 << 20);
  cudaStream_t producer, consumer;
  REQUIRE(cudaStreamCreateWithFlags(&producer, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamCreateWithFlags(&consumer, cudaStreamNonBlocking) == cudaSuccess);
  // The producer rewrites GPU 0 slot 0 (expert 0) from the mirror copy of expert 0 after a delay; moves from it
  // must see those bytes, not garbage written first.
  REQUIRE(cudaMemset(c.mem[0], 0, static_cast<std::size_t>(c.bytes + 256)) == cudaSuccess);
  REQUIRE(cudaMemcpyAsync(c.mem[0], c.mirror, static_cast<std::size_t>(c.bytes + 256), cudaMemcpyHostToDevice,
                          producer) == cudaSuccess);
  cudaEvent_t ready;
  REQUIRE(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming) == cudaSuccess);
  REQUIRE(cudaEventRecord(ready, producer) == cudaSuccess);
  const std::vector<Move> moves{{0, 0, 1, 1}};
  rt::MoveBatch mb;
  mb.moves = moves;
  mb.sources_ready.cuda_event = ready;
  rt::Ticket t;
  REQUIRE(c.engine->submit(mb, t).ok());
  REQUIRE(t.enqueue_wait(consumer).ok());
  // Work on the consumer after the wait reads the moved slot: copy it out and compare on the host.
  std::vector<std::byte> out(static_cast<std::size_t>(c.bytes + 256));
  REQUIRE(cudaMemcpyAsync(out.data(), static_cast<std::byte *>(c.mem[1]) + (c.bytes + 256), out.size(),
                          cudaMemcpyDeviceToHost, consumer) == cudaSuccess);
  REQUIRE(t.wait_for(30s).ok());
  REQUIRE(cudaStreamSynchronize(consumer) == cudaSuccess);
  for (std::int64_t i = 0; i < c.bytes / 2; ++i)
    REQUIRE(out[i] == pattern(0, i));
  cudaEventDestroy(ready);
  cudaStreamDestroy(producer);
  cudaStreamDestroy(consumer);
}

TEST_CASE("CUDA engine: moves do not overwrite a slot before its last use (slots_free event)") {
  DeviceCluster c(2, 2, 4, 8 << 20);
  cudaStream_t compute;
  REQUIRE(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking) == cudaSuccess);
  // The "last use" of GPU 1 slot 1: a long copy (a few ms), then a write of a marker into the slot, then the
  // event. A move that ignored the event would land first and be overwritten by the marker.
  const std::size_t big = std::size_t{2} << 30;
  void *a = nullptr, *b = nullptr;
  REQUIRE(cudaSetDevice(1 % std::max(1, rt::build_info().num_devices)) == cudaSuccess);
  REQUIRE(cudaMalloc(&a, big) == cudaSuccess);
  REQUIRE(cudaMalloc(&b, big) == cudaSuccess);
  std::byte *slot = static_cast<std::byte *>(c.mem[1]) + (c.bytes + 256);
  REQUIRE(cudaMemcpyAsync(b, a, big, cudaMemcpyDeviceToDevice, compute) == cudaSuccess);
  REQUIRE(cudaMemcpyAsync(b, a, big, cudaMemcpyDeviceToDevice, compute) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(slot, 0xab, static_cast<std::size_t>(c.bytes + 256), compute) == cudaSuccess);
  cudaEvent_t last_use;
  REQUIRE(cudaEventCreateWithFlags(&last_use, cudaEventDisableTiming) == cudaSuccess);
  REQUIRE(cudaEventRecord(last_use, compute) == cudaSuccess);
  const std::vector<Move> moves{{2, host_mirror, 1, 1}};
  rt::MoveBatch mb;
  mb.moves = moves;
  mb.slots_free.cuda_event = last_use;
  rt::Ticket t;
  REQUIRE(c.engine->submit(mb, t).ok());
  REQUIRE(t.wait_for(30s).ok());
  REQUIRE(cudaStreamSynchronize(compute) == cudaSuccess);
  CHECK(c.holds(1, 1, 2));
  cudaEventDestroy(last_use);
  cudaStreamDestroy(compute);
  cudaFree(a);
  cudaFree(b);
}

TEST_CASE("CUDA engine: replica gradients reduce on the device") {
  DeviceCluster c(2, 2, 2, 1 << 12);
  LayerPlacement p(2, 2, 2);
  p.slot(0, 0) = 0;
  p.slot(1, 0) = 1;
  p.slot(1, 1) = 0; // replica of expert 0 on GPU 1
  REQUIRE(c.engine->set_resident(0, p).ok());
  const int n = 1 << 16;
  std::vector<float> g0(2 * n), g1(2 * n);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (auto &x : g0)
    x = nd(rng);
  for (auto &x : g1)
    x = nd(rng);
  void *d0, *d1;
  REQUIRE(cudaMalloc(&d0, g0.size() * 4) == cudaSuccess);
  REQUIRE(cudaMalloc(&d1, g1.size() * 4) == cudaSuccess);
  REQUIRE(cudaMemcpy(d0, g0.data(), g0.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(cudaMemcpy(d1, g1.data(), g1.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(c.engine->register_grads(0, 0, {d0, n * 4, 2, 1, 0}, n * 4).ok());
  REQUIRE(c.engine->register_grads(0, 1, {d1, n * 4, 2, 1, 0}, n * 4).ok());
  const std::vector<std::int32_t> owner{0, 1};
  rt::ReduceBatch rb;
  rb.owner_gpu = owner;
  rt::Ticket t;
  REQUIRE(c.engine->submit_reduce(rb, t).ok());
  REQUIRE(t.wait_for(30s).ok());
  std::vector<float> got(n);
  REQUIRE(cudaMemcpy(got.data(), d0, n * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  for (int i = 0; i < n; ++i)
    REQUIRE(got[i] == g0[i] + g1[n + i]);
  // Held-gradient rule: the selected replica returns once more, then its gradient is zeroed on its device.
  const std::vector<rt::ReplicaRef> returns{{1, 0}};
  rb.select = true;
  rb.returns = returns;
  REQUIRE(c.engine->submit_reduce(rb, t).ok());
  REQUIRE(t.wait_for(30s).ok());
  REQUIRE(cudaMemcpy(got.data(), d0, n * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  for (int i = 0; i < n; ++i)
    REQUIRE(got[i] == (g0[i] + g1[n + i]) + g1[n + i]);
  REQUIRE(cudaMemcpy(got.data(), static_cast<float *>(d1) + n, n * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(std::all_of(got.begin(), got.end(), [](float x) { return x == 0.0f; }));
  cudaFree(d0);
  cudaFree(d1);
}

TEST_CASE("CUDA engine: split replica gradients in every dtype add as the host reference does, bit for bit") {
  const rt::GradType types[] = {rt::GradType::f64, rt::GradType::bf16, rt::GradType::f16, rt::GradType::f32};
  for (const rt::GradType type : types) {
    DeviceCluster c(2, 2, 2, 1 << 12); // two tensors: split gradient regions of two tensors per GPU
    LayerPlacement p(2, 2, 2);
    p.slot(0, 0) = 0;
    p.slot(1, 0) = 1;
    p.slot(1, 1) = 0;
    REQUIRE(c.engine->set_resident(0, p).ok());
    const std::int64_t n = (1 << 15) + 3, bytes = n * rt::grad_type_bytes(type), stride = bytes + 64;
    // Tensor ti of GPU g's slot s at mem_g + (ti * 2 + s) * stride.
    std::vector<std::byte> h0(static_cast<std::size_t>(4 * stride)), h1(h0.size());
    std::mt19937_64 rng(static_cast<std::uint64_t>(type) + 1);
    std::normal_distribution<float> nd;
    auto fill = [&](std::vector<std::byte> &h) {
      for (std::int64_t i = 0; i < 4 * stride / rt::grad_type_bytes(type); ++i) {
        const float x = std::ldexp(nd(rng), static_cast<int>(rng() % 13) - 6);
        std::byte *at = h.data() + i * rt::grad_type_bytes(type);
        if (type == rt::GradType::f32) std::memcpy(at, &x, 4);
        if (type == rt::GradType::f64) {
          const double d = static_cast<double>(x) * (1.0 + 1e-9);
          std::memcpy(at, &d, 8);
        }
        const std::uint16_t b = type == rt::GradType::bf16 ? rt::float_to_bf16(x) : rt::float_to_f16(x);
        if (rt::grad_type_bytes(type) == 2) std::memcpy(at, &b, 2);
      }
    };
    fill(h0);
    fill(h1);
    void *d0, *d1;
    REQUIRE(cudaMalloc(&d0, h0.size()) == cudaSuccess);
    REQUIRE(cudaMalloc(&d1, h1.size()) == cudaSuccess);
    REQUIRE(cudaMemcpy(d0, h0.data(), h0.size(), cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(d1, h1.data(), h1.size(), cudaMemcpyHostToDevice) == cudaSuccess);
    for (int g = 0; g < 2; ++g) {
      rt::SlotRegion r{nullptr, 0, 2, 1, 0};
      auto *base = static_cast<std::byte *>(g == 0 ? d0 : d1);
      r.tensors = {{base, stride, 0}, {base + 2 * stride, stride, 0}};
      REQUIRE(c.engine->register_grads(0, g, r, rt::GradLayout{type, {bytes, bytes}}).ok());
    }
    const std::vector<std::int32_t> owner{0, 1};
    rt::ReduceBatch rb;
    rb.owner_gpu = owner;
    rt::Ticket t;
    REQUIRE(c.engine->submit_reduce(rb, t).ok());
    REQUIRE(t.wait_for(30s).ok());
    std::vector<std::byte> got(h0.size()), want = h0;
    for (int ti = 0; ti < 2; ++ti) // GPU 1 slot 1 into GPU 0 slot 0, each tensor
      rt::add_grads(want.data() + ti * 2 * stride, h1.data() + (ti * 2 + 1) * stride, n, type);
    REQUIRE(cudaMemcpy(got.data(), d0, got.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK_MESSAGE(got == want, rt::to_string(type));
    cudaFree(d0);
    cudaFree(d1);
  }
}
#endif

int main(int argc, char **argv) {
#if defined(FOREMOE_TEST_HAVE_CUDART)
  if (rt::build_info().num_devices > 0) {
    doctest::Context ctx(argc, argv);
    return ctx.run();
  }
#else
  (void)argc;
  (void)argv;
#endif
  std::puts("gpu_test_transfer: no CUDA device (or runtime built without CUDA), skipped");
  return 77;
}
