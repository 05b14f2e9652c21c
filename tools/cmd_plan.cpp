// `foremoe plan`: plans the micro-steps of one RL step from a load file.

#include <chrono>
#include <iomanip>
#include <ostream>

#include "command.hpp"
#include "foremoe/config/documents.hpp"
#include "foremoe/config/placement_export.hpp"
#include "foremoe/core/files.hpp"
#include "foremoe/plan/evaluate.hpp"
#include "foremoe/plan/planner.hpp"
#include "foremoe/trace/io.hpp"
#include "foremoe/transfer/transfer_plan.hpp"

namespace foremoe::cli {
namespace {

Command make_plan() {
  Command c;
  c.words = {"plan"};
  c.summary = "plan replicas, placement, token split and moves for the micro-steps of one RL step";
  c.description =
      "LOADS.npy is [L, E] (one micro-step) or [M, L, E] (the micro-steps of one RL step in execution order;\n"
      "owners are planned from their sum), integer or float. Writes PLAN.json with, per micro-step and layer,\n"
      "owner_gpu, gpu_slots, slot_tokens and moves ([expert, src_gpu or -1 for host, dst_gpu, dst_slot]).";
  c.options = {
      {"loads", "LOADS.npy", "per-micro-step loads (required)", ""},
      {"previous-loads", "FILE.npy", "previous step's loads: the history EPLB plans from", ""},
      {"resident", "PLACEMENT.json", "placement left by the previous micro-step (from --out-placement)", ""},
      {"out", "PLAN.json", "write the plan here", ""},
      {"out-placement", "PLACEMENT.json", "write the final placement here (readable by --resident)", ""},
      {"placement-format", "NAME",
       "--out-placement form: foremoe (readable by --resident), sglang (--init-expert-location JSON: "
       "physical_to_logical_map), vllm (EplbState maps); sglang/vllm fill spare slots",
       "foremoe"},
      {"expert-bytes", "B",
       "bytes of one expert's weights: adds each layer's transfer plan (chunks, paths, rounds, "
       "modelled time)",
       ""},
      {"max-chunk-bytes", "B", "transfer chunks are cut to at most this", "67108864"},
      {"no-mirror", "", "the nodes have no pinned host mirror (GPU-direct sources only)", ""},
      {"mode", "MODE", "gone: free mode is --strategy foremoe-free, foremoe is two-level", ""},
  };
  for (auto &o : plot_options("plan"))
    c.options.push_back(std::move(o));
  for (auto &o : schema_specs(config::plan_schema())) {
    if (o.name == "strategy") o.help += "; all (side by side, no --out); list (the registered strategies)";
    c.options.push_back(std::move(o));
  }
  c.run = [](const Args &a, std::ostream &out, std::ostream &) {
    refuse_plot(a, "plan");
    if (a.str("strategy") == "list") {
      for (const StrategyInfo *s : strategies()) {
        out << "  " << std::left << std::setw(14) << s->name << s->help << "\n";
        if (!s->options.empty()) {
          out << "  " << std::setw(14) << ""
              << "options:";
          for (const std::string &o : s->options)
            out << " " << o;
          out << "\n";
        }
      }
      return 0;
    }
    if (a.has("mode"))
      throw UsageError{"--mode is gone: use --strategy foremoe-free for free mode (foremoe is two-level)"};
    if (!a.has("loads")) throw UsageError{"--loads LOADS.npy is required"};
    const std::string placement_format = a.has("placement-format") ? a.str("placement-format") : "foremoe";
    {
      const auto &names = config::placement_format_names();
      if (std::find(names.begin(), names.end(), placement_format) == names.end())
        throw UsageError{"--placement-format must be foremoe, sglang or vllm, got '" + placement_format + "'"};
      if (a.has("placement-format") && !a.has("out-placement"))
        throw UsageError{"--placement-format is for --out-placement"};
    }
    const bool all = a.str("strategy") == "all";
    if (all && (a.has("out") || a.has("out-placement") || a.has("plot-document")))
      throw UsageError{"--strategy all prints a comparison; --out, --out-placement and --plot need one strategy"};
    const json::Value flags = all ? schema_overrides(config::plan_schema(), a, {"planner.strategy"})
                                  : schema_overrides(config::plan_schema(), a);
    config::PlanSettings settings;
    try {
      config::plan_schema().read(settings, flags, "--");
      // What the flags alone decide is checked here, so that a bad flag value is a usage error (exit 2).
      settings.topo.validate();
      settings.planner.validate();
    } catch (const Error &e) {
      throw UsageError{e.what()}; // an unknown --strategy or a bad flag value is a usage error (exit 2)
    }
    {
      std::vector<NamedPath> inputs{{"--loads", a.str("loads")}}, outputs;
      for (const char *o : {"previous-loads", "resident"})
        if (a.has(o)) inputs.push_back({std::string("--") + o, a.str(o)});
      for (const char *o : {"out", "out-placement", "plot-document"})
        if (a.has(o)) outputs.push_back({std::string("--") + o, a.str(o)});
      check_outputs(outputs, inputs);
    }
    const Topology topo = settings.topo;
    const PlannerOptions opts = settings.planner;
    const Stage stage = settings.stage;
    const LoadTensor loads = read_loads_npy(a.str("loads"));
    topo.validate(loads.num_experts());

    std::vector<std::int64_t> previous;
    if (a.has("previous-loads")) {
      const LoadTensor prev = read_loads_npy(a.str("previous-loads"));
      if (prev.num_layers() != loads.num_layers() || prev.num_experts() != loads.num_experts())
        throw Error("--previous-loads has " + std::to_string(prev.num_layers()) + " layers x " +
                    std::to_string(prev.num_experts()) + " experts, --loads has " + std::to_string(loads.num_layers()) +
                    " x " + std::to_string(loads.num_experts()));
      previous = Planner(loads.num_layers(), loads.num_experts(), topo, opts).sum_steps(prev);
    }
    Placement resident;
    if (a.has("resident"))
      resident = config::read_placement_file(a.str("resident"), topo, loads.num_layers(), loads.num_experts());

    const Placement *res = a.has("resident") ? &resident : nullptr;
    if (all) {
      out << "planning " << loads.num_micro_steps() << " micro-steps x " << loads.num_layers() << " layers x "
          << loads.num_experts() << " experts on " << topo.num_nodes << " x " << topo.gpus_per_node << " GPUs x "
          << topo.slots_per_gpu << " slots" << (previous.empty() ? " (eplb without history = static)" : "") << "\n";
      out << "  " << std::left << std::setw(14) << "strategy" << std::right << std::setw(12) << "median"
          << std::setw(10) << "p99" << std::setw(10) << "max" << std::setw(16) << "moves/micro" << std::setw(14)
          << "planner ms"
          << "   (layer max/mean GPU load)\n";
      for (const StrategyInfo *st : strategies()) {
        PlannerOptions o = opts;
        o.strategy = st->name;
        Planner p(loads.num_layers(), loads.num_experts(), topo, o);
        const StepPlan sp = p.plan_step(loads, res, previous, stage);
        std::size_t moves = 0;
        for (const auto &layers : sp.micro_steps)
          for (const LayerPlan &lp : layers)
            moves += lp.moves.size();
        const BalanceStats b = balance_stats(imbalances(sp.micro_steps));
        out << "  " << std::left << std::setw(14) << st->name << std::right << std::fixed << std::setprecision(4)
            << std::setw(12) << b.median << std::setw(10) << b.p99 << std::setw(10) << b.max << std::setprecision(1)
            << std::setw(16) << double(moves) / double(sp.micro_steps.size()) << std::setprecision(2) << std::setw(14)
            << sp.planner_seconds * 1e3 << "\n";
      }
      return 0;
    }

    transfer::Options topt;
    const bool transfers = a.has("expert-bytes");
    if (transfers) {
      topt.expert_bytes = a.integer("expert-bytes", 1, std::int64_t{1} << 40);
      topt.max_chunk_bytes = a.integer("max-chunk-bytes", 1, std::int64_t{1} << 40);
      topt.align_bytes = std::min<std::int64_t>(topt.align_bytes, topt.max_chunk_bytes);
      topt.host_mirror = !a.flag("no-mirror");
      try {
        topt.validate(); // before planning: a chunk count above the limit is a usage error, not a late failure
      } catch (const Error &e) {
        throw UsageError{std::string("--expert-bytes / --max-chunk-bytes: ") + e.what()};
      }
    } else if (a.has("max-chunk-bytes") || a.flag("no-mirror")) {
      throw UsageError{"--max-chunk-bytes and --no-mirror shape the transfer plan: give --expert-bytes too"};
    }

    Planner planner(loads.num_layers(), loads.num_experts(), topo, opts);
    const StepPlan sp = planner.plan_step(loads, res, previous, stage);

    // Sources are what the slots held before each micro-step: the previous one's placement, or --resident, or
    // (micro-step 0 without --resident) what the planner assumed resident: every slot its moves do not write.
    std::vector<std::vector<transfer::TransferPlan>> transfer_plans;
    std::size_t num_moves = 0;
    double est_seconds = 0.0, bound_seconds = 0.0;
    std::int64_t path_bytes[transfer::num_paths] = {0, 0, 0};
    for (std::size_t m = 0; m < sp.micro_steps.size(); ++m) {
      const auto &layers = sp.micro_steps[m];
      if (transfers) transfer_plans.emplace_back();
      for (std::size_t l = 0; l < layers.size(); ++l) {
        const LayerPlan &lp = layers[l];
        num_moves += lp.moves.size();
        if (!transfers) continue;
        const LayerPlacement before = m > 0            ? sp.micro_steps[m - 1][l].placement
                                      : res != nullptr ? res->layer(static_cast<int>(l))
                                                       : transfer::resident_before(lp.placement, lp.moves);
        try {
          transfer_plans.back().push_back(transfer::plan_transfers(lp.moves, before, topo, topt));
        } catch (const Error &e) {
          throw Error("micro-step " + std::to_string(m) + " layer " + std::to_string(l) + ": " + e.what());
        }
        const transfer::TransferPlan &tp = transfer_plans.back().back();
        est_seconds += tp.est_seconds;
        bound_seconds += tp.link_bound_seconds;
        for (int p = 0; p < transfer::num_paths; ++p)
          path_bytes[p] += tp.path_bytes[p];
      }
    }
    // Every output is staged first and renamed into place together: a failure leaves none of them behind.
    files::OutputSet outputs;
    if (a.has("out") || a.has("plot-document")) {
      const config::PlanHeader h{opts.strategy, topo, loads.num_layers(), loads.num_experts(), sp.planner_seconds};
      const std::string text =
          json::dump(config::plan_document(h, sp.micro_steps, transfers ? &transfer_plans : nullptr)) + "\n";
      if (a.has("out")) outputs.add_text(a.str("out"), text);
      if (a.has("plot-document")) outputs.add_text(a.str("plot-document"), text);
    }
    if (a.has("out-placement") && placement_format == "foremoe") {
      outputs.add_text(a.str("out-placement"),
                       json::dump(config::placement_document(topo, sp.final_placement())) + "\n");
    } else if (a.has("out-placement")) {
      // SGLang and vLLM need every physical slot filled: spare slots get the step's heaviest experts per replica.
      const std::size_t cells = static_cast<std::size_t>(loads.num_layers()) * loads.num_experts();
      std::vector<std::int64_t> weights(cells, 0);
      const auto tot = loads.totals();
      for (std::size_t i = 0; i < tot.size(); ++i)
        weights[i % cells] += tot[i];
      Placement full = sp.final_placement();
      config::fill_empty_slots(full, weights);
      outputs.add_text(a.str("out-placement"), config::placement_export_text(full, placement_format));
    }
    outputs.commit();

    const BalanceStats balance = balance_stats(imbalances(sp.micro_steps));
    out << "planned " << sp.micro_steps.size() << " micro-steps x " << loads.num_layers() << " layers x "
        << loads.num_experts() << " experts on " << topo.num_nodes << " x " << topo.gpus_per_node << " GPUs x "
        << topo.slots_per_gpu << " slots with " << opts.strategy << " in " << std::fixed << std::setprecision(2)
        << sp.planner_seconds * 1e3 << " ms\n"
        << "  layer max/mean GPU load: median " << std::setprecision(4) << balance.median << ", p99 " << balance.p99
        << ", max " << balance.max << "\n"
        << "  moves: " << num_moves << " (" << std::setprecision(2)
        << (sp.micro_steps.empty() ? 0.0 : double(num_moves) / double(sp.micro_steps.size())) << " per micro-step)\n";
    if (transfers) {
      const double micro = sp.micro_steps.empty() ? 1.0 : double(sp.micro_steps.size());
      const double total = double(path_bytes[0] + path_bytes[1] + path_bytes[2]);
      out << "  transfers: " << std::setprecision(3) << est_seconds * 1e3 / micro
          << " ms modelled per micro-step (all layers, link bound " << bound_seconds * 1e3 / micro << " ms), "
          << std::setprecision(1) << (total > 0 ? 100.0 * double(path_bytes[0]) / total : 0.0) << "% NVLink, "
          << (total > 0 ? 100.0 * double(path_bytes[1]) / total : 0.0) << "% host mirror, "
          << (total > 0 ? 100.0 * double(path_bytes[2]) / total : 0.0) << "% network\n";
    }
    if (a.has("out")) out << "  wrote " << a.str("out") << "\n";
    if (a.has("out-placement")) out << "  wrote " << a.str("out-placement") << "\n";
    return 0;
  };
  return c;
}

FOREMOE_REGISTER_COMMAND(make_plan);

} // namespace
} // namespace foremoe::cli
