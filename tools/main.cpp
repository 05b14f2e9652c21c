// `foremoe`: entry point, command dispatch and the option parser.

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "command.hpp"
#include "foremoe/core/error.hpp"
#include "foremoe/core/files.hpp"
#include "foremoe/version.hpp"

namespace foremoe::cli {

std::vector<Command> &command_table() {
  static std::vector<Command> table;
  return table;
}

bool register_command(Command c) {
  command_table().push_back(std::move(c));
  return true;
}

Args::Args(std::vector<OptionSpec> specs, std::vector<std::string> argv, int max_positional)
    : specs_(std::move(specs)) {
  bool options_done = false;
  for (std::size_t i = 0; i < argv.size(); ++i) {
    const std::string &a = argv[i];
    if (!options_done && a == "--") {
      options_done = true;
      continue;
    }
    if (!options_done && a.size() > 2 && a.starts_with("--")) {
      std::string name = a.substr(2), value;
      bool has_inline = false;
      if (auto eq = name.find('='); eq != std::string::npos) {
        value = name.substr(eq + 1);
        name.resize(eq);
        has_inline = true;
      }
      const OptionSpec &s = spec(name);
      if (s.value.empty()) {
        if (has_inline) throw UsageError{"option --" + name + " takes no value"};
        value = "1";
      } else if (!has_inline) {
        if (i + 1 >= argv.size()) throw UsageError{"option --" + name + " needs a value " + s.value};
        value = argv[++i];
      }
      if (values_.count(name) != 0) throw UsageError{"option --" + name + " given twice"};
      values_[name] = value;
      continue;
    }
    if (!options_done && a.size() > 1 && a[0] == '-' && !(a[1] >= '0' && a[1] <= '9'))
      throw UsageError{"unknown option '" + a + "'"};
    positional_.push_back(a);
  }
  if (static_cast<int>(positional_.size()) > max_positional)
    throw UsageError{"unexpected argument '" + positional_[max_positional] + "'"};
}

const OptionSpec &Args::spec(std::string_view name) const {
  for (const auto &s : specs_)
    if (s.name == name) return s;
  throw UsageError{"unknown option '--" + std::string(name) + "'"};
}

bool Args::flag(std::string_view name) const {
  (void)spec(name);
  return values_.count(std::string(name)) != 0;
}
bool Args::has(std::string_view name) const { return flag(name); }

std::string Args::str(std::string_view name) const {
  const OptionSpec &s = spec(name);
  if (auto it = values_.find(name); it != values_.end()) return it->second;
  return s.fallback;
}

std::int64_t Args::integer(std::string_view name, std::int64_t lo, std::int64_t hi) const {
  const std::string v = str(name);
  std::int64_t x = 0;
  const auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (v.empty() || ec != std::errc() || p != v.data() + v.size())
    throw UsageError{"--" + std::string(name) + " expects an integer, got '" + v + "'"};
  if (x < lo || x > hi)
    throw UsageError{"--" + std::string(name) + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                     "], got " + v};
  return x;
}

double Args::real(std::string_view name, double lo, double hi) const {
  const std::string v = str(name);
  double x = 0;
  const auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (v.empty() || ec != std::errc() || p != v.data() + v.size() || !std::isfinite(x))
    throw UsageError{"--" + std::string(name) + " expects a number, got '" + v + "'"};
  if (x < lo || x > hi) {
    std::ostringstream os;
    os << "--" << name << " must be in [" << lo << ", " << hi << "], got " << v;
    throw UsageError{os.str()};
  }
  return x;
}

namespace {
/// The checks of `check_output_path` on one path, `what` naming it in the message.
void check_writable(const std::string &what, const std::string &path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p(path);
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  if (path.empty() || fs::is_directory(p, ec)) throw UsageError{what + " '" + path + "' is a folder, not a file"};
  if (!fs::is_directory(dir, ec))
    throw UsageError{what + " '" + path + "': folder '" + dir.string() + "' does not exist"};
  if (::access(dir.c_str(), W_OK) != 0 || (fs::exists(p, ec) && ::access(p.c_str(), W_OK) != 0))
    throw UsageError{what + " '" + path + "' is not writable"};
}
} // namespace

void check_output_path(const Args &a, std::string_view option) {
  if (!a.has(option)) return;
  const std::string path = a.str(option);
  if (path == "-") return;
  check_writable("--" + std::string(option), path);
}

void check_outputs(const std::vector<NamedPath> &outputs, const std::vector<NamedPath> &inputs) {
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const NamedPath &o = outputs[i];
    if (o.path == "-") continue;
    check_writable(o.what, o.path.string());
    for (const NamedPath &in : inputs)
      if (files::same_file(o.path, in.path))
        throw UsageError{o.what + " " + o.path.string() + " is the same file as " + in.what + " " + in.path.string() +
                         ": an output never overwrites an input; give another path"};
    for (std::size_t j = 0; j < i; ++j)
      if (outputs[j].path != "-" && files::same_file(o.path, outputs[j].path))
        throw UsageError{outputs[j].what + " " + outputs[j].path.string() + " and " + o.what + " " + o.path.string() +
                         " name the same file: give two different paths"};
  }
}

