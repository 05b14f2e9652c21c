#pragma once
// Shared helpers for the tests: seeds and the reference-data folder.

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>

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

} // namespace foremoe_test
