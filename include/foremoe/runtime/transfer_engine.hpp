#pragma once
/// @file
/// The transfer engine: executes one layer's weight moves over GPU-direct and CPU-assisted paths, overlapped with
/// compute, with deadlines, retries on the other path, optional verification, and replica gradient reduction.
/// CUDA handles (streams, events) cross this API as opaque pointers so that the header compiles without CUDA.

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "foremoe/core/placement.hpp"
#include "foremoe/core/topology.hpp"
#include "foremoe/plan/plan.hpp"
#include "foremoe/runtime/runtime.hpp"
#include "foremoe/runtime/status.hpp"
#include "foremoe/transfer/transfer_plan.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime {

/// One weight tensor's rows in a split slot layout (`SlotRegion::tensors`): this tensor of slot `s`, buffer `b`
/// starts at `base + b * buffer_stride_bytes + s * slot_stride_bytes` (e.g. one `[slots, ...]` tensor per weight
/// kind, rows of its own size, without re-laying out the trainer's memory).
struct SlotTensor {
  void *base = nullptr;
  std::int64_t slot_stride_bytes = 0;   ///< >= the tensor's `TensorSpan::num_bytes`
  std::int64_t buffer_stride_bytes = 0; ///< double-buffered slots: >= `slot_stride_bytes * num_slots`
};

/// One GPU's expert slots of one layer. Device memory for CUDA; plain host memory standing for device memory on the
/// host backend. Two layouts:
///   - packed (`tensors` empty): slot `s`, buffer `b` starts at `base + b * buffer_stride_bytes +
///     s * slot_stride_bytes`, and tensor `ti` of it at `TensorSpan::offset_bytes` inside;
///   - split (`tensors` non-empty, one entry per `EngineOptions::tensors` entry, same order): tensor `ti` of slot
///     `s`, buffer `b` starts at `tensors[ti].base + b * tensors[ti].buffer_stride_bytes +
///     s * tensors[ti].slot_stride_bytes`; `base`, `slot_stride_bytes`, `buffer_stride_bytes` and the tensors'
///     `offset_bytes` are not used. No two rows of the region may overlap (registration checks it).
/// Gradient regions (`register_grads`) use the same two layouts with `GradLayout` sizes instead of the tensors'
/// spans: packed, an expert's gradient at the start of its slot; split, tensor `ti`'s gradient at
/// `tensors[ti].base + s * tensors[ti].slot_stride_bytes` (gradients have one buffer: buffer strides are unused).
struct SlotRegion {
  void *base = nullptr;
  std::int64_t slot_stride_bytes = 0;
  int num_slots = 0;
  int num_buffers = 1; ///< 2: double-buffered slots (a move writes one buffer while compute reads the other)
  std::int64_t buffer_stride_bytes = 0;
  std::vector<SlotTensor> tensors{}; ///< non-empty: the split layout above
};

/// One weight tensor's entries in a split mirror (`MirrorRegion::tensors`): expert `e`'s tensor starts at
/// `base + e * expert_stride_bytes` (e.g. one `[experts, ...]` tensor per weight kind).
struct MirrorTensor {
  const void *base = nullptr;
  std::int64_t expert_stride_bytes = 0; ///< >= the tensor's `TensorSpan::num_bytes`
};

class NodeMirror;

/// A node's pinned host mirror of one layer. Packed (`tensors` empty): expert `e` starts at `base + e *
/// expert_stride_bytes`, its tensor `ti` at `TensorSpan::offset_bytes` inside. Split (`tensors` non-empty, one
/// entry per `EngineOptions::tensors` entry): expert `e`'s tensor `ti` starts at `tensors[ti].base + e *
/// tensors[ti].expert_stride_bytes`; `base` and `expert_stride_bytes` are not used. No two entries may overlap.
struct MirrorRegion {
  const void *base = nullptr;
  std::int64_t expert_stride_bytes = 0;
  int num_experts = 0;
  /// The node-shared mirror segment the region lies in (`node_mirror_region`), or null for memory the caller keeps
  /// current itself. With it, moves read the mirror only while it is fresh (`NodeMirror::stale` false, checked when
  /// a batch is submitted): a batch submitted while a refresh is under way, was interrupted or was missed by this
  /// rank takes GPU-direct sources only (a single-process engine), or is refused naming the generations when it
  /// must read the mirror (SPMD use, where every process must plan the same chunks). Refresh only while no batch
  /// reads the mirror (after the optimizer step, as DESIGN.md has it). The segment must outlive its registration.
  /// Split mirrors may name a segment too: every tensor's entries must then lie inside its payload (e.g. one
  /// 64-byte aligned block per weight kind, as foremoe.torch's node mirror lays them out).
  const NodeMirror *node_mirror = nullptr;
  std::vector<MirrorTensor> tensors{}; ///< non-empty: the split layout above
};

