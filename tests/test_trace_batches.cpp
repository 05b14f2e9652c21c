// The in-memory trainer formats (foremoe/trace/batch_formats/): the registry lists exactly the files present, each
// format counts random batches as a direct count of the same tokens does (property), and every bad layout is an
// error naming the value. A new in-memory format is one header plus its test case here.

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "foremoe/trace/batch_formats/builtin.hpp"
#include "test_support.hpp"

using namespace foremoe;
namespace fs = std::filesystem;

namespace {

/// The in-memory formats with a test case below, by name.
constexpr std::array<const char *, 3> tested_formats = {"megatron", "slime", "verl"};

/// A message fragment built from parts, for CHECK_ERROR_CONTAINS.
template <class... P> doctest::String msg(const P &...parts) { return detail::concat(parts...).c_str(); }

int rounds() { return 30 * foremoe_test::seed_multiplier(); }

/// Direct count: `loads[m][l][e]` += 1 for every routed id of a token.
struct Oracle {
  int M, L, E;
  std::vector<std::int64_t> v;
  Oracle(int m, int l, int e) : M(m), L(l), E(e), v(static_cast<std::size_t>(m) * l * e) {}
  void add(int m, int l, std::int64_t id) {
    if (id >= 0) ++v[(static_cast<std::size_t>(m) * L + l) * E + static_cast<std::size_t>(id)];
  }
};

void check_equal(const LoadTensor &got, const Oracle &want) {
  REQUIRE(got.num_micro_steps() == want.M);
  REQUIRE(got.num_layers() == want.L);
  REQUIRE(got.num_experts() == want.E);
  for (int m = 0; m < want.M; ++m)
    for (int l = 0; l < want.L; ++l)
      for (int e = 0; e < want.E; ++e)
        REQUIRE(got.layer(m, l)[e] == want.v[(static_cast<std::size_t>(m) * want.L + l) * want.E + e]);
}

/// Ids in [-1, E) (-1 about one in ten).
std::int64_t random_id(std::mt19937_64 &rng, int E) {
  return rng() % 10 == 0 ? -1 : static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(E));
}

/// A random partition of `n` items into micro-batches: a size, or shuffled index lists.
struct Partition {
  MicroBatches spec;
  std::vector<std::vector<std::int64_t>> groups;
  std::vector<std::vector<std::int64_t>> storage; // the lists' values
};
Partition random_partition(std::mt19937_64 &rng, std::int64_t n) {
  Partition p;
  if (rng() % 3 == 0) {
    const std::int64_t size = 1 + static_cast<std::int64_t>(rng() % 4);
    p.spec = MicroBatches::of_size(size);
    for (std::int64_t i = 0; i < n; i += size) {
      auto &g = p.groups.emplace_back();
      for (std::int64_t j = i; j < std::min(n, i + size); ++j)
        g.push_back(j);
    }
    if (p.groups.empty()) p.groups.emplace_back();
    return p;
  }
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const std::size_t num = 1 + rng() % 4;
  p.storage.resize(num);
  for (const std::int64_t i : order)
    p.storage[rng() % num].push_back(i);
  std::vector<ArrayRef> lists;
  for (const auto &s : p.storage)
    lists.push_back(array_ref(std::span<const std::int64_t>(s), {static_cast<std::int64_t>(s.size())}));
  p.spec = MicroBatches::of_lists(std::move(lists));
  p.groups = p.storage;
  return p;
}

