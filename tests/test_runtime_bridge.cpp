// The transfer engine's paired transfers over an embedder's PeerBridge (`PeerOptions::bridge`): one engine per
// "process", each with its own bridge object and worker thread, joined by a message board the bridges share (the
// stand-in for a trainer's gloo group). The engine keeps its pairing, headers, verification and deadlines; these
// tests check that moves land exactly, that a peer that never answers ends the wait `timed_out` naming the peer and
// the deadline, and that a bridge's error, or a peer's abort, fails the batch naming it before the deadline.

#include <doctest/doctest.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <thread>

#include "expert_bytes.hpp"
#include "foremoe/runtime/testing.hpp"
#include "foremoe/runtime/transfer_engine.hpp"
#include "foremoe/runtime/transport.hpp"
#include "grad_ref.hpp"
#include "test_support.hpp"

using namespace foremoe;
namespace rt = foremoe::runtime;
using namespace std::chrono_literals;

namespace {

// Messages between GPUs, per (source GPU, destination GPU) in send order: eager sends, receives that wait.
struct Board {
  struct Msg {
    std::vector<std::byte> bytes;
    std::uint64_t header[2] = {0, 0};
  };
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::pair<int, int>, std::deque<Msg>> q;
};

// One process's bridge: a worker thread runs its groups in posting order, each with a deadline.
class ThreadBridge final : public rt::PeerBridge {
public:
  ThreadBridge(std::shared_ptr<Board> board, std::chrono::milliseconds timeout)
      : board_(std::move(board)), timeout_(timeout), worker_([this] { work(); }) {}
  ~ThreadBridge() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  void post(std::span<rt::PeerOp> ops, Done done) override {
    {
      std::lock_guard lock(mu_);
      groups_.push_back({ops, std::move(done)});
    }
    cv_.notify_all();
  }
  std::string fail_with; // set before use: every group fails with this error, nothing is sent
  int groups_run = 0;    // read after the engine is gone

private:
  struct Posted {
    std::span<rt::PeerOp> ops;
    Done done;
  };
  void work() {
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !groups_.empty(); });
      if (groups_.empty()) return;
      Posted g = std::move(groups_.front());
      groups_.pop_front();
      lock.unlock();
      rt::Status st = run(g.ops);
      if (!st.ok() && first_error_.empty()) first_error_ = st.to_string();
      ++groups_run;
      g.done(std::move(st));
      lock.lock();
    }
  }
  rt::Status run(std::span<rt::PeerOp> ops) {
    if (!first_error_.empty())
      return {rt::StatusCode::device_error, "bridge: an earlier group failed: " + first_error_};
    if (!fail_with.empty()) return {rt::StatusCode::device_error, fail_with};
    {
      std::lock_guard lock(board_->mu);
      for (const rt::PeerOp &op : ops)
        if (op.send) {
          Board::Msg m;
          m.bytes.assign(op.buf, op.buf + op.num_bytes);
          m.header[0] = op.header[0];
          m.header[1] = op.header[1];
          board_->q[{op.local_gpu, op.peer_gpu}].push_back(std::move(m));
        }
    }
    board_->cv.notify_all();
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    std::unique_lock lock(board_->mu);
    for (rt::PeerOp &op : ops) {
      if (op.send) continue;
      auto &q = board_->q[{op.peer_gpu, op.local_gpu}];
      if (!board_->cv.wait_until(lock, deadline, [&] { return !q.empty(); }))
        return {rt::StatusCode::timed_out, "bridge: nothing from GPU " + std::to_string(op.peer_gpu) + " to GPU " +
                                               std::to_string(op.local_gpu) + " within " +
                                               std::to_string(timeout_.count()) + " ms"};
      Board::Msg m = std::move(q.front());
      q.pop_front();
      if (static_cast<std::int64_t>(m.bytes.size()) != op.num_bytes)
        return {rt::StatusCode::device_error,
                "bridge: GPU " + std::to_string(op.peer_gpu) + " sent " + std::to_string(m.bytes.size()) +
                    " bytes, GPU " + std::to_string(op.local_gpu) + " expected " + std::to_string(op.num_bytes)};
      std::copy(m.bytes.begin(), m.bytes.end(), op.buf);
      op.header[0] = m.header[0];
      op.header[1] = m.header[1];
    }
    return rt::Status::success();
  }

  std::shared_ptr<Board> board_;
  std::chrono::milliseconds timeout_;
  std::string first_error_; // worker thread only
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Posted> groups_;
  bool stop_ = false;
  std::thread worker_; // last: starts once the rest is built
};

