// Token -> physical slot mapping: the CPU reference against an independent naive mapping on plans from the real
// planner, its invariants, the runtime's host backend against the reference, and bad input.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "foremoe/foremoe.hpp"
#include "foremoe/plan/token_map.hpp"
#include "foremoe/runtime/runtime.hpp"
#include "foremoe/runtime/token_map.hpp"
#include "test_support.hpp"

using namespace foremoe;
namespace rt = foremoe::runtime;

namespace {

/// A random micro-step: skewed routed ids (hot experts get replicas), its loads and the planner's plans.
struct Scenario {
  Topology topo;
  int num_experts = 0, num_layers = 0, topk = 0;
  std::int64_t num_tokens = 0;
  std::vector<std::int32_t> ids;            ///< `[T][L][K]`, -1 = no route
  std::vector<std::int64_t> source_offsets; ///< `[G + 1]`
  LoadTensor loads;                         ///< with the per-source split
  std::vector<LayerPlan> plans;
};

Scenario make_scenario(std::mt19937_64 &rng) {
  Scenario s;
  const int num_nodes = 1 + int(rng() % 2), gpn = 1 + int(rng() % 4);
  const int num_gpus = num_nodes * gpn;
  s.num_experts = 2 + int(rng() % 40);
  const int owners = (s.num_experts + num_gpus - 1) / num_gpus;
  s.topo = Topology{num_nodes, gpn, owners + int(rng() % 4)};
  s.num_layers = 1 + int(rng() % 3);
  s.topk = 1 + int(rng() % std::min(4, s.num_experts));
  s.num_tokens = std::int64_t(rng() % 3000);
  s.ids.resize(std::size_t(s.num_tokens) * s.num_layers * s.topk);
  std::vector<double> weight(std::size_t(s.num_experts));
  for (auto &w : weight)
    w = std::pow(double(rng() % 1000 + 1), 1.5);
  std::discrete_distribution<int> pick(weight.begin(), weight.end());
  for (std::int64_t t = 0; t < s.num_tokens; ++t)
    for (int l = 0; l < s.num_layers; ++l)
      for (int k = 0; k < s.topk; ++k)
        s.ids[(std::size_t(t) * s.num_layers + l) * s.topk + k] = rng() % 11 == 0 ? -1 : pick(rng);
  s.source_offsets = {0};
  for (int g = 0; g < num_gpus - 1; ++g)
    s.source_offsets.push_back(s.num_tokens == 0 ? 0 : std::int64_t(rng() % (s.num_tokens + 1)));
  s.source_offsets.push_back(s.num_tokens);
  std::sort(s.source_offsets.begin(), s.source_offsets.end());
  CountOptions o;
  o.num_experts = s.num_experts;
  o.num_sources = num_gpus;
  o.source_offsets = s.source_offsets;
  s.loads = count_loads(std::span<const std::int32_t>(s.ids), s.num_tokens, s.num_layers, s.topk, o);
  PlannerOptions popts;
  popts.strategy = rng() % 4 == 0 ? "eplb-oracle" : "foremoe";
  Planner planner(s.num_layers, s.num_experts, s.topo, popts);
  s.plans = planner.plan(s.loads, 0);
  return s;
}

/// The rule spelled out directly: the i-th occurrence of (source, expert) goes to the copy, in ascending physical
/// order, whose cumulative range of `split[slot][source]` contains i.
std::vector<std::int32_t> naive_map(const LayerPlacement &p, const std::vector<std::int64_t> &split, int num_sources,
                                    const std::vector<std::int32_t> &ids, std::int64_t num_tokens, int num_layers,
                                    int topk, int l, const std::vector<std::int64_t> &so) {
  std::vector<std::int32_t> out(std::size_t(num_tokens) * topk, -1);
  std::vector<std::int64_t> seen(std::size_t(num_sources) * p.num_experts(), 0);
  for (std::int64_t t = 0; t < num_tokens; ++t) {
    int src = 0;
    while (!(so[src] <= t && t < so[src + 1]))
      ++src;
    for (int k = 0; k < topk; ++k) {
      const std::int32_t e = ids[(std::size_t(t) * num_layers + l) * topk + k];
      if (e < 0) continue;
      const std::int64_t i = seen[std::size_t(src) * p.num_experts() + e]++;
      std::int64_t begin = 0;
      for (int slot = 0; slot < p.num_slots(); ++slot) {
        if (p.phys_to_log()[slot] != e) continue;
        const std::int64_t n = split[std::size_t(slot) * num_sources + src];
        if (i >= begin && i < begin + n) {
          out[std::size_t(t) * topk + k] = slot;
          break;
        }
        begin += n;
      }
    }
  }
  return out;
}

template <class T> std::vector<T> cast_ids(const std::vector<std::int32_t> &ids) {
  std::vector<T> out(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i)
    out[i] = static_cast<T>(ids[i]);
  return out;
}

} // namespace

