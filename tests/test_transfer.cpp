// Transfer planning: sources, chunk split across the two paths, rounds, estimates.

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <numeric>
#include <random>
#include <set>

#include "foremoe/cost/params.hpp"
#include "foremoe/plan/planner.hpp"
#include "foremoe/transfer/transfer_plan.hpp"
#include "test_support.hpp"

using namespace foremoe;
using transfer::Path;

namespace {

// A random resident placement (no duplicate copy on a GPU, some empty slots) and a random move batch onto it.
struct Instance {
  Topology topo;
  LayerPlacement resident;
  std::vector<Move> moves;
};

Instance random_instance(std::mt19937_64 &rng) {
  Instance in;
  in.topo.num_nodes = std::uniform_int_distribution<int>(1, 3)(rng);
  in.topo.gpus_per_node = std::uniform_int_distribution<int>(1, 4)(rng);
  in.topo.slots_per_gpu = std::uniform_int_distribution<int>(1, 4)(rng);
  const int num_gpus = in.topo.num_gpus(), slots = in.topo.slots_per_gpu;
  const int num_experts = std::uniform_int_distribution<int>(slots, std::max(slots, num_gpus * slots))(rng);
  in.resident = LayerPlacement(num_gpus, slots, num_experts);
  std::uniform_int_distribution<int> pick_e(0, num_experts - 1);
  std::bernoulli_distribution fill(0.7), move(0.4);
  for (int g = 0; g < num_gpus; ++g)
    for (int s = 0; s < slots; ++s)
      if (fill(rng)) {
        const int e = pick_e(rng);
        if (!in.resident.holds(g, e)) in.resident.slot(g, s) = e;
      }
  LayerPlacement target = in.resident;
  for (int g = 0; g < num_gpus; ++g)
    for (int s = 0; s < slots; ++s)
      if (move(rng)) {
        const int e = pick_e(rng);
        if (target.holds(g, e)) continue;
        target.slot(g, s) = e;
        in.moves.push_back({e, host_mirror, g, s});
      }
  // Sources: mostly the planner's choice (`detail::move_source` with the slots the batch writes), sometimes any
  // GPU or the mirror, so that transfer planning has to override (and record why).
  std::vector<char> written(static_cast<std::size_t>(num_gpus) * slots, 0);
  for (const Move &m : in.moves)
    written[static_cast<std::size_t>(m.dst_gpu) * slots + m.dst_slot] = 1;
  std::bernoulli_distribution planner(0.7);
  std::uniform_int_distribution<int> any_src(-1, num_gpus - 1);
  for (Move &m : in.moves)
    m.src_gpu = planner(rng) ? detail::move_source(in.resident, {}, m.expert, m.dst_gpu, in.topo.gpus_per_node, written)
                             : any_src(rng);
  std::shuffle(in.moves.begin(), in.moves.end(), rng);
  return in;
}

// Whether GPU `g` holds `e` in `in.resident` in a slot no move of the batch writes.
bool readable(const Instance &in, int g, int e) {
  for (int s = 0; s < in.topo.slots_per_gpu; ++s) {
    if (in.resident.slot(g, s) != e) continue;
    bool written = false;
    for (const Move &m : in.moves)
      written = written || (m.dst_gpu == g && m.dst_slot == s);
    if (!written) return true;
  }
  return false;
}

// Whether some source exists for every move under `opt` (mirror, in-node copy that stays, or a remote copy).
bool all_sourced(const Instance &in, const transfer::Options &opt) {
  if (opt.host_mirror) return true;
  const int slots = in.topo.slots_per_gpu;
  std::set<std::pair<int, int>> overwritten;
  for (const Move &m : in.moves)
    overwritten.insert({m.dst_gpu, m.dst_slot});
  for (const Move &m : in.moves) {
    bool found = false;
    for (int g = 0; g < in.topo.num_gpus() && !found; ++g) {
      if (g == m.dst_gpu) continue;
      const bool local = g / in.topo.gpus_per_node == m.dst_gpu / in.topo.gpus_per_node;
      if (!local && !opt.allow_network) continue;
      for (int s = 0; s < slots; ++s)
        if (in.resident.slot(g, s) == m.expert && !overwritten.count({g, s})) found = true;
    }
    if (!found) return false;
  }
  return true;
}

} // namespace

