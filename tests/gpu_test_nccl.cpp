// GPU test of the engine's own NCCL communicator (foremoe/runtime/nccl.hpp): a one-rank communicator from a fresh
// unique id, leaving the caller's current device as it was; a rank whose peer never joins ends timed_out at its
// deadline (aborted, naming the rank and the seconds) instead of hanging; and, with two devices, two ranks made
// from one unique id on two threads (as two processes would) carry an engine's moves and verified bytes between
// them. Needs a CUDA device and NCCL; elsewhere exit 77 (reported as skipped).

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <array>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "foremoe/runtime/nccl.hpp"
#include "foremoe/runtime/runtime.hpp"
#include "foremoe/runtime/transfer_engine.hpp"
#include "gpu_main.hpp"

#if defined(FOREMOE_TEST_HAVE_CUDART) && defined(FOREMOE_TEST_HAVE_NCCL)
#include <cuda_runtime_api.h>

#include "gpu_ranks.hpp"
#define FOREMOE_NCCL_TEST 1
#endif

using namespace foremoe;
namespace rt = foremoe::runtime;
using namespace std::chrono_literals;

#if defined(FOREMOE_NCCL_TEST)
namespace {

std::chrono::steady_clock::time_point in(std::chrono::milliseconds d) { return std::chrono::steady_clock::now() + d; }

TEST_CASE("one rank: a communicator from a fresh unique id, the current device left as it was") {
  rt::NcclUniqueId id{};
  const rt::Status sid = rt::nccl_unique_id(id);
  REQUIRE_MESSAGE(sid.ok(), sid.to_string());
  const int last = rt::build_info().num_devices - 1;
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  rt::NcclCommunicator comm;
  const rt::Status st = rt::NcclCommunicator::create(id, 1, 0, last, in(30s), comm);
  REQUIRE_MESSAGE(st.ok(), st.to_string());
  CHECK(comm.valid());
  CHECK(comm.handle() != nullptr);
  CHECK(comm.num_ranks() == 1);
  CHECK(comm.rank() == 0);
  CHECK(comm.cuda_device() == last);
  int cur = -1;
  REQUIRE(cudaGetDevice(&cur) == cudaSuccess);
  CHECK(cur == 0);
  rt::NcclCommunicator moved(std::move(comm));
  CHECK_FALSE(comm.valid()); // NOLINT(bugprone-use-after-move): the moved-from state is what is checked
  CHECK(moved.valid());
  const rt::Status closed = moved.close(in(30s));
  CHECK_MESSAGE(closed.ok(), closed.to_string());
  CHECK_FALSE(moved.valid());
}

TEST_CASE("a rank whose peer never joins ends timed_out at its deadline, aborted") {
  rt::NcclUniqueId id{};
  REQUIRE(rt::nccl_unique_id(id).ok());
  rt::NcclCommunicator comm;
  const auto start = std::chrono::steady_clock::now();
  const rt::Status st = rt::NcclCommunicator::create(id, 2, 0, 0, in(2s), comm); // rank 1 never comes
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(st.code() == rt::StatusCode::timed_out);
  CHECK_MESSAGE(st.message().find("rank 0 of 2 on CUDA device 0: not every rank joined within 2.") != std::string::npos,
                st.to_string());
  CHECK(waited >= 2.0);
  CHECK(waited < 30.0); // the abort returned, it did not wait for the missing rank
  CHECK_FALSE(comm.valid());
}

std::byte pattern(int e, std::int64_t i) { return static_cast<std::byte>((e * 71 + i * 7 + (i >> 9)) & 0xff); }

TEST_CASE("two ranks from one unique id carry an engine's verified moves between two devices") {
  if (rt::build_info().num_devices < 2) {
    MESSAGE("one CUDA device: the two-rank case needs two, skipped");
    return;
  }
  rt::NcclUniqueId id{};
  REQUIRE(rt::nccl_unique_id(id).ok());
  std::array<rt::NcclCommunicator, 2> comms;
  std::array<rt::Status, 2> made;
  {
    std::vector<std::thread> ranks;
    for (int g = 0; g < 2; ++g)
      ranks.emplace_back([&, g] { made[g] = rt::NcclCommunicator::create(id, 2, g, g, in(60s), comms[g]); });
    for (auto &t : ranks)
      t.join();
  }
  for (int g = 0; g < 2; ++g)
    REQUIRE_MESSAGE(made[g].ok(), made[g].to_string());

  constexpr std::int64_t bytes = 1 << 20;
  constexpr int slots = 2;
  std::array<void *, 2> mem{};
  std::array<std::unique_ptr<rt::TransferEngine>, 2> engines;
  for (int g = 0; g < 2; ++g) {
    rt::EngineOptions o;
    o.backend = rt::Backend::cuda;
    o.topology = {2, 1, slots};
    o.num_experts = 2;
    o.tensors = {{0, bytes}};
    o.planning.host_mirror = false;
    o.verify = true;
    o.peers.local_gpus = {g};
    o.peers.nccl_comm_of_gpu = {g == 0 ? comms[0].handle() : nullptr, g == 1 ? comms[1].handle() : nullptr};
    o.cuda_device_of_gpu = {g == 0 ? 0 : -1, g == 1 ? 1 : -1};
    const rt::Status st = rt::TransferEngine::create(o, engines[g]);
    REQUIRE_MESSAGE(st.ok(), st.to_string());
    REQUIRE(cudaSetDevice(g) == cudaSuccess);
    REQUIRE(cudaMalloc(&mem[g], bytes * slots) == cudaSuccess);
    std::vector<std::byte> host(bytes);
    for (std::int64_t i = 0; i < bytes; ++i)
      host[i] = pattern(g, i);
    REQUIRE(cudaMemcpy(mem[g], host.data(), bytes, cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(engines[g]->register_slots(0, g, {mem[g], bytes, slots, 1, 0}).ok());
  }
  foremoe_test::swap_experts_and_check(engines, mem, slots, 2, bytes, bytes, pattern);
  for (auto &e : engines) // the engines first: their progress threads use the communicators
    e.reset();
  for (int g = 0; g < 2; ++g) {
    (void)cudaSetDevice(g);
    (void)cudaFree(mem[g]);
  }
  std::array<rt::Status, 2> closed;
  {
    std::vector<std::thread> ranks;
    for (int g = 0; g < 2; ++g)
      ranks.emplace_back([&, g] { closed[g] = comms[g].close(in(30s)); });
    for (auto &t : ranks)
      t.join();
  }
  for (int g = 0; g < 2; ++g)
    CHECK_MESSAGE(closed[g].ok(), closed[g].to_string());
}

} // namespace
#endif

int main(int argc, char **argv) {
#if defined(FOREMOE_NCCL_TEST)
  constexpr bool built = true;
#else
  constexpr bool built = false;
#endif
  return foremoe_test::gpu_test_main(argc, argv, "gpu_test_nccl", "a CUDA device and NCCL", built, 1);
}
