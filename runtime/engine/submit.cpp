// Submitting a batch: checks, transfer planning, slot hazards between batches, the ticket.

#include <algorithm>

#include "engine.hpp"
#include "foremoe/runtime/node_mirror.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {

Status EngineImpl::submit(const MoveBatch &b, Ticket &out, std::shared_ptr<TicketImpl> &made) {
  if (Status st = check_layer(b.layer, "submit"); !st.ok()) return st;
  if (b.timeout.count() <= 0) return bad("submit: timeout must be positive, got ", b.timeout.count(), " ms");
  const Topology &topo = opts_.topology;
  const int slots = topo.slots_per_gpu;
  for (;;) {
    auto t = std::make_shared<TicketImpl>();
    t->kind = TicketImpl::Kind::moves;
    t->layer = b.layer;
    t->dst_buffer = b.dst_buffer;
    transfer::Options popt = opts_.planning;
    LayerPlacement view;
    std::vector<char> registered(static_cast<std::size_t>(topo.num_gpus()), 0); // per GPU: slots registered
    std::uint64_t generation = 0;
    {
      std::lock_guard lock(mu_);
      LayerState &ls = layers_[b.layer];
      // Every local GPU a chunk may write must be registered.
      for (const Move &m : b.moves) {
        if (m.dst_gpu < 0 || m.dst_gpu >= topo.num_gpus())
          return bad("submit: move of expert ", m.expert, " targets GPU ", m.dst_gpu);
        if (!local_[m.dst_gpu]) continue;
        if (!is_registered(ls.slots[m.dst_gpu]))
          return bad("submit: layer ", b.layer, " GPU ", m.dst_gpu, " has no registered slots");
        if (b.dst_buffer < 0 || b.dst_buffer >= ls.slots[m.dst_gpu].num_buffers)
          return bad("submit: dst_buffer ", b.dst_buffer, " but GPU ", m.dst_gpu, " has ",
                     ls.slots[m.dst_gpu].num_buffers, " buffers per slot");
      }
      // A move never overwrites a slot whose replica still holds its gradient (every process checks every move).
      for (const Move &m : b.moves)
        if (m.dst_slot >= 0 && m.dst_slot < slots)
          if (Status st =
                  check_not_held("submit", b.layer, spmd_ ? ls.planned : ls.resident, m.dst_gpu, m.dst_slot, m.expert);
              !st.ok())
            return st;
      if (spmd_) {
        // Every process must derive the same chunks: plan on the placement as planned, whatever has landed yet. A
        // source still being written is waited for (slot hazards below), and one whose move failed sends a header
        // saying so.
        view = ls.planned;
        if (popt.host_mirror)
          for (const Move &m : b.moves) {
            if (!local_[m.dst_gpu]) continue;
            const int nd = topo.node_of(m.dst_gpu);
            if (!is_registered(ls.mirrors[nd]))
              return bad("submit: planning.host_mirror is set but node ", nd, " has no registered mirror for layer ",
                         b.layer, " (multi-process use declares the mirrors of every node)");
            if (const NodeMirror *nm = ls.mirrors[nd].node_mirror; nm != nullptr && nm->stale())
              return bad("submit: node ", nd, "'s mirror of layer ", b.layer, " (", nm->name(),
                         ") is stale: generation ", nm->generation(), ", this rank's last ", nm->seen_generation(),
                         " (refresh it on every local rank, or submit with planning.host_mirror off)");
          }
      } else {
        // Planning sees only copies no other batch is writing.
        std::vector<char> written(static_cast<std::size_t>(ls.resident.num_slots()), 0);
        for (auto &a : active_)
          if (a->layer == b.layer && a->kind == TicketImpl::Kind::moves && a->busy())
            for (int p : a->touched)
              written[p] = 1;
        view = ls.resident;
        for (int g = 0; g < topo.num_gpus(); ++g)
          for (int s = 0; s < slots; ++s)
            if (written[static_cast<std::size_t>(g) * slots + s] || !is_registered(ls.slots[g]))
              view.slot(g, s) = empty_slot;
        // A node-shared mirror under refresh (or missed by this rank) is no source: GPU-direct only.
        bool all_mirrors = true;
        for (const Move &m : b.moves) {
          const MirrorRegion &mr = ls.mirrors[topo.node_of(m.dst_gpu)];
          all_mirrors = all_mirrors && is_registered(mr) && (mr.node_mirror == nullptr || !mr.node_mirror->stale());
        }
        popt.host_mirror = popt.host_mirror && all_mirrors;
      }
      for (int g = 0; g < topo.num_gpus(); ++g)
        registered[g] = is_registered(ls.slots[g]);
      generation = ls.generation;
    }
    // Planning runs outside the lock the progress thread needs. A submit, registration or set_resident on the layer
    // meanwhile changes what planning may read (the generation): the batch is then planned again.
    try {
      t->plan = transfer::plan_transfers(b.moves, view, topo, popt);
    } catch (const Error &err) {
      return {StatusCode::invalid_argument, std::string("submit: ") + err.what()};
    }
    for (const transfer::Chunk &c : t->plan.chunks)
      if (c.path != transfer::Path::pcie && local_[c.src_gpu] && !registered[c.src_gpu])
        return bad("submit: layer ", b.layer, " GPU ", c.src_gpu, " holds a source of expert ", c.expert,
                   " but has no registered slots");
    for (const Move &m : b.moves)
      if (local_[m.dst_gpu]) t->touched.push_back(m.dst_gpu * slots + m.dst_slot);
    std::sort(t->touched.begin(), t->touched.end()); // searched below: a retry source is never a slot it writes
    t->moves.resize(b.moves.size());
    for (std::size_t i = 0; i < b.moves.size(); ++i) {
      MoveRun &mr = t->moves[i];
      const Move &m = b.moves[i];
      mr.remote = !local_[m.dst_gpu];
      if (mr.remote) continue;
      // A local GPU source for retries: any copy that stays in place, in the node first.
      int best = -1, best_slot = -1;
      for (int g = 0; g < topo.num_gpus(); ++g)
        for (int s = 0; s < slots; ++s)
          if (g != m.dst_gpu && local_[g] && registered[g] && view.slot(g, s) == m.expert &&
              !std::binary_search(t->touched.begin(), t->touched.end(), g * slots + s)) {
            const bool same_node = topo.node_of(g) == topo.node_of(m.dst_gpu);
            if (!same_node && !popt.allow_network) continue;
            if (best < 0 || (same_node && topo.node_of(best) != topo.node_of(m.dst_gpu))) best = g, best_slot = s;
          }
      mr.gpu_src = best;
      mr.gpu_src_slot = best_slot;
      if (best >= 0) t->reads.push_back(best * slots + best_slot);
    }
    t->chunks.reserve(t->plan.chunks.size());
    for (const transfer::Chunk &c : t->plan.chunks) {
      t->moves[c.move_idx].chunk_idx.push_back(static_cast<int>(t->chunks.size()));
      ChunkRun cr;
      cr.c = c;
      const bool dst_local = local_[c.dst_gpu];
      if (c.path == transfer::Path::pcie) {
        cr.role = dst_local ? Role::local : Role::none;
      } else {
        const bool src_local = local_[c.src_gpu];
        cr.role = dst_local && src_local ? Role::local : dst_local ? Role::recv : src_local ? Role::send : Role::none;
        if (src_local) t->reads.push_back(c.src_gpu * slots + c.src_slot);
      }
      t->has_peer = t->has_peer || cr.role == Role::send || cr.role == Role::recv;
      t->chunks.push_back(std::move(cr));
    }
    std::sort(t->reads.begin(), t->reads.end());
    t->reads.erase(std::unique(t->reads.begin(), t->reads.end()), t->reads.end());
    std::lock_guard lock(mu_);
    LayerState &ls = layers_[b.layer];
    if (ls.generation != generation) continue;
    ++ls.generation;
    t->after = overlapping(b.layer, t->touched, t->reads);
    if (spmd_)
      for (const Move &m : b.moves) {
        ls.planned.slot(m.dst_gpu, m.dst_slot) = m.expert;
        if (!local_[m.dst_gpu]) ls.resident.slot(m.dst_gpu, m.dst_slot) = m.expert;
      }
    t->host_mirror = popt.host_mirror;
    ls.last_plan = t->plan;
    return finish_submit(t, b.timeout, {b.sources_ready, b.slots_free}, out, made);
  }
}