// One layer, one process per GPU (every move is a paired transfer, or a copy from the node's mirror when `mirror`).
// Slots packed, or in split regions of random layouts (`split`), single or double-buffered.
struct World {
  rt::EngineOptions opts;
  bool split = false, mirror = false;
  int num_buffers = 1;
  std::shared_ptr<const rt::FaultSchedule> faults;
  std::int64_t stride = 0;
  int slots_per_gpu = 0;
  std::vector<std::vector<std::byte>> mem;          // [gpu], packed
  std::vector<foremoe_test::SplitMemory> split_mem; // [gpu], split
  std::vector<std::byte> mirror_mem;                // packed
  foremoe_test::SplitMemory split_mirror;
  std::shared_ptr<Board> board = std::make_shared<Board>();
  std::vector<std::shared_ptr<ThreadBridge>> bridges;
  std::vector<std::unique_ptr<rt::TransferEngine>> engines;

  std::byte *slot(int g, int s, int b = 0) { return mem[g].data() + (b * slots_per_gpu + s) * stride; }
  // Tensor `ti` of GPU `g`'s slot `s`, buffer `b`.
  std::byte *at(int g, int s, int ti, int b = 0) {
    return split ? split_mem[g].at(ti, s, b) : slot(g, s, b) + opts.tensors[ti].offset_bytes;
  }
  void fill(int g, int s, int e, int b = 0) {
    foremoe_test::fill_expert_at([&](int ti) { return at(g, s, ti, b); }, opts.tensors, 0, e);
  }
  bool holds(int g, int s, int e, int b = 0) {
    return foremoe_test::holds_expert_at([&](int ti) { return at(g, s, ti, b); }, opts.tensors, 0, e);
  }

  void build(std::mt19937_64 &rng, int gpus, int slots, int experts, std::chrono::milliseconds bridge_timeout,
             const std::string &fail_gpu0 = "") {
    opts.topology.num_nodes = 1;
    opts.topology.gpus_per_node = gpus;
    opts.topology.slots_per_gpu = slots;
    opts.num_experts = experts;
    opts.planning.host_mirror = mirror;
    opts.planning.align_bytes = 256;
    opts.planning.max_chunk_bytes = 256 * std::uniform_int_distribution<int>(1, 16)(rng);
    opts.host_threads_per_path = 1;
    opts.faults = faults;
    slots_per_gpu = slots;
    std::int64_t off = std::uniform_int_distribution<int>(0, 64)(rng);
    for (int i = std::uniform_int_distribution<int>(1, 3)(rng); i > 0; --i) {
      const std::int64_t n = std::uniform_int_distribution<std::int64_t>(1, 10 << 10)(rng);
      opts.tensors.push_back({off, n});
      off += n + std::uniform_int_distribution<int>(0, 50)(rng);
    }
    stride = off;
    mem.assign(static_cast<std::size_t>(gpus),
               std::vector<std::byte>(static_cast<std::size_t>(stride * slots * num_buffers)));
    split_mem.resize(static_cast<std::size_t>(gpus));
    for (int g = 0; g < gpus && split; ++g)
      split_mem[g].build(rng, opts.tensors, slots, num_buffers);
    if (mirror) {
      mirror_mem.assign(static_cast<std::size_t>(stride * experts), std::byte{0});
      split_mirror.build(rng, opts.tensors, experts, 1);
      for (int e = 0; e < experts; ++e) {
        foremoe_test::fill_expert(mirror_mem.data() + e * stride, opts.tensors, 0, e);
        foremoe_test::fill_expert_at([&](int ti) { return split_mirror.at(ti, e); }, opts.tensors, 0, e);
      }
    }
    for (int p = 0; p < gpus; ++p) {
      auto b = std::make_shared<ThreadBridge>(board, bridge_timeout);
      if (p == 0) b->fail_with = fail_gpu0;
      bridges.push_back(b);
      rt::EngineOptions o = opts;
      o.peers.local_gpus = {p};
      o.peers.bridge = b;
      std::unique_ptr<rt::TransferEngine> e;
      const rt::Status st = rt::TransferEngine::create(o, e);
      REQUIRE_MESSAGE(st.ok(), st.to_string());
      rt::SlotRegion r{slot(p, 0), stride, slots, num_buffers, stride * slots};
      if (split) {
        r.base = nullptr;
        r.tensors = split_mem[p].slot_tensors();
      }
      const rt::Status reg = e->register_slots(0, p, r);
      REQUIRE_MESSAGE(reg.ok(), reg.to_string());
      if (mirror) { // every process maps the node's mirror
        rt::MirrorRegion m{mirror_mem.data(), stride, experts};
        if (split) {
          m.base = nullptr;
          m.tensors = split_mirror.mirror_tensors();
        }
        REQUIRE(e->register_mirror(0, 0, m).ok());
      }
      engines.push_back(std::move(e));
    }
  }
  void set_resident(const LayerPlacement &p) {
    for (int g = 0; g < p.num_gpus(); ++g)
      for (int s = 0; s < p.slots_per_gpu(); ++s)
        if (p.slot(g, s) != empty_slot) fill(g, s, p.slot(g, s));
    for (auto &e : engines)
      REQUIRE(e->set_resident(0, p).ok());
  }
};

