// The node-shared host mirror (foremoe/runtime/node_mirror.hpp): a POSIX shared-memory segment, its header and
// the generation protocol. CUDA pinning goes through the device helpers (device/cuda_util.cpp), only in CUDA builds.

#include "foremoe/runtime/node_mirror.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <thread>
#include <utility>

#include "backends.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime {

namespace {

constexpr std::int64_t page_bytes = 4096;

/// The first bytes of the segment. The generation and the ready flag are shared between processes and accessed
/// atomically (`std::atomic_ref`); the other fields are written before the ready flag is set (release) and read
/// after it was seen set (acquire).
struct Header {
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t header_bytes;
  std::int64_t payload_bytes;
  std::uint64_t generation;
  std::uint32_t ready;
  std::uint32_t reserved;
};
static_assert(sizeof(Header) <= static_cast<std::size_t>(node_mirror_header_bytes));

Header &header_of(void *map) { return *static_cast<Header *>(map); }

std::atomic_ref<std::uint64_t> generation_of(void *map) { return std::atomic_ref(header_of(map).generation); }
std::atomic_ref<std::uint32_t> ready_of(void *map) { return std::atomic_ref(header_of(map).ready); }

Status invalid(std::string msg) { return {StatusCode::invalid_argument, "node mirror: " + std::move(msg)}; }

Status system_error(const std::string &what, const std::string &name, int err) {
  return {StatusCode::internal, "node mirror: " + what + " of " + name + " failed: " + std::strerror(err)};
}

std::string hex(std::uint64_t v, int num_digits = 16) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s = "0x";
  for (int shift = 4 * (num_digits - 1); shift >= 0; shift -= 4)
    s += digits[(v >> shift) & 0xF];
  return s;
}

/// Where a leftover segment can be removed by hand (Linux keeps POSIX shared memory under /dev/shm).
std::string remove_hint(const std::string &name) { return "remove /dev/shm" + name + " if no job uses it"; }

class Fd {
public:
  explicit Fd(int fd = -1) noexcept : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd &) = delete;
  Fd &operator=(const Fd &) = delete;
  [[nodiscard]] int get() const noexcept { return fd_; }

private:
  int fd_;
};

