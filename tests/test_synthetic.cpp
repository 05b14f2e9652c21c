// Synthetic RL traces (trace/synthetic.hpp) and trace statistics (trace/stats.hpp).

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "foremoe/trace/npy.hpp"
#include "foremoe/trace/stats.hpp"
#include "foremoe/trace/synthetic.hpp"
#include "test_support.hpp"

using namespace foremoe;

namespace {

/// A small random config that still exercises every feature: long sequences past the budget, idle ranks,
/// topk == num_experts, no or full persistence, strongly concentrated topics.
SyntheticConfig random_config(std::uint64_t seed) {
  detail::Xoshiro256 rng(seed);
  auto pick = [&](int lo, int hi) { return lo + static_cast<int>(rng.below(static_cast<std::uint64_t>(hi - lo) + 1)); };
  SyntheticConfig c;
  c.seed = rng.next();
  c.num_layers = pick(1, 4);
  c.num_experts = pick(2, 40);
  c.topk = pick(1, std::min(9, c.num_experts));
  if (rng.below(5) == 0) c.topk = c.num_experts;
  c.num_steps = pick(1, 3);
  c.prompts_per_step = pick(1, 6);
  c.responses_per_prompt = pick(1, 4);
  c.prompt_length = {10.0 + 60.0 * rng.uniform(), 0.8 * rng.uniform(), pick(1, 5), pick(5, 150)};
  c.response_length = {10.0 + 90.0 * rng.uniform(), 1.2 * rng.uniform(), pick(1, 5), pick(5, 250)};
  c.num_topics = pick(1, 6);
  c.topics_per_prompt = pick(1, std::min(3, c.num_topics));
  c.topic_concentration = 0.02 + 2.0 * rng.uniform();
  c.topic_mix_concentration = 0.2 + 2.0 * rng.uniform();
  c.response_topic_weight = rng.below(4) == 0 ? 0.0 : rng.uniform();
  c.popularity = rng.below(2) == 0 ? PopularityModel::lognormal : PopularityModel::zipf;
  c.skew = 1.5 * rng.uniform();
  c.skew_layer_sigma = 0.5 * rng.uniform();
  const double persistence[] = {0.0, 0.3, 0.6, 0.9, 1.0};
  c.persistence = persistence[rng.below(5)];
  c.num_gpus = pick(1, 5);
  c.microbatch_tokens_per_gpu = pick(30, 400);
  return c;
}

/// One RL step of `prompts` x `responses` sequences on the given MoE shape; the rest defaults.
SyntheticConfig one_step(int layers, int experts, int topk, int prompts, int responses) {
  SyntheticConfig c;
  c.num_layers = layers;
  c.num_experts = experts;
  c.topk = topk;
  c.num_steps = 1;
  c.prompts_per_step = prompts;
  c.responses_per_prompt = responses;
  return c;
}

int num_seeds(int base) { return base * foremoe_test::seed_multiplier(); }

std::int16_t id_at(const SyntheticTrace &t, std::int64_t token, int layer, int k) {
  return t.routed_ids[(static_cast<std::size_t>(token) * static_cast<std::size_t>(t.num_layers) +
                       static_cast<std::size_t>(layer)) *
                          static_cast<std::size_t>(t.topk) +
                      static_cast<std::size_t>(k)];
}

/// Counts the ids token by token, the obvious way.
LoadTensor naive_count(const SyntheticTrace &t, int num_gpus, bool by_source) {
  const int num_micro = static_cast<int>(t.microbatch_offsets.size()) - 1;
  LoadTensor out(num_micro, t.num_layers, t.num_experts, by_source ? num_gpus : 0);
  for (int m = 0; m < num_micro; ++m)
    for (int r = 0; r < num_gpus; ++r) {
      const std::size_t b =
          static_cast<std::size_t>(m) * static_cast<std::size_t>(num_gpus) + static_cast<std::size_t>(r);
      for (std::int64_t tok = t.source_offsets[b]; tok < t.source_offsets[b + 1]; ++tok)
        for (int l = 0; l < t.num_layers; ++l)
          for (int k = 0; k < t.topk; ++k) {
            const int e = id_at(t, tok, l, k);
            ++out.at(m, l, e);
            if (by_source) ++out.at(m, l, e, r);
          }
    }
  return out;
}

std::string describe(const SyntheticConfig &c) {
  std::ostringstream os;
  os << "seed " << c.seed << " L " << c.num_layers << " E " << c.num_experts << " k " << c.topk << " steps "
     << c.num_steps << " P " << c.prompts_per_step << " R " << c.responses_per_prompt << " G " << c.num_gpus
     << " budget " << c.microbatch_tokens_per_gpu << " persistence " << c.persistence;
  return os.str();
}

/// FNV-1a 64 over the little-endian bytes of `values` (the shape and the values), for pinning a stream.
template <class T> std::uint64_t fnv1a(std::span<const T> values, std::uint64_t h = 0xcbf29ce484222325ULL) {
  for (const T v : values) {
    auto u = static_cast<std::uint64_t>(static_cast<std::int64_t>(v));
    for (std::size_t b = 0; b < sizeof(T); ++b, u >>= 8)
      h = (h ^ (u & 0xFFu)) * 0x100000001b3ULL;
  }
  return h;
}

std::uint64_t fingerprint(const LoadTensor &t) {
  const std::int64_t shape[] = {t.num_micro_steps(), t.num_layers(), t.num_experts(), t.num_sources()};
  std::uint64_t h = fnv1a(std::span<const std::int64_t>(shape));
  h = fnv1a(t.totals(), h);
  return fnv1a(t.by_source(), h);
}

std::string error_of(const std::function<void()> &f) {
  try {
    f();
  } catch (const Error &e) {
    return e.what();
  }
  return "(no error)";
}

} // namespace

TEST_CASE("synthetic: samplers are deterministic and have the right moments") {
  detail::Xoshiro256 a(42), b(42), c(43);
  for (int i = 0; i < 100; ++i)
    CHECK(a.next() == b.next());
  CHECK(a.next() != c.next());

  detail::Xoshiro256 rng(7);
  const int n = 200000;
  double sum = 0, sum2 = 0, gsum = 0, gsmall = 0, lsum = 0;
  for (int i = 0; i < n; ++i) {
    const double x = detail::sample_normal(rng);
    sum += x;
    sum2 += x * x;
    gsum += detail::sample_gamma(rng, 3.5);
    gsmall += detail::sample_gamma(rng, 0.2);
    lsum += detail::sample_lognormal(rng, 100.0, 0.7);
  }
  CHECK(std::fabs(sum / n) < 0.01);
  CHECK(std::fabs(sum2 / n - 1.0) < 0.02);
  CHECK(gsum / n == doctest::Approx(3.5).epsilon(0.02));
  CHECK(gsmall / n == doctest::Approx(0.2).epsilon(0.03));
  CHECK(lsum / n == doctest::Approx(100.0).epsilon(0.02));

  std::vector<std::uint64_t> hist(7, 0);
  for (int i = 0; i < 70000; ++i)
    ++hist[rng.below(7)];
  for (auto h : hist)
    CHECK(std::fabs(static_cast<double>(h) - 10000.0) < 500.0);

  const double alpha[] = {0.1, 1.0, 5.0};
  double out[3], mean[3] = {0, 0, 0};
  for (int i = 0; i < 20000; ++i) {
    detail::sample_dirichlet(rng, alpha, out, 3);
    CHECK(out[0] + out[1] + out[2] == doctest::Approx(1.0));
    for (int j = 0; j < 3; ++j)
      mean[j] += out[j] / 20000;
  }
  CHECK(mean[0] == doctest::Approx(0.1 / 6.1).epsilon(0.1));
  CHECK(mean[2] == doctest::Approx(5.0 / 6.1).epsilon(0.02));

  // Alias table draws follow the weights.
  const double w[] = {1.0, 0.0, 3.0, 6.0};
  detail::AliasTable table;
  table.build(w, 4);
  std::vector<int> counts(4, 0);
  for (int i = 0; i < 100000; ++i)
    ++counts[static_cast<std::size_t>(table.sample(rng))];
  CHECK(counts[1] == 0);
  CHECK(counts[0] == doctest::Approx(10000).epsilon(0.05));
  CHECK(counts[3] == doctest::Approx(60000).epsilon(0.02));
}