TEST_CASE("transfer plans realise every move once from valid sources, rounds never share a link") {
  std::mt19937_64 rng(7);
  const int runs = 3000 * foremoe_test::seed_multiplier();
  int planned = 0, refused = 0, split_moves = 0, network_chunks = 0;
  std::array<int, transfer::num_source_reasons> reasons{};
  for (int run = 0; run < runs; ++run) {
    Instance in = random_instance(rng);
    transfer::Options opt;
    opt.align_bytes = std::int64_t{1} << std::uniform_int_distribution<int>(0, 12)(rng);
    opt.expert_bytes = std::uniform_int_distribution<std::int64_t>(1, 1 << 22)(rng);
    opt.max_chunk_bytes = opt.align_bytes * std::uniform_int_distribution<std::int64_t>(1, 64)(rng);
    opt.max_chunk_bytes = std::max(opt.max_chunk_bytes, (opt.expert_bytes / 16 + opt.align_bytes) / opt.align_bytes *
                                                            opt.align_bytes); // at most ~16 chunks per path
    opt.split_paths = std::bernoulli_distribution(0.8)(rng);
    opt.host_mirror = std::bernoulli_distribution(0.7)(rng);
    opt.allow_network = std::bernoulli_distribution(0.7)(rng);
    if (!all_sourced(in, opt)) {
      CHECK_THROWS_AS((void)transfer::plan_transfers(in.moves, in.resident, in.topo, opt), Error);
      ++refused;
      continue;
    }
    const transfer::TransferPlan tp = transfer::plan_transfers(in.moves, in.resident, in.topo, opt);
    REQUIRE_NOTHROW(transfer::validate(tp, in.moves, in.resident, in.topo, opt));
    CHECK(tp.est_seconds >= tp.link_bound_seconds * (1 - 1e-12));
    std::int64_t bytes = 0;
    for (std::int64_t b : tp.path_bytes)
      bytes += b;
    CHECK(bytes == opt.expert_bytes * static_cast<std::int64_t>(in.moves.size()));
    std::vector<std::set<Path>> paths(in.moves.size());
    for (const auto &c : tp.chunks) {
      paths[c.move_idx].insert(c.path);
      network_chunks += c.path == Path::network;
      if (!opt.host_mirror) CHECK(c.path != Path::pcie);
      // Another node's GPU only as the planner's own source, or for lack of a mirror.
      if (c.path == Path::network) CHECK((!opt.host_mirror || in.moves[c.move_idx].src_gpu == c.src_gpu));
    }
    for (const auto &p : paths) {
      split_moves += p.size() > 1;
      if (!opt.split_paths) CHECK(p.size() == 1);
    }
    // The planner's source is kept unless it cannot be read, and then the recorded reason is the true one.
    REQUIRE(tp.source_reason.size() == in.moves.size());
    for (std::size_t i = 0; i < in.moves.size(); ++i) {
      const Move &m = in.moves[i];
      const int gpn = in.topo.gpus_per_node;
      const bool mirror = m.src_gpu == host_mirror;
      const bool gpu_ok = !mirror && m.src_gpu != m.dst_gpu && readable(in, m.src_gpu, m.expert) &&
                          (m.src_gpu / gpn == m.dst_gpu / gpn || opt.allow_network);
      const transfer::SourceReason why = tp.source_reason[i];
      ++reasons[static_cast<int>(why)];
      if ((mirror && opt.host_mirror) || gpu_ok) {
        CHECK((why == transfer::SourceReason::planned || why == transfer::SourceReason::split));
        for (const auto &c : tp.chunks)
          if (c.move_idx == static_cast<int>(i) && c.path != Path::pcie) CHECK(c.src_gpu == m.src_gpu);
        if (why == transfer::SourceReason::planned)
          for (const auto &c : tp.chunks)
            if (c.move_idx == static_cast<int>(i)) CHECK(c.src_gpu == m.src_gpu);
      } else if (mirror) {
        CHECK(why == transfer::SourceReason::no_mirror);
      } else if (m.src_gpu == m.dst_gpu ||
                 (!readable(in, m.src_gpu, m.expert) && in.resident.holds(m.src_gpu, m.expert))) {
        CHECK(why == transfer::SourceReason::rewritten);
      } else if (!in.resident.holds(m.src_gpu, m.expert)) {
        CHECK(why == transfer::SourceReason::not_resident);
      } else {
        CHECK(why == transfer::SourceReason::no_network);
      }
    }
    ++planned;
  }
  MESSAGE(planned, " planned, ", refused, " without a source refused, ", split_moves, " moves split, ", network_chunks,
          " network chunks");
  for (int r = 0; r < transfer::num_source_reasons; ++r) {
    MESSAGE(transfer::to_string(static_cast<transfer::SourceReason>(r)), ": ", reasons[r], " moves");
    CHECK(reasons[r] > 0); // every reason shows up
  }
  CHECK(planned > runs / 2);
  CHECK(split_moves > 0);
  CHECK(network_chunks > 0);
  CHECK(refused > 0);
}