/// verl's batch: ids `[bs, seq, L, K]` left padded with expert 0, the 0/1 mask, possibly with rows spaced apart
/// (`pitch` > seq: a slice of a wider buffer, so the rows are separate parts).
struct VerlBatch {
  std::int64_t bs, seq, pitch;
  int L, K, E;
  std::vector<std::int16_t> ids; // [bs][pitch][L][K]
  std::vector<std::uint8_t> mask;
  [[nodiscard]] ArrayRef ids_ref() const {
    ArrayRef a = array_ref(std::span<const std::int16_t>(ids), {bs, pitch, L, K});
    a.shape[1] = seq;
    return a;
  }
  [[nodiscard]] ArrayRef mask_ref() const { return array_ref(std::span<const std::uint8_t>(mask), {bs, seq}); }
  [[nodiscard]] std::int16_t at(std::int64_t b, std::int64_t s, int l, int k) const {
    return ids[static_cast<std::size_t>(((b * pitch + s) * L + l) * K + k)];
  }
};
VerlBatch random_verl(std::mt19937_64 &rng) {
  VerlBatch v{
      static_cast<std::int64_t>(rng() % 6), static_cast<std::int64_t>(rng() % 7), 0,  1 + static_cast<int>(rng() % 3),
      1 + static_cast<int>(rng() % 3),      1 + static_cast<int>(rng() % 9),      {}, {}};
  v.pitch = v.seq + (rng() % 2 == 0 ? 0 : 1 + static_cast<std::int64_t>(rng() % 3));
  v.ids.resize(static_cast<std::size_t>(v.bs * v.pitch * v.L * v.K));
  v.mask.resize(static_cast<std::size_t>(v.bs * v.seq));
  for (std::int64_t b = 0; b < v.bs; ++b) {
    const std::int64_t pad = v.seq == 0 ? 0 : static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(v.seq + 1));
    for (std::int64_t s = 0; s < v.pitch; ++s)
      for (int x = 0; x < v.L * v.K; ++x)
        v.ids[static_cast<std::size_t>((b * v.pitch + s) * v.L * v.K + x)] =
            static_cast<std::int16_t>(s < pad ? 0 : random_id(rng, v.E)); // padding holds expert 0
    for (std::int64_t s = pad; s < v.seq; ++s)
      v.mask[static_cast<std::size_t>(b * v.seq + s)] = 1;
  }
  return v;
}

BatchInput verl_input(const VerlBatch &v, const MicroBatches &mb) {
  BatchInput in;
  in.who = "loads_from_verl";
  in.arrays = {v.ids_ref()};
  in.mask = v.mask_ref();
  in.micro_batches = mb;
  return in;
}

/// Random per-layer `[T, K]` ids of Megatron (one int32 buffer `[L][T][K]`) and token offsets.
struct MegatronStage {
  std::int64_t T;
  int L, K, E;
  std::vector<std::int32_t> ids;
  std::vector<std::int64_t> offsets;
  [[nodiscard]] std::int32_t at(int l, std::int64_t t, int k) const {
    return ids[static_cast<std::size_t>((l * T + t) * K + k)];
  }
  [[nodiscard]] ArrayRef layer(int l, std::int64_t t0, std::int64_t t1) const {
    ArrayRef a = array_ref(std::span<const std::int32_t>(ids), {L, T, K});
    a.data = ids.data() + (l * T + t0) * K;
    a.shape = {t1 - t0, K};
    a.strides = {K, 1};
    return a;
  }
};
MegatronStage random_megatron(std::mt19937_64 &rng) {
  MegatronStage s{static_cast<std::int64_t>(rng() % 30),
                  1 + static_cast<int>(rng() % 4),
                  1 + static_cast<int>(rng() % 3),
                  1 + static_cast<int>(rng() % 9),
                  {},
                  {0}};
  s.ids.resize(static_cast<std::size_t>(s.L * s.T * s.K));
  for (auto &i : s.ids)
    i = static_cast<std::int32_t>(random_id(rng, s.E));
  const std::size_t cuts = rng() % 4;
  for (std::size_t c = 0; c < cuts; ++c)
    s.offsets.push_back(s.T == 0 ? 0 : static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(s.T + 1)));
  s.offsets.push_back(s.T);
  std::sort(s.offsets.begin(), s.offsets.end());
  return s;
}

Oracle megatron_oracle(const MegatronStage &s) {
  Oracle o(static_cast<int>(s.offsets.size() - 1), s.L, s.E);
  for (std::size_t m = 0; m + 1 < s.offsets.size(); ++m)
    for (std::int64_t t = s.offsets[m]; t < s.offsets[m + 1]; ++t)
      for (int l = 0; l < s.L; ++l)
        for (int k = 0; k < s.K; ++k)
          o.add(static_cast<int>(m), l, s.at(l, t, k));
  return o;
}