TEST_CASE("synthetic: same seed gives the same trace, another seed another") {
  SyntheticConfig c = random_config(1);
  c.num_experts = 16;
  c.topk = 4;
  c.prompts_per_step = 4;
  const SyntheticTrace a = generate_trace(c), b = generate_trace(c);
  CHECK(a.routed_ids == b.routed_ids);
  CHECK(a.microbatch_offsets == b.microbatch_offsets);
  CHECK(a.source_offsets == b.source_offsets);
  CHECK(a.sequence_offsets == b.sequence_offsets);
  CHECK(generate_loads(c) == generate_loads(c));
  SyntheticConfig d = c;
  d.seed += 1;
  const SyntheticTrace other = generate_trace(d);
  CHECK((other.routed_ids != a.routed_ids || other.sequence_offsets != a.sequence_offsets));
  CHECK(!(generate_loads(d) == generate_loads(c)));
}

TEST_CASE("synthetic: generate_loads counts exactly the tokens of generate_trace") {
  for (int i = 0; i < num_seeds(12); ++i) {
    const SyntheticConfig c = random_config(1000 + static_cast<std::uint64_t>(i));
    INFO(describe(c));
    const SyntheticTrace t = generate_trace(c);
    std::vector<std::int64_t> steps;
    const LoadTensor loads = generate_loads(c, &steps, false);
    CHECK(steps == t.step_offsets);
    CHECK(loads == naive_count(t, c.num_gpus, false));
    const LoadTensor by_src = generate_loads(c, nullptr, true);
    CHECK(by_src.num_sources() == c.num_gpus);
    CHECK_NOTHROW(by_src.validate()); // totals are the sums over sources
    CHECK(by_src == naive_count(t, c.num_gpus, true));
    CHECK(std::equal(by_src.totals().begin(), by_src.totals().end(), loads.totals().begin(), loads.totals().end()));
  }
}

TEST_CASE("synthetic: the output does not depend on the thread count, and progress reaches every token") {
  for (int i = 0; i < num_seeds(8); ++i) {
    const SyntheticConfig c = random_config(1500 + static_cast<std::uint64_t>(i));
    INFO(describe(c));
    GeneratorOptions one, many;
    one.num_threads = 1;
    many.num_threads = 2 + i % 4;
    std::int64_t last_done = -1, last_total = -1;
    bool monotone = true;
    many.progress = [&](std::int64_t done, std::int64_t total) {
      monotone = monotone && done > last_done && done <= total;
      last_done = done;
      last_total = total;
    };
    const SyntheticTrace a = generate_trace(c, one), b = generate_trace(c, many);
    CHECK(a.routed_ids == b.routed_ids);
    CHECK(a.sequence_offsets == b.sequence_offsets);
    CHECK(monotone);
    CHECK(last_done == a.num_tokens);
    CHECK(last_total == a.num_tokens);
    const bool by_source = i % 2 == 1;
    CHECK(generate_loads(c, nullptr, by_source, one) == generate_loads(c, nullptr, by_source, many));
    CHECK(last_done == a.num_tokens);
  }
}

TEST_CASE("synthetic: every token routes to topk distinct experts in range") {
  for (int i = 0; i < num_seeds(12); ++i) {
    SyntheticConfig c = random_config(2000 + static_cast<std::uint64_t>(i));
    if (i % 3 == 0) { // nearly all mass on a few experts: forces the exact fallback
      c.topic_concentration = 0.01;
      c.skew = 3.0;
      c.topk = std::max(1, c.num_experts - 1);
    }
    INFO(describe(c));
    const SyntheticTrace t = generate_trace(c);
    REQUIRE(t.routed_ids.size() == static_cast<std::size_t>(t.num_tokens) * static_cast<std::size_t>(c.num_layers) *
                                       static_cast<std::size_t>(c.topk));
    bool ok = true;
    std::vector<char> seen(static_cast<std::size_t>(c.num_experts));
    for (std::int64_t tok = 0; tok < t.num_tokens && ok; ++tok)
      for (int l = 0; l < c.num_layers && ok; ++l) {
        std::fill(seen.begin(), seen.end(), 0);
        for (int k = 0; k < c.topk; ++k) {
          const int e = id_at(t, tok, l, k);
          if (e < 0 || e >= c.num_experts || seen[static_cast<std::size_t>(e)]) {
            ok = false;
            FAIL_CHECK("token ", tok, " layer ", l, ": bad or repeated expert ", e);
            break;
          }
          seen[static_cast<std::size_t>(e)] = 1;
        }
      }
    CHECK(ok);
  }
}

namespace {

/// Gives `c` a random group limit that it can satisfy: groups dividing the experts, a limit below them.
/// Returns false when no limit fits (no divisor above 1 whose groups can hold topk).
bool add_group_limit(SyntheticConfig &c, detail::Xoshiro256 &rng) {
  std::vector<std::pair<int, int>> options; // (groups, max groups)
  for (int g = 2; g <= c.num_experts; ++g)
    if (c.num_experts % g == 0)
      for (int m = 1; m < g; ++m)
        if ((c.num_experts / g) * m >= c.topk) options.emplace_back(g, m);
  if (options.empty()) return false;
  const auto [g, m] = options[rng.below(options.size())];
  c.route_groups = g;
  c.route_max_groups = m;
  return true;
}

} // namespace

