// The node-shared host mirror: several processes (fork) map one segment and see each other's writes, the
// generation protocol of a collective refresh and its staleness, every refused input with the value it names, and
// the segment's removal when its creator closes it, and the transfer engine reading it only while it is fresh.

#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "foremoe/runtime/node_mirror.hpp"
#include "foremoe/runtime/runtime.hpp"
#include "foremoe/runtime/transfer_engine.hpp"

namespace rt = foremoe::runtime;
using namespace std::chrono_literals;

namespace {

/// A key of its own per test process, so that parallel runs (another build's ctest) never share a segment.
std::string job_key(const char *what) { return std::string(what) + "-" + std::to_string(::getpid()); }

rt::NodeMirrorOptions options(const char *what, std::int64_t bytes) {
  rt::NodeMirrorOptions o;
  o.job_key = job_key(what);
  o.node = 1;
  o.layer = 2;
  o.payload_bytes = bytes;
  return o;
}

bool exists(const std::string &name) {
  const int fd = ::shm_open(name.c_str(), O_RDONLY, 0);
  if (fd >= 0) ::close(fd);
  return fd >= 0;
}

/// Writes `bytes` as a segment named `name` without the runtime (a leftover of another program or an old format).
void write_raw(const std::string &name, const std::vector<std::byte> &bytes) {
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, S_IRUSR | S_IWUSR);
  REQUIRE(fd >= 0);
  REQUIRE(::write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()));
  ::close(fd);
}

/// The header fields as the runtime lays them out (magic, version, header bytes, payload bytes, generation, ready).
std::vector<std::byte> raw_header(std::uint64_t magic, std::uint32_t version, std::int64_t payload, std::uint32_t ready,
                                  std::int64_t total) {
  std::vector<std::byte> b(static_cast<std::size_t>(total));
  const auto header_bytes = static_cast<std::uint32_t>(rt::node_mirror_header_bytes);
  const std::uint64_t generation = 2;
  std::memcpy(b.data(), &magic, 8);
  std::memcpy(b.data() + 8, &version, 4);
  std::memcpy(b.data() + 12, &header_bytes, 4);
  std::memcpy(b.data() + 16, &payload, 8);
  std::memcpy(b.data() + 24, &generation, 8);
  std::memcpy(b.data() + 32, &ready, 4);
  return b;
}

bool contains(const rt::Status &st, const std::string &part) { return st.message().find(part) != std::string::npos; }

/// A barrier between forked processes, in an anonymous shared page mapped before the fork.
class ProcessBarrier {
public:
  explicit ProcessBarrier(int parties) : parties_(parties) {
    void *p = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    REQUIRE(p != MAP_FAILED);
    count_ = static_cast<std::uint64_t *>(p);
    *count_ = 0;
  }
  ~ProcessBarrier() { ::munmap(count_, 4096); }
  ProcessBarrier(const ProcessBarrier &) = delete;
  ProcessBarrier &operator=(const ProcessBarrier &) = delete;
  /// The `round`-th barrier (1, 2, ...): false after 20 s without every party.
  bool arrive(std::uint64_t round) {
    std::atomic_ref<std::uint64_t> c(*count_);
    c.fetch_add(1, std::memory_order_acq_rel);
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (c.load(std::memory_order_acquire) < round * static_cast<std::uint64_t>(parties_)) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(100us);
    }
    return true;
  }

private:
  int parties_;
  std::uint64_t *count_ = nullptr;
};

std::byte pattern(int rank, std::int64_t i, std::uint64_t generation) {
  return static_cast<std::byte>((rank * 31 + i * 7 + static_cast<std::int64_t>(generation)) & 0xFF);
}