/// slime's samples: int64 `[len, L, K]` each.
struct SlimeSamples {
  int L, K, E;
  std::vector<std::vector<std::int64_t>> samples;
  [[nodiscard]] ArrayRef ref(std::size_t i) const {
    return array_ref(std::span<const std::int64_t>(samples[i]),
                     {static_cast<std::int64_t>(samples[i].size()) / (L * K), L, K});
  }
};
SlimeSamples random_slime(std::mt19937_64 &rng) {
  SlimeSamples s{1 + static_cast<int>(rng() % 3), 1 + static_cast<int>(rng() % 3), 1 + static_cast<int>(rng() % 9), {}};
  const std::size_t n = 1 + rng() % 8;
  for (std::size_t i = 0; i < n; ++i) {
    auto &v = s.samples.emplace_back(static_cast<std::size_t>(rng() % 6) * s.L * s.K);
    for (auto &x : v)
      x = random_id(rng, s.E);
  }
  return s;
}

} // namespace

TEST_CASE("the in-memory registry lists exactly the format files present, each with a test case") {
  std::vector<std::string> files, registered, tested(tested_formats.begin(), tested_formats.end());
  for (const auto &e : fs::directory_iterator(fs::path(FOREMOE_SOURCE_DIR) / "include/foremoe/trace/batch_formats"))
    if (e.path().extension() == ".hpp" && e.path().stem() != "builtin") files.push_back(e.path().stem().string());
  for (const BatchFormat *f : batch_formats())
    registered.push_back(f->name);
  std::sort(files.begin(), files.end());
  CHECK(registered == files);
  CHECK(registered == tested);
  CHECK_ERROR_CONTAINS((void)find_batch_format("nemo"), "unknown in-memory trace format 'nemo' (registered: megatron");
  CHECK_ERROR_CONTAINS(register_batch_format({"verl", "", true, verl_batch_layout}), "'verl' is already registered");
}

TEST_CASE("format verl: masked rows counted per sample into their micro-batches (property)") {
  std::mt19937_64 rng(11);
  for (int r = 0; r < rounds(); ++r) {
    CAPTURE(r);
    const VerlBatch v = random_verl(rng);
    const Partition p = random_partition(rng, v.bs);
    Oracle want(static_cast<int>(p.groups.size()), v.L, v.E);
    for (std::size_t m = 0; m < p.groups.size(); ++m)
      for (const std::int64_t b : p.groups[m])
        for (std::int64_t s = 0; s < v.seq; ++s)
          if (v.mask[static_cast<std::size_t>(b * v.seq + s)] != 0)
            for (int l = 0; l < v.L; ++l)
              for (int k = 0; k < v.K; ++k)
                want.add(static_cast<int>(m), l, v.at(b, s, l, k));
    const BatchInput in = verl_input(v, p.spec);
    const BatchLayout layout = verl_batch_layout(in);
    CHECK(layout.parts.size() == (v.pitch == v.seq || v.bs <= 1 ? 1u : static_cast<std::size_t>(v.bs)));
    check_equal(count_batch("verl", in, v.E), want);
  }
}

TEST_CASE("format verl: a layer map drops dense layers") {
  std::mt19937_64 rng(12);
  VerlBatch v = random_verl(rng);
  while (v.L < 2 || v.bs == 0)
    v = random_verl(rng);
  const BatchInput in = verl_input(v, {});
  std::vector<int> map(static_cast<std::size_t>(v.L));
  std::iota(map.begin(), map.end(), -1); // the first layer is dense
  const LoadTensor got = count_batch("verl", in, v.E, LayerMap(map));
  const LoadTensor all = count_batch("verl", in, v.E);
  REQUIRE(got.num_layers() == v.L - 1);
  for (int l = 1; l < v.L; ++l)
    for (int e = 0; e < v.E; ++e)
      CHECK(got.layer(0, l - 1)[e] == all.layer(0, l)[e]);
  CHECK_ERROR_CONTAINS((void)count_batch("megatron", BatchInput{}, 4, LayerMap(map)),
                       "format megatron takes no layer map");
}

