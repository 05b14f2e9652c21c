#pragma once
/// @file
/// One description of every option of a front end: JSON key path, command-line flag, type, default, range,
/// help text and the field of a settings struct it binds to. The JSON config reader, the command-line flags,
/// `--help`, `--print-config` and the Python bindings are all derived from it, so they cannot disagree.
///
/// Defaults are read from a default-constructed settings struct (one source). Values are checked strictly:
/// an integer option takes a JSON integer (never 3.7 or true) inside its range, checked before narrowing; a
/// number option takes any finite number inside its range; a bool takes true/false; a choice one of its
/// names. Messages name the place (`config.topology.slots`, or `--slots` on the command line), the range and
/// the value.

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/json.hpp"

namespace foremoe {
inline namespace v0 {
namespace config {

/// The type of an option's value.
enum class Type { integer, number, boolean, string, choice };

[[nodiscard]] inline std::string_view type_name(Type t) noexcept {
  switch (t) {
  case Type::integer: return "int";
  case Type::number: return "float";
  case Type::boolean: return "bool";
  case Type::string: return "string";
  case Type::choice: return "enum";
  }
  return "?";
}

/// A number as written in messages and help: the shortest round-trip form, integral values without ".0".
[[nodiscard]] inline std::string number_text(double d) {
  std::string s = json::format_double(d);
  if (s.size() > 2 && s.ends_with(".0")) s.resize(s.size() - 2);
  return s;
}

/// A value as written in messages: JSON text, numbers without a trailing ".0" for integral non-integers kept.
[[nodiscard]] inline std::string value_text(const json::Value &v) {
  std::string s = json::dump(v);
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

/// One option bound to a field of the settings struct `T`.
template <class T> struct Option {
  std::string key;  ///< JSON path inside the document, sections separated by '.', e.g. "topology.slots"
  std::string flag; ///< command-line flag without "--" (derived from the key unless given)
  Type type = Type::integer;
  std::string help;
  std::string metavar;                   ///< shown in --help (derived from the type unless given)
  std::int64_t int_min = 0, int_max = 0; ///< range of an integer option
  double min = 0, max = 0;               ///< range of a number option
  std::vector<std::string> choices;      ///< names of a choice option
  bool first = false; ///< applied before every other option of a document (a preset that resets the rest)
  std::function<json::Value(const T &)> get;
  std::function<void(T &, const json::Value &)> set; ///< gets a value that passed `check`

  /// The last path component ("slots" of "topology.slots").
  [[nodiscard]] std::string_view name() const {
    const auto dot = key.rfind('.');
    return dot == std::string::npos ? std::string_view(key) : std::string_view(key).substr(dot + 1);
  }
  /// "[lo, hi]" for numbers, "a|b|c" for choices, "" otherwise.
  [[nodiscard]] std::string range_text() const {
    if (type == Type::integer) return "[" + std::to_string(int_min) + ", " + std::to_string(int_max) + "]";
    if (type == Type::number) return "[" + number_text(min) + ", " + number_text(max) + "]";
    if (type == Type::choice) {
      std::string s;
      for (const auto &c : choices)
        s += (s.empty() ? "" : ", ") + c;
      return s;
    }
    return "";
  }
};

/// Joins a place and a message: "config.a.b: message", or "--flag message" for command-line flags (whose
/// messages read as sentences: "--slots must be in [1, 16384], got 0").
[[nodiscard]] inline std::string at(std::string_view where, std::string_view message) {
  return std::string(where) + (where.starts_with("--") ? " " : ": ") + std::string(message);
}

/// The options of one front end over the settings struct `T`.
template <class T> class Schema {
public:
  Schema(std::string name, std::vector<Option<T>> options) : name_(std::move(name)), options_(std::move(options)) {
    for (auto &o : options_) {
      detail::require(!o.key.empty() && o.get && o.set, "schema ", name_, ": option without key or binding");
      for (const auto &p : options_)
        detail::require(&p == &o || p.key != o.key, "schema ", name_, ": duplicate key '", o.key, "'");
      if (o.flag.empty()) {
        // The last component names the flag unless another option shares it; then the whole path does.
        bool shared = false;
        for (const auto &p : options_)
          shared = shared || (&p != &o && p.name() == o.name());
        o.flag = std::string(shared ? std::string_view(o.key) : o.name());
        std::replace(o.flag.begin(), o.flag.end(), '_', '-');
        std::replace(o.flag.begin(), o.flag.end(), '.', '-');
      }
      if (o.metavar.empty())
        o.metavar = o.type == Type::integer   ? "N"
                    : o.type == Type::number  ? "X"
                    : o.type == Type::boolean ? ""
                                              : "NAME";
    }
    for (const auto &o : options_)
      for (const auto &p : options_)
        detail::require(&p == &o || (p.flag != o.flag && p.flag != "no-" + o.flag), "schema ", name_, ": flag --",
                        o.flag, " is given to two options");
  }

  [[nodiscard]] const std::string &name() const noexcept { return name_; }
  [[nodiscard]] std::span<const Option<T>> options() const noexcept { return options_; }

  [[nodiscard]] const Option<T> *find_key(std::string_view key) const {
    for (const auto &o : options_)
      if (o.key == key) return &o;
    return nullptr;
  }
  [[nodiscard]] const Option<T> *find_flag(std::string_view flag) const {
    for (const auto &o : options_)
      if (o.flag == flag) return &o;
    return nullptr;
  }
  [[nodiscard]] const Option<T> &key(std::string_view k) const {
    const Option<T> *o = find_key(k);
    detail::require(o != nullptr, "schema ", name_, ": no option '", k, "'");
    return *o;
  }

  /// The value `v` checked against `o` (integers accepted for number options, as doubles); throws `Error`
  /// naming `where`, the range and the value.
  [[nodiscard]] json::Value check(const Option<T> &o, const json::Value &v, std::string_view where) const {
    auto bad_type = [&](std::string_view want) {
      detail::fail(at(where, "expected " + std::string(want) + ", got " + value_text(v)));
    };
    switch (o.type) {
    case Type::integer: {
      if (!v.is_integer()) bad_type("an integer");
      const std::int64_t i = v.as_integer();
      if (i < o.int_min || i > o.int_max)
        detail::fail(at(where, "must be in " + o.range_text() + ", got " + std::to_string(i)));
      return v;
    }
    case Type::number: {
      if (!v.is_number()) bad_type("a number");
      const double d = v.as_double();
      if (!(d >= o.min && d <= o.max))
        detail::fail(at(where, "must be in " + o.range_text() + ", got " + number_text(d)));
      return json::Value(d);
    }
    case Type::boolean:
      if (!v.is_bool()) bad_type("true or false");
      return v;
    case Type::string:
      if (!v.is_string()) bad_type("a string");
      return v;
    case Type::choice:
      if (!v.is_string()) bad_type("a string");
      if (std::find(o.choices.begin(), o.choices.end(), v.as_string()) == o.choices.end())
        detail::fail(at(where, "must be one of " + o.range_text() + ", got '" + v.as_string() + "'"));
      return v;
    }
    return v;
  }

  /// Checks `v` and stores it; an error of the binding (e.g. an unknown strategy) is reported at `where`.
  void apply(T &t, const Option<T> &o, const json::Value &v, std::string_view where) const {
    const json::Value c = check(o, v, where);
    try {
      o.set(t, c);
    } catch (const Error &e) {
      detail::fail(at(where, e.what()));
    }
  }

  /// A command-line value as a JSON value of `o`'s type; throws `Error` ("--slots expects an integer, got 'x'").
  [[nodiscard]] static json::Value from_text(const Option<T> &o, std::string_view text) {
    const std::string where = "--" + o.flag;
    switch (o.type) {
    case Type::integer: {
      std::int64_t i = 0;
      const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), i);
      if (text.empty() || ec != std::errc() || p != text.data() + text.size())
        detail::fail(where, " expects an integer, got '", text, "'");
      return json::Value(i);
    }
    case Type::number: {
      double d = 0;
      const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), d);
      if (text.empty() || ec != std::errc() || p != text.data() + text.size() || !std::isfinite(d))
        detail::fail(where, " expects a number, got '", text, "'");
      return json::Value(d);
    }
    case Type::boolean:
      if (text == "true" || text == "1") return json::Value(true);
      if (text == "false" || text == "0") return json::Value(false);
      detail::fail(where, " expects true or false, got '", text, "'");
    case Type::string:
    case Type::choice: return json::Value(text);
    }
    return {};
  }

