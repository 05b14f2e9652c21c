#pragma once
/// @file
/// Files as every front end reads and writes them.
///
/// Inputs: a path must name a regular file. The file is opened without blocking (opening a FIFO for reading
/// would wait for a writer) and its kind is checked on the open descriptor, so a FIFO, a device such as
/// `/dev/zero` or a folder is refused by name before a byte is read, and what is read is what was checked.
/// Whole-file reads are bounded by a size the caller gives (what its format allows).
///
/// Outputs: `OutputSet` writes each output to a temporary file beside its target and renames them all into place
/// only once every one has been written, so a failing command leaves no complete-looking output behind and
/// readers never see a partial file. A target that exists and is not a regular file (a terminal, `/dev/null`,
/// `/dev/stdout`, a pipe) is written in place, never replaced by a rename; a folder is refused. `same_file`
/// tells a command that an output names one of its inputs.

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#if __has_include(<fcntl.h>) && __has_include(<sys/stat.h>) && __has_include(<unistd.h>)
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#define FOREMOE_FILES_POSIX 1
#else
#define FOREMOE_FILES_POSIX 0
#endif

#include "foremoe/core/error.hpp"

namespace foremoe {
inline namespace v0 {
namespace files {

/// Closes a `std::FILE` (the deleter of `File`).
struct FileCloser {
  void operator()(std::FILE *f) const noexcept {
    if (f != nullptr) std::fclose(f);
  }
};
/// An owned `std::FILE`.
using File = std::unique_ptr<std::FILE, FileCloser>;

/// The largest JSON document (config, placement) the readers take: 256 MiB. A placement of 61 layers on
/// 1,024 GPUs x 16 slots is about 5 MB.
inline constexpr std::uint64_t max_document_bytes = std::uint64_t{256} << 20;

namespace detail {

#if FOREMOE_FILES_POSIX
/// "a folder", "a FIFO", ... for a `st_mode`.
[[nodiscard]] inline const char *kind_text(mode_t m) noexcept {
  if (S_ISDIR(m)) return "a folder";
  if (S_ISFIFO(m)) return "a FIFO (named pipe)";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}
#endif

} // namespace detail

/// An input opened for reading: the stream and the file's size at open.
struct OpenInput {
  File file;
  std::uint64_t size = 0;
};

/// Opens `path` for reading if it names a regular file (links followed); throws `Error` naming the path and what
/// it is otherwise ("is a folder", "is a FIFO (named pipe), not a regular file", "cannot open: No such file ...").
[[nodiscard]] inline OpenInput open_input(const std::filesystem::path &path) {
#if FOREMOE_FILES_POSIX
  errno = 0;
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC); // NOLINT(cppcoreguidelines-pro-type-vararg)
  if (fd < 0) {
    const int e = errno;
    if (e == EISDIR) foremoe::detail::fail(path.string(), ": is a folder, not a file");
    foremoe::detail::fail(path.string(), ": cannot open: ", std::strerror(e));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    foremoe::detail::fail(path.string(), ": cannot stat: ", std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    if (S_ISDIR(st.st_mode)) foremoe::detail::fail(path.string(), ": is a folder, not a file");
    foremoe::detail::fail(path.string(), ": is ", detail::kind_text(st.st_mode), ", not a regular file");
  }
  // Back to blocking reads: the non-blocking open was only for the check.
  const int flags = ::fcntl(fd, F_GETFL);                          // NOLINT(cppcoreguidelines-pro-type-vararg)
  if (flags >= 0) (void)::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK); // NOLINT(cppcoreguidelines-pro-type-vararg)
  File f{::fdopen(fd, "rb")};
  if (!f) {
    const int e = errno;
    ::close(fd);
    foremoe::detail::fail(path.string(), ": cannot open: ", std::strerror(e));
  }
  return {std::move(f), static_cast<std::uint64_t>(st.st_size)};
#else
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (std::filesystem::is_directory(status)) foremoe::detail::fail(path.string(), ": is a folder, not a file");
  if (std::filesystem::exists(status) && !std::filesystem::is_regular_file(status))
    foremoe::detail::fail(path.string(), ": is not a regular file");
  errno = 0;
  File f{std::fopen(path.string().c_str(), "rb")};
  if (!f) foremoe::detail::fail(path.string(), ": cannot open: ", std::strerror(errno));
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) foremoe::detail::fail(path.string(), ": cannot get the file size: ", ec.message());
  return {std::move(f), static_cast<std::uint64_t>(size)};
#endif
}

/// Reads the whole of `path` (a regular file, see `open_input`) if it holds at most `max_bytes`; `what` names
/// the kind of file in the size message ("a config file").
[[nodiscard]] inline std::string read_file(const std::filesystem::path &path, std::uint64_t max_bytes,
                                           std::string_view what = "an input") {
  OpenInput in = open_input(path);
  foremoe::detail::require(in.size <= max_bytes, path.string(), ": ", in.size, " bytes, more than the ", max_bytes, " ",
                           what, " may hold");
  std::string s(static_cast<std::size_t>(in.size), '\0');
  errno = 0;
  if (!s.empty() && std::fread(s.data(), 1, s.size(), in.file.get()) != s.size())
    foremoe::detail::fail(path.string(), ": read failed",
                          std::ferror(in.file.get()) ? std::string(": ") + std::strerror(errno) : ": the file shrank");
  foremoe::detail::require(std::fgetc(in.file.get()) == EOF, path.string(), ": the file grew while it was read");
  return s;
}

/// Whether `a` and `b` name the same file: the same existing file (links and `..` resolved, hard links too), or
/// the same path once resolved when either does not exist yet.
[[nodiscard]] inline bool same_file(const std::filesystem::path &a, const std::filesystem::path &b) {
  std::error_code ec;
  if (std::filesystem::exists(a, ec) && std::filesystem::exists(b, ec)) {
    const bool same = std::filesystem::equivalent(a, b, ec);
    if (!ec) return same;
  }
  std::error_code ea, eb;
  const auto ca = std::filesystem::weakly_canonical(a, ea), cb = std::filesystem::weakly_canonical(b, eb);
  return !ea && !eb && ca == cb;
}

/// A command's outputs, written together (see the file comment). `add` runs the writer at once, into a temporary
/// file beside the target or, for a target that exists and is not a regular file, into an anonymous spool file
/// copied to the target at commit, so that nothing a writer points to need outlive the `add`; `commit` writes the
/// spooled targets and renames every temporary file into place. Destroyed without a commit (an error on the way),
/// it removes its temporary files and the targets stay as they were.
class OutputSet {
public:
  using Writer = std::function<void(std::FILE *)>;

