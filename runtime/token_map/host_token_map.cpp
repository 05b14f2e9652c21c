// Host backend of token mapping: the header-only CPU reference, run in place on host ids.

#include <exception>
#include <string>

#include "token_map_backends.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {

Status host_map_tokens(const MapRequest &req, const TokenRanges &ranges, std::span<const std::int64_t> source_offsets,
                       std::int32_t *out_slots) try {
  const RoutedView view(req.ids, req.dtype, req.num_tokens, req.num_layers, req.topk);
  ::foremoe::map_tokens(ranges, view, req.layer_idx,
                        std::span<std::int32_t>(out_slots, static_cast<std::size_t>(req.num_tokens) * req.topk),
                        source_offsets);
  return Status::success();
} catch (const Error &e) {
  return {StatusCode::invalid_argument, e.what()};
} catch (const std::exception &e) {
  return {StatusCode::internal, std::string("map_tokens: ") + e.what()};
}

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
