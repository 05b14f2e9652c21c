// The transfer engine on the host backend: the real state machine with host buffers standing for device memory,
// random plans under random fault schedules, gates and slot hazards, deadlines, abort, gradient reduction.

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <thread>

#include "expert_bytes.hpp"
#include "foremoe/runtime/grad_add.hpp"
#include "foremoe/runtime/testing.hpp"
#include "foremoe/runtime/transfer_engine.hpp"
#include "grad_ref.hpp"
#include "test_support.hpp"

using namespace foremoe;
namespace rt = foremoe::runtime;
using namespace std::chrono_literals;

namespace {

// A modelled EP group: host buffers for every GPU's slots (optionally double-buffered), a mirror per node, and
// the engine driving them.
struct Cluster {
  Topology topo;
  int num_layers = 2, num_experts = 0, num_buffers = 1;
  std::vector<rt::TensorSpan> tensors;
  std::int64_t slot_stride = 0, buffer_stride = 0;
  std::vector<std::vector<std::byte>> gpu_mem;    // [layer * gpus + gpu]
  std::vector<std::vector<std::byte>> mirror_mem; // [layer * nodes + node]
  std::unique_ptr<rt::TransferEngine> engine;

  std::byte *slot_ptr(int l, int g, int s, int b) {
    return gpu_mem[static_cast<std::size_t>(l) * topo.num_gpus() + g].data() + b * buffer_stride + s * slot_stride;
  }
  void fill(int l, int g, int s, int b, int e) { foremoe_test::fill_expert(slot_ptr(l, g, s, b), tensors, l, e); }
  bool holds_bytes(int l, int g, int s, int b, int e) {
    return foremoe_test::holds_expert(slot_ptr(l, g, s, b), tensors, l, e);
  }

  rt::Status build(std::mt19937_64 &rng, rt::EngineOptions opts, bool mirrors = true) {
    topo = opts.topology;
    num_layers = opts.num_layers;
    num_experts = opts.num_experts;
    // 1-3 tensors with gaps between them, like gate/up/down projections padded for alignment.
    const int n = std::uniform_int_distribution<int>(1, 3)(rng);
    std::int64_t off = std::uniform_int_distribution<int>(0, 64)(rng);
    for (int i = 0; i < n; ++i) {
      const std::int64_t bytes = std::uniform_int_distribution<std::int64_t>(1, 24 << 10)(rng);
      tensors.push_back({off, bytes});
      off += bytes + std::uniform_int_distribution<int>(0, 100)(rng);
    }
    slot_stride = off;
    buffer_stride = slot_stride * topo.slots_per_gpu;
    opts.tensors = tensors;
    if (rt::Status st = rt::TransferEngine::create(opts, engine); !st.ok()) return st;
    gpu_mem.assign(static_cast<std::size_t>(num_layers) * topo.num_gpus(),
                   std::vector<std::byte>(static_cast<std::size_t>(buffer_stride * num_buffers), std::byte{0xee}));
    mirror_mem.assign(static_cast<std::size_t>(num_layers) * topo.num_nodes,
                      std::vector<std::byte>(static_cast<std::size_t>(slot_stride * num_experts)));
    for (int l = 0; l < num_layers; ++l) {
      for (int g = 0; g < topo.num_gpus(); ++g) {
        rt::SlotRegion r{gpu_mem[static_cast<std::size_t>(l) * topo.num_gpus() + g].data(), slot_stride,
                         topo.slots_per_gpu, num_buffers, buffer_stride};
        if (rt::Status st = engine->register_slots(l, g, r); !st.ok()) return st;
      }
      for (int nd = 0; nd < topo.num_nodes && mirrors; ++nd) {
        auto &m = mirror_mem[static_cast<std::size_t>(l) * topo.num_nodes + nd];
        for (int e = 0; e < num_experts; ++e)
          foremoe_test::fill_expert(m.data() + e * slot_stride, tensors, l, e);
        if (rt::Status st = engine->register_mirror(l, nd, {m.data(), slot_stride, num_experts}); !st.ok()) return st;
      }
    }
    return rt::Status::success();
  }

  // A random valid placement written into the buffers and declared resident.
  void random_resident(std::mt19937_64 &rng, int l) {
    LayerPlacement p(topo.num_gpus(), topo.slots_per_gpu, num_experts);
    std::uniform_int_distribution<int> pick(0, num_experts - 1);
    for (int g = 0; g < topo.num_gpus(); ++g)
      for (int s = 0; s < topo.slots_per_gpu; ++s)
        if (const int e = pick(rng); !p.holds(g, e) && rng() % 5 != 0) {
          p.slot(g, s) = e;
          fill(l, g, s, 0, e);
        }
    REQUIRE(engine->set_resident(l, p).ok());
  }

  // Random moves onto the engine's resident placement of `l`.
  std::vector<Move> random_moves(std::mt19937_64 &rng, int l, double p_move) {
    LayerPlacement target = engine->resident(l);
    std::vector<Move> moves;
    std::uniform_int_distribution<int> pick(0, num_experts - 1);
    for (int g = 0; g < topo.num_gpus(); ++g)
      for (int s = 0; s < topo.slots_per_gpu; ++s)
        if (std::bernoulli_distribution(p_move)(rng)) {
          const int e = pick(rng);
          if (target.holds(g, e)) continue;
          target.slot(g, s) = e;
          moves.push_back({e, host_mirror, g, s});
        }
    return moves;
  }

  // Every slot the engine calls valid holds exactly its expert's bytes (in buffer `b`, or any buffer if b < 0).
  void check_valid_bytes(int l) {
    const LayerPlacement p = engine->resident(l);
    for (int g = 0; g < topo.num_gpus(); ++g)
      for (int s = 0; s < topo.slots_per_gpu; ++s)
        if (const int e = p.slot(g, s); e != empty_slot) {
          bool ok = false;
          for (int b = 0; b < num_buffers; ++b)
            ok = ok || holds_bytes(l, g, s, b, e);
          CHECK_MESSAGE(ok, "layer ", l, " GPU ", g, " slot ", s, " is valid for expert ", e, " with wrong bytes");
        }
  }
};

rt::EngineOptions random_options(std::mt19937_64 &rng) {
  rt::EngineOptions o;
  o.topology.num_nodes = std::uniform_int_distribution<int>(1, 2)(rng);
  o.topology.gpus_per_node = std::uniform_int_distribution<int>(1, 4)(rng);
  o.topology.slots_per_gpu = std::uniform_int_distribution<int>(1, 3)(rng);
  o.num_layers = 2;
  o.num_experts = std::uniform_int_distribution<int>(o.topology.slots_per_gpu,
                                                     o.topology.num_gpus() * o.topology.slots_per_gpu + 2)(rng);
  o.planning.align_bytes = 256;
  o.planning.max_chunk_bytes = std::int64_t{256} * std::uniform_int_distribution<int>(1, 40)(rng);
  o.max_attempts = std::uniform_int_distribution<int>(1, 4)(rng);
  o.host_threads_per_path = std::uniform_int_distribution<int>(1, 3)(rng);
  return o;
}

} // namespace