TEST_CASE("synthetic: group-limited routing keeps every token within route_max_groups groups") {
  int limited = 0, spans_at_limit = 0;
  for (int i = 0; i < num_seeds(40); ++i) {
    detail::Xoshiro256 rng(9100 + static_cast<std::uint64_t>(i));
    SyntheticConfig c = random_config(9000 + static_cast<std::uint64_t>(i));
    if (c.topk == c.num_experts) c.topk = std::max(1, c.num_experts / 2);
    if (i % 4 == 0) { // nearly all mass on a few experts: forces the exact fallback
      c.topic_concentration = 0.01;
      c.skew = 3.0;
    }
    if (!add_group_limit(c, rng)) continue;
    ++limited;
    INFO(describe(c), " route_groups=", c.route_groups, " route_max_groups=", c.route_max_groups);
    REQUIRE(c.group_limited());
    const SyntheticTrace t = generate_trace(c);
    const int per_group = c.num_experts / c.route_groups;
    bool ok = true;
    std::vector<char> seen(static_cast<std::size_t>(c.num_experts)),
        group_seen(static_cast<std::size_t>(c.route_groups));
    for (std::int64_t tok = 0; tok < t.num_tokens && ok; ++tok)
      for (int l = 0; l < c.num_layers && ok; ++l) {
        std::fill(seen.begin(), seen.end(), 0);
        std::fill(group_seen.begin(), group_seen.end(), 0);
        int groups = 0;
        for (int k = 0; k < c.topk; ++k) {
          const int e = id_at(t, tok, l, k);
          if (e < 0 || e >= c.num_experts || seen[static_cast<std::size_t>(e)]) {
            ok = false;
            FAIL_CHECK("token ", tok, " layer ", l, ": bad or repeated expert ", e);
            break;
          }
          seen[static_cast<std::size_t>(e)] = 1;
          char &g = group_seen[static_cast<std::size_t>(e / per_group)];
          groups += g == 0 ? 1 : 0;
          g = 1;
        }
        if (ok && groups > c.route_max_groups) {
          ok = false;
          FAIL_CHECK("token ", tok, " layer ", l, ": ", groups, " groups, more than ", c.route_max_groups);
        }
        spans_at_limit += groups == c.route_max_groups ? 1 : 0;
      }
    CHECK(ok);
    // The counting path (run-length, prompts counted once) follows the same chains.
    CHECK(generate_loads(c, nullptr, true) == naive_count(t, c.num_gpus, true));
  }
  CHECK(limited >= num_seeds(40) / 2);
  CHECK(spans_at_limit > 0); // the limit binds somewhere
}

TEST_CASE("synthetic: without a group limit the ids are those of the unlimited generator") {
  for (int i = 0; i < num_seeds(16); ++i) {
    const SyntheticConfig base = random_config(9500 + static_cast<std::uint64_t>(i));
    INFO(describe(base));
    const SyntheticTrace t0 = generate_trace(base);
    std::vector<int> divisors;
    for (int g = 1; g <= base.num_experts; ++g)
      if (base.num_experts % g == 0) divisors.push_back(g);
    detail::Xoshiro256 rng(9600 + static_cast<std::uint64_t>(i));
    const int g = divisors[rng.below(divisors.size())];
    for (const int m : {0, g, g + 3, 1 + static_cast<int>(rng.below(static_cast<std::uint64_t>(g)))}) {
      SyntheticConfig c = base;
      c.route_groups = g;
      c.route_max_groups = m;
      if (g > 1 && m > 0 && m < g) continue; // a real limit
      INFO("route_groups=", c.route_groups, " route_max_groups=", c.route_max_groups);
      CHECK_FALSE(c.group_limited());
      CHECK(generate_trace(c).routed_ids == t0.routed_ids);
    }
  }
  // The default model has no limit.
  CHECK_FALSE(SyntheticConfig{}.group_limited());
}

TEST_CASE("synthetic: without co-activation the ids are those of the generator before it") {
  // coactivation 0 draws nothing from its streams, whatever the cluster count: the ids of the default config.
  for (int i = 0; i < num_seeds(16); ++i) {
    const SyntheticConfig base = random_config(9700 + static_cast<std::uint64_t>(i));
    INFO(describe(base));
    CHECK(base.coactivation == 0.0); // the default
    const SyntheticTrace t0 = generate_trace(base);
    detail::Xoshiro256 rng(9800 + static_cast<std::uint64_t>(i));
    SyntheticConfig c = base;
    c.coactivation_clusters = static_cast<int>(rng.below(static_cast<std::uint64_t>(base.num_experts) + 1));
    INFO("coactivation_clusters=", c.coactivation_clusters);
    CHECK(generate_trace(c).routed_ids == t0.routed_ids);
    // ... and co-activation on changes them (when anything can change: more than top-k experts).
    c.coactivation = 0.9;
    if (base.topk < base.num_experts && c.coactivation_cluster_count() > 1)
      CHECK(generate_trace(c).routed_ids != t0.routed_ids);
  }
}

/// Per layer, the co-activation of expert pairs in one cluster against pairs in different clusters of `cfg`'s
/// partition: the mean over pairs of (tokens routing both) / (expected under independence, load_a * load_b / T).
struct PairLift {
  double within = 0, across = 0;
};
PairLift pair_lift(const SyntheticConfig &cfg, const SyntheticTrace &t, const SyntheticConfig &clusters_of) {
  const auto ne = static_cast<std::size_t>(cfg.num_experts), k = static_cast<std::size_t>(cfg.topk);
  double within = 0, across = 0;
  std::int64_t n_within = 0, n_across = 0;
  for (int l = 0; l < cfg.num_layers; ++l) {
    const std::vector<int> cl = detail::coactivation_clusters_of_layer(clusters_of, l);
    std::vector<double> load(ne, 0.0), pair(ne * ne, 0.0);
    for (std::int64_t tok = 0; tok < t.num_tokens; ++tok) {
      const std::int16_t *row =
          t.routed_ids.data() +
          (static_cast<std::size_t>(tok) * static_cast<std::size_t>(cfg.num_layers) + static_cast<std::size_t>(l)) * k;
      for (std::size_t a = 0; a < k; ++a) {
        load[static_cast<std::size_t>(row[a])] += 1;
        for (std::size_t b = 0; b < k; ++b)
          if (a != b) pair[static_cast<std::size_t>(row[a]) * ne + static_cast<std::size_t>(row[b])] += 1;
      }
    }
    const auto tokens = static_cast<double>(t.num_tokens);
    for (std::size_t a = 0; a < ne; ++a)
      for (std::size_t b = a + 1; b < ne; ++b) {
        const double expect = load[a] * load[b] / tokens;
        if (expect < 1.0) continue; // too rare to say
        const double lift = pair[a * ne + b] / expect;
        if (cl[a] == cl[b]) {
          within += lift;
          ++n_within;
        } else {
          across += lift;
          ++n_across;
        }
      }
  }
  return {n_within > 0 ? within / static_cast<double>(n_within) : 0.0,
          n_across > 0 ? across / static_cast<double>(n_across) : 0.0};
}

