// Token mapping front end: checks the request on the host, builds the token ranges once, hands them to a backend.

#include "foremoe/runtime/token_map.hpp"

#include <exception>
#include <string>
#include <vector>

#include "backends.hpp"
#include "foremoe/core/error.hpp"
#include "foremoe/plan/token_map.hpp"
#include "token_map_backends.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime {

Status map_tokens(Backend backend, const MapRequest &req, std::int32_t *out_slots, void *stream, int timeout_ms) {
  TokenRanges ranges;
  std::vector<std::int64_t> so;
  try {
    using ::foremoe::detail::require;
    (void)RoutedView(req.ids, req.dtype, req.num_tokens, req.num_layers, req.topk);
    require(req.layer_idx >= 0 && req.layer_idx < req.num_layers, "layer_idx ", req.layer_idx, " outside [0, ",
            req.num_layers, ")");
    require(req.num_experts > 0, "num_experts must be positive, got ", req.num_experts);
    require(req.num_sources > 0, "num_sources must be positive, got ", req.num_sources);
    require(timeout_ms >= 0, "timeout_ms must be >= 0, got ", timeout_ms);
    ranges = token_ranges(req.slot_expert, req.num_experts, req.slot_tokens, req.num_sources);
    so = ::foremoe::detail::source_ranges(req.source_offsets, req.num_sources, req.num_tokens);
  } catch (const Error &e) {
    const std::string what = e.what();
    return {StatusCode::invalid_argument, what.rfind("map_tokens: ", 0) == 0 ? what : "map_tokens: " + what};
  } catch (const std::exception &e) {
    return {StatusCode::internal, std::string("map_tokens: ") + e.what()};
  }
  if (out_slots == nullptr && req.num_tokens > 0) return {StatusCode::invalid_argument, "map_tokens: null output"};
  switch (backend) {
  case Backend::host:
    (void)stream;
    return detail::host_map_tokens(req, ranges, so, out_slots);
  case Backend::cuda:
#if defined(FOREMOE_HAVE_CUDA)
    if (detail::cuda_num_devices() == 0) return {StatusCode::unavailable, "map_tokens: no CUDA device"};
    return detail::cuda_map_tokens(req, ranges, so, out_slots, stream, timeout_ms);
#else
    (void)stream;
    return {StatusCode::unavailable, "map_tokens: this runtime was built without CUDA"};
#endif
  }
  return {StatusCode::invalid_argument, "map_tokens: unknown backend " + std::to_string(static_cast<int>(backend))};
}

} // namespace runtime
} // namespace v0
} // namespace foremoe
