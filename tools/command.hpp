#pragma once
// The `foremoe` command table and a small strict option parser. A subcommand
// is one cmd_<name>.cpp that defines a `Command` and registers it with
// `FOREMOE_REGISTER_COMMAND`; main.cpp dispatches on the words given.

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace foremoe::cli {

/// Thrown for bad command-line use; main prints it with the command's usage.
struct UsageError {
  std::string message;
};

/// One option a command accepts.
struct OptionSpec {
  std::string name;      ///< without the leading "--"
  std::string value;     ///< metavariable, empty for a flag
  std::string help;
  std::string fallback;  ///< default shown in --help (empty: none)
};

/// Parsed options and positional arguments of one command.
class Args {
public:
  Args(std::vector<OptionSpec> specs, std::vector<std::string> argv, int max_positional);

  [[nodiscard]] bool flag(std::string_view name) const;
  [[nodiscard]] bool has(std::string_view name) const;
  [[nodiscard]] std::string str(std::string_view name) const;          ///< value or the spec's fallback
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
  std::string usage;                 ///< positional part of the synopsis, e.g. "[FILE.npy]"
  std::string description;
  std::vector<OptionSpec> options;
  int max_positional = 0;
  std::function<int(const Args &, std::ostream &out, std::ostream &err)> run;
};

std::vector<Command> &command_table();
bool register_command(Command c);
void print_command_help(std::ostream &os, const Command &c);

} // namespace foremoe::cli

#define FOREMOE_CLI_CONCAT2(a, b) a##b
#define FOREMOE_CLI_CONCAT(a, b) FOREMOE_CLI_CONCAT2(a, b)
#define FOREMOE_REGISTER_COMMAND(make)                                                                                 \
  static const bool FOREMOE_CLI_CONCAT(foremoe_cmd_registered_, __LINE__) = ::foremoe::cli::register_command(make())