Status EngineImpl::submit_reduce(const ReduceBatch &b, Ticket &out, std::shared_ptr<TicketImpl> &made) {
  if (Status st = check_layer(b.layer, "submit_reduce"); !st.ok()) return st;
  if (b.timeout.count() <= 0) return bad("submit_reduce: timeout must be positive, got ", b.timeout.count(), " ms");
  if (static_cast<int>(b.owner_gpu.size()) != opts_.num_experts)
    return bad("submit_reduce: owner_gpu has ", b.owner_gpu.size(), " entries for ", opts_.num_experts, " experts");
  const Topology &topo = opts_.topology;
  const int slots = topo.slots_per_gpu, num_experts = opts_.num_experts;
  for (int e = 0; e < num_experts; ++e)
    if (const int o = b.owner_gpu[e]; o < 0 || o >= topo.num_gpus())
      return bad("submit_reduce: expert ", e, " has owner GPU ", o);
  auto t = std::make_shared<TicketImpl>();
  t->kind = TicketImpl::Kind::reduce;
  t->layer = b.layer;
  std::lock_guard lock(mu_);
  LayerState &ls = layers_[b.layer];
  if (ls.grad_bytes == 0) return bad("submit_reduce: layer ", b.layer, " has no registered gradients");
  // Multi-process: every process enumerates the same replicas (from the planned placement); a sender whose
  // replica is not valid says so in its header.
  const LayerPlacement &where = spmd_ ? ls.planned : ls.resident;
  std::vector<char> chosen; // select: per (GPU, expert), whether the replica returns
  if (b.select)
    if (Status st = check_selection(b, where, chosen); !st.ok()) return st;
  for (int e = 0; e < num_experts; ++e) {
    const int o = b.owner_gpu[e];
    int owner_slot = -1;
    for (int s = 0; s < slots; ++s)
      if (where.slot(o, s) == e) owner_slot = s;
    bool any = false;
    for (int g = 0; g < topo.num_gpus(); ++g)
      for (int s = 0; s < slots; ++s)
        if (g != o && where.slot(g, s) == e &&
            (!b.select || chosen[static_cast<std::size_t>(g) * num_experts + e] != 0)) {
          if (owner_slot < 0)
            return bad("submit_reduce: expert ", e, " has a replica on GPU ", g, " but its owner GPU ", o,
                       " holds no valid copy");
          ReduceRun r;
          r.expert = e, r.gpu = g, r.slot = s, r.owner = o, r.owner_slot = owner_slot, r.zero = b.select;
          r.role = local_[g] && local_[o] ? Role::local : local_[o] ? Role::recv : local_[g] ? Role::send : Role::none;
          for (int x : {g, o})
            if (local_[x] && !is_registered(ls.grads[x]))
              return bad("submit_reduce: gradients of GPU ", x, " layer ", b.layer, " are not registered");
          t->has_peer = t->has_peer || r.role == Role::send || r.role == Role::recv;
          t->reduces.push_back(r);
          if (local_[g]) t->touched.push_back(g * slots + s);
          any = any || local_[o];
        }
    if (any) t->touched.push_back(o * slots + owner_slot);
  }
  std::sort(t->touched.begin(), t->touched.end());
  t->touched.erase(std::unique(t->touched.begin(), t->touched.end()), t->touched.end());
  t->after = overlapping(b.layer, t->touched, t->reads);
  for (ReduceRun &r : t->reduces) {
    if (r.role == Role::send || r.role == Role::none) continue;
    t->pool = pool_; // gives back what was taken, also on failure
    t->staging_bytes = ls.grad_bytes;
    if (Status st = pool_->take_block(r.owner, ls.grad_bytes, r.staging); !st.ok()) return st;
    r.copy.c.path = topo.node_of(r.gpu) == topo.node_of(r.owner) ? transfer::Path::nvlink : transfer::Path::network;
    r.copy.c.src_gpu = r.gpu;
    r.copy.c.dst_gpu = r.owner;
    r.copy.c.num_bytes = ls.grad_bytes;
  }
  if (Status st = finish_submit(t, b.timeout, {b.grads_ready, Gate{}}, out, made); !st.ok()) return st;
  // The gradients this reduction leaves in place, by slot; without a selection every replica returned.
  ls.held.clear();
  if (b.select && !b.held.empty()) {
    ls.held.assign(static_cast<std::size_t>(where.num_slots()), -1);
    for (int g = 0; g < topo.num_gpus(); ++g)
      for (int s = 0; s < slots; ++s)
        if (const std::int32_t e = where.slot(g, s); e != empty_slot)
          ls.held[static_cast<std::size_t>(g) * slots + s] = b.held[static_cast<std::size_t>(g) * num_experts + e];
  }
  return Status::success();
}

