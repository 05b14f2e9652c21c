// Paired transfers over an embedder's PeerBridge: a decorator of any transport that hands each peer group to the
// bridge and forwards everything else, so the engine's pairing, headers, deadlines and telemetry stay unchanged.

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "forwarding_transport.hpp"
#include "transport_util.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {
namespace {

class BridgeTransport final : public ForwardingTransport {
public:
  BridgeTransport(std::unique_ptr<Transport> inner, std::shared_ptr<PeerBridge> bridge)
      : ForwardingTransport(std::move(inner)), bridge_(std::move(bridge)), state_(std::make_shared<State>()) {}
  // The bridge may still run groups of batches that ended (abort, deadline): their operations point into this
  // engine's memory, so the transport (and the engine's pools) stay until each group reported `done`, which the
  // bridge's contract bounds in time.
  ~BridgeTransport() override {
    post_held(); // the engine flushes every burst; nothing is left here unless it was destroyed mid-burst
    std::unique_lock lock(state_->mu);
    state_->cv.wait(lock, [&] { return state_->running == 0; });
  }

  // Each bridge post costs a fixed round trip (a hand-off to the embedder's worker, one post and one finish; the
  // gloo bridge: about a millisecond on a loaded 2-core machine), which dominates small moves. So consecutive
  // groups of one burst (`flush_peer`) that lie next to each other in memory (one batch's rounds) travel as one
  // post while together they carry at most `merge_bytes`; a larger group goes alone, at once. Posting order, and
  // so the pairing, is the same; each group still answers `query` with its own status (a merged post's outcome
  // is every member's). 1 MiB: an assumption (above it a round's own transfer time hides the round trip),
  // measured with `python/bench/bench_bridge_moves.py` (CHANGELOG).
  static constexpr std::int64_t merge_bytes = std::int64_t{1} << 20;

  Status start_peer(std::span<PeerOp> ops, std::uint64_t &handle) override {
    {
      std::lock_guard lock(state_->mu);
      handle = next_++ | peer_bit;
      state_->groups[handle] = Group{};
      ++state_->running;
    }
    std::int64_t bytes = 0;
    for (const PeerOp &op : ops)
      bytes += op.num_bytes;
    if (!held_.empty() && (held_ops_.data() + held_ops_.size() != ops.data() || held_bytes_ + bytes > merge_bytes))
      post_held();
    held_ops_ = held_.empty() ? ops : std::span<PeerOp>(held_ops_.data(), held_ops_.size() + ops.size());
    held_.push_back(handle);
    held_bytes_ += bytes;
    if (held_bytes_ >= merge_bytes) post_held();
    return Status::success();
  }
  void flush_peer() override { post_held(); }
  bool set_peer_waker(const std::function<void()> &wake) override {
    std::lock_guard lock(state_->mu);
    state_->wake = wake;
    return true;
  }
  Status query(std::uint64_t handle, double &seconds) override {
    if ((handle & peer_bit) == 0) return inner().query(handle, seconds);
    std::lock_guard lock(state_->mu);
    auto it = state_->groups.find(handle);
    if (it == state_->groups.end()) return {StatusCode::invalid_argument, "bridge: unknown peer group handle"};
    if (!it->second.done) return {StatusCode::in_progress, ""};
    seconds = std::chrono::duration<double>(it->second.t1 - it->second.t0).count();
    Status st = std::move(it->second.status);
    state_->groups.erase(it);
    return st;
  }

  Status start(const CopyOp &op, std::uint64_t &handle) override {
    Status st = inner().start(op, handle);
    if (st.ok() && (handle & peer_bit) != 0)
      return {StatusCode::internal, "bridge: the inner transport's copy handle uses the bridge's bit"};
    return st;
  }
  bool cancel(std::uint64_t handle) override { return (handle & peer_bit) == 0 && inner().cancel(handle); }

private:
  // Hands the held groups to the bridge as one post (progress thread; `done` may run on this thread, so no lock
  // is held here).
  void post_held() {
    if (held_.empty()) return;
    std::vector<std::uint64_t> handles;
    handles.swap(held_);
    const std::span<PeerOp> ops = held_ops_;
    held_ops_ = {};
    held_bytes_ = 0;
    bridge_->post(ops, [state = state_, handles = std::move(handles)](const Status &st) {
      {
        std::lock_guard lock(state->mu);
        const auto t1 = std::chrono::steady_clock::now();
        for (const std::uint64_t handle : handles) {
          auto it = state->groups.find(handle);
          if (it != state->groups.end() && !it->second.done) {
            it->second.done = true;
            it->second.status = st;
            it->second.t1 = t1;
            --state->running;
          }
        }
        if (state->wake) state->wake(); // under the lock: the engine withdraws it under the same lock
      }
      state->cv.notify_all();
    });
  }

  static constexpr std::uint64_t peer_bit = std::uint64_t{1} << 63;
  struct Group {
    bool done = false;
    Status status;
    std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now(), t1{};
  };
  // Shared with the `done` callbacks, which may outlive a call into the bridge.
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::unordered_map<std::uint64_t, Group> groups;
    int running = 0;
    std::function<void()> wake; // the engine's progress thread (`set_peer_waker`)
  };
  std::shared_ptr<PeerBridge> bridge_;
  std::shared_ptr<State> state_;
  std::uint64_t next_ = 1; // under state_->mu
  // Groups of the current burst not yet handed to the bridge (progress thread only): their handles, their
  // operations (adjacent in memory, so one span) and bytes.
  std::vector<std::uint64_t> held_;
  std::span<PeerOp> held_ops_;
  std::int64_t held_bytes_ = 0;
};

} // namespace

std::unique_ptr<Transport> make_bridge_transport(std::unique_ptr<Transport> inner, std::shared_ptr<PeerBridge> bridge) {
  return std::make_unique<BridgeTransport>(std::move(inner), std::move(bridge));
}

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