/// A mapping that is unmapped unless released.
class Map {
public:
  Map() = default;
  ~Map() { reset(); }
  Map(const Map &) = delete;
  Map &operator=(const Map &) = delete;
  [[nodiscard]] Status map(int fd, std::int64_t bytes, const std::string &name) {
    void *p = ::mmap(nullptr, static_cast<std::size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return system_error("mmap of " + std::to_string(bytes) + " bytes", name, errno);
    ptr_ = p, bytes_ = bytes;
    return {};
  }
  [[nodiscard]] void *get() const noexcept { return ptr_; }
  void *release() noexcept { return std::exchange(ptr_, nullptr); }
  void reset() noexcept {
    if (ptr_ != nullptr) ::munmap(ptr_, static_cast<std::size_t>(bytes_));
    ptr_ = nullptr;
  }

private:
  void *ptr_ = nullptr;
  std::int64_t bytes_ = 0;
};

Status check_options(const NodeMirrorOptions &o, std::string &name) {
  if (Status st = node_mirror_name(o, name); !st.ok()) return st;
  if (o.payload_bytes <= 0)
    return invalid("payload_bytes must be positive, got " + std::to_string(o.payload_bytes) + " (segment " + name +
                   ")");
  if (node_mirror_segment_bytes(o.payload_bytes) < 0)
    return invalid("payload_bytes " + std::to_string(o.payload_bytes) + " overflows the segment size (segment " + name +
                   ")");
  if (o.open_timeout.count() < 0)
    return invalid("open_timeout must not be negative, got " + std::to_string(o.open_timeout.count()) + " ms");
#if !defined(FOREMOE_HAVE_CUDA)
  if (o.pin)
    return {StatusCode::unavailable,
            "node mirror: pin needs cudaHostRegister, and this runtime was built without CUDA (segment " + name + ")"};
#endif
  return {};
}

/// One try at opening `name`: `retry` is set when the creator may not have finished yet (missing, too small, not
/// ready), so that waiting could help.
Status try_open(const std::string &name, const NodeMirrorOptions &o, Map &map, bool &retry) {
  retry = false;
  const Fd fd(::shm_open(name.c_str(), O_RDWR, 0));
  if (fd.get() < 0) {
    if (errno != ENOENT) return system_error("shm_open", name, errno);
    retry = true;
    return {StatusCode::unavailable, "node mirror: segment " + name +
                                         " does not exist (the node's first local rank creates it, with the same "
                                         "job key, node and layer)"};
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return system_error("fstat", name, errno);
  const auto size = static_cast<std::int64_t>(st.st_size);
  if (size < node_mirror_header_bytes) {
    retry = true;
    return invalid("segment " + name + " is " + std::to_string(size) + " bytes, smaller than its " +
                   std::to_string(node_mirror_header_bytes) +
                   "-byte header: not a node mirror, or still being created (" + remove_hint(name) + ")");
  }
  if (Status s = map.map(fd.get(), size, name); !s.ok()) return s;
  const Header &h = header_of(map.get());
  const bool ready = ready_of(map.get()).load(std::memory_order_acquire) == 1;
  if (h.magic != node_mirror_magic) {
    retry = !ready && h.magic == 0; // zero-filled: the creator has not written the header yet
    return invalid("segment " + name + " is not a foremoe node mirror (magic " + hex(h.magic) + ", expected " +
                   hex(node_mirror_magic) + "): left over from another program or job (" + remove_hint(name) + ")");
  }
  if (h.version != node_mirror_format_version || h.header_bytes != node_mirror_header_bytes)
    return invalid("segment " + name + " has format version " + std::to_string(h.version) + " with a " +
                   std::to_string(h.header_bytes) + "-byte header; this build reads version " +
                   std::to_string(node_mirror_format_version) + " with a " + std::to_string(node_mirror_header_bytes) +
                   "-byte header (" + remove_hint(name) + ")");
  if (!ready) {
    retry = true;
    return {StatusCode::unavailable, "node mirror: segment " + name +
                                         " is not ready (its creator has not finished creating it, or died while "
                                         "doing so; " +
                                         remove_hint(name) + ")"};
  }
  if (h.payload_bytes != o.payload_bytes)
    return invalid("segment " + name + " holds " + std::to_string(h.payload_bytes) +
                   " payload bytes, this rank expects " + std::to_string(o.payload_bytes) +
                   " (another layer shape, or another job with the same key)");
  if (size != node_mirror_segment_bytes(h.payload_bytes))
    return invalid("segment " + name + " is " + std::to_string(size) + " bytes, its header's " +
                   std::to_string(h.payload_bytes) + " payload bytes need " +
                   std::to_string(node_mirror_segment_bytes(h.payload_bytes)));
  return {};
}

} // namespace

Status node_mirror_name(const NodeMirrorOptions &o, std::string &out) {
  const std::string &key = o.job_key;
  if (key.empty()) return invalid("job_key is empty; give every job a key of letters, digits, '_' or '-'");
  if (key.size() > NodeMirrorOptions::max_job_key_chars)
    return invalid("job_key '" + key.substr(0, 16) + "...' is " + std::to_string(key.size()) + " characters, at most " +
                   std::to_string(NodeMirrorOptions::max_job_key_chars));
  const auto bad = std::find_if_not(key.begin(), key.end(), [](char ch) {
    const auto c = static_cast<unsigned char>(ch);
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  });
  if (bad != key.end()) {
    const auto c = static_cast<unsigned char>(*bad);
    const std::string where = " at index " + std::to_string(bad - key.begin()) + "; use letters, digits, '_' and '-'";
    if (c < 0x20 || c >= 0x7F) return invalid("job_key has the byte " + hex(c, 2) + where);
    const std::string shown{'\'', *bad, '\''};
    return invalid("job_key '" + key + "' has " + shown + where);
  }
  if (o.node < 0) return invalid("node must not be negative, got " + std::to_string(o.node));
  if (o.layer < 0) return invalid("layer must not be negative, got " + std::to_string(o.layer));
  out = "/foremoe." + key + ".n" + std::to_string(o.node) + ".l" + std::to_string(o.layer);
  return {};
}

std::int64_t node_mirror_segment_bytes(std::int64_t payload_bytes) noexcept {
  constexpr std::int64_t max = std::numeric_limits<std::int64_t>::max();
  if (payload_bytes <= 0 || payload_bytes > max - node_mirror_header_bytes - page_bytes) return -1;
  return node_mirror_header_bytes + (payload_bytes + page_bytes - 1) / page_bytes * page_bytes;
}

Status NodeMirror::create(const NodeMirrorOptions &o, std::unique_ptr<NodeMirror> &out) {
  std::string name;
  if (Status st = check_options(o, name); !st.ok()) return st;
  const std::int64_t total = node_mirror_segment_bytes(o.payload_bytes);
  const Fd fd(::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, S_IRUSR | S_IWUSR));
  if (fd.get() < 0) {
    if (errno == EEXIST)
      return invalid("segment " + name + " exists already: another job uses the key '" + o.job_key +
                     "', or a process that died left it (" + remove_hint(name) + ")");
    return system_error("shm_open (create)", name, errno);
  }
  std::unique_ptr<NodeMirror> m(new NodeMirror());
  m->name_ = name, m->creator_ = true, m->linked_ = true; // from here on the destructor removes the name
  // Reserve the memory now: tmpfs allocates pages lazily, and a full /dev/shm would otherwise end a later write
  // with SIGBUS instead of an error here.
  if (const int err = ::posix_fallocate(fd.get(), 0, total); err != 0)
    return system_error("reserving " + std::to_string(total) + " bytes (posix_fallocate) in /dev/shm", name, err);
  Map map;
  if (Status st = map.map(fd.get(), total, name); !st.ok()) return st;
  Header &h = header_of(map.get());
  h.magic = node_mirror_magic;
  h.version = node_mirror_format_version;
  h.header_bytes = static_cast<std::uint32_t>(node_mirror_header_bytes);
  h.payload_bytes = o.payload_bytes;
  generation_of(map.get()).store(0, std::memory_order_relaxed);
  m->map_bytes_ = total, m->bytes_ = o.payload_bytes;
  m->map_ = map.release();
  m->data_ = static_cast<std::byte *>(m->map_) + node_mirror_header_bytes;
#if defined(FOREMOE_HAVE_CUDA)
  if (o.pin) {
    if (Status st = detail::cuda_host_register(m->map_, m->map_bytes_, name); !st.ok()) return st;
    m->pinned_ = true;
  }
#endif
  ready_of(m->map_).store(1, std::memory_order_release);
  out = std::move(m);
  return {};
}

