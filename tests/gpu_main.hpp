#pragma once
// The main of the GPU tests that need one device: runs the doctest cases where a CUDA device is present, else
// exits 77 (reported as skipped by CTest).

#include <doctest/doctest.h>

#include <cstdio>

#include "foremoe/runtime/runtime.hpp"

namespace foremoe_test {

inline int gpu_test_main(int argc, char **argv) {
  const foremoe::runtime::BuildInfo info = foremoe::runtime::build_info();
  if (info.num_devices == 0) {
    std::printf("skipped: no CUDA device (cuda compiled: %d)\n", int(info.cuda_compiled));
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}

/// The same for a test program that needs more: its cases were compiled (`built`, e.g. NCCL was found) and at
/// least `min_devices` devices are present; else it says what `name` needs and exits 77.
inline int gpu_test_main(int argc, char **argv, const char *name, const char *needs, bool built, int min_devices) {
  if (!built || foremoe::runtime::build_info().num_devices < min_devices) {
    std::printf("%s: needs %s, skipped\n", name, needs);
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}

} // namespace foremoe_test
