#pragma once
/// @file
/// Non-owning views over routed expert ids `[tokens, layers, topk]` in any
/// integer dtype, and the map from trace layers to MoE layers.

#include <array>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "foremoe/core/error.hpp"

namespace foremoe {
inline namespace v0 {

/// Element type of a routed-id array.
enum class IdDtype : std::uint8_t { i8, u8, i16, u16, i32, i64 };

[[nodiscard]] constexpr int id_dtype_bytes(IdDtype d) noexcept {
  switch (d) {
  case IdDtype::i8:
  case IdDtype::u8: return 1;
  case IdDtype::i16:
  case IdDtype::u16: return 2;
  case IdDtype::i32: return 4;
  case IdDtype::i64: return 8;
  }
  return 0;
}

[[nodiscard]] constexpr bool id_dtype_signed(IdDtype d) noexcept {
  return d == IdDtype::i8 || d == IdDtype::i16 || d == IdDtype::i32 || d == IdDtype::i64;
}

[[nodiscard]] constexpr std::string_view to_string(IdDtype d) noexcept {
  switch (d) {
  case IdDtype::i8: return "int8";
  case IdDtype::u8: return "uint8";
  case IdDtype::i16: return "int16";
  case IdDtype::u16: return "uint16";
  case IdDtype::i32: return "int32";
  case IdDtype::i64: return "int64";
  }
  return "?";
}

template <class T> [[nodiscard]] constexpr IdDtype id_dtype_of() noexcept {
  static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool> && sizeof(T) <= 8 &&
                    !(std::is_unsigned_v<T> && sizeof(T) > 2),
                "routed ids must be int8/uint8/int16/uint16/int32/int64");
  if constexpr (sizeof(T) == 1)
    return std::is_signed_v<T> ? IdDtype::i8 : IdDtype::u8;
  else if constexpr (sizeof(T) == 2)
    return std::is_signed_v<T> ? IdDtype::i16 : IdDtype::u16;
  else if constexpr (sizeof(T) == 4)
    return IdDtype::i32;
  else
    return IdDtype::i64;
}

/// Calls `f(T{})` with the C++ type of `d`.
template <class F> decltype(auto) visit_id_dtype(IdDtype d, F &&f) {
  switch (d) {
  case IdDtype::i8: return f(std::int8_t{});
  case IdDtype::u8: return f(std::uint8_t{});
  case IdDtype::i16: return f(std::int16_t{});
  case IdDtype::u16: return f(std::uint16_t{});
  case IdDtype::i32: return f(std::int32_t{});
  case IdDtype::i64: return f(std::int64_t{});
  }
  detail::fail("visit_id_dtype: invalid dtype tag ", static_cast<int>(d));
}

/// A view over routed ids `ids[t][l][k]` with element strides (in elements of
/// the dtype, possibly zero or negative for broadcasts and reversed views).
///
/// "No route" is `-1` for signed dtypes. For unsigned dtypes it is the all-ones
/// value (what `-1` becomes when a signed tensor is cast), unless the expert
/// count is so large that all-ones is itself a valid id (uint8 with 256 experts),
/// in which case the dtype cannot express "no route".
class RoutedView {
public:
  RoutedView() = default;
  RoutedView(const void *data, IdDtype dtype, std::int64_t num_tokens, int num_layers, int topk,
             std::array<std::int64_t, 3> strides)
      : data_(data), dtype_(dtype), num_tokens_(num_tokens), num_layers_(num_layers), topk_(topk), strides_(strides) {
    detail::require(num_tokens >= 0, "RoutedView: num_tokens must be >= 0, got ", num_tokens);
    detail::require(num_layers > 0, "RoutedView: num_layers must be positive, got ", num_layers);
    detail::require(topk > 0, "RoutedView: topk must be positive, got ", topk);
    detail::require(data != nullptr || num_tokens == 0, "RoutedView: null data for ", num_tokens, " tokens");
  }
  /// C-contiguous `[tokens][layers][topk]`.
  RoutedView(const void *data, IdDtype dtype, std::int64_t num_tokens, int num_layers, int topk)
      : RoutedView(data, dtype, num_tokens, num_layers, topk,
                   {std::int64_t{num_layers} * topk, std::int64_t{topk}, 1}) {}

  template <class T>
  RoutedView(std::span<const T> ids, std::int64_t num_tokens, int num_layers, int topk)
      : RoutedView(ids.data(), id_dtype_of<T>(), num_tokens, num_layers, topk) {
    detail::require(static_cast<std::int64_t>(ids.size()) == num_tokens * num_layers * topk, "RoutedView: ", ids.size(),
                    " ids for shape [", num_tokens, ", ", num_layers, ", ", topk, "] which needs ",
                    num_tokens * num_layers * topk);
  }