TEST_CASE("synthetic: with co-activation, experts of one cluster are routed together more than across clusters") {
  int checked = 0;
  for (int i = 0; i < num_seeds(24); ++i) {
    SyntheticConfig c = random_config(9900 + static_cast<std::uint64_t>(i));
    detail::Xoshiro256 rng(10000 + static_cast<std::uint64_t>(i));
    // Enough experts for several clusters of more than one expert, enough tokens to count pairs.
    c.num_experts = 16 + static_cast<int>(rng.below(49));
    c.topk = 2 + static_cast<int>(rng.below(7));
    c.num_topics = 4 + static_cast<int>(rng.below(29));
    c.topics_per_prompt = 1 + static_cast<int>(rng.below(3));
    c.prompts_per_step = 48;
    c.num_steps = 1;
    c.coactivation = 0.7 + 0.3 * rng.uniform();
    // Clusters of at least top-k experts (0: E / k), so that a token can take its experts from one cluster.
    const int most = c.num_experts / c.topk;
    c.coactivation_clusters =
        rng.below(2) == 0 ? 0 : 2 + static_cast<int>(rng.below(static_cast<std::uint64_t>(most - 1)));
    INFO(describe(c), " coactivation=", c.coactivation, " clusters=", c.coactivation_cluster_count());
    const PairLift on = pair_lift(c, generate_trace(c), c);
    // The same partition measured on the ids without co-activation: no preference for within-cluster pairs.
    SyntheticConfig off = c;
    off.coactivation = 0;
    const PairLift base = pair_lift(off, generate_trace(off), c);
    INFO("lift within/across: on ", on.within, "/", on.across, ", off ", base.within, "/", base.across);
    CHECK(on.within > on.across);
    CHECK(on.within / on.across > 1.1 * (base.within / base.across));
    ++checked;
  }
  CHECK(checked > 0);
}

TEST_CASE("synthetic: co-activation keeps the experts' marginal loads close to those without it") {
  // The favoured cluster is drawn with its popularity share, so step loads keep their imbalance roughly.
  SyntheticConfig c = one_step(4, 64, 8, 64, 8);
  c.coactivation = 0.5;
  SyntheticConfig off = c;
  off.coactivation = 0;
  const LoadTensor on_loads = generate_loads(c), off_loads = generate_loads(off);
  const auto max_mean = [](const LoadTensor &t) {
    double worst = 0;
    for (int l = 0; l < t.num_layers(); ++l) {
      std::vector<double> row(static_cast<std::size_t>(t.num_experts()), 0.0);
      for (int m = 0; m < t.num_micro_steps(); ++m)
        for (int e = 0; e < t.num_experts(); ++e)
          row[static_cast<std::size_t>(e)] += static_cast<double>(t.at(m, l, e));
      double sum = 0, mx = 0;
      for (const double v : row) {
        sum += v;
        mx = std::max(mx, v);
      }
      worst = std::max(worst, mx * static_cast<double>(row.size()) / sum);
    }
    return worst;
  };
  const double a = max_mean(on_loads), b = max_mean(off_loads);
  INFO("worst layer's step max/mean: on ", a, ", off ", b);
  CHECK(a < 1.5 * b);
  CHECK(a > b / 1.5);
}

TEST_CASE("synthetic: offsets are consistent and micro-batches respect the budget") {
  for (int i = 0; i < num_seeds(12); ++i) {
    const SyntheticConfig c = random_config(3000 + static_cast<std::uint64_t>(i));
    INFO(describe(c));
    const SyntheticTrace t = generate_trace(c);
    const std::size_t num_gpus = static_cast<std::size_t>(c.num_gpus);
    const std::size_t num_micro = t.microbatch_offsets.size() - 1;
    REQUIRE(t.step_offsets.size() == static_cast<std::size_t>(c.num_steps) + 1);
    CHECK(t.step_offsets.front() == 0);
    CHECK(t.step_offsets.back() == static_cast<std::int64_t>(num_micro));
    for (std::size_t s = 0; s + 1 < t.step_offsets.size(); ++s)
      CHECK(t.step_offsets[s + 1] > t.step_offsets[s]);
    REQUIRE(t.source_offsets.size() == num_micro * num_gpus + 1);
    CHECK(t.microbatch_offsets.front() == 0);
    CHECK(t.source_offsets.front() == 0);
    CHECK(t.microbatch_offsets.back() == t.num_tokens);
    CHECK(t.source_offsets.back() == t.num_tokens);
    CHECK(t.sequence_offsets.back() == t.num_tokens);
    CHECK(std::is_sorted(t.source_offsets.begin(), t.source_offsets.end()));
    for (std::size_t m = 0; m < num_micro; ++m) {
      CHECK(t.source_offsets[m * num_gpus] == t.microbatch_offsets[m]); // source offsets refine micro-batches
      CHECK(t.microbatch_offsets[m + 1] > t.microbatch_offsets[m]);     // no empty micro-step
    }
    // Sequences: the right number, lengths within the clip range, boundaries refining the blocks.
    const std::size_t num_seqs = static_cast<std::size_t>(c.num_steps) * static_cast<std::size_t>(c.prompts_per_step) *
                                 static_cast<std::size_t>(c.responses_per_prompt);
    REQUIRE(t.sequence_offsets.size() == num_seqs + 1);
    std::int64_t total = 0;
    for (std::size_t s = 0; s < num_seqs; ++s) {
      const std::int64_t len = t.sequence_offsets[s + 1] - t.sequence_offsets[s];
      CHECK(len >= c.prompt_length.min_tokens + c.response_length.min_tokens);
      CHECK(len <= c.prompt_length.max_tokens + c.response_length.max_tokens);
      total += len;
    }
    CHECK(total == t.num_tokens);
    const auto is_boundary = [&](std::int64_t tok) {
      return std::binary_search(t.sequence_offsets.begin(), t.sequence_offsets.end(), tok);
    };
    for (std::int64_t off : t.source_offsets)
      CHECK(is_boundary(off));
    const auto sequences_in = [&](std::int64_t lo, std::int64_t hi) {
      return std::upper_bound(t.sequence_offsets.begin(), t.sequence_offsets.end(), hi) -
             std::upper_bound(t.sequence_offsets.begin(), t.sequence_offsets.end(), lo);
    };
    // Per rank and step: blocks within budget unless one long sequence, packed greedily, no gaps.
    for (std::size_t s = 0; s < static_cast<std::size_t>(c.num_steps); ++s)
      for (std::size_t r = 0; r < num_gpus; ++r) {
        bool ended = false;
        for (auto m = static_cast<std::size_t>(t.step_offsets[s]); m < static_cast<std::size_t>(t.step_offsets[s + 1]);
             ++m) {
          const std::int64_t lo = t.source_offsets[m * num_gpus + r], hi = t.source_offsets[m * num_gpus + r + 1];
          if (hi == lo) {
            ended = true;
            continue;
          }
          CHECK_MESSAGE(!ended, "rank ", r, " resumes after an empty micro-batch in micro-step ", m);
          CHECK((hi - lo <= c.microbatch_tokens_per_gpu || sequences_in(lo, hi) == 1));
          if (m + 1 < static_cast<std::size_t>(t.step_offsets[s + 1])) {
            const std::int64_t next_lo = t.source_offsets[(m + 1) * num_gpus + r];
            const std::int64_t next_hi = t.source_offsets[(m + 1) * num_gpus + r + 1];
            if (next_hi > next_lo) { // the next micro-batch's first sequence did not fit here
              const auto it = std::upper_bound(t.sequence_offsets.begin(), t.sequence_offsets.end(), next_lo);
              CHECK(hi - lo + (*it - next_lo) > c.microbatch_tokens_per_gpu);
            }
          }
        }
      }
  }
}

