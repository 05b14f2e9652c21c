// `foremoe simulate`: replays RL steps on a modelled cluster and compares strategies. The project's main job.

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <ostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "command.hpp"
#include "foremoe/sim/simulator.hpp"
#include "foremoe/trace/io.hpp"
#include "foremoe/trace/synthetic.hpp"
#include "plan_json.hpp"

namespace foremoe::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

/// The embedded default batch: a GRPO step of 256 prompts x 8 responses on 64 GPUs, micro-batches of
/// 8,192 tokens per GPU (about 8 micro-steps per step).
SyntheticConfig default_batch() {
  SyntheticConfig b;
  b.num_steps = 2;
  b.prompts_per_step = 256;
  b.microbatch_tokens_per_gpu = 8192;
  return b;
}

// Reads `obj[key]` into `out` when present; unknown keys are errors so that typos do not pass silently.
template <class T> void get(const json &obj, const char *key, T &out, const std::string &where) {
  if (!obj.contains(key)) return;
  try {
    out = obj.at(key).get<T>();
  } catch (const json::exception &e) {
    detail::fail(where, ".", key, ": ", e.what());
  }
}
void check_keys(const json &obj, std::initializer_list<const char *> keys, const std::string &where) {
  detail::require(obj.is_object(), where, " must be a JSON object");
  for (const auto &[k, v] : obj.items()) {
    bool known = false;
    for (const char *key : keys) known = known || k == key;
    detail::require(known, where, ": unknown key '", k, "'");
  }
}

