/// @file
/// libFuzzer target for the NPY reader: any input must either parse or throw foremoe::Error; anything else (another
/// exception, a crash, a sanitizer report, a failed self-check) is a bug.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "foremoe/trace/npy.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  // Small limits keep each run cheap while still letting sizes near them through.
  const foremoe::NpyReadLimits limits{std::int64_t{1} << 24, 8, 1 << 16};
  foremoe::NpyArray array;
  try {
    array = foremoe::parse_npy(std::span<const std::byte>{reinterpret_cast<const std::byte *>(data), size}, limits);
  } catch (const foremoe::Error &) {
    return 0;
  }
  // Accepted inputs must be self-consistent: every accessor works and a re-encoded image reads back identically.
  const std::int64_t num_elements = array.num_elements();
  if (static_cast<std::int64_t>(array.data.size()) != num_elements * array.dtype.item_bytes) std::abort();
  if (array.strides_elements().size() != array.shape.size()) std::abort();
  if (static_cast<std::int64_t>(array.to_doubles().size()) != num_elements) std::abort();
  const foremoe::NpyArray c_order = array.to_c_order();
  if (c_order.fortran_order || c_order.data.size() != array.data.size()) std::abort();
  if (array.dtype.kind != foremoe::NpyKind::float_) {
    try {
      if (static_cast<std::int64_t>(array.to_int64().size()) != num_elements) std::abort();
    } catch (const foremoe::Error &) {
      if (array.dtype != foremoe::NpyDtype{foremoe::NpyKind::uint_, 8}) std::abort(); // only uint64 may not fit
    }
  }
  const auto image = foremoe::encode_npy(array.dtype, array.shape, array.data.data(), array.fortran_order);
  const foremoe::NpyArray again = foremoe::parse_npy(image, limits);
  if (again.dtype != array.dtype || again.shape != array.shape || again.fortran_order != array.fortran_order ||
      again.data != array.data)
    std::abort();
  return 0;
}
