#pragma once
/// @file
/// Deterministic synthetic routing traces of GRPO-style RL post-training: routed ids or per-micro-step loads.
///
/// Model, from the seed alone (own PRNG and samplers, so the output is the same with every standard library):
/// - every MoE layer has a global expert popularity (lognormal weights by default, or a power law over a random
///   permutation of the experts), whose `skew` (jittered per layer) sets the step-level skew;
/// - `num_topics` topics each have, per layer, a preference over experts drawn from a Dirichlet centred on that
///   popularity; a prompt mixes a few topics, and each of its responses adds a topic of its own;
/// - with `coactivation` > 0 each topic also moves that share of its per-layer preference onto one cluster of
///   experts (a random partition per layer, the cluster drawn with its popularity share), so that a token's top-k
///   tend to come from its topics' clusters: pairwise co-activation. At 0 nothing is drawn for it and the ids are
///   unchanged;
/// - a sequence is its prompt (routed identically in every response of that prompt, as a real router would)
///   followed by its response. Per layer, consecutive tokens keep each of their top-k experts with probability
///   `persistence` and re-draw the others, distinct within the token, from the sequence's expert distribution;
/// - with a group limit (`route_groups`, `route_max_groups`: DeepSeek-V3's node-limited routing), a re-drawn slot
///   keeps the token within `route_max_groups` contiguous expert groups: once its other slots use that many, it
///   draws only from their groups (the same weights, restricted). Without a limit the code and ids are unchanged;
///   with one, candidates are rejected one at a time (about 3x the CPU on the DeepSeek-V3 preset);
/// - every step shuffles its sequences, deals them to the `num_gpus` data-parallel ranks (each to the rank with
///   the fewest tokens so far), and each rank packs its sequences in order into micro-batches of at most
///   `microbatch_tokens_per_gpu` tokens. Micro-step `m` of a step is the `m`-th micro-batch of every rank.
///
/// - `packing` (not `none`) then re-packs each step's sequences into the same number of micro-steps and ranks, as a
///   trainer with routing replay could (foremoe/plan/packing.hpp): `tokens` balances token counts (verl's
///   `rearrange_micro_batches` in spirit), `routing` balances every micro-step's expert loads from the sequences'
///   routing, starting from the layout above. Neither changes any sequence's routing.
///
/// Step totals average over thousands of sequences and barely move from step to step; a micro-step holds only a
/// fraction of them, and the sequences' topic-coherent routing makes its loads swing.
///
/// Stream version (`synthetic_stream_version`): the ids for a seed are fixed within a version and the same at any
/// thread count; a new version keeps the model above (the same distribution) but draws it from other random bits.
/// - 1: per token, four slots' keep coins per 64-bit word (15-bit thresholds); dropped slots re-drawn by
///   rejection from an alias table of `E` buckets, on the chain's one stream.
/// - 2 (current): each (sequence part, layer) chain has a coin stream, whose first word seeds its candidate
///   stream. Coins: per token and group of up to 8 slots, 32 bits draw the group's drop mask from an alias table
///   over its 2^8 masks of independent coins. Candidates: experts pre-drawn two per word from an alias table
///   padded to a power-of-two bucket count; a dropped slot takes the next candidates that no other slot holds.
///   About 10% less CPU than version 1 (bench/bench_synthetic.cpp); the chains themselves (3.2 re-draws per
///   token and layer at the defaults) are the cost: about 110 instructions per re-draw (cachegrind), a fifth of
///   them drawing candidates. Writing each token's drop list as two vector stores took another 11% off
///   (BM_generate_loads/1, CPU time 597 -> 531 ms on a 2-core Xeon VM), with the same stream.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <queue>
#include <thread>
#include <utility>
#include <vector>

#include "foremoe/core/detail/random.hpp"
#include "foremoe/core/error.hpp"
#include "foremoe/core/limits.hpp"
#include "foremoe/core/load_tensor.hpp"
#include "foremoe/core/thread_pool.hpp"
#include "foremoe/plan/packing.hpp"

