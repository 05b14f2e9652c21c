#pragma once
// The transfer engine's state machine (internal), shared by every transport. One file per seam:
//   registration.cpp  construction, slot/mirror/gradient registration, resident placement, queries
//   submit.cpp        checking and planning a batch, slot hazards between batches
//   progress.cpp      the progress thread: gates, issuing and polling chunk copies, path switches
//   peers.cpp         paired transfers with other processes (posting in order, collecting headers)
//   moves.cpp         a move batch: chunks to moves, verification, publishing valid copies
//   reduce.cpp        replica-gradient reductions
//   telemetry.cpp     ending a batch: telemetry and its final status

#include <algorithm>
#include <array>
#include <atomic>
#include <cassert>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "../transport_util.hpp"
#include "foremoe/core/error.hpp"
#include "foremoe/runtime/transfer_engine.hpp"
#include "foremoe/runtime/transport.hpp"
#include "pool.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {

using clock = std::chrono::steady_clock;

// Whether a weight region was registered (either layout).
[[nodiscard]] inline bool is_registered(const SlotRegion &r) noexcept {
  return r.base != nullptr || !r.tensors.empty();
}
[[nodiscard]] inline bool is_registered(const MirrorRegion &m) noexcept {
  return m.base != nullptr || !m.tensors.empty();
}

// Where an expert's bytes are: GPU `gpu`'s slot `index`, buffer `buffer`; or (`mirror`) expert `index` of the
// mirror of GPU `gpu`'s node.
struct Site {
  bool mirror = false;
  int gpu = 0, index = 0, buffer = 0;
};
[[nodiscard]] inline Site slot_site(int gpu, int slot, int buffer) noexcept { return {false, gpu, slot, buffer}; }
[[nodiscard]] inline Site mirror_site(int gpu, int expert) noexcept { return {true, gpu, expert, 0}; }

struct LayerState {
  std::vector<SlotRegion> slots;         // per GPU
  std::vector<MirrorRegion> mirrors;     // per node
  std::vector<SlotRegion> grads;         // per GPU
  GradLayout grad_layout;                // one per layer (every GPU registers the same)
  std::vector<std::int64_t> grad_offset; // per gradient tensor: its offset in the concatenation (staging)
  std::int64_t grad_bytes = 0;           // an expert's gradient: the tensors' sum (0: none registered)

  // Tensor `ti`'s gradient in GPU `gpu`'s slot `slot` (packed: one tensor at the start of the slot).
  [[nodiscard]] std::byte *grad_at(int gpu, int slot, std::size_t ti) const noexcept {
    const SlotRegion &g = grads[static_cast<std::size_t>(gpu)];
    if (g.tensors.empty()) return static_cast<std::byte *>(g.base) + slot * g.slot_stride_bytes;
    return static_cast<std::byte *>(g.tensors[ti].base) + slot * g.tensors[ti].slot_stride_bytes;
  }
  LayerPlacement resident;          // valid copies (other processes' GPUs: as planned)
  LayerPlacement planned;           // multi-process: the placement every submitted move leads to
  std::vector<std::uint8_t> buffer; // per physical slot: the buffer holding the valid copy
  transfer::TransferPlan last_plan;
  std::uint64_t generation = 0; // bumped by whatever changes what planning reads (submit, registration)
  // Per physical slot: the owner GPU its replica's gradient is held for (`ReduceBatch::held` of the last
  // reduction), or -1; empty: none held.
  std::vector<std::int32_t> held;
};

// Who carries a chunk in this process: itself (both ends local, or the local mirror), one side of a paired
// transfer with another process, or nobody.
enum class Role : std::uint8_t { local, send, recv, none };

// Where one chunk (or one replica-gradient copy) stands. Local copies go idle -> copying -> landed | failed;
// paired transfers idle -> paired -> arrived -> landed | failed (the progress step takes up an arrival); the
// `_bad` states are still in flight with one piece failed already. A failed chunk is re-armed (idle) for another
// attempt or given up (lost); verification re-arms a landed one.
enum class ChunkState : std::uint8_t {
  idle,
  skipped, // another process carries it: nothing to do here (counts as landed)
  copying,
  copying_bad,
  paired,
  paired_bad,
  arrived,
  arrived_bad,
  landed,
  failed,
  lost,
};