/// Local rank `rank` of `ranks`: one collective refresh (its contiguous share of the payload), then it checks
/// every other rank's share; rank 0 then refreshes alone and the others must see their mirror stale and refuse to
/// join a later refresh. Returns 0 or the number of the first failed step (the exit code of a forked child).
int local_rank(rt::NodeMirror &m, int rank, int ranks, ProcessBarrier &barrier) {
  const std::int64_t n = m.payload_bytes();
  const std::int64_t lo = n * rank / ranks, hi = n * (rank + 1) / ranks;
  std::byte *data = m.payload().data();
  // Every rank, the creator included, starts together: a child that opened the segment must not begin a refresh
  // while the creator still checks the fresh segment's generation 0 (a race CI's TSan run caught).
  if (!barrier.arrive(1)) return 17;
  if (!m.stale()) return 1; // generation 0: never filled
  if (!m.begin_refresh().ok()) return 2;
  if (m.generation() != 1) return 3;
  for (std::int64_t i = lo; i < hi; ++i)
    data[i] = pattern(static_cast<int>(i * ranks / n), i, 2);
  if (!barrier.arrive(2)) return 4;
  if (!m.end_refresh().ok()) return 5;
  if (m.generation() != 2 || m.seen_generation() != 2 || m.stale()) return 6;
  for (std::int64_t i = 0; i < n; ++i) // every rank's share, written by the other processes
    if (data[i] != pattern(static_cast<int>(i * ranks / n), i, 2)) return 7;
  if (!barrier.arrive(3)) return 8;
  if (rank == 0) { // refreshes alone: a local rank that does so makes everyone else's mirror stale
    if (!m.begin_refresh().ok()) return 9;
    if (!barrier.arrive(4)) return 10;
    if (!barrier.arrive(5)) return 11;
    if (!m.end_refresh().ok() || m.generation() != 4 || m.stale()) return 12;
    if (!barrier.arrive(6)) return 13;
  } else {
    if (!barrier.arrive(4)) return 10;
    if (!m.stale() || m.generation() != 3) return 14; // a refresh under way
    if (!barrier.arrive(5)) return 11;
    if (!barrier.arrive(6)) return 13;
    if (!m.stale() || m.generation() != 4) return 15; // done without this rank
    const rt::Status st = m.begin_refresh();
    if (st.code() != rt::StatusCode::aborted || !contains(st, "generation 4 while this rank last saw 2")) return 16;
  }
  return 0;
}

} // namespace

TEST_CASE("forked local ranks map one segment: each sees the others' writes, refresh generations and staleness") {
  constexpr int ranks = 4;
  const rt::NodeMirrorOptions o = [] {
    rt::NodeMirrorOptions x = options("fork", 3 * 4096 + 123); // shares that do not fall on page boundaries
    x.open_timeout = 20s; // the children start before the segment exists and wait for it
    return x;
  }();
  ProcessBarrier barrier(ranks);
  std::vector<pid_t> children;
  for (int r = 1; r < ranks; ++r) {
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      std::unique_ptr<rt::NodeMirror> m;
      if (!rt::NodeMirror::open(o, m).ok()) ::_exit(100);
      if (m->is_creator()) ::_exit(101);
      ::_exit(local_rank(*m, r, ranks, barrier));
    }
    children.push_back(pid);
  }
  std::string name;
  {
    std::unique_ptr<rt::NodeMirror> m;
    std::this_thread::sleep_for(20ms); // let the children find no segment first
    REQUIRE(rt::NodeMirror::create(o, m).ok());
    name = m->name();
    CHECK(name == "/foremoe." + o.job_key + ".n1.l2");
    CHECK(m->is_creator());
    CHECK(m->payload_bytes() == o.payload_bytes);
    CHECK(m->segment_bytes() == 4096 + 4 * 4096); // header page + the payload in whole pages
    CHECK(reinterpret_cast<std::uintptr_t>(m->payload().data()) % 4096 == 0);
    CHECK(m->generation() == 0);
    CHECK(local_rank(*m, 0, ranks, barrier) == 0);
    for (const pid_t pid : children) {
      int status = 0;
      REQUIRE(::waitpid(pid, &status, 0) == pid);
      CHECK(WIFEXITED(status));
      CHECK_MESSAGE(WEXITSTATUS(status) == 0, "child failed at step " << WEXITSTATUS(status));
    }
    CHECK(exists(name));
  }
  CHECK_FALSE(exists(name)); // the creator removed it when it closed
}

TEST_CASE("unlink removes the name early; the mappings stay valid and later opens fail") {
  const rt::NodeMirrorOptions o = options("unlink", 100);
  std::unique_ptr<rt::NodeMirror> a, b;
  REQUIRE(rt::NodeMirror::create(o, a).ok());
  REQUIRE(rt::NodeMirror::open(o, b).ok());
  CHECK_FALSE(b->is_creator());
  CHECK(b->unlink().ok()); // not the creator: the name stays
  CHECK(exists(a->name()));
  CHECK(a->unlink().ok());
  CHECK_FALSE(exists(a->name()));
  CHECK(a->unlink().ok()); // idempotent
  a->payload()[99] = std::byte{42};
  CHECK(b->payload()[99] == std::byte{42});
  std::unique_ptr<rt::NodeMirror> c;
  const rt::Status st = rt::NodeMirror::open(o, c);
  CHECK(st.code() == rt::StatusCode::unavailable);
  CHECK_MESSAGE(contains(st, "segment " + a->name() + " does not exist"), st.message());
  a.reset();
  CHECK(b->payload()[99] == std::byte{42}); // the other rank's mapping outlives the creator's
}

