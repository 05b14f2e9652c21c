#pragma once
/// @file
/// Library version. The one version number is `project(foremoe VERSION ...)` in the root CMakeLists.txt; this
/// file is checked in so that a copy of include/ compiles without CMake, and every configure (the root build and
/// the Python extension's) fails if the two differ (cmake/ForemoeHeaders.cmake).

#define FOREMOE_VERSION_MAJOR 0
#define FOREMOE_VERSION_MINOR 1
#define FOREMOE_VERSION_PATCH 0

namespace foremoe {
inline namespace v0 {
/// "major.minor.patch" of the headers in use.
inline constexpr const char *version_string = "0.1.0";
} // namespace v0
} // namespace foremoe
