// core/files.hpp: inputs must be regular files (refused by kind before a byte is read, never blocking on a FIFO),
// reads are bounded, outputs are staged and renamed together, and non-regular targets are written in place.

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "foremoe/core/files.hpp"
#include "foremoe/core/json.hpp"
#include "test_support.hpp"

#if defined(__unix__)
#include <sys/stat.h>
#endif

using namespace foremoe;
namespace fs = std::filesystem;

namespace {
std::string slurp(const fs::path &p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
std::vector<std::string> listing(const fs::path &d) {
  std::vector<std::string> out;
  for (const auto &e : fs::directory_iterator(d))
    out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}
} // namespace

TEST_CASE("read_file: regular files only, bounded, named on failure") {
  const foremoe_test::TempDir dir;
  const fs::path f = dir.path / "a.txt";
  files::write_text(f, "hello");
  CHECK(files::read_file(f, 5) == "hello");
  CHECK_THROWS_WITH_AS((void)files::read_file(f, 4), doctest::Contains("5 bytes, more than the 4"), Error);
  CHECK_THROWS_WITH_AS((void)files::read_file(dir.path, 100), doctest::Contains("is a folder, not a file"), Error);
  CHECK_THROWS_WITH_AS((void)files::read_file(dir.path / "none", 100), doctest::Contains("No such file"), Error);
#if defined(__unix__)
  // A FIFO without a writer would block an open for reading; /dev/zero would fill memory.
  const fs::path fifo = dir.path / "fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THROWS_WITH_AS((void)files::read_file(fifo, 100),
                       doctest::Contains("is a FIFO (named pipe), not a regular file"), Error);
  if (fs::exists("/dev/zero"))
    CHECK_THROWS_WITH_AS((void)files::read_file("/dev/zero", 100), doctest::Contains("is a character device"), Error);
#endif
}

TEST_CASE("OutputSet: every output appears at the commit, none when the set is dropped") {
  const foremoe_test::TempDir dir;
  const fs::path a = dir.path / "a.json", b = dir.path / "b.json";
  files::write_text(a, "old a");
  {
    files::OutputSet set;
    set.add_text(a, "new a");
    set.add_text(b, "new b");
    CHECK(slurp(a) == "old a"); // staged, not yet in place
    CHECK_FALSE(fs::exists(b));
  } // dropped without a commit: an error on the way
  CHECK(slurp(a) == "old a");
  CHECK(listing(dir.path) == std::vector<std::string>{"a.json"}); // no temporary file left
  files::OutputSet set;
  set.add_text(a, "new a");
  set.add_text(b, "new b");
  set.commit();
  CHECK(slurp(a) == "new a");
  CHECK(slurp(b) == "new b");
  CHECK(listing(dir.path) == std::vector<std::string>{"a.json", "b.json"});
}

TEST_CASE("OutputSet: a folder target or a missing folder is refused naming the target, and nothing is left") {
  const foremoe_test::TempDir dir;
  files::OutputSet set;
  set.add_text(dir.path / "a.json", "a");
  CHECK_THROWS_WITH_AS(set.add_text(dir.path, "x"), doctest::Contains("is a folder, not a file"), Error);
  CHECK_THROWS_WITH_AS(set.add_text(dir.path / "no" / "x.json", "x"), doctest::Contains("x.json"), Error);
}

#if defined(__unix__)
TEST_CASE("OutputSet: a device is written in place and stays a device; a failed in-place write renames nothing") {
  const foremoe_test::TempDir dir;
  files::write_text("/dev/null", "discarded");
  struct stat st {};
  REQUIRE(::stat("/dev/null", &st) == 0);
  CHECK(S_ISCHR(st.st_mode));
  if (!fs::exists("/dev/full")) return;
  files::OutputSet set;
  set.add_text(dir.path / "plan.json", "plan");
  set.add_text("/dev/full", "placement");
  CHECK_THROWS_WITH_AS(set.commit(), doctest::Contains("No space left on device"), Error);
  REQUIRE(::stat("/dev/full", &st) == 0);
  CHECK(S_ISCHR(st.st_mode));
  CHECK_FALSE(fs::exists(dir.path / "plan.json")); // the in-place write failed first: nothing was renamed
}

TEST_CASE("OutputSet: an in-place target gets what the writer wrote at add, though its source changed since") {
  const foremoe_test::TempDir dir;
  const fs::path fifo = dir.path / "out";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  std::string got;
  std::thread reader([&] { got = slurp(fifo); }); // blocks until the commit opens the FIFO for writing
  files::OutputSet set;
  {
    std::string text(100000, 'a');
    set.add_text(fifo, text);
    std::fill(text.begin(), text.end(), 'b'); // then freed: the commit must not read it
  }
  set.commit();
  reader.join();
  CHECK(got == std::string(100000, 'a'));
  CHECK(fs::is_fifo(fifo));
}

TEST_CASE("OutputSet: a link is written through, and stays a link") {
  const foremoe_test::TempDir dir;
  files::write_text(dir.path / "target.json", "old");
  fs::create_symlink("target.json", dir.path / "link.json");
  files::write_text(dir.path / "link.json", "new");
  CHECK(fs::is_symlink(dir.path / "link.json"));
  CHECK(slurp(dir.path / "target.json") == "new");
}
#endif

TEST_CASE("same_file: links, dots and hard links resolved; outputs that do not exist yet compared by path") {
  const foremoe_test::TempDir dir;
  const fs::path f = dir.path / "x.npy";
  files::write_text(f, "x");
  CHECK(files::same_file(f, dir.path / "." / "x.npy"));
  fs::create_hard_link(f, dir.path / "hard.npy");
  CHECK(files::same_file(f, dir.path / "hard.npy"));
  CHECK(files::same_file(dir.path / "new.npy", dir.path / "sub" / ".." / "new.npy"));
  CHECK_FALSE(files::same_file(f, dir.path / "new.npy"));
}

TEST_CASE("json: the duplicate-key check stays linear and still finds the duplicate, in small and large objects") {
  std::mt19937_64 rng(7);
  for (const int n : {2, 15, 16, 17, 1000, 100000}) {
    std::string doc = "{";
    for (int i = 0; i < n; ++i)
      doc += "\"k" + std::to_string(i) + "\": " + std::to_string(i) + ", ";
    const int dup = static_cast<int>(rng() % static_cast<unsigned>(n));
    CHECK_NOTHROW((void)json::parse(doc + "\"end\": 0}"));
    const std::string want = "duplicate key 'k" + std::to_string(dup) + "'";
    CHECK_THROWS_WITH_AS((void)json::parse(doc + "\"k" + std::to_string(dup) + "\": 1}"),
                         doctest::Contains(want.c_str()), Error);
  }
}

TEST_CASE("messages cut a huge quoted value to its start and length") {
  const std::string big(std::size_t{10'000'000}, 'x'); // NOLINT(bugprone-string-constructor): a 10 MB key
  try {
    (void)json::parse("{\"" + big + "\": 1, \"" + big + "\": 2}");
    FAIL("no error");
  } catch (const Error &e) {
    const std::string what = e.what();
    CHECK(what.size() < 2000);
    CHECK(what.find("[10000000 characters]") != std::string::npos);
  }
}
