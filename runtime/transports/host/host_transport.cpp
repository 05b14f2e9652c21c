// Host backend of the transfer engine: "device memory" is host memory and copies are memcpy on worker threads, one
// pool per path, so that CPU tests run the engine's real state machine with real concurrency.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "../../transport_util.hpp"
#include "foremoe/runtime/grad_add.hpp"
#include "host_fabric.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {
namespace {

class HostTransport final : public Transport {
public:
  HostTransport(int threads_per_path, std::shared_ptr<HostFabric::Impl> fabric) : fabric_(std::move(fabric)) {
    for (int p = 0; p < transfer::num_paths; ++p)
      for (int t = 0; t < threads_per_path; ++t)
        workers_.emplace_back([this, p] { work(p); });
  }
  ~HostTransport() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto &w : workers_)
      w.join();
    if (fabric_) fabric_->drop(this);
  }

  Status start(const CopyOp &op, std::uint64_t &handle) override {
    if (op.num_bytes < 0 || (op.num_bytes > 0 && (op.src == nullptr || op.dst == nullptr)))
      return {StatusCode::invalid_argument, "host transport: bad copy of " + std::to_string(op.num_bytes) + " bytes"};
    std::lock_guard lock(mu_);
    handle = next_++;
    ops_[handle] = Op{op, StatusCode::in_progress, 0.0, false};
    queue_[static_cast<int>(op.path)].push_back(handle);
    cv_.notify_all();
    return Status::success();
  }
  Status start_peer(std::span<PeerOp> ops, std::uint64_t &handle) override {
    if (!fabric_) return {StatusCode::unavailable, "host transport: no HostFabric joins this engine to others"};
    auto g = std::make_shared<HostFabric::Impl::Group>(static_cast<int>(ops.size()));
    {
      std::lock_guard lock(mu_);
      handle = next_++;
      groups_[handle] = g;
    }
    for (PeerOp &op : ops)
      fabric_->post(&op, g, this);
    return Status::success();
  }
  Status query(std::uint64_t handle, double &seconds) override {
    std::lock_guard lock(mu_);
    if (auto gi = groups_.find(handle); gi != groups_.end()) {
      HostFabric::Impl::Group &g = *gi->second;
      if (g.remaining.load(std::memory_order_acquire) > 0) return {StatusCode::in_progress, ""};
      seconds = std::chrono::duration<double>(g.t1 - g.t0).count();
      Status st = Status::success();
      {
        std::lock_guard glock(g.mu);
        if (!g.error.empty()) st = {StatusCode::device_error, g.error};
      }
      groups_.erase(gi);
      return st;
    }
    auto it = ops_.find(handle);
    if (it == ops_.end()) return {StatusCode::invalid_argument, "host transport: unknown copy handle"};
    if (it->second.code == StatusCode::in_progress) return {StatusCode::in_progress, ""};
    seconds = it->second.seconds;
    const StatusCode c = it->second.code;
    ops_.erase(it);
    return c == StatusCode::ok ? Status::success() : Status{c, "host copy failed"};
  }
  bool cancel(std::uint64_t handle) override {
    std::lock_guard lock(mu_);
    auto it = ops_.find(handle);
    if (it == ops_.end() || it->second.running) return false;
    auto &q = queue_[static_cast<int>(it->second.op.path)];
    for (auto qi = q.begin(); qi != q.end(); ++qi)
      if (*qi == handle) {
        q.erase(qi);
        ops_.erase(it);
        return true;
      }
    return false;
  }
  Status gate(const Gate &g, bool &ready) override {
    if (g.cuda_event != nullptr) return {StatusCode::invalid_argument, "host backend: a CUDA event cannot gate it"};
    ready = g.host == nullptr || g.host->is_set();
    return Status::success();
  }
  Status checksum(int, const std::byte *p, std::int64_t n, std::uint64_t &out) override {
    out = runtime::checksum({p, static_cast<std::size_t>(n)});
    return Status::success();
  }
  Status accumulate(int, void *dst, const void *src, std::int64_t n, GradType type) override {
    add_grads(dst, src, n, type);
    return Status::success();
  }
  Status zero(int, void *dst, std::int64_t num_bytes) override {
    std::memset(dst, 0, static_cast<std::size_t>(num_bytes));
    return Status::success();
  }
  Status alloc(int, std::int64_t n, std::byte *&out) override {
    out = new (std::nothrow) std::byte[static_cast<std::size_t>(n)];
    if (out == nullptr) return {StatusCode::internal, "host transport: out of memory for " + std::to_string(n)};
    return Status::success();
  }
  void free(int, std::byte *p) noexcept override { delete[] p; }
  Status alloc_flags(std::int64_t n, volatile std::uint32_t *&flags) override {
    flags = new (std::nothrow) std::uint32_t[static_cast<std::size_t>(n)]();
    if (flags == nullptr)
      return {StatusCode::internal, "host transport: out of memory for " + std::to_string(n) + " flags"};
    return Status::success();
  }
  void free_flags(volatile std::uint32_t *flags) noexcept override { delete[] const_cast<std::uint32_t *>(flags); }
  Status enqueue_wait(void *, volatile std::uint32_t *, std::uint32_t) override {
    return {StatusCode::unavailable, "enqueue_wait: the host backend has no streams; use wait()"};
  }

private:
  struct Op {
    CopyOp op;
    StatusCode code;
    double seconds;
    bool running;
  };
  void work(int path) {
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !queue_[path].empty(); });
      if (stop_) return;
      const std::uint64_t h = queue_[path].front();
      queue_[path].pop_front();
      Op &o = ops_.at(h);
      o.running = true;
      const CopyOp op = o.op;
      lock.unlock();
      const auto t0 = std::chrono::steady_clock::now();
      if (op.num_bytes > 0) std::memcpy(op.dst, op.src, static_cast<std::size_t>(op.num_bytes));
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      lock.lock();
      Op &done = ops_.at(h); // the map may have rehashed meanwhile
      done.seconds = secs;
      done.code = StatusCode::ok;
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::uint64_t next_ = 1;
  std::unordered_map<std::uint64_t, Op> ops_;
  std::unordered_map<std::uint64_t, std::shared_ptr<HostFabric::Impl::Group>> groups_;
  std::shared_ptr<HostFabric::Impl> fabric_;
  std::deque<std::uint64_t> queue_[transfer::num_paths];
  std::vector<std::thread> workers_;
};

} // namespace

void register_builtin_transport_host() {
  add_builtin_transport("host", [](const EngineOptions &opts, std::unique_ptr<Transport> &out) {
    out = std::make_unique<HostTransport>(opts.host_threads_per_path < 1 ? 1 : opts.host_threads_per_path,
                                          opts.peers.host_fabric ? opts.peers.host_fabric->impl() : nullptr);
    return Status::success();
  });
}

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
