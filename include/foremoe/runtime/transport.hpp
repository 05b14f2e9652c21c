#pragma once
/// @file
/// The interface between the transfer engine and the backends that move bytes, and the registry of backends by
/// name. The engine decides what to copy, when, in which order and what to do on failure (retries on the other
/// path, verification, deadlines, the valid-expert map); a transport only copies, checksums, accumulates and
/// provides completion flags. Backends in the tree live in `runtime/transports/<name>/` and register themselves;
/// an out-of-tree backend (NIXL, Mooncake, a trainer's own) calls `register_transport` before creating engines
/// and is then picked by `EngineOptions::transport`. No CUDA types cross this header: streams and events are
/// opaque pointers.
///
/// Contract, for every method: never throw (report failures as a `Status` naming what failed), and be callable
/// from the engine's progress thread while `submit` runs on other threads (the engine serialises nothing for the
/// transport beyond what is said below).
///
/// - A *copy* (`CopyOp`) is one contiguous range; the engine cuts chunks into pieces that lie in one tensor and
///   starts each piece with `start`. The transport returns a handle at once (the copy may run later) and
///   answers `query(handle)` with `in_progress` until the copy ended, then once with `ok` or the failure;
///   that answer releases the handle (it is never queried again). A failed copy may have written part of `dst`:
///   the engine never publishes a slot whose chunks did not all report `ok`.
/// - `cancel` drops a copy that has not started; answering false (always allowed) means it will run to its end.
/// - Paired transfers (`start_peer`, optional) pair sends and receives between two GPUs in posting order;
///   a posted group cannot be cancelled, and the engine keeps its `PeerOp`s alive until the group's `query`
///   answered anything but `in_progress`.
/// - `checksum`, `accumulate` and `zero` are synchronous; they run on the progress thread, never on a caller's thread.
/// - `alloc`/`alloc_flags` are called at registration and while pools warm up, never per chunk; the engine
///   pools what they return and frees it at its destruction.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "foremoe/runtime/status.hpp"
#include "foremoe/runtime/transfer_engine.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime {

/// One contiguous copy. `src_gpu == -1` reads host memory (the mirror).
struct CopyOp {
  transfer::Path path = transfer::Path::pcie;
  int src_gpu = -1;
  int dst_gpu = 0;
  const std::byte *src = nullptr;
  std::byte *dst = nullptr;
  std::int64_t num_bytes = 0;
  std::uint64_t fault_key = 0; ///< identity of the chunk and attempt (the fault injector's seed input)
};

/// One side of a paired transfer with a GPU another process drives; the other process posts the matching side.
/// Sends and receives between two GPUs pair up in posting order (NCCL's rule). A header travels with the bytes.
struct PeerOp {
  bool send = false;
  int local_gpu = 0;        ///< this process's GPU
  int peer_gpu = 0;         ///< the other side's GPU
  std::byte *buf = nullptr; ///< send: read from; receive: written to
  std::int64_t num_bytes = 0;
  std::uint64_t header[2] = {0, 0}; ///< send: delivered with the bytes; receive: filled on arrival
  std::uint64_t fault_key = 0;
};

/// A peer fabric the embedder supplies (`PeerOptions::bridge`): the engine hands it each group of paired
/// operations it would otherwise post on its transport (`Transport::start_peer`), and the bridge executes them
/// over whatever joins the processes (foremoe.torch: the trainer's `torch.distributed` group; an NCCL communicator
/// made from a unique id broadcast over that group could sit behind the same interface). Matching is the
/// transport's rule: sends and receives between two GPUs pair up in posting order, and a send's `header` is
/// delivered with its bytes into the matching receive's `header`. The engine keeps its pairing, headers, deadlines,
/// abort, verification and telemetry; the bridge only moves bytes.
///
/// Contract:
/// - `post` is called from the engine's progress thread, groups in posting order; it must not block on the peer
///   (queue the group and return). It reports a failure to start by calling `done` (at once or later).
/// - `done` is called exactly once per group, from any thread: `ok` once every operation of the group ended (a
///   receive's bytes and header written), otherwise the failure naming the peer (e.g. `timed_out` naming the peer
///   and the bridge's deadline, `device_error` for a closed connection or a size mismatch). After `done` the
///   bridge never touches `ops` or the memory they point to.
/// - `done` must come within a bounded time (the bridge's own deadline per group): the engine waits for every
///   posted group before it is destroyed. After a group failed, the pairing with that peer is unknown; a bridge
///   should fail later groups at once (naming the first failure) rather than risk pairing them wrongly.
/// - Operations' `buf` are what the engine's transport calls memory (host memory on the host backend, device
///   pointers on the CUDA backend); `local_gpu`/`peer_gpu` are EP-group GPU ids (the bridge maps them to ranks).
class PeerBridge {
public:
  virtual ~PeerBridge() = default;
  using Done = std::function<void(Status)>;
  virtual void post(std::span<PeerOp> ops, Done done) = 0;
};

