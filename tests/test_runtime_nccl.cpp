// The engine's own NCCL communicator (foremoe/runtime/nccl.hpp) on the host: every refused argument names its value
// in every build, a build without NCCL says so, a build with NCCL but no device says that, and an empty
// communicator is safe to close, abort, move and destroy. Making real communicators needs a device:
// tests/gpu_test_nccl.cpp.

#include <doctest/doctest.h>

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "foremoe/runtime/nccl.hpp"
#include "foremoe/runtime/runtime.hpp"

namespace rt = foremoe::runtime;
using namespace std::chrono_literals;

namespace {

rt::Status make(std::span<const char> id, int num_ranks, int rank, int device, rt::NcclCommunicator &out) {
  return rt::NcclCommunicator::create(id, num_ranks, rank, device, std::chrono::steady_clock::now() + 1s, out);
}

void check_refused(const rt::Status &st, const std::string &names) {
  CHECK(st.code() == rt::StatusCode::invalid_argument);
  CHECK_MESSAGE(st.message().find(names) != std::string::npos, st.to_string(), " should name ", names);
}

} // namespace

TEST_CASE("NcclCommunicator::create refuses bad arguments naming the value, in every build") {
  const rt::NcclUniqueId id{};
  rt::NcclCommunicator comm;
  check_refused(make(id, 0, 0, 0, comm), "num_ranks must be at least 1, got 0");
  check_refused(make(id, -3, 0, 0, comm), "got -3");
  check_refused(make(id, 2, 2, 0, comm), "rank 2 outside [0, 2)");
  check_refused(make(id, 2, -1, 0, comm), "rank -1 outside [0, 2)");
  check_refused(make(id, 1, 0, -1, comm), "cuda_device must be a device ordinal >= 0, got -1");
  const std::vector<char> short_id(rt::nccl_unique_id_bytes - 1), long_id(rt::nccl_unique_id_bytes + 5);
  check_refused(make(short_id, 1, 0, 0, comm), "the unique id has 127 bytes, expected 128");
  check_refused(make(long_id, 1, 0, 0, comm), "has 133 bytes");
  check_refused(make({}, 1, 0, 0, comm), "has 0 bytes");
  CHECK_FALSE(comm.valid()); // `out` is replaced only on success
}

TEST_CASE("NcclCommunicator without NCCL or without a device: a clear unavailable status") {
  const rt::BuildInfo info = rt::build_info();
  if (info.nccl_compiled && info.num_devices > 0) {
    MESSAGE("NCCL and a device are present: tests/gpu_test_nccl.cpp makes real communicators");
    return;
  }
  rt::NcclCommunicator comm;
  const rt::Status st = make(rt::NcclUniqueId{}, 1, 0, 0, comm);
  CHECK(st.code() == rt::StatusCode::unavailable);
  if (!info.nccl_compiled) {
    CHECK_MESSAGE(st.message().find("NCCL is not compiled into this runtime") != std::string::npos, st.to_string());
    rt::NcclUniqueId id{};
    const rt::Status sid = rt::nccl_unique_id(id);
    CHECK(sid.code() == rt::StatusCode::unavailable);
    CHECK_MESSAGE(sid.message().find("nccl_unique_id: NCCL is not compiled") != std::string::npos, sid.to_string());
  } else {
    CHECK_MESSAGE(st.message().find("rank 0 of 1 on CUDA device 0: no CUDA device") != std::string::npos,
                  st.to_string());
  }
  CHECK_FALSE(comm.valid());
}

TEST_CASE("nccl_unique_id with NCCL: a fresh id each call (no device needed)") {
  if (!rt::build_info().nccl_compiled) {
    MESSAGE("built without NCCL: covered by the unavailable case");
    return;
  }
  rt::NcclUniqueId a{}, b{};
  const rt::Status sa = rt::nccl_unique_id(a);
  if (sa.code() == rt::StatusCode::device_error) { // e.g. a sandbox without a network interface for the bootstrap
    MESSAGE("ncclGetUniqueId failed here: ", sa.to_string());
    CHECK(sa.message().find("ncclGetUniqueId failed") != std::string::npos);
    return;
  }
  REQUIRE_MESSAGE(sa.ok(), sa.to_string());
  REQUIRE(rt::nccl_unique_id(b).ok());
  CHECK(a != rt::NcclUniqueId{});
  CHECK(a != b);
}

TEST_CASE("an empty NcclCommunicator closes, aborts, moves and destroys without NCCL calls") {
  rt::NcclCommunicator a;
  CHECK_FALSE(a.valid());
  CHECK(a.handle() == nullptr);
  CHECK(a.num_ranks() == 0);
  CHECK(a.rank() == -1);
  CHECK(a.cuda_device() == -1);
  CHECK(a.close(std::chrono::steady_clock::now()).ok());
  CHECK(a.close(std::chrono::steady_clock::now()).ok()); // twice
  a.abort();
  rt::NcclCommunicator b(std::move(a));
  CHECK_FALSE(b.valid());
  a = std::move(b);
  CHECK_FALSE(a.valid());
}