TEST_CASE("random plans under random faults: valid slots always hold exact bytes, failures are reported") {
  const int runs = 120 * foremoe_test::seed_multiplier();
  int done = 0, failed = 0, moves_total = 0, moves_ok = 0, retried = 0;
  for (int run = 0; run < runs; ++run) {
    std::mt19937_64 rng(1000 + run);
    rt::EngineOptions o = random_options(rng);
    auto faults = std::make_shared<rt::FaultSchedule>();
    faults->seed = rng();
    faults->fail_probability = std::uniform_real_distribution<double>(0, 0.4)(rng);
    faults->delay_probability = std::uniform_real_distribution<double>(0, 0.3)(rng);
    faults->delay_us = std::uniform_int_distribution<int>(0, 300)(rng);
    o.verify = rng() % 2 == 0;
    // Truncated copies report success: only verification can catch them, so only then are they injected.
    faults->corrupt_probability = o.verify ? std::uniform_real_distribution<double>(0, 0.3)(rng) : 0.0;
    if (rng() % 8 == 0) faults->fail_path[rng() % 2] = true; // one path down entirely
    o.faults = faults;
    Cluster c;
    c.num_buffers = rng() % 3 == 0 ? 2 : 1;
    REQUIRE(c.build(rng, o).ok());
    for (int l = 0; l < c.num_layers; ++l)
      c.random_resident(rng, l);
    for (int batch = 0; batch < 3; ++batch) {
      const int l = batch % c.num_layers;
      const auto moves = c.random_moves(rng, l, 0.5);
      rt::MoveBatch mb;
      mb.layer = l;
      mb.moves = moves;
      mb.dst_buffer = c.num_buffers == 2 ? static_cast<int>(rng() % 2) : 0;
      mb.timeout = 20s;
      rt::Ticket t;
      const rt::Status st = c.engine->submit(mb, t);
      REQUIRE_MESSAGE(st.ok(), st.to_string());
      const rt::Status end = t.wait_for(30s);
      REQUIRE(end.code() != rt::StatusCode::timed_out);
      const auto tel = t.telemetry();
      REQUIRE(tel.size() == moves.size());
      const LayerPlacement after = c.engine->resident(l);
      for (std::size_t i = 0; i < moves.size(); ++i) {
        const Move &m = moves[i];
        ++moves_total;
        retried += tel[i].attempts > tel[i].num_chunks;
        if (tel[i].ok) {
          ++moves_ok;
          CHECK(after.slot(m.dst_gpu, m.dst_slot) == m.expert);
          CHECK(c.holds_bytes(l, m.dst_gpu, m.dst_slot, mb.dst_buffer, m.expert));
          CHECK(tel[i].num_bytes == c.engine->last_plan(l).expert_bytes);
          if (o.verify) CHECK(tel[i].verified);
        } else {
          CHECK(after.slot(m.dst_gpu, m.dst_slot) != m.expert);
        }
      }
      const bool all_ok = std::all_of(tel.begin(), tel.end(), [](const auto &x) { return x.ok; });
      CHECK(end.ok() == all_ok);
      CHECK((t.state() == rt::TicketState::done) == all_ok);
      if (!all_ok) CHECK(end.code() == rt::StatusCode::device_error);
      (all_ok ? done : failed) += 1;
      c.check_valid_bytes(l);
    }
  }
  MESSAGE(runs, " runs: ", done, " batches done, ", failed, " failed; ", moves_ok, " of ", moves_total,
          " moves landed, ", retried, " needed a retry");
  CHECK(done > 0);
  CHECK(failed > 0);
  CHECK(retried > 0);
}

TEST_CASE("without faults every move lands, also split across both paths") {
  std::mt19937_64 rng(5);
  for (int run = 0; run < 30; ++run) {
    rt::EngineOptions o = random_options(rng);
    o.verify = true;
    Cluster c;
    REQUIRE(c.build(rng, o).ok());
    c.random_resident(rng, 0);
    const auto moves = c.random_moves(rng, 0, 0.6);
    rt::MoveBatch mb;
    mb.moves = moves;
    rt::Ticket t;
    REQUIRE(c.engine->submit(mb, t).ok());
    const rt::Status st = t.wait_for(20s);
    REQUIRE_MESSAGE(st.ok(), st.to_string());
    for (const Move &m : moves) {
      CHECK(c.engine->valid_expert(0, m.dst_gpu, m.dst_slot) == m.expert);
      CHECK(c.holds_bytes(0, m.dst_gpu, m.dst_slot, 0, m.expert));
    }
    c.check_valid_bytes(0);
    CHECK(c.engine->last_plan(0).moves.size() == moves.size());
    // A move carries the expert's tensors, packed: the plan's size is their sum, not the slot stride.
    std::int64_t expert_bytes = 0;
    for (const rt::TensorSpan &ts : c.tensors)
      expert_bytes += ts.num_bytes;
    CHECK(c.engine->last_plan(0).expert_bytes == expert_bytes);
  }
}

namespace {
// A small fixed cluster: 1 node x 2 GPUs x 2 slots, 4 experts; GPU 0 holds 0 and 1, GPU 1 holds 2 and 3.
Cluster small_cluster(rt::EngineOptions o = {}) {
  std::mt19937_64 rng(1);
  o.topology = {1, 2, 2};
  o.num_layers = 1;
  o.num_experts = 4;
  Cluster c;
  REQUIRE(c.build(rng, o).ok());
  LayerPlacement p(2, 2, 4);
  for (int g = 0; g < 2; ++g)
    for (int s = 0; s < 2; ++s) {
      p.slot(g, s) = g * 2 + s;
      c.fill(0, g, s, 0, g * 2 + s);
    }
  REQUIRE(c.engine->set_resident(0, p).ok());
  return c;
}
} // namespace

TEST_CASE("gates: nothing is written before slots are free, and deadlines fire") {
  Cluster c = small_cluster();
  const std::vector<Move> moves{{0, 0, 1, 1}}; // expert 0 replaces expert 3 on GPU 1
  rt::HostEvent free_ev;
  rt::MoveBatch mb;
  mb.moves = moves;
  mb.slots_free.host = &free_ev;
  rt::Ticket t;
  REQUIRE(c.engine->submit(mb, t).ok());
  std::this_thread::sleep_for(20ms);
  CHECK(t.poll().code() == rt::StatusCode::in_progress);
  CHECK(c.holds_bytes(0, 1, 1, 0, 3)); // the slot's last reader still sees expert 3
  CHECK(c.engine->valid_expert(0, 1, 1) == 3);
  CHECK(t.wait_for(5ms).code() == rt::StatusCode::timed_out); // a wait deadline leaves the batch running
  free_ev.set();
  REQUIRE(t.wait_for(10s).ok());
  CHECK(c.holds_bytes(0, 1, 1, 0, 0));
  CHECK(c.engine->valid_expert(0, 1, 1) == 0);

  // A gate that never opens: the batch's own deadline ends it, and the slot keeps its old valid copy.
  rt::HostEvent never;
  mb.moves = std::vector<Move>{{1, 0, 1, 0}};
  const std::vector<Move> m2{{1, 0, 1, 0}};
  mb.moves = m2;
  mb.slots_free.host = &never;
  mb.timeout = 30ms;
  rt::Ticket t2;
  REQUIRE(c.engine->submit(mb, t2).ok());
  const rt::Status st = t2.wait_for(10s);
  CHECK(st.code() == rt::StatusCode::timed_out);
  CHECK(t2.state() == rt::TicketState::timed_out);
  CHECK(c.engine->valid_expert(0, 1, 0) == 2);
  CHECK(c.holds_bytes(0, 1, 0, 0, 2));
}