TEST_CASE("format megatron: per-layer [T, K] cut at offsets, or per-micro-batch lists (property)") {
  std::mt19937_64 rng(13);
  for (int r = 0; r < rounds(); ++r) {
    CAPTURE(r);
    const MegatronStage s = random_megatron(rng);
    const Oracle want = megatron_oracle(s);
    BatchInput flat;
    flat.who = "loads_from_megatron";
    for (int l = 0; l < s.L; ++l)
      flat.arrays.push_back(s.layer(l, 0, s.T));
    flat.offsets = std::span<const std::int64_t>(s.offsets);
    check_equal(count_batch("megatron", flat, s.E), want);
    BatchInput nested;
    nested.who = flat.who;
    nested.list_sizes.emplace();
    for (std::size_t m = 0; m + 1 < s.offsets.size(); ++m) {
      nested.list_sizes->push_back(s.L);
      for (int l = 0; l < s.L; ++l)
        nested.arrays.push_back(s.layer(l, s.offsets[m], s.offsets[m + 1]));
    }
    check_equal(count_batch("megatron", nested, s.E), want);
  }
}

TEST_CASE("format slime: per-micro-batch sample lists, or samples with index lists (property)") {
  std::mt19937_64 rng(14);
  for (int r = 0; r < rounds(); ++r) {
    CAPTURE(r);
    const SlimeSamples s = random_slime(rng);
    const Partition p = random_partition(rng, static_cast<std::int64_t>(s.samples.size()));
    Oracle want(static_cast<int>(p.groups.size()), s.L, s.E);
    BatchInput lists, indexed;
    lists.who = indexed.who = "loads_from_slime";
    lists.list_sizes.emplace();
    for (std::size_t m = 0; m < p.groups.size(); ++m) {
      lists.list_sizes->push_back(static_cast<std::int64_t>(p.groups[m].size()));
      for (const std::int64_t i : p.groups[m]) {
        lists.arrays.push_back(s.ref(static_cast<std::size_t>(i)));
        for (std::size_t x = 0; x < s.samples[static_cast<std::size_t>(i)].size(); ++x)
          want.add(static_cast<int>(m), static_cast<int>(x / s.K % s.L), s.samples[static_cast<std::size_t>(i)][x]);
      }
    }
    for (std::size_t i = 0; i < s.samples.size(); ++i)
      indexed.arrays.push_back(s.ref(i));
    indexed.micro_batches = p.spec;
    check_equal(count_batch("slime", lists, s.E), want);
    check_equal(count_batch("slime", indexed, s.E), want);
  }
}