/// The region of `mirror`'s payload holding `num_experts` experts of equal stride (payload bytes / `num_experts`,
/// which must divide it), registered with its segment so that a stale mirror is never read; `invalid_argument`
/// naming the sizes otherwise.
[[nodiscard]] Status node_mirror_region(const NodeMirror &mirror, int num_experts, MirrorRegion &out);

/// One weight tensor of an expert, at `offset_bytes` inside a slot (and inside a mirror entry) of the packed layout;
/// split regions (`SlotRegion::tensors`, `MirrorRegion::tensors`) place each tensor themselves and ignore
/// `offset_bytes`. An expert's bytes are its tensors concatenated in this order; chunks of a move are ranges of that
/// concatenation, so both layouts move, checksum and verify the same bytes.
struct TensorSpan {
  std::int64_t offset_bytes = 0;
  std::int64_t num_bytes = 0;
};

/// Element type of replica gradients (`GradLayout`). One per layer: every GPU and every tensor of a layer's
/// gradients has it. A trainer's expert parameters of one layer share one dtype (and so their `.grad`s, or one
/// fp32 `main_grad` dtype under mixed precision), and a replica's gradient travels as raw bytes to its owner, which
/// adds it in that dtype, so the dtype is a property of the layer, checked at every registration.
/// Additions (`Transport::accumulate`, every backend): `f32` and `f64` add in their type; `bf16` and `f16` add the
/// two operands converted to float32 in float32 and round that sum to the type, to nearest, ties to even (what
/// PyTorch's CPU and CUDA kernels do for a bfloat16 / float16 `add_`).
enum class GradType : int { f32 = 0, f64, bf16, f16 };
[[nodiscard]] constexpr std::int64_t grad_type_bytes(GradType t) noexcept {
  switch (t) {
  case GradType::f32: return 4;
  case GradType::f64: return 8;
  case GradType::bf16:
  case GradType::f16: return 2;
  }
  return 0;
}
[[nodiscard]] constexpr std::string_view to_string(GradType t) noexcept {
  switch (t) {
  case GradType::f32: return "float32";
  case GradType::f64: return "float64";
  case GradType::bf16: return "bfloat16";
  case GradType::f16: return "float16";
  }
  return "?";
}

/// An expert's replica gradient in one layer's gradient regions (`TransferEngine::register_grads`): `type`'s
/// elements, `tensor_bytes[ti]` bytes of tensor `ti` (each a positive multiple of `grad_type_bytes(type)`). A
/// packed region takes one entry (the whole gradient at the start of a slot); a split region (`SlotRegion::tensors`)
/// one per `EngineOptions::tensors` entry, in that order. Every GPU of a layer registers the same layout. An
/// expert's gradient travels as the concatenation of its tensors' gradients; each tensor is added on its own.
struct GradLayout {
  GradType type = GradType::f32;
  std::vector<std::int64_t> tensor_bytes;
};

/// Events that gate a move batch or a reduction. Host events are flags set by `HostEvent::set`; CUDA events are
/// `cudaEvent_t` handles (recorded by the caller on its compute stream).
class HostEvent {
public:
  HostEvent();
  void set() noexcept;
  [[nodiscard]] bool is_set() const noexcept;
  struct State;
  [[nodiscard]] const std::shared_ptr<State> &state() const noexcept { return state_; }

private:
  std::shared_ptr<State> state_;
};
struct Gate {
  const HostEvent *host = nullptr; ///< host backend; read at submit (the batch keeps a copy sharing its flag)
  void *cuda_event = nullptr;      ///< CUDA backend: a `cudaEvent_t` on the device that writes or reads the memory
};

/// Test doubles (`foremoe/runtime/testing.hpp`, not in the umbrella header): the fault injector's schedule and
/// the host fabric joining engines that stand for separate processes.
struct FaultSchedule;
class HostFabric;
class PeerBridge; // transport.hpp

