// The trainer input formats: the registry lists exactly the files in include/foremoe/trace/formats/, `auto`
// detection, and one test case per format that writes random ids in the format and reads them back through the
// registry. A new format is one header plus its test case here (`tested_formats` fails until it has one).

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "foremoe/trace/readers.hpp"
#include "test_support.hpp"

using namespace foremoe;
namespace fs = std::filesystem;

namespace {

/// The formats with a reader test case below, in registry listing order.
constexpr std::array<const char *, 4> tested_formats = {"npy", "verl", "sglang", "megatron"};

/// A fresh folder for one test case's files.
fs::path temp_dir(const std::string &name) {
  fs::path d = fs::temp_directory_path() / ("foremoe_test_trace_formats_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

/// Random ids `[T, L, K]` in [0, E), T in [0, 40).
struct Ids {
  std::int64_t T;
  int L, K;
  std::vector<std::int32_t> v; ///< C order
  [[nodiscard]] std::int32_t at(std::int64_t t, int l, int k) const { return v[(t * L + l) * K + k]; }
};
Ids random_ids(std::mt19937_64 &rng) {
  Ids x{static_cast<std::int64_t>(rng() % 40), 1 + static_cast<int>(rng() % 4), 1 + static_cast<int>(rng() % 3), {}};
  x.v.resize(static_cast<std::size_t>(x.T * x.L * x.K));
  for (auto &i : x.v)
    i = static_cast<std::int32_t>(rng() % 300);
  return x;
}

/// Every id of `r` (read with no mask) equals the corresponding one of `want`.
void check_ids(const RoutedRecord &r, const Ids &want) {
  REQUIRE(r.view.num_tokens() == want.T);
  REQUIRE(r.view.num_layers() == want.L);
  REQUIRE(r.view.topk() == want.K);
  for (std::int64_t t = 0; t < want.T; ++t)
    for (int l = 0; l < want.L; ++l)
      for (int k = 0; k < want.K; ++k)
        REQUIRE(r.view.at(t, l, k, 1 << 20) == want.at(t, l, k));
}

std::string encode_base64(const std::vector<std::uint8_t> &b) {
  const char *abc = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string s;
  for (std::size_t i = 0; i < b.size(); i += 3) {
    const std::uint32_t v = std::uint32_t{b[i]} << 16 | (i + 1 < b.size() ? std::uint32_t{b[i + 1]} << 8 : 0u) |
                            (i + 2 < b.size() ? std::uint32_t{b[i + 2]} : 0u);
    s += abc[(v >> 18) & 63];
    s += abc[(v >> 12) & 63];
    s += i + 1 < b.size() ? abc[(v >> 6) & 63] : '=';
    s += i + 2 < b.size() ? abc[v & 63] : '=';
  }
  return s;
}

void write_text(const fs::path &p, const std::string &s) { std::ofstream(p, std::ios::binary) << s; }

int rounds() { return 20 * foremoe_test::seed_multiplier(); }

} // namespace

TEST_CASE("the registry lists exactly the format files present, each with a reader test case") {
  std::vector<std::string> files;
  for (const auto &e : fs::directory_iterator(fs::path(FOREMOE_SOURCE_DIR) / "include/foremoe/trace/formats"))
    if (e.path().extension() == ".hpp" && e.path().stem() != "builtin") files.push_back(e.path().stem().string());
  std::vector<std::string> registered, tested(tested_formats.begin(), tested_formats.end());
  for (const TraceFormat *f : trace_formats())
    registered.push_back(f->name);
  CHECK(registered == tested); // listing order too
  std::sort(files.begin(), files.end());
  std::sort(registered.begin(), registered.end());
  CHECK(files == registered);
  CHECK_THROWS_WITH_AS((void)find_trace_format("parquet"),
                       doctest::Contains("unknown trace format 'parquet' (registered: npy, verl, sglang, megatron)"),
                       Error);
  CHECK_THROWS_WITH_AS(
      register_trace_format({"npy", "", "", 1, false, false, false, [](const TraceProbe &) { return 0; },
                             [](const TraceInput &, const TraceReadOptions &) { return RoutedRecord{}; }}),
      doctest::Contains("format 'npy' is already registered"), Error);
  CHECK_THROWS_WITH_AS(
      register_trace_format({"Bad_Name", "", "", 1, false, false, false, [](const TraceProbe &) { return 0; },
                             [](const TraceInput &, const TraceReadOptions &) { return RoutedRecord{}; }}),
      doctest::Contains("'Bad_Name' may hold only"), Error);
}

TEST_CASE("auto detection: .jsonl/.json/.ndjson are sglang, a 4-D NPY verl, anything else npy; megatron only named") {
  const fs::path d = temp_dir("detect");
  const std::int64_t s3[3] = {2, 1, 1}, s4[4] = {1, 2, 1, 1};
  const std::int32_t v[2] = {0, 1};
  write_npy(d / "ids.npy", NpyDtype::of<std::int32_t>(), s3, v);
  write_npy(d / "verl.npy", NpyDtype::of<std::int32_t>(), s4, v);
  write_text(d / "r.JSONL", "");
  write_text(d / "notes.txt", "hello");
  CHECK(detect_trace_format(d / "ids.npy").name == "npy");
  CHECK(detect_trace_format(d / "verl.npy").name == "verl");
  CHECK(detect_trace_format(d / "r.JSONL").name == "sglang");
  CHECK(detect_trace_format(d / "missing.ndjson").name == "sglang");
  CHECK(detect_trace_format(d / "notes.txt").name == "npy"); // whose reader then names the file
  CHECK_THROWS_WITH_AS((void)read_trace(d / "notes.txt", "auto"), doctest::Contains("notes.txt"), Error);
  CHECK(find_trace_format("megatron").detect(TraceProbe(d / "ids.npy")) == 0);
  // an option the format does not read is refused, not dropped
  TraceReadOptions mask;
  mask.mask = TraceInput(d / "ids.npy");
  CHECK_THROWS_WITH_AS((void)read_trace(d / "ids.npy", "auto", mask), doctest::Contains("ids.npy is read as npy"),
                       Error);
  CHECK_THROWS_WITH_AS((void)read_trace(d / "r.JSONL", "sglang"),
                       doctest::Contains("format sglang needs the payload's layers and topk"), Error);
}

TEST_CASE("format npy: [T, L, K] ids of any integer dtype read back equal (property)") {
  std::mt19937_64 rng(11);
  const fs::path d = temp_dir("npy");
  for (int round = 0; round < rounds(); ++round) {
    const Ids x = random_ids(rng);
    const std::int64_t shape[3] = {x.T, x.L, x.K};
    std::vector<std::int16_t> narrow(x.v.begin(), x.v.end());
    if (round % 2 == 0)
      write_npy(d / "ids.npy", NpyDtype::of<std::int32_t>(), shape, x.v.data());
    else
      write_npy(d / "ids.npy", NpyDtype::of<std::int16_t>(), shape, narrow.data());
    const RoutedRecord r = read_trace(d / "ids.npy", "auto");
    check_ids(r, x);
    CHECK(r.mask.empty());
  }
  const std::int64_t s2[2] = {2, 2};
  const std::int32_t v[4] = {};
  write_npy(d / "flat.npy", NpyDtype::of<std::int32_t>(), s2, v);
  CHECK_THROWS_WITH_AS((void)read_trace(d / "flat.npy", "npy"),
                       doctest::Contains("flat.npy: routed ids must be [tokens, layers, topk], got shape [2, 2]"),
                       Error);
}

TEST_CASE("format verl: [bs, seq, L, K] rows flatten in order; the mask keeps the positions set to 1 (property)") {
  std::mt19937_64 rng(12);
  const fs::path d = temp_dir("verl");
  for (int round = 0; round < rounds(); ++round) {
    Ids x = random_ids(rng);
    const std::int64_t bs = 1 + static_cast<std::int64_t>(rng() % 4);
    x.T = x.T / bs * bs;
    x.v.resize(static_cast<std::size_t>(x.T * x.L * x.K));
    const std::int64_t shape[4] = {bs, x.T / bs, x.L, x.K}, mshape[2] = {bs, x.T / bs};
    write_npy(d / "ids.npy", NpyDtype::of<std::int32_t>(), shape, x.v.data());
    std::vector<std::uint8_t> mask(static_cast<std::size_t>(x.T));
    for (auto &m : mask)
      m = static_cast<std::uint8_t>(rng() % 2);
    write_npy(d / "mask.npy", NpyDtype::of<std::uint8_t>(), mshape, mask.data());
    check_ids(read_trace(d / "ids.npy", "auto"), x);
    TraceReadOptions o;
    o.mask = TraceInput(d / "mask.npy");
    const RoutedRecord r = read_trace(d / "ids.npy", "verl", o);
    check_ids(r, x);
    REQUIRE(r.mask.size() == mask.size());
    for (std::size_t t = 0; t < mask.size(); ++t)
      CHECK(r.mask[t] == mask[t]);
    // A value other than 0 or 1 is an error naming its position and value, as for the in-memory batch.
    if (mask.empty()) continue;
    const std::size_t at = rng() % mask.size();
    mask[at] = static_cast<std::uint8_t>(2 + rng() % 200);
    write_npy(d / "mask.npy", NpyDtype::of<std::uint8_t>(), mshape, mask.data());
    const std::int64_t row = static_cast<std::int64_t>(at) / mshape[1], col = static_cast<std::int64_t>(at) % mshape[1];
    const std::string want =
        detail::concat("mask.npy: attention mask [", row, ", ", col, "] = ", int(mask[at]), " is not 0 or 1");
    CHECK_ERROR_CONTAINS((void)read_trace(d / "ids.npy", "verl", o), want.c_str());
  }
  // the same bytes from memory, NumPy's bool mask included; errors name the given names
  const std::int64_t shape[4] = {1, 2, 1, 1}, mshape[2] = {2, 1};
  const std::int32_t v[2] = {5, 6};
  const std::vector<std::byte> ids = encode_npy(NpyDtype::of<std::int32_t>(), shape, v);
  const std::uint8_t m[2] = {0, 1};
  std::vector<std::byte> mask = encode_npy(NpyDtype::of<std::uint8_t>(), std::span<const std::int64_t>(shape, 2), m);
  std::string text(reinterpret_cast<const char *>(mask.data()), mask.size());
  text.replace(text.find("'|u1'"), 5, "'|b1'");
  TraceReadOptions o;
  o.mask =
      TraceInput("mask", std::span<const std::byte>(reinterpret_cast<const std::byte *>(text.data()), text.size()));
  const RoutedRecord r = read_trace(TraceInput("ids", ids), "verl", o);
  CHECK(r.view.at(1, 0, 0, 8) == 6);
  CHECK(r.mask == std::vector<std::uint8_t>{0, 1});
  const std::vector<std::byte> bad = encode_npy(NpyDtype::of<std::uint8_t>(), mshape, m);
  o.mask = TraceInput("bad mask", bad);
  CHECK_THROWS_WITH_AS((void)read_trace(TraceInput("ids", ids), "verl", o),
                       doctest::Contains("bad mask: attention mask must be [1, 2] to match ids, got shape [2, 1]"),
                       Error);
}

TEST_CASE("format sglang: requests' base64 payloads concatenate in order (property)") {
  std::mt19937_64 rng(13);
  const fs::path d = temp_dir("sglang");
  for (int round = 0; round < rounds(); ++round) {
    const Ids x = random_ids(rng);
    // cut the tokens into requests, some empty, alternating top-level and meta_info payloads and blank lines
    std::vector<std::int64_t> cuts{0};
    while (cuts.back() < x.T)
      cuts.push_back(std::min<std::int64_t>(x.T, cuts.back() + static_cast<std::int64_t>(rng() % 6)));
    std::string text;
    for (std::size_t q = 0; q + 1 < cuts.size(); ++q) {
      std::vector<std::uint8_t> b;
      for (std::int64_t i = cuts[q] * x.L * x.K; i < cuts[q + 1] * x.L * x.K; ++i)
        for (int byte = 0; byte < 4; ++byte)
          b.push_back(static_cast<std::uint8_t>(static_cast<std::uint32_t>(x.v[i]) >> (8 * byte)));
      text += q % 2 ? "{\"routed_experts\": \"" + encode_base64(b) + "\"}\n\n"
                    : "{\"text\": \"a\", \"meta_info\": {\"routed_experts\": \"" + encode_base64(b) + "\"}}\n";
    }
    if (cuts.size() < 2) continue; // no request: an error, checked below
    write_text(d / "r.jsonl", text);
    TraceReadOptions o;
    o.num_layers = x.L;
    o.topk = x.K;
    const RoutedRecord r = read_trace(d / "r.jsonl", "auto", o);
    check_ids(r, x);
    CHECK(r.request_offsets == cuts);
  }
  TraceReadOptions o;
  o.num_layers = o.topk = 2;
  write_text(d / "bad.jsonl", "\n{\"routed_experts\": \"AAAA*AAA\"}\n");
  CHECK_THROWS_WITH_AS((void)read_trace(d / "bad.jsonl", "sglang", o),
                       doctest::Contains("bad.jsonl:2: routed_experts: malformed base64: character * at position 4"),
                       Error);
  write_text(d / "none.jsonl", "\n");
  CHECK_THROWS_WITH_AS((void)read_trace(d / "none.jsonl", "sglang", o), doctest::Contains("none.jsonl: no request"),
                       Error);
  const std::string mem = "{\"meta_info\": {}}";
  CHECK_THROWS_WITH_AS(
      (void)read_trace(TraceInput("requests", std::as_bytes(std::span(mem.data(), mem.size()))), "sglang", o),
      doctest::Contains("requests:1: no routed_experts"), Error);
}

TEST_CASE("decode_base64 inverts encoding on random bytes (property) and names a malformed character") {
  std::mt19937_64 rng(99);
  for (int round = 0; round < 200; ++round) {
    std::vector<std::uint8_t> b(rng() % 40);
    for (auto &x : b)
      x = static_cast<std::uint8_t>(rng());
    const auto d = decode_base64(encode_base64(b));
    REQUIRE(d.size() == b.size());
    for (std::size_t i = 0; i < b.size(); ++i)
      CHECK(static_cast<std::uint8_t>(d[i]) == b[i]);
  }
  CHECK_THROWS_WITH_AS((void)decode_base64("AAAA*AAA", "req"),
                       doctest::Contains("req: malformed base64: character * at position 4"), Error);
  CHECK_THROWS_WITH_AS((void)decode_base64("AAAAA"), doctest::Contains("5 characters is not a valid length"), Error);
}

TEST_CASE("format megatron: [L, T, K] reads as [T, L, K] without a copy (property)") {
  std::mt19937_64 rng(14);
  const fs::path d = temp_dir("megatron");
  for (int round = 0; round < rounds(); ++round) {
    const Ids x = random_ids(rng);
    std::vector<std::int64_t> ltk(x.v.size());
    for (std::int64_t t = 0; t < x.T; ++t)
      for (int l = 0; l < x.L; ++l)
        for (int k = 0; k < x.K; ++k)
          ltk[static_cast<std::size_t>((l * x.T + t) * x.K + k)] = x.at(t, l, k);
    const std::int64_t shape[3] = {x.L, x.T, x.K};
    write_npy(d / "mg.npy", NpyDtype::of<std::int64_t>(), shape, ltk.data());
    const RoutedRecord r = read_trace(d / "mg.npy", "megatron");
    check_ids(r, x);
    if (x.T > 1) CHECK(r.view.strides()[1] == x.T * x.K); // a view over the file's [L, T, K], not a copy
  }
  const std::int64_t s4[4] = {1, 1, 1, 1};
  const std::int32_t v[1] = {0};
  write_npy(d / "four.npy", NpyDtype::of<std::int32_t>(), s4, v);
  CHECK_THROWS_WITH_AS((void)read_trace(d / "four.npy", "megatron"),
                       doctest::Contains("four.npy: Megatron router replay must be [layers, tokens, topk]"), Error);
}