TEST_CASE("token map: the reference follows the plan's split exactly on planner plans (property)") {
  std::mt19937_64 rng(2024);
  const int rounds = 60 * foremoe_test::seed_multiplier();
  for (int it = 0; it < rounds; ++it) {
    const Scenario s = make_scenario(rng);
    const RoutedView view(std::span<const std::int32_t>(s.ids), s.num_tokens, s.num_layers, s.topk);
    for (int l = 0; l < s.num_layers; ++l) {
      const LayerPlan &plan = s.plans[l];
      const auto got = map_tokens(plan, view, l);
      REQUIRE(got.size() == std::size_t(s.num_tokens) * s.topk);
      std::vector<std::int64_t> per_slot(plan.slot_tokens.size(), 0);
      for (std::int64_t t = 0; t < s.num_tokens; ++t)
        for (int k = 0; k < s.topk; ++k) {
          const std::int32_t e = s.ids[(std::size_t(t) * s.num_layers + l) * s.topk + k];
          const std::int32_t slot = got[std::size_t(t) * s.topk + k];
          if (e < 0) {
            CHECK(slot == -1);
            continue;
          }
          REQUIRE(slot >= 0);
          REQUIRE(slot < plan.placement.num_slots());
          CHECK(plan.placement.phys_to_log()[slot] == e); // the slot hosts the token's expert
          ++per_slot[slot];
        }
      CHECK(per_slot == plan.slot_tokens); // every copy gets exactly its share
      const std::vector<std::int64_t> whole{0, s.num_tokens};
      CHECK(got == naive_map(plan.placement, plan.slot_tokens, 1, s.ids, s.num_tokens, s.num_layers, s.topk, l, whole));
      CHECK(map_tokens(plan, view, l) == got); // deterministic
    }
  }
}

TEST_CASE("token map: per-source split from split_by_source maps each source's tokens to its ranges (property)") {
  std::mt19937_64 rng(77);
  const int rounds = 40 * foremoe_test::seed_multiplier();
  for (int it = 0; it < rounds; ++it) {
    const Scenario s = make_scenario(rng);
    const int num_sources = s.topo.num_gpus();
    const RoutedView view(std::span<const std::int32_t>(s.ids), s.num_tokens, s.num_layers, s.topk);
    for (int l = 0; l < s.num_layers; ++l) {
      const LayerPlan &plan = s.plans[l];
      const auto src_loads = s.loads.layer_by_source(0, l);
      const auto split =
          split_by_source(plan.placement, plan.slot_tokens, src_loads, num_sources, s.topo.gpus_per_node);
      const TokenRanges ranges = token_ranges(plan.placement, split, num_sources);
      std::vector<std::int32_t> got(std::size_t(s.num_tokens) * s.topk, -5);
      map_tokens(ranges, view, l, got, s.source_offsets);
      std::vector<std::int64_t> per(split.size(), 0);
      for (int src = 0; src < num_sources; ++src)
        for (std::int64_t t = s.source_offsets[src]; t < s.source_offsets[src + 1]; ++t)
          for (int k = 0; k < s.topk; ++k) {
            const std::int32_t e = s.ids[(std::size_t(t) * s.num_layers + l) * s.topk + k];
            const std::int32_t slot = got[std::size_t(t) * s.topk + k];
            if (e < 0) {
              CHECK(slot == -1);
              continue;
            }
            REQUIRE(slot >= 0);
            CHECK(plan.placement.phys_to_log()[slot] == e);
            ++per[std::size_t(slot) * num_sources + src];
          }
      CHECK(per == split);
      CHECK(got == naive_map(plan.placement, split, num_sources, s.ids, s.num_tokens, s.num_layers, s.topk, l,
                             s.source_offsets));
      // Summed over sources the copies still get the plan's totals.
      std::vector<std::int64_t> per_slot(plan.slot_tokens.size(), 0);
      for (std::size_t i = 0; i < per.size(); ++i)
        per_slot[i / num_sources] += per[i];
      CHECK(per_slot == plan.slot_tokens);
    }
  }
}

