#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "foremoe/foremoe.hpp"
#include "foremoe/trace/readers.hpp"
#include "test_support.hpp"

using namespace foremoe;

namespace {

// Naive reference: one id at a time through the checked accessor.
LoadTensor reference_count(const RoutedView &v, const CountOptions &o) {
  const LayerMap lm = o.layer_map.empty() ? LayerMap::identity(v.num_layers()) : o.layer_map;
  std::vector<std::int64_t> mb(o.microbatch_offsets.begin(), o.microbatch_offsets.end());
  if (mb.empty()) mb = {0, v.num_tokens()};
  const int M = int(mb.size()) - 1, S = o.num_sources;
  LoadTensor out(M, lm.num_moe_layers(), o.num_experts, S);
  for (int m = 0; m < M; ++m)
    for (std::int64_t t = mb[m]; t < mb[m + 1]; ++t) {
      int src = -1;
      if (S > 0) {
        if (o.source_offsets.empty()) {
          const std::int64_t n = mb[m + 1] - mb[m];
          for (int r = 0; r < S; ++r)
            if (t >= mb[m] + n * r / S) src = r;
        } else {
          for (int r = 0; r < S; ++r)
            if (t >= o.source_offsets[std::size_t(m) * S + r]) src = r;
        }
      }
      for (int l = 0; l < v.num_layers(); ++l) {
        if (lm.moe_layer(l) < 0) continue;
        for (int k = 0; k < v.topk(); ++k) {
          const std::int64_t id = v.at(t, l, k, o.num_experts);
          if (id < 0) continue;
          ++out.at(m, lm.moe_layer(l), int(id));
          if (S > 0) ++out.at(m, lm.moe_layer(l), int(id), src);
        }
      }
    }
  return out;
}

std::vector<std::int64_t> random_offsets(std::mt19937_64 &rng, std::int64_t n, int parts) {
  std::vector<std::int64_t> o{0};
  for (int i = 1; i < parts; ++i)
    o.push_back(n == 0 ? 0 : std::int64_t(rng() % std::uint64_t(n + 1)));
  o.push_back(n);
  std::sort(o.begin(), o.end());
  return o;
}

template <class T> void property_round(std::mt19937_64 &rng) {
  const std::int64_t T_ = std::int64_t(rng() % 300);
  const int L = 1 + int(rng() % 6), K = 1 + int(rng() % 4);
  int max_e = 120;
  if constexpr (sizeof(T) == 1 && std::is_unsigned_v<T>) max_e = 255; // keep 255 as "no route"
  const int E = K + int(rng() % std::uint64_t(max_e - K));
  std::vector<T> ids(std::size_t(T_) * L * K);
  for (auto &x : ids) {
    const auto r = rng() % 10;
    if (r == 0)
      x = static_cast<T>(-1); // no route (all-ones for unsigned)
    else
      x = static_cast<T>(rng() % std::uint64_t(E));
  }
  CountOptions o;
  o.num_experts = E;
  const auto mb = random_offsets(rng, T_, 1 + int(rng() % 5));
  if (rng() % 4 != 0) o.microbatch_offsets = mb;
  std::vector<int> lm;
  if (rng() % 2 == 0 && L > 1) {
    for (int l = 0, next = 0; l < L; ++l)
      lm.push_back(rng() % 3 == 0 && !(l == L - 1 && next == 0) ? -1 : next++);
    o.layer_map = LayerMap(lm);
  }
  std::vector<std::int64_t> so;
  if (rng() % 2 == 0) {
    o.num_sources = 1 + int(rng() % 4);
    if (rng() % 2 == 0) {
      std::vector<std::int64_t> m2(o.microbatch_offsets.begin(), o.microbatch_offsets.end());
      if (m2.empty()) m2 = {0, T_};
      for (std::size_t m = 0; m + 1 < m2.size(); ++m) {
        auto part = random_offsets(rng, m2[m + 1] - m2[m], o.num_sources);
        for (int r = 0; r < o.num_sources; ++r)
          so.push_back(m2[m] + part[r]);
      }
      so.push_back(T_);
      o.source_offsets = so;
    }
  }
  const RoutedView view(std::span<const T>(ids), T_, L, K);
  const LoadTensor fast = count_loads(view, o);
  fast.validate();
  CHECK(fast == reference_count(view, o));

  // The same ids seen through a strided (Fortran-order) view count the same.
  std::vector<T> fortran(ids.size());
  for (std::int64_t t = 0; t < T_; ++t)
    for (int l = 0; l < L; ++l)
      for (int k = 0; k < K; ++k)
        fortran[std::size_t(t) + std::size_t(T_) * (std::size_t(l) + std::size_t(L) * k)] =
            ids[(std::size_t(t) * L + l) * K + k];
  const RoutedView strided(fortran.data(), id_dtype_of<T>(), T_, L, K, {1, T_, T_ * L});
  CHECK(count_loads(strided, o) == fast);

  // Masked counting equals counting the unmasked tokens with the masked ones set to "no route".
  std::vector<std::uint8_t> mask(static_cast<std::size_t>(T_));
  const auto keep = 1 + rng() % 4; // from all kept to about a quarter masked
  for (auto &b : mask)
    b = static_cast<std::uint8_t>(rng() % keep == 0 ? 0 : 1 + rng() % 255);
  std::vector<T> unrouted = ids;
  for (std::int64_t t = 0; t < T_; ++t)
    if (mask[std::size_t(t)] == 0)
      for (int j = 0; j < L * K; ++j)
        unrouted[std::size_t(t) * L * K + j] = static_cast<T>(-1);
  CountOptions om = o;
  om.mask = mask;
  const LoadTensor masked = count_loads(view, om);
  masked.validate();
  CHECK(masked == count_loads(RoutedView(std::span<const T>(unrouted), T_, L, K), o));
  CHECK(count_loads(strided, om) == masked);
  // A bad id under a masked token is never read, so it cannot fail.
  if (T_ > 0 && mask[0] == 0) {
    std::vector<T> bad = ids;
    bad[0] = static_cast<T>(E < 127 ? E : 0);
    if (bad[0] == static_cast<T>(E)) CHECK(count_loads(RoutedView(std::span<const T>(bad), T_, L, K), om) == masked);
  }
}

} // namespace

