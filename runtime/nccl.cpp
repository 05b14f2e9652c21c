// The engine's own NCCL communicator from a unique id (foremoe/runtime/nccl.hpp). The arguments are checked in
// every build; the NCCL calls are compiled only with NCCL (FOREMOE_HAVE_NCCL, which implies CUDA), so that a build
// without it says so instead of failing at link time.

#include "foremoe/runtime/nccl.hpp"

#include <cstdio>
#include <string>
#include <utility>

#if defined(FOREMOE_HAVE_NCCL)
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "backends.hpp"
#endif

namespace foremoe {
inline namespace v0 {
namespace runtime {

namespace {

Status invalid(const std::string &msg) { return {StatusCode::invalid_argument, "NCCL communicator: " + msg}; }

Status check_arguments(std::span<const char> unique_id, int num_ranks, int rank, int cuda_device) {
  if (unique_id.size() != nccl_unique_id_bytes)
    return invalid("the unique id has " + std::to_string(unique_id.size()) + " bytes, expected " +
                   std::to_string(nccl_unique_id_bytes) + " (one nccl_unique_id, unchanged)");
  if (num_ranks < 1) return invalid("num_ranks must be at least 1, got " + std::to_string(num_ranks));
  if (rank < 0 || rank >= num_ranks)
    return invalid("rank " + std::to_string(rank) + " outside [0, " + std::to_string(num_ranks) + ")");
  if (cuda_device < 0) return invalid("cuda_device must be a device ordinal >= 0, got " + std::to_string(cuda_device));
  return {};
}

#if !defined(FOREMOE_HAVE_NCCL)
Status not_compiled(const char *what) {
  return {StatusCode::unavailable, std::string(what) +
                                       ": NCCL is not compiled into this runtime (it was built without CUDA or "
                                       "without NCCL; rebuild with the CUDA toolkit and NCCL found)"};
}
#else
static_assert(NCCL_UNIQUE_ID_BYTES == nccl_unique_id_bytes, "nccl_unique_id_bytes disagrees with this NCCL");

std::string seconds(std::chrono::steady_clock::duration d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", std::chrono::duration<double>(d).count());
  return buf;
}

/// NCCL's error string plus its last-error text, which names the cause (a socket, a peer, a version mismatch).
std::string nccl_text(ncclResult_t r, ncclComm_t comm) {
  std::string m = ncclGetErrorString(r);
  if (const char *last = ncclGetLastError(comm); last != nullptr && *last != 0) m += std::string(" (") + last + ")";
  return m;
}

/// Makes `device` the calling thread's current device and restores the previous one at scope exit.
class DeviceScope {
public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();
      previous_ = -1;
    }
    error_ = cudaSetDevice(device);
    if (error_ != cudaSuccess) (void)cudaGetLastError();
  }
  ~DeviceScope() {
    if (previous_ >= 0 && error_ == cudaSuccess) (void)cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope &) = delete;
  DeviceScope &operator=(const DeviceScope &) = delete;
  [[nodiscard]] cudaError_t error() const noexcept { return error_; }

private:
  int previous_ = -1;
  cudaError_t error_ = cudaSuccess;
};

/// Polls a non-blocking communicator until its state leaves `ncclInProgress` (returns that state, or the failure of
/// the poll itself) or `deadline` passes (returns `ncclInProgress`).
ncclResult_t wait_ready(ncclComm_t comm, std::chrono::steady_clock::time_point deadline) {
  auto pause = std::chrono::microseconds(20);
  for (;;) {
    ncclResult_t state = ncclInProgress;
    if (const ncclResult_t r = ncclCommGetAsyncError(comm, &state); r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if (std::chrono::steady_clock::now() >= deadline) return ncclInProgress;
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(1));
  }
}
#endif

} // namespace

Status nccl_unique_id(NcclUniqueId &out) {
#if defined(FOREMOE_HAVE_NCCL)
  ncclUniqueId id;
  if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess)
    return {StatusCode::device_error, "nccl_unique_id: ncclGetUniqueId failed: " + nccl_text(r, nullptr)};
  std::memcpy(out.data(), id.internal, nccl_unique_id_bytes);
  return {};
#else
  (void)out;
  return not_compiled("nccl_unique_id");
#endif
}

