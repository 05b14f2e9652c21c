// Multi-process (SPMD) use of the transfer engine on the host backend: several engines, each driving some GPUs of
// one modelled EP group, joined by a HostFabric that pairs sends and receives in posting order as NCCL does. Every
// engine gets the same batches, from its own thread, as every process of a trainer would.

#include <doctest/doctest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <thread>

#include "expert_bytes.hpp"
#include "foremoe/runtime/testing.hpp"
#include "foremoe/runtime/transfer_engine.hpp"
#include "test_support.hpp"

using namespace foremoe;
namespace rt = foremoe::runtime;
using namespace std::chrono_literals;

namespace {

// The memory of a whole EP group and one engine per "process"; process p drives the GPUs with proc_of_gpu == p.
struct Group {
  Topology topo;
  int num_layers = 1, num_experts = 0;
  std::vector<rt::TensorSpan> tensors;
  std::int64_t slot_stride = 0;
  std::int64_t grad_bytes = 0;
  bool mirrors = true;
  std::vector<int> proc_of_gpu;
  int num_procs = 0;
  std::vector<std::shared_ptr<const rt::FaultSchedule>> faults_of_proc; // optional, per process
  std::vector<std::vector<std::byte>> gpu_mem, mirror_mem;              // [layer * gpus + gpu], [layer * nodes + node]
  std::vector<std::vector<float>> grad_mem; // [gpu]: slots * grad_bytes / 4 floats (layer 0)
  std::shared_ptr<rt::HostFabric> fabric = std::make_shared<rt::HostFabric>();
  std::vector<std::unique_ptr<rt::TransferEngine>> engines;

  // `split`: slots and mirrors in split regions (`SlotRegion::tensors`) of random layouts drawn from `layout_seed`.
  bool split = false;
  std::uint64_t layout_seed = 0;
  std::vector<foremoe_test::SplitMemory> split_mem, split_mirror; // [layer * gpus + gpu], [layer * nodes + node]

  std::byte *slot_ptr(int l, int g, int s) {
    return gpu_mem[static_cast<std::size_t>(l) * topo.num_gpus() + g].data() + s * slot_stride;
  }
  std::byte *at(int l, int g, int s, int ti) {
    return split ? split_mem[static_cast<std::size_t>(l) * topo.num_gpus() + g].at(ti, s)
                 : slot_ptr(l, g, s) + tensors[ti].offset_bytes;
  }
  void fill(int l, int g, int s, int e) {
    foremoe_test::fill_expert_at([&](int ti) { return at(l, g, s, ti); }, tensors, l, e);
  }
  bool holds_bytes(int l, int g, int s, int e) {
    return foremoe_test::holds_expert_at([&](int ti) { return at(l, g, s, ti); }, tensors, l, e);
  }
  rt::TransferEngine &engine_of(int g) { return *engines[proc_of_gpu[g]]; }

  void build(std::mt19937_64 &rng, rt::EngineOptions opts) {
    topo = opts.topology;
    num_layers = opts.num_layers;
    num_experts = opts.num_experts;
    const int n = std::uniform_int_distribution<int>(1, 3)(rng);
    std::int64_t off = std::uniform_int_distribution<int>(0, 64)(rng);
    for (int i = 0; i < n; ++i) {
      const std::int64_t bytes = std::uniform_int_distribution<std::int64_t>(1, 12 << 10)(rng);
      tensors.push_back({off, bytes});
      off += bytes + std::uniform_int_distribution<int>(0, 100)(rng);
    }
    slot_stride = off;
    opts.tensors = tensors;
    opts.peers.host_fabric = fabric;
    gpu_mem.assign(static_cast<std::size_t>(num_layers) * topo.num_gpus(),
                   std::vector<std::byte>(static_cast<std::size_t>(slot_stride * topo.slots_per_gpu), std::byte{0xee}));
    mirror_mem.assign(static_cast<std::size_t>(num_layers) * topo.num_nodes,
                      std::vector<std::byte>(static_cast<std::size_t>(slot_stride * num_experts)));
    grad_bytes = 4 * std::uniform_int_distribution<std::int64_t>(1, 300)(rng);
    grad_mem.assign(static_cast<std::size_t>(topo.num_gpus()),
                    std::vector<float>(static_cast<std::size_t>(topo.slots_per_gpu * grad_bytes / 4), 0.f));
    for (int p = 0; p < num_procs; ++p) {
      rt::EngineOptions o = opts;
      if (p < static_cast<int>(faults_of_proc.size())) o.faults = faults_of_proc[p];
      for (int g = 0; g < topo.num_gpus(); ++g)
        if (proc_of_gpu[g] == p) o.peers.local_gpus.push_back(g);
      std::unique_ptr<rt::TransferEngine> e;
      const rt::Status st = rt::TransferEngine::create(o, e);
      REQUIRE_MESSAGE(st.ok(), st.to_string());
      engines.push_back(std::move(e));
    }
    std::mt19937_64 layout_rng(layout_seed);
    if (split) {
      split_mem.resize(static_cast<std::size_t>(num_layers) * topo.num_gpus());
      split_mirror.resize(static_cast<std::size_t>(num_layers) * topo.num_nodes);
      for (auto &m : split_mem)
        m.build(layout_rng, tensors, topo.slots_per_gpu, 1);
      for (auto &m : split_mirror)
        m.build(layout_rng, tensors, num_experts, 1);
    }
    for (int l = 0; l < num_layers; ++l)
      for (int g = 0; g < topo.num_gpus(); ++g) {
        rt::SlotRegion r{slot_ptr(l, g, 0), slot_stride, topo.slots_per_gpu, 1, 0};
        if (split) r.tensors = split_mem[static_cast<std::size_t>(l) * topo.num_gpus() + g].slot_tensors();
        REQUIRE(engine_of(g).register_slots(l, g, r).ok());
        if (l == 0) {
          rt::SlotRegion gr{grad_mem[g].data(), grad_bytes, topo.slots_per_gpu, 1, 0};
          REQUIRE(engine_of(g).register_grads(0, g, gr, grad_bytes).ok());
        }
      }
    for (int l = 0; l < num_layers && mirrors; ++l)
      for (int nd = 0; nd < topo.num_nodes; ++nd) {
        auto &m = mirror_mem[static_cast<std::size_t>(l) * topo.num_nodes + nd];
        for (int e = 0; e < num_experts; ++e)
          foremoe_test::fill_expert(m.data() + e * slot_stride, tensors, l, e);
        rt::MirrorRegion region{m.data(), slot_stride, num_experts};
        if (split) {
          auto &sm = split_mirror[static_cast<std::size_t>(l) * topo.num_nodes + nd];
          for (int e = 0; e < num_experts; ++e)
            foremoe_test::fill_expert_at([&](int ti) { return sm.at(ti, e); }, tensors, l, e);
          region.tensors = sm.mirror_tensors();
        }
        // Every process on the node registers the node's mirror (each has its own mapping of it).
        for (int p = 0; p < num_procs; ++p) {
          bool on_node = false;
          for (int g = nd * topo.gpus_per_node; g < (nd + 1) * topo.gpus_per_node; ++g)
            on_node = on_node || proc_of_gpu[g] == p;
          if (on_node) REQUIRE(engines[p]->register_mirror(l, nd, region).ok());
        }
      }
  }