[[nodiscard]] constexpr bool chunk_transition_allowed(ChunkState from, ChunkState to) noexcept {
  using S = ChunkState;
  switch (from) {
  case S::idle: return to == S::copying || to == S::copying_bad || to == S::paired || to == S::skipped;
  case S::copying: return to == S::copying_bad || to == S::landed;
  case S::copying_bad: return to == S::failed;
  case S::paired: return to == S::paired_bad || to == S::arrived || to == S::lost;
  case S::paired_bad: return to == S::arrived_bad || to == S::lost;
  case S::arrived: return to == S::landed || to == S::failed; // failed: a reduction's arrival did not verify
  case S::arrived_bad: return to == S::failed;
  case S::landed: return to == S::idle || to == S::failed; // verification found wrong bytes
  case S::failed: return to == S::idle || to == S::lost;
  case S::skipped:
  case S::lost: return false;
  }
  return false;
}
static_assert(chunk_transition_allowed(ChunkState::failed, ChunkState::idle));
static_assert(!chunk_transition_allowed(ChunkState::landed, ChunkState::copying));
static_assert(!chunk_transition_allowed(ChunkState::lost, ChunkState::idle));

struct ChunkRun {
  transfer::Chunk c;
  Role role = Role::local;
  ChunkState state = ChunkState::idle;
  int attempts = 0;
  bool fell_back = false; // now reads the host mirror after an attempt on a GPU path failed or did not verify
  std::vector<std::uint64_t> handles;
  std::size_t pending = 0; // pieces (local) or paired operations not yet ended
  double seconds = 0.0;

  /// Moves to `next`; an illegal transition is a bug of the engine (asserted in debug builds).
  void to(ChunkState next) noexcept {
    assert(chunk_transition_allowed(state, next) && "illegal chunk state transition");
    state = next;
  }
  [[nodiscard]] bool in_flight() const noexcept {
    return state == ChunkState::copying || state == ChunkState::copying_bad || state == ChunkState::paired ||
           state == ChunkState::paired_bad || state == ChunkState::arrived || state == ChunkState::arrived_bad;
  }
  [[nodiscard]] bool done() const noexcept { return state == ChunkState::landed || state == ChunkState::skipped; }
  /// One piece or paired operation failed (the chunk stays in flight until the others end).
  void piece_failed() noexcept {
    if (state == ChunkState::copying)
      to(ChunkState::copying_bad);
    else if (state == ChunkState::paired)
      to(ChunkState::paired_bad);
  }
  /// Every local piece ended.
  void pieces_ended() noexcept { to(state == ChunkState::copying ? ChunkState::landed : ChunkState::failed); }
  /// Every paired operation ended (the progress step takes the arrival up).
  void pairs_ended() noexcept { to(state == ChunkState::paired ? ChunkState::arrived : ChunkState::arrived_bad); }
  /// Takes up an arrival.
  void take_arrival() noexcept { to(state == ChunkState::arrived ? ChunkState::landed : ChunkState::failed); }
  [[nodiscard]] bool waiting_for_peer() const noexcept {
    return state == ChunkState::paired || state == ChunkState::paired_bad;
  }
};