Status EngineImpl::check_selection(const ReduceBatch &b, const LayerPlacement &where, std::vector<char> &chosen) const {
  const int num_gpus = opts_.topology.num_gpus(), num_experts = opts_.num_experts, slots = where.slots_per_gpu();
  const std::size_t pairs = static_cast<std::size_t>(num_gpus) * num_experts;
  if (!b.held.empty() && b.held.size() != pairs)
    return bad("submit_reduce: held has ", b.held.size(), " entries, expected GPUs x experts = ", pairs);
  // A replica the selection names: a valid copy off its owner.
  auto replica = [&](const char *what, int g, int e) -> Status {
    if (g == b.owner_gpu[e])
      return bad("submit_reduce: ", what, " GPU ", g, " expert ", e, ", but GPU ", g, " is its owner, not a replica");
    if (!where.holds(g, e))
      return bad("submit_reduce: ", what, " GPU ", g, " expert ", e, ", but layer ", b.layer, " GPU ", g,
                 " holds no valid copy of it");
    return Status::success();
  };
  chosen.assign(pairs, 0);
  for (const ReplicaRef &r : b.returns) {
    if (r.gpu < 0 || r.gpu >= num_gpus)
      return bad("submit_reduce: returns names GPU ", r.gpu, " (expert ", r.expert, "), outside [0, ", num_gpus, ")");
    if (r.expert < 0 || r.expert >= num_experts)
      return bad("submit_reduce: returns names expert ", r.expert, " (GPU ", r.gpu, "), outside [0, ", num_experts,
                 ")");
    char &c = chosen[static_cast<std::size_t>(r.gpu) * num_experts + r.expert];
    if (c != 0) return bad("submit_reduce: returns names GPU ", r.gpu, " expert ", r.expert, " twice");
    c = 1;
    if (Status st = replica("returns names", r.gpu, r.expert); !st.ok()) return st;
  }
  for (int g = 0; g < num_gpus && !b.held.empty(); ++g)
    for (int e = 0; e < num_experts; ++e) {
      const std::size_t i = static_cast<std::size_t>(g) * num_experts + e;
      const std::int32_t h = b.held[i];
      if (h == -1) continue;
      if (h != b.owner_gpu[e])
        return bad("submit_reduce: held names owner GPU ", h, " for GPU ", g, " expert ", e, ", but owner_gpu says ",
                   b.owner_gpu[e]);
      if (chosen[i] != 0) return bad("submit_reduce: GPU ", g, " expert ", e, " is both returned and held");
      if (Status st = replica("held names", g, e); !st.ok()) return st;
    }
  // Gradients an earlier reduction left in place are returned or held again, for the same owner.
  const std::vector<std::int32_t> &before = layers_[b.layer].held;
  for (std::size_t q = 0; q < before.size(); ++q) {
    const std::int32_t o = before[q];
    if (o < 0) continue;
    const int g = static_cast<int>(q) / slots, s = static_cast<int>(q) % slots;
    const std::int32_t e = where.slot(g, s);
    if (e == empty_slot)
      return bad("submit_reduce: layer ", b.layer, " GPU ", g, " slot ", s, " held a gradient for owner GPU ", o,
                 " but holds no valid expert now");
    const std::size_t i = static_cast<std::size_t>(g) * num_experts + e;
    const bool returned = chosen[i] != 0 && b.owner_gpu[e] == o, kept = !b.held.empty() && b.held[i] == o;
    if (!returned && !kept)
      return bad("submit_reduce: layer ", b.layer, " GPU ", g, " slot ", s, " holds the gradient of expert ", e,
                 " for owner GPU ", o, " (held by an earlier reduction); return it to that owner or hold it again");
  }
  return Status::success();
}

