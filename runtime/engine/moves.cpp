// A move batch: destinations invalidated, chunks issued and retried, moves verified and published.

#include "engine.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {

void EngineImpl::start_moves(TicketImpl &t, double now_s) {
  LayerState &ls = layers_[t.layer];
  const int slots = opts_.topology.slots_per_gpu;
  {
    // The destinations now hold partial bytes: not valid until their move ends (a double buffer keeps the old
    // copy valid in the other buffer).
    std::lock_guard lock(mu_);
    for (std::size_t i = 0; i < t.plan.moves.size(); ++i) {
      const Move &m = t.plan.moves[i];
      if (t.moves[i].remote) continue;
      const int p = m.dst_gpu * slots + m.dst_slot;
      if (ls.buffer[p] == t.dst_buffer || ls.slots[m.dst_gpu].num_buffers == 1)
        ls.resident.slot(m.dst_gpu, m.dst_slot) = empty_slot;
    }
  }
  if (opts_.verify)
    for (std::size_t i = 0; i < t.moves.size(); ++i) {
      const Move &m = t.plan.moves[i];
      MoveRun &mr = t.moves[i];
      if (mr.remote) continue;
      Site src;
      if (t.host_mirror) {
        src = mirror_site(m.dst_gpu, m.expert);
      } else if (mr.gpu_src >= 0) {
        std::unique_lock lock(mu_);
        if (ls.resident.slot(mr.gpu_src, mr.gpu_src_slot) != m.expert) {
          mr.gpu_src = -1; // planned there but not valid here (multi-process): no sum, no retry source
          continue;
        }
        lock.unlock();
        src = slot_site(mr.gpu_src, mr.gpu_src_slot, ls.buffer[mr.gpu_src * slots + mr.gpu_src_slot]);
      } else {
        continue; // only another process holds it: its sender's header carries the checksum
      }
      if (!expert_sum(ls, src, mr.src_sum).ok()) mr.failed = true;
      mr.have_sum = true;
    }
  for (ChunkRun &cr : t.chunks) {
    MoveRun &mr = t.moves[cr.c.move_idx];
    if (cr.role == Role::none) {
      cr.to(ChunkState::skipped);
      continue;
    }
    if (mr.start < 0) mr.start = now_s;
    if (cr.role != Role::local) {
      // Waits for its paired transfer; `pending` counts its ops until they are posted.
      cr.to(ChunkState::paired);
      cr.pending = 0;
      ++cr.attempts;
      ++mr.attempts;
      continue;
    }
    if (mr.failed) continue;
    issue(t, cr, cr.c.move_idx);
  }
  step_moves(t, now_s);
}

void EngineImpl::step_moves(TicketImpl &t, double now_s) {
  if (t.has_peer && !t.peer_posted) post_peer(t, t.draining);
  LayerState &ls = layers_[t.layer];
  const int slots = opts_.topology.slots_per_gpu;
  bool in_flight = false;
  for (ChunkRun &cr : t.chunks) {
    MoveRun &mr = t.moves[cr.c.move_idx];
    if (!cr.in_flight()) continue;
    if (cr.role == Role::local) {
      if (t.draining)
        for (std::uint64_t &h : cr.handles)
          if (h != 0 && transport_->cancel(h)) h = 0, --cr.pending, cr.piece_failed();
      if (!poll(cr)) {
        in_flight = true;
        continue;
      }
    } else {
      if (cr.waiting_for_peer() && t.draining) {
        // Paired transfers cannot be cancelled: the chunk is lost, and the batch stays busy (its slots locked)
        // until the transfer ends.
        cr.to(ChunkState::lost);
        mr.failed = true;
        continue;
      }
      if (cr.waiting_for_peer()) {
        in_flight = true;
        continue;
      }
      cr.take_arrival();
    }
    if (cr.state == ChunkState::landed) {
      mr.path_bytes[static_cast<int>(cr.c.path)] += cr.c.num_bytes;
      continue;
    }
    if (cr.role == Role::send || t.draining || mr.failed || cr.attempts >= opts_.max_attempts ||
        !switch_path(t, cr, mr)) {
      cr.to(ChunkState::lost);
      mr.failed = true;
      continue;
    }
    cr.to(ChunkState::idle);
    issue(t, cr, cr.c.move_idx);
    in_flight = true;
  }
  // Moves whose chunks all landed: verify, then publish the copy.
  for (std::size_t i = 0; i < t.moves.size(); ++i) {
    MoveRun &mr = t.moves[i];
    if (mr.finished) continue;
    bool all_done = true, busy = false;
    for (int ci : mr.chunk_idx)
      all_done = all_done && t.chunks[ci].done(), busy = busy || t.chunks[ci].in_flight();
    if (busy) continue;
    if (mr.failed || (t.draining && !all_done)) {
      mr.failed = true;
      mr.finished = true;
      mr.end = now_s;
      continue;
    }
    if (!all_done) continue;
    if (mr.remote) {
      mr.finished = true;
      mr.end = now_s;
      continue;
    }
    const Move &m = t.plan.moves[i];
    if (opts_.verify) {
      std::uint64_t got = 0;
      const bool read = expert_sum(ls, slot_site(m.dst_gpu, m.dst_slot, t.dst_buffer), got).ok();
      if (!read || !mr.have_sum || got != mr.src_sum) {
        // Wrong bytes: copy the whole expert again over the other path, while attempts remain.
        ++mr.verify_rounds;
        bool again = !t.draining && mr.verify_rounds < opts_.max_attempts;
        for (int ci : mr.chunk_idx)
          again = again && (t.chunks[ci].role == Role::local || switch_path(t, t.chunks[ci], mr));
        if (!again) {
          mr.failed = mr.finished = true;
          mr.end = now_s;
          continue;
        }
        for (int ci : mr.chunk_idx) {
          ChunkRun &cr = t.chunks[ci];
          cr.to(ChunkState::idle);
          switch_path(t, cr, mr);
          issue(t, cr, static_cast<int>(i));
        }
        in_flight = true;
        continue;
      }
      mr.checked = true;
    }
    mr.finished = true;
    mr.end = now_s;
    std::lock_guard lock(mu_);
    ls.resident.slot(m.dst_gpu, m.dst_slot) = m.expert;
    ls.buffer[m.dst_gpu * slots + m.dst_slot] = static_cast<std::uint8_t>(t.dst_buffer);
  }
  bool all_finished = true;
  for (const MoveRun &mr : t.moves)
    all_finished = all_finished && mr.finished;
  if (all_finished && !in_flight) end(t);
}

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