TEST_CASE("bad names, sizes and timeouts are refused, naming the value") {
  struct Case {
    rt::NodeMirrorOptions o;
    std::string message;
  };
  auto with = [](auto edit) {
    rt::NodeMirrorOptions o = options("bad", 64);
    edit(o);
    return o;
  };
  const std::string long_key(201, 'k');
  const std::vector<Case> cases{
      {with([](auto &o) { o.job_key.clear(); }), "job_key is empty"},
      {with([&](auto &o) { o.job_key = long_key; }), "job_key 'kkkkkkkkkkkkkkkk...' is 201 characters, at most 200"},
      {with([](auto &o) { o.job_key = "a/b"; }), "job_key 'a/b' has '/' at index 1"},
      {with([](auto &o) { o.job_key = "a.b"; }), "job_key 'a.b' has '.' at index 1"},
      {with([](auto &o) { o.job_key = std::string("a\nb"); }), "job_key has the byte 0x0a at index 1"},
      {with([](auto &o) { o.node = -1; }), "node must not be negative, got -1"},
      {with([](auto &o) { o.layer = -3; }), "layer must not be negative, got -3"},
      {with([](auto &o) { o.payload_bytes = 0; }), "payload_bytes must be positive, got 0"},
      {with([](auto &o) { o.payload_bytes = -5; }), "payload_bytes must be positive, got -5"},
      {with([](auto &o) { o.payload_bytes = std::numeric_limits<std::int64_t>::max() - 10; }),
       "payload_bytes 9223372036854775797 overflows the segment size"},
      {with([](auto &o) { o.open_timeout = -1ms; }), "open_timeout must not be negative, got -1 ms"},
  };
  for (const Case &c : cases) {
    std::unique_ptr<rt::NodeMirror> m;
    for (const rt::Status &st : {rt::NodeMirror::create(c.o, m), rt::NodeMirror::open(c.o, m)}) {
      CHECK(st.code() == rt::StatusCode::invalid_argument);
      CHECK_MESSAGE(contains(st, "node mirror: " + c.message), st.message());
    }
    CHECK(m == nullptr);
  }
  CHECK(rt::node_mirror_segment_bytes(0) == -1);
  CHECK(rt::node_mirror_segment_bytes(1) == 2 * 4096);
  CHECK(rt::node_mirror_segment_bytes(4096) == 2 * 4096);
  CHECK(rt::node_mirror_segment_bytes(4097) == 3 * 4096);
}

TEST_CASE("an existing name, a size mismatch and a missing segment are refused") {
  const rt::NodeMirrorOptions o = options("size", 1000);
  std::unique_ptr<rt::NodeMirror> a, b;
  REQUIRE(rt::NodeMirror::create(o, a).ok());
  rt::Status st = rt::NodeMirror::create(o, b);
  CHECK(st.code() == rt::StatusCode::invalid_argument);
  CHECK_MESSAGE(contains(st, "segment " + a->name() + " exists already: another job uses the key '" + o.job_key),
                st.message());
  CHECK(exists(a->name())); // the failed create did not remove the first one's name

  rt::NodeMirrorOptions other = o;
  other.payload_bytes = 2000;
  st = rt::NodeMirror::open(other, b);
  CHECK(st.code() == rt::StatusCode::invalid_argument);
  CHECK_MESSAGE(contains(st, "holds 1000 payload bytes, this rank expects 2000"), st.message());
  CHECK(b == nullptr);

  rt::NodeMirrorOptions missing = o;
  missing.layer = 9;
  st = rt::NodeMirror::open(missing, b);
  CHECK(st.code() == rt::StatusCode::unavailable);
  CHECK_MESSAGE(contains(st, "does not exist"), st.message());
  missing.open_timeout = 30ms;
  const auto t0 = std::chrono::steady_clock::now();
  st = rt::NodeMirror::open(missing, b);
  CHECK(std::chrono::steady_clock::now() - t0 >= 30ms);
  CHECK(st.code() == rt::StatusCode::timed_out);
  CHECK_MESSAGE(contains(st, "does not exist (the node's first local rank creates it"), st.message());
  CHECK_MESSAGE(contains(st, "after waiting 30 ms"), st.message());
}

