// `foremoe simulate`: replays RL steps on a modelled cluster and compares strategies. The project's main job.
// Every setting comes from the simulate schema (foremoe/config/options.hpp): defaults < --preset < --config
// file < explicit flags.

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iomanip>
#include <ostream>

#include "command.hpp"
#include "foremoe/config/documents.hpp"
#include "foremoe/trace/io.hpp"

namespace foremoe::cli {
namespace {

namespace fs = std::filesystem;

Command make_simulate() {
  Command c;
  c.words = {"simulate"};
  c.summary = "replay RL steps on a modelled cluster and compare balancing strategies (the main job)";
  c.description =
      "Without arguments: Qwen3-30B-A3B (48 MoE layers x 128 experts, top-8, H 2048, I 768, bf16) on 8 nodes x 8\n"
      "H200 with 3 slots per GPU per layer (2 owners + 1 spare), a synthetic GRPO batch (2 steps x 256 prompts x\n"
      "8 responses, 8,192-token micro-batches per GPU), recompute + update, all strategies.\n"
      "Settings: defaults < --preset < --config FILE.json (the keys in [brackets], nested by section; see\n"
      "--print-config) < the flags given.";
  c.options = {
      {"config", "FILE.json", "settings file (the document --print-config writes, any subset of it)", ""},
      {"print-config", "", "print the effective settings as JSON (readable by --config) and exit", ""},
      {"loads", "FILE.npy", "per-micro-step loads [M, L, E] instead of the generator (steps from FILE.steps.npy)", ""},
      {"json", "OUT.json", "write machine-readable results", ""},
      {"csv", "", "print the table as CSV (header first; the summary line goes to stderr)", ""},
  };
  for (auto &o : schema_specs(config::simulate_schema()))
    c.options.push_back(std::move(o));
  c.run = [](const Args &a, std::ostream &out, std::ostream &err) {
    const json::Value cli = schema_overrides(config::simulate_schema(), a);
    json::Value file;
    std::vector<config::Schema<config::SimulateSettings>::Layer> layers;
    if (a.has("config")) {
      const std::string path = a.str("config");
      file = json::parse(config::read_text(path), path);
      layers.push_back({&file, "config"});
    }
    layers.push_back({&cli, "--"});
    const config::SimulateSettings s = config::simulate_settings(layers);
    if (a.flag("print-config")) {
      out << json::dump(config::simulate_schema().write(s), 2) << "\n";
      return 0;
    }

    const bool tty = isatty(fileno(stderr)) != 0;
    LoadTensor loads;
    std::vector<std::int64_t> steps;
    if (a.has("loads")) {
      const fs::path p = a.str("loads");
      loads = read_loads_npy(p);
      if (fs::exists(sidecar_path(p, "steps"))) steps = read_offsets_npy(sidecar_path(p, "steps"));
    }
    auto progress = [&](int done, int total) {
      if (tty)
        err << "\rsimulating: " << done << "/" << total << " strategy-steps" << (done == total ? "\033[K\r" : "")
            << std::flush;
    };
    if (tty && !a.has("loads")) err << "generating the synthetic GRPO batch ..." << std::flush;
    double gen_s = 0;
    const auto t0 = std::chrono::steady_clock::now();
    const json::Value doc = config::run_simulate(s, a.has("loads") ? &loads : nullptr, steps, progress, &gen_s);
    const double sim_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() - gen_s;
    if (tty) err << "\r\033[K";

    if (a.flag("csv")) {
      err << config::simulate_summary(s, doc);
      out << config::simulate_csv(doc);
    } else {
      out << config::simulate_summary(s, doc) << config::simulate_table(doc) << std::fixed << std::setprecision(2)
          << "loads in " << gen_s << " s, simulation and planning in " << sim_s << " s\n";
    }
    if (a.has("json")) config::write_text(a.str("json"), json::dump(doc) + "\n");
    return 0;
  };
  return c;
}

FOREMOE_REGISTER_COMMAND(make_simulate);

} // namespace
} // namespace foremoe::cli
