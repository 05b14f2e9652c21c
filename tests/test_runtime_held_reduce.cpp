// The engine's replica-gradient reductions under the held-gradient rule (issue 30): `ReduceBatch`'s selection,
// `HeldReduction` deriving it from `HeldGradients`, zeroing of returned gradients, moves refused over held ones.

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "foremoe/plan/held_gradients.hpp"
#include "foremoe/runtime/held_reduce.hpp"
#include "foremoe/runtime/testing.hpp"
#include "foremoe/runtime/transfer_engine.hpp"
#include "grad_ref.hpp"
#include "test_support.hpp"

using namespace foremoe;
namespace rt = foremoe::runtime;
using namespace std::chrono_literals;

namespace {

constexpr std::int64_t weight_bytes = 64;

// One EP group on the host backend: weight slots, a mirror per node, float32 gradient slots of `n` floats.
struct Group {
  Topology topo;
  int num_experts = 0, n = 0;
  std::vector<std::vector<std::byte>> slots, mirrors; // per GPU, per node
  std::vector<std::vector<float>> grads;              // per GPU: [slots * n]
  std::unique_ptr<rt::TransferEngine> engine;

  Group(Topology t, int experts, int floats) : topo(t), num_experts(experts), n(floats) {
    rt::EngineOptions o;
    o.topology = topo;
    o.num_layers = 1;
    o.num_experts = experts;
    o.tensors = {{0, weight_bytes}};
    REQUIRE(rt::TransferEngine::create(o, engine).ok());
    slots.assign(static_cast<std::size_t>(topo.num_gpus()),
                 std::vector<std::byte>(static_cast<std::size_t>(weight_bytes * topo.slots_per_gpu)));
    mirrors.assign(static_cast<std::size_t>(topo.num_nodes),
                   std::vector<std::byte>(static_cast<std::size_t>(weight_bytes * experts)));
    grads.assign(static_cast<std::size_t>(topo.num_gpus()),
                 std::vector<float>(static_cast<std::size_t>(topo.slots_per_gpu) * floats, 0.0f));
    for (int g = 0; g < topo.num_gpus(); ++g) {
      REQUIRE(engine->register_slots(0, g, {slots[g].data(), weight_bytes, topo.slots_per_gpu, 1, 0}).ok());
      REQUIRE(engine->register_grads(0, g, {grads[g].data(), floats * 4, topo.slots_per_gpu, 1, 0}, floats * 4).ok());
    }
    for (int nd = 0; nd < topo.num_nodes; ++nd)
      REQUIRE(engine->register_mirror(0, nd, {mirrors[nd].data(), weight_bytes, experts}).ok());
  }
  float *grad(int g, int s) { return grads[g].data() + static_cast<std::ptrdiff_t>(s) * n; }

