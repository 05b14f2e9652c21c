// Paired transfers with GPUs of other processes: posted once per batch in submission order, one group per
// round, each carrying a header that names what it carries, whether the sender's copy is valid and its checksum.

#include <algorithm>
#include <initializer_list>
#include <string>

#include "engine.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {

std::byte *EngineImpl::scratch(TicketImpl &t, int gpu, std::int64_t need) {
  for (const TicketImpl::Scratch &s : t.scratch)
    if (s.gpu == gpu) return s.p;
  std::byte *p = nullptr;
  if (!pool_->take_block(gpu, need, p).ok()) return nullptr;
  t.scratch.push_back({gpu, need, p});
  return p;
}

// Posts the batch's paired transfers once it is the oldest batch of this engine with any, one group per round
// (moves) or one group (reduce). `discard`: the batch is abandoned; sends read and receives write scratch memory
// and every header says "not valid". Returns false while older batches have not posted theirs.
bool EngineImpl::post_peer(TicketImpl &t, bool discard) {
  {
    std::lock_guard lock(mu_);
    if (peer_order_.empty() || peer_order_.front() != &t) return false;
  }
  LayerState &ls = layers_[t.layer];
  const int slots = opts_.topology.slots_per_gpu;
  std::vector<int> group_of;
  // `tag` names what the bytes are (both sides compute it): a receiver accepts only its own tag, so batches
  // that differ between processes fail instead of landing the wrong expert.
  auto add = [&](bool send, int local, int peer, std::byte *buf, std::int64_t n, bool valid, std::uint64_t sum,
                 int item, int group, std::uint64_t tag) {
    PeerOp op;
    op.send = send;
    op.local_gpu = local;
    op.peer_gpu = peer;
    op.buf = buf;
    op.num_bytes = n;
    op.header[0] = send && valid ? tag : 0;
    op.header[1] = send && valid ? sum : 0;
    op.fault_key = mix64(t.serial) ^ tag;
    t.peer_ops.push_back(op);
    t.peer_item.push_back(item);
    t.peer_tag.push_back(tag);
    group_of.push_back(group);
  };
  auto tag_of = [&](std::initializer_list<std::int64_t> v) {
    std::uint64_t h = mix64(static_cast<std::uint64_t>(t.layer));
    for (std::int64_t x : v)
      h = mix64(h ^ static_cast<std::uint64_t>(x));
    return h | 1; // never 0, which says "not valid"
  };
  std::int64_t biggest = 0;
  if (t.kind == TicketImpl::Kind::moves) {
    for (std::size_t i = 0; i < t.chunks.size(); ++i) {
      ChunkRun &cr = t.chunks[i];
      if (cr.role != Role::send && cr.role != Role::recv) continue;
      const transfer::Chunk &c = cr.c;
      MoveRun &mr = t.moves[c.move_idx];
      const bool send = cr.role == Role::send;
      bool valid = false;
      Site site;
      if (send) {
        std::lock_guard lock(mu_);
        valid = ls.resident.slot(c.src_gpu, c.src_slot) == c.expert;
        site = slot_site(c.src_gpu, c.src_slot, ls.buffer[c.src_gpu * slots + c.src_slot]);
      } else {
        site = slot_site(c.dst_gpu, c.dst_slot, t.dst_buffer);
      }
      if (send && valid && opts_.verify && !mr.have_send_sum && !discard) {
        valid = expert_sum(ls, site, mr.send_sum).ok();
        mr.have_send_sum = valid;
      }
      for_each_piece(c, [&](int ti, std::int64_t lo, std::int64_t hi) {
        biggest = std::max(biggest, hi - lo);
        add(send, send ? c.src_gpu : c.dst_gpu, send ? c.dst_gpu : c.src_gpu, at(ls, site, ti, lo - prefix_[ti]),
            hi - lo, valid && !discard, mr.send_sum, static_cast<int>(i), c.round,
            tag_of({c.expert, c.src_gpu, c.src_slot, c.dst_gpu, c.dst_slot, lo, hi}));
      });
    }
  } else {
    for (std::size_t i = 0; i < t.reduces.size(); ++i) {
      ReduceRun &r = t.reduces[i];
      if (r.role != Role::send && r.role != Role::recv) continue;
      const bool send = r.role == Role::send;
      bool valid = false;
      if (send) {
        std::lock_guard lock(mu_);
        valid = ls.resident.slot(r.gpu, r.slot) == r.expert;
      }
      // Verification: every operation of the gradient carries its checksum (all tensors), checked on the owner.
      std::uint64_t sum = 0;
      if (send && valid && opts_.verify && !discard) valid = grad_sum(ls, r, false, sum).ok();
      // One paired transfer per gradient tensor; the packed float32 layout keeps its tag of before, other layouts
      // name the tensor and the type too (processes registering different layouts fail rather than mix bytes).
      const GradLayout &gl = ls.grad_layout;
      const bool plain = gl.type == GradType::f32 && gl.tensor_bytes.size() == 1;
      r.copy.pending = 0;
      for (std::size_t ti = 0; ti < gl.tensor_bytes.size(); ++ti) {
        const std::int64_t n = gl.tensor_bytes[ti];
        std::byte *buf = send ? ls.grad_at(r.gpu, r.slot, ti) : r.staging + ls.grad_offset[ti];
        biggest = std::max(biggest, n);
        add(send, send ? r.gpu : r.owner, send ? r.owner : r.gpu, buf, n, valid && !discard, sum, static_cast<int>(i),
            0,
            plain ? tag_of({-1, r.expert, r.gpu, r.slot, r.owner, n})
                  : tag_of({-2, r.expert, r.gpu, r.slot, r.owner, n, static_cast<std::int64_t>(ti),
                            static_cast<std::int64_t>(gl.type), static_cast<std::int64_t>(gl.tensor_bytes.size())}));
      }
    }
  }
  for (int item : t.peer_item)
    if (t.kind == TicketImpl::Kind::moves)
      ++t.chunks[item].pending;
    else
      ++t.reduces[item].copy.pending;
  if (discard)
    for (PeerOp &op : t.peer_ops) {
      std::byte *p = scratch(t, op.local_gpu, biggest);
      if (p != nullptr && (op.send || t.kind == TicketImpl::Kind::moves)) op.buf = p;
    }
  // One group per round, at most `max_group` operations each (NCCL limits the calls in one group; splitting a
  // group does not change the pairing, which follows posting order).
  constexpr std::size_t max_group = 512;
  for (std::size_t i = 0; i < t.peer_ops.size();) {
    std::size_t j = i;
    while (j < t.peer_ops.size() && group_of[j] == group_of[i] && j - i < max_group)
      ++j;
    TicketImpl::PeerGroup g;
    g.begin = i;
    g.end = j;
    g.status = transport_->start_peer(std::span<PeerOp>(t.peer_ops.data() + i, j - i), g.handle);
    g.pending = g.status.ok();
    t.peer_groups.push_back(g);
    i = j;
  }
  transport_->flush_peer();
  t.peer_posted = true;
  t.peer_outstanding.store(true, std::memory_order_release);
  {
    std::lock_guard lock(mu_);
    peer_order_.pop_front();
  }
  poll_peer(t);
  return true;
}