rt::MoveBatch batch_of(const std::vector<Move> &moves, std::chrono::milliseconds timeout) {
  rt::MoveBatch b;
  b.moves = moves;
  b.timeout = timeout;
  return b;
}

} // namespace

TEST_CASE("moves over a bridge land exactly where the engine says, on every process") {
  int paired = 0;
  for (std::uint64_t seed = 1; seed <= 25 * static_cast<std::uint64_t>(foremoe_test::seed_multiplier()); ++seed) {
    std::mt19937_64 rng(seed);
    World w;
    const int gpus = std::uniform_int_distribution<int>(2, 4)(rng),
              slots = std::uniform_int_distribution<int>(1, 3)(rng);
    const int experts = std::uniform_int_distribution<int>(slots, gpus * slots)(rng);
    w.opts.verify = rng() % 2 == 0;
    w.build(rng, gpus, slots, experts, 10s);
    LayerPlacement before(gpus, slots, experts);
    for (int g = 0; g < gpus; ++g)
      for (int s = 0; s < slots; ++s)
        if (const int e = static_cast<int>(rng() % experts); !before.holds(g, e) && rng() % 4 != 0)
          before.slot(g, s) = e;
    w.set_resident(before);
    // Moves whose source stays in place: a slot that is a source is never written.
    LayerPlacement target = before;
    std::vector<char> kept(static_cast<std::size_t>(gpus * slots), 0);
    std::vector<Move> moves;
    for (int g = 0; g < gpus; ++g)
      for (int s = 0; s < slots; ++s) {
        if (kept[g * slots + s] || rng() % 2 == 0) continue;
        const int e = static_cast<int>(rng() % experts);
        if (target.holds(g, e)) continue;
        int src = -1;
        for (int p = 0; p < gpus * slots && src < 0; ++p)
          if (p / slots != g && before.slot(p / slots, p % slots) == e && target.slot(p / slots, p % slots) == e)
            src = p;
        if (src < 0) continue;
        kept[src] = 1;
        target.slot(g, s) = e;
        moves.push_back({e, src / slots, g, s});
        paired += 1;
      }
    std::vector<rt::Status> st(static_cast<std::size_t>(gpus));
    std::vector<std::thread> procs;
    for (int p = 0; p < gpus; ++p)
      procs.emplace_back([&, p] {
        rt::Ticket t;
        st[p] = w.engines[p]->submit(batch_of(moves, 10s), t);
        if (st[p].ok()) st[p] = t.wait_for(15s);
      });
    for (auto &t : procs)
      t.join();
    for (int p = 0; p < gpus; ++p)
      CHECK_MESSAGE(st[p].ok(), "seed ", seed, " process ", p, ": ", st[p].to_string());
    for (int g = 0; g < gpus; ++g)
      for (int s = 0; s < slots; ++s) {
        const int e = w.engines[g]->valid_expert(0, g, s);
        CHECK_MESSAGE(e == target.slot(g, s), "seed ", seed, " GPU ", g, " slot ", s);
        if (e != empty_slot)
          CHECK_MESSAGE(w.holds(g, s, e), "seed ", seed, " GPU ", g, " slot ", s, " holds wrong bytes for expert ", e);
      }
  }
  CHECK(paired > 20); // the instances did exercise paired transfers
}

