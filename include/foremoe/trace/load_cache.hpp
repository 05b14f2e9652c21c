#pragma once
/// @file
/// A cache on disk of generated loads, so that repeated simulations of one batch generate it once.
///
/// The synthetic generator is deterministic: its loads are a function of its inputs (every `SyntheticConfig`
/// field, the workload, the EP grouping) and of `synthetic_stream_version`. `foremoe simulate` and
/// `foremoe.simulate` spend nearly all their time generating (the default job: seconds of generation, under a
/// second of simulation), so they keep each batch's loads in a cache directory keyed by those inputs, and a call
/// with the same batch and any other strategies, cost model or planner options reads them back in milliseconds.
///
/// An entry is one file, `loads-<16 hex digits of the key's hash>.bin`: a text line with the format and the full
/// key (compared in full, so a hash collision is a miss), the dimensions, the step offsets, the totals and the
/// per-source split (int64, this machine's byte order, recorded in the header), and an FNV-1a checksum of all of
/// it. Anything that does not match (another key, another version or byte order, a short or corrupted file) is a
/// miss, never an error: the loads are generated again and the entry rewritten. Entries are written to a temporary
/// file and renamed into place, so concurrent runs never see half an entry. Entries above `max_entry_bytes` are
/// not cached. Nothing is ever deleted by the cache; removing the directory is always safe.

#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/files.hpp"
#include "foremoe/core/load_tensor.hpp"