namespace foremoe {
inline namespace v0 {

/// Version of the random streams the generator draws from (see the file comment).
inline constexpr int synthetic_stream_version = 2;

/// Shape of a layer's global expert popularity.
enum class PopularityModel {
  /// Independent lognormal weights, `exp(skew * N(0, 1))`. Its shape matches the DeepSeek-V3 histograms: 256 such
  /// weights with skew 0.7 have (median layer) max/mean 5.6, min/mean 0.12 and CV 0.78, the real prefill data
  /// 5.89, 0.12 and 0.83, while a power law of the same max/mean has min/mean 0.6 and CV 0.6. Routed loads come
  /// out flatter than the popularity (a token takes an expert at most once), so the presets use a larger skew.
  lognormal,
  /// Power law: the expert of popularity rank r (a random permutation per layer) gets weight (r+1)^-skew.
  zipf,
};

/// A lognormal length distribution, rounded to whole tokens and clipped to `[min_tokens, max_tokens]`.
struct LengthDistribution {
  double mean = 1.0;  ///< arithmetic mean of the unclipped lognormal, in tokens
  double sigma = 0.0; ///< standard deviation of the underlying normal (log scale); 0 = every length is `mean`
  int min_tokens = 1; ///< clip below
  int max_tokens = 1; ///< clip above
};

/// Shape and statistics of a synthetic GRPO trace. The defaults model Qwen3-30B-A3B (48 MoE layers, 128 experts,
/// top-8) on 64 GPUs: about 8M tokens and 10 micro-steps per RL step.
struct SyntheticConfig {
  std::uint64_t seed = 1; ///< everything below is a deterministic function of this

  int num_layers = 48;   ///< MoE layers
  int num_experts = 128; ///< routed experts per layer (at most 32767: ids are int16)
  int topk = 8;          ///< distinct experts per token and layer
  /// Group-limited ("node-limited") routing: the experts form this many contiguous groups of equal size (expert
  /// `e` is in group `e / (num_experts / route_groups)`), of which a token may use at most `route_max_groups` per
  /// layer (DeepSeek-V3: 8 groups, 4 per token, arXiv:2412.19437 sec. 2.1.2, `n_group` / `topk_group` in its
  /// config.json). 1 = no groups; must divide `num_experts`.
  int route_groups = 1;
  /// Groups a token may use per layer; 0, or at least `route_groups`, = no limit. With a limit, a re-drawn slot
  /// takes its expert from the sequence's distribution restricted to the groups that the token's other slots use
  /// once those are `route_max_groups` many (any group while fewer are used), so the token's groups follow the same
  /// weights that pick its experts, and every token spans at most `route_max_groups` groups.
  int route_max_groups = 0;

  int num_steps = 2;            ///< RL steps
  int prompts_per_step = 512;   ///< GRPO prompts per step
  int responses_per_prompt = 8; ///< GRPO group size; a step has prompts_per_step x responses_per_prompt sequences
  LengthDistribution prompt_length{512.0, 0.6, 32, 8192};    ///< drawn once per prompt
  LengthDistribution response_length{1500.0, 0.8, 16, 8192}; ///< drawn per response

  int num_topics = 32;       ///< topics with their own expert preferences, drawn once from the seed
  int topics_per_prompt = 3; ///< distinct topics mixed by one prompt
  /// Dirichlet concentration of a topic's per-layer expert preference, per expert (the total is this times
  /// `num_experts`), centred on the layer's popularity; smaller means more specialised topics.
  double topic_concentration = 0.5;
  /// In [0, 1]: co-activation strength, the share of each topic's per-layer preference that it puts on one cluster
  /// of experts, so that a token's top-k tend to come from the clusters of its topics. Every layer's experts form
  /// `coactivation_clusters` clusters (a random partition per layer, fixed by the seed, of sizes differing by at
  /// most one); each topic favours one cluster per layer, drawn with probability equal to the cluster's share of
  /// the layer's popularity (so the experts' marginal loads keep the popularity in expectation), and its preference
  /// becomes `(1 - coactivation) * q + coactivation * q|c`, where `q` is its Dirichlet preference and `q|c` that
  /// restricted to the cluster and renormalised. 0 = none: the preferences and the ids are those without it, to the
  /// bit. Calibrated value: see docs/simulator.md "Co-activation" (an assumption until a real trace is measured).
  double coactivation = 0.0;
  /// Expert clusters per layer for `coactivation`, in [0, num_experts]; 0 = `num_experts / topk` (clusters of about
  /// top-k experts, so that a token of one topic can take all its experts from its cluster).
  int coactivation_clusters = 0;
  /// Symmetric Dirichlet concentration of a prompt's weights over its topics.
  double topic_mix_concentration = 1.0;
  /// In [0, 1]: weight of one topic that each response draws for itself (uniformly), because responses to one
  /// prompt share its subject but not their reasoning path; the rest follows the prompt's mixture. 0 = every
  /// response routes like its prompt.
  double response_topic_weight = 0.5;

  /// Shape of the global per-layer expert popularity that `skew` parameterises.
  PopularityModel popularity = PopularityModel::lognormal;
  /// Skew of the global per-layer expert popularity, in [0, 20] (0 is uniform): the log-scale sigma of the
  /// lognormal weights, or the power-law exponent. The default puts the median step-level per-layer max/mean load
  /// near 4.7 for 128 experts.
  double skew = 0.8;
  /// Per-layer lognormal jitter (log-scale sigma) of `skew`, so layers differ in skew as real ones do.
  double skew_layer_sigma = 0.2;

  /// In [0, 1]: probability that a token keeps each of the previous token's experts in a layer.
  double persistence = 0.6;

  int num_gpus = 64;                              ///< data-parallel ranks (8 nodes x 8 GPUs)
  std::int64_t microbatch_tokens_per_gpu = 16384; ///< per-rank micro-batch token budget (dynamic batch size)
  /// Re-packing of each step's sequences into the trainer's micro-steps (the same number of micro-steps and ranks).
  /// A sequence longer than the budget runs alone in the trainer's layout; a re-packing raises its step's budget to
  /// the longest sequence, as verl requires of its own (`max_token_len` at least the longest sequence).
  BatchPacking packing = BatchPacking::none;
  /// Ranks that pack their sequences together: consecutive groups of this many ranks (an EP group, whose ranks'
  /// micro-batches make one EP group's micro-step) each re-pack only the sequences the trainer dealt them; 0: all
  /// ranks together. Must divide `num_gpus`.
  int packing_ranks = 0;

  /// DeepSeek-V3's MoE shape (58 MoE layers, 256 routed experts, top-8), with the skew calibrated so that the
  /// median step-level per-layer max/mean matches the real SGLang histograms (5.9).
  [[nodiscard]] static SyntheticConfig deepseek_v3() {
    SyntheticConfig c;
    c.num_layers = 58;
    c.num_experts = 256;
    c.topk = 8;
    c.skew = 0.85;
    // Node-limited routing: 8 groups of 32 experts, a token's experts in at most 4 of them (arXiv:2412.19437
    // sec. 2.1.2; config.json of deepseek-ai/DeepSeek-V3: "n_group": 8, "topk_group": 4).
    c.route_groups = 8;
    c.route_max_groups = 4;
    return c;
  }

  /// A Kimi-K2-like MoE shape: 60 MoE layers (61 layers, the first dense: `first_k_dense_replace` 1), 384 routed
  /// experts, top-8, no group limit (`n_group` 1), as in moonshotai/Kimi-K2-Instruct's config.json. No routing
  /// histograms of Kimi K2 are at hand, so the skew is DeepSeek-V3's calibrated one (an assumption).
  [[nodiscard]] static SyntheticConfig kimi_k2() {
    SyntheticConfig c;
    c.num_layers = 60;
    c.num_experts = 384;
    c.topk = 8;
    c.skew = deepseek_v3().skew;
    return c;
  }

  /// The expert clusters per layer that `coactivation` uses (`coactivation_clusters`, or `num_experts / topk`).
  [[nodiscard]] int coactivation_cluster_count() const noexcept {
    return coactivation_clusters > 0 ? coactivation_clusters : std::max(1, num_experts / std::max(1, topk));
  }

  /// Whether tokens are group-limited (`route_max_groups` between 1 and `route_groups - 1`).
  [[nodiscard]] bool group_limited() const noexcept {
    return route_groups > 1 && route_max_groups > 0 && route_max_groups < route_groups;
  }

  /// Throws `Error` naming the first bad value.
  void validate() const {
    using detail::require;
    require(num_layers > 0, "SyntheticConfig: num_layers must be positive, got ", num_layers);
    require(num_experts > 0, "SyntheticConfig: num_experts must be positive, got ", num_experts);
    require(num_experts <= 32767, "SyntheticConfig: num_experts ", num_experts,
            " exceeds 32767, the largest that int16 routed ids can name");
    require(topk > 0, "SyntheticConfig: topk must be positive, got ", topk);
    require(topk <= num_experts, "SyntheticConfig: topk ", topk, " exceeds num_experts ", num_experts,
            " (experts of a token are distinct)");
    require(route_groups >= 1 && num_experts % route_groups == 0, "SyntheticConfig: route_groups ", route_groups,
            " must be >= 1 and divide num_experts ", num_experts);
    require(route_max_groups >= 0, "SyntheticConfig: route_max_groups must be >= 0 (0: no limit), got ",
            route_max_groups);
    require(!group_limited() || static_cast<std::int64_t>(num_experts / route_groups) * route_max_groups >= topk,
            "SyntheticConfig: route_max_groups ", route_max_groups, " groups of ",
            num_experts / std::max(1, route_groups), " experts hold fewer than topk ", topk, " experts");
    require(num_steps > 0, "SyntheticConfig: num_steps must be positive, got ", num_steps);
    require(prompts_per_step > 0, "SyntheticConfig: prompts_per_step must be positive, got ", prompts_per_step);
    require(responses_per_prompt > 0, "SyntheticConfig: responses_per_prompt must be positive, got ",
            responses_per_prompt);
    require(static_cast<std::int64_t>(prompts_per_step) * responses_per_prompt <= (std::int64_t{1} << 28),
            "SyntheticConfig: ", prompts_per_step, " prompts x ", responses_per_prompt,
            " responses per step exceed 2^28 sequences");
    check_length(prompt_length, "prompt_length");
    check_length(response_length, "response_length");
    require(num_topics > 0, "SyntheticConfig: num_topics must be positive, got ", num_topics);
    require(topics_per_prompt > 0 && topics_per_prompt <= num_topics, "SyntheticConfig: topics_per_prompt ",
            topics_per_prompt, " must be in [1, num_topics = ", num_topics, "]");
    require(std::isfinite(topic_concentration) && topic_concentration > 0,
            "SyntheticConfig: topic_concentration must be positive and finite, got ", topic_concentration);
    require(std::isfinite(topic_mix_concentration) && topic_mix_concentration > 0,
            "SyntheticConfig: topic_mix_concentration must be positive and finite, got ", topic_mix_concentration);
    require(std::isfinite(coactivation) && coactivation >= 0 && coactivation <= 1,
            "SyntheticConfig: coactivation must be in [0, 1], got ", coactivation);
    require(coactivation_clusters >= 0 && coactivation_clusters <= num_experts,
            "SyntheticConfig: coactivation_clusters ", coactivation_clusters,
            " must be in [0, num_experts = ", num_experts, "] (0: num_experts / topk)");
    require(response_topic_weight >= 0 && response_topic_weight <= 1,
            "SyntheticConfig: response_topic_weight must be in [0, 1], got ", response_topic_weight);
    require(popularity == PopularityModel::lognormal || popularity == PopularityModel::zipf,
            "SyntheticConfig: unknown popularity model ", static_cast<int>(popularity));
    require(std::isfinite(skew) && skew >= 0 && skew <= 20, "SyntheticConfig: skew must be in [0, 20], got ", skew);
    require(std::isfinite(skew_layer_sigma) && skew_layer_sigma >= 0,
            "SyntheticConfig: skew_layer_sigma must be finite and >= 0, got ", skew_layer_sigma);
    require(persistence >= 0 && persistence <= 1, "SyntheticConfig: persistence must be in [0, 1], got ", persistence);
    require(num_gpus > 0, "SyntheticConfig: num_gpus must be positive, got ", num_gpus);
    require(num_gpus <= (1 << 20), "SyntheticConfig: num_gpus ", num_gpus, " exceeds 2^20");
    require(microbatch_tokens_per_gpu > 0, "SyntheticConfig: microbatch_tokens_per_gpu must be positive, got ",
            microbatch_tokens_per_gpu);
    require(packing == BatchPacking::none || packing == BatchPacking::tokens || packing == BatchPacking::routing,
            "SyntheticConfig: unknown packing ", static_cast<int>(packing));
    require(packing_ranks >= 0 && (packing_ranks == 0 || num_gpus % packing_ranks == 0),
            "SyntheticConfig: packing_ranks ", packing_ranks, " must be 0 (all ranks) or divide num_gpus ", num_gpus);
    // The work: routed ids for the expected tokens (lengths are clipped to their max, so a mean is at most that).
    const auto expected = [](const LengthDistribution &d) {
      return static_cast<std::int64_t>(std::ceil(std::min(d.mean, static_cast<double>(d.max_tokens))));
    };
    limits::require_product("SyntheticConfig",
                            {{"steps", num_steps},
                             {"prompts", prompts_per_step},
                             {"responses", responses_per_prompt},
                             {"tokens per sequence (expected)", expected(prompt_length) + expected(response_length)},
                             {"layers", num_layers},
                             {"topk", topk}},
                            limits::max_generator_work, "routed ids to generate");
  }

private:
  static void check_length(const LengthDistribution &d, const char *name) {
    using detail::require;
    require(std::isfinite(d.mean) && d.mean > 0, "SyntheticConfig: ", name, ".mean must be positive and finite, got ",
            d.mean);
    require(std::isfinite(d.sigma) && d.sigma >= 0 && d.sigma <= 10, "SyntheticConfig: ", name,
            ".sigma must be in [0, 10], got ", d.sigma);
    require(d.min_tokens > 0, "SyntheticConfig: ", name, ".min_tokens must be positive, got ", d.min_tokens);
    require(d.max_tokens >= d.min_tokens, "SyntheticConfig: ", name, ".max_tokens ", d.max_tokens,
            " is below min_tokens ", d.min_tokens);
    require(d.max_tokens <= (1 << 28), "SyntheticConfig: ", name, ".max_tokens ", d.max_tokens, " exceeds 2^28");
  }
};

/// How the generator runs; the output does not depend on these.
struct GeneratorOptions {
  int num_threads = 0; ///< worker threads; 0 = one per hardware thread
  /// Called with (tokens generated so far, total tokens) as work completes, from any worker (serialised).
  std::function<void(std::int64_t, std::int64_t)> progress;
  /// With `by_source`: consecutive ranks counted as one source (each data-parallel EP group's tokens as one
  /// source when it is the EP group size); must divide `num_gpus`.
  int ranks_per_source = 1;
};

/// Routed ids of a synthetic trace with its micro-batch, source-rank, step and sequence boundaries.
struct SyntheticTrace {
  std::vector<std::int16_t> routed_ids; ///< `[num_tokens][num_layers][topk]`, C order, execution order
  std::int64_t num_tokens = 0;
  int num_layers = 0, topk = 0, num_experts = 0;
  /// `[M + 1]` token offsets: micro-step `m` is tokens `[microbatch_offsets[m], microbatch_offsets[m+1])`.
  std::vector<std::int64_t> microbatch_offsets;
  /// `[M * num_gpus + 1]`: tokens of micro-step `m` from rank `r` are `[source_offsets[m*G+r],
  /// source_offsets[m*G+r+1])`.
  std::vector<std::int64_t> source_offsets;
  /// `[num_steps + 1]` offsets in micro-steps: step `s` is micro-steps `[step_offsets[s], step_offsets[s+1])`.
  std::vector<std::int64_t> step_offsets;
  /// `[num_sequences + 1]` token offsets of the sequences (prompt + response) in execution order.
  std::vector<std::int64_t> sequence_offsets;
};

namespace detail {

inline int sample_length(Xoshiro256 &rng, const LengthDistribution &d) noexcept {
  const double x = std::round(sample_lognormal(rng, d.mean, d.sigma));
  return static_cast<int>(std::clamp(x, static_cast<double>(d.min_tokens), static_cast<double>(d.max_tokens)));
}

/// Expert preferences drawn once from the seed: `topic_prefs[(t * L + l) * E + e]`.
struct SyntheticWorld {
  std::vector<double> topic_prefs;
};

// Stream tags, so that adding a stream never shifts another one.
inline constexpr std::uint64_t tag_popularity = 1, tag_topic = 2, tag_step = 3, tag_prompt = 4, tag_response = 5,
                               tag_route = 6, tag_coactivation = 7;

/// Expert clusters of layer `l` for `cfg.coactivation`: `cluster_of[e]`, a random partition of the experts into
/// `cfg.coactivation_cluster_count()` clusters whose sizes differ by at most one.
inline std::vector<int> coactivation_clusters_of_layer(const SyntheticConfig &cfg, int l) {
  const auto ne = static_cast<std::size_t>(cfg.num_experts);
  const auto nc = static_cast<std::size_t>(cfg.coactivation_cluster_count());
  Xoshiro256 rng(stream_seed(cfg.seed, tag_coactivation, 0, static_cast<std::uint64_t>(l)));
  std::vector<int> perm(ne);
  for (std::size_t e = 0; e < ne; ++e)
    perm[e] = static_cast<int>(e);
  for (std::size_t i = ne; i > 1; --i)
    std::swap(perm[i - 1], perm[rng.below(i)]);
  std::vector<int> cluster_of(ne);
  for (std::size_t i = 0; i < ne; ++i) // position i of the permutation is in cluster floor(i * nc / ne)
    cluster_of[static_cast<std::size_t>(perm[i])] = static_cast<int>(i * nc / ne);
  return cluster_of;
}

/// Moves `cfg.coactivation` of topic `t`'s preference `q` (layer `l`, popularity `p`) onto one cluster of
/// `cluster_of`, drawn with probability equal to its share of `p`: `q <- (1 - s) q + s q|c` (see
/// `SyntheticConfig::coactivation`). A cluster where `q` has no mass at all takes `p` restricted to it instead.
inline void apply_coactivation(const SyntheticConfig &cfg, int t, int l, const double *p,
                               const std::vector<int> &cluster_of, double *q) {
  const std::size_t ne = cluster_of.size();
  Xoshiro256 rng(
      stream_seed(cfg.seed, tag_coactivation, static_cast<std::uint64_t>(t) + 1, static_cast<std::uint64_t>(l)));
  const double u = rng.uniform();
  // The favoured cluster: the first whose cumulative popularity passes u (experts in index order).
  const int nc = cfg.coactivation_cluster_count();
  std::vector<double> mass(static_cast<std::size_t>(nc), 0.0);
  for (std::size_t e = 0; e < ne; ++e)
    mass[static_cast<std::size_t>(cluster_of[e])] += p[e];
  int c = nc - 1;
  double acc = 0;
  for (int i = 0; i < nc; ++i) {
    acc += mass[static_cast<std::size_t>(i)];
    if (u < acc) {
      c = i;
      break;
    }
  }
  double in = 0;
  for (std::size_t e = 0; e < ne; ++e)
    if (cluster_of[e] == c) in += q[e];
  const double *src = in > 0 ? q : p;
  const double norm = in > 0 ? in : mass[static_cast<std::size_t>(c)];
  const double s = cfg.coactivation;
  for (std::size_t e = 0; e < ne; ++e)
    q[e] = (1.0 - s) * q[e] + (cluster_of[e] == c ? s * src[e] / norm : 0.0);
}

inline SyntheticWorld make_world(const SyntheticConfig &cfg) {
  const int num_layers = cfg.num_layers, num_experts = cfg.num_experts;
  const auto ne = static_cast<std::size_t>(num_experts);
  std::vector<double> popularity(static_cast<std::size_t>(num_layers) * ne);
  for (int l = 0; l < num_layers; ++l) {
    Xoshiro256 rng(stream_seed(cfg.seed, tag_popularity, static_cast<std::uint64_t>(l)));
    const double jitter = cfg.skew_layer_sigma;
    const double s = cfg.skew * std::exp(jitter * sample_normal(rng) - 0.5 * jitter * jitter);
    double *p = popularity.data() + static_cast<std::size_t>(l) * ne;
    if (cfg.popularity == PopularityModel::zipf) {
      std::vector<int> perm(ne);
      for (int e = 0; e < num_experts; ++e)
        perm[static_cast<std::size_t>(e)] = e;
      for (std::size_t i = ne; i > 1; --i)
        std::swap(perm[i - 1], perm[rng.below(i)]);
      for (std::size_t r = 0; r < ne; ++r)
        p[perm[r]] = std::pow(static_cast<double>(r + 1), -s);
    } else {
      for (std::size_t e = 0; e < ne; ++e)
        p[e] = std::exp(s * sample_normal(rng));
    }
    double sum = 0;
    for (std::size_t e = 0; e < ne; ++e)
      sum += p[e];
    for (std::size_t e = 0; e < ne; ++e)
      p[e] /= sum;
  }
  SyntheticWorld w;
  w.topic_prefs.resize(static_cast<std::size_t>(cfg.num_topics) * popularity.size());
  std::vector<double> alpha(ne);
  // Every expert stays reachable, so k distinct experts can always be drawn.
  const double floor_mass = 1e-4;
  // Without co-activation nothing below draws from its streams, so the preferences are those before it existed.
  std::vector<std::vector<int>> clusters;
  if (cfg.coactivation > 0)
    for (int l = 0; l < num_layers; ++l)
      clusters.push_back(coactivation_clusters_of_layer(cfg, l));
  for (int t = 0; t < cfg.num_topics; ++t)
    for (int l = 0; l < num_layers; ++l) {
      Xoshiro256 rng(stream_seed(cfg.seed, tag_topic, static_cast<std::uint64_t>(t), static_cast<std::uint64_t>(l)));
      const double *p = popularity.data() + static_cast<std::size_t>(l) * ne;
      for (std::size_t e = 0; e < ne; ++e)
        alpha[e] = cfg.topic_concentration * num_experts * p[e];
      double *q = w.topic_prefs.data() + (static_cast<std::size_t>(t) * num_layers + l) * ne;
      sample_dirichlet(rng, alpha.data(), q, ne);
      if (cfg.coactivation > 0) apply_coactivation(cfg, t, l, p, clusters[static_cast<std::size_t>(l)], q);
      for (std::size_t e = 0; e < ne; ++e)
        q[e] = (1.0 - floor_mass) * q[e] + floor_mass / num_experts;
    }
  return w;
}

/// One sequence of a step: a response to a prompt.
struct SyntheticSequence {
  int prompt_idx = 0;
  int prompt_tokens = 0, response_tokens = 0;
  std::uint64_t prompt_seed = 0, response_seed = 0; ///< routing streams of the two parts
};

/// A step's sequences, topic mixtures and execution layout (no routing yet).
struct SyntheticStepPlan {
  std::vector<SyntheticSequence> sequences; ///< prompt-major: response j of prompt p is `p * R + j`
  std::vector<int> prompt_topics;           ///< `[P][topics_per_prompt]`
  std::vector<double> prompt_weights;       ///< `[P][topics_per_prompt]`
  std::vector<int> response_topics;         ///< `[P * R][topics_per_prompt + 1]`: the prompt's, then its own
  std::vector<double> response_weights;     ///< `[P * R][topics_per_prompt + 1]`
  std::vector<int> order;                   ///< sequence indices in execution order
  std::vector<std::int64_t> block_offsets;  ///< `[M * G + 1]` into `order`: micro-step m, rank r
  int num_micro_steps = 0;
};

inline SyntheticStepPlan plan_step(const SyntheticConfig &cfg, int step_idx) {
  const int num_prompts = cfg.prompts_per_step, num_responses = cfg.responses_per_prompt;
  const int tp = cfg.topics_per_prompt, num_gpus = cfg.num_gpus;
  const auto ntp = static_cast<std::size_t>(tp);
  const auto num_seqs = static_cast<std::size_t>(num_prompts) * static_cast<std::size_t>(num_responses);
  const auto step = static_cast<std::uint64_t>(step_idx);
  SyntheticStepPlan plan;
  plan.sequences.resize(num_seqs);
  plan.prompt_topics.resize(static_cast<std::size_t>(num_prompts) * ntp);
  plan.prompt_weights.resize(plan.prompt_topics.size());
  plan.response_topics.resize(num_seqs * (ntp + 1));
  plan.response_weights.resize(num_seqs * (ntp + 1));
  const std::vector<double> mix_alpha(ntp, cfg.topic_mix_concentration);
  std::vector<int> topics(static_cast<std::size_t>(cfg.num_topics));
  for (int p = 0; p < num_prompts; ++p) {
    const auto pu = static_cast<std::size_t>(p);
    Xoshiro256 rng(stream_seed(cfg.seed, tag_prompt, step, pu));
    const int prompt_tokens = sample_length(rng, cfg.prompt_length);
    const std::uint64_t prompt_seed = stream_seed(cfg.seed, tag_route, step, pu, 0);
    for (std::size_t t = 0; t < topics.size(); ++t)
      topics[t] = static_cast<int>(t);
    for (std::size_t i = 0; i < ntp; ++i) { // partial Fisher-Yates: tp distinct topics
      std::swap(topics[i], topics[i + rng.below(topics.size() - i)]);
      plan.prompt_topics[pu * ntp + i] = topics[i];
    }
    double *pw = plan.prompt_weights.data() + pu * ntp;
    sample_dirichlet(rng, mix_alpha.data(), pw, ntp);
    for (int j = 0; j < num_responses; ++j) {
      const std::size_t s = pu * static_cast<std::size_t>(num_responses) + static_cast<std::size_t>(j);
      Xoshiro256 rrng(stream_seed(cfg.seed, tag_response, step, pu, static_cast<std::uint64_t>(j)));
      SyntheticSequence &seq = plan.sequences[s];
      seq.prompt_idx = p;
      seq.prompt_tokens = prompt_tokens;
      seq.response_tokens = sample_length(rrng, cfg.response_length);
      seq.prompt_seed = prompt_seed;
      seq.response_seed = stream_seed(cfg.seed, tag_route, step, pu, static_cast<std::uint64_t>(j) + 1);
      int *rt = plan.response_topics.data() + s * (ntp + 1);
      double *rw = plan.response_weights.data() + s * (ntp + 1);
      for (std::size_t i = 0; i < ntp; ++i) {
        rt[i] = plan.prompt_topics[pu * ntp + i];
        rw[i] = (1.0 - cfg.response_topic_weight) * pw[i];
      }
      rt[ntp] = static_cast<int>(rrng.below(static_cast<std::uint64_t>(cfg.num_topics)));
      rw[ntp] = cfg.response_topic_weight;
    }
  }

  // Shuffle, deal to the least-loaded rank, then pack each rank greedily in order.
  Xoshiro256 rng(stream_seed(cfg.seed, tag_step, step));
  std::vector<int> shuffled(num_seqs);
  for (std::size_t i = 0; i < num_seqs; ++i)
    shuffled[i] = static_cast<int>(i);
  for (std::size_t i = num_seqs; i > 1; --i)
    std::swap(shuffled[i - 1], shuffled[rng.below(i)]);
  const auto ng = static_cast<std::size_t>(num_gpus);
  std::vector<std::vector<int>> rank_seqs(ng);
  // (tokens so far, rank), least first; ties go to the lower rank.
  std::priority_queue<std::pair<std::int64_t, std::size_t>, std::vector<std::pair<std::int64_t, std::size_t>>,
                      std::greater<>>
      least_loaded;
  for (std::size_t r = 0; r < ng; ++r)
    least_loaded.emplace(0, r);
  for (int s : shuffled) {
    const auto [tokens, r] = least_loaded.top();
    least_loaded.pop();
    const SyntheticSequence &seq = plan.sequences[static_cast<std::size_t>(s)];
    least_loaded.emplace(tokens + seq.prompt_tokens + seq.response_tokens, r);
    rank_seqs[r].push_back(s);
  }
  // rank_mb[r][b] = first index into rank_seqs[r] of micro-batch b, plus an end marker.
  std::vector<std::vector<std::size_t>> rank_mb(ng);
  std::size_t num_micro = 0;
  for (std::size_t r = 0; r < ng; ++r) {
    std::int64_t fill = 0;
    for (std::size_t i = 0; i < rank_seqs[r].size(); ++i) {
      const SyntheticSequence &seq = plan.sequences[static_cast<std::size_t>(rank_seqs[r][i])];
      const std::int64_t n = seq.prompt_tokens + seq.response_tokens;
      if (i == 0 || fill + n > cfg.microbatch_tokens_per_gpu) {
        rank_mb[r].push_back(i);
        fill = 0;
      }
      fill += n;
    }
    num_micro = std::max(num_micro, rank_mb[r].size());
    rank_mb[r].push_back(rank_seqs[r].size());
  }
  plan.num_micro_steps = static_cast<int>(num_micro);
  plan.order.reserve(num_seqs);
  plan.block_offsets.reserve(num_micro * ng + 1);
  for (std::size_t m = 0; m < num_micro; ++m)
    for (std::size_t r = 0; r < ng; ++r) {
      plan.block_offsets.push_back(static_cast<std::int64_t>(plan.order.size()));
      if (m + 1 < rank_mb[r].size())
        for (std::size_t i = rank_mb[r][m]; i < rank_mb[r][m + 1]; ++i)
          plan.order.push_back(rank_seqs[r][i]);
    }
  plan.block_offsets.push_back(static_cast<std::int64_t>(plan.order.size()));
  return plan;
}

/// Routes one sequence, layer by layer (a layer's alias table stays in L1 for the whole sequence), calling
/// `sink.route(token_idx, layer_idx, ids)` with the token's `topk` distinct expert ids.
///
/// Each (sequence part, layer) chain draws from two streams of its own seed (stream version 2): its coin stream,
/// whose first word seeds its candidate stream. Coins: per token and group of (up to) 8 slots, 32 bits draw the
/// group's drop mask from an alias table over the 2^8 masks of independent per-slot coins. Candidates: experts
/// pre-drawn from the layer's alias table, two per word; a dropped slot takes the next candidate that no other
/// slot holds (rejection), and slots drop in token and slot order.
class SequenceRouter {
public:
  explicit SequenceRouter(const SyntheticConfig &cfg)
      : num_layers_(cfg.num_layers), num_experts_(cfg.num_experts),
        tp_(static_cast<std::size_t>(cfg.topics_per_prompt)), k_(static_cast<std::size_t>(cfg.topk)),
        drops_(cfg.persistence < 1.0), distinct_weights_(cfg.response_topic_weight > 0),
        block_tokens_(std::max<std::size_t>(1, kEventBuffer / static_cast<std::size_t>(cfg.topk))),
        limited_(cfg.group_limited()), max_groups_(cfg.route_max_groups),
        scratch_((static_cast<std::size_t>(cfg.num_experts) + 63) / 64, 0) {
    if (limited_) {
      const int per_group = cfg.num_experts / cfg.route_groups;
      group_of_.resize(static_cast<std::size_t>(cfg.num_experts));
      for (int e = 0; e < cfg.num_experts; ++e)
        group_of_[static_cast<std::size_t>(e)] = static_cast<std::uint16_t>(e / per_group);
      group_count_.assign(static_cast<std::size_t>(cfg.route_groups), 0);
    }
    for (Lane &ln : lanes_) {
      ln.mix.resize(static_cast<std::size_t>(num_experts_));
      ln.cur.assign(k_, std::int16_t{-1});
      ln.taken.assign(scratch_.size(), 0);
      ln.enter.assign(k_, 0);
      ln.events.resize(block_tokens_ * k_ + 8);
      ln.candidates.resize(kCandidates);
    }
    // Drop masks of a full group of 8 slots ([0]) and of the last group ([1], k % 8 slots if that is not 0).
    const double q = 1.0 - cfg.persistence;
    for (int which = 0; which < 2; ++which) {
      const int g = which == 1 && cfg.topk % 8 != 0 ? cfg.topk % 8 : 8;
      std::vector<double> w(std::size_t{1} << g);
      for (std::size_t m = 0; m < w.size(); ++m) {
        const int d = std::popcount(m);
        w[m] = std::pow(q, d) * std::pow(1.0 - q, g - d);
      }
      mask_tables_[which].build(w.data(), static_cast<int>(w.size()));
    }
    for (unsigned m = 0; m < 256; ++m) {
      unsigned n = 0;
      for (unsigned b = 0; b < 8; ++b)
        if ((m >> b) & 1u) slot_lists_[m][n++] = b;
      slot_counts_[m] = static_cast<std::uint8_t>(n);
    }
  }

  template <class Sink>
  void route(const SyntheticWorld &world, const SyntheticStepPlan &plan, int seq_idx, std::int64_t first_token,
             Sink &sink) {
    const auto s = static_cast<std::size_t>(seq_idx);
    const SyntheticSequence &seq = plan.sequences[s];
    Lane &prompt = lanes_[0], &response = lanes_[1];
    for (int l = 0; l < num_layers_; ++l) {
      set_table(world, plan, seq, s, l, false, prompt);
      if (distinct_weights_) set_table(world, plan, seq, s, l, true, response);
      const auto lu = static_cast<std::uint64_t>(l);
      // The prompt's stream depends only on the prompt, so every response repeats its prompt's routes.
      run_single(prompt, prompt, mix64(seq.prompt_seed ^ lu), true, seq.prompt_tokens, first_token, l, sink);
      run_single(prompt, distinct_weights_ ? response : prompt, mix64(seq.response_seed ^ lu), false,
                 seq.response_tokens, first_token + seq.prompt_tokens, l, sink);
    }
  }

  /// Counts the prompt part of sequence `seq_idx` alone (identical in every response of its prompt, so it is
  /// counted once per prompt): each layer's `(expert, tokens)` pairs go to `counts` (layer `l`'s are
  /// `[count_offsets[l], count_offsets[l+1])`) and its final top-k, where the responses start, to `last`.
  template <class Sink>
  void count_prompt(const SyntheticWorld &world, const SyntheticStepPlan &plan, int seq_idx, Sink &sink,
                    std::vector<std::pair<std::int32_t, std::int32_t>> &counts,
                    std::vector<std::int32_t> &count_offsets, std::vector<std::int16_t> &last) {
    const auto s = static_cast<std::size_t>(seq_idx);
    const SyntheticSequence &seq = plan.sequences[s];
    counts.clear();
    count_offsets.assign(1, 0);
    last.resize(static_cast<std::size_t>(num_layers_) * k_);
    Lane &ln = lanes_[0];
    for (int l = 0; l < num_layers_; ++l) {
      set_table(world, plan, seq, s, l, false, ln);
      run_single(ln, ln, mix64(seq.prompt_seed ^ static_cast<std::uint64_t>(l)), true, seq.prompt_tokens, 0, l, sink);
      std::int64_t *row = sink.count_row(l);
      for (int e = 0; e < num_experts_; ++e)
        if (row[e] != 0) {
          counts.emplace_back(e, static_cast<std::int32_t>(row[e]));
          row[e] = 0;
        }
      count_offsets.push_back(static_cast<std::int32_t>(counts.size()));
      std::copy(ln.cur.begin(), ln.cur.end(), last.begin() + static_cast<std::ptrdiff_t>(l * k_));
    }
  }

  /// Counts the response part of sequence `seq_idx` into `sink`, each layer's chain starting from `last` (the
  /// prompt's final top-k that `count_prompt` recorded); the same counts as that part of `route`.
  template <class Sink>
  void count_response(const SyntheticWorld &world, const SyntheticStepPlan &plan, int seq_idx, const std::int16_t *last,
                      Sink &sink) {
    const auto s = static_cast<std::size_t>(seq_idx);
    const SyntheticSequence &seq = plan.sequences[s];
    Lane &ln = lanes_[0];
    for (int l = 0; l < num_layers_; ++l) {
      const auto lu = static_cast<std::size_t>(l);
      std::copy(last + lu * k_, last + (lu + 1) * k_, ln.cur.begin());
      set_table(world, plan, seq, s, l, distinct_weights_, ln);
      run_single(ln, ln, mix64(seq.response_seed ^ lu), false, seq.response_tokens, 0, l, sink);
    }
  }

private:
  /// One chain's buffers and its layer's expert distribution.
  struct Lane {
    std::vector<double> mix;              ///< the layer's expert distribution
    AliasTable table;                     ///< ... as an alias table
    std::vector<std::int16_t> cur;        ///< current top-k of the chain; -1 before the first draw
    std::vector<std::uint64_t> taken;     ///< bit set of the experts in `cur` (top-k above 8)
    std::vector<std::int64_t> enter;      ///< run-length counting: token at which each slot got its expert
    std::vector<std::uint32_t> events;    ///< a block's drops: token in the block << 10 | slot
    std::vector<std::int16_t> candidates; ///< pre-drawn alias-table candidates
  };
  using Quad = std::uint32_t __attribute__((vector_size(16)));
  static constexpr std::size_t kCandidates = 256;   ///< candidates drawn per refill
  static constexpr std::size_t kEventBuffer = 4096; ///< (token, slot) coins per block

  [[nodiscard]] static bool taken(const std::uint64_t *bits, int e) noexcept {
    return (bits[static_cast<unsigned>(e) >> 6] >> (static_cast<unsigned>(e) & 63u)) & 1u;
  }
  static void flip(std::uint64_t *bits, int e) noexcept {
    bits[static_cast<unsigned>(e) >> 6] ^= std::uint64_t{1} << (static_cast<unsigned>(e) & 63u);
  }

  /// The experts held by the other slots, as a bit set (any top-k).
  struct BitTaken {
    std::uint64_t *bits;
    [[nodiscard]] bool test(int e) const noexcept { return taken(bits, e); }
    void remove(std::size_t, int e) noexcept { flip(bits, e); }
    void add(std::size_t, int e) noexcept { flip(bits, e); }
    [[nodiscard]] const std::uint64_t *bit_set(std::uint64_t *) const noexcept { return bits; }
    static BitTaken of(Lane &ln) {
      std::fill(ln.taken.begin(), ln.taken.end(), 0);
      for (const std::int16_t e : ln.cur)
        if (e >= 0) flip(ln.taken.data(), e);
      return {ln.taken.data()};
    }
  };
  /// The experts held by the other slots, as 8 lanes of one vector register (top-k up to 8; a free lane holds -1):
  /// testing a candidate is one compare, with no store to wait for.
  struct LaneTaken {
    using Lanes = std::int16_t __attribute__((vector_size(16)));
    Lanes held;
    std::size_t num_words;
    /// All ones in lane `j`, from a table (building it in place would store one lane and load all eight).
    [[nodiscard]] static Lanes lane(std::size_t j) noexcept {
      alignas(16) static constexpr std::int16_t masks[15] = {0, 0, 0, 0, 0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0};
      Lanes m;
      std::memcpy(&m, masks + 7 - j, sizeof m);
      return m;
    }
    [[nodiscard]] bool test(int e) const noexcept {
      const Lanes eq = held == static_cast<std::int16_t>(e);
      std::uint64_t w[2];
      std::memcpy(w, &eq, sizeof w);
      return (w[0] | w[1]) != 0;
    }
    void remove(std::size_t j, int) noexcept { held |= lane(j); }
    void add(std::size_t j, int e) noexcept {
      const Lanes m = lane(j);
      held = (held & ~m) | (static_cast<std::int16_t>(e) & m);
    }
    [[nodiscard]] const std::uint64_t *bit_set(std::uint64_t *scratch) const noexcept {
      std::fill(scratch, scratch + num_words, 0);
      for (std::size_t j = 0; j < 8; ++j)
        if (held[j] >= 0) flip(scratch, held[j]);
      return scratch;
    }
    static LaneTaken of(const Lane &ln) {
      LaneTaken t{{-1, -1, -1, -1, -1, -1, -1, -1}, ln.taken.size()};
      for (std::size_t j = 0; j < ln.cur.size(); ++j)
        t.held[j] = ln.cur[j];
      return t;
    }
  };

  /// One layer's chain over one sequence part, run in blocks of tokens: first the drops of the whole block,
  /// without branches, into a list in token and slot order; then the drops, each re-drawn excluding every other
  /// slot's current expert (so the top-k stays distinct) but not its own. A sink with `count_row(layer_idx)` gets
  /// run-length counts (an expert's load grows by the tokens it stayed for, added when it leaves); any other sink
  /// sees every token through `route`.
  template <class Taken, class Sink, bool Limited> struct Chain {
    static constexpr bool run_length = requires(Sink & sk) { sk.count_row(0); };
    SequenceRouter &router;
    Xoshiro256 coins, draws;
    std::size_t pos = kCandidates; ///< next of `candidates`
    Taken held;
    const AliasTable &table;
    const double *probs;
    std::int16_t *cur;
    std::int64_t *enter, *row = nullptr;
    std::uint32_t *events;
    std::int16_t *candidates;
    std::int64_t first_token;
    int num_tokens, layer;
    std::size_t n = 0; ///< drops in the current block
    // Group limit (Limited only): slots of the current top-k in each group, and the groups with any.
    std::int32_t *group_count = nullptr;
    const std::uint16_t *group_of = nullptr;
    int groups_used = 0;

    Chain(SequenceRouter &r, Lane &state, const Lane &dist, std::uint64_t seed, std::int64_t first, int tokens, int l,
          Sink &sink)
        : router(r), coins(seed), draws(coins.next()), held(Taken::of(state)), table(dist.table),
          probs(dist.mix.data()), cur(state.cur.data()), enter(state.enter.data()), events(state.events.data()),
          candidates(state.candidates.data()), first_token(first), num_tokens(tokens), layer(l) {
      if constexpr (run_length) row = sink.count_row(l);
      if constexpr (Limited) {
        group_count = r.group_count_.data();
        group_of = r.group_of_.data();
        std::fill(r.group_count_.begin(), r.group_count_.end(), 0);
        for (std::size_t j = 0; j < r.k_; ++j)
          if (cur[j] >= 0) enter_group(cur[j]);
      }
    }

    void enter_group(int e) noexcept { groups_used += group_count[group_of[e]]++ == 0 ? 1 : 0; }
    void leave_group(int e) noexcept { groups_used -= --group_count[group_of[e]] == 0 ? 1 : 0; }
    /// Whether `e` keeps the token within `route_max_groups` groups, given the other slots' groups.
    [[nodiscard]] bool allowed(int e) const noexcept {
      return groups_used < router.max_groups_ || group_count[group_of[e]] > 0;
    }

    /// `draw` under the group limit: the next candidate that no other slot holds and that is in an allowed group;
    /// exact over the allowed remaining mass if that stalls. Candidates are taken one at a time.
    int draw_limited() {
      for (int tries = 0; tries < 64; ++tries) {
        if (pos == kCandidates) [[unlikely]]
          refill();
        const int x = candidates[pos++];
        if (!held.test(x) && allowed(x)) return x;
      }
      Xoshiro256 rng = draws;
      const Taken others = held;
      const int e =
          router.draw_exact(rng, probs, others.bit_set(router.scratch_.data()), [this](int x) { return allowed(x); });
      draws = rng;
      return e;
    }

    int next() {
      if constexpr (Limited)
        return draw_limited();
      else
        return draw();
    }

    void refill() {
      // Through locals only: a member whose address escaped would have to be reloaded after every count store.
      Xoshiro256 rng = draws;
      fill_candidates(rng, table, candidates);
      draws = rng;
      pos = 0;
    }

    /// An expert no other slot holds: the next candidate not taken, exact over the remaining mass if that stalls
    /// (a few experts holding almost all the mass). The first two candidates are read together and consumed in order
    /// either way. Compilers branch on the first test (held about 13% of the time at the defaults); that measured
    /// faster than a branch-free choice, which puts the test on the path to the next candidate's address (25% slower),
    /// and interleaving two layers' chains in one loop to hide that latency gained nothing.
    int draw() {
      if (pos + 2 > kCandidates) [[unlikely]]
        refill();
      const int e0 = candidates[pos], e1 = candidates[pos + 1];
      const bool t0 = held.test(e0);
      const int e = t0 ? e1 : e0;
      pos += t0 ? 2 : 1;
      if (!(t0 && held.test(e1))) [[likely]]
        return e;
      for (int tries = 2; tries < 64; ++tries) {
        if (pos == kCandidates) [[unlikely]]
          refill();
        const int x = candidates[pos++];
        if (!held.test(x)) return x;
      }
      Xoshiro256 rng = draws;
      const Taken others = held;
      const int e2 = router.draw_exact(rng, probs, others.bit_set(router.scratch_.data()), [](int) { return true; });
      draws = rng;
      return e2;
    }

    /// Draws a fresh top-k (a prompt's first token); returns the first token that may drop.
    int start(bool fresh, Sink &sink) {
      int t = 0;
      if (fresh && num_tokens > 0) {
        for (std::size_t j = 0; j < router.k_; ++j) {
          cur[j] = static_cast<std::int16_t>(next());
          held.add(j, cur[j]);
          if constexpr (Limited) enter_group(cur[j]);
        }
        if constexpr (!run_length) sink.route(first_token, layer, cur);
        t = 1;
      }
      if constexpr (run_length) std::fill(enter, enter + router.k_, first_token);
      return t;
    }

    /// Lists the drops of tokens `[t0, t1)`: per group of 8 slots, one 32-bit draw of the group's mask.
    void list_drops(int t0, int t1) {
      n = 0;
      if (!router.drops_) return;
      const std::size_t num_groups = (router.k_ + 7) / 8;
      std::uint64_t word = 0;
      bool half = false;
      for (int u = t0; u < t1; ++u) {
        const auto tag = static_cast<std::uint32_t>(u - t0) << 10;
        for (std::size_t g = 0; g < num_groups; ++g) {
          if (!half) word = coins.next();
          const auto r = static_cast<std::uint32_t>(half ? word : word >> 32);
          half = !half;
          const auto mask = static_cast<unsigned>(router.mask_tables_[g + 1 == num_groups ? 1 : 0].sample_bits(r));
          // All 8 entries are written, 4 at a time (whole vectors: storing entry by entry costs more than the
          // rest of the token's coins); the count says how many are events.
          const std::uint32_t *list = router.slot_lists_[mask];
          const auto base = tag | static_cast<std::uint32_t>(g * 8);
          for (std::size_t h = 0; h < 8; h += 4) {
            Quad v;
            std::memcpy(&v, list + h, sizeof v);
            v |= base;
            std::memcpy(events + n + h, &v, sizeof v);
          }
          n += router.slot_counts_[mask];
        }
      }
    }

    void redraw(std::uint32_t ev, int t0) {
      const std::size_t j = ev & 1023u;
      held.remove(j, cur[j]);
      if constexpr (Limited) leave_group(cur[j]);
      const int e = next();
      held.add(j, e);
      if constexpr (Limited) enter_group(e);
      if constexpr (run_length) {
        const std::int64_t now = first_token + t0 + (ev >> 10);
        row[cur[j]] += now - enter[j];
        enter[j] = now;
      }
      cur[j] = static_cast<std::int16_t>(e);
    }

    /// Redraws the block's drops, routing every token to a routing sink.
    void redraw_block(int t0, int t1, Sink &sink) {
      if constexpr (run_length) {
        for (std::size_t i = 0; i < n; ++i)
          redraw(events[i], t0);
      } else {
        std::size_t i = 0;
        for (int u = t0; u < t1; ++u) {
          for (; i < n && static_cast<int>(events[i] >> 10) == u - t0; ++i)
            redraw(events[i], t0);
          sink.route(first_token + u, layer, cur);
        }
      }
    }

    void finish() {
      if constexpr (run_length) {
        const std::int64_t end = first_token + num_tokens;
        for (std::size_t j = 0; j < router.k_; ++j)
          row[cur[j]] += end - enter[j];
      }
    }
  };

  /// Pre-draws `kCandidates` experts from `table`, two per word, in a loop without branches, so that the
  /// generator and the look-ups pipeline.
  [[gnu::noinline]] static void fill_candidates(Xoshiro256 &rng_ref, const AliasTable &table, std::int16_t *out) {
    Xoshiro256 rng = rng_ref;
    for (std::size_t i = 0; i < kCandidates; i += 2) {
      const std::uint64_t w = rng.next();
      out[i] = static_cast<std::int16_t>(table.sample_bits(static_cast<std::uint32_t>(w >> 32)));
      out[i + 1] = static_cast<std::int16_t>(table.sample_bits(static_cast<std::uint32_t>(w)));
    }
    rng_ref = rng;
  }

  /// Sets `ln`'s distribution to layer `l` of the sequence's prompt mixture, or of its response's.
  void set_table(const SyntheticWorld &world, const SyntheticStepPlan &plan, const SyntheticSequence &seq,
                 std::size_t s, int l, bool response, Lane &ln) const {
    if (response)
      mix(world, plan.response_topics.data() + s * (tp_ + 1), plan.response_weights.data() + s * (tp_ + 1), tp_ + 1, l,
          ln.mix.data());
    else
      mix(world, plan.prompt_topics.data() + static_cast<std::size_t>(seq.prompt_idx) * tp_,
          plan.prompt_weights.data() + static_cast<std::size_t>(seq.prompt_idx) * tp_, tp_, l, ln.mix.data());
    ln.table.build(ln.mix.data(), num_experts_);
  }

  /// Runs one chain on `state`'s top-k with `dist`'s distribution (a fresh top-k if `fresh`).
  template <class Sink>
  void run_single(Lane &state, const Lane &dist, std::uint64_t seed, bool fresh, int num_tokens,
                  std::int64_t first_token, int l, Sink &sink) {
    if (fresh) std::fill(state.cur.begin(), state.cur.end(), std::int16_t{-1});
    if (limited_) {
      if (k_ <= 8)
        run_single<LaneTaken, true>(state, dist, seed, fresh, num_tokens, first_token, l, sink);
      else
        run_single<BitTaken, true>(state, dist, seed, fresh, num_tokens, first_token, l, sink);
    } else if (k_ <= 8) {
      run_single<LaneTaken, false>(state, dist, seed, fresh, num_tokens, first_token, l, sink);
    } else {
      run_single<BitTaken, false>(state, dist, seed, fresh, num_tokens, first_token, l, sink);
    }
  }
  template <class Taken, bool Limited, class Sink>
  void run_single(Lane &state, const Lane &dist, std::uint64_t seed, bool fresh, int num_tokens,
                  std::int64_t first_token, int l, Sink &sink) {
    Chain<Taken, Sink, Limited> c(*this, state, dist, seed, first_token, num_tokens, l, sink);
    const auto block = static_cast<int>(block_tokens_);
    for (int t0 = c.start(fresh, sink); t0 < num_tokens; t0 += block) {
      const int t1 = std::min(num_tokens, t0 + block);
      c.list_drops(t0, t1);
      c.redraw_block(t0, t1, sink);
    }
    c.finish();
  }

  void mix(const SyntheticWorld &world, const int *topics, const double *weights, std::size_t num_topics, int l,
           double *out) const {
    const auto ne = static_cast<std::size_t>(num_experts_);
    std::fill(out, out + ne, 0.0);
    for (std::size_t i = 0; i < num_topics; ++i) {
      const double *q =
          world.topic_prefs.data() +
          (static_cast<std::size_t>(topics[i]) * static_cast<std::size_t>(num_layers_) + static_cast<std::size_t>(l)) *
              ne;
      const double w = weights[i];
      for (std::size_t e = 0; e < ne; ++e)
        out[e] += w * q[e];
    }
  }

  /// An expert not in `bits` for which `allowed` holds, drawn by `probs` over those.
  template <class Allowed>
  int draw_exact(Xoshiro256 &rng, const double *probs, const std::uint64_t *bits, const Allowed &allowed) const {
    double rest = 0;
    for (int e = 0; e < num_experts_; ++e)
      if (!taken(bits, e) && allowed(e)) rest += probs[e];
    double u = rng.uniform() * rest;
    int last = -1;
    for (int e = 0; e < num_experts_; ++e) {
      if (taken(bits, e) || !allowed(e)) continue;
      last = e;
      if ((u -= probs[e]) < 0) return e;
    }
    return last; // rounding left u >= 0 at the end
  }

  int num_layers_, num_experts_;
  std::size_t tp_, k_;
  bool drops_;                                     ///< persistence below 1: slots drop their experts
  bool distinct_weights_;                          ///< responses have their own topic
  std::size_t block_tokens_;                       ///< tokens per block of coins
  bool limited_;                                   ///< group-limited routing (`SyntheticConfig::group_limited`)
  int max_groups_;                                 ///< `route_max_groups` when limited
  std::vector<std::uint16_t> group_of_;            ///< each expert's group (limited only)
  std::vector<std::int32_t> group_count_;          ///< a chain's slots per group (limited only)
  AliasTable mask_tables_[2];                      ///< drop masks of a full group of 8 slots and of the last group
  alignas(32) std::uint32_t slot_lists_[256][8]{}; ///< the set bits of each 8-bit mask, in order
  std::uint8_t slot_counts_[256]{};                ///< the number of set bits of each 8-bit mask
  std::vector<std::uint64_t> scratch_;             ///< bit set for the exact fallback
  Lane lanes_[2];                                  ///< a prompt's chain and its response's distribution
};

[[nodiscard]] inline int generator_threads(int requested) noexcept {
  if (requested > 0) return requested;
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

/// Reports tokens done to `progress` (if set) from any worker, serialised.
class ProgressMeter {
public:
  ProgressMeter(const std::function<void(std::int64_t, std::int64_t)> &fn, std::int64_t total)
      : fn_(fn), total_(total) {}
  void add(std::int64_t tokens) {
    if (!fn_ || tokens == 0) return;
    const std::lock_guard<std::mutex> lock(mutex_);
    done_ += tokens;
    fn_(done_, total_);
  }

private:
  const std::function<void(std::int64_t, std::int64_t)> &fn_;
  std::int64_t total_, done_ = 0;
  std::mutex mutex_;
};

/// Routes every (micro-step, rank) block of `plans` on its own worker's router: `sink(worker)` gives that
/// worker's sink, which sees `route(token_idx, layer_idx, ids)` for the tokens of its blocks. Blocks are
/// independent (every sequence's streams come from its own seeds), so the ids do not depend on the threads.
template <class SinkOf>
void route_synthetic(const SyntheticConfig &cfg, const std::vector<SyntheticStepPlan> &plans, int num_threads,
                     ProgressMeter &meter, SinkOf &&sink_of) {
  const SyntheticWorld world = make_world(cfg);
  struct Block {
    const SyntheticStepPlan *plan;
    std::size_t index;
    std::int64_t first_token;
  };
  std::vector<Block> blocks;
  std::int64_t token = 0;
  for (const SyntheticStepPlan &plan : plans)
    for (std::size_t b = 0; b + 1 < plan.block_offsets.size(); ++b) {
      blocks.push_back({&plan, b, token});
      for (std::int64_t i = plan.block_offsets[b]; i < plan.block_offsets[b + 1]; ++i) {
        const SyntheticSequence &seq =
            plan.sequences[static_cast<std::size_t>(plan.order[static_cast<std::size_t>(i)])];
        token += seq.prompt_tokens + seq.response_tokens;
      }
    }
  ThreadPool pool(static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(generator_threads(num_threads)),
                                                         std::max<std::size_t>(1, blocks.size()))));
  std::vector<SequenceRouter> routers(static_cast<std::size_t>(pool.num_threads()), SequenceRouter(cfg));
  pool.parallel_for(blocks.size(), [&](std::size_t t, int w) {
    const Block &blk = blocks[t];
    auto &&sink = sink_of(w);
    std::int64_t tok = blk.first_token;
    for (std::int64_t i = blk.plan->block_offsets[blk.index]; i < blk.plan->block_offsets[blk.index + 1]; ++i) {
      const int s = blk.plan->order[static_cast<std::size_t>(i)];
      routers[static_cast<std::size_t>(w)].route(world, *blk.plan, s, tok, sink);
      const SyntheticSequence &seq = blk.plan->sequences[static_cast<std::size_t>(s)];
      tok += seq.prompt_tokens + seq.response_tokens;
    }
    meter.add(tok - blk.first_token);
  });
}

/// Counts `plans` into `out` (`[micro_steps][L][E]`, optionally by source rank). Each prompt's part is counted
/// once (threads over prompts) and added to each of its responses' blocks, then the micro-steps are counted on
/// threads, a few ranks per task, each rank into its worker's rows and then added to the micro-step's: the loads do
/// not depend on the threads and equal the counts of the ids.
inline void count_synthetic(const SyntheticConfig &cfg, const std::vector<SyntheticStepPlan> &plans, int num_threads,
                            ProgressMeter &meter, LoadTensor &out, int ranks_per_source = 1) {
  const SyntheticWorld world = make_world(cfg);
  // One pool per call, reused by both phases of every step: the generator is a free function with no object to
  // keep threads in, and a call runs for milliseconds to seconds, so starting them once per call costs nothing.
  ThreadPool pool(generator_threads(num_threads));
  const int workers = pool.num_threads();
  const auto ne = static_cast<std::size_t>(cfg.num_experts);
  const auto nl = static_cast<std::size_t>(cfg.num_layers);
  struct Rows {
    std::vector<std::int64_t> block; ///< `[L][E]` counts of the current (micro-step, rank)
    std::int64_t *count_row(int layer_idx) { return block.data() + static_cast<std::size_t>(layer_idx) * ne_; }
    std::size_t ne_;
  };
  struct Worker {
    SequenceRouter router;
    Rows rows;
  };
  std::vector<Worker> ws(static_cast<std::size_t>(workers),
                         Worker{SequenceRouter(cfg), Rows{std::vector<std::int64_t>(nl * ne), ne}});
  struct PromptCounts {
    std::vector<std::pair<std::int32_t, std::int32_t>> counts;
    std::vector<std::int32_t> offsets;
    std::vector<std::int16_t> last;
  };
  const auto nr = static_cast<std::size_t>(cfg.responses_per_prompt);
  const auto ng = static_cast<std::size_t>(cfg.num_gpus);
  // Ranks per micro-step task: 4, so that a step's tasks outnumber the workers many times over.
  const std::size_t chunk = std::min<std::size_t>(ng, 4), chunks_per_micro = (ng + chunk - 1) / chunk;
  int micro_base = 0;
  for (const SyntheticStepPlan &plan : plans) {
    const std::size_t num_prompts = plan.sequences.size() / nr;
    std::vector<PromptCounts> prompts(num_prompts);
    // count_prompt needs zero rows and leaves them zero; the previous step's blocks do not.
    for (Worker &wk : ws)
      std::fill(wk.rows.block.begin(), wk.rows.block.end(), 0);
    pool.parallel_for(num_prompts, [&](std::size_t p, int w) {
      Worker &wk = ws[static_cast<std::size_t>(w)];
      PromptCounts &pc = prompts[p];
      wk.router.count_prompt(world, plan, static_cast<int>(p * nr), wk.rows, pc.counts, pc.offsets, pc.last);
    });
    // Tasks of `chunk` ranks of one micro-step (a step has only about 11 micro-steps, too few to keep the workers
    // evenly busy to the end), each counting rank by rank into its worker's rows and adding them to the micro-step's
    // rows under that micro-step's lock. Integer sums do not depend on the order, so neither do the loads.
    const std::size_t num_micro = static_cast<std::size_t>(plan.num_micro_steps);
    std::vector<std::mutex> micro_locks(num_micro);
    pool.parallel_for(num_micro * chunks_per_micro, [&](std::size_t task, int w) {
      Worker &wk = ws[static_cast<std::size_t>(w)];
      const std::size_t m = task / chunks_per_micro, first_rank = task % chunks_per_micro * chunk;
      const int micro = micro_base + static_cast<int>(m);
      std::int64_t tokens = 0;
      for (std::size_t r = first_rank; r < std::min(ng, first_rank + chunk); ++r) {
        const std::size_t b = m * ng + r;
        std::fill(wk.rows.block.begin(), wk.rows.block.end(), 0);
        for (std::int64_t i = plan.block_offsets[b]; i < plan.block_offsets[b + 1]; ++i) {
          const int s = plan.order[static_cast<std::size_t>(i)];
          const SyntheticSequence &seq = plan.sequences[static_cast<std::size_t>(s)];
          const PromptCounts &pc = prompts[static_cast<std::size_t>(seq.prompt_idx)];
          for (std::size_t l = 0; l < nl; ++l) {
            std::int64_t *row = wk.rows.block.data() + l * ne;
            for (auto c = static_cast<std::size_t>(pc.offsets[l]); c < static_cast<std::size_t>(pc.offsets[l + 1]); ++c)
              row[pc.counts[c].first] += pc.counts[c].second;
          }
          wk.router.count_response(world, plan, s, pc.last.data(), wk.rows);
          tokens += seq.prompt_tokens + seq.response_tokens;
        }
        const std::lock_guard<std::mutex> lock(micro_locks[m]);
        for (std::size_t l = 0; l < nl; ++l) {
          const std::int64_t *row = wk.rows.block.data() + l * ne;
          auto tot = out.layer(micro, static_cast<int>(l));
          for (std::size_t e = 0; e < ne; ++e)
            tot[e] += row[e];
          if (out.has_sources()) {
            auto src = out.layer_by_source(micro, static_cast<int>(l));
            const auto ns = static_cast<std::size_t>(out.num_sources());
            for (std::size_t e = 0; e < ne; ++e)
              src[e * ns + r / static_cast<std::size_t>(ranks_per_source)] += row[e];
          }
        }
      }
      meter.add(tokens);
    });
    micro_base += plan.num_micro_steps;
  }
}

/// Per-sequence expert histograms of a step, `[S][L][E]` (prompt-major, as `plan.sequences`): the counts of the
/// ids `route` gives each sequence. Threads over prompts; each prompt's part is counted once.
inline std::vector<std::int64_t> sequence_histograms(const SyntheticConfig &cfg, const SyntheticWorld &world,
                                                     const SyntheticStepPlan &plan, ThreadPool &pool) {
  const auto ne = static_cast<std::size_t>(cfg.num_experts), nl = static_cast<std::size_t>(cfg.num_layers);
  const auto nr = static_cast<std::size_t>(cfg.responses_per_prompt);
  const std::size_t cells = nl * ne, num_seqs = plan.sequences.size();
  require(static_cast<double>(num_seqs) * static_cast<double>(cells) <= static_cast<double>(limits::max_load_cells),
          "packing a step of ", num_seqs, " sequences x ", nl, " layers x ", ne,
          " experts needs that many histogram cells, more than ", limits::limit_text(limits::max_load_cells));
  std::vector<std::int64_t> hist(num_seqs * cells, 0);
  struct Rows {
    std::int64_t *base;
    std::size_t ne;
    std::int64_t *count_row(int layer_idx) const { return base + static_cast<std::size_t>(layer_idx) * ne; }
  };
  struct Worker {
    SequenceRouter router;
    std::vector<std::pair<std::int32_t, std::int32_t>> counts;
    std::vector<std::int32_t> offsets;
    std::vector<std::int16_t> last;
    std::vector<std::int64_t> scratch;
  };
  std::vector<Worker> ws(static_cast<std::size_t>(pool.num_threads()),
                         Worker{SequenceRouter(cfg), {}, {}, {}, std::vector<std::int64_t>(cells, 0)});
  pool.parallel_for(num_seqs / nr, [&](std::size_t p, int w) {
    Worker &wk = ws[static_cast<std::size_t>(w)];
    Rows scratch{wk.scratch.data(), ne}; // count_prompt leaves its rows zero
    wk.router.count_prompt(world, plan, static_cast<int>(p * nr), scratch, wk.counts, wk.offsets, wk.last);
    for (std::size_t j = 0; j < nr; ++j) {
      const std::size_t s = p * nr + j;
      Rows rows{hist.data() + s * cells, ne};
      for (std::size_t l = 0; l < nl; ++l)
        for (auto c = static_cast<std::size_t>(wk.offsets[l]); c < static_cast<std::size_t>(wk.offsets[l + 1]); ++c)
          rows.count_row(static_cast<int>(l))[wk.counts[c].first] += wk.counts[c].second;
      wk.router.count_response(world, plan, static_cast<int>(s), wk.last.data(), rows);
    }
  });
  return hist;
}

/// Re-packs `plan` (the trainer's layout) by `cfg.packing`: the same micro-steps and ranks, every micro-batch within
/// the budget (raised to the step's longest sequence), each group of `cfg.packing_ranks` ranks re-packing the
/// sequences the trainer dealt it, the sequences of a micro-batch in index order.
inline void repack_step(const SyntheticConfig &cfg, const SyntheticWorld &world, SyntheticStepPlan &plan, int step_idx,
                        ThreadPool &pool) {
  const std::size_t num_seqs = plan.sequences.size();
  const auto ng = static_cast<std::size_t>(cfg.num_gpus);
  const std::size_t group = cfg.packing_ranks > 0 ? static_cast<std::size_t>(cfg.packing_ranks) : ng;
  const std::size_t cells = static_cast<std::size_t>(cfg.num_layers) * static_cast<std::size_t>(cfg.num_experts);
  std::vector<std::int64_t> lengths(num_seqs);
  for (std::size_t s = 0; s < num_seqs; ++s)
    lengths[s] = plan.sequences[s].prompt_tokens + plan.sequences[s].response_tokens;
  const PackingShape shape{plan.num_micro_steps, static_cast<std::int64_t>(group),
                           std::max(cfg.microbatch_tokens_per_gpu, *std::max_element(lengths.begin(), lengths.end()))};
  // The trainer's layout, by group: the group's sequences (ascending) and their micro-steps and ranks in it.
  std::vector<std::size_t> micro_of(num_seqs), rank_of(num_seqs);
  for (std::size_t b = 0; b + 1 < plan.block_offsets.size(); ++b)
    for (std::int64_t i = plan.block_offsets[b]; i < plan.block_offsets[b + 1]; ++i) {
      const auto s = static_cast<std::size_t>(plan.order[static_cast<std::size_t>(i)]);
      micro_of[s] = b / ng;
      rank_of[s] = b % ng;
    }
  const std::vector<std::int64_t> hist =
      cfg.packing == BatchPacking::routing ? sequence_histograms(cfg, world, plan, pool) : std::vector<std::int64_t>{};
  std::vector<std::vector<std::size_t>> by_group(ng / group); // each group's sequences, ascending
  for (std::size_t s = 0; s < num_seqs; ++s)
    by_group[rank_of[s] / group].push_back(s);
  std::vector<std::vector<int>> blocks(static_cast<std::size_t>(plan.num_micro_steps) * ng);
  for (std::size_t g0 = 0; g0 < ng; g0 += group) {
    const std::vector<std::size_t> &seqs = by_group[g0 / group];
    std::vector<std::int64_t> len(seqs.size());
    Packing trainer;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      len[i] = lengths[seqs[i]];
      trainer.micro_step.push_back(static_cast<std::int32_t>(micro_of[seqs[i]]));
      trainer.rank.push_back(static_cast<std::int32_t>(rank_of[seqs[i]] - g0));
    }
    Packing packed;
    try {
      if (cfg.packing == BatchPacking::tokens) {
        packed = pack_by_tokens(len, shape);
      } else if (group == ng) {
        packed = pack_by_routing(PackingInput{cfg.num_layers, cfg.num_experts, len, hist}, shape, {}, trainer);
      } else {
        std::vector<std::int64_t> h(seqs.size() * cells);
        for (std::size_t i = 0; i < seqs.size(); ++i)
          std::copy_n(hist.begin() + static_cast<std::ptrdiff_t>(seqs[i] * cells), cells,
                      h.begin() + static_cast<std::ptrdiff_t>(i * cells));
        packed = pack_by_routing(PackingInput{cfg.num_layers, cfg.num_experts, len, h}, shape, {}, trainer);
      }
    } catch (const Error &e) {
      throw Error(std::string("SyntheticConfig: packing step ") + std::to_string(step_idx) + " (ranks " +
                  std::to_string(g0) + ".." + std::to_string(g0 + group - 1) + ") into the trainer's " +
                  std::to_string(plan.num_micro_steps) + " micro-steps: " + e.what());
    }
    for (std::size_t i = 0; i < seqs.size(); ++i)
      blocks[static_cast<std::size_t>(packed.micro_step[i]) * ng + g0 + static_cast<std::size_t>(packed.rank[i])]
          .push_back(static_cast<int>(seqs[i]));
  }
  plan.order.clear();
  plan.block_offsets.assign(1, 0);
  for (const std::vector<int> &blk : blocks) {
    plan.order.insert(plan.order.end(), blk.begin(), blk.end());
    plan.block_offsets.push_back(static_cast<std::int64_t>(plan.order.size()));
  }
}

/// The steps' layouts, re-packed by `cfg.packing` (which routes every sequence once more to count it).
inline std::vector<SyntheticStepPlan> plan_steps(const SyntheticConfig &cfg, std::vector<std::int64_t> &step_offsets,
                                                 std::int64_t &num_tokens, int num_threads = 0) {
  std::vector<SyntheticStepPlan> plans;
  plans.reserve(static_cast<std::size_t>(cfg.num_steps));
  step_offsets.assign(1, 0);
  num_tokens = 0;
  std::optional<ThreadPool> pool;
  std::optional<SyntheticWorld> world;
  if (cfg.packing != BatchPacking::none) {
    pool.emplace(generator_threads(num_threads));
    world.emplace(make_world(cfg));
  }
  for (int s = 0; s < cfg.num_steps; ++s) {
    plans.push_back(plan_step(cfg, s));
    if (cfg.packing != BatchPacking::none) repack_step(cfg, *world, plans.back(), s, *pool);
    step_offsets.push_back(step_offsets.back() + plans.back().num_micro_steps);
    for (const SyntheticSequence &seq : plans.back().sequences)
      num_tokens += seq.prompt_tokens + seq.response_tokens;
  }
  require(step_offsets.back() <= std::numeric_limits<int>::max(), "synthetic trace: ", step_offsets.back(),
          " micro-steps exceed the int range");
  return plans;
}

} // namespace detail

