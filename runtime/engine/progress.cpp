// The progress thread: gates and ordering between batches, issuing and polling chunk copies, path switches.

#include <algorithm>

#include "engine.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {

void EngineImpl::run() {
  std::unique_lock lock(mu_);
  for (;;) {
    // Stopping: every batch ended. With a bridge (`PeerOptions::bridge`) also every paired transfer was posted
    // (an ended batch's on scratch memory, so that the other processes' matching operations fail at once, naming
    // this one, instead of waiting for their deadline) and reported done (its operations point into this engine),
    // which the bridge's own deadline bounds.
    const bool bridged = opts_.peers.bridge != nullptr;
    if (stopping_ && std::all_of(active_.begin(), active_.end(),
                                 [&](const auto &t) { return bridged ? !t->busy() : t->finished(); }))
      return;
    if (active_.empty()) {
      cv_.wait(lock, [&] { return stopping_ || !active_.empty(); });
      continue;
    }
    std::vector<std::shared_ptr<TicketImpl>> batch = active_;
    kicked_ = false; // a wake-up from here on ends the sleep below at once
    lock.unlock();
    bool sleep = peer_wakes_;
    for (auto &t : batch) {
      step(*t);
      sleep = sleep && waits_for_peers_only(*t);
    }
    lock.lock();
    std::erase_if(active_, [](const auto &t) { return !t->busy(); });
    if (active_.empty()) continue;
    if (sleep)
      cv_.wait_for(lock, peer_sleep, [&] { return kicked_ || stopping_; });
    else
      cv_.wait_for(lock, poll_interval);
  }
}

bool EngineImpl::waits_for_peers_only(const TicketImpl &t) const {
  if (t.finished()) return !t.has_peer || t.peer_posted; // an ended batch only collects its posted groups
  if (!t.gated || t.draining || (t.has_peer && !t.peer_posted)) return false;
  if (t.kind == TicketImpl::Kind::moves)
    return std::all_of(t.chunks.begin(), t.chunks.end(),
                       [](const ChunkRun &cr) { return !cr.in_flight() || cr.waiting_for_peer(); });
  return std::all_of(t.reduces.begin(), t.reduces.end(),
                     [](const ReduceRun &r) { return !r.copy.in_flight() || r.copy.waiting_for_peer(); });
}

bool EngineImpl::issue(TicketImpl &t, ChunkRun &cr, int move_idx) {
  LayerState &ls = layers_[t.layer];
  const transfer::Chunk &c = cr.c;
  Site src;
  {
    std::lock_guard lock(mu_);
    if (c.path != transfer::Path::pcie && ls.resident.slot(c.src_gpu, c.src_slot) != c.expert) {
      // Multi-process: planned there, but its move failed here. Fails at once; the retry takes the other path.
      ++cr.attempts;
      ++t.moves[move_idx].attempts;
      cr.handles.clear();
      cr.pending = 0;
      cr.to(ChunkState::copying_bad); // no pieces: the next poll ends it failed
      return false;
    }
    src = c.path == transfer::Path::pcie
              ? mirror_site(c.dst_gpu, c.expert)
              : slot_site(c.src_gpu, c.src_slot, ls.buffer[c.src_gpu * opts_.topology.slots_per_gpu + c.src_slot]);
  }
  const Site dst = slot_site(c.dst_gpu, c.dst_slot, t.dst_buffer);
  cr.handles.clear();
  cr.to(ChunkState::copying);
  cr.seconds = 0.0;
  ++cr.attempts;
  ++t.moves[move_idx].attempts;
  for_each_piece(c, [&](int ti, std::int64_t lo, std::int64_t hi) {
    CopyOp op;
    op.path = c.path;
    op.src_gpu = c.path == transfer::Path::pcie ? -1 : c.src_gpu;
    op.dst_gpu = c.dst_gpu;
    op.src = at(ls, src, ti, lo - prefix_[ti]);
    op.dst = at(ls, dst, ti, lo - prefix_[ti]);
    op.num_bytes = hi - lo;
    op.fault_key = mix64(t.serial) ^
                   mix64((static_cast<std::uint64_t>(move_idx) << 20) ^ static_cast<std::uint64_t>(lo)) ^
                   mix64(static_cast<std::uint64_t>(cr.attempts) * 131 + static_cast<std::uint64_t>(c.path));
    std::uint64_t h = 0;
    if (!transport_->start(op, h).ok()) {
      cr.piece_failed();
      return;
    }
    cr.handles.push_back(h);
  });
  cr.pending = cr.handles.size();
  return true;
}

