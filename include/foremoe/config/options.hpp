#pragma once
/// @file
/// The option schemas of the front ends (`foremoe simulate`, `foremoe plan`, Python's `simulate()` and
/// `Planner`): every key, flag, type, default, range and help text, bound to the library's config structs.
/// Defaults are those structs' own; a preset is applied before a config file, a config file before explicit
/// command-line flags.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "foremoe/config/schema.hpp"
#include "foremoe/core/limits.hpp"
#include "foremoe/core/model_spec.hpp"
#include "foremoe/core/topology.hpp"
#include "foremoe/plan/planner.hpp"
#include "foremoe/plan/traffic.hpp"
#include "foremoe/sim/deployment.hpp"
#include "foremoe/sim/simulator.hpp"
#include "foremoe/trace/baseline_workloads.hpp"
#include "foremoe/trace/formats/builtin.hpp"
#include "foremoe/trace/synthetic.hpp"

namespace foremoe {
inline namespace v0 {
namespace config {

/// Upper bounds shared by every front end (one limit per option).
inline constexpr std::int64_t max_nodes = 1 << 14, max_gpus_per_node = 1 << 10, max_slots = 1 << 14;
inline constexpr std::int64_t max_threads = 1024, max_rounds = 1 << 10, max_budget = 1 << 16;
inline constexpr double max_seconds = 1e6, max_us = 1e6, max_gb_per_s = 1e6, min_gb_per_s = 1e-6;

/// The model presets (`simulate`, `trace gen`, `trace stats`, Python).
inline const std::vector<std::string> &preset_names() {
  static const std::vector<std::string> names{"qwen3-30b-a3b", "deepseek-v3", "kimi-k2"};
  return names;
}

/// Gives `c` the MoE shape of a preset: layers, experts, top-k and the calibrated skew (the rest is kept).
inline void apply_synthetic_preset(SyntheticConfig &c, std::string_view name) {
  detail::require(name == "qwen3-30b-a3b" || name == "deepseek-v3" || name == "kimi-k2", "unknown preset '", name,
                  "' (expected qwen3-30b-a3b, deepseek-v3 or kimi-k2)");
  const SyntheticConfig p = name == "deepseek-v3" ? SyntheticConfig::deepseek_v3()
                            : name == "kimi-k2"   ? SyntheticConfig::kimi_k2()
                                                  : SyntheticConfig{};
  c.num_layers = p.num_layers;
  c.num_experts = p.num_experts;
  c.topk = p.topk;
  c.skew = p.skew;
  c.route_groups = p.route_groups;
  c.route_max_groups = p.route_max_groups;
}

/// The one default preset of every command (`plan`, `trace gen`, `trace stats`, `simulate`, Python): the EP group
/// of 8 nodes x 8 GPUs with 3 slots per GPU per layer (2 owners + 1 spare for 128 experts).
[[nodiscard]] inline Topology default_topology() { return Topology{8, 8, 3}; }

/// The default batch of the preset: Qwen3-30B-A3B's MoE shape, 2 RL steps of 256 GRPO prompts x 8 responses on
/// the 64 ranks of `default_topology()`, micro-batches of 8,192 tokens per GPU (about 11 micro-steps per step).
[[nodiscard]] inline SyntheticConfig default_batch() {
  SyntheticConfig b;
  b.num_steps = 2;
  b.prompts_per_step = 256;
  b.microbatch_tokens_per_gpu = 8192;
  b.num_gpus = default_topology().num_gpus();
  return b;
}

/// The default preset in words, for `--help`.
[[nodiscard]] inline std::string default_preset_text() {
  const Topology t = default_topology();
  const SyntheticConfig b = default_batch();
  std::ostringstream os;
  os << "qwen3-30b-a3b (" << b.num_layers << " MoE layers x " << b.num_experts << " experts, top-" << b.topk << ") on "
     << t.num_nodes << " x " << t.gpus_per_node << " GPUs x " << t.slots_per_gpu
     << " slots per GPU per layer, a synthetic GRPO batch of " << b.num_steps << " RL steps x " << b.prompts_per_step
     << " prompts x " << b.responses_per_prompt << " responses with " << b.microbatch_tokens_per_gpu
     << "-token micro-batches per GPU, seed " << b.seed;
  return os.str();
}

/// The synthetic GRPO generator's options (`SyntheticConfig`): the flags of `foremoe trace gen` and `trace
/// stats`, the keywords of Python `synthetic_trace()` / `synthetic_loads()`, and (a subset, under `batch`)
/// simulate's batch section.
[[nodiscard]] inline const Schema<SyntheticConfig> &synthetic_schema() {
  using C = SyntheticConfig;
  static const Schema<C> s = [] {
    constexpr std::int64_t max_tokens = std::int64_t{1} << 28;
    std::vector<Option<C>> o;
    o.push_back(integer<C>(
        "seed", 0, std::numeric_limits<std::int64_t>::max(),
        "generator seed; the trace is a deterministic function of it", [](auto &c) -> auto & { return c.seed; }));
    o.push_back(integer<C>(
        "layers", 1, 4096, "MoE layers", [](auto &c) -> auto & { return c.num_layers; }));
    o.push_back(integer<C>(
        "experts", 1, 32767, "routed experts per layer", [](auto &c) -> auto & { return c.num_experts; }));
    o.push_back(integer<C>(
        "topk", 1, 1024, "experts per token", [](auto &c) -> auto & { return c.topk; }));
    o.push_back(integer<C>(
        "route_groups", 1, 32767,
        "contiguous equal groups of experts for group-limited routing (must divide experts; 1: none; deepseek-v3: 8)",
        [](auto &c) -> auto & { return c.route_groups; }));
    o.push_back(integer<C>(
        "route_max_groups", 0, 32767,
        "groups a token's experts may span per layer (0 or >= route_groups: no limit; deepseek-v3: 4, "
        "arXiv:2412.19437 sec. 2.1.2)",
        [](auto &c) -> auto & { return c.route_max_groups; }));
    o.push_back(integer<C>(
        "steps", 1, 1 << 16, "RL steps to generate", [](auto &c) -> auto & { return c.num_steps; }));
    o.push_back(integer<C>(
        "prompts", 1, 1 << 24, "GRPO prompts per step", [](auto &c) -> auto & { return c.prompts_per_step; }));
    o.push_back(integer<C>(
        "responses", 1, 1 << 16, "responses per prompt (group size)",
        [](auto &c) -> auto & { return c.responses_per_prompt; }));
    o.push_back(number<C>(
        "prompt_mean", 1, max_tokens, "mean prompt length (tokens)",
        [](auto &c) -> auto & { return c.prompt_length.mean; }));
    o.push_back(number<C>(
        "response_mean", 1, max_tokens, "mean response length (tokens)",
        [](auto &c) -> auto & { return c.response_length.mean; }));
    // One bound for prompts and responses; the shortest lengths follow it down so that it may be small.
    Option<C> max_length = bound<C>(
        "max_length", Type::integer, "longest prompt or response (tokens)",
        [](const C &c) {
          return json::Value(
              static_cast<std::int64_t>(std::max(c.prompt_length.max_tokens, c.response_length.max_tokens)));
        },
        [](C &c, const json::Value &v) {
          const int n = static_cast<int>(v.as_integer());
          for (LengthDistribution *d : {&c.prompt_length, &c.response_length}) {
            d->max_tokens = n;
            d->min_tokens = std::min(d->min_tokens, n);
          }
        });
    max_length.int_min = 1;
    max_length.int_max = max_tokens;
    o.push_back(std::move(max_length));
    o.push_back(integer<C>(
        "gpus", 1, 1 << 20, "data-parallel ranks packing micro-batches (and EP GPUs for the GPU skew)",
        [](auto &c) -> auto & { return c.num_gpus; }));
    o.push_back(integer<C>(
        "microbatch_tokens", 1, std::int64_t{1} << 30, "per-GPU micro-batch token budget (dynamic batch size)",
        [](auto &c) -> auto & { return c.microbatch_tokens_per_gpu; }));
    o.push_back(choice<C>(
        "packing", {batch_packing_names.begin(), batch_packing_names.end()},
        "micro-batch packing of each step's sequences: none (shuffle, deal to ranks, fill in order), tokens "
        "(longest first to the emptiest micro-batch, verl-style) or routing (expert loads of every micro-step close "
        "to the step's share); the same micro-steps and ranks",
        [](const C &c) { return std::string(to_string(c.packing)); },
        [](C &c, const std::string &v) { c.packing = parse_batch_packing(v, "packing"); }));
    o.push_back(integer<C>(
        "packing_ranks", 0, 1 << 20,
        "ranks that re-pack their sequences together (an EP group; consecutive ranks, dividing gpus; 0: all); "
        "simulate sets it to the EP size",
        [](auto &c) -> auto & { return c.packing_ranks; }));
    o.push_back(number<C>(
        "skew", 0, 20, "skew of the per-layer expert popularity (0 = uniform)",
        [](auto &c) -> auto & { return c.skew; }));
    o.push_back(number<C>(
        "persistence", 0, 1, "probability a token keeps each expert of the previous token",
        [](auto &c) -> auto & { return c.persistence; }));
    // Fewer topics than a prompt mixes lowers the mixture to all of them.
    Option<C> topics = integer<C>(
        "topics", 1, 1 << 16, "topics with their own expert preferences (topics_per_prompt is capped by it)",
        [](auto &c) -> auto & { return c.num_topics; });
    topics.set = [set = topics.set](C &c, const json::Value &v) {
      set(c, v);
      c.topics_per_prompt = std::min(c.topics_per_prompt, c.num_topics);
    };
    o.push_back(std::move(topics));
    o.push_back(integer<C>(
        "topics_per_prompt", 1, 1 << 16, "distinct topics mixed by one prompt (at most topics)",
        [](auto &c) -> auto & { return c.topics_per_prompt; }));
    o.push_back(number<C>(
        "topic_concentration", 1e-6, 1e6, "Dirichlet concentration of a topic's expert preference, per expert",
        [](auto &c) -> auto & { return c.topic_concentration; }));
    o.push_back(number<C>(
        "coactivation", 0, 1,
        "co-activation strength: share of each topic's per-layer preference put on one cluster of experts, so that "
        "a token's experts tend to come from the same clusters (0: none, the ids as without it; 0.95: calibrated to "
        "an OLMoE-shaped routing measurement, docs/simulator.md \"Co-activation\")",
        [](auto &c) -> auto & { return c.coactivation; }));
    o.push_back(integer<C>(
        "coactivation_clusters", 0, 32767,
        "expert clusters per layer for coactivation (a random partition per layer; at most experts; 0: experts / "
        "topk)",
        [](auto &c) -> auto & { return c.coactivation_clusters; }));
    o.push_back(number<C>(
        "topic_mix_concentration", 1e-6, 1e6, "Dirichlet concentration of a prompt's weights over its topics",
        [](auto &c) -> auto & { return c.topic_mix_concentration; }));
    o.push_back(number<C>(
        "response_topic_weight", 0, 1, "weight of the topic each response draws for itself",
        [](auto &c) -> auto & { return c.response_topic_weight; }));
    o.push_back(choice<C>(
        "popularity", {"lognormal", "zipf"}, "shape of the expert popularity that skew parameterises",
        [](const C &c) { return c.popularity == PopularityModel::zipf ? "zipf" : "lognormal"; },
        [](C &c, const std::string &v) {
          c.popularity = v == "zipf" ? PopularityModel::zipf : PopularityModel::lognormal;
        }));
    o.push_back(number<C>(
        "skew_layer_sigma", 0, 10, "per-layer lognormal jitter of skew (log-scale sigma)",
        [](auto &c) -> auto & { return c.skew_layer_sigma; }));
    o.push_back(number<C>(
        "prompt_sigma", 0, 10, "log-scale sigma of the prompt lengths (0: every prompt is prompt_mean)",
        [](auto &c) -> auto & { return c.prompt_length.sigma; }));
    o.push_back(number<C>(
        "response_sigma", 0, 10, "log-scale sigma of the response lengths (0: every response is response_mean)",
        [](auto &c) -> auto & { return c.response_length.sigma; }));
    o.push_back(integer<C>(
        "prompt_min", 1, max_tokens, "shortest prompt (tokens)",
        [](auto &c) -> auto & { return c.prompt_length.min_tokens; }));
    o.push_back(integer<C>(
        "response_min", 1, max_tokens, "shortest response (tokens)",
        [](auto &c) -> auto & { return c.response_length.min_tokens; }));
    return Schema<C>("synthetic", std::move(o));
  }();
  return s;
}

/// What `foremoe trace gen` / `trace stats` and Python `synthetic_trace()` generate with: a preset (applied
/// first; it sets the MoE shape) and the generator's options.
struct SyntheticSettings {
  std::string preset = "qwen3-30b-a3b";
  SyntheticConfig config = default_batch();
};

[[nodiscard]] inline const Schema<SyntheticSettings> &synthetic_settings_schema() {
  using S = SyntheticSettings;
  static const Schema<S> s = [] {
    std::vector<Option<S>> o;
    Option<S> preset = choice<S>(
        "preset", preset_names(),
        "model shape: qwen3-30b-a3b (48 x 128, top-8), deepseek-v3 (58 x 256, top-8, 4 of 8 groups) or kimi-k2 (60 "
        "x 384, top-8)",
        [](const S &x) { return x.preset; },
        [](S &x, const std::string &v) {
          x.preset = v;
          apply_synthetic_preset(x.config, v);
        });
    preset.first = true; // the shape it sets is overridden by explicit layers, experts, topk and skew
    o.push_back(std::move(preset));
    lift(
        o, synthetic_schema(), "", [](auto &x) -> auto & { return x.config; });
    return Schema<S>("synthetic", std::move(o));
  }();
  return s;
}

/// The generator config that document `doc` (named `root` in messages; "--" for command-line flags) gives over
/// `defaults`, validated.
[[nodiscard]] inline SyntheticConfig read_synthetic(const json::Value &doc, std::string root,
                                                    SyntheticConfig defaults = default_batch()) {
  SyntheticSettings s;
  s.config = defaults;
  synthetic_settings_schema().read(s, doc, std::move(root));
  s.config.validate();
  return s.config;
}

/// The `format` choices of the count schema: "auto", then every registered trace format in listing order.
[[nodiscard]] inline std::vector<std::string> trace_format_choices() {
  std::vector<std::string> out{"auto"};
  for (const TraceFormat *f : trace_formats())
    out.push_back(f->name);
  return out;
}

/// What `auto` picks, from the formats' own descriptions, e.g. "verl for a 4-D NPY, ...".
[[nodiscard]] inline std::string trace_format_detection() {
  std::string out;
  for (const TraceFormat *f : trace_formats())
    if (!f->detects.empty()) out.append(out.empty() ? "" : ", ").append(f->name + " for " + f->detects);
  return out;
}

/// What `foremoe trace count` (and Python `count_trace`) counts: the input form, the expert count, the layer
/// map and how the token stream is cut into micro-steps and source ranks.
struct CountSettings {
  std::string format = "auto"; ///< auto or a registered trace format (`trace_formats()`)
  std::int64_t experts = 0;    ///< 0: largest id + 1
  std::int64_t dense_layers = 0;
  std::int64_t microbatch_tokens = 0; ///< 0: the micro-batch sidecar, else one micro-step
  bool by_source = false;
  std::int64_t sources = 0; ///< with by_source: 0 means the sources sidecar
  std::int64_t layers = 0;  ///< SGLang payload shape
  std::int64_t topk = 0;
};

[[nodiscard]] inline const Schema<CountSettings> &count_schema() {
  using C = CountSettings;
  static const Schema<C> s(
      "count",
      {
          choice<C>(
              "format", trace_format_choices(), "input form (auto: " + trace_format_detection() + ")",
              [](const C &c) { return c.format; }, [](C &c, const std::string &v) { c.format = v; }),
          integer<C>(
              "experts", 0, 32767, "routed experts per MoE layer (0: largest id + 1)",
              [](auto &c) -> auto & { return c.experts; }),
          integer<C>(
              "dense_layers", 0, 4096, "leading dense layers in the trace to skip (vLLM/SGLang layout)",
              [](auto &c) -> auto & { return c.dense_layers; }),
          integer<C>(
              "microbatch_tokens", 0, std::int64_t{1} << 40,
              "cut the token stream into micro-steps of N tokens (0: FILE.microbatches.npy if present, else one)",
              [](auto &c) -> auto & { return c.microbatch_tokens; }),
          boolean<C>(
              "by_source", "also split the loads by source rank ([M, L, E, S])",
              [](auto &c) -> auto & { return c.by_source; }),
          integer<C>(
              "sources", 0, max_nodes * max_gpus_per_node,
              "with by_source: S equal source ranks per micro-step (0: FILE.sources.npy)",
              [](auto &c) -> auto & { return c.sources; }),
          integer<C>(
              "layers", 0, 4096, "sglang: trace layers of the int32 [tokens, layers, topk] payload",
              [](auto &c) -> auto & { return c.layers; }),
          integer<C>(
              "topk", 0, 1024, "sglang: experts per token of the payload", [](auto &c) -> auto & { return c.topk; }),
      });
  return s;
}

/// The expert-parallel group's shape: nodes x GPUs, slots per GPU per layer.
[[nodiscard]] inline const Schema<Topology> &topology_schema() {
  static const Schema<Topology> s("topology", {
                                                  integer<Topology>(
                                                      "nodes", 1, max_nodes, "nodes in the EP group",
                                                      [](auto &t) -> auto & { return t.num_nodes; }),
                                                  integer<Topology>(
                                                      "gpus_per_node", 1, max_gpus_per_node, "GPUs per node",
                                                      [](auto &t) -> auto & { return t.gpus_per_node; }),
                                                  integer<Topology>(
                                                      "slots", 1, max_slots, "expert slots per GPU per layer",
                                                      [](auto &t) -> auto & { return t.slots_per_gpu; }),
                                              });
  return s;
}

/// The held-gradient rule (`PlannerOptions::hold_replica_gradients`, `SimConfig::hold_replica_gradients`): one
/// definition for the planner's schema and the simulator's, so `--[no-]hold-replica-gradients` reads the same in
/// `foremoe plan`, `foremoe simulate`, config files and Python.
template <class T, class F> [[nodiscard]] Option<T> hold_replica_gradients_option(std::string key, F field) {
  return boolean<T>(std::move(key),
                    "update stage: a resident replica accumulates its gradient in place and returns it once, when "
                    "its slot is reused or before the optimizer step, and the tolerance charges it once (off: every "
                    "used replica returns its gradient every micro-step)",
                    field);
}

/// The baselines' balancing domain (`PlannerOptions::peer_domain_gpus`, `SimConfig::peer_domain_gpus`): one
/// definition for the planner's schema and the simulator's.
template <class T, class F> [[nodiscard]] Option<T> peer_domain_option(std::string key, F field) {
  return integer<T>(std::move(key), -1, max_nodes * max_gpus_per_node,
                    "ultraep, moonep: GPUs per balancing domain, where their replicas may go (0: a node, as "
                    "published; -1: the whole EP group, moved over the network across nodes)",
                    field);
}

/// The traffic-aware owner settings (`TrafficSettings`, foremoe/plan/traffic.hpp) as `PREFIX.traffic_aware`,
/// `PREFIX.traffic_tolerance` and `PREFIX.traffic_tokens`: one definition for `foremoe plan` (`planner.`, off by
/// default) and `foremoe simulate` (`sim.`, on by default: it counts only where the ids are routed). `where` says
/// when the front end applies them.
template <class T, class F>
void traffic_options(std::vector<Option<T>> &o, const std::string &prefix, std::string_view where, F field) {
  o.push_back(boolean<T>(
      prefix + ".traffic_aware",
      std::string(where) +
          ": owners chosen per RL step from the step's routed ids so that experts routed together share a node "
          "(fewer distinct nodes per token in the hierarchical all-to-all), each node's owned load within "
          "traffic_tolerance; replicas per micro-step as usual",
      [field](auto &x) -> auto & { return field(x).aware; }));
  o.push_back(number<T>(
      prefix + ".traffic_tolerance", 1, 100,
      "traffic_aware: every node's owned load stays at most X times the mean node load (or the load-only owners' "
      "most loaded node if higher); X >= 1",
      [field](auto &x) -> auto & { return field(x).tolerance; }));
  o.push_back(integer<T>(
      prefix + ".traffic_tokens", 0, limits::max_load_total,
      "traffic_aware: count the co-activation on about N of the step's tokens (every ceil(T / N)-th; 0: all)",
      [field](auto &x) -> auto & { return field(x).tokens; }));
}

/// The planner's options (`PlannerOptions`), as `foremoe plan` flags and Python `Planner(...)` keywords.
[[nodiscard]] inline const Schema<PlannerOptions> &planner_schema() {
  using P = PlannerOptions;
  static const Schema<P> s(
      "planner",
      {
          bound<P>(
              "strategy", Type::string, "planning strategy: " + strategy_names(),
              [](const P &o) { return json::Value(o.strategy); },
              [](P &o, const json::Value &v) { o.strategy = find_plan_strategy(v.as_string()).name; }),
          integer<P>(
              "move_budget", -1, max_budget, "new replicas per GPU per micro-step (-1: the spare slots)",
              [](auto &o) -> auto & { return o.move_budget; }),
          boolean<P>(
              "hierarchical_owners", "owners placed nodes first, then GPUs in each node (else flat)",
              [](auto &o) -> auto & { return o.hierarchical_owners; }),
          boolean<P>(
              "reowning_free",
              "a new owner map costs nothing (colocated trainers); else keep owners within the tolerance",
              [](auto &o) -> auto & { return o.reowning_free; }),
          number<P>(
              "owner_keep_tolerance", 0, 10,
              "without reowning_free: keep the previous owners unless their peak is this much above a fresh plan",
              [](auto &o) -> auto & { return o.owner_keep_tolerance; }),
          integer<P>(
              "threads", 1, max_threads, "planning threads over layers (plans do not depend on it)",
              [](auto &o) -> auto & { return o.num_threads; }),
          integer<P>(
              "local_search_rounds", 0, max_rounds, "two-level exact-split local-search rounds per layer",
              [](auto &o) -> auto & { return o.local_search_rounds; }),
          integer<P>(
              "free_search_rounds", 0, max_rounds, "free-mode placement swap rounds per layer",
              [](auto &o) -> auto & { return o.free_search_rounds; }),
          boolean<P>(
              "exact_split",
              "re-split every two-level plan exactly (plans from a resident otherwise keep the search's split)",
              [](auto &o) -> auto & { return o.exact_split; }),
          number<P>(
              "tolerance", 0, 100,
              "largest accepted layer max/mean; within it the plan moving fewest bytes wins: weights in, and in the "
              "update stage gradients out (0: as balanced as possible; else >= 1)",
              [](auto &o) -> auto & { return o.tolerance; }),
          number<P>(
              "gradient_bytes_factor", 0, 100,
              "with a tolerance, update stage: a used replica's gradient bytes per weight byte (fp32 gradients of "
              "bf16 weights: 2; 0: count moves alone)",
              [](auto &o) -> auto & { return o.gradient_bytes_factor; }),
          hold_replica_gradients_option<P>(
              "hold_replica_gradients", [](auto &o) -> auto & { return o.hold_replica_gradients; }),
          integer<P>(
              "min_tokens_per_replica", 0, std::int64_t{1} << 40,
              "fewest tokens a replica may run (0: any); lighter pieces go back to another copy",
              [](auto &o) -> auto & { return o.min_tokens_per_replica; }),
          integer<P>(
              "ultraep_min_tokens", 0, std::int64_t{1} << 40,
              "ultraep: fewest tokens a replica runs (UltraEP's published 1,024)",
              [](auto &o) -> auto & { return o.ultraep_min_tokens; }),
          peer_domain_option<P>(
              "peer_domain_gpus", [](auto &o) -> auto & { return o.peer_domain_gpus; }),
          integer<P>(
              "eplb_num_groups", 1, 32767, "expert groups for EPLB (hierarchical when they divide over nodes)",
              [](auto &o) -> auto & { return o.eplb_num_groups; }),
          integer<P>(
              "eplb_interval", 1, 1 << 16,
              "eplb, eplb-split: rebalance every N RL steps from the loads seen since the last rebalance (static "
              "placement before the first)",
              [](auto &o) -> auto & { return o.eplb_interval; }),
      });
  return s;
}

/// Expert moves (`MoveParams`, `foremoe/cost/move.hpp`): the one move model that the simulator, the transfer
/// planner (`foremoe plan --expert-bytes`) and the runtime price moves with; `cost.move_*` keys of both commands.
[[nodiscard]] inline const Schema<MoveParams> &move_schema() {
  using M = MoveParams;
  static const Schema<M> s(
      "move",
      {
          number<M>(
              "move_intra_gb_per_s", min_gb_per_s, max_gb_per_s, "expert move GB/s inside a node",
              [](auto &m) -> auto & { return m.gpu_intra.gb_per_s; }),
          number<M>(
              "move_inter_gb_per_s", min_gb_per_s, max_gb_per_s, "expert move GB/s across nodes",
              [](auto &m) -> auto & { return m.gpu_inter.gb_per_s; }),
          number<M>(
              "move_host_gb_per_s", min_gb_per_s, max_gb_per_s, "expert move GB/s from the host mirror",
              [](auto &m) -> auto & { return m.host.gb_per_s; }),
          number<M>(
              "move_intra_latency_us", 0, max_us, "fixed us of a move inside a node",
              [](auto &m) -> auto & { return m.gpu_intra.latency_us; }),
          number<M>(
              "move_inter_latency_us", 0, max_us, "fixed us of a move across nodes",
              [](auto &m) -> auto & { return m.gpu_inter.latency_us; }),
          number<M>(
              "move_host_latency_us", 0, max_us, "fixed us of a move from the host mirror",
              [](auto &m) -> auto & { return m.host.latency_us; }),
          number<M>(
              "pcie_ingress_gb_per_s", min_gb_per_s, max_gb_per_s,
              "one GPU's PCIe ingress GB/s, shared by the moves it receives over the NIC and from the host mirror",
              [](auto &m) -> auto & { return m.pcie_ingress_gb_per_s; }),
      });
  return s;
}

/// What `foremoe plan` plans with: the EP group (`default_topology()` unless given), the planner options and the
/// stage.
struct PlanSettings {
  Topology topo = default_topology();
  PlannerOptions planner{};
  Stage stage = Stage::update;
  MoveParams move{}; ///< what the transfer plan (`--expert-bytes`) prices moves with
  /// `--[no-]traffic-aware`: on by default, acting where the ids are known (`--ids`) and the strategy is foremoe.
  TrafficSettings traffic = {.aware = true};
};

[[nodiscard]] inline const Schema<PlanSettings> &plan_schema() {
  static const Schema<PlanSettings> s = [] {
    std::vector<Option<PlanSettings>> o;
    lift(
        o, topology_schema(), "topology", [](auto &p) -> auto & { return p.topo; });
    lift(
        o, planner_schema(), "planner", [](auto &p) -> auto & { return p.planner; });
    traffic_options(
        o, "planner", "with --ids and strategy foremoe (on by default there; no effect otherwise)",
        [](auto &p) -> auto & { return p.traffic; });
    o.push_back(choice<PlanSettings>(
        "stage", {"update", "recompute"}, "micro-step stage (in update, replicas also return gradients)",
        [](const PlanSettings &p) { return p.stage == Stage::update ? "update" : "recompute"; },
        [](PlanSettings &p, const std::string &v) { p.stage = v == "update" ? Stage::update : Stage::recompute; }));
    lift(
        o, move_schema(), "cost", [](auto &p) -> auto & { return p.move; });
    return Schema<PlanSettings>("plan", std::move(o));
  }();
  return s;
}

/// Everything `foremoe simulate` (and Python `simulate()`) runs with.
struct SimulateSettings {
  std::string preset = "qwen3-30b-a3b";
  std::string strategies = sim_strategy_names(","); ///< comma-separated
  SimConfig sim = [] {
    SimConfig c;
    c.topo = default_topology();
    return c;
  }();
  SyntheticConfig batch = default_batch(); ///< the GPUs, layers, experts and top-k follow `sim` (`finish`)
  /// The load generator: "grpo" (the synthetic GRPO batch), "ultraep:A" or "moonep:V" (`baseline_workloads.hpp`).
  std::string workload = "grpo";
  /// Where generated GRPO loads are kept for the next run with the same batch: "auto", "off" or a directory
  /// (`LoadCache::from_setting`, foremoe/trace/load_cache.hpp). Changes no figure.
  std::string cache = "auto";
  /// Also search each strategy's best deployment (foremoe/sim/deployment.hpp) over `search`'s space.
  bool best_deployment = true;
  DeploymentSpace search;

  /// The defaults of a preset: Qwen3-30B-A3B on 8 x 8 GPUs x 3 slots, DeepSeek-V3 (fp8) on 8 x 8 x 5 or
  /// Kimi-K2 (fp8) on 8 x 8 x 7, both with 128 prompts per step and the dense part tensor-parallel over 2.
  [[nodiscard]] static SimulateSettings for_preset(std::string_view name) {
    SimulateSettings s;
    if (name == "deepseek-v3") {
      s.preset = "deepseek-v3";
      s.sim.model = deepseek_v3(WeightDtype::fp8);
      s.sim.topo = Topology{8, 8, 5};
      apply_synthetic_preset(s.batch, name);
      s.batch.prompts_per_step = 128;
      // 654B expert parameters x (1 B fp8 weights + 4 B fp32 gradients + 12 B Adam state) = 11.1 TB do not fit in
      // the 64 GPUs' 9.0 TB of HBM: the preset keeps the optimizer state in host memory (ZeRO-Offload).
      s.sim.optimizer_offload = true;
      s.sim.dense = DenseShape::deepseek_v3();
      // The dense part (15.4B parameters: fp8 weights, fp32 gradients) takes 76.8 GB per GPU without TP or PP, so
      // the preset's 64-GPU deployment (4 owners + 1 spare per GPU) needs 145 GB; TP 2 is the smallest tensor
      // parallelism at which it fits 141 GB (docs/simulator.md, "memory"). An assumption of this preset: DeepSeek
      // trained with 16-way PP, 64-way EP and no TP (arXiv:2412.19437 sec. 3.2), on far more than 64 GPUs.
      s.sim.tensor_parallel = 2;
      // DeepSeek-V3 dispatches fp8 and combines bf16 (arXiv:2412.19437 sec. 3.3.2; DeepEP's kernels).
      s.sim.dispatch_dtype = WeightDtype::fp8;
    } else if (name == "kimi-k2") {
      s.preset = "kimi-k2";
      s.sim.model = kimi_k2(WeightDtype::fp8);
      // 6 owners + 1 spare slot per GPU for 384 experts on 64 GPUs.
      s.sim.topo = Topology{8, 8, 7};
      apply_synthetic_preset(s.batch, name);
      s.batch.prompts_per_step = 128;
      // 1.015T expert parameters x 17 B (as DeepSeek-V3's) = 17.3 TB: the optimizer state in host memory.
      s.sim.optimizer_offload = true;
      s.sim.dense = DenseShape::kimi_k2();
      // As DeepSeek-V3's: the dense part (11.2B parameters) takes 56.1 GB per GPU without TP, so 64 GPUs fit 141 GB
      // from TP 2 (153 GB at TP 1). An assumption of this preset.
      s.sim.tensor_parallel = 2;
      // fp8 dispatch as in DeepSeek-V3's recipe (Kimi K2 reuses its architecture); an assumption for Kimi K2.
      s.sim.dispatch_dtype = WeightDtype::fp8;
    } else {
      detail::require(name == "qwen3-30b-a3b", "unknown preset '", name,
                      "' (expected qwen3-30b-a3b, deepseek-v3 or kimi-k2)");
    }
    return s;
  }

  /// The batch's shape follows the model and topology; validates the whole configuration.
  void finish() {
    batch.num_layers = sim.model.num_layers;
    batch.num_experts = sim.model.num_experts;
    batch.topk = sim.model.topk;
    batch.num_gpus = sim.topo.num_gpus();
    // A token attends on average to half its sequence (causal); the mean sequence is the batch's.
    if (sim.dense.context == 0) sim.dense.context = 0.5 * (batch.prompt_length.mean + batch.response_length.mean);
    sim.validate();
    (void)strategy_list(); // a bad list fails here, before the batch is generated
    if (best_deployment) (void)deployment_candidates(sim, search, batch.microbatch_tokens_per_gpu); // and the space
    if (sim.a2a_hits == A2aHitsSource::ids) {
      detail::require(workload == "grpo", "sim.a2a_hits = ids counts the routed ids of the synthetic GRPO batch; the ",
                      "workload '", workload, "' has none");
      detail::require(!best_deployment, "sim.a2a_hits = ids routes every token of every micro-step under each plan ",
                      "and runs the configured deployment only: turn search.best_deployment off ",
                      "(--no-best-deployment)");
      detail::require(sim.effective_ep_size() == sim.topo.num_gpus(), "sim.a2a_hits = ids needs one EP group over ",
                      "all ", sim.topo.num_gpus(), " GPUs, got sim.ep_size ", sim.effective_ep_size());
      detail::require(sim.cost.a2a.model == A2aModel::hierarchical,
                      "sim.a2a_hits = ids counts the hierarchical all-to-all; cost.a2a_model is ",
                      to_string(sim.cost.a2a.model));
    }
  }

  /// The strategies to simulate, parsed; throws `Error` for an unknown or repeated name or an empty list.
  [[nodiscard]] std::vector<SimStrategy> strategy_list() const {
    std::vector<SimStrategy> out;
    std::stringstream ss(strategies);
    std::string name;
    while (std::getline(ss, name, ',')) {
      if (name.empty()) continue;
      const SimStrategy st = parse_sim_strategy(name);
      // A repeated name would simulate (and print) the same strategy twice.
      detail::require(std::none_of(out.begin(), out.end(), [&](const SimStrategy &o) { return o.name == st.name; }),
                      "strategies: '", name, "' is listed twice in '", strategies, "'");
      out.push_back(st);
    }
    detail::require(!out.empty(), "strategies lists no strategy");
    return out;
  }
};

/// A comma-separated list of integers in `[lo, hi]` ("" for none), as the search settings write them.
template <class I> [[nodiscard]] std::string int_list_text(const std::vector<I> &v) {
  std::string out;
  for (const I x : v)
    out.append(out.empty() ? "" : ",").append(std::to_string(x));
  return out;
}

/// Parses `int_list_text`'s form; throws `Error` naming the bad item.
template <class I>
[[nodiscard]] std::vector<I> parse_int_list(const std::string &text, std::int64_t lo, std::int64_t hi) {
  std::vector<I> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    std::size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception &) {
      used = 0;
    }
    detail::require(used > 0 && used == item.size(), "'", item, "' in '", text, "' is not an integer");
    detail::require(v >= lo && v <= hi, "'", item, "' in '", text, "' is outside [", lo, ", ", hi, "]");
    out.push_back(static_cast<I>(v));
  }
  detail::require(!out.empty(), "'", text, "' lists no value");
  return out;
}

[[nodiscard]] inline const Schema<SimulateSettings> &simulate_schema() {
  using S = SimulateSettings;
  static const Schema<S> s = [] {
    std::vector<Option<S>> o;
    Option<S> preset = choice<S>(
        "preset", preset_names(),
        "model and cluster defaults (qwen3-30b-a3b: 48 x 128, top-8, bf16, 8 x 8 GPUs x 3 slots; deepseek-v3: "
        "58 x 256, H 7168, I 2048, fp8, 8 x 8 GPUs x 5 slots, 4 of 8 expert groups per token; kimi-k2: 60 x 384, H "
        "7168, I 2048, fp8, 8 x 8 GPUs x 7 slots)",
        [](const S &x) { return x.preset; }, [](S &x, const std::string &v) { x = S::for_preset(v); });
    preset.first = true; // resets everything else: applied before the rest of any document
    o.push_back(std::move(preset));
    o.push_back(string<S>(
        "strategies", "comma-separated strategies: " + sim_strategy_names(","),
        [](auto &x) -> auto & { return x.strategies; }));
    o.back().metavar = "LIST";
    // model
    o.push_back(integer<S>(
        "model.layers", 1, 4096, "MoE layers", [](auto &x) -> auto & { return x.sim.model.num_layers; }));
    o.push_back(integer<S>(
        "model.experts", 1, 32767, "routed experts per layer",
        [](auto &x) -> auto & { return x.sim.model.num_experts; }));
    o.push_back(integer<S>(
        "model.topk", 1, 1024, "experts per token", [](auto &x) -> auto & { return x.sim.model.topk; }));
    o.push_back(integer<S>(
        "model.hidden", 1, 1 << 20, "model dimension H", [](auto &x) -> auto & { return x.sim.model.hidden; }));
    o.push_back(integer<S>(
        "model.expert_ffn", 1, 1 << 20, "per-expert FFN intermediate size I",
        [](auto &x) -> auto & { return x.sim.model.expert_ffn; }));
    o.push_back(choice<S>(
        "model.dtype", {"bf16", "fp16", "fp32", "fp8"}, "expert weight dtype",
        [](const S &x) { return to_string(x.sim.model.dtype); },
        [](S &x, const std::string &v) { x.sim.model.dtype = parse_weight_dtype(v); }));
    o.back().metavar = "DTYPE";
    o.push_back(number<S>(
        "model.dense_params", 0, 1e12,
        "non-routed parameters per MoE layer (attention, shared experts, router) for the dense part's time and "
        "memory",
        [](auto &x) -> auto & { return x.sim.dense.params; }));
    o.push_back(number<S>(
        "model.attention_dim", 0, 1e9, "query heads x head dim (QK^T and PV width) for the dense part's time",
        [](auto &x) -> auto & { return x.sim.dense.attention_dim; }));
    o.push_back(number<S>(
        "model.attention_context", 0, 1e9,
        "mean attended context per token (0: half the batch's mean prompt + response length)",
        [](auto &x) -> auto & { return x.sim.dense.context; }));
    o.push_back(number<S>(
        "model.vocab", 0, 1e9,
        "vocabulary of the LM head and embedding, for their time and memory (Qwen3-30B-A3B 151,936, DeepSeek-V3 "
        "129,280; 0: no LM head)",
        [](auto &x) -> auto & { return x.sim.dense.vocab; }));
    lift(
        o, topology_schema(), "topology", [](auto &x) -> auto & { return x.sim.topo; });
    o.push_back(integer<S>(
        "topology.ep_size", 0, max_nodes * max_gpus_per_node,
        "GPUs per EP group; more GPUs are data-parallel copies of it, each balanced alone on its own tokens (0: "
        "every GPU when they do not outnumber the experts, else the largest divisor not above the experts)",
        [](auto &x) -> auto & { return x.sim.ep_size; }));
    // batch: the synthetic GRPO batch (its layers, experts, top-k and GPUs follow the model and topology)
    lift(o, synthetic_schema(), "batch", [](auto &x) -> auto & { return x.batch; },
         {"steps", "prompts", "responses", "prompt_mean", "response_mean", "microbatch_tokens", "packing", "seed",
          "skew", "persistence", "topic_concentration", "coactivation", "coactivation_clusters", "route_groups",
          "route_max_groups"});
    o.push_back(bound<S>(
        "batch.workload", Type::string,
        "load generator: grpo (the synthetic GRPO batch), ultraep:A (UltraEP's: rank weight 1/r^alpha, alpha "
        "bisected to a rank max/mean of A; expert weight in a rank 1/j^4) or moonep:V (MoonEP's: expert weight "
        "exp(N(0, sigma)), sigma bisected to maxvio = max/mean - 1 of V); the baselines' use the GRPO batch's "
        "micro-steps",
        [](const S &x) { return json::Value(x.workload); },
        [](S &x, const json::Value &v) { x.workload = to_string(parse_workload(v.as_string())); }));
    o.back().metavar = "NAME[:PARAM]";
    o.push_back(bound<S>(
        "batch.cache", Type::string,
        "keep the generated GRPO loads for the next run with the same batch: auto ($FOREMOE_CACHE_DIR, else "
        "$XDG_CACHE_HOME/foremoe, else ~/.cache/foremoe), off, or a directory; keyed by every generator input and "
        "the stream version, so no figure changes",
        [](const S &x) { return json::Value(x.cache); },
        [](S &x, const json::Value &v) {
          detail::require(!v.as_string().empty(), "must be auto, off or a directory, got an empty string");
          x.cache = v.as_string();
        }));
    o.back().metavar = "auto|off|DIR";
    // search: each strategy's best deployment (foremoe/sim/deployment.hpp defines the space)
    o.push_back(boolean<S>(
        "search.best_deployment",
        "also simulate every strategy in every deployment of the search space (EP sizes x slots x micro-batches) "
        "and report each one's fastest that fits GPU memory (off: the configured deployment only)",
        [](auto &x) -> auto & { return x.best_deployment; }));
    o.push_back(bound<S>(
        "search.ep_sizes", Type::string,
        "EP group sizes to search: auto (every divisor of the GPUs that is whole nodes and at most the experts) or a "
        "comma-separated list; the configured one is always searched",
        [](const S &x) { return json::Value(x.search.ep_sizes.empty() ? "auto" : int_list_text(x.search.ep_sizes)); },
        [](S &x, const json::Value &v) {
          x.search.ep_sizes = v.as_string() == "auto"
                                  ? std::vector<int>{}
                                  : parse_int_list<int>(v.as_string(), 1, max_nodes * max_gpus_per_node);
        }));
    o.back().metavar = "auto|N,N,...";
    o.push_back(bound<S>(
        "search.spare_slots", Type::string,
        "spare slots per GPU per layer to search above each EP size's owners, comma-separated (the configured "
        "slots are searched too)",
        [](const S &x) { return json::Value(int_list_text(x.search.spare_slots)); },
        [](S &x, const json::Value &v) {
          x.search.spare_slots = parse_int_list<int>(v.as_string(), 0, max_spare_slots);
        }));
    o.back().metavar = "N,N,...";
    o.push_back(bound<S>(
        "search.microbatches", Type::string,
        "micro-batch tokens per GPU to search, comma-separated (batch: the batch's own; each size's batch is "
        "generated once, then cached)",
        [](const S &x) {
          return json::Value(x.search.microbatch_tokens.empty() ? "batch" : int_list_text(x.search.microbatch_tokens));
        },
        [](S &x, const json::Value &v) {
          x.search.microbatch_tokens = v.as_string() == "batch"
                                           ? std::vector<std::int64_t>{}
                                           : parse_int_list<std::int64_t>(v.as_string(), 1, std::int64_t{1} << 30);
        }));
    o.back().metavar = "batch|N,N,...";
    for (const char *dim : {"pipeline_stages", "tensor_parallel"}) {
      const bool pp = dim == std::string_view("pipeline_stages");
      o.push_back(bound<S>(
          std::string("search.") + dim, Type::string,
          pp ? "pipeline stages to search, comma-separated (config: the configured sim.pipeline_stages only)"
             : "tensor-parallel sizes of the dense part to search, comma-separated (config: the configured "
               "sim.tensor_parallel only)",
          [pp](const S &x) {
            const std::vector<int> &v = pp ? x.search.pipeline_stages : x.search.tensor_parallel;
            return json::Value(v.empty() ? "config" : int_list_text(v));
          },
          [pp](S &x, const json::Value &v) {
            std::vector<int> &dst = pp ? x.search.pipeline_stages : x.search.tensor_parallel;
            dst = v.as_string() == "config" ? std::vector<int>{} : parse_int_list<int>(v.as_string(), 1, 4096);
          }));
      o.back().metavar = "config|N,N,...";
    }
    for (Option<S> &opt : o)
      if (opt.key == "batch.steps")
        opt.help = "RL steps to simulate and count (the generator adds sim.warmup_steps warm-up steps in front)";
    // sim
    o.push_back(integer<S>(
        "sim.recompute_passes", 0, 64, "forward-only passes over the batch (old policy, reference)",
        [](auto &x) -> auto & { return x.sim.recompute_passes; }));
    o.push_back(integer<S>(
        "sim.warmup_steps", 0, 1 << 16,
        "RL steps planned and simulated first but left out of every figure (steady state for history-fed eplb)",
        [](auto &x) -> auto & { return x.sim.warmup_steps; }));
    // The planner's options, from its own schema (`SimConfig::planner`): all but the strategy (each simulated
    // strategy's own) and `gradient_bytes_factor` (from `sim.grad_dtype`); `eplb_interval` here, where
    // `sim.eplb_interval` stood before the planner held it, the rest below.
    const auto planner_of = [](auto &x) -> auto & { return x.sim.planner; };
    lift(o, planner_schema(), "sim", planner_of, {"eplb_interval"});
    o.push_back(integer<S>(
        "sim.gpu_load_layer", 0, 4095,
        "the MoE layer whose per-GPU loads per micro-step the results hold (micro_step_gpu_load)",
        [](auto &x) -> auto & { return x.sim.gpu_load_layer; }));
    o.push_back(integer<S>(
        "sim.minibatches_per_step", 1, 1 << 16, "optimizer steps per RL step",
        [](auto &x) -> auto & { return x.sim.minibatches_per_step; }));
    o.push_back(number<S>(
        "sim.optimizer_seconds", 0, max_seconds,
        "fixed time of one optimizer step, on top of sim.optimizer_traffic_bytes_per_param",
        [](auto &x) -> auto & { return x.sim.optimizer_seconds; }));
    o.push_back(number<S>(
        "sim.optimizer_traffic_bytes_per_param", 0, 1024,
        "HBM bytes an optimizer step moves per parameter on a GPU (fused Adam, fp32 master and gradients: reads 16, "
        "writes 12 + 2 bf16 = 30; 0: only sim.optimizer_seconds)",
        [](auto &x) -> auto & { return x.sim.optimizer_traffic_bytes_per_param; }));
    o.push_back(number<S>(
        "sim.a2a_overlap", 0, 1,
        "fraction of each layer's all-to-all that may hide under its compute (Megatron-core "
        "overlap_moe_expert_parallel_comm, DeepEP hooks; 0: none, Megatron's default; 1: full)",
        [](auto &x) -> auto & { return x.sim.a2a_overlap; }));
    o.push_back(choice<S>(
        "sim.dispatch_dtype", {"bf16", "fp8"},
        "dtype of the forward dispatch's token rows (fp8: 1 B per element plus an fp32 scale per 128, as DeepEP "
        "dispatches; the combine and the backward exchanges stay bf16)",
        [](const S &x) { return to_string(x.sim.dispatch_dtype); },
        [](S &x, const std::string &v) { x.sim.dispatch_dtype = parse_weight_dtype(v); }));
    o.back().metavar = "DTYPE";
    o.push_back(choice<S>(
        "sim.a2a_hits", std::vector<std::string>(std::begin(a2a_hits_source_names), std::end(a2a_hits_source_names)),
        "the hierarchical all-to-all's distinct nodes and GPUs per token: independent (estimated from each slot's "
        "rows) or ids (counted from the synthetic batch's routed ids, as the runtime dispatches them; slower, one EP "
        "group, no deployment search)",
        [](const S &x) { return std::string(to_string(x.sim.a2a_hits)); },
        [](S &x, const std::string &v) { x.sim.a2a_hits = parse_a2a_hits_source(v, "sim.a2a_hits"); }));
    o.back().metavar = "SOURCE";
    traffic_options(
        o, "sim", "sim.a2a_hits ids only (no effect on the estimate), foremoe and foremoe-free",
        [](auto &x) -> auto & { return x.sim.traffic; });
    o.push_back(number<S>(
        "sim.dp_grad_overlap", 0, 1,
        "fraction of the expert-gradient all-reduce across EP-group copies that may run under the last backward "
        "(Megatron DDP overlap_grad_reduce; 0: none, its default; 1: every layer's bucket once its backward ends)",
        [](auto &x) -> auto & { return x.sim.dp_grad_overlap; }));
    o.push_back(number<S>(
        "sim.rollout_seconds", 0, max_seconds, "rollout time (end-to-end figure only; 0: from sim.rollout_share)",
        [](auto &x) -> auto & { return x.sim.rollout_seconds; }));
    o.push_back(number<S>(
        "sim.rollout_share", 0, 0.99,
        "without sim.rollout_seconds, the rollout's share of an RL step with the static placement (end-to-end figure "
        "only; 0.7: RollPacker, arXiv:2509.21009, synchronous veRL; 0: training only)",
        [](auto &x) -> auto & { return x.sim.rollout_share; }));
    o.push_back(boolean<S>(
        "sim.two_way_link_sharing",
        "the all-to-all also yields half a GPU's link to its moves and gradient returns while they run (off: only "
        "the moves yield to it)",
        [](auto &x) -> auto & { return x.sim.two_way_link_sharing; }));
    o.push_back(boolean<S>(
        "sim.double_buffer", "a second buffer per replica slot: moves may start a micro-step early",
        [](auto &x) -> auto & { return x.sim.double_buffer; }));
    lift(o, planner_schema(), "sim", planner_of,
         {"reowning_free", "move_budget", "tolerance", "min_tokens_per_replica", "hold_replica_gradients",
          "peer_domain_gpus"});
    o.push_back(boolean<S>(
        "sim.cost_gate", "a new replica only when the expert compute it saves exceeds its move and gradient cost",
        [](auto &x) -> auto & { return x.sim.cost_gate; }));
    lift(o, planner_schema(), "sim", planner_of,
         {"threads", "hierarchical_owners", "owner_keep_tolerance", "local_search_rounds", "free_search_rounds",
          "exact_split", "ultraep_min_tokens", "eplb_num_groups"});
    o.push_back(choice<S>(
        "sim.dense_model", {"shape", "constant"},
        "dense part's time: from the model shape (FLOPs at sim.dense_efficiency) or cost.dense_per_token_us",
        [](const S &x) { return x.sim.dense_from_shape ? "shape" : "constant"; },
        [](S &x, const std::string &v) { x.sim.dense_from_shape = v == "shape"; }));
    o.push_back(number<S>(
        "sim.dense_efficiency", 1e-6, 1, "achieved fraction of the bf16 peak in the dense part (Llama 3 MFU: 0.4)",
        [](auto &x) -> auto & { return x.sim.dense_efficiency; }));
    o.push_back(boolean<S>(
        "sim.planner_overlap",
        "planning micro-step m+1 overlaps micro-step m (foresight): only what exceeds it is on the critical path",
        [](auto &x) -> auto & { return x.sim.planner_overlap; }));
    o.push_back(choice<S>(
        "sim.grad_dtype", {"fp32", "bf16", "fp16"},
        "expert gradient dtype (replica gradient returns and buffers; fp32: mixed-precision main gradients)",
        [](const S &x) { return to_string(x.sim.grad_dtype); },
        [](S &x, const std::string &v) { x.sim.grad_dtype = parse_weight_dtype(v); }));
    o.back().metavar = "DTYPE";
    o.push_back(number<S>(
        "sim.optimizer_bytes_per_param", 0, 1024,
        "optimizer state bytes per parameter, owned experts and dense part (Adam: fp32 master + 2 moments = 12, "
        "ZeRO's K)",
        [](auto &x) -> auto & { return x.sim.optimizer_bytes_per_param; }));
    o.push_back(boolean<S>(
        "sim.optimizer_offload", "optimizer state in host memory: not counted in GPU memory",
        [](auto &x) -> auto & { return x.sim.optimizer_offload; }));
    o.push_back(boolean<S>(
        "sim.distributed_optimizer",
        "Megatron's distributed optimizer (ZeRO-1): GPU optimizer state sharded over the data-parallel ranks (dense "
        "part: stage GPUs / TP; experts: the EP-group copies); verl's default",
        [](auto &x) -> auto & { return x.sim.distributed_optimizer; }));
    o.push_back(integer<S>(
        "sim.pipeline_stages", 1, 4096,
        "pipeline-parallel stages: each GPU runs the MoE layers of one stage (split as evenly as possible, the first "
        "stages one more), 1F1B bubble (PP-1)/m, activations sent between stages; must divide the GPUs (1: none)",
        [](auto &x) -> auto & { return x.sim.pipeline_stages; }));
    o.push_back(integer<S>(
        "sim.tensor_parallel", 1, 4096,
        "tensor parallelism of the attention and dense part (Megatron sequence parallel, inside a node; experts stay "
        "EP); must divide the GPUs of a node (1: none)",
        [](auto &x) -> auto & { return x.sim.tensor_parallel; }));
    o.push_back(number<S>(
        "sim.gpu_memory_gb", 1e-3, 1e6,
        "GPU memory in GB (H200: 141); a strategy whose peak per-GPU memory exceeds it is an error",
        [](auto &x) -> auto & { return x.sim.gpu_memory_gb; }));
    // cost: the cost-model parameters that a config may set
    auto cost = [&](const char *key, double lo, double hi, const char *help, auto field) {
      o.push_back(number<S>(std::string("cost.") + key, lo, hi, help, field));
    };
    cost(
        "backward_factor", 1e-3, 1e3, "backward time = factor x forward",
        [](auto &x) -> auto & { return x.sim.cost.backward_factor; });
    cost(
        "dense_per_token_us", 0, max_us, "attention + dense forward us per token per layer (sim.dense_model constant)",
        [](auto &x) -> auto & { return x.sim.cost.dense.per_token_us; });
    cost(
        "dense_launch_us", 0, max_us, "fixed us of a layer's dense part",
        [](auto &x) -> auto & { return x.sim.cost.dense.launch_us; });
    cost(
        "gemm_launch_us", 0, max_us, "fixed us of one grouped-GEMM call",
        [](auto &x) -> auto & { return x.sim.cost.gemm.launch_us; });
    cost(
        "gemm_per_expert_us", 0, max_us, "fixed us per active expert",
        [](auto &x) -> auto & { return x.sim.cost.gemm.per_expert_us; });
    cost(
        "gemm_compute_efficiency", 1e-6, 1, "achieved fraction of the tensor peak",
        [](auto &x) -> auto & { return x.sim.cost.gemm.compute_efficiency; });
    cost(
        "gemm_hbm_efficiency", 1e-6, 1, "achieved fraction of HBM bandwidth",
        [](auto &x) -> auto & { return x.sim.cost.gemm.hbm_efficiency; });
    o.push_back(choice<S>(
        "cost.a2a_model", {"hierarchical", "flat"},
        "all-to-all model: hierarchical (DeepEP-style: a token crosses to a remote node once, then fans out over "
        "NVLink; per-GPU deduplication; latency per message) or flat (every GPU's rows come evenly from all GPUs)",
        [](const S &x) { return to_string(x.sim.cost.a2a.model); },
        [](S &x, const std::string &v) { x.sim.cost.a2a.model = parse_a2a_model(v); }));
    o.back().metavar = "MODEL";
    cost(
        "a2a_intra_gb_per_s", min_gb_per_s, max_gb_per_s, "all-to-all NVLink GB/s per GPU",
        [](auto &x) -> auto & { return x.sim.cost.a2a.intra_gb_per_s; });
    cost(
        "a2a_inter_gb_per_s", min_gb_per_s, max_gb_per_s, "all-to-all network GB/s per GPU",
        [](auto &x) -> auto & { return x.sim.cost.a2a.inter_gb_per_s; });
    cost(
        "a2a_intra_latency_us", 0, max_us, "fixed us of an intra-node exchange",
        [](auto &x) -> auto & { return x.sim.cost.a2a.intra_latency_us; });
    cost(
        "a2a_inter_latency_us", 0, max_us, "fixed us of an inter-node exchange",
        [](auto &x) -> auto & { return x.sim.cost.a2a.inter_latency_us; });
    cost(
        "a2a_per_message_us", 0, max_us, "hierarchical all-to-all: us per NVLink peer with traffic",
        [](auto &x) -> auto & { return x.sim.cost.a2a.per_message_us; });
    cost(
        "a2a_inter_per_message_us", 0, max_us, "hierarchical all-to-all: us per remote node with traffic",
        [](auto &x) -> auto & { return x.sim.cost.a2a.inter_per_message_us; });
    lift(
        o, move_schema(), "cost", [](auto &x) -> auto & { return x.sim.cost.move; });
    cost(
        "grad_add_gb_per_s", min_gb_per_s, max_gb_per_s, "replica gradient accumulate GB/s",
        [](auto &x) -> auto & { return x.sim.cost.grad.add_gb_per_s; });
    cost(
        "cpu_adam_gparams_per_s", 1e-6, 1e6,
        "CPU Adam billions of parameters per second per node, with sim.optimizer_offload (ZeRO-Offload's CPU-Adam: "
        "3.9)",
        [](auto &x) -> auto & { return x.sim.cost.cpu_adam_gparams_per_s; });
    return Schema<S>("simulate", std::move(o));
  }();
  return s;
}

/// The effective simulate settings: the preset (from the last layer naming one), then each layer in order
/// (a config document, then command-line overrides); the batch shape follows the model; validated.
[[nodiscard]] inline SimulateSettings simulate_settings(std::span<const Schema<SimulateSettings>::Layer> layers) {
  SimulateSettings s;
  simulate_schema().read(s, layers);
  s.finish();
  return s;
}

} // namespace config
} // namespace v0
} // namespace foremoe