/// Materialises the routed ids (`num_tokens * num_layers * topk` int16 values: meant for small configs; use
/// `generate_loads` for large ones). Throws `Error` for an invalid config or one above 2^31 ids.
[[nodiscard]] inline SyntheticTrace generate_trace(const SyntheticConfig &cfg, const GeneratorOptions &opts = {}) {
  cfg.validate();
  SyntheticTrace out;
  const auto plans = detail::plan_steps(cfg, out.step_offsets, out.num_tokens, opts.num_threads);
  const double num_ids = static_cast<double>(out.num_tokens) * cfg.num_layers * cfg.topk;
  detail::require(num_ids <= static_cast<double>(std::int64_t{1} << 31), "generate_trace: ", out.num_tokens,
                  " tokens x ", cfg.num_layers, " layers x top-", cfg.topk,
                  " exceed 2^31 routed ids; use generate_loads, which does not store them");
  out.num_layers = cfg.num_layers;
  out.topk = cfg.topk;
  out.num_experts = cfg.num_experts;
  out.routed_ids.resize(static_cast<std::size_t>(num_ids));

  // Boundaries come from the plans alone, so they cannot drift from the routing order.
  std::int64_t token = 0;
  out.sequence_offsets.push_back(0);
  for (const auto &plan : plans) {
    for (int m = 0; m < plan.num_micro_steps; ++m) {
      out.microbatch_offsets.push_back(token);
      for (int r = 0; r < cfg.num_gpus; ++r) {
        const std::size_t b =
            static_cast<std::size_t>(m) * static_cast<std::size_t>(cfg.num_gpus) + static_cast<std::size_t>(r);
        out.source_offsets.push_back(token);
        for (std::int64_t i = plan.block_offsets[b]; i < plan.block_offsets[b + 1]; ++i) {
          const auto &seq = plan.sequences[static_cast<std::size_t>(plan.order[static_cast<std::size_t>(i)])];
          token += seq.prompt_tokens + seq.response_tokens;
          out.sequence_offsets.push_back(token);
        }
      }
    }
  }
  out.microbatch_offsets.push_back(token);
  out.source_offsets.push_back(token);
  struct Routes {
    SyntheticTrace &trace;
    void route(std::int64_t token_idx, int layer_idx, const std::int16_t *ids) {
      const std::size_t k = static_cast<std::size_t>(trace.topk);
      std::copy(ids, ids + k,
                trace.routed_ids.data() +
                    (static_cast<std::size_t>(token_idx) * static_cast<std::size_t>(trace.num_layers) +
                     static_cast<std::size_t>(layer_idx)) *
                        k);
    }
  } routes{out};
  detail::ProgressMeter meter(opts.progress, out.num_tokens);
  detail::route_synthetic(cfg, plans, opts.num_threads, meter, [&](int) -> Routes & { return routes; });
  return out;
}