  LayerPlacement random_resident(std::mt19937_64 &rng, int l) {
    LayerPlacement p(topo.num_gpus(), topo.slots_per_gpu, num_experts);
    std::uniform_int_distribution<int> pick(0, num_experts - 1);
    for (int g = 0; g < topo.num_gpus(); ++g)
      for (int s = 0; s < topo.slots_per_gpu; ++s)
        if (const int e = pick(rng); !p.holds(g, e) && rng() % 5 != 0) {
          p.slot(g, s) = e;
          fill(l, g, s, e);
        }
    for (auto &e : engines)
      REQUIRE(e->set_resident(l, p).ok());
    return p;
  }

  // Random moves onto `target` (updated), which every process agrees on. `need_source`: only moves with a GPU copy
  // that stays in place during the batch (no mirror to fall back on).
  std::vector<Move> random_moves(std::mt19937_64 &rng, LayerPlacement &target, double p_move, bool need_source) {
    const LayerPlacement before = target;
    const int slots = topo.slots_per_gpu;
    std::vector<char> kept(static_cast<std::size_t>(target.num_slots()), 0), written(kept.size(), 0);
    std::vector<Move> moves;
    std::uniform_int_distribution<int> pick(0, num_experts - 1);
    for (int g = 0; g < topo.num_gpus(); ++g)
      for (int s = 0; s < slots; ++s)
        if (std::bernoulli_distribution(p_move)(rng) && !kept[g * slots + s]) {
          const int e = pick(rng);
          if (target.holds(g, e)) continue;
          if (need_source) {
            int src = -1;
            for (int p = 0; p < target.num_slots() && src < 0; ++p)
              if (p / slots != g && before.slot(p / slots, p % slots) == e && !written[p]) src = p;
            if (src < 0) continue;
            kept[src] = 1; // its source stays in place
          }
          target.slot(g, s) = e;
          written[g * slots + s] = 1;
          moves.push_back({e, host_mirror, g, s});
        }
    return moves;
  }

  // A random resident placement per layer, then three rounds of one batch per layer: later batches read what
  // earlier ones wrote, in other processes too. Without mirrors every move has a GPU source that stays in place.
  // `target` receives each layer's placement after all of them.
  std::vector<std::pair<int, std::vector<Move>>> random_batches(std::mt19937_64 &rng,
                                                                std::vector<LayerPlacement> &target) {
    std::vector<std::pair<int, std::vector<Move>>> batches;
    target.clear();
    for (int l = 0; l < num_layers; ++l)
      target.push_back(random_resident(rng, l));
    for (int k = 0; k < 3; ++k)
      for (int l = 0; l < num_layers; ++l)
        batches.emplace_back(l, random_moves(rng, target[l], 0.4, !mirrors));
    return batches;
  }

