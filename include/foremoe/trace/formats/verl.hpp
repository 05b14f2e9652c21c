#pragma once
/// @file
/// Format "verl": verl's padded `routed_experts [bs, seq, L, K]` with its attention mask.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "foremoe/core/error.hpp"
#include "foremoe/trace/batch_formats.hpp"
#include "foremoe/trace/formats.hpp"

namespace foremoe {
inline namespace v0 {

namespace detail {
/// Reads a mask NPY, accepting NumPy's bool (`|b1`, one byte 0/1) as uint8: the NPY reader refuses bool for
/// loads and ids, where it would be a mistake, but a mask is naturally bool.
[[nodiscard]] inline NpyArray read_mask_npy(const TraceInput &in) {
  std::string bytes = in.text();
  const std::size_t head = std::min<std::size_t>(bytes.size(), 4096);
  if (const auto at = std::string_view(bytes.data(), head).find("'|b1'"); at != std::string_view::npos)
    bytes[at + 2] = 'u';
  return TraceInput(in.path,
                    std::span<const std::byte>(reinterpret_cast<const std::byte *>(bytes.data()), bytes.size()))
      .npy();
}
} // namespace detail

/// verl: `routed_experts [bs, seq, L, K]` (C order) and its attention mask `[bs, seq]` (bool or integer 0/1,
/// 1 = real token, any other value an error; verl pads prompts on the left, so padding sits at the start of each row).
/// Tokens are taken row by row (`t = b * seq + s`); masked positions are not counted. No `mask`: every position counts.
[[nodiscard]] inline RoutedRecord read_verl(const TraceInput &ids, const std::optional<TraceInput> &mask) {
  RoutedRecord r;
  r.array = ids.npy();
  const NpyArray &a = r.array;
  const std::string name = ids.path.string();
  detail::require(a.shape.size() == 4, name, ": verl routed_experts must be [batch, seq, layers, topk], got shape ",
                  detail::shape_text(a.shape));
  detail::require(!a.fortran_order || a.shape[0] * a.shape[1] <= 1 || a.shape[2] * a.shape[3] <= 1, name,
                  ": verl routed_experts must be C-ordered (save np.ascontiguousarray)");
  detail::require_int_dim(a.shape[2], ids.path, "layers");
  detail::require_int_dim(a.shape[3], ids.path, "topk");
  const IdDtype dt = detail::npy_id_dtype(a, ids.path);
  const std::int64_t tokens = a.shape[0] * a.shape[1];
  r.view = RoutedView(a.data.data(), dt, tokens, static_cast<int>(a.shape[2]), static_cast<int>(a.shape[3]));
  if (!mask) return r;
  const NpyArray m = detail::read_mask_npy(*mask);
  const std::string mname = mask->path.string();
  detail::require(m.shape.size() == 2 && m.shape[0] == a.shape[0] && m.shape[1] == a.shape[1], mname,
                  ": attention mask must be [", a.shape[0], ", ", a.shape[1], "] to match ", name, ", got shape ",
                  detail::shape_text(m.shape));
  detail::require(m.dtype.kind != NpyKind::float_, mname, ": attention mask must be bool or integer, got ",
                  m.dtype.descr());
  // The mask's values are checked as for verl's in-memory batch (batch_formats.hpp): 0 or 1, else an error
  // naming the position and the value.
  ArrayRef mref;
  mref.data = m.data.data();
  mref.kind = m.dtype.kind == NpyKind::uint_ ? ElemKind::uint_ : ElemKind::int_;
  mref.bits = m.dtype.item_bytes * 8;
  mref.shape = m.shape;
  mref.strides = m.strides_elements();
  r.mask.reserve(static_cast<std::size_t>(tokens));
  for (std::int64_t b = 0; b < m.shape[0]; ++b) {
    const std::vector<std::uint8_t> row =
        detail::mask_values(mref, b * mref.strides[0], mref.strides[1], m.shape[1], [&](std::int64_t s) {
          return detail::concat(mname, ": attention mask [", b, ", ", s, "]");
        });
    r.mask.insert(r.mask.end(), row.begin(), row.end());
  }
  return r;
}

/// `read_verl` of two files; an empty `mask_path` means no mask.
[[nodiscard]] inline RoutedRecord read_verl(const std::filesystem::path &ids_path,
                                            const std::filesystem::path &mask_path) {
  return read_verl(TraceInput(ids_path), mask_path.empty() ? std::nullopt : std::optional<TraceInput>(mask_path));
}

namespace detail {
inline const bool verl_trace_format_registered =
    (register_trace_format(
         {"verl",
          "routed_experts [batch, seq, L, K] (C order) as NPY; --mask FILE.npy is the attention\n"
          "mask [batch, seq] (bool/int 0/1, 0 = padding; verl pads on the left): masked tokens are not\n"
          "counted. Tokens run row by row (t = b * seq + s); offsets index that stream.",
          "a 4-D NPY", 20, true, false, false,
          [](const TraceProbe &p) {
            const auto *shape = p.npy_shape();
            return shape != nullptr && shape->size() == 4 ? 50 : 0;
          },
          [](const TraceInput &in, const TraceReadOptions &o) { return read_verl(in, o.mask); }}),
     true);
} // namespace detail

} // namespace v0
} // namespace foremoe