  rt::Status reduce(const rt::ReduceBatch &b, std::size_t *returned = nullptr) {
    rt::Ticket t;
    if (rt::Status st = engine->submit_reduce(b, t); !st.ok()) return st;
    rt::Status st = t.wait_for(10s);
    if (returned != nullptr) *returned = t.telemetry().size();
    return st;
  }
  rt::Status move(std::span<const Move> moves) {
    rt::MoveBatch mb;
    mb.moves = moves;
    rt::Ticket t;
    if (rt::Status st = engine->submit(mb, t); !st.ok()) return st;
    return t.wait_for(10s);
  }
};

// A random update stage: owners fixed (each GPU owns `owned` experts, in its first slots), replica slots kept,
// replaced or filled from one micro-step to the next; random tokens per slot (zero for some).
std::vector<LayerPlan> random_stage(std::mt19937_64 &rng, const Topology &topo, int owned, int steps) {
  const int G = topo.num_gpus(), S = topo.slots_per_gpu, E = G * owned;
  std::vector<std::int32_t> experts(static_cast<std::size_t>(E));
  std::iota(experts.begin(), experts.end(), 0);
  std::shuffle(experts.begin(), experts.end(), rng);
  LayerPlan p;
  p.placement = LayerPlacement(G, S, E);
  p.owner_gpu.assign(static_cast<std::size_t>(E), 0);
  for (int g = 0; g < G; ++g)
    for (int s = 0; s < owned; ++s) {
      const std::int32_t e = experts[static_cast<std::size_t>(g) * owned + s];
      p.owner_gpu[e] = g;
      p.placement.slot(g, s) = e;
    }
  std::vector<LayerPlan> out;
  std::uniform_int_distribution<int> pick(0, E - 1), tokens(1, 5);
  for (int k = 0; k < steps; ++k) {
    // A replaced expert never comes back to another slot of the same GPU in the next micro-step (a planner keeps
    // a kept copy in its slot, `layout_gpu_slots`; the engine refuses moving over a held gradient).
    const LayerPlacement prev = p.placement;
    for (int g = 0; g < G; ++g)
      for (int s = owned; s < S; ++s) {
        const double u = std::uniform_real_distribution<double>(0, 1)(rng);
        if (k > 0 && u < 0.5) continue;  // kept
        if (k == 0 && u < 0.2) continue; // stays empty
        const std::int32_t e = pick(rng);
        if (!p.placement.holds(g, e) && !prev.holds(g, e)) p.placement.slot(g, s) = e;
      }
    p.slot_tokens.assign(static_cast<std::size_t>(G) * S, 0);
    for (int q = 0; q < G * S; ++q)
      if (p.placement.phys_to_log()[q] != empty_slot && rng() % 3 != 0) p.slot_tokens[q] = tokens(rng);
    out.push_back(p);
  }
  return out;
}

enum class Mode { held, every_step, no_selection };

struct StageResult {
  std::vector<std::vector<float>> owner_grads; // per expert
  std::int64_t returned = 0;                   // reduction runs the engine reported
  std::int64_t expected_returns = 0;           // HeldGradients' count (advance + final release)
  bool held_across = false;                    // a replica gradient stayed in place after a reduction
};

// Runs `plans` on a fresh group: each micro-step's backward adds integer-valued gradients into every slot that ran
// tokens (in place), then the layer's reduction per `mode`, then the moves to the next plan.
StageResult run_stage(const Topology &topo, int E, int n, const std::vector<LayerPlan> &plans, Mode mode,
                      std::uint64_t seed, std::vector<std::vector<float>> &sent) {
  Group grp(topo, E, n);
  const int G = topo.num_gpus(), S = topo.slots_per_gpu;
  REQUIRE(grp.engine->set_resident(0, plans[0].placement).ok());
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> value(-8, 8);
  HeldGradients held(1, G, E), reference(1, G, E);
  rt::HeldReduction red;
  StageResult r;
  sent.assign(static_cast<std::size_t>(E), std::vector<float>(static_cast<std::size_t>(n), 0.0f));
  for (std::size_t k = 0; k < plans.size(); ++k) {
    const LayerPlan &p = plans[k];
    for (int q = 0; q < G * S; ++q)
      if (const std::int32_t e = p.placement.phys_to_log()[q]; e != empty_slot && p.slot_tokens[q] > 0)
        for (int i = 0; i < n; ++i) {
          const auto v = static_cast<float>(value(rng));
          grp.grad(q / S, q % S)[i] += v;
          sent[e][i] += v;
        }
    r.expected_returns += reference.advance(0, p, mode == Mode::held);
    const LayerPlan *next = k + 1 < plans.size() ? &plans[k + 1] : nullptr;
    std::size_t returned = 0;
    if (mode == Mode::no_selection) {
      rt::ReduceBatch b;
      b.owner_gpu = p.owner_gpu;
      REQUIRE(grp.reduce(b, &returned).ok());
      for (int q = 0; q < G * S; ++q) // the caller clears every replica gradient (the engine leaves them)
        if (const std::int32_t e = p.placement.phys_to_log()[q]; e != empty_slot && p.owner_gpu[e] != q / S)
          std::fill(grp.grad(q / S, q % S), grp.grad(q / S, q % S) + n, 0.0f);
    } else {
      const rt::ReduceBatch b = red.prepare(held, 0, p, next, mode == Mode::held);
      REQUIRE(grp.reduce(b, &returned).ok());
      CHECK(returned == red.returns().size());
      r.returned += static_cast<std::int64_t>(returned);
      for (int q = 0; q < G * S; ++q) {
        const std::int32_t e = p.placement.phys_to_log()[q];
        if (e == empty_slot || p.owner_gpu[e] == q / S) continue;
        const bool nonzero =
            std::any_of(grp.grad(q / S, q % S), grp.grad(q / S, q % S) + n, [](float x) { return x != 0.0f; });
        const bool is_held = held.layer(0)[static_cast<std::size_t>(q / S) * E + e] >= 0;
        // A replica gradient is in place exactly while it is held (a held one ran tokens, values rarely sum to 0).
        if (nonzero) CHECK_MESSAGE(is_held, "GPU ", q / S, " slot ", q % S, " kept a gradient it returned");
        r.held_across = r.held_across || (is_held && nonzero);
      }
    }
    if (next != nullptr) {
      const std::vector<Move> moves = compute_moves(next->placement, next->owner_gpu, &p.placement, topo.gpus_per_node);
      const rt::Status st = grp.move(moves);
      REQUIRE_MESSAGE(st.ok(), st.to_string());
    }
  }
  reference.release(0, nullptr, false, [&](int, int, std::int32_t) { ++r.expected_returns; });
  CHECK(held.count(0) == 0);
  const LayerPlan &last = plans.back();
  r.owner_grads.resize(static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e)
    for (int s = 0; s < S; ++s)
      if (last.placement.slot(last.owner_gpu[e], s) == e)
        r.owner_grads[e].assign(grp.grad(last.owner_gpu[e], s), grp.grad(last.owner_gpu[e], s) + n);
  if (mode != Mode::no_selection)
    for (int q = 0; q < G * S; ++q)
      if (const std::int32_t e = last.placement.phys_to_log()[q]; e != empty_slot && last.owner_gpu[e] != q / S)
        for (int i = 0; i < n; ++i)
          REQUIRE(grp.grad(q / S, q % S)[i] == 0.0f); // every returned gradient was zeroed
  return r;
}

// Two GPUs, 3 slots, 4 experts: GPU 0 owns 0 and 2, GPU 1 owns 1 and 3 (slots 0, 1); slot 2 holds a replica,
// of expert 1 on GPU 0 and of expert 0 on GPU 1. Gradients of 4 floats.
struct Pair {
  Group grp{Topology{1, 2, 3}, 4, 4};
  std::vector<std::int32_t> owner{0, 1, 0, 1};
  Pair() {
    LayerPlacement p(2, 3, 4);
    p.slot(0, 0) = 0, p.slot(0, 1) = 2, p.slot(0, 2) = 1;
    p.slot(1, 0) = 1, p.slot(1, 1) = 3, p.slot(1, 2) = 0;
    REQUIRE(grp.engine->set_resident(0, p).ok());
  }
  rt::Status reduce(std::span<const rt::ReplicaRef> returns, std::span<const std::int32_t> held) {
    rt::ReduceBatch b;
    b.owner_gpu = owner;
    b.select = true;
    b.returns = returns;
    b.held = held;
    return grp.reduce(b);
  }
  // `[gpus * experts]` with GPU 1's replica of expert 0 held for owner 0.
  static std::vector<std::int32_t> held_on_1() {
    std::vector<std::int32_t> h(8, -1);
    h[4] = 0;
    return h;
  }
};

bool has(const rt::Status &st, const std::string &text) {
  if (st.message().find(text) != std::string::npos) return true;
  MESSAGE("status: ", st.to_string(), " lacks: ", text);
  return false;
}

} // namespace