// Collects finished groups and hands their outcome to chunks or reductions (unless the batch already ended).
void EngineImpl::poll_peer(TicketImpl &t) {
  bool pending = false;
  for (TicketImpl::PeerGroup &g : t.peer_groups) {
    if (g.pending) {
      double secs = 0;
      Status st = transport_->query(g.handle, secs);
      if (st.code() == StatusCode::in_progress) {
        pending = true;
        continue;
      }
      g.pending = false;
      g.status = st;
    } else if (g.end == g.begin) {
      continue;
    }
    // Outcome of every op of the group, once (dropped when the batch already ended).
    for (std::size_t k = g.begin; k < g.end && !t.finished(); ++k) {
      const PeerOp &op = t.peer_ops[k];
      const bool ok = g.status.ok() && (op.send || op.header[0] == t.peer_tag[k]);
      if (!ok && t.peer_error.empty()) {
        if (!g.status.ok())
          t.peer_error =
              foremoe::detail::concat("paired transfer with GPU ", op.peer_gpu, " failed: ", g.status.to_string());
        else if (op.header[0] == 0)
          t.peer_error = foremoe::detail::concat("GPU ", op.peer_gpu, " sent no valid copy (its process aborted ",
                                                 "or timed out the batch, or did not hold the expert)");
        else
          t.peer_error = foremoe::detail::concat("GPU ", op.peer_gpu, " sent other bytes than this process expects ",
                                                 "(did every process submit the same batches?)");
      }
      if (t.kind == TicketImpl::Kind::moves) {
        ChunkRun &cr = t.chunks[t.peer_item[k]];
        const bool waiting = cr.waiting_for_peer(); // not when given up (drained) meanwhile
        if (!ok && waiting) cr.piece_failed();
        if (!op.send && ok && opts_.verify) {
          MoveRun &mr = t.moves[cr.c.move_idx];
          if (!mr.have_sum) mr.src_sum = op.header[1], mr.have_sum = true;
        }
        if (--cr.pending == 0 && waiting) cr.pairs_ended();
      } else {
        ReduceRun &r = t.reduces[t.peer_item[k]];
        const bool waiting = r.copy.waiting_for_peer(); // not when given up (drained) meanwhile
        if (!ok && waiting) r.copy.piece_failed();
        if (!op.send && ok && opts_.verify && !r.have_sum) r.src_sum = op.header[1], r.have_sum = true;
        if (r.copy.pending > 0 && --r.copy.pending == 0 && waiting) r.copy.pairs_ended();
      }
    }
    g.end = g.begin; // consumed
  }
  if (!pending && t.peer_posted) t.peer_outstanding.store(false, std::memory_order_release);
}

std::string EngineImpl::peer_waiting(const TicketImpl &t) {
  std::vector<int> peers;
  for (const TicketImpl::PeerGroup &g : t.peer_groups)
    if (g.pending)
      for (std::size_t k = g.begin; k < g.end; ++k)
        if (std::find(peers.begin(), peers.end(), t.peer_ops[k].peer_gpu) == peers.end())
          peers.push_back(t.peer_ops[k].peer_gpu);
  if (peers.empty()) return "";
  std::sort(peers.begin(), peers.end());
  std::string out = "; paired transfers still waiting on ";
  for (std::size_t i = 0; i < peers.size(); ++i)
    out += foremoe::detail::concat(i ? ", " : "", "GPU ", peers[i]);
  return out + " (other processes)";
}

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
