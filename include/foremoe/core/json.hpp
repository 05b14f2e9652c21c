#pragma once
/// @file
/// A small strict JSON value, parser and writer: the one JSON code of the library (config files, placement
/// files and every output document). Objects keep their key order; duplicate keys, trailing garbage, NaN and
/// comments are errors; numbers remember whether they were written as integers (int64, range checked) or not;
/// parse errors name `source:line:column`. The writer emits keys in stored order and doubles in the shortest
/// form that reads back equal, so documents are stable and round-trip.

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <variant>
#include <vector>

#include "foremoe/core/error.hpp"

namespace foremoe {
inline namespace v0 {
namespace json {

class Value;
using Array = std::vector<Value>;
using Member = std::pair<std::string, Value>;
/// An object: members in the order written (or inserted).
using Object = std::vector<Member>;

/// The kinds of a JSON value; `integer` and `number` are both JSON numbers, told apart by how they were written.
enum class Kind { null, boolean, integer, number, string, array, object };

[[nodiscard]] inline std::string_view kind_name(Kind k) noexcept {
  switch (k) {
  case Kind::null: return "null";
  case Kind::boolean: return "a bool";
  case Kind::integer: return "an integer";
  case Kind::number: return "a number";
  case Kind::string: return "a string";
  case Kind::array: return "an array";
  case Kind::object: return "an object";
  }
  return "?";
}

/// One JSON value.
class Value {
public:
  Value() = default;
  Value(std::nullptr_t) {}
  Value(bool b) : v_(b) {}
  Value(int i) : v_(static_cast<std::int64_t>(i)) {}
  Value(long i) : v_(static_cast<std::int64_t>(i)) {}
  Value(long long i) : v_(static_cast<std::int64_t>(i)) {}
  Value(unsigned i) : v_(static_cast<std::int64_t>(i)) {}
  Value(unsigned long i) : v_(checked_unsigned(i)) {}
  Value(unsigned long long i) : v_(checked_unsigned(i)) {}
  Value(double d) : v_(d) {}
  Value(const char *s) : v_(std::string(s)) {}
  Value(std::string s) : v_(std::move(s)) {}
  Value(std::string_view s) : v_(std::string(s)) {}
  Value(Array a) : v_(std::move(a)) {}
  Value(Object o) : v_(std::move(o)) {}
  template <class T> Value(const std::vector<T> &xs) : v_(Array(xs.begin(), xs.end())) {}

  [[nodiscard]] Kind kind() const noexcept { return static_cast<Kind>(v_.index()); }
  [[nodiscard]] bool is_null() const noexcept { return kind() == Kind::null; }
  [[nodiscard]] bool is_bool() const noexcept { return kind() == Kind::boolean; }
  [[nodiscard]] bool is_integer() const noexcept { return kind() == Kind::integer; }
  /// Any JSON number (integer or not).
  [[nodiscard]] bool is_number() const noexcept { return kind() == Kind::integer || kind() == Kind::number; }
  [[nodiscard]] bool is_string() const noexcept { return kind() == Kind::string; }
  [[nodiscard]] bool is_array() const noexcept { return kind() == Kind::array; }
  [[nodiscard]] bool is_object() const noexcept { return kind() == Kind::object; }

  [[nodiscard]] bool as_bool() const { return std::get<bool>(v_); }
  [[nodiscard]] std::int64_t as_integer() const { return std::get<std::int64_t>(v_); }
  /// The number as a double (integers converted).
  [[nodiscard]] double as_double() const {
    return is_integer() ? static_cast<double>(as_integer()) : std::get<double>(v_);
  }
  [[nodiscard]] const std::string &as_string() const { return std::get<std::string>(v_); }
  [[nodiscard]] const Array &as_array() const { return std::get<Array>(v_); }
  [[nodiscard]] Array &as_array() { return std::get<Array>(v_); }
  [[nodiscard]] const Object &as_object() const { return std::get<Object>(v_); }
  [[nodiscard]] Object &as_object() { return std::get<Object>(v_); }

  /// The member `key` of an object, or null when absent.
  [[nodiscard]] const Value *find(std::string_view key) const {
    if (!is_object()) return nullptr;
    for (const auto &[k, v] : as_object())
      if (k == key) return &v;
    return nullptr;
  }
  /// The member `key`, appended (null) when absent; the value becomes an object if it was null.
  Value &operator[](std::string_view key) {
    if (is_null()) v_ = Object{};
    Object &o = as_object();
    for (auto &[k, v] : o)
      if (k == key) return v;
    o.emplace_back(std::string(key), Value());
    return o.back().second;
  }
  /// Appends to an array (a null value becomes an empty array first).
  void push_back(Value v) {
    if (is_null()) v_ = Array{};
    as_array().push_back(std::move(v));
  }

  friend bool operator==(const Value &a, const Value &b) = default;

private:
  template <class U> static std::int64_t checked_unsigned(U u) {
    detail::require(u <= static_cast<U>(INT64_MAX), "json: unsigned value ", u, " does not fit int64");
    return static_cast<std::int64_t>(u);
  }
  std::variant<std::nullptr_t, bool, std::int64_t, double, std::string, Array, Object> v_;
};

namespace detail {

/// Recursive-descent parser; depth is bounded so that malformed input cannot overflow the stack.
class Parser {
public:
  Parser(std::string_view text, std::string_view source) : s_(text), source_(source) {}

  Value document() {
    skip_ws();
    Value v = value(0);
    skip_ws();
    if (pos_ != s_.size()) fail("unexpected '", printable(s_[pos_]), "' after the JSON value");
    return v;
  }

private:
  static constexpr int max_depth = 256;

  template <class... A> [[noreturn]] void fail(const A &...parts) const {
    std::size_t line = 1, col = 1;
    for (std::size_t i = 0; i < pos_ && i < s_.size(); ++i) {
      if (s_[i] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    foremoe::detail::fail(source_, ":", line, ":", col, ": ", parts...);
  }
  static std::string printable(char c) {
    if (static_cast<unsigned char>(c) >= 0x20 && static_cast<unsigned char>(c) < 0x7f) return std::string(1, c);
    char buf[8];
    std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned char>(c));
    return buf;
  }
  void skip_ws() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
      ++pos_;
  }
  bool eof() const { return pos_ >= s_.size(); }
  void expect_word(std::string_view w) {
    if (s_.substr(pos_, w.size()) != w) fail("invalid literal (expected ", w, ")");
    pos_ += w.size();
  }

  Value value(int depth) {
    if (depth > max_depth) fail("nesting deeper than ", max_depth);
    if (eof()) fail("unexpected end of input");
    const char c = s_[pos_];
    switch (c) {
    case '{': return object(depth);
    case '[': return array(depth);
    case '"': return Value(string());
    case 't': expect_word("true"); return Value(true);
    case 'f': expect_word("false"); return Value(false);
    case 'n': expect_word("null"); return Value(nullptr);
    default:
      if (c == '-' || (c >= '0' && c <= '9')) return number();
      fail("unexpected '", printable(c), "'");
    }
  }

  Value object(int depth) {
    ++pos_;
    Object o;
    skip_ws();
    if (!eof() && s_[pos_] == '}') {
      ++pos_;
      return Value(std::move(o));
    }
    // Duplicate keys: a linear scan while the object is small, a hash set of the keys seen once it is not (an
    // object of 100k keys would otherwise take quadratic time).
    constexpr std::size_t scan_up_to = 16;
    std::unordered_set<std::string> seen;
    for (;;) {
      skip_ws();
      if (eof() || s_[pos_] != '"') fail("expected a string key");
      const std::size_t key_pos = pos_;
      std::string key = string();
      bool duplicate = false;
      if (o.size() < scan_up_to) {
        for (const auto &m : o)
          duplicate = duplicate || m.first == key;
      } else {
        if (seen.empty())
          for (const auto &m : o)
            seen.insert(m.first);
        duplicate = !seen.insert(key).second;
      }
      if (duplicate) {
        pos_ = key_pos;
        fail("duplicate key '", key, "'");
      }
      skip_ws();
      if (eof() || s_[pos_] != ':') fail("expected ':' after key '", key, "'");
      ++pos_;
      skip_ws();
      Value v = value(depth + 1);
      o.emplace_back(std::move(key), std::move(v));
      skip_ws();
      if (eof()) fail("unexpected end of input in an object");
      if (s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (s_[pos_] == '}') {
        ++pos_;
        return Value(std::move(o));
      }
      fail("expected ',' or '}' in an object");
    }
  }

  Value array(int depth) {
    ++pos_;
    Array a;
    skip_ws();
    if (!eof() && s_[pos_] == ']') {
      ++pos_;
      return Value(std::move(a));
    }
    for (;;) {
      skip_ws();
      a.push_back(value(depth + 1));
      skip_ws();
      if (eof()) fail("unexpected end of input in an array");
      if (s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (s_[pos_] == ']') {
        ++pos_;
        return Value(std::move(a));
      }
      fail("expected ',' or ']' in an array");
    }
  }

  unsigned hex4() {
    if (s_.size() - pos_ < 4) fail("truncated \\u escape");
    unsigned u = 0;
    for (int i = 0; i < 4; ++i) {
      const char h = s_[pos_++];
      u <<= 4;
      if (h >= '0' && h <= '9')
        u |= static_cast<unsigned>(h - '0');
      else if (h >= 'a' && h <= 'f')
        u |= static_cast<unsigned>(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F')
        u |= static_cast<unsigned>(h - 'A' + 10);
      else
        fail("bad hex digit in a \\u escape");
    }
    return u;
  }
  static void append_utf8(std::string &out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xc0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xe0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    }
  }

  std::string string() {
    ++pos_; // opening quote
    std::string out;
    for (;;) {
      if (eof()) fail("unterminated string");
      const char c = s_[pos_];
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (static_cast<unsigned char>(c) < 0x20) fail("control character ", printable(c), " in a string");
      if (c != '\\') {
        out += c;
        ++pos_;
        continue;
      }
      ++pos_;
      if (eof()) fail("unterminated string");
      const char e = s_[pos_++];
      switch (e) {
      case '"': out += '"'; break;
      case '\\': out += '\\'; break;
      case '/': out += '/'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'n': out += '\n'; break;
      case 'r': out += '\r'; break;
      case 't': out += '\t'; break;
      case 'u': {
        unsigned cp = hex4();
        if (cp >= 0xd800 && cp < 0xdc00) {
          if (s_.substr(pos_, 2) != "\\u") fail("unpaired surrogate in a \\u escape");
          pos_ += 2;
          const unsigned lo = hex4();
          if (lo < 0xdc00 || lo >= 0xe000) fail("unpaired surrogate in a \\u escape");
          cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
        } else if (cp >= 0xdc00 && cp < 0xe000) {
          fail("unpaired surrogate in a \\u escape");
        }
        append_utf8(out, cp);
        break;
      }
      default: --pos_; fail("bad escape '\\", printable(e), "'");
      }
    }
  }

  Value number() {
    const std::size_t start = pos_;
    bool integral = true;
    if (s_[pos_] == '-') ++pos_;
    if (eof() || !(s_[pos_] >= '0' && s_[pos_] <= '9')) fail("bad number");
    if (s_[pos_] == '0') {
      ++pos_;
    } else {
      while (!eof() && s_[pos_] >= '0' && s_[pos_] <= '9')
        ++pos_;
    }
    if (!eof() && s_[pos_] == '.') {
      integral = false;
      ++pos_;
      if (eof() || !(s_[pos_] >= '0' && s_[pos_] <= '9')) fail("bad number: digits must follow '.'");
      while (!eof() && s_[pos_] >= '0' && s_[pos_] <= '9')
        ++pos_;
    }
    if (!eof() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      integral = false;
      ++pos_;
      if (!eof() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (eof() || !(s_[pos_] >= '0' && s_[pos_] <= '9')) fail("bad number: digits must follow the exponent");
      while (!eof() && s_[pos_] >= '0' && s_[pos_] <= '9')
        ++pos_;
    }
    const std::string_view text = s_.substr(start, pos_ - start);
    if (integral) {
      std::int64_t i = 0;
      const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), i);
      if (ec != std::errc() || p != text.data() + text.size()) {
        pos_ = start;
        fail("integer ", text, " is outside the int64 range");
      }
      return Value(i);
    }
    // strtod, not from_chars: the parse must not depend on the locale, and strtod with "C" digits and '.' is
    // what every libc does; the text was validated above.
    const std::string t(text);
    const double d = std::strtod(t.c_str(), nullptr);
    if (!std::isfinite(d)) {
      pos_ = start;
      fail("number ", text, " is outside the double range");
    }
    return Value(d);
  }

  std::string_view s_;
  std::string_view source_;
  std::size_t pos_ = 0;
};

inline void write_string(std::string &out, std::string_view s) {
  out += '"';
  for (const char c : s) {
    switch (c) {
    case '"': out += "\\\""; break;
    case '\\': out += "\\\\"; break;
    case '\n': out += "\\n"; break;
    case '\r': out += "\\r"; break;
    case '\t': out += "\\t"; break;
    case '\b': out += "\\b"; break;
    case '\f': out += "\\f"; break;
    default:
      if (static_cast<unsigned char>(c) < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned char>(c));
        out += buf;
      } else {
        out += c;
      }
    }
  }
  out += '"';
}

} // namespace detail

/// The shortest decimal form of `d` that reads back equal (at most 17 significant digits), with ".0" added
/// to integral values so that they read back as non-integers. Non-finite values have no JSON form: "null".
[[nodiscard]] inline std::string format_double(double d) {
  if (!std::isfinite(d)) return "null";
  char buf[48];
  int prec = 1;
  for (; prec < 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*e", prec - 1, d);
    if (std::strtod(buf, nullptr) == d) break;
  }
  std::snprintf(buf, sizeof buf, "%.*e", prec - 1, d);
  // Fixed notation for decimal exponents in [-5, 17) (as JavaScript and Python print), scientific beyond.
  const int exp10 = std::atoi(std::strchr(buf, 'e') + 1);
  if (exp10 >= -5 && exp10 < 17) std::snprintf(buf, sizeof buf, "%.*f", std::max(0, prec - 1 - exp10), d);
  std::string s(buf);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

/// Parses one JSON document; errors name `source:line:column`.
[[nodiscard]] inline Value parse(std::string_view text, std::string_view source = "json") {
  return detail::Parser(text, source).document();
}

/// Writes `v` to `out`: compact when `indent` < 0, else pretty with `indent` spaces per level (arrays of
/// scalars stay on one line so that long number lists remain readable).
inline void write(std::string &out, const Value &v, int indent = -1, int level = 0) {
  auto newline = [&](int lvl) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<std::size_t>(indent) * static_cast<std::size_t>(lvl), ' ');
  };
  switch (v.kind()) {
  case Kind::null: out += "null"; break;
  case Kind::boolean: out += v.as_bool() ? "true" : "false"; break;
  case Kind::integer: out += std::to_string(v.as_integer()); break;
  case Kind::number: out += format_double(v.as_double()); break;
  case Kind::string: detail::write_string(out, v.as_string()); break;
  case Kind::array: {
    const Array &a = v.as_array();
    bool scalars = true;
    for (const Value &x : a)
      scalars = scalars && !x.is_array() && !x.is_object();
    out += '[';
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (i > 0) out += indent >= 0 && scalars ? ", " : ",";
      if (!scalars) newline(level + 1);
      write(out, a[i], indent, level + 1);
    }
    if (!scalars && !a.empty()) newline(level);
    out += ']';
    break;
  }
  case Kind::object: {
    const Object &o = v.as_object();
    out += '{';
    for (std::size_t i = 0; i < o.size(); ++i) {
      if (i > 0) out += ',';
      newline(level + 1);
      detail::write_string(out, o[i].first);
      out += indent >= 0 ? ": " : ":";
      write(out, o[i].second, indent, level + 1);
    }
    if (!o.empty()) newline(level);
    out += '}';
    break;
  }
  }
}

/// `v` as text (see `write`).
[[nodiscard]] inline std::string dump(const Value &v, int indent = -1) {
  std::string s;
  write(s, v, indent);
  return s;
}

} // namespace json
} // namespace v0
} // namespace foremoe