Status EngineImpl::check_not_held(const char *what, int layer, const LayerPlacement &placement, int gpu, int slot,
                                  std::int32_t incoming) const {
  const std::vector<std::int32_t> &held = layers_[layer].held;
  if (gpu < 0 || gpu >= placement.num_gpus() || held.empty()) return Status::success();
  const std::int32_t o = held[static_cast<std::size_t>(gpu) * placement.slots_per_gpu() + slot];
  const std::int32_t e = placement.slot(gpu, slot);
  if (o < 0 || e == incoming) return Status::success();
  return bad(what, ": layer ", layer, " GPU ", gpu, " slot ", slot, " holds the gradient of expert ", e,
             " for owner GPU ", o, " (held-gradient rule); return it with submit_reduce before replacing expert ", e,
             " there");
}

// Busy batches of `layer` that write what a new batch touches or reads, or read what it writes (all sorted);
// the caller holds `mu_`.
std::vector<std::shared_ptr<TicketImpl>> EngineImpl::overlapping(int layer, const std::vector<int> &writes,
                                                                 const std::vector<int> &reads) const {
  auto meet = [](const std::vector<int> &x, const std::vector<int> &y) {
    for (std::size_t i = 0, j = 0; i < x.size() && j < y.size();)
      if (x[i] == y[j])
        return true;
      else if (x[i] < y[j])
        ++i;
      else
        ++j;
    return false;
  };
  std::vector<std::shared_ptr<TicketImpl>> out;
  for (const auto &a : active_) {
    if (a->layer != layer || !a->busy()) continue;
    if (meet(a->touched, writes) || meet(a->touched, reads) || meet(a->reads, writes)) out.push_back(a);
  }
  return out;
}