namespace foremoe {
inline namespace v0 {

namespace detail {
inline constexpr std::uint64_t fnv1a_basis = 0xcbf29ce484222325ULL;
/// 64-bit FNV-1a of `n` bytes at `p`, continuing from `h`: the checksum of cache entries and packed loads.
[[nodiscard]] inline std::uint64_t fnv1a(const void *p, std::size_t n, std::uint64_t h = fnv1a_basis) noexcept {
  const auto *b = static_cast<const unsigned char *>(p);
  for (std::size_t i = 0; i < n; ++i)
    h = (h ^ b[i]) * 0x100000001b3ULL;
  return h;
}
} // namespace detail

/// Generated loads as a cache entry holds them.
struct CachedLoads {
  LoadTensor loads;
  std::vector<std::int64_t> step_offsets;
};

/// A directory of generated loads (see the file comment). A default-constructed cache is off.
class LoadCache {
public:
  /// Format of an entry; a change of layout gets a new number (old entries are then misses).
  static constexpr int format_version = 1;
  /// Largest entry written (loads plus header), in bytes.
  static constexpr std::int64_t max_entry_bytes = std::int64_t{1} << 30;

  LoadCache() = default;
  explicit LoadCache(std::filesystem::path dir) : dir_(std::move(dir)) {}

  /// The cache a setting names: "off" (none), "auto" (`$FOREMOE_CACHE_DIR` if set, where "off" also turns it
  /// off; else `$XDG_CACHE_HOME/foremoe`; else `$HOME/.cache/foremoe`; else none) or a directory. Throws `Error`
  /// for an empty setting.
  [[nodiscard]] static LoadCache from_setting(std::string_view setting) {
    detail::require(!setting.empty(), "load cache: the setting is empty (expected auto, off or a directory)");
    if (setting == "off") return {};
    if (setting != "auto") return LoadCache(std::filesystem::path(setting));
    if (const char *dir = std::getenv("FOREMOE_CACHE_DIR"); dir != nullptr && *dir != '\0')
      return std::string_view(dir) == "off" ? LoadCache() : LoadCache(dir);
    if (const char *xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0')
      return LoadCache(std::filesystem::path(xdg) / "foremoe");
    if (const char *home = std::getenv("HOME"); home != nullptr && *home != '\0')
      return LoadCache(std::filesystem::path(home) / ".cache" / "foremoe");
    return {};
  }

  [[nodiscard]] bool enabled() const noexcept { return !dir_.empty(); }
  [[nodiscard]] const std::filesystem::path &dir() const noexcept { return dir_; }

  /// The file of `key`'s entry.
  [[nodiscard]] std::filesystem::path file_of(std::string_view key) const {
    static constexpr char hex[] = "0123456789abcdef";
    std::uint64_t h = detail::fnv1a(key.data(), key.size());
    std::string name = "loads-";
    for (int i = 15; i >= 0; --i)
      name += hex[(h >> (4 * i)) & 15u];
    return dir_ / (name + ".bin");
  }

  /// The entry of `key`, or nothing (cache off, no entry, or one that does not match in every byte). Never throws
  /// for the file's content; allocation failure still propagates.
  [[nodiscard]] std::optional<CachedLoads> read(std::string_view key) const {
    if (!enabled()) return std::nullopt;
    std::optional<files::OpenInput> opened;
    try {
      opened.emplace(files::open_input(file_of(key))); // a regular file only: a FIFO would block the read
    } catch (const Error &) {
      return std::nullopt;
    }
    std::FILE *in = opened->file.get();
    const auto read = [in](void *p, std::size_t n) { return n == 0 || std::fread(p, 1, n, in) == n; };
    const std::string line = header_line(key);
    std::string head(line.size() + 1, '\0');
    if (!read(head.data(), head.size()) || head != line + '\n') return std::nullopt;
    std::int64_t dims[5] = {}; // M, L, E, S, number of step offsets
    if (!read(dims, sizeof dims)) return std::nullopt;
    const std::int64_t m = dims[0], l = dims[1], e = dims[2], s = dims[3], ns = dims[4];
    const std::int64_t limit = std::int64_t{1} << 30;
    if (m < 0 || m > limit || l <= 0 || l > limit || e <= 0 || e > limit || s < 0 || s > limit || ns < 0 || ns > limit)
      return std::nullopt;
    if (static_cast<double>(m) * static_cast<double>(l) * static_cast<double>(e) * static_cast<double>(s + 1) * 8.0 >
        static_cast<double>(max_entry_bytes))
      return std::nullopt;
    CachedLoads out{LoadTensor(static_cast<int>(m), static_cast<int>(l), static_cast<int>(e), static_cast<int>(s)),
                    std::vector<std::int64_t>(static_cast<std::size_t>(ns))};
    std::uint64_t sum = detail::fnv1a(dims, sizeof dims, detail::fnv1a(line.data(), line.size()));
    const auto get = [&](void *p, std::size_t n) {
      if (!read(p, n)) return false;
      sum = detail::fnv1a(p, n, sum);
      return true;
    };
    if (!get(out.step_offsets.data(), out.step_offsets.size() * 8) ||
        !get(out.loads.totals().data(), out.loads.totals().size() * 8) ||
        !get(out.loads.by_source().data(), out.loads.by_source().size() * 8))
      return std::nullopt;
    std::uint64_t stored = 0;
    if (!read(&stored, sizeof stored) || stored != sum || std::fgetc(in) != EOF) return std::nullopt;
    try {
      out.loads.validate();
    } catch (const Error &) {
      return std::nullopt;
    }
    return out;
  }

  /// What `write` did: the entry is in place, or why not (a cache that cannot be written is no error).
  enum class Write { written, disabled, too_large, failed };

  /// Stores `loads` as `key`'s entry unless the cache is off or the entry is larger than `max_entry_bytes`. Never
  /// leaves a partial entry in place.
  Write write(std::string_view key, const LoadTensor &loads, const std::vector<std::int64_t> &step_offsets) const {
    if (!enabled()) return Write::disabled;
    const double bytes = (static_cast<double>(loads.totals().size()) + static_cast<double>(loads.by_source().size()) +
                          static_cast<double>(step_offsets.size())) *
                         8.0;
    if (bytes > static_cast<double>(max_entry_bytes)) return Write::too_large;
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (ec) return Write::failed;
    const std::filesystem::path target = file_of(key);
    // A cache entry is a regular file or nothing: a special file in its place is left alone (written through, a
    // FIFO would block).
    if (std::filesystem::exists(target, ec) && !std::filesystem::is_regular_file(target, ec)) return Write::failed;
    try {
      files::write_file(target, [&](std::FILE *out) {
        const std::string line = header_line(key) + '\n';
        const std::int64_t dims[5] = {loads.num_micro_steps(), loads.num_layers(), loads.num_experts(),
                                      loads.num_sources(), static_cast<std::int64_t>(step_offsets.size())};
        std::uint64_t sum = detail::fnv1a(dims, sizeof dims, detail::fnv1a(line.data(), line.size() - 1));
        files::OutputSet::write_bytes(out, line.data(), line.size());
        files::OutputSet::write_bytes(out, dims, sizeof dims);
        const auto put = [&](const std::int64_t *p, std::size_t n) {
          files::OutputSet::write_bytes(out, p, n * 8);
          if (n > 0) sum = detail::fnv1a(p, n * 8, sum);
        };
        put(step_offsets.data(), step_offsets.size());
        put(loads.totals().data(), loads.totals().size());
        put(loads.by_source().data(), loads.by_source().size());
        files::OutputSet::write_bytes(out, &sum, sizeof sum);
      });
    } catch (const Error &) {
      return Write::failed; // staged and renamed: a failed write leaves no partial entry
    }
    return Write::written;
  }

private:
  [[nodiscard]] static std::string header_line(std::string_view key) {
    std::string line = "foremoe-load-cache " + std::to_string(format_version) +
                       (std::endian::native == std::endian::little ? " little " : " big ");
    line += key;
    for (char &c : line) // the key is one line
      if (c == '\n') c = ' ';
    return line;
  }

  std::filesystem::path dir_;
};

} // namespace v0
} // namespace foremoe
