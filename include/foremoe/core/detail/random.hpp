#pragma once
/// @file
/// Random numbers specified bit for bit (not by the standard library), so that seeded output is the same with
/// every standard library: stream seeds, the xoshiro256** generator, samplers and a Walker/Vose alias table.
/// Shared by the synthetic trace generator and the peer workloads; not API.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace foremoe {
inline namespace v0 {
namespace detail {

/// splitmix64 finaliser: a bijective mix used to derive independent stream seeds.
[[nodiscard]] constexpr std::uint64_t mix64(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// Seed of the stream named by `parts`; order matters, so (a, b) and (b, a) differ.
[[nodiscard]] constexpr std::uint64_t stream_seed(std::uint64_t seed, std::uint64_t a, std::uint64_t b = 0,
                                                  std::uint64_t c = 0, std::uint64_t d = 0) noexcept {
  std::uint64_t h = mix64(seed ^ 0x666f72656d6f6521ULL);
  h = mix64(h ^ a);
  h = mix64(h ^ (b + 0x1000193ULL));
  h = mix64(h ^ (c + 0x2000329ULL));
  return mix64(h ^ (d + 0x30004bfULL));
}

/// xoshiro256**: small, fast, and specified bit for bit (unlike std distributions).
class Xoshiro256 {
public:
  explicit Xoshiro256(std::uint64_t seed) noexcept {
    for (auto &w : s_) {
      seed += 0x9e3779b97f4a7c15ULL;
      std::uint64_t z = seed;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
      w = z ^ (z >> 31);
    }
  }
  std::uint64_t next() noexcept {
    const std::uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const std::uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  /// Uniform in [0, 1).
  double uniform() noexcept { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  /// Uniform in (0, 1), safe for log().
  double uniform_open() noexcept { return (static_cast<double>(next() >> 12) + 0.5) * 0x1.0p-52; }
  /// Uniform integer in [0, n) for 0 < n <= 2^32, unbiased (Lemire's multiply-shift with rejection).
  std::uint64_t below(std::uint64_t n) noexcept {
    std::uint64_t m = (next() >> 32) * n;
    if (static_cast<std::uint32_t>(m) < n) {
      const std::uint64_t threshold = (std::uint64_t{1} << 32) % n;
      while ((m & 0xFFFFFFFFu) < threshold)
        m = (next() >> 32) * n;
    }
    return m >> 32;
  }

private:
  static constexpr std::uint64_t rotl(std::uint64_t x, int k) noexcept { return (x << k) | (x >> (64 - k)); }
  std::uint64_t s_[4]{};
};

/// Standard normal (Marsaglia polar method).
inline double sample_normal(Xoshiro256 &rng) noexcept {
  for (;;) {
    const double u = 2.0 * rng.uniform() - 1.0, v = 2.0 * rng.uniform() - 1.0;
    const double s = u * u + v * v;
    if (s > 0 && s < 1) return u * std::sqrt(-2.0 * std::log(s) / s);
  }
}

/// Gamma(shape, 1) (Marsaglia-Tsang; shapes below 1 boosted by U^(1/shape)).
inline double sample_gamma(Xoshiro256 &rng, double shape) noexcept {
  if (shape < 1.0) return sample_gamma(rng, shape + 1.0) * std::pow(rng.uniform_open(), 1.0 / shape);
  const double d = shape - 1.0 / 3.0, c = 1.0 / std::sqrt(9.0 * d);
  for (;;) {
    const double x = sample_normal(rng);
    double v = 1.0 + c * x;
    if (v <= 0) continue;
    v = v * v * v;
    const double u = rng.uniform_open();
    if (u < 1.0 - 0.0331 * (x * x) * (x * x)) return d * v;
    if (std::log(u) < 0.5 * x * x + d * (1.0 - v + std::log(v))) return d * v;
  }
}

/// exp(N(mu, sigma^2)) with mu chosen so that the mean is `mean`.
inline double sample_lognormal(Xoshiro256 &rng, double mean, double sigma) noexcept {
  if (sigma == 0) return mean;
  return std::exp(std::log(mean) - 0.5 * sigma * sigma + sigma * sample_normal(rng));
}

/// Dirichlet(alpha) into `out` (same size); an all-underflow draw falls back to the normalised alpha.
inline void sample_dirichlet(Xoshiro256 &rng, const double *alpha, double *out, std::size_t n) noexcept {
  double sum = 0;
  for (std::size_t i = 0; i < n; ++i)
    sum += out[i] = sample_gamma(rng, alpha[i]);
  if (!(sum > 0)) {
    sum = 0;
    for (std::size_t i = 0; i < n; ++i)
      sum += out[i] = alpha[i];
  }
  for (std::size_t i = 0; i < n; ++i)
    out[i] /= sum;
}

/// Walker/Vose alias table over a power-of-two number of buckets (the weights padded with zeros), so that one
/// 32-bit random draws from it: its high bits pick the bucket exactly uniformly, the rest decide between the
/// bucket and its alias.
class AliasTable {
public:
  /// Builds from `n` (1 <= n <= 2^20) non-negative weights with a positive sum.
  void build(const double *weights, int n) {
    const auto size = std::bit_ceil(static_cast<std::uint32_t>(n));
    shift_ = 32 - std::countr_zero(size);
    low_mask_ = static_cast<std::uint32_t>((std::uint64_t{1} << shift_) - 1);
    const double unit = static_cast<double>(std::uint64_t{1} << shift_);
    cells_.resize(size);
    scaled_.resize(size);
    small_.resize(size);
    large_.resize(size);
    double sum = 0;
    for (int i = 0; i < n; ++i)
      sum += weights[i];
    std::size_t num_small = 0, num_large = 0;
    for (std::uint32_t i = 0; i < size; ++i) {
      const double s = i < static_cast<std::uint32_t>(n) ? weights[i] * size / sum : 0.0;
      scaled_[i] = s;
      (s < 1.0 ? small_[num_small++] : large_[num_large++]) = static_cast<int>(i);
    }
    while (num_small > 0 && num_large > 0) {
      const int s = small_[--num_small], g = large_[--num_large];
      const double ps = scaled_[static_cast<std::size_t>(s)];
      cells_[static_cast<std::size_t>(s)] = {static_cast<std::uint32_t>(std::min(std::max(0.0, ps) * unit, unit - 1)),
                                             g};
      double &sg = scaled_[static_cast<std::size_t>(g)];
      sg = (sg + ps) - 1.0;
      (sg < 1.0 ? small_[num_small++] : large_[num_large++]) = g;
    }
    // Leftovers are 1 up to rounding; pointing them at themselves makes the threshold irrelevant. A padding bucket
    // (zero weight) can only be left over by rounding: it points at the heaviest real weight instead.
    int heaviest = 0;
    for (int i = 1; i < n; ++i)
      if (weights[i] > weights[heaviest]) heaviest = i;
    for (std::size_t q = 0; q < num_large + num_small; ++q) {
      const int g = q < num_large ? large_[q] : small_[q - num_large];
      cells_[static_cast<std::size_t>(g)] = {0, g < n ? g : heaviest};
    }
  }
  /// A draw from 32 random bits.
  [[nodiscard]] int sample_bits(std::uint32_t r) const noexcept {
    const auto idx = static_cast<std::size_t>(static_cast<std::uint64_t>(r) >> shift_);
    const Cell c = cells_[idx];
    return (r & low_mask_) < c.threshold ? static_cast<int>(idx) : c.alias;
  }
  /// A draw from the high half of one random word.
  [[nodiscard]] int sample(Xoshiro256 &rng) const noexcept {
    return sample_bits(static_cast<std::uint32_t>(rng.next() >> 32));
  }

private:
  struct Cell {
    std::uint32_t threshold; ///< keep the bucket when the low bits are below this
    int alias;
  };
  int shift_ = 32;
  std::uint32_t low_mask_ = 0;
  std::vector<Cell> cells_;
  std::vector<double> scaled_;
  std::vector<int> small_, large_;
};

} // namespace detail
} // namespace v0
} // namespace foremoe
