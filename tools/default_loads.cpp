// tools/default_loads.bin is assembled into the program's read-only data as it is: no generated source, no
// dependency, no compile time. tests/test_default_loads.cpp regenerates it and compares, so it cannot drift from
// the generator; cmake/ForemoeDefaultLoads.cmake passes its path and rebuilds this file when it changes.

#include "default_loads.hpp"

#if defined(__ELF__) && defined(FOREMOE_DEFAULT_LOADS_FILE)
// Hidden, so that the Python extension does not export them.
__asm__(".pushsection .rodata.foremoe_default_loads,\"a\",@progbits\n"
        ".balign 8\n"
        ".globl foremoe_default_loads_begin\n"
        ".hidden foremoe_default_loads_begin\n"
        "foremoe_default_loads_begin:\n"
        ".incbin \"" FOREMOE_DEFAULT_LOADS_FILE "\"\n"
        ".globl foremoe_default_loads_end\n"
        ".hidden foremoe_default_loads_end\n"
        "foremoe_default_loads_end:\n"
        ".popsection\n");
extern "C" {
extern const unsigned char foremoe_default_loads_begin[];
extern const unsigned char foremoe_default_loads_end[];
}
#endif

namespace foremoe::cli {

std::span<const unsigned char> default_loads() noexcept {
#if defined(__ELF__) && defined(FOREMOE_DEFAULT_LOADS_FILE)
  return {foremoe_default_loads_begin, foremoe_default_loads_end};
#else
  return {};
#endif
}

} // namespace foremoe::cli