/// Multi-process (SPMD) use: one engine per process, each driving `local_gpus`, every process submitting the same
/// batches (same moves, same order) for the whole EP group. Transfer planning then runs on the placement as planned
/// (so every process derives the same chunks); bytes between GPUs of different processes travel as paired
/// send/receive operations, grouped per round, each carrying a header with the source's validity (and checksum when
/// verifying), so a receiver never publishes bytes its sender did not hold. Paired operations cannot be cancelled:
/// a batch that ends (abort, deadline) before its exchanges ran still posts them, reading and writing scratch memory.
/// Submit from one thread per process, so that the order is the same everywhere.
struct PeerOptions {
  std::vector<int> local_gpus;             ///< GPUs this engine drives; empty: all of them (one process)
  std::shared_ptr<HostFabric> host_fabric; ///< host backend: the fabric joining the engines (testing.hpp)
  /// Any backend: the embedder's fabric that runs the paired transfers (`transport.hpp`, `PeerBridge`), instead
  /// of `host_fabric` or the CUDA backend's NCCL communicators (give one of them). foremoe.torch's
  /// `TransferEngine(group=...)` runs them over a `torch.distributed` group.
  std::shared_ptr<PeerBridge> bridge;
  /// CUDA: `ncclComm_t` per GPU id (null for GPUs of other processes). Give the engine communicators of its own
  /// (e.g. `ncclCommSplit`): its progress thread calls them, and NCCL communicators must not be used from two
  /// threads at once. Non-blocking ones (`config.blocking = 0`) keep a late peer from stalling that thread; the
  /// engine waits for them at most 30 s per group.
  std::vector<void *> nccl_comm_of_gpu;
  std::vector<int> nccl_rank_of_gpu; ///< CUDA: NCCL rank of each GPU in those communicators; empty = identity
};

struct EngineOptions {
  Backend backend = Backend::host;
  /// Name of a registered transport (`foremoe/runtime/transport.hpp`: "host", "cuda" or one a trainer
  /// registered); empty: the one named like `backend`.
  std::string transport;
  Topology topology; ///< GPUs `0 .. num_gpus-1` of the EP group
  int num_layers = 1;
  int num_experts = 1;
  std::vector<TensorSpan> tensors; ///< an expert's tensors inside a slot; their sum is the move size
  transfer::Options planning{};    ///< `expert_bytes` is filled from `tensors`
  int max_attempts = 3;            ///< per chunk, alternating paths where another one exists
  /// Checksum every moved expert against its source, and every replica gradient a reduction adds: a staged
  /// gradient whose checksum does not match its source's is copied again (a local copy, while attempts remain) or,
  /// from another process, not added (its expert's whole reduction is skipped and the batch fails).
  bool verify = false;
  int host_threads_per_path = 2; ///< host backend copy workers per path
  std::vector<int>
      cuda_device_of_gpu; ///< CUDA: local device ordinal of each GPU (-1: another process); empty = identity
  std::shared_ptr<const FaultSchedule> faults; ///< non-null: wrap the transport in the fault injector (testing.hpp)
  PeerOptions peers;                           ///< multi-process use (default: this engine drives every GPU)
};

enum class TicketState : int { pending = 0, done, failed, timed_out, aborted };
[[nodiscard]] constexpr std::string_view to_string(TicketState s) noexcept {
  switch (s) {
  case TicketState::pending: return "pending";
  case TicketState::done: return "done";
  case TicketState::failed: return "failed";
  case TicketState::timed_out: return "timed_out";
  case TicketState::aborted: return "aborted";
  }
  return "?";
}

/// What one move (or one replica-gradient reduction) did.
struct MoveTelemetry {
  int move_idx = 0;
  transfer::Path path = transfer::Path::pcie; ///< the path that carried most of its bytes
  std::int64_t num_bytes = 0;
  double start_seconds = 0.0; ///< since submit
  double end_seconds = 0.0;
  double gb_per_s = 0.0;
  int num_chunks = 0; ///< chunks the transfer plan cut it into
  int attempts = 0;   ///< chunk copies issued, retries included (> num_chunks: something was retried)
  bool ok = false;
  /// Moves: the landed copy matched its source's checksum. Reductions: the staged copy of this replica gradient
  /// matched (it is added only when every replica of its expert did: `ok`). False without `EngineOptions::verify`.
  bool verified = false;
  bool remote = false; ///< multi-process: the destination is another process's GPU (this one sent bytes)
  /// Moves: landed copies of this move whose checksum did not match its source's (each one copied the expert again,
  /// over the other path while attempts remained); reductions: staged copies of the replica gradient that did not
  /// match. 0 without `EngineOptions::verify`. Counted by the process that drives the destination (0 where
  /// `remote`).
  int verify_failures = 0;
  /// Moves: the move landed with bytes read from the host mirror after an attempt of them on another path (a GPU
  /// copy, or a paired transfer from another process's GPU) failed or did not verify. False where `remote`.
  bool fallback = false;
};

