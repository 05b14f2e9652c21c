#pragma once
// `run_simulate`, the orchestration behind `foremoe simulate` and Python `foremoe.simulate()`: the loads (given,
// read from the load cache, or generated), the simulation, and the results document. It lives with the front end
// rather than in include/foremoe: it is a tool's job, not a document's (config/ describes options and documents)
// and not the simulator's (it reads the config layer's settings and documents, which sit above sim/). The Python
// extension compiles the CLI in and has this folder on its include path, so both front ends share this one copy.

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "foremoe/config/documents.hpp"
#include "foremoe/config/options.hpp"
#include "foremoe/core/json.hpp"
#include "foremoe/core/load_tensor.hpp"
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
};

/// Where `run_simulate`'s loads came from.
struct LoadsReport {
  double seconds = 0;               ///< generating them, or reading them from the cache
  bool generated = false;           ///< false: given by the caller
  bool from_cache = false;          ///< read from the cache instead of generated
  bool built_in = false;            ///< unpacked from the copy built into the program instead of generated
  std::filesystem::path cache_file; ///< the cache entry read or written; empty when none
  bool cache_written = false;       ///< a new entry was written
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

[[nodiscard]] inline SimulateBatch simulate_batch(const config::SimulateSettings &s) {
  SimulateBatch b;
  b.config = s.batch;
  b.config.num_steps += s.sim.warmup_steps;
  b.config.validate();
  const int ep = s.sim.effective_ep_size();
  b.by_source = ep < s.sim.topo.num_gpus();
  b.ranks_per_source = b.by_source ? ep : 1;
  // Each EP group re-packs its own sequences: its ranks' micro-batches make its micro-steps.
  if (b.by_source && b.config.packing != BatchPacking::none) b.config.packing_ranks = ep;
  b.key = synthetic_cache_key(b.config, b.by_source, b.ranks_per_source);
  return b;
}

/// Runs a simulation from settings: the synthetic batch unless `loads` is given (with its `step_offsets`). The
/// GRPO batch's loads come from `built_in` (a packed entry, foremoe/trace/packed_loads.hpp: the front ends pass
/// the default batch's, built into them) when it is that batch's, else from the cache that `s.cache` names when
/// it holds them, and are stored there when not.
[[nodiscard]] inline json::Value run_simulate(const config::SimulateSettings &s, const LoadTensor *loads,
                                              std::vector<std::int64_t> step_offsets,
                                              const SimulateProgress &progress = {}, LoadsReport *report = nullptr,
                                              std::span<const unsigned char> built_in = {}) {
  const std::vector<SimStrategy> strategies = s.strategy_list();
  LoadTensor generated;
  LoadsReport rep;
  if (loads == nullptr) {
    const auto t0 = std::chrono::steady_clock::now();
    const SimulateBatch batch = simulate_batch(s);
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
        generated = std::move(hit->loads);
        step_offsets = std::move(hit->step_offsets);
      } else {
        generated = generate_loads(batch.config, &step_offsets, batch.by_source, gen);
        const LoadCache::Write w = cache.write(batch.key, generated, step_offsets);
        rep.cache_written = w == LoadCache::Write::written;
        if (w == LoadCache::Write::too_large) rep.cache_file.clear(); // not kept, and not a failure to report
      }
    } else { // the baselines' generators route the same micro-steps; the copies split them evenly (not cached)
      generated = generate_baseline_loads(workload, batch.config, s.sim.effective_ep_size(), &step_offsets);
    }
    loads = &generated;
    rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  if (report != nullptr) *report = rep;
  const std::vector<SimResult> res = simulate(s.sim, *loads, step_offsets, strategies, progress.simulate);
  const int num_steps = step_offsets.empty() ? 1 : static_cast<int>(step_offsets.size() - 1);
  const std::int64_t warmup_micro = step_offsets.empty() ? 0 : step_offsets[s.sim.warmup_steps];
  return config::simulate_document(s, num_steps - s.sim.warmup_steps, loads->num_micro_steps() - warmup_micro, res);
}

} // namespace foremoe::cli