TEST_CASE("a batch keeps its host events: the caller may drop one after submit") {
  Cluster c = small_cluster();
  const std::vector<Move> moves{{0, 0, 1, 1}};
  rt::Ticket t;
  {
    auto ev = std::make_unique<rt::HostEvent>(); // never set, gone before the engine looks at it
    rt::MoveBatch mb;
    mb.moves = moves;
    mb.slots_free.host = ev.get();
    mb.timeout = 50ms;
    REQUIRE(c.engine->submit(mb, t).ok());
  }
  CHECK(t.wait_for(10s).code() == rt::StatusCode::timed_out);
  CHECK(t.state() == rt::TicketState::timed_out);
  CHECK(c.engine->valid_expert(0, 1, 1) == 3);
  CHECK(c.holds_bytes(0, 1, 1, 0, 3));
}

TEST_CASE("a later batch on the same slot waits for the earlier one") {
  Cluster c = small_cluster();
  rt::HostEvent open;
  const std::vector<Move> first{{0, 0, 1, 1}}, second{{1, 0, 1, 1}};
  rt::MoveBatch a;
  a.moves = first;
  a.sources_ready.host = &open;
  rt::MoveBatch b;
  b.moves = second;
  rt::Ticket ta, tb;
  REQUIRE(c.engine->submit(a, ta).ok());
  REQUIRE(c.engine->submit(b, tb).ok());
  std::this_thread::sleep_for(20ms);
  CHECK(tb.poll().code() == rt::StatusCode::in_progress);
  open.set();
  REQUIRE(ta.wait_for(10s).ok());
  REQUIRE(tb.wait_for(10s).ok());
  CHECK(c.engine->valid_expert(0, 1, 1) == 1);
  CHECK(c.holds_bytes(0, 1, 1, 0, 1));
}

TEST_CASE("abort ends a batch, unfinished slots are not valid") {
  rt::EngineOptions o;
  auto f = std::make_shared<rt::FaultSchedule>();
  f->delay_probability = 1.0;
  f->delay_us = 2'000'000;
  o.faults = f;
  Cluster c = small_cluster(o);
  const std::vector<Move> moves{{0, 0, 1, 1}};
  rt::MoveBatch mb;
  mb.moves = moves;
  rt::Ticket t;
  REQUIRE(c.engine->submit(mb, t).ok());
  std::this_thread::sleep_for(10ms);
  t.abort();
  const rt::Status st = t.wait_for(1s);
  CHECK(st.code() == rt::StatusCode::aborted);
  CHECK(t.state() == rt::TicketState::aborted);
  CHECK(c.engine->valid_expert(0, 1, 1) == empty_slot);
  CHECK(t.enqueue_wait(nullptr).code() == rt::StatusCode::unavailable);
}

TEST_CASE("double-buffered slots keep the old copy valid until the new one lands") {
  std::mt19937_64 rng(2);
  rt::EngineOptions o;
  o.topology = {1, 2, 1};
  o.num_layers = 1;
  o.num_experts = 2;
  o.faults = std::make_shared<rt::FaultSchedule>(rt::FaultSchedule{0, 0, 0, 0, {true, true, true}, 1});
  Cluster c;
  c.num_buffers = 2;
  REQUIRE(c.build(rng, o).ok());
  LayerPlacement p(2, 1, 2);
  p.slot(0, 0) = 0;
  p.slot(1, 0) = 1;
  c.fill(0, 0, 0, 0, 0);
  c.fill(0, 1, 0, 0, 1);
  REQUIRE(c.engine->set_resident(0, p).ok());
  const std::vector<Move> moves{{0, 0, 1, 0}};
  rt::MoveBatch mb;
  mb.moves = moves;
  mb.dst_buffer = 1;
  rt::Ticket t;
  REQUIRE(c.engine->submit(mb, t).ok());
  CHECK(t.wait_for(10s).code() == rt::StatusCode::device_error); // every path fails
  CHECK(c.engine->valid_expert(0, 1, 0) == 1);                   // the old copy in buffer 0 stays valid
  CHECK(c.holds_bytes(0, 1, 0, 0, 1));
}

TEST_CASE("replica gradients reduce into owners, in a fixed order, all or nothing per expert") {
  for (const double fail : {0.0, 0.5}) {
    std::mt19937_64 rng(9);
    rt::EngineOptions o;
    o.topology = {2, 2, 3};
    o.num_layers = 1;
    o.num_experts = 8;
    auto f = std::make_shared<rt::FaultSchedule>();
    f->fail_probability = fail;
    f->seed = 4;
    o.faults = f;
    o.max_attempts = 1;
    Cluster c;
    REQUIRE(c.build(rng, o).ok());
    // Owners: expert e on GPU e / 2 slot e % 2; replicas in slot 2.
    LayerPlacement p(4, 3, 8);
    std::vector<std::int32_t> owner(8);
    for (int e = 0; e < 8; ++e) {
      owner[e] = e / 2;
      p.slot(e / 2, e % 2) = e;
    }
    p.slot(0, 2) = 7; // replica of 7 (owner GPU 3, other node)
    p.slot(1, 2) = 0; // replica of 0 (owner GPU 0, same node)
    p.slot(2, 2) = 0; // another replica of 0, other node
    p.slot(3, 2) = 5;
    REQUIRE(c.engine->set_resident(0, p).ok());
    const int n = 1000;
    std::vector<std::vector<float>> grads(4, std::vector<float>(3 * n));
    std::normal_distribution<float> nd;
    for (auto &g : grads)
      for (auto &x : g)
        x = nd(rng);
    for (int g = 0; g < 4; ++g)
      REQUIRE(c.engine->register_grads(0, g, {grads[g].data(), n * 4, 3, 1, 0}, n * 4).ok());
    const auto before = grads;
    rt::ReduceBatch rb;
    rb.owner_gpu = owner;
    rt::Ticket t;
    REQUIRE(c.engine->submit_reduce(rb, t).ok());
    const rt::Status st = t.wait_for(10s);
    const auto tel = t.telemetry();
    REQUIRE(tel.size() == 4);
    auto expect = [&](int e, const std::vector<std::pair<int, int>> &reps, bool applied) {
      const int o_gpu = owner[e], o_slot = e % 2;
      for (int i = 0; i < n; ++i) {
        float want = before[o_gpu][o_slot * n + i];
        if (applied)
          for (auto [g, s] : reps)
            want += before[g][s * n + i];
        REQUIRE(grads[o_gpu][o_slot * n + i] == want);
      }
    };
    // Telemetry order: experts ascending, replicas by GPU: 0@1, 0@2, 5@3, 7@0.
    const bool ok0 = tel[0].ok && tel[1].ok, ok5 = tel[2].ok, ok7 = tel[3].ok;
    expect(0, {{1, 2}, {2, 2}}, ok0);
    expect(5, {{3, 2}}, ok5);
    expect(7, {{0, 2}}, ok7);
    CHECK(tel[1].path == transfer::Path::network);
    CHECK(tel[0].path == transfer::Path::nvlink);
    if (fail == 0.0) {
      CHECK(st.ok());
      CHECK(ok0);
    } else {
      CHECK(st.ok() == (ok0 && ok5 && ok7));
    }
  }
}