TEST_CASE("micro-batch partitions: out of range, duplicated, missing, empty, not integer, sizes") {
  const std::vector<std::int64_t> a = {0, 1}, b = {1}, c = {0}, d = {2}, neg = {-3};
  const std::vector<std::uint64_t> huge = {std::numeric_limits<std::uint64_t>::max()};
  const std::vector<float> f = {0.5F};
  const auto ref = [](const auto &v) {
    return array_ref(std::span<const typename std::decay_t<decltype(v)>::value_type>(v),
                     {static_cast<std::int64_t>(v.size())});
  };
  using L = std::vector<ArrayRef>;
  CHECK_ERROR_CONTAINS((void)micro_batch_groups(MicroBatches::of_lists(L{ref(a), ref(b)}), 2, "w", "sample"),
                       "w: sample 1 is in micro-batch 0 and micro-batch 1");
  CHECK_ERROR_CONTAINS((void)micro_batch_groups(MicroBatches::of_lists(L{ref(c), ref(d)}), 2, "w", "sample"),
                       "w: micro-batch 1 names sample 2, outside [0, 2)");
  CHECK_ERROR_CONTAINS((void)micro_batch_groups(MicroBatches::of_lists(L{ref(neg)}), 2, "w", "sample"),
                       "micro-batch 0 names sample -3, outside [0, 2)");
  CHECK_ERROR_CONTAINS((void)micro_batch_groups(MicroBatches::of_lists(L{ref(huge)}), 2, "w", "sample"),
                       "names sample 18446744073709551615, outside [0, 2)");
  CHECK_ERROR_CONTAINS((void)micro_batch_groups(MicroBatches::of_lists(L{ref(c)}), 3, "w", "sample"),
                       "w: sample 1 is in no micro-batch (the micro-batches must cover the 3 samples of the stage)");
  CHECK_ERROR_CONTAINS((void)micro_batch_groups(MicroBatches::of_lists(L{}), 3, "w", "sample"), "w: no micro-batch");
  CHECK_ERROR_CONTAINS((void)micro_batch_groups(MicroBatches::of_lists(L{ref(f)}), 1, "w", "sample"),
                       "micro-batch 0 must list sample indices, got dtype float32");
  const std::array<bool, 1> yes = {true};
  CHECK_ERROR_CONTAINS(
      (void)micro_batch_groups(MicroBatches::of_lists(L{array_ref(std::span<const bool>(yes), {1})}), 1, "w", "sample"),
      "micro-batch 0 must list sample indices, got dtype bool");
  CHECK_ERROR_CONTAINS((void)micro_batch_groups(MicroBatches::of_size(0), 3, "w", "sample"),
                       "w: micro-batch size must be positive, got 0");
  CHECK_ERROR_CONTAINS((void)micro_batch_groups(MicroBatches::of_size(-5), 3, "w", "sample"), "got -5");
  // A size past the items (no overflow near int64's end) is one micro-batch; empty lists of any dtype are fine.
  const auto big = micro_batch_groups(MicroBatches::of_size(std::numeric_limits<std::int64_t>::max()), 3, "w", "s");
  CHECK(big == std::vector<std::vector<std::int64_t>>{{0, 1, 2}});
  const std::vector<float> none;
  CHECK(micro_batch_groups(MicroBatches::of_lists(L{ref(a), ref(none)}), 2, "w", "s").size() == 2);
}

