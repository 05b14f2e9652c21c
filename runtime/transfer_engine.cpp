// The transfer engine's state machine, shared by every backend: plans a batch's chunks, waits for its gates and for
// earlier batches touching the same slots, issues the copies, retries failed chunks on the other path, verifies
// moved experts, keeps the valid-expert map exact, and ends every batch by its deadline.

#include "foremoe/runtime/transfer_engine.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "foremoe/core/error.hpp"
#include "transport.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime {

struct HostEvent::State {
  std::atomic<bool> set{false};
};
HostEvent::HostEvent() : state_(std::make_shared<State>()) {}
void HostEvent::set() noexcept { state_->set.store(true, std::memory_order_release); }
bool HostEvent::is_set() const noexcept { return state_->set.load(std::memory_order_acquire); }

std::uint64_t checksum(std::span<const std::byte> bytes) noexcept {
  // Sum of mixed (word, index) pairs: order-free, so the device computes it with any reduction tree.
  std::uint64_t sum = detail::mix64(bytes.size());
  const std::size_t words = bytes.size() / 8;
  for (std::size_t i = 0; i < words; ++i) {
    std::uint64_t w;
    std::memcpy(&w, bytes.data() + i * 8, 8);
    sum += detail::mix64(w ^ detail::mix64(i));
  }
  if (const std::size_t tail = bytes.size() % 8; tail != 0) {
    std::uint64_t w = 0;
    std::memcpy(&w, bytes.data() + words * 8, tail);
    sum += detail::mix64(w ^ detail::mix64(words));
  }
  return sum;
}

namespace detail {
namespace {
using clock = std::chrono::steady_clock;

struct LayerState {
  std::vector<SlotRegion> slots;     // per GPU
  std::vector<MirrorRegion> mirrors; // per node
  std::vector<SlotRegion> grads;     // per GPU
  std::int64_t grad_bytes = 0;
  LayerPlacement resident;           // valid copies
  std::vector<std::uint8_t> buffer;  // per physical slot: the buffer holding the valid copy
  transfer::TransferPlan last_plan;
};

struct ChunkRun {
  transfer::Chunk c;
  int attempts = 0;
  bool in_flight = false, done = false;
  std::vector<std::uint64_t> handles;
  std::size_t pending = 0;
  bool segment_failed = false;
  double seconds = 0.0;
};

struct MoveRun {
  int gpu_src = -1, gpu_src_slot = -1; // a GPU source for retries (-1: none)
  bool finished = false, failed = false, checked = false;
  std::uint64_t src_sum = 0;
  int verify_rounds = 0;
  std::vector<int> chunk_idx; // its chunks in TicketImpl::chunks
  std::int64_t path_bytes[transfer::num_paths] = {0, 0, 0};
  double start = -1.0, end = 0.0;
  int attempts = 0;
};

// One replica gradient on its way to the owner: copied into `staging` on the owner GPU, then accumulated.
struct ReduceRun {
  int expert = 0, gpu = 0, slot = 0, owner = 0, owner_slot = 0;
  std::byte *staging = nullptr;
  ChunkRun copy;
  double start = -1.0, end = 0.0;
};

} // namespace

struct TicketImpl {
  enum class Kind { moves, reduce } kind = Kind::moves;
  std::uint64_t serial = 0;
  int layer = 0;
  mutable std::mutex mu;
  std::condition_variable cv;
  std::atomic<int> state{static_cast<int>(TicketState::pending)};
  Status final_status{StatusCode::in_progress, ""};
  std::atomic<bool> abort_requested{false};
  clock::time_point t0, deadline;
  Gate gates[2];
  std::shared_ptr<HostEvent::State> host_events[2]; // keep the caller's host events alive
  bool gated = false, draining = false, host_mirror = false;
  StatusCode drain_reason = StatusCode::ok;
  int dst_buffer = 0;
  std::vector<int> touched; // physical slots this batch writes (moves) or reads (reduce)
  std::vector<std::shared_ptr<TicketImpl>> after; // earlier batches on the same slots
  transfer::TransferPlan plan;
  std::vector<ChunkRun> chunks;
  std::vector<MoveRun> moves;
  std::vector<ReduceRun> reduces;
  std::vector<MoveTelemetry> telemetry;
  volatile std::uint32_t *flag = nullptr;
  std::shared_ptr<Transport> transport;

  ~TicketImpl() {
    if (flag != nullptr && transport) transport->free_flag(flag);
    for (ReduceRun &r : reduces)
      if (r.staging != nullptr && transport) transport->free(r.owner, r.staging);
  }
  [[nodiscard]] bool finished() const noexcept {
    return state.load(std::memory_order_acquire) != static_cast<int>(TicketState::pending);
  }
};

class EngineImpl {
public:
  EngineImpl(EngineOptions o, std::shared_ptr<Transport> t) : opts_(std::move(o)), transport_(std::move(t)) {
    const int num_gpus = opts_.topology.num_gpus();
    layers_.resize(static_cast<std::size_t>(opts_.num_layers));
    for (LayerState &ls : layers_) {
      ls.slots.resize(num_gpus);
      ls.grads.resize(num_gpus);
      ls.mirrors.resize(opts_.topology.num_nodes);
      ls.resident = LayerPlacement(num_gpus, opts_.topology.slots_per_gpu, opts_.num_experts);
      ls.buffer.assign(static_cast<std::size_t>(ls.resident.num_slots()), 0);
    }
    prefix_.push_back(0);
    for (const TensorSpan &ts : opts_.tensors)
      prefix_.push_back(prefix_.back() + ts.num_bytes);
    progress_ = std::thread([this] { run(); });
  }
  ~EngineImpl() {
    // Running batches end aborted (bounded by their deadlines) before the thread stops.
    {
      std::lock_guard lock(mu_);
      for (auto &t : active_)
        t->abort_requested = true;
      stopping_ = true;
    }
    cv_.notify_all();
    progress_.join();
  }

