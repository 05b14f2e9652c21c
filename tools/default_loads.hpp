#pragma once
// The default batch's loads, built into the program (default_loads.cpp) so that `foremoe simulate` and Python's
// `simulate()` do not generate them on their first run.

#include <span>

namespace foremoe::cli {

/// The packed entry (foremoe/trace/packed_loads.hpp) of the default batch's loads, as tools/default_loads.bin held
/// it at build time; empty where the build embeds none (a non-ELF target), which only means generating them.
[[nodiscard]] std::span<const unsigned char> default_loads() noexcept;

} // namespace foremoe::cli
