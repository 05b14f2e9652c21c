#pragma once
/// @file
/// Readers for the routed-id records of trainers and inference engines: verl's padded
/// `routed_experts [bs, seq, L, K]` with its attention mask, SGLang's base64 `routed_experts` payloads in
/// JSON lines, and Megatron-core's router-replay record `[L, T, K]`. Each gives a `RoutedView` (and a mask)
/// for `count_loads`.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include "foremoe/config/json.hpp"
#include "foremoe/core/error.hpp"
#include "foremoe/trace/io.hpp"
#include "foremoe/trace/routed_view.hpp"

namespace foremoe {
inline namespace v0 {

/// Decodes standard base64 (RFC 4648 alphabet, `=` padding optional). Throws `Error` naming `what` and the
/// offending position for a character outside the alphabet or an impossible length.
[[nodiscard]] inline std::vector<std::byte> decode_base64(std::string_view s, std::string_view what = "base64") {
  static constexpr auto table = [] {
    std::array<std::int8_t, 256> t{};
    t.fill(-1);
    const char *abc = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int i = 0; i < 64; ++i)
      t[static_cast<unsigned char>(abc[i])] = static_cast<std::int8_t>(i);
    return t;
  }();
  std::size_t n = s.size();
  while (n > 0 && s[n - 1] == '=' && s.size() - n < 2)
    --n;
  detail::require(n % 4 != 1, what, ": malformed base64: ", s.size(), " characters is not a valid length");
  std::vector<std::byte> out;
  out.reserve(n / 4 * 3 + 2);
  std::uint32_t acc = 0;
  int bits = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::int8_t v = table[static_cast<unsigned char>(s[i])];
    if (v < 0) {
      const unsigned c = static_cast<unsigned char>(s[i]);
      detail::fail(what, ": malformed base64: character ",
                   c < 32 || c > 126 ? std::string("\\x") + std::to_string(c) : std::string(1, s[i]), " at position ",
                   i, " is not in the base64 alphabet");
    }
    acc = (acc << 6) | static_cast<std::uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<std::byte>((acc >> bits) & 0xFFu));
    }
  }
  return out;
}

/// Routed ids gathered from a reader: owning storage, the view `count_loads` reads, and the per-token mask
/// (empty: every token counts).
struct RoutedRecord {
  NpyArray array;                            ///< owning storage when read from an NPY file
  std::vector<std::int32_t> ids;             ///< owning storage when decoded (SGLang)
  RoutedView view;                           ///< `[tokens, layers, topk]` over `array` or `ids`
  std::vector<std::uint8_t> mask;            ///< `[tokens]`, 0 = padding; empty when none
  std::vector<std::int64_t> request_offsets; ///< SGLang: `[requests + 1]` token offsets of the JSON lines
};

namespace detail {
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
/// Reads a mask NPY, accepting NumPy's bool (`|b1`, one byte 0/1) as uint8: the NPY reader refuses bool for
/// loads and ids, where it would be a mistake, but a mask is naturally bool.
[[nodiscard]] inline NpyArray read_mask_npy(const std::filesystem::path &path) {
  std::ifstream in(path, std::ios::binary);
  require(in.good(), path.string(), ": cannot open");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::size_t head = std::min<std::size_t>(bytes.size(), 4096);
  if (const auto at = std::string_view(bytes.data(), head).find("'|b1'"); at != std::string_view::npos)
    bytes[at + 2] = 'u';
  return parse_npy(std::span<const std::byte>(reinterpret_cast<const std::byte *>(bytes.data()), bytes.size()));
}
} // namespace detail

/// verl: `routed_experts [bs, seq, L, K]` (C order) and its attention mask `[bs, seq]` (bool or integer,
/// nonzero = real token; verl pads prompts on the left, so padding sits at the start of each row). Tokens are
/// taken row by row (`t = b * seq + s`); masked positions are not counted. `mask_path` may be empty (every
/// position counts).
[[nodiscard]] inline RoutedRecord read_verl(const std::filesystem::path &ids_path,
                                            const std::filesystem::path &mask_path) {
  RoutedRecord r;
  r.array = read_npy(ids_path);
  const NpyArray &a = r.array;
  detail::require(a.shape.size() == 4, ids_path.string(),
                  ": verl routed_experts must be [batch, seq, layers, topk], got shape ", detail::shape_text(a.shape));
  detail::require(!a.fortran_order || a.shape[0] * a.shape[1] <= 1 || a.shape[2] * a.shape[3] <= 1, ids_path.string(),
                  ": verl routed_experts must be C-ordered (save np.ascontiguousarray)");
  detail::require_int_dim(a.shape[2], ids_path, "layers");
  detail::require_int_dim(a.shape[3], ids_path, "topk");
  const IdDtype dt = detail::npy_id_dtype(a, ids_path);
  const std::int64_t tokens = a.shape[0] * a.shape[1];
  r.view = RoutedView(a.data.data(), dt, tokens, static_cast<int>(a.shape[2]), static_cast<int>(a.shape[3]));
  if (mask_path.empty()) return r;
  const NpyArray m = detail::read_mask_npy(mask_path);
  detail::require(m.shape.size() == 2 && m.shape[0] == a.shape[0] && m.shape[1] == a.shape[1], mask_path.string(),
                  ": attention mask must be [", a.shape[0], ", ", a.shape[1], "] to match ", ids_path.string(),
                  ", got shape ", detail::shape_text(m.shape));
  detail::require(m.dtype.kind != NpyKind::float_, mask_path.string(), ": attention mask must be bool or integer, got ",
                  m.dtype.descr());
  const auto st = m.strides_elements();
  r.mask.resize(static_cast<std::size_t>(tokens));
  const std::size_t w = static_cast<std::size_t>(m.dtype.item_bytes);
  for (std::int64_t b = 0; b < m.shape[0]; ++b)
    for (std::int64_t s = 0; s < m.shape[1]; ++s) {
      const std::byte *p = m.data.data() + static_cast<std::size_t>(b * st[0] + s * st[1]) * w;
      bool nz = false;
      for (std::size_t i = 0; i < w; ++i)
        nz = nz || p[i] != std::byte{0};
      r.mask[static_cast<std::size_t>(b * m.shape[1] + s)] = nz ? 1 : 0;
    }
  return r;
}

