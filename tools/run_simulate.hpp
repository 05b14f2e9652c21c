#pragma once
// `run_simulate`, the orchestration behind `foremoe simulate` and Python `foremoe.simulate()`: the loads (given,
// read from the load cache, or generated), the simulation, and the results document. It lives with the front end
// rather than in include/foremoe: it is a tool's job, not a document's (config/ describes options and documents)
// and not the simulator's (it reads the config layer's settings and documents, which sit above sim/). The Python
// extension compiles the CLI in and has this folder on its include path, so both front ends share this one copy.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "foremoe/config/documents.hpp"
#include "foremoe/config/options.hpp"
#include "foremoe/core/json.hpp"
#include "foremoe/core/load_tensor.hpp"
#include "foremoe/sim/deployment.hpp"
#include "foremoe/sim/simulator.hpp"
#include "foremoe/trace/baseline_workloads.hpp"
#include "foremoe/trace/load_cache.hpp"
#include "foremoe/trace/packed_loads.hpp"
#include "foremoe/trace/synthetic.hpp"

namespace foremoe::cli {

/// Progress callbacks of `run_simulate`: tokens generated of the total, then strategy-steps simulated.
struct SimulateProgress {
  std::function<void(std::int64_t, std::int64_t)> generate;
  std::function<void(int, int)> simulate;
  std::function<void(int, int)> search; ///< (strategy, deployment) runs of the deployment search done, of the total
};

/// Where `run_simulate`'s loads came from.
struct LoadsReport {
  double seconds = 0;               ///< generating them, or reading them from the cache
  bool generated = false;           ///< false: given by the caller
  bool from_cache = false;          ///< read from the cache instead of generated
  bool built_in = false;            ///< unpacked from the copy built into the program instead of generated
  std::filesystem::path cache_file; ///< the cache entry read or written; empty when none
  bool cache_written = false;       ///< a new entry was written
  double search_load_seconds = 0;   ///< the deployment search's batches: generating or reading them
  bool search_generated = false;    ///< some batch of the deployment search was generated
};

/// The cache key of a GRPO batch: every `SyntheticConfig` field (doubles exactly, in hex) and what else decides
/// the generated loads (the source grouping), under the generator's stream version. A field added to
/// `SyntheticConfig` must join it (tests/test_config.cpp checks the struct's size to catch one that did not).
[[nodiscard]] inline std::string synthetic_cache_key(const SyntheticConfig &c, bool by_source, int ranks_per_source) {
  std::ostringstream k;
  k << std::hexfloat;
  const auto len = [&k](const char *name, const LengthDistribution &d) {
    k << ' ' << name << '=' << d.mean << ',' << d.sigma << ',' << d.min_tokens << ',' << d.max_tokens;
  };
  k << "grpo stream=" << synthetic_stream_version << " seed=" << c.seed << " layers=" << c.num_layers
    << " experts=" << c.num_experts << " topk=" << c.topk << " steps=" << c.num_steps
    << " prompts=" << c.prompts_per_step << " responses=" << c.responses_per_prompt;
  len("prompt", c.prompt_length);
  len("response", c.response_length);
  k << " topics=" << c.num_topics << " topics_per_prompt=" << c.topics_per_prompt
    << " topic_concentration=" << c.topic_concentration << " topic_mix=" << c.topic_mix_concentration
    << " response_topic_weight=" << c.response_topic_weight << " popularity=" << static_cast<int>(c.popularity)
    << " skew=" << c.skew << " skew_layer_sigma=" << c.skew_layer_sigma << " persistence=" << c.persistence
    << " gpus=" << c.num_gpus << " microbatch_tokens=" << c.microbatch_tokens_per_gpu << " by_source=" << by_source
    << " ranks_per_source=" << ranks_per_source;
  // Absent without co-activation (the same ids as before it existed), so that those batches' keys stay as they were.
  if (c.coactivation > 0) k << " coactivation=" << c.coactivation << '/' << c.coactivation_cluster_count();
  // Absent without a group limit, so that the keys of unlimited batches stay as they were.
  if (c.group_limited()) k << " route_groups=" << c.route_groups << '/' << c.route_max_groups;
  // Absent for `none`, so that the keys of unpacked batches (the built-in default's among them) stay as they were.
  if (c.packing != BatchPacking::none)
    k << " packing=" << (c.packing == BatchPacking::tokens ? "tokens" : "routing") << '/' << packing_version
      << " packing_ranks=" << c.packing_ranks;
  return k.str();
}

/// The GRPO batch that `run_simulate` generates for `s`, and its cache key.
struct SimulateBatch {
  SyntheticConfig config;   ///< the settings' batch with the warm-up steps generated in front of the counted ones
  bool by_source = false;   ///< several EP groups: each group's tokens are counted as one source, so that every
                            ///< data-parallel copy runs its own sequences
  int ranks_per_source = 1; ///< ranks per source: the EP group size when `by_source`
  std::string key;          ///< `synthetic_cache_key` of the above
};

/// The GRPO batch of `s` for an EP group size `ep`, its tokens counted by source in blocks of `ranks_per_source`
/// ranks (`ep` for the configured deployment; a divisor of several searched EP sizes, whose groups' loads are sums
/// of its sources), with `microbatch` tokens per GPU per micro-batch (0: the batch's).
///
/// With `pipeline_stages` P and `tensor_parallel` T (default: the configured ones) the batch's ranks are the
/// `G / (P T)` data-parallel ranks of the dense part (Megatron-core's MoE parallel folding): each holds its own
/// micro-batches of `microbatch` tokens (verl's per-rank dynamic batch size), a micro-step is one micro-batch of
/// every rank, and an EP group of `ep` GPUs in a stage carries `ep / T` ranks' tokens (sources only when T divides
/// the group sizes; else the groups split the loads evenly).
[[nodiscard]] inline SimulateBatch simulate_batch(const config::SimulateSettings &s, int ep, int ranks_per_source,
                                                  std::int64_t microbatch = 0, int pipeline_stages = 0,
                                                  int tensor_parallel = 0) {
  const int P = pipeline_stages > 0 ? pipeline_stages : s.sim.pipeline_stages;
  const int T = tensor_parallel > 0 ? tensor_parallel : s.sim.tensor_parallel;
  SimulateBatch b;
  b.config = s.batch;
  b.config.num_steps += s.sim.warmup_steps;
  if (microbatch > 0) b.config.microbatch_tokens_per_gpu = microbatch;
  const int ranks = s.sim.topo.num_gpus() / (P * T); // data-parallel ranks (every GPU without P and T)
  if (P * T > 1) b.config.num_gpus = ranks;
  b.config.validate();
  const int rps = ranks_per_source % T == 0 ? ranks_per_source / T : ranks; // in ranks
  b.by_source = rps < ranks;
  b.ranks_per_source = b.by_source ? rps : 1;
  // Each EP group re-packs its own sequences: its ranks' micro-batches make its micro-steps.
  if (ep < s.sim.topo.num_gpus() / P && b.config.packing != BatchPacking::none)
    b.config.packing_ranks = std::max(1, ep / T);
  b.key = synthetic_cache_key(b.config, b.by_source, b.ranks_per_source);
  return b;
}

/// The configured deployment's batch.
[[nodiscard]] inline SimulateBatch simulate_batch(const config::SimulateSettings &s) {
  const int ep = s.sim.effective_ep_size();
  return simulate_batch(s, ep, ep);
}

/// Loads and their RL step offsets, owned.
struct OwnedLoads {
  LoadTensor loads;
  std::vector<std::int64_t> step_offsets;
};

/// Generates the loads of `batch` (GRPO: from `built_in` when they are that batch's, else the cache that
/// `s.cache` names when it holds them, and stored there when not; a baseline workload for EP size `ep`).
[[nodiscard]] inline OwnedLoads simulate_loads(const config::SimulateSettings &s, const SimulateBatch &batch, int ep,
                                               const SimulateProgress &progress, LoadsReport &rep,
                                               std::span<const unsigned char> built_in) {
  const auto t0 = std::chrono::steady_clock::now();
  OwnedLoads out;
  GeneratorOptions gen;
  gen.progress = progress.generate;
  gen.ranks_per_source = batch.ranks_per_source;
  const WorkloadSpec workload = parse_workload(s.workload);
  rep.generated = true;
  if (workload.kind == WorkloadKind::grpo) {
    const LoadCache cache = LoadCache::from_setting(s.cache);
    std::optional<CachedLoads> hit = unpack_loads(built_in, batch.key);
    rep.built_in = hit.has_value();
    if (!rep.built_in) {
      if (cache.enabled()) rep.cache_file = cache.file_of(batch.key);
      hit = cache.read(batch.key);
      rep.from_cache = hit.has_value();
    }
    if (hit) {
      out.loads = std::move(hit->loads);
      out.step_offsets = std::move(hit->step_offsets);
    } else {
      out.loads = generate_loads(batch.config, &out.step_offsets, batch.by_source, gen);
      const LoadCache::Write w = cache.write(batch.key, out.loads, out.step_offsets);
      rep.cache_written = w == LoadCache::Write::written;
      if (w == LoadCache::Write::too_large) rep.cache_file.clear(); // not kept, and not a failure to report
    }
  } else { // the baselines' generators route the same micro-steps; the copies split them evenly (not cached)
    out.loads = generate_baseline_loads(workload, batch.config, ep, &out.step_offsets);
  }
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

/// Each strategy's best deployment (`s.search`) for the run of `run_simulate`: over `given` when the loads were
/// given (EP sizes whose groups are whole sources, and slots), else over the batches the space needs, generated or
/// cached (`configured`: the configured deployment's batch, reused where the space needs it); `rep` adds up their
/// generation.
[[nodiscard]] inline DeploymentSearch search_simulate(const config::SimulateSettings &s,
                                                      std::span<const SimStrategy> strategies,
                                                      const DeploymentLoads *given, const SimulateProgress &progress,
                                                      LoadsReport &rep, std::span<const unsigned char> built_in,
                                                      const DeploymentLoads *configured = nullptr) {
  DeploymentSpace space = s.search;
  if (given != nullptr) space.microbatch_tokens.clear();
  std::vector<Deployment> candidates =
      deployment_candidates(s.sim, space, given != nullptr ? 0 : s.batch.microbatch_tokens_per_gpu);
  const int G = s.sim.topo.num_gpus();
  if (given != nullptr && given->loads->has_sources()) // only EP sizes whose groups are whole sources
    std::erase_if(candidates, [&](const Deployment &d) { return given->loads->num_sources() % (G / d.ep_size) != 0; });
  // One batch per micro-batch size serves every EP size when the groups' loads are sums of its sources (the GRPO
  // batch without per-group packing): counted by source at the gcd of the EP sizes below the cluster.
  const bool per_ep = parse_workload(s.workload).kind != WorkloadKind::grpo || s.batch.packing != BatchPacking::none;
  // Per (pipeline stages, tensor parallel): the gcd of the EP sizes below a stage's GPUs.
  std::map<std::pair<int, int>, int> rps_of;
  for (const Deployment &d : candidates) {
    const int stage = G / d.pipeline_stages;
    int &r = rps_of.try_emplace({d.pipeline_stages, d.tensor_parallel}, stage).first->second;
    if (d.ep_size < stage) r = std::gcd(r, d.ep_size);
  }
  const std::string configured_key = simulate_batch(s).key;
  // Per (micro-batch, EP size or 0 when one batch serves every EP size): the loads made, or why they could not be.
  using BatchKey = std::tuple<std::int64_t, int, int, int>; // micro-batch, EP size (or 0), PP, TP
  std::map<BatchKey, OwnedLoads> made;                      // node-based: the loads stay where they are
  std::map<BatchKey, std::string> failed;
  std::vector<Deployment> kept;
  std::vector<DeploymentLoads> kept_loads;
  std::vector<std::pair<Deployment, std::string>> skipped;
  // Loads first, so that a deployment whose loads cannot be made is left out (with its reason), not the search.
  for (const Deployment &d : candidates) {
    const BatchKey key{d.microbatch_tokens, per_ep ? d.ep_size : 0, d.pipeline_stages, d.tensor_parallel};
    if (const auto f = failed.find(key); f != failed.end()) {
      skipped.emplace_back(d, f->second);
      continue;
    }
    DeploymentLoads dl;
    if (given != nullptr) {
      dl = *given;
    } else if (const auto it = made.find(key); it != made.end()) {
      dl = {&it->second.loads, it->second.step_offsets};
    } else {
      const int P = d.pipeline_stages, T = d.tensor_parallel;
      const SimulateBatch batch = per_ep ? simulate_batch(s, d.ep_size, d.ep_size, d.microbatch_tokens, P, T)
                                         : simulate_batch(s, G / P, rps_of.at({P, T}), d.microbatch_tokens, P, T);
      if (configured != nullptr && batch.key == configured_key && (!per_ep || d.ep_size == s.sim.effective_ep_size())) {
        dl = *configured; // the configured deployment's own batch, already made
      } else {
        LoadsReport r;
        try {
          const auto at = made.emplace(key, simulate_loads(s, batch, d.ep_size, progress, r, built_in)).first;
          dl = {&at->second.loads, at->second.step_offsets};
        } catch (const Error &e) {
          failed.emplace(key, e.what());
          skipped.emplace_back(d, e.what());
          continue;
        }
        rep.seconds += r.seconds;
        rep.generated = rep.generated || (!r.from_cache && !r.built_in);
      }
    }
    kept.push_back(d);
    kept_loads.push_back(dl);
  }
  if (kept.empty()) throw Error("deployment search: no deployment's loads could be made: " + skipped.front().second);
  DeploymentSearch out =
      search_deployments(s.sim, strategies, std::move(kept), std::move(kept_loads), 0, progress.search);
  out.skipped = std::move(skipped);
  return out;
}

/// Runs a simulation from settings: the synthetic batch unless `loads` is given (with its `step_offsets`). The
/// GRPO batch's loads come from `built_in` (a packed entry, foremoe/trace/packed_loads.hpp: the front ends pass
/// the default batch's, built into them) when it is that batch's, else from the cache that `s.cache` names when
/// it holds them, and are stored there when not. With `s.best_deployment` the document also holds each strategy's
/// best deployment (`search_simulate`).
[[nodiscard]] inline json::Value run_simulate(const config::SimulateSettings &s, const LoadTensor *loads,
                                              std::vector<std::int64_t> step_offsets,
                                              const SimulateProgress &progress = {}, LoadsReport *report = nullptr,
                                              std::span<const unsigned char> built_in = {}) {
  const std::vector<SimStrategy> strategies = s.strategy_list();
  OwnedLoads generated;
  LoadsReport rep;
  const bool given = loads != nullptr;
  if (!given) {
    generated = simulate_loads(s, simulate_batch(s), s.sim.effective_ep_size(), progress, rep, built_in);
    loads = &generated.loads;
    step_offsets = std::move(generated.step_offsets);
  }
  // Counting the all-to-all from the ids: each micro-step routed again from the batch's settings when simulated
  // (the simulator checks that their counts are the loads').
  std::optional<SyntheticMicroSteps> batch_routes;
  MicroStepRoutes routes;
  if (s.sim.a2a_hits == A2aHitsSource::ids) {
    detail::require(!given, "sim.a2a_hits = ids counts the routed ids of the synthetic batch; loads given without ",
                    "their ids have none");
    batch_routes.emplace(simulate_batch(s).config);
    routes = [&batch_routes](int m, RoutedMicroStep &out) { batch_routes->route(m, out.ids, out.source_offsets); };
  }
  const std::vector<SimResult> res =
      simulate(s.sim, *loads, step_offsets, strategies, progress.simulate, /*check_memory=*/true, routes);
  const int num_steps = step_offsets.empty() ? 1 : static_cast<int>(step_offsets.size() - 1);
  const std::int64_t warmup_micro = step_offsets.empty() ? 0 : step_offsets[s.sim.warmup_steps];
  std::optional<DeploymentSearch> search;
  if (s.best_deployment) {
    LoadsReport search_rep;
    const DeploymentLoads mine{loads, step_offsets};
    search = search_simulate(s, strategies, given ? &mine : nullptr, progress, search_rep, built_in, &mine);
    rep.search_load_seconds = search_rep.seconds;
    rep.search_generated = search_rep.generated;
  }
  if (report != nullptr) *report = rep;
  return config::simulate_document(s, num_steps - s.sim.warmup_steps, loads->num_micro_steps() - warmup_micro, res,
                                   search ? &*search : nullptr);
}

} // namespace foremoe::cli