/// Per step, the routed ids of every sequence, sorted: the same multiset means the same sequences routed the same.
std::vector<std::vector<std::vector<std::int16_t>>> sequences_by_step(const SyntheticTrace &t) {
  std::vector<std::vector<std::vector<std::int16_t>>> out(t.step_offsets.size() - 1);
  const std::size_t per_token = static_cast<std::size_t>(t.num_layers) * static_cast<std::size_t>(t.topk);
  std::size_t step = 0;
  for (std::size_t s = 0; s + 1 < t.sequence_offsets.size(); ++s) {
    const std::int64_t lo = t.sequence_offsets[s], hi = t.sequence_offsets[s + 1];
    while (lo >= t.microbatch_offsets[static_cast<std::size_t>(t.step_offsets[step + 1])])
      ++step;
    out[step].emplace_back(t.routed_ids.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(lo) * per_token),
                           t.routed_ids.begin() +
                               static_cast<std::ptrdiff_t>(static_cast<std::size_t>(hi) * per_token));
  }
  for (auto &seqs : out)
    std::sort(seqs.begin(), seqs.end());
  return out;
}

/// Per step, the squared deviation of the micro-steps' expert loads from the step's share (the packer's J).
std::vector<double> step_deviations(const LoadTensor &loads, const std::vector<std::int64_t> &steps) {
  std::vector<double> out;
  for (std::size_t s = 0; s + 1 < steps.size(); ++s) {
    const int m0 = static_cast<int>(steps[s]), m1 = static_cast<int>(steps[s + 1]);
    double j = 0;
    for (int l = 0; l < loads.num_layers(); ++l)
      for (int e = 0; e < loads.num_experts(); ++e) {
        double total = 0;
        for (int m = m0; m < m1; ++m)
          total += static_cast<double>(loads.at(m, l, e));
        for (int m = m0; m < m1; ++m) {
          const double d = static_cast<double>(loads.at(m, l, e)) - total / (m1 - m0);
          j += d * d;
        }
      }
    out.push_back(j);
  }
  return out;
}

TEST_CASE("synthetic: packing re-packs each step's sequences, routed as before, into the trainer's micro-steps") {
  int improved = 0;
  for (int i = 0; i < num_seeds(10); ++i) {
    const SyntheticConfig c = random_config(7000 + static_cast<std::uint64_t>(i));
    INFO(describe(c));
    const SyntheticTrace t0 = generate_trace(c);
    std::vector<std::int64_t> steps0;
    const LoadTensor loads0 = generate_loads(c, &steps0);
    const auto seqs0 = sequences_by_step(t0);
    const std::vector<double> j0 = step_deviations(loads0, steps0);
    for (const BatchPacking packing : {BatchPacking::tokens, BatchPacking::routing}) {
      SyntheticConfig cp = c;
      cp.packing = packing;
      INFO("packing " << static_cast<int>(packing));
      GeneratorOptions one, many;
      one.num_threads = 1;
      many.num_threads = 3;
      const SyntheticTrace t = generate_trace(cp, one);
      CHECK(t.step_offsets == t0.step_offsets); // the trainer's number of micro-steps
      CHECK(t.num_tokens == t0.num_tokens);
      CHECK(sequences_by_step(t) == seqs0); // a permutation within each step; every sequence routed as before
      std::vector<std::int64_t> steps;
      const LoadTensor loads = generate_loads(cp, &steps, false, many);
      CHECK(steps == steps0);
      CHECK(loads == naive_count(t, c.num_gpus, false)); // loads and ids agree, at any thread count
      CHECK(generate_loads(cp, nullptr, true, one) == naive_count(t, c.num_gpus, true));
      // Every micro-batch within the budget, raised to the step's longest sequence.
      const std::size_t ng = static_cast<std::size_t>(c.num_gpus);
      for (std::size_t s = 0; s + 1 < t.step_offsets.size(); ++s) {
        const auto m0 = static_cast<std::size_t>(t.step_offsets[s]),
                   m1 = static_cast<std::size_t>(t.step_offsets[s + 1]);
        std::int64_t longest = 0;
        for (std::size_t q = 0; q + 1 < t.sequence_offsets.size(); ++q)
          if (t.sequence_offsets[q] >= t.microbatch_offsets[m0] && t.sequence_offsets[q] < t.microbatch_offsets[m1])
            longest = std::max(longest, t.sequence_offsets[q + 1] - t.sequence_offsets[q]);
        for (std::size_t b = m0 * ng; b < m1 * ng; ++b)
          CHECK(t.source_offsets[b + 1] - t.source_offsets[b] <= std::max(c.microbatch_tokens_per_gpu, longest));
      }
      if (packing == BatchPacking::routing) { // never further from the step's share than the trainer's layout
        const std::vector<double> j = step_deviations(loads, steps);
        REQUIRE(j.size() == j0.size());
        for (std::size_t s = 0; s < j.size(); ++s) {
          CHECK(j[s] <= j0[s] * (1 + 1e-12));
          improved += j[s] < j0[s] * (1 - 1e-9) ? 1 : 0;
        }
      }
    }
  }
  CHECK(improved > 0); // the packer does something on these instances
}

TEST_CASE("synthetic: every slot keeps its expert with probability persistence (stream 2 drop masks)") {
  // Near-uniform routing over many experts, so that a re-draw almost never returns the dropped expert: the
  // fraction of (token, slot) pairs whose expert equals the previous token's is then the persistence, for every
  // slot, in full groups of 8 slots and in the last partial group alike.
  for (const int topk : {3, 8, 11}) {
    for (const double persistence : {0.0, 0.3, 0.6, 0.9}) {
      SyntheticConfig c = one_step(2, 2000, topk, 4, 2);
      c.seed = 77 + static_cast<std::uint64_t>(topk);
      c.prompt_length = {400.0, 0.0, 400, 400};
      c.response_length = {400.0, 0.0, 400, 400};
      c.skew = 0.0;
      c.skew_layer_sigma = 0.0;
      c.topic_concentration = 1000.0;
      c.persistence = persistence;
      c.num_gpus = 1;
      c.microbatch_tokens_per_gpu = 1 << 20;
      INFO("topk ", topk, " persistence ", persistence);
      const SyntheticTrace t = generate_trace(c);
      std::vector<double> kept(static_cast<std::size_t>(topk), 0.0);
      double pairs = 0;
      for (std::size_t s = 0; s + 1 < t.sequence_offsets.size(); ++s)
        for (std::int64_t tok = t.sequence_offsets[s] + 1; tok < t.sequence_offsets[s + 1]; ++tok) {
          for (int l = 0; l < c.num_layers; ++l)
            for (int k = 0; k < topk; ++k)
              kept[static_cast<std::size_t>(k)] += id_at(t, tok, l, k) == id_at(t, tok - 1, l, k) ? 1.0 : 0.0;
          pairs += c.num_layers;
        }
      for (int k = 0; k < topk; ++k) {
        const double rate = kept[static_cast<std::size_t>(k)] / pairs;
        // Binomial standard error is at most 0.5 / sqrt(pairs) ~ 0.006 here; a re-draw repeats with p ~ 1/2000.
        CHECK_MESSAGE(std::fabs(rate - persistence) < 0.03, "slot ", k, " keeps at ", rate);
      }
    }
  }
}

