#pragma once
/// @file
/// Token loads per micro-step, MoE layer and expert, optionally split by the
/// source EP rank that holds the tokens.

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/limits.hpp"

namespace foremoe {
inline namespace v0 {

/// `load[m][l][e]`: tokens routed to expert `e` of MoE layer `l` in micro-step
/// `m`. With `num_sources > 0` it also holds `load[m][l][e][src]`, the part of
/// those tokens that sits on EP rank `src` before dispatch; the totals are then
/// always the sums over sources.
class LoadTensor {
public:
  using value_type = std::int64_t;

  LoadTensor() = default;
  LoadTensor(int num_micro_steps, int num_layers, int num_experts, int num_sources = 0)
      : num_micro_steps_(num_micro_steps), num_layers_(num_layers), num_experts_(num_experts),
        num_sources_(num_sources) {
    require_shape(num_micro_steps, num_layers, num_experts, num_sources);
    totals_.assign(static_cast<std::size_t>(num_micro_steps) * num_layers * num_experts, 0);
    if (num_sources > 0) by_source_.assign(totals_.size() * static_cast<std::size_t>(num_sources), 0);
  }

  /// Throws `Error` naming the value unless a tensor of this shape may be made: every size in range and the cells
  /// within `limits::max_load_cells`. The constructor's check, for callers that size other buffers from the same
  /// shape before making the tensor.
  static void require_shape(int num_micro_steps, int num_layers, int num_experts, int num_sources) {
    detail::require(num_micro_steps >= 0, "LoadTensor: num_micro_steps must be >= 0, got ", num_micro_steps);
    detail::require(num_layers > 0, "LoadTensor: num_layers must be positive, got ", num_layers);
    detail::require(num_experts > 0, "LoadTensor: num_experts must be positive, got ", num_experts);
    detail::require(num_sources >= 0, "LoadTensor: num_sources must be >= 0, got ", num_sources);
    if (num_sources > 0)
      limits::require_product("LoadTensor",
                              {{"micro-steps", num_micro_steps},
                               {"layers", num_layers},
                               {"experts", num_experts},
                               {"(sources + 1)", std::int64_t{num_sources} + 1}},
                              limits::max_load_cells, "load cells");
    else
      limits::require_product("LoadTensor",
                              {{"micro-steps", num_micro_steps}, {"layers", num_layers}, {"experts", num_experts}},
                              limits::max_load_cells, "load cells");
  }

  [[nodiscard]] int num_micro_steps() const noexcept { return num_micro_steps_; }
  [[nodiscard]] int num_layers() const noexcept { return num_layers_; }
  [[nodiscard]] int num_experts() const noexcept { return num_experts_; }
  /// 0 when the tensor carries no per-source split.
  [[nodiscard]] int num_sources() const noexcept { return num_sources_; }
  [[nodiscard]] bool has_sources() const noexcept { return num_sources_ > 0; }

  [[nodiscard]] value_type &at(int m, int l, int e) noexcept { return totals_[index(m, l, e)]; }
  [[nodiscard]] value_type at(int m, int l, int e) const noexcept { return totals_[index(m, l, e)]; }
  [[nodiscard]] value_type &at(int m, int l, int e, int src) noexcept {
    return by_source_[index(m, l, e) * num_sources_ + src];
  }
  [[nodiscard]] value_type at(int m, int l, int e, int src) const noexcept {
    return by_source_[index(m, l, e) * num_sources_ + src];
  }

  /// The `num_experts` totals of one (micro-step, layer).
  [[nodiscard]] std::span<value_type> layer(int m, int l) noexcept {
    return {totals_.data() + index(m, l, 0), static_cast<std::size_t>(num_experts_)};
  }
  [[nodiscard]] std::span<const value_type> layer(int m, int l) const noexcept {
    return {totals_.data() + index(m, l, 0), static_cast<std::size_t>(num_experts_)};
  }
  /// `[experts][sources]` of one (micro-step, layer); empty without sources.
  [[nodiscard]] std::span<const value_type> layer_by_source(int m, int l) const noexcept {
    if (num_sources_ == 0) return {};
    return {by_source_.data() + index(m, l, 0) * num_sources_, static_cast<std::size_t>(num_experts_) * num_sources_};
  }
  [[nodiscard]] std::span<value_type> layer_by_source(int m, int l) noexcept {
    if (num_sources_ == 0) return {};
    return {by_source_.data() + index(m, l, 0) * num_sources_, static_cast<std::size_t>(num_experts_) * num_sources_};
  }

  /// Flat `[M][L][E]` totals, C order.
  [[nodiscard]] std::span<const value_type> totals() const noexcept { return totals_; }
  [[nodiscard]] std::span<value_type> totals() noexcept { return totals_; }
  /// Flat `[M][L][E][S]` split, C order; empty without sources.
  [[nodiscard]] std::span<const value_type> by_source() const noexcept { return by_source_; }
  [[nodiscard]] std::span<value_type> by_source() noexcept { return by_source_; }

  /// Sum of one (micro-step, layer) over experts.
  [[nodiscard]] value_type layer_total(int m, int l) const noexcept {
    value_type s = 0;
    for (value_type v : layer(m, l))
      s += v;
    return s;
  }

  /// Throws `Error` for a negative load, totals that disagree with the split, or a layer whose loads over every
  /// micro-step sum past `limits::max_load_total` (sums are checked before they are formed, so none overflows).
  void validate() const {
    for (std::size_t i = 0; i < totals_.size(); ++i)
      if (totals_[i] < 0) [[unlikely]]
        fail_at("negative load ", totals_[i], i);
    check_layer_sums();
    if (num_sources_ == 0) return;
    for (std::size_t i = 0; i < totals_.size(); ++i) {
      value_type s = 0;
      for (int src = 0; src < num_sources_; ++src) {
        const value_type v = by_source_[i * num_sources_ + src];
        if (v < 0) [[unlikely]]
          fail_at("negative per-source load ", v, i);
        if (v > totals_[i] - s) [[unlikely]]
          fail_at(detail::concat("per-source loads summing past the total "), totals_[i], i);
        s += v;
      }
      if (s != totals_[i]) [[unlikely]]
        fail_at(detail::concat("per-source loads summing to ", s, " but total "), totals_[i], i);
    }
  }

  /// Builds totals from floating-point counts `[M][L][E]` (e.g. NPY float64),
  /// rejecting NaN, infinities, negative and non-integral values by position.
  [[nodiscard]] static LoadTensor from_floats(std::span<const double> values, int num_micro_steps, int num_layers,
                                              int num_experts) {
    LoadTensor t(num_micro_steps, num_layers, num_experts);
    detail::require(values.size() == t.totals_.size(), "LoadTensor: ", values.size(), " values for shape [",
                    num_micro_steps, ", ", num_layers, ", ", num_experts, "] which needs ", t.totals_.size());
    for (std::size_t i = 0; i < values.size(); ++i) {
      const double v = values[i];
      if (!std::isfinite(v) || v < 0 || v != std::floor(v) || v > 9.0e15) [[unlikely]]
        t.fail_at(std::isfinite(v) ? (v < 0 ? "negative load " : "non-integral or too large load ")
                                   : "non-finite load ",
                  v, i);
      t.totals_[i] = static_cast<value_type>(v);
    }
    t.check_layer_sums();
    return t;
  }

  /// Builds totals from integer counts `[M][L][E]`, rejecting negative values.
  [[nodiscard]] static LoadTensor from_counts(std::span<const value_type> values, int num_micro_steps, int num_layers,
                                              int num_experts) {
    LoadTensor t(num_micro_steps, num_layers, num_experts);
    detail::require(values.size() == t.totals_.size(), "LoadTensor: ", values.size(), " values for shape [",
                    num_micro_steps, ", ", num_layers, ", ", num_experts, "] which needs ", t.totals_.size());
    t.totals_.assign(values.begin(), values.end());
    t.validate();
    return t;
  }

  friend bool operator==(const LoadTensor &, const LoadTensor &) = default;

private:
  /// Every layer's loads (non-negative) over all micro-steps sum to at most `limits::max_load_total`.
  void check_layer_sums() const {
    for (int l = 0; l < num_layers_; ++l) {
      value_type s = 0;
      for (int m = 0; m < num_micro_steps_; ++m)
        for (const value_type v : layer(m, l)) {
          if (v > limits::max_load_total - s) [[unlikely]]
            detail::fail("LoadTensor: the loads of layer ", l, " sum past ", limits::limit_text(limits::max_load_total),
                         " over the ", num_micro_steps_, " micro-steps (by micro-step ", m,
                         "); the planner's sums must stay within int64");
          s += v;
        }
    }
  }

  [[nodiscard]] std::size_t index(int m, int l, int e) const noexcept {
    return (static_cast<std::size_t>(m) * num_layers_ + l) * num_experts_ + e;
  }
  template <class V> [[noreturn]] void fail_at(const std::string &what, V v, std::size_t flat) const {
    const std::size_t e = flat % num_experts_, l = (flat / num_experts_) % num_layers_,
                      m = flat / (static_cast<std::size_t>(num_experts_) * num_layers_);
    detail::fail("LoadTensor: ", what, v, " at micro-step ", m, ", layer ", l, ", expert ", e);
  }

  int num_micro_steps_ = 0, num_layers_ = 0, num_experts_ = 0, num_sources_ = 0;
  std::vector<value_type> totals_;
  std::vector<value_type> by_source_;
};

} // namespace v0
} // namespace foremoe