TEST_CASE("a peer that never answers ends the wait timed_out at the batch deadline, naming the peer and the deadline") {
  std::mt19937_64 rng(7);
  World w;
  w.build(rng, 2, 1, 2, 1500ms);
  LayerPlacement p(2, 1, 2);
  p.slot(1, 0) = 1;
  w.set_resident(p);
  const std::vector<Move> moves{{1, 1, 0, 0}}; // GPU 1's expert 1 into GPU 0's slot
  rt::Ticket t;
  const auto t0 = std::chrono::steady_clock::now();
  REQUIRE(w.engines[0]->submit(batch_of(moves, 300ms), t).ok()); // process 1 never submits
  const rt::Status st = t.wait_for(5s);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(st.code() == rt::StatusCode::timed_out);
  CHECK(t.state() == rt::TicketState::timed_out);
  const std::string msg = st.to_string();
  CHECK_MESSAGE(msg.find("waiting on GPU 1") != std::string::npos, msg);
  CHECK_MESSAGE(msg.find("deadline 300 ms") != std::string::npos, msg);
  CHECK(waited < 1.2); // the batch's deadline, not the bridge's
  CHECK(w.engines[0]->valid_expert(0, 0, 0) == empty_slot);
  w.engines.clear();                    // waits for the bridge's own deadline on the group it still runs
  CHECK(w.bridges[0]->groups_run >= 1); // every group it was given ended before the engine went away
}

TEST_CASE("a bridge's error fails the batch naming the peer and the bridge's message") {
  std::mt19937_64 rng(8);
  World w;
  w.build(rng, 2, 2, 3, 5s, "injected: the link to rank 1 is down");
  LayerPlacement p(2, 2, 3);
  p.slot(1, 0) = 1;
  p.slot(1, 1) = 2;
  w.set_resident(p);
  const std::vector<Move> moves{{1, 1, 0, 0}, {2, 1, 0, 1}}; // only GPU 1 sends: its process is unaffected
  std::vector<rt::Status> st(2);
  std::vector<std::thread> procs;
  for (int q = 0; q < 2; ++q)
    procs.emplace_back([&, q] {
      rt::Ticket t;
      st[q] = w.engines[q]->submit(batch_of(moves, 5s), t);
      if (st[q].ok()) st[q] = t.wait_for(10s);
    });
  for (auto &t : procs)
    t.join();
  CHECK(st[0].code() == rt::StatusCode::device_error);
  const std::string msg = st[0].to_string();
  CHECK_MESSAGE(msg.find("paired transfer with GPU 1 failed") != std::string::npos, msg);
  CHECK_MESSAGE(msg.find("injected: the link to rank 1 is down") != std::string::npos, msg);
  CHECK_MESSAGE(st[1].ok(), st[1].to_string());
  CHECK(w.engines[0]->valid_expert(0, 0, 0) == empty_slot);
  CHECK(w.engines[0]->valid_expert(0, 0, 1) == empty_slot);
}

