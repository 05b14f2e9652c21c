// The transport registry: in-tree backends (one folder each under runtime/transports/) are found by name in a
// static link, an out-of-tree backend registered at run time through the public header carries an engine's
// moves, and a bad name is answered with the registered ones. The fault injector's draws are public
// (`fault_draw`, `fault_key`) so that other move paths replay one schedule the same way.

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <memory>
#include <vector>

#include "expert_bytes.hpp"
#include "foremoe/runtime/runtime.hpp"
#include "foremoe/runtime/testing.hpp"
#include "foremoe/runtime/transfer_engine.hpp"
#include "foremoe/runtime/transport.hpp"

using namespace foremoe;
namespace rt = foremoe::runtime;
using namespace std::chrono_literals;

namespace {

// 1 node x 2 GPUs x 1 slot, 2 experts of one 3000-byte tensor, a mirror; GPU 0 holds expert 0.
struct Pair {
  std::vector<rt::TensorSpan> tensors{{0, 3000}};
  std::vector<std::byte> gpu[2], mirror;
  std::unique_ptr<rt::TransferEngine> engine;

  rt::Status build(rt::EngineOptions o) {
    o.topology = {1, 2, 1};
    o.num_layers = 1;
    o.num_experts = 2;
    o.tensors = tensors;
    o.planning.align_bytes = 256;
    o.planning.max_chunk_bytes = 1024; // several chunks per move
    if (rt::Status st = rt::TransferEngine::create(o, engine); !st.ok()) return st;
    for (auto &g : gpu)
      g.assign(3000, std::byte{0});
    mirror.assign(6000, std::byte{0});
    for (int e = 0; e < 2; ++e)
      foremoe_test::fill_expert(mirror.data() + e * 3000, tensors, 0, e);
    foremoe_test::fill_expert(gpu[0].data(), tensors, 0, 0);
    for (int g = 0; g < 2; ++g)
      if (rt::Status st = engine->register_slots(0, g, {gpu[g].data(), 3000, 1, 1, 0}); !st.ok()) return st;
    if (rt::Status st = engine->register_mirror(0, 0, {mirror.data(), 3000, 2}); !st.ok()) return st;
    LayerPlacement p(2, 1, 2);
    p.slot(0, 0) = 0;
    return engine->set_resident(0, p);
  }
  // Moves expert 1 onto GPU 1 and waits.
  rt::Status move() {
    const std::vector<Move> moves{{1, host_mirror, 1, 0}};
    rt::MoveBatch mb;
    mb.moves = moves;
    rt::Ticket t;
    if (rt::Status st = engine->submit(mb, t); !st.ok()) return st;
    return t.wait_for(10s);
  }
};

// A trainer's own transport: forwards to the host transport and counts what it was asked to copy.
class CountingTransport final : public rt::Transport {
public:
  CountingTransport(std::unique_ptr<rt::Transport> inner, std::shared_ptr<std::atomic<int>> starts)
      : inner_(std::move(inner)), starts_(std::move(starts)) {}
  rt::Status start(const rt::CopyOp &op, std::uint64_t &h) override {
    ++*starts_;
    return inner_->start(op, h);
  }
  rt::Status query(std::uint64_t h, double &s) override { return inner_->query(h, s); }
  bool cancel(std::uint64_t h) override { return inner_->cancel(h); }
  rt::Status gate(const rt::Gate &g, bool &ready) override { return inner_->gate(g, ready); }
  rt::Status checksum(int gpu, const std::byte *p, std::int64_t n, std::uint64_t &out) override {
    return inner_->checksum(gpu, p, n, out);
  }
  rt::Status accumulate(int gpu, void *dst, const void *src, std::int64_t n, rt::GradType type) override {
    return inner_->accumulate(gpu, dst, src, n, type);
  }
  rt::Status alloc(int gpu, std::int64_t n, std::byte *&out) override { return inner_->alloc(gpu, n, out); }
  void free(int gpu, std::byte *p) noexcept override { inner_->free(gpu, p); }
  rt::Status alloc_flags(std::int64_t n, volatile std::uint32_t *&f) override { return inner_->alloc_flags(n, f); }
  void free_flags(volatile std::uint32_t *f) noexcept override { inner_->free_flags(f); }
  rt::Status enqueue_wait(void *s, volatile std::uint32_t *f, std::uint32_t v) override {
    return inner_->enqueue_wait(s, f, v);
  }

private:
  std::unique_ptr<rt::Transport> inner_;
  std::shared_ptr<std::atomic<int>> starts_;
};

} // namespace

