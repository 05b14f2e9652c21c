#pragma once
// The `foremoe` command table and a small strict option parser. A subcommand
// is one cmd_<name>.cpp that defines a `Command` and registers it with
// `FOREMOE_REGISTER_COMMAND`; main.cpp dispatches on the words given.

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <iosfwd>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "foremoe/config/schema.hpp"
#include "foremoe/trace/routed_view.hpp"

namespace foremoe::cli {

/// Thrown for bad command-line use; main prints it with the command's usage.
struct UsageError {
  std::string message;
};

/// One option a command accepts.
struct OptionSpec {
  OptionSpec(std::string name_, std::string value_, std::string help_, std::string fallback_ = "",
             std::string label_ = "", bool hidden_ = false)
      : name(std::move(name_)), value(std::move(value_)), help(std::move(help_)), fallback(std::move(fallback_)),
        label(std::move(label_)), hidden(hidden_) {}
  std::string name;  ///< without the leading "--"
  std::string value; ///< metavariable, empty for a flag
  std::string help;
  std::string fallback; ///< default shown in --help (empty: none)
  std::string label;    ///< shown in --help instead of "--name VALUE" (empty: that)
  bool hidden = false;  ///< accepted but not listed (the "--no-" form of a bool option)
};

/// Parsed options and positional arguments of one command.
class Args {
public:
  Args(std::vector<OptionSpec> specs, std::vector<std::string> argv, int max_positional);