  const EngineOptions &options() const noexcept { return opts_; }

  Status register_region(int layer, int idx, const SlotRegion &r, bool grads, std::int64_t grad_bytes) {
    const char *what = grads ? "register_grads" : "register_slots";
    if (Status st = check_layer(layer, what); !st.ok()) return st;
    if (idx < 0 || idx >= opts_.topology.num_gpus())
      return bad(what, ": GPU ", idx, " outside [0, ", opts_.topology.num_gpus(), ")");
    if (r.base == nullptr) return bad(what, ": null base for GPU ", idx);
    if (r.num_slots != opts_.topology.slots_per_gpu)
      return bad(what, ": GPU ", idx, " has ", r.num_slots, " slots, the topology ", opts_.topology.slots_per_gpu);
    if (r.num_buffers < 1 || r.num_buffers > 2) return bad(what, ": num_buffers must be 1 or 2, got ", r.num_buffers);
    const std::int64_t need = grads ? grad_bytes : span_end();
    if (grads && (grad_bytes <= 0 || grad_bytes % 4 != 0))
      return bad(what, ": grad_bytes must be a positive multiple of 4, got ", grad_bytes);
    if (r.slot_stride_bytes < need)
      return bad(what, ": slot stride ", r.slot_stride_bytes, " is smaller than the ", need, " bytes of an expert");
    if (r.num_buffers == 2 && r.buffer_stride_bytes < r.slot_stride_bytes * r.num_slots)
      return bad(what, ": buffer stride ", r.buffer_stride_bytes, " overlaps the ", r.num_slots, " slots");
    std::lock_guard lock(mu_);
    LayerState &ls = layers_[layer];
    if (grads) {
      if (ls.grad_bytes != 0 && ls.grad_bytes != grad_bytes)
        return bad(what, ": grad_bytes ", grad_bytes, " differs from ", ls.grad_bytes, " registered before");
      ls.grads[idx] = r;
      ls.grad_bytes = grad_bytes;
    } else {
      ls.slots[idx] = r;
    }
    return Status::success();
  }

  Status register_mirror(int layer, int node, const MirrorRegion &m) {
    if (Status st = check_layer(layer, "register_mirror"); !st.ok()) return st;
    if (node < 0 || node >= opts_.topology.num_nodes)
      return bad("register_mirror: node ", node, " outside [0, ", opts_.topology.num_nodes, ")");
    if (m.base == nullptr) return bad("register_mirror: null base for node ", node);
    if (m.num_experts != opts_.num_experts)
      return bad("register_mirror: ", m.num_experts, " experts, the engine has ", opts_.num_experts);
    if (m.expert_stride_bytes < span_end())
      return bad("register_mirror: expert stride ", m.expert_stride_bytes, " is smaller than ", span_end());
    std::lock_guard lock(mu_);
    layers_[layer].mirrors[node] = m;
    return Status::success();
  }

  Status set_resident(int layer, const LayerPlacement &p) {
    if (Status st = check_layer(layer, "set_resident"); !st.ok()) return st;
    try {
      foremoe::detail::require(p.num_gpus() == opts_.topology.num_gpus() &&
                                   p.slots_per_gpu() == opts_.topology.slots_per_gpu &&
                                   p.num_experts() == opts_.num_experts,
                               "placement is ", p.num_gpus(), " GPUs x ", p.slots_per_gpu(), " slots x ",
                               p.num_experts(), " experts");
      for (int g = 0; g < p.num_gpus(); ++g)
        for (int s = 0; s < p.slots_per_gpu(); ++s) {
          const std::int32_t e = p.slot(g, s);
          foremoe::detail::require(e == empty_slot || (e >= 0 && e < p.num_experts()), "GPU ", g, " slot ", s,
                                   " holds expert ", e);
          for (int s2 = 0; s2 < s; ++s2)
            foremoe::detail::require(e == empty_slot || p.slot(g, s2) != e, "GPU ", g, " holds expert ", e, " twice");
        }
    } catch (const Error &err) {
      return {StatusCode::invalid_argument, std::string("set_resident: ") + err.what()};
    }
    std::lock_guard lock(mu_);
    for (auto &t : active_)
      if (t->layer == layer && !t->finished()) return {StatusCode::invalid_argument, "set_resident: layer " + std::to_string(layer) +
                                                                       " has batches in flight"};
    layers_[layer].resident = p;
    return Status::success();
  }