TEST_CASE("bad verl batches: shapes, dtypes, mask values, ids, sizes") {
  std::mt19937_64 rng(15);
  VerlBatch v = random_verl(rng);
  while (v.bs < 2 || v.seq < 2)
    v = random_verl(rng);
  BatchInput in = verl_input(v, {});
  CAPTURE(v.bs);
  CAPTURE(v.seq);
  // mask shape (transposed), missing, float
  const std::vector<std::uint8_t> t(v.mask.size(), 1);
  BatchInput bad = in;
  bad.mask = array_ref(std::span<const std::uint8_t>(t), {v.seq, v.bs});
  CHECK_ERROR_CONTAINS((void)verl_batch_layout(bad), msg("loads_from_verl: attention_mask must be [", v.bs, ", ", v.seq,
                                                         "] to match routed_experts [", v.bs, ", ", v.seq, ", ", v.L,
                                                         ", ", v.K, "], got [", v.seq, ", ", v.bs, "]"));
  bad.mask.reset();
  CHECK_ERROR_CONTAINS((void)verl_batch_layout(bad), "loads_from_verl: attention_mask is required");
  const std::vector<float> fm(v.mask.size(), 1.0F);
  bad.mask = array_ref(std::span<const float>(fm), {v.bs, v.seq});
  CHECK_ERROR_CONTAINS((void)verl_batch_layout(bad), "attention_mask must be bool or integer, got dtype float32");
  // a mask value other than 0/1, named with its index
  std::vector<std::int64_t> m2(v.mask.begin(), v.mask.end());
  m2[static_cast<std::size_t>(v.seq + 1)] = 2;
  bad.mask = array_ref(std::span<const std::int64_t>(m2), {v.bs, v.seq});
  CHECK_ERROR_CONTAINS((void)verl_batch_layout(bad), "loads_from_verl: attention_mask[1, 1] = 2 is not 0 or 1");
  m2[static_cast<std::size_t>(v.seq + 1)] = -1;
  CHECK_ERROR_CONTAINS((void)verl_batch_layout(bad), "attention_mask[1, 1] = -1 is not 0 or 1");
  // ids: not 4-D, float, unsupported integer
  bad = in;
  bad.arrays[0].shape.pop_back();
  bad.arrays[0].strides.pop_back();
  CHECK_ERROR_CONTAINS((void)verl_batch_layout(bad),
                       "routed_experts [batch, seq, layers, topk] must have 4 dimensions, got shape [");
  bad = in;
  bad.arrays[0].kind = ElemKind::float_;
  bad.arrays[0].bits = 32;
  CHECK_ERROR_CONTAINS((void)verl_batch_layout(bad), "must hold integer expert ids, got dtype float32");
  bad.arrays[0].kind = ElemKind::uint_;
  CHECK_ERROR_CONTAINS((void)verl_batch_layout(bad), "must be int8, uint8, int16, uint16, int32 or int64, got uint32");
  // sizes: a product past int64, layers past 2^20
  bad = in;
  bad.arrays[0].shape = {std::int64_t{1} << 40, std::int64_t{1} << 20, 16, 2};
  bad.mask = array_ref(std::span<const std::uint8_t>(v.mask), {v.bs, v.seq});
  CHECK_ERROR_CONTAINS((void)verl_batch_layout(bad), "elements, more than int64 holds");
  bad.arrays[0].shape = {v.bs, v.seq, (1 << 20) + 1, v.K};
  CHECK_ERROR_CONTAINS((void)verl_batch_layout(bad), "has dimension 2 = 1048577");
  // an id out of range, named by sample and position (a row the mask keeps)
  std::int64_t b = 0, s = 0;
  while (v.mask[static_cast<std::size_t>(b * v.seq + s)] == 0)
    if (++s == v.seq) s = 0, ++b;
  if (b < v.bs) {
    v.ids[static_cast<std::size_t>(((b * v.pitch + s) * v.L + v.L - 1) * v.K)] = static_cast<std::int16_t>(v.E + 3);
    in = verl_input(v, {});
    CHECK_ERROR_CONTAINS((void)count_batch("verl", in, v.E),
                         msg("loads_from_verl: expert id ", v.E + 3, " at sample ", b, ", position ", s, ", layer ",
                             v.L - 1, ", k 0 is outside [0, ", v.E, ") (int16 ids"));
  }
  CHECK_ERROR_CONTAINS((void)count_batch("verl", in, 0), "loads_from_verl: num_experts 0 is outside [1, 2^30)");
}