// Stream version 2 fingerprints; a change here needs a new synthetic_stream_version (and new fingerprints).
TEST_CASE("synthetic: stream version 2 fingerprints") {
  REQUIRE(synthetic_stream_version == 2);
  // Qwen3-30B-A3B shape (top-8: the vector-lane path) with the default lengths, few prompts, 8 ranks.
  SyntheticConfig base = one_step(48, 128, 8, 3, 8);
  base.num_gpus = 8;
  base.microbatch_tokens_per_gpu = 4096;
  // Top-12 of 40 (the bit-set path; a full group of 8 slots and one of 4), zipf popularity, two steps.
  SyntheticConfig wide = one_step(5, 40, 12, 4, 3);
  wide.seed = 77;
  wide.num_steps = 2;
  wide.popularity = PopularityModel::zipf;
  wide.num_gpus = 3;
  wide.microbatch_tokens_per_gpu = 3000;
  // Edge cases: no drops at all (persistence 1) with responses routed like their prompt; every slot redrawn.
  SyntheticConfig frozen = one_step(6, 32, 6, 5, 4);
  frozen.seed = 5;
  frozen.persistence = 1.0;
  frozen.response_topic_weight = 0.0;
  frozen.num_gpus = 4;
  SyntheticConfig churn = frozen;
  churn.persistence = 0.0;
  churn.response_topic_weight = 0.3;
  // Group-limited (DeepSeek-V3-like: 8 groups, at most 3 here), so that its stream is pinned too.
  SyntheticConfig grouped = one_step(6, 64, 8, 4, 3);
  grouped.seed = 11;
  grouped.route_groups = 8;
  grouped.route_max_groups = 3;
  grouped.num_gpus = 4;

  const std::pair<const SyntheticConfig *, std::uint64_t> loads[] = {{&base, 0xa18f5b4bec5c2993ULL},
                                                                     {&wide, 0x6293b2d84c55e3ebULL},
                                                                     {&frozen, 0x5e1c026112e14299ULL},
                                                                     {&churn, 0x62f65b32b62cf873ULL},
                                                                     {&grouped, 0x7544ac6f49824578ULL}};
  for (const auto &entry : loads) { // not a structured binding: INFO captures it, which clang 14 refuses
    const SyntheticConfig &c = *entry.first;
    INFO(describe(c));
    for (int threads : {1, 2}) {
      GeneratorOptions opts;
      opts.num_threads = threads;
      const std::uint64_t got = fingerprint(generate_loads(c, nullptr, false, opts));
      CHECK(got == entry.second);
    }
  }
  CHECK(fingerprint(generate_loads(wide, nullptr, true)) == 0xdd6f6334bf871248ULL);

  SyntheticConfig small = wide;
  small.num_layers = 3;
  small.num_steps = 1;
  const SyntheticTrace t = generate_trace(small);
  std::uint64_t ids = fnv1a(std::span<const std::int16_t>(t.routed_ids));
  ids = fnv1a(std::span<const std::int64_t>(t.sequence_offsets), ids);
  CHECK(ids == 0x92fc584017f6fcb0ULL);
}

TEST_CASE("synthetic: alias tables padded to a power of two follow their weights") {
  detail::Xoshiro256 rng(11);
  for (const int n : {1, 3, 5, 100, 129}) {
    std::vector<double> w(static_cast<std::size_t>(n));
    for (auto &x : w)
      x = rng.uniform() < 0.2 ? 0.0 : rng.uniform();
    w[0] += 0.5; // a positive sum
    double sum = 0;
    for (double x : w)
      sum += x;
    detail::AliasTable table;
    table.build(w.data(), n);
    std::vector<double> counts(static_cast<std::size_t>(n), 0.0);
    const int draws = 400000;
    bool in_range = true;
    for (int i = 0; i < draws && in_range; ++i) {
      const int e = table.sample_bits(static_cast<std::uint32_t>(rng.next()));
      in_range = e >= 0 && e < n;
      if (in_range) counts[static_cast<std::size_t>(e)] += 1;
    }
    REQUIRE(in_range);
    for (int e = 0; e < n; ++e) {
      const double p = w[static_cast<std::size_t>(e)] / sum;
      INFO("n ", n, " expert ", e, " weight ", p);
      if (p == 0)
        CHECK(counts[static_cast<std::size_t>(e)] == 0);
      else
        CHECK(std::fabs(counts[static_cast<std::size_t>(e)] / draws - p) < 5 * std::sqrt(p / draws) + 1e-4);
    }
  }
}

TEST_CASE("synthetic: responses of one prompt repeat its prompt routes") {
  SyntheticConfig c = one_step(3, 32, 4, 6, 3);
  c.prompt_length = {24.0, 0.0, 24, 24};
  c.response_length = {40.0, 0.5, 8, 120};
  c.num_gpus = 2;
  c.microbatch_tokens_per_gpu = 200;
  const SyntheticTrace t = generate_trace(c);
  const std::size_t row = static_cast<std::size_t>(c.num_layers) * static_cast<std::size_t>(c.topk);
  std::map<std::vector<std::int16_t>, int> prompts;
  std::map<std::vector<std::int16_t>, int> responses;
  for (std::size_t s = 0; s + 1 < t.sequence_offsets.size(); ++s) {
    const auto begin =
        t.routed_ids.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(t.sequence_offsets[s]) * row);
    ++prompts[std::vector<std::int16_t>(begin, begin + static_cast<std::ptrdiff_t>(24 * row))];
    ++responses[std::vector<std::int16_t>(begin + static_cast<std::ptrdiff_t>(24 * row),
                                          begin + static_cast<std::ptrdiff_t>(32 * row))];
  }
  REQUIRE(prompts.size() == 6);
  for (const auto &[ids, n] : prompts)
    CHECK(n == 3);
  CHECK(responses.size() == 18); // responses diverge after the prompt
}

TEST_CASE("synthetic: step loads are stable, micro-step loads swing, skew is realistic") {
  // The default model at a test-friendly size: 8 layers, 8 GPUs, short sequences, about 20 micro-steps per step.
  SyntheticConfig c;
  c.num_layers = 8;
  c.num_steps = 4;
  c.prompts_per_step = 128;
  c.responses_per_prompt = 4;
  c.prompt_length = {128.0, 0.6, 16, 2048};
  c.response_length = {384.0, 0.8, 16, 4096};
  c.num_gpus = 8;
  c.microbatch_tokens_per_gpu = 2048;
  std::vector<std::int64_t> steps;
  const LoadTensor loads = generate_loads(c, &steps);
  const TraceStats st = compute_trace_stats(loads, steps, c.num_gpus, c.topk);
  std::ostringstream table;
  print_trace_stats(table, st);
  INFO(table.str());
  CHECK(st.micro_steps_per_step.min >= 15);
  CHECK(st.step_cv.median < 0.1);
  CHECK(st.micro_cv.median > 3.0 * st.step_cv.median);
  CHECK(st.step_max_over_mean.median > 3.0);
  CHECK(st.step_max_over_mean.median < 6.0);
  CHECK(st.micro_max_over_mean.p90 > st.step_max_over_mean.median);
}

