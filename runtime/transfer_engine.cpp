// The transfer engine's public surface: host events, the checksum, tickets and `TransferEngine::create`. The state
// machine (plans a batch's chunks, waits for its gates and for earlier batches touching the same slots, issues the
// copies, retries failed chunks on the other path, verifies moved experts, keeps the valid-expert map exact, and
// ends every batch by its deadline) lives in engine/, one file per seam.

#include "foremoe/runtime/transfer_engine.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "engine/engine.hpp"
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
  return impl_->pool->transport().enqueue_wait(stream, impl_->flag, impl_->flag_value);
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
    foremoe::detail::require(!detail::multi_process(o) || o.backend != Backend::host ||
                                 o.peers.host_fabric != nullptr || o.peers.bridge != nullptr,
                             "peers.local_gpus leaves GPUs to other engines, but no peers.host_fabric or peers.bridge "
                             "joins them");
    foremoe::detail::require(o.peers.host_fabric == nullptr || o.peers.bridge == nullptr,
                             "peers.host_fabric and peers.bridge both given: one fabric joins the engines");
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
  if (o.peers.bridge) t = detail::make_bridge_transport(std::move(t), o.peers.bridge);
  if (o.faults) t = make_fault_transport(std::move(t), o.faults, o.backend == Backend::host);
  out.reset(new TransferEngine(std::make_unique<detail::EngineImpl>(std::move(o), std::move(t))));
  return Status::success();
}

Status TransferEngine::register_slots(int layer, int gpu, const SlotRegion &slots) {
  return impl_->register_region(layer, gpu, slots, nullptr);
}
Status TransferEngine::register_mirror(int layer, int node, const MirrorRegion &mirror) {
  return impl_->register_mirror(layer, node, mirror);
}
Status TransferEngine::register_grads(int layer, int gpu, const SlotRegion &grads, std::int64_t grad_bytes) {
  const GradLayout layout{GradType::f32, {grad_bytes}};
  return impl_->register_region(layer, gpu, grads, &layout);
}
Status TransferEngine::register_grads(int layer, int gpu, const SlotRegion &grads, const GradLayout &layout) {
  return impl_->register_region(layer, gpu, grads, &layout);
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
EngineStats TransferEngine::stats() const { return impl_->stats(); }

} // namespace runtime
} // namespace v0
} // namespace foremoe