TEST_CASE("an abort on one process fails the others at once, naming the aborting GPU") {
  std::mt19937_64 rng(9);
  World w;
  w.build(rng, 3, 1, 3, 5s);
  LayerPlacement p(3, 1, 3);
  p.slot(1, 0) = 1;
  p.slot(2, 0) = 2;
  w.set_resident(p);
  const std::vector<Move> moves{{1, 1, 0, 0}}; // GPU 1 -> GPU 0; GPU 2 takes no part
  rt::HostEvent never;                         // process 1's slots never free up: it aborts instead
  rt::MoveBatch b1 = batch_of(moves, 5s);
  b1.slots_free.host = &never;
  rt::Ticket t0, t1, t2;
  const auto start = std::chrono::steady_clock::now();
  REQUIRE(w.engines[0]->submit(batch_of(moves, 5s), t0).ok());
  REQUIRE(w.engines[2]->submit(batch_of(moves, 5s), t2).ok());
  REQUIRE(w.engines[1]->submit(b1, t1).ok());
  std::this_thread::sleep_for(50ms);
  t1.abort();
  CHECK(t1.wait_for(5s).code() == rt::StatusCode::aborted);
  const rt::Status st = t0.wait_for(10s);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(st.code() == rt::StatusCode::device_error);
  CHECK_MESSAGE(st.to_string().find("GPU 1 sent no valid copy") != std::string::npos, st.to_string());
  CHECK(waited < 2.0); // well before the 5 s deadline
  CHECK(t2.wait_for(5s).ok());
  CHECK(w.engines[0]->valid_expert(0, 0, 0) == empty_slot);
}

TEST_CASE("a bridge and a host fabric together, or neither for a multi-process engine, are refused naming them") {
  rt::EngineOptions o;
  o.topology.num_nodes = 1;
  o.topology.gpus_per_node = 2;
  o.topology.slots_per_gpu = 1;
  o.num_experts = 2;
  o.tensors = {{0, 64}};
  o.peers.local_gpus = {0};
  std::unique_ptr<rt::TransferEngine> e;
  rt::Status st = rt::TransferEngine::create(o, e);
  CHECK(st.code() == rt::StatusCode::invalid_argument);
  CHECK_MESSAGE(st.to_string().find("peers.bridge") != std::string::npos, st.to_string());
  o.peers.bridge = std::make_shared<ThreadBridge>(std::make_shared<Board>(), 1s);
  o.peers.host_fabric = std::make_shared<rt::HostFabric>();
  st = rt::TransferEngine::create(o, e);
  CHECK(st.code() == rt::StatusCode::invalid_argument);
  CHECK_MESSAGE(st.to_string().find("peers.host_fabric and peers.bridge both given") != std::string::npos,
                st.to_string());
  o.peers.host_fabric = nullptr;
  CHECK(rt::TransferEngine::create(o, e).ok());
}

namespace {
// Per process: the telemetry of its batch, and its status.
struct Outcome {
  rt::Status status;
  std::vector<rt::MoveTelemetry> tel;
};
std::vector<Outcome> run_all(World &w, const std::vector<Move> &moves, int dst_buffer) {
  std::vector<Outcome> out(w.engines.size());
  std::vector<std::thread> procs;
  for (std::size_t p = 0; p < w.engines.size(); ++p)
    procs.emplace_back([&, p] {
      rt::MoveBatch b = batch_of(moves, 10s);
      b.dst_buffer = dst_buffer;
      rt::Ticket t;
      out[p].status = w.engines[p]->submit(b, t);
      if (!out[p].status.ok()) return;
      out[p].status = t.wait_for(20s);
      out[p].tel = t.telemetry();
    });
  for (auto &t : procs)
    t.join();
  return out;
}
// Whether the transfer plan of `engine`'s last batch carries move `i` over a GPU path (here: a paired transfer, as
// every process drives one GPU).
bool planned_over_gpu(const rt::TransferEngine &engine, int i) {
  for (const transfer::Chunk &c : engine.last_plan(0).chunks)
    if (c.move_idx == i && c.path != transfer::Path::pcie) return true;
  return false;
}
} // namespace

