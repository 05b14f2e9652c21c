#pragma once
/// @file
/// In-memory trainer formats are a registry too: a trainer hands over its routing as tensors (verl's padded
/// batch and attention mask, Megatron-core's per-layer indices, slime's per-sample arrays) rather than as a file.
/// Each format is a file in `foremoe/trace/batch_formats/` that registers a `BatchFormat` when included: it checks
/// the arrays' layout (shapes, dtypes, masks, micro-batch partitions; never the ids themselves) and turns it into
/// `BatchPart`s, token streams that `count_batch` counts into `[M, L, E]` loads. The layout reads only metadata,
/// masks and index lists, so ids on a device are laid out the same and counted there part by part (Python's
/// device counter). `batch_formats/builtin.hpp` includes them all.

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/load_tensor.hpp"
#include "foremoe/trace/count.hpp"
#include "foremoe/trace/io.hpp"
#include "foremoe/trace/routed_view.hpp"

namespace foremoe {
inline namespace v0 {

/// Element kind of an array handed over in memory.
enum class ElemKind : std::uint8_t { int_, uint_, bool_, float_, other };

/// A strided array handed over in memory (a NumPy array, a tensor): its element type, shape and strides (in
/// elements). `data` is null for an array whose values cannot be read here (a tensor on a device): its layout is
/// still checked, only counting needs the values.
struct ArrayRef {
  const void *data = nullptr;
  ElemKind kind = ElemKind::int_;
  int bits = 64;
  std::vector<std::int64_t> shape, strides;

  [[nodiscard]] int ndim() const noexcept { return static_cast<int>(shape.size()); }
  /// Elements in all, or -1 when the count does not fit int64.
  [[nodiscard]] std::int64_t size() const noexcept {
    std::int64_t n = 1;
    for (const std::int64_t d : shape) {
      if (d == 0) return 0;
      if (d < 0 || n > std::numeric_limits<std::int64_t>::max() / d) return -1;
      n *= d;
    }
    return n;
  }
  /// NumPy's name of the element type: "int64", "uint8", "float32", "bool".
  [[nodiscard]] std::string dtype_name() const {
    switch (kind) {
    case ElemKind::int_: return "int" + std::to_string(bits);
    case ElemKind::uint_: return "uint" + std::to_string(bits);
    case ElemKind::bool_: return "bool";
    case ElemKind::float_: return "float" + std::to_string(bits);
    case ElemKind::other: break;
    }
    return "other" + std::to_string(bits);
  }
  [[nodiscard]] std::string shape_text() const { return detail::shape_text(shape); }
  [[nodiscard]] bool is_integer() const noexcept {
    return (kind == ElemKind::int_ || kind == ElemKind::uint_) && (bits == 8 || bits == 16 || bits == 32 || bits == 64);
  }
  /// The routed-id dtype, if the element type is one.
  [[nodiscard]] std::optional<IdDtype> id_dtype() const noexcept {
    if (kind == ElemKind::int_) switch (bits) {
      case 8: return IdDtype::i8;
      case 16: return IdDtype::i16;
      case 32: return IdDtype::i32;
      case 64: return IdDtype::i64;
      default: return std::nullopt;
      }
    if (kind == ElemKind::uint_ && bits == 8) return IdDtype::u8;
    if (kind == ElemKind::uint_ && bits == 16) return IdDtype::u16;
    return std::nullopt;
  }
  /// The integer (or bool) element at element offset `at` from `data`; `std::nullopt` for a uint64 past int64.
  [[nodiscard]] std::optional<std::int64_t> int_at(std::int64_t at) const {
    detail::require(data != nullptr, "ArrayRef: values of an array not readable here");
    const auto read = [&](auto tag) { return static_cast<const decltype(tag) *>(data)[at]; };
    if (kind == ElemKind::bool_ || (kind == ElemKind::uint_ && bits == 8)) return read(std::uint8_t{});
    if (kind == ElemKind::int_) switch (bits) {
      case 8: return read(std::int8_t{});
      case 16: return read(std::int16_t{});
      case 32: return read(std::int32_t{});
      default: return read(std::int64_t{});
      }
    switch (bits) {
    case 16: return read(std::uint16_t{});
    case 32: return read(std::uint32_t{});
    default: break;
    }
    const std::uint64_t u = read(std::uint64_t{});
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return std::nullopt;
    return static_cast<std::int64_t>(u);
  }
};

/// A C-contiguous `ArrayRef` over `v` with shape `shape` (tests, C++ callers).
template <class T> [[nodiscard]] ArrayRef array_ref(std::span<const T> v, std::vector<std::int64_t> shape) {
  ArrayRef a;
  a.data = v.data();
  a.kind = std::is_same_v<T, bool>       ? ElemKind::bool_
           : std::is_floating_point_v<T> ? ElemKind::float_
           : std::is_signed_v<T>         ? ElemKind::int_
                                         : ElemKind::uint_;
  a.bits = static_cast<int>(sizeof(T) * 8);
  a.strides.assign(shape.size(), 1);
  for (std::size_t i = shape.size(); i-- > 1;)
    a.strides[i - 1] = a.strides[i] * shape[i];
  a.shape = std::move(shape);
  detail::require(a.size() == static_cast<std::int64_t>(v.size()), "array_ref: ", v.size(), " values for shape ",
                  a.shape_text());
  return a;
}

/// How a format's items (samples) form micro-batches: one micro-batch of all, consecutive runs of `size`, or one
/// index list per micro-batch in execution order (every item in exactly one).
struct MicroBatches {
  enum class Kind : std::uint8_t { one, size, lists };
  Kind kind = Kind::one;
  std::int64_t size = 0;
  std::vector<ArrayRef> lists; ///< 1-D integer arrays (any dtype: checked, empty ones of any dtype)

  [[nodiscard]] static MicroBatches of_size(std::int64_t n) { return {Kind::size, n, {}}; }
  [[nodiscard]] static MicroBatches of_lists(std::vector<ArrayRef> l) { return {Kind::lists, 0, std::move(l)}; }
};

/// What a trainer handed over, as the binding (or a C++ caller) passes it to a format.
struct BatchInput {
  std::string who = "count_batch"; ///< starts every message (Python's function name)
  /// The id arrays, in order: verl one `[bs, seq, L, K]`; Megatron one `[T, K]` per MoE layer; slime the samples.
  std::vector<ArrayRef> arrays;
  /// Set when `arrays` came as nested lists (Megatron per micro-batch, slime per micro-batch): the inner lists'
  /// lengths, in order; `arrays` is their concatenation.
  std::optional<std::vector<std::int64_t>> list_sizes;
  std::optional<ArrayRef> mask;                         ///< verl's attention mask `[bs, seq]`
  MicroBatches micro_batches;                           ///< over the format's items (verl, slime samples)
  std::optional<std::span<const std::int64_t>> offsets; ///< `[M + 1]` token offsets (Megatron)
};

/// One token stream to count: `arrays[array_idx]` (its row `row` when >= 0) read as `[tokens, layers, topk]`,
/// cut at `offsets` into segments, segment `s` added to micro-step `micro_step[s]` at trace layers
/// `[first_layer, first_layer + layers)`.
struct BatchPart {
  std::size_t array_idx = 0;
  std::int64_t row = -1;
  IdDtype dtype = IdDtype::i64;
  std::int64_t num_tokens = 0;
  int num_layers = 1, topk = 1;
  std::array<std::int64_t, 3> strides{};
  std::int64_t data_offset = 0;      ///< elements from the array's data to token 0
  std::vector<std::uint8_t> mask;    ///< `[tokens]` 0/1, empty: every token counts
  std::vector<std::int64_t> offsets; ///< `[segments + 1]` token offsets, 0 .. tokens
  std::vector<int> micro_step;       ///< `[segments]`
  int first_layer = 0;
  /// Where token `t`, layer `l` (of this part) sits in the trainer's terms, e.g. "sample 1, position 4, layer 0".
  std::function<std::string(std::int64_t t, int l)> where;

  [[nodiscard]] RoutedView view(const std::vector<ArrayRef> &arrays) const {
    const ArrayRef &a = arrays.at(array_idx);
    detail::require(a.data != nullptr || num_tokens == 0, "count_batch: array ", array_idx,
                    " is not readable here (a device array: count it with a device counter)");
    const void *p = a.data == nullptr ? nullptr
                                      : static_cast<const std::byte *>(a.data) +
                                            data_offset * static_cast<std::int64_t>(id_dtype_bytes(dtype));
    return {p, dtype, num_tokens, num_layers, topk, strides};
  }
};

/// A format's layout of one input: the parts, the micro-steps and the trace layers of the loads.
struct BatchLayout {
  int num_micro_steps = 0;
  int num_layers = 0; ///< trace layers (before a layer map)
  std::vector<BatchPart> parts;
};

/// One in-memory format as registered.
struct BatchFormat {
  std::string name;             ///< e.g. "verl"
  std::string help;             ///< what the arrays are
  bool takes_layer_map = false; ///< `count_batch` accepts a layer map (the arrays carry every trace layer)
  std::function<BatchLayout(const BatchInput &)> layout;
};

namespace detail {

struct BatchFormatRegistry {
  std::mutex mutex;
  std::vector<std::unique_ptr<const BatchFormat>> by_name;
};
inline BatchFormatRegistry &batch_format_registry() {
  static BatchFormatRegistry registry;
  return registry;
}

/// The id array `a` must have `ndim` dimensions, an id dtype and at most 2^20 layers and topk; `what` names it.
inline void check_id_array(const ArrayRef &a, int ndim, std::string_view who, std::string_view what) {
  require(a.ndim() == ndim, who, ": ", what, " must have ", ndim, " dimensions, got shape ", a.shape_text());
  require(a.is_integer(), who, ": ", what, " must hold integer expert ids, got dtype ", a.dtype_name());
  require(a.id_dtype().has_value(), who, ": ", what, " must be int8, uint8, int16, uint16, int32 or int64, got ",
          a.dtype_name());
  require(a.size() >= 0, who, ": ", what, " has ", a.shape_text(), " elements, more than int64 holds");
  for (int d = std::max(1, ndim - 2); d < ndim; ++d) // layers and topk (Megatron's [T, K]: topk)
    require(a.shape[d] > 0 && a.shape[d] <= (std::int64_t{1} << 20), who, ": ", what, " has dimension ", d, " = ",
            a.shape[d], " (layers and topk must lie in [1, 2^20]), shape ", a.shape_text());
}

/// The `[n]` 0/1 values of a mask region: elements `base + i * stride` of `m`; `at(i)` names element `i`.
inline std::vector<std::uint8_t> mask_values(const ArrayRef &m, std::int64_t base, std::int64_t stride, std::int64_t n,
                                             const std::function<std::string(std::int64_t)> &at) {
  std::vector<std::uint8_t> out(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const std::optional<std::int64_t> v = m.int_at(base + i * stride);
    require(v.has_value() && (*v == 0 || *v == 1), at(i), " = ",
            v ? std::to_string(*v) : std::string("a value past int64"), " is not 0 or 1 (0 = padding, 1 = a token)");
    out[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(*v);
  }
  return out;
}

} // namespace detail

/// The micro-batches of `n` items (`unit`, e.g. "sample") as index lists in execution order; throws `Error`
/// starting with `who` and naming the value for a size that is not positive, an index list that is not integer,
/// an index outside `[0, n)`, an item in two micro-batches or in none, and no micro-batch.
[[nodiscard]] inline std::vector<std::vector<std::int64_t>>
micro_batch_groups(const MicroBatches &mb, std::int64_t n, std::string_view who, std::string_view unit) {
  using detail::require;
  std::vector<std::vector<std::int64_t>> groups;
  if (mb.kind == MicroBatches::Kind::one) {
    groups.emplace_back(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i)
      groups.back()[static_cast<std::size_t>(i)] = i;
    return groups;
  }
  if (mb.kind == MicroBatches::Kind::size) {
    require(mb.size > 0, who, ": micro-batch size must be positive, got ", mb.size);
    for (std::int64_t i = 0; i < n; i += std::min(mb.size, n - i)) {
      auto &g = groups.emplace_back();
      for (std::int64_t j = i; j < i + std::min(mb.size, n - i); ++j)
        g.push_back(j);
    }
    if (groups.empty()) groups.emplace_back();
    return groups;
  }
  require(!mb.lists.empty(), who, ": no micro-batch");
  std::vector<std::int64_t> seen(static_cast<std::size_t>(n), -1);
  for (std::size_t m = 0; m < mb.lists.size(); ++m) {
    const ArrayRef &a = mb.lists[m];
    const std::int64_t len = a.size();
    require(len == 0 || a.is_integer(), who, ": micro-batch ", m, " must list ", unit, " indices, got dtype ",
            a.dtype_name());
    require(len == 0 || a.ndim() == 1, who, ": micro-batch ", m, " must be a 1-D list of ", unit,
            " indices, got shape ", a.shape_text());
    auto &g = groups.emplace_back();
    for (std::int64_t j = 0; j < len; ++j) {
      const std::optional<std::int64_t> v = a.int_at(j * a.strides[0]);
      require(v && *v >= 0 && *v < n, who, ": micro-batch ", m, " names ", unit, " ",
              v ? std::to_string(*v) : std::to_string(std::numeric_limits<std::uint64_t>::max()), ", outside [0, ", n,
              ")");
      auto &s = seen[static_cast<std::size_t>(*v)];
      require(s < 0, who, ": ", unit, " ", *v, " is in micro-batch ", s, " and micro-batch ", m);
      s = static_cast<std::int64_t>(m);
      g.push_back(*v);
    }
  }
  const auto missing = std::find(seen.begin(), seen.end(), -1);
  require(missing == seen.end(), who, ": ", unit, " ", missing - seen.begin(),
          " is in no micro-batch (the micro-batches must cover the ", n, " ", unit, "s of the stage)");
  return groups;
}

/// Adds a format; throws `Error` on an empty or duplicate name or no layout.
inline void register_batch_format(BatchFormat format) {
  detail::require(!format.name.empty() && format.layout, "register_batch_format: format '", format.name,
                  "' needs a name and a layout");
  auto &reg = detail::batch_format_registry();
  const std::lock_guard hold(reg.mutex);
  auto &v = reg.by_name;
  detail::require(std::none_of(v.begin(), v.end(), [&](const auto &f) { return f->name == format.name; }),
                  "register_batch_format: format '", format.name, "' is already registered");
  const auto before = std::find_if(v.begin(), v.end(), [&](const auto &f) { return format.name < f->name; });
  v.insert(before, std::make_unique<const BatchFormat>(std::move(format)));
}

/// Every registered in-memory format, by name.
[[nodiscard]] inline std::vector<const BatchFormat *> batch_formats() {
  auto &reg = detail::batch_format_registry();
  const std::lock_guard hold(reg.mutex);
  std::vector<const BatchFormat *> out(reg.by_name.size());
  std::transform(reg.by_name.begin(), reg.by_name.end(), out.begin(), [](const auto &f) { return f.get(); });
  return out;
}

/// The format named `name`; throws `Error` naming the value and the registered names when there is none.
[[nodiscard]] inline const BatchFormat &find_batch_format(std::string_view name) {
  std::string names;
  for (const BatchFormat *f : batch_formats()) {
    if (f->name == name) return *f;
    names.append(names.empty() ? "" : ", ").append(f->name);
  }
  detail::fail("unknown in-memory trace format '", name, "' (registered: ", names, ")");
}

/// Counts a format's layout into `[M, L', E]` loads (L' = the layer map's MoE layers, or the trace layers): each
/// part on the CPU, its segments added to their micro-steps. Throws `Error` starting with `who` for an id outside
/// `[0, num_experts)` (other than "no route"), naming it and where it sits.
[[nodiscard]] inline LoadTensor count_batch(const BatchLayout &layout, const std::vector<ArrayRef> &arrays,
                                            int num_experts, const LayerMap &layer_map, std::string_view who) {
  using detail::require;
  require(num_experts > 0 && num_experts < (1 << 30), who, ": num_experts ", num_experts, " is outside [1, 2^30)");
  const LayerMap lmap = layer_map.empty() ? LayerMap::identity(layout.num_layers) : layer_map;
  require(lmap.num_trace_layers() == layout.num_layers, who, ": layer_map covers ", lmap.num_trace_layers(),
          " trace layers but the routing has ", layout.num_layers);
  LoadTensor out(layout.num_micro_steps, lmap.num_moe_layers(), num_experts);
  for (const BatchPart &p : layout.parts) {
    const RoutedView v = p.view(arrays);
    const bool whole = p.first_layer == 0 && p.num_layers == layout.num_layers;
    require(whole || layer_map.empty(), who, ": a layer map needs parts that hold every layer");
    CountOptions o;
    o.num_experts = num_experts;
    if (whole) o.layer_map = lmap;
    o.microbatch_offsets = p.offsets;
    o.mask = p.mask;
    LoadTensor part;
    try {
      part = count_loads(v, o);
    } catch (const Error &e) {
      // Name the bad id in the trainer's terms: the first one in the part, as the counter met it.
      for (std::int64_t t = 0; t < v.num_tokens(); ++t)
        if (p.mask.empty() || p.mask[static_cast<std::size_t>(t)] != 0)
          for (int l = 0; l < v.num_layers(); ++l)
            for (int k = 0; k < v.topk() && (!whole || lmap.moe_layer(l) >= 0); ++k) {
              const std::int64_t id = v.at(t, l, k, num_experts);
              require(id == -1 || (id >= 0 && id < num_experts), who, ": expert id ", id, " at ",
                      p.where ? p.where(t, p.first_layer + l) : "token " + std::to_string(t), ", k ", k,
                      " is outside [0, ", num_experts, ") (", to_string(v.dtype()), " ids, -1 = no route)");
            }
      detail::fail(who, ": ", e.what());
    }
    for (std::size_t s = 0; s < p.micro_step.size(); ++s)
      for (int l = 0; l < part.num_layers(); ++l) {
        const auto from = part.layer(static_cast<int>(s), l);
        auto to = out.layer(p.micro_step[s], whole ? l : lmap.moe_layer(p.first_layer + l));
        for (int e = 0; e < num_experts; ++e)
          to[e] += from[e];
      }
  }
  return out;
}

/// `find_batch_format(name)`'s layout of `in`, counted (`count_batch`): the whole path for arrays on the CPU.
[[nodiscard]] inline LoadTensor count_batch(std::string_view name, const BatchInput &in, int num_experts,
                                            const LayerMap &layer_map = {}) {
  const BatchFormat &f = find_batch_format(name);
  detail::require(layer_map.empty() || f.takes_layer_map, in.who, ": format ", name, " takes no layer map");
  return count_batch(f.layout(in), in.arrays, num_experts, layer_map, in.who);
}

} // namespace v0
} // namespace foremoe
