// The host fabric: pairs sends and receives between GPUs of different engines in posting order and copies the bytes
// and the header when both sides are posted, so the multi-process protocol runs, and is tested, on one CPU.

#include "host_fabric.hpp"

#include <cstring>

#include "foremoe/core/error.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime {

HostFabric::HostFabric() : impl_(std::make_shared<Impl>()) {}

void HostFabric::Impl::complete(Group &g, const std::string &error) {
  if (!error.empty()) {
    std::lock_guard lock(g.mu);
    if (g.error.empty()) g.error = error;
  }
  if (g.remaining.load(std::memory_order_relaxed) == 1) g.t1 = std::chrono::steady_clock::now();
  g.remaining.fetch_sub(1, std::memory_order_acq_rel);
}

void HostFabric::Impl::post(PeerOp *op, const std::shared_ptr<Group> &g, const void *owner) {
  const std::pair<int, int> key =
      op->send ? std::pair{op->local_gpu, op->peer_gpu} : std::pair{op->peer_gpu, op->local_gpu};
  std::lock_guard lock(mu_);
  auto &mine = op->send ? sends_[key] : recvs_[key];
  auto &theirs = op->send ? recvs_[key] : sends_[key];
  if (theirs.empty()) {
    mine.push_back({op, g, owner});
    return;
  }
  Pending other = theirs.front();
  theirs.pop_front();
  PeerOp *s = op->send ? op : other.op;
  PeerOp *r = op->send ? other.op : op;
  std::string error;
  if (s->num_bytes != r->num_bytes) {
    error = foremoe::detail::concat("GPU ", key.first, " -> GPU ", key.second, ": sent ", s->num_bytes,
                                    " bytes, the receiver expected ", r->num_bytes,
                                    " (did every process submit the same batches?)");
  } else {
    if (s->num_bytes > 0) std::memcpy(r->buf, s->buf, static_cast<std::size_t>(s->num_bytes));
    r->header[0] = s->header[0];
    r->header[1] = s->header[1];
  }
  complete(*g, error);
  complete(*other.group, error);
}

void HostFabric::Impl::drop(const void *owner) {
  std::lock_guard lock(mu_);
  for (auto *m : {&sends_, &recvs_})
    for (auto &[key, q] : *m)
      std::erase_if(q, [&](const Pending &p) { return p.owner == owner; });
}

} // namespace runtime
} // namespace v0
} // namespace foremoe