  OutputSet() = default;
  OutputSet(const OutputSet &) = delete;
  OutputSet &operator=(const OutputSet &) = delete;
  ~OutputSet() { discard(); }

  /// Stages `write` for `target`; errors (a folder, a folder that does not exist, a full disk) name the target.
  void add(const std::filesystem::path &target, const Writer &write) {
    std::filesystem::path path = target;
    std::error_code ec;
    if (std::filesystem::is_symlink(target, ec)) {
      // Write where the link points, keeping the link (a rename would replace it by a regular file).
      const auto resolved = std::filesystem::weakly_canonical(target, ec);
      if (!ec) path = resolved;
    }
    const auto status = std::filesystem::status(path, ec);
    if (std::filesystem::is_directory(status)) foremoe::detail::fail(target.string(), ": is a folder, not a file");
    if (std::filesystem::exists(status) && !std::filesystem::is_regular_file(status)) {
      try {
        errno = 0;
        File spool{std::tmpfile()};
        if (!spool) foremoe::detail::fail("cannot create a spool file: ", std::strerror(errno));
        write(spool.get());
        if (std::fflush(spool.get()) != 0) foremoe::detail::fail("cannot write a spool file: ", std::strerror(errno));
        entries_.push_back({target, path, {}, std::move(spool)});
      } catch (const Error &e) {
        foremoe::detail::fail(target.string(), ": ", e.what());
      }
      return;
    }
    std::filesystem::path tmp = path;
    tmp += ".tmp-" + std::to_string(unique_suffix());
    entries_.push_back({target, path, tmp, {}});
    try {
      errno = 0;
      File f{std::fopen(tmp.c_str(), "wb")};
      if (!f) foremoe::detail::fail("cannot create ", tmp.string(), ": ", std::strerror(errno));
      write(f.get());
      // Buffered write errors (a full disk) surface at the close, so it is checked.
      if (std::fclose(f.release()) != 0)
        foremoe::detail::fail("cannot write ", tmp.string(), ": ", std::strerror(errno));
    } catch (const Error &e) {
      foremoe::detail::fail(target.string(), ": ", e.what());
    }
  }