TEST_CASE("token map: the micro-step version maps every MoE layer and leaves dense layers -1") {
  std::mt19937_64 rng(5);
  for (int it = 0; it < 10 * foremoe_test::seed_multiplier(); ++it) {
    const Scenario s = make_scenario(rng);
    // Trace with a dense layer in front (its ids are junk, never read) and the MoE layers after it.
    const int trace_layers = s.num_layers + 1;
    std::vector<std::int32_t> ids(std::size_t(s.num_tokens) * trace_layers * s.topk, 12345);
    for (std::int64_t t = 0; t < s.num_tokens; ++t)
      for (int l = 0; l < s.num_layers; ++l)
        std::copy_n(&s.ids[(std::size_t(t) * s.num_layers + l) * s.topk], s.topk,
                    &ids[(std::size_t(t) * trace_layers + l + 1) * s.topk]);
    const RoutedView trace(std::span<const std::int32_t>(ids), s.num_tokens, trace_layers, s.topk);
    const auto got = map_tokens(std::span<const LayerPlan>(s.plans), trace, LayerMap::dense_prefix(trace_layers, 1));
    const RoutedView moe(std::span<const std::int32_t>(s.ids), s.num_tokens, s.num_layers, s.topk);
    for (int l = 0; l < trace_layers; ++l) {
      const auto want = l == 0 ? std::vector<std::int32_t>(std::size_t(s.num_tokens) * s.topk, -1)
                               : map_tokens(s.plans[l - 1], moe, l - 1);
      for (std::int64_t t = 0; t < s.num_tokens; ++t)
        for (int k = 0; k < s.topk; ++k)
          REQUIRE(got[(std::size_t(t) * trace_layers + l) * s.topk + k] == want[std::size_t(t) * s.topk + k]);
    }
  }
}

TEST_CASE("token map: a hand-computed split") {
  // 2 GPUs x 2 slots; expert 0 on GPU 0 slot 0 (3 tokens) and GPU 1 slot 1 (2 tokens), expert 1 on GPU 0 slot 1.
  LayerPlacement p(2, 2, 2);
  p.slot(0, 0) = 0;
  p.slot(0, 1) = 1;
  p.slot(1, 1) = 0;
  const std::vector<std::int64_t> slot_tokens{3, 1, 0, 2};
  const std::vector<std::int8_t> ids{0, 1, 0, -1, 0, 0, 0, -1}; // [4 tokens][1 layer][top-2]
  std::vector<std::int32_t> out(8);
  map_tokens(token_ranges(p, slot_tokens), RoutedView(std::span<const std::int8_t>(ids), 4, 1, 2), 0, out);
  CHECK(out == std::vector<std::int32_t>{0, 1, 0, -1, 0, 3, 3, -1});
  // Reversed strides (tokens in the opposite order) read the same ids through the view.
  const RoutedView rev(ids.data() + 6, IdDtype::i8, 4, 1, 2, {-2, 2, 1});
  map_tokens(token_ranges(p, slot_tokens), rev, 0, out);
  CHECK(out == std::vector<std::int32_t>{0, -1, 0, 0, 3, -1, 3, 1});
}