/// Streams the same tokens as `generate_trace(cfg)` and counts them into `[micro_steps][num_layers][num_experts]`
/// loads without storing ids; with `by_source` also `[...][num_gpus / opts.ranks_per_source]` by source rank (or
/// group of consecutive ranks). `step_offsets`, if given,
/// receives the `[num_steps + 1]` micro-step offsets of the steps. Throws `Error` for an invalid config.
[[nodiscard]] inline LoadTensor generate_loads(const SyntheticConfig &cfg,
                                               std::vector<std::int64_t> *step_offsets = nullptr,
                                               bool by_source = false, const GeneratorOptions &opts = {}) {
  cfg.validate();
  std::vector<std::int64_t> steps;
  std::int64_t num_tokens = 0;
  const auto plans = detail::plan_steps(cfg, steps, num_tokens, opts.num_threads);
  detail::require(opts.ranks_per_source >= 1 && cfg.num_gpus % opts.ranks_per_source == 0,
                  "generate_loads: ranks_per_source ", opts.ranks_per_source, " does not divide ", cfg.num_gpus,
                  " ranks");
  LoadTensor out(static_cast<int>(steps.back()), cfg.num_layers, cfg.num_experts,
                 by_source ? cfg.num_gpus / opts.ranks_per_source : 0);
  detail::ProgressMeter meter(opts.progress, num_tokens);
  detail::count_synthetic(cfg, plans, opts.num_threads, meter, out, opts.ranks_per_source);
  if (step_offsets != nullptr) *step_offsets = std::move(steps);
  return out;
}

