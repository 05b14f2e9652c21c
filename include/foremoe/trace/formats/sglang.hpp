#pragma once
/// @file
/// Format "sglang": SGLang's base64 `routed_experts` payloads in JSON lines.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/json.hpp"
#include "foremoe/trace/formats.hpp"

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

/// SGLang: JSON lines, one request per line, each an object whose `routed_experts` (at the top level or under
/// `meta_info`, as `/generate` returns it with `return_routed_experts`) is base64 of little-endian int32
/// `[tokens, num_layers, topk]` in C order. Requests are concatenated in input order; `request_offsets` gives
/// their token ranges. Blank lines are skipped; messages name the line as `path:line`.
[[nodiscard]] inline RoutedRecord read_sglang(const TraceInput &in, int num_layers, int topk) {
  detail::require(num_layers > 0, "read_sglang: num_layers must be positive, got ", num_layers);
  detail::require(topk > 0, "read_sglang: topk must be positive, got ", topk);
  const std::string text = in.text();
  RoutedRecord r;
  r.request_offsets.push_back(0);
  const std::size_t per_token = static_cast<std::size_t>(num_layers) * topk;
  std::int64_t lineno = 0;
  for (std::size_t begin = 0; begin < text.size();) {
    const std::size_t end = std::min(text.find('\n', begin), text.size());
    const std::string_view line(text.data() + begin, end - begin);
    begin = end + 1;
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    const std::string where = in.path.string() + ":" + std::to_string(lineno);
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
  detail::require(r.request_offsets.size() > 1, in.path.string(), ": no request (no JSON line)");
  r.view = RoutedView(std::span<const std::int32_t>(r.ids), static_cast<std::int64_t>(r.ids.size() / per_token),
                      num_layers, topk);
  return r;
}

namespace detail {
inline const bool sglang_trace_format_registered =
    (register_trace_format(
         {"sglang",
          "JSON lines, one request per line, each with routed_experts (top level or under meta_info)\n"
          "= base64 of little-endian int32 [tokens, layers, topk]; give --layers and --topk.\n"
          "Requests are concatenated in file order; malformed base64 is an error naming the line.",
          ".jsonl, .json or .ndjson", 30, false, true, false,
          [](const TraceProbe &p) {
            const std::string e = p.extension();
            return e == ".jsonl" || e == ".json" || e == ".ndjson" ? 100 : 0;
          },
          [](const TraceInput &in, const TraceReadOptions &o) { return read_sglang(in, o.num_layers, o.topk); }}),
     true);
} // namespace detail

} // namespace v0
} // namespace foremoe
