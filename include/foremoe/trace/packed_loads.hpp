#pragma once
/// @file
/// Generated loads packed small enough to ship inside a program: the default batch's loads are built into
/// `foremoe` and the Python extension this way, so that the main job's first run does not wait for the generator.
///
/// A packed entry is a text line `foremoe-packed-loads <version>`, the key's length and the key (the load cache's,
/// compared in full), then unsigned LEB128 varints: the dimensions (M, L, E, S, number of step offsets), the step
/// offsets, and every load in `totals()` then `by_source()` order as the zigzag-coded difference from the same
/// value one micro-step earlier (micro-step loads swing, but less than they are large: 0.44 MB for the default
/// batch's 1.6 MB of int64 loads), then the FNV-1a hash of everything before it as 8 little-endian bytes. Nothing
/// in it depends on the machine's byte order or word size.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/load_tensor.hpp"
#include "foremoe/trace/load_cache.hpp"

namespace foremoe {
inline namespace v0 {

/// Version of the packed layout; a change gets a new number (old entries then never match).
inline constexpr int packed_loads_version = 1;

namespace detail {

inline void put_varint(std::string &out, std::uint64_t v) { // unsigned LEB128
  while (v >= 0x80) {
    out += static_cast<char>(static_cast<unsigned char>(v) | 0x80u);
    v >>= 7;
  }
  out += static_cast<char>(v);
}

/// The magic line, then the key's length as a varint and the key itself (compared byte for byte: any key).
[[nodiscard]] inline std::string packed_header(std::string_view key) {
  std::string header = "foremoe-packed-loads " + std::to_string(packed_loads_version) + "\n";
  put_varint(header, key.size());
  header += key;
  return header;
}

/// Reads varints from a byte range; any overrun or over-long varint marks it failed (and reads 0 from then on).
class VarintReader {
public:
  explicit VarintReader(std::span<const unsigned char> bytes) noexcept : bytes_(bytes) {}
  [[nodiscard]] std::uint64_t next() noexcept {
    std::uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= bytes_.size()) break;
      const unsigned char b = bytes_[pos_++];
      v |= static_cast<std::uint64_t>(b & 0x7fu) << shift;
      if ((b & 0x80u) == 0) return v;
    }
    failed_ = true;
    pos_ = bytes_.size();
    return 0;
  }
  [[nodiscard]] bool failed() const noexcept { return failed_; }
  [[nodiscard]] std::size_t position() const noexcept { return pos_; }

private:
  std::span<const unsigned char> bytes_;
  std::size_t pos_ = 0;
  bool failed_ = false;
};

} // namespace detail

/// Packs `loads` and their `step_offsets` as `key`'s entry (see the file comment).
[[nodiscard]] inline std::string pack_loads(std::string_view key, const LoadTensor &loads,
                                            const std::vector<std::int64_t> &step_offsets) {
  std::string out = detail::packed_header(key);
  for (const std::int64_t d :
       {static_cast<std::int64_t>(loads.num_micro_steps()), static_cast<std::int64_t>(loads.num_layers()),
        static_cast<std::int64_t>(loads.num_experts()), static_cast<std::int64_t>(loads.num_sources()),
        static_cast<std::int64_t>(step_offsets.size())})
    detail::put_varint(out, static_cast<std::uint64_t>(d));
  std::uint64_t prev = 0;
  for (const std::int64_t s : step_offsets) {
    detail::put_varint(out, static_cast<std::uint64_t>(s) - prev);
    prev = static_cast<std::uint64_t>(s);
  }
  const auto put_deltas = [&out](std::span<const std::int64_t> v, std::size_t stride) {
    for (std::size_t i = 0; i < v.size(); ++i) {
      // In unsigned arithmetic, so that no input overflows; unpacking wraps back.
      const std::uint64_t d =
          static_cast<std::uint64_t>(v[i]) - static_cast<std::uint64_t>(i >= stride ? v[i - stride] : 0);
      detail::put_varint(out, (d << 1) ^ (0 - (d >> 63)));
    }
  };
  const std::size_t row = static_cast<std::size_t>(loads.num_layers()) * static_cast<std::size_t>(loads.num_experts());
  put_deltas(loads.totals(), row);
  put_deltas(loads.by_source(), row * static_cast<std::size_t>(loads.num_sources()));
  std::uint64_t h = detail::fnv1a(out.data(), out.size());
  for (int i = 0; i < 8; ++i, h >>= 8)
    out += static_cast<char>(static_cast<unsigned char>(h));
  return out;
}

/// The loads of a packed entry if it is `key`'s and intact, else nothing (another key or version, a damaged or
/// short entry, loads that fail `LoadTensor::validate`). Never throws for the bytes' content.
[[nodiscard]] inline std::optional<CachedLoads> unpack_loads(std::span<const unsigned char> bytes,
                                                             std::string_view key) {
  const std::string header = detail::packed_header(key);
  if (bytes.size() < header.size() + 8 ||
      std::string_view(reinterpret_cast<const char *>(bytes.data()), header.size()) != header)
    return std::nullopt;
  const std::size_t body_end = bytes.size() - 8;
  std::uint64_t stored = 0;
  for (int i = 7; i >= 0; --i)
    stored = stored << 8 | bytes[body_end + static_cast<std::size_t>(i)];
  if (stored != detail::fnv1a(bytes.data(), body_end)) return std::nullopt;

  detail::VarintReader in(bytes.subspan(header.size(), body_end - header.size()));
  std::uint64_t dims[5] = {}; // M, L, E, S, number of step offsets
  for (std::uint64_t &d : dims)
    d = in.next();
  const std::uint64_t limit = std::uint64_t{1} << 30;
  const std::uint64_t m = dims[0], l = dims[1], e = dims[2], s = dims[3], ns = dims[4];
  if (in.failed() || m > limit || l == 0 || l > limit || e == 0 || e > limit || s > limit || ns > limit)
    return std::nullopt;
  // Every value takes at least one byte, so a count beyond the bytes left is damage, not a huge allocation.
  const double values =
      static_cast<double>(m) * static_cast<double>(l) * static_cast<double>(e) * static_cast<double>(s + 1) +
      static_cast<double>(ns);
  if (values > static_cast<double>(body_end - header.size())) return std::nullopt;
  CachedLoads out{LoadTensor(static_cast<int>(m), static_cast<int>(l), static_cast<int>(e), static_cast<int>(s)),
                  std::vector<std::int64_t>(static_cast<std::size_t>(ns))};
  std::uint64_t offset = 0;
  for (std::int64_t &off : out.step_offsets)
    off = static_cast<std::int64_t>(offset += in.next());
  const auto get_deltas = [&in](std::span<std::int64_t> v, std::size_t stride) {
    for (std::size_t i = 0; i < v.size(); ++i) {
      const std::uint64_t z = in.next();
      const std::uint64_t d = (z >> 1) ^ (0 - (z & 1));
      v[i] = static_cast<std::int64_t>(d + static_cast<std::uint64_t>(i >= stride ? v[i - stride] : 0));
    }
  };
  const std::size_t row = static_cast<std::size_t>(l * e);
  get_deltas(out.loads.totals(), row);
  get_deltas(out.loads.by_source(), row * static_cast<std::size_t>(s));
  if (in.failed() || in.position() != body_end - header.size()) return std::nullopt;
  try {
    out.loads.validate();
  } catch (const Error &) {
    return std::nullopt;
  }
  return out;
}

} // namespace v0
} // namespace foremoe