TEST_CASE("trace stats: hand-made tensors with known answers") {
  SUBCASE("constant loads: no variation, perfect balance") {
    LoadTensor t(6, 2, 4);
    for (auto &v : t.totals())
      v = 5;
    const std::vector<std::int64_t> steps = {0, 2, 4, 6};
    const TraceStats st = compute_trace_stats(t, steps, 2, 1);
    CHECK(st.num_steps == 3);
    CHECK(st.step_cv.median == 0.0);
    CHECK(st.step_cv.max == 0.0);
    CHECK(st.micro_cv.max == 0.0);
    CHECK(st.step_cv.count == 8);
    CHECK(st.step_max_over_mean.median == 1.0);
    CHECK(st.micro_max_over_mean.max == 1.0);
    CHECK(st.step_gpu_max_over_mean.max == 1.0);
    CHECK(st.micro_gpu_max_over_mean.p90 == 1.0);
    CHECK(st.micro_steps_per_step.mean == 2.0);
    CHECK(st.tokens_per_micro_step.min == 20.0);
    CHECK(st.assignments_per_micro_step.max == 20.0);
    CHECK(st.step_cv_load_weighted == 0.0);
  }
  SUBCASE("two steps with mirrored loads") {
    // Layer 0: step 0 = [3, 1], step 1 = [1, 3]: shares 0.75/0.25 then 0.25/0.75, mean 0.5, sample sd 0.3536.
    LoadTensor t(2, 1, 2);
    t.at(0, 0, 0) = 3;
    t.at(0, 0, 1) = 1;
    t.at(1, 0, 0) = 1;
    t.at(1, 0, 1) = 3;
    const std::vector<std::int64_t> steps = {0, 1, 2};
    const TraceStats st = compute_trace_stats(t, steps, 2);
    CHECK(st.step_cv.median == doctest::Approx(std::sqrt(0.125) / 0.5));
    CHECK(st.micro_cv.median == doctest::Approx(std::sqrt(0.125) / 0.5));
    CHECK(st.step_max_over_mean.median == doctest::Approx(1.5));
    CHECK(st.step_gpu_max_over_mean.median == doctest::Approx(1.5));
    CHECK(st.tokens_per_micro_step.count == 0); // topk not given
    CHECK(std::isnan(st.tokens_per_micro_step.median));
  }
  SUBCASE("one step: micro-step CV only; shares weigh micro-steps equally") {
    // Two micro-steps of one step: [2, 0, 2, 0] and [0, 1, 0, 1] -> shares 0.5/0/0.5/0 and 0/0.5/0/0.5.
    LoadTensor t(2, 1, 4);
    t.at(0, 0, 0) = 2;
    t.at(0, 0, 2) = 2;
    t.at(1, 0, 1) = 1;
    t.at(1, 0, 3) = 1;
    const TraceStats st = compute_trace_stats(t);
    CHECK(st.num_steps == 1);
    CHECK(st.step_cv.count == 0);
    CHECK(std::isnan(st.step_cv.median));
    CHECK(std::isnan(st.step_cv_load_weighted));
    CHECK(st.micro_cv.count == 4);
    CHECK(st.micro_cv.median == doctest::Approx(std::sqrt(2.0)));      // sd of {0.5, 0} is 0.3536, mean 0.25
    CHECK(st.step_max_over_mean.median == doctest::Approx(4.0 / 3.0)); // [2, 1, 2, 1]
    CHECK(st.micro_max_over_mean.median == doctest::Approx(2.0));
    CHECK(st.micro_max_over_mean.p90 == doctest::Approx(2.0));
    CHECK(st.micro_steps_per_step.max == 2.0);
  }
  SUBCASE("empty layers and unused experts are left out") {
    LoadTensor t(3, 2, 3);
    t.at(0, 0, 0) = 4; // layer 1 is empty everywhere, expert 2 of layer 0 is never used
    t.at(1, 0, 0) = 2;
    t.at(1, 0, 1) = 2;
    t.at(2, 0, 1) = 4;
    const TraceStats st = compute_trace_stats(t, std::vector<std::int64_t>{0, 1, 3});
    CHECK(st.micro_cv.count == 2);
    CHECK(st.step_cv.count == 2);
    CHECK(st.micro_max_over_mean.count == 3);
    CHECK(st.step_max_over_mean.count == 2);
    CHECK(st.micro_max_over_mean.max == doctest::Approx(3.0));
  }
  SUBCASE("printing") {
    LoadTensor t(2, 1, 4);
    t.at(0, 0, 0) = 2;
    t.at(1, 0, 1) = 1;
    std::ostringstream os;
    print_trace_stats(os, compute_trace_stats(t, {}, 2, 1));
    const std::string s = os.str();
    CHECK(s.find("expert share CV across micro-steps") != std::string::npos);
    CHECK(s.find("GPU max/mean per (micro-step, layer)") != std::string::npos);
    CHECK(s.find("tokens per micro-step") != std::string::npos);
  }
}

TEST_CASE("trace stats: bad inputs are named") {
  LoadTensor t(4, 1, 6);
  t.at(0, 0, 0) = 1;
  CHECK(error_of([&] {
          (void)compute_trace_stats(t, std::vector<std::int64_t>{0, 2, 3});
        }).find("end at 3") != std::string::npos);
  CHECK(error_of([&] {
          (void)compute_trace_stats(t, std::vector<std::int64_t>{0, 3, 2, 4});
        }).find("decrease") != std::string::npos);
  CHECK(error_of([&] {
          (void)compute_trace_stats(t, std::vector<std::int64_t>{1, 4});
        }).find("got 1") != std::string::npos);
  CHECK(error_of([&] { (void)compute_trace_stats(t, {}, 4); }).find("num_gpus 4") != std::string::npos);
  CHECK(error_of([&] { (void)compute_trace_stats(LoadTensor(0, 1, 6)); }).find("no micro-steps") != std::string::npos);
  const std::vector<double> counts = {1, 2, 3};
  CHECK(error_of([&] { (void)layer_skew(counts, 2, 2); }).find("3 counts") != std::string::npos);
  const std::vector<double> negative = {1, -2};
  CHECK(error_of([&] { (void)layer_skew(negative, 1, 2); }).find("-2") != std::string::npos);
}