Status NodeMirror::open(const NodeMirrorOptions &o, std::unique_ptr<NodeMirror> &out) {
  std::string name;
  if (Status st = check_options(o, name); !st.ok()) return st;
  const auto deadline = std::chrono::steady_clock::now() + o.open_timeout;
  Map map;
  for (;;) {
    bool retry = false;
    Status st = try_open(name, o, map, retry);
    if (st.ok()) break;
    if (!retry) return st;
    if (std::chrono::steady_clock::now() >= deadline) {
      if (o.open_timeout.count() == 0) return st;
      return {StatusCode::timed_out, st.message() + " after waiting " + std::to_string(o.open_timeout.count()) + " ms"};
    }
    map.reset();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::unique_ptr<NodeMirror> m(new NodeMirror());
  m->name_ = name;
  m->map_bytes_ = node_mirror_segment_bytes(o.payload_bytes), m->bytes_ = o.payload_bytes;
  m->map_ = map.release();
  m->data_ = static_cast<std::byte *>(m->map_) + node_mirror_header_bytes;
  // An odd generation is a refresh under way (which this rank joins) or one that was interrupted: either way the
  // refresh this rank takes part in next starts from the even generation below it.
  m->seen_ = m->generation() & ~std::uint64_t{1};
#if defined(FOREMOE_HAVE_CUDA)
  if (o.pin) {
    if (Status st = detail::cuda_host_register(m->map_, m->map_bytes_, name); !st.ok()) return st;
    m->pinned_ = true;
  }
#endif
  out = std::move(m);
  return {};
}

NodeMirror::~NodeMirror() {
#if defined(FOREMOE_HAVE_CUDA)
  if (pinned_) detail::cuda_host_unregister(map_);
#endif
  if (map_ != nullptr) ::munmap(map_, static_cast<std::size_t>(map_bytes_));
  if (linked_) (void)::shm_unlink(name_.c_str());
}

std::uint64_t NodeMirror::generation() const noexcept { return generation_of(map_).load(std::memory_order_acquire); }

bool NodeMirror::stale() const noexcept {
  const std::uint64_t g = generation();
  return g == 0 || g % 2 == 1 || g != seen_;
}

Status NodeMirror::begin_refresh() {
  std::uint64_t expected = seen_;
  if (generation_of(map_).compare_exchange_strong(expected, seen_ + 1, std::memory_order_acq_rel) ||
      expected == seen_ + 1)
    return {};
  return {StatusCode::aborted, "node mirror: segment " + name_ + " is at generation " + std::to_string(expected) +
                                   " while this rank last saw " + std::to_string(seen_) +
                                   ": a local rank refreshed the mirror without the others (refresh is collective "
                                   "over every local rank of the node)"};
}

Status NodeMirror::end_refresh() {
  std::uint64_t expected = seen_ + 1;
  if (generation_of(map_).compare_exchange_strong(expected, seen_ + 2, std::memory_order_acq_rel) ||
      expected == seen_ + 2) {
    seen_ += 2;
    return {};
  }
  return {StatusCode::aborted, "node mirror: segment " + name_ + " is at generation " + std::to_string(expected) +
                                   " at the end of a refresh from generation " + std::to_string(seen_) + " (expected " +
                                   std::to_string(seen_ + 1) + " or " + std::to_string(seen_ + 2) +
                                   "): local ranks refreshed out of step"};
}

Status NodeMirror::unlink() {
  if (!linked_) return {};
  linked_ = false;
  if (::shm_unlink(name_.c_str()) != 0 && errno != ENOENT) return system_error("shm_unlink", name_, errno);
  return {};
}

} // namespace runtime
} // namespace v0
} // namespace foremoe