struct MoveRun {
  int gpu_src = -1, gpu_src_slot = -1; // a local GPU source for retries (-1: none)
  bool finished = false, failed = false, checked = false, remote = false;
  bool have_sum = false; // src_sum known (from a local source or a sender's header)
  std::uint64_t src_sum = 0;
  bool have_send_sum = false; // this process sends chunks of the move: checksum of its source
  std::uint64_t send_sum = 0;
  int verify_rounds = 0;      // landed copies that did not verify
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
  bool ok = false;   // its expert's replicas were all added into the owner (or, remote owner: its copy landed)
  bool zero = false; // held-gradient rule: clear the replica's gradient once it was added
  // Verification (`EngineOptions::verify`): the checksum of the replica's gradient, from a local source or the
  // sender's header, checked against the staged copy before anything is added.
  bool have_sum = false;
  std::uint64_t src_sum = 0;
  int verify_rounds = 0; // staged copies that did not verify
  double start = -1.0, end = 0.0;
};

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
  // Copies of the caller's host events (sharing their state): the gates point here, so a caller may drop its
  // HostEvent once the batch is submitted.
  std::optional<HostEvent> host_events[2];
  bool gated = false, draining = false, host_mirror = false;
  StatusCode drain_reason = StatusCode::ok;
  int dst_buffer = 0;
  std::vector<int> touched;                       // physical slots this batch writes (moves) or reads (reduce)
  std::vector<std::shared_ptr<TicketImpl>> after; // earlier batches on the same slots
  transfer::TransferPlan plan;
  std::vector<ChunkRun> chunks;
  std::vector<MoveRun> moves;
  std::vector<ReduceRun> reduces;
  std::vector<MoveTelemetry> telemetry;
  volatile std::uint32_t *flag = nullptr;
  std::uint32_t flag_value = 1;       // what `flag` holds once the batch ended
  std::shared_ptr<ResourcePool> pool; // where the flag, staging and scratch go back
  std::vector<int> reads;             // physical slots read as sources (sorted)

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
  std::vector<int> peer_item;          // per op: its chunk (moves) or reduction (reduce)
  std::vector<std::uint64_t> peer_tag; // per op: what a valid header names
  std::vector<PeerGroup> peer_groups;
  std::string peer_error; // the first failure of a paired transfer, named in the batch's status
  struct Scratch {
    int gpu;
    std::int64_t bytes;
    std::byte *p;
  };
  std::vector<Scratch> scratch;   // per local GPU: what ops of an abandoned batch read and write
  std::int64_t staging_bytes = 0; // of each reduction's staging block

  ~TicketImpl() {
    if (!pool) return;
    if (flag != nullptr) pool->give_flag(flag, flag_value);
    for (ReduceRun &r : reduces)
      if (r.staging != nullptr) pool->give_block(r.owner, staging_bytes, r.staging);
    for (const Scratch &s : scratch)
      pool->give_block(s.gpu, s.bytes, s.p);
  }
  [[nodiscard]] bool finished() const noexcept {
    return state.load(std::memory_order_acquire) != static_cast<int>(TicketState::pending);
  }
  /// Finished, and no paired transfer of it can still write its slots.
  [[nodiscard]] bool busy() const noexcept { return !finished() || peer_outstanding.load(std::memory_order_acquire); }
};

class EngineImpl {
public:
  EngineImpl(EngineOptions o, std::shared_ptr<Transport> t);
  ~EngineImpl();

  const EngineOptions &options() const noexcept { return opts_; }

  // registration.cpp
  Status register_region(int layer, int idx, const SlotRegion &r, const GradLayout *grads);
  Status register_mirror(int layer, int node, const MirrorRegion &m);
  Status set_resident(int layer, const LayerPlacement &p);
  std::int32_t valid_expert(int layer, int gpu, int slot) const;
  LayerPlacement resident(int layer) const;
  transfer::TransferPlan last_plan(int layer) const;

  // submit.cpp
  Status submit(const MoveBatch &b, Ticket &out, std::shared_ptr<TicketImpl> &made);
  Status submit_reduce(const ReduceBatch &b, Ticket &out, std::shared_ptr<TicketImpl> &made);