TEST_CASE("16-bit conversions round to nearest even like an independent table of every value") {
  std::mt19937_64 rng(17);
  const auto &f16 = foremoe_test::f16_ref();
  const auto &bf16 = foremoe_test::bf16_ref();
  for (std::uint32_t h = 0; h < 0x10000; ++h) { // every pattern decodes exactly (NaNs aside)
    const auto x = static_cast<std::uint16_t>(h);
    if ((x & 0x7fffu) <= 0x7c00u) REQUIRE(rt::f16_to_float(x) == f16.decode(x));
    if ((x & 0x7fffu) <= 0x7f80u) REQUIRE(rt::bf16_to_float(x) == bf16.decode(x));
  }
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 400000; ++i) {
    // Random floats over every exponent, and exact midpoints between neighbouring 16-bit values.
    std::uint32_t u = bits(rng);
    if (i % 4 == 1)
      u = (u & 0x80000000u) | (std::uniform_int_distribution<std::uint32_t>(90, 145)(rng) << 23) |
          (u & 0x7fffffu);                           // f16's range and beyond
    if (i % 4 == 2) u = (u & 0xffff8000u) | 0x8000u; // a bf16 tie (the dropped half is exactly 0x8000)
    if (i % 4 == 3) u = (u & 0xffffe000u) | 0x1000u; // an f16 tie among normals
    const float f = std::bit_cast<float>(u);
    if (std::isnan(f)) continue;
    REQUIRE_MESSAGE(rt::float_to_f16(f) == f16.encode(f), "float bits ", u);
    REQUIRE_MESSAGE(rt::float_to_bf16(f) == bf16.encode(f), "float bits ", u);
  }
  CHECK(rt::float_to_f16(65520.f) == 0x7c00);         // the tie above 65504 goes to the even pattern: infinity
  CHECK(rt::float_to_f16(std::ldexp(1.f, -25)) == 0); // the tie below the least subnormal: zero
  CHECK(rt::float_to_f16(std::ldexp(1.5f, -25)) == 1);
  CHECK(std::isnan(rt::f16_to_float(rt::float_to_f16(std::nanf("")))));
  CHECK(std::isnan(rt::bf16_to_float(rt::float_to_bf16(std::nanf("")))));
}

TEST_CASE("replica gradients of every dtype, packed or split, add bitwise in the fixed order, all or nothing") {
  const rt::GradType types[] = {rt::GradType::f32, rt::GradType::f64, rt::GradType::bf16, rt::GradType::f16};
  int applied_with_faults = 0, failed_replicas = 0;
  for (std::uint64_t seed = 1; seed <= 48 * static_cast<std::uint64_t>(foremoe_test::seed_multiplier()); ++seed) {
    std::mt19937_64 rng(seed * 7 + 3);
    const rt::GradType type = types[seed % 4];
    const bool split = (seed / 4) % 2 == 1, faults = (seed / 8) % 2 == 1, select = (seed / 16) % 2 == 1;
    rt::EngineOptions o;
    o.topology = {std::uniform_int_distribution<int>(1, 2)(rng), std::uniform_int_distribution<int>(1, 3)(rng),
                  std::uniform_int_distribution<int>(2, 4)(rng)};
    const int gpus = o.topology.num_gpus(), slots = o.topology.slots_per_gpu;
    o.num_experts = std::uniform_int_distribution<int>(1, gpus * slots)(rng);
    const int num_tensors = std::uniform_int_distribution<int>(1, 3)(rng);
    for (int i = 0; i < num_tensors; ++i)
      o.tensors.push_back({64 * i, 64}); // weights are not moved here; the gradients have their own sizes
    if (!split) o.tensors = {{0, 64}};
    if (faults) {
      auto f = std::make_shared<rt::FaultSchedule>();
      f->fail_probability = 0.25;
      f->seed = seed;
      o.faults = f;
      o.max_attempts = 1;
    }
    std::unique_ptr<rt::TransferEngine> engine;
    REQUIRE(rt::TransferEngine::create(o, engine).ok());
    foremoe_test::GradWorld w;
    w.build(rng, type, split, gpus, slots, num_tensors);
    std::vector<std::int32_t> owner;
    const LayerPlacement p = foremoe_test::random_owned(rng, gpus, slots, o.num_experts, owner);
    REQUIRE(engine->set_resident(0, p).ok());
    for (int g = 0; g < gpus; ++g) {
      const rt::Status st = engine->register_grads(0, g, w.region(g), w.layout);
      REQUIRE_MESSAGE(st.ok(), st.to_string());
    }
    std::vector<rt::ReplicaRef> returns;
    std::vector<std::int32_t> held(static_cast<std::size_t>(gpus) * o.num_experts, -1);
    for (int g = 0; g < gpus && select; ++g)
      for (int e = 0; e < o.num_experts; ++e)
        if (g != owner[e] && p.holds(g, e)) {
          if (rng() % 3 != 0)
            returns.push_back({g, e});
          else
            held[static_cast<std::size_t>(g) * o.num_experts + e] = owner[e];
        }
    std::shuffle(returns.begin(), returns.end(), rng); // the order of `returns` does not matter
    const foremoe_test::GradWorld before = w;
    rt::ReduceBatch rb;
    rb.owner_gpu = owner;
    rb.select = select;
    rb.returns = returns;
    rb.held = held;
    rt::Ticket t;
    REQUIRE(engine->submit_reduce(rb, t).ok());
    const rt::Status st = t.wait_for(10s);
    const std::string what =
        foremoe::detail::concat("seed ", seed, " ", rt::to_string(type), split ? " split" : " packed",
                                faults ? " faults" : "", select ? " select" : "");
    CHECK_MESSAGE((st.ok() || faults), what, ": ", st.to_string());
    const int applied = foremoe_test::check_reduced(w, before, p, owner, faults, select, returns, what);
    if (faults) {
      applied_with_faults += applied;
      for (const rt::MoveTelemetry &m : t.telemetry())
        failed_replicas += m.ok ? 0 : 1;
    }
  }
  // The fault schedule did fail some replicas, and some experts were still applied (the test can tell them apart).
  CHECK(applied_with_faults > 0);
  CHECK(failed_replicas > 0);
}