TEST_CASE("split regions over a bridge under injected faults: exact bytes, receivers fall back to their mirror") {
  int fallbacks = 0, paired_fallbacks = 0, verify_failures = 0, paired = 0, faultless_runs = 0;
  for (std::uint64_t seed = 1; seed <= 30 * static_cast<std::uint64_t>(foremoe_test::seed_multiplier()); ++seed) {
    INFO("seed ", seed);
    std::mt19937_64 rng(seed * 7919);
    World w;
    w.split = rng() % 4 != 0;
    w.mirror = true;
    w.num_buffers = rng() % 2 == 0 ? 2 : 1;
    w.opts.verify = rng() % 3 != 0;
    w.opts.max_attempts = 3;
    auto f = std::make_shared<rt::FaultSchedule>();
    f->seed = seed;
    const bool faultless = seed % 5 == 0;
    faultless_runs += faultless;
    if (!faultless) {
      f->fail_probability = std::uniform_real_distribution<double>(0, 0.3)(rng);
      f->corrupt_probability = w.opts.verify ? std::uniform_real_distribution<double>(0, 0.3)(rng) : 0.0;
    }
    w.faults = f;
    const int gpus = std::uniform_int_distribution<int>(2, 4)(rng),
              slots = std::uniform_int_distribution<int>(1, 3)(rng);
    const int experts = std::uniform_int_distribution<int>(slots, gpus * slots + 2)(rng);
    w.build(rng, gpus, slots, experts, 10s);
    LayerPlacement before(gpus, slots, experts);
    for (int g = 0; g < gpus; ++g)
      for (int s = 0; s < slots; ++s)
        if (const int e = static_cast<int>(rng() % experts); !before.holds(g, e) && rng() % 4 != 0)
          before.slot(g, s) = e;
    w.set_resident(before);
    // Moves from GPU copies that stay in place where there is one, else from the mirror.
    LayerPlacement target = before;
    std::vector<char> kept(static_cast<std::size_t>(gpus * slots), 0);
    std::vector<Move> moves;
    for (int g = 0; g < gpus; ++g)
      for (int s = 0; s < slots; ++s) {
        if (kept[g * slots + s] || rng() % 3 == 0) continue;
        const int e = static_cast<int>(rng() % experts);
        if (target.holds(g, e)) continue;
        int src = -1;
        for (int p = 0; p < gpus * slots && src < 0; ++p)
          if (p / slots != g && before.slot(p / slots, p % slots) == e && target.slot(p / slots, p % slots) == e)
            src = p;
        if (src >= 0) kept[src] = 1;
        target.slot(g, s) = e;
        moves.push_back({e, src < 0 ? host_mirror : src / slots, g, s});
      }
    const int dst_buffer = w.num_buffers == 2 ? static_cast<int>(rng() % 2) : 0;
    const std::vector<Outcome> out = run_all(w, moves, dst_buffer);
    for (int p = 0; p < gpus; ++p) {
      CHECK_MESSAGE((out[p].status.ok() || out[p].status.code() == rt::StatusCode::device_error), "process ", p, ": ",
                    out[p].status.to_string());
      REQUIRE(out[p].tel.size() == moves.size());
    }
    for (std::size_t i = 0; i < moves.size(); ++i) {
      const Move &m = moves[i];
      const rt::MoveTelemetry &mine = out[m.dst_gpu].tel[i];
      for (int p = 0; p < gpus; ++p)
        if (p != m.dst_gpu) // the destination's process counts verification and fallbacks
          CHECK((out[p].tel[i].remote && out[p].tel[i].verify_failures == 0 && !out[p].tel[i].fallback));
      CHECK(!mine.remote);
      const bool over_gpu = planned_over_gpu(*w.engines[m.dst_gpu], static_cast<int>(i));
      paired += over_gpu;
      if (mine.ok) {
        CHECK_MESSAGE(w.holds(m.dst_gpu, m.dst_slot, m.expert, dst_buffer), "move ", i, ": wrong bytes");
        CHECK(w.engines[m.dst_gpu]->valid_expert(0, m.dst_gpu, m.dst_slot) == m.expert);
      }
      if (mine.fallback) CHECK((mine.ok && mine.attempts > mine.num_chunks));
      if (!w.opts.verify) CHECK(mine.verify_failures == 0);
      if (faultless) CHECK((mine.ok && !mine.fallback && mine.verify_failures == 0));
      fallbacks += mine.fallback;
      paired_fallbacks += mine.fallback && over_gpu;
      verify_failures += mine.verify_failures;
    }
    for (int g = 0; g < gpus; ++g) {
      for (int s = 0; s < slots; ++s)
        if (const int e = w.engines[g]->valid_expert(0, g, s); e != empty_slot) {
          bool ok = false;
          for (int b = 0; b < w.num_buffers; ++b)
            ok = ok || w.holds(g, s, e, b);
          CHECK_MESSAGE(ok, "GPU ", g, " slot ", s, " valid for expert ", e, " with wrong bytes");
        }
      if (w.split) CHECK_MESSAGE(w.split_mem[g].guards_intact(), "GPU ", g, ": a byte outside the rows was written");
    }
  }
  MESSAGE(paired, " moves planned over paired transfers; ", fallbacks, " fell back to the mirror (", paired_fallbacks,
          " after a paired transfer), ", verify_failures, " received copies failed verification");
  CHECK(faultless_runs > 0);
  CHECK(paired > 10);
  CHECK(paired_fallbacks > 0); // the injector acts on bridged transfers, and receivers retry from the mirror
  CHECK(verify_failures > 0);
}

