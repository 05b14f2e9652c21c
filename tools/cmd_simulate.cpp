// `foremoe simulate`: replays RL steps on a modelled cluster and compares strategies. The project's main job.
// Every setting comes from the simulate schema (foremoe/config/options.hpp): defaults < --preset < --config
// file < explicit flags.

#include <chrono>
#include <cstdio>
#include <iomanip>
#include <ostream>

#include "command.hpp"
#include "default_loads.hpp"
#include "foremoe/config/documents.hpp"
#include "foremoe/core/files.hpp"
#include "foremoe/trace/io.hpp"
#include "run_simulate.hpp"

namespace foremoe::cli {
namespace {

namespace fs = std::filesystem;

Command make_simulate() {
  Command c;
  c.words = {"simulate"};
  c.summary = "replay RL steps on a modelled cluster and compare balancing strategies (the main job)";
  c.description =
      "Without arguments: the default preset, " + config::default_preset_text() +
      ", recompute + update, all strategies.\n"
      "Settings: defaults < --preset < --config FILE.json (the keys in [brackets], nested by section; see\n"
      "--print-config) < the flags given. Results go to stdout (the table, --csv, or --json -), everything\n"
      "else to stderr.";
  c.options = {
      {"config", "FILE.json", "settings file (the document --print-config writes, any subset of it)", ""},
      {"print-config", "", "print the effective settings as JSON (readable by --config) and exit", ""},
      {"loads", "FILE.npy", "per-micro-step loads [M, L, E] instead of the generator (steps from FILE.steps.npy)", ""},
      {"json", "OUT.json", "write machine-readable results ('-': stdout, instead of the table)", ""},
      {"csv", "", "print the table as CSV (header first; the summary line goes to stderr)", ""},
      quiet_option(),
  };
  for (auto &o : plot_options("simulate"))
    c.options.push_back(std::move(o));
  for (auto &o : schema_specs(config::simulate_schema()))
    c.options.push_back(std::move(o));
  c.run = [](const Args &a, std::ostream &out, std::ostream &err) {
    refuse_plot(a, "simulate");
    const json::Value cli = schema_overrides(config::simulate_schema(), a);
    json::Value file;
    std::vector<config::Schema<config::SimulateSettings>::Layer> layers;
    if (a.has("config")) {
      const std::string path = a.str("config");
      file = json::parse(config::read_text(path), path);
      layers.push_back({&file, "config"});
    }
    layers.push_back({&cli, "--"});
    // Without a config file every setting comes from a flag, so a refused setting is a usage error (exit 2).
    const bool flags_only = !a.has("config");
    const config::SimulateSettings s = [&] {
      try {
        return config::simulate_settings(layers);
      } catch (const Error &e) {
        if (flags_only) throw UsageError{e.what()};
        throw;
      }
    }();
    if (a.flag("print-config")) {
      out << json::dump(config::simulate_schema().write(s), 2) << "\n";
      return 0;
    }
    {
      std::vector<NamedPath> inputs, outputs;
      if (a.has("config")) inputs.push_back({"--config", a.str("config")});
      if (a.has("loads")) {
        inputs.push_back({"--loads", a.str("loads")});
        inputs.push_back({"the steps of --loads", sidecar_path(a.str("loads"), "steps")});
      }
      for (const char *o : {"json", "plot-document"})
        if (a.has(o)) outputs.push_back({std::string("--") + o, a.str(o)});
      check_outputs(outputs, inputs);
    }
    if (a.has("loads") && s.batch.packing != BatchPacking::none)
      throw UsageError{"--packing re-packs the synthetic batch's sequences; --loads " + a.str("loads") +
                       " holds per-micro-step loads, already packed (pack the sequences before counting them: "
                       "foremoe plan's per-sequence input or foremoe.pack_micro_batches)"};
    if (a.has("loads") && s.sim.a2a_hits == A2aHitsSource::ids)
      throw UsageError{"sim.a2a_hits = ids counts the routed ids of the synthetic batch; loads given without their "
                       "ids have none (--loads " +
                       a.str("loads") + ")"};
    const bool json_stdout = a.has("json") && a.str("json") == "-";
    if (json_stdout && a.flag("csv")) throw UsageError{"--json - and --csv both write to stdout; choose one"};

    LoadTensor loads;
    std::vector<std::int64_t> steps;
    if (a.has("loads")) {
      const fs::path p = a.str("loads");
      loads = read_loads_npy(p);
      if (fs::exists(sidecar_path(p, "steps"))) steps = read_offsets_npy(sidecar_path(p, "steps"));
    }
    Progress meter(err, progress_wanted(a));
    SimulateProgress progress;
    progress.generate = [&](std::int64_t done, std::int64_t total) {
      meter.update("generating the synthetic GRPO batch (tokens)", static_cast<double>(done),
                   static_cast<double>(total));
    };
    progress.simulate = [&](int done, int total) { meter.update("simulating (strategy-steps)", done, total); };
    progress.search = [&](int done, int total) {
      meter.update("searching each strategy's best deployment (strategy-deployments)", done, total);
    };
    LoadsReport rep;
    const auto t0 = std::chrono::steady_clock::now();
    const json::Value doc = [&] {
      try {
        return run_simulate(s, a.has("loads") ? &loads : nullptr, steps, progress, &rep, default_loads());
      } catch (const Error &e) {
        // With neither a config file nor a load file, what the run refuses (a GPU memory too small for the
        // deployment, a strategy that cannot plan it) follows from flag values alone: a usage error.
        if (flags_only && !a.has("loads")) throw UsageError{e.what()};
        throw;
      }
    }();
    const double sim_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() - rep.seconds -
                         rep.search_load_seconds;
    meter.clear();

    if (a.flag("csv")) {
      err << config::simulate_summary(s, doc);
      out << config::simulate_csv(doc);
    } else {
      std::ostream &table = json_stdout ? err : out;
      table << config::simulate_summary(s, doc) << config::simulate_table(doc);
    }
    if (!a.flag("quiet")) {
      err << std::fixed << std::setprecision(2);
      if (rep.built_in)
        err << "loads of the default batch built into the program, unpacked in " << rep.seconds << " s, ";
      else if (rep.from_cache)
        err << "loads read from the cache in " << rep.seconds << " s (" << rep.cache_file.string() << "), ";
      else if (rep.generated)
        err << "loads generated in " << rep.seconds << " s, ";
      err << "simulation and planning in " << sim_s << " s";
      if (const json::Value *best = doc.find("best_deployment"); best != nullptr)
        err << " (the deployment search's " << best->find("runs")->as_array().size()
            << " runs: " << best->find("search_seconds")->as_double() << " s; its batches "
            << (rep.search_generated ? "generated" : "read") << " in " << rep.search_load_seconds << " s)";
      err << "\n";
      if (rep.generated && !rep.from_cache && !rep.cache_file.empty() && !rep.cache_written)
        err << "note: could not write the load cache entry " << rep.cache_file.string() << " (--cache)\n";
    }
    // The document is serialised once for every output that takes it (--json and the plot front end's copy).
    const std::string text = json_stdout || a.has("json") || a.has("plot-document") ? json::dump(doc) + "\n" : "";
    files::OutputSet outputs;
    if (a.has("json") && !json_stdout) outputs.add_text(a.str("json"), text);
    if (a.has("plot-document")) outputs.add_text(a.str("plot-document"), text);
    outputs.commit();
    if (json_stdout) out << text;
    return 0;
  };
  return c;
}

FOREMOE_REGISTER_COMMAND(make_simulate);

} // namespace
} // namespace foremoe::cli
