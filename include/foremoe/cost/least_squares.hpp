#pragma once
/// @file
/// Small dense weighted least squares (Householder QR) for the cost-model fits; no external library.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

#include "foremoe/core/error.hpp"

namespace foremoe {
inline namespace v0 {
namespace detail {

/// Least squares on a column-major `m x n` matrix `q` (overwritten by its Householder QR) and right-hand side
/// `y` (overwritten by Q^T y): returns argmin |q x - y|. A column that is zero, or dependent on the earlier
/// ones, gets coefficient 0.
[[nodiscard]] inline std::vector<double> householder_solve(std::vector<double> &q, std::vector<double> &y,
                                                           std::size_t n) {
  const std::size_t m = y.size();
  std::vector<double> diag(n, 0.0);
  for (std::size_t k = 0; k < n && k < m; ++k) {
    double *col = &q[k * m];
    double norm = 0;
    for (std::size_t i = k; i < m; ++i)
      norm += col[i] * col[i];
    norm = std::sqrt(norm);
    if (norm < 1e-12) {
      diag[k] = 0;
      continue;
    }
    const double alpha = col[k] > 0 ? -norm : norm;
    col[k] -= alpha; // v = x - alpha e1, stored in place
    double vnorm2 = 0;
    for (std::size_t i = k; i < m; ++i)
      vnorm2 += col[i] * col[i];
    auto reflect = [&](double *t) {
      double dot = 0;
      for (std::size_t i = k; i < m; ++i)
        dot += col[i] * t[i];
      const double f = 2.0 * dot / vnorm2;
      for (std::size_t i = k; i < m; ++i)
        t[i] -= f * col[i];
    };
    for (std::size_t j = k + 1; j < n; ++j)
      reflect(&q[j * m]);
    reflect(y.data());
    diag[k] = alpha;
  }
  std::vector<double> x(n, 0.0);
  for (std::size_t kk = n; kk-- > 0;) {
    if (diag[kk] == 0) continue;
    double s = y[kk];
    for (std::size_t j = kk + 1; j < n; ++j)
      s -= q[j * m + kk] * x[j];
    x[kk] = s / diag[kk];
  }
  return x;
}

/// The weighted problem min_x sum_i w_i^2 (A_i x - b_i)^2 in column-major form with each column scaled to unit
/// max norm (for conditioning): solve for z, then x_j = z_j / scale_j (x_j = 0 where scale_j = 0).
struct ScaledProblem {
  std::size_t m = 0, n = 0;
  std::vector<double> q; ///< column-major m x n: A_ij w_i / scale_j
  std::vector<double> y; ///< b_i w_i
  std::vector<double> scale;

  ScaledProblem(const std::vector<double> &a, const std::vector<double> &b, const std::vector<double> &w,
                std::size_t cols)
      : m(b.size()), n(cols), q(m * n), y(m), scale(n, 0.0) {
    require(n > 0 && a.size() == m * n && w.size() == m, "least squares: inconsistent sizes");
    require(m >= n, "least squares: ", m, " samples cannot determine ", n, " parameters");
    for (std::size_t j = 0; j < n; ++j) {
      for (std::size_t i = 0; i < m; ++i)
        scale[j] = std::max(scale[j], std::abs(a[i * n + j] * w[i]));
      const double s = scale[j] > 0 ? 1.0 / scale[j] : 0.0;
      for (std::size_t i = 0; i < m; ++i)
        q[j * m + i] = a[i * n + j] * w[i] * s;
    }
    for (std::size_t i = 0; i < m; ++i)
      y[i] = b[i] * w[i];
  }

  /// argmin over z with z_j = 0 outside `cols` (ascending column indices), unconstrained inside.
  [[nodiscard]] std::vector<double> solve_on(const std::vector<std::size_t> &cols) const {
    std::vector<double> sub(m * cols.size()), rhs = y;
    for (std::size_t c = 0; c < cols.size(); ++c)
      std::copy_n(q.begin() + static_cast<std::ptrdiff_t>(cols[c] * m), m,
                  sub.begin() + static_cast<std::ptrdiff_t>(c * m));
    const auto zs = householder_solve(sub, rhs, cols.size());
    std::vector<double> z(n, 0.0);
    for (std::size_t c = 0; c < cols.size(); ++c)
      z[cols[c]] = zs[c];
    return z;
  }

  /// q^T (y - q z): the negative gradient of the half squared residual.
  [[nodiscard]] std::vector<double> descent(const std::vector<double> &z) const {
    std::vector<double> r = y;
    for (std::size_t j = 0; j < n; ++j)
      if (z[j] != 0)
        for (std::size_t i = 0; i < m; ++i)
          r[i] -= q[j * m + i] * z[j];
    std::vector<double> g(n, 0.0);
    for (std::size_t j = 0; j < n; ++j)
      for (std::size_t i = 0; i < m; ++i)
        g[j] += q[j * m + i] * r[i];
    return g;
  }

  [[nodiscard]] std::vector<double> unscale(std::vector<double> z) const {
    for (std::size_t j = 0; j < n; ++j)
      z[j] = scale[j] > 0 ? z[j] / scale[j] : 0.0;
    return z;
  }
};

/// Solves min_x sum_i w_i^2 (A_i x - b_i)^2 for `A` row-major `m x n` (m >= n, n small) by Householder QR
/// on column-scaled data. Columns that are all zero get coefficient 0. Throws `Error` when m < n.
[[nodiscard]] inline std::vector<double> weighted_least_squares(const std::vector<double> &a,
                                                                const std::vector<double> &b,
                                                                const std::vector<double> &w, std::size_t n) {
  ScaledProblem p(a, b, w, n);
  return p.unscale(householder_solve(p.q, p.y, n));
}

/// Like `weighted_least_squares` but with every coefficient >= 0: the exact non-negative least squares
/// optimum by Lawson and Hanson's active-set method ("Solving Least Squares Problems", 1974, ch. 23). It
/// frees the column with the largest descent, solves on the free set, and steps back to the feasible
/// boundary when a free coefficient would go negative; at the end x >= 0, the descent A^T W^2 (b - A x) is
/// ~0 where x > 0 and <= 0 where x = 0 (the KKT conditions). Throws `Error` as `weighted_least_squares`.
[[nodiscard]] inline std::vector<double> nonneg_least_squares(const std::vector<double> &a,
                                                              const std::vector<double> &b,
                                                              const std::vector<double> &w, std::size_t n) {
  const ScaledProblem p(a, b, w, n);
  // Descents at or below `tol` count as zero (MATLAB's lsqnonneg uses the same form of tolerance).
  double norm1 = 0; // max column sum of |q|
  for (std::size_t j = 0; j < n; ++j) {
    double s = 0;
    for (std::size_t i = 0; i < p.m; ++i)
      s += std::abs(p.q[j * p.m + i]);
    norm1 = std::max(norm1, s);
  }
  double ynorm = 0;
  for (double v : p.y)
    ynorm = std::max(ynorm, std::abs(v));
  const double tol =
      10 * std::numeric_limits<double>::epsilon() * norm1 * static_cast<double>(p.m) * std::max(1.0, ynorm);
  std::vector<bool> free_set(n, false); // Lawson-Hanson's P; the rest (Z) are held at 0
  std::vector<double> z(n, 0.0);
  auto free_cols = [&] {
    std::vector<std::size_t> c;
    for (std::size_t j = 0; j < n; ++j)
      if (free_set[j]) c.push_back(j);
    return c;
  };
  // Each outer step frees one column and the objective strictly decreases, so no support repeats; the cap
  // only guards against rounding loops (then z is still feasible, and as good as any support seen).
  for (std::size_t outer = 0; outer < 3 * n + 3; ++outer) {
    const auto g = p.descent(z);
    std::size_t t = n;
    for (std::size_t j = 0; j < n; ++j)
      if (!free_set[j] && p.scale[j] > 0 && g[j] > tol && (t == n || g[j] > g[t])) t = j;
    if (t == n) break; // KKT holds
    free_set[t] = true;
    const auto before = z;
    for (std::size_t inner = 0; inner <= n; ++inner) {
      auto s = p.solve_on(free_cols());
      double step = 1;
      std::size_t blocking = n; // the free coefficient that reaches 0 first
      for (std::size_t j = 0; j < n; ++j)
        if (free_set[j] && s[j] <= 0) {
          const double r = z[j] > 0 ? z[j] / (z[j] - s[j]) : 0.0;
          if (blocking == n || r < step) {
            step = r;
            blocking = j;
          }
        }
      if (blocking == n) {
        z = std::move(s);
        break;
      }
      // Move towards s until the blocking coefficient reaches 0, and hold every one at 0 there.
      for (std::size_t j = 0; j < n; ++j) {
        if (!free_set[j]) continue;
        z[j] += step * (s[j] - z[j]);
        if (j == blocking || z[j] <= 0) {
          z[j] = 0;
          free_set[j] = false;
        }
      }
    }
    if (z == before) break; // only rounding can refuse the column with the largest descent: nothing to gain
  }
  return p.unscale(z);
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