  // Every slot an engine calls valid on its own GPUs holds exactly its expert's bytes.
  int check_valid_bytes(int l) {
    int valid = 0;
    for (int g = 0; g < topo.num_gpus(); ++g) {
      const LayerPlacement p = engine_of(g).resident(l);
      for (int s = 0; s < topo.slots_per_gpu; ++s)
        if (const int e = p.slot(g, s); e != empty_slot) {
          ++valid;
          CHECK_MESSAGE(holds_bytes(l, g, s, e), "layer ", l, " GPU ", g, " slot ", s, " is valid for expert ", e,
                        " with wrong bytes");
        }
      if (split)
        CHECK_MESSAGE(split_mem[static_cast<std::size_t>(l) * topo.num_gpus() + g].guards_intact(), "layer ", l,
                      " GPU ", g, ": a byte outside the rows was written");
    }
    return valid;
  }
};

// Random partitions: one process per GPU, one per node, or random contiguous groups.
std::vector<int> random_partition(std::mt19937_64 &rng, const Topology &topo, int &num_procs) {
  std::vector<int> proc(static_cast<std::size_t>(topo.num_gpus()));
  const int kind = static_cast<int>(rng() % 3);
  int p = 0;
  for (int g = 0; g < topo.num_gpus(); ++g) {
    if (kind == 0)
      proc[g] = g;
    else if (kind == 1)
      proc[g] = topo.node_of(g);
    else {
      if (g > 0 && rng() % 2 == 0) ++p;
      proc[g] = p;
    }
  }
  num_procs = *std::max_element(proc.begin(), proc.end()) + 1;
  if (num_procs == 1 && topo.num_gpus() > 1) { // at least two processes
    proc.back() = 1;
    num_procs = 2;
  }
  return proc;
}

rt::EngineOptions random_options(std::mt19937_64 &rng) {
  rt::EngineOptions o;
  o.topology.num_nodes = std::uniform_int_distribution<int>(1, 2)(rng);
  o.topology.gpus_per_node = std::uniform_int_distribution<int>(1, 4)(rng);
  if (o.topology.num_gpus() == 1) o.topology.gpus_per_node = 2;
  o.topology.slots_per_gpu = std::uniform_int_distribution<int>(1, 3)(rng);
  o.num_layers = 2;
  o.num_experts = std::uniform_int_distribution<int>(o.topology.slots_per_gpu,
                                                     o.topology.num_gpus() * o.topology.slots_per_gpu + 2)(rng);
  o.planning.align_bytes = 256;
  o.planning.max_chunk_bytes = std::int64_t{256} * std::uniform_int_distribution<int>(1, 20)(rng);
  o.max_attempts = std::uniform_int_distribution<int>(1, 3)(rng);
  o.host_threads_per_path = 1;
  return o;
}

// Submits `batches` (layer, moves) on every engine, each engine from its own thread in the same order, and waits.
std::vector<std::vector<rt::Status>> run_everywhere(Group &grp,
                                                    const std::vector<std::pair<int, std::vector<Move>>> &batches,
                                                    std::chrono::milliseconds timeout) {
  std::vector<std::vector<rt::Status>> out(static_cast<std::size_t>(grp.num_procs));
  std::vector<std::thread> procs;
  for (int p = 0; p < grp.num_procs; ++p)
    procs.emplace_back([&, p] {
      std::vector<rt::Ticket> tickets;
      for (const auto &[layer, moves] : batches) {
        rt::MoveBatch b;
        b.layer = layer;
        b.moves = moves;
        b.timeout = timeout;
        rt::Ticket t;
        const rt::Status st = grp.engines[p]->submit(b, t);
        if (!st.ok()) {
          out[p].push_back(st);
          continue;
        }
        tickets.push_back(t);
      }
      for (auto &t : tickets)
        out[p].push_back(t.wait_for(timeout + 5s));
    });
  for (auto &t : procs)
    t.join();
  return out;
}

// One layer, one process per GPU, no mirror; GPU g's first slots hold `held[g]`, written and declared resident
// everywhere.
void build_small(Group &grp, int nodes, int gpn, int slots, int experts, const std::vector<std::vector<int>> &held) {
  std::mt19937_64 rng(static_cast<std::uint64_t>(nodes * 1000 + gpn * 100 + slots * 10 + experts));
  rt::EngineOptions o;
  o.topology.num_nodes = nodes;
  o.topology.gpus_per_node = gpn;
  o.topology.slots_per_gpu = slots;
  o.num_layers = 1;
  o.num_experts = experts;
  o.planning.host_mirror = false;
  grp.mirrors = false;
  grp.num_procs = nodes * gpn;
  for (int g = 0; g < grp.num_procs; ++g)
    grp.proc_of_gpu.push_back(g);
  grp.build(rng, o);
  LayerPlacement p(nodes * gpn, slots, experts);
  for (int g = 0; g < nodes * gpn; ++g)
    for (std::size_t s = 0; s < held[g].size(); ++s) {
      p.slot(g, static_cast<int>(s)) = held[g][s];
      grp.fill(0, g, static_cast<int>(s), held[g][s]);
    }
  for (auto &e : grp.engines)
    REQUIRE(e->set_resident(0, p).ok());
}

} // namespace