TEST_CASE("token map: bad input is named") {
  LayerPlacement p(1, 2, 2);
  p.slot(0, 0) = 0;
  p.slot(0, 1) = 1;
  std::vector<std::int64_t> slot_tokens{2, 1};
  std::vector<std::int32_t> ids{0, 1, 0, 9};
  std::vector<std::int32_t> out(4);
  const RoutedView view(std::span<const std::int32_t>(ids), 2, 1, 2);
  CHECK_THROWS_WITH_AS(map_tokens(token_ranges(p, slot_tokens), view, 0, out),
                       doctest::Contains("expert id 9 at token 1, layer 0, k 1 is outside [0, 2)"), Error);
  ids[3] = 0; // expert 0 now has 3 routed tokens, the plan gives 2
  CHECK_THROWS_WITH_AS(map_tokens(token_ranges(p, slot_tokens), view, 0, out),
                       doctest::Contains("expert 0 has 3 routed tokens but the plan gives its 1 copies 2"), Error);
  ids[3] = -1; // expert 0: 2 as planned, expert 1: 1 as planned
  map_tokens(token_ranges(p, slot_tokens), view, 0, out);
  CHECK(out == std::vector<std::int32_t>{0, 1, 0, -1});
  ids[1] = -1; // expert 1 now has 0 routed tokens, the plan gives 1
  CHECK_THROWS_WITH_AS(map_tokens(token_ranges(p, slot_tokens), view, 0, out),
                       doctest::Contains("expert 1 has 0 routed tokens but the plan gives its 1 copies 1"), Error);
  CHECK_THROWS_WITH_AS(map_tokens(token_ranges(p, slot_tokens), view, 1, out), doctest::Contains("layer 1 outside"),
                       Error);
  std::vector<std::int32_t> short_out(3);
  CHECK_THROWS_WITH_AS(map_tokens(token_ranges(p, slot_tokens), view, 0, short_out),
                       doctest::Contains("output has 3 entries"), Error);
  CHECK_THROWS_WITH_AS((void)token_ranges(p, std::vector<std::int64_t>{1, -1}),
                       doctest::Contains("slot 1 source 0 gets a negative token count -1"), Error);
  CHECK_THROWS_WITH_AS((void)token_ranges(p, std::vector<std::int64_t>{1}), doctest::Contains("1 slot token counts"),
                       Error);
  LayerPlacement with_empty(1, 3, 2);
  with_empty.slot(0, 0) = 0;
  with_empty.slot(0, 1) = 1;
  CHECK_THROWS_WITH_AS((void)token_ranges(with_empty, std::vector<std::int64_t>{1, 1, 4}),
                       doctest::Contains("empty slot 2 gets 4 tokens"), Error);
  CHECK_THROWS_WITH_AS((void)token_ranges(std::vector<std::int32_t>{0, 5}, 2, slot_tokens),
                       doctest::Contains("slot 1 holds expert id 5"), Error);
  // Per source: bad offsets and a per-source mismatch name the source.
  const TokenRanges two = token_ranges(p, std::vector<std::int64_t>{1, 1, 1, 0}, 2); // [slot][source]
  ids = {0, 1, 0, -1};
  CHECK_THROWS_WITH_AS(map_tokens(two, view, 0, out, std::vector<std::int64_t>{0, 2}),
                       doctest::Contains("2 source offsets for 2 sources"), Error);
  CHECK_THROWS_WITH_AS(map_tokens(two, view, 0, out, std::vector<std::int64_t>{0, 3, 2}), doctest::Contains("decrease"),
                       Error);
  map_tokens(two, view, 0, out, std::vector<std::int64_t>{0, 1, 2});
  CHECK(out == std::vector<std::int32_t>{0, 1, 0, -1});
  CHECK_THROWS_WITH_AS(map_tokens(two, view, 0, out, std::vector<std::int64_t>{0, 2, 2}),
                       doctest::Contains("expert 0 has 2 routed tokens from source 0 but the plan gives its 1 copies 1 "
                                         "from that source"),
                       Error);
}