TEST_CASE("in-tree transports are found by name, each registered by its folder") {
  const std::vector<std::string> names = rt::registered_transports();
  CHECK(std::is_sorted(names.begin(), names.end()));
  // Nothing in this test references the host transport's code: only the generated registration keeps it linked.
  CHECK(std::count(names.begin(), names.end(), "host") == 1);
  CHECK(std::count(names.begin(), names.end(), "cuda") == (rt::build_info().cuda_compiled ? 1 : 0));
  rt::EngineOptions o;
  o.transport = "host";
  Pair p;
  REQUIRE(p.build(o).ok());
  REQUIRE(p.move().ok());
  CHECK(foremoe_test::holds_expert(p.gpu[1].data(), p.tensors, 0, 1));
  CHECK(p.engine->valid_expert(0, 1, 0) == 1);
}

TEST_CASE("an unknown transport name is answered with the registered ones") {
  rt::EngineOptions o;
  o.transport = "nixl-not-here";
  Pair p;
  const rt::Status st = p.build(o);
  CHECK(st.code() == rt::StatusCode::invalid_argument);
  CHECK(st.message().find("\"nixl-not-here\"") != std::string::npos);
  CHECK(st.message().find("registered: ") != std::string::npos);
  CHECK(st.message().find("host") != std::string::npos);
  if (!rt::build_info().cuda_compiled) {
    o.transport = "cuda";
    CHECK(p.build(o).code() == rt::StatusCode::unavailable);
  }
}

TEST_CASE("a transport registered at run time through the public header carries an engine's moves") {
  auto starts = std::make_shared<std::atomic<int>>(0);
  const rt::Status reg = rt::register_transport(
      "test_counting", [starts](const rt::EngineOptions &opts, std::unique_ptr<rt::Transport> &out) {
        std::unique_ptr<rt::Transport> inner;
        if (rt::Status st = rt::make_transport("host", opts, inner); !st.ok()) return st;
        out = std::make_unique<CountingTransport>(std::move(inner), starts);
        return rt::Status::success();
      });
  REQUIRE_MESSAGE(reg.ok(), reg.to_string());
  const auto names = rt::registered_transports();
  CHECK(std::count(names.begin(), names.end(), "test_counting") == 1);
  CHECK(rt::register_transport("test_counting", [](const rt::EngineOptions &,
                                                   std::unique_ptr<rt::Transport> &) { return rt::Status::success(); })
            .message()
            .find("already registered") != std::string::npos);
  CHECK(rt::register_transport("", nullptr).code() == rt::StatusCode::invalid_argument);
  CHECK(rt::register_transport("test_empty", nullptr).code() == rt::StatusCode::invalid_argument);

  rt::EngineOptions o;
  o.transport = "test_counting";
  Pair p;
  REQUIRE(p.build(o).ok());
  REQUIRE(p.move().ok());
  CHECK(*starts >= 3); // 3000 bytes in chunks of at most 1024
  CHECK(foremoe_test::holds_expert(p.gpu[1].data(), p.tensors, 0, 1));

  // The fault injector (testing.hpp) wraps a trainer's transport too: with every path down the move fails.
  const int before = *starts;
  o.faults = std::make_shared<rt::FaultSchedule>(rt::FaultSchedule{0, 0, 0, 0, {true, true, true}, 1});
  Pair q;
  REQUIRE(q.build(o).ok());
  CHECK(q.move().code() == rt::StatusCode::device_error);
  CHECK(*starts == before); // failed before reaching the wrapped transport
  CHECK(q.engine->valid_expert(0, 1, 0) == empty_slot);
}

TEST_CASE("a factory that fails or makes nothing is reported") {
  REQUIRE(rt::register_transport("test_failing", [](const rt::EngineOptions &, std::unique_ptr<rt::Transport> &) {
            return rt::Status{rt::StatusCode::unavailable, "test_failing: no such fabric here"};
          }).ok());
  REQUIRE(rt::register_transport("test_null", [](const rt::EngineOptions &, std::unique_ptr<rt::Transport> &) {
            return rt::Status::success();
          }).ok());
  rt::EngineOptions o;
  o.transport = "test_failing";
  Pair p;
  const rt::Status st = p.build(o);
  CHECK(st.code() == rt::StatusCode::unavailable);
  CHECK(st.message() == "test_failing: no such fabric here");
  o.transport = "test_null";
  CHECK(p.build(o).message().find("made nothing") != std::string::npos);
}

