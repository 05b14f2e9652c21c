// Paired transfers over an embedder's PeerBridge: a decorator of any transport that hands each peer group to the
// bridge and forwards everything else, so the engine's pairing, headers, deadlines and telemetry stay unchanged.

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <unordered_map>

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
    std::unique_lock lock(state_->mu);
    state_->cv.wait(lock, [&] { return state_->running == 0; });
  }

  Status start_peer(std::span<PeerOp> ops, std::uint64_t &handle) override {
    {
      std::lock_guard lock(state_->mu);
      handle = next_++ | peer_bit;
      state_->groups[handle] = Group{};
      ++state_->running;
    }
    // `done` may run on this thread (a bridge that fails at once), so no lock is held here.
    bridge_->post(ops, [state = state_, handle](Status st) {
      {
        std::lock_guard lock(state->mu);
        auto it = state->groups.find(handle);
        if (it != state->groups.end() && !it->second.done) {
          it->second.done = true;
          it->second.status = std::move(st);
          it->second.t1 = std::chrono::steady_clock::now();
          --state->running;
        }
      }
      state->cv.notify_all();
    });
    return Status::success();
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
  };
  std::shared_ptr<PeerBridge> bridge_;
  std::shared_ptr<State> state_;
  std::uint64_t next_ = 1; // under state_->mu
};

} // namespace

std::unique_ptr<Transport> make_bridge_transport(std::unique_ptr<Transport> inner, std::shared_ptr<PeerBridge> bridge) {
  return std::make_unique<BridgeTransport>(std::move(inner), std::move(bridge));
}

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
