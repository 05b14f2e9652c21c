#pragma once
/// @file
/// Public API of the compiled runtime (`foremoe::runtime`). CUDA handles cross
/// this API as opaque pointers so that the header compiles without the toolkit.

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "foremoe/runtime/status.hpp"
#include "foremoe/trace/routed_view.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime {

/// Where work runs.
enum class Backend : int { host = 0, cuda = 1 };

/// How this copy of the runtime was built and what it sees.
struct BuildInfo {
  bool cuda_compiled = false;     ///< the CUDA backend is in the library
  bool nccl_compiled = false;     ///< NCCL paths are in the library
  int num_devices = 0;            ///< CUDA devices visible now (0 without CUDA or GPU)
  std::string cuda_architectures; ///< e.g. "90"
};
[[nodiscard]] BuildInfo build_info();

/// Load counting request: contiguous `[tokens][layers][topk]` ids.
struct CountRequest {
  const void *ids = nullptr; ///< host memory (host backend) or device memory (CUDA)
  IdDtype dtype = IdDtype::i32;
  std::int64_t num_tokens = 0;
  int num_layers = 0; ///< trace layers
  int topk = 0;
  int num_experts = 0;
  std::span<const std::int64_t> microbatch_offsets{}; ///< host memory, `[M + 1]`; empty = one micro-step
  std::span<const int> layer_map{};                   ///< host memory, trace layer -> MoE layer or -1; empty = identity
};

/// Counts `req` into `out[M][moe_layers][E]` (int64; host memory for the host
/// backend, device memory for CUDA, overwritten; `out.size()` must be exactly
/// that, or `invalid_argument` names both sizes). The host backend splits the
/// micro-steps over `num_threads` threads. The CUDA backend enqueues on
/// `stream` (a `cudaStream_t`, null = legacy default) and waits for it, at most
/// `timeout_ms`, to check the ids. An out-of-range id gives `invalid_argument`
/// naming it, a missing backend `unavailable`. The hot-path form is
/// `count_loads_async`.
Status count_loads(Backend backend, const CountRequest &req, std::span<std::int64_t> out, int num_threads = 1,
                   void *stream = nullptr, int timeout_ms = 60000);

/// State of the asynchronous calls (`count_loads_async`, `map_tokens_async`) on one stream: device scratch and
/// pinned staging, created on first use and grown geometrically, freed at destruction, plus one error record per
/// call in flight. A steady state of the same calls allocates nothing (`allocations` stays put) and never blocks
/// the host. Not thread-safe: one thread and one stream per workspace (between `check`s).
class Workspace {
public:
  explicit Workspace(Backend backend = Backend::host);
  ~Workspace(); ///< waits (bounded) for calls still in flight; past the bound their resources are left to them
  Workspace(const Workspace &) = delete;
  Workspace &operator=(const Workspace &) = delete;

  [[nodiscard]] Backend backend() const noexcept { return backend_; }
  /// Outcome of the calls enqueued since the last `check`: `in_progress` while the device has not finished one of
  /// them after waiting at most `timeout_ms` (0: do not wait), else `ok` or the first call's failure (an id out of
  /// range, a count that differs from the plan, named as the synchronous forms name them); the records are then
  /// reused. The host backend runs its calls at once, so `check` just reports their outcome.
  [[nodiscard]] Status check(int timeout_ms = 0);
  /// Scratch, staging and event allocations made so far (what a steady state does not add to).
  [[nodiscard]] std::int64_t allocations() const noexcept;
  struct Impl;
  /// Internal (the runtime's backends).
  [[nodiscard]] Impl *impl(Status &error);

private:
  Backend backend_;
  std::unique_ptr<Impl> impl_;
};

/// Enqueues the counting of `req` into `out` (as `count_loads`) on `stream` without waiting for it: ids are checked
/// on the device and reported by `ws.check()`. Returns at once with `invalid_argument` for a bad request shape or
/// output size, `unavailable` for a missing backend, `device_error` for a launch that failed.
[[nodiscard]] Status count_loads_async(Workspace &ws, const CountRequest &req, std::span<std::int64_t> out,
                                       void *stream = nullptr, int num_threads = 1);

} // namespace runtime
} // namespace v0
} // namespace foremoe
