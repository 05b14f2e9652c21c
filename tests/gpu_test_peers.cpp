// GPU test of multi-process use over NCCL: two engines in one process stand for two processes, each driving one
// GPU on its own device with its own NCCL communicator rank; moves between them are ncclSend/ncclRecv groups.
// Needs two CUDA devices and NCCL; elsewhere exit 77 (reported as skipped).

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <array>
#include <cstdio>
#include <thread>
#include <vector>

#include "foremoe/runtime/runtime.hpp"
#include "foremoe/runtime/transfer_engine.hpp"

#if defined(FOREMOE_TEST_HAVE_CUDART) && defined(FOREMOE_TEST_HAVE_NCCL)
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "gpu_ranks.hpp"
#define FOREMOE_PEERS_TEST 1
#endif

using namespace foremoe;
namespace rt = foremoe::runtime;
using namespace std::chrono_literals;

#if defined(FOREMOE_PEERS_TEST)
namespace {

std::byte pattern(int e, std::int64_t i) { return static_cast<std::byte>((e * 53 + i * 13 + (i >> 11)) & 0xff); }

using foremoe_test::on_both_ranks;

TEST_CASE("two engines, two devices, NCCL: moves and replica gradients cross between them") {
  ncclComm_t comms[2];
  const int devs[2] = {0, 1};
  REQUIRE(ncclCommInitAll(comms, 2, devs) == ncclSuccess);
  constexpr std::int64_t bytes = 3 << 20, stride = bytes + 512, grad_bytes = 1 << 20;
  constexpr int slots = 2, experts = 2;
  std::vector<void *> mem(2), grads(2);
  std::vector<std::unique_ptr<rt::TransferEngine>> engines(2);
  for (int g = 0; g < 2; ++g) {
    rt::EngineOptions o;
    o.backend = rt::Backend::cuda;
    o.topology = {2, 1, slots}; // two nodes: the network path
    o.num_experts = experts;
    o.tensors = {{0, bytes / 3}, {bytes / 3 + 512, bytes - bytes / 3}};
    o.planning.host_mirror = false;
    o.planning.max_chunk_bytes = 1 << 20;
    o.verify = true;
    o.peers.local_gpus = {g};
    o.peers.nccl_comm_of_gpu = {g == 0 ? comms[0] : nullptr, g == 1 ? comms[1] : nullptr};
    o.cuda_device_of_gpu = {g == 0 ? 0 : -1, g == 1 ? 1 : -1};
    const rt::Status st = rt::TransferEngine::create(o, engines[g]);
    REQUIRE_MESSAGE(st.ok(), st.to_string());
    REQUIRE(cudaSetDevice(g) == cudaSuccess);
    REQUIRE(cudaMalloc(&mem[g], stride * slots) == cudaSuccess);
    REQUIRE(cudaMalloc(&grads[g], grad_bytes * slots) == cudaSuccess);
    std::vector<std::byte> host(stride);
    for (std::int64_t i = 0; i < stride; ++i)
      host[i] = pattern(g, i);
    REQUIRE(cudaMemcpy(mem[g], host.data(), stride, cudaMemcpyHostToDevice) == cudaSuccess);
    std::vector<float> gh(static_cast<std::size_t>(grad_bytes / 4 * slots), static_cast<float>(g + 1));
    REQUIRE(cudaMemcpy(grads[g], gh.data(), grad_bytes * slots, cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(engines[g]->register_slots(0, g, {mem[g], stride, slots, 1, 0}).ok());
    REQUIRE(engines[g]->register_grads(0, g, {grads[g], grad_bytes, slots, 1, 0}, grad_bytes).ok());
  }
  foremoe_test::swap_experts_and_check(engines, mem, slots, experts, stride, bytes / 3, pattern);
  // Replica gradients: expert 0 is owned by GPU 0 and replicated on GPU 1 (and expert 1 the other way round).
  const std::vector<std::int32_t> owner{0, 1};
  const auto st = on_both_ranks([&](int g, rt::Ticket &t) {
    rt::ReduceBatch b;
    b.owner_gpu = owner;
    b.timeout = 20s;
    return engines[g]->submit_reduce(b, t);
  });
  for (int g = 0; g < 2; ++g) {
    CHECK_MESSAGE(st[g].ok(), st[g].to_string());
    float v = 0;
    REQUIRE(cudaMemcpy(&v, grads[g], sizeof v, cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(v == 3.0f); // own 1 (or 2) plus the other GPU's 2 (or 1)
  }
  engines.clear();
  for (int g = 0; g < 2; ++g) {
    cudaSetDevice(g);
    cudaFree(mem[g]);
    cudaFree(grads[g]);
    ncclCommDestroy(comms[g]);
  }
}

} // namespace
#endif

int main(int argc, char **argv) {
#if defined(FOREMOE_PEERS_TEST)
  if (rt::build_info().num_devices >= 2) {
    doctest::Context ctx(argc, argv);
    return ctx.run();
  }
#else
  (void)argc;
  (void)argv;
#endif
  std::puts("gpu_test_peers: needs two CUDA devices and NCCL, skipped");
  return 77;
}