TEST_CASE("a move with both paths is split so that they finish together") {
  Topology topo{1, 2, 2};
  LayerPlacement resident(2, 2, 4);
  resident.slot(0, 0) = 0;
  const std::vector<Move> moves{{0, 0, 1, 0}}; // the planner's source: GPU 0
  transfer::Options opt;
  opt.move.gpu_intra.latency_us = opt.move.host.latency_us = 0;
  opt.expert_bytes = std::int64_t{44} << 20;
  opt.max_chunk_bytes = opt.expert_bytes;
  const auto tp = transfer::plan_transfers(moves, resident, topo, opt);
  REQUIRE(tp.chunks.size() == 2);
  const double nv_rate = opt.move.gpu_intra.gb_per_s * 1e9, pc_rate = opt.move.host.gb_per_s * 1e9;
  const double t_nv = static_cast<double>(tp.path_bytes[0]) / nv_rate;
  const double t_pc = static_cast<double>(tp.path_bytes[1]) / pc_rate;
  CHECK(std::abs(t_nv - t_pc) <= 2 * 4096 / pc_rate);
  // Shares follow the move rates: NVLink carries nvlink / (nvlink + pcie) of the bytes (340/390 by default).
  CHECK(static_cast<double>(tp.path_bytes[0]) / static_cast<double>(opt.expert_bytes) ==
        doctest::Approx(nv_rate / (nv_rate + pc_rate)).epsilon(1e-3));
  CHECK(tp.chunks[0].round == 0);
  CHECK(tp.chunks[1].round == 0); // different links: the same round
  CHECK(tp.est_seconds == doctest::Approx(std::max(t_nv, t_pc)));
  CHECK(tp.moves[0].src_gpu == 0);
  CHECK(tp.source_reason[0] == transfer::SourceReason::split);

  // Without splitting the whole move reads from the planner's source.
  opt.split_paths = false;
  const auto whole = transfer::plan_transfers(moves, resident, topo, opt);
  REQUIRE(whole.chunks.size() == 1);
  CHECK(whole.chunks[0].path == Path::nvlink);
  CHECK(whole.source_reason[0] == transfer::SourceReason::planned);
  // The planner chose the mirror: kept, though GPU 0 holds a copy.
  const std::vector<Move> from_mirror{{0, host_mirror, 1, 0}};
  const auto kept = transfer::plan_transfers(from_mirror, resident, topo, opt);
  REQUIRE(kept.chunks.size() == 1);
  CHECK(kept.chunks[0].path == Path::pcie);
  CHECK(kept.source_reason[0] == transfer::SourceReason::planned);
}

TEST_CASE("a source slot overwritten in the same batch is never read") {
  Topology topo{1, 2, 1};
  LayerPlacement resident(2, 1, 2);
  resident.slot(0, 0) = 0;
  resident.slot(1, 0) = 1;
  // Swap the two experts: neither GPU copy may serve, only the mirror.
  const std::vector<Move> moves{{1, 1, 0, 0}, {0, 0, 1, 0}};
  transfer::Options opt;
  opt.expert_bytes = 1 << 20;
  const auto tp = transfer::plan_transfers(moves, resident, topo, opt);
  for (const auto &c : tp.chunks)
    CHECK(c.path == Path::pcie);
  CHECK(tp.source_reason == std::vector{transfer::SourceReason::rewritten, transfer::SourceReason::rewritten});
  opt.host_mirror = false;
  CHECK_THROWS_WITH_AS((void)transfer::plan_transfers(moves, resident, topo, opt), doctest::Contains("has no source"),
                       Error);
}

TEST_CASE("transfer plans of real planner moves, per layer, with estimates") {
  Topology topo{2, 4, 3};
  const int num_layers = 4, num_experts = 16;
  Planner planner(num_layers, num_experts, topo);
  std::mt19937_64 rng(3);
  std::gamma_distribution<double> skew(0.3, 100.0);
  Placement resident;
  transfer::Options opt;
  opt.expert_bytes = std::int64_t{3} * 2048 * 768 * 2; // a Qwen3-30B-A3B expert in bf16
  opt.max_chunk_bytes = 1 << 20;
  int total_moves = 0;
  for (int m = 0; m < 6; ++m) {
    std::vector<std::int64_t> loads(num_layers * num_experts);
    for (auto &x : loads)
      x = static_cast<std::int64_t>(skew(rng));
    const auto plans = planner.plan(loads, Stage::update, m == 0 ? nullptr : &resident);
    for (int l = 0; l < num_layers; ++l) {
      const LayerPlacement before =
          m == 0 ? LayerPlacement(topo.num_gpus(), topo.slots_per_gpu, num_experts) : resident.layer(l);
      const auto tp = transfer::plan_transfers(plans[l].moves, before, topo, opt);
      REQUIRE_NOTHROW(transfer::validate(tp, plans[l].moves, before, topo, opt));
      total_moves += static_cast<int>(plans[l].moves.size());
      if (!plans[l].moves.empty()) CHECK(tp.est_seconds > 0);
    }
    resident = to_placement(plans);
  }
  CHECK(total_moves > 0);
}