/// What the engine's backend resources cost so far, to check that a steady state creates none.
struct EngineStats {
  /// Transport resources created: the engine's pooled completion flags and staging blocks (`Transport::alloc`,
  /// `alloc_flags` calls) plus what the transport created itself (`Transport::resources_created`: CUDA events,
  /// pinned header blocks, device scratch). Host bookkeeping (tickets, chunk lists) is not counted.
  std::int64_t allocations = 0;
  std::int64_t batches = 0; ///< move and reduce batches submitted
};

namespace detail {
struct TicketImpl;
class EngineImpl;
} // namespace detail

/// Handle of one submitted batch. Copyable; the engine keeps its own reference until the batch ends.
class TransferEngine;
class Ticket {
public:
  Ticket() = default;
  /// `in_progress` while running; `ok` when done; otherwise the failure (`device_error`, `timed_out`, `aborted`)
  /// naming the moves that failed.
  [[nodiscard]] Status poll() const;
  [[nodiscard]] TicketState state() const;
  /// Blocks until the batch ends or `deadline` passes (then `timed_out`, the batch keeps running).
  [[nodiscard]] Status wait(std::chrono::steady_clock::time_point deadline) const;
  [[nodiscard]] Status wait_for(std::chrono::milliseconds timeout) const {
    return wait(std::chrono::steady_clock::now() + timeout);
  }
  /// CUDA backend: makes `stream` (a `cudaStream_t`) wait for the end of the batch without blocking the host; the
  /// stream is released also when the batch fails, times out or is aborted (check `poll`). Host backend: `unavailable`.
  [[nodiscard]] Status enqueue_wait(void *stream) const;
  /// Stops issuing copies, waits for those in flight (bounded by the batch deadline) and ends the batch `aborted`;
  /// slots whose move did not complete are marked invalid.
  void abort() const;
  [[nodiscard]] std::vector<MoveTelemetry> telemetry() const;
  [[nodiscard]] bool valid() const noexcept { return impl_ != nullptr; }

private:
  friend class detail::EngineImpl;
  friend class TransferEngine;
  std::shared_ptr<detail::TicketImpl> impl_;
};

/// One layer's move batch.
struct MoveBatch {
  int layer = 0;
  std::span<const Move> moves; ///< from a plan (`LayerPlan::moves`); sources are re-chosen by transfer planning
  Gate sources_ready{};        ///< source copies are written (e.g. after the optimizer step refreshed them)
  Gate slots_free{};           ///< destination slots' last reads are done
  int dst_buffer = 0;          ///< buffer written in double-buffered slots
  std::chrono::milliseconds timeout{10000}; ///< the batch ends `timed_out` after this
};

/// A replica: the copy of `expert` on GPU `gpu`, a GPU other than the expert's owner.
struct ReplicaRef {
  std::int32_t gpu = 0;
  std::int32_t expert = 0;
  friend bool operator==(const ReplicaRef &, const ReplicaRef &) = default;
};

/// One layer's replica gradients to add into their owners' gradients (update stage).
///
/// Held-gradient rule (issue 30, `plan/held_gradients.hpp`; `runtime/held_reduce.hpp` fills the three fields
/// below from a `HeldGradients` and the plans). With `select` false (the default) every resident replica returns
/// and its gradient slot is left as it is (the caller clears it), as before the rule. With `select` true:
///   - only the replicas in `returns` are added into their owners (each a resident replica: its GPU validly holds
///     the expert and is not `owner_gpu[expert]`; no pair twice), in the same fixed order as without a selection
///     (experts ascending, an expert's replicas by GPU), whatever the order of `returns`;
///   - a returned replica's gradient slot (its `grad_bytes`) is zeroed once it was added (its expert's additions
///     all succeeded; a replica whose owner another process drives: once its send landed), so that the in-place
///     accumulation restarts from zero. A replica whose return failed keeps its gradient (and a failed zeroing
///     reports the return failed, the gradient added yet still in place: redo the step);
///   - `held` (`[gpus * experts]`, `HeldGradients::layer` after the release; empty: none) names the replicas whose
///     gradient stays in place, each with the owner it is held for: a resident replica of that owner, not in
///     `returns`. The engine records their slots until the layer's next reduction. A held gradient of an earlier
///     reduction must be returned or held again (never dropped), a move batch writing a slot that holds one is
///     refused unless it writes the same expert, and so is `set_resident` changing such a slot's expert (each
///     naming layer, GPU, slot and expert). A reduction without a selection returns every replica and forgets the
///     records. Owner gradients are never zeroed (the optimizer step and the trainer's `zero_grad` own them).
/// Replicas neither returned nor held must hold a zero gradient (they ran no tokens since their last return):
/// zero the gradient slots before the update stage's first micro-step, as a trainer's `zero_grad` does.
struct ReduceBatch {
  int layer = 0;
  std::span<const std::int32_t> owner_gpu; ///< `[experts]`
  Gate grads_ready{};                      ///< backward of the layer wrote the gradients
  std::chrono::milliseconds timeout{10000};
  bool select = false;                 ///< true: the held-gradient rule's selection below
  std::span<const ReplicaRef> returns; ///< `select`: the replicas that return (added, then zeroed)
  std::span<const std::int32_t> held;  ///< `select`: `[gpus * experts]` owner each replica still holds for, or -1
};

