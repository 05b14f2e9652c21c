#pragma once
// The base of the in-tree transport decorators (internal): every operation goes to the wrapped transport, and a
// decorator overrides only what it changes (the bridge: paired transfers; the fault injector: copies and paired
// transfers).

#include <functional>
#include <memory>
#include <span>

#include "foremoe/runtime/transport.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {

class ForwardingTransport : public Transport {
public:
  explicit ForwardingTransport(std::unique_ptr<Transport> inner) : inner_(std::move(inner)) {}

  Status start(const CopyOp &op, std::uint64_t &handle) override { return inner_->start(op, handle); }
  Status query(std::uint64_t handle, double &seconds) override { return inner_->query(handle, seconds); }
  bool cancel(std::uint64_t handle) override { return inner_->cancel(handle); }
  Status gate(const Gate &g, bool &ready) override { return inner_->gate(g, ready); }
  Status checksum(int gpu, const std::byte *p, std::int64_t n, std::uint64_t &out) override {
    return inner_->checksum(gpu, p, n, out);
  }
  Status accumulate(int gpu, void *dst, const void *src, std::int64_t n, GradType type) override {
    return inner_->accumulate(gpu, dst, src, n, type);
  }
  Status zero(int gpu, void *dst, std::int64_t num_bytes) override { return inner_->zero(gpu, dst, num_bytes); }
  Status alloc(int gpu, std::int64_t n, std::byte *&out) override { return inner_->alloc(gpu, n, out); }
  void free(int gpu, std::byte *p) noexcept override { inner_->free(gpu, p); }
  Status alloc_flags(std::int64_t n, volatile std::uint32_t *&flags) override { return inner_->alloc_flags(n, flags); }
  void free_flags(volatile std::uint32_t *flags) noexcept override { inner_->free_flags(flags); }
  Status enqueue_wait(void *stream, volatile std::uint32_t *flag, std::uint32_t value) override {
    return inner_->enqueue_wait(stream, flag, value);
  }
  Status start_peer(std::span<PeerOp> ops, std::uint64_t &handle) override { return inner_->start_peer(ops, handle); }
  void flush_peer() override { inner_->flush_peer(); }
  bool set_peer_waker(const std::function<void()> &wake) override { return inner_->set_peer_waker(wake); }
  std::int64_t resources_created() const noexcept override { return inner_->resources_created(); }

protected:
  /// The wrapped transport.
  [[nodiscard]] Transport &inner() const noexcept { return *inner_; }

private:
  std::unique_ptr<Transport> inner_;
};

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