bool EngineImpl::poll(ChunkRun &cr) {
  for (std::uint64_t &h : cr.handles) {
    if (h == 0) continue;
    double secs = 0;
    const Status st = transport_->query(h, secs);
    if (st.code() == StatusCode::in_progress) continue;
    if (!st.ok()) cr.piece_failed();
    cr.seconds += secs;
    h = 0;
    --cr.pending;
  }
  if (cr.pending != 0) return false;
  cr.pieces_ended();
  return true;
}

bool EngineImpl::switch_path(const TicketImpl &t, ChunkRun &cr, const MoveRun &mr) const {
  transfer::Chunk &c = cr.c;
  const bool was_peer = cr.role != Role::local;
  if (c.path != transfer::Path::pcie && t.host_mirror) {
    cr.fell_back = true;
    c.path = transfer::Path::pcie;
    c.src_gpu = host_mirror;
    c.src_slot = -1;
  } else if ((c.path == transfer::Path::pcie || was_peer) && mr.gpu_src >= 0) {
    cr.fell_back = false;
    c.src_gpu = mr.gpu_src;
    c.src_slot = mr.gpu_src_slot;
    c.path = opts_.topology.node_of(mr.gpu_src) == opts_.topology.node_of(c.dst_gpu) ? transfer::Path::nvlink
                                                                                     : transfer::Path::network;
  } else if (was_peer) {
    return false;
  }
  cr.role = Role::local;
  return true;
}

Status EngineImpl::expert_sum(const LayerState &ls, const Site &where, std::uint64_t &out) {
  out = 0;
  const int device = where.mirror ? -1 : where.gpu; // the mirror is host memory
  for (std::size_t ti = 0; ti < opts_.tensors.size(); ++ti) {
    std::uint64_t s = 0;
    if (Status st =
            transport_->checksum(device, at(ls, where, static_cast<int>(ti), 0), opts_.tensors[ti].num_bytes, s);
        !st.ok())
      return st;
    out += s * (2 * ti + 1);
  }
  return Status::success();
}

Status EngineImpl::grad_sum(const LayerState &ls, const ReduceRun &r, bool staged, std::uint64_t &out) {
  out = 0;
  const GradLayout &gl = ls.grad_layout;
  for (std::size_t ti = 0; ti < gl.tensor_bytes.size(); ++ti) {
    std::uint64_t s = 0;
    const std::byte *p = staged ? r.staging + ls.grad_offset[ti] : ls.grad_at(r.gpu, r.slot, ti);
    if (Status st = transport_->checksum(staged ? r.owner : r.gpu, p, gl.tensor_bytes[ti], s); !st.ok()) return st;
    out += s * (2 * ti + 1);
  }
  return Status::success();
}

void EngineImpl::step(TicketImpl &t) {
  if (t.finished()) {
    // An ended batch still posts its paired transfers in turn (on scratch memory) and collects them.
    if (t.has_peer && !t.peer_posted) {
      // A reduction's transfers stay spared by the fault injector (`FaultSchedule::spare_reductions`) here too.
      if (t.kind == TicketImpl::Kind::reduce)
        spared([&] { post_peer(t, true); });
      else
        post_peer(t, true);
    } else if (t.peer_outstanding.load(std::memory_order_relaxed))
      poll_peer(t);
    return;
  }
  if (t.peer_posted && t.peer_outstanding.load(std::memory_order_relaxed)) poll_peer(t);
  const double now_s = std::chrono::duration<double>(clock::now() - t.t0).count();
  if (!t.draining && (t.abort_requested || clock::now() > t.deadline)) {
    t.draining = true;
    t.drain_reason = t.abort_requested ? StatusCode::aborted : StatusCode::timed_out;
  }
  if (!t.gated) {
    if (t.draining) return end(t); // its paired transfers are still posted, in turn, on scratch memory
    for (auto &a : t.after)
      if (a->busy()) return;
    for (const Gate &g : t.gates) {
      bool ready = false;
      if (Status st = transport_->gate(g, ready); !st.ok()) {
        t.final_status = st;
        t.draining = true;
        t.drain_reason = st.code();
        return end(t);
      }
      if (!ready) return;
    }
    t.gated = true;
    if (t.kind == TicketImpl::Kind::moves)
      start_moves(t, now_s);
    else
      start_reduce(t, now_s);
    return;
  }
  if (t.kind == TicketImpl::Kind::moves)
    step_moves(t, now_s);
  else
    step_reduce(t, now_s);
}

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
