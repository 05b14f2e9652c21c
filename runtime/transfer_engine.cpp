// The transfer engine's state machine, shared by every backend: plans a batch's chunks, waits for its gates and for
// earlier batches touching the same slots, issues the copies, retries failed chunks on the other path, verifies
// moved experts, keeps the valid-expert map exact, and ends every batch by its deadline.

#include "foremoe/runtime/transfer_engine.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "foremoe/core/error.hpp"
#include "foremoe/runtime/testing.hpp"
#include "transport_util.hpp"

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
  LayerPlacement resident;           // valid copies (other processes' GPUs: as planned)
  LayerPlacement planned;            // multi-process: the placement every submitted move leads to
  std::vector<std::uint8_t> buffer;  // per physical slot: the buffer holding the valid copy
  transfer::TransferPlan last_plan;
};

// Who carries a chunk in this process: itself (both ends local, or the local mirror), one side of a paired
// transfer with another process, or nobody.
enum class Role : std::uint8_t { local, send, recv, none };

struct ChunkRun {
  transfer::Chunk c;
  Role role = Role::local;
  bool peer_done = false; // a paired transfer's outcome arrived
  int attempts = 0;
  bool in_flight = false, done = false;
  std::vector<std::uint64_t> handles;
  std::size_t pending = 0;
  bool segment_failed = false;
  double seconds = 0.0;
};

struct MoveRun {
  int gpu_src = -1, gpu_src_slot = -1; // a local GPU source for retries (-1: none)
  bool finished = false, failed = false, checked = false, remote = false;
  bool have_sum = false;               // src_sum known (from a local source or a sender's header)
  std::uint64_t src_sum = 0;
  bool have_send_sum = false;          // this process sends chunks of the move: checksum of its source
  std::uint64_t send_sum = 0;
  int verify_rounds = 0;
  std::vector<int> chunk_idx; // its chunks in TicketImpl::chunks
  std::int64_t path_bytes[transfer::num_paths] = {0, 0, 0};
  double start = -1.0, end = 0.0;
  int attempts = 0;
};

// One replica gradient on its way to the owner: copied into `staging` on the owner GPU, then accumulated.
struct ReduceRun {
  int expert = 0, gpu = 0, slot = 0, owner = 0, owner_slot = 0;
  Role role = Role::local;
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
  std::vector<int> reads; // physical slots read as sources (sorted)

  // Paired transfers with other processes: posted once, in submission order, one group per round.
  struct PeerGroup {
    std::size_t begin = 0, end = 0;
    std::uint64_t handle = 0;
    bool pending = false;
    Status status;
  };
  bool has_peer = false, peer_posted = false;
  std::atomic<bool> peer_outstanding{false};
  std::vector<PeerOp> peer_ops;
  std::vector<int> peer_item; // per op: its chunk (moves) or reduction (reduce)
  std::vector<std::uint64_t> peer_tag; // per op: what a valid header names
  std::vector<PeerGroup> peer_groups;
  std::vector<std::pair<int, std::byte *>> scratch; // per local GPU: what ops of an abandoned batch read and write

  ~TicketImpl() {
    if (flag != nullptr && transport) transport->free_flags(flag);
    for (ReduceRun &r : reduces)
      if (r.staging != nullptr && transport) transport->free(r.owner, r.staging);
    for (auto &[gpu, p] : scratch)
      if (transport) transport->free(gpu, p);
  }
  [[nodiscard]] bool finished() const noexcept {
    return state.load(std::memory_order_acquire) != static_cast<int>(TicketState::pending);
  }
  /// Finished, and no paired transfer of it can still write its slots.
  [[nodiscard]] bool busy() const noexcept { return !finished() || peer_outstanding.load(std::memory_order_acquire); }
};