TEST_CASE("a receiver whose bridge fails takes the bytes from its node's mirror, and telemetry says so") {
  int fell_back = 0;
  for (std::uint64_t seed = 1; seed <= 10; ++seed) {
    INFO("seed ", seed);
    std::mt19937_64 rng(seed);
    World w;
    w.split = seed % 2 == 0;
    w.mirror = true;
    w.opts.verify = true;
    w.build(rng, 2, 3, 4, 5s, "bridge says no");
    LayerPlacement p(2, 3, 4);
    p.slot(1, 0) = 1;
    p.slot(1, 1) = 2;
    w.set_resident(p);
    const std::vector<Move> moves{{1, 1, 0, 0}, {2, 1, 0, 1}}; // GPU 1's experts into GPU 0 (which only receives)
    const std::vector<Outcome> out = run_all(w, moves, 0);
    REQUIRE_MESSAGE(out[0].status.ok(), out[0].status.to_string());
    REQUIRE_MESSAGE(out[1].status.ok(), out[1].status.to_string());
    for (int i = 0; i < 2; ++i) {
      const rt::MoveTelemetry &m = out[0].tel[static_cast<std::size_t>(i)];
      const bool over_gpu = planned_over_gpu(*w.engines[0], i);
      CHECK_MESSAGE((m.ok && m.verified && m.fallback == over_gpu && !m.remote), "move ", i, " over GPU ", over_gpu);
      CHECK(w.holds(0, i, moves[static_cast<std::size_t>(i)].expert));
      CHECK((out[1].tel[static_cast<std::size_t>(i)].remote && !out[1].tel[static_cast<std::size_t>(i)].fallback));
      fell_back += m.fallback;
    }
  }
  CHECK(fell_back > 0);
}