TEST_CASE("gradient registration: dtype and layout checked, every GPU the same") {
  rt::EngineOptions o;
  o.tensors = {{0, 100}, {100, 40}};
  o.topology = {1, 2, 2};
  o.num_experts = 4;
  std::unique_ptr<rt::TransferEngine> e;
  REQUIRE(rt::TransferEngine::create(o, e).ok());
  std::vector<std::byte> a(1000), b(1000), c(1000);
  auto has = [](const rt::Status &st, const std::string &s) {
    INFO(st.to_string());
    return st.message().find(s) != std::string::npos;
  };
  auto split = [&](std::byte *x, std::int64_t sx, std::byte *y, std::int64_t sy) {
    rt::SlotRegion r{nullptr, 0, 2, 1, 0};
    r.tensors = {{x, sx, 0}, {y, sy, 0}};
    return r;
  };
  using GT = rt::GradType;
  CHECK(has(e->register_grads(0, 0, split(a.data(), 64, b.data(), 16), rt::GradLayout{GT::f64, {64}}),
            "1 gradient tensor sizes for a split region (2 expected"));
  CHECK(has(e->register_grads(0, 0, {a.data(), 64, 2, 1, 0}, rt::GradLayout{GT::f64, {32, 32}}),
            "2 gradient tensor sizes for a packed region"));
  CHECK(has(e->register_grads(0, 0, split(a.data(), 64, b.data(), 16), rt::GradLayout{GT::f64, {64, 12}}),
            "tensor 1: gradient bytes must be a positive multiple of 8 (float64), got 12"));
  CHECK(has(e->register_grads(0, 0, {a.data(), 64, 2, 1, 0}, rt::GradLayout{GT::bf16, {0}}),
            "positive multiple of 2 (bfloat16), got 0"));
  CHECK(has(e->register_grads(0, 0, split(a.data(), 64, b.data(), 14), rt::GradLayout{GT::f16, {64, 16}}),
            "tensor 1: slot stride 14 is smaller than its 16 bytes"));
  CHECK(has(e->register_grads(0, 0, split(a.data(), 64, a.data() + 64, 16), rt::GradLayout{GT::f16, {64, 16}}),
            "overlaps tensor"));
  CHECK(has(e->register_grads(0, 0, {a.data(), 62, 2, 1, 0}, rt::GradLayout{GT::f16, {64}}),
            "slot stride 62 is smaller than the 64 bytes"));
  CHECK(has(e->register_grads(0, 0, split(nullptr, 64, b.data(), 16), rt::GradLayout{GT::f16, {64, 16}}),
            "tensor 0: null base"));
  CHECK(has(e->register_grads(0, 0, {a.data(), 64, 2, 1, 0}, rt::GradLayout{static_cast<GT>(9), {64}}),
            "unknown gradient type 9"));
  CHECK(has(e->register_grads(0, 0, {a.data(), 68, 2, 1, 0}, rt::GradLayout{GT::f64, {64}}),
            "slot stride 68) are not aligned to the 8-byte float64 elements"));
  CHECK(has(e->register_grads(0, 0, split(a.data(), 64, b.data() + 2, 16), rt::GradLayout{GT::f32, {64, 16}}),
            "GPU 0 tensor 1: rows (base"));
  rt::SlotRegion two = split(a.data(), 64, b.data(), 16);
  two.num_buffers = 2;
  CHECK(has(e->register_grads(0, 0, two, rt::GradLayout{GT::f32, {64, 16}}), "one buffer, got num_buffers 2"));
  // GPU 0 registers split bf16; GPU 1 must match dtype, sizes and layout.
  REQUIRE(e->register_grads(0, 0, split(a.data(), 64, b.data(), 16), rt::GradLayout{GT::bf16, {64, 16}}).ok());
  CHECK(has(e->register_grads(0, 1, split(c.data(), 64, c.data() + 200, 16), rt::GradLayout{GT::f16, {64, 16}}),
            "gradient type float16 differs from bfloat16 registered before"));
  CHECK(has(e->register_grads(0, 1, split(c.data(), 64, c.data() + 200, 16), rt::GradLayout{GT::bf16, {64, 14}}),
            "gradient tensor sizes (78 bytes in 2 tensors) differ from those registered before (80 bytes"));
  CHECK(has(e->register_grads(0, 1, {c.data(), 80, 2, 1, 0}, 80), "gradient type float32 differs from bfloat16"));
  CHECK(e->register_grads(0, 1, split(c.data(), 64, c.data() + 200, 16), rt::GradLayout{GT::bf16, {64, 16}}).ok());
  // A packed region of the same total is another layout: refused (one tensor, so sizes alone do not tell).
  rt::EngineOptions o1 = o;
  o1.tensors = {{0, 100}};
  REQUIRE(rt::TransferEngine::create(o1, e).ok());
  rt::SlotRegion one{nullptr, 0, 2, 1, 0};
  one.tensors = {{a.data(), 64, 0}};
  REQUIRE(e->register_grads(0, 0, one, rt::GradLayout{GT::f64, {64}}).ok());
  CHECK(has(e->register_grads(0, 1, {c.data(), 64, 2, 1, 0}, rt::GradLayout{GT::f64, {64}}),
            "a packed gradient region, GPU 0 registered a split one"));
}

TEST_CASE("engine bad input: clear statuses, no crash") {
  rt::EngineOptions o;
  std::unique_ptr<rt::TransferEngine> e;
  CHECK(rt::TransferEngine::create(o, e).code() == rt::StatusCode::invalid_argument); // no tensors
  o.tensors = {{0, 100}, {50, 100}};
  const rt::Status overlap = rt::TransferEngine::create(o, e);
  CHECK(overlap.message().find("overlap") != std::string::npos);
  o.tensors = {{0, 100}};
  o.topology = {1, 2, 2};
  o.num_experts = 4;
  REQUIRE(rt::TransferEngine::create(o, e).ok());
  std::vector<std::byte> mem(1000);
  CHECK(e->register_slots(3, 0, {mem.data(), 100, 2, 1, 0}).message().find("layer 3") != std::string::npos);
  CHECK(e->register_slots(0, 5, {mem.data(), 100, 2, 1, 0}).message().find("GPU 5") != std::string::npos);
  CHECK(e->register_slots(0, 0, {mem.data(), 50, 2, 1, 0}).message().find("slot stride 50") != std::string::npos);
  CHECK(e->register_slots(0, 0, {mem.data(), 100, 3, 1, 0}).code() == rt::StatusCode::invalid_argument);
  CHECK(e->register_mirror(0, 0, {mem.data(), 100, 3}).message().find("3 experts") != std::string::npos);
  LayerPlacement dup(2, 2, 4);
  dup.slot(0, 0) = dup.slot(0, 1) = 1;
  CHECK(e->set_resident(0, dup).message().find("twice") != std::string::npos);
  // No registered slots, no mirror, no source.
  const std::vector<Move> m{{1, host_mirror, 0, 0}};
  rt::MoveBatch mb;
  mb.moves = m;
  rt::Ticket t;
  CHECK(e->submit(mb, t).message().find("no registered slots") != std::string::npos);
  REQUIRE(e->register_slots(0, 0, {mem.data(), 100, 2, 1, 0}).ok());
  REQUIRE(e->register_slots(0, 1, {mem.data() + 200, 100, 2, 1, 0}).ok());
  CHECK(e->submit(mb, t).message().find("has no source") != std::string::npos);
  CHECK(!t.valid());
  CHECK(t.poll().code() == rt::StatusCode::invalid_argument);
  mb.timeout = 0ms;
  CHECK(e->submit(mb, t).code() == rt::StatusCode::invalid_argument);
  rt::ReduceBatch rb;
  CHECK(e->submit_reduce(rb, t).message().find("owner_gpu has 0 entries") != std::string::npos);

  o.backend = rt::Backend::cuda;
  const rt::Status cuda = rt::TransferEngine::create(o, e);
  if (rt::build_info().num_devices == 0) CHECK(cuda.code() == rt::StatusCode::unavailable);
}

