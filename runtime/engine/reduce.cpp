// Replica gradients: staged on the owner GPU, then added in a fixed order, all or nothing per expert; under the
// held-gradient rule (`ReduceBatch::select`) each returned replica gradient is then zeroed.

#include "engine.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {

void EngineImpl::start_reduce(TicketImpl &t, double now_s) {
  for (ReduceRun &r : t.reduces) {
    if (r.start < 0) r.start = now_s;
    if (r.role == Role::local)
      issue_reduce(t, r, now_s);
    else if (r.role == Role::none)
      r.copy.to(ChunkState::skipped);
    else
      r.copy.to(ChunkState::paired), ++r.copy.attempts;
  }
  step_reduce(t, now_s);
}

void EngineImpl::issue_reduce(TicketImpl &t, ReduceRun &r, double now_s) {
  LayerState &ls = layers_[t.layer];
  const SlotRegion &g = ls.grads[r.gpu];
  CopyOp op;
  op.path = r.copy.c.path;
  op.src_gpu = r.gpu;
  op.dst_gpu = r.owner;
  op.src = static_cast<const std::byte *>(g.base) + r.slot * g.slot_stride_bytes;
  op.dst = r.staging;
  op.num_bytes = ls.grad_bytes;
  ++r.copy.attempts;
  op.fault_key = mix64(t.serial) ^ mix64(0xabcdull + (static_cast<std::uint64_t>(r.expert) << 24) +
                                         (static_cast<std::uint64_t>(r.gpu) << 8) + r.copy.attempts);
  if (r.start < 0) r.start = now_s;
  r.copy.handles.assign(1, 0);
  r.copy.to(ChunkState::copying);
  if (!transport_->start(op, r.copy.handles[0]).ok()) {
    r.copy.handles.clear();
    r.copy.piece_failed();
  }
  r.copy.pending = r.copy.handles.size();
}

void EngineImpl::step_reduce(TicketImpl &t, double now_s) {
  if (t.has_peer && !t.peer_posted) post_peer(t, t.draining);
  bool in_flight = false;
  for (ReduceRun &r : t.reduces) {
    if (!r.copy.in_flight()) continue;
    if (r.role != Role::local) {
      if (r.copy.waiting_for_peer() && !t.draining) {
        in_flight = true;
        continue;
      }
      if (r.copy.waiting_for_peer())
        r.copy.to(ChunkState::lost);
      else
        r.copy.take_arrival();
      r.end = now_s;
      continue;
    }
    if (t.draining && !r.copy.handles.empty() && r.copy.handles[0] != 0 && transport_->cancel(r.copy.handles[0]))
      r.copy.handles[0] = 0, --r.copy.pending, r.copy.piece_failed();
    if (!poll(r.copy)) {
      in_flight = true;
      continue;
    }
    if (r.copy.state == ChunkState::landed) {
      r.end = now_s;
    } else if (!t.draining && r.copy.attempts < opts_.max_attempts) {
      r.copy.to(ChunkState::idle);
      issue_reduce(t, r, now_s);
      in_flight = true;
    } else {
      r.copy.to(ChunkState::lost);
      r.end = now_s;
    }
  }
  if (in_flight) return;
  // Every staging copy ended: add each expert's replicas into a local owner, in replica order, all or nothing.
  LayerState &ls = layers_[t.layer];
  const std::int64_t n = ls.grad_bytes / 4;
  for (std::size_t i = 0; i < t.reduces.size();) {
    std::size_t j = i;
    bool ok = true;
    for (; j < t.reduces.size() && t.reduces[j].expert == t.reduces[i].expert; ++j)
      ok = ok && t.reduces[j].copy.done();
    if (!local_[t.reduces[i].owner]) {
      for (std::size_t k = i; k < j; ++k) // another process adds them; sends report their own outcome
        t.reduces[k].ok = t.reduces[k].copy.done();
    } else {
      if (ok)
        for (std::size_t k = i; k < j; ++k) {
          const ReduceRun &r = t.reduces[k];
          const SlotRegion &og = ls.grads[r.owner];
          auto *dst =
              reinterpret_cast<float *>(static_cast<std::byte *>(og.base) + r.owner_slot * og.slot_stride_bytes);
          if (!transport_->accumulate(r.owner, dst, reinterpret_cast<const float *>(r.staging), n).ok()) ok = false;
        }
      for (std::size_t k = i; k < j; ++k)
        t.reduces[k].ok = ok;
    }
    // Held-gradient rule: a returned gradient restarts from zero on its (local) replica GPU.
    for (std::size_t k = i; k < j; ++k) {
      ReduceRun &r = t.reduces[k];
      if (!r.zero || !r.ok || !local_[r.gpu]) continue;
      const SlotRegion &rg = ls.grads[r.gpu];
      auto *src = reinterpret_cast<float *>(static_cast<std::byte *>(rg.base) + r.slot * rg.slot_stride_bytes);
      r.ok = transport_->zero(r.gpu, src, n).ok();
    }
    i = j;
  }
  end(t);
}

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