TEST_CASE("transfer planning rejects bad input naming the value") {
  Topology topo{1, 2, 2};
  LayerPlacement resident(2, 2, 4);
  transfer::Options opt;
  opt.expert_bytes = 0;
  CHECK_THROWS_WITH_AS((void)transfer::plan_transfers({}, resident, topo, opt),
                       doctest::Contains("expert_bytes must be positive, got 0"), Error);
  opt.expert_bytes = 100;
  const std::vector<Move> bad_expert{{9, host_mirror, 0, 0}};
  CHECK_THROWS_WITH_AS((void)transfer::plan_transfers(bad_expert, resident, topo, opt), doctest::Contains("expert 9"),
                       Error);
  const std::vector<Move> bad_slot{{1, host_mirror, 0, 5}};
  CHECK_THROWS_WITH_AS((void)transfer::plan_transfers(bad_slot, resident, topo, opt), doctest::Contains("slot 5"),
                       Error);
  const std::vector<Move> twice{{1, host_mirror, 0, 0}, {2, host_mirror, 0, 0}};
  CHECK_THROWS_WITH_AS((void)transfer::plan_transfers(twice, resident, topo, opt),
                       doctest::Contains("two moves write GPU 0 slot 0"), Error);
  LayerPlacement wrong(3, 2, 4);
  CHECK_THROWS_WITH_AS((void)transfer::plan_transfers({}, wrong, topo, opt), doctest::Contains("3 GPUs"), Error);
}

TEST_CASE("transfer planner and simulator cost model price a move alike (property)") {
  // One move alone, one chunk: the planner's estimate is `move_seconds` on the same `MoveParams` the simulator
  // prices moves with, to the bit, for random rates, latencies, bytes and paths. A planner that went back to its
  // own link table would miss the random parameters.
  std::mt19937_64 rng(4242);
  std::uniform_real_distribution<double> rate(1.0, 900.0), lat(0.0, 50.0);
  const int rounds = 200 * foremoe_test::seed_multiplier();
  int seen[transfer::num_paths] = {0, 0, 0};
  for (int r = 0; r < rounds; ++r) {
    transfer::Options opt;
    if (r > 0) // round 0: the defaults
      for (PathParams *p : {&opt.move.gpu_intra, &opt.move.gpu_inter, &opt.move.host})
        *p = {rate(rng), lat(rng)};
    opt.expert_bytes = 1 + static_cast<std::int64_t>(rng() % (std::int64_t{1} << 34));
    opt.max_chunk_bytes = opt.expert_bytes; // one chunk
    opt.align_bytes = std::min<std::int64_t>(opt.align_bytes, opt.max_chunk_bytes);
    const auto path = static_cast<Path>(rng() % transfer::num_paths);
    CAPTURE(r);
    CAPTURE(static_cast<int>(path));
    CAPTURE(opt.expert_bytes);
    // Two nodes of two GPUs; the move fills GPU 1. A copy on GPU 0 (same node) forces NVLink without the mirror,
    // a copy on GPU 2 (other node) and no mirror forces the network, no GPU copy forces the mirror.
    Topology topo{2, 2, 1};
    LayerPlacement resident(4, 1, 2);
    opt.split_paths = false;
    opt.host_mirror = path == Path::pcie;
    if (path == Path::nvlink) resident.slot(0, 0) = 0;
    if (path == Path::network) resident.slot(2, 0) = 0;
    const std::vector<Move> moves{{0, host_mirror, 1, 0}};
    const auto tp = transfer::plan_transfers(moves, resident, topo, opt);
    transfer::validate(tp, moves, resident, topo, opt);
    REQUIRE(tp.chunks.size() == 1);
    REQUIRE(tp.chunks[0].path == path);
    ++seen[static_cast<int>(path)];
    const auto bytes = static_cast<double>(opt.expert_bytes);
    CHECK(tp.est_seconds == move_seconds(opt.move, path, bytes));
    CHECK(tp.link_bound_seconds == bytes / (path_params(opt.move, path).gb_per_s * 1e9));
    // The simulator reads the same struct: `CostParams::move`.
    CostParams cost;
    cost.move = opt.move;
    CHECK(tp.est_seconds == move_seconds(cost.move, path, bytes));
  }
  for (int n : seen)
    CHECK(n > 0);
}
