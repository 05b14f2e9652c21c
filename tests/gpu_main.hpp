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

} // namespace foremoe_test
