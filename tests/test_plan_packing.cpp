// Routing-aware micro-batch packing (plan/packing.hpp): validity, never worse than the trainer's packing,
// determinism, closeness to the optimum on small instances, and errors that name the value.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "foremoe/plan/packing.hpp"
#include "test_support.hpp"

using namespace foremoe;

namespace {

/// A step of sequences with topic-coherent routing: each sequence prefers a few experts per layer.
struct Step {
  std::int64_t L = 0, E = 0;
  std::vector<std::int64_t> len, hist;
  [[nodiscard]] PackingInput input() const { return {L, E, len, hist}; }
};

Step random_step(std::mt19937_64 &rng, std::int64_t S, std::int64_t L, std::int64_t E, std::int64_t max_len,
                 int topk = 2) {
  Step st;
  st.L = L, st.E = E;
  st.len.resize(static_cast<std::size_t>(S));
  st.hist.assign(static_cast<std::size_t>(S * L * E), 0);
  for (std::int64_t s = 0; s < S; ++s) {
    const std::int64_t n = 1 + static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(max_len));
    st.len[static_cast<std::size_t>(s)] = n;
    const std::int64_t hot = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(E));
    for (std::int64_t l = 0; l < L; ++l)
      for (std::int64_t t = 0; t < n * topk; ++t) {
        // Half of the routes go to the sequence's hot expert's neighbourhood, the rest anywhere.
        const std::int64_t e = rng() % 2 ? (hot + l + static_cast<std::int64_t>(rng() % 2)) % E
                                         : static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(E));
        ++st.hist[static_cast<std::size_t>((s * L + l) * E + e)];
      }
  }
  return st;
}

/// Checks that `p` places every sequence once, within the shape and the budget.
void check_valid(const Step &st, const PackingShape &shape, const Packing &p) {
  REQUIRE(p.micro_step.size() == st.len.size());
  REQUIRE(p.rank.size() == st.len.size());
  std::vector<std::int64_t> fill(static_cast<std::size_t>(shape.micro_steps * shape.ranks), 0);
  for (std::size_t s = 0; s < st.len.size(); ++s) {
    REQUIRE(p.micro_step[s] >= 0);
    REQUIRE(p.micro_step[s] < shape.micro_steps);
    REQUIRE(p.rank[s] >= 0);
    REQUIRE(p.rank[s] < shape.ranks);
    fill[static_cast<std::size_t>(p.micro_step[s] * shape.ranks + p.rank[s])] += st.len[s];
  }
  for (const std::int64_t f : fill)
    CHECK(f <= shape.token_budget);
  std::int64_t placed = 0;
  for (const auto &m : p.by_micro_step(shape.micro_steps))
    placed += static_cast<std::int64_t>(m.size());
  CHECK(placed == static_cast<std::int64_t>(st.len.size()));
}

/// A shape with `slack` (>= 1) times the tokens' total as room.
PackingShape shape_for(const Step &st, std::int64_t M, std::int64_t R, double slack) {
  std::int64_t total = 0, longest = 0;
  for (const std::int64_t n : st.len)
    total += n, longest = std::max(longest, n);
  const auto budget = static_cast<std::int64_t>(slack * static_cast<double>(total) / static_cast<double>(M * R)) + 1;
  return {M, R, std::max(budget, 2 * longest)};
}

/// Ranges of a random case: sequences `s0 + [0, s_span)`, layers `1 + [0, l_span)`, experts `2 + [0, e_span)`,
/// lengths `1 + [0, len_span)`, micro-steps `1 + [0, m_span)`, ranks `r0 + [0, r_span)`.
struct CaseRanges {
  std::uint64_t s0, s_span, l_span, e_span, len_span, m_span, r0, r_span;
};

