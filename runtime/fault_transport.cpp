// Fault-injecting decorator of a transport: fails, delays or truncates chunks by a seeded schedule. Truncation drops
// a copy's last byte while reporting success, which only verification can catch.

#include <chrono>
#include <mutex>
#include <span>
#include <unordered_map>

#include "foremoe/runtime/testing.hpp"
#include "forwarding_transport.hpp"
#include "transport_util.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {
namespace {

class FaultTransport final : public ForwardingTransport, public FaultControl {
public:
  FaultTransport(std::unique_ptr<Transport> inner, std::shared_ptr<const FaultSchedule> f, bool host_memory)
      : ForwardingTransport(std::move(inner)), f_(std::move(f)), host_memory_(host_memory) {}

  void spare(bool on) noexcept override {
    std::lock_guard lock(mu_);
    spare_ = on;
  }

  Status start(const CopyOp &op, std::uint64_t &handle) override {
    std::lock_guard lock(mu_);
    if (spare_) { // forwarded as it is, under a handle of this transport
      Pending p;
      p.op = op;
      if (Status st = inner().start(p.op, p.inner); !st.ok()) return st;
      p.started = true;
      handle = next_++;
      ops_[handle] = p;
      return Status::success();
    }
    handle = next_++;
    Pending p;
    p.op = op;
    const bool drawn = !f_->paired_only; // a copy of this process's own
    if (f_->fail_path[static_cast<int>(op.path)] || (drawn && draw(op.fault_key, fail) < f_->fail_probability)) {
      p.failed = true;
    } else {
      if (drawn && draw(op.fault_key, corrupt) < f_->corrupt_probability && p.op.num_bytes > 0) --p.op.num_bytes;
      if (drawn && draw(op.fault_key, delay) < f_->delay_probability)
        p.release = std::chrono::steady_clock::now() + std::chrono::microseconds(f_->delay_us);
      else if (Status st = inner().start(p.op, p.inner); !st.ok())
        return st;
      else
        p.started = true;
    }
    ops_[handle] = p;
    return Status::success();
  }
  // Paired operations are always posted (skipping one would shift the pairing of everything after it); faults
  // act on what the group reports: a failure, one flipped byte in received host bytes, or a late completion.
  Status start_peer(std::span<PeerOp> ops, std::uint64_t &handle) override {
    std::uint64_t inner_handle = 0;
    if (Status st = inner().start_peer(ops, inner_handle); !st.ok()) return st;
    std::lock_guard lock(mu_);
    handle = next_++;
    PeerPending p;
    p.inner = inner_handle;
    p.ops = ops;
    p.spared = spare_;
    peer_[handle] = p;
    return Status::success();
  }
  // A delayed group ends later than its inner group woke the engine: with delays drawn, it is polled.
  bool set_peer_waker(const std::function<void()> &wake) override {
    return inner().set_peer_waker(wake) && !(f_->delay_probability > 0);
  }
  Status query(std::uint64_t handle, double &seconds) override {
    std::lock_guard lock(mu_);
    if (auto pi = peer_.find(handle); pi != peer_.end()) {
      PeerPending &p = pi->second;
      if (!p.landed) {
        Status st = inner().query(p.inner, seconds);
        if (st.code() == StatusCode::in_progress) return st;
        p.landed = true;
        p.result = st;
        p.seconds = seconds;
        for (PeerOp &op : p.spared ? std::span<PeerOp>{} : p.ops) {
          if (draw(op.fault_key, fail) < f_->fail_probability && p.result.ok())
            p.result = {StatusCode::device_error, "injected peer transfer failure"};
          if (!op.send && host_memory_ && op.num_bytes > 0 && draw(op.fault_key, corrupt) < f_->corrupt_probability)
            op.buf[op.num_bytes - 1] ^= std::byte{0x5a};
          if (draw(op.fault_key, delay) < f_->delay_probability)
            p.release = std::chrono::steady_clock::now() + std::chrono::microseconds(f_->delay_us);
        }
      }
      if (std::chrono::steady_clock::now() < p.release) return {StatusCode::in_progress, ""};
      seconds = p.seconds;
      Status st = p.result;
      peer_.erase(pi);
      return st;
    }
    auto it = ops_.find(handle);
    if (it == ops_.end()) return {StatusCode::invalid_argument, "fault transport: unknown copy handle"};
    Pending &p = it->second;
    if (p.failed) {
      ops_.erase(it);
      return {StatusCode::device_error, "injected copy failure"};
    }
    if (!p.started) {
      if (std::chrono::steady_clock::now() < p.release) return {StatusCode::in_progress, ""};
      if (Status st = inner().start(p.op, p.inner); !st.ok()) {
        ops_.erase(it);
        return st;
      }
      p.started = true;
    }
    Status st = inner().query(p.inner, seconds);
    if (st.code() != StatusCode::in_progress) ops_.erase(it);
    return st;
  }
  bool cancel(std::uint64_t handle) override {
    std::lock_guard lock(mu_);
    auto it = ops_.find(handle);
    if (it == ops_.end()) return false;
    if (it->second.started && !inner().cancel(it->second.inner)) return false;
    ops_.erase(it);
    return true;
  }

private:
  static constexpr FaultDecision fail = FaultDecision::fail, corrupt = FaultDecision::corrupt,
                                 delay = FaultDecision::delay;
  [[nodiscard]] double draw(std::uint64_t key, FaultDecision d) const noexcept { return fault_draw(*f_, key, d); }
  struct Pending {
    CopyOp op;
    std::uint64_t inner = 0;
    bool failed = false, started = false;
    std::chrono::steady_clock::time_point release{};
  };
  struct PeerPending {
    std::uint64_t inner = 0;
    std::span<PeerOp> ops;
    bool landed = false, spared = false;
    Status result;
    double seconds = 0.0;
    std::chrono::steady_clock::time_point release{};
  };
  std::shared_ptr<const FaultSchedule> f_;
  bool host_memory_ = false;
  bool spare_ = false; // FaultControl::spare
  std::unordered_map<std::uint64_t, PeerPending> peer_;
  std::mutex mu_;
  std::uint64_t next_ = 1;
  std::unordered_map<std::uint64_t, Pending> ops_;
};

} // namespace
} // namespace runtime::detail

namespace runtime {
double fault_draw(const FaultSchedule &f, std::uint64_t key, FaultDecision d) noexcept {
  using detail::mix64;
  return static_cast<double>(mix64(mix64(f.seed ^ mix64(key)) + static_cast<std::uint64_t>(d)) >> 11) * 0x1.0p-53;
}

std::uint64_t fault_key(std::span<const std::uint64_t> identity) noexcept {
  std::uint64_t h = 0;
  for (const std::uint64_t x : identity)
    h = detail::mix64(h ^ x);
  return h;
}

std::unique_ptr<Transport> make_fault_transport(std::unique_ptr<Transport> inner,
                                                std::shared_ptr<const FaultSchedule> faults, bool host_memory) {
  return std::make_unique<detail::FaultTransport>(std::move(inner), std::move(faults), host_memory);
}

} // namespace runtime
} // namespace v0
} // namespace foremoe
