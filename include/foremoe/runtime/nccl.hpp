#pragma once
/// @file
/// An NCCL communicator of the engine's own (`PeerOptions::nccl_comm_of_gpu`), made from a unique id that one rank
/// creates and the embedder hands to every other rank over its own channel (foremoe.torch: a broadcast over the
/// trainer's process group). The communicator is non-blocking (`ncclConfig_t::blocking = 0`), so neither its
/// creation nor its destruction can hang on a rank that never joins: both poll NCCL until a deadline, then abort
/// it. Built without NCCL, every call here returns `unavailable` saying so (after the arguments are checked, so
/// bad input is refused the same way in every build). NCCL types cross this API as bytes and opaque pointers so
/// that the header compiles without NCCL.

#include <array>
#include <chrono>
#include <cstddef>
#include <span>

#include "foremoe/runtime/status.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime {

/// Bytes of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`; the runtime checks that its NCCL agrees).
inline constexpr std::size_t nccl_unique_id_bytes = 128;
using NcclUniqueId = std::array<char, nccl_unique_id_bytes>;

/// A new unique id (`ncclGetUniqueId`), made by one rank (rank 0) and given to every rank's
/// `NcclCommunicator::create`. It names a bootstrap server this process runs until the communicator is made.
/// `unavailable` without NCCL, `device_error` with NCCL's message when it fails (e.g. no network interface).
[[nodiscard]] Status nccl_unique_id(NcclUniqueId &out);

/// One rank's NCCL communicator, owned: destroyed (or aborted) at destruction. Move-only. Use it from one thread
/// at a time (NCCL's rule): a `TransferEngine` given it drives it from its progress thread, so give each engine
/// a communicator of its own and destroy the engine first.
class NcclCommunicator {
public:
  /// How long `close` waits at destruction for the communicator to be finalized before aborting it.
  static constexpr std::chrono::seconds default_close_timeout{30};

  NcclCommunicator() noexcept = default; ///< empty: no communicator (`valid()` false)
  ~NcclCommunicator();
  NcclCommunicator(NcclCommunicator &&other) noexcept;
  NcclCommunicator &operator=(NcclCommunicator &&other) noexcept; ///< closes the communicator held before
  NcclCommunicator(const NcclCommunicator &) = delete;
  NcclCommunicator &operator=(const NcclCommunicator &) = delete;

  /// Makes rank `rank` of a `num_ranks`-rank communicator on CUDA device `cuda_device` from `unique_id` (the
  /// bytes of one `nccl_unique_id`, the same on every rank), collectively with the other ranks: each calls this
  /// with its own rank. Waits until `deadline` for every rank to join; past it the communicator is aborted and the
  /// status is `timed_out` naming the rank and the seconds waited. `invalid_argument` naming the value for
  /// `num_ranks < 1`, `rank` outside `[0, num_ranks)`, a negative `cuda_device` (or one this process does not see),
  /// or a unique id that is not `nccl_unique_id_bytes` long; `unavailable` without NCCL or without a device;
  /// `device_error` with NCCL's message when the creation fails. The calling thread's current device is left as
  /// it was. `out` is replaced only on success.
  [[nodiscard]] static Status create(std::span<const char> unique_id, int num_ranks, int rank, int cuda_device,
                                     std::chrono::steady_clock::time_point deadline, NcclCommunicator &out);

  /// The `ncclComm_t`, for `PeerOptions::nccl_comm_of_gpu`; null when empty.
  [[nodiscard]] void *handle() const noexcept { return comm_; }
  [[nodiscard]] bool valid() const noexcept { return comm_ != nullptr; }
  [[nodiscard]] int num_ranks() const noexcept { return num_ranks_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int cuda_device() const noexcept { return device_; }

  /// Finalizes and destroys the communicator (`ncclCommFinalize`, polled until `deadline`, then
  /// `ncclCommDestroy`); one that fails or does not finish by then is aborted (`ncclCommAbort`) and the status
  /// says why. Empty afterwards either way; closing an empty communicator is ok.
  Status close(std::chrono::steady_clock::time_point deadline);
  /// Aborts the communicator at once (`ncclCommAbort`: operations in flight are dropped); empty afterwards.
  void abort() noexcept;

private:
  void *comm_ = nullptr;
  int num_ranks_ = 0;
  int rank_ = -1;
  int device_ = -1;
};

} // namespace runtime
} // namespace v0
} // namespace foremoe
