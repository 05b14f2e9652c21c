// even_split_rebalance (plan/even_split.hpp): EPLB's contract, never a higher peak than EPLB under the even split.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "foremoe/core/error.hpp"
#include "foremoe/plan/eplb.hpp"
#include "foremoe/plan/even_split.hpp"
#include "foremoe/trace/npy.hpp"
#include "test_support.hpp"

using namespace foremoe;

namespace {

double peak(const std::vector<double> &loads) { return *std::max_element(loads.begin(), loads.end()); }

bool has_duplicate(const std::vector<std::int32_t> &phys_to_log, int num_gpus) {
  const std::size_t per_gpu = phys_to_log.size() / static_cast<std::size_t>(num_gpus);
  for (std::size_t g = 0; g < phys_to_log.size(); g += per_gpu) {
    std::vector<std::int32_t> row(phys_to_log.begin() + static_cast<std::ptrdiff_t>(g),
                                  phys_to_log.begin() + static_cast<std::ptrdiff_t>(g + per_gpu));
    std::sort(row.begin(), row.end());
    if (std::adjacent_find(row.begin(), row.end()) != row.end()) return true;
  }
  return false;
}

/// EPLB's output contract, and no two copies of an expert on one GPU.
void check_contract(const EplbLayer &layer, int num_experts, int num_gpus) {
  const int R = static_cast<int>(layer.phys_to_log.size()), S = R / num_gpus;
  REQUIRE(static_cast<int>(layer.replica_count.size()) == num_experts);
  std::vector<int> seen(static_cast<std::size_t>(num_experts), 0);
  for (int p = 0; p < R; ++p) {
    const int e = layer.phys_to_log[p];
    REQUIRE((e >= 0 && e < num_experts));
    CHECK(layer.replica_rank[p] == seen[e]++);
    if (p % S != 0) CHECK(layer.phys_to_log[p - 1] < e); // increasing within a GPU: distinct
  }
  for (int e = 0; e < num_experts; ++e) {
    CHECK(seen[e] >= 1);
    CHECK(layer.replica_count[e] == seen[e]);
  }
}

std::vector<double> random_weights(std::mt19937_64 &rng, int num_experts) {
  std::vector<double> w(static_cast<std::size_t>(num_experts));
  switch (rng() % 3) {
  case 0: {
    std::gamma_distribution<double> gamma(0.2 + 2.0 * std::uniform_real_distribution<double>()(rng), 100.0);
    for (double &v : w)
      v = gamma(rng);
    break;
  }
  case 1: { // Zipf-like, shuffled
    const double s = 0.5 + 1.5 * std::uniform_real_distribution<double>()(rng);
    for (int e = 0; e < num_experts; ++e)
      w[e] = 1e4 / std::pow(e + 1, s);
    std::shuffle(w.begin(), w.end(), rng);
    break;
  }
  default: // small integers: many ties
    for (double &v : w)
      v = static_cast<double>(rng() % 20);
  }
  return w;
}

} // namespace

TEST_CASE("even_split: a hot expert gets one copy per GPU, not two on one") {
  // 2 GPUs x 2 slots: EPLB gives expert 0 three copies, two on one GPU (peak 2 * 100 / 3); here 2 + 2 copies.
  const std::vector<double> w{100, 10};
  const EplbLayer theirs = eplb_rebalance_layer(w, 4, 1, 1, 2);
  CHECK(peak(even_split_gpu_loads(theirs.phys_to_log, w, 2)) == doctest::Approx(200.0 / 3));
  const EplbLayer ours = even_split_rebalance_layer(w, 4, 1, 1, 2);
  check_contract(ours, 2, 2);
  CHECK(ours.phys_to_log == std::vector<std::int32_t>{0, 1, 0, 1});
  CHECK(peak(even_split_gpu_loads(ours.phys_to_log, w, 2)) == doctest::Approx(55.0));
}

TEST_CASE("even_split: where only EPLB's duplicates reach its peak, the duplicate-free optimum") {
  // 8 experts, 2 GPUs x 7 slots. Without duplicates every expert has one or two copies: six on both GPUs, one
  // single on each, so the peak is at least total / 2 + min |wi - wj| / 2 = 49.5 + 0.5. EPLB puts two of the
  // hottest expert's three copies on one GPU and reaches 49.5.
  const std::vector<double> w{5, 14, 18, 12, 10, 17, 7, 16};
  const EplbLayer eplb = eplb_rebalance_layer(w, 14, 1, 1, 2);
  CHECK(has_duplicate(eplb.phys_to_log, 2));
  CHECK(peak(even_split_gpu_loads(eplb.phys_to_log, w, 2)) == 49.5);
  const EplbLayer ours = even_split_rebalance_layer(w, 14, 1, 1, 2);
  check_contract(ours, 8, 2);
  CHECK(peak(even_split_gpu_loads(ours.phys_to_log, w, 2)) == 50.0);
}

