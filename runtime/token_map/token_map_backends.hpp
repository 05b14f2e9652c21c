#pragma once
// Internal interface between the token-mapping front end and its backends. The front end has checked the
// request's shape and built the token ranges and source offsets on the host.

#include <cstdint>
#include <span>

#include "foremoe/plan/token_map.hpp"
#include "foremoe/runtime/token_map.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {

Status host_map_tokens(const MapRequest &req, const TokenRanges &ranges, std::span<const std::int64_t> source_offsets,
                       std::int32_t *out_slots);

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
