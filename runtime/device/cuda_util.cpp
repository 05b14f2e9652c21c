#include <string>

#include "../backends.hpp"
#include "cuda_check.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {

void throw_cuda_error(cudaError_t err, const char *expr, const char *file, int line) {
  throw DeviceError(std::string(expr) + " failed with " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
                    ") at " + file + ":" + std::to_string(line));
}

int cuda_num_devices() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError(); // clear the sticky "no device" error
    return 0;
  }
  return n;
}

Status cuda_host_register(void *ptr, std::int64_t bytes, const std::string &what) {
  const cudaError_t err = cudaHostRegister(ptr, static_cast<std::size_t>(bytes), cudaHostRegisterPortable);
  if (err == cudaSuccess) return {};
  (void)cudaGetLastError();
  return {StatusCode::device_error, "cudaHostRegister of " + std::to_string(bytes) + " bytes of " + what +
                                        " failed with " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")"};
}

void cuda_host_unregister(void *ptr) noexcept { (void)cudaHostUnregister(ptr); }

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
