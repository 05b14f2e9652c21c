#pragma once
/// @file
/// Each strategy in its best deployment: the parallel configurations a cluster allows (EP group size, expert
/// slots per GPU, micro-batch tokens), every strategy simulated in each on the same batch, and each strategy's
/// fastest configuration that fits one GPU's memory. A practitioner deploys a balancer where it runs best, so a
/// comparison at one fixed configuration (the one a balancer needs most) is not the comparison that matters.
///
/// The space (`DeploymentSpace`), defined here once for every front end:
/// - EP sizes: every divisor of the cluster's GPU count that is whole nodes (a multiple of the GPUs per node) and
///   not above the expert count, plus the configured EP size;
/// - slots: the owners' `ceil(experts / ep)` plus each of `spare_slots` (default 0, 1, 2 and 4 spare slots per
///   GPU per layer), plus the configured slots at the configured EP size;
/// - micro-batch tokens per GPU: `microbatch_tokens` (default: the batch's own).
/// Memory bounds the space: a candidate whose peak (`SimMemory`: experts, dense part, activations) exceeds
/// `SimConfig::gpu_memory_gb` for a strategy is reported as not fitting for it and never chosen. Ties go to the
/// smaller EP size, then fewer slots, then the smaller micro-batch: the cheaper deployment.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/core/load_tensor.hpp"
#include "foremoe/core/thread_pool.hpp"
#include "foremoe/sim/simulator.hpp"