  Status submit(const MoveBatch &b, Ticket &out, std::shared_ptr<TicketImpl> &made) {
    if (Status st = check_layer(b.layer, "submit"); !st.ok()) return st;
    if (b.timeout.count() <= 0) return bad("submit: timeout must be positive, got ", b.timeout.count(), " ms");
    const Topology &topo = opts_.topology;
    const int slots = topo.slots_per_gpu;
    auto t = std::make_shared<TicketImpl>();
    t->kind = TicketImpl::Kind::moves;
    t->layer = b.layer;
    t->dst_buffer = b.dst_buffer;
    std::lock_guard lock(mu_);
    LayerState &ls = layers_[b.layer];
    // Every GPU a chunk may touch must be registered; planning sees only copies no other batch is writing.
    for (const Move &m : b.moves) {
      if (m.dst_gpu < 0 || m.dst_gpu >= topo.num_gpus())
        return bad("submit: move of expert ", m.expert, " targets GPU ", m.dst_gpu);
      if (ls.slots[m.dst_gpu].base == nullptr)
        return bad("submit: layer ", b.layer, " GPU ", m.dst_gpu, " has no registered slots");
      if (b.dst_buffer < 0 || b.dst_buffer >= ls.slots[m.dst_gpu].num_buffers)
        return bad("submit: dst_buffer ", b.dst_buffer, " but GPU ", m.dst_gpu, " has ",
                   ls.slots[m.dst_gpu].num_buffers, " buffers per slot");
    }
    std::vector<char> written(static_cast<std::size_t>(ls.resident.num_slots()), 0);
    for (auto &a : active_)
      if (a->layer == b.layer && a->kind == TicketImpl::Kind::moves)
        for (int p : a->touched)
          written[p] = 1;
    LayerPlacement view = ls.resident;
    for (int g = 0; g < topo.num_gpus(); ++g)
      for (int s = 0; s < slots; ++s)
        if (written[static_cast<std::size_t>(g) * slots + s] || ls.slots[g].base == nullptr) view.slot(g, s) = empty_slot;
    transfer::Options popt = opts_.planning;
    bool all_mirrors = true;
    for (const Move &m : b.moves)
      all_mirrors = all_mirrors && ls.mirrors[topo.node_of(m.dst_gpu)].base != nullptr;
    popt.host_mirror = popt.host_mirror && all_mirrors;
    try {
      t->plan = transfer::plan_transfers(b.moves, view, topo, popt);
    } catch (const Error &err) {
      return {StatusCode::invalid_argument, std::string("submit: ") + err.what()};
    }
    for (const Move &m : b.moves)
      t->touched.push_back(m.dst_gpu * slots + m.dst_slot);
    std::sort(t->touched.begin(), t->touched.end());
    t->after = overlapping(b.layer, t->touched);
    t->moves.resize(b.moves.size());
    for (std::size_t i = 0; i < b.moves.size(); ++i) {
      MoveRun &mr = t->moves[i];
      // A GPU source for retries: the plan's, else any copy that stays in place, in the node first.
      const Move &m = b.moves[i];
      int best = -1, best_slot = -1;
      for (int g = 0; g < topo.num_gpus(); ++g)
        for (int s = 0; s < slots; ++s)
          if (g != m.dst_gpu && view.slot(g, s) == m.expert &&
              !std::binary_search(t->touched.begin(), t->touched.end(), g * slots + s)) {
            const bool local = topo.node_of(g) == topo.node_of(m.dst_gpu);
            if (!local && !popt.allow_network) continue;
            if (best < 0 || (local && topo.node_of(best) != topo.node_of(m.dst_gpu))) best = g, best_slot = s;
          }
      mr.gpu_src = best;
      mr.gpu_src_slot = best_slot;
    }
    t->chunks.reserve(t->plan.chunks.size());
    for (const transfer::Chunk &c : t->plan.chunks) {
      t->moves[c.move_idx].chunk_idx.push_back(static_cast<int>(t->chunks.size()));
      ChunkRun cr;
      cr.c = c;
      t->chunks.push_back(std::move(cr));
    }
    t->host_mirror = popt.host_mirror;
    ls.last_plan = t->plan;
    return finish_submit(t, b.timeout, {b.sources_ready, b.slots_free}, out, made);
  }

  Status submit_reduce(const ReduceBatch &b, Ticket &out, std::shared_ptr<TicketImpl> &made) {
    if (Status st = check_layer(b.layer, "submit_reduce"); !st.ok()) return st;
    if (b.timeout.count() <= 0) return bad("submit_reduce: timeout must be positive, got ", b.timeout.count(), " ms");
    if (static_cast<int>(b.owner_gpu.size()) != opts_.num_experts)
      return bad("submit_reduce: owner_gpu has ", b.owner_gpu.size(), " entries for ", opts_.num_experts, " experts");
    const Topology &topo = opts_.topology;
    const int slots = topo.slots_per_gpu;
    auto t = std::make_shared<TicketImpl>();
    t->kind = TicketImpl::Kind::reduce;
    t->layer = b.layer;
    std::lock_guard lock(mu_);
    LayerState &ls = layers_[b.layer];
    if (ls.grad_bytes == 0) return bad("submit_reduce: layer ", b.layer, " has no registered gradients");
    for (int e = 0; e < opts_.num_experts; ++e) {
      const int o = b.owner_gpu[e];
      if (o < 0 || o >= topo.num_gpus()) return bad("submit_reduce: expert ", e, " has owner GPU ", o);
      int owner_slot = -1;
      for (int s = 0; s < slots; ++s)
        if (ls.resident.slot(o, s) == e) owner_slot = s;
      bool any = false;
      for (int g = 0; g < topo.num_gpus(); ++g)
        for (int s = 0; s < slots; ++s)
          if (g != o && ls.resident.slot(g, s) == e) {
            if (owner_slot < 0)
              return bad("submit_reduce: expert ", e, " has a replica on GPU ", g, " but its owner GPU ", o,
                         " holds no valid copy");
            if (ls.grads[g].base == nullptr || ls.grads[o].base == nullptr)
              return bad("submit_reduce: gradients of GPU ", ls.grads[g].base == nullptr ? g : o, " layer ", b.layer,
                         " are not registered");
            ReduceRun r;
            r.expert = e, r.gpu = g, r.slot = s, r.owner = o, r.owner_slot = owner_slot;
            t->reduces.push_back(r);
            t->touched.push_back(g * slots + s);
            any = true;
          }
      if (any) t->touched.push_back(o * slots + owner_slot);
    }
    std::sort(t->touched.begin(), t->touched.end());
    t->touched.erase(std::unique(t->touched.begin(), t->touched.end()), t->touched.end());
    t->after = overlapping(b.layer, t->touched);
    for (ReduceRun &r : t->reduces) {
      if (Status st = transport_->alloc(r.owner, ls.grad_bytes, r.staging); !st.ok()) {
        t->transport = transport_; // frees what was allocated
        return st;
      }
      r.copy.c.path = topo.node_of(r.gpu) == topo.node_of(r.owner) ? transfer::Path::nvlink : transfer::Path::network;
      r.copy.c.src_gpu = r.gpu;
      r.copy.c.dst_gpu = r.owner;
      r.copy.c.num_bytes = ls.grad_bytes;
    }
    return finish_submit(t, b.timeout, {b.grads_ready, Gate{}}, out, made);
  }