TEST_CASE("token map: uint8 ids with 256 experts treat 255 as an expert, with fewer as no route") {
  LayerPlacement p(1, 256, 256);
  for (int e = 0; e < 256; ++e)
    p.slot(0, e) = 255 - e;
  std::vector<std::int64_t> slot_tokens(256, 0);
  slot_tokens[0] = 1;   // expert 255
  slot_tokens[255] = 1; // expert 0
  const std::vector<std::uint8_t> ids{255, 0};
  std::vector<std::int32_t> out(2);
  map_tokens(token_ranges(p, slot_tokens), RoutedView(std::span<const std::uint8_t>(ids), 2, 1, 1), 0, out);
  CHECK(out == std::vector<std::int32_t>{0, 255});
  LayerPlacement q(1, 2, 2);
  q.slot(0, 0) = 1;
  q.slot(0, 1) = 0;
  map_tokens(token_ranges(q, std::vector<std::int64_t>{0, 1}), RoutedView(std::span<const std::uint8_t>(ids), 2, 1, 1),
             0, out);
  CHECK(out == std::vector<std::int32_t>{-1, 1});
}

TEST_CASE_TEMPLATE("runtime host token map equals the reference (property)", T, std::int8_t, std::uint8_t, std::int16_t,
                   std::uint16_t, std::int32_t, std::int64_t) {
  std::mt19937_64 rng(31 + sizeof(T) + std::is_signed_v<T>);
  const int rounds = 15 * foremoe_test::seed_multiplier();
  for (int it = 0; it < rounds; ++it) {
    const Scenario s = make_scenario(rng);
    const auto ids = cast_ids<T>(s.ids);
    const RoutedView view(std::span<const T>(ids), s.num_tokens, s.num_layers, s.topk);
    const bool by_source = rng() % 2 == 0;
    const int num_sources = by_source ? s.topo.num_gpus() : 1;
    for (int l = 0; l < s.num_layers; ++l) {
      const LayerPlan &plan = s.plans[l];
      const auto split = by_source ? split_by_source(plan.placement, plan.slot_tokens, s.loads.layer_by_source(0, l),
                                                     num_sources, s.topo.gpus_per_node)
                                   : plan.slot_tokens;
      std::vector<std::int32_t> want(std::size_t(s.num_tokens) * s.topk);
      const std::span<const std::int64_t> so =
          by_source ? std::span<const std::int64_t>(s.source_offsets) : std::span<const std::int64_t>{};
      map_tokens(token_ranges(plan.placement, split, num_sources), view, l, want, so);

      rt::MapRequest req;
      req.ids = ids.data();
      req.dtype = id_dtype_of<T>();
      req.num_tokens = s.num_tokens;
      req.num_layers = s.num_layers;
      req.topk = s.topk;
      req.layer_idx = l;
      req.num_experts = s.num_experts;
      req.slot_expert = plan.placement.phys_to_log();
      req.slot_tokens = split;
      req.num_sources = num_sources;
      req.source_offsets = so;
      std::vector<std::int32_t> got(want.size() + 1, -7); // one guard entry past the end
      const rt::Status st = rt::map_tokens(rt::Backend::host, req, std::span(got).first(want.size()));
      REQUIRE_MESSAGE(st.ok(), st.to_string());
      CHECK(std::equal(want.begin(), want.end(), got.begin()));
      CHECK(got.back() == -7);
    }
  }
}

