#pragma once
/// @file
/// Communication costs: all-to-all dispatch/combine from a token matrix, expert moves per path, replica
/// gradient reduction, and the alpha-beta fit of measured NCCL collectives (shared/data/h200-nccl.csv).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <istream>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/cost/csv.hpp"
#include "foremoe/cost/least_squares.hpp"
#include "foremoe/cost/params.hpp"

namespace foremoe {
inline namespace v0 {

/// Seconds of one all-to-all given `tokens`, a row-major `num_gpus x num_gpus` matrix: `tokens[s * n + d]`
/// tokens (token-expert rows) go from rank `s` to GPU `d`; the diagonal stays local and is free. Each row
/// carries `hidden * bytes_per_element` bytes. GPUs `g / gpus_per_node` share a node. Per GPU and link class
/// (NVLink inside the node, NIC across nodes): `latency + per_message * messages + max(send, recv) / bw`;
/// the two classes run concurrently and the collective ends with the slowest GPU. Combine is the same
/// exchange transposed, so it costs the same. Throws `Error` for a non-square matrix, a negative count or
/// non-positive sizes.
[[nodiscard]] inline double all_to_all_seconds(const AllToAllParams &p, std::span<const double> tokens, int num_gpus,
                                               int gpus_per_node, double hidden, double bytes_per_element) {
  detail::require(num_gpus > 0 && gpus_per_node > 0, "all_to_all_seconds: num_gpus and gpus_per_node must be positive");
  const auto n = static_cast<std::size_t>(num_gpus);
  detail::require(tokens.size() == n * n, "all_to_all_seconds: matrix has ", tokens.size(), " entries, expected ",
                  num_gpus, " x ", num_gpus);
  detail::require(hidden > 0 && bytes_per_element > 0,
                  "all_to_all_seconds: hidden and bytes_per_element must be positive");
  const double row_bytes = hidden * bytes_per_element;
  // [g][0] intra, [g][1] inter
  std::vector<double> send(2 * n, 0.0), recv(2 * n, 0.0), msgs_out(2 * n, 0.0), msgs_in(2 * n, 0.0);
  for (std::size_t s = 0; s < n; ++s)
    for (std::size_t d = 0; d < n; ++d) {
      const double t = tokens[s * n + d];
      detail::require(t >= 0 && std::isfinite(t), "all_to_all_seconds: tokens[", s, "][", d, "] = ", t,
                      " must be >= 0 and finite");
      if (s == d || t == 0) continue;
      const std::size_t c = (static_cast<int>(s) / gpus_per_node == static_cast<int>(d) / gpus_per_node) ? 0 : 1;
      send[2 * s + c] += t * row_bytes;
      recv[2 * d + c] += t * row_bytes;
      msgs_out[2 * s + c] += 1;
      msgs_in[2 * d + c] += 1;
    }
  const double bw[2] = {p.intra_gb_per_s * 1e9, p.inter_gb_per_s * 1e9};
  const double lat[2] = {p.intra_latency_us * 1e-6, p.inter_latency_us * 1e-6};
  double worst = 0;
  for (std::size_t g = 0; g < n; ++g) {
    double gpu = 0;
    for (std::size_t c = 0; c < 2; ++c) {
      const double bytes = std::max(send[2 * g + c], recv[2 * g + c]);
      if (bytes == 0) continue;
      const double msgs = std::max(msgs_out[2 * g + c], msgs_in[2 * g + c]);
      gpu = std::max(gpu, lat[c] + p.per_message_us * 1e-6 * msgs + bytes / bw[c]);
    }
    worst = std::max(worst, gpu);
  }
  return worst;
}

/// Dispatch: `all_to_all_seconds` with `tokens[src][dst]` as given.
[[nodiscard]] inline double dispatch_seconds(const AllToAllParams &p, std::span<const double> tokens, int num_gpus,
                                             int gpus_per_node, double hidden, double bytes_per_element) {
  return all_to_all_seconds(p, tokens, num_gpus, gpus_per_node, hidden, bytes_per_element);
}

/// Combine: the results travel back (the transposed exchange); same cost in this model.
[[nodiscard]] inline double combine_seconds(const AllToAllParams &p, std::span<const double> tokens, int num_gpus,
                                            int gpus_per_node, double hidden, double bytes_per_element) {
  const auto n = static_cast<std::size_t>(std::max(num_gpus, 0));
  detail::require(tokens.size() == n * n, "combine_seconds: matrix has ", tokens.size(), " entries, expected ",
                  num_gpus, " x ", num_gpus);
  std::vector<double> tr(n * n);
  for (std::size_t s = 0; s < n; ++s)
    for (std::size_t d = 0; d < n; ++d)
      tr[d * n + s] = tokens[s * n + d];
  return all_to_all_seconds(p, tr, num_gpus, gpus_per_node, hidden, bytes_per_element);
}

/// The path an expert move takes.
enum class MovePath : std::uint8_t { gpu_intra, gpu_inter, host };

[[nodiscard]] inline const PathParams &path_params(const MoveParams &p, MovePath path) noexcept {
  switch (path) {
  case MovePath::gpu_intra: return p.gpu_intra;
  case MovePath::gpu_inter: return p.gpu_inter;
  default: return p.host;
  }
}

/// Seconds to move `bytes` on `path` with the link to itself: latency + bytes / bandwidth (0 for 0 bytes).
[[nodiscard]] inline double move_seconds(const MoveParams &p, MovePath path, double bytes) {
  detail::require(bytes >= 0 && std::isfinite(bytes), "move_seconds: bytes must be >= 0, got ", bytes);
  if (bytes == 0) return 0.0;
  const PathParams &pp = path_params(p, path);
  return pp.latency_us * 1e-6 + bytes / (pp.gb_per_s * 1e9);
}

/// Seconds to reduce a replica's gradient (of an expert with `weight_bytes` bytes of weights) into its
/// owner over GPU-direct `path` (gpu_intra or gpu_inter): transfer + accumulate + fixed latency.
[[nodiscard]] inline double grad_reduce_seconds(const CostParams &p, MovePath path, double weight_bytes) {
  detail::require(path != MovePath::host, "grad_reduce_seconds: gradients are reduced GPU-direct, not via host");
  detail::require(weight_bytes >= 0 && std::isfinite(weight_bytes), "grad_reduce_seconds: bytes must be >= 0, got ",
                  weight_bytes);
  if (weight_bytes == 0) return 0.0;
  const double g = weight_bytes * p.grad.grad_bytes_factor;
  return p.grad.latency_us * 1e-6 + move_seconds(p.move, path, g) + g / (p.grad.add_gb_per_s * 1e9);
}

/// One measured NCCL collective (nccl-tests convention for `bytes`).
struct NcclSample {
  std::string op; ///< all_gather, alltoall, reduce_scatter, all_reduce
  int num_gpus = 0;
  double bytes = 0;
  double seconds = 0;
  int line = 0;
};

/// latency = alpha + bytes / beta, fitted on relative error; `bus_gb_per_s` = beta (n-1)/n / 1e9 for
/// all_to_all-like ops (the per-GPU link bandwidth `AllToAllParams::intra_gb_per_s` means).
struct AlphaBetaFit {
  double alpha_s = 0;
  double beta_bytes_per_s = 0;
  std::vector<double> rel_error;
  [[nodiscard]] double seconds(double bytes) const noexcept { return alpha_s + bytes / beta_bytes_per_s; }
  [[nodiscard]] double median() const { return detail::quantile(rel_error, 0.5); }
  [[nodiscard]] double p90() const { return detail::quantile(rel_error, 0.9); }
};

/// Fits alpha + S / beta by non-negative least squares weighted by 1 / measured time on the samples with
/// `op` and `num_gpus` (all of them when `op` is empty and `num_gpus` <= 0). Throws `Error` for fewer than 2
/// matching samples.
[[nodiscard]] inline AlphaBetaFit fit_alpha_beta(std::span<const NcclSample> samples, const std::string &op = "",
                                                 int num_gpus = 0) {
  std::vector<double> a, b, w;
  std::vector<const NcclSample *> used;
  for (const auto &s : samples) {
    if (!op.empty() && s.op != op) continue;
    if (num_gpus > 0 && s.num_gpus != num_gpus) continue;
    detail::require(s.seconds > 0 && s.bytes > 0, "fit_alpha_beta: line ", s.line, ": non-positive time or size");
    a.push_back(1.0);
    a.push_back(s.bytes);
    b.push_back(s.seconds);
    w.push_back(1.0 / s.seconds);
    used.push_back(&s);
  }
  detail::require(b.size() >= 2, "fit_alpha_beta: need 2 samples of op '", op, "' on ", num_gpus, " GPUs, got ",
                  b.size());
  const auto x = detail::nonneg_least_squares(a, b, w, 2);
  AlphaBetaFit f;
  f.alpha_s = x[0];
  f.beta_bytes_per_s = x[1] > 0 ? 1.0 / x[1] : 1e30;
  for (const auto *s : used)
    f.rel_error.push_back(std::abs(f.seconds(s->bytes) - s->seconds) / s->seconds);
  return f;
}

/// Reads the nccl-tests table (columns by name: op_name, num_gpus, message_bytes, latency_ms). Throws `Error`
/// naming the line of a malformed row.
[[nodiscard]] inline std::vector<NcclSample> read_nccl_csv(std::istream &in, const std::string &source = "<csv>") {
  const detail::CsvTable t(in, source);
  const auto c_op = t.column("op_name"), c_n = t.column("num_gpus"), c_b = t.column("message_bytes"),
             c_l = t.column("latency_ms");
  std::vector<NcclSample> out;
  for (std::size_t r = 0; r < t.size(); ++r) {
    NcclSample s;
    s.op = t.text(r, c_op);
    const long long n = t.integer(r, c_n);
    if (n <= 0 || n > (1 << 20)) t.fail_at(r, "num_gpus must be in [1, 2^20], got ", n);
    s.num_gpus = static_cast<int>(n);
    s.bytes = t.number(r, c_b);
    if (!(s.bytes > 0)) t.fail_at(r, "message_bytes must be positive, got ", s.bytes);
    s.seconds = t.number(r, c_l) * 1e-3;
    if (!(s.seconds > 0)) t.fail_at(r, "latency_ms must be positive");
    s.line = t.line_of(r);
    out.push_back(std::move(s));
  }
  return out;
}

/// `read_nccl_csv` on the file at `path`.
[[nodiscard]] inline std::vector<NcclSample> read_nccl_csv(const std::string &path) {
  std::ifstream in(path);
  detail::require(static_cast<bool>(in), "cannot open '", path, "'");
  return read_nccl_csv(in, path);
}

} // namespace v0
} // namespace foremoe
