#pragma once
/// @file
/// Which logical expert each physical GPU slot holds, per MoE layer.

#include <cstdint>
#include <span>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/topology.hpp"

namespace foremoe {
inline namespace v0 {

/// Marks an empty slot.
inline constexpr std::int32_t empty_slot = -1;

/// One MoE layer's slots: physical slot `p = gpu * slots_per_gpu + s` holds
/// logical expert `phys_to_log()[p]` or `empty_slot`.
class LayerPlacement {
public:
  LayerPlacement() = default;
  LayerPlacement(int num_gpus, int slots_per_gpu, int num_experts)
      : num_gpus_(num_gpus), slots_per_gpu_(slots_per_gpu), num_experts_(num_experts) {
    detail::require(num_gpus > 0, "LayerPlacement: num_gpus must be positive, got ", num_gpus);
    detail::require(slots_per_gpu > 0, "LayerPlacement: slots_per_gpu must be positive, got ", slots_per_gpu);
    detail::require(num_experts > 0, "LayerPlacement: num_experts must be positive, got ", num_experts);
    slots_.assign(static_cast<std::size_t>(num_gpus) * slots_per_gpu, empty_slot);
  }

  [[nodiscard]] int num_gpus() const noexcept { return num_gpus_; }
  [[nodiscard]] int slots_per_gpu() const noexcept { return slots_per_gpu_; }
  [[nodiscard]] int num_experts() const noexcept { return num_experts_; }
  [[nodiscard]] int num_slots() const noexcept { return num_gpus_ * slots_per_gpu_; }

  [[nodiscard]] std::int32_t &slot(int gpu_idx, int slot_idx) noexcept {
    return slots_[static_cast<std::size_t>(gpu_idx) * slots_per_gpu_ + slot_idx];
  }
  [[nodiscard]] std::int32_t slot(int gpu_idx, int slot_idx) const noexcept {
    return slots_[static_cast<std::size_t>(gpu_idx) * slots_per_gpu_ + slot_idx];
  }
  /// `[gpus * slots_per_gpu]` logical expert per physical slot.
  [[nodiscard]] std::span<const std::int32_t> phys_to_log() const noexcept { return slots_; }
  [[nodiscard]] std::span<std::int32_t> phys_to_log() noexcept { return slots_; }
  /// The slots of one GPU.
  [[nodiscard]] std::span<const std::int32_t> gpu_slots(int gpu_idx) const noexcept {
    return {slots_.data() + static_cast<std::size_t>(gpu_idx) * slots_per_gpu_,
            static_cast<std::size_t>(slots_per_gpu_)};
  }

  /// True when `gpu_idx` holds a copy of `expert_idx`.
  [[nodiscard]] bool holds(int gpu_idx, std::int32_t expert_idx) const noexcept {
    for (std::int32_t e : gpu_slots(gpu_idx))
      if (e == expert_idx) return true;
    return false;
  }
  /// First empty slot index of a GPU, or -1.
  [[nodiscard]] int free_slot(int gpu_idx) const noexcept {
    const auto s = gpu_slots(gpu_idx);
    for (int i = 0; i < slots_per_gpu_; ++i)
      if (s[i] == empty_slot) return i;
    return -1;
  }

  /// Copies of every expert (0 for an expert with none).
  [[nodiscard]] std::vector<int> replica_counts() const {
    std::vector<int> c(num_experts_, 0);
    for (std::int32_t e : slots_)
      if (e >= 0 && e < num_experts_) ++c[e];
    return c;
  }

  /// Logical -> physical map in CSR form: the copies of expert `e` are
  /// `phys[offsets[e] .. offsets[e+1])`, in increasing physical slot order.
  struct LogToPhys {
    std::vector<std::int32_t> offsets; ///< `[experts + 1]`
    std::vector<std::int32_t> phys;    ///< physical slot indices
  };
  [[nodiscard]] LogToPhys log_to_phys() const {
    LogToPhys m;
    m.offsets.assign(static_cast<std::size_t>(num_experts_) + 1, 0);
    for (std::int32_t e : slots_)
      if (e >= 0 && e < num_experts_) ++m.offsets[e + 1];
    for (int e = 0; e < num_experts_; ++e)
      m.offsets[e + 1] += m.offsets[e];
    m.phys.resize(m.offsets.back());
    std::vector<std::int32_t> fill(m.offsets.begin(), m.offsets.end() - 1);
    for (int p = 0; p < num_slots(); ++p)
      if (const std::int32_t e = slots_[p]; e >= 0 && e < num_experts_) m.phys[fill[e]++] = p;
    return m;
  }

  /// Throws `Error` for an id out of range, two copies of one expert on one GPU
  /// or an expert without any copy.
  void validate() const {
    std::vector<int> last_gpu(num_experts_, -1);
    std::vector<char> seen(num_experts_, 0);
    for (int g = 0; g < num_gpus_; ++g)
      for (int s = 0; s < slots_per_gpu_; ++s) {
        const std::int32_t e = slot(g, s);
        if (e == empty_slot) continue;
        detail::require(e >= 0 && e < num_experts_, "LayerPlacement: GPU ", g, " slot ", s, " holds expert id ", e,
                        ", outside [0, ", num_experts_, ")");
        detail::require(last_gpu[e] != g, "LayerPlacement: GPU ", g, " holds two copies of expert ", e);
        last_gpu[e] = g;
        seen[e] = 1;
      }
    for (int e = 0; e < num_experts_; ++e)
      detail::require(seen[e] != 0, "LayerPlacement: expert ", e, " has no copy on any GPU");
  }

  friend bool operator==(const LayerPlacement &, const LayerPlacement &) = default;

private:
  int num_gpus_ = 0, slots_per_gpu_ = 0, num_experts_ = 0;
  std::vector<std::int32_t> slots_;
};

/// The placement of every MoE layer on one topology.
class Placement {
public:
  Placement() = default;
  Placement(const Topology &topo, int num_layers, int num_experts) {
    topo.validate(num_experts);
    detail::require(num_layers > 0, "Placement: num_layers must be positive, got ", num_layers);
    layers_.assign(num_layers, LayerPlacement(topo.num_gpus(), topo.slots_per_gpu, num_experts));
  }

  [[nodiscard]] int num_layers() const noexcept { return static_cast<int>(layers_.size()); }
  [[nodiscard]] LayerPlacement &layer(int l) noexcept { return layers_[l]; }
  [[nodiscard]] const LayerPlacement &layer(int l) const noexcept { return layers_[l]; }

  /// Validates every layer; the message names the layer.
  void validate() const {
    for (int l = 0; l < num_layers(); ++l) {
      try {
        layers_[l].validate();
      } catch (const Error &err) {
        detail::fail("layer ", l, ": ", err.what());
      }
    }
  }

  /// Experts placed contiguously, `ceil(E / gpus)` per GPU (the "static" layout).
  [[nodiscard]] static Placement contiguous(const Topology &topo, int num_layers, int num_experts) {
    Placement p(topo, num_layers, num_experts);
    const int per_gpu = topo.owners_per_gpu(num_experts);
    detail::require(per_gpu <= topo.slots_per_gpu, "Placement: contiguous layout needs ", per_gpu,
                    " slots per GPU for ", num_experts, " experts, topology has ", topo.slots_per_gpu);
    for (auto &lp : p.layers_)
      for (int e = 0; e < num_experts; ++e)
        lp.slot(e / per_gpu, e % per_gpu) = e;
    return p;
  }

  friend bool operator==(const Placement &, const Placement &) = default;

private:
  std::vector<LayerPlacement> layers_;
};

} // namespace v0
} // namespace foremoe