TEST_CASE("layer_skew of a plain count matrix") {
  // Layer 0: [4, 0, 0, 0] -> max/mean 4, GPU (2 per GPU) [4, 0] -> 2. Layer 1: uniform -> 1. Layer 2: empty.
  const std::vector<double> counts = {4, 0, 0, 0, 3, 3, 3, 3, 0, 0, 0, 0};
  const LayerSkew s = layer_skew(counts, 3, 4, 2);
  CHECK(s.max_over_mean.count == 2);
  CHECK(s.max_over_mean.max == doctest::Approx(4.0));
  CHECK(s.max_over_mean.min == doctest::Approx(1.0));
  CHECK(s.max_over_mean.median == doctest::Approx(2.5));
  CHECK(s.gpu_max_over_mean.max == doctest::Approx(2.0));
  CHECK(s.gpu_max_over_mean.median == doctest::Approx(1.5));
  CHECK(layer_skew(counts, 3, 4).gpu_max_over_mean.count == 0);
}

TEST_CASE("layer_skew reproduces the DeepSeek-V3 reference figures") {
  const auto first = foremoe_test::data_path("deepseek-v3-sglang/prefill_in1024.npy");
  if (first.empty()) return;
  const auto path = first.parent_path();
  const struct {
    const char *file;
    double median;
  } cases[] = {{"prefill_in1024.npy", 5.89}, {"decode_in2000out100.npy", 5.79}};
  for (const auto &cs : cases) {
    const NpyArray a = read_npy(path / cs.file);
    REQUIRE(a.shape == std::vector<std::int64_t>{58, 256});
    const std::vector<double> counts = a.to_doubles();
    const LayerSkew s = layer_skew(counts, 58, 256, 32);
    CHECK(s.max_over_mean.median == doctest::Approx(cs.median).epsilon(0.002));
    CHECK(s.gpu_max_over_mean.median == doctest::Approx(2.2).epsilon(0.05)); // README: "about 2.2x"
  }
}

TEST_CASE("synthetic: presets validate and bad configs are named") {
  CHECK_NOTHROW(SyntheticConfig{}.validate());
  const SyntheticConfig ds = SyntheticConfig::deepseek_v3();
  CHECK_NOTHROW(ds.validate());
  CHECK(ds.num_layers == 58);
  CHECK(ds.num_experts == 256);
  CHECK(ds.topk == 8);
  CHECK(ds.route_groups == 8);     // DeepSeek-V3's n_group
  CHECK(ds.route_max_groups == 4); // ... and topk_group
  CHECK(ds.group_limited());
  const SyntheticConfig kimi = SyntheticConfig::kimi_k2();
  CHECK_NOTHROW(kimi.validate());
  CHECK(kimi.num_layers == 60); // 61 layers, the first dense
  CHECK(kimi.num_experts == 384);
  CHECK(kimi.topk == 8);
  CHECK_FALSE(kimi.group_limited()); // n_group 1

  const struct {
    std::function<void(SyntheticConfig &)> mutate;
    const char *expected;
  } cases[] = {
      {[](SyntheticConfig &c) { c.topk = 200; }, "topk 200 exceeds num_experts 128"},
      {[](SyntheticConfig &c) { c.topk = 0; }, "topk must be positive, got 0"},
      {[](SyntheticConfig &c) { c.num_experts = 40000; }, "num_experts 40000 exceeds 32767"},
      {[](SyntheticConfig &c) { c.num_layers = -3; }, "num_layers must be positive, got -3"},
      {[](SyntheticConfig &c) { c.num_steps = 0; }, "num_steps must be positive, got 0"},
      {[](SyntheticConfig &c) { c.route_groups = 3; }, "route_groups 3 must be >= 1 and divide num_experts 128"},
      {[](SyntheticConfig &c) { c.route_groups = 0; }, "route_groups 0 must be >= 1 and divide num_experts 128"},
      {[](SyntheticConfig &c) { c.route_max_groups = -1; }, "route_max_groups must be >= 0 (0: no limit), got -1"},
      {[](SyntheticConfig &c) {
         c.route_groups = 64;
         c.route_max_groups = 3;
       },
       "route_max_groups 3 groups of 2 experts hold fewer than topk 8 experts"},
      {[](SyntheticConfig &c) { c.prompts_per_step = 0; }, "prompts_per_step must be positive, got 0"},
      {[](SyntheticConfig &c) { c.responses_per_prompt = -1; }, "responses_per_prompt must be positive, got -1"},
      {[](SyntheticConfig &c) { c.skew = -0.5; }, "skew must be in [0, 20], got -0.5"},
      {[](SyntheticConfig &c) { c.skew = std::nan(""); }, "skew must be in [0, 20], got "},
      {[](SyntheticConfig &c) { c.persistence = 1.5; }, "persistence must be in [0, 1], got 1.5"},
      {[](SyntheticConfig &c) { c.persistence = -0.1; }, "persistence must be in [0, 1], got -0.1"},
      {[](SyntheticConfig &c) { c.response_topic_weight = 2; }, "response_topic_weight must be in [0, 1], got 2"},
      {[](SyntheticConfig &c) { c.topic_concentration = 0; }, "topic_concentration must be positive and finite, got 0"},
      {[](SyntheticConfig &c) { c.coactivation = 1.5; }, "coactivation must be in [0, 1], got 1.5"},
      {[](SyntheticConfig &c) { c.coactivation = -0.25; }, "coactivation must be in [0, 1], got -0.25"},
      {[](SyntheticConfig &c) { c.coactivation = std::nan(""); }, "coactivation must be in [0, 1], got "},
      {[](SyntheticConfig &c) { c.coactivation_clusters = 129; },
       "coactivation_clusters 129 must be in [0, num_experts = 128] (0: num_experts / topk)"},
      {[](SyntheticConfig &c) { c.coactivation_clusters = -1; },
       "coactivation_clusters -1 must be in [0, num_experts = 128]"},
      {[](SyntheticConfig &c) { c.topics_per_prompt = 33; }, "topics_per_prompt 33 must be in [1, num_topics = 32]"},
      {[](SyntheticConfig &c) { c.num_topics = 0; }, "num_topics must be positive, got 0"},
      {[](SyntheticConfig &c) { c.num_gpus = 0; }, "num_gpus must be positive, got 0"},
      {[](SyntheticConfig &c) { c.microbatch_tokens_per_gpu = -5; },
       "microbatch_tokens_per_gpu must be positive, got -5"},
      {[](SyntheticConfig &c) { c.prompt_length.mean = -1; }, "prompt_length.mean must be positive and finite, got -1"},
      {[](SyntheticConfig &c) { c.response_length.max_tokens = 3; },
       "response_length.max_tokens 3 is below min_tokens 16"},
      {[](SyntheticConfig &c) { c.response_length.sigma = -1; }, "response_length.sigma must be in [0, 10], got -1"},
  };
  for (const auto &cs : cases) {
    SyntheticConfig c;
    cs.mutate(c);
    const std::string what = error_of([&] { c.validate(); });
    INFO(what);
    CHECK(what.find(cs.expected) != std::string::npos);
    // Both generators validate before doing any work.
    CHECK(error_of([&] { (void)generate_loads(c); }) == what);
    CHECK(error_of([&] { (void)generate_trace(c); }) == what);
  }

  SyntheticConfig big;
  CHECK(error_of([&] { (void)generate_trace(big); }).find("use generate_loads") != std::string::npos);
}
