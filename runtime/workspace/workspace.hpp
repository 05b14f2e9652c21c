#pragma once
// Internal: what a backend's workspace does for the asynchronous calls. The front ends (runtime.cpp,
// token_map/token_map.cpp) have checked the request's shape and the output's size.

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "foremoe/plan/token_map.hpp"
#include "foremoe/runtime/runtime.hpp"
#include "foremoe/runtime/token_map.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime {

struct Workspace::Impl {
  virtual ~Impl() = default;
  /// Enqueues (or, on the host, runs) one call; failures found by the work itself go to `check`.
  [[nodiscard]] virtual Status count(const CountRequest &req, int num_moe_layers, std::span<std::int64_t> out,
                                     void *stream, int num_threads) = 0;
  [[nodiscard]] virtual Status map(const MapRequest &req, const TokenRanges &ranges,
                                   std::span<const std::int64_t> source_offsets, std::span<std::int32_t> out_slots,
                                   void *stream) = 0;
  [[nodiscard]] virtual Status check(int timeout_ms) = 0;
  [[nodiscard]] virtual std::int64_t allocations() const noexcept { return 0; }
  /// The calls in flight outlived their deadline: leave their resources to them rather than free them under them.
  virtual void abandon() noexcept {}
};

namespace detail {
/// The synchronous form of an asynchronous call: `enqueue(ws)` on a workspace of its own, then waits at most
/// `timeout_ms` for it. `what` names the call, `work` the device work in the timeout message.
template <class F>
Status run_synchronously(Backend backend, int timeout_ms, const char *what, const char *work, F &&enqueue) {
  if (timeout_ms < 0)
    return {StatusCode::invalid_argument,
            std::string(what) + ": timeout_ms must be >= 0, got " + std::to_string(timeout_ms)};
  Workspace ws(backend);
  if (Status st = enqueue(ws); !st.ok()) return st;
  Status st = ws.check(timeout_ms);
  if (st.code() != StatusCode::in_progress) return st;
  Status err;
  ws.impl(err)->abandon(); // still in use by the stream: left to it rather than freed under it
  return {StatusCode::timed_out,
          std::string(what) + ": device " + work + " did not finish within " + std::to_string(timeout_ms) + " ms"};
}

std::unique_ptr<Workspace::Impl> make_host_workspace();
#if defined(FOREMOE_HAVE_CUDA)
std::unique_ptr<Workspace::Impl> make_cuda_workspace();
#endif
} // namespace detail

} // namespace runtime
} // namespace v0
} // namespace foremoe