/// A transfer backend (see the file comment for the contract).
class Transport {
public:
  virtual ~Transport() = default;
  /// Starts `op` asynchronously; `handle` (never 0) names it in `query` and `cancel`.
  [[nodiscard]] virtual Status start(const CopyOp &op, std::uint64_t &handle) = 0;
  /// `in_progress`, `ok` or the error of a started copy or peer group; anything but `in_progress` releases the
  /// handle. `seconds` receives the copy's duration.
  [[nodiscard]] virtual Status query(std::uint64_t handle, double &seconds) = 0;
  /// Drops a copy not yet started; true if it was dropped (the handle is then released).
  virtual bool cancel(std::uint64_t handle) = 0;
  /// Whether work gated by `g` may be issued now. Host events: whether set. CUDA events: a device backend makes
  /// its copy streams wait on the event and says yes (the host never blocks on compute).
  [[nodiscard]] virtual Status gate(const Gate &g, bool &ready) = 0;
  /// `checksum` (see `runtime::checksum`) of the `num_bytes` at `p` on GPU `gpu` (-1: host memory); synchronous.
  [[nodiscard]] virtual Status checksum(int gpu, const std::byte *p, std::int64_t num_bytes, std::uint64_t &out) = 0;
  /// `dst[i] += src[i]` for `n` elements of `type` on GPU `gpu` (`dst` and `src` there), rounding as `GradType`
  /// says; synchronous.
  [[nodiscard]] virtual Status accumulate(int gpu, void *dst, const void *src, std::int64_t n, GradType type) = 0;
  /// Clears `num_bytes` at `dst` on GPU `gpu`; synchronous. Reductions under the held-gradient rule
  /// (`ReduceBatch::select`) clear each returned replica gradient with it; the default answers `unavailable`.
  [[nodiscard]] virtual Status zero(int gpu, void *dst, std::int64_t num_bytes) {
    (void)dst, (void)num_bytes;
    return {StatusCode::unavailable, "zero: this transport cannot clear GPU " + std::to_string(gpu) + "'s memory"};
  }
  /// Staging memory on GPU `gpu` (replica gradients on their way to the owner, scratch of abandoned exchanges).
  [[nodiscard]] virtual Status alloc(int gpu, std::int64_t num_bytes, std::byte *&out) = 0;
  virtual void free(int gpu, std::byte *p) noexcept = 0;
  /// `n` zeroed completion flags in memory both the host and `enqueue_wait` streams see; freed by `free_flags`.
  [[nodiscard]] virtual Status alloc_flags(std::int64_t n, volatile std::uint32_t *&flags) = 0;
  virtual void free_flags(volatile std::uint32_t *flags) noexcept = 0;
  /// Makes `stream` wait until `*flag` reaches `value` (wrap-around order: `int32(*flag - value) >= 0`). The
  /// engine only ever increases a flag, so a stale wait on a reused flag is released, never held.
  [[nodiscard]] virtual Status enqueue_wait(void *stream, volatile std::uint32_t *flag, std::uint32_t value) = 0;
  /// Posts `ops` as one group (NCCL: one `ncclGroupStart/End`); they stay alive, and receive headers are written
  /// into them, until `query(handle)` reports anything but `in_progress`. Posted groups cannot be cancelled.
  [[nodiscard]] virtual Status start_peer(std::span<PeerOp> ops, std::uint64_t &handle) {
    (void)ops;
    (void)handle;
    return {StatusCode::unavailable, "this transport cannot reach GPUs of other processes"};
  }
  /// Ends a burst of `start_peer` calls: the engine posts a batch's groups (one per round) back to back and then
  /// calls this. A transport may hold groups of a burst back and post several as one (same posting order, so the
  /// same pairing); it must have posted every group when this returns. The default posts each group at once.
  virtual void flush_peer() {}
  /// Asks the transport to call `wake` (from any thread, at once and without blocking on the engine) whenever a
  /// posted group ended; `nullptr` withdraws it, and no call starts after that returned. Returns whether it will:
  /// then the engine's progress thread sleeps while its batches wait only for groups, instead of polling them
  /// every 50 us. The default answers false (polled).
  virtual bool set_peer_waker(const std::function<void()> &wake) {
    (void)wake;
    return false;
  }
  /// Resources the transport created itself since construction (events, pinned blocks, device scratch); what
  /// the engine counts in `EngineStats::allocations` besides its own pools. A steady state adds none.
  [[nodiscard]] virtual std::int64_t resources_created() const noexcept { return 0; }
};

/// Makes a transport for an engine with options `opts` (already validated by `TransferEngine::create`).
using TransportFactory = std::function<Status(const EngineOptions &opts, std::unique_ptr<Transport> &out)>;

/// Registers `factory` under `name` (thread-safe). `invalid_argument` for an empty name or one already taken.
[[nodiscard]] Status register_transport(std::string name, TransportFactory factory);
/// Names of the registered transports, sorted.
[[nodiscard]] std::vector<std::string> registered_transports();
/// Creates the transport registered under `name`; `invalid_argument` naming the registered ones if none is.
[[nodiscard]] Status make_transport(std::string_view name, const EngineOptions &opts, std::unique_ptr<Transport> &out);

} // namespace runtime
} // namespace v0
} // namespace foremoe