TEST_CASE("segments left by another program, another format or an unfinished creator are refused") {
  const std::int64_t payload = 64;
  const std::int64_t total = rt::node_mirror_segment_bytes(payload);
  struct Case {
    const char *what;
    std::vector<std::byte> bytes;
    rt::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases{
      {"magic", raw_header(0x1234, 1, payload, 1, total), rt::StatusCode::invalid_argument,
       "is not a foremoe node mirror (magic 0x0000000000001234, expected 0x524f5252494d4d46): left over"},
      {"version", raw_header(rt::node_mirror_magic, 7, payload, 1, total), rt::StatusCode::invalid_argument,
       "has format version 7 with a 4096-byte header; this build reads version 1"},
      {"small", std::vector<std::byte>(10), rt::StatusCode::invalid_argument,
       "is 10 bytes, smaller than its 4096-byte header"},
      {"ready", raw_header(rt::node_mirror_magic, 1, payload, 0, total), rt::StatusCode::unavailable,
       "is not ready (its creator has not finished"},
      {"length", raw_header(rt::node_mirror_magic, 1, payload, 1, total + 4096), rt::StatusCode::invalid_argument,
       "is 12288 bytes, its header's 64 payload bytes need 8192"},
  };
  for (const Case &c : cases) {
    CAPTURE(c.what);
    rt::NodeMirrorOptions o = options(c.what, payload);
    std::string name;
    REQUIRE(rt::node_mirror_name(o, name).ok());
    write_raw(name, c.bytes);
    std::unique_ptr<rt::NodeMirror> m;
    rt::Status st = rt::NodeMirror::open(o, m);
    CHECK(st.code() == c.code);
    CHECK_MESSAGE(contains(st, "segment " + name + " " + c.message), st.message());
    CHECK(m == nullptr);
    if (c.code == rt::StatusCode::unavailable) { // waiting does not help when the creator never finishes
      o.open_timeout = 20ms;
      st = rt::NodeMirror::open(o, m);
      CHECK(st.code() == rt::StatusCode::timed_out);
      CHECK_MESSAGE(contains(st, c.message), st.message());
    }
    st = rt::NodeMirror::create(o, m); // a leftover blocks a new creator too, naming the file to remove
    CHECK_MESSAGE(contains(st, "remove /dev/shm" + name), st.message());
    CHECK(::shm_unlink(name.c_str()) == 0);
  }
}

TEST_CASE("pinning needs CUDA: unavailable without it, a device error without a device") {
  rt::NodeMirrorOptions o = options("pin", 4096);
  o.pin = true;
  std::unique_ptr<rt::NodeMirror> m;
  const rt::Status st = rt::NodeMirror::create(o, m);
  const rt::BuildInfo info = rt::build_info();
  std::string name;
  REQUIRE(rt::node_mirror_name(o, name).ok());
  if (!info.cuda_compiled) {
    CHECK(st.code() == rt::StatusCode::unavailable);
    CHECK_MESSAGE(contains(st, "built without CUDA"), st.message());
  } else if (info.num_devices == 0) {
    CHECK(st.code() == rt::StatusCode::device_error);
    CHECK_MESSAGE(contains(st, "cudaHostRegister of 8192 bytes of " + name), st.message());
  } else {
    REQUIRE(st.ok());
    CHECK(m->pinned());
    m.reset();
  }
  CHECK_FALSE(exists(name)); // a failed create leaves nothing behind
}

TEST_CASE("the transfer engine reads a node mirror only while it is fresh") {
  // One node of 2 GPUs x 2 slots, 3 experts of 1 KiB (one tensor), the mirror a node segment. Expert e's bytes are
  // all e + 1. GPU 0 slot 0 holds expert 0, GPU 1 slot 0 expert 1; expert 2 is only in the mirror.
  constexpr std::int64_t kb = 1024;
  rt::EngineOptions o;
  o.topology = {1, 2, 2};
  o.num_layers = 1;
  o.num_experts = 3;
  o.tensors = {{0, kb}};
  o.planning.align_bytes = 256;
  o.planning.max_chunk_bytes = kb;
  std::unique_ptr<rt::TransferEngine> engine;
  REQUIRE(rt::TransferEngine::create(o, engine).ok());
  rt::NodeMirrorOptions mo = options("engine", 3 * kb);
  mo.node = 0;
  mo.layer = 0;
  std::unique_ptr<rt::NodeMirror> mirror;
  REQUIRE(rt::NodeMirror::create(mo, mirror).ok());
  auto write_expert = [&](int e, int value) {
    std::memset(mirror->payload().data() + e * kb, value, static_cast<std::size_t>(kb));
  };
  REQUIRE(mirror->begin_refresh().ok());
  for (int e = 0; e < 3; ++e)
    write_expert(e, e + 1);
  REQUIRE(mirror->end_refresh().ok());
  std::vector<std::vector<std::byte>> mem(2, std::vector<std::byte>(static_cast<std::size_t>(2 * kb), std::byte{0}));
  for (int g = 0; g < 2; ++g)
    REQUIRE(engine->register_slots(0, g, {mem[g].data(), kb, 2, 1, 2 * kb}).ok());
  std::memset(mem[0].data(), 1, static_cast<std::size_t>(kb));
  std::memset(mem[1].data(), 2, static_cast<std::size_t>(kb));
  foremoe::LayerPlacement resident(2, 2, 3);
  resident.slot(0, 0) = 0;
  resident.slot(1, 0) = 1;
  REQUIRE(engine->set_resident(0, resident).ok());

  // The region must fit the segment and divide it evenly.
  rt::MirrorRegion region;
  CHECK(rt::node_mirror_region(*mirror, 5, region).message().find("5 experts do not divide") != std::string::npos);
  REQUIRE(rt::node_mirror_region(*mirror, 3, region).ok());
  rt::MirrorRegion past = region;
  past.base = mirror->payload().data() + kb;
  CHECK(engine->register_mirror(0, 0, past).message().find("do not fit node mirror") != std::string::npos);
  REQUIRE(engine->register_mirror(0, 0, region).ok());

  const auto holds = [&](int g, int s, int value) {
    const std::byte *p = mem[g].data() + s * kb;
    return std::all_of(p, p + kb, [&](std::byte b) { return b == static_cast<std::byte>(value); });
  };
  const auto move = [&](int expert) {
    const foremoe::Move mv{expert, foremoe::host_mirror, 0, 1};
    rt::MoveBatch b;
    b.layer = 0;
    b.moves = std::span<const foremoe::Move>(&mv, 1);
    rt::Ticket t;
    rt::Status st = engine->submit(b, t);
    if (st.ok()) st = t.wait_for(10s);
    return st;
  };
  const auto reset = [&] {
    std::memset(mem[0].data() + kb, 0, static_cast<std::size_t>(kb));
    REQUIRE(engine->set_resident(0, resident).ok());
  };

  // Fresh: expert 2 comes from the mirror.
  REQUIRE(move(2).ok());
  CHECK(holds(0, 1, 3));
  reset();

  // A refresh under way, with the mirror's bytes of experts 1 and 2 half written: expert 2 has no other source, so
  // its move is refused and the slot untouched; expert 1 comes from GPU 1, never from the mirror.
  REQUIRE(mirror->begin_refresh().ok());
  CHECK(mirror->stale());
  write_expert(1, 0xab);
  write_expert(2, 0xab);
  const rt::Status refused = move(2);
  CHECK_FALSE(refused.ok());
  CHECK(holds(0, 1, 0));
  CHECK(engine->resident(0).slot(0, 1) == foremoe::empty_slot);
  reset();
  REQUIRE(move(1).ok());
  CHECK(holds(0, 1, 2));
  reset();

  // Refreshed again: the mirror's new bytes are read.
  REQUIRE(mirror->end_refresh().ok());
  REQUIRE(move(2).ok());
  CHECK(holds(0, 1, 0xab));
}

TEST_CASE("a split mirror in a node segment: its tensors must lie in the payload, and it is read only while fresh") {
  // One node of 2 GPUs x 2 slots, 3 experts of two tensors (512 and 384 bytes), each tensor's entries in a 64-byte
  // aligned block of the segment (as foremoe.torch lays out a node mirror by weight kind); split slots too. Expert e's
  // tensor t is all bytes 10 e + t + 1. GPU 1 slot 0 holds expert 1; expert 2 is only in the mirror.
  const std::int64_t n0 = 512, n1 = 384, off1 = (3 * n0 + 63) / 64 * 64;
  rt::EngineOptions o;
  o.topology = {1, 2, 2};
  o.num_layers = 1;
  o.num_experts = 3;
  o.tensors = {{0, n0}, {n0, n1}};
  o.planning.align_bytes = 128;
  o.planning.max_chunk_bytes = 256;
  std::unique_ptr<rt::TransferEngine> engine;
  REQUIRE(rt::TransferEngine::create(o, engine).ok());
  rt::NodeMirrorOptions mo = options("split", off1 + 3 * n1);
  std::unique_ptr<rt::NodeMirror> mirror;
  REQUIRE(rt::NodeMirror::create(mo, mirror).ok());
  std::byte *payload = mirror->payload().data();
  auto write_expert = [&](int e, int value) {
    std::memset(payload + e * n0, value >= 0 ? value : 10 * e + 1, static_cast<std::size_t>(n0));
    std::memset(payload + off1 + e * n1, value >= 0 ? value : 10 * e + 2, static_cast<std::size_t>(n1));
  };
  REQUIRE(mirror->begin_refresh().ok());
  for (int e = 0; e < 3; ++e)
    write_expert(e, -1);
  REQUIRE(mirror->end_refresh().ok());
  // Slots: per GPU one block per tensor, rows of the tensor's size.
  std::vector<std::vector<std::byte>> t0(2, std::vector<std::byte>(2 * n0)), t1(2, std::vector<std::byte>(2 * n1));
  for (int g = 0; g < 2; ++g) {
    rt::SlotRegion r;
    r.num_slots = 2;
    r.tensors = {{t0[g].data(), n0, 0}, {t1[g].data(), n1, 0}};
    REQUIRE(engine->register_slots(0, g, r).ok());
  }
  std::memset(t0[1].data(), 11, static_cast<std::size_t>(n0));
  std::memset(t1[1].data(), 12, static_cast<std::size_t>(n1));
  foremoe::LayerPlacement resident(2, 2, 3);
  resident.slot(1, 0) = 1;
  REQUIRE(engine->set_resident(0, resident).ok());

  rt::MirrorRegion region;
  region.num_experts = 3;
  region.node_mirror = mirror.get();
  region.tensors = {{payload, n0}, {payload + off1 + 64, n1}}; // tensor 1 runs 64 bytes past the payload
  const rt::Status past = engine->register_mirror(0, 0, region);
  CHECK_MESSAGE(past.message().find("layer 0 node 0 tensor 1") != std::string::npos, past.message());
  CHECK(past.message().find("do not fit node mirror") != std::string::npos);
  region.tensors[1].base = payload + off1;
  REQUIRE(engine->register_mirror(0, 0, region).ok());

  const auto holds = [&](int value0, int value1) { // GPU 0 slot 1
    return std::all_of(t0[0].begin() + n0, t0[0].end(), [&](std::byte b) { return b == std::byte(value0); }) &&
           std::all_of(t1[0].begin() + n1, t1[0].end(), [&](std::byte b) { return b == std::byte(value1); });
  };
  const auto move = [&](int expert) {
    std::fill(t0[0].begin() + n0, t0[0].end(), std::byte{0});
    std::fill(t1[0].begin() + n1, t1[0].end(), std::byte{0});
    REQUIRE(engine->set_resident(0, resident).ok());
    const foremoe::Move mv{expert, foremoe::host_mirror, 0, 1};
    rt::MoveBatch b;
    b.moves = std::span<const foremoe::Move>(&mv, 1);
    rt::Ticket t;
    rt::Status st = engine->submit(b, t);
    if (st.ok()) st = t.wait_for(10s);
    return st;
  };
  REQUIRE(move(2).ok());
  CHECK(holds(21, 22));
  REQUIRE(mirror->begin_refresh().ok()); // stale: the mirror is no source
  write_expert(1, 0xab);
  write_expert(2, 0xab);
  CHECK_FALSE(move(2).ok());
  CHECK(holds(0, 0));
  REQUIRE(move(1).ok()); // from GPU 1
  CHECK(holds(11, 12));
  REQUIRE(mirror->end_refresh().ok());
  REQUIRE(move(2).ok());
  CHECK(holds(0xab, 0xab));
}