  /// Command-line flags as an override document (read it as a layer rooted "--"): each pair is a flag name
  /// without "--" and its text; a bool option `x` is given as ("x", "true") or ("no-x", anything). Throws
  /// `Error` naming the flag for unknown flags and bad values.
  [[nodiscard]] json::Value flags_document(std::span<const std::pair<std::string, std::string>> flags) const {
    json::Value doc = json::Object{};
    for (const auto &[flag, text] : flags) {
      const Option<T> *o = find_flag(flag);
      json::Value v;
      if (o == nullptr && flag.starts_with("no-") && (o = find_flag(flag.substr(3))) != nullptr &&
          o->type == Type::boolean) {
        v = json::Value(false);
      } else if (o == nullptr) {
        detail::fail("unknown option '--", flag, "'");
      } else {
        v = check(*o, from_text(*o, text), "--" + o->flag);
      }
      json::Value &dst = slot(doc, o->key);
      detail::require(dst.is_null(), "option --", o->flag, " given twice");
      dst = std::move(v);
    }
    return doc;
  }

  /// The settings of `t` as a document: every option, nested by section, in schema order.
  [[nodiscard]] json::Value write(const T &t) const {
    json::Value doc = json::Object{};
    for (const auto &o : options_)
      slot(doc, o.key) = o.get(t);
    return doc;
  }

