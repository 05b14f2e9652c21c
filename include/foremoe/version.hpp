#pragma once
/// @file
/// Library version.

#define FOREMOE_VERSION_MAJOR 0
#define FOREMOE_VERSION_MINOR 1
#define FOREMOE_VERSION_PATCH 0

namespace foremoe {
inline namespace v0 {
/// "major.minor.patch" of the headers in use.
inline constexpr const char *version_string = "0.1.0";
} // namespace v0
} // namespace foremoe