TEST_CASE("multi-process moves without faults land everywhere, over paired transfers where processes differ") {
  int runs = 0, paired_moves = 0;
  for (std::uint64_t seed = 1; seed <= 60 * static_cast<std::uint64_t>(foremoe_test::seed_multiplier()); ++seed) {
    std::mt19937_64 rng(seed);
    Group grp;
    rt::EngineOptions o = random_options(rng);
    grp.mirrors = rng() % 2 == 0;
    o.planning.host_mirror = grp.mirrors;
    o.verify = rng() % 2 == 0;
    grp.split = seed % 2 == 0; // split regions, in a layout of their own seed (the instance is drawn as before)
    grp.layout_seed = seed;
    grp.proc_of_gpu = random_partition(rng, o.topology, grp.num_procs);
    grp.build(rng, o);
    std::vector<LayerPlacement> target;
    const auto st = run_everywhere(grp, grp.random_batches(rng, target), 10s);
    for (int p = 0; p < grp.num_procs; ++p)
      for (const rt::Status &s : st[p])
        CHECK_MESSAGE(s.ok(), "seed ", seed, " process ", p, ": ", s.to_string());
    for (int l = 0; l < grp.num_layers; ++l) {
      grp.check_valid_bytes(l);
      for (int g = 0; g < grp.topo.num_gpus(); ++g)
        for (int s = 0; s < grp.topo.slots_per_gpu; ++s)
          CHECK_MESSAGE(grp.engine_of(g).valid_expert(l, g, s) == target[l].slot(g, s), "seed ", seed, " layer ", l,
                        " GPU ", g, " slot ", s);
      // Every process tracks the same planned placement.
      for (auto &e : grp.engines)
        for (int g = 0; g < grp.topo.num_gpus(); ++g)
          for (int s = 0; s < grp.topo.slots_per_gpu; ++s)
            CHECK(e->resident(l).slot(g, s) == target[l].slot(g, s));
      const transfer::TransferPlan plan = grp.engines[0]->last_plan(l);
      for (const transfer::Chunk &c : plan.chunks)
        paired_moves += c.path != transfer::Path::pcie && grp.proc_of_gpu[c.src_gpu] != grp.proc_of_gpu[c.dst_gpu];
    }
    ++runs;
  }
  MESSAGE(runs, " runs; ", paired_moves, " chunks of the last batches crossed processes");
  CHECK(paired_moves > 0);
}

TEST_CASE("multi-process moves under random faults: valid slots hold exact bytes, every batch ends") {
  int done = 0, failed = 0;
  for (std::uint64_t seed = 1; seed <= 60 * static_cast<std::uint64_t>(foremoe_test::seed_multiplier()); ++seed) {
    std::mt19937_64 rng(seed ^ 0x5eed);
    INFO("seed ", seed);
    Group grp;
    rt::EngineOptions o = random_options(rng);
    grp.mirrors = rng() % 3 != 0;
    o.planning.host_mirror = grp.mirrors;
    o.verify = true; // corruption is only caught by verification
    auto f = std::make_shared<rt::FaultSchedule>();
    f->fail_probability = std::uniform_real_distribution<double>(0, 0.3)(rng);
    f->corrupt_probability = std::uniform_real_distribution<double>(0, 0.2)(rng);
    f->delay_probability = 0.1;
    f->delay_us = 200;
    f->seed = seed;
    o.faults = f;
    grp.split = seed % 2 == 0;
    grp.layout_seed = seed;
    grp.proc_of_gpu = random_partition(rng, o.topology, grp.num_procs);
    grp.build(rng, o);
    std::vector<LayerPlacement> target;
    const auto st = run_everywhere(grp, grp.random_batches(rng, target), 10s);
    for (int p = 0; p < grp.num_procs; ++p)
      for (const rt::Status &s : st[p]) {
        CHECK_MESSAGE((s.ok() || s.code() == rt::StatusCode::device_error), "seed ", seed, ": ", s.to_string());
        (s.ok() ? done : failed) += 1;
      }
    for (int l = 0; l < grp.num_layers; ++l)
      grp.check_valid_bytes(l);
  }
  MESSAGE(done, " batch ends done, ", failed, " failed");
  CHECK(done > 0);
  CHECK(failed > 0);
}

TEST_CASE("multi-process: a sender whose copy is not valid says so, and the receiver does not publish it") {
  // 3 GPUs in 3 processes on one node, no mirror. Batch 1 moves expert 0 from GPU 2 onto GPU 0, and fails on GPU 0
  // only (its engine fails every transfer): the other processes still plan with expert 0 on GPU 0. Batch 2 moves
  // expert 0 onto GPU 1 while overwriting GPU 2's copy, so GPU 0's (invalid) copy is the only source.
  Group grp;
  auto f = std::make_shared<rt::FaultSchedule>();
  f->fail_probability = 1.0;
  grp.faults_of_proc = {f, nullptr, nullptr};
  build_small(grp, 1, 3, 2, 4, {{1}, {3}, {0}});
  const std::vector<Move> first{{0, host_mirror, 0, 1}};
  const std::vector<Move> second{{0, host_mirror, 1, 1}, {3, host_mirror, 2, 0}};
  const auto st = run_everywhere(grp, {{0, first}, {0, second}}, 2s);
  CHECK(st[0][0].code() == rt::StatusCode::device_error); // batch 1 failed on GPU 0
  CHECK(st[1][1].code() == rt::StatusCode::device_error); // GPU 1 got a header saying "not valid"
  CHECK(st[1][1].message().find("expert 0 on GPU 1") != std::string::npos);
  CHECK(st[2][1].ok()); // GPU 2 got expert 3 from GPU 1
  CHECK(grp.engines[0]->valid_expert(0, 0, 1) == empty_slot);
  CHECK(grp.engines[1]->valid_expert(0, 1, 1) == empty_slot);
  CHECK(grp.engines[2]->valid_expert(0, 2, 0) == 3);
  CHECK(grp.holds_bytes(0, 2, 0, 3));
  grp.check_valid_bytes(0);
}

