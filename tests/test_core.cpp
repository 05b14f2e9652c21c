#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>

#include "foremoe/foremoe.hpp"
#include "test_support.hpp"

using namespace foremoe;

TEST_CASE("ModelSpec validates and sizes experts") {
  ModelSpec q = qwen3_30b_a3b();
  q.validate();
  CHECK(q.bytes_per_expert() == 3LL * 2048 * 768 * 2);
  ModelSpec d = deepseek_v3(WeightDtype::fp8);
  // fp8 weights plus 128x128 float32 block scales.
  CHECK(d.bytes_per_expert() == 3LL * 7168 * 2048 + 3LL * 56 * 16 * 4);
  CHECK(deepseek_v3(WeightDtype::bf16).bytes_per_expert() == 3LL * 7168 * 2048 * 2);

  ModelSpec bad = q;
  bad.topk = 129;
  CHECK_ERROR_CONTAINS(bad.validate(), "129");
  bad = q;
  bad.num_experts = 0;
  CHECK_ERROR_CONTAINS(bad.validate(), "num_experts");
  bad = q;
  bad.num_matrices = 4;
  CHECK_ERROR_CONTAINS(bad.validate(), "4");
  CHECK(parse_weight_dtype("bfloat16") == WeightDtype::bf16);
  CHECK_ERROR_CONTAINS((void)parse_weight_dtype("int4"), "int4");
}

TEST_CASE("Topology validates shape, bandwidths and capacity") {
  Topology t{4, 8, 9};
  t.validate(256);
  CHECK(t.num_gpus() == 32);
  CHECK(t.node_of(17) == 2);
  CHECK(t.owners_per_gpu(256) == 8);
  CHECK(t.spare_slots_per_gpu(256) == 1);
  CHECK(t.owners_per_gpu(250) == 8);

  Topology small{1, 8, 2};
  CHECK_ERROR_CONTAINS(small.validate(17), "cannot hold all 17 experts");
  Topology zero{0, 8, 2};
  CHECK_ERROR_CONTAINS(zero.validate(), "num_nodes");
}

TEST_CASE("LoadTensor indexing, sources and validation") {
  LoadTensor t(2, 3, 4, 2);
  CHECK(t.has_sources());
  t.at(1, 2, 3) = 7;
  t.at(1, 2, 3, 0) = 3;
  t.at(1, 2, 3, 1) = 4;
  t.validate();
  CHECK(t.layer(1, 2)[3] == 7);
  CHECK(t.layer_total(1, 2) == 7);
  CHECK(t.layer_by_source(1, 2)[3 * 2 + 1] == 4);
  t.at(1, 2, 3, 1) = 5;
  CHECK_ERROR_CONTAINS(t.validate(), "micro-step 1, layer 2, expert 3");
  t.at(1, 2, 3, 1) = 4;
  t.at(0, 1, 2) = -5;
  CHECK_ERROR_CONTAINS(t.validate(), "negative load -5 at micro-step 0, layer 1, expert 2");

  std::vector<double> v(2 * 3 * 4, 1.0);
  CHECK(LoadTensor::from_floats(v, 2, 3, 4).layer_total(0, 0) == 4);
  v[5] = std::numeric_limits<double>::quiet_NaN();
  CHECK_ERROR_CONTAINS((void)LoadTensor::from_floats(v, 2, 3, 4),
                       "non-finite load nan at micro-step 0, layer 1, expert 1");
  v[5] = -2;
  CHECK_ERROR_CONTAINS((void)LoadTensor::from_floats(v, 2, 3, 4), "negative load -2");
  v[5] = 0.5;
  CHECK_ERROR_CONTAINS((void)LoadTensor::from_floats(v, 2, 3, 4), "non-integral");
  v[5] = std::numeric_limits<double>::infinity();
  CHECK_ERROR_CONTAINS((void)LoadTensor::from_floats(v, 2, 3, 4), "non-finite load inf");
  CHECK_ERROR_CONTAINS((void)LoadTensor::from_floats(v, 2, 3, 5), "needs 30");
  CHECK_ERROR_CONTAINS(LoadTensor(1, 0, 4), "num_layers");
  CHECK_ERROR_CONTAINS(LoadTensor(1 << 20, 1 << 10, 1 << 10), "load cells is beyond the supported 2^28");
  // Sums: every entry in range, a layer's sum over the micro-steps is not (it would overflow the planner's sums).
  {
    LoadTensor big(3, 2, 2);
    big.at(2, 1, 1) = limits::max_load_total;
    CHECK_NOTHROW(big.validate());
    big.at(0, 1, 0) = 1;
    CHECK_ERROR_CONTAINS(big.validate(), "the loads of layer 1 sum past 2^42");
    std::vector<double> at_bound(16, std::ldexp(1.0, 38)); // 16 x 2^38 = 2^42: at the bound
    CHECK_NOTHROW((void)LoadTensor::from_floats(at_bound, 1, 1, 16).validate());
    at_bound[3] += 1;
    CHECK_ERROR_CONTAINS((void)LoadTensor::from_floats(at_bound, 1, 1, 16), "sum past 2^42");
  }
}

TEST_CASE("LayerPlacement maps and validation") {
  LayerPlacement p(4, 3, 6);
  for (int e = 0; e < 6; ++e)
    p.slot(e / 2, e % 2) = e;
  p.slot(2, 2) = 0; // replica of expert 0 on GPU 2
  p.slot(3, 0) = 5; // replica of expert 5 on GPU 3
  p.validate();
  auto counts = p.replica_counts();
  CHECK(counts[0] == 2);
  CHECK(counts[5] == 2);
  CHECK(counts[1] == 1);
  auto l2p = p.log_to_phys();
  CHECK(l2p.offsets.back() == 8);
  CHECK(l2p.phys[l2p.offsets[0]] == 0);
  CHECK(l2p.phys[l2p.offsets[0] + 1] == 2 * 3 + 2);
  CHECK(p.holds(2, 0));
  CHECK_FALSE(p.holds(1, 0));
  CHECK(p.free_slot(3) == 1);

  p.slot(3, 1) = 5;
  CHECK_ERROR_CONTAINS(p.validate(), "GPU 3 holds two copies of expert 5");
  p.slot(3, 1) = 6;
  CHECK_ERROR_CONTAINS(p.validate(), "expert id 6, outside [0, 6)");
  p.slot(3, 1) = empty_slot;
  p.slot(0, 1) = empty_slot;
  CHECK_ERROR_CONTAINS(p.validate(), "expert 1 has no copy");
}

TEST_CASE("Placement::contiguous is valid on random topologies (property)") {
  std::mt19937_64 rng(42);
  for (int it = 0; it < 200; ++it) {
    const int nodes = 1 + int(rng() % 4), gpn = 1 + int(rng() % 8), experts = 1 + int(rng() % 300);
    const Topology topo{nodes, gpn, (experts + nodes * gpn - 1) / (nodes * gpn) + int(rng() % 3)};
    const Placement p = Placement::contiguous(topo, 2, experts);
    p.validate();
    for (int e : p.layer(1).replica_counts())
      CHECK(e == 1);
  }
  CHECK_ERROR_CONTAINS(Placement(Topology{1, 2, 1}, 1, 3), "cannot hold all 3 experts");
}
