#pragma once
// Internal interface between the runtime's front end and its backends.

#include <cstdint>
#include <string>

#include "foremoe/core/thread_pool.hpp"
#include "foremoe/runtime/runtime.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {

/// Counts on the host, micro-steps split in contiguous blocks over the threads of `pool`.
Status host_count_loads(const CountRequest &req, int num_moe_layers, std::int64_t *out, ThreadPool &pool);

#if defined(FOREMOE_HAVE_CUDA)
int cuda_num_devices() noexcept;
/// Pins `bytes` of host memory at `ptr` for every device (`cudaHostRegister`, portable); `device_error` naming
/// `what` when CUDA refuses (no device, memory already registered).
Status cuda_host_register(void *ptr, std::int64_t bytes, const std::string &what);
void cuda_host_unregister(void *ptr) noexcept;
#endif

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
