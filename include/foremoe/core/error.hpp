#pragma once
/// @file
/// The single exception type of the algorithm library and helpers that build
/// messages naming the offending value.

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace foremoe {
inline namespace v0 {

/// Thrown by every validation in the header-only library; `what()` names the
/// offending value and, where it helps, the valid range.
class Error : public std::runtime_error {
public:
  using std::runtime_error::runtime_error;
};

namespace detail {

template <class... Parts> [[nodiscard]] std::string concat(Parts &&...parts) {
  std::ostringstream os;
  (os << ... << std::forward<Parts>(parts));
  return os.str();
}

/// Throws `Error` with the concatenation of `parts`.
template <class... Parts> [[noreturn]] void fail(Parts &&...parts) {
  throw Error(concat(std::forward<Parts>(parts)...));
}

/// Throws unless `cond`; the message is only built on failure.
template <class... Parts> void require(bool cond, Parts &&...parts) {
  if (!cond) [[unlikely]]
    fail(std::forward<Parts>(parts)...);
}

} // namespace detail
} // namespace v0
} // namespace foremoe