  /// Applies documents in order (later ones win): each is `{doc, root}` where `root` names the document in
  /// messages ("config"), or a root starting with "--", whose members are then reported by flag (command-line
  /// overrides). Options marked `first` are applied from the last document that has them before anything else.
  /// Unknown keys, sections that are not objects and bad values are errors naming the place.
  struct Layer {
    const json::Value *doc;
    std::string root;
  };
  void read(T &t, std::span<const Layer> layers) const {
    std::vector<std::pair<const Option<T> *, const Layer *>> firsts;
    for (const Layer &l : layers) {
      detail::require(l.doc->is_object(), l.root, ": expected an object, got ", value_text(*l.doc));
      walk(*l.doc, "", l, [&](const Option<T> &o, const json::Value &) {
        if (!o.first) return;
        for (auto &f : firsts)
          if (f.first == &o) {
            f.second = &l;
            return;
          }
        firsts.emplace_back(&o, &l);
      });
    }
    for (const auto &[o, l] : firsts)
      apply(t, *o, *lookup(*l->doc, o->key), where(*l, *o));
    for (const Layer &l : layers)
      walk(*l.doc, "", l, [&](const Option<T> &o, const json::Value &v) {
        if (!o.first) apply(t, o, v, where(l, o));
      });
  }
  /// One document named `root` over `t`.
  void read(T &t, const json::Value &doc, std::string root = "config") const {
    const Layer l{&doc, std::move(root)};
    read(t, std::span<const Layer>(&l, 1));
  }

  /// Every option described: `[{key, flag, type, default, min, max, choices, help}]` (defaults from `T{}`).
  [[nodiscard]] json::Value describe(const T &defaults = T{}) const {
    json::Value out = json::Array{};
    for (const auto &o : options_) {
      json::Value d;
      d["key"] = o.key;
      d["flag"] = o.flag;
      d["type"] = std::string(type_name(o.type));
      d["default"] = o.get(defaults);
      if (o.type == Type::integer) {
        d["min"] = o.int_min;
        d["max"] = o.int_max;
      } else if (o.type == Type::number) {
        d["min"] = o.min;
        d["max"] = o.max;
      }
      if (o.type == Type::choice) d["choices"] = o.choices;
      d["help"] = o.help;
      out.push_back(std::move(d));
    }
    return out;
  }

  /// The member at path `key` ("a.b.c") of `doc`, created (with its sections) when absent.
  static json::Value &slot(json::Value &doc, std::string_view key) {
    json::Value *v = &doc;
    std::size_t start = 0;
    for (;;) {
      const auto dot = key.find('.', start);
      v = &(*v)[key.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start)];
      if (dot == std::string_view::npos) return *v;
      start = dot + 1;
    }
  }

private:
  static const json::Value *lookup(const json::Value &doc, std::string_view key) {
    const json::Value *v = &doc;
    std::size_t start = 0;
    for (;;) {
      const auto dot = key.find('.', start);
      v = v->find(key.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start));
      if (v == nullptr || dot == std::string_view::npos) return v;
      start = dot + 1;
    }
  }
  static std::string where(const Layer &l, const Option<T> &o) {
    return l.root.starts_with("--") ? "--" + o.flag : l.root + "." + o.key;
  }
  bool is_section(std::string_view prefix) const {
    for (const auto &o : options_)
      if (o.key.size() > prefix.size() && std::string_view(o.key).starts_with(prefix) && o.key[prefix.size()] == '.')
        return true;
    return false;
  }
  template <class F> void walk(const json::Value &obj, const std::string &prefix, const Layer &l, F &&f) const {
    for (const auto &[k, v] : obj.as_object()) {
      std::string key = prefix;
      if (!key.empty()) key += '.';
      key += k;
      if (const Option<T> *o = find_key(key)) {
        f(*o, v);
      } else if (is_section(key)) {
        detail::require(v.is_object(), l.root, ".", key, ": expected an object, got ", value_text(v));
        walk(v, key, l, f);
      } else {
        std::string known;
        for (const auto &opt : options_)
          if (std::string_view(opt.key).starts_with(prefix.empty() ? "" : prefix + ".")) {
            std::string_view rest = std::string_view(opt.key).substr(prefix.empty() ? 0 : prefix.size() + 1);
            rest = rest.substr(0, rest.find('.'));
            if (known.find(std::string(rest) + ",") == std::string::npos && !known.ends_with(std::string(rest)))
              known += (known.empty() ? "" : ", ") + std::string(rest);
          }
        detail::fail(l.root, prefix.empty() ? "" : ".", prefix, ": unknown key '", k, "' (known: ", known, ")");
      }
    }
  }

  std::string name_;
  std::vector<Option<T>> options_;
};

