#pragma once
// Two engines in one process standing for two processes (the multi-process GPU tests): each rank's submission runs
// on its own thread with its own device current, as it would in its own process.

#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include "foremoe/runtime/transfer_engine.hpp"

namespace foremoe_test {

// Runs `submit(rank, ticket)` for both ranks at once, each from its own thread on device `rank`, and waits for the
// tickets (at most 30 s); doctest assertions stay on the main thread.
template <class Submit> std::array<foremoe::runtime::Status, 2> on_both_ranks(Submit &&submit) {
  namespace rt = foremoe::runtime;
  std::array<rt::Status, 2> st;
  std::vector<std::thread> ranks;
  for (int g = 0; g < 2; ++g)
    ranks.emplace_back([&, g] {
      if (cudaSetDevice(g) != cudaSuccess) {
        st[g] = {rt::StatusCode::device_error, "cudaSetDevice failed"};
        return;
      }
      rt::Ticket t;
      st[g] = submit(g, t);
      if (st[g].ok()) st[g] = t.wait_for(std::chrono::seconds(30));
    });
  for (auto &t : ranks)
    t.join();
  return st;
}

// Expert `g` in slot 0 of GPU `g` (g = 0, 1; `mem[g]`: GPU g's slots, `stride` bytes apart) moves into slot 1 of
// the other GPU, both ranks submitting the two moves at once; checks that both batches landed, that the engines
// call the copies valid, and that the first `check_bytes` bytes of each are `pattern(expert, i)`.
template <class Pattern>
void swap_experts_and_check(std::span<const std::unique_ptr<foremoe::runtime::TransferEngine>> engines,
                            std::span<void *const> mem, int slots, int num_experts, std::int64_t stride,
                            std::int64_t check_bytes, Pattern &&pattern) {
  namespace rt = foremoe::runtime;
  foremoe::LayerPlacement p(2, slots, num_experts);
  p.slot(0, 0) = 0;
  p.slot(1, 0) = 1;
  for (const auto &e : engines)
    REQUIRE(e->set_resident(0, p).ok());
  const std::vector<foremoe::Move> moves{{0, foremoe::host_mirror, 1, 1}, {1, foremoe::host_mirror, 0, 1}};
  const std::array<rt::Status, 2> st = on_both_ranks([&](int g, rt::Ticket &t) {
    rt::MoveBatch b;
    b.moves = moves;
    b.timeout = std::chrono::seconds(20);
    return engines[g]->submit(b, t);
  });
  for (int g = 0; g < 2; ++g) {
    CHECK_MESSAGE(st[g].ok(), st[g].to_string());
    CHECK(engines[g]->valid_expert(0, g, 1) == 1 - g);
    std::vector<std::byte> host(static_cast<std::size_t>(check_bytes));
    REQUIRE(cudaMemcpy(host.data(), static_cast<std::byte *>(mem[g]) + stride, host.size(), cudaMemcpyDeviceToHost) ==
            cudaSuccess);
    bool same = true;
    for (std::int64_t i = 0; i < check_bytes; ++i)
      same = same && host[i] == pattern(1 - g, i);
    CHECK(same);
  }
}

} // namespace foremoe_test
