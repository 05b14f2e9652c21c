#pragma once
/// @file
/// Replica-gradient additions in each `GradType` on the host: what the host transport runs, the reference the CUDA
/// transport's kernel mirrors (`runtime/transports/cuda/cuda_transport.cu`, `accumulate_kernel`), and a helper for
/// transports of one's own. bfloat16 / float16 values are their bit patterns (`std::uint16_t`).

#include <bit>
#include <cstdint>

#include "foremoe/runtime/transfer_engine.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime {

/// The float32 value of bfloat16 `h` (exact: bfloat16 is float32's upper half).
[[nodiscard]] inline float bf16_to_float(std::uint16_t h) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);
}
/// `f` rounded to bfloat16, to nearest, ties to even; NaN gives a quiet NaN of the same sign (0x7fc0 | sign).
[[nodiscard]] inline std::uint16_t float_to_bf16(float f) noexcept {
  std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u); // carries into the exponent where the mantissa rounds up (to inf at the top)
  return static_cast<std::uint16_t>(u >> 16);
}
/// The float32 value of IEEE binary16 `h` (exact).
[[nodiscard]] inline float f16_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) { // zero or subnormal: mant * 2^-24, exact in float32
    const float v = static_cast<float>(mant) * 0x1p-24f;
    return sign ? -v : v;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}
/// `f` rounded to IEEE binary16, to nearest, ties to even (subnormals included, overflow to infinity); NaN gives a
/// quiet NaN of the same sign (0x7e00 | sign).
[[nodiscard]] inline std::uint16_t float_to_f16(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u;
  if (ax >= 0x477ff000u) return sign | 0x7c00u; // >= 65520 (the tie above 65504 rounds to even: infinity)
  const std::uint32_t e = ax >> 23;
  if (e < 113) { // below 2^-14: a subnormal (or zero) of 2^-24 units
    const std::uint32_t shift = 126 - e;
    if (shift >= 25) return sign; // below 2^-25, or exactly it (a tie, to even: zero)
    const std::uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    std::uint32_t r = m >> shift;
    const std::uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<std::uint16_t>(sign | r);
  }
  std::uint32_t r = ((e - 112u) << 10) | ((ax & 0x7fffffu) >> 13);
  const std::uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r; // a carry moves into the exponent, as it should
  return static_cast<std::uint16_t>(sign | r);
}

/// `dst[i] += src[i]` for `n` elements of `type` (`GradType`'s rounding rule).
inline void add_grads(void *dst, const void *src, std::int64_t n, GradType type) noexcept {
  switch (type) {
  case GradType::f32: {
    auto *d = static_cast<float *>(dst);
    const auto *s = static_cast<const float *>(src);
    for (std::int64_t i = 0; i < n; ++i)
      d[i] += s[i];
    return;
  }
  case GradType::f64: {
    auto *d = static_cast<double *>(dst);
    const auto *s = static_cast<const double *>(src);
    for (std::int64_t i = 0; i < n; ++i)
      d[i] += s[i];
    return;
  }
  case GradType::bf16: {
    auto *d = static_cast<std::uint16_t *>(dst);
    const auto *s = static_cast<const std::uint16_t *>(src);
    for (std::int64_t i = 0; i < n; ++i)
      d[i] = float_to_bf16(bf16_to_float(d[i]) + bf16_to_float(s[i]));
    return;
  }
  case GradType::f16: {
    auto *d = static_cast<std::uint16_t *>(dst);
    const auto *s = static_cast<const std::uint16_t *>(src);
    for (std::int64_t i = 0; i < n; ++i)
      d[i] = float_to_f16(f16_to_float(d[i]) + f16_to_float(s[i]));
    return;
  }
  }
}

} // namespace runtime
} // namespace v0
} // namespace foremoe