/// A random step and a shape with 1-2x its tokens as room.
std::pair<Step, PackingShape> random_case(std::mt19937_64 &rng, const CaseRanges &c) {
  const auto draw = [&rng](std::uint64_t base, std::uint64_t span) {
    return static_cast<std::int64_t>(base + rng() % span);
  };
  const std::int64_t S = draw(c.s0, c.s_span), L = draw(1, c.l_span), E = draw(2, c.e_span);
  Step st = random_step(rng, S, L, E, draw(1, c.len_span));
  const std::int64_t M = draw(1, c.m_span), R = draw(c.r0, c.r_span);
  const PackingShape shape = shape_for(st, M, R, 1.0 + static_cast<double>(rng() % 100) / 100.0);
  return {std::move(st), shape};
}

} // namespace

TEST_CASE("pack_by_routing: valid, deterministic, never worse than the token packing or a given start (property)") {
  std::mt19937_64 rng(31);
  int strictly_better = 0, cases = 0;
  for (int round = 0; round < 40 * foremoe_test::seed_multiplier(); ++round) {
    const auto drawn = random_case(rng, {4, 60, 4, 16, 40, 6, 1, 3});
    const Step &st = drawn.first;
    const PackingShape &shape = drawn.second;
    const std::int64_t M = shape.micro_steps;
    const Packing tokens = pack_by_tokens(st.len, shape);
    check_valid(st, shape, tokens);
    const Packing routed = pack_by_routing(st.input(), shape);
    check_valid(st, shape, routed);
    const double j0 = packing_deviation(st.input(), shape, tokens), j1 = packing_deviation(st.input(), shape, routed);
    CHECK(j1 <= j0 * (1 + 1e-12) + 1e-9);
    // The deviations it reports are packing_deviation's of its start (the token packing) and its result.
    CHECK(routed.start_deviation == doctest::Approx(j0).epsilon(1e-9));
    CHECK(routed.deviation == doctest::Approx(j1).epsilon(1e-9));
    const Packing again = pack_by_routing(st.input(), shape);
    CHECK(again.micro_step == routed.micro_step);
    CHECK(again.rank == routed.rank);
    // From a trainer's own packing (here: the token packing with micro-steps rotated), never worse than it.
    Packing trainer = tokens;
    for (auto &m : trainer.micro_step)
      m = static_cast<std::int32_t>((m + 1) % M);
    const Packing from_trainer = pack_by_routing(st.input(), shape, {}, trainer);
    check_valid(st, shape, from_trainer);
    CHECK(packing_deviation(st.input(), shape, from_trainer) <=
          packing_deviation(st.input(), shape, trainer) * (1 + 1e-12) + 1e-9);
    ++cases;
    strictly_better += M > 1 && j1 < j0 * 0.999 ? 1 : 0;
  }
  // Coherent routing leaves room to improve on most steps with more than one micro-step.
  CHECK(strictly_better * 2 > cases);
}

TEST_CASE("pack_by_routing: each micro-step's ranks are dealt evenly where the budget allows (property)") {
  // Step 4: where dealing a micro-step's sequences longest first to the emptiest rank fits the budget, the fullest
  // micro-batch is no fuller than that dealing's (before step 4, best fit filled some ranks and left others empty).
  std::mt19937_64 rng(77);
  int dealt = 0;
  for (int round = 0; round < 40 * foremoe_test::seed_multiplier(); ++round) {
    const auto drawn = random_case(rng, {8, 60, 3, 12, 30, 4, 2, 4});
    const Step &st = drawn.first;
    const PackingShape &shape = drawn.second;
    const std::int64_t M = shape.micro_steps, R = shape.ranks;
    const Packing p = pack_by_routing(st.input(), shape);
    check_valid(st, shape, p);
    for (std::vector<std::int64_t> seqs : p.by_micro_step(M)) {
      std::sort(seqs.begin(), seqs.end(), [&](std::int64_t a, std::int64_t b) {
        const std::int64_t la = st.len[static_cast<std::size_t>(a)], lb = st.len[static_cast<std::size_t>(b)];
        return la != lb ? la > lb : a < b;
      });
      std::vector<std::int64_t> fill(static_cast<std::size_t>(R), 0), now(static_cast<std::size_t>(R), 0);
      for (const std::int64_t s : seqs) {
        *std::min_element(fill.begin(), fill.end()) += st.len[static_cast<std::size_t>(s)];
        now[static_cast<std::size_t>(p.rank[static_cast<std::size_t>(s)])] += st.len[static_cast<std::size_t>(s)];
      }
      const std::int64_t lpt = *std::max_element(fill.begin(), fill.end());
      if (lpt > shape.token_budget) continue;
      CHECK(*std::max_element(now.begin(), now.end()) <= lpt);
      ++dealt;
    }
  }
  CHECK(dealt > 0);
}