  [[nodiscard]] EngineStats stats() const;
  void wake() {
    {
      std::lock_guard lock(mu_);
      kicked_ = true;
    }
    cv_.notify_all();
  }
  Transport &transport() { return *transport_; }

private:
  template <class... A> static Status bad(const A &...a) {
    return {StatusCode::invalid_argument, foremoe::detail::concat(a...)};
  }
  Status check_layer(int layer, const char *what) const;
  // A slot of `placement` whose held gradient (`LayerState::held`) would be overwritten by expert `incoming`:
  // `invalid_argument` naming layer, GPU, slot and expert, else ok. The caller holds `mu_`.
  Status check_not_held(const char *what, int layer, const LayerPlacement &placement, int gpu, int slot,
                        std::int32_t incoming) const;
  // Checks `b`'s selection against the placement `where` and the layer's held records; `chosen` gets per
  // (GPU, expert) whether it returns. The caller holds `mu_`.
  Status check_selection(const ReduceBatch &b, const LayerPlacement &where, std::vector<char> &chosen) const;
  std::int64_t span_end() const;
  // Checks a split region (`SlotRegion::tensors`, `MirrorRegion::tensors`): one entry per tensor, non-null bases,
  // strides that hold each tensor, and no two rows sharing a byte; `where` names layer and GPU or node.
  // `sizes`: each tensor's row bytes (gradients: `GradLayout::tensor_bytes`); null: the tensors' spans.
  Status check_split(const std::string &where, const SlotRegion &r,
                     const std::vector<std::int64_t> *sizes = nullptr) const;
  Status check_split(const std::string &where, const MirrorRegion &m) const;
  // `invalid_argument` while batches of `layer` are in flight (they read its regions); the caller holds `mu_`.
  Status check_idle(int layer, const char *what) const;
  // Busy batches of `layer` that write what a new batch touches or reads, or read what it writes (all sorted);
  // the caller holds `mu_`.
  std::vector<std::shared_ptr<TicketImpl>> overlapping(int layer, const std::vector<int> &writes,
                                                       const std::vector<int> &reads) const;
  Status finish_submit(std::shared_ptr<TicketImpl> &t, std::chrono::milliseconds timeout, std::array<Gate, 2> gates,
                       Ticket &out, std::shared_ptr<TicketImpl> &made);

  // progress.cpp
  void run();
  // Whether `t` waits only for paired-transfer groups (posted, their transport wakes the engine when one ends):
  // nothing local in flight, no gate or earlier batch to wait for, no arrival to take up.
  [[nodiscard]] bool waits_for_peers_only(const TicketImpl &t) const;
  void step(TicketImpl &t);
  // Issues `cr` (its current path and source) as one copy per tensor it overlaps.
  bool issue(TicketImpl &t, ChunkRun &cr, int move_idx);
  // Polls `cr`'s local copies; returns true when they all ended (then its state tells the outcome).
  bool poll(ChunkRun &cr);
  // Moves the chunk to the other path where there is one (mirror <-> a local GPU copy). A paired transfer is
  // never posted again (its sender would not know), so a received chunk without a local alternative is lost:
  // returns false then.
  bool switch_path(const TicketImpl &t, ChunkRun &cr, const MoveRun &mr) const;
  // Checksum of an expert's bytes in a slot or mirror entry (tensor by tensor, combined; the same in both layouts).
  Status expert_sum(const LayerState &ls, const Site &where, std::uint64_t &out);
  // Checksum of reduction `r`'s replica gradient: at its source (`staged` false) or its staged copy on the owner.
  Status grad_sum(const LayerState &ls, const ReduceRun &r, bool staged, std::uint64_t &out);
  bool staged_verifies(const LayerState &ls, ReduceRun &r);

  // peers.cpp
  std::byte *scratch(TicketImpl &t, int gpu, std::int64_t need);
  bool post_peer(TicketImpl &t, bool discard);
  void poll_peer(TicketImpl &t);
  // "; paired transfers still waiting on GPU 3, GPU 5 (other processes)" or "" (progress thread).
  static std::string peer_waiting(const TicketImpl &t);

  // moves.cpp
  void start_moves(TicketImpl &t, double now_s);
  void step_moves(TicketImpl &t, double now_s);

  // reduce.cpp
  void start_reduce(TicketImpl &t, double now_s);
  void issue_reduce(TicketImpl &t, ReduceRun &r, double now_s);
  void step_reduce(TicketImpl &t, double now_s);
  // Runs `f` with the fault injector sparing what it starts (`FaultSchedule::spare_reductions`).
  template <class F> void spared(F &&f) {
    if (spare_faults_ != nullptr) spare_faults_->spare(true);
    f();
    if (spare_faults_ != nullptr) spare_faults_->spare(false);
  }

