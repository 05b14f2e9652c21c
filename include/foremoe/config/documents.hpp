#pragma once
/// @file
/// The one writer (and, for placements, reader) of each document the front ends exchange: PLAN.json
/// (`foremoe plan --out`, Python `plan_document`), placement files (`--out-placement` / `--resident`), and the
/// simulate results as JSON (`foremoe simulate --json`, Python `simulate()`), CSV and the text table.

#include <filesystem>
#include <iomanip>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "foremoe/config/options.hpp"
#include "foremoe/core/files.hpp"
#include "foremoe/core/json.hpp"
#include "foremoe/core/placement.hpp"
#include "foremoe/core/topology.hpp"
#include "foremoe/plan/plan.hpp"
#include "foremoe/sim/simulator.hpp"
#include "foremoe/trace/io.hpp"
#include "foremoe/transfer/transfer_plan.hpp"

namespace foremoe {
inline namespace v0 {
namespace config {

using ::foremoe::read_text; // trace/io.hpp: the one whole-file reader

using ::foremoe::files::write_text; // core/files.hpp: staged and renamed into place, naming the path on failure

namespace detail {
inline json::Value gpu_slots_json(const LayerPlacement &p) {
  json::Value g = json::Array{};
  for (int gpu = 0; gpu < p.num_gpus(); ++gpu) {
    const auto s = p.gpu_slots(gpu);
    g.push_back(std::vector<std::int32_t>(s.begin(), s.end()));
  }
  return g;
}
} // namespace detail

/// One layer's plan: `{"owner_gpu", "gpu_slots": [[expert or -1 ...] per GPU], "slot_tokens", "moves":
/// [[expert, src_gpu or -1 (host), dst_gpu, dst_slot] ...], "max_gpu_load", "imbalance", "tolerance_met"}`
/// (`tolerance_met` false: an imbalance tolerance was asked for and not met; the plan is the best found).
[[nodiscard]] inline json::Value layer_plan_json(const LayerPlan &lp) {
  json::Value j;
  j["owner_gpu"] = lp.owner_gpu;
  j["gpu_slots"] = detail::gpu_slots_json(lp.placement);
  json::Value tokens = json::Array{};
  const int slots = lp.placement.slots_per_gpu();
  for (int gpu = 0; gpu < lp.placement.num_gpus(); ++gpu)
    tokens.push_back(
        std::vector<std::int64_t>(lp.slot_tokens.begin() + gpu * slots, lp.slot_tokens.begin() + (gpu + 1) * slots));
  j["slot_tokens"] = std::move(tokens);
  json::Value moves = json::Array{};
  for (const Move &m : lp.moves)
    moves.push_back(std::vector<int>{m.expert, m.src_gpu, m.dst_gpu, m.dst_slot});
  j["moves"] = std::move(moves);
  j["max_gpu_load"] = lp.max_gpu_load;
  j["imbalance"] = lp.imbalance();
  j["tolerance_met"] = lp.tolerance_met;
  return j;
}

/// One layer's transfer plan: `{"num_rounds", "est_seconds", "link_bound_seconds", "path_bytes": {nvlink, pcie,
/// network}, "chunk_columns", "chunks": [[move, path, src_gpu, src_slot, dst_gpu, dst_slot, expert,
/// offset_bytes, num_bytes, round] ...]}`.
[[nodiscard]] inline json::Value transfer_plan_json(const transfer::TransferPlan &tp) {
  json::Value j;
  j["num_rounds"] = tp.num_rounds;
  j["est_seconds"] = tp.est_seconds;
  j["link_bound_seconds"] = tp.link_bound_seconds;
  json::Value pb = json::Object{};
  for (int p = 0; p < transfer::num_paths; ++p)
    pb[transfer::to_string(static_cast<transfer::Path>(p))] = tp.path_bytes[p];
  j["path_bytes"] = std::move(pb);
  j["chunk_columns"] = std::vector<std::string>{"move",     "path",   "src_gpu",      "src_slot",  "dst_gpu",
                                                "dst_slot", "expert", "offset_bytes", "num_bytes", "round"};
  json::Value chunks = json::Array{};
  for (const transfer::Chunk &c : tp.chunks)
    chunks.push_back(json::Array{c.move_idx, std::string(transfer::to_string(c.path)), c.src_gpu, c.src_slot, c.dst_gpu,
                                 c.dst_slot, c.expert, c.offset_bytes, c.num_bytes, c.round});
  j["chunks"] = std::move(chunks);
  return j;
}

/// What a PLAN.json names besides the plans.
struct PlanHeader {
  std::string strategy;
  Topology topo;
  int num_layers = 0, num_experts = 0;
  double planner_seconds = 0;
};

/// PLAN.json: the header and, per micro-step and layer, `layer_plan_json` (plus `"transfers"` where
/// `transfers` is given, `[micro_steps][layers]`).
[[nodiscard]] inline json::Value
plan_document(const PlanHeader &h, const std::vector<std::vector<LayerPlan>> &micro_steps,
              const std::vector<std::vector<transfer::TransferPlan>> *transfers = nullptr) {
  json::Value j;
  j["strategy"] = h.strategy;
  j["nodes"] = h.topo.num_nodes;
  j["gpus_per_node"] = h.topo.gpus_per_node;
  j["slots"] = h.topo.slots_per_gpu;
  j["num_layers"] = h.num_layers;
  j["num_experts"] = h.num_experts;
  j["planner_seconds"] = h.planner_seconds;
  json::Value steps = json::Array{};
  for (std::size_t m = 0; m < micro_steps.size(); ++m) {
    json::Value layers = json::Array{};
    for (std::size_t l = 0; l < micro_steps[m].size(); ++l) {
      json::Value lj = layer_plan_json(micro_steps[m][l]);
      if (transfers != nullptr) lj["transfers"] = transfer_plan_json((*transfers)[m][l]);
      layers.push_back(std::move(lj));
    }
    json::Value step;
    step["layers"] = std::move(layers);
    steps.push_back(std::move(step));
  }
  j["micro_steps"] = std::move(steps);
  return j;
}

/// A placement file: `{"nodes", "gpus_per_node", "slots", "num_experts", "layers": [{"gpu_slots": ...}]}`.
[[nodiscard]] inline json::Value placement_document(const Topology &topo, const Placement &p) {
  json::Value j;
  j["nodes"] = topo.num_nodes;
  j["gpus_per_node"] = topo.gpus_per_node;
  j["slots"] = topo.slots_per_gpu;
  j["num_experts"] = p.num_layers() > 0 ? p.layer(0).num_experts() : 0;
  json::Value layers = json::Array{};
  for (int l = 0; l < p.num_layers(); ++l) {
    json::Value layer;
    layer["gpu_slots"] = detail::gpu_slots_json(p.layer(l));
    layers.push_back(std::move(layer));
  }
  j["layers"] = std::move(layers);
  return j;
}

/// Reads a placement document (named `where` in messages) strictly: every key present, no other key, whole
/// integers only, checked against the topology, layer and expert counts.
[[nodiscard]] inline Placement read_placement(const json::Value &j, std::string_view where, const Topology &topo,
                                              int num_layers, int num_experts) {
  using foremoe::detail::fail;
  using foremoe::detail::require;
  const std::string w(where);
  require(j.is_object(), w, ": expected a JSON object, got ", value_text(j));
  static const char *const keys[] = {"nodes", "gpus_per_node", "slots", "num_experts", "layers"};
  for (const auto &[k, v] : j.as_object()) {
    bool known = false;
    for (const char *key : keys)
      known = known || k == key;
    require(known, w, ": unknown key '", k, "' (known: nodes, gpus_per_node, slots, num_experts, layers)");
  }
  auto get = [&](const json::Value &obj, const char *key, const std::string &at) -> const json::Value & {
    const json::Value *v = obj.find(key);
    require(v != nullptr, at, ": missing key '", key, "'");
    return *v;
  };
  auto get_int = [&](const json::Value &v, const std::string &at) {
    require(v.is_integer(), at, ": expected an integer, got ", value_text(v));
    return v.as_integer();
  };
  const std::int64_t nodes = get_int(get(j, "nodes", w), w + ".nodes"),
                     gpn = get_int(get(j, "gpus_per_node", w), w + ".gpus_per_node"),
                     slots = get_int(get(j, "slots", w), w + ".slots"),
                     experts = get_int(get(j, "num_experts", w), w + ".num_experts");
  require(nodes == topo.num_nodes && gpn == topo.gpus_per_node && slots == topo.slots_per_gpu, w, ": placement is for ",
          nodes, " x ", gpn, " GPUs x ", slots, " slots, the topology is ", topo.num_nodes, " x ", topo.gpus_per_node,
          " x ", topo.slots_per_gpu);
  require(experts == num_experts, w, ": placement has ", experts, " experts, the loads have ", num_experts);
  const json::Value &layers = get(j, "layers", w);
  require(layers.is_array() && static_cast<std::int64_t>(layers.as_array().size()) == num_layers, w, ": ",
          layers.is_array() ? layers.as_array().size() : 0, " layers, the loads have ", num_layers);
  Placement p(topo, num_layers, num_experts);
  for (int l = 0; l < num_layers; ++l) {
    const std::string wl = w + ".layers[" + std::to_string(l) + "]";
    const json::Value &layer = layers.as_array()[l];
    require(layer.is_object(), wl, ": expected an object, got ", value_text(layer));
    for (const auto &[k, v] : layer.as_object())
      require(k == "gpu_slots", wl, ": unknown key '", k, "'");
    const json::Value &g = get(layer, "gpu_slots", wl);
    require(g.is_array() && static_cast<int>(g.as_array().size()) == topo.num_gpus(), w, ": layer ", l, " has ",
            g.is_array() ? g.as_array().size() : 0, " GPU lists, expected ", topo.num_gpus());
    for (int gpu = 0; gpu < topo.num_gpus(); ++gpu) {
      const json::Value &s = g.as_array()[gpu];
      require(s.is_array() && static_cast<int>(s.as_array().size()) == topo.slots_per_gpu, w, ": layer ", l, " GPU ",
              gpu, " lists ", s.is_array() ? s.as_array().size() : 0, " slots, expected ", topo.slots_per_gpu);
      for (int k = 0; k < topo.slots_per_gpu; ++k) {
        const std::string at = wl + ".gpu_slots[" + std::to_string(gpu) + "][" + std::to_string(k) + "]";
        const std::int64_t e = get_int(s.as_array()[k], at);
        require(e >= -1 && e < num_experts, w, ": layer ", l, " GPU ", gpu, " slot ", k, " holds expert ", e,
                ", outside [-1, ", num_experts, ")");
        p.layer(l).slot(gpu, k) = static_cast<std::int32_t>(e);
      }
    }
  }
  try {
    p.validate();
  } catch (const Error &e) {
    fail(w, ": ", e.what());
  }
  return p;
}

/// Reads a placement file (parse errors name `path:line:column`).
[[nodiscard]] inline Placement read_placement_file(const std::filesystem::path &path, const Topology &topo,
                                                   int num_layers, int num_experts) {
  const std::string where = path.string();
  return read_placement(json::parse(read_text(path), where), where, topo, num_layers, num_experts);
}

/// A breakdown as named seconds (`total` is their sum).
[[nodiscard]] inline json::Value breakdown_json(const SimBreakdown &b) {
  json::Value j;
  for (const BreakdownPart &p : breakdown_parts)
    j[std::string(p.name) + "_seconds"] = b.*p.field;
  j["total_seconds"] = b.total();
  return j;
}

/// A strategy's figures per RL step as JSON fields of `d` (both result tables: the configured deployment's and the
/// best deployments').
inline void result_figures_json(json::Value &d, const SimResult &r) {
  d["step_seconds"] = r.step_seconds;
  d["recompute_seconds"] = r.recompute_seconds;
  d["update_seconds"] = r.update_seconds;
  d["end_to_end_seconds"] = r.end_to_end_seconds;
  d["imbalance_median"] = r.imbalance_median;
  d["imbalance_p99"] = r.imbalance_p99;
  d["moved_gb"] = r.moved_gb;
  d["grad_gb"] = r.grad_gb;
  d["inter_node_gb"] = r.inter_node_gb;
  d["stall_seconds"] = r.stall_seconds;
}

/// A deployment as JSON fields of `j`.
inline void deployment_json(json::Value &j, const Deployment &d, int num_gpus) {
  j["ep_size"] = d.ep_size;
  j["num_ep_groups"] = num_gpus / d.pipeline_stages / d.ep_size; // per pipeline stage
  j["slots"] = d.slots;
  j["microbatch_tokens"] = d.microbatch_tokens; // 0: the loads as given
  j["pipeline_stages"] = d.pipeline_stages;
  j["tensor_parallel"] = d.tensor_parallel;
}

/// The deployment search's part of the results document: each strategy's best deployment and every run.
[[nodiscard]] inline json::Value best_deployment_json(const SimulateSettings &s, const DeploymentSearch &search) {
  const int G = s.sim.topo.num_gpus();
  auto best_of = [&](std::string_view name) -> const DeploymentRun * {
    for (std::size_t i = 0; i < search.strategies.size(); ++i)
      if (search.strategies[i].name == name && search.best[i] >= 0)
        return &search.runs[static_cast<std::size_t>(search.best[i])];
    return nullptr;
  };
  const DeploymentRun *st = best_of("static"), *ep = best_of("eplb"), *fm = best_of("foremoe");
  json::Value j;
  json::Value cands = json::Array{};
  for (const Deployment &d : search.candidates) {
    json::Value c;
    deployment_json(c, d, G);
    cands.push_back(std::move(c));
  }
  j["candidates"] = std::move(cands);
  j["gpu_memory_gb"] = s.sim.gpu_memory_gb;
  j["search_seconds"] = search.seconds; // wall time of the simulations
  json::Value rows = json::Array{};
  for (std::size_t i = 0; i < search.strategies.size(); ++i) {
    json::Value d;
    d["strategy"] = search.strategies[i].name;
    d["fits"] = search.best[i] >= 0;
    if (search.best[i] >= 0) {
      const DeploymentRun &b = search.runs[static_cast<std::size_t>(search.best[i])];
      const SimResult &r = b.result;
      deployment_json(d, b.deployment, G);
      result_figures_json(d, r);
      d["peak_memory_gb"] = r.memory.total() * 1e-9;
      d["breakdown"] = breakdown_json(r.breakdown);
      // Each against the other's best deployment: >1 means this strategy's best is the faster.
      d["speedup_over_static"] = st != nullptr ? st->result.step_seconds / r.step_seconds : 0.0;
      d["speedup_over_eplb"] = ep != nullptr ? ep->result.step_seconds / r.step_seconds : 0.0;
      d["foremoe_speedup"] = fm != nullptr ? r.step_seconds / fm->result.step_seconds : 0.0;
    }
    rows.push_back(std::move(d));
  }
  j["strategies"] = std::move(rows);
  json::Value runs = json::Array{};
  for (std::size_t t = 0; t < search.runs.size(); ++t) {
    const DeploymentRun &r = search.runs[t];
    json::Value d;
    d["strategy"] = search.strategies[t % search.strategies.size()].name;
    deployment_json(d, r.deployment, G);
    if (r.error.empty()) {
      d["step_seconds"] = r.result.step_seconds;
      d["imbalance_median"] = r.result.imbalance_median;
      d["peak_memory_gb"] = r.result.memory.total() * 1e-9;
      d["fits"] = r.fits;
    } else {
      d["fits"] = false;
      d["error"] = r.error;
    }
    runs.push_back(std::move(d));
  }
  j["runs"] = std::move(runs);
  json::Value skipped = json::Array{};
  for (const auto &[d, why] : search.skipped) {
    json::Value k;
    deployment_json(k, d, G);
    k["reason"] = why;
    skipped.push_back(std::move(k));
  }
  j["skipped"] = std::move(skipped);
  return j;
}

/// The simulate results document (`foremoe simulate --json`, Python `simulate()`); with `search`, its
/// `best_deployment`.
[[nodiscard]] inline json::Value simulate_document(const SimulateSettings &s, int num_steps,
                                                   std::int64_t num_micro_steps, const std::vector<SimResult> &res,
                                                   const DeploymentSearch *search = nullptr) {
  const SimResult *base_static = nullptr, *base_eplb = nullptr;
  for (const auto &r : res) {
    if (r.strategy == "static") base_static = &r;
    if (r.strategy == "eplb") base_eplb = &r;
  }
  json::Value j;
  j["config"] = simulate_schema().write(s); // the full effective settings, readable by --config
  j["nodes"] = s.sim.topo.num_nodes;
  j["gpus_per_node"] = s.sim.topo.gpus_per_node;
  j["slots"] = s.sim.topo.slots_per_gpu;
  j["num_layers"] = s.sim.model.num_layers;
  j["num_experts"] = s.sim.model.num_experts;
  j["num_steps"] = num_steps; // counted
  j["num_micro_steps"] = num_micro_steps;
  j["warmup_steps"] = s.sim.warmup_steps; // simulated before them, not counted
  j["eplb_interval"] = s.sim.planner.eplb_interval;
  j["gpu_load_layer"] = s.sim.gpu_load_layer;
  j["workload"] = s.workload;
  j["rollout_seconds"] = res.empty() ? s.sim.rollout_seconds : res.front().rollout_seconds; // the one in use
  j["rollout_share"] = s.sim.rollout_share;
  j["gpu_memory_gb"] = s.sim.gpu_memory_gb;
  j["ep_size"] = s.sim.effective_ep_size();
  j["num_ep_groups"] = s.sim.stage_gpus() / s.sim.effective_ep_size(); // per pipeline stage
  j["pipeline_stages"] = s.sim.pipeline_stages;
  j["tensor_parallel"] = s.sim.tensor_parallel;
  if (s.sim.a2a_hits == A2aHitsSource::ids) {
    // Counted mode only (the estimate's document is unchanged): the strategies that planned traffic-aware.
    json::Value ta = json::Array{};
    for (const auto &r : res)
      if (plans_traffic_aware(s.sim, r.strategy)) ta.push_back(r.strategy);
    j["traffic_aware_strategies"] = std::move(ta);
  }
  json::Value list = json::Array{};
  for (const auto &r : res) {
    json::Value d;
    d["strategy"] = r.strategy;
    result_figures_json(d, r);
    d["mirror_refresh_seconds"] = r.mirror_seconds;
    d["host_mirror_gb_per_node"] = r.memory.host_mirror_per_node * 1e-9; // host memory, not in peak_memory
    d["planner_seconds"] = r.planner_seconds;
    d["planner_critical_seconds"] = r.planner_critical_seconds; // wall time: not in step_seconds
    d["step_with_planner_seconds"] = r.step_seconds + r.planner_critical_seconds;
    d["grad_tail_seconds"] = r.grad_tail_seconds;
    d["a2a_hidden_seconds"] = r.a2a_hidden_seconds; // under compute (sim.a2a_overlap): not in the breakdown
    json::Value mem;
    for (const MemoryPart &p : memory_parts)
      mem[std::string(p.name) + "_gb"] = r.memory.*p.field * 1e-9;
    mem["total_gb"] = r.memory.total() * 1e-9;
    mem["gpu"] = r.memory.gpu;
    mem["stage"] = r.memory.stage;
    d["peak_memory"] = std::move(mem);
    d["min_experts_per_gpu"] = r.min_experts_per_gpu;
    d["speedup_over_static"] = base_static ? base_static->step_seconds / r.step_seconds : 0.0;
    d["speedup_over_eplb"] = base_eplb ? base_eplb->step_seconds / r.step_seconds : 0.0;
    // The whole RL step: training (step_seconds) plus rollout (sim.rollout_seconds, the same for every strategy).
    d["rl_speedup_over_static"] = base_static ? base_static->end_to_end_seconds / r.end_to_end_seconds : 0.0;
    d["rl_speedup_over_eplb"] = base_eplb ? base_eplb->end_to_end_seconds / r.end_to_end_seconds : 0.0;
    d["breakdown"] = breakdown_json(r.breakdown);
    json::Value steps = json::Array{};
    for (const SimBreakdown &b : r.step_breakdown)
      steps.push_back(breakdown_json(b));
    d["steps"] = std::move(steps);
    json::Value micro = json::Array{};
    for (const SimBreakdown &b : r.micro_breakdown)
      micro.push_back(breakdown_json(b));
    d["micro_steps"] = std::move(micro);
    d["micro_step_layer_seconds"] = r.layer_seconds;
    d["micro_step_layer_imbalance"] = r.layer_imbalance;
    d["micro_step_gpu_load"] = r.gpu_loads;
    list.push_back(std::move(d));
  }
  j["strategies"] = std::move(list);
  if (search != nullptr) j["best_deployment"] = best_deployment_json(s, *search);
  // What each array's axes are, so that a reader need not guess.
  json::Value axes;
  axes["strategies[].steps"] = json::Array{"rl_step"};
  axes["strategies[].micro_steps"] = json::Array{"simulated_micro_step"};
  axes["strategies[].micro_step_layer_seconds"] = json::Array{"simulated_micro_step", "layer"};
  axes["strategies[].micro_step_layer_imbalance"] = json::Array{"simulated_micro_step", "layer"};
  axes["strategies[].micro_step_gpu_load"] = json::Array{"simulated_micro_step", "gpu"};
  j["axes"] = std::move(axes);
  j["notes"] =
      json::Value("simulated micro-steps run per RL step: the recompute passes' micro-steps, then the update pass's; "
                  "breakdown fields are seconds and add up to step_seconds (per RL step); every figure covers the "
                  "num_steps counted steps, after warmup_steps steps that were simulated and dropped; with several EP "
                  "groups (data-parallel copies) a step's times are those of its slowest group, volumes the sum; "
                  "micro_step_layer_imbalance is each layer's max/mean GPU load and micro_step_gpu_load the tokens "
                  "per GPU (of the EP group) in layer gpu_load_layer, both of that slowest group");
  return j;
}

/// The line that says what was simulated (stdout before the table; stderr in CSV mode).
[[nodiscard]] inline std::string simulate_summary(const SimulateSettings &s, const json::Value &doc) {
  std::ostringstream out;
  const SimConfig &c = s.sim;
  const std::int64_t num_steps = doc.find("num_steps")->as_integer();
  out << "simulated " << num_steps << (num_steps == 1 ? " RL step (" : " RL steps (")
      << doc.find("num_micro_steps")->as_integer() << " micro-steps, recompute x " << c.recompute_passes
      << " + update), after " << c.warmup_steps << (c.warmup_steps == 1 ? " warm-up step," : " warm-up steps,")
      << " of " << c.model.num_layers << " MoE layers x " << c.model.num_experts << " experts, top-" << c.model.topk
      << ", on " << c.topo.num_nodes << " x " << c.topo.gpus_per_node << " GPUs";
  const std::int64_t ep = doc.find("ep_size")->as_integer(), groups = doc.find("num_ep_groups")->as_integer();
  const std::int64_t pp = doc.find("pipeline_stages")->as_integer(), tp = doc.find("tensor_parallel")->as_integer();
  if (pp > 1) out << " in " << pp << " pipeline stages";
  if (tp > 1) out << ", dense part tensor-parallel over " << tp;
  if (groups > 1)
    out << " (" << groups << " data-parallel EP groups of " << ep << " GPUs" << (pp > 1 ? " per stage" : "") << ")";
  out << " with " << c.topo.slots_per_gpu << " slots per GPU per layer";
  if (s.workload != "grpo") out << ", workload " << s.workload;
  if (s.batch.packing == BatchPacking::tokens) out << ", micro-batches packed by tokens";
  if (s.batch.packing == BatchPacking::routing) out << ", micro-batches packed by routing";
  out << "\n";
  return out.str();
}

/// The results as CSV: the header line first, one row per strategy.
[[nodiscard]] inline std::string simulate_csv(const json::Value &doc) {
  std::ostringstream out;
  out << "strategy,step_s,recompute_s,update_s,median_max_mean,p99_max_mean,moved_gb,stall_ms,speedup_static,"
         "speedup_eplb";
  for (const BreakdownPart &p : breakdown_parts)
    out << "," << p.name << "_s";
  out << ",peak_memory_gb,rl_step_s,inter_node_gb\n";
  for (const json::Value &r : doc.find("strategies")->as_array()) {
    auto f = [&](const char *k) { return r.find(k)->as_double(); };
    out << r.find("strategy")->as_string() << "," << f("step_seconds") << "," << f("recompute_seconds") << ","
        << f("update_seconds") << "," << f("imbalance_median") << "," << f("imbalance_p99") << "," << f("moved_gb")
        << "," << f("stall_seconds") * 1e3 << "," << f("speedup_over_static") << "," << f("speedup_over_eplb");
    const json::Value &b = *r.find("breakdown");
    for (const BreakdownPart &p : breakdown_parts)
      out << "," << b.find(std::string(p.name) + "_seconds")->as_double();
    out << "," << r.find("peak_memory")->find("total_gb")->as_double() << "," << f("end_to_end_seconds");
    out << "," << f("inter_node_gb") << "\n";
  }
  return out.str();
}

/// A speed-up as the tables print it: "1.234x", or "n/a" where there is no baseline (0).
[[nodiscard]] inline std::string ratio_text(double v) {
  std::ostringstream os;
  if (v > 0)
    os << std::fixed << std::setprecision(3) << v << "x";
  else
    os << "n/a";
  return os.str();
}

/// The `best_deployment` part of a results document as a text table: the space searched, then each strategy's
/// fastest deployment that fits.
[[nodiscard]] inline std::string best_deployment_table(const json::Value &best) {
  std::ostringstream out;
  std::vector<std::int64_t> eps, mbs;
  const json::Array &cands = best.find("candidates")->as_array();
  for (const json::Value &c : cands) {
    eps.push_back(c.find("ep_size")->as_integer());
    mbs.push_back(c.find("microbatch_tokens")->as_integer());
  }
  auto distinct = [](std::vector<std::int64_t> v) {
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
    std::string t;
    for (const std::int64_t x : v)
      t.append(t.empty() ? "" : ", ").append(std::to_string(x));
    return t;
  };
  out << "\neach strategy in its best deployment: the fastest of " << cands.size() << " (EP " << distinct(eps)
      << "; slots per EP size: the owners + "
      << "spares; micro-batch tokens per GPU "
      << (mbs.size() == 1 && mbs.front() == 0 ? std::string("as given") : distinct(mbs)) << ") that fits "
      << std::defaultfloat << best.find("gpu_memory_gb")->as_double() << " GB, on the same batch\n";
  out << std::left << std::setw(14) << "strategy" << std::right << std::setw(5) << "EP" << std::setw(7) << "slots"
      << std::setw(11) << "mb tokens" << std::setw(10) << "step s" << std::setw(9) << "median" << std::setw(11)
      << "moved GB" << std::setw(9) << "peak GB" << std::setw(11) << "vs static" << std::setw(9) << "vs eplb"
      << std::setw(12) << "foremoe is"
      << "\n";
  for (const json::Value &r : best.find("strategies")->as_array()) {
    out << std::left << std::setw(14) << r.find("strategy")->as_string() << std::right;
    if (!r.find("fits")->as_bool()) {
      out << "  no deployment of the space fits or plans\n";
      continue;
    }
    auto f = [&](const char *k) { return r.find(k)->as_double(); };
    const std::int64_t mb = r.find("microbatch_tokens")->as_integer();
    out << std::setw(5) << r.find("ep_size")->as_integer() << std::setw(7) << r.find("slots")->as_integer()
        << std::setw(11) << (mb > 0 ? std::to_string(mb) : std::string("given")) << std::fixed << std::setprecision(3)
        << std::setw(10) << f("step_seconds") << std::setw(9) << f("imbalance_median") << std::setprecision(1)
        << std::setw(11) << f("moved_gb") << std::setw(9) << f("peak_memory_gb") << std::setw(11)
        << ratio_text(f("speedup_over_static")) << std::setw(9) << ratio_text(f("speedup_over_eplb")) << std::setw(12)
        << ratio_text(f("foremoe_speedup"));
    const std::int64_t pp = r.find("pipeline_stages")->as_integer(), tp = r.find("tensor_parallel")->as_integer();
    if (pp != 1 || tp != 1) out << "  PP " << pp << " TP " << tp;
    out << "\n";
  }
  for (const json::Value &k : best.find("skipped")->as_array())
    out << "left out: EP " << k.find("ep_size")->as_integer() << ", " << k.find("reason")->as_string() << "\n";
  out << "(vs static, vs eplb: against their best deployments; foremoe is: how much faster foremoe's best deployment "
         "is\n than this strategy's best, below 1 where this one is faster; every run: best_deployment.runs in "
         "--json)\n";
  return out.str();
}

/// The results as the aligned text table with its legend line.
[[nodiscard]] inline std::string simulate_table(const json::Value &doc) {
  std::ostringstream out;
  out << std::left << std::setw(14) << "strategy" << std::right << std::setw(10) << "step s" << std::setw(13)
      << "recompute s" << std::setw(10) << "update s" << std::setw(9) << "median" << std::setw(9) << "p99"
      << std::setw(11) << "moved GB" << std::setw(10) << "stall ms" << std::setw(11) << "vs static" << std::setw(9)
      << "vs eplb" << std::setw(9) << "peak GB" << std::setw(9) << "plan ms" << std::setw(11) << "x-node GB"
      << "\n";
  for (const json::Value &r : doc.find("strategies")->as_array()) {
    auto f = [&](const char *k) { return r.find(k)->as_double(); };
    out << std::left << std::setw(14) << r.find("strategy")->as_string() << std::right << std::fixed
        << std::setprecision(3) << std::setw(10) << f("step_seconds") << std::setw(13) << f("recompute_seconds")
        << std::setw(10) << f("update_seconds") << std::setw(9) << f("imbalance_median") << std::setw(9)
        << f("imbalance_p99") << std::setprecision(1) << std::setw(11) << f("moved_gb") << std::setw(10)
        << f("stall_seconds") * 1e3 << std::setw(11) << ratio_text(f("speedup_over_static")) << std::setw(9)
        << ratio_text(f("speedup_over_eplb")) << std::setw(9) << r.find("peak_memory")->find("total_gb")->as_double()
        << std::setw(9) << f("planner_critical_seconds") * 1e3 << std::setprecision(0) << std::setw(11)
        << f("inter_node_gb") << "\n";
  }
  out << "(step/recompute/update: seconds per RL step; median/p99: per-layer max/mean GPU load; moved GB: weights\n"
         " moved per step; stall ms: per step, layers waiting for moved weights or returning gradients; vs: step-time\n"
         " speed-up. foremoe-free may put copies in any slot, but foremoe's plan is one of its candidates: where that\n"
         " plan already balances perfectly (median 1.000) foremoe-free keeps it, and the figures agree; peak GB:\n"
         " memory of the fullest GPU; plan ms: per step, planning on the critical path, wall time, not in step s;\n"
         " x-node GB: per step, all-to-all token bytes sent between nodes, dispatch and combine, every EP group)\n";
  if (const double rollout = doc.find("rollout_seconds")->as_double(); rollout > 0) {
    out << "whole RL step with " << std::setprecision(3) << rollout << " s rollout (training s + rollout s; speed-up "
        << "vs static, vs eplb):";
    for (const json::Value &r : doc.find("strategies")->as_array())
      out << " " << r.find("strategy")->as_string() << " " << r.find("end_to_end_seconds")->as_double() << " s "
          << ratio_text(r.find("rl_speedup_over_static")->as_double()) << " "
          << ratio_text(r.find("rl_speedup_over_eplb")->as_double()) << ";";
    out << "\n";
  }
  if (const json::Value *best = doc.find("best_deployment"); best != nullptr) out << best_deployment_table(*best);
  const std::int64_t warm = doc.find("warmup_steps")->as_integer(), every = doc.find("eplb_interval")->as_integer();
  const json::Value *a2a = doc.find("config") != nullptr && doc.find("config")->find("cost") != nullptr
                               ? doc.find("config")->find("cost")->find("a2a_model")
                               : nullptr;
  const bool flat = a2a != nullptr && a2a->is_string() && a2a->as_string() == "flat";
  // The overlap settings, from the effective config (0 where a document has none).
  auto sim_setting = [&](const char *key) {
    const json::Value *c = doc.find("config");
    const json::Value *sim = c != nullptr ? c->find("sim") : nullptr;
    const json::Value *v = sim != nullptr ? sim->find(key) : nullptr;
    return v != nullptr && v->is_number() ? v->as_double() : 0.0;
  };
  const json::Value *sim_cfg = doc.find("config") != nullptr ? doc.find("config")->find("sim") : nullptr;
  const json::Value *hits = sim_cfg != nullptr ? sim_cfg->find("a2a_hits") : nullptr;
  const bool from_ids = hits != nullptr && hits->is_string() && hits->as_string() == "ids";
  out << "model: "
      << (flat       ? "per-GPU uniform (flat)"
          : from_ids ? "hierarchical (DeepEP-style, per-node dedup; hits counted from the routed ids)"
                     : "hierarchical (DeepEP-style, per-node dedup)")
      << " all-to-all, " << std::defaultfloat << std::setprecision(3) << sim_setting("a2a_overlap")
      << " of it under compute (sim.a2a_overlap), expert-gradient sync across EP-group copies "
      << sim_setting("dp_grad_overlap") << " under the backward (sim.dp_grad_overlap), LM head and optimizer from "
      << "the model, grouped-GEMM fit, move windows (docs/simulator.md)\nwarm-up: " << warm
      << (warm == 1 ? " RL step" : " RL steps") << " simulated and not counted; eplb rebalances every " << every
      << (every == 1 ? " step" : " steps") << "\n";
  return out.str();
}

} // namespace config
} // namespace v0
} // namespace foremoe
