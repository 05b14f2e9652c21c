#include "foremoe/runtime/runtime.hpp"

#include <exception>

#include "backends.hpp"
#include "foremoe/core/error.hpp"
#include "foremoe/trace/count.hpp"
#include "workspace/workspace.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime {

BuildInfo build_info() {
  BuildInfo info;
#if defined(FOREMOE_HAVE_CUDA)
  info.cuda_compiled = true;
  info.num_devices = detail::cuda_num_devices();
  info.cuda_architectures = FOREMOE_CUDA_ARCHS;
#endif
#if defined(FOREMOE_HAVE_NCCL)
  info.nccl_compiled = true;
#endif
  return info;
}

namespace {
// Validates the request's shape on the host; ids are checked by the backend.
Status check_request(const CountRequest &req, int &num_moe_layers) {
  try {
    (void)RoutedView(req.ids, req.dtype, req.num_tokens, req.num_layers, req.topk);
    ::foremoe::detail::require(req.num_experts > 0, "num_experts must be positive, got ", req.num_experts);
    LayerMap lmap = req.layer_map.empty() ? LayerMap::identity(req.num_layers)
                                          : LayerMap(std::vector<int>(req.layer_map.begin(), req.layer_map.end()));
    ::foremoe::detail::require(lmap.num_trace_layers() == req.num_layers, "layer map covers ", lmap.num_trace_layers(),
                               " layers but the trace has ", req.num_layers);
    if (!req.microbatch_offsets.empty())
      ::foremoe::detail::check_offsets(req.microbatch_offsets, req.num_tokens, "microbatch_offsets");
    num_moe_layers = lmap.num_moe_layers();
  } catch (const Error &e) {
    return {StatusCode::invalid_argument, std::string("count_loads: ") + e.what()};
  }
  return Status::success();
}
} // namespace

Workspace::Workspace(Backend backend) : backend_(backend) {}
Workspace::~Workspace() = default;

Workspace::Impl *Workspace::impl(Status &error) {
  if (impl_) return impl_.get();
  switch (backend_) {
  case Backend::host: impl_ = detail::make_host_workspace(); break;
  case Backend::cuda:
#if defined(FOREMOE_HAVE_CUDA)
    if (detail::cuda_num_devices() == 0) {
      error = {StatusCode::unavailable, "no CUDA device"};
      return nullptr;
    }
    impl_ = detail::make_cuda_workspace();
    break;
#else
    error = {StatusCode::unavailable, "this runtime was built without CUDA"};
    return nullptr;
#endif
  default:
    error = {StatusCode::invalid_argument, "unknown backend " + std::to_string(static_cast<int>(backend_))};
    return nullptr;
  }
  return impl_.get();
}

Status Workspace::check(int timeout_ms) {
  if (timeout_ms < 0)
    return {StatusCode::invalid_argument, "check: timeout_ms must be >= 0, got " + std::to_string(timeout_ms)};
  return impl_ ? impl_->check(timeout_ms) : Status::success();
}

std::int64_t Workspace::allocations() const noexcept { return impl_ ? impl_->allocations() : 0; }

Status count_loads_async(Workspace &ws, const CountRequest &req, std::span<std::int64_t> out, void *stream,
                         int num_threads) {
  int num_moe_layers = 0;
  if (Status st = check_request(req, num_moe_layers); !st.ok()) return st;
  const std::int64_t steps =
      req.microbatch_offsets.empty() ? 1 : static_cast<std::int64_t>(req.microbatch_offsets.size()) - 1;
  const std::int64_t want = steps * num_moe_layers * req.num_experts;
  if (static_cast<std::int64_t>(out.size()) != want || (out.data() == nullptr && want > 0))
    return {StatusCode::invalid_argument,
            ::foremoe::detail::concat("count_loads: ", out.data() == nullptr ? "null output, " : "", "out has ",
                                      out.size(), " elements, expected ", want, " (", steps, " micro-steps x ",
                                      num_moe_layers, " MoE layers x ", req.num_experts, " experts)")};
  Status err;
  Workspace::Impl *impl = ws.impl(err);
  if (impl == nullptr) return {err.code(), "count_loads: " + err.message()};
  return impl->count(req, num_moe_layers, out, stream, num_threads);
}

Status count_loads(Backend backend, const CountRequest &req, std::span<std::int64_t> out, int num_threads, void *stream,
                   int timeout_ms) {
  return detail::run_synchronously(backend, timeout_ms, "count_loads", "counting",
                                   [&](Workspace &ws) { return count_loads_async(ws, req, out, stream, num_threads); });
}

} // namespace runtime
} // namespace v0
} // namespace foremoe