Status EngineImpl::finish_submit(std::shared_ptr<TicketImpl> &t, std::chrono::milliseconds timeout,
                                 std::array<Gate, 2> gates, Ticket &out, std::shared_ptr<TicketImpl> &made) {
  if (stopping_) return {StatusCode::aborted, "submit: the engine is shutting down"};
  for (int i = 0; i < 2; ++i) {
    t->gates[i] = gates[i];
    if (gates[i].host != nullptr) t->gates[i].host = &t->host_events[i].emplace(*gates[i].host);
  }
  t->pool = pool_;
  if (Status st = pool_->take_flag(t->flag, t->flag_value); !st.ok()) return st;
  // Under FaultSchedule::spare_reductions a reduction takes a serial of its own count: the moves' serials (and so
  // their fault decisions) are then those of an engine without reductions.
  t->serial = t->kind == TicketImpl::Kind::reduce && spare_faults_ != nullptr ? ++reduce_serial_ : ++serial_;
  t->t0 = clock::now();
  t->deadline = t->t0 + timeout;
  active_.push_back(t);
  if (t->has_peer) {
    peer_order_.push_back(t.get());
    t->peer_outstanding.store(true, std::memory_order_release);
  }
  made = t;
  (void)out;
  kicked_ = true; // the caller holds mu_
  cv_.notify_all();
  return Status::success();
}

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