  [[nodiscard]] const void *data() const noexcept { return data_; }
  [[nodiscard]] IdDtype dtype() const noexcept { return dtype_; }
  [[nodiscard]] std::int64_t num_tokens() const noexcept { return num_tokens_; }
  [[nodiscard]] int num_layers() const noexcept { return num_layers_; }
  [[nodiscard]] int topk() const noexcept { return topk_; }
  [[nodiscard]] const std::array<std::int64_t, 3> &strides() const noexcept { return strides_; }
  [[nodiscard]] bool is_contiguous() const noexcept {
    return strides_[2] == 1 && strides_[1] == topk_ && strides_[0] == std::int64_t{num_layers_} * topk_;
  }

  /// Maps a raw value to int64, unsigned all-ones to -1 when it means "no route".
  template <class T> [[nodiscard]] static constexpr std::int64_t widen(T v, int num_experts) noexcept {
    if constexpr (std::is_unsigned_v<T>) {
      if (v == std::numeric_limits<T>::max() && num_experts <= static_cast<int>(std::numeric_limits<T>::max()))
        return -1;
    }
    return static_cast<std::int64_t>(v);
  }

  /// Id at `(t, l, k)` widened to int64, or -1 for "no route" (given `num_experts`).
  [[nodiscard]] std::int64_t at(std::int64_t t, int l, int k, int num_experts) const noexcept {
    return visit_id_dtype(dtype_, [&](auto tag) -> std::int64_t {
      using T = decltype(tag);
      const T v = static_cast<const T *>(data_)[t * strides_[0] + l * strides_[1] + k * strides_[2]];
      return widen(v, num_experts);
    });
  }

private:
  const void *data_ = nullptr;
  IdDtype dtype_ = IdDtype::i32;
  std::int64_t num_tokens_ = 0;
  int num_layers_ = 1, topk_ = 1;
  std::array<std::int64_t, 3> strides_{1, 1, 1};
};

/// Maps each layer of a trace to its MoE layer index, or -1 for a dense layer
/// whose ids are ignored. vLLM/SGLang hand over all transformer layers;
/// Megatron-style trainers hand over only the MoE layers (identity map).
class LayerMap {
public:
  LayerMap() = default;
  /// `trace_to_moe[i]` is the MoE layer of trace layer `i` or -1.
  explicit LayerMap(std::vector<int> trace_to_moe) : map_(std::move(trace_to_moe)) {
    int next = 0;
    for (std::size_t i = 0; i < map_.size(); ++i) {
      if (map_[i] < 0) {
        detail::require(map_[i] == -1, "LayerMap: trace layer ", i, " maps to ", map_[i], " (use -1 for dense)");
        continue;
      }
      detail::require(map_[i] == next, "LayerMap: trace layer ", i, " maps to MoE layer ", map_[i],
                      " but the next MoE layer in order is ", next);
      ++next;
    }
    num_moe_layers_ = next;
    detail::require(num_moe_layers_ > 0, "LayerMap: no MoE layer among ", map_.size(), " trace layers");
  }
  /// Every trace layer is an MoE layer.
  [[nodiscard]] static LayerMap identity(int num_layers) {
    std::vector<int> m(num_layers);
    for (int i = 0; i < num_layers; ++i)
      m[i] = i;
    return LayerMap(std::move(m));
  }
  /// `num_dense` leading dense layers, then MoE layers (DeepSeek-V3: 61 layers, 3 dense).
  [[nodiscard]] static LayerMap dense_prefix(int num_layers, int num_dense) {
    detail::require(num_dense >= 0 && num_dense < num_layers, "LayerMap: ", num_dense, " dense layers out of ",
                    num_layers);
    std::vector<int> m(num_layers);
    for (int i = 0; i < num_layers; ++i)
      m[i] = i < num_dense ? -1 : i - num_dense;
    return LayerMap(std::move(m));
  }
  /// Every `period`-th layer (starting at `first`) is MoE, the rest dense.
  [[nodiscard]] static LayerMap interleaved(int num_layers, int period, int first = 0) {
    detail::require(period > 0, "LayerMap: period must be positive, got ", period);
    detail::require(first >= 0 && first < num_layers, "LayerMap: first MoE layer ", first, " outside [0, ", num_layers,
                    ")");
    std::vector<int> m(num_layers, -1);
    int next = 0;
    for (int i = first; i < num_layers; i += period)
      m[i] = next++;
    return LayerMap(std::move(m));
  }

  [[nodiscard]] bool empty() const noexcept { return map_.empty(); }
  [[nodiscard]] int num_trace_layers() const noexcept { return static_cast<int>(map_.size()); }
  [[nodiscard]] int num_moe_layers() const noexcept { return num_moe_layers_; }
  [[nodiscard]] int moe_layer(int trace_layer) const noexcept { return map_[trace_layer]; }
  [[nodiscard]] std::span<const int> map() const noexcept { return map_; }

private:
  std::vector<int> map_;
  int num_moe_layers_ = 0;
};

} // namespace v0
} // namespace foremoe
