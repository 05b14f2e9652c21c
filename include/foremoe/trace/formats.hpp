#pragma once
/// @file
/// Trainer input formats are a registry: each one is a file in `foremoe/trace/formats/` that registers a
/// `TraceFormat` (name, detection for `--format auto`, reader) when included, so `foremoe trace count`, the
/// count schema's `format` choices and Python's readers list none by hand. `formats/builtin.hpp` includes them all.

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <filesystem>
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
#include "foremoe/trace/io.hpp"
#include "foremoe/trace/npy.hpp"
#include "foremoe/trace/routed_view.hpp"

namespace foremoe {
inline namespace v0 {

/// Routed ids gathered from a reader: owning storage, the view `count_loads` reads, and the per-token mask
/// (empty: every token counts).
struct RoutedRecord {
  NpyArray array;                            ///< owning storage when read from an NPY file
  std::vector<std::int32_t> ids;             ///< owning storage when decoded (SGLang)
  RoutedView view;                           ///< `[tokens, layers, topk]` over `array` or `ids`
  std::vector<std::uint8_t> mask;            ///< `[tokens]`, 0 = padding; empty when none
  std::vector<std::int64_t> request_offsets; ///< SGLang: `[requests + 1]` token offsets of the JSON lines
};

/// One input of a reader: a file, or its content already in memory (Python's arrays and request lists), in
/// which case `path` only names it in messages.
struct TraceInput {
  std::filesystem::path path;
  std::optional<std::span<const std::byte>> bytes; ///< the content; none: read `path`

  TraceInput() = default;
  TraceInput(std::filesystem::path file)
      : path(std::move(file)) {} // NOLINT(google-explicit-constructor): a path is an input
  TraceInput(std::filesystem::path name, std::span<const std::byte> content) : path(std::move(name)), bytes(content) {}

  /// The whole content (the file's, or a copy of `bytes`); throws `Error` naming the path when it cannot be read.
  [[nodiscard]] std::string text() const {
    if (bytes) return {reinterpret_cast<const char *>(bytes->data()), bytes->size()};
    return read_text(path, std::numeric_limits<std::uint64_t>::max(), "a trace"); // a regular file's own size
  }
  /// The content as an NPY array; errors name the path.
  [[nodiscard]] NpyArray npy() const {
    if (!bytes) return read_npy(path);
    try {
      return parse_npy(*bytes);
    } catch (const Error &e) {
      detail::fail(path.string(), ": ", e.what());
    }
  }
};

/// What a reader may take besides its input; each format says which it reads (`TraceFormat::takes_mask`,
/// `needs_shape`).
struct TraceReadOptions {
  std::optional<TraceInput> mask; ///< per-token mask (verl's attention mask)
  int num_layers = 0, topk = 0;   ///< the payload's shape where the file does not carry it (SGLang)
};

/// What `--format auto` looks at: the file name and, for an NPY file, its header (read once, on first use).
class TraceProbe {
public:
  explicit TraceProbe(std::filesystem::path path) : path_(std::move(path)) {}

  [[nodiscard]] const std::filesystem::path &path() const noexcept { return path_; }
  /// The extension, lower case, with its dot (".jsonl").
  [[nodiscard]] std::string extension() const {
    std::string e = path_.extension().string();
    std::transform(e.begin(), e.end(), e.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    return e;
  }
  /// The NPY header's shape, or null when the file is not a readable NPY file (its reader then says why).
  [[nodiscard]] const std::vector<std::int64_t> *npy_shape() const {
    if (!probed_) {
      probed_ = true;
      shape_ = read_shape();
    }
    return shape_ ? &*shape_ : nullptr;
  }

private:
  [[nodiscard]] std::optional<std::vector<std::int64_t>> read_shape() const {
    try {
      return detail::npy_read_file_header(path_, NpyReadLimits{}).shape;
    } catch (const Error &) {
      return std::nullopt;
    }
  }

  std::filesystem::path path_;
  mutable bool probed_ = false;
  mutable std::optional<std::vector<std::int64_t>> shape_;
};

/// One input format as registered.
struct TraceFormat {
  std::string name;            ///< as in `--format`, e.g. "verl"
  std::string help;            ///< what the file holds; lines of at most ~100 characters, for `trace count --help`
  std::string detects;         ///< when `--format auto` picks it, e.g. "a 4-D NPY"; empty: only when named
  int order = 100;             ///< listing order (built-ins 10, 20, ...), ties by name
  bool takes_mask = false;     ///< reads `TraceReadOptions::mask`
  bool needs_shape = false;    ///< needs `TraceReadOptions::num_layers` and `topk`
  bool reads_sidecars = false; ///< FILE.microbatches/.sources/.steps.npy belong to the file (`trace gen --ids`)
  /// How sure `--format auto` is that the file is this format: 0 not at all; the highest wins (ties by order).
  std::function<int(const TraceProbe &)> detect;
  std::function<RoutedRecord(const TraceInput &, const TraceReadOptions &)> read;
};

namespace detail {

/// Function-local, so registration from any translation unit's static initialisers finds it constructed;
/// entries never move (the registry hands out pointers).
struct TraceFormatRegistry {
  std::mutex mutex;
  std::vector<std::unique_ptr<const TraceFormat>> by_order;
};
inline TraceFormatRegistry &trace_format_registry() {
  static TraceFormatRegistry registry;
  return registry;
}

} // namespace detail

/// Adds a format; throws `Error` on an empty, "auto" or duplicate name, a name with characters other than
/// `a-z`, `0-9` and `-`, or no reader or detection.
inline void register_trace_format(TraceFormat format) {
  const std::string &n = format.name;
  detail::require(!n.empty() && n != "auto", "register_trace_format: bad format name '", n, "'");
  detail::require(std::all_of(n.begin(), n.end(),
                              [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-'; }),
                  "register_trace_format: format name '", n, "' may hold only a-z, 0-9 and '-'");
  detail::require(format.read && format.detect, "register_trace_format: format '", n, "' needs read and detect");
  auto &reg = detail::trace_format_registry();
  const std::lock_guard hold(reg.mutex);
  auto &v = reg.by_order;
  detail::require(std::none_of(v.begin(), v.end(), [&](const auto &f) { return f->name == n; }),
                  "register_trace_format: format '", n, "' is already registered");
  const auto before = std::find_if(v.begin(), v.end(), [&](const auto &f) {
    return format.order < f->order || (format.order == f->order && n < f->name);
  });
  v.insert(before, std::make_unique<const TraceFormat>(std::move(format)));
}

/// Every registered format in listing order.
[[nodiscard]] inline std::vector<const TraceFormat *> trace_formats() {
  auto &reg = detail::trace_format_registry();
  const std::lock_guard hold(reg.mutex);
  std::vector<const TraceFormat *> out(reg.by_order.size());
  std::transform(reg.by_order.begin(), reg.by_order.end(), out.begin(), [](const auto &f) { return f.get(); });
  return out;
}

/// The registered names in listing order, joined by `sep`.
[[nodiscard]] inline std::string trace_format_names(std::string_view sep = ", ") {
  std::string out;
  for (const TraceFormat *f : trace_formats())
    out.append(out.empty() ? "" : sep).append(f->name);
  return out;
}

/// The format named `name`; throws `Error` naming the value and the registered names when there is none.
[[nodiscard]] inline const TraceFormat &find_trace_format(std::string_view name) {
  for (const TraceFormat *f : trace_formats())
    if (f->name == name) return *f;
  detail::fail("unknown trace format '", name, "' (registered: ", trace_format_names(), ")");
}

/// The format `--format auto` reads `path` as: the most confident detection, ties to the earlier listed;
/// throws `Error` naming the file when no format claims it.
[[nodiscard]] inline const TraceFormat &detect_trace_format(const std::filesystem::path &path) {
  const TraceProbe probe(path);
  const TraceFormat *best = nullptr;
  int best_score = 0;
  for (const TraceFormat *f : trace_formats())
    if (const int s = f->detect(probe); s > best_score) {
      best = f;
      best_score = s;
    }
  detail::require(best != nullptr, path.string(), ": no trace format recognises the file (give one of ",
                  trace_format_names(), ")");
  return *best;
}

/// `name`, or the detected format when `name` is "auto"; checks the options against what the format reads, so a
/// mask or shape the format would ignore is an error rather than silently dropped.
[[nodiscard]] inline const TraceFormat &resolve_trace_format(const std::filesystem::path &path, std::string_view name,
                                                             const TraceReadOptions &opts) {
  const TraceFormat &f = name == "auto" ? detect_trace_format(path) : find_trace_format(name);
  detail::require(!opts.mask || f.takes_mask, "a mask is for a format that takes one (", path.string(), " is read as ",
                  f.name, ")");
  detail::require(!f.needs_shape || (opts.num_layers > 0 && opts.topk > 0), "format ", f.name,
                  " needs the payload's layers and topk (positive), got ", opts.num_layers, " and ", opts.topk);
  return f;
}

/// Reads `input` as format `name` ("auto": detected from `input.path`).
[[nodiscard]] inline RoutedRecord read_trace(const TraceInput &input, std::string_view name,
                                             const TraceReadOptions &opts = {}) {
  return resolve_trace_format(input.path, name, opts).read(input, opts);
}

} // namespace v0
} // namespace foremoe