// -------------------------------------------------------------------------------------------------------------
// Option builders. `field` is a generic accessor returning a reference to the bound field:
// `[](auto &s) -> auto & { return s.topo.slots_per_gpu; }`; it serves both reading and writing.

/// An option of `type` read through `get` and written through `set` (which gets checked values).
template <class T, class Get, class Set>
[[nodiscard]] Option<T> bound(const std::string &key, Type type, const std::string &help, Get get, Set set) {
  Option<T> o;
  o.key = key;
  o.type = type;
  o.help = help;
  o.get = std::move(get);
  o.set = std::move(set);
  return o;
}

template <class T, class F>
[[nodiscard]] Option<T> integer(std::string key, std::int64_t lo, std::int64_t hi, std::string help, F field) {
  Option<T> o = bound<T>(
      std::move(key), Type::integer, std::move(help),
      [field](const T &t) { return json::Value(static_cast<std::int64_t>(field(t))); },
      [field](T &t, const json::Value &v) {
        using Field = std::remove_reference_t<decltype(field(t))>;
        field(t) = static_cast<Field>(v.as_integer()); // in range: checked against [lo, hi] first
      });
  o.int_min = lo;
  o.int_max = hi;
  return o;
}

template <class T, class F>
[[nodiscard]] Option<T> number(std::string key, double lo, double hi, std::string help, F field) {
  Option<T> o = bound<T>(
      std::move(key), Type::number, std::move(help),
      [field](const T &t) { return json::Value(static_cast<double>(field(t))); },
      [field](T &t, const json::Value &v) { field(t) = v.as_double(); });
  o.min = lo;
  o.max = hi;
  return o;
}

template <class T, class F> [[nodiscard]] Option<T> boolean(std::string key, std::string help, F field) {
  return bound<T>(
      std::move(key), Type::boolean, std::move(help),
      [field](const T &t) { return json::Value(static_cast<bool>(field(t))); },
      [field](T &t, const json::Value &v) { field(t) = v.as_bool(); });
}

template <class T, class F> [[nodiscard]] Option<T> string(std::string key, std::string help, F field) {
  return bound<T>(
      std::move(key), Type::string, std::move(help), [field](const T &t) { return json::Value(std::string(field(t))); },
      [field](T &t, const json::Value &v) { field(t) = v.as_string(); });
}

/// A choice stored through conversions: `to` gives the field's name, `from` sets the field from a name.
template <class T, class To, class From>
[[nodiscard]] Option<T> choice(std::string key, const std::vector<std::string> &choices, std::string help, To to,
                               From from) {
  Option<T> o = bound<T>(
      std::move(key), Type::choice, std::move(help), [to](const T &t) { return json::Value(std::string(to(t))); },
      [from](T &t, const json::Value &v) { from(t, v.as_string()); });
  o.choices = choices;
  return o;
}

/// The option `i` of a schema over `U` as an option of `T` under `prefix` ("" keeps the key), through `field`.
template <class T, class U, class F>
[[nodiscard]] Option<T> lifted(const Option<U> &i, const std::string &prefix, F field) {
  Option<T> o;
  o.key = prefix.empty() ? i.key : prefix + "." + i.key;
  o.flag = i.flag;
  o.type = i.type;
  o.help = i.help;
  o.metavar = i.metavar;
  o.int_min = i.int_min;
  o.int_max = i.int_max;
  o.min = i.min;
  o.max = i.max;
  o.choices = i.choices;
  o.first = i.first;
  o.get = [g = i.get, field](const T &t) { return g(field(t)); };
  o.set = [s = i.set, field](T &t, const json::Value &v) { s(field(t), v); };
  return o;
}

/// The options of `inner` (over `U`) as options of `T` under `prefix` ("" keeps the keys), through `field`.
template <class T, class U, class F>
void lift(std::vector<Option<T>> &out, const Schema<U> &inner, const std::string &prefix, F field) {
  for (const Option<U> &i : inner.options())
    out.push_back(lifted<T>(i, prefix, field));
}

/// The options of `inner` named by `keys`, in that order, lifted like `lift` (one definition shared by two
/// front ends that expose different subsets of a struct).
template <class T, class U, class F>
void lift(std::vector<Option<T>> &out, const Schema<U> &inner, const std::string &prefix, F field,
          std::initializer_list<std::string_view> keys) {
  for (std::string_view k : keys)
    out.push_back(lifted<T>(inner.key(k), prefix, field));
}

} // namespace config
} // namespace v0
} // namespace foremoe
