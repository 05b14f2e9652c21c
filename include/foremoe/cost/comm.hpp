#pragma once
/// @file
/// Communication costs: all-to-all dispatch/combine from a token matrix, expert moves per path, replica
/// gradient reduction, and the alpha-beta fit of measured NCCL collectives (shared/data/h200-nccl.csv).

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <istream>
#include <limits>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/files.hpp"
#include "foremoe/cost/csv.hpp"
#include "foremoe/cost/least_squares.hpp"
#include "foremoe/cost/params.hpp"

namespace foremoe {
inline namespace v0 {

/// Seconds of one all-to-all given `tokens`, a row-major `num_gpus x num_gpus` matrix: `tokens[s * n + d]`
/// tokens (token-expert rows) go from rank `s` to GPU `d`; the diagonal stays local and is free. Each row
/// carries `hidden * bytes_per_element` bytes. GPUs `g / gpus_per_node` share a node. Per GPU and link class
/// (NVLink inside the node, NIC across nodes): `latency + per_message * messages + max(send, recv) / bw`
/// (`per_message_us` inside a node, `inter_per_message_us` across);
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
  const double per_msg[2] = {p.per_message_us * 1e-6, p.inter_per_message_us * 1e-6};
  double worst = 0;
  for (std::size_t g = 0; g < n; ++g) {
    double gpu = 0;
    for (std::size_t c = 0; c < 2; ++c) {
      const double bytes = std::max(send[2 * g + c], recv[2 * g + c]);
      if (bytes == 0) continue;
      const double msgs = std::max(msgs_out[2 * g + c], msgs_in[2 * g + c]);
      gpu = std::max(gpu, lat[c] + per_msg[c] * msgs + bytes / bw[c]);
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

// ---------------------------------------------------------------------------------------------------------
// The all-to-all of one layer from per-slot token counts (what the simulator knows).
//
// The simulator has, per layer and micro-step, the token-expert rows each physical expert slot receives, not
// which token went where. Dispatch volume after deduplication depends on how many distinct GPUs and nodes a
// token's top-k experts land on, so it is estimated: a token selects each slot c independently with
// probability pi_c = rows_c / tokens, except that the copies of one expert are mutually exclusive (a token
// goes to one copy); hence the probability that a token sends nothing to a set X of GPUs (a GPU, or a node)
// is prod over experts e of (1 - sum of pi_c over e's copies in X). This independence approximation
// ignores co-activation (experts that tend to be picked together) and the router's node limit
// (DeepSeek-V3 sends a token to at most 4 nodes); both would lower the volume further.

/// Per GPU and node: the probability that one token sends at least one row there.
struct A2aHits {
  std::vector<double> gpu;  ///< `[num_gpus]`: q_g
  std::vector<double> node; ///< `[num_nodes]`: h_b
};

/// Hit probabilities of one layer: `slot_expert[g * slots_per_gpu + s]` is the logical expert of GPU g's slot
/// s (negative: empty), `slot_rows` the token-expert rows it receives, `tokens` the tokens of the micro-step
/// (before routing). Throws `Error` for inconsistent sizes, negative rows or non-positive tokens.
[[nodiscard]] inline A2aHits a2a_hits_from_slots(std::span<const std::int32_t> slot_expert,
                                                 std::span<const std::int64_t> slot_rows, int slots_per_gpu,
                                                 int gpus_per_node, int num_experts, double tokens) {
  detail::require(slots_per_gpu > 0 && gpus_per_node > 0 && num_experts > 0,
                  "a2a_hits_from_slots: slots, gpus_per_node and experts must be positive");
  detail::require(slot_expert.size() == slot_rows.size() && slot_expert.size() % slots_per_gpu == 0,
                  "a2a_hits_from_slots: ", slot_expert.size(), " slot experts and ", slot_rows.size(),
                  " slot rows for ", slots_per_gpu, " slots per GPU");
  const int G = static_cast<int>(slot_expert.size()) / slots_per_gpu;
  detail::require(G % gpus_per_node == 0, "a2a_hits_from_slots: ", G, " GPUs are not whole nodes of ", gpus_per_node);
  detail::require(tokens > 0 && std::isfinite(tokens), "a2a_hits_from_slots: tokens must be positive, got ", tokens);
  const int N = G / gpus_per_node;
  A2aHits h;
  h.gpu.assign(static_cast<std::size_t>(G), 0.0);
  h.node.assign(static_cast<std::size_t>(N), 0.0);
  std::vector<double> share(static_cast<std::size_t>(num_experts), 0.0); // sum of pi over copies in the set
  std::vector<std::int32_t> touched;
  auto miss_of = [&](int g0, int g1) { // GPUs [g0, g1)
    touched.clear();
    for (int p = g0 * slots_per_gpu; p < g1 * slots_per_gpu; ++p) {
      const std::int32_t e = slot_expert[p];
      detail::require(slot_rows[p] >= 0, "a2a_hits_from_slots: slot ", p, " has ", slot_rows[p], " rows");
      if (e < 0 || slot_rows[p] == 0) continue;
      detail::require(e < num_experts, "a2a_hits_from_slots: slot ", p, " holds expert ", e, " of ", num_experts);
      if (share[e] == 0) touched.push_back(e);
      share[e] += static_cast<double>(slot_rows[p]) / tokens;
    }
    double miss = 1;
    for (std::int32_t e : touched) {
      miss *= std::max(0.0, 1.0 - std::min(1.0, share[e]));
      share[e] = 0;
    }
    return 1.0 - miss;
  };
  for (int g = 0; g < G; ++g)
    h.gpu[g] = miss_of(g, g + 1);
  for (int b = 0; b < N; ++b)
    h.node[b] = miss_of(b * gpus_per_node, (b + 1) * gpus_per_node);
  return h;
}

/// The fewest distinct tokens any placement can give GPUs receiving `gpu_rows` rows: each GPU's (and node's)
/// rows spread evenly over all `num_experts` experts, q = 1 - (1 - rows / (tokens E))^E. Since log(1 - x) is
/// concave, no placement with at most E distinct experts on a GPU or node gives it a lower hit probability
/// for the same rows; `ideal` uses this bound.
[[nodiscard]] inline A2aHits a2a_hits_spread(std::span<const double> gpu_rows, int gpus_per_node, int num_experts,
                                             double tokens) {
  detail::require(gpus_per_node > 0 && num_experts > 0 && gpu_rows.size() % gpus_per_node == 0,
                  "a2a_hits_spread: ", gpu_rows.size(), " GPUs are not whole nodes of ", gpus_per_node);
  detail::require(tokens > 0 && std::isfinite(tokens), "a2a_hits_spread: tokens must be positive, got ", tokens);
  const double E = num_experts;
  auto hit = [&](double rows) {
    return rows <= 0 ? 0.0 : 1.0 - std::pow(std::max(0.0, 1.0 - std::min(E, rows / tokens) / E), E);
  };
  A2aHits h;
  const std::size_t G = gpu_rows.size(), P = static_cast<std::size_t>(gpus_per_node);
  for (std::size_t b = 0; b < G / P; ++b) {
    double node = 0;
    for (std::size_t g = b * P; g < (b + 1) * P; ++g) {
      h.gpu.push_back(hit(gpu_rows[g]));
      node += gpu_rows[g];
    }
    h.node.push_back(hit(node));
  }
  return h;
}

/// One layer's hierarchical (DeepEP-style) dispatch per GPU, in tokens (rows of `row_bytes` bytes), and the peers
/// each GPU exchanges with: the larger of the peers it sends to and receives from with traffic, per link class.
/// Combine is the same exchange reversed (the partial sums reduced at the forwarding GPU), so it has the same
/// volumes. A token of rank (a, i) that hits remote node b crosses once, from its rank's NIC to GPU (b, i), which
/// forwards it over NVLink to the hit GPUs of b; its own node's hit GPUs get it from the rank itself; a token
/// crosses to a GPU once however many of its experts that GPU holds.
struct A2aVolumes {
  int gpus_per_node = 1;
  std::vector<double> nic_send, nic_recv;   ///< `[num_gpus]`: tokens over the GPU's NIC
  std::vector<double> nvl_send, nvl_recv;   ///< `[num_gpus]`: tokens over its NVLink (own and forwarded)
  std::vector<double> nic_peers, nvl_peers; ///< `[num_gpus]`: remote nodes / local GPUs with traffic

  [[nodiscard]] int num_gpus() const noexcept { return static_cast<int>(nic_send.size()); }
  /// Token copies that cross between nodes: the NIC sends summed over the GPUs.
  [[nodiscard]] double inter_node_rows() const noexcept {
    double s = 0;
    for (const double v : nic_send)
      s += v;
    return s;
  }
};

/// Expected volumes from hit probabilities (the independence estimate, see `a2a_hits_from_slots`). `tokens` of the
/// micro-step are spread evenly over the G = N P ranks (data parallel), T_s = tokens / G each. For GPU g = (b, i):
///   NIC   send  T_s sum_{b' != b} h_b'        receive  (N - 1) T_s h_b
///   NVLink send (tokens / P) sum_{j in b, j != g} q_j (own tokens and forwarded ones)
///          receive tokens q_g (P - 1) / P
/// Peers: the nodes (GPUs of the node) hit at all, as every rank sends some token to each with probability near 1.
[[nodiscard]] inline A2aVolumes a2a_volumes(const A2aHits &hits, double tokens, int gpus_per_node) {
  const auto G = static_cast<int>(hits.gpu.size()), P = gpus_per_node;
  detail::require(P > 0 && G % P == 0 && static_cast<int>(hits.node.size()) * P == G, "a2a_volumes: ", G, " GPU and ",
                  hits.node.size(), " node hit probabilities for ", gpus_per_node, " GPUs per node");
  detail::require(tokens >= 0 && std::isfinite(tokens), "a2a_volumes: tokens must be >= 0 and finite, got ", tokens);
  A2aVolumes v;
  v.gpus_per_node = P;
  for (auto *x : {&v.nic_send, &v.nic_recv, &v.nvl_send, &v.nvl_recv, &v.nic_peers, &v.nvl_peers})
    x->assign(static_cast<std::size_t>(G), 0.0);
  if (G == 0) return v;
  const int N = G / P;
  const double ts = tokens / G;
  double node_sum = 0;
  int nodes_hit = 0;
  for (const double h : hits.node) {
    node_sum += h;
    nodes_hit += h > 0;
  }
  for (int b = 0; b < N; ++b) {
    const double hb = hits.node[b];
    double local_sum = 0;
    int local_hit = 0;
    for (int g = b * P; g < (b + 1) * P; ++g) {
      local_sum += hits.gpu[g];
      local_hit += hits.gpu[g] > 0;
    }
    for (int g = b * P; g < (b + 1) * P; ++g) {
      const double q = hits.gpu[g];
      v.nic_send[g] = ts * (node_sum - hb);
      v.nic_recv[g] = (N - 1) * ts * hb;
      v.nic_peers[g] = std::max<double>(nodes_hit - (hb > 0), hb > 0 ? N - 1 : 0);
      v.nvl_send[g] = tokens / P * (local_sum - q);
      v.nvl_recv[g] = tokens * q * (P - 1) / P;
      v.nvl_peers[g] = std::max<double>(local_hit - (q > 0), q > 0 ? P - 1 : 0);
    }
  }
  return v;
}

namespace detail {

/// The working cells `check_route_args` bounds: `hits` (`a2a_volumes_from_routes`, `[gpus][gpus + nodes]` hit counts)
/// or `peers` (`a2a_volumes_from_routes_marks`, `[gpus][nodes + gpus_per_node]` peer marks).
enum class RouteCells { hits, peers };

/// The argument checks of `a2a_volumes_from_routes` and its oracle, in this order: the shape (top-k, slots per GPU,
/// whole nodes), whole tokens of top-k, the source offsets running from 0 to the token count over `num_gpus` ranks,
/// the working cells (`cells`) at most 1e9, the source offsets never decreasing. The slots themselves are checked
/// by `check_route_slots` or as they are read (`fail_route_slot`). Throws `Error` naming the bad value.
inline void check_route_args(std::span<const std::int32_t> slots, int topk, int slots_per_gpu, int gpus_per_node,
                             int num_gpus, std::span<const std::int64_t> source_offsets, RouteCells cells) {
  require(topk > 0 && slots_per_gpu > 0 && gpus_per_node > 0 && num_gpus > 0 && num_gpus % gpus_per_node == 0,
          "a2a_volumes_from_routes: top-", topk, ", ", slots_per_gpu, " slots per GPU, ", num_gpus, " GPUs of ",
          gpus_per_node, " per node");
  require(slots.size() % static_cast<std::size_t>(topk) == 0, "a2a_volumes_from_routes: ", slots.size(),
          " routes are not whole tokens of top-", topk);
  const auto num_tokens = static_cast<std::int64_t>(slots.size() / static_cast<std::size_t>(topk));
  require(static_cast<int>(source_offsets.size()) == num_gpus + 1 && source_offsets.front() == 0 &&
              source_offsets.back() == num_tokens,
          "a2a_volumes_from_routes: ", source_offsets.size(), " source offsets must run from 0 to ", num_tokens,
          " over ", num_gpus, " GPUs");
  const int P = gpus_per_node, N = num_gpus / P, G = num_gpus;
  const int per_gpu = cells == RouteCells::hits ? G + N : N + P;
  require(static_cast<double>(G) * per_gpu <= 1e9, "a2a_volumes_from_routes: ", G, " GPUs x ", per_gpu,
          cells == RouteCells::hits ? " hit counts exceed 1e9" : " peer cells exceed 1e9");
  for (int r = 0; r < G; ++r)
    require(source_offsets[r + 1] >= source_offsets[r], "a2a_volumes_from_routes: source offsets decrease at ", r);
}

/// Throws `Error` for route `index` of `slots` (`[tokens][topk]`), whose slot is outside `[-1, num_slots)`.
[[noreturn]] inline void fail_route_slot(std::span<const std::int32_t> slots, int topk, std::size_t index,
                                         std::int64_t num_slots) {
  fail("a2a_volumes_from_routes: token ", index / static_cast<std::size_t>(topk), " k ",
       index % static_cast<std::size_t>(topk), " goes to slot ", slots[index], " of ", num_slots);
}

/// Throws `Error` (`fail_route_slot`) for the first route of `slots` outside `[-1, num_slots)`.
inline void check_route_slots(std::span<const std::int32_t> slots, int topk, std::int64_t num_slots) {
  if (const auto bad =
          std::find_if(slots.begin(), slots.end(), [num_slots](std::int32_t p) { return p < -1 || p >= num_slots; });
      bad != slots.end())
    fail_route_slot(slots, topk, static_cast<std::size_t>(bad - slots.begin()), num_slots);
}

/// The first version of `a2a_volumes_from_routes`, kept as its test oracle and bench baseline (`tests/test_cost.cpp`,
/// `bench/bench_count.cpp`): it marks every token's GPUs and nodes and scatters its counts token by token.
/// Volumes counted from the routes themselves: `slots` is `[tokens][topk]` physical slots (`gpu * slots_per_gpu +
/// slot`, -1 for no route) and `source_offsets` (`[num_gpus + 1]`) groups the tokens by the rank that holds them.
/// Each token counts the distinct nodes and GPUs its routes reach, so co-activated experts and a token map that
/// keeps a token's copies together show as they are. Throws `Error` for inconsistent sizes, a slot outside the
/// GPUs or malformed offsets. O(tokens x topk) plus O(num_gpus x (nodes + gpus_per_node)) for the peers.
[[nodiscard]] inline A2aVolumes a2a_volumes_from_routes_marks(std::span<const std::int32_t> slots, int topk,
                                                              int slots_per_gpu, int gpus_per_node, int num_gpus,
                                                              std::span<const std::int64_t> source_offsets) {
  check_route_args(slots, topk, slots_per_gpu, gpus_per_node, num_gpus, source_offsets, RouteCells::peers);
  const int P = gpus_per_node, N = num_gpus / P, G = num_gpus;
  const std::int64_t num_slots = static_cast<std::int64_t>(G) * slots_per_gpu;
  A2aVolumes v;
  v.gpus_per_node = P;
  for (auto *x : {&v.nic_send, &v.nic_recv, &v.nvl_send, &v.nvl_recv, &v.nic_peers, &v.nvl_peers})
    x->assign(static_cast<std::size_t>(G), 0.0);
  check_route_slots(slots, topk, num_slots);
  // Integer counts in the loop (no divisions: the GPU of every slot and the node of every GPU looked up).
  std::vector<std::int32_t> gpu_of(static_cast<std::size_t>(num_slots));
  for (std::int64_t p = 0; p < num_slots; ++p)
    gpu_of[static_cast<std::size_t>(p)] = static_cast<std::int32_t>(p / slots_per_gpu);
  std::vector<std::int32_t> node_of(static_cast<std::size_t>(G)), local_of(node_of.size());
  for (int g = 0; g < G; ++g) {
    node_of[g] = g / P;
    local_of[g] = g % P;
  }
  std::vector<std::int64_t> nic_send(static_cast<std::size_t>(G), 0), nic_recv(nic_send), nvl_send(nic_send),
      nvl_recv(nic_send);
  // Peers with traffic: [gpu][node] sent to / received from over the NIC, [gpu][local gpu] over NVLink.
  std::vector<std::uint8_t> nic_to(static_cast<std::size_t>(G) * N, 0), nic_from(nic_to.size(), 0);
  std::vector<std::uint8_t> nvl_to(static_cast<std::size_t>(G) * P, 0), nvl_from(nvl_to.size(), 0);
  std::vector<std::int32_t> gpus(static_cast<std::size_t>(topk)), nodes(static_cast<std::size_t>(topk));
  std::vector<std::int64_t> gpu_mark(static_cast<std::size_t>(G), -1), node_mark(static_cast<std::size_t>(N), -1);
  for (int r = 0; r < G; ++r) {
    const int a = r / P, i = r % P;
    for (std::int64_t t = source_offsets[r]; t < source_offsets[r + 1]; ++t) {
      int ng = 0, nn = 0; // distinct GPUs and nodes of the token
      const std::int32_t *row = slots.data() + t * topk;
      for (int k = 0; k < topk; ++k) {
        if (row[k] < 0) continue;
        const std::int32_t g = gpu_of[static_cast<std::size_t>(row[k])];
        if (gpu_mark[g] == t) continue;
        gpu_mark[g] = t;
        gpus[ng++] = g;
        const std::int32_t b = node_of[g];
        if (node_mark[b] != t) {
          node_mark[b] = t;
          nodes[nn++] = b;
        }
      }
      for (int x = 0; x < nn; ++x)
        if (const std::int32_t b = nodes[x]; b != a) { // crosses once, from the rank's NIC to GPU (b, i)
          const int f = b * P + i;
          ++nic_send[r];
          ++nic_recv[f];
          nic_to[static_cast<std::size_t>(r) * N + b] = 1;
          nic_from[static_cast<std::size_t>(f) * N + a] = 1;
        }
      for (int x = 0; x < ng; ++x) {
        const std::int32_t g = gpus[x], j = local_of[g];
        if (j == i) continue; // g fans the token out on its node itself (the rank itself on its own node)
        const int f = g - j + i;
        ++nvl_send[f];
        ++nvl_recv[g];
        nvl_to[static_cast<std::size_t>(f) * P + j] = 1;
        nvl_from[static_cast<std::size_t>(g) * P + i] = 1;
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    v.nic_send[g] = static_cast<double>(nic_send[g]);
    v.nic_recv[g] = static_cast<double>(nic_recv[g]);
    v.nvl_send[g] = static_cast<double>(nvl_send[g]);
    v.nvl_recv[g] = static_cast<double>(nvl_recv[g]);
  }
  auto peers = [](const std::vector<std::uint8_t> &to, const std::vector<std::uint8_t> &from, int g, int width) {
    int out = 0, in = 0;
    for (int x = 0; x < width; ++x) {
      out += to[static_cast<std::size_t>(g) * width + x];
      in += from[static_cast<std::size_t>(g) * width + x];
    }
    return static_cast<double>(std::max(out, in));
  };
  for (int g = 0; g < G; ++g) {
    v.nic_peers[g] = peers(nic_to, nic_from, g, N);
    v.nvl_peers[g] = peers(nvl_to, nvl_from, g, P);
  }
  return v;
}

} // namespace detail

/// Volumes counted from the routes themselves: `slots` is `[tokens][topk]` physical slots (`gpu * slots_per_gpu +
/// slot`, -1 for no route) and `source_offsets` (`[num_gpus + 1]`) groups the tokens by the rank that holds them.
/// Each token counts the distinct nodes and GPUs its routes reach, so co-activated experts and a token map that
/// keeps a token's copies together show as they are. Throws `Error` for inconsistent sizes, a slot outside the
/// GPUs or malformed offsets. O(tokens x topk) plus O(num_gpus x num_gpus) for the volumes and peers.
///
/// A token's distinct GPUs are a 64-bit mask when there are at most 64 GPUs (marks per GPU otherwise); the loop
/// over the tokens only counts, per source rank, the tokens that reach each GPU and each node, and every volume
/// and peer follows from those counts (integer sums, so the same numbers as counting token by token:
/// `detail::a2a_volumes_from_routes_marks`, the property test in `tests/test_cost.cpp`).
[[nodiscard]] inline A2aVolumes a2a_volumes_from_routes(std::span<const std::int32_t> slots, int topk,
                                                        int slots_per_gpu, int gpus_per_node, int num_gpus,
                                                        std::span<const std::int64_t> source_offsets) {
  detail::check_route_args(slots, topk, slots_per_gpu, gpus_per_node, num_gpus, source_offsets,
                           detail::RouteCells::hits);
  const int P = gpus_per_node, N = num_gpus / P, G = num_gpus;
  const std::int64_t num_slots = static_cast<std::int64_t>(G) * slots_per_gpu;
  A2aVolumes v;
  v.gpus_per_node = P;
  for (auto *x : {&v.nic_send, &v.nic_recv, &v.nvl_send, &v.nvl_recv, &v.nic_peers, &v.nvl_peers})
    x->assign(static_cast<std::size_t>(G), 0.0);
  // A slot outside [-1, num_slots): the first such route names its token and k (checked inside the GPU-mask loop,
  // which visits the tokens in order, so the routes are read once).
  if (G > 64) detail::check_route_slots(slots, topk, num_slots);
  std::vector<std::int32_t> gpu_of(static_cast<std::size_t>(num_slots));
  for (std::int64_t p = 0; p < num_slots; ++p)
    gpu_of[static_cast<std::size_t>(p)] = static_cast<std::int32_t>(p / slots_per_gpu);
  std::vector<std::int32_t> node_of(static_cast<std::size_t>(G));
  for (int g = 0; g < G; ++g)
    node_of[g] = g / P;
  // The GPU mask of slot p - 1 at index p (index 0: no route).
  std::vector<std::uint64_t> mask_of(G <= 64 ? static_cast<std::size_t>(num_slots) + 1 : 0, 0);
  for (std::size_t p = 1; p < mask_of.size(); ++p)
    mask_of[p] = std::uint64_t{1} << gpu_of[p - 1];
  // gpu_hits[r][g]: tokens of rank r with a route to GPU g; node_hits[r][b]: with a route to node b.
  std::vector<std::int64_t> gpu_hits(static_cast<std::size_t>(G) * G, 0), node_hits(static_cast<std::size_t>(G) * N, 0);
  for (int r = 0; r < G; ++r) {
    std::int64_t *hg = gpu_hits.data() + static_cast<std::size_t>(r) * G;
    std::int64_t *hn = node_hits.data() + static_cast<std::size_t>(r) * N;
    const std::int32_t *row = slots.data() + source_offsets[r] * topk;
    const std::int32_t *const last = slots.data() + source_offsets[r + 1] * topk;
    if (G <= 64) {
      for (; row != last; row += topk) {
        std::uint64_t gm = 0, nm = 0;
        for (int k = 0; k < topk; ++k) {
          const auto u = static_cast<std::uint64_t>(static_cast<std::int64_t>(row[k]) + 1);
          if (u > static_cast<std::uint64_t>(num_slots))
            detail::fail_route_slot(slots, topk, static_cast<std::size_t>(row + k - slots.data()), num_slots);
          gm |= mask_of[u];
        }
        for (std::uint64_t m = gm; m != 0; m &= m - 1) {
          const int g = std::countr_zero(m);
          ++hg[g];
          nm |= std::uint64_t{1} << node_of[g];
        }
        for (; nm != 0; nm &= nm - 1)
          ++hn[std::countr_zero(nm)];
      }
    } else {
      std::vector<std::int64_t> gpu_mark(static_cast<std::size_t>(G), -1), node_mark(static_cast<std::size_t>(N), -1);
      for (std::int64_t t = source_offsets[r]; row != last; row += topk, ++t)
        for (int k = 0; k < topk; ++k) {
          if (row[k] < 0) continue;
          const std::int32_t g = gpu_of[static_cast<std::size_t>(row[k])];
          if (gpu_mark[g] == t) continue;
          gpu_mark[g] = t;
          ++hg[g];
          if (const std::int32_t b = node_of[g]; node_mark[b] != t) {
            node_mark[b] = t;
            ++hn[b];
          }
        }
    }
  }
  // A token of rank (a, i) crosses once to each remote node b it reaches (NIC of (a, i) to GPU (b, i)); GPU (b, i)
  // (the rank itself on its own node) sends it once over NVLink to each other GPU (b, j) it reaches.
  std::vector<std::int64_t> nic_send(static_cast<std::size_t>(G), 0), nic_recv(nic_send), nvl_send(nic_send),
      nvl_recv(nic_send);
  std::vector<std::uint8_t> nic_to(static_cast<std::size_t>(G) * N, 0), nic_from(nic_to.size(), 0);
  std::vector<std::uint8_t> nvl_to(static_cast<std::size_t>(G) * P, 0), nvl_from(nvl_to.size(), 0);
  for (int r = 0; r < G; ++r) {
    const int a = r / P, i = r % P;
    for (int b = 0; b < N; ++b) {
      const std::int64_t c = node_hits[static_cast<std::size_t>(r) * N + b];
      if (b == a || c == 0) continue;
      const int f = b * P + i;
      nic_send[r] += c;
      nic_recv[f] += c;
      nic_to[static_cast<std::size_t>(r) * N + b] = 1;
      nic_from[static_cast<std::size_t>(f) * N + a] = 1;
    }
    for (int g = 0; g < G; ++g) {
      const std::int64_t c = gpu_hits[static_cast<std::size_t>(r) * G + g];
      const int j = g % P;
      if (j == i || c == 0) continue;
      const int f = g - j + i;
      nvl_send[f] += c;
      nvl_recv[g] += c;
      nvl_to[static_cast<std::size_t>(f) * P + j] = 1;
      nvl_from[static_cast<std::size_t>(g) * P + i] = 1;
    }
  }
  for (int g = 0; g < G; ++g) {
    v.nic_send[g] = static_cast<double>(nic_send[g]);
    v.nic_recv[g] = static_cast<double>(nic_recv[g]);
    v.nvl_send[g] = static_cast<double>(nvl_send[g]);
    v.nvl_recv[g] = static_cast<double>(nvl_recv[g]);
  }
  auto peers = [](const std::vector<std::uint8_t> &to, const std::vector<std::uint8_t> &from, int g, int width) {
    int out = 0, in = 0;
    for (int x = 0; x < width; ++x) {
      out += to[static_cast<std::size_t>(g) * width + x];
      in += from[static_cast<std::size_t>(g) * width + x];
    }
    return static_cast<double>(std::max(out, in));
  };
  for (int g = 0; g < G; ++g) {
    v.nic_peers[g] = peers(nic_to, nic_from, g, N);
    v.nvl_peers[g] = peers(nvl_to, nvl_from, g, P);
  }
  return v;
}

/// DeepEP-style dispatch seconds of one layer from its volumes (combine costs the same). Per GPU and link class:
/// `latency + per_message x peers + max(send, receive) / bandwidth`; the classes overlap (`max`), and the layer
/// ends with the slowest GPU.
[[nodiscard]] inline double hierarchical_a2a_seconds(const AllToAllParams &p, const A2aVolumes &v, double row_bytes) {
  detail::require(row_bytes > 0, "hierarchical_a2a_seconds: row bytes must be > 0, got ", row_bytes);
  auto part = [&](double lat_us, double msg_us, double msgs, double bytes, double gb_per_s) {
    return bytes > 0 ? lat_us * 1e-6 + msg_us * 1e-6 * msgs + bytes / (gb_per_s * 1e9) : 0.0;
  };
  double worst = 0;
  for (int g = 0; g < v.num_gpus(); ++g) {
    const double nic = part(p.inter_latency_us, p.inter_per_message_us, v.nic_peers[g],
                            std::max(v.nic_send[g], v.nic_recv[g]) * row_bytes, p.inter_gb_per_s);
    const double nvl = part(p.intra_latency_us, p.per_message_us, v.nvl_peers[g],
                            std::max(v.nvl_send[g], v.nvl_recv[g]) * row_bytes, p.intra_gb_per_s);
    worst = std::max({worst, nic, nvl});
  }
  return worst;
}

/// The same from hit probabilities (`a2a_volumes`). Throws `Error` for inconsistent sizes, negative tokens or
/// non-positive row bytes.
[[nodiscard]] inline double hierarchical_a2a_seconds(const AllToAllParams &p, const A2aHits &hits, double tokens,
                                                     int gpus_per_node, double row_bytes) {
  detail::require(tokens >= 0 && row_bytes > 0, "hierarchical_a2a_seconds: tokens must be >= 0 and row bytes > 0");
  if (hits.gpu.empty() || tokens == 0) {
    detail::require(gpus_per_node > 0 &&
                        static_cast<int>(hits.node.size()) * gpus_per_node == static_cast<int>(hits.gpu.size()),
                    "hierarchical_a2a_seconds: ", hits.gpu.size(), " GPU and ", hits.node.size(),
                    " node hit probabilities for ", gpus_per_node, " GPUs per node");
    return 0.0;
  }
  return hierarchical_a2a_seconds(p, a2a_volumes(hits, tokens, gpus_per_node), row_bytes);
}

/// The earlier per-GPU model (`A2aModel::flat`): every GPU's received token-expert rows `recv_rows` come
/// evenly from all G ranks (the tokens of a micro-step are data-parallel, so each rank holds 1/G of every
/// expert's tokens), no deduplication; per GPU and class `latency + max(send, recv) / bw`. O(G).
[[nodiscard]] inline double flat_a2a_seconds(const AllToAllParams &p, std::span<const double> recv_rows,
                                             int gpus_per_node, double row_bytes) {
  const int G = static_cast<int>(recv_rows.size());
  const int num_nodes = G / gpus_per_node;
  double total = 0;
  std::vector<double> node_total(static_cast<std::size_t>(num_nodes), 0.0);
  for (int g = 0; g < G; ++g) {
    total += recv_rows[g];
    node_total[g / gpus_per_node] += recv_rows[g];
  }
  double worst = 0;
  for (int g = 0; g < G; ++g) {
    const double r = recv_rows[g] / G, node = node_total[g / gpus_per_node] / G;
    // Receive: from the other GPUs of the node and from the other nodes.
    const double recv_intra = r * (gpus_per_node - 1), recv_inter = r * (G - gpus_per_node);
    // Send: this rank's share of what the node's other GPUs and the other nodes receive.
    const double send_intra = node - r, send_inter = total / G - node;
    double t = 0;
    const double intra = std::max(recv_intra, send_intra) * row_bytes,
                 inter = std::max(recv_inter, send_inter) * row_bytes;
    if (intra > 0) t = std::max(t, p.intra_latency_us * 1e-6 + intra / (p.intra_gb_per_s * 1e9));
    if (inter > 0) t = std::max(t, p.inter_latency_us * 1e-6 + inter / (p.inter_gb_per_s * 1e9));
    worst = std::max(worst, t);
  }
  return worst;
}

/// One layer's all-to-all: the seconds of one exchange at the combine's row size (the combine, and both exchanges
/// of the backward pass, whose gradients travel at that size), the forward dispatch's seconds at its own row size
/// (fp8 dispatch: DeepEP sends fp8 rows with their scales and combines in bf16), and the token copies one exchange
/// sends between nodes.
struct LayerA2a {
  double seconds = 0;
  double inter_node_rows = 0;  ///< rows (tokens) crossing between nodes in one dispatch
  double dispatch_seconds = 0; ///< the forward dispatch (= `seconds` when it has the combine's row size)
};

/// `LayerA2a` of hierarchical volumes: one exchange at `row_bytes`, the forward dispatch at `dispatch_row_bytes`
/// (0: `row_bytes`).
[[nodiscard]] inline LayerA2a layer_a2a_of(const AllToAllParams &p, const A2aVolumes &v, double row_bytes,
                                           double dispatch_row_bytes = 0) {
  const double t = hierarchical_a2a_seconds(p, v, row_bytes);
  const bool same = dispatch_row_bytes == 0 || dispatch_row_bytes == row_bytes;
  return {t, v.inter_node_rows(), same ? t : hierarchical_a2a_seconds(p, v, dispatch_row_bytes)};
}

/// One layer's dispatch (= combine) under `p.model`. `slot_expert`/`slot_rows` as in `a2a_hits_from_slots`;
/// empty spans mean the physical limit (`ideal`): `gpu_rows` per GPU with hit probabilities from
/// `a2a_hits_spread`. `gpu_rows` are the rows each GPU receives (the flat model's input; it has no deduplication,
/// so every row received from another node crosses: the total times (G - P) / G). `dispatch_row_bytes` (0: the
/// same as `row_bytes`) is the forward dispatch's row size, timed into `LayerA2a::dispatch_seconds`.
[[nodiscard]] inline LayerA2a layer_a2a(const AllToAllParams &p, std::span<const std::int32_t> slot_expert,
                                        std::span<const std::int64_t> slot_rows, std::span<const double> gpu_rows,
                                        int slots_per_gpu, int gpus_per_node, int num_experts, double tokens,
                                        double row_bytes, double dispatch_row_bytes = 0) {
  detail::require(std::isfinite(dispatch_row_bytes) && dispatch_row_bytes >= 0,
                  "layer_a2a: dispatch row bytes must be >= 0 (0: the combine's), got ", dispatch_row_bytes);
  const bool same = dispatch_row_bytes == 0 || dispatch_row_bytes == row_bytes;
  if (p.model == A2aModel::flat) {
    double total = 0;
    for (const double r : gpu_rows)
      total += r;
    const auto G = static_cast<double>(gpu_rows.size());
    const double t = flat_a2a_seconds(p, gpu_rows, gpus_per_node, row_bytes);
    return {t, G > 0 ? total * (G - gpus_per_node) / G : 0.0,
            same ? t : flat_a2a_seconds(p, gpu_rows, gpus_per_node, dispatch_row_bytes)};
  }
  if (tokens <= 0) return {};
  const A2aHits hits = slot_expert.empty() ? a2a_hits_spread(gpu_rows, gpus_per_node, num_experts, tokens)
                                           : a2a_hits_from_slots(slot_expert, slot_rows, slots_per_gpu, gpus_per_node,
                                                                 num_experts, tokens);
  return layer_a2a_of(p, a2a_volumes(hits, tokens, gpus_per_node), row_bytes, dispatch_row_bytes);
}

/// The seconds of `layer_a2a`.
[[nodiscard]] inline double layer_a2a_seconds(const AllToAllParams &p, std::span<const std::int32_t> slot_expert,
                                              std::span<const std::int64_t> slot_rows, std::span<const double> gpu_rows,
                                              int slots_per_gpu, int gpus_per_node, int num_experts, double tokens,
                                              double row_bytes) {
  return layer_a2a(p, slot_expert, slot_rows, gpu_rows, slots_per_gpu, gpus_per_node, num_experts, tokens, row_bytes)
      .seconds;
}

/// The largest lateness `finish - deadline` (0 when none is late) of jobs on one link served by preemptive
/// earliest-deadline-first: job j is released at `release[j]`, needs `work[j]` seconds of the link and is due
/// at `deadline[j]`. Preemptive EDF minimises the largest lateness on one link with release times (Horn, 1974),
/// so this is what the link cannot avoid. Jobs with no work are ignored. Throws `Error` for inconsistent sizes
/// or negative or non-finite values.
[[nodiscard]] inline double edf_max_lateness(std::span<const double> release, std::span<const double> deadline,
                                             std::span<const double> work) {
  const std::size_t n = work.size();
  detail::require(release.size() == n && deadline.size() == n, "edf_max_lateness: ", release.size(), " releases, ",
                  deadline.size(), " deadlines and ", n, " jobs");
  std::vector<std::size_t> order;
  for (std::size_t j = 0; j < n; ++j) {
    detail::require(std::isfinite(release[j]) && std::isfinite(deadline[j]) && std::isfinite(work[j]) && work[j] >= 0,
                    "edf_max_lateness: job ", j, " has release ", release[j], ", deadline ", deadline[j], ", work ",
                    work[j]);
    if (work[j] > 0) order.push_back(j);
  }
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return release[a] < release[b]; });
  std::vector<double> left(work.begin(), work.end());
  std::vector<std::size_t> ready; // released, unfinished
  double t = order.empty() ? 0.0 : release[order.front()], worst = 0;
  std::size_t next = 0;
  while (next < order.size() || !ready.empty()) {
    while (next < order.size() && release[order[next]] <= t)
      ready.push_back(order[next++]);
    if (ready.empty()) {
      t = release[order[next]];
      continue;
    }
    auto it = std::min_element(ready.begin(), ready.end(),
                               [&](std::size_t a, std::size_t b) { return deadline[a] < deadline[b]; });
    const std::size_t j = *it;
    const double until = next < order.size() ? release[order[next]] : std::numeric_limits<double>::infinity();
    if (t + left[j] <= until) {
      t += left[j];
      worst = std::max(worst, t - deadline[j]);
      ready.erase(it);
    } else {
      left[j] -= until - t;
      t = until;
    }
  }
  return worst;
}

/// Link time of `work` seconds of moves (alone on the link) on a link that the all-to-all also uses for the
/// fraction `a2a_share` of the time: while both run they share it fairly (each gets half), and the
/// all-to-all's share is taken as spread evenly over the window, so the moves need
/// `work / (1 - a2a_share / 2)`. DeepEP's dispatch and combine keep NVLink and the NIC (and the PCIe switch
/// the NIC shares with host-mirror reads on H200 nodes) busy together, so one share applies to every path.
/// Throws `Error` for a share outside [0, 1] or negative work.
[[nodiscard]] inline double shared_link_seconds(double work, double a2a_share) {
  detail::require(work >= 0 && std::isfinite(work), "shared_link_seconds: work must be >= 0, got ", work);
  detail::require(a2a_share >= 0 && a2a_share <= 1, "shared_link_seconds: a2a_share must be in [0, 1], got ",
                  a2a_share);
  return work / (1 - a2a_share / 2);
}

/// Seconds to reduce a replica's gradient (of an expert with `weight_bytes` bytes of weights) into its
/// owner over GPU-direct `path` (nvlink or network): transfer + accumulate + fixed latency.
[[nodiscard]] inline double grad_reduce_seconds(const CostParams &p, MovePath path, double weight_bytes) {
  detail::require(path != MovePath::pcie, "grad_reduce_seconds: gradients are reduced GPU-direct, not via host");
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

/// The NVLink all-to-all parameters fitted on nccl-tests `alltoall` rows of one node: t = latency +
/// per_peer (n - 1) + S (n - 1) / n / bw (each GPU sends S (n - 1) / n bytes to n - 1 peers), non-negative
/// least squares on relative error. `gpus` restricts the rows to those GPU counts (empty: all).
struct NcclAllToAllFit {
  double latency_s = 0, per_peer_s = 0, bytes_per_s = 0;
  std::vector<double> rel_error;
  [[nodiscard]] double seconds(int n, double bytes) const noexcept {
    return latency_s + per_peer_s * (n - 1) + bytes * (n - 1) / n / bytes_per_s;
  }
  [[nodiscard]] double median() const { return detail::quantile(rel_error, 0.5); }
  [[nodiscard]] double p90() const { return detail::quantile(rel_error, 0.9); }
};

/// Fits `NcclAllToAllFit` on the `alltoall` samples with `num_gpus` in `gpus` (all when empty). Throws
/// `Error` for fewer than 3 such samples.
[[nodiscard]] inline NcclAllToAllFit fit_nccl_all_to_all(std::span<const NcclSample> samples,
                                                         std::span<const int> gpus = {}) {
  std::vector<double> a, b, w;
  std::vector<const NcclSample *> used;
  for (const auto &s : samples) {
    if (s.op != "alltoall" || s.num_gpus < 2) continue;
    if (!gpus.empty() && std::find(gpus.begin(), gpus.end(), s.num_gpus) == gpus.end()) continue;
    detail::require(s.seconds > 0 && s.bytes > 0, "fit_nccl_all_to_all: line ", s.line, ": non-positive time or size");
    const double n = s.num_gpus;
    a.insert(a.end(), {1.0, n - 1, s.bytes * (n - 1) / n});
    b.push_back(s.seconds);
    w.push_back(1.0 / s.seconds);
    used.push_back(&s);
  }
  detail::require(b.size() >= 3, "fit_nccl_all_to_all: need 3 alltoall samples, got ", b.size());
  const auto x = detail::nonneg_least_squares(a, b, w, 3);
  NcclAllToAllFit f;
  f.latency_s = x[0];
  f.per_peer_s = x[1];
  f.bytes_per_s = x[2] > 0 ? 1.0 / x[2] : 1e30;
  for (const auto *s : used)
    f.rel_error.push_back(std::abs(f.seconds(s->num_gpus, s->bytes) - s->seconds) / s->seconds);
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
  std::istringstream in(files::read_file(path, files::max_document_bytes, "a CSV file")); // a regular file only
  return read_nccl_csv(in, path);
}

} // namespace v0
} // namespace foremoe