  std::int32_t valid_expert(int layer, int gpu, int slot) const {
    std::lock_guard lock(mu_);
    if (layer < 0 || layer >= opts_.num_layers || gpu < 0 || gpu >= opts_.topology.num_gpus() || slot < 0 ||
        slot >= opts_.topology.slots_per_gpu)
      return empty_slot;
    return layers_[layer].resident.slot(gpu, slot);
  }
  LayerPlacement resident(int layer) const {
    std::lock_guard lock(mu_);
    return layer >= 0 && layer < opts_.num_layers ? layers_[layer].resident : LayerPlacement{};
  }
  transfer::TransferPlan last_plan(int layer) const {
    std::lock_guard lock(mu_);
    return layer >= 0 && layer < opts_.num_layers ? layers_[layer].last_plan : transfer::TransferPlan{};
  }
  void wake() { cv_.notify_all(); }
  Transport &transport() { return *transport_; }

private:
  template <class... A> static Status bad(const A &...a) {
    return {StatusCode::invalid_argument, foremoe::detail::concat(a...)};
  }
  Status check_layer(int layer, const char *what) const {
    if (layer < 0 || layer >= opts_.num_layers)
      return bad(what, ": layer ", layer, " outside [0, ", opts_.num_layers, ")");
    return Status::success();
  }
  std::int64_t span_end() const {
    std::int64_t end = 0;
    for (const TensorSpan &t : opts_.tensors)
      end = std::max(end, t.offset_bytes + t.num_bytes);
    return end;
  }
  // Active batches of `layer` touching any of `slots` (sorted); the caller holds `mu_`.
  std::vector<std::shared_ptr<TicketImpl>> overlapping(int layer, const std::vector<int> &slots) const {
    std::vector<std::shared_ptr<TicketImpl>> out;
    for (const auto &a : active_) {
      if (a->layer != layer || a->finished()) continue;
      std::vector<int> common;
      std::set_intersection(a->touched.begin(), a->touched.end(), slots.begin(), slots.end(),
                            std::back_inserter(common));
      if (!common.empty()) out.push_back(a);
    }
    return out;
  }
  Status finish_submit(std::shared_ptr<TicketImpl> &t, std::chrono::milliseconds timeout, std::array<Gate, 2> gates,
                       Ticket &out, std::shared_ptr<TicketImpl> &made) {
    if (stopping_) return {StatusCode::aborted, "submit: the engine is shutting down"};
    for (int i = 0; i < 2; ++i) {
      t->gates[i] = gates[i];
      if (gates[i].host != nullptr) t->host_events[i] = gates[i].host->state();
    }
    t->transport = transport_;
    if (Status st = transport_->alloc_flag(t->flag); !st.ok()) return st;
    t->serial = ++serial_;
    t->t0 = clock::now();
    t->deadline = t->t0 + timeout;
    active_.push_back(t);
    made = t;
    (void)out;
    cv_.notify_all();
    return Status::success();
  }

  // --- the progress thread -------------------------------------------------------------------------------------

  void run() {
    std::unique_lock lock(mu_);
    for (;;) {
      if (active_.empty()) {
        if (stopping_) return;
        cv_.wait(lock, [&] { return stopping_ || !active_.empty(); });
        continue;
      }
      std::vector<std::shared_ptr<TicketImpl>> batch = active_;
      lock.unlock();
      for (auto &t : batch)
        step(*t);
      lock.lock();
      std::erase_if(active_, [](const auto &t) { return t->finished(); });
      if (!active_.empty()) cv_.wait_for(lock, std::chrono::microseconds(50));
    }
  }

  // Pointer to the bytes `[lo, lo+n)` of tensor `ti` of a slot or mirror entry starting at `base`.
  std::byte *at(void *base, int ti, std::int64_t from) const {
    return static_cast<std::byte *>(base) + opts_.tensors[ti].offset_bytes + from;
  }
  std::byte *slot_base(const LayerState &ls, int gpu, int slot, int buffer) const {
    const SlotRegion &r = ls.slots[gpu];
    return static_cast<std::byte *>(r.base) + buffer * r.buffer_stride_bytes + slot * r.slot_stride_bytes;
  }