TEST_CASE("multi-process: a missing peer makes the batch time out; a late peer completes the pairing") {
  Group grp;
  build_small(grp, 2, 1, 2, 2, {{0}, {1}});
  const LayerPlacement p = grp.engines[0]->resident(0);
  std::vector<Move> first{{0, host_mirror, 1, 1}};
  rt::MoveBatch b;
  b.moves = first;
  b.timeout = 200ms;
  rt::Ticket recv;
  REQUIRE(grp.engines[1]->submit(b, recv).ok());
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(recv.wait_for(3s).code() == rt::StatusCode::timed_out);
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
  CHECK(grp.engines[1]->valid_expert(0, 1, 1) == empty_slot);
  // The slot stays locked while the posted receive can still land: set_resident refuses.
  CHECK_FALSE(grp.engines[1]->set_resident(0, p).ok());
  // The late sender posts; the pairing completes (the bytes land in the slot, which stays invalid: the batch ended).
  rt::Ticket send;
  b.timeout = 2s;
  REQUIRE(grp.engines[0]->submit(b, send).ok());
  CHECK(send.wait_for(3s).ok());
  // Then a second batch works on both sides: the pairing of later transfers is intact.
  std::vector<Move> second{{1, host_mirror, 0, 1}};
  b.moves = second;
  const auto st = run_everywhere(grp, {{0, second}}, 2s);
  CHECK(st[0][0].ok());
  CHECK(st[1][0].ok());
  CHECK(grp.engines[0]->valid_expert(0, 0, 1) == 1);
  CHECK(grp.holds_bytes(0, 0, 1, 1));
}

TEST_CASE("multi-process: batches that differ between processes fail instead of landing the wrong expert") {
  Group grp;
  // Equal sizes: only the header tells the experts apart.
  build_small(grp, 1, 2, 3, 4, {{0, 1}, {2}});
  std::vector<Move> a{{0, host_mirror, 1, 1}}, b2{{1, host_mirror, 1, 1}};
  rt::MoveBatch ba, bb;
  ba.moves = a;
  bb.moves = b2;
  ba.timeout = bb.timeout = 2s;
  rt::Ticket ta, tb;
  REQUIRE(grp.engines[0]->submit(bb, ta).ok()); // sender sends expert 1
  REQUIRE(grp.engines[1]->submit(ba, tb).ok()); // receiver expects expert 0
  CHECK(ta.wait_for(3s).ok());
  const rt::Status s = tb.wait_for(3s);
  CHECK(s.code() == rt::StatusCode::device_error);
  CHECK(grp.engines[1]->valid_expert(0, 1, 1) == empty_slot);
}

TEST_CASE("multi-process replica gradients: owners receive every replica's gradient once, all or nothing") {
  for (std::uint64_t seed = 1; seed <= 40 * static_cast<std::uint64_t>(foremoe_test::seed_multiplier()); ++seed) {
    std::mt19937_64 rng(seed * 3 + 1);
    Group grp;
    rt::EngineOptions o = random_options(rng);
    o.num_layers = 1;
    const bool faults = seed % 2 == 1;
    if (faults) {
      auto f = std::make_shared<rt::FaultSchedule>();
      f->fail_probability = 0.3;
      f->seed = seed;
      o.faults = f;
    }
    grp.proc_of_gpu = random_partition(rng, o.topology, grp.num_procs);
    grp.build(rng, o);
    const LayerPlacement p = grp.random_resident(rng, 0);
    // Owners: the first GPU holding each expert.
    std::vector<std::int32_t> owner(static_cast<std::size_t>(grp.num_experts), 0);
    for (int e = 0; e < grp.num_experts; ++e) {
      owner[e] = -1;
      for (int g = 0; g < grp.topo.num_gpus() && owner[e] < 0; ++g)
        if (p.holds(g, e)) owner[e] = g;
      if (owner[e] < 0) owner[e] = 0; // no copy anywhere: no replicas either
    }
    const std::int64_t n = grp.grad_bytes / 4;
    for (int g = 0; g < grp.topo.num_gpus(); ++g)
      for (int s = 0; s < grp.topo.slots_per_gpu; ++s)
        for (std::int64_t i = 0; i < n; ++i)
          grp.grad_mem[g][static_cast<std::size_t>(s * n + i)] =
              static_cast<float>(g + 1) + 0.25f * static_cast<float>(i % 5);
    const auto before = grp.grad_mem;
    // Every fourth seed (no faults) under the held-gradient rule: a random half of the replicas returns (then
    // zeroed by the process driving the replica's GPU), the others stay held; every process submits the same.
    const bool select = seed % 4 == 0;
    std::vector<rt::ReplicaRef> returns;
    std::vector<std::int32_t> held(static_cast<std::size_t>(grp.topo.num_gpus()) * grp.num_experts, -1);
    auto returned = [&](int g, int e) {
      return !select || std::find(returns.begin(), returns.end(), rt::ReplicaRef{g, e}) != returns.end();
    };
    for (int g = 0; g < grp.topo.num_gpus() && select; ++g)
      for (int e = 0; e < grp.num_experts; ++e)
        if (g != owner[e] && p.holds(g, e)) {
          if (rng() % 2 == 0)
            returns.push_back({g, e});
          else
            held[static_cast<std::size_t>(g) * grp.num_experts + e] = owner[e];
        }
    std::vector<rt::Status> st(static_cast<std::size_t>(grp.num_procs));
    std::vector<std::vector<rt::MoveTelemetry>> tel(static_cast<std::size_t>(grp.num_procs));
    std::vector<std::thread> procs;
    for (int q = 0; q < grp.num_procs; ++q)
      procs.emplace_back([&, q] {
        rt::ReduceBatch b;
        b.owner_gpu = owner;
        b.timeout = 5s;
        b.select = select;
        b.returns = returns;
        b.held = held;
        rt::Ticket t;
        st[q] = grp.engines[q]->submit_reduce(b, t);
        if (st[q].ok()) st[q] = t.wait_for(8s);
        tel[q] = t.telemetry();
      });
    for (auto &t : procs)
      t.join();
    for (int q = 0; q < grp.num_procs; ++q)
      CHECK_MESSAGE((st[q].ok() || (faults && st[q].code() == rt::StatusCode::device_error)), "seed ", seed, ": ",
                    st[q].to_string());
    // Each owner slot holds its own gradient plus either all replicas' gradients or none of them.
    for (int e = 0; e < grp.num_experts; ++e) {
      const int o_gpu = owner[e];
      int o_slot = -1;
      for (int s = 0; s < grp.topo.slots_per_gpu; ++s)
        if (p.slot(o_gpu, s) == e) o_slot = s;
      if (o_slot < 0) continue;
      std::vector<int> replicas;
      for (int g = 0; g < grp.topo.num_gpus(); ++g)
        if (g != o_gpu && p.holds(g, e) && returned(g, e)) replicas.push_back(g);
      for (int g = 0; g < grp.topo.num_gpus() && select; ++g)
        for (int s = 0; s < grp.topo.slots_per_gpu; ++s)
          if (g != o_gpu && p.slot(g, s) == e)
            for (std::int64_t i = 0; i < n; ++i) {
              const auto at = static_cast<std::size_t>(s * n + i);
              CHECK_MESSAGE(grp.grad_mem[g][at] == (returned(g, e) ? 0.0f : before[g][at]), "seed ", seed,
                            " replica of ", e, " on GPU ", g);
            }
      for (std::int64_t i = 0; i < n; ++i) {
        const float own = before[o_gpu][static_cast<std::size_t>(o_slot * n + i)];
        float all = own;
        for (int g : replicas)
          all += static_cast<float>(g + 1) + 0.25f * static_cast<float>(i % 5);
        const float got = grp.grad_mem[o_gpu][static_cast<std::size_t>(o_slot * n + i)];
        CHECK_MESSAGE((got == all || (faults && got == own)), "seed ", seed, " expert ", e, " element ", i);
        if (!faults) CHECK(got == all);
        if (got != all && got != own) break;
      }
    }
  }
}