TEST_CASE("held replica gradients: owners get every gradient once, returns as HeldGradients counts them") {
  const int instances = 200 * foremoe_test::seed_multiplier();
  std::mt19937_64 rng(30);
  std::int64_t held_returns = 0, every_returns = 0;
  int held_across = 0;
  for (int it = 0; it < instances; ++it) {
    const int nodes = std::uniform_int_distribution<int>(1, 2)(rng);
    const int per_node = std::uniform_int_distribution<int>(1, 3)(rng);
    const int slots = std::uniform_int_distribution<int>(2, 4)(rng);
    const int owned = std::uniform_int_distribution<int>(1, slots - 1)(rng);
    const int steps = std::uniform_int_distribution<int>(1, 5)(rng);
    const int n = std::uniform_int_distribution<int>(1, 9)(rng);
    const Topology topo{nodes, per_node, slots};
    const int E = topo.num_gpus() * owned;
    const std::vector<LayerPlan> plans = random_stage(rng, topo, owned, steps);
    const std::uint64_t seed = rng();
    CAPTURE(it);
    std::vector<std::vector<float>> sent_held, sent_every, sent_plain;
    const StageResult h = run_stage(topo, E, n, plans, Mode::held, seed, sent_held);
    const StageResult every = run_stage(topo, E, n, plans, Mode::every_step, seed, sent_every);
    const StageResult plain = run_stage(topo, E, n, plans, Mode::no_selection, seed, sent_plain);
    REQUIRE(sent_held == sent_every);
    REQUIRE(sent_held == sent_plain);
    // Integer-valued floats: every order of the additions is exact, so the owners' gradients compare bit for bit.
    for (int e = 0; e < E; ++e) {
      CHECK(h.owner_grads[e] == sent_held[e]);
      CHECK(every.owner_grads[e] == sent_held[e]);
      CHECK(plain.owner_grads[e] == sent_held[e]);
    }
    CHECK(h.returned == h.expected_returns);
    CHECK(every.returned == every.expected_returns);
    CHECK(h.returned <= every.returned);
    CHECK(!every.held_across);
    held_returns += h.returned;
    every_returns += every.returned;
    held_across += h.held_across;
  }
  MESSAGE("returns held ", held_returns, " vs every micro-step ", every_returns, "; ", held_across, " of ", instances,
          " stages kept a gradient in place across a reduction");
  CHECK(held_returns < every_returns);
  CHECK(held_across > instances / 4);
}