TEST_CASE("pack_by_routing: within a few percent of the optimum on small steps (exhaustive reference)") {
  std::mt19937_64 rng(32);
  double ratio_sum = 0;
  int optimal = 0, cases = 0;
  for (int round = 0; round < 30; ++round) {
    const std::int64_t S = 4 + static_cast<std::int64_t>(rng() % 5), M = 2 + static_cast<std::int64_t>(rng() % 2);
    const Step st = random_step(rng, S, 2, 6, 8);
    const PackingShape shape = shape_for(st, M, 1, 1.3);
    const Packing routed = pack_by_routing(st.input(), shape);
    const double j = packing_deviation(st.input(), shape, routed);
    // Every assignment of sequences to micro-steps (one rank: the budget is the micro-step's).
    double best = std::numeric_limits<double>::infinity();
    Packing p;
    p.micro_step.assign(static_cast<std::size_t>(S), 0);
    p.rank.assign(static_cast<std::size_t>(S), 0);
    const std::function<void(std::int64_t, std::vector<std::int64_t> &)> visit = [&](std::int64_t s,
                                                                                     std::vector<std::int64_t> &fill) {
      if (s == S) {
        best = std::min(best, packing_deviation(st.input(), shape, p));
        return;
      }
      for (std::int64_t m = 0; m < M; ++m) {
        if (fill[static_cast<std::size_t>(m)] + st.len[static_cast<std::size_t>(s)] > shape.token_budget) continue;
        fill[static_cast<std::size_t>(m)] += st.len[static_cast<std::size_t>(s)];
        p.micro_step[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(m);
        visit(s + 1, fill);
        fill[static_cast<std::size_t>(m)] -= st.len[static_cast<std::size_t>(s)];
      }
    };
    std::vector<std::int64_t> fill(static_cast<std::size_t>(M), 0);
    visit(0, fill);
    REQUIRE(best <= j * (1 + 1e-12) + 1e-9);
    // J is a sum of squared deviations: compare its square roots (the deviation's norm).
    const double ratio = best > 0 ? std::sqrt(j / best) : (j > 0 ? 2.0 : 1.0);
    ratio_sum += ratio;
    optimal += ratio < 1 + 1e-9 ? 1 : 0;
    ++cases;
  }
  MESSAGE("mean deviation norm over the optimum's: ", ratio_sum / cases, "; optimal in ", optimal, " of ", cases);
  CHECK(ratio_sum / cases <= 1.10);
  CHECK(optimal * 3 >= cases);
}

TEST_CASE("pack_by_routing: a placement aggregates experts into GPU columns") {
  std::mt19937_64 rng(33);
  const Step st = random_step(rng, 40, 3, 8, 20);
  const PackingShape shape = shape_for(st, 4, 2, 1.2);
  // The identity placement is the same objective as none.
  std::vector<std::int32_t> identity(static_cast<std::size_t>(st.L * st.E));
  for (std::size_t i = 0; i < identity.size(); ++i)
    identity[i] = static_cast<std::int32_t>(static_cast<std::int64_t>(i) % st.E);
  const Packing tokens = pack_by_tokens(st.len, shape);
  CHECK(packing_deviation(st.input(), shape, tokens, {identity, st.E}) ==
        doctest::Approx(packing_deviation(st.input(), shape, tokens)));
  // Two experts per GPU: the objective is over GPU loads, and routing packing lowers it.
  std::vector<std::int32_t> pairs(identity.size());
  for (std::size_t i = 0; i < pairs.size(); ++i)
    pairs[i] = identity[i] / 2;
  const PackingOptions opt{pairs, st.E / 2};
  const Packing routed = pack_by_routing(st.input(), shape, opt);
  check_valid(st, shape, routed);
  CHECK(packing_deviation(st.input(), shape, routed, opt) <= packing_deviation(st.input(), shape, tokens, opt));
  const std::vector<double> imb = packing_imbalance(st.input(), shape, routed, opt);
  CHECK(imb.size() == static_cast<std::size_t>(shape.micro_steps * st.L));
  for (const double x : imb)
    CHECK(x >= 1.0);
}

TEST_CASE("packing: bad input is an error naming the value") {
  Step st;
  st.L = 1, st.E = 2;
  st.len = {3, 2};
  st.hist = {3, 0, 1, 1};
  const PackingInput in = st.input();
  CHECK_ERROR_CONTAINS((void)pack_by_routing(in, {2, 1, 2}), "sequence 0 has 3 tokens, more than the micro-batch "
                                                             "token budget 2");
  CHECK_ERROR_CONTAINS((void)pack_by_routing(in, {0, 1, 4}), "micro_steps 0 is outside [1, 2^20]");
  CHECK_ERROR_CONTAINS((void)pack_by_routing(in, {1, 1, 4}), "5 tokens do not fit in 1 x 1 micro-batches of 4");
  CHECK_ERROR_CONTAINS((void)pack_by_tokens(std::vector<std::int64_t>{3, 0}, {2, 1, 4}), "sequence 1 has length 0");
  CHECK_ERROR_CONTAINS((void)pack_by_tokens(std::vector<std::int64_t>{3, 3, 2}, {2, 1, 4}),
                       "sequence 2 (2 tokens) fits in no micro-batch of 4 tokens");
  // A huge budget is fine: the room is a saturating product, never an overflow.
  CHECK(pack_by_routing(in, {2, 1, std::int64_t{1} << 62}).micro_step.size() == 2);
  Step bad = st;
  bad.hist = {3, 0, 1};
  CHECK_ERROR_CONTAINS((void)pack_by_routing(bad.input(), {2, 1, 4}), "histograms hold 3 values, expected");
  bad.hist = {3, 0, -1, 1};
  CHECK_ERROR_CONTAINS((void)pack_by_routing(bad.input(), {2, 1, 4}),
                       "histograms[sequence 1, layer 0, expert 0] = -1 is outside [0, 2^42]");
  const std::vector<std::int32_t> gpu_of = {0, 5};
  CHECK_ERROR_CONTAINS((void)pack_by_routing(in, {2, 1, 4}, {gpu_of, 2}), "gpu_of[layer 0, expert 1] = 5 is outside "
                                                                          "[0, 2)");
  Packing start;
  start.micro_step = {0, 2};
  start.rank = {0, 0};
  CHECK_ERROR_CONTAINS((void)pack_by_routing(in, {2, 1, 4}, {}, start),
                       "sequence 1 is placed at (micro-step 2, rank 0), outside 2 x 1");
  start.micro_step = {0, 0};
  CHECK_ERROR_CONTAINS((void)pack_by_routing(in, {2, 1, 4}, {}, start),
                       "micro-batch (micro-step 0, rank 0) holds more than 4 tokens");
  start.micro_step = {0};
  CHECK_ERROR_CONTAINS((void)pack_by_routing(in, {2, 1, 4}, {}, start), "the packing places 1 sequences");
  const std::vector<std::int64_t> huge_hist(4, std::int64_t{1} << 43);
  Step h = st;
  h.hist = huge_hist;
  CHECK_ERROR_CONTAINS((void)pack_by_routing(h.input(), {2, 1, 4}), "is outside [0, 2^42]");
}
