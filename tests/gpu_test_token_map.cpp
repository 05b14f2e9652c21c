// GPU tests of token mapping: the CUDA backend against the CPU reference for every id dtype, with and without a
// per-source split, and its error reports. Compiled always; exits 77 (CTest: skipped) without a CUDA device.
// (Device load counting against the CPU counter is in gpu_test_runtime.)

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "foremoe/foremoe.hpp"
#include "foremoe/plan/token_map.hpp"
#include "foremoe/runtime/runtime.hpp"
#include "foremoe/runtime/token_map.hpp"
#include "gpu_main.hpp"

#if defined(FOREMOE_TEST_HAVE_CUDART)
#include <cuda_runtime_api.h>
#endif

using namespace foremoe;
namespace rt = foremoe::runtime;

#if defined(FOREMOE_TEST_HAVE_CUDART)
namespace {

/// Device copy of a host vector, freed at scope exit.
template <class T> struct DeviceVec {
  T *ptr = nullptr;
  std::size_t n = 0;
  explicit DeviceVec(const std::vector<T> &v) : n(v.size()) {
    REQUIRE(cudaMalloc(reinterpret_cast<void **>(&ptr), std::max<std::size_t>(n, 1) * sizeof(T)) == cudaSuccess);
    if (n > 0) REQUIRE(cudaMemcpy(ptr, v.data(), n * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
  }
  DeviceVec(const DeviceVec &) = delete;
  DeviceVec &operator=(const DeviceVec &) = delete;
  ~DeviceVec() { cudaFree(ptr); }
  std::span<T> span() const { return {ptr, n}; }
  std::vector<T> get() const {
    std::vector<T> v(n);
    if (n > 0) REQUIRE(cudaMemcpy(v.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
    return v;
  }
};

struct Case {
  Topology topo;
  int E = 0, L = 0, K = 0;
  std::int64_t T = 0;
  std::vector<std::int32_t> ids;
  std::vector<std::int64_t> so;
  LoadTensor loads;
  std::vector<LayerPlan> plans;
};

Case make_case(std::mt19937_64 &rng, bool large) {
  Case c;
  const int nodes = 1 + int(rng() % 2), gpn = 1 + int(rng() % 8);
  const int G = nodes * gpn;
  c.E = 2 + int(rng() % (large ? 256 : 60));
  c.topo = Topology{nodes, gpn, (c.E + G - 1) / G + int(rng() % 4)};
  c.L = 1 + int(rng() % 3);
  c.K = 1 + int(rng() % std::min(8, c.E));
  c.T = std::int64_t(rng() % (large ? 40000 : 3000));
  std::vector<double> w(std::size_t(c.E));
  for (auto &x : w)
    x = std::pow(double(rng() % 1000 + 1), 1.5);
  std::discrete_distribution<int> pick(w.begin(), w.end());
  c.ids.resize(std::size_t(c.T) * c.L * c.K);
  for (auto &x : c.ids)
    x = rng() % 13 == 0 ? -1 : pick(rng);
  c.so = {0};
  for (int g = 0; g < G - 1; ++g)
    c.so.push_back(c.T == 0 ? 0 : std::int64_t(rng() % (c.T + 1)));
  c.so.push_back(c.T);
  std::sort(c.so.begin(), c.so.end());
  CountOptions o;
  o.num_experts = c.E;
  o.num_sources = G;
  o.source_offsets = c.so;
  c.loads = count_loads(std::span<const std::int32_t>(c.ids), c.T, c.L, c.K, o);
  Planner planner(c.L, c.E, c.topo);
  c.plans = planner.plan(c.loads, 0);
  return c;
}

} // namespace

TEST_CASE_TEMPLATE("device token map equals the CPU reference", T, std::int8_t, std::uint8_t, std::int16_t,
                   std::uint16_t, std::int32_t, std::int64_t) {
  std::mt19937_64 rng(17 + sizeof(T) + std::is_signed_v<T>);
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  for (int it = 0; it < 12; ++it) {
    const bool large = it % 3 == 0 && sizeof(T) >= 2;
    Case c = make_case(rng, large);
    if (sizeof(T) == 1 && c.E > 127) continue; // int8 cannot hold the ids
    std::vector<T> ids(c.ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i)
      ids[i] = static_cast<T>(c.ids[i]);
    const DeviceVec<T> d_ids(ids);
    const RoutedView view(std::span<const T>(ids), c.T, c.L, c.K);
    for (int l = 0; l < c.L; ++l)
      for (bool by_source : {false, true}) {
        const LayerPlan &plan = c.plans[l];
        const int S = by_source ? c.topo.num_gpus() : 1;
        const auto split = by_source ? split_by_source(plan.placement, plan.slot_tokens, c.loads.layer_by_source(0, l),
                                                       S, c.topo.gpus_per_node)
                                     : plan.slot_tokens;
        const std::span<const std::int64_t> so =
            by_source ? std::span<const std::int64_t>(c.so) : std::span<const std::int64_t>{};
        std::vector<std::int32_t> want(std::size_t(c.T) * c.K);
        map_tokens(token_ranges(plan.placement, split, S), view, l, want, so);

        rt::MapRequest req;
        req.ids = d_ids.ptr;
        req.dtype = id_dtype_of<T>();
        req.num_tokens = c.T;
        req.num_layers = c.L;
        req.topk = c.K;
        req.layer_idx = l;
        req.num_experts = c.E;
        req.slot_expert = plan.placement.phys_to_log();
        req.slot_tokens = split;
        req.num_sources = S;
        req.source_offsets = so;
        DeviceVec<std::int32_t> d_out(std::vector<std::int32_t>(want.size(), -7));
        const rt::Status st = rt::map_tokens(rt::Backend::cuda, req, d_out.span(), it % 2 ? stream : nullptr);
        REQUIRE_MESSAGE(st.ok(), st.to_string());
        const auto got = d_out.get();
        CHECK(got == want);
        // Deterministic across runs.
        REQUIRE(rt::map_tokens(rt::Backend::cuda, req, d_out.span(), stream).ok());
        CHECK(d_out.get() == got);
      }
  }
  cudaStreamDestroy(stream);
}

TEST_CASE("device token map names a bad id and a count mismatch like the reference") {
  std::vector<std::int32_t> ids{0, 1, 0, 9, 1, 1};
  const std::vector<std::int32_t> slot_expert{0, 1, 1};
  const std::vector<std::int64_t> slot_tokens{2, 2, 1};
  rt::MapRequest req;
  req.dtype = IdDtype::i32;
  req.num_tokens = 3;
  req.num_layers = 1;
  req.topk = 2;
  req.num_experts = 2;
  req.slot_expert = slot_expert;
  req.slot_tokens = slot_tokens;
  DeviceVec<std::int32_t> d_out(std::vector<std::int32_t>(6, 0));
  {
    const DeviceVec<std::int32_t> d_ids(ids);
    req.ids = d_ids.ptr;
    const rt::Status st = rt::map_tokens(rt::Backend::cuda, req, d_out.span());
    CHECK(st.code() == rt::StatusCode::invalid_argument);
    CHECK_MESSAGE(st.message().find("expert id 9 at token 1, layer 0, k 1 is outside [0, 2)") != std::string::npos,
                  st.message());
  }
  ids[3] = 0; // expert 0: 3 routed, 2 planned
  {
    const DeviceVec<std::int32_t> d_ids(ids);
    req.ids = d_ids.ptr;
    const rt::Status st = rt::map_tokens(rt::Backend::cuda, req, d_out.span());
    CHECK(st.code() == rt::StatusCode::invalid_argument);
    std::vector<std::int32_t> host(6);
    const RoutedView view(std::span<const std::int32_t>(ids), 3, 1, 2);
    std::string want;
    try {
      map_tokens(token_ranges(slot_expert, 2, slot_tokens), view, 0, host);
    } catch (const Error &e) {
      want = e.what();
    }
    CHECK(!want.empty());
    CHECK(st.message() == want);
  }
  ids[3] = -1; // as planned: expert 0 x2 -> slot 0; expert 1 x3 -> slots 1, 1, 2
  {
    const DeviceVec<std::int32_t> d_ids(ids);
    req.ids = d_ids.ptr;
    REQUIRE(rt::map_tokens(rt::Backend::cuda, req, d_out.span()).ok());
    CHECK(d_out.get() == std::vector<std::int32_t>{0, 1, 0, -1, 1, 2});
  }
}

TEST_CASE("device token map of zero tokens succeeds and checks the plan's totals") {
  const std::vector<std::int32_t> slot_expert{0, 1};
  std::vector<std::int64_t> slot_tokens{0, 0};
  rt::MapRequest req;
  req.ids = nullptr;
  req.num_tokens = 0;
  req.num_layers = 1;
  req.topk = 2;
  req.num_experts = 2;
  req.slot_expert = slot_expert;
  req.slot_tokens = slot_tokens;
  CHECK(rt::map_tokens(rt::Backend::cuda, req, {}).ok());
  slot_tokens[1] = 4;
  const rt::Status st = rt::map_tokens(rt::Backend::cuda, req, {});
  CHECK(st.code() == rt::StatusCode::invalid_argument);
  CHECK_MESSAGE(st.message().find("expert 1 has 0 routed tokens but the plan gives its 1 copies 4") !=
                    std::string::npos,
                st.message());
}
#endif

int main(int argc, char **argv) { return foremoe_test::gpu_test_main(argc, argv); }
