#pragma once
/// @file
/// Small dense weighted least squares (Householder QR) for the cost-model fits; no external library.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "foremoe/core/error.hpp"

namespace foremoe {
inline namespace v0 {
namespace detail {

/// Solves min_x sum_i w_i^2 (A_i x - b_i)^2 for `A` row-major `m x n` (m >= n, n small) by Householder QR
/// on column-scaled data. Columns that are all zero get coefficient 0. Throws `Error` when m < n.
[[nodiscard]] inline std::vector<double> weighted_least_squares(const std::vector<double> &a,
                                                                const std::vector<double> &b,
                                                                const std::vector<double> &w, std::size_t n) {
  const std::size_t m = b.size();
  require(n > 0 && a.size() == m * n && w.size() == m, "least squares: inconsistent sizes");
  require(m >= n, "least squares: ", m, " samples cannot determine ", n, " parameters");
  // Column-major weighted copy, each column scaled to unit max norm for conditioning.
  std::vector<double> q(m * n), y(m), scale(n, 0.0);
  for (std::size_t j = 0; j < n; ++j) {
    for (std::size_t i = 0; i < m; ++i) scale[j] = std::max(scale[j], std::abs(a[i * n + j] * w[i]));
    const double s = scale[j] > 0 ? 1.0 / scale[j] : 0.0;
    for (std::size_t i = 0; i < m; ++i) q[j * m + i] = a[i * n + j] * w[i] * s;
  }
  for (std::size_t i = 0; i < m; ++i) y[i] = b[i] * w[i];
  std::vector<double> diag(n, 0.0);
  for (std::size_t k = 0; k < n; ++k) {
    double *col = &q[k * m];
    double norm = 0;
    for (std::size_t i = k; i < m; ++i) norm += col[i] * col[i];
    norm = std::sqrt(norm);
    if (norm < 1e-12) {
      diag[k] = 0;
      continue;
    }
    const double alpha = col[k] > 0 ? -norm : norm;
    col[k] -= alpha; // v = x - alpha e1, stored in place
    double vnorm2 = 0;
    for (std::size_t i = k; i < m; ++i) vnorm2 += col[i] * col[i];
    auto reflect = [&](double *t) {
      double dot = 0;
      for (std::size_t i = k; i < m; ++i) dot += col[i] * t[i];
      const double f = 2.0 * dot / vnorm2;
      for (std::size_t i = k; i < m; ++i) t[i] -= f * col[i];
    };
    for (std::size_t j = k + 1; j < n; ++j) reflect(&q[j * m]);
    reflect(y.data());
    diag[k] = alpha;
  }
  std::vector<double> x(n, 0.0);
  for (std::size_t kk = n; kk-- > 0;) {
    if (diag[kk] == 0) continue;
    double s = y[kk];
    for (std::size_t j = kk + 1; j < n; ++j) s -= q[j * m + kk] * x[j];
    x[kk] = s / diag[kk];
  }
  for (std::size_t j = 0; j < n; ++j) x[j] = scale[j] > 0 ? x[j] / scale[j] : 0.0;
  return x;
}

/// Like `weighted_least_squares` but with every coefficient >= 0: columns whose coefficient comes out
/// negative are dropped (coefficient 0) one at a time, most negative first, and the rest refitted.
[[nodiscard]] inline std::vector<double> nonneg_least_squares(const std::vector<double> &a,
                                                              const std::vector<double> &b,
                                                              const std::vector<double> &w, std::size_t n) {
  const std::size_t m = b.size();
  std::vector<bool> active(n, true);
  for (;;) {
    std::vector<double> sub(m * n);
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t j = 0; j < n; ++j) sub[i * n + j] = active[j] ? a[i * n + j] : 0.0;
    auto x = weighted_least_squares(sub, b, w, n);
    std::size_t worst = n;
    for (std::size_t j = 0; j < n; ++j)
      if (active[j] && x[j] < 0 && (worst == n || x[j] < x[worst])) worst = j;
    if (worst == n) return x;
    active[worst] = false;
  }
}

/// Value at quantile `q` in [0, 1] (linear interpolation) of `v`; 0 for an empty vector.
[[nodiscard]] inline double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<std::size_t>(pos);
  const std::size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (pos - static_cast<double>(lo)) * (v[hi] - v[lo]);
}

} // namespace detail
} // namespace v0
} // namespace foremoe