TEST_CASE("destroying the engine with a batch in flight neither hangs nor leaks a thread") {
  for (int i = 0; i < 5; ++i) {
    rt::HostEvent never;
    Cluster c = small_cluster();
    const std::vector<Move> moves{{0, 0, 1, 1}};
    rt::MoveBatch mb;
    mb.moves = moves;
    mb.slots_free.host = &never;
    mb.timeout = 50ms;
    rt::Ticket t;
    REQUIRE(c.engine->submit(mb, t).ok());
    c.engine.reset(); // aborts the batch
    CHECK(t.state() == rt::TicketState::aborted);
    CHECK(t.poll().code() == rt::StatusCode::aborted);
  }
}

TEST_CASE("several threads submit at once: batches on shared slots serialise, every landed copy is exact") {
  std::mt19937_64 rng(77);
  rt::EngineOptions o;
  o.topology = {2, 2, 3};
  o.num_layers = 4;
  o.num_experts = 10;
  o.planning.align_bytes = 256;
  o.planning.max_chunk_bytes = 2048;
  o.verify = true;
  auto f = std::make_shared<rt::FaultSchedule>();
  f->fail_probability = 0.1;
  f->corrupt_probability = 0.1;
  f->delay_probability = 0.2;
  f->delay_us = 100;
  f->seed = 3;
  o.faults = f;
  Cluster c;
  REQUIRE(c.build(rng, o).ok());
  for (int l = 0; l < o.num_layers; ++l)
    c.random_resident(rng, l);
  // Each thread owns a layer for its batches; two threads share layer 0 to exercise slot ordering.
  std::vector<std::thread> threads;
  std::atomic<int> ended{0};
  for (int th = 0; th < 5; ++th)
    threads.emplace_back([&, th] {
      const int l = th < 4 ? th : 0;
      for (int b = 0; b < 8; ++b) {
        // Moves into one slot per GPU, chosen so that the threads on layer 0 collide on slot 2.
        std::vector<Move> moves;
        for (int g = 0; g < c.topo.num_gpus(); ++g)
          moves.push_back({(g * 3 + b + th) % o.num_experts, host_mirror, g, 2});
        // Drop moves whose expert already sits on that GPU in another slot (not a valid target placement).
        LayerPlacement now = c.engine->resident(l);
        std::erase_if(moves, [&](const Move &m) {
          for (int s = 0; s < 2; ++s)
            if (now.slot(m.dst_gpu, s) == m.expert) return true;
          return false;
        });
        rt::MoveBatch mb;
        mb.layer = l;
        mb.moves = moves;
        rt::Ticket t;
        const rt::Status st = c.engine->submit(mb, t);
        if (!st.ok()) continue; // e.g. a duplicate the other thread's batch created meanwhile
        const rt::Status end = t.wait_for(20s);
        CHECK(end.code() != rt::StatusCode::timed_out);
        ++ended;
      }
    });
  for (auto &t : threads)
    t.join();
  CHECK(ended > 20);
  for (int l = 0; l < o.num_layers; ++l)
    c.check_valid_bytes(l);
}

// --- split (per-tensor) slot and mirror regions ------------------------------------------------------------------

namespace {

// The same EP group as a `Cluster`, its slots and mirrors in split regions (`SlotRegion::tensors`,
// `MirrorRegion::tensors`) of random layouts.
struct SplitCluster {
  Topology topo;
  int num_layers = 0, num_experts = 0, num_buffers = 1;
  std::vector<rt::TensorSpan> tensors;
  std::vector<foremoe_test::SplitMemory> gpu_mem, mirror_mem; // [layer * gpus + gpu], [layer * nodes + node]
  std::unique_ptr<rt::TransferEngine> engine;

  foremoe_test::SplitMemory &mem(int l, int g) { return gpu_mem[static_cast<std::size_t>(l) * topo.num_gpus() + g]; }
  std::byte *at(int l, int g, int s, int b, int ti) { return mem(l, g).at(ti, s, b); }
  void fill(int l, int g, int s, int b, int e) {
    foremoe_test::fill_expert_at([&](int ti) { return at(l, g, s, b, ti); }, tensors, l, e);
  }
  bool holds_bytes(int l, int g, int s, int b, int e) {
    return foremoe_test::holds_expert_at([&](int ti) { return at(l, g, s, b, ti); }, tensors, l, e);
  }

  // `opts.tensors` must be set (the packed twin's); the split regions ignore their offsets.
  rt::Status build(std::mt19937_64 &rng, const rt::EngineOptions &opts, int buffers) {
    topo = opts.topology;
    num_layers = opts.num_layers;
    num_experts = opts.num_experts;
    num_buffers = buffers;
    tensors = opts.tensors;
    if (rt::Status st = rt::TransferEngine::create(opts, engine); !st.ok()) return st;
    gpu_mem.resize(static_cast<std::size_t>(num_layers) * topo.num_gpus());
    mirror_mem.resize(static_cast<std::size_t>(num_layers) * topo.num_nodes);
    for (int l = 0; l < num_layers; ++l) {
      for (int g = 0; g < topo.num_gpus(); ++g) {
        mem(l, g).build(rng, tensors, topo.slots_per_gpu, num_buffers);
        rt::SlotRegion r;
        r.num_slots = topo.slots_per_gpu;
        r.num_buffers = num_buffers;
        r.tensors = mem(l, g).slot_tensors();
        if (rt::Status st = engine->register_slots(l, g, r); !st.ok()) return st;
      }
      for (int nd = 0; nd < topo.num_nodes; ++nd) {
        auto &m = mirror_mem[static_cast<std::size_t>(l) * topo.num_nodes + nd];
        m.build(rng, tensors, num_experts, 1);
        for (int e = 0; e < num_experts; ++e)
          foremoe_test::fill_expert_at([&](int ti) { return m.at(ti, e); }, tensors, l, e);
        rt::MirrorRegion mr;
        mr.num_experts = num_experts;
        mr.tensors = m.mirror_tensors();
        if (rt::Status st = engine->register_mirror(l, nd, mr); !st.ok()) return st;
      }
    }
    return rt::Status::success();
  }
};

std::string telemetry_str(const rt::MoveTelemetry &m) {
  return foremoe::detail::concat("move ", m.move_idx, " path ", transfer::to_string(m.path), " ok ", m.ok, " attempts ",
                                 m.attempts, "/", m.num_chunks, " verified ", m.verified, " verify_failures ",
                                 m.verify_failures, " fallback ", m.fallback);
}

} // namespace

