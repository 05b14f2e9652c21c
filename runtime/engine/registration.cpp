// Construction, registration of slots, mirrors and gradients, the resident placement, and queries.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine.hpp"
#include "foremoe/runtime/node_mirror.hpp"
#include "foremoe/runtime/testing.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime {

Status node_mirror_region(const NodeMirror &mirror, int num_experts, MirrorRegion &out) {
  const std::int64_t bytes = mirror.payload_bytes();
  if (num_experts <= 0 || bytes % num_experts != 0)
    return {StatusCode::invalid_argument,
            foremoe::detail::concat("node_mirror_region: ", num_experts, " experts do not divide node mirror ",
                                    mirror.name(), "'s ", bytes, " bytes into equal strides")};
  out = MirrorRegion{mirror.payload().data(), bytes / num_experts, num_experts, &mirror};
  return Status::success();
}

namespace detail {

EngineImpl::EngineImpl(EngineOptions o, std::shared_ptr<Transport> t)
    : opts_(std::move(o)), transport_(std::move(t)), pool_(std::make_shared<ResourcePool>(transport_)) {
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
  peer_wakes_ = transport_->set_peer_waker([this] { wake(); });
  if (opts_.faults && opts_.faults->spare_reductions) spare_faults_ = dynamic_cast<FaultControl *>(transport_.get());
  progress_ = std::thread([this] { run(); });
}
EngineImpl::~EngineImpl() {
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
  // The transport (shared with pools that tickets may still hold) calls no waker of this engine from now on.
  if (peer_wakes_) (void)transport_->set_peer_waker(nullptr);
}

Status EngineImpl::register_region(int layer, int idx, const SlotRegion &r, const GradLayout *grads) {
  const char *what = grads ? "register_grads" : "register_slots";
  if (Status st = check_layer(layer, what); !st.ok()) return st;
  if (idx < 0 || idx >= opts_.topology.num_gpus())
    return bad(what, ": GPU ", idx, " outside [0, ", opts_.topology.num_gpus(), ")");
  if (!local_[idx]) return bad(what, ": GPU ", idx, " is driven by another process (peers.local_gpus)");
  const bool split = !r.tensors.empty();
  std::int64_t grad_bytes = 0;
  if (grads) {
    const std::int64_t esize = grad_type_bytes(grads->type);
    if (esize == 0)
      return bad(what, ": layer ", layer, " GPU ", idx, ": unknown gradient type ", static_cast<int>(grads->type));
    const std::size_t want = split ? opts_.tensors.size() : 1;
    if (grads->tensor_bytes.size() != want)
      return bad(what, ": layer ", layer, " GPU ", idx, ": ", grads->tensor_bytes.size(),
                 " gradient tensor sizes for a ", split ? "split" : "packed", " region (", want,
                 " expected: ", split ? "one per EngineOptions::tensors entry" : "one, the whole gradient", ")");
    for (std::size_t ti = 0; ti < want; ++ti) {
      const std::int64_t n = grads->tensor_bytes[ti];
      if (n <= 0 || n % esize != 0)
        return bad(what, ": layer ", layer, " GPU ", idx, " tensor ", ti, ": gradient bytes must be a positive ",
                   "multiple of ", esize, " (", to_string(grads->type), "), got ", n);
      grad_bytes += n;
    }
    if (split && r.num_buffers != 1)
      return bad(what, ": layer ", layer, " GPU ", idx, ": gradient regions have one buffer, got num_buffers ",
                 r.num_buffers);
    // Elements are read and written as `type`: every row must start on a multiple of its size.
    auto misaligned = [&](const void *base, std::int64_t stride) {
      return reinterpret_cast<std::uintptr_t>(base) % static_cast<std::uintptr_t>(esize) != 0 || stride % esize != 0;
    };
    for (std::size_t ti = 0; ti < (split ? r.tensors.size() : 1); ++ti) {
      const void *base = split ? r.tensors[ti].base : r.base;
      const std::int64_t stride = split ? r.tensors[ti].slot_stride_bytes : r.slot_stride_bytes;
      if (misaligned(base, stride))
        return bad(what, ": layer ", layer, " GPU ", idx, split ? foremoe::detail::concat(" tensor ", ti) : "",
                   ": rows (base ", base, ", slot stride ", stride, ") are not aligned to the ", esize, "-byte ",
                   to_string(grads->type), " elements");
    }
  }
  if (!split && r.base == nullptr) return bad(what, ": null base for GPU ", idx);
  if (r.num_slots != opts_.topology.slots_per_gpu)
    return bad(what, ": GPU ", idx, " has ", r.num_slots, " slots, the topology ", opts_.topology.slots_per_gpu);
  if (r.num_buffers < 1 || r.num_buffers > 2) return bad(what, ": num_buffers must be 1 or 2, got ", r.num_buffers);
  const std::int64_t need = grads ? grad_bytes : span_end();
  if (split) {
    if (Status st = check_split(foremoe::detail::concat(what, ": layer ", layer, " GPU ", idx), r,
                                grads ? &grads->tensor_bytes : nullptr);
        !st.ok())
      return st;
  } else {
    if (r.slot_stride_bytes < need)
      return bad(what, ": slot stride ", r.slot_stride_bytes, " is smaller than the ", need, " bytes of an expert");
    if (r.num_buffers == 2 && r.buffer_stride_bytes < r.slot_stride_bytes * r.num_slots)
      return bad(what, ": buffer stride ", r.buffer_stride_bytes, " overlaps the ", r.num_slots, " slots");
  }
  std::lock_guard lock(mu_);
  if (Status st = check_idle(layer, what); !st.ok()) return st;
  LayerState &ls = layers_[layer];
  ++ls.generation;
  if (grads) {
    // Every GPU of the layer has the same layout (replica gradients travel as raw bytes to their owners).
    if (ls.grad_bytes != 0) {
      if (ls.grad_layout.type != grads->type)
        return bad(what, ": layer ", layer, " GPU ", idx, ": gradient type ", to_string(grads->type), " differs from ",
                   to_string(ls.grad_layout.type), " registered before");
      if (ls.grad_layout.tensor_bytes != grads->tensor_bytes)
        return bad(what, ": layer ", layer, " GPU ", idx, ": gradient tensor sizes (", grad_bytes, " bytes in ",
                   grads->tensor_bytes.size(), " tensors) differ from those registered before (", ls.grad_bytes,
                   " bytes in ", ls.grad_layout.tensor_bytes.size(), ")");
      for (std::size_t g = 0; g < ls.grads.size(); ++g)
        if (static_cast<int>(g) != idx && is_registered(ls.grads[g]) && ls.grads[g].tensors.empty() == split)
          return bad(what, ": layer ", layer, " GPU ", idx, ": a ", split ? "split" : "packed",
                     " gradient region, GPU ", g, " registered a ", split ? "packed" : "split", " one");
    }
    ls.grads[idx] = r;
    ls.grad_layout = *grads;
    ls.grad_offset.assign(grads->tensor_bytes.size(), 0);
    for (std::size_t ti = 1; ti < grads->tensor_bytes.size(); ++ti)
      ls.grad_offset[ti] = ls.grad_offset[ti - 1] + grads->tensor_bytes[ti - 1];
    ls.grad_bytes = grad_bytes;
  } else {
    ls.slots[idx] = r;
  }
  return Status::success();
}

Status EngineImpl::register_mirror(int layer, int node, const MirrorRegion &m) {
  if (Status st = check_layer(layer, "register_mirror"); !st.ok()) return st;
  if (node < 0 || node >= opts_.topology.num_nodes)
    return bad("register_mirror: node ", node, " outside [0, ", opts_.topology.num_nodes, ")");
  const bool split = !m.tensors.empty();
  if (!split && m.base == nullptr) return bad("register_mirror: null base for node ", node);
  bool has_local = false;
  for (int g = 0; g < opts_.topology.gpus_per_node; ++g)
    has_local = has_local || local_[node * opts_.topology.gpus_per_node + g];
  if (!has_local) return bad("register_mirror: node ", node, " has no GPU this engine drives");
  if (m.num_experts != opts_.num_experts)
    return bad("register_mirror: ", m.num_experts, " experts, the engine has ", opts_.num_experts);
  if (split) {
    if (Status st = check_split(foremoe::detail::concat("register_mirror: layer ", layer, " node ", node), m); !st.ok())
      return st;
  } else if (m.expert_stride_bytes < span_end()) {
    return bad("register_mirror: expert stride ", m.expert_stride_bytes, " is smaller than ", span_end());
  }
  if (m.node_mirror != nullptr && split) {
    // Every tensor's entries must lie inside the segment's payload (addresses as integers).
    const auto first = reinterpret_cast<std::uintptr_t>(m.node_mirror->payload().data());
    const auto bytes = static_cast<std::uintptr_t>(m.node_mirror->payload_bytes());
    for (std::size_t ti = 0; ti < m.tensors.size(); ++ti) {
      const auto lo = reinterpret_cast<std::uintptr_t>(m.tensors[ti].base);
      const auto extent = static_cast<std::uintptr_t>((m.num_experts - 1) * m.tensors[ti].expert_stride_bytes +
                                                      opts_.tensors[ti].num_bytes);
      if (lo < first || lo - first > bytes || extent > bytes - (lo - first))
        return bad("register_mirror: layer ", layer, " node ", node, " tensor ", ti, ": ", m.num_experts,
                   " experts of stride ", m.tensors[ti].expert_stride_bytes, " at offset ",
                   lo >= first ? static_cast<std::int64_t>(lo - first) : -static_cast<std::int64_t>(first - lo),
                   " do not fit node mirror ", m.node_mirror->name(), "'s ", m.node_mirror->payload_bytes(), " bytes");
    }
  } else if (m.node_mirror != nullptr) {
    // Addresses as integers: the region must lie inside the segment's payload.
    const auto first = reinterpret_cast<std::uintptr_t>(m.node_mirror->payload().data());
    const auto lo = reinterpret_cast<std::uintptr_t>(m.base);
    const std::int64_t bytes = m.node_mirror->payload_bytes();
    const std::int64_t offset = lo >= first ? static_cast<std::int64_t>(lo - first) : -1;
    if (offset < 0 || offset > bytes || m.expert_stride_bytes > bytes ||
        m.num_experts > (bytes - offset) / m.expert_stride_bytes)
      return bad("register_mirror: ", m.num_experts, " experts of ", m.expert_stride_bytes, " bytes at offset ", offset,
                 " do not fit node mirror ", m.node_mirror->name(), "'s ", bytes, " bytes");
  }
  std::lock_guard lock(mu_);
  if (Status st = check_idle(layer, "register_mirror"); !st.ok()) return st;
  layers_[layer].mirrors[node] = m;
  ++layers_[layer].generation;
  return Status::success();
}

Status EngineImpl::set_resident(int layer, const LayerPlacement &p) {
  if (Status st = check_layer(layer, "set_resident"); !st.ok()) return st;
  try {
    foremoe::detail::require(
        p.num_gpus() == opts_.topology.num_gpus() && p.slots_per_gpu() == opts_.topology.slots_per_gpu &&
            p.num_experts() == opts_.num_experts,
        "placement is ", p.num_gpus(), " GPUs x ", p.slots_per_gpu(), " slots x ", p.num_experts(), " experts");
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
    if (t->layer == layer && t->busy())
      return {StatusCode::invalid_argument, "set_resident: layer " + std::to_string(layer) + " has batches in flight"};
  for (int g = 0; g < p.num_gpus(); ++g)
    for (int s = 0; s < p.slots_per_gpu(); ++s)
      if (Status st = check_not_held("set_resident", layer, spmd_ ? layers_[layer].planned : layers_[layer].resident, g,
                                     s, p.slot(g, s));
          !st.ok())
        return st;
  ++layers_[layer].generation;
  layers_[layer].resident = p;
  layers_[layer].planned = p;
  return Status::success();
}

EngineStats EngineImpl::stats() const {
  EngineStats s;
  s.allocations = pool_->allocations() + transport_->resources_created();
  std::lock_guard lock(mu_);
  s.batches = static_cast<std::int64_t>(serial_ + reduce_serial_);
  return s;
}

std::int32_t EngineImpl::valid_expert(int layer, int gpu, int slot) const {
  std::lock_guard lock(mu_);
  if (layer < 0 || layer >= opts_.num_layers || gpu < 0 || gpu >= opts_.topology.num_gpus() || slot < 0 ||
      slot >= opts_.topology.slots_per_gpu)
    return empty_slot;
  return layers_[layer].resident.slot(gpu, slot);
}

LayerPlacement EngineImpl::resident(int layer) const {
  std::lock_guard lock(mu_);
  return layer >= 0 && layer < opts_.num_layers ? layers_[layer].resident : LayerPlacement{};
}

transfer::TransferPlan EngineImpl::last_plan(int layer) const {
  std::lock_guard lock(mu_);
  return layer >= 0 && layer < opts_.num_layers ? layers_[layer].last_plan : transfer::TransferPlan{};
}

Status EngineImpl::check_layer(int layer, const char *what) const {
  if (layer < 0 || layer >= opts_.num_layers)
    return bad(what, ": layer ", layer, " outside [0, ", opts_.num_layers, ")");
  return Status::success();
}

Status EngineImpl::check_idle(int layer, const char *what) const {
  for (const auto &t : active_)
    if (t->layer == layer && t->busy())
      return bad(what, ": layer ", layer, " has batches in flight (they read its registered regions)");
  return Status::success();
}

namespace {
// One row of a split region: tensor `ti`'s bytes of slot (or expert) `index`, buffer `buffer`.
struct Row {
  std::uintptr_t lo = 0, hi = 0;
  int ti = 0, index = 0, buffer = 0;
};
// The first two rows that share a byte, or nullopt.
std::optional<std::pair<Row, Row>> overlapping_rows(std::vector<Row> rows) {
  std::sort(rows.begin(), rows.end(), [](const Row &a, const Row &b) { return a.lo < b.lo; });
  std::size_t reach = 0; // the row reaching furthest so far
  for (std::size_t i = 1; i < rows.size(); ++i) {
    if (rows[i].lo < rows[reach].hi) return std::make_pair(rows[reach], rows[i]);
    if (rows[i].hi > rows[reach].hi) reach = i;
  }
  return std::nullopt;
}
} // namespace

Status EngineImpl::check_split(const std::string &where, const SlotRegion &r,
                               const std::vector<std::int64_t> *sizes) const {
  if (r.tensors.size() != opts_.tensors.size())
    return bad(where, ": ", r.tensors.size(), " tensor regions, the engine has ", opts_.tensors.size(),
               " tensors (EngineOptions::tensors)");
  std::vector<Row> rows;
  for (std::size_t ti = 0; ti < r.tensors.size(); ++ti) {
    const SlotTensor &x = r.tensors[ti];
    const std::int64_t n = sizes ? (*sizes)[ti] : opts_.tensors[ti].num_bytes;
    if (x.base == nullptr) return bad(where, " tensor ", ti, ": null base");
    if (x.slot_stride_bytes < n)
      return bad(where, " tensor ", ti, ": slot stride ", x.slot_stride_bytes, " is smaller than its ", n, " bytes");
    if (r.num_buffers == 2 && x.buffer_stride_bytes < x.slot_stride_bytes * r.num_slots)
      return bad(where, " tensor ", ti, ": buffer stride ", x.buffer_stride_bytes, " overlaps its ", r.num_slots,
                 " slots of ", x.slot_stride_bytes, " bytes");
    for (int b = 0; b < r.num_buffers; ++b)
      for (int s = 0; s < r.num_slots; ++s) {
        const std::uintptr_t lo = reinterpret_cast<std::uintptr_t>(x.base) +
                                  static_cast<std::uintptr_t>(b * x.buffer_stride_bytes + s * x.slot_stride_bytes);
        rows.push_back({lo, lo + static_cast<std::uintptr_t>(n), static_cast<int>(ti), s, b});
      }
  }
  if (auto o = overlapping_rows(std::move(rows)))
    return bad(where, ": tensor ", o->first.ti, " slot ", o->first.index,
               r.num_buffers == 2 ? foremoe::detail::concat(" buffer ", o->first.buffer) : std::string(),
               " overlaps tensor ", o->second.ti, " slot ", o->second.index,
               r.num_buffers == 2 ? foremoe::detail::concat(" buffer ", o->second.buffer) : std::string());
  return Status::success();
}

Status EngineImpl::check_split(const std::string &where, const MirrorRegion &m) const {
  if (m.tensors.size() != opts_.tensors.size())
    return bad(where, ": ", m.tensors.size(), " tensor regions, the engine has ", opts_.tensors.size(),
               " tensors (EngineOptions::tensors)");
  std::vector<Row> rows;
  for (std::size_t ti = 0; ti < m.tensors.size(); ++ti) {
    const MirrorTensor &x = m.tensors[ti];
    const std::int64_t n = opts_.tensors[ti].num_bytes;
    if (x.base == nullptr) return bad(where, " tensor ", ti, ": null base");
    if (x.expert_stride_bytes < n)
      return bad(where, " tensor ", ti, ": expert stride ", x.expert_stride_bytes, " is smaller than its ", n,
                 " bytes");
    for (int e = 0; e < m.num_experts; ++e) {
      const std::uintptr_t lo =
          reinterpret_cast<std::uintptr_t>(x.base) + static_cast<std::uintptr_t>(e * x.expert_stride_bytes);
      rows.push_back({lo, lo + static_cast<std::uintptr_t>(n), static_cast<int>(ti), e, 0});
    }
  }
  if (auto o = overlapping_rows(std::move(rows)))
    return bad(where, ": tensor ", o->first.ti, " of expert ", o->first.index, " overlaps tensor ", o->second.ti,
               " of expert ", o->second.index);
  return Status::success();
}

std::int64_t EngineImpl::span_end() const {
  std::int64_t end = 0;
  for (const TensorSpan &t : opts_.tensors)
    end = std::max(end, t.offset_bytes + t.num_bytes);
  return end;
}

} // namespace detail
} // namespace runtime
} // namespace v0
} // namespace foremoe
