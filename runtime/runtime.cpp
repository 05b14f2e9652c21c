#include "foremoe/runtime/runtime.hpp"

#include <exception>

#include "backends.hpp"
#include "foremoe/core/error.hpp"
#include "foremoe/trace/count.hpp"

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
    ::foremoe::detail::require(lmap.num_trace_layers() == req.num_layers, "layer map covers ",
                               lmap.num_trace_layers(), " layers but the trace has ", req.num_layers);
    if (!req.microbatch_offsets.empty())
      ::foremoe::detail::check_offsets(req.microbatch_offsets, req.num_tokens, "microbatch_offsets");
    num_moe_layers = lmap.num_moe_layers();
  } catch (const Error &e) {
    return {StatusCode::invalid_argument, std::string("count_loads: ") + e.what()};
  }
  return Status::success();
}
} // namespace

Status count_loads(Backend backend, const CountRequest &req, std::int64_t *out, int num_threads, void *stream,
                   int timeout_ms) {
  int num_moe_layers = 0;
  if (Status st = check_request(req, num_moe_layers); !st.ok()) return st;
  if (out == nullptr) return {StatusCode::invalid_argument, "count_loads: null output"};
  switch (backend) {
  case Backend::host:
    return detail::host_count_loads(req, num_moe_layers, out, num_threads < 1 ? 1 : num_threads);
  case Backend::cuda:
#if defined(FOREMOE_HAVE_CUDA)
    return detail::cuda_count_loads(req, num_moe_layers, out, stream, timeout_ms);
#else
    (void)stream;
    (void)timeout_ms;
    return {StatusCode::unavailable, "count_loads: this runtime was built without CUDA"};
#endif
  }
  return {StatusCode::invalid_argument, "count_loads: unknown backend"};
}

} // namespace runtime
} // namespace v0
} // namespace foremoe
