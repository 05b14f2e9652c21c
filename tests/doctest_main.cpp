// The one doctest main of the test executables: like doctest's own, but a run in which a test case skipped
// for missing reference data (foremoe_test::data_path) and nothing failed exits 77, which CTest reports as
// skipped (SKIP_RETURN_CODE), not passed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "test_support.hpp"

int main(int argc, char **argv) {
  doctest::Context context(argc, argv);
  const int rc = context.run();
  if (context.shouldExit() || rc != 0) return rc;
  if (foremoe_test::data_skips() > 0) {
    std::fprintf(stderr, "%d reference-data file(s) missing (FOREMOE_DATA_DIR): test cases skipped, exit 77\n",
                 foremoe_test::data_skips());
    return 77;
  }
  return 0;
}