TEST_CASE("runtime token map reports bad input as statuses, never throws") {
  std::vector<std::int16_t> ids{0, 1, 0, 9};
  const std::vector<std::int32_t> slot_expert{0, 1};
  std::vector<std::int64_t> slot_tokens{2, 1};
  rt::MapRequest req;
  req.ids = ids.data();
  req.dtype = IdDtype::i16;
  req.num_tokens = 2;
  req.num_layers = 1;
  req.topk = 2;
  req.num_experts = 2;
  req.slot_expert = slot_expert;
  req.slot_tokens = slot_tokens;
  std::vector<std::int32_t> out(4);
  rt::Status st = rt::map_tokens(rt::Backend::host, req, out);
  CHECK(st.code() == rt::StatusCode::invalid_argument);
  CHECK(st.message().find("expert id 9 at token 1, layer 0, k 1") != std::string::npos);
  ids[3] = 0;
  st = rt::map_tokens(rt::Backend::host, req, out);
  CHECK(st.code() == rt::StatusCode::invalid_argument);
  CHECK(st.message().find("expert 0 has 3 routed tokens but the plan gives its 1 copies 2") != std::string::npos);
  ids[3] = -1;
  REQUIRE(rt::map_tokens(rt::Backend::host, req, out).ok());
  CHECK(out == std::vector<std::int32_t>{0, 1, 0, -1});

  auto expect_invalid = [&](rt::MapRequest r, const char *text, std::span<std::int32_t> o) {
    const rt::Status s = rt::map_tokens(rt::Backend::host, r, o);
    CHECK(s.code() == rt::StatusCode::invalid_argument);
    CHECK_MESSAGE(s.message().find(text) != std::string::npos, s.message());
    CHECK(s.message().rfind("map_tokens: ", 0) == 0);
  };
  expect_invalid(req, "null output", {});
  rt::MapRequest r = req;
  r.layer_idx = 1;
  expect_invalid(r, "layer_idx 1 outside [0, 1)", out);
  r = req;
  r.num_experts = 0;
  expect_invalid(r, "num_experts must be positive", out);
  r = req;
  r.slot_tokens = std::span<const std::int64_t>(slot_tokens.data(), 1);
  expect_invalid(r, "1 slot token counts for 2 slots", out);
  r = req;
  r.num_sources = 2;
  expect_invalid(r, "2 slot token counts for 2 slots x 2 sources", out);
  r = req;
  r.num_sources = 0;
  expect_invalid(r, "num_sources must be positive", out);
  r = req;
  const std::vector<std::int64_t> end_wrong{0, 3};
  r.source_offsets = end_wrong;
  expect_invalid(r, "end at 3 but the trace has 2 tokens", out);
  r = req;
  r.ids = nullptr;
  expect_invalid(r, "null data", out);
  r = req;
  r.topk = 0;
  expect_invalid(r, "topk must be positive", out);
}

TEST_CASE("runtime token map: the CUDA backend is unavailable without a device, never crashes") {
  const rt::BuildInfo info = rt::build_info();
  if (info.num_devices > 0) {
    MESSAGE("a CUDA device is present: the CUDA backend is compared in gpu_test_token_map");
    return;
  }
  std::vector<std::int32_t> ids{0, 1};
  const std::vector<std::int32_t> slot_expert{0, 1};
  const std::vector<std::int64_t> slot_tokens{1, 1};
  rt::MapRequest req;
  req.ids = ids.data();
  req.num_tokens = 1;
  req.num_layers = 1;
  req.topk = 2;
  req.num_experts = 2;
  req.slot_expert = slot_expert;
  req.slot_tokens = slot_tokens;
  std::vector<std::int32_t> out(2, -9);
  const rt::Status st = rt::map_tokens(rt::Backend::cuda, req, out);
  CHECK(st.code() == rt::StatusCode::unavailable);
  CHECK(out == std::vector<std::int32_t>{-9, -9});
  CHECK(rt::map_tokens(static_cast<rt::Backend>(7), req, out).code() == rt::StatusCode::invalid_argument);
}
