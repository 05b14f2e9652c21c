#pragma once
// Checked CUDA calls: a throwing form for code that may fail, an assert-only
// form for destructors (which never throw), and conversion to Status at the
// runtime's API boundary.

#include <cuda_runtime_api.h>

#include <cassert>
#include <stdexcept>
#include <string>

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {

/// A CUDA or NCCL call failed; converted to `StatusCode::device_error` at the API.
class DeviceError : public std::runtime_error {
public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] void throw_cuda_error(cudaError_t err, const char *expr, const char *file, int line);

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe

#define FOREMOE_CUDA_CHECK(expr)                                                                                       \
  do {                                                                                                                 \
    const cudaError_t foremoe_err_ = (expr);                                                                           \
    if (foremoe_err_ != cudaSuccess)                                                                                   \
      ::foremoe::runtime::detail::throw_cuda_error(foremoe_err_, #expr, __FILE__, __LINE__);                           \
  } while (0)

#define FOREMOE_CUDA_ASSERT(expr)                                                                                      \
  do {                                                                                                                 \
    [[maybe_unused]] const cudaError_t foremoe_err_ = (expr);                                                          \
    assert(foremoe_err_ == cudaSuccess && #expr);                                                                      \
  } while (0)