// One reduction of every replica gradient into its owner, on every process of a random group (`seed`) whose
// engines take `faults` and `verify`: random gradients, the owner of each expert its first holder. `sum` and `own`
// per expert and element are what its owner should hold after and holds before; `got` what it holds after.
struct ReductionRun {
  Group grp;
  LayerPlacement where;
  std::vector<std::int32_t> owner;
  std::vector<rt::Status> status;                  // per process
  std::vector<std::vector<rt::MoveTelemetry>> tel; // per process
  std::vector<std::vector<float>> before;          // per GPU
  std::int64_t n = 0;                              // floats per gradient
  // Whether expert `e`'s owner holds the exact sum (`all`) or its own gradient untouched (`own`); -1: no owner slot.
  [[nodiscard]] std::pair<bool, bool> outcome(int e) const {
    const int o_gpu = owner[e];
    int o_slot = -1;
    for (int s = 0; s < grp.topo.slots_per_gpu; ++s)
      if (where.slot(o_gpu, s) == e) o_slot = s;
    if (o_slot < 0) return {true, true};
    bool is_all = true, is_own = true;
    for (std::int64_t i = 0; i < n; ++i) {
      const float own = before[o_gpu][static_cast<std::size_t>(o_slot * n + i)];
      float all = own; // the owner's own first, then each replica's in GPU order (the engine's fixed order)
      for (int g = 0; g < grp.topo.num_gpus(); ++g)
        for (int s = 0; s < grp.topo.slots_per_gpu; ++s)
          if (g != o_gpu && where.slot(g, s) == e) all += before[g][static_cast<std::size_t>(s * n + i)];
      const float got = grp.grad_mem[o_gpu][static_cast<std::size_t>(o_slot * n + i)];
      is_all = is_all && got == all;
      is_own = is_own && got == own;
    }
    return {is_all, is_own};
  }
};

std::unique_ptr<ReductionRun> run_reduction(std::uint64_t rng_seed, const std::shared_ptr<rt::FaultSchedule> &faults,
                                            bool verify, int max_attempts = 0, bool one_process = false) {
  auto run = std::make_unique<ReductionRun>();
  std::mt19937_64 rng(rng_seed);
  Group &grp = run->grp;
  rt::EngineOptions o = random_options(rng);
  o.num_layers = 1;
  o.verify = verify;
  o.faults = faults;
  if (max_attempts > 0) o.max_attempts = max_attempts;
  grp.proc_of_gpu = random_partition(rng, o.topology, grp.num_procs);
  if (one_process) // every reduction a local copy
    std::fill(grp.proc_of_gpu.begin(), grp.proc_of_gpu.end(), 0), grp.num_procs = 1;
  grp.build(rng, o);
  run->where = grp.random_resident(rng, 0);
  run->owner.assign(static_cast<std::size_t>(grp.num_experts), 0);
  for (int e = 0; e < grp.num_experts; ++e) {
    run->owner[e] = -1;
    for (int g = 0; g < grp.topo.num_gpus() && run->owner[e] < 0; ++g)
      if (run->where.holds(g, e)) run->owner[e] = g;
    if (run->owner[e] < 0) run->owner[e] = 0;
  }
  run->n = grp.grad_bytes / 4;
  std::uniform_real_distribution<float> val(-4.f, 4.f);
  for (int g = 0; g < grp.topo.num_gpus(); ++g)
    for (float &x : grp.grad_mem[g])
      x = val(rng);
  run->before = grp.grad_mem;
  run->status.resize(static_cast<std::size_t>(grp.num_procs));
  run->tel.resize(static_cast<std::size_t>(grp.num_procs));
  std::vector<std::thread> procs;
  for (int q = 0; q < grp.num_procs; ++q)
    procs.emplace_back([&run = *run, q] {
      rt::ReduceBatch b;
      b.owner_gpu = run.owner;
      b.timeout = 5s;
      rt::Ticket t;
      run.status[q] = run.grp.engines[q]->submit_reduce(b, t);
      if (run.status[q].ok()) run.status[q] = t.wait_for(8s), run.tel[q] = t.telemetry();
    });
  for (auto &t : procs)
    t.join();
  return run;
}