namespace foremoe {
inline namespace v0 {

/// The most deployments one search simulates (each strategy in each): a space past it would run for hours.
inline constexpr std::size_t max_deployment_candidates = 512;

/// The most spare slots per GPU a search may add (the topology's slot bound is far above any that fits memory).
inline constexpr int max_spare_slots = 4096;

/// What the deployment search varies (see the file comment).
struct DeploymentSpace {
  std::vector<int> ep_sizes;                   ///< empty: whole-node divisors of the cluster (file comment)
  std::vector<int> spare_slots{0, 1, 2, 4};    ///< spare slots per GPU per layer above the owners
  std::vector<std::int64_t> microbatch_tokens; ///< empty: the batch's own (0 in the results: loads as given)
  std::vector<int> pipeline_stages;            ///< empty: the configured `SimConfig::pipeline_stages` only
  std::vector<int> tensor_parallel;            ///< empty: the configured `SimConfig::tensor_parallel` only
  int threads = 0;                             ///< candidates simulated at once (0: the hardware's threads)
};

/// One parallel configuration.
struct Deployment {
  int ep_size = 0;                    ///< GPUs per EP group (the rest are data-parallel copies)
  int slots = 0;                      ///< expert slots per GPU per layer
  std::int64_t microbatch_tokens = 0; ///< tokens per GPU per micro-batch (0: the loads as given)
  int pipeline_stages = 1;            ///< `SimConfig::pipeline_stages`
  int tensor_parallel = 1;            ///< `SimConfig::tensor_parallel`
  friend bool operator==(const Deployment &, const Deployment &) = default;
};

/// The EP sizes of the space for `cfg` (the configured one included), ascending; with `pipeline_stages` > 1 those of
/// one stage's GPUs (an EP size that does not divide them is left out).
[[nodiscard]] inline std::vector<int> deployment_ep_sizes(const SimConfig &cfg, const DeploymentSpace &space,
                                                          int pipeline_stages = 1) {
  const int G = cfg.topo.num_gpus() / pipeline_stages, gpn = cfg.topo.gpus_per_node, E = cfg.model.num_experts;
  std::vector<int> out;
  if (space.ep_sizes.empty()) {
    for (int d = gpn; d <= G; d += gpn)
      if (G % d == 0 && d <= E) out.push_back(d);
  } else {
    for (const int ep : space.ep_sizes) {
      if (pipeline_stages > 1 && ep > 0 && G % ep != 0) continue;
      detail::require(ep > 0 && G % ep == 0 && ep <= E && (ep % gpn == 0 || gpn % ep == 0),
                      "deployment search: EP size ", ep, " is not a group of whole nodes (or part of one node of ", gpn,
                      " GPUs) dividing ", G, " GPUs with at most ", E, " experts");
      out.push_back(ep);
    }
  }
  if (pipeline_stages == cfg.pipeline_stages || G % cfg.effective_ep_size() == 0)
    out.push_back(cfg.effective_ep_size());
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

/// The slot counts of the space at EP size `ep`, ascending.
[[nodiscard]] inline std::vector<int> deployment_slots(const SimConfig &cfg, const DeploymentSpace &space, int ep) {
  const int owners = (cfg.model.num_experts + ep - 1) / ep;
  std::vector<int> out;
  for (const int spare : space.spare_slots) {
    detail::require(spare >= 0 && spare <= max_spare_slots, "deployment search: ", spare,
                    " spare slots per GPU is outside [0, ", max_spare_slots, "]");
    out.push_back(owners + spare);
  }
  if (ep == cfg.effective_ep_size()) out.push_back(cfg.topo.slots_per_gpu);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

/// Every deployment of the space: micro-batch tokens outermost, then EP size, then slots, each ascending.
/// `microbatch` is the batch's own micro-batch tokens per GPU (0 for loads as given).
[[nodiscard]] inline std::vector<Deployment> deployment_candidates(const SimConfig &cfg, const DeploymentSpace &space,
                                                                   std::int64_t microbatch) {
  std::vector<std::int64_t> mbs =
      space.microbatch_tokens.empty() ? std::vector<std::int64_t>{microbatch} : space.microbatch_tokens;
  std::sort(mbs.begin(), mbs.end());
  mbs.erase(std::unique(mbs.begin(), mbs.end()), mbs.end());
  const std::vector<int> pps =
      space.pipeline_stages.empty() ? std::vector<int>{cfg.pipeline_stages} : space.pipeline_stages;
  const std::vector<int> tps =
      space.tensor_parallel.empty() ? std::vector<int>{cfg.tensor_parallel} : space.tensor_parallel;
  const int G = cfg.topo.num_gpus();
  for (const int pp : pps)
    detail::require(pp >= 1 && pp <= cfg.model.num_layers && G % pp == 0, "deployment search: ", pp,
                    " pipeline stages do not divide ", G, " GPUs into stages of at least one of ", cfg.model.num_layers,
                    " layers");
  for (const int tp : tps)
    detail::require(tp >= 1 && cfg.topo.gpus_per_node % tp == 0, "deployment search: tensor-parallel size ", tp,
                    " does not divide the ", cfg.topo.gpus_per_node, " GPUs of a node");
  std::vector<Deployment> out;
  for (const std::int64_t mb : mbs)
    for (const int pp : pps)
      for (const int tp : tps)
        for (const int ep : deployment_ep_sizes(cfg, space, pp))
          for (const int slots : deployment_slots(cfg, space, ep))
            out.push_back({ep, slots, mb, pp, tp});
  detail::require(out.size() <= max_deployment_candidates, "deployment search: ", out.size(),
                  " deployments (micro-batch sizes x EP sizes x slot counts) are more than ", max_deployment_candidates,
                  "; give fewer search.ep_sizes, search.spare_slots or search.microbatches");
  return out;
}

/// The loads one deployment runs on, `[M, L, E(, sources)]`, and its RL step offsets; the caller owns both.
struct DeploymentLoads {
  const LoadTensor *loads = nullptr;
  std::span<const std::int64_t> step_offsets;
};

/// One strategy in one deployment.
struct DeploymentRun {
  Deployment deployment;
  SimResult result;  ///< valid when `error` is empty
  bool fits = false; ///< its peak memory fits one GPU
  std::string error; ///< the reason the strategy could not run there (its planner refused the configuration)
};

/// The search's results: every run, candidate-major (`runs[c * strategies + s]`), and per strategy the index of
/// its best run (-1 when no candidate fits).
struct DeploymentSearch {
  std::vector<Deployment> candidates;
  std::vector<SimStrategy> strategies;
  std::vector<DeploymentRun> runs;
  std::vector<int> best; ///< per strategy: index into `runs`, or -1
  double seconds = 0;    ///< wall time of the simulations
  /// Deployments of the space left out before simulating, with the reason (their loads could not be made: a
  /// baseline workload's generator that cannot reach its target on that EP size); filled by the caller.
  std::vector<std::pair<Deployment, std::string>> skipped;
};

/// The configuration `cfg` at deployment `d`.
[[nodiscard]] inline SimConfig deployed(SimConfig cfg, const Deployment &d) {
  cfg.ep_size = d.ep_size;
  cfg.topo.slots_per_gpu = d.slots;
  cfg.pipeline_stages = d.pipeline_stages;
  cfg.tensor_parallel = d.tensor_parallel;
  return cfg;
}

/// Simulates every strategy in every candidate deployment and picks each strategy's fastest one that fits.
/// `loads[c]` are the loads of `candidates[c]` (several may share one tensor). `progress(done, total)` counts
/// (candidate, strategy) runs.
[[nodiscard]] inline DeploymentSearch search_deployments(const SimConfig &cfg, std::span<const SimStrategy> strategies,
                                                         std::vector<Deployment> candidates,
                                                         std::vector<DeploymentLoads> loads, int threads = 0,
                                                         const std::function<void(int, int)> &progress = {}) {
  detail::require(!candidates.empty(), "deployment search: no candidate deployment");
  detail::require(!strategies.empty(), "deployment search: no strategy");
  detail::require(loads.size() == candidates.size(), "deployment search: loads for ", loads.size(), " of ",
                  candidates.size(), " deployments");
  DeploymentSearch out;
  out.candidates = std::move(candidates);
  out.strategies.assign(strategies.begin(), strategies.end());
  for (std::size_t c = 0; c < out.candidates.size(); ++c) {
    deployed(cfg, out.candidates[c]).validate(); // a bad candidate fails before hours of simulation
    detail::require(loads[c].loads != nullptr, "deployment search: no loads for EP ", out.candidates[c].ep_size);
  }
  const std::size_t S = out.strategies.size(), n = out.candidates.size() * S;
  out.runs.resize(n);
  const auto t0 = std::chrono::steady_clock::now();
  if (threads <= 0) threads = static_cast<int>(std::max(1U, std::thread::hardware_concurrency()));
  ThreadPool pool(static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(threads), n)));
  std::atomic<int> done{0};
  std::mutex progress_mutex;
  pool.parallel_for(n, [&](std::size_t task, int) {
    const std::size_t c = task / S, s = task % S;
    DeploymentRun &run = out.runs[task];
    run.deployment = out.candidates[c];
    const SimConfig dc = deployed(cfg, run.deployment);
    const DeploymentLoads &dl = loads[c];
    try {
      run.result = simulate(dc, *dl.loads, dl.step_offsets, std::span(&out.strategies[s], 1), {}, false).front();
      run.fits = memory_fits(dc, run.result.memory);
    } catch (const Error &e) { // a planner that cannot plan this configuration: that strategy is not deployable here
      run.error = e.what();
    }
    const int k = ++done;
    if (progress) {
      const std::lock_guard lock(progress_mutex);
      progress(k, static_cast<int>(n));
    }
  });
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  out.best.assign(S, -1);
  for (std::size_t t = 0; t < n; ++t) {
    const DeploymentRun &r = out.runs[t];
    if (!r.error.empty() || !r.fits) continue;
    int &b = out.best[t % S];
    // Ties: the smaller EP size, then fewer slots, then the smaller micro-batch (file comment).
    auto key = [&](const DeploymentRun &x) {
      return std::tuple(x.result.step_seconds, x.deployment.ep_size, x.deployment.slots, x.deployment.microbatch_tokens,
                        x.deployment.pipeline_stages, x.deployment.tensor_parallel);
    };
    if (b < 0 || key(r) < key(out.runs[static_cast<std::size_t>(b)])) b = static_cast<int>(t);
  }
  return out;
}

} // namespace v0
} // namespace foremoe
