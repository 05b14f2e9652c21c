#include <doctest/doctest.h>

#include <random>
#include <vector>

#include "foremoe/foremoe.hpp"
#include "foremoe/runtime/runtime.hpp"
#include "test_support.hpp"

using namespace foremoe;
namespace rt = foremoe::runtime;

TEST_CASE("runtime host count equals the header counter for any thread count (property)") {
  std::mt19937_64 rng(99);
  rt::Workspace ws(rt::Backend::host); // reused across rounds and thread counts: it keeps its counting pool
  const int rounds = 40 * foremoe_test::seed_multiplier();
  for (int it = 0; it < rounds; ++it) {
    const std::int64_t T = std::int64_t(rng() % 2000);
    const int L = 1 + int(rng() % 5), K = 1 + int(rng() % 4), E = K + int(rng() % 60);
    std::vector<std::int32_t> ids(std::size_t(T) * L * K);
    for (auto &x : ids)
      x = rng() % 13 == 0 ? -1 : std::int32_t(rng() % E);
    std::vector<std::int64_t> mb{0};
    for (int m = 0, parts = 1 + int(rng() % 9); m < parts - 1; ++m)
      mb.push_back(T == 0 ? 0 : std::int64_t(rng() % T));
    mb.push_back(T);
    std::sort(mb.begin(), mb.end());
    CountOptions o;
    o.num_experts = E;
    o.microbatch_offsets = mb;
    const LoadTensor want = count_loads(std::span<const std::int32_t>(ids), T, L, K, o);

    rt::CountRequest req;
    req.ids = ids.data();
    req.dtype = IdDtype::i32;
    req.num_tokens = T;
    req.num_layers = L;
    req.topk = K;
    req.num_experts = E;
    req.microbatch_offsets = mb;
    for (int threads : {1, 2, 3, 8}) {
      std::vector<std::int64_t> out(want.totals().size(), -7);
      const rt::Status st = rt::count_loads(rt::Backend::host, req, out, threads);
      REQUIRE_MESSAGE(st.ok(), st.to_string());
      CHECK(std::equal(out.begin(), out.end(), want.totals().begin()));
      std::vector<std::int64_t> again(want.totals().size(), -7);
      REQUIRE(rt::count_loads_async(ws, req, again, nullptr, threads).ok());
      const rt::Status done = ws.check(10000);
      REQUIRE_MESSAGE(done.ok(), done.to_string());
      CHECK(again == out);
    }
  }
}

TEST_CASE("runtime count reports bad input as statuses, never throws") {
  std::vector<std::int16_t> ids{0, 1, 2, 9};
  rt::CountRequest req;
  req.ids = ids.data();
  req.dtype = IdDtype::i16;
  req.num_tokens = 2;
  req.num_layers = 1;
  req.topk = 2;
  req.num_experts = 4;
  std::vector<std::int64_t> out(4);
  rt::Status st = rt::count_loads(rt::Backend::host, req, out, 2);
  CHECK(st.code() == rt::StatusCode::invalid_argument);
  CHECK(st.message().find("expert id 9") != std::string::npos);
  ids[3] = 3;
  CHECK(rt::count_loads(rt::Backend::host, req, out).ok());
  CHECK(rt::count_loads(rt::Backend::host, req, {}).code() == rt::StatusCode::invalid_argument);
  std::vector<std::int64_t> bad_mb{0, 3};
  req.microbatch_offsets = bad_mb;
  st = rt::count_loads(rt::Backend::host, req, out);
  CHECK(st.code() == rt::StatusCode::invalid_argument);
  CHECK(st.message().find("end at 3 but the trace has 2") != std::string::npos);
  req.microbatch_offsets = {};
  req.num_experts = 0;
  CHECK(rt::count_loads(rt::Backend::host, req, out).code() == rt::StatusCode::invalid_argument);
}

TEST_CASE("CUDA backend without a device answers with a status") {
  const rt::BuildInfo info = rt::build_info();
  MESSAGE("cuda compiled: " << info.cuda_compiled << ", devices: " << info.num_devices
                            << ", archs: " << info.cuda_architectures);
  if (info.num_devices > 0) return; // covered by the GPU test
  std::vector<std::int16_t> ids{0, 1};
  rt::CountRequest req;
  req.ids = ids.data();
  req.dtype = IdDtype::i16;
  req.num_tokens = 1;
  req.num_layers = 1;
  req.topk = 2;
  req.num_experts = 4;
  std::vector<std::int64_t> out(4);
  const rt::Status st = rt::count_loads(rt::Backend::cuda, req, out);
  CHECK_FALSE(st.ok());
  CHECK((st.code() == rt::StatusCode::unavailable || st.code() == rt::StatusCode::device_error));
}