// FaultSchedule::spare_reductions: a schedule that fails and corrupts paired transfers and copies leaves the
// reductions alone, so every one adds the exact replica gradients (nothing verifies them here); the same
// schedule without it makes some reductions fail or add corrupt bytes (the check can fail).
TEST_CASE("multi-process replica gradients under a schedule that spares reductions: exact sums every time") {
  int bad_unspared = 0;
  for (std::uint64_t seed = 1; seed <= 24 * static_cast<std::uint64_t>(foremoe_test::seed_multiplier()); ++seed) {
    for (const bool spare : {true, false}) {
      auto f = std::make_shared<rt::FaultSchedule>();
      f->fail_probability = 0.3;
      f->corrupt_probability = 0.5;
      f->seed = seed;
      f->spare_reductions = spare;
      const auto run = run_reduction(seed * 7 + 3, f, false);
      bool bad = false;
      for (const rt::Status &st : run->status) {
        if (spare) CHECK_MESSAGE(st.ok(), "seed ", seed, ": ", st.to_string());
        bad = bad || !st.ok();
      }
      for (int e = 0; e < run->grp.num_experts; ++e) {
        const bool exact = run->outcome(e).first;
        if (spare) CHECK_MESSAGE(exact, "seed ", seed, " expert ", e);
        bad = bad || !exact;
      }
      if (!spare && bad) ++bad_unspared;
    }
  }
  MESSAGE(bad_unspared, " seeds went wrong without spare_reductions");
  CHECK(bad_unspared > 0);
}

// Verified reductions (`EngineOptions::verify`) under a schedule that fails and corrupts them too (no
// spare_reductions): each replica gradient's checksum travels with it (or, local, is taken at its source) and is
// checked on the owner before anything is added, local copies that do not verify are copied again, so every expert's
// owner ends with the exact sum or, all or nothing, its own gradient untouched, and then its process's batch failed.
// Without verify the same schedules add corrupt bytes for some seeds (the check can fail). Each seed runs on a random
// split into processes and on one process (every copy local, so that the local retries are exercised).
TEST_CASE("multi-process replica gradients verified under faults: the exact sum or the owner's own, never corrupt") {
  int corrupt_unverified = 0, failed_verified = 0, retried_verified = 0;
  for (std::uint64_t seed = 1; seed <= 24 * static_cast<std::uint64_t>(foremoe_test::seed_multiplier()); ++seed) {
    for (const auto &[verify, one_process] :
         {std::pair{true, false}, std::pair{false, false}, std::pair{true, true}, std::pair{false, true}}) {
      auto f = std::make_shared<rt::FaultSchedule>();
      f->fail_probability = 0.2;
      f->corrupt_probability = 0.5;
      f->seed = seed;
      const auto run = run_reduction(seed * 13 + 1, f, verify, 3, one_process);
      for (const auto &ts : run->tel)
        for (const rt::MoveTelemetry &m : ts) // a local copy that verified after one that did not
          if (verify && m.verified && m.verify_failures > 0) ++retried_verified;
      for (int e = 0; e < run->grp.num_experts; ++e) {
        const auto [is_all, is_own] = run->outcome(e);
        if (!verify) {
          corrupt_unverified += !is_all && !is_own;
          continue;
        }
        CHECK_MESSAGE((is_all || is_own), "seed ", seed, " expert ", e, ": the owner's gradient is neither the sum ",
                      "nor its own");
        if (!is_all) { // nothing added: the owner's process must not report success
          ++failed_verified;
          const int proc = run->grp.proc_of_gpu[run->owner[e]];
          CHECK_MESSAGE(!run->status[static_cast<std::size_t>(proc)].ok(), "seed ", seed, " expert ", e,
                        ": not added, yet its owner's batch succeeded");
        }
      }
    }
  }
  MESSAGE(corrupt_unverified, " experts got corrupt sums without verify; verified: ", failed_verified,
          " left at the owner's own, ", retried_verified, " local copies verified after a retry");
  CHECK(corrupt_unverified > 0);
  CHECK(failed_verified > 0);
  CHECK(retried_verified > 0);
}

