#pragma once
// Command-line options shared by every command that generates a synthetic trace.

#include <vector>

#include "command.hpp"
#include "foremoe/trace/synthetic.hpp"

namespace foremoe::cli {

/// The options that shape a synthetic GRPO trace.
std::vector<OptionSpec> synthetic_options(const SyntheticConfig &defaults);
/// Builds the config from `--preset` and the overrides in `a`, starting from `c`.
SyntheticConfig synthetic_config(const Args &a, SyntheticConfig c);

} // namespace foremoe::cli
