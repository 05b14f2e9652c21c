// `foremoe trace gen` and `foremoe trace stats`.

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iomanip>
#include <ostream>
#include <sstream>

#include "command.hpp"
#include "foremoe/config/options.hpp"
#include "foremoe/core/files.hpp"
#include "foremoe/trace/count.hpp"
#include "foremoe/trace/formats/builtin.hpp"
#include "foremoe/trace/io.hpp"
#include "foremoe/trace/stats.hpp"
#include "foremoe/trace/synthetic.hpp"

namespace foremoe::cli {
namespace {

namespace fs = std::filesystem;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// The generator flags of both commands, from the synthetic schema: the defaults they show are the ones
/// `synthetic_config` generates with, `config::SyntheticSettings`' (the one default batch of every command).
std::vector<OptionSpec> synthetic_specs() {
  return schema_specs(config::synthetic_settings_schema(), config::SyntheticSettings{});
}

/// The config the generator flags give over `config::SyntheticSettings`' defaults (those `synthetic_specs` shows);
/// whatever `SyntheticConfig::validate` refuses is a usage error too, since every setting is a flag.
SyntheticConfig synthetic_config(const Args &a) {
  const json::Value flags = schema_overrides(config::synthetic_settings_schema(), a);
  try {
    return config::read_synthetic(flags, "--", config::SyntheticSettings{}.config);
  } catch (const Error &e) {
    throw UsageError{e.what()}; // the generator's settings all come from flags
  }
}

// ------------------------------------------------------------------ trace gen
Command make_trace_gen() {
  Command c;
  c.words = {"trace", "gen"};
  c.summary = "generate a synthetic GRPO routing trace: loads [M,L,E] and/or routed ids [T,L,K] as NPY";
  c.description =
      "Writes --loads OUT.npy (int64 [micro_steps, layers, experts], or [..., gpus] with --by-source) with\n"
      "OUT.steps.npy (micro-step offsets of the RL steps), and/or --ids OUT.npy (int16 [tokens, layers, topk])\n"
      "with OUT.microbatches.npy (token offsets of the micro-steps), OUT.sources.npy (token offsets per source\n"
      "rank within micro-steps), OUT.steps.npy and OUT.sequences.npy (token offsets of the sequences, which\n"
      "plan --ids packs).";
  c.options = synthetic_specs();
  c.options.emplace_back("loads", "FILE.npy", "write the per-micro-step loads here", "");
  c.options.emplace_back("ids", "FILE.npy", "write the routed ids here (memory: tokens x layers x topk x 2 bytes)", "");
  c.options.emplace_back("by-source", "", "split the loads by source rank ([M, L, E, gpus])", "");
  c.run = [](const Args &a, std::ostream &out, std::ostream &) {
    const SyntheticConfig cfg = synthetic_config(a);
    if (!a.has("loads") && !a.has("ids")) throw UsageError{"give --loads FILE.npy and/or --ids FILE.npy"};
    if (a.flag("by-source") && !a.has("loads"))
      throw UsageError{"--by-source splits the loads: give --loads FILE.npy too"};
    // Every output, sidecars included, is checked before minutes of generation, and written together at the end.
    std::vector<NamedPath> targets;
    if (a.has("ids")) {
      const fs::path p = a.str("ids");
      targets.push_back({"--ids", p});
      for (const char *side : {"microbatches", "sources", "steps", "sequences"})
        targets.push_back({std::string("the ") + side + " sidecar of --ids", sidecar_path(p, side)});
    }
    if (a.has("loads")) {
      targets.push_back({"--loads", a.str("loads")});
      targets.push_back({"the steps sidecar of --loads", sidecar_path(a.str("loads"), "steps")});
    }
    check_outputs(targets, {});
    files::OutputSet outputs;
    const auto t0 = std::chrono::steady_clock::now();
    // Each output is written (staged) as soon as it is generated, so the routed ids are freed before the loads are
    // generated; the report waits for the commit.
    std::ostringstream report;
    if (a.has("ids")) {
      const fs::path p = a.str("ids");
      const SyntheticTrace tr = generate_trace(cfg);
      const std::int64_t shape[3] = {tr.num_tokens, tr.num_layers, tr.topk};
      outputs.add(p, npy_writer(NpyDtype::of<std::int16_t>(), shape, tr.routed_ids.data()));
      outputs.add(sidecar_path(p, "microbatches"), offsets_npy_writer(tr.microbatch_offsets));
      outputs.add(sidecar_path(p, "sources"), offsets_npy_writer(tr.source_offsets));
      outputs.add(sidecar_path(p, "steps"), offsets_npy_writer(tr.step_offsets));
      outputs.add(sidecar_path(p, "sequences"), offsets_npy_writer(tr.sequence_offsets));
      report << "wrote " << p.string() << ": routed ids [" << tr.num_tokens << ", " << tr.num_layers << ", " << tr.topk
             << "] int16, " << tr.microbatch_offsets.size() - 1 << " micro-steps, " << tr.step_offsets.size() - 1
             << " steps\n";
    }
    if (a.has("loads")) {
      const fs::path p = a.str("loads");
      const bool by_source = a.flag("by-source");
      std::vector<std::int64_t> steps;
      const LoadTensor loads = generate_loads(cfg, &steps, by_source);
      outputs.add(p, loads_npy_writer(loads, by_source));
      outputs.add(sidecar_path(p, "steps"), offsets_npy_writer(steps));
      report << "wrote " << p.string() << ": loads [" << loads.num_micro_steps() << ", " << loads.num_layers() << ", "
             << loads.num_experts() << (by_source ? ", " + std::to_string(loads.num_sources()) : std::string())
             << "] int64, " << steps.size() - 1 << " steps (" << sidecar_path(p, "steps").string() << ")\n";
    }
    outputs.commit();
    out << report.str() << "generated in " << std::fixed << std::setprecision(2) << seconds_since(t0) << " s\n";
    return 0;
  };
  return c;
}

// ---------------------------------------------------------------- trace stats
void print_real_comparison(std::ostream &out, const TraceStats &st, const fs::path &dir) {
  const fs::path real_dir = dir / "deepseek-v3-sglang";
  if (!fs::exists(real_dir)) return;
  out << "\nexpert-load skew, synthetic vs real DeepSeek-V3 (SGLang EPLB statistics, " << real_dir.string() << ")\n";
  out << "  " << std::left << std::setw(44) << "source" << std::right << std::setw(12) << "median" << std::setw(10)
      << "min" << std::setw(10) << "max"
      << "   (per-layer max/mean expert load)\n";
  auto row = [&](const std::string &name, const SummaryStats &s) {
    out << "  " << std::left << std::setw(44) << name << std::right << std::fixed << std::setprecision(2)
        << std::setw(12) << s.median << std::setw(10) << s.min << std::setw(10) << s.max << "\n";
  };
  row("synthetic, step level", st.step_max_over_mean);
  row("synthetic, micro-step level", st.micro_max_over_mean);
  for (const char *name : {"prefill_in1024", "decode_in2000out100"}) {
    const fs::path f = real_dir / (std::string(name) + ".npy");
    if (!fs::exists(f)) continue;
    const NpyArray a = read_npy(f);
    if (a.shape.size() != 2) continue;
    const LayerSkew sk = layer_skew(a.to_doubles(), static_cast<int>(a.shape[0]), static_cast<int>(a.shape[1]));
    row(std::string("real ") + name + " (" + std::to_string(a.shape[1]) + " experts)", sk.max_over_mean);
  }
}

Command make_trace_stats() {
  Command c;
  c.words = {"trace", "stats"};
  c.usage = "[FILE.npy]";
  c.max_positional = 1;
  c.summary = "load statistics of a trace: step vs micro-step stability and skew";
  c.description =
      "FILE is loads [M, L, E] (any int or float dtype; [M, L, E, S] and [L, E] too), or routed ids\n"
      "[T, L, K] when --microbatch-tokens or --microbatches is given. Without FILE a synthetic GRPO trace\n"
      "is generated (the synthetic options below shape it) and compared with the real DeepSeek-V3\n"
      "statistics in --data-dir or $FOREMOE_DATA_DIR when present. With FILE, --gpus N splits the experts\n"
      "over N GPUs for the GPU skew and --microbatch-tokens N cuts routed ids into micro-steps of N tokens.";
  c.options = synthetic_specs();
  c.options.emplace_back("steps-file", "FILE.npy",
                         "micro-step offsets of the RL steps (default: FILE.steps.npy if present)", "");
  c.options.emplace_back("microsteps-per-step", "N", "cut the micro-steps into steps of N", "");
  c.options.emplace_back("microbatches", "FILE.npy", "FILE is routed ids; token offsets of the micro-steps", "");
  c.options.emplace_back("num-experts", "N", "experts per layer for routed ids (default: largest id + 1)", "");
  c.options.emplace_back("dense-layers", "N", "routed ids hold N leading dense layers to skip (vLLM/SGLang layout)",
                         "0");
  c.options.emplace_back("data-dir", "DIR",
                         "reference data folder to compare against (default: $FOREMOE_DATA_DIR, else ../shared/data "
                         "if it exists)",
                         "");
  c.run = [](const Args &a, std::ostream &out, std::ostream &err) {
    // An explicit --data-dir must hold the reference data: checked first, not after minutes of generation.
    if (a.has("data-dir")) {
      const fs::path d = a.str("data-dir");
      if (!fs::is_directory(d)) throw UsageError{"--data-dir " + d.string() + ": no such directory"};
      if (!fs::is_directory(d / "deepseek-v3-sglang"))
        throw UsageError{"--data-dir " + d.string() + ": holds no deepseek-v3-sglang/ reference data"};
    }
    LoadTensor loads;
    std::vector<std::int64_t> steps;
    int num_gpus = 0, topk = 0;
    const auto t0 = std::chrono::steady_clock::now();
    if (a.positional().empty()) {
      const SyntheticConfig cfg = synthetic_config(a);
      err << "generating a synthetic GRPO trace: " << cfg.num_steps << " steps x " << cfg.prompts_per_step
          << " prompts x " << cfg.responses_per_prompt << " responses, " << cfg.num_layers << " layers x "
          << cfg.num_experts << " experts, top-" << cfg.topk << ", " << cfg.num_gpus << " GPUs, seed " << cfg.seed
          << " ...\n";
      loads = generate_loads(cfg, &steps);
      if (cfg.num_experts % cfg.num_gpus == 0) num_gpus = cfg.num_gpus;
      topk = cfg.topk;
      out << "synthetic trace generated in " << std::fixed << std::setprecision(2) << seconds_since(t0) << " s\n\n";
    } else {
      const fs::path p = a.positional()[0];
      const fs::path mb_sidecar = sidecar_path(p, "microbatches");
      const bool ids_input = a.has("microbatch-tokens") || a.has("microbatches") || fs::exists(mb_sidecar);
      if (ids_input) {
        const RoutedIdsFile ids = read_routed_ids_npy(p);
        const RoutedView view = ids.view();
        CountOptions o;
        LayerMap lmap = LayerMap::identity(view.num_layers());
        const int dense = static_cast<int>(a.integer("dense-layers", 0, 1 << 20));
        if (dense > 0) lmap = LayerMap::dense_prefix(view.num_layers(), dense);
        o.layer_map = lmap;
        if (a.has("num-experts")) {
          o.num_experts = static_cast<int>(a.integer("num-experts", 1, 1 << 24));
        } else {
          std::int64_t mx = -1;
          for (std::int64_t t = 0; t < view.num_tokens(); ++t)
            for (int l = 0; l < view.num_layers(); ++l)
              for (int k = 0; k < view.topk(); ++k)
                mx = std::max(mx, view.at(t, l, k, 1 << 30));
          if (mx < 0) throw UsageError{"the trace routes no token; give --num-experts"};
          o.num_experts = static_cast<int>(mx + 1);
          err << "num-experts not given: using largest id + 1 = " << o.num_experts << "\n";
        }
        std::vector<std::int64_t> mb;
        if (a.has("microbatches")) {
          if (a.has("microbatch-tokens")) throw UsageError{"give --microbatch-tokens or --microbatches, not both"};
          mb = read_offsets_npy(a.str("microbatches"));
        } else if (!a.has("microbatch-tokens")) {
          mb = read_offsets_npy(mb_sidecar);
          err << "micro-steps from " << mb_sidecar.string() << "\n";
        } else {
          const std::int64_t n = a.integer("microbatch-tokens", 1, std::int64_t{1} << 40);
          for (std::int64_t t = 0; t < view.num_tokens(); t += n)
            mb.push_back(t);
          mb.push_back(view.num_tokens());
          if (mb.size() == 1) mb.insert(mb.begin(), 0);
        }
        o.microbatch_offsets = mb;
        loads = count_loads(view, o);
        topk = view.topk();
      } else {
        loads = read_loads_npy(p);
      }
      if (a.has("steps-file")) {
        steps = read_offsets_npy(a.str("steps-file"));
      } else if (a.has("microsteps-per-step")) {
        const std::int64_t n = a.integer("microsteps-per-step", 1, 1 << 30);
        for (std::int64_t m = 0; m < loads.num_micro_steps(); m += n)
          steps.push_back(m);
        steps.push_back(loads.num_micro_steps());
      } else if ((!ids_input || !a.has("microbatch-tokens")) && fs::exists(sidecar_path(p, "steps"))) {
        steps = read_offsets_npy(sidecar_path(p, "steps"));
        err << "steps from " << sidecar_path(p, "steps").string() << "\n";
        if (!ids_input && !steps.empty() && steps.back() != loads.num_micro_steps())
          throw UsageError{sidecar_path(p, "steps").string() + " ends at micro-step " + std::to_string(steps.back()) +
                           " but " + p.string() + " read as loads has " + std::to_string(loads.num_micro_steps()) +
                           " micro-steps; if it holds routed ids [T, L, K], pass --microbatches FILE.npy or "
                           "--microbatch-tokens N (or keep the " +
                           mb_sidecar.string() + " sidecar that trace gen writes)"};
      }
      if (a.has("gpus")) {
        num_gpus = static_cast<int>(a.integer("gpus", 1, 1 << 20));
        if (loads.num_experts() % num_gpus != 0)
          throw UsageError{"--gpus " + std::to_string(num_gpus) + " does not divide the " +
                           std::to_string(loads.num_experts()) + " experts"};
      }
    }
    const TraceStats st = compute_trace_stats(loads, steps, num_gpus, topk);
    print_trace_stats(out, st);
    fs::path data_dir;
    if (a.has("data-dir"))
      data_dir = a.str("data-dir");
    else if (const char *env = std::getenv("FOREMOE_DATA_DIR"))
      data_dir = env;
    else if (fs::is_directory("../shared/data"))
      data_dir = "../shared/data"; // the reference data beside a checkout, as on the project's machines
    if (!data_dir.empty()) print_real_comparison(out, st, data_dir);
    return 0;
  };
  return c;
}

// ---------------------------------------------------------------- trace count
/// The formats that take a per-token mask, for the message when --mask is given to another.
std::string mask_formats() {
  std::string out;
  for (const TraceFormat *f : trace_formats())
    if (f->takes_mask) out.append(out.empty() ? "" : " or ").append(f->name);
  return out;
}

Command make_trace_count() {
  Command c;
  c.words = {"trace", "count"};
  c.usage = "FILE";
  c.max_positional = 1;
  c.summary = "count routed ids (" + trace_format_names() + ") into loads [M, L, E] as NPY";
  c.description = "Input forms (--format, auto by default):\n";
  for (const TraceFormat *f : trace_formats()) {
    // Each format's help lines, indented under its name in a column.
    std::string help = f->help;
    for (std::size_t at = help.find('\n'); at != std::string::npos; at = help.find('\n', at + 1))
      help.insert(at + 1, std::string(12, ' '));
    c.description += "  " + f->name + std::string(f->name.size() < 10 ? 10 - f->name.size() : 1, ' ') + help + "\n";
  }
  c.description += "  auto      " + config::trace_format_detection() + "\n";
  c.description += "Micro-steps: --microbatches FILE.npy, else --microbatch-tokens N, else the sidecar, else one.\n"
                   "Writes --out LOADS.npy (int64 [M, L, E], [M, L, E, S] with --by-source) and LOADS.steps.npy\n"
                   "when FILE.steps.npy exists, the files plan, simulate and trace stats read.";
  c.options = schema_specs(config::count_schema());
  c.options.emplace_back("out", "FILE.npy", "write the loads here (required)", "");
  c.options.emplace_back("mask", "FILE.npy",
                         "verl: attention mask [batch, seq] (0 = padding, not counted; 1 = a token)", "");
  c.options.emplace_back("microbatches", "FILE.npy", "token offsets [M+1] of the micro-steps", "");
  c.run = [](const Args &a, std::ostream &out, std::ostream &err) {
    config::CountSettings cs;
    config::count_schema().read(cs, schema_overrides(config::count_schema(), a), "--");
    if (a.positional().empty()) throw UsageError{"give the routed-id FILE to count"};
    if (!a.has("out")) throw UsageError{"give --out LOADS.npy"};
    const fs::path p = a.positional()[0], outp = a.str("out");
    {
      std::vector<NamedPath> inputs{{"FILE", p}};
      for (const char *side : {"microbatches", "sources", "steps"})
        inputs.push_back({std::string("the ") + side + " sidecar of FILE", sidecar_path(p, side)});
      for (const char *o : {"mask", "microbatches"})
        if (a.has(o)) inputs.push_back({std::string("--") + o, a.str(o)});
      check_outputs({{"--out", outp}, {"the steps sidecar of --out", sidecar_path(outp, "steps")}}, inputs);
    }
    const TraceFormat &fmt = cs.format == "auto" ? detect_trace_format(p) : find_trace_format(cs.format);
    TraceReadOptions ro;
    if (a.has("mask")) {
      if (!fmt.takes_mask) throw UsageError{"--mask is for --format " + mask_formats() + " (got " + fmt.name + ")"};
      ro.mask = TraceInput(fs::path(a.str("mask")));
    }
    if (fmt.needs_shape && (cs.layers == 0 || cs.topk == 0))
      throw UsageError{"--format " + fmt.name +
                       " needs --layers and --topk (the payload's int32 [tokens, layers, topk])"};
    ro.num_layers = static_cast<int>(cs.layers);
    ro.topk = static_cast<int>(cs.topk);
    const RoutedRecord rec = fmt.read(TraceInput(p), ro);
    const RoutedView &view = rec.view;
    CountOptions o;
    o.mask = rec.mask;
    if (cs.dense_layers > 0) o.layer_map = LayerMap::dense_prefix(view.num_layers(), static_cast<int>(cs.dense_layers));
    if (cs.experts > 0) {
      o.num_experts = static_cast<int>(cs.experts);
    } else {
      o.num_experts = infer_num_experts(view, rec.mask);
      err << "--experts not given: using largest id + 1 = " << o.num_experts << "\n";
    }
    std::vector<std::int64_t> mb, so;
    const fs::path mb_side = sidecar_path(p, "microbatches"), so_side = sidecar_path(p, "sources");
    if (a.has("microbatches")) {
      if (cs.microbatch_tokens > 0) throw UsageError{"give --microbatch-tokens or --microbatches, not both"};
      mb = read_offsets_npy(a.str("microbatches"));
    } else if (cs.microbatch_tokens > 0) {
      for (std::int64_t t = 0; t < view.num_tokens(); t += cs.microbatch_tokens)
        mb.push_back(t);
      mb.push_back(view.num_tokens());
      if (mb.size() == 1) mb.insert(mb.begin(), 0);
    } else if (fmt.reads_sidecars && fs::exists(mb_side)) {
      mb = read_offsets_npy(mb_side);
      err << "micro-steps from " << mb_side.string() << "\n";
    }
    o.microbatch_offsets = mb;
    if (cs.by_source) {
      if (cs.sources > 0) {
        o.num_sources = static_cast<int>(cs.sources);
      } else if (fmt.reads_sidecars && fs::exists(so_side) && !mb.empty()) {
        so = read_offsets_npy(so_side);
        const std::size_t M = mb.size() - 1;
        if (so.size() < 2 || (so.size() - 1) % M != 0)
          throw UsageError{so_side.string() + " has " + std::to_string(so.size()) +
                           " offsets, not M * S + 1 for M = " + std::to_string(M) + " micro-steps"};
        o.num_sources = static_cast<int>((so.size() - 1) / M);
        o.source_offsets = so;
        err << "sources from " << so_side.string() << " (" << o.num_sources << " ranks)\n";
      } else {
        throw UsageError{"--by-source needs --sources S (or a " + so_side.string() + " sidecar with micro-steps)"};
      }
    } else if (cs.sources > 0) {
      throw UsageError{"--sources is for --by-source"};
    }
    const LoadTensor loads = count_loads(view, o);
    files::OutputSet outputs;
    outputs.add(outp, loads_npy_writer(loads, cs.by_source));
    const fs::path steps_in = sidecar_path(p, "steps");
    std::vector<std::int64_t> steps;
    if (fmt.reads_sidecars && fs::exists(steps_in)) {
      steps = read_offsets_npy(steps_in);
      outputs.add(sidecar_path(outp, "steps"), offsets_npy_writer(steps));
    }
    outputs.commit();
    std::int64_t masked = 0;
    for (const std::uint8_t b : rec.mask)
      masked += b == 0;
    out << "wrote " << outp.string() << ": loads [" << loads.num_micro_steps() << ", " << loads.num_layers() << ", "
        << loads.num_experts() << (cs.by_source ? ", " + std::to_string(loads.num_sources()) : std::string())
        << "] int64 from " << fmt.name << " " << p.string() << " (" << view.num_tokens() << " tokens";
    if (!rec.mask.empty()) out << ", " << masked << " masked";
    if (!rec.request_offsets.empty()) out << ", " << rec.request_offsets.size() - 1 << " requests";
    out << ")\n";
    return 0;
  };
  return c;
}

FOREMOE_REGISTER_COMMAND(make_trace_count);
FOREMOE_REGISTER_COMMAND(make_trace_gen);
FOREMOE_REGISTER_COMMAND(make_trace_stats);

} // namespace
} // namespace foremoe::cli