TEST_CASE("even_split: never a higher peak than EPLB, random and skewed loads") {
  std::mt19937_64 rng(2024);
  const int cases = 400 * foremoe_test::seed_multiplier();
  int better = 0, above = 0;
  for (int c = 0; c < cases; ++c) {
    const int nodes = std::vector<int>{1, 1, 2, 4}[rng() % 4];
    const int gpus = nodes * std::vector<int>{1, 2, 4, 8}[rng() % 4];
    std::vector<int> experts_choice;
    for (int e : {8, 12, 16, 24, 32, 64})
      if (e % nodes == 0) experts_choice.push_back(e);
    const int E = experts_choice[rng() % experts_choice.size()];
    const int s_min = (E + gpus - 1) / gpus;
    const int S = s_min + static_cast<int>(rng() % static_cast<unsigned>(std::min(E, 4 * s_min) - s_min + 1));
    std::vector<int> groups_choice;
    for (int g : {1, 2, 4, 8, 16})
      if (E % g == 0) groups_choice.push_back(g);
    const int groups = groups_choice[rng() % groups_choice.size()];
    const std::vector<double> w = random_weights(rng, E);
    CAPTURE(c);
    CAPTURE(E);
    CAPTURE(gpus);
    CAPTURE(S);
    CAPTURE(nodes);
    CAPTURE(groups);
    const EplbLayer ours = even_split_rebalance_layer(w, gpus * S, groups, nodes, gpus);
    check_contract(ours, E, gpus);
    const double p_ours = peak(even_split_gpu_loads(ours.phys_to_log, w, gpus));
    const EplbLayer eplb = eplb_rebalance_layer(w, gpus * S, groups, nodes, gpus);
    const double p_eplb = peak(even_split_gpu_loads(eplb.phys_to_log, w, gpus));
    // Strict where EPLB's placement has no duplicate (the search starts from it) and on shapes with >= 16 experts,
    // at most half of them per GPU; elsewhere EPLB's duplicates can reach a peak that no duplicate-free placement
    // does (see the case above); 10 % guards against regressions there (python/tests/test_eplb_split.py).
    if (!has_duplicate(eplb.phys_to_log, gpus) || (E >= 16 && 2 * S <= E)) {
      CHECK(p_ours <= p_eplb * (1 + 1e-12));
    } else {
      CHECK(p_ours <= p_eplb * 1.10);
      above += p_ours > p_eplb * (1 + 1e-12) ? 1 : 0;
    }
    better += p_ours < p_eplb * (1 - 1e-9) ? 1 : 0;
  }
  MESSAGE(better, " of ", cases, " layers below EPLB's peak, ", above, " above it (EPLB with duplicates)");
  CHECK(better > cases / 4);
}

TEST_CASE("even_split: argument errors name the bad value") {
  const std::vector<double> w{1, 2, 3, 4};
  CHECK_THROWS_WITH_AS((void)even_split_rebalance_layer(w, 10, 1, 1, 1), doctest::Contains("10 slots per GPU exceed"),
                       Error);
  CHECK_THROWS_WITH_AS((void)even_split_rebalance_layer(w, 6, 1, 1, 4), doctest::Contains("do not divide over 4 GPUs"),
                       Error);
  const std::vector<double> bad{1, -2, 3, 4};
  CHECK_THROWS_WITH_AS((void)even_split_rebalance_layer(bad, 4, 1, 1, 2), doctest::Contains("expert 1 is -2"), Error);
}

TEST_CASE("even_split: DeepSeek-V3 profiles, median max/mean under the even split vs EPLB") {
  for (const std::string name : {"prefill_in1024", "decode_in2000out100"}) {
    const auto file = foremoe_test::data_path("deepseek-v3-sglang/" + name + ".npy");
    if (file.empty()) return;
    const NpyArray a = read_npy(file);
    REQUIRE(a.shape == std::vector<std::int64_t>{58, 256});
    const std::vector<double> w = a.to_doubles();
    struct Shape {
      int gpus, slots, nodes, groups;
    };
    for (const Shape s : {Shape{32, 9, 4, 8}, Shape{64, 5, 8, 8}}) {
      std::vector<double> ours, theirs;
      for (int l = 0; l < 58; ++l) {
        const std::span<const double> wl(w.data() + static_cast<std::size_t>(l) * 256, 256);
        double mean = 0;
        for (double v : wl)
          mean += v / s.gpus;
        const EplbLayer o = even_split_rebalance_layer(wl, s.gpus * s.slots, s.groups, s.nodes, s.gpus);
        const EplbLayer t = eplb_rebalance_layer(wl, s.gpus * s.slots, s.groups, s.nodes, s.gpus);
        ours.push_back(peak(even_split_gpu_loads(o.phys_to_log, wl, s.gpus)) / mean);
        theirs.push_back(peak(even_split_gpu_loads(t.phys_to_log, wl, s.gpus)) / mean);
        CHECK(ours.back() <= theirs.back() * (1 + 1e-12));
      }
      std::sort(ours.begin(), ours.end());
      std::sort(theirs.begin(), theirs.end());
      const double med_ours = (ours[28] + ours[29]) / 2, med_theirs = (theirs[28] + theirs[29]) / 2;
      MESSAGE(name, " ", s.gpus, " GPUs x ", s.slots, " slots, ", s.nodes, " nodes: median max/mean ", med_ours,
              " (EPLB ", med_theirs, ")");
      CHECK(med_ours < med_theirs);
    }
  }
}