TEST_CASE("held gradients in every dtype and split regions, over processes: held, then returned, sums bitwise") {
  const rt::GradType types[] = {rt::GradType::f32, rt::GradType::f64, rt::GradType::bf16, rt::GradType::f16};
  int held_total = 0, unapplied_total = 0, applied_with_faults = 0;
  for (std::uint64_t seed = 1; seed <= 32 * static_cast<std::uint64_t>(foremoe_test::seed_multiplier()); ++seed) {
    std::mt19937_64 rng(seed * 13 + 1);
    const rt::GradType type = types[seed % 4];
    const bool split = (seed / 4) % 2 == 0, faults = (seed / 8) % 2 == 1; // faults: no selection (see below)
    rt::EngineOptions o;
    o.topology = {std::uniform_int_distribution<int>(1, 2)(rng), std::uniform_int_distribution<int>(1, 3)(rng),
                  std::uniform_int_distribution<int>(2, 4)(rng)};
    const int gpus = o.topology.num_gpus(), slots = o.topology.slots_per_gpu;
    if (gpus < 2) o.topology.gpus_per_node = 2;
    const int G = o.topology.num_gpus();
    o.num_experts = std::uniform_int_distribution<int>(1, G * slots)(rng);
    const int num_tensors = split ? std::uniform_int_distribution<int>(1, 3)(rng) : 1;
    for (int i = 0; i < num_tensors; ++i)
      o.tensors.push_back({weight_bytes * i, weight_bytes});
    if (faults) {
      auto f = std::make_shared<rt::FaultSchedule>();
      f->fail_probability = 0.3;
      f->seed = seed;
      o.faults = f;
    }
    o.peers.host_fabric = std::make_shared<rt::HostFabric>();
    // Processes: GPUs split at random into 2..G groups.
    std::vector<int> proc_of(static_cast<std::size_t>(G));
    int procs = 1;
    for (int g = 1; g < G; ++g)
      proc_of[g] = rng() % 2 == 0 ? procs++ : procs - 1;
    if (procs == 1) proc_of[G - 1] = procs++;
    std::vector<std::unique_ptr<rt::TransferEngine>> engines;
    for (int q = 0; q < procs; ++q) {
      rt::EngineOptions oq = o;
      for (int g = 0; g < G; ++g)
        if (proc_of[g] == q) oq.peers.local_gpus.push_back(g);
      std::unique_ptr<rt::TransferEngine> e;
      const rt::Status st = rt::TransferEngine::create(oq, e);
      REQUIRE_MESSAGE(st.ok(), st.to_string());
      engines.push_back(std::move(e));
    }
    foremoe_test::GradWorld w;
    w.build(rng, type, split, G, slots, num_tensors);
    std::vector<std::int32_t> owner;
    const LayerPlacement p = foremoe_test::random_owned(rng, G, slots, o.num_experts, owner);
    for (auto &e : engines)
      REQUIRE(e->set_resident(0, p).ok());
    for (int g = 0; g < G; ++g) {
      const rt::Status st = engines[proc_of[g]]->register_grads(0, g, w.region(g), w.layout);
      REQUIRE_MESSAGE(st.ok(), st.to_string());
    }
    // Round 1: a random part of the replicas returns, the rest is held (without faults: a sender zeroes its
    // replica once its send landed, even where another replica of the expert failed, so with faults the zeroes
    // would not follow the owner's outcome); with faults every replica returns, no selection.
    std::vector<rt::ReplicaRef> returns, all;
    std::vector<std::int32_t> held(static_cast<std::size_t>(G) * o.num_experts, -1);
    for (int g = 0; g < G; ++g)
      for (int e = 0; e < o.num_experts; ++e)
        if (g != owner[e] && p.holds(g, e)) {
          all.push_back({g, e});
          if (rng() % 2 == 0)
            returns.push_back({g, e});
          else
            held[static_cast<std::size_t>(g) * o.num_experts + e] = owner[e], ++held_total;
        }
    rt::ReduceBatch b;
    b.owner_gpu = owner;
    b.timeout = 5s;
    b.select = !faults;
    b.returns = returns;
    b.held = held;
    const std::string what = foremoe::detail::concat("seed ", seed, " ", rt::to_string(type),
                                                     split ? " split" : " packed", faults ? " faults" : " held");
    foremoe_test::GradWorld before = w;
    for (const rt::Status &st : foremoe_test::reduce_everywhere(engines, b))
      CHECK_MESSAGE((st.ok() || faults), what, ": ", st.to_string());
    int unapplied = 0;
    const int applied = foremoe_test::check_reduced(w, before, p, owner, faults, !faults, returns, what, &unapplied);
    unapplied_total += unapplied;
    if (faults) {
      applied_with_faults += applied;
      continue;
    }
    // Round 2: the held replicas kept accumulating (a new micro-step's gradient added in place), the returned
    // ones restarted from zero and ran tokens again; now every replica returns.
    for (const rt::ReplicaRef &r : all)
      for (int s = 0; s < slots; ++s)
        if (p.slot(r.gpu, s) == r.expert)
          for (int ti = 0; ti < w.tensors(); ++ti)
            for (std::int64_t i = 0; i < w.layout.tensor_bytes[ti]; i += w.esize()) {
              std::byte more[8];
              foremoe_test::random_value(rng, type, more);
              foremoe_test::ref_add(type, w.row(r.gpu, s, ti) + i, more);
            }
    before = w;
    std::vector<std::int32_t> none(held.size(), -1);
    b.returns = all;
    b.held = none;
    for (const rt::Status &st : foremoe_test::reduce_everywhere(engines, b))
      CHECK_MESSAGE(st.ok(), what, " round 2: ", st.to_string());
    foremoe_test::check_reduced(w, before, p, owner, false, true, all, what + " round 2");
  }
  CHECK(held_total > 0);
  CHECK(applied_with_faults > 0);
  CHECK(unapplied_total > 0); // the fault schedule failed some experts (all or nothing, told apart from sums)
}