class EngineImpl {
public:
  EngineImpl(EngineOptions o, std::shared_ptr<Transport> t) : opts_(std::move(o)), transport_(std::move(t)) {
    const int num_gpus = opts_.topology.num_gpus();
    local_.assign(static_cast<std::size_t>(num_gpus), opts_.peers.local_gpus.empty() ? 1 : 0);
    for (int g : opts_.peers.local_gpus)
      local_[g] = 1;
    spmd_ = multi_process(opts_);
    layers_.resize(static_cast<std::size_t>(opts_.num_layers));
    for (LayerState &ls : layers_) {
      ls.slots.resize(num_gpus);
      ls.grads.resize(num_gpus);
      ls.mirrors.resize(opts_.topology.num_nodes);
      ls.resident = LayerPlacement(num_gpus, opts_.topology.slots_per_gpu, opts_.num_experts);
      ls.planned = ls.resident;
      ls.buffer.assign(static_cast<std::size_t>(ls.resident.num_slots()), 0);
    }
    prefix_.push_back(0);
    for (const TensorSpan &ts : opts_.tensors)
      prefix_.push_back(prefix_.back() + ts.num_bytes);
    progress_ = std::thread([this] { run(); });
  }
  ~EngineImpl() {
    // Running batches end aborted (bounded by their deadlines) before the thread stops; paired transfers another
    // process never matched are dropped with the transport.
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
    if (!local_[idx]) return bad(what, ": GPU ", idx, " is driven by another process (peers.local_gpus)");
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
    bool has_local = false;
    for (int g = 0; g < opts_.topology.gpus_per_node; ++g)
      has_local = has_local || local_[node * opts_.topology.gpus_per_node + g];
    if (!has_local) return bad("register_mirror: node ", node, " has no GPU this engine drives");
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
      if (t->layer == layer && t->busy()) return {StatusCode::invalid_argument, "set_resident: layer " + std::to_string(layer) +
                                                                       " has batches in flight"};
    layers_[layer].resident = p;
    layers_[layer].planned = p;
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
    // Every local GPU a chunk may write must be registered.
    for (const Move &m : b.moves) {
      if (m.dst_gpu < 0 || m.dst_gpu >= topo.num_gpus())
        return bad("submit: move of expert ", m.expert, " targets GPU ", m.dst_gpu);
      if (!local_[m.dst_gpu]) continue;
      if (ls.slots[m.dst_gpu].base == nullptr)
        return bad("submit: layer ", b.layer, " GPU ", m.dst_gpu, " has no registered slots");
      if (b.dst_buffer < 0 || b.dst_buffer >= ls.slots[m.dst_gpu].num_buffers)
        return bad("submit: dst_buffer ", b.dst_buffer, " but GPU ", m.dst_gpu, " has ",
                   ls.slots[m.dst_gpu].num_buffers, " buffers per slot");
    }
    transfer::Options popt = opts_.planning;
    LayerPlacement view;
    if (spmd_) {
      // Every process must derive the same chunks: plan on the placement as planned, whatever has landed yet. A
      // source still being written is waited for (slot hazards below), and one whose move failed sends a header
      // saying so.
      view = ls.planned;
      if (popt.host_mirror)
        for (const Move &m : b.moves)
          if (local_[m.dst_gpu] && ls.mirrors[topo.node_of(m.dst_gpu)].base == nullptr)
            return bad("submit: planning.host_mirror is set but node ", topo.node_of(m.dst_gpu),
                       " has no registered mirror for layer ", b.layer,
                       " (multi-process use declares the mirrors of every node)");
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
          if (written[static_cast<std::size_t>(g) * slots + s] || ls.slots[g].base == nullptr)
            view.slot(g, s) = empty_slot;
      bool all_mirrors = true;
      for (const Move &m : b.moves)
        all_mirrors = all_mirrors && ls.mirrors[topo.node_of(m.dst_gpu)].base != nullptr;
      popt.host_mirror = popt.host_mirror && all_mirrors;
    }
    try {
      t->plan = transfer::plan_transfers(b.moves, view, topo, popt);
    } catch (const Error &err) {
      return {StatusCode::invalid_argument, std::string("submit: ") + err.what()};
    }
    for (const transfer::Chunk &c : t->plan.chunks)
      if (c.path != transfer::Path::pcie && local_[c.src_gpu] && ls.slots[c.src_gpu].base == nullptr)
        return bad("submit: layer ", b.layer, " GPU ", c.src_gpu, " holds a source of expert ", c.expert,
                   " but has no registered slots");
    for (const Move &m : b.moves)
      if (local_[m.dst_gpu]) t->touched.push_back(m.dst_gpu * slots + m.dst_slot);
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
          if (g != m.dst_gpu && local_[g] && ls.slots[g].base != nullptr && view.slot(g, s) == m.expert &&
              !std::binary_search(t->touched.begin(), t->touched.end(), g * slots + s)) {
            const bool same_node = topo.node_of(g) == topo.node_of(m.dst_gpu);
            if (!same_node && !popt.allow_network) continue;
            if (best < 0 || (same_node && topo.node_of(best) != topo.node_of(m.dst_gpu))) best = g, best_slot = s;
          }
      mr.gpu_src = best;
      mr.gpu_src_slot = best_slot;
      if (best >= 0) t->reads.push_back(best * slots + best_slot);
    }
    std::sort(t->touched.begin(), t->touched.end());
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
    // Multi-process: every process enumerates the same replicas (from the planned placement); a sender whose
    // replica is not valid says so in its header.
    const LayerPlacement &where = spmd_ ? ls.planned : ls.resident;
    for (int e = 0; e < opts_.num_experts; ++e) {
      const int o = b.owner_gpu[e];
      if (o < 0 || o >= topo.num_gpus()) return bad("submit_reduce: expert ", e, " has owner GPU ", o);
      int owner_slot = -1;
      for (int s = 0; s < slots; ++s)
        if (where.slot(o, s) == e) owner_slot = s;
      bool any = false;
      for (int g = 0; g < topo.num_gpus(); ++g)
        for (int s = 0; s < slots; ++s)
          if (g != o && where.slot(g, s) == e) {
            if (owner_slot < 0)
              return bad("submit_reduce: expert ", e, " has a replica on GPU ", g, " but its owner GPU ", o,
                         " holds no valid copy");
            ReduceRun r;
            r.expert = e, r.gpu = g, r.slot = s, r.owner = o, r.owner_slot = owner_slot;
            r.role = local_[g] && local_[o] ? Role::local : local_[o] ? Role::recv : local_[g] ? Role::send : Role::none;
            for (int x : {g, o})
              if (local_[x] && ls.grads[x].base == nullptr)
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
  // Busy batches of `layer` that write what a new batch touches or reads, or read what it writes (all sorted);
  // the caller holds `mu_`.
  std::vector<std::shared_ptr<TicketImpl>> overlapping(int layer, const std::vector<int> &writes,
                                                       const std::vector<int> &reads) const {
    auto meet = [](const std::vector<int> &x, const std::vector<int> &y) {
      for (std::size_t i = 0, j = 0; i < x.size() && j < y.size();)
        if (x[i] == y[j]) return true;
        else if (x[i] < y[j]) ++i;
        else ++j;
      return false;
    };
    std::vector<std::shared_ptr<TicketImpl>> out;
    for (const auto &a : active_) {
      if (a->layer != layer || !a->busy()) continue;
      if (meet(a->touched, writes) || meet(a->touched, reads) || meet(a->reads, writes)) out.push_back(a);
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
    if (Status st = transport_->alloc_flags(1, t->flag); !st.ok()) return st;
    t->serial = ++serial_;
    t->t0 = clock::now();
    t->deadline = t->t0 + timeout;
    active_.push_back(t);
    if (t->has_peer) {
      peer_order_.push_back(t.get());
      t->peer_outstanding.store(true, std::memory_order_release);
    }
    made = t;
    (void)out;
    cv_.notify_all();
    return Status::success();
  }

  // --- the progress thread -------------------------------------------------------------------------------------

  void run() {
    std::unique_lock lock(mu_);
    for (;;) {
      if (stopping_ && std::all_of(active_.begin(), active_.end(), [](const auto &t) { return t->finished(); }))
        return;
      if (active_.empty()) {
        cv_.wait(lock, [&] { return stopping_ || !active_.empty(); });
        continue;
      }
      std::vector<std::shared_ptr<TicketImpl>> batch = active_;
      lock.unlock();
      for (auto &t : batch)
        step(*t);
      lock.lock();
      std::erase_if(active_, [](const auto &t) { return !t->busy(); });
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
  // Expert `expert`'s entry in the mirror of GPU `gpu`'s node.
  std::byte *mirror_base(const LayerState &ls, int gpu, int expert) const {
    const MirrorRegion &m = ls.mirrors[opts_.topology.node_of(gpu)];
    return static_cast<std::byte *>(const_cast<void *>(m.base)) + expert * m.expert_stride_bytes;
  }
  // Calls `f(tensor, lo, hi)` for each piece `[lo, hi)` of chunk `c` that lies in one tensor (offsets into the
  // expert's packed bytes; the piece starts at `at(base, tensor, lo - prefix_[tensor])` of a slot or mirror entry).
  template <class F> void for_each_piece(const transfer::Chunk &c, F &&f) const {
    for (std::size_t ti = 0; ti < opts_.tensors.size(); ++ti) {
      const std::int64_t lo = std::max(c.offset_bytes, prefix_[ti]),
                         hi = std::min(c.offset_bytes + c.num_bytes, prefix_[ti + 1]);
      if (lo < hi) f(static_cast<int>(ti), lo, hi);
    }
  }

  // Issues `cr` (its current path and source) as one copy per tensor it overlaps.
  bool issue(TicketImpl &t, ChunkRun &cr, int move_idx) {
    LayerState &ls = layers_[t.layer];
    const transfer::Chunk &c = cr.c;
    void *src_base;
    {
      std::lock_guard lock(mu_);
      if (c.path != transfer::Path::pcie && ls.resident.slot(c.src_gpu, c.src_slot) != c.expert) {
        // Multi-process: planned there, but its move failed here. Fails at once; the retry takes the other path.
        ++cr.attempts;
        ++t.moves[move_idx].attempts;
        cr.handles.clear();
        cr.segment_failed = true;
        cr.pending = 0;
        cr.in_flight = true;
        return false;
      }
      src_base = c.path == transfer::Path::pcie
                     ? mirror_base(ls, c.dst_gpu, c.expert)
                     : slot_base(ls, c.src_gpu, c.src_slot, ls.buffer[c.src_gpu * opts_.topology.slots_per_gpu + c.src_slot]);
    }
    std::byte *dst_base = slot_base(ls, c.dst_gpu, c.dst_slot, t.dst_buffer);
    cr.handles.clear();
    cr.segment_failed = false;
    cr.seconds = 0.0;
    ++cr.attempts;
    ++t.moves[move_idx].attempts;
    for_each_piece(c, [&](int ti, std::int64_t lo, std::int64_t hi) {
      CopyOp op;
      op.path = c.path;
      op.src_gpu = c.path == transfer::Path::pcie ? -1 : c.src_gpu;
      op.dst_gpu = c.dst_gpu;
      op.src = at(src_base, ti, lo - prefix_[ti]);
      op.dst = at(dst_base, ti, lo - prefix_[ti]);
      op.num_bytes = hi - lo;
      op.fault_key = mix64(t.serial) ^ mix64((static_cast<std::uint64_t>(move_idx) << 20) ^ static_cast<std::uint64_t>(lo)) ^
                     mix64(static_cast<std::uint64_t>(cr.attempts) * 131 + static_cast<std::uint64_t>(c.path));
      std::uint64_t h = 0;
      if (!transport_->start(op, h).ok()) {
        cr.segment_failed = true;
        return;
      }
      cr.handles.push_back(h);
    });
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

  // Moves the chunk to the other path where there is one (mirror <-> a local GPU copy). A paired transfer is
  // never posted again (its sender would not know), so a received chunk without a local alternative is lost:
  // returns false then.
  bool switch_path(const TicketImpl &t, ChunkRun &cr, const MoveRun &mr) const {
    transfer::Chunk &c = cr.c;
    const bool was_peer = cr.role != Role::local;
    if (c.path != transfer::Path::pcie && t.host_mirror) {
      c.path = transfer::Path::pcie;
      c.src_gpu = host_mirror;
      c.src_slot = -1;
    } else if ((c.path == transfer::Path::pcie || was_peer) && mr.gpu_src >= 0) {
      c.src_gpu = mr.gpu_src;
      c.src_slot = mr.gpu_src_slot;
      c.path = opts_.topology.node_of(mr.gpu_src) == opts_.topology.node_of(c.dst_gpu) ? transfer::Path::nvlink
                                                                                       : transfer::Path::network;
    } else if (was_peer) {
      return false;
    }
    cr.role = Role::local;
    cr.peer_done = false;
    return true;
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
    if (t.finished()) {
      // An ended batch still posts its paired transfers in turn (on scratch memory) and collects them.
      if (t.has_peer && !t.peer_posted) post_peer(t, true);
      else if (t.peer_outstanding.load(std::memory_order_relaxed)) poll_peer(t);
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
      if (t.kind == TicketImpl::Kind::moves) start_moves(t, now_s);
      else start_reduce(t, now_s);
      return;
    }
    if (t.kind == TicketImpl::Kind::moves) step_moves(t, now_s);
    else step_reduce(t, now_s);
  }

  // --- paired transfers with other processes ---------------------------------------------------------------------

  std::byte *scratch(TicketImpl &t, int gpu, std::int64_t need) {
    for (auto &[g, p] : t.scratch)
      if (g == gpu) return p;
    std::byte *p = nullptr;
    if (!transport_->alloc(gpu, need, p).ok()) return nullptr;
    t.scratch.emplace_back(gpu, p);
    return p;
  }

  // Posts the batch's paired transfers once it is the oldest batch of this engine with any, one group per round
  // (moves) or one group (reduce). `discard`: the batch is abandoned; sends read and receives write scratch memory
  // and every header says "not valid". Returns false while older batches have not posted theirs.
  bool post_peer(TicketImpl &t, bool discard) {
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
        std::byte *base = nullptr;
        if (send) {
          std::lock_guard lock(mu_);
          valid = ls.resident.slot(c.src_gpu, c.src_slot) == c.expert;
          base = slot_base(ls, c.src_gpu, c.src_slot, ls.buffer[c.src_gpu * slots + c.src_slot]);
        } else {
          base = slot_base(ls, c.dst_gpu, c.dst_slot, t.dst_buffer);
        }
        if (send && valid && opts_.verify && !mr.have_send_sum && !discard) {
          valid = expert_sum(c.src_gpu, base, mr.send_sum).ok();
          mr.have_send_sum = valid;
        }
        for_each_piece(c, [&](int ti, std::int64_t lo, std::int64_t hi) {
          biggest = std::max(biggest, hi - lo);
          add(send, send ? c.src_gpu : c.dst_gpu, send ? c.dst_gpu : c.src_gpu, at(base, ti, lo - prefix_[ti]), hi - lo,
              valid && !discard, mr.send_sum, static_cast<int>(i), c.round,
              tag_of({c.expert, c.src_gpu, c.src_slot, c.dst_gpu, c.dst_slot, lo, hi}));
        });
      }
    } else {
      for (std::size_t i = 0; i < t.reduces.size(); ++i) {
        ReduceRun &r = t.reduces[i];
        if (r.role != Role::send && r.role != Role::recv) continue;
        const bool send = r.role == Role::send;
        bool valid = false;
        std::byte *buf = r.staging;
        if (send) {
          std::lock_guard lock(mu_);
          valid = ls.resident.slot(r.gpu, r.slot) == r.expert;
          buf = static_cast<std::byte *>(ls.grads[r.gpu].base) + r.slot * ls.grads[r.gpu].slot_stride_bytes;
        }
        biggest = std::max(biggest, ls.grad_bytes);
        add(send, send ? r.gpu : r.owner, send ? r.owner : r.gpu, buf, ls.grad_bytes, valid && !discard, 0,
            static_cast<int>(i), 0, tag_of({-1, r.expert, r.gpu, r.slot, r.owner, ls.grad_bytes}));
      }
    }
    if (t.kind == TicketImpl::Kind::moves)
      for (int item : t.peer_item)
        ++t.chunks[item].pending;
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
  void poll_peer(TicketImpl &t) {
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
        if (t.kind == TicketImpl::Kind::moves) {
          ChunkRun &cr = t.chunks[t.peer_item[k]];
          if (!ok) cr.segment_failed = true;
          if (!op.send && ok && opts_.verify) {
            MoveRun &mr = t.moves[cr.c.move_idx];
            if (!mr.have_sum) mr.src_sum = op.header[1], mr.have_sum = true;
          }
          if (--cr.pending == 0) cr.peer_done = true;
        } else {
          ReduceRun &r = t.reduces[t.peer_item[k]];
          r.copy.segment_failed = !ok;
          r.copy.pending = 0;
          r.copy.peer_done = true;
        }
      }
      g.end = g.begin; // consumed
    }
    if (!pending && t.peer_posted) t.peer_outstanding.store(false, std::memory_order_release);
  }

  // --- moves ---------------------------------------------------------------------------------------------------

  void start_moves(TicketImpl &t, double now_s) {
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
        if (ls.buffer[p] == t.dst_buffer || ls.slots[m.dst_gpu].num_buffers == 1) ls.resident.slot(m.dst_gpu, m.dst_slot) = empty_slot;
      }
    }
    if (opts_.verify)
      for (std::size_t i = 0; i < t.moves.size(); ++i) {
        const Move &m = t.plan.moves[i];
        MoveRun &mr = t.moves[i];
        if (mr.remote) continue;
        void *base;
        int gpu;
        if (t.host_mirror) {
          base = mirror_base(ls, m.dst_gpu, m.expert);
          gpu = -1;
        } else if (mr.gpu_src >= 0) {
          std::unique_lock lock(mu_);
          if (ls.resident.slot(mr.gpu_src, mr.gpu_src_slot) != m.expert) {
            mr.gpu_src = -1; // planned there but not valid here (multi-process): no sum, no retry source
            continue;
          }
          lock.unlock();
          gpu = mr.gpu_src;
          base = slot_base(ls, mr.gpu_src, mr.gpu_src_slot, ls.buffer[mr.gpu_src * slots + mr.gpu_src_slot]);
        } else {
          continue; // only another process holds it: its sender's header carries the checksum
        }
        if (!expert_sum(gpu, base, mr.src_sum).ok()) mr.failed = true;
        mr.have_sum = true;
      }
    for (ChunkRun &cr : t.chunks) {
      MoveRun &mr = t.moves[cr.c.move_idx];
      if (cr.role == Role::none) {
        cr.done = true;
        continue;
      }
      if (mr.start < 0) mr.start = now_s;
      if (cr.role != Role::local) {
        // Waits for its paired transfer; `pending` counts its ops until they are posted.
        cr.in_flight = true;
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

  void step_moves(TicketImpl &t, double now_s) {
    if (t.has_peer && !t.peer_posted) post_peer(t, t.draining);
    LayerState &ls = layers_[t.layer];
    const int slots = opts_.topology.slots_per_gpu;
    bool in_flight = false;
    for (ChunkRun &cr : t.chunks) {
      MoveRun &mr = t.moves[cr.c.move_idx];
      if (!cr.in_flight) continue;
      if (cr.role == Role::local) {
        if (t.draining)
          for (std::uint64_t &h : cr.handles)
            if (h != 0 && transport_->cancel(h)) h = 0, --cr.pending, cr.segment_failed = true;
        if (!poll(cr)) {
          in_flight = true;
          continue;
        }
      } else {
        if (!cr.peer_done && t.draining) {
          // Paired transfers cannot be cancelled: the chunk is lost, and the batch stays busy (its slots locked)
          // until the transfer ends.
          cr.in_flight = false;
          mr.failed = true;
          continue;
        }
        if (!cr.peer_done) {
          in_flight = true;
          continue;
        }
        cr.in_flight = false;
      }
      if (!cr.segment_failed) {
        cr.done = true;
        mr.path_bytes[static_cast<int>(cr.c.path)] += cr.c.num_bytes;
        continue;
      }
      if (cr.role == Role::send || t.draining || mr.failed || cr.attempts >= opts_.max_attempts ||
          !switch_path(t, cr, mr)) {
        mr.failed = true;
        continue;
      }
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
      if (mr.remote) {
        mr.finished = true;
        mr.end = now_s;
        continue;
      }
      const Move &m = t.plan.moves[i];
      if (opts_.verify) {
        std::uint64_t got = 0;
        const bool read = expert_sum(m.dst_gpu, slot_base(ls, m.dst_gpu, m.dst_slot, t.dst_buffer), got).ok();
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

  // --- replica gradients ---------------------------------------------------------------------------------------

  void start_reduce(TicketImpl &t, double now_s) {
    for (ReduceRun &r : t.reduces) {
      if (r.start < 0) r.start = now_s;
      if (r.role == Role::local) issue_reduce(t, r, now_s);
      else if (r.role == Role::none) r.copy.done = true;
      else r.copy.in_flight = true, ++r.copy.attempts;
    }
    step_reduce(t, now_s);
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
    if (t.has_peer && !t.peer_posted) post_peer(t, t.draining);
    bool in_flight = false;
    for (ReduceRun &r : t.reduces) {
      if (!r.copy.in_flight) continue;
      if (r.role != Role::local) {
        if (!r.copy.peer_done && !t.draining) {
          in_flight = true;
          continue;
        }
        r.copy.in_flight = false;
        r.copy.done = r.copy.peer_done && !r.copy.segment_failed;
        r.end = now_s;
        continue;
      }
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
    // Every staging copy ended: add each expert's replicas into a local owner, in replica order, all or nothing.
    LayerState &ls = layers_[t.layer];
    const std::int64_t n = ls.grad_bytes / 4;
    for (std::size_t i = 0; i < t.reduces.size();) {
      std::size_t j = i;
      bool ok = true;
      for (; j < t.reduces.size() && t.reduces[j].expert == t.reduces[i].expert; ++j)
        ok = ok && t.reduces[j].copy.done;
      if (!local_[t.reduces[i].owner]) {
        i = j; // another process adds them; sends report their own outcome
        continue;
      }
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
        m.remote = mr.remote;
        tel.push_back(m);
        if (!mr.remote) note(static_cast<int>(i), m.ok, "move", t.plan.moves[i].expert, t.plan.moves[i].dst_gpu);
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
        m.remote = !local_[r.owner];
        tel.push_back(m);
        if (!m.remote) note(static_cast<int>(i), m.ok, "reduction", r.expert, r.gpu);
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
  std::deque<TicketImpl *> peer_order_; // batches with paired transfers not yet posted, in submission order
  std::vector<char> local_;             // per GPU: driven by this engine
  bool spmd_ = false;                   // some GPUs are driven by other processes
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
  return impl_->transport->enqueue_wait(stream, impl_->flag, 1);
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
    std::vector<char> seen(static_cast<std::size_t>(o.topology.num_gpus()), 0);
    for (int g : o.peers.local_gpus) {
      foremoe::detail::require(g >= 0 && g < o.topology.num_gpus(), "peers.local_gpus names GPU ", g, " outside [0, ",
                               o.topology.num_gpus(), ")");
      foremoe::detail::require(!seen[g], "peers.local_gpus names GPU ", g, " twice");
      seen[g] = 1;
    }
    foremoe::detail::require(!detail::multi_process(o) || o.backend != Backend::host || o.peers.host_fabric != nullptr,
                             "peers.local_gpus leaves GPUs to other engines, but no peers.host_fabric joins them");
    if (o.faults) {
      for (double p : {o.faults->fail_probability, o.faults->corrupt_probability, o.faults->delay_probability})
        foremoe::detail::require(p >= 0 && p <= 1, "fault probabilities must lie in [0, 1], got ", p);
      foremoe::detail::require(o.faults->delay_us >= 0, "delay_us must be >= 0, got ", o.faults->delay_us);
    }
  } catch (const Error &e) {
    return {StatusCode::invalid_argument, std::string("TransferEngine: ") + e.what()};
  }
  if (o.transport.empty()) {
    switch (o.backend) {
    case Backend::host: o.transport = "host"; break;
    case Backend::cuda: o.transport = "cuda"; break;
    default:
      return {StatusCode::invalid_argument,
              "TransferEngine: unknown backend " + std::to_string(static_cast<int>(o.backend))};
    }
  }
  std::unique_ptr<Transport> t;
  if (Status st = make_transport(o.transport, o, t); !st.ok()) return st;
  if (o.faults) t = make_fault_transport(std::move(t), o.faults, o.backend == Backend::host);
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
