// GPU tests of the runtime: compiled always, run only where a CUDA device is
// present; elsewhere they exit 77, which CTest reports as skipped.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <random>
#include <vector>

#include "foremoe/foremoe.hpp"
#include "foremoe/runtime/runtime.hpp"
#include "gpu_main.hpp"

#if defined(FOREMOE_TEST_HAVE_CUDART)
#include <cuda_runtime_api.h>
#endif

using namespace foremoe;
namespace rt = foremoe::runtime;

#if defined(FOREMOE_TEST_HAVE_CUDART)
TEST_CASE_TEMPLATE("device counting equals the CPU counter", T, std::int8_t, std::uint8_t, std::int16_t, std::uint16_t,
                   std::int32_t, std::int64_t) {
  std::mt19937_64 rng(5 + sizeof(T));
  for (int it = 0; it < 20; ++it) {
    const std::int64_t num_tokens = 1 + std::int64_t(rng() % 20000);
    const int L = 1 + int(rng() % 6), K = 1 + int(rng() % 8), E = K + int(rng() % 100);
    std::vector<T> ids(std::size_t(num_tokens) * L * K);
    for (auto &x : ids)
      x = rng() % 17 == 0 ? static_cast<T>(-1) : static_cast<T>(rng() % E);
    std::vector<std::int64_t> mb{0};
    for (int m = 0; m < int(rng() % 6); ++m)
      mb.push_back(std::int64_t(rng() % num_tokens));
    mb.push_back(num_tokens);
    std::sort(mb.begin(), mb.end());
    CountOptions o;
    o.num_experts = E;
    o.microbatch_offsets = mb;
    const LoadTensor want = count_loads(std::span<const T>(ids), num_tokens, L, K, o);

    void *d_ids = nullptr, *d_out = nullptr;
    REQUIRE(cudaMalloc(&d_ids, ids.size() * sizeof(T)) == cudaSuccess);
    REQUIRE(cudaMalloc(&d_out, want.totals().size() * sizeof(std::int64_t)) == cudaSuccess);
    REQUIRE(cudaMemcpy(d_ids, ids.data(), ids.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
    rt::CountRequest req;
    req.ids = d_ids;
    req.dtype = id_dtype_of<T>();
    req.num_tokens = num_tokens;
    req.num_layers = L;
    req.topk = K;
    req.num_experts = E;
    req.microbatch_offsets = mb;
    const rt::Status st =
        rt::count_loads(rt::Backend::cuda, req, {static_cast<std::int64_t *>(d_out), want.totals().size()});
    REQUIRE_MESSAGE(st.ok(), st.to_string());
    std::vector<std::int64_t> got(want.totals().size());
    REQUIRE(cudaMemcpy(got.data(), d_out, got.size() * sizeof(std::int64_t), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(std::equal(got.begin(), got.end(), want.totals().begin()));
    cudaFree(d_ids);
    cudaFree(d_out);
  }
}

TEST_CASE("device counting names an out-of-range id") {
  std::vector<std::int32_t> ids{0, 1, 2, 3, 4, 77};
  void *d_ids = nullptr, *d_out = nullptr;
  REQUIRE(cudaMalloc(&d_ids, ids.size() * 4) == cudaSuccess);
  REQUIRE(cudaMalloc(&d_out, 8 * 8) == cudaSuccess);
  REQUIRE(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
  rt::CountRequest req;
  req.ids = d_ids;
  req.dtype = IdDtype::i32;
  req.num_tokens = 3;
  req.num_layers = 1;
  req.topk = 2;
  req.num_experts = 8;
  const rt::Status st = rt::count_loads(rt::Backend::cuda, req, {static_cast<std::int64_t *>(d_out), 8});
  CHECK(st.code() == rt::StatusCode::invalid_argument);
  CHECK(st.message().find("expert id 77 at token 2, layer 0, k 1") != std::string::npos);
  cudaFree(d_ids);
  cudaFree(d_out);
}
#endif

int main(int argc, char **argv) { return foremoe_test::gpu_test_main(argc, argv); }