TEST_CASE("a held gradient's slot cannot be overwritten, by a move or set_resident, until it returns") {
  Pair pr;
  std::fill(pr.grp.grads[1].begin() + 8, pr.grp.grads[1].end(), 2.0f); // GPU 1's replica of expert 0
  REQUIRE(pr.reduce({}, Pair::held_on_1()).ok());
  CHECK(pr.grp.grads[0][0] == 0.0f);               // nothing returned
  const std::vector<Move> over{{2, 0, 1, 2}};      // expert 2 into GPU 1 slot 2
  const std::vector<Move> elsewhere{{3, 1, 0, 2}}; // expert 3 into GPU 0 slot 2 (its replica holds nothing)
  CHECK(has(pr.grp.move(over), "submit: layer 0 GPU 1 slot 2 holds the gradient of expert 0 for owner GPU 0"));
  CHECK(pr.grp.engine->valid_expert(0, 1, 2) == 0);
  CHECK(pr.grp.move(elsewhere).ok());
  LayerPlacement p = pr.grp.engine->resident(0);
  p.slot(1, 2) = empty_slot;
  CHECK(has(pr.grp.engine->set_resident(0, p), "set_resident: layer 0 GPU 1 slot 2 holds the gradient of expert 0"));
  // Dropping it without a return is refused too.
  CHECK(has(pr.reduce({}, {}), "GPU 1 slot 2 holds the gradient of expert 0 for owner GPU 0 (held by an earlier"));
  const std::vector<rt::ReplicaRef> back{{1, 0}};
  REQUIRE(pr.reduce(back, {}).ok());
  CHECK(pr.grp.grads[0][0] == 2.0f);
  CHECK(pr.grp.grads[1][8] == 0.0f); // zeroed after its return
  CHECK(pr.grp.move(over).ok());
  CHECK(pr.grp.engine->valid_expert(0, 1, 2) == 2);
}