  [[nodiscard]] bool flag(std::string_view name) const;
  [[nodiscard]] bool has(std::string_view name) const;
  [[nodiscard]] std::string str(std::string_view name) const; ///< value or the spec's fallback
  [[nodiscard]] std::int64_t integer(std::string_view name, std::int64_t lo, std::int64_t hi) const;
  [[nodiscard]] double real(std::string_view name, double lo, double hi) const;
  [[nodiscard]] const std::vector<std::string> &positional() const { return positional_; }

private:
  [[nodiscard]] const OptionSpec &spec(std::string_view name) const;
  std::vector<OptionSpec> specs_;
  std::map<std::string, std::string, std::less<>> values_;
  std::vector<std::string> positional_;
};

/// A subcommand: `words` are the words that select it ("trace", "stats").
struct Command {
  std::vector<std::string> words;
  std::string summary;
  std::string usage; ///< positional part of the synopsis, e.g. "[FILE.npy]"
  std::string description;
  std::vector<OptionSpec> options;
  int max_positional = 0;
  std::function<int(const Args &, std::ostream &out, std::ostream &err)> run;
};

/// The flags of a schema's options (`skip`: keys the command handles itself). A bool option `x` takes `--x`
/// (true) and `--no-x` (false); the others take one value.
template <class T>
std::vector<OptionSpec> schema_specs(const config::Schema<T> &s, const T &defaults = T{},
                                     std::initializer_list<std::string_view> skip = {}) {
  std::vector<OptionSpec> out;
  for (const auto &o : s.options()) {
    if (std::find(skip.begin(), skip.end(), o.key) != skip.end()) continue;
    const json::Value d = o.get(defaults);
    std::string help = o.help, fallback;
    if (o.type == config::Type::integer || o.type == config::Type::number) help += " " + o.range_text();
    if (o.type == config::Type::choice) help += ": " + o.range_text();
    if (d.is_string())
      fallback = d.as_string();
    else if (d.is_bool())
      fallback = d.as_bool() ? "true" : "false";
    else if (d.is_integer())
      fallback = std::to_string(d.as_integer());
    else
      fallback = config::number_text(d.as_double());
    if (o.type == config::Type::boolean) {
      out.push_back({o.flag, "", help + " [" + o.key + "]", fallback, "--[no-]" + o.flag, false});
      out.push_back({"no-" + o.flag, "", "", "", "", true});
    } else {
      out.push_back({o.flag, o.metavar, help + " [" + o.key + "]", fallback, "", false});
    }
  }
  return out;
}

/// The schema options given on the command line, as a document keyed like a config file (read it as the
/// layer rooted "--" so that messages name the flag). Bad values are usage errors.
template <class T>
json::Value schema_overrides(const config::Schema<T> &s, const Args &a,
                             std::initializer_list<std::string_view> skip = {}) {
  std::vector<std::pair<std::string, std::string>> given;
  for (const auto &o : s.options()) {
    if (std::find(skip.begin(), skip.end(), o.key) != skip.end()) continue;
    if (o.type == config::Type::boolean) {
      if (a.flag(o.flag) && a.flag("no-" + o.flag))
        throw UsageError{"--" + o.flag + " and --no-" + o.flag + " contradict each other"};
      if (a.flag(o.flag)) given.emplace_back(o.flag, "true");
      if (a.flag("no-" + o.flag)) given.emplace_back("no-" + o.flag, "");
    } else if (a.has(o.flag)) {
      given.emplace_back(o.flag, a.str(o.flag));
    }
  }
  try {
    return s.flags_document(given);
  } catch (const Error &e) {
    throw UsageError{e.what()};
  }
}

/// Refuses, before any work, an output path that cannot be written: "-" (stdout) is fine, otherwise its folder
/// must exist and be writable and the path must not be a folder. A usage error naming the option and the path.
void check_output_path(const Args &a, std::string_view option);

/// A file a command reads or writes, with how the user named it ("--loads", "the sidecar of --out").
struct NamedPath {
  std::string what;
  std::filesystem::path path;
};

/// Refuses, before any work, outputs that would destroy an input or one another: every output must pass
/// `check_output_path`'s rules and name neither one of `inputs` (the same file, links resolved) nor another
/// output. Outputs "-" (stdout) are skipped. A usage error naming both.
void check_outputs(const std::vector<NamedPath> &outputs, const std::vector<NamedPath> &inputs);

/// Largest routed id + 1 over the tokens whose `mask` byte is not 0 (every token when `mask` is empty): the expert
/// count when `--experts` is not given. A usage error when no token is routed or the largest id is beyond 32766.
[[nodiscard]] int infer_num_experts(const RoutedView &v, std::span<const std::uint8_t> mask);

/// Progress for long work on stderr: shown only when stderr is a terminal and `--quiet` is not given, after the
/// work has run for `delay_s` seconds, so that quick runs print nothing.
class Progress {
public:
  Progress(std::ostream &err, bool enabled, double delay_s = 2.0);
  /// `done` of `total` units of `what`; ends the line at done == total.
  void update(std::string_view what, double done, double total);
  void clear();
  [[nodiscard]] bool enabled() const { return enabled_; }

private:
  std::ostream &err_;
  bool enabled_, shown_ = false;
  double delay_s_;
  std::int64_t start_ns_;
};

/// Whether progress may be shown: stderr is a terminal and `--quiet` was not given.
[[nodiscard]] bool progress_wanted(const Args &a);

/// The `--quiet` option every long-running command takes.
[[nodiscard]] OptionSpec quiet_option();

/// The `--plot` options of `plan` or `simulate` (`what`: "plan" or "simulate"). Pictures are drawn by the Python
/// package (`python -m foremoe`, with matplotlib), which takes these options off before running the program; they
/// are listed here so that both front ends show them, and `refuse_plot` rejects them in the compiled program.
[[nodiscard]] std::vector<OptionSpec> plot_options(std::string_view what);

/// Throws a `UsageError` saying where `--plot` works when any plot option was given.
void refuse_plot(const Args &a, std::string_view what);

std::vector<Command> &command_table();
bool register_command(Command c);
void print_command_help(std::ostream &os, const Command &c);
/// The whole program on `args` (the words after `foremoe`): output on std::cout and std::cerr (flushed on
/// return), the exit status returned. `main()` calls it; so does Python's `foremoe._core.cli`.
int run_cli(const std::vector<std::string> &args);

} // namespace foremoe::cli

#define FOREMOE_CLI_CONCAT2(a, b) a##b
#define FOREMOE_CLI_CONCAT(a, b) FOREMOE_CLI_CONCAT2(a, b)
#define FOREMOE_REGISTER_COMMAND(make)                                                                                 \
  static const bool FOREMOE_CLI_CONCAT(foremoe_cmd_registered_, __LINE__) = ::foremoe::cli::register_command(make())