Status NcclCommunicator::create(std::span<const char> unique_id, int num_ranks, int rank, int cuda_device,
                                std::chrono::steady_clock::time_point deadline, NcclCommunicator &out) {
  if (Status st = check_arguments(unique_id, num_ranks, rank, cuda_device); !st.ok()) return st;
#if defined(FOREMOE_HAVE_NCCL)
  const std::string who = "NCCL communicator: rank " + std::to_string(rank) + " of " + std::to_string(num_ranks) +
                          " on CUDA device " + std::to_string(cuda_device);
  const int num_devices = detail::cuda_num_devices();
  if (num_devices == 0) return {StatusCode::unavailable, who + ": no CUDA device"};
  if (cuda_device >= num_devices)
    return invalid("cuda_device " + std::to_string(cuda_device) + " outside the " + std::to_string(num_devices) +
                   " devices this process sees");
  const DeviceScope scope(cuda_device);
  if (scope.error() != cudaSuccess)
    return {StatusCode::device_error, who + ": cudaSetDevice failed: " + cudaGetErrorString(scope.error())};
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), nccl_unique_id_bytes);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0; // creation returns at once; the poll below bounds the wait for the other ranks
  ncclComm_t comm = nullptr;
  const auto start = std::chrono::steady_clock::now();
  ncclResult_t r = ncclCommInitRankConfig(&comm, num_ranks, id, rank, &config);
  if ((r == ncclSuccess || r == ncclInProgress) && comm != nullptr) r = wait_ready(comm, deadline);
  if (r == ncclInProgress) {
    (void)ncclCommAbort(comm);
    return {StatusCode::timed_out, who + ": not every rank joined within " +
                                       seconds(std::chrono::steady_clock::now() - start) +
                                       " s (its deadline); aborted. Did every rank call it with the same unique id "
                                       "and number of ranks?"};
  }
  if (r != ncclSuccess || comm == nullptr) {
    std::string msg =
        who + ": ncclCommInitRankConfig failed: " + nccl_text(r == ncclSuccess ? ncclInternalError : r, comm);
    if (comm != nullptr) (void)ncclCommAbort(comm);
    return {StatusCode::device_error, std::move(msg)};
  }
  NcclCommunicator made;
  made.comm_ = comm;
  made.num_ranks_ = num_ranks;
  made.rank_ = rank;
  made.device_ = cuda_device;
  out = std::move(made);
  return {};
#else
  (void)deadline, (void)out;
  return not_compiled("NCCL communicator");
#endif
}

NcclCommunicator::~NcclCommunicator() { (void)close(std::chrono::steady_clock::now() + default_close_timeout); }

NcclCommunicator::NcclCommunicator(NcclCommunicator &&other) noexcept
    : comm_(std::exchange(other.comm_, nullptr)), num_ranks_(std::exchange(other.num_ranks_, 0)),
      rank_(std::exchange(other.rank_, -1)), device_(std::exchange(other.device_, -1)) {}

NcclCommunicator &NcclCommunicator::operator=(NcclCommunicator &&other) noexcept {
  if (this != &other) {
    (void)close(std::chrono::steady_clock::now() + default_close_timeout);
    comm_ = std::exchange(other.comm_, nullptr);
    num_ranks_ = std::exchange(other.num_ranks_, 0);
    rank_ = std::exchange(other.rank_, -1);
    device_ = std::exchange(other.device_, -1);
  }
  return *this;
}

Status NcclCommunicator::close(std::chrono::steady_clock::time_point deadline) {
  if (comm_ == nullptr) return {};
#if defined(FOREMOE_HAVE_NCCL)
  auto *comm = static_cast<ncclComm_t>(std::exchange(comm_, nullptr));
  const std::string who = "NCCL communicator: rank " + std::to_string(rank_) + " of " + std::to_string(num_ranks_);
  const DeviceScope scope(device_);
  const auto start = std::chrono::steady_clock::now();
  ncclResult_t r = ncclCommFinalize(comm);
  if (r == ncclSuccess || r == ncclInProgress) r = wait_ready(comm, deadline);
  if (r == ncclSuccess) {
    r = ncclCommDestroy(comm);
    if (r == ncclSuccess) return {};
    return {StatusCode::device_error, who + ": ncclCommDestroy failed: " + nccl_text(r, nullptr)};
  }
  std::string msg = r == ncclInProgress ? who + ": not finalized within " +
                                              seconds(std::chrono::steady_clock::now() - start) + " s; aborted"
                                        : who + ": ncclCommFinalize failed: " + nccl_text(r, comm) + "; aborted";
  (void)ncclCommAbort(comm);
  return {r == ncclInProgress ? StatusCode::timed_out : StatusCode::device_error, std::move(msg)};
#else
  (void)deadline;
  comm_ = nullptr; // never set without NCCL
  return {};
#endif
}

void NcclCommunicator::abort() noexcept {
  if (comm_ == nullptr) return;
#if defined(FOREMOE_HAVE_NCCL)
  const DeviceScope scope(device_);
  (void)ncclCommAbort(static_cast<ncclComm_t>(std::exchange(comm_, nullptr)));
#else
  comm_ = nullptr;
#endif
}

} // namespace runtime
} // namespace v0
} // namespace foremoe