Progress::Progress(std::ostream &err, bool enabled, double delay_s)
    : err_(err), enabled_(enabled), delay_s_(delay_s),
      start_ns_(
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
              .count()) {}

void Progress::update(std::string_view what, double done, double total) {
  if (!enabled_) return;
  const auto now =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  if (!shown_ && static_cast<double>(now - start_ns_) * 1e-9 < delay_s_) return;
  shown_ = true;
  const double pct = total > 0 ? 100.0 * done / total : 100.0;
  err_ << "\r" << what << ": " << std::fixed << std::setprecision(0) << pct << "%\033[K" << std::flush;
}

void Progress::clear() {
  if (shown_) err_ << "\r\033[K" << std::flush;
  shown_ = false;
}

int infer_num_experts(const RoutedView &v, std::span<const std::uint8_t> mask) {
  std::int64_t mx = -1;
  for (std::int64_t t = 0; t < v.num_tokens(); ++t) {
    if (!mask.empty() && mask[static_cast<std::size_t>(t)] == 0) continue;
    for (int l = 0; l < v.num_layers(); ++l)
      for (int k = 0; k < v.topk(); ++k)
        mx = std::max(mx, v.at(t, l, k, 1 << 30));
  }
  if (mx < 0) throw UsageError{"the trace routes no token; give --experts"};
  if (mx >= 32767) throw UsageError{"largest id " + std::to_string(mx) + " is beyond 32766; give --experts"};
  return static_cast<int>(mx + 1);
}

bool progress_wanted(const Args &a) { return !a.flag("quiet") && isatty(fileno(stderr)) != 0; }

OptionSpec quiet_option() {
  return {"quiet", "", "no progress (shown only on a terminal, for work over ~2 s) and no timing line on stderr"};
}

std::vector<OptionSpec> plot_options(std::string_view what) {
  const std::string where = "python -m foremoe only, with matplotlib (pip install ./python[plot]): ";
  // Hidden: where the Python front end has the results document written for drawing (results as --json or
  // PLAN.json as --out write them), so that the user's own outputs and stdout stay as they are.
  OptionSpec document{"plot-document", "FILE.json", "", "", "", true};
  if (what == "simulate")
    return {{"plot", "DIR",
             where + "write PNGs of the step-time breakdown, the per-GPU load of layer --gpu-load-layer over the "
                     "micro-steps and the layer max/mean distribution, per strategy, to DIR"},
            document};
  return {{"plot", "FILE.png", where + "draw one micro-step and layer's placement (GPUs x slots, tokens)"},
          {"plot-micro-step", "M", "the micro-step --plot draws (default: the most imbalanced micro-step and layer)"},
          {"plot-layer", "L", "the layer --plot draws (default: the most imbalanced micro-step and layer)"},
          document};
}

void refuse_plot(const Args &a, std::string_view what) {
  for (const OptionSpec &o : plot_options(what))
    if (!o.hidden && a.has(o.name))
      throw UsageError{"--" + o.name + " is drawn by the Python package: run python -m foremoe " + std::string(what) +
                       " --plot ... (pip install ./python[plot])"};
}