TEST_CASE("split regions land exactly the bytes of the packed layout, under random faults, with double buffers") {
  const int runs = 60 * foremoe_test::seed_multiplier();
  int moves_total = 0, fallbacks = 0, verify_failures = 0, failed_moves = 0, interleaved = 0;
  for (int run = 0; run < runs; ++run) {
    INFO("run ", run);
    std::mt19937_64 rng(7000 + run);
    rt::EngineOptions o = random_options(rng);
    auto faults = std::make_shared<rt::FaultSchedule>();
    faults->seed = rng();
    faults->fail_probability = std::uniform_real_distribution<double>(0, 0.4)(rng);
    faults->delay_probability = std::uniform_real_distribution<double>(0, 0.2)(rng);
    faults->delay_us = std::uniform_int_distribution<int>(0, 200)(rng);
    o.verify = rng() % 2 == 0;
    faults->corrupt_probability = o.verify ? std::uniform_real_distribution<double>(0, 0.3)(rng) : 0.0;
    if (rng() % 8 == 0) faults->fail_path[rng() % 2] = true;
    if (rng() % 6 == 0) *faults = rt::FaultSchedule{}; // some runs without faults
    o.faults = faults;
    Cluster c;
    c.num_buffers = rng() % 3 == 0 ? 2 : 1;
    REQUIRE(c.build(rng, o).ok());
    rt::EngineOptions so = o;
    so.tensors = c.tensors;
    SplitCluster d;
    const rt::Status built = d.build(rng, so, c.num_buffers);
    REQUIRE_MESSAGE(built.ok(), built.to_string());
    interleaved += d.gpu_mem[0].blocks.size() == 1 && c.tensors.size() > 1;
    for (int l = 0; l < c.num_layers; ++l) {
      c.random_resident(rng, l);
      const LayerPlacement p = c.engine->resident(l);
      for (int g = 0; g < c.topo.num_gpus(); ++g)
        for (int s = 0; s < c.topo.slots_per_gpu; ++s)
          if (p.slot(g, s) != empty_slot) d.fill(l, g, s, 0, p.slot(g, s));
      REQUIRE(d.engine->set_resident(l, p).ok());
    }
    const bool faultless = faults->fail_probability == 0 && faults->corrupt_probability == 0 && !faults->fail_path[0] &&
                           !faults->fail_path[1];
    // (layer, GPU, slot, buffer) holding a failed move's partial bytes, until a later move lands there in both.
    std::set<std::array<int, 4>> partial;
    for (int batch = 0; batch < 3; ++batch) {
      const int l = batch % c.num_layers;
      const auto moves = c.random_moves(rng, l, 0.5);
      rt::MoveBatch mb;
      mb.layer = l;
      mb.moves = moves;
      mb.dst_buffer = c.num_buffers == 2 ? static_cast<int>(rng() % 2) : 0;
      mb.timeout = 20s;
      rt::Ticket tc, td;
      REQUIRE(c.engine->submit(mb, tc).ok());
      const rt::Status ec = tc.wait_for(30s);
      REQUIRE(d.engine->submit(mb, td).ok());
      const rt::Status ed = td.wait_for(30s);
      CHECK(ec.code() == ed.code());
      const auto tel_c = tc.telemetry(), tel_d = td.telemetry();
      REQUIRE(tel_d.size() == moves.size());
      REQUIRE(tel_c.size() == tel_d.size());
      for (std::size_t i = 0; i < moves.size(); ++i) {
        const rt::MoveTelemetry &a = tel_c[i], &b = tel_d[i];
        // The same decisions: fault draws name the packed byte range, not an address. (A failed move's count of
        // attempts depends on when its chunks learn that another one was given up, so only `ok` is compared.)
        CHECK_MESSAGE((a.ok == b.ok && a.num_chunks == b.num_chunks &&
                       (!a.ok || (a.attempts == b.attempts && a.path == b.path && a.verified == b.verified &&
                                  a.verify_failures == b.verify_failures && a.fallback == b.fallback))),
                      "packed ", telemetry_str(a), " vs split ", telemetry_str(b));
        // Telemetry against the injected faults.
        if (!o.verify) CHECK(b.verify_failures == 0);
        if (b.fallback) CHECK((b.ok && b.attempts > b.num_chunks));
        if (faultless) CHECK((b.ok && !b.fallback && b.verify_failures == 0 && b.attempts == b.num_chunks));
        if (b.ok) CHECK(d.holds_bytes(l, moves[i].dst_gpu, moves[i].dst_slot, mb.dst_buffer, moves[i].expert));
        ++moves_total;
        fallbacks += b.fallback;
        verify_failures += b.verify_failures;
        failed_moves += !b.ok;
      }
      // The same resident placement and, byte for byte, the same slot contents (landed or untouched; a failed
      // move's partial bytes depend on timing as its attempts do, and stay until a later move lands there).
      const LayerPlacement pc = c.engine->resident(l), pd = d.engine->resident(l);
      CHECK(std::ranges::equal(pc.phys_to_log(), pd.phys_to_log()));
      for (std::size_t i = 0; i < moves.size(); ++i) {
        const std::array<int, 4> at{l, moves[i].dst_gpu, moves[i].dst_slot, mb.dst_buffer};
        if (!tel_d[i].ok || !tel_c[i].ok)
          partial.insert(at);
        else
          partial.erase(at);
      }
      for (int g = 0; g < c.topo.num_gpus(); ++g)
        for (int s = 0; s < c.topo.slots_per_gpu; ++s) {
          for (int b = 0; b < c.num_buffers; ++b)
            for (std::size_t ti = 0; ti < c.tensors.size() && !partial.contains({l, g, s, b}); ++ti)
              CHECK_MESSAGE(std::memcmp(c.slot_ptr(l, g, s, b) + c.tensors[ti].offset_bytes,
                                        d.at(l, g, s, b, static_cast<int>(ti)),
                                        static_cast<std::size_t>(c.tensors[ti].num_bytes)) == 0,
                            "layer ", l, " GPU ", g, " slot ", s, " buffer ", b, " tensor ", ti);
          if (const int e = pd.slot(g, s); e != empty_slot) {
            bool ok = false;
            for (int b = 0; b < d.num_buffers; ++b)
              ok = ok || d.holds_bytes(l, g, s, b, e);
            CHECK_MESSAGE(ok, "layer ", l, " GPU ", g, " slot ", s, " valid for expert ", e, " with wrong bytes");
          }
        }
      for (int g = 0; g < c.topo.num_gpus(); ++g)
        CHECK_MESSAGE(d.mem(l, g).guards_intact(), "layer ", l, " GPU ", g, ": a byte outside the rows was written");
    }
  }
  MESSAGE(runs, " runs (", interleaved, " interleaved): ", moves_total, " moves, ", failed_moves, " failed, ",
          fallbacks, " fell back to the mirror, ", verify_failures, " copies failed verification");
  CHECK(fallbacks > 0);
  CHECK(verify_failures > 0);
  CHECK(failed_moves > 0);
  CHECK(interleaved > 0);
}

