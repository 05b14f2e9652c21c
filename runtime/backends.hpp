#pragma once
// Internal interface between the runtime's front end and its backends.

#include "foremoe/runtime/runtime.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {

Status host_count_loads(const CountRequest &req, int num_moe_layers, std::int64_t *out, int num_threads);

#if defined(FOREMOE_HAVE_CUDA)
int cuda_num_devices() noexcept;
#endif

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