TEST_CASE_TEMPLATE("count_loads equals the naive reference on random traces (property)", T, std::int8_t, std::uint8_t,
                   std::int16_t, std::uint16_t, std::int32_t, std::int64_t) {
  std::mt19937_64 rng(1234 + sizeof(T) * 7 + std::is_signed_v<T>);
  const int rounds = 60 * foremoe_test::seed_multiplier();
  for (int i = 0; i < rounds; ++i)
    property_round<T>(rng);
}

TEST_CASE("count_loads totals: every routed id is counted exactly once") {
  std::vector<std::uint16_t> ids(1000 * 4 * 8);
  std::mt19937_64 rng(7);
  for (auto &x : ids)
    x = std::uint16_t(rng() % 64);
  std::vector<std::int64_t> mb{0, 100, 100, 700, 1000};
  CountOptions o;
  o.num_experts = 64;
  o.microbatch_offsets = mb;
  const LoadTensor t = count_loads(std::span<const std::uint16_t>(ids), 1000, 4, 8, o);
  CHECK(t.num_micro_steps() == 4);
  for (int l = 0; l < 4; ++l) {
    CHECK(t.layer_total(0, l) == 100 * 8);
    CHECK(t.layer_total(1, l) == 0);
    CHECK(t.layer_total(2, l) == 600 * 8);
    CHECK(t.layer_total(3, l) == 300 * 8);
  }
}

TEST_CASE("uint8 with 256 experts: 255 is an expert, not 'no route'") {
  std::vector<std::uint8_t> ids{255, 0, 255, 1};
  CountOptions o;
  o.num_experts = 256;
  const LoadTensor t = count_loads(std::span<const std::uint8_t>(ids), 2, 1, 2, o);
  CHECK(t.at(0, 0, 255) == 2);
  o.num_experts = 200;
  const LoadTensor u = count_loads(std::span<const std::uint8_t>(ids), 2, 1, 2, o);
  CHECK(u.layer_total(0, 0) == 2); // 255 means no route here
}