  // Issues `cr` (its current path and source) as one copy per tensor it overlaps.
  bool issue(TicketImpl &t, ChunkRun &cr, int move_idx) {
    LayerState &ls = layers_[t.layer];
    const transfer::Chunk &c = cr.c;
    void *src_base;
    {
      std::lock_guard lock(mu_);
      src_base = c.path == transfer::Path::pcie
                     ? static_cast<std::byte *>(const_cast<void *>(ls.mirrors[opts_.topology.node_of(c.dst_gpu)].base)) +
                           c.expert * ls.mirrors[opts_.topology.node_of(c.dst_gpu)].expert_stride_bytes
                     : slot_base(ls, c.src_gpu, c.src_slot, ls.buffer[c.src_gpu * opts_.topology.slots_per_gpu + c.src_slot]);
    }
    std::byte *dst_base = slot_base(ls, c.dst_gpu, c.dst_slot, t.dst_buffer);
    cr.handles.clear();
    cr.segment_failed = false;
    cr.seconds = 0.0;
    ++cr.attempts;
    ++t.moves[move_idx].attempts;
    for (std::size_t ti = 0; ti < opts_.tensors.size(); ++ti) {
      const std::int64_t lo = std::max(c.offset_bytes, prefix_[ti]),
                         hi = std::min(c.offset_bytes + c.num_bytes, prefix_[ti + 1]);
      if (lo >= hi) continue;
      CopyOp op;
      op.path = c.path;
      op.src_gpu = c.path == transfer::Path::pcie ? -1 : c.src_gpu;
      op.dst_gpu = c.dst_gpu;
      op.src = at(src_base, static_cast<int>(ti), lo - prefix_[ti]);
      op.dst = at(dst_base, static_cast<int>(ti), lo - prefix_[ti]);
      op.num_bytes = hi - lo;
      op.fault_key = mix64(t.serial) ^ mix64((static_cast<std::uint64_t>(move_idx) << 20) ^ static_cast<std::uint64_t>(lo)) ^
                     mix64(static_cast<std::uint64_t>(cr.attempts) * 131 + static_cast<std::uint64_t>(c.path));
      std::uint64_t h = 0;
      if (!transport_->start(op, h).ok()) {
        cr.segment_failed = true;
        continue;
      }
      cr.handles.push_back(h);
    }
    cr.pending = cr.handles.size();
    cr.in_flight = true;
    return true;
  }

  // Polls `cr`; returns true when it is no longer in flight (then `segment_failed` tells the outcome).
  bool poll(ChunkRun &cr) {
    for (std::uint64_t &h : cr.handles) {
      if (h == 0) continue;
      double secs = 0;
      const Status st = transport_->query(h, secs);
      if (st.code() == StatusCode::in_progress) continue;
      if (!st.ok()) cr.segment_failed = true;
      cr.seconds += secs;
      h = 0;
      --cr.pending;
    }
    if (cr.pending == 0) cr.in_flight = false;
    return !cr.in_flight;
  }

  // Moves the chunk to the other path where there is one (mirror <-> a GPU copy).
  void switch_path(const TicketImpl &t, ChunkRun &cr, const MoveRun &mr) const {
    transfer::Chunk &c = cr.c;
    if (c.path != transfer::Path::pcie && t.host_mirror) {
      c.path = transfer::Path::pcie;
      c.src_gpu = host_mirror;
      c.src_slot = -1;
    } else if (c.path == transfer::Path::pcie && mr.gpu_src >= 0) {
      c.src_gpu = mr.gpu_src;
      c.src_slot = mr.gpu_src_slot;
      c.path = opts_.topology.node_of(mr.gpu_src) == opts_.topology.node_of(c.dst_gpu) ? transfer::Path::nvlink
                                                                                       : transfer::Path::network;
    }
  }

  // Checksum of an expert's bytes in a slot or mirror entry (tensor by tensor, combined).
  Status expert_sum(int gpu, void *base, std::uint64_t &out) {
    out = 0;
    for (std::size_t ti = 0; ti < opts_.tensors.size(); ++ti) {
      std::uint64_t s = 0;
      if (Status st = transport_->checksum(gpu, at(base, static_cast<int>(ti), 0), opts_.tensors[ti].num_bytes, s);
          !st.ok())
        return st;
      out += s * (2 * ti + 1);
    }
    return Status::success();
  }

  void step(TicketImpl &t) {
    if (t.finished()) return;
    const double now_s = std::chrono::duration<double>(clock::now() - t.t0).count();
    if (!t.draining && (t.abort_requested || clock::now() > t.deadline)) {
      t.draining = true;
      t.drain_reason = t.abort_requested ? StatusCode::aborted : StatusCode::timed_out;
    }
    if (!t.gated) {
      if (t.draining) return end(t);
      for (auto &a : t.after)
        if (!a->finished()) return;
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
      if (t.kind == TicketImpl::Kind::moves) start_moves(t, now_s);
      else
        for (ReduceRun &r : t.reduces)
          issue_reduce(t, r, now_s);
      return;
    }
    if (t.kind == TicketImpl::Kind::moves) step_moves(t, now_s);
    else step_reduce(t, now_s);
  }

