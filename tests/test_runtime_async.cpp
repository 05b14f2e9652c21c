// The asynchronous forms of counting and token mapping on the host backend (the device forms are compared in
// gpu_test_hot_path), and the output spans' size checks of every form.

#include <doctest/doctest.h>

#include <vector>

#include "foremoe/runtime/runtime.hpp"
#include "foremoe/runtime/token_map.hpp"

using namespace foremoe;
namespace rt = foremoe::runtime;

namespace {
// 2 tokens x 1 layer x top-2 over 4 experts (count) or 2 experts with one slot each (map).
struct Small {
  std::vector<std::int16_t> ids{0, 1, 0, -1};
  const std::vector<std::int32_t> slot_expert{0, 1};
  const std::vector<std::int64_t> slot_tokens{2, 1};
  rt::CountRequest count() const {
    rt::CountRequest r;
    r.ids = ids.data(), r.dtype = IdDtype::i16, r.num_tokens = 2, r.num_layers = 1, r.topk = 2, r.num_experts = 4;
    return r;
  }
  rt::MapRequest map() const {
    rt::MapRequest r;
    r.ids = ids.data(), r.dtype = IdDtype::i16, r.num_tokens = 2, r.num_layers = 1, r.topk = 2, r.num_experts = 2;
    r.slot_expert = slot_expert, r.slot_tokens = slot_tokens;
    return r;
  }
};
} // namespace

TEST_CASE("output spans of the wrong size are refused, naming expected and given sizes") {
  Small s;
  std::vector<std::int64_t> loads(5, -1);
  for (std::size_t n : {3, 5}) {
    const rt::Status st = rt::count_loads(rt::Backend::host, s.count(), std::span(loads).first(n));
    CHECK(st.code() == rt::StatusCode::invalid_argument);
    CHECK_MESSAGE(st.message() == "count_loads: out has " + std::to_string(n) +
                                      " elements, expected 4 (1 micro-steps x 1 MoE layers x 4 experts)",
                  st.message());
  }
  CHECK(loads == std::vector<std::int64_t>(5, -1)); // nothing written
  CHECK(rt::count_loads(rt::Backend::host, s.count(), {static_cast<std::int64_t *>(nullptr), 4})
            .message()
            .find("null output") != std::string::npos);
  CHECK(rt::count_loads(rt::Backend::host, s.count(), std::span(loads).first(4)).ok());
  CHECK(loads == std::vector<std::int64_t>{2, 1, 0, 0, -1});
  rt::CountRequest two_steps = s.count();
  const std::vector<std::int64_t> mb{0, 1, 2};
  two_steps.microbatch_offsets = mb;
  CHECK(rt::count_loads(rt::Backend::host, two_steps, std::span(loads).first(4))
            .message()
            .find("expected 8 (2 micro-steps") != std::string::npos);

  std::vector<std::int32_t> slots(5, -7);
  const rt::Status st = rt::map_tokens(rt::Backend::host, s.map(), slots);
  CHECK(st.code() == rt::StatusCode::invalid_argument);
  CHECK_MESSAGE(st.message() == "map_tokens: out_slots has 5 elements, expected 4 (2 tokens x topk 2)", st.message());
  CHECK(slots == std::vector<std::int32_t>(5, -7));
  rt::Workspace ws;
  CHECK(rt::map_tokens_async(ws, s.map(), std::span(slots).first(3)).message().find("has 3 elements, expected 4") !=
        std::string::npos);
  CHECK(rt::count_loads_async(ws, s.count(), std::span(loads).first(2)).message().find("has 2 elements, expected 4") !=
        std::string::npos);
  CHECK(ws.check().ok()); // refused calls leave nothing to report
}

TEST_CASE("asynchronous host calls report what the work found at check, once, the first failure first") {
  Small s;
  rt::Workspace ws(rt::Backend::host);
  CHECK(ws.backend() == rt::Backend::host);
  std::vector<std::int64_t> loads(4, -1);
  std::vector<std::int32_t> slots(4, -7);
  REQUIRE(rt::count_loads_async(ws, s.count(), loads).ok());
  REQUIRE(rt::map_tokens_async(ws, s.map(), slots).ok());
  REQUIRE(ws.check().ok());
  CHECK(loads == std::vector<std::int64_t>{2, 1, 0, 0});
  CHECK(slots == std::vector<std::int32_t>{0, 1, 0, -1});

  s.ids[3] = 9;                                              // out of range for both
  REQUIRE(rt::count_loads_async(ws, s.count(), loads).ok()); // enqueued: the id is found by the work
  REQUIRE(rt::map_tokens_async(ws, s.map(), slots).ok());
  const rt::Status st = ws.check();
  CHECK(st.code() == rt::StatusCode::invalid_argument);
  CHECK_MESSAGE(st.message().find("expert id 9") != std::string::npos, st.message());
  CHECK(st.message().find("map_tokens") == std::string::npos); // the first call's failure
  CHECK(ws.check().ok());                                      // reported once
  CHECK(ws.check(-1).code() == rt::StatusCode::invalid_argument);
  CHECK(ws.allocations() == 0); // the host backend keeps no scratch
}

TEST_CASE("an asynchronous CUDA call without a device answers at once") {
  if (rt::build_info().num_devices > 0) return; // covered by gpu_test_hot_path
  Small s;
  rt::Workspace ws(rt::Backend::cuda);
  std::vector<std::int64_t> loads(4);
  std::vector<std::int32_t> slots(4);
  CHECK(rt::count_loads_async(ws, s.count(), loads).code() == rt::StatusCode::unavailable);
  CHECK(rt::map_tokens_async(ws, s.map(), slots).code() == rt::StatusCode::unavailable);
  CHECK(ws.check().ok());
  rt::Workspace bad(static_cast<rt::Backend>(7));
  CHECK(rt::count_loads_async(bad, s.count(), loads).message() == "count_loads: unknown backend 7");
}
