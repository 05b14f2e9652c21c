// Token mapping front end: checks the request on the host, builds the token ranges once, hands them to a backend.

#include "foremoe/runtime/token_map.hpp"

#include <exception>
#include <string>
#include <vector>

#include "../backends.hpp"
#include "../workspace/workspace.hpp"
#include "foremoe/core/error.hpp"
#include "foremoe/plan/token_map.hpp"
#include "token_map_backends.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime {

namespace {
// Checks `req` and the output's size, and builds the plan's token ranges and the source offsets.
Status prepare(const MapRequest &req, std::span<std::int32_t> out_slots, TokenRanges &ranges,
               std::vector<std::int64_t> &so) {
  try {
    using ::foremoe::detail::require;
    (void)RoutedView(req.ids, req.dtype, req.num_tokens, req.num_layers, req.topk);
    require(req.layer_idx >= 0 && req.layer_idx < req.num_layers, "layer_idx ", req.layer_idx, " outside [0, ",
            req.num_layers, ")");
    require(req.num_experts > 0, "num_experts must be positive, got ", req.num_experts);
    require(req.num_sources > 0, "num_sources must be positive, got ", req.num_sources);
    ranges = token_ranges(req.slot_expert, req.num_experts, req.slot_tokens, req.num_sources);
    so = ::foremoe::detail::source_ranges(req.source_offsets, req.num_sources, req.num_tokens);
  } catch (const Error &e) {
    const std::string what = e.what();
    return {StatusCode::invalid_argument, what.rfind("map_tokens: ", 0) == 0 ? what : "map_tokens: " + what};
  } catch (const std::exception &e) {
    return {StatusCode::internal, std::string("map_tokens: ") + e.what()};
  }
  const std::int64_t want = req.num_tokens * req.topk;
  if (static_cast<std::int64_t>(out_slots.size()) != want || (out_slots.data() == nullptr && want > 0))
    return {StatusCode::invalid_argument,
            ::foremoe::detail::concat("map_tokens: ", out_slots.data() == nullptr ? "null output, " : "",
                                      "out_slots has ", out_slots.size(), " elements, expected ", want, " (",
                                      req.num_tokens, " tokens x topk ", req.topk, ")")};
  return Status::success();
}
} // namespace

Status map_tokens_async(Workspace &ws, const MapRequest &req, std::span<std::int32_t> out_slots, void *stream) {
  TokenRanges ranges;
  std::vector<std::int64_t> so;
  if (Status st = prepare(req, out_slots, ranges, so); !st.ok()) return st;
  Status err;
  Workspace::Impl *impl = ws.impl(err);
  if (impl == nullptr) return {err.code(), "map_tokens: " + err.message()};
  return impl->map(req, ranges, so, out_slots, stream);
}

Status map_tokens(Backend backend, const MapRequest &req, std::span<std::int32_t> out_slots, void *stream,
                  int timeout_ms) {
  return detail::run_synchronously(backend, timeout_ms, "map_tokens", "mapping",
                                   [&](Workspace &ws) { return map_tokens_async(ws, req, out_slots, stream); });
}

} // namespace runtime
} // namespace v0
} // namespace foremoe