TEST_CASE("count_loads rejects bad ids, offsets and maps with clear messages") {
  std::vector<std::int32_t> ids(10 * 2 * 2, 1);
  CountOptions o;
  o.num_experts = 4;
  ids[(7 * 2 + 1) * 2 + 1] = 9;
  const std::span<const std::int32_t> s(ids);
  CHECK_THROWS_WITH_AS((void)count_loads(s, 10, 2, 2, o),
                       doctest::Contains("expert id 9 at token 7, layer 1, k 1 is outside [0, 4)"), Error);
  ids[(7 * 2 + 1) * 2 + 1] = -2;
  CHECK_THROWS_WITH_AS((void)count_loads(s, 10, 2, 2, o), doctest::Contains("expert id -2"), Error);
  ids[(7 * 2 + 1) * 2 + 1] = -1;
  CHECK(count_loads(s, 10, 2, 2, o).layer_total(0, 1) == 19);

  std::vector<std::int64_t> bad1{0, 5, 3, 10};
  o.microbatch_offsets = bad1;
  CHECK_THROWS_WITH_AS((void)count_loads(s, 10, 2, 2, o), doctest::Contains("decrease at index 2: 5 then 3"), Error);
  std::vector<std::int64_t> bad2{0, 5, 9};
  o.microbatch_offsets = bad2;
  CHECK_THROWS_WITH_AS((void)count_loads(s, 10, 2, 2, o), doctest::Contains("end at 9 but the trace has 10"), Error);
  std::vector<std::int64_t> bad3{1, 10};
  o.microbatch_offsets = bad3;
  CHECK_THROWS_WITH_AS((void)count_loads(s, 10, 2, 2, o), doctest::Contains("[0] must be 0, got 1"), Error);
  o.microbatch_offsets = {};
  o.layer_map = LayerMap::identity(3);
  CHECK_THROWS_WITH_AS((void)count_loads(s, 10, 2, 2, o), doctest::Contains("covers 3 trace layers"), Error);
  o.layer_map = {};
  o.num_sources = 2;
  std::vector<std::int64_t> so{0, 4};
  o.source_offsets = so;
  CHECK_THROWS_WITH_AS((void)count_loads(s, 10, 2, 2, o), doctest::Contains("2 source_offsets"), Error);
  // A source count whose split would not fit is refused before anything is sized from it (the even source offsets
  // of a billion sources took 8 GB and seconds before the output's own check refused it).
  o.source_offsets = {};
  o.num_sources = 1000000000;
  CHECK_THROWS_WITH_AS((void)count_loads(s, 10, 2, 2, o),
                       doctest::Contains("1000000001 (sources + 1) = 8000000008 load cells is beyond"), Error);
  o.num_sources = std::numeric_limits<int>::max(); // sources + 1 in int64, not an int overflow
  CHECK_THROWS_WITH_AS((void)count_loads(s, 10, 2, 2, o), doctest::Contains("2147483648 (sources + 1)"), Error);
  o.num_sources = 0;
  CHECK_THROWS_WITH_AS((void)count_loads(std::span<const std::int32_t>(ids.data(), 7), 10, 2, 2, CountOptions{4}),
                       doctest::Contains("7 ids for shape [10, 2, 2]"), Error);
  CHECK_THROWS_WITH_AS(LayerMap({0, 2}), doctest::Contains("maps to MoE layer 2"), Error);
  CHECK_THROWS_WITH_AS(LayerMap({-1, -1}), doctest::Contains("no MoE layer"), Error);
}

TEST_CASE("LayerMap presets") {
  const LayerMap ds = LayerMap::dense_prefix(61, 3);
  CHECK(ds.num_moe_layers() == 58);
  CHECK(ds.moe_layer(2) == -1);
  CHECK(ds.moe_layer(3) == 0);
  const LayerMap il = LayerMap::interleaved(8, 2, 1);
  CHECK(il.num_moe_layers() == 4);
  CHECK(il.moe_layer(7) == 3);
  CHECK(il.moe_layer(0) == -1);
}

TEST_CASE("count_loads mask: wrong length is refused; all-zero mask counts nothing") {
  std::vector<std::int16_t> ids{0, 1, 2, 3, 1, 1};
  CountOptions o;
  o.num_experts = 4;
  std::vector<std::uint8_t> mask{1, 0};
  o.mask = mask;
  CHECK_THROWS_WITH_AS((void)count_loads(std::span<const std::int16_t>(ids), 3, 1, 2, o),
                       doctest::Contains("mask has 2 entries but the trace has 3 tokens"), Error);
  std::vector<std::uint8_t> zeros(3, 0);
  o.mask = zeros;
  const LoadTensor none = count_loads(std::span<const std::int16_t>(ids), 3, 1, 2, o);
  for (int e = 0; e < 4; ++e)
    CHECK(none.at(0, 0, e) == 0);
  std::vector<std::uint8_t> last{0, 0, 1};
  o.mask = last;
  const LoadTensor one = count_loads(std::span<const std::int16_t>(ids), 3, 1, 2, o);
  CHECK(one.at(0, 0, 1) == 2);
  CHECK(one.at(0, 0, 0) == 0);
}
