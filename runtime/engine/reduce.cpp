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

// One copy per gradient tensor (packed: one), each into its place in the staging concatenation.
void EngineImpl::issue_reduce(TicketImpl &t, ReduceRun &r, double now_s) {
  LayerState &ls = layers_[t.layer];
  ++r.copy.attempts;
  if (r.start < 0) r.start = now_s;
  if (opts_.verify && !r.have_sum) r.have_sum = grad_sum(ls, r, false, r.src_sum).ok();
  r.copy.handles.clear();
  r.copy.to(ChunkState::copying);
  for (std::size_t ti = 0; ti < ls.grad_layout.tensor_bytes.size(); ++ti) {
    CopyOp op;
    op.path = r.copy.c.path;
    op.src_gpu = r.gpu;
    op.dst_gpu = r.owner;
    op.src = ls.grad_at(r.gpu, r.slot, ti);
    op.dst = r.staging + ls.grad_offset[ti];
    op.num_bytes = ls.grad_layout.tensor_bytes[ti];
    // Tensor 0's key is the packed layout's (the same fault decisions as before split regions).
    op.fault_key = mix64(t.serial) ^
                   mix64(0xabcdull + (static_cast<std::uint64_t>(r.expert) << 24) +
                         (static_cast<std::uint64_t>(r.gpu) << 8) + r.copy.attempts) ^
                   (ti == 0 ? 0 : mix64(0x7e45ull + ti));
    std::uint64_t h = 0;
    bool started = false;
    spared([&] { started = transport_->start(op, h).ok(); });
    if (started)
      r.copy.handles.push_back(h);
    else
      r.copy.piece_failed();
  }
  r.copy.pending = r.copy.handles.size();
}

// Whether reduction `r`'s staged copy holds the bytes its source checksummed (always true without `verify`); a
// copy that does not is counted in `verify_rounds`.
bool EngineImpl::staged_verifies(const LayerState &ls, ReduceRun &r) {
  if (!opts_.verify) return true;
  std::uint64_t got = 0;
  const bool ok = r.have_sum && grad_sum(ls, r, true, got).ok() && got == r.src_sum;
  if (!ok) ++r.verify_rounds;
  return ok;
}

void EngineImpl::step_reduce(TicketImpl &t, double now_s) {
  if (t.has_peer && !t.peer_posted) spared([&] { post_peer(t, t.draining); });
  LayerState &ls = layers_[t.layer];
  bool in_flight = false;
  for (ReduceRun &r : t.reduces) {
    if (!r.copy.in_flight()) continue;
    if (r.role != Role::local) {
      if (r.copy.waiting_for_peer() && !t.draining) {
        in_flight = true;
        continue;
      }
      if (r.copy.waiting_for_peer()) {
        r.copy.to(ChunkState::lost);
      } else if (r.copy.state == ChunkState::arrived && r.role == Role::recv && !staged_verifies(ls, r)) {
        // Wrong bytes from another process: nothing of its expert is added (no second exchange to retry on).
        r.copy.to(ChunkState::failed);
        if (t.peer_error.empty())
          t.peer_error = foremoe::detail::concat("the replica gradient of expert ", r.expert, " from GPU ", r.gpu,
                                                 " did not verify (checksum mismatch); nothing of it was added");
      } else {
        r.copy.take_arrival();
      }
      r.end = now_s;
      continue;
    }
    if (t.draining)
      for (std::uint64_t &h : r.copy.handles)
        if (h != 0 && transport_->cancel(h)) h = 0, --r.copy.pending, r.copy.piece_failed();
    if (!poll(r.copy)) {
      in_flight = true;
      continue;
    }
    if (r.copy.state == ChunkState::landed && staged_verifies(ls, r)) {
      r.end = now_s;
      continue;
    }
    if (r.copy.state == ChunkState::landed) r.copy.to(ChunkState::failed); // wrong bytes: copy it again
    if (!t.draining && r.copy.attempts < opts_.max_attempts) {
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
  const GradLayout &gl = ls.grad_layout;
  const std::int64_t esize = grad_type_bytes(gl.type);
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
          for (std::size_t ti = 0; ti < gl.tensor_bytes.size(); ++ti)
            if (!transport_
                     ->accumulate(r.owner, ls.grad_at(r.owner, r.owner_slot, ti), r.staging + ls.grad_offset[ti],
                                  gl.tensor_bytes[ti] / esize, gl.type)
                     .ok())
              ok = false;
        }
      for (std::size_t k = i; k < j; ++k)
        t.reduces[k].ok = ok;
    }
    // Held-gradient rule: a returned gradient restarts from zero on its (local) replica GPU.
    for (std::size_t k = i; k < j; ++k) {
      ReduceRun &r = t.reduces[k];
      if (!r.zero || !r.ok || !local_[r.gpu]) continue;
      for (std::size_t ti = 0; ti < gl.tensor_bytes.size() && r.ok; ++ti)
        r.ok = transport_->zero(r.gpu, ls.grad_at(r.gpu, r.slot, ti), gl.tensor_bytes[ti]).ok();
    }
    i = j;
  }
  end(t);
}

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
