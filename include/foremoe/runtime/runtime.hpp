#pragma once
/// @file
/// Public API of the compiled runtime (`foremoe::runtime`). CUDA handles cross
/// this API as opaque pointers so that the header compiles without the toolkit.

#include <cstdint>
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
  bool cuda_compiled = false; ///< the CUDA backend is in the library
  bool nccl_compiled = false; ///< NCCL paths are in the library
  int num_devices = 0;        ///< CUDA devices visible now (0 without CUDA or GPU)
  std::string cuda_architectures; ///< e.g. "90"
};
[[nodiscard]] BuildInfo build_info();

/// Load counting request: contiguous `[tokens][layers][topk]` ids.
struct CountRequest {
  const void *ids = nullptr;   ///< host memory (host backend) or device memory (CUDA)
  IdDtype dtype = IdDtype::i32;
  std::int64_t num_tokens = 0;
  int num_layers = 0;          ///< trace layers
  int topk = 0;
  int num_experts = 0;
  std::span<const std::int64_t> microbatch_offsets{}; ///< host memory, `[M + 1]`; empty = one micro-step
  std::span<const int> layer_map{};                  ///< host memory, trace layer -> MoE layer or -1; empty = identity
};

/// Counts `req` into `out[M][moe_layers][E]` (int64; host memory for the host
/// backend, device memory for CUDA, overwritten). The host backend splits the
/// micro-steps over `num_threads` threads. The CUDA backend enqueues on
/// `stream` (a `cudaStream_t`, null = legacy default) and waits for it, at most
/// `timeout_ms`, to check the ids. An out-of-range id gives `invalid_argument`
/// naming it, a missing backend `unavailable`.
Status count_loads(Backend backend, const CountRequest &req, std::int64_t *out, int num_threads = 1,
                   void *stream = nullptr, int timeout_ms = 60000);

} // namespace runtime
} // namespace v0
} // namespace foremoe