// FaultSchedule::spare_reductions: reductions do not advance the serial that fault decisions hash, so moves after a
// reduction meet the faults they meet on an engine that runs none (what foremoe.torch relies on to keep a seeded
// schedule's decisions when its reductions share the moves' engine). Without it they differ for some seeds. `gated`:
// the reduction waits for a gradient gate that never opens and ends timed out before its paired transfers were
// posted; the engine then still posts them (on scratch memory), and they are spared too.
TEST_CASE("multi-process: under spare_reductions a reduction between move batches leaves the moves' faults alone") {
  int differ_unspared = 0;
  for (std::uint64_t seed = 1; seed <= 30 * static_cast<std::uint64_t>(foremoe_test::seed_multiplier()); ++seed) {
    for (const auto &mode : {std::pair{true, false}, std::pair{false, false}, std::pair{true, true}}) {
      const bool spare = mode.first, gated = mode.second; // plain locals: the lambda below captures them
      // Two runs of the same batches (same seed everywhere), one with a reduction between the halves.
      std::vector<std::vector<rt::Status>> st[2];
      std::vector<std::int32_t> valid[2];
      for (int with_reduce = 0; with_reduce < 2; ++with_reduce) {
        std::mt19937_64 rng(seed * 11 + 5);
        Group grp;
        rt::EngineOptions o = random_options(rng);
        grp.mirrors = false;
        o.planning.host_mirror = false;
        auto f = std::make_shared<rt::FaultSchedule>();
        f->fail_probability = 0.25;
        f->seed = seed;
        f->spare_reductions = spare;
        o.faults = f;
        grp.proc_of_gpu = random_partition(rng, o.topology, grp.num_procs);
        grp.build(rng, o);
        std::vector<LayerPlacement> target;
        auto batches = grp.random_batches(rng, target);
        const std::size_t half = batches.size() / 2;
        const std::vector<std::pair<int, std::vector<Move>>> first(batches.begin(), batches.begin() + half),
            second(batches.begin() + half, batches.end());
        st[with_reduce] = run_everywhere(grp, first, 10s);
        if (with_reduce == 1) {
          const LayerPlacement where = grp.engines[0]->resident(0); // planned placement (the same everywhere)
          std::vector<std::int32_t> owner(static_cast<std::size_t>(grp.num_experts), 0);
          for (int e = 0; e < grp.num_experts; ++e)
            for (int g = grp.topo.num_gpus() - 1; g >= 0; --g)
              if (where.holds(g, e)) owner[e] = g;
          std::vector<std::thread> procs;
          for (int q = 0; q < grp.num_procs; ++q)
            procs.emplace_back([&, q] {
              rt::ReduceBatch b;
              b.owner_gpu = owner;
              b.timeout = 5s;
              rt::HostEvent never;
              if (gated) {
                b.grads_ready.host = &never;
                b.timeout = 20ms;
              }
              rt::Ticket t;
              if (grp.engines[q]->submit_reduce(b, t).ok()) (void)t.wait_for(8s);
            });
          for (auto &t : procs)
            t.join();
        }
        const auto rest = run_everywhere(grp, second, 10s);
        for (int q = 0; q < grp.num_procs; ++q)
          st[with_reduce][q].insert(st[with_reduce][q].end(), rest[q].begin(), rest[q].end());
        for (int l = 0; l < grp.num_layers; ++l)
          for (int g = 0; g < grp.topo.num_gpus(); ++g)
            for (int s = 0; s < grp.topo.slots_per_gpu; ++s)
              valid[with_reduce].push_back(grp.engine_of(g).valid_expert(l, g, s));
      }
      bool same = valid[0] == valid[1] && st[0].size() == st[1].size();
      for (std::size_t q = 0; same && q < st[0].size(); ++q) {
        same = st[0][q].size() == st[1][q].size();
        for (std::size_t i = 0; same && i < st[0][q].size(); ++i)
          same = st[0][q][i].code() == st[1][q][i].code();
      }
      if (spare)
        CHECK_MESSAGE(same, "seed ", seed, gated ? " (timed-out reduction)" : "",
                      ": the moves after a reduction met other faults");
      else if (!same)
        ++differ_unspared;
    }
  }
  MESSAGE(differ_unspared, " seeds differed without spare_reductions");
  CHECK(differ_unspared > 0);
}

TEST_CASE("multi-process options and registration are checked") {
  rt::EngineOptions o;
  o.topology.num_nodes = 2;
  o.topology.gpus_per_node = 2;
  o.topology.slots_per_gpu = 2;
  o.num_experts = 4;
  o.tensors = {{0, 1024}};
  std::unique_ptr<rt::TransferEngine> e;
  o.peers.local_gpus = {0, 1};
  rt::Status st = rt::TransferEngine::create(o, e);
  CHECK(st.code() == rt::StatusCode::invalid_argument);
  CHECK(st.message().find("host_fabric") != std::string::npos);
  o.peers.host_fabric = std::make_shared<rt::HostFabric>();
  o.peers.local_gpus = {0, 4};
  st = rt::TransferEngine::create(o, e);
  CHECK(st.message().find("GPU 4") != std::string::npos);
  o.peers.local_gpus = {1, 1};
  st = rt::TransferEngine::create(o, e);
  CHECK(st.message().find("twice") != std::string::npos);
  o.peers.local_gpus = {0, 1};
  REQUIRE(rt::TransferEngine::create(o, e).ok());
  std::vector<std::byte> mem(4096);
  st = e->register_slots(0, 2, {mem.data(), 1024, 2, 1, 0});
  CHECK(st.code() == rt::StatusCode::invalid_argument);
  CHECK(st.message().find("another process") != std::string::npos);
  st = e->register_mirror(0, 1, {mem.data(), 1024, 4});
  CHECK(st.message().find("node 1") != std::string::npos);
  REQUIRE(e->register_slots(0, 0, {mem.data(), 1024, 2, 1, 0}).ok());
  // host_mirror is declared (the default) but node 0's mirror is not registered.
  std::vector<Move> moves{{1, host_mirror, 0, 1}};
  rt::MoveBatch b;
  b.moves = moves;
  rt::Ticket t;
  st = e->submit(b, t);
  CHECK(st.code() == rt::StatusCode::invalid_argument);
  CHECK(st.message().find("mirror") != std::string::npos);
}