  /// Stages `text` for `target`.
  void add_text(const std::filesystem::path &target, std::string_view text) {
    add(target, [text](std::FILE *f) { write_bytes(f, text.data(), text.size()); });
  }

  /// Writes the in-place targets first (a device or a pipe can still fail: a full disk, a closed reader), then
  /// renames the temporary files into place, so that a failure leaves none of the renamed outputs behind.
  void commit() {
    for (Entry &e : entries_) {
      if (!e.tmp.empty()) continue;
      errno = 0;
      File f{std::fopen(e.path.c_str(), "wb")};
      if (!f) foremoe::detail::fail(e.target.string(), ": cannot open for writing: ", std::strerror(errno));
      std::rewind(e.spool.get());
      char buf[1 << 16];
      for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, e.spool.get())) > 0;)
        if (std::fwrite(buf, 1, n, f.get()) != n)
          foremoe::detail::fail(e.target.string(), ": write failed: ", std::strerror(errno));
      if (std::ferror(e.spool.get()) != 0) foremoe::detail::fail(e.target.string(), ": cannot read its spool file");
      if (std::fclose(f.release()) != 0)
        foremoe::detail::fail(e.target.string(), ": write failed: ", std::strerror(errno));
    }
    for (Entry &e : entries_) {
      if (e.tmp.empty()) continue;
      std::error_code ec;
      std::filesystem::rename(e.tmp, e.path, ec);
      if (ec)
        foremoe::detail::fail(e.target.string(), ": cannot rename ", e.tmp.string(), " into place: ", ec.message());
      e.tmp.clear();
    }
    entries_.clear();
  }

  /// Writes `n` bytes to `f` or throws `Error` (for writers).
  static void write_bytes(std::FILE *f, const void *data, std::size_t n) {
    errno = 0;
    if (n > 0 && std::fwrite(data, 1, n, f) != n) foremoe::detail::fail("write failed: ", std::strerror(errno));
  }

private:
  struct Entry {
    std::filesystem::path target; ///< as given (messages)
    std::filesystem::path path;   ///< where it is written (links resolved)
    std::filesystem::path tmp;    ///< the staged file; empty: `spool` is copied to the target at commit
    File spool;
  };

  void discard() noexcept {
    for (const Entry &e : entries_)
      if (!e.tmp.empty()) {
        std::error_code ignored;
        std::filesystem::remove(e.tmp, ignored);
      }
    entries_.clear();
  }

  static std::uint64_t unique_suffix() noexcept {
#if FOREMOE_FILES_POSIX
    const auto pid = static_cast<std::uint64_t>(::getpid());
#else
    const std::uint64_t pid = 0;
#endif
    static std::atomic<std::uint64_t> counter{0};
    const auto now = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    return (pid << 40) ^ now ^ ((counter.fetch_add(1) + 1) * 0x9e3779b97f4a7c15ull);
  }

  std::vector<Entry> entries_;
};

/// Writes one output (see `OutputSet`).
inline void write_file(const std::filesystem::path &target, const OutputSet::Writer &write) {
  OutputSet set;
  set.add(target, write);
  set.commit();
}

/// Writes `text` to `target` (see `OutputSet`).
inline void write_text(const std::filesystem::path &target, std::string_view text) {
  OutputSet set;
  set.add_text(target, text);
  set.commit();
}

} // namespace files
} // namespace v0
} // namespace foremoe
