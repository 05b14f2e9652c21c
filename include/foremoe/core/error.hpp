#pragma once
/// @file
/// The single exception type of the algorithm library and helpers that build
/// messages naming the offending value.

#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
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

/// The most characters of one string a message quotes: a 100 MB key, string or number in an input is cut to its
/// start and its length, so that a message stays readable and small.
inline constexpr std::size_t max_quoted_chars = 1024;

/// `s`, or its first 200 characters and its length when it is longer than `max_quoted_chars`.
[[nodiscard]] inline std::string cut_quote(std::string_view s) {
  if (s.size() <= max_quoted_chars) return std::string(s);
  return std::string(s.substr(0, 200)) + "... [" + std::to_string(s.size()) + " characters]";
}

/// A message part as written: strings cut by `cut_quote`, everything else as it is.
template <class P> decltype(auto) message_part(const P &p) {
  if constexpr (std::is_convertible_v<const P &, std::string_view>)
    return cut_quote(std::string_view(p));
  else
    return (p);
}

template <class... Parts> [[nodiscard]] std::string concat(Parts &&...parts) {
  std::ostringstream os;
  (os << ... << message_part(parts));
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

/// The value of the enum `E` whose name is `name`, `names[i]` naming the value `i`; throws `Error` "`who` must be
/// one of a, b, c, got 'name'". The one parser behind each enum's `parse_...` (packing, token-map rule).
template <class E>
[[nodiscard]] E enum_from_name(std::span<const std::string_view> names, std::string_view name, std::string_view who) {
  std::string list;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (name == names[i]) return static_cast<E>(i);
    list.append(i == 0 ? "" : ", ").append(names[i]);
  }
  throw Error(std::string(who) + " must be one of " + list + ", got '" + std::string(name) + "'");
}

} // namespace detail
} // namespace v0
} // namespace foremoe