TEST_CASE("replica gradients of every dtype, packed or split, over a bridge: ordered sums, all or nothing") {
  const rt::GradType types[] = {rt::GradType::f32, rt::GradType::f64, rt::GradType::bf16, rt::GradType::f16};
  int applied_with_faults = 0, unapplied_with_faults = 0;
  for (std::uint64_t seed = 1; seed <= 24 * static_cast<std::uint64_t>(foremoe_test::seed_multiplier()); ++seed) {
    std::mt19937_64 rng(seed * 11 + 5);
    const rt::GradType type = types[seed % 4];
    const bool split = (seed / 4) % 2 == 1, faults = (seed / 8) % 3 == 1, select = (seed / 8) % 3 == 2;
    World w;
    if (faults) {
      auto f = std::make_shared<rt::FaultSchedule>();
      f->fail_probability = 0.25;
      f->seed = seed;
      w.faults = f;
    }
    const int gpus = std::uniform_int_distribution<int>(2, 4)(rng),
              slots = std::uniform_int_distribution<int>(2, 3)(rng);
    const int experts = std::uniform_int_distribution<int>(1, gpus * slots)(rng);
    w.build(rng, gpus, slots, experts, 5s);
    const int num_tensors = split ? static_cast<int>(w.opts.tensors.size()) : 1;
    foremoe_test::GradWorld gw;
    gw.build(rng, type, split, gpus, slots, num_tensors);
    std::vector<std::int32_t> owner;
    const LayerPlacement p = foremoe_test::random_owned(rng, gpus, slots, experts, owner);
    w.set_resident(p);
    for (int g = 0; g < gpus; ++g) { // each process registers its own GPU's gradients
      const rt::Status st = w.engines[g]->register_grads(0, g, gw.region(g), gw.layout);
      REQUIRE_MESSAGE(st.ok(), st.to_string());
    }
    std::vector<rt::ReplicaRef> returns;
    std::vector<std::int32_t> held(static_cast<std::size_t>(gpus) * experts, -1);
    for (int g = 0; g < gpus && select; ++g)
      for (int e = 0; e < experts; ++e)
        if (g != owner[e] && p.holds(g, e)) {
          if (rng() % 2 == 0)
            returns.push_back({g, e});
          else
            held[static_cast<std::size_t>(g) * experts + e] = owner[e];
        }
    const foremoe_test::GradWorld before = gw;
    rt::ReduceBatch b;
    b.owner_gpu = owner;
    b.timeout = 5s;
    b.select = select;
    b.returns = returns;
    b.held = held;
    const std::vector<rt::Status> st = foremoe_test::reduce_everywhere(w.engines, b);
    const std::string what =
        foremoe::detail::concat("seed ", seed, " ", rt::to_string(type), split ? " split" : " packed",
                                faults ? " faults" : "", select ? " select" : "");
    for (const rt::Status &s : st)
      CHECK_MESSAGE((s.ok() || faults), what, ": ", s.to_string());
    int unapplied = 0;
    const int applied = foremoe_test::check_reduced(gw, before, p, owner, faults, select, returns, what, &unapplied);
    if (faults) applied_with_faults += applied, unapplied_with_faults += unapplied;
  }
  CHECK(applied_with_faults > 0); // the fault schedule failed some experts' reductions, not all
  CHECK(unapplied_with_faults > 0);
}

TEST_CASE("a batch's small rounds reach the bridge as one post, and land as they did one by one") {
  for (std::uint64_t seed = 1; seed <= 5; ++seed) {
    std::mt19937_64 rng(seed);
    World w;
    w.opts.verify = seed % 2 == 0;
    w.build(rng, 2, 4, 4, 10s);
    LayerPlacement before(2, 4, 4);
    for (int e = 0; e < 4; ++e)
      before.slot(e / 2, e % 2) = e;
    w.set_resident(before);
    // Each GPU's two experts into the other's spare slots: at least two chunks each way, so several rounds.
    const std::vector<Move> moves{{0, 0, 1, 2}, {1, 0, 1, 3}, {2, 1, 0, 2}, {3, 1, 0, 3}};
    std::vector<rt::Status> st(2);
    std::vector<std::thread> procs;
    for (int p = 0; p < 2; ++p)
      procs.emplace_back([&, p] {
        rt::Ticket t;
        st[p] = w.engines[p]->submit(batch_of(moves, 10s), t);
        if (st[p].ok()) st[p] = t.wait_for(15s);
      });
    for (auto &t : procs)
      t.join();
    const int rounds = w.engines[0]->last_plan(0).num_rounds;
    REQUIRE(rounds >= 2);
    for (int p = 0; p < 2; ++p) {
      CHECK_MESSAGE(st[p].ok(), "seed ", seed, " process ", p, ": ", st[p].to_string());
      // Every round's groups together carry far less than the bridge transport's 1 MiB: one post, not one per round.
      CHECK_MESSAGE(w.bridges[p]->groups_run == 1, "seed ", seed, " process ", p, ": ", w.bridges[p]->groups_run,
                    " posts for ", rounds, " rounds");
      for (int s = 2; s < 4; ++s) {
        const int e = 2 * (1 - p) + s - 2;
        CHECK(w.engines[p]->valid_expert(0, p, s) == e);
        CHECK_MESSAGE(w.holds(p, s, e), "seed ", seed, " GPU ", p, " slot ", s);
      }
    }
  }
}
