#pragma once
/// @file
/// Transfer planning: turns one layer's weight moves into chunks on the two move paths (GPU-direct and the host
/// mirror), chooses every chunk's source, splits large moves so that both paths finish together, and orders the
/// chunks in rounds in which each GPU pair and each PCIe link carries at most one chunk.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <span>
#include <string_view>
#include <tuple>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/core/topology.hpp"
#include "foremoe/cost/move.hpp"
#include "foremoe/plan/plan.hpp"

namespace foremoe {
inline namespace v0 {
namespace transfer {

/// How a chunk travels: the one path enum of the library (`MovePath`, `cost/move.hpp`), under the name this
/// namespace has always used. `transfer::Path` and `foremoe::MovePath` are the same type.
using Path = MovePath;
inline constexpr int num_paths = num_move_paths;
using foremoe::v0::to_string;

/// Most chunks one move may be cut into (per move, both paths together): the bound that keeps a plan's size and
/// planning time proportional to its moves whatever `expert_bytes` / `max_chunk_bytes` a front end is given.
/// 4096 chunks of the default 64 MiB cover a 256 GiB expert.
inline constexpr std::int64_t max_chunks_per_move = 4096;

/// Knobs of transfer planning.
struct Options {
  std::int64_t expert_bytes = 0;                         ///< bytes of one expert's weights (all its tensors)
  std::int64_t max_chunk_bytes = std::int64_t{64} << 20; ///< pieces of one path are cut to at most this (retry unit)
  std::int64_t align_bytes = 4096;                       ///< chunk boundaries are multiples of this (but the tail)
  bool split_paths = true;   ///< split a move across GPU-direct and the mirror so that both finish together
  bool host_mirror = true;   ///< every node has a valid pinned mirror of all experts
  bool allow_network = true; ///< read from another node's GPU when the node has no source at all
  /// What each path costs: the split, the source choice and the estimates price chunks with these, the same
  /// parameters the simulator prices moves with (`CostParams::move`).
  MoveParams move{};

  void validate() const {
    foremoe::detail::require(expert_bytes > 0, "transfer::Options: expert_bytes must be positive, got ", expert_bytes);
    move.validate();
    foremoe::detail::require(align_bytes > 0, "transfer::Options: align_bytes must be positive, got ", align_bytes);
    foremoe::detail::require(max_chunk_bytes >= align_bytes, "transfer::Options: max_chunk_bytes (", max_chunk_bytes,
                             ") must be at least align_bytes (", align_bytes, ")");
    const std::int64_t chunks = expert_bytes / max_chunk_bytes + (expert_bytes % max_chunk_bytes != 0 ? 1 : 0);
    foremoe::detail::require(
        chunks <= max_chunks_per_move, "transfer::Options: expert_bytes ", expert_bytes,
        " in chunks of max_chunk_bytes ", max_chunk_bytes, " makes ", chunks, " chunks per move, above the limit of ",
        max_chunks_per_move, " (max_chunk_bytes must be at least ",
        expert_bytes / max_chunks_per_move + (expert_bytes % max_chunks_per_move != 0 ? 1 : 0), ")");
  }
};

/// One contiguous byte range of one move, read from one source over one path.
struct Chunk {
  std::int32_t move_idx = 0;
  Path path = Path::nvlink;
  std::int32_t src_gpu = host_mirror; ///< GPU read from; `host_mirror` for `pcie`
  std::int32_t src_slot = -1;         ///< slot of the source copy on `src_gpu`; -1 for the mirror
  std::int32_t dst_gpu = 0;
  std::int32_t dst_slot = 0;
  std::int32_t expert = 0;
  std::int64_t offset_bytes = 0; ///< into the expert's packed bytes
  std::int64_t num_bytes = 0;
  std::int32_t round = 0;

  friend bool operator==(const Chunk &, const Chunk &) = default;
};

/// Why a move reads from where it does. The planner decides every move's source (`Move::src_gpu`, `plan.hpp`
/// `detail::move_source`); transfer planning keeps it and overrides it only for one of these recorded reasons.
enum class SourceReason : std::uint8_t {
  planned = 0,      ///< the planner's source, all bytes
  split = 1,        ///< the planner's GPU source and the host mirror, split so that both parts end together
  rewritten = 2,    ///< the planner's source slot is written by a move of the same batch (or is the destination)
  not_resident = 3, ///< the planner's source GPU does not hold the expert in the resident placement
  no_mirror = 4,    ///< the planner chose the host mirror, but there is none (`Options::host_mirror` off)
  no_network = 5,   ///< the planner chose another node's GPU, but network sources are off
};
inline constexpr int num_source_reasons = 6;

[[nodiscard]] constexpr std::string_view to_string(SourceReason r) noexcept {
  constexpr std::array<std::string_view, num_source_reasons> names{"planned",      "split",     "rewritten",
                                                                   "not_resident", "no_mirror", "no_network"};
  const auto i = static_cast<std::size_t>(r);
  return i < names.size() ? names[i] : std::string_view{"unknown"};
}

/// The chunks realising one layer's moves, and what they are expected to cost.
struct TransferPlan {
  std::int64_t expert_bytes = 0;
  std::vector<Move> moves; ///< the moves, `src_gpu` set to the GPU source of most bytes (or `host_mirror`)
  std::vector<SourceReason> source_reason; ///< per move: why it reads from its source (`planned` unless overridden)
  std::vector<Chunk> chunks;               ///< ordered by round
  int num_rounds = 0;
  double est_seconds = 0.0;        ///< rounds run one after the other, each as long as its busiest link
  double link_bound_seconds = 0.0; ///< bytes of the busiest link over its bandwidth: no schedule beats it
  std::array<std::int64_t, num_paths> path_bytes{};

  /// Chunks of round `r`.
  [[nodiscard]] std::span<const Chunk> round(int r) const {
    auto lo = std::lower_bound(chunks.begin(), chunks.end(), r, [](const Chunk &c, int v) { return c.round < v; });
    auto hi = std::upper_bound(lo, chunks.end(), r, [](int v, const Chunk &c) { return v < c.round; });
    return {lo, hi};
  }
};

namespace detail {

/// A link a chunk occupies for one round: an ordered GPU pair of a GPU-direct path, or the PCIe link into a GPU.
[[nodiscard]] inline std::tuple<int, int, int> link_of(const Chunk &c) noexcept {
  return {static_cast<int>(c.path), c.path == Path::pcie ? -1 : c.src_gpu, c.dst_gpu};
}

} // namespace detail

/// What the slots held before a batch of `moves` whose result is `after`, when nothing else is known (no placement
/// of a previous micro-step): every slot the batch does not write was already in place (the owners among them),
/// and the written ones were empty. This is the planner's own view of micro-step 0 without a resident placement.
[[nodiscard]] inline LayerPlacement resident_before(const LayerPlacement &after, std::span<const Move> moves) {
  LayerPlacement before = after;
  for (const Move &m : moves) {
    foremoe::detail::require(m.dst_gpu >= 0 && m.dst_gpu < after.num_gpus() && m.dst_slot >= 0 &&
                                 m.dst_slot < after.slots_per_gpu(),
                             "resident_before: a move targets GPU ", m.dst_gpu, " slot ", m.dst_slot, ", outside ",
                             after.num_gpus(), " GPUs x ", after.slots_per_gpu(), " slots");
    before.slot(m.dst_gpu, m.dst_slot) = empty_slot;
  }
  return before;
}

/// Round-by-round time and link bound of `plan`'s chunks (fills `est_seconds` and `link_bound_seconds`). A GPU's
/// NVLink or NIC port is shared by all its chunks of a round, so a round lasts as long as its busiest port. A chunk
/// alone in its round lasts `move_seconds(move, path, bytes)`, as the simulator prices the same move.
inline void estimate(TransferPlan &plan, const Topology &topo, const MoveParams &move) {
  const int num_gpus = topo.num_gpus();
  const PathParams &nv = path_params(move, Path::nvlink), &net = path_params(move, Path::network),
                   &pc = path_params(move, Path::pcie);
  // Per GPU: NVLink out, NVLink in, NIC out, NIC in, PCIe in.
  std::vector<double> total(static_cast<std::size_t>(num_gpus) * 5, 0.0), in_round(total.size(), 0.0);
  std::vector<double> lat(total.size(), 0.0);
  auto port_busy = [&](std::vector<double> &acc, const Chunk &c, bool with_latency) {
    const double b = static_cast<double>(c.num_bytes);
    auto add = [&](int gpu, int k, const PathParams &p) {
      const std::size_t i = static_cast<std::size_t>(gpu) * 5 + k;
      acc[i] += b / (p.gb_per_s * 1e9);
      if (with_latency) lat[i] = std::max(lat[i], p.latency_us * 1e-6);
    };
    switch (c.path) {
    case Path::nvlink:
      add(c.src_gpu, 0, nv);
      add(c.dst_gpu, 1, nv);
      break;
    case Path::network:
      add(c.src_gpu, 2, net);
      add(c.dst_gpu, 3, net);
      break;
    case Path::pcie: add(c.dst_gpu, 4, pc); break;
    }
  };
  plan.est_seconds = 0.0;
  for (int r = 0; r < plan.num_rounds; ++r) {
    std::fill(in_round.begin(), in_round.end(), 0.0);
    std::fill(lat.begin(), lat.end(), 0.0);
    for (const Chunk &c : plan.round(r))
      port_busy(in_round, c, true);
    double longest = 0.0;
    for (std::size_t i = 0; i < in_round.size(); ++i)
      longest = std::max(longest, in_round[i] + (in_round[i] > 0 ? lat[i] : 0.0));
    plan.est_seconds += longest;
  }
  for (const Chunk &c : plan.chunks)
    port_busy(total, c, false);
  plan.link_bound_seconds = total.empty() ? 0.0 : *std::max_element(total.begin(), total.end());
}

/// Plans the chunks of `moves` (one layer, one micro-step) starting from `resident`, the placement before them.
///
/// Sources are the planner's (`Move::src_gpu`): a GPU that holds the expert in `resident` in a slot no move of this
/// batch overwrites, or the host mirror. With a GPU source in the destination's node, a host mirror and
/// `split_paths`, the move is split so that its GPU-direct part and its PCIe part end at the same time given what
/// each link already carries (reason `split`). Transfer planning overrides the planner's source only when it cannot
/// be read, recording why (`TransferPlan::source_reason`): its slot is overwritten in the same batch (it would be
/// read while written) or it does not hold the expert, the mirror is off, or network sources are off. An overridden
/// move reads from the least busy GPU of the destination's node holding the expert (split with the mirror as
/// above), else the mirror, else another node's GPU (`allow_network`).
[[nodiscard]] inline TransferPlan plan_transfers(std::span<const Move> moves, const LayerPlacement &resident,
                                                 const Topology &topo, const Options &opt) {
  topo.validate();
  opt.validate();
  const int num_gpus = topo.num_gpus(), slots = topo.slots_per_gpu, gpn = topo.gpus_per_node;
  foremoe::detail::require(resident.num_gpus() == num_gpus && resident.slots_per_gpu() == slots,
                           "plan_transfers: resident placement is ", resident.num_gpus(), " GPUs x ",
                           resident.slots_per_gpu(), " slots, topology is ", num_gpus, " x ", slots);
  const int num_experts = resident.num_experts();
  std::vector<char> overwritten(static_cast<std::size_t>(resident.num_slots()), 0);
  for (std::size_t i = 0; i < moves.size(); ++i) {
    const Move &m = moves[i];
    foremoe::detail::require(m.expert >= 0 && m.expert < num_experts, "plan_transfers: move ", i, " copies expert ",
                             m.expert, ", outside [0, ", num_experts, ")");
    foremoe::detail::require(m.dst_gpu >= 0 && m.dst_gpu < num_gpus && m.dst_slot >= 0 && m.dst_slot < slots,
                             "plan_transfers: move ", i, " targets GPU ", m.dst_gpu, " slot ", m.dst_slot, ", outside ",
                             num_gpus, " GPUs x ", slots, " slots");
    char &w = overwritten[static_cast<std::size_t>(m.dst_gpu) * slots + m.dst_slot];
    foremoe::detail::require(!w, "plan_transfers: two moves write GPU ", m.dst_gpu, " slot ", m.dst_slot);
    w = 1;
  }
  // Readable copies per expert: (gpu, slot) pairs that stay in place during the batch.
  std::vector<std::vector<std::pair<int, int>>> holders(static_cast<std::size_t>(num_experts));
  for (int g = 0; g < num_gpus; ++g)
    for (int s = 0; s < slots; ++s) {
      const std::int32_t e = resident.slot(g, s);
      if (e != empty_slot && !overwritten[static_cast<std::size_t>(g) * slots + s]) holders[e].push_back({g, s});
    }

  const double inv_nv = 1.0 / (path_params(opt.move, Path::nvlink).gb_per_s * 1e9),
               inv_pc = 1.0 / (path_params(opt.move, Path::pcie).gb_per_s * 1e9),
               inv_net = 1.0 / (path_params(opt.move, Path::network).gb_per_s * 1e9);
  // Busy seconds so far per port: NVLink out/in, NIC out/in, PCIe in.
  std::vector<double> nv_out(num_gpus, 0.0), nv_in(num_gpus, 0.0), net_out(num_gpus, 0.0), net_in(num_gpus, 0.0),
      pc_in(num_gpus, 0.0);

  TransferPlan plan;
  plan.expert_bytes = opt.expert_bytes;
  plan.moves.assign(moves.begin(), moves.end());
  const std::int64_t total = opt.expert_bytes;
  auto align_down = [&](std::int64_t x) { return x / opt.align_bytes * opt.align_bytes; };
  auto emit = [&](int move_idx, Path path, int src_gpu, int src_slot, std::int64_t lo, std::int64_t hi) {
    const Move &m = moves[move_idx];
    for (std::int64_t off = lo; off < hi; off += opt.max_chunk_bytes) {
      Chunk c;
      c.move_idx = move_idx;
      c.path = path;
      c.src_gpu = src_gpu;
      c.src_slot = src_slot;
      c.dst_gpu = m.dst_gpu;
      c.dst_slot = m.dst_slot;
      c.expert = m.expert;
      c.offset_bytes = off;
      c.num_bytes = std::min(opt.max_chunk_bytes, hi - off);
      plan.chunks.push_back(c);
      plan.path_bytes[static_cast<int>(path)] += c.num_bytes;
    }
  };

  plan.source_reason.assign(moves.size(), SourceReason::planned);
  // A GPU copy of `e` readable during the batch: the slot of `g` holding it, or -1.
  auto readable_slot = [&](int g, std::int32_t e) {
    for (auto [h, s] : holders[e])
      if (h == g) return s;
    return -1;
  };
  auto split_or_whole = [&](int idx, int src, int src_slot, int dst) {
    // GPU-direct part x ends at t_nv + x/bw_nv, the PCIe part at t_pc + (B - x)/bw_pc; equalise them.
    const double t_nv = std::max(nv_out[src], nv_in[dst]), t_pc = pc_in[dst];
    const double xf = (t_pc - t_nv + static_cast<double>(total) * inv_pc) / (inv_nv + inv_pc);
    std::int64_t x = xf <= 0 ? 0 : xf >= static_cast<double>(total) ? total : align_down(static_cast<std::int64_t>(xf));
    if (total - x < opt.align_bytes) x = total; // no sliver on one path
    if (x > 0) emit(idx, Path::nvlink, src, src_slot, 0, x);
    if (x < total) emit(idx, Path::pcie, host_mirror, -1, x, total);
    const double nv_t = static_cast<double>(x) * inv_nv, pc_t = static_cast<double>(total - x) * inv_pc;
    nv_out[src] += nv_t;
    nv_in[dst] += nv_t;
    pc_in[dst] += pc_t;
    plan.moves[idx].src_gpu = x * 2 >= total ? src : host_mirror;
    return x < total;
  };
  auto gpu_source = [&](int idx, int src, int src_slot, int dst) {
    const Path path = src / gpn == dst / gpn ? Path::nvlink : Path::network;
    if (path == Path::nvlink && opt.host_mirror && opt.split_paths) return split_or_whole(idx, src, src_slot, dst);
    emit(idx, path, src, src_slot, 0, total);
    const double t = static_cast<double>(total) * (path == Path::nvlink ? inv_nv : inv_net);
    (path == Path::nvlink ? nv_out : net_out)[src] += t;
    (path == Path::nvlink ? nv_in : net_in)[dst] += t;
    plan.moves[idx].src_gpu = src;
    return false;
  };
  auto mirror_source = [&](int idx, int dst) {
    emit(idx, Path::pcie, host_mirror, -1, 0, total);
    pc_in[dst] += static_cast<double>(total) * inv_pc;
    plan.moves[idx].src_gpu = host_mirror;
  };

  for (std::size_t i = 0; i < moves.size(); ++i) {
    const Move &m = moves[i];
    const int dst = m.dst_gpu, node = dst / gpn, idx = static_cast<int>(i);
    SourceReason &why = plan.source_reason[i];
    // The planner's source, when it can be read.
    const int want = m.src_gpu;
    if (want == host_mirror) {
      if (opt.host_mirror) {
        mirror_source(idx, dst);
        continue;
      }
      why = SourceReason::no_mirror;
    } else if (want < 0 || want >= num_gpus || want == dst) {
      why = SourceReason::rewritten;
    } else if (const int s = readable_slot(want, m.expert); s >= 0) {
      if (want / gpn != node && !opt.allow_network) {
        why = SourceReason::no_network;
      } else {
        if (gpu_source(idx, want, s, dst)) why = SourceReason::split;
        continue;
      }
    } else {
      // It held the expert, but a move of this batch writes that slot; or it never held it.
      bool held = false;
      for (int k = 0; k < slots && !held; ++k)
        held = resident.slot(want, k) == m.expert;
      why = held ? SourceReason::rewritten : SourceReason::not_resident;
    }
    // Overridden (reason recorded): the least busy in-node source, else the mirror, else the least busy remote one.
    int best_local = -1, best_local_slot = -1, best_remote = -1, best_remote_slot = -1;
    for (auto [g, s] : holders[m.expert]) {
      if (g == dst) continue;
      if (g / gpn == node) {
        if (best_local < 0 || nv_out[g] < nv_out[best_local]) best_local = g, best_local_slot = s;
      } else if (best_remote < 0 || net_out[g] < net_out[best_remote]) {
        best_remote = g, best_remote_slot = s;
      }
    }
    if (best_local >= 0) {
      (void)gpu_source(idx, best_local, best_local_slot, dst);
    } else if (opt.host_mirror) {
      mirror_source(idx, dst);
    } else {
      foremoe::detail::require(
          opt.allow_network && best_remote >= 0, "plan_transfers: move ", i, " of expert ", m.expert, " to GPU ", dst,
          " has no source: no copy on node ", node, opt.host_mirror ? "" : ", no host mirror",
          opt.allow_network ? (best_remote < 0 ? ", no copy on any other node" : "") : ", network sources disallowed");
      (void)gpu_source(idx, best_remote, best_remote_slot, dst);
    }
  }

  // Rounds: every link takes its chunks one per round, largest first, so each round uses a link at most once.
  std::stable_sort(plan.chunks.begin(), plan.chunks.end(),
                   [](const Chunk &a, const Chunk &b) { return a.num_bytes > b.num_bytes; });
  std::map<std::tuple<int, int, int>, int> next_round;
  for (Chunk &c : plan.chunks) {
    int &r = next_round[detail::link_of(c)];
    c.round = r++;
    plan.num_rounds = std::max(plan.num_rounds, c.round + 1);
  }
  std::stable_sort(plan.chunks.begin(), plan.chunks.end(), [](const Chunk &a, const Chunk &b) {
    return std::tie(a.round, a.move_idx, a.offset_bytes) < std::tie(b.round, b.move_idx, b.offset_bytes);
  });
  estimate(plan, topo, opt.move);
  return plan;
}

/// Checks `plan` against the `moves` and `resident` placement it was made from, throwing `Error` naming the first
/// violation: every move's bytes are covered exactly once, every chunk reads from a valid source over the right
/// path (the mirror only over PCIe and only when the options allow it, a GPU in the destination's node over NVLink,
/// another node's GPU over the network, and never a slot that a move of the batch overwrites), chunks respect the
/// size limit, and no round uses a link twice.
inline void validate(const TransferPlan &plan, std::span<const Move> moves, const LayerPlacement &resident,
                     const Topology &topo, const Options &opt) {
  const int slots = topo.slots_per_gpu, gpn = topo.gpus_per_node, num_gpus = topo.num_gpus();
  foremoe::detail::require(plan.moves.size() == moves.size(), "TransferPlan: ", plan.moves.size(), " moves for ",
                           moves.size(), " requested");
  std::vector<char> overwritten(static_cast<std::size_t>(resident.num_slots()), 0);
  for (const Move &m : moves)
    overwritten[static_cast<std::size_t>(m.dst_gpu) * slots + m.dst_slot] = 1;
  std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> ranges(moves.size());
  std::map<std::tuple<int, int, int, int>, int> used; // (round, link) -> chunk
  for (std::size_t i = 0; i < plan.chunks.size(); ++i) {
    const Chunk &c = plan.chunks[i];
    foremoe::detail::require(c.move_idx >= 0 && static_cast<std::size_t>(c.move_idx) < moves.size(),
                             "TransferPlan: chunk ", i, " belongs to move ", c.move_idx, " of ", moves.size());
    const Move &m = moves[c.move_idx];
    foremoe::detail::require(c.expert == m.expert && c.dst_gpu == m.dst_gpu && c.dst_slot == m.dst_slot,
                             "TransferPlan: chunk ", i, " does not match move ", c.move_idx);
    foremoe::detail::require(c.num_bytes > 0 && c.num_bytes <= opt.max_chunk_bytes && c.offset_bytes >= 0 &&
                                 c.offset_bytes + c.num_bytes <= plan.expert_bytes,
                             "TransferPlan: chunk ", i, " covers bytes [", c.offset_bytes, ", ",
                             c.offset_bytes + c.num_bytes, ") of an expert of ", plan.expert_bytes,
                             " with chunks of at most ", opt.max_chunk_bytes);
    if (c.path == Path::pcie) {
      foremoe::detail::require(c.src_gpu == host_mirror && opt.host_mirror, "TransferPlan: chunk ", i,
                               " goes over PCIe but does not read the host mirror (or there is none)");
    } else {
      foremoe::detail::require(c.src_gpu >= 0 && c.src_gpu < num_gpus && c.src_gpu != c.dst_gpu && c.src_slot >= 0 &&
                                   c.src_slot < slots,
                               "TransferPlan: chunk ", i, " reads GPU ", c.src_gpu, " slot ", c.src_slot);
      foremoe::detail::require(resident.slot(c.src_gpu, c.src_slot) == c.expert, "TransferPlan: chunk ", i,
                               " reads expert ", c.expert, " from GPU ", c.src_gpu, " slot ", c.src_slot,
                               ", which holds ", resident.slot(c.src_gpu, c.src_slot));
      foremoe::detail::require(!overwritten[static_cast<std::size_t>(c.src_gpu) * slots + c.src_slot],
                               "TransferPlan: chunk ", i, " reads GPU ", c.src_gpu, " slot ", c.src_slot,
                               ", which the same batch overwrites");
      const bool same_node = c.src_gpu / gpn == c.dst_gpu / gpn;
      foremoe::detail::require(same_node == (c.path == Path::nvlink), "TransferPlan: chunk ", i, " uses ",
                               to_string(c.path), " between GPUs ", c.src_gpu, " and ", c.dst_gpu);
    }
    auto [p, s, d] = detail::link_of(c);
    auto [it, fresh] = used.try_emplace({c.round, p, s, d}, static_cast<int>(i));
    foremoe::detail::require(fresh, "TransferPlan: chunks ", it->second, " and ", i, " share a ", to_string(c.path),
                             " link in round ", c.round);
    foremoe::detail::require(c.round >= 0 && c.round < plan.num_rounds, "TransferPlan: chunk ", i, " in round ",
                             c.round, " of ", plan.num_rounds);
    ranges[c.move_idx].push_back({c.offset_bytes, c.offset_bytes + c.num_bytes});
  }
  for (std::size_t i = 0; i < moves.size(); ++i) {
    auto &r = ranges[i];
    std::sort(r.begin(), r.end());
    std::int64_t at = 0;
    for (auto [lo, hi] : r) {
      foremoe::detail::require(lo == at, "TransferPlan: move ", i, " has ", lo < at ? "overlapping" : "missing",
                               " bytes at ", std::min(lo, at));
      at = hi;
    }
    foremoe::detail::require(at == plan.expert_bytes, "TransferPlan: move ", i, " covers ", at, " of ",
                             plan.expert_bytes, " bytes");
  }
}

} // namespace transfer
} // namespace v0
} // namespace foremoe