/// Applies a JSON config: {"model": {...}, "topology": {...}, "batch": {...}, "sim": {...}, "cost": {...}}.
void apply_config(const fs::path &path, SimConfig &cfg, SyntheticConfig &batch) {
  std::ifstream in(path);
  detail::require(in.good(), path.string(), ": cannot open");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception &e) {
    detail::fail(path.string(), ": not valid JSON: ", e.what());
  }
  const std::string w = path.string();
  check_keys(j, {"model", "topology", "batch", "sim", "cost"}, w);
  if (j.contains("model")) {
    const json &m = j["model"];
    check_keys(m, {"layers", "experts", "topk", "hidden", "expert_ffn", "dtype"}, w + ".model");
    get(m, "layers", cfg.model.num_layers, w + ".model");
    get(m, "experts", cfg.model.num_experts, w + ".model");
    get(m, "topk", cfg.model.topk, w + ".model");
    get(m, "hidden", cfg.model.hidden, w + ".model");
    get(m, "expert_ffn", cfg.model.expert_ffn, w + ".model");
    std::string d;
    get(m, "dtype", d, w + ".model");
    if (!d.empty()) cfg.model.dtype = parse_weight_dtype(d);
  }
  if (j.contains("topology")) {
    const json &t = j["topology"];
    check_keys(t, {"nodes", "gpus_per_node", "slots"}, w + ".topology");
    get(t, "nodes", cfg.topo.num_nodes, w + ".topology");
    get(t, "gpus_per_node", cfg.topo.gpus_per_node, w + ".topology");
    get(t, "slots", cfg.topo.slots_per_gpu, w + ".topology");
  }
  if (j.contains("batch")) {
    const json &b = j["batch"];
    check_keys(b, {"steps", "prompts", "responses", "prompt_mean", "response_mean", "microbatch_tokens", "seed",
                   "skew", "persistence"},
               w + ".batch");
    get(b, "steps", batch.num_steps, w + ".batch");
    get(b, "prompts", batch.prompts_per_step, w + ".batch");
    get(b, "responses", batch.responses_per_prompt, w + ".batch");
    get(b, "prompt_mean", batch.prompt_length.mean, w + ".batch");
    get(b, "response_mean", batch.response_length.mean, w + ".batch");
    get(b, "microbatch_tokens", batch.microbatch_tokens_per_gpu, w + ".batch");
    get(b, "seed", batch.seed, w + ".batch");
    get(b, "skew", batch.skew, w + ".batch");
    get(b, "persistence", batch.persistence, w + ".batch");
  }
  if (j.contains("sim")) {
    const json &s = j["sim"];
    check_keys(s, {"recompute_passes", "minibatches_per_step", "optimizer_seconds", "rollout_seconds", "double_buffer",
                   "reowning_free", "move_budget"},
               w + ".sim");
    get(s, "recompute_passes", cfg.recompute_passes, w + ".sim");
    get(s, "minibatches_per_step", cfg.minibatches_per_step, w + ".sim");
    get(s, "optimizer_seconds", cfg.optimizer_seconds, w + ".sim");
    get(s, "rollout_seconds", cfg.rollout_seconds, w + ".sim");
    get(s, "double_buffer", cfg.double_buffer, w + ".sim");
    get(s, "reowning_free", cfg.reowning_free, w + ".sim");
    get(s, "move_budget", cfg.move_budget, w + ".sim");
  }
  if (j.contains("cost")) {
    const json &c = j["cost"];
    check_keys(c, {"backward_factor", "dense_per_token_us", "dense_launch_us", "gemm_launch_us", "gemm_per_expert_us",
                   "gemm_compute_efficiency", "gemm_hbm_efficiency", "a2a_intra_gb_per_s", "a2a_inter_gb_per_s",
                   "a2a_intra_latency_us", "a2a_inter_latency_us", "move_intra_gb_per_s", "move_inter_gb_per_s",
                   "move_host_gb_per_s", "move_intra_latency_us", "move_inter_latency_us", "move_host_latency_us",
                   "grad_add_gb_per_s"},
               w + ".cost");
    get(c, "dense_launch_us", cfg.cost.dense.launch_us, w + ".cost");
    get(c, "gemm_launch_us", cfg.cost.gemm.launch_us, w + ".cost");
    get(c, "gemm_per_expert_us", cfg.cost.gemm.per_expert_us, w + ".cost");
    get(c, "gemm_compute_efficiency", cfg.cost.gemm.compute_efficiency, w + ".cost");
    get(c, "gemm_hbm_efficiency", cfg.cost.gemm.hbm_efficiency, w + ".cost");
    get(c, "a2a_intra_latency_us", cfg.cost.a2a.intra_latency_us, w + ".cost");
    get(c, "a2a_inter_latency_us", cfg.cost.a2a.inter_latency_us, w + ".cost");
    get(c, "move_intra_latency_us", cfg.cost.move.gpu_intra.latency_us, w + ".cost");
    get(c, "move_inter_latency_us", cfg.cost.move.gpu_inter.latency_us, w + ".cost");
    get(c, "move_host_latency_us", cfg.cost.move.host.latency_us, w + ".cost");
    get(c, "grad_add_gb_per_s", cfg.cost.grad.add_gb_per_s, w + ".cost");
    get(c, "backward_factor", cfg.cost.backward_factor, w + ".cost");
    get(c, "dense_per_token_us", cfg.cost.dense.per_token_us, w + ".cost");
    get(c, "a2a_intra_gb_per_s", cfg.cost.a2a.intra_gb_per_s, w + ".cost");
    get(c, "a2a_inter_gb_per_s", cfg.cost.a2a.inter_gb_per_s, w + ".cost");
    get(c, "move_intra_gb_per_s", cfg.cost.move.gpu_intra.gb_per_s, w + ".cost");
    get(c, "move_inter_gb_per_s", cfg.cost.move.gpu_inter.gb_per_s, w + ".cost");
    get(c, "move_host_gb_per_s", cfg.cost.move.host.gb_per_s, w + ".cost");
  }
}