/// Executes moves and reductions. Thread-safe: several threads may submit; one progress thread drives all batches.
class TransferEngine {
public:
  /// Creates an engine; `unavailable` if the backend is not compiled in or has no device.
  [[nodiscard]] static Status create(EngineOptions options, std::unique_ptr<TransferEngine> &out);
  ~TransferEngine();
  TransferEngine(const TransferEngine &) = delete;
  TransferEngine &operator=(const TransferEngine &) = delete;

  /// Registers GPU `gpu`'s slots of `layer` (packed or split, `SlotRegion`); `invalid_argument` naming layer, GPU
  /// and tensor for a bad region, or while batches of `layer` are in flight (they read the registration).
  [[nodiscard]] Status register_slots(int layer, int gpu, const SlotRegion &slots);
  /// Registers node `node`'s pinned mirror of `layer` (packed or split, `MirrorRegion`); checked as `register_slots`.
  [[nodiscard]] Status register_mirror(int layer, int node, const MirrorRegion &mirror);
  /// Registers GPU `gpu`'s float32 gradient slots of `layer` (same slot indices as the weights), packed: an
  /// expert's gradient is `grad_bytes / 4` floats at the start of its slot (`GradLayout{f32, {grad_bytes}}`).
  [[nodiscard]] Status register_grads(int layer, int gpu, const SlotRegion &grads, std::int64_t grad_bytes);
  /// Registers GPU `gpu`'s gradient slots of `layer`, packed or split (`SlotRegion`), laid out as `layout` says;
  /// `invalid_argument` naming layer, GPU and tensor for a bad region (a stride smaller than the tensor's gradient,
  /// overlapping rows, a size not a multiple of the element size) or a layout (dtype, sizes, packed or split)
  /// that differs from one registered before for `layer`.
  [[nodiscard]] Status register_grads(int layer, int gpu, const SlotRegion &grads, const GradLayout &layout);
  /// Declares which expert each slot of `layer` validly holds now (`empty_slot` = none).
  [[nodiscard]] Status set_resident(int layer, const LayerPlacement &placement);

  /// Plans and starts `batch`; `out` is valid only when the status is ok.
  [[nodiscard]] Status submit(const MoveBatch &batch, Ticket &out);
  /// Adds every replica's gradient of `batch.layer` (per the resident placement), or with `batch.select` those in
  /// `batch.returns` (then zeroed), into its owner's gradient, in a fixed order (experts ascending, replicas by
  /// GPU), so results are the same on every run. See `ReduceBatch` for the held-gradient rule.
  [[nodiscard]] Status submit_reduce(const ReduceBatch &batch, Ticket &out);

  /// The expert that GPU `gpu` slot `slot` of `layer` validly holds, or `empty_slot` (never partial bytes). For
  /// GPUs of other processes (multi-process use): what the submitted moves planned there.
  [[nodiscard]] std::int32_t valid_expert(int layer, int gpu, int slot) const;
  /// The resident placement of `layer` as the engine tracks it (failed moves leave empty slots).
  [[nodiscard]] LayerPlacement resident(int layer) const;
  /// The transfer plan of the last move batch of `layer`.
  [[nodiscard]] transfer::TransferPlan last_plan(int layer) const;
  /// Resources created and batches submitted so far.
  [[nodiscard]] EngineStats stats() const;

private:
  explicit TransferEngine(std::unique_ptr<detail::EngineImpl> impl);
  std::unique_ptr<detail::EngineImpl> impl_;
};

/// A 64-bit checksum of `bytes` (what verification compares; the CUDA backend computes the same on the device).
[[nodiscard]] std::uint64_t checksum(std::span<const std::byte> bytes) noexcept;

} // namespace runtime
} // namespace v0
} // namespace foremoe