  void start_moves(TicketImpl &t, double now_s) {
    LayerState &ls = layers_[t.layer];
    const int slots = opts_.topology.slots_per_gpu;
    {
      // The destinations now hold partial bytes: not valid until their move ends (a double buffer keeps the old
      // copy valid in the other buffer).
      std::lock_guard lock(mu_);
      for (const Move &m : t.plan.moves) {
        const int p = m.dst_gpu * slots + m.dst_slot;
        if (ls.buffer[p] == t.dst_buffer || ls.slots[m.dst_gpu].num_buffers == 1) ls.resident.slot(m.dst_gpu, m.dst_slot) = empty_slot;
      }
    }
    if (opts_.verify)
      for (std::size_t i = 0; i < t.moves.size(); ++i) {
        const Move &m = t.plan.moves[i];
        MoveRun &mr = t.moves[i];
        void *base;
        int gpu;
        if (t.host_mirror) {
          const MirrorRegion &mir = ls.mirrors[opts_.topology.node_of(m.dst_gpu)];
          base = static_cast<std::byte *>(const_cast<void *>(mir.base)) + m.expert * mir.expert_stride_bytes;
          gpu = -1;
        } else {
          gpu = mr.gpu_src;
          base = slot_base(ls, mr.gpu_src, mr.gpu_src_slot, ls.buffer[mr.gpu_src * slots + mr.gpu_src_slot]);
        }
        if (!expert_sum(gpu, base, mr.src_sum).ok()) mr.failed = true;
      }
    for (ChunkRun &cr : t.chunks) {
      MoveRun &mr = t.moves[cr.c.move_idx];
      if (mr.failed) continue;
      if (mr.start < 0) mr.start = now_s;
      issue(t, cr, cr.c.move_idx);
    }
    step_moves(t, now_s);
  }