TEST_CASE("without a selection a reduction returns every replica and forgets held records") {
  Pair pr;
  pr.grp.grads[1][8] = 3.0f;
  REQUIRE(pr.reduce({}, Pair::held_on_1()).ok());
  rt::ReduceBatch all;
  all.owner_gpu = pr.owner;
  std::size_t returned = 0;
  REQUIRE(pr.grp.reduce(all, &returned).ok());
  CHECK(returned == 2);
  CHECK(pr.grp.grads[0][0] == 3.0f);
  CHECK(pr.grp.grads[1][8] == 3.0f); // left as it is: the caller clears it
  const std::vector<Move> over{{2, 0, 1, 2}};
  CHECK(pr.grp.move(over).ok());
}

TEST_CASE("held-gradient selection bad input: clear statuses naming the value") {
  Pair pr;
  using R = rt::ReplicaRef;
  using H = std::vector<std::int32_t>;
  const H none(8, -1);
  CHECK(has(pr.reduce(std::vector<R>{{2, 0}}, none), "returns names GPU 2 (expert 0), outside [0, 2)"));
  CHECK(has(pr.reduce(std::vector<R>{{-1, 0}}, none), "returns names GPU -1"));
  CHECK(has(pr.reduce(std::vector<R>{{0, 5}}, none), "returns names expert 5 (GPU 0), outside [0, 4)"));
  CHECK(has(pr.reduce(std::vector<R>{{1, 0}, {1, 0}}, none), "returns names GPU 1 expert 0 twice"));
  CHECK(has(pr.reduce(std::vector<R>{{0, 0}}, none), "GPU 0 expert 0, but GPU 0 is its owner, not a replica"));
  CHECK(has(pr.reduce(std::vector<R>{{0, 3}}, none), "GPU 0 expert 3, but layer 0 GPU 0 holds no valid copy of it"));
  CHECK(has(pr.reduce({}, H{-1, -1}), "held has 2 entries, expected GPUs x experts = 8"));
  CHECK(has(pr.reduce({}, H{-1, 0, -1, -1, -1, -1, -1, -1}),
            "held names owner GPU 0 for GPU 0 expert 1, but owner_gpu says 1"));
  CHECK(has(pr.reduce({}, H{-1, -1, -1, 1, -1, -1, -1, -1}), "held names GPU 0 expert 3, but layer 0 GPU 0 holds no"));
  CHECK(has(pr.reduce(std::vector<R>{{0, 1}}, H{-1, 1, -1, -1, -1, -1, -1, -1}),
            "GPU 0 expert 1 is both returned and held"));
  rt::ReduceBatch b;
  b.owner_gpu = pr.owner;
  b.select = true;
  b.timeout = 0ms;
  CHECK(has(pr.grp.reduce(b), "timeout must be positive"));
  CHECK(pr.reduce({}, H{-1, 1, -1, -1, -1, -1, -1, -1}).ok()); // a valid selection still goes through
  CHECK(pr.reduce(std::vector<R>{{0, 1}}, none).ok());
}