TEST_CASE("bad megatron and slime inputs name the layer, micro-batch and sample") {
  std::mt19937_64 rng(16);
  MegatronStage s = random_megatron(rng);
  while (s.T < 3 || s.L < 2)
    s = random_megatron(rng);
  BatchInput in;
  in.who = "loads_from_megatron";
  in.arrays = {s.layer(0, 0, s.T), s.layer(1, 0, s.T - 1)};
  CHECK_ERROR_CONTAINS((void)megatron_batch_layout(in), msg("loads_from_megatron: layer 1 has indices [", s.T - 1, ", ",
                                                            s.K, "], layer 0 [", s.T, ", ", s.K, "]"));
  in.arrays = {s.layer(0, 0, s.T)};
  const std::vector<std::int64_t> off = {0, s.T - 1};
  in.offsets = std::span<const std::int64_t>(off);
  CHECK_ERROR_CONTAINS((void)megatron_batch_layout(in), msg("loads_from_megatron: microbatch_offsets end at ", s.T - 1,
                                                            " but the trace has ", s.T, " tokens"));
  in.offsets.reset();
  in.arrays.clear();
  CHECK_ERROR_CONTAINS((void)megatron_batch_layout(in), "per_layer must be a non-empty list");
  in.arrays = {s.layer(0, 0, 1), s.layer(1, 0, 1), s.layer(0, 1, 2)};
  in.list_sizes = std::vector<std::int64_t>{2, 1};
  CHECK_ERROR_CONTAINS((void)megatron_batch_layout(in),
                       "loads_from_megatron: micro-batch 1 has 1 MoE layers, micro-batch 0 has 2");
  in.list_sizes = std::vector<std::int64_t>{1, 1, 1};
  in.offsets = std::span<const std::int64_t>(off);
  CHECK_ERROR_CONTAINS((void)megatron_batch_layout(in), "leave microbatch_offsets out");
  // an id out of range in layer 1, token 2
  std::vector<std::int32_t> ids = s.ids;
  ids[static_cast<std::size_t>((1 * s.T + 2) * s.K + s.K - 1)] = -4;
  MegatronStage t = s;
  t.ids = ids;
  BatchInput id_in;
  id_in.who = in.who;
  for (int l = 0; l < t.L; ++l)
    id_in.arrays.push_back(t.layer(l, 0, t.T));
  CHECK_ERROR_CONTAINS((void)count_batch("megatron", id_in, t.E),
                       msg("expert id -4 at token 2, layer 1, k ", t.K - 1, " is outside"));

  // slime
  const std::vector<std::int64_t> a(4 * 2 * 2, 1), b(2 * 1 * 2, 1);
  std::vector<std::int64_t> c(3 * 2 * 2, 1);
  c[5] = 8; // token 1, layer 0, k 1
  BatchInput sl;
  sl.who = "loads_from_slime";
  sl.arrays = {array_ref(std::span<const std::int64_t>(a), {4, 2, 2}),
               array_ref(std::span<const std::int64_t>(b), {2, 1, 2})};
  sl.list_sizes = std::vector<std::int64_t>{1, 1};
  CHECK_ERROR_CONTAINS((void)slime_batch_layout(sl),
                       "loads_from_slime: micro-batch 1, sample 0 has [layers, topk] [1, 2], the first sample [2, 2]");
  sl.arrays[1] = array_ref(std::span<const std::int64_t>(c), {3, 2, 2});
  CHECK_ERROR_CONTAINS(
      (void)count_batch("slime", sl, 8),
      "loads_from_slime: expert id 8 at micro-batch 1, sample 0, token 1, layer 0, k 1 is outside [0, 8)");
  sl.list_sizes = std::vector<std::int64_t>{0, 0};
  CHECK_ERROR_CONTAINS((void)slime_batch_layout(sl), "list_sizes hold 0 samples, 2 given");
  sl.arrays.clear();
  CHECK_ERROR_CONTAINS((void)slime_batch_layout(sl), "no sample in any micro-batch (the layer count is unknown)");
  sl.list_sizes = std::vector<std::int64_t>{};
  CHECK_ERROR_CONTAINS((void)slime_batch_layout(sl), "micro_batches must be a non-empty list of per-sample lists");
  // samples with index lists: a missing sample, named
  const std::vector<std::int64_t> i0 = {0}, i2 = {2};
  sl.list_sizes.reset();
  sl.arrays = {array_ref(std::span<const std::int64_t>(a), {4, 2, 2}),
               array_ref(std::span<const std::int64_t>(a), {4, 2, 2}),
               array_ref(std::span<const std::int64_t>(a), {4, 2, 2})};
  sl.micro_batches = MicroBatches::of_lists(
      {array_ref(std::span<const std::int64_t>(i0), {1}), array_ref(std::span<const std::int64_t>(i2), {1})});
  CHECK_ERROR_CONTAINS((void)slime_batch_layout(sl), "loads_from_slime: sample 1 is in no micro-batch");
}

TEST_CASE("a device array is laid out without reading it; counting it here says so") {
  std::mt19937_64 rng(17);
  VerlBatch v = random_verl(rng);
  while (v.bs == 0 || v.seq == 0)
    v = random_verl(rng);
  BatchInput in = verl_input(v, {});
  in.arrays[0].data = nullptr;
  const BatchLayout layout = verl_batch_layout(in);
  CHECK(!layout.parts.empty());
  CHECK_ERROR_CONTAINS((void)count_batch(layout, in.arrays, v.E, {}, "w"), "is not readable here (a device array");
}
