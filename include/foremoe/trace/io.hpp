#pragma once
/// @file
/// NPY files of the trace layer: load tensors, offset vectors and routed ids.

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/files.hpp"
#include "foremoe/core/load_tensor.hpp"
#include "foremoe/trace/npy.hpp"
#include "foremoe/trace/routed_view.hpp"

namespace foremoe {
inline namespace v0 {

namespace detail {
[[nodiscard]] inline std::string shape_text(std::span<const std::int64_t> shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}
inline void require_int_dim(std::int64_t d, const std::filesystem::path &path, const char *what) {
  require(d > 0 && d <= (std::int64_t{1} << 30), path.string(), ": ", what, " ", d, " is outside [1, 2^30]");
}
} // namespace detail

/// Reads a whole regular file of at most `max_bytes` (`files::read_file`), naming it on failure (the trace
/// formats' inputs, and `config::read_text` for JSON documents).
[[nodiscard]] inline std::string read_text(const std::filesystem::path &path,
                                           std::uint64_t max_bytes = files::max_document_bytes,
                                           std::string_view what = "a JSON document") {
  return files::read_file(path, max_bytes, what);
}

/// `dir/stem.npy` -> `dir/stem.<what>.npy`: where the 1-D sidecars of a trace file live
/// (`steps`, `microbatches`, `sources`).
[[nodiscard]] inline std::filesystem::path sidecar_path(const std::filesystem::path &p, const char *what) {
  std::filesystem::path s = p;
  s.replace_extension();
  return s.string() + "." + what + ".npy";
}

/// Reads loads `[M, L, E]`, `[M, L, E, S]` (per source rank) or `[L, E]` (one
/// micro-step) of any integer or float dtype, validated: NaN, negative or
/// fractional counts are errors naming their position.
[[nodiscard]] inline LoadTensor read_loads_npy(const std::filesystem::path &path) {
  const NpyArray a = read_npy(path).to_c_order();
  std::vector<std::int64_t> shape = a.shape;
  detail::require(shape.size() >= 2 && shape.size() <= 4, path.string(),
                  ": loads must be [M, L, E], [M, L, E, S] or [L, E], got shape ", detail::shape_text(shape));
  if (shape.size() == 2) shape.insert(shape.begin(), 1);
  for (std::size_t i = 0; i < shape.size(); ++i)
    detail::require_int_dim(shape[i], path, "dimension");
  const int M = static_cast<int>(shape[0]), L = static_cast<int>(shape[1]), E = static_cast<int>(shape[2]);
  const int S = shape.size() == 4 ? static_cast<int>(shape[3]) : 0;
  const std::vector<double> v = a.to_doubles();
  try {
    if (S == 0) return LoadTensor::from_floats(v, M, L, E);
    LoadTensor t(M, L, E, S);
    auto src = t.by_source();
    for (std::size_t i = 0; i < v.size(); ++i) {
      const double x = v[i];
      if (!std::isfinite(x) || x < 0 || x != std::floor(x) || x > 9.0e15) [[unlikely]]
        detail::fail("bad per-source load ", x, " at flat index ", i, " (must be a finite non-negative integer)");
      src[i] = static_cast<std::int64_t>(x);
    }
    auto tot = t.totals();
    for (std::size_t c = 0; c < tot.size(); ++c)
      for (int s = 0; s < S; ++s)
        tot[c] += src[c * S + s];
    return t;
  } catch (const Error &e) {
    detail::fail(path.string(), ": ", e.what());
  }
}

/// The writer (`files::OutputSet`) of the totals `[M, L, E]` as int64, or the split `[M, L, E, S]` with
/// `by_source`, to be handed to `OutputSet::add` at once (it runs there; `loads` must live until then).
[[nodiscard]] inline files::OutputSet::Writer loads_npy_writer(const LoadTensor &loads, bool by_source = false) {
  detail::require(!by_source || loads.has_sources(), "by-source output asked for a tensor without sources");
  std::vector<std::int64_t> shape{loads.num_micro_steps(), loads.num_layers(), loads.num_experts()};
  if (by_source) shape.push_back(loads.num_sources());
  const auto data = by_source ? loads.by_source() : loads.totals();
  return npy_writer(NpyDtype::of<std::int64_t>(), shape, data.data());
}

/// Writes the totals `[M, L, E]` as int64, or the split `[M, L, E, S]` with `by_source`.
inline void write_loads_npy(const std::filesystem::path &path, const LoadTensor &loads, bool by_source = false) {
  try {
    files::write_file(path, loads_npy_writer(loads, by_source));
  } catch (const Error &e) {
    detail::fail("write_loads_npy ", path.string(), ": ", e.what());
  }
}

/// Reads a 1-D integer vector (micro-batch, source or step offsets).
[[nodiscard]] inline std::vector<std::int64_t> read_offsets_npy(const std::filesystem::path &path) {
  const NpyArray a = read_npy(path);
  detail::require(a.shape.size() == 1, path.string(), ": offsets must be 1-D, got shape ", detail::shape_text(a.shape));
  detail::require(a.dtype.kind != NpyKind::float_, path.string(), ": offsets must be integers, got ", a.dtype.descr());
  try {
    return a.to_int64();
  } catch (const Error &e) {
    detail::fail(path.string(), ": ", e.what());
  }
}

/// The writer (`files::OutputSet`) of a 1-D int64 vector, to be handed to `OutputSet::add` at once.
[[nodiscard]] inline files::OutputSet::Writer offsets_npy_writer(std::span<const std::int64_t> offsets) {
  const std::int64_t n = static_cast<std::int64_t>(offsets.size());
  return npy_writer(NpyDtype::of<std::int64_t>(), std::span<const std::int64_t>(&n, 1), offsets.data());
}

inline void write_offsets_npy(const std::filesystem::path &path, std::span<const std::int64_t> offsets) {
  try {
    files::write_file(path, offsets_npy_writer(offsets));
  } catch (const Error &e) {
    detail::fail("write_npy: ", e.what());
  }
}

/// Routed ids read from a file, owning their bytes; `view()` sees them in the
/// file's order (C or Fortran) without a copy.
struct RoutedIdsFile {
  NpyArray array;
  IdDtype dtype = IdDtype::i32;

  [[nodiscard]] std::int64_t num_tokens() const noexcept { return array.shape[0]; }
  [[nodiscard]] int num_layers() const noexcept { return static_cast<int>(array.shape[1]); }
  [[nodiscard]] int topk() const noexcept { return static_cast<int>(array.shape[2]); }
  [[nodiscard]] RoutedView view() const {
    const auto st = array.strides_elements();
    return RoutedView(array.data.data(), dtype, num_tokens(), num_layers(), topk(), {st[0], st[1], st[2]});
  }
};

namespace detail {
/// The id dtype of an NPY array of routed ids; throws `Error` naming `p` for any other dtype.
[[nodiscard]] inline IdDtype npy_id_dtype(const NpyArray &a, const std::filesystem::path &p) {
  const auto &d = a.dtype;
  if (d.kind == NpyKind::int_)
    return d.item_bytes == 1   ? IdDtype::i8
           : d.item_bytes == 2 ? IdDtype::i16
           : d.item_bytes == 4 ? IdDtype::i32
                               : IdDtype::i64;
  if (d.kind == NpyKind::uint_ && d.item_bytes <= 2) return d.item_bytes == 1 ? IdDtype::u8 : IdDtype::u16;
  fail(p.string(), ": routed ids must be int8, uint8, int16, uint16, int32 or int64, got ", d.descr());
}
} // namespace detail

/// Routed ids `[tokens, layers, topk]` of dtype int8/uint8/int16/uint16/int32/int64 from an array read from `path`
/// (named in messages).
[[nodiscard]] inline RoutedIdsFile routed_ids_from_npy(NpyArray array, const std::filesystem::path &path) {
  RoutedIdsFile f;
  f.array = std::move(array);
  const auto &a = f.array;
  detail::require(a.shape.size() == 3, path.string(), ": routed ids must be [tokens, layers, topk], got shape ",
                  detail::shape_text(a.shape));
  detail::require(a.shape[0] >= 0, path.string(), ": negative token count");
  detail::require_int_dim(a.shape[1], path, "layers");
  detail::require_int_dim(a.shape[2], path, "topk");
  f.dtype = detail::npy_id_dtype(a, path);
  return f;
}

/// Reads routed ids `[tokens, layers, topk]` of dtype int8/uint8/int16/uint16/int32/int64.
[[nodiscard]] inline RoutedIdsFile read_routed_ids_npy(const std::filesystem::path &path) {
  return routed_ids_from_npy(read_npy(path), path);
}

} // namespace v0
} // namespace foremoe