  void step_moves(TicketImpl &t, double now_s) {
    LayerState &ls = layers_[t.layer];
    const int slots = opts_.topology.slots_per_gpu;
    bool in_flight = false;
    for (ChunkRun &cr : t.chunks) {
      MoveRun &mr = t.moves[cr.c.move_idx];
      if (!cr.in_flight) continue;
      if (t.draining)
        for (std::uint64_t &h : cr.handles)
          if (h != 0 && transport_->cancel(h)) h = 0, --cr.pending, cr.segment_failed = true;
      if (!poll(cr)) {
        in_flight = true;
        continue;
      }
      if (!cr.segment_failed) {
        cr.done = true;
        mr.path_bytes[static_cast<int>(cr.c.path)] += cr.c.num_bytes;
        continue;
      }
      if (t.draining || mr.failed || cr.attempts >= opts_.max_attempts) {
        mr.failed = true;
        continue;
      }
      switch_path(t, cr, mr);
      issue(t, cr, cr.c.move_idx);
      in_flight = true;
    }
    // Moves whose chunks all landed: verify, then publish the copy.
    for (std::size_t i = 0; i < t.moves.size(); ++i) {
      MoveRun &mr = t.moves[i];
      if (mr.finished) continue;
      bool all_done = true, busy = false;
      for (int ci : mr.chunk_idx)
        all_done = all_done && t.chunks[ci].done, busy = busy || t.chunks[ci].in_flight;
      if (busy) continue;
      if (mr.failed || (t.draining && !all_done)) {
        mr.failed = true;
        mr.finished = true;
        mr.end = now_s;
        continue;
      }
      if (!all_done) continue;
      const Move &m = t.plan.moves[i];
      if (opts_.verify) {
        std::uint64_t got = 0;
        const bool read = expert_sum(m.dst_gpu, slot_base(ls, m.dst_gpu, m.dst_slot, t.dst_buffer), got).ok();
        if (!read || got != mr.src_sum) {
          // Wrong bytes: copy the whole expert again over the other path, while attempts remain.
          ++mr.verify_rounds;
          if (t.draining || mr.verify_rounds >= opts_.max_attempts) {
            mr.failed = mr.finished = true;
            mr.end = now_s;
            continue;
          }
          for (int ci : mr.chunk_idx) {
            ChunkRun &cr = t.chunks[ci];
            cr.done = false;
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

  void issue_reduce(TicketImpl &t, ReduceRun &r, double now_s) {
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
    r.copy.segment_failed = false;
    if (!transport_->start(op, r.copy.handles[0]).ok()) {
      r.copy.handles.clear();
      r.copy.segment_failed = true;
    }
    r.copy.pending = r.copy.handles.size();
    r.copy.in_flight = true;
  }

  void step_reduce(TicketImpl &t, double now_s) {
    bool in_flight = false;
    for (ReduceRun &r : t.reduces) {
      if (!r.copy.in_flight) continue;
      if (t.draining && !r.copy.handles.empty() && r.copy.handles[0] != 0 && transport_->cancel(r.copy.handles[0]))
        r.copy.handles[0] = 0, --r.copy.pending, r.copy.segment_failed = true;
      if (!poll(r.copy)) {
        in_flight = true;
        continue;
      }
      if (!r.copy.segment_failed) {
        r.copy.done = true;
        r.end = now_s;
      } else if (!t.draining && r.copy.attempts < opts_.max_attempts) {
        issue_reduce(t, r, now_s);
        in_flight = true;
      } else {
        r.end = now_s;
      }
    }
    if (in_flight) return;
    // Every staging copy ended: add each expert's replicas into the owner, in replica order, all or nothing.
    LayerState &ls = layers_[t.layer];
    const std::int64_t n = ls.grad_bytes / 4;
    for (std::size_t i = 0; i < t.reduces.size();) {
      std::size_t j = i;
      bool ok = true;
      for (; j < t.reduces.size() && t.reduces[j].expert == t.reduces[i].expert; ++j)
        ok = ok && t.reduces[j].copy.done;
      if (ok)
        for (std::size_t k = i; k < j; ++k) {
          const ReduceRun &r = t.reduces[k];
          const SlotRegion &og = ls.grads[r.owner];
          auto *dst = reinterpret_cast<float *>(static_cast<std::byte *>(og.base) + r.owner_slot * og.slot_stride_bytes);
          if (!transport_->accumulate(r.owner, dst, reinterpret_cast<const float *>(r.staging), n).ok()) ok = false;
        }
      for (std::size_t k = i; k < j; ++k)
        t.reduces[k].copy.done = ok;
      i = j;
    }
    end(t);
  }

  void end(TicketImpl &t) {
    std::vector<MoveTelemetry> tel;
    std::string failed;
    int num_failed = 0;
    auto note = [&](int idx, bool ok, const char *what, int expert, int gpu) {
      if (ok) return;
      if (++num_failed <= 8) failed += foremoe::detail::concat(num_failed > 1 ? ", " : "", what, " ", idx, " (expert ",
                                                                expert, " on GPU ", gpu, ")");
    };
    if (t.kind == TicketImpl::Kind::moves) {
      for (std::size_t i = 0; i < t.moves.size(); ++i) {
        const MoveRun &mr = t.moves[i];
        MoveTelemetry m;
        m.move_idx = static_cast<int>(i);
        int best = 0;
        for (int p = 1; p < transfer::num_paths; ++p)
          if (mr.path_bytes[p] > mr.path_bytes[best]) best = p;
        m.path = static_cast<transfer::Path>(best);
        m.num_bytes = t.plan.expert_bytes;
        m.start_seconds = std::max(0.0, mr.start);
        m.end_seconds = mr.end;
        m.gb_per_s = mr.end > m.start_seconds ? static_cast<double>(m.num_bytes) / (mr.end - m.start_seconds) / 1e9 : 0;
        m.attempts = mr.attempts;
        m.num_chunks = static_cast<int>(mr.chunk_idx.size());
        m.ok = mr.finished && !mr.failed;
        m.verified = mr.checked;
        tel.push_back(m);
        note(static_cast<int>(i), m.ok, "move", t.plan.moves[i].expert, t.plan.moves[i].dst_gpu);
      }
    } else {
      for (std::size_t i = 0; i < t.reduces.size(); ++i) {
        const ReduceRun &r = t.reduces[i];
        MoveTelemetry m;
        m.move_idx = static_cast<int>(i);
        m.path = r.copy.c.path;
        m.num_bytes = r.copy.c.num_bytes;
        m.start_seconds = std::max(0.0, r.start);
        m.end_seconds = r.end;
        m.gb_per_s = r.end > m.start_seconds ? static_cast<double>(m.num_bytes) / (r.end - m.start_seconds) / 1e9 : 0;
        m.attempts = r.copy.attempts;
        m.num_chunks = 1;
        m.ok = r.copy.done;
        tel.push_back(m);
        note(static_cast<int>(i), m.ok, "reduction", r.expert, r.gpu);
      }
    }
    Status st;
    TicketState ts = TicketState::done;
    if (t.draining && t.drain_reason != StatusCode::ok && (num_failed > 0 || !t.gated)) {
      ts = t.drain_reason == StatusCode::aborted ? TicketState::aborted
           : t.drain_reason == StatusCode::timed_out ? TicketState::timed_out
                                                     : TicketState::failed;
      if (t.final_status.code() == StatusCode::in_progress)
        st = {t.drain_reason, foremoe::detail::concat("layer ", t.layer, ": batch ",
                                                     ts == TicketState::aborted ? "aborted" : "timed out",
                                                     t.gated ? "" : " before its gates opened",
                                                     num_failed ? "; unfinished: " : "", failed)};
      else
        st = t.final_status;
    } else if (num_failed > 0) {
      ts = TicketState::failed;
      st = {StatusCode::device_error,
            foremoe::detail::concat("layer ", t.layer, ": ", num_failed, " of ", tel.size(), " failed on every path: ",
                                    failed, num_failed > 8 ? ", ..." : "")};
    }
    if (t.flag != nullptr) *t.flag = 1; // releases streams waiting in enqueue_wait, also on failure
    {
      // The state changes under the ticket's lock so that a waiter cannot miss the notification.
      std::lock_guard lock(t.mu);
      t.telemetry = std::move(tel);
      t.final_status = st;
      t.after.clear();
      t.state.store(static_cast<int>(ts), std::memory_order_release);
    }
    t.cv.notify_all();
  }

  EngineOptions opts_;
  std::shared_ptr<Transport> transport_;
  std::vector<std::int64_t> prefix_; // packed byte offset of each tensor
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<LayerState> layers_;
  std::vector<std::shared_ptr<TicketImpl>> active_;
  std::uint64_t serial_ = 0;
  bool stopping_ = false;
  std::thread progress_;

  friend class ::foremoe::runtime::TransferEngine;
};

} // namespace detail

// --- Ticket ------------------------------------------------------------------------------------------------------

Status Ticket::poll() const {
  if (!impl_) return {StatusCode::invalid_argument, "poll: empty ticket"};
  if (!impl_->finished()) return {StatusCode::in_progress, ""};
  std::lock_guard lock(impl_->mu);
  return impl_->final_status;
}
TicketState Ticket::state() const {
  return impl_ ? static_cast<TicketState>(impl_->state.load(std::memory_order_acquire)) : TicketState::failed;
}
Status Ticket::wait(std::chrono::steady_clock::time_point deadline) const {
  if (!impl_) return {StatusCode::invalid_argument, "wait: empty ticket"};
  std::unique_lock lock(impl_->mu);
  if (!impl_->cv.wait_until(lock, deadline, [&] { return impl_->finished(); }))
    return {StatusCode::timed_out, "wait: the batch is still running at the deadline"};
  return impl_->final_status;
}
Status Ticket::enqueue_wait(void *stream) const {
  if (!impl_) return {StatusCode::invalid_argument, "enqueue_wait: empty ticket"};
  return impl_->transport->enqueue_wait(stream, impl_->flag);
}
void Ticket::abort() const {
  if (impl_) impl_->abort_requested = true;
}
std::vector<MoveTelemetry> Ticket::telemetry() const {
  if (!impl_) return {};
  std::lock_guard lock(impl_->mu);
  return impl_->telemetry;
}

// --- TransferEngine ----------------------------------------------------------------------------------------------

TransferEngine::TransferEngine(std::unique_ptr<detail::EngineImpl> impl) : impl_(std::move(impl)) {}
TransferEngine::~TransferEngine() = default;

Status TransferEngine::create(EngineOptions o, std::unique_ptr<TransferEngine> &out) {
  try {
    o.topology.validate();
    foremoe::detail::require(o.num_layers > 0, "num_layers must be positive, got ", o.num_layers);
    foremoe::detail::require(o.num_experts > 0, "num_experts must be positive, got ", o.num_experts);
    foremoe::detail::require(!o.tensors.empty(), "an expert needs at least one tensor");
    std::int64_t total = 0;
    for (std::size_t i = 0; i < o.tensors.size(); ++i) {
      const TensorSpan &t = o.tensors[i];
      foremoe::detail::require(t.offset_bytes >= 0 && t.num_bytes > 0, "tensor ", i, " has offset ", t.offset_bytes,
                               " and ", t.num_bytes, " bytes");
      for (std::size_t j = 0; j < i; ++j)
        foremoe::detail::require(t.offset_bytes >= o.tensors[j].offset_bytes + o.tensors[j].num_bytes ||
                                     o.tensors[j].offset_bytes >= t.offset_bytes + t.num_bytes,
                                 "tensors ", j, " and ", i, " overlap");
      total += t.num_bytes;
    }
    o.planning.expert_bytes = total;
    o.planning.validate();
    foremoe::detail::require(o.max_attempts >= 1, "max_attempts must be >= 1, got ", o.max_attempts);
    if (o.faults) {
      for (double p : {o.faults->fail_probability, o.faults->corrupt_probability, o.faults->delay_probability})
        foremoe::detail::require(p >= 0 && p <= 1, "fault probabilities must lie in [0, 1], got ", p);
      foremoe::detail::require(o.faults->delay_us >= 0, "delay_us must be >= 0, got ", o.faults->delay_us);
    }
  } catch (const Error &e) {
    return {StatusCode::invalid_argument, std::string("TransferEngine: ") + e.what()};
  }
  std::unique_ptr<detail::Transport> t;
  switch (o.backend) {
  case Backend::host: t = detail::make_host_transport(o); break;
  case Backend::cuda:
#if defined(FOREMOE_HAVE_CUDA)
    if (Status st = detail::make_cuda_transport(o, t); !st.ok()) return st;
    break;
#else
    return {StatusCode::unavailable, "TransferEngine: this runtime was built without CUDA"};
#endif
  default: return {StatusCode::invalid_argument, "TransferEngine: unknown backend"};
  }
  if (o.faults) t = detail::make_fault_transport(std::move(t), o.faults);
  out.reset(new TransferEngine(std::make_unique<detail::EngineImpl>(std::move(o), std::move(t))));
  return Status::success();
}

Status TransferEngine::register_slots(int layer, int gpu, const SlotRegion &slots) {
  return impl_->register_region(layer, gpu, slots, false, 0);
}
Status TransferEngine::register_mirror(int layer, int node, const MirrorRegion &mirror) {
  return impl_->register_mirror(layer, node, mirror);
}
Status TransferEngine::register_grads(int layer, int gpu, const SlotRegion &grads, std::int64_t grad_bytes) {
  return impl_->register_region(layer, gpu, grads, true, grad_bytes);
}
Status TransferEngine::set_resident(int layer, const LayerPlacement &placement) {
  return impl_->set_resident(layer, placement);
}
Status TransferEngine::submit(const MoveBatch &batch, Ticket &out) {
  std::shared_ptr<detail::TicketImpl> made;
  Status st = impl_->submit(batch, out, made);
  if (st.ok()) out.impl_ = std::move(made);
  return st;
}
Status TransferEngine::submit_reduce(const ReduceBatch &batch, Ticket &out) {
  std::shared_ptr<detail::TicketImpl> made;
  Status st = impl_->submit_reduce(batch, out, made);
  if (st.ok()) out.impl_ = std::move(made);
  return st;
}
std::int32_t TransferEngine::valid_expert(int layer, int gpu, int slot) const {
  return impl_->valid_expert(layer, gpu, slot);
}
LayerPlacement TransferEngine::resident(int layer) const { return impl_->resident(layer); }
transfer::TransferPlan TransferEngine::last_plan(int layer) const { return impl_->last_plan(layer); }

} // namespace runtime
} // namespace v0
} // namespace foremoe