  // telemetry.cpp
  void end(TicketImpl &t);

  // Byte `from` of tensor `ti` of GPU `gpu`'s slot `slot`, buffer `buffer`, in either layout (`SlotRegion`).
  std::byte *slot_at(const LayerState &ls, int gpu, int slot, int buffer, int ti, std::int64_t from) const {
    const SlotRegion &r = ls.slots[gpu];
    if (r.tensors.empty())
      return static_cast<std::byte *>(r.base) + buffer * r.buffer_stride_bytes + slot * r.slot_stride_bytes +
             opts_.tensors[ti].offset_bytes + from;
    const SlotTensor &x = r.tensors[ti];
    return static_cast<std::byte *>(x.base) + buffer * x.buffer_stride_bytes + slot * x.slot_stride_bytes + from;
  }
  // Byte `from` of tensor `ti` of expert `expert` in the mirror of GPU `gpu`'s node, in either layout.
  std::byte *mirror_at(const LayerState &ls, int gpu, int expert, int ti, std::int64_t from) const {
    const MirrorRegion &m = ls.mirrors[opts_.topology.node_of(gpu)];
    if (m.tensors.empty())
      return static_cast<std::byte *>(const_cast<void *>(m.base)) + expert * m.expert_stride_bytes +
             opts_.tensors[ti].offset_bytes + from;
    const MirrorTensor &x = m.tensors[ti];
    return static_cast<std::byte *>(const_cast<void *>(x.base)) + expert * x.expert_stride_bytes + from;
  }
  std::byte *at(const LayerState &ls, const Site &s, int ti, std::int64_t from) const {
    return s.mirror ? mirror_at(ls, s.gpu, s.index, ti, from) : slot_at(ls, s.gpu, s.index, s.buffer, ti, from);
  }
  // Calls `f(tensor, lo, hi)` for each piece `[lo, hi)` of chunk `c` that lies in one tensor (offsets into the
  // expert's packed bytes; the piece starts at `at(ls, site, tensor, lo - prefix_[tensor])`).
  template <class F> void for_each_piece(const transfer::Chunk &c, F &&f) const {
    for (std::size_t ti = 0; ti < opts_.tensors.size(); ++ti) {
      const std::int64_t lo = std::max(c.offset_bytes, prefix_[ti]),
                         hi = std::min(c.offset_bytes + c.num_bytes, prefix_[ti + 1]);
      if (lo < hi) f(static_cast<int>(ti), lo, hi);
    }
  }

  EngineOptions opts_;
  std::shared_ptr<Transport> transport_;
  std::shared_ptr<ResourcePool> pool_;
  std::vector<std::int64_t> prefix_; // packed byte offset of each tensor
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<LayerState> layers_;
  std::vector<std::shared_ptr<TicketImpl>> active_;
  std::deque<TicketImpl *> peer_order_; // batches with paired transfers not yet posted, in submission order
  std::vector<char> local_;             // per GPU: driven by this engine
  bool spmd_ = false;                   // some GPUs are driven by other processes
  std::uint64_t serial_ = 0;
  std::uint64_t reduce_serial_ = 0;      // reductions' serials under FaultSchedule::spare_reductions
  FaultControl *spare_faults_ = nullptr; // the fault injector, when it spares reductions
  bool stopping_ = false;
  // Polling: every 50 us while a batch has local copies, gates or arrivals to see to; while every batch only
  // waits for paired-transfer groups of a transport that wakes the engine (`Transport::set_peer_waker`), the
  // thread sleeps until woken (`kicked_`: a group ended, a batch was submitted), at most `peer_sleep` (which
  // bounds how late it sees a deadline, an abort or a delayed group).
  static constexpr std::chrono::microseconds poll_interval{50}, peer_sleep{1000};
  bool peer_wakes_ = false;
  bool kicked_ = false; // under mu_
  std::thread progress_;

  friend class ::foremoe::runtime::TransferEngine;
};

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