TEST_CASE("telemetry: fallback and verify_failures follow the injected faults") {
  int over_gpu = 0;
  for (int run = 0; run < 20; ++run) {
    INFO("run ", run);
    std::mt19937_64 rng(900 + run);
    rt::EngineOptions o = random_options(rng);
    o.topology.num_nodes = 1;
    o.topology.gpus_per_node = std::max(2, o.topology.gpus_per_node);
    o.num_experts = std::max(o.num_experts, o.topology.slots_per_gpu);
    o.max_attempts = 3;
    o.verify = true;
    auto faults = std::make_shared<rt::FaultSchedule>();
    faults->fail_path[static_cast<int>(transfer::Path::nvlink)] = true; // every GPU copy fails
    o.faults = faults;
    Cluster c;
    REQUIRE(c.build(rng, o).ok());
    c.random_resident(rng, 0);
    auto moves = c.random_moves(rng, 0, 0.6);
    // The planner's sources: a GPU copy that no move overwrites where there is one, else the mirror.
    const LayerPlacement before = c.engine->resident(0);
    for (Move &m : moves)
      for (int g = 0; g < c.topo.num_gpus() && m.src_gpu == host_mirror; ++g)
        for (int s = 0; s < c.topo.slots_per_gpu; ++s)
          if (g != m.dst_gpu && before.slot(g, s) == m.expert &&
              std::none_of(moves.begin(), moves.end(),
                           [&](const Move &x) { return x.dst_gpu == g && x.dst_slot == s; }))
            m.src_gpu = g;
    rt::MoveBatch mb;
    mb.moves = moves;
    rt::Ticket t;
    REQUIRE(c.engine->submit(mb, t).ok());
    const rt::Status st = t.wait_for(20s);
    CHECK_MESSAGE(st.ok(), st.to_string());
    const auto tel = t.telemetry();
    const transfer::TransferPlan plan = c.engine->last_plan(0);
    for (std::size_t i = 0; i < moves.size(); ++i) {
      bool gpu_chunk = false; // planned a chunk over NVLink, which fails: it lands from the mirror
      for (const transfer::Chunk &ch : plan.chunks)
        gpu_chunk = gpu_chunk || (ch.move_idx == static_cast<int>(i) && ch.path != transfer::Path::pcie);
      CHECK_MESSAGE((tel[i].ok && tel[i].fallback == gpu_chunk && tel[i].verify_failures == 0), telemetry_str(tel[i]),
                    " planned over NVLink: ", gpu_chunk);
      over_gpu += gpu_chunk;
    }
  }
  CHECK(over_gpu > 10); // the fault did act
  // Every copy truncated: each verification fails, max_attempts times, and the move fails without a fallback.
  rt::EngineOptions o;
  o.verify = true;
  o.max_attempts = 3;
  auto faults = std::make_shared<rt::FaultSchedule>();
  faults->corrupt_probability = 1.0;
  o.faults = faults;
  Cluster c = small_cluster(o);
  const std::vector<Move> moves{{0, host_mirror, 1, 1}, {3, host_mirror, 0, 0}};
  rt::MoveBatch mb;
  mb.moves = moves;
  rt::Ticket t;
  REQUIRE(c.engine->submit(mb, t).ok());
  CHECK(t.wait_for(20s).code() == rt::StatusCode::device_error);
  for (const rt::MoveTelemetry &m : t.telemetry())
    CHECK_MESSAGE((!m.ok && !m.fallback && m.verify_failures == 3 && !m.verified), telemetry_str(m));
}

TEST_CASE("split regions: bad registrations are refused naming layer, GPU or node and tensor") {
  rt::EngineOptions o;
  o.tensors = {{0, 100}, {100, 40}};
  o.topology = {1, 2, 2};
  o.num_experts = 3;
  std::unique_ptr<rt::TransferEngine> e;
  REQUIRE(rt::TransferEngine::create(o, e).ok());
  std::vector<std::byte> a(1000), b(1000);
  auto slots = [&](std::vector<rt::SlotTensor> t, int buffers = 1) {
    rt::SlotRegion r;
    r.num_slots = 2;
    r.num_buffers = buffers;
    r.tensors = std::move(t);
    return r;
  };
  auto mirror = [&](std::vector<rt::MirrorTensor> t) {
    rt::MirrorRegion m;
    m.num_experts = 3;
    m.tensors = std::move(t);
    return m;
  };
  auto msg = [](const rt::Status &st) { return st.message(); };
  auto has = [](const std::string &s, const char *part) {
    INFO(s);
    return s.find(part) != std::string::npos;
  };
  CHECK(has(msg(e->register_slots(0, 1, slots({{a.data(), 100, 0}}))), "layer 0 GPU 1: 1 tensor regions"));
  CHECK(has(msg(e->register_slots(0, 1, slots({{a.data(), 100, 0}, {nullptr, 40, 0}}))), "GPU 1 tensor 1: null base"));
  CHECK(has(msg(e->register_slots(0, 0, slots({{a.data(), 99, 0}, {b.data(), 40, 0}}))),
            "tensor 0: slot stride 99 is smaller than its 100 bytes"));
  CHECK(has(msg(e->register_slots(0, 0, slots({{a.data(), 100, 300}, {b.data(), 40, 79}}, 2))),
            "tensor 1: buffer stride 79 overlaps its 2 slots"));
  // Tensor 1's rows inside tensor 0's: refused naming both.
  CHECK(has(msg(e->register_slots(0, 0, slots({{a.data(), 100, 0}, {a.data() + 150, 40, 0}}))),
            "tensor 0 slot 1 overlaps tensor 1 slot 0"));
  CHECK(has(msg(e->register_slots(0, 0, slots({{a.data(), 140, 280}, {a.data() + 100, 140, 280}}, 2))), "") ==
        true); // interleaved rows (a packed layout) are fine...
  REQUIRE(e->register_slots(0, 0, slots({{a.data(), 140, 280}, {a.data() + 100, 140, 280}}, 2)).ok());
  // ...but not one buffer of tensor 1 reaching into the other buffer's rows of tensor 0.
  const std::string reach = msg(e->register_slots(0, 1, slots({{b.data(), 140, 280}, {b.data() + 250, 140, 280}}, 2)));
  CHECK_MESSAGE(has(reach, "layer 0 GPU 1: tensor"), reach);
  CHECK_MESSAGE(has(reach, "overlaps tensor"), reach);
  rt::SlotRegion grads = slots({{a.data(), 100, 0}, {b.data(), 40, 0}});
  CHECK(has(msg(e->register_grads(0, 0, grads, 100)), "1 gradient tensor sizes for a split region"));

  CHECK(has(msg(e->register_mirror(0, 0, mirror({{a.data(), 100}}))), "layer 0 node 0: 1 tensor regions"));
  CHECK(has(msg(e->register_mirror(0, 0, mirror({{a.data(), 100}, {nullptr, 40}}))), "node 0 tensor 1: null base"));
  CHECK(has(msg(e->register_mirror(0, 0, mirror({{a.data(), 100}, {b.data(), 39}}))),
            "tensor 1: expert stride 39 is smaller than its 40 bytes"));
  CHECK(has(msg(e->register_mirror(0, 0, mirror({{a.data(), 100}, {a.data() + 240, 40}}))),
            "tensor 0 of expert 2 overlaps tensor 1 of expert 0"));
  REQUIRE(e->register_mirror(0, 0, mirror({{a.data(), 100}, {a.data() + 300, 40}})).ok());
}

TEST_CASE("registration is refused while batches of the layer are in flight") {
  Cluster c = small_cluster();
  rt::HostEvent free_ev;
  const std::vector<Move> moves{{0, 0, 1, 1}};
  rt::MoveBatch mb;
  mb.moves = moves;
  mb.slots_free.host = &free_ev;
  rt::Ticket t;
  REQUIRE(c.engine->submit(mb, t).ok());
  const rt::SlotRegion r{c.slot_ptr(0, 1, 0, 0), c.slot_stride, 2, 1, 0};
  CHECK(c.engine->register_slots(0, 1, r).message().find("layer 0 has batches in flight") != std::string::npos);
  CHECK(c.engine->register_mirror(0, 0, {c.mirror_mem[0].data(), c.slot_stride, 4}).message().find("in flight") !=
        std::string::npos);
  free_ev.set();
  REQUIRE(t.wait_for(10s).ok());
  CHECK(c.engine->register_slots(0, 1, r).ok());
}
