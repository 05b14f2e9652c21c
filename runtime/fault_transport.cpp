// Fault-injecting decorator of a transport: fails, delays or truncates chunks by a seeded schedule. Truncation drops
// a copy's last byte while reporting success, which only verification can catch.

#include <chrono>
#include <mutex>
#include <unordered_map>

#include "transport.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {
namespace {

class FaultTransport final : public Transport {
public:
  FaultTransport(std::unique_ptr<Transport> inner, std::shared_ptr<const FaultSchedule> f)
      : inner_(std::move(inner)), f_(std::move(f)) {}

  Status start(const CopyOp &op, std::uint64_t &handle) override {
    const std::uint64_t h = mix64(f_->seed ^ mix64(op.fault_key));
    auto uniform = [](std::uint64_t x) { return static_cast<double>(x >> 11) * 0x1.0p-53; };
    std::lock_guard lock(mu_);
    handle = next_++;
    Pending p;
    p.op = op;
    if (f_->fail_path[static_cast<int>(op.path)] || uniform(mix64(h + 1)) < f_->fail_probability) {
      p.failed = true;
    } else {
      if (uniform(mix64(h + 2)) < f_->corrupt_probability && p.op.num_bytes > 0) --p.op.num_bytes;
      if (uniform(mix64(h + 3)) < f_->delay_probability)
        p.release = std::chrono::steady_clock::now() + std::chrono::microseconds(f_->delay_us);
      else if (Status st = inner_->start(p.op, p.inner); !st.ok())
        return st;
      else
        p.started = true;
    }
    ops_[handle] = p;
    return Status::success();
  }
  Status query(std::uint64_t handle, double &seconds) override {
    std::lock_guard lock(mu_);
    auto it = ops_.find(handle);
    if (it == ops_.end()) return {StatusCode::invalid_argument, "fault transport: unknown copy handle"};
    Pending &p = it->second;
    if (p.failed) {
      ops_.erase(it);
      return {StatusCode::device_error, "injected copy failure"};
    }
    if (!p.started) {
      if (std::chrono::steady_clock::now() < p.release) return {StatusCode::in_progress, ""};
      if (Status st = inner_->start(p.op, p.inner); !st.ok()) {
        ops_.erase(it);
        return st;
      }
      p.started = true;
    }
    Status st = inner_->query(p.inner, seconds);
    if (st.code() != StatusCode::in_progress) ops_.erase(it);
    return st;
  }
  bool cancel(std::uint64_t handle) override {
    std::lock_guard lock(mu_);
    auto it = ops_.find(handle);
    if (it == ops_.end()) return false;
    if (it->second.started && !inner_->cancel(it->second.inner)) return false;
    ops_.erase(it);
    return true;
  }
  Status gate(const Gate &g, bool &ready) override { return inner_->gate(g, ready); }
  Status checksum(int gpu, const std::byte *p, std::int64_t n, std::uint64_t &out) override {
    return inner_->checksum(gpu, p, n, out);
  }
  Status accumulate(int gpu, float *dst, const float *src, std::int64_t n) override {
    return inner_->accumulate(gpu, dst, src, n);
  }
  Status alloc(int gpu, std::int64_t n, std::byte *&out) override { return inner_->alloc(gpu, n, out); }
  void free(int gpu, std::byte *p) noexcept override { inner_->free(gpu, p); }
  Status alloc_flag(volatile std::uint32_t *&flag) override { return inner_->alloc_flag(flag); }
  void free_flag(volatile std::uint32_t *flag) noexcept override { inner_->free_flag(flag); }
  Status enqueue_wait(void *stream, volatile std::uint32_t *flag) override {
    return inner_->enqueue_wait(stream, flag);
  }

private:
  struct Pending {
    CopyOp op;
    std::uint64_t inner = 0;
    bool failed = false, started = false;
    std::chrono::steady_clock::time_point release{};
  };
  std::unique_ptr<Transport> inner_;
  std::shared_ptr<const FaultSchedule> f_;
  std::mutex mu_;
  std::uint64_t next_ = 1;
  std::unordered_map<std::uint64_t, Pending> ops_;
};

} // namespace

std::unique_ptr<Transport> make_fault_transport(std::unique_ptr<Transport> inner,
                                                std::shared_ptr<const FaultSchedule> faults) {
  return std::make_unique<FaultTransport>(std::move(inner), std::move(faults));
}

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