void print_command_help(std::ostream &os, const Command &c) {
  std::string words;
  for (const auto &w : c.words)
    words += " " + w;
  os << "usage: foremoe" << words << (c.options.empty() ? "" : " [options]") << (c.usage.empty() ? "" : " ") << c.usage
     << "\n\n"
     << c.summary << "\n";
  if (!c.description.empty()) os << "\n" << c.description << "\n";
  if (!c.options.empty()) {
    os << "\noptions:\n";
    for (const auto &o : c.options) {
      if (o.hidden) continue;
      const std::string left =
          "  " + (o.label.empty() ? "--" + o.name + (o.value.empty() ? "" : " " + o.value) : o.label);
      os << std::left << std::setw(30) << left << (left.size() >= 30 ? "\n" + std::string(31, ' ') : " ") << o.help;
      if (!o.fallback.empty()) os << " (default: " << o.fallback << ")";
      os << "\n";
    }
  }
  os << std::left << std::setw(30) << "  --help"
     << " show this help\n";
}

namespace {

/// The commands; with `group` (a first word such as "trace"), only that group's.
void print_overview(std::ostream &os, const std::string &group = "") {
  os << "foremoe " << version_string << ": per-micro-step MoE expert load balancing for RL post-training\n\n"
     << "usage: foremoe <command> [options]\n\ncommands:\n";
  auto table = command_table();
  if (!group.empty()) std::erase_if(table, [&](const Command &c) { return c.words.size() < 2 || c.words[0] != group; });
  std::sort(table.begin(), table.end(), [](const Command &a, const Command &b) { return a.words < b.words; });
  for (const auto &c : table) {
    std::string words;
    for (const auto &w : c.words)
      words += (words.empty() ? "" : " ") + w;
    os << "  " << std::left << std::setw(16) << words << " " << c.summary << "\n";
  }
  os << "\nRun 'foremoe <command> --help' for a command's options.\n";
}

int run_words(const std::vector<std::string> &args);

} // namespace

int run_cli(const std::vector<std::string> &args) {
  const int rc = run_words(args);
  std::cout.flush();
  std::cerr.flush();
  return rc;
}

namespace {

int run_words(const std::vector<std::string> &args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    print_overview(std::cout);
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "--version") {
    std::cout << "foremoe " << foremoe::version_string << "\n";
    return 0;
  }
  // The longest run of leading words that names a command wins.
  const Command *best = nullptr;
  std::size_t best_len = 0;
  for (const auto &c : command_table()) {
    if (c.words.size() > args.size() || c.words.size() <= best_len) continue;
    if (std::equal(c.words.begin(), c.words.end(), args.begin())) {
      best = &c;
      best_len = c.words.size();
    }
  }
  if (best == nullptr && (args.size() == 1 || args[1] == "--help" || args[1] == "-h")) {
    // A group's first word alone (`foremoe trace`, `foremoe trace --help`): list that group's commands.
    const auto &table = command_table();
    if (std::any_of(table.begin(), table.end(), [&](const Command &c) { return c.words[0] == args[0]; })) {
      print_overview(args.size() == 1 ? std::cerr : std::cout, args[0]);
      return args.size() == 1 ? 2 : 0;
    }
  }
  if (best == nullptr) {
    std::cerr << "foremoe: unknown command '" << args[0] << (args.size() > 1 ? " " + args[1] : "") << "'\n\n";
    print_overview(std::cerr);
    return 2;
  }
  std::vector<std::string> rest(args.begin() + static_cast<std::ptrdiff_t>(best_len), args.end());
  if (std::find(rest.begin(), rest.end(), "--help") != rest.end() ||
      std::find(rest.begin(), rest.end(), "-h") != rest.end()) {
    print_command_help(std::cout, *best);
    return 0;
  }
  std::string words;
  for (const auto &w : best->words)
    words += " " + w;
  try {
    const Args parsed(best->options, rest, best->max_positional);
    return best->run(parsed, std::cout, std::cerr);
  } catch (const UsageError &e) {
    std::cerr << "foremoe" << words << ": " << foremoe::detail::cut_quote(e.message) << "\n(run 'foremoe" << words
              << " --help' for usage)\n";
    return 2;
  } catch (const foremoe::Error &e) {
    std::cerr << "foremoe" << words << ": error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception &e) {
    std::cerr << "foremoe" << words << ": unexpected error: " << e.what() << "\n";
    return 1;
  }
}

} // namespace
} // namespace foremoe::cli

#ifndef FOREMOE_CLI_NO_MAIN
int main(int argc, char **argv) { return foremoe::cli::run_cli(std::vector<std::string>(argv + 1, argv + argc)); }
#endif