/// SGLang: JSON lines, one request per line, each an object whose `routed_experts` (at the top level or under
/// `meta_info`, as `/generate` returns it with `return_routed_experts`) is base64 of little-endian int32
/// `[tokens, num_layers, topk]` in C order. Requests are concatenated in file order; `request_offsets` gives
/// their token ranges. Blank lines are skipped.
[[nodiscard]] inline RoutedRecord read_sglang(const std::filesystem::path &path, int num_layers, int topk) {
  detail::require(num_layers > 0, "read_sglang: num_layers must be positive, got ", num_layers);
  detail::require(topk > 0, "read_sglang: topk must be positive, got ", topk);
  std::ifstream in(path, std::ios::binary);
  detail::require(in.good(), path.string(), ": cannot open");
  RoutedRecord r;
  r.request_offsets.push_back(0);
  const std::size_t per_token = static_cast<std::size_t>(num_layers) * topk;
  std::string line;
  std::int64_t lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path.string() + ":" + std::to_string(lineno);
    const json::Value doc = json::parse(line, where);
    const json::Value *v = doc.find("routed_experts");
    if (v == nullptr)
      if (const json::Value *meta = doc.find("meta_info")) v = meta->find("routed_experts");
    detail::require(v != nullptr, where, ": no routed_experts (top level or meta_info)");
    detail::require(v->is_string(), where, ": routed_experts must be a base64 string, got ",
                    json::kind_name(v->kind()));
    const std::vector<std::byte> bytes = decode_base64(v->as_string(), where + ": routed_experts");
    detail::require(bytes.size() % (4 * per_token) == 0, where, ": routed_experts holds ", bytes.size(),
                    " bytes, not a whole number of int32 [tokens, ", num_layers, ", ", topk, "] rows (", 4 * per_token,
                    " bytes per token); check --layers and --topk");
    const std::size_t n = bytes.size() / 4, at = r.ids.size();
    r.ids.resize(at + n);
    for (std::size_t i = 0; i < n; ++i) {
      const auto *b = reinterpret_cast<const unsigned char *>(bytes.data() + 4 * i);
      r.ids[at + i] = static_cast<std::int32_t>(std::uint32_t{b[0]} | std::uint32_t{b[1]} << 8 |
                                                std::uint32_t{b[2]} << 16 | std::uint32_t{b[3]} << 24);
    }
    r.request_offsets.push_back(static_cast<std::int64_t>(r.ids.size() / per_token));
  }
  detail::require(r.request_offsets.size() > 1, path.string(), ": no request (no JSON line)");
  r.view = RoutedView(std::span<const std::int32_t>(r.ids), static_cast<std::int64_t>(r.ids.size() / per_token),
                      num_layers, topk);
  return r;
}

/// Megatron-core router replay: `[num_moe_layers, tokens, topk]` integer ids, the per-layer
/// `RouterReplay.recorded_topk_idx` tensors (`[tokens, topk]`, one router instance per MoE layer in layer
/// order) stacked on a new leading axis and saved as NPY. Viewed as `[tokens, layers, topk]` without a copy.
[[nodiscard]] inline RoutedRecord read_megatron(const std::filesystem::path &path) {
  RoutedRecord r;
  r.array = read_npy(path);
  const NpyArray &a = r.array;
  detail::require(a.shape.size() == 3, path.string(),
                  ": Megatron router replay must be [layers, tokens, topk] (stacked recorded_topk_idx), got shape ",
                  detail::shape_text(a.shape));
  detail::require_int_dim(a.shape[0], path, "layers");
  detail::require_int_dim(a.shape[2], path, "topk");
  const auto st = a.strides_elements();
  r.view = RoutedView(a.data.data(), detail::npy_id_dtype(a, path), a.shape[1], static_cast<int>(a.shape[0]),
                      static_cast<int>(a.shape[2]), {st[1], st[0], st[2]});
  return r;
}

} // namespace v0
} // namespace foremoe