/// The routed ids of a synthetic batch one micro-step at a time: micro-step `m`'s tokens of `generate_trace(cfg)`,
/// the same ids in the same order, without materialising the batch (the simulator counts each micro-step's
/// all-to-all from them, `SimConfig::a2a_hits`). Routing a micro-step costs what generating its tokens costs.
class SyntheticMicroSteps {
public:
  /// Plans the batch's steps (sequences, packing); throws `Error` for an invalid config.
  explicit SyntheticMicroSteps(const SyntheticConfig &cfg, int num_threads = 0) : cfg_(cfg), threads_(num_threads) {
    cfg_.validate();
    std::int64_t tokens = 0;
    plans_ = detail::plan_steps(cfg_, step_offsets_, tokens, num_threads);
  }

  [[nodiscard]] int num_micro_steps() const noexcept { return static_cast<int>(step_offsets_.back()); }
  /// `[num_steps + 1]` micro-step offsets of the steps (as `generate_loads` gives them).
  [[nodiscard]] const std::vector<std::int64_t> &step_offsets() const noexcept { return step_offsets_; }

  /// Micro-step `m`'s ids, layer-major `[num_layers][tokens][topk]` (each layer's ids contiguous, as a layer at a
  /// time reads them), and `[num_gpus + 1]` token offsets of its ranks. Throws
  /// `Error` for `m` outside `[0, num_micro_steps())` or more than 2^31 ids.
  void route(int m, std::vector<std::int16_t> &ids, std::vector<std::int64_t> &source_offsets) const {
    detail::require(m >= 0 && m < num_micro_steps(), "SyntheticMicroSteps: micro-step ", m, " outside [0, ",
                    num_micro_steps(), ")");
    const auto step = static_cast<std::size_t>(
        std::upper_bound(step_offsets_.begin(), step_offsets_.end(), static_cast<std::int64_t>(m)) -
        step_offsets_.begin() - 1);
    const detail::SyntheticStepPlan &plan = plans_[step];
    const auto ng = static_cast<std::size_t>(cfg_.num_gpus);
    const auto first = static_cast<std::size_t>(m - step_offsets_[step]) * ng;
    // The step's layout with only this micro-step's blocks (one per rank).
    std::vector<detail::SyntheticStepPlan> one{plan};
    one[0].block_offsets.assign(plan.block_offsets.begin() + static_cast<std::ptrdiff_t>(first),
                                plan.block_offsets.begin() + static_cast<std::ptrdiff_t>(first + ng + 1));
    source_offsets.assign(1, 0);
    for (std::size_t r = 0; r < ng; ++r) {
      std::int64_t t = source_offsets.back();
      for (std::int64_t i = one[0].block_offsets[r]; i < one[0].block_offsets[r + 1]; ++i) {
        const detail::SyntheticSequence &seq =
            plan.sequences[static_cast<std::size_t>(plan.order[static_cast<std::size_t>(i)])];
        t += seq.prompt_tokens + seq.response_tokens;
      }
      source_offsets.push_back(t);
    }
    const double num_ids = static_cast<double>(source_offsets.back()) * cfg_.num_layers * cfg_.topk;
    detail::require(num_ids <= static_cast<double>(std::int64_t{1} << 31), "SyntheticMicroSteps: micro-step ", m,
                    " has ", source_offsets.back(), " tokens x ", cfg_.num_layers, " layers x top-", cfg_.topk,
                    ", more than 2^31 routed ids");
    ids.assign(static_cast<std::size_t>(num_ids), std::int16_t{0});
    struct Routes {
      std::vector<std::int16_t> &ids;
      std::size_t tokens, k;
      void route(std::int64_t token_idx, int layer_idx, const std::int16_t *row) {
        std::copy(row, row + k,
                  ids.data() +
                      (static_cast<std::size_t>(layer_idx) * tokens + static_cast<std::size_t>(token_idx)) * k);
      }
    } routes{ids, static_cast<std::size_t>(source_offsets.back()), static_cast<std::size_t>(cfg_.topk)};
    const std::function<void(std::int64_t, std::int64_t)> none;
    detail::ProgressMeter meter(none, source_offsets.back());
    detail::route_synthetic(cfg_, one, threads_, meter, [&](int) -> Routes & { return routes; });
  }

private:
  SyntheticConfig cfg_;
  int threads_ = 0;
  std::vector<detail::SyntheticStepPlan> plans_;
  std::vector<std::int64_t> step_offsets_;
};

} // namespace v0
} // namespace foremoe