Command make_simulate() {
  Command c;
  c.words = {"simulate"};
  c.summary = "replay RL steps on a modelled cluster and compare balancing strategies (the main job)";
  c.description =
      "Without arguments: Qwen3-30B-A3B (48 MoE layers x 128 experts, top-8, H 2048, I 768, bf16) on 8 nodes x 8\n"
      "H200 with 3 slots per GPU per layer (2 owners + 1 spare), a synthetic GRPO batch (2 steps x 256 prompts x\n"
      "8 responses, 8,192-token micro-batches per GPU), recompute + update, all strategies.";
  c.options = {
      {"config", "FILE.json", "model, topology, batch, sim and cost settings", ""},
      {"preset", "NAME", "qwen3-30b-a3b or deepseek-v3 (58 x 256, H 7168, I 2048, fp8, 8 x 8 GPUs, 5 slots)", "qwen3-30b-a3b"},
      {"loads", "FILE.npy", "per-micro-step loads [M, L, E] instead of the generator (steps from FILE.steps.npy)", ""},
      {"strategies", "LIST", "comma-separated: " + sim_strategy_names(","), sim_strategy_names(",")},
      {"steps", "N", "RL steps to generate", ""},
      {"nodes", "N", "nodes", ""},
      {"gpus-per-node", "G", "GPUs per node", ""},
      {"slots", "S", "expert slots per GPU per layer", ""},
      {"seed", "N", "generator seed", "1"},
      {"threads", "T", "planner threads over layers", "1"},
      {"double-buffer", "", "a second buffer per replica slot", ""},
      {"dtype", "DTYPE", "expert weight dtype: bf16, fp16, fp32 or fp8 (default: the preset's)", ""},
      {"json", "OUT.json", "write machine-readable results", ""},
      {"csv", "", "print the table as CSV", ""},
  };
  c.run = [](const Args &a, std::ostream &out, std::ostream &err) {
    SimConfig cfg;
    SyntheticConfig batch = default_batch();
    const std::string preset = a.str("preset");
    if (preset == "deepseek-v3") {
      cfg.model = deepseek_v3(WeightDtype::fp8);
      cfg.topo = Topology{8, 8, 5};
      const SyntheticConfig ds = SyntheticConfig::deepseek_v3();
      batch.num_layers = ds.num_layers;
      batch.num_experts = ds.num_experts;
      batch.topk = ds.topk;
      batch.skew = ds.skew;
      batch.prompts_per_step = 128;
    } else if (preset != "qwen3-30b-a3b") {
      throw UsageError{"--preset must be qwen3-30b-a3b or deepseek-v3, got '" + preset + "'"};
    }
    if (a.has("config")) apply_config(a.str("config"), cfg, batch);
    if (a.has("dtype")) cfg.model.dtype = parse_weight_dtype(a.str("dtype"));
    if (a.has("nodes")) cfg.topo.num_nodes = static_cast<int>(a.integer("nodes", 1, 1 << 14));
    if (a.has("gpus-per-node")) cfg.topo.gpus_per_node = static_cast<int>(a.integer("gpus-per-node", 1, 1024));
    if (a.has("slots")) cfg.topo.slots_per_gpu = static_cast<int>(a.integer("slots", 1, 1 << 14));
    if (a.has("steps")) batch.num_steps = static_cast<int>(a.integer("steps", 1, 1 << 12));
    batch.seed = static_cast<std::uint64_t>(a.integer("seed", 0, std::numeric_limits<std::int64_t>::max()));
    cfg.planner_threads = static_cast<int>(a.integer("threads", 1, 1024));
    cfg.double_buffer = cfg.double_buffer || a.flag("double-buffer");
    batch.num_layers = cfg.model.num_layers;
    batch.num_experts = cfg.model.num_experts;
    batch.topk = cfg.model.topk;
    batch.num_gpus = cfg.topo.num_gpus();
    cfg.validate();

    std::vector<SimStrategy> strategies;
    {
      std::stringstream ss(a.str("strategies"));
      std::string name;
      while (std::getline(ss, name, ','))
        if (!name.empty()) strategies.push_back(parse_sim_strategy(name));
      if (strategies.empty()) throw UsageError{"--strategies lists no strategy"};
    }

    const bool tty = isatty(fileno(stderr)) != 0;
    const auto t0 = std::chrono::steady_clock::now();
    LoadTensor loads;
    std::vector<std::int64_t> steps;
    if (a.has("loads")) {
      const fs::path p = a.str("loads");
      loads = read_loads_npy(p);
      if (fs::exists(sidecar_path(p, "steps"))) steps = read_offsets_npy(sidecar_path(p, "steps"));
    } else {
      batch.validate();
      if (tty) err << "generating the synthetic GRPO batch ..." << std::flush;
      loads = generate_loads(batch, &steps);
      if (tty) err << "\r\033[K";
    }
    const double gen_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    auto progress = [&](int done, int total) {
      if (tty) err << "\rsimulating: " << done << "/" << total << " strategy-steps" << (done == total ? "\033[K\r" : "")
                   << std::flush;
    };
    const auto t1 = std::chrono::steady_clock::now();
    const std::vector<SimResult> res = simulate(cfg, loads, steps, strategies, progress);
    const double sim_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    if (tty) err << "\r\033[K";

    auto find = [&](const char *name) -> const SimResult * {
      for (const auto &r : res)
        if (r.strategy == name) return &r;
      return nullptr;
    };
    const SimResult *base_static = find("static"), *base_eplb = find("eplb");
    const int num_steps = steps.empty() ? 1 : static_cast<int>(steps.size() - 1);
    out << "simulated " << num_steps << " RL steps (" << loads.num_micro_steps() << " micro-steps, recompute x "
        << cfg.recompute_passes << " + update) of " << cfg.model.num_layers << " MoE layers x " << cfg.model.num_experts
        << " experts, top-" << cfg.model.topk << ", on " << cfg.topo.num_nodes << " x " << cfg.topo.gpus_per_node
        << " GPUs with " << cfg.topo.slots_per_gpu << " slots per GPU per layer\n";
    const bool csv = a.flag("csv");
    if (csv)
      out << "strategy,step_s,recompute_s,update_s,median_max_mean,p99_max_mean,moved_gb,stall_ms,speedup_static,speedup_eplb\n";
    else
      out << std::left << std::setw(14) << "strategy" << std::right << std::setw(10) << "step s" << std::setw(13)
          << "recompute s" << std::setw(10) << "update s" << std::setw(9) << "median" << std::setw(9) << "p99"
          << std::setw(11) << "moved GB" << std::setw(10) << "stall ms" << std::setw(11) << "vs static" << std::setw(9)
          << "vs eplb" << "\n";
    for (const auto &r : res) {
      const double vs_static = base_static ? base_static->step_seconds / r.step_seconds : 0;
      const double vs_eplb = base_eplb ? base_eplb->step_seconds / r.step_seconds : 0;
      if (csv) {
        out << r.strategy << "," << r.step_seconds << "," << r.recompute_seconds << "," << r.update_seconds << ","
            << r.imbalance_median << "," << r.imbalance_p99 << "," << r.moved_gb << "," << r.stall_seconds * 1e3 << ","
            << vs_static << "," << vs_eplb << "\n";
        continue;
      }
      auto ratio = [](double v) {
        std::ostringstream os;
        if (v > 0) os << std::fixed << std::setprecision(3) << v << "x";
        else os << "n/a";
        return os.str();
      };
      out << std::left << std::setw(14) << r.strategy << std::right << std::fixed << std::setprecision(3)
          << std::setw(10) << r.step_seconds << std::setw(13) << r.recompute_seconds << std::setw(10)
          << r.update_seconds << std::setw(9) << r.imbalance_median << std::setw(9) << r.imbalance_p99
          << std::setprecision(1) << std::setw(11) << r.moved_gb << std::setw(10) << r.stall_seconds * 1e3
          << std::setw(11) << ratio(vs_static) << std::setw(9) << ratio(vs_eplb) << "\n";
    }
    if (!csv)
      out << "(step/recompute/update: seconds per RL step; median/p99: per-layer max/mean GPU load; moved GB per step)\n"
          << std::fixed << std::setprecision(2) << "loads in " << gen_s << " s, simulation and planning in " << sim_s
          << " s\n";
    if (a.has("json")) {
      json j;
      j["nodes"] = cfg.topo.num_nodes;
      j["gpus_per_node"] = cfg.topo.gpus_per_node;
      j["slots"] = cfg.topo.slots_per_gpu;
      j["num_layers"] = cfg.model.num_layers;
      j["num_experts"] = cfg.model.num_experts;
      j["num_steps"] = num_steps;
      j["num_micro_steps"] = loads.num_micro_steps();
      json list = json::array();
      for (const auto &r : res)
        list.push_back({{"strategy", r.strategy},
                        {"step_seconds", r.step_seconds},
                        {"recompute_seconds", r.recompute_seconds},
                        {"update_seconds", r.update_seconds},
                        {"end_to_end_seconds", r.end_to_end_seconds},
                        {"imbalance_median", r.imbalance_median},
                        {"imbalance_p99", r.imbalance_p99},
                        {"moved_gb", r.moved_gb},
                        {"grad_gb", r.grad_gb},
                        {"stall_seconds", r.stall_seconds},
                        {"mirror_refresh_seconds", r.mirror_seconds},
                        {"planner_seconds", r.planner_seconds},
                        {"speedup_over_static", base_static ? base_static->step_seconds / r.step_seconds : 0.0},
                        {"speedup_over_eplb", base_eplb ? base_eplb->step_seconds / r.step_seconds : 0.0},
                        {"micro_step_layer_seconds", r.layer_seconds}});
      j["strategies"] = std::move(list);
      write_json(a.str("json"), j);
    }
    return 0;
  };
  return c;
}

FOREMOE_REGISTER_COMMAND(make_simulate);

} // namespace
} // namespace foremoe::cli
