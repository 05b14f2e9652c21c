#pragma once
// Shared helpers for the tests: seeds and the reference-data folder.

#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <system_error>

/// Checks that `expr` throws `foremoe::Error` (foremoe/core/error.hpp, included by the test) with `text` in its
/// message.
#define CHECK_ERROR_CONTAINS(expr, text) CHECK_THROWS_WITH_AS(expr, doctest::Contains(text), ::foremoe::Error)

namespace foremoe_test {

/// Multiplier for property-test iteration counts: FOREMOE_TEST_SEEDS=10 runs ten times as many.
inline int seed_multiplier() {
  const char *s = std::getenv("FOREMOE_TEST_SEEDS");
  if (s == nullptr) return 1;
  const int v = std::atoi(s);
  return v > 0 ? v : 1;
}

/// The shared/data folder given by FOREMOE_DATA_DIR (set by CTest), or empty.
inline std::filesystem::path data_dir() {
  const char *s = std::getenv("FOREMOE_DATA_DIR");
  if (s == nullptr || !std::filesystem::exists(s)) return {};
  return s;
}

/// How many reference-data lookups of this executable found nothing; doctest_main.cpp exits 77
/// (CTest's SKIP_RETURN_CODE) when it is non-zero and nothing failed, so a run without data never reads as
/// "passed".
inline int &data_skips() {
  static int n = 0;
  return n;
}

/// `rel` (a file or folder) under the reference-data folder, or empty after recording a skip: callers
/// `return` from the test case on empty.
inline std::filesystem::path data_path(const std::filesystem::path &rel) {
  const auto dir = data_dir();
  if (dir.empty()) {
    MESSAGE("FOREMOE_DATA_DIR unset or missing: skipped (needs ", rel.string(), ")");
  } else if (!std::filesystem::exists(dir / rel)) {
    MESSAGE("no ", rel.string(), " under ", dir.string(), ": skipped");
  } else {
    return dir / rel;
  }
  ++data_skips();
  return {};
}

/// A fresh folder under the system's temporary folder, removed with everything in it at scope exit.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string &prefix = "foremoe_test_") {
    path = std::filesystem::temp_directory_path() / (prefix + std::to_string(std::random_device{}()));
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir &) = delete;
  TempDir &operator=(const TempDir &) = delete;
};

} // namespace foremoe_test
