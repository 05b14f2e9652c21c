#pragma once
// Internal interface between the transfer engine's state machine and the backends that move bytes. The engine
// decides what to copy, when, and what to do on failure; a transport only copies, checksums and accumulates.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "foremoe/runtime/transfer_engine.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {

/// One contiguous copy. `src_gpu == -1` reads host memory (the mirror).
struct CopyOp {
  transfer::Path path = transfer::Path::pcie;
  int src_gpu = -1;
  int dst_gpu = 0;
  const std::byte *src = nullptr;
  std::byte *dst = nullptr;
  std::int64_t num_bytes = 0;
  std::uint64_t fault_key = 0; ///< identity of the chunk and attempt, for the fault injector
};

/// One side of a paired transfer with a GPU another process drives; the other process posts the matching side.
/// Sends and receives between two GPUs pair up in posting order (NCCL's rule). A header travels with the bytes.
struct PeerOp {
  bool send = false;
  int local_gpu = 0; ///< this process's GPU
  int peer_gpu = 0;  ///< the other side's GPU
  std::byte *buf = nullptr; ///< send: read from; receive: written to
  std::int64_t num_bytes = 0;
  std::uint64_t header[2] = {0, 0}; ///< send: delivered with the bytes; receive: filled on arrival
  std::uint64_t fault_key = 0;
};

class Transport {
public:
  virtual ~Transport() = default;
  /// Starts `op` asynchronously.
  [[nodiscard]] virtual Status start(const CopyOp &op, std::uint64_t &handle) = 0;
  /// `in_progress`, `ok` or the error of a started copy; anything but `in_progress` releases the handle.
  /// `seconds` receives the copy's duration.
  [[nodiscard]] virtual Status query(std::uint64_t handle, double &seconds) = 0;
  /// Drops a copy not yet started; true if it was dropped (the handle is then released).
  virtual bool cancel(std::uint64_t handle) = 0;
  /// Whether work gated by `gate` may be issued now (CUDA: makes the copy streams wait on it and says yes).
  [[nodiscard]] virtual Status gate(const Gate &g, bool &ready) = 0;
  /// Checksum of the `num_bytes` at `p` on GPU `gpu` (-1: host memory); synchronous.
  [[nodiscard]] virtual Status checksum(int gpu, const std::byte *p, std::int64_t num_bytes, std::uint64_t &out) = 0;
  /// `dst[i] += src[i]` for `n` floats on GPU `gpu`; synchronous.
  [[nodiscard]] virtual Status accumulate(int gpu, float *dst, const float *src, std::int64_t n) = 0;
  /// Staging memory on GPU `gpu`.
  [[nodiscard]] virtual Status alloc(int gpu, std::int64_t num_bytes, std::byte *&out) = 0;
  virtual void free(int gpu, std::byte *p) noexcept = 0;
  /// Completion flag in memory both the host and `enqueue_wait` streams see.
  [[nodiscard]] virtual Status alloc_flag(volatile std::uint32_t *&flag) = 0;
  virtual void free_flag(volatile std::uint32_t *flag) noexcept = 0;
  /// Makes `stream` wait until `*flag != 0`.
  [[nodiscard]] virtual Status enqueue_wait(void *stream, volatile std::uint32_t *flag) = 0;
  /// Posts `ops` as one group (NCCL: one `ncclGroupStart/End`); they stay alive, and receive headers are written
  /// into them, until `query(handle)` reports anything but `in_progress`. Posted groups cannot be cancelled.
  [[nodiscard]] virtual Status start_peer(std::span<PeerOp> ops, std::uint64_t &handle) {
    (void)ops;
    (void)handle;
    return {StatusCode::unavailable, "this transport cannot reach GPUs of other processes"};
  }
};

std::unique_ptr<Transport> make_host_transport(const EngineOptions &opts);
std::unique_ptr<Transport> make_fault_transport(std::unique_ptr<Transport> inner,
                                                std::shared_ptr<const FaultSchedule> faults, bool host_memory);
#if defined(FOREMOE_HAVE_CUDA)
Status make_cuda_transport(const EngineOptions &opts, std::unique_ptr<Transport> &out);
#endif

/// Whether other processes drive some GPUs of the group (`local_gpus` distinct and in range, as `create` checks).
[[nodiscard]] inline bool multi_process(const EngineOptions &o) noexcept {
  return !o.peers.local_gpus.empty() && static_cast<int>(o.peers.local_gpus.size()) < o.topology.num_gpus();
}

/// 64-bit mix used by checksums and fault decisions.
[[nodiscard]] constexpr std::uint64_t mix64(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