TEST_CASE("a steady state of moves and reductions creates no transport resources after warm-up") {
  // 1 node x 2 GPUs x 2 slots, 3 experts of two tensors: GPU 0 owns 0 and 1, GPU 1 owns 2; each micro-step moves
  // expert 0 or 1 into GPU 1's second slot (a replica) and reduces the replica's gradient into its owner.
  // Counted (EngineStats::allocations): completion flags and staging blocks the engine takes from the transport,
  // and what the transport creates itself; host bookkeeping (tickets, chunk lists) is not.
  const std::vector<rt::TensorSpan> tensors{{0, 2000}, {2048, 1000}};
  const std::int64_t stride = 3072, grad_bytes = 4000;
  rt::EngineOptions o;
  o.topology = {1, 2, 2};
  o.num_layers = 1;
  o.num_experts = 3;
  o.tensors = tensors;
  o.planning.align_bytes = 256;
  o.planning.max_chunk_bytes = 1024;
  o.verify = true;
  std::unique_ptr<rt::TransferEngine> engine;
  REQUIRE(rt::TransferEngine::create(o, engine).ok());
  std::vector<std::byte> gpu[2], mirror(3 * stride);
  std::vector<float> grads[2];
  for (int g = 0; g < 2; ++g) {
    gpu[g].assign(2 * stride, std::byte{0});
    grads[g].assign(2 * grad_bytes / 4, 1.0f);
    REQUIRE(engine->register_slots(0, g, {gpu[g].data(), stride, 2, 1, 0}).ok());
    REQUIRE(engine->register_grads(0, g, {grads[g].data(), grad_bytes, 2, 1, 0}, grad_bytes).ok());
  }
  for (int e = 0; e < 3; ++e)
    foremoe_test::fill_expert(mirror.data() + e * stride, tensors, 0, e);
  REQUIRE(engine->register_mirror(0, 0, {mirror.data(), stride, 3}).ok());
  LayerPlacement p(2, 2, 3);
  p.slot(0, 0) = 0, p.slot(0, 1) = 1, p.slot(1, 0) = 2;
  for (auto [g, s, e] : {std::array{0, 0, 0}, {0, 1, 1}, {1, 0, 2}})
    foremoe_test::fill_expert(gpu[g].data() + s * stride, tensors, 0, e);
  REQUIRE(engine->set_resident(0, p).ok());
  const std::vector<std::int32_t> owner{0, 0, 1};

  auto micro_step = [&](int i) {
    const std::vector<Move> moves{{i % 2, host_mirror, 1, 1}};
    rt::MoveBatch mb;
    mb.moves = moves;
    rt::Ticket t;
    REQUIRE(engine->submit(mb, t).ok());
    REQUIRE(t.wait_for(10s).ok());
    REQUIRE(foremoe_test::holds_expert(gpu[1].data() + stride, tensors, 0, i % 2));
    rt::ReduceBatch rb;
    rb.owner_gpu = owner;
    rt::Ticket r;
    REQUIRE(engine->submit_reduce(rb, r).ok());
    REQUIRE(r.wait_for(10s).ok());
    REQUIRE(r.telemetry().size() == 1);
  };
  for (int i = 0; i < 4; ++i)
    micro_step(i);
  const rt::EngineStats warm = engine->stats();
  CHECK(warm.allocations > 0); // the pools did fill
  CHECK(warm.batches == 8);
  for (int i = 4; i < 40; ++i)
    micro_step(i);
  const rt::EngineStats steady = engine->stats();
  CHECK(steady.batches == 80);
  CHECK_MESSAGE(steady.allocations == warm.allocations, "36 steady micro-steps created ",
                steady.allocations - warm.allocations, " transport resources");
  // The replica gradients (1.0 each step) were added into the owner's: slot 0 of GPU 0 for expert 0 (20 steps),
  // slot 1 for expert 1 (20 steps).
  CHECK(grads[0][0] == 21.0f);
  CHECK(grads[0][grad_bytes / 4] == 21.0f);
}

TEST_CASE("fault draws replay from the seed, are uniform, and differ by decision and identity") {
  using rt::FaultDecision;
  rt::FaultSchedule f;
  f.seed = 42;
  const std::uint64_t id[3] = {7, 3, 11}, swapped[3] = {3, 7, 11};
  const std::uint64_t key = rt::fault_key(id);
  CHECK(key == rt::fault_key(id));
  CHECK(key != rt::fault_key(swapped));
  CHECK(rt::fault_draw(f, key, FaultDecision::fail) == rt::fault_draw(f, key, FaultDecision::fail));
  CHECK(rt::fault_draw(f, key, FaultDecision::fail) != rt::fault_draw(f, key, FaultDecision::corrupt));
  rt::FaultSchedule g = f;
  g.seed = 43;
  CHECK(rt::fault_draw(f, key, FaultDecision::delay) != rt::fault_draw(g, key, FaultDecision::delay));
  // Over many identities each decision's draws are uniform in [0, 1): mean 1/2, a tenth of them below 0.1.
  for (const FaultDecision d : {FaultDecision::fail, FaultDecision::corrupt, FaultDecision::delay}) {
    const int n = 20000;
    double sum = 0;
    int below = 0;
    for (std::uint64_t i = 0; i < static_cast<std::uint64_t>(n); ++i) {
      const std::uint64_t ident[2] = {i, 5};
      const double u = rt::fault_draw(f, rt::fault_key(ident), d);
      REQUIRE(u >= 0.0);
      REQUIRE(u < 1.0);
      sum += u;
      below += u < 0.1;
    }
    CHECK(sum / n == doctest::Approx(0.5).epsilon(0.02));
    CHECK(below == doctest::Approx(n / 10.0).epsilon(0.06));
  }
}
