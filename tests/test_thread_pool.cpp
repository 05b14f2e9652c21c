#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "foremoe/core/thread_pool.hpp"
#include "foremoe/plan/plan.hpp"
#include "foremoe/plan/planner.hpp"
#include "test_support.hpp"

#if defined(__unix__)
#include <sys/wait.h>
#include <unistd.h>
#endif

using namespace foremoe;

namespace {

/// Runs `num_tasks` tasks on `pool` and checks every index ran exactly once, each worker index was in range and
/// never held by two tasks at once.
void check_once(ThreadPool &pool, std::size_t num_tasks) {
  std::vector<std::atomic<int>> runs(num_tasks);
  const auto max_workers = std::min<std::size_t>(static_cast<std::size_t>(pool.num_threads()), num_tasks);
  std::vector<std::atomic<int>> in_use(std::max<std::size_t>(1, max_workers));
  std::atomic<int> bad_worker{0}, overlap{0};
  pool.parallel_for(num_tasks, [&](std::size_t t, int w) {
    if (w < 0 || static_cast<std::size_t>(w) >= max_workers) {
      ++bad_worker;
      return;
    }
    if (in_use[static_cast<std::size_t>(w)].fetch_add(1) != 0) ++overlap;
    runs[t].fetch_add(1);
    in_use[static_cast<std::size_t>(w)].fetch_sub(1);
  });
  CHECK(bad_worker.load() == 0);
  CHECK(overlap.load() == 0);
  for (std::size_t t = 0; t < num_tasks; ++t)
    if (runs[t].load() != 1) FAIL_CHECK("task ", t, " of ", num_tasks, " ran ", runs[t].load(), " times");
}

} // namespace

TEST_CASE("ThreadPool: every task runs exactly once for any task and thread count (property)") {
  std::mt19937_64 rng(31);
  const int rounds = 60 * foremoe_test::seed_multiplier();
  for (int it = 0; it < rounds; ++it) {
    const int threads = 1 + static_cast<int>(rng() % 8);
    const auto tasks = static_cast<std::size_t>(rng() % 400);
    CAPTURE(threads);
    CAPTURE(tasks);
    ThreadPool pool(threads);
    CHECK(pool.num_threads() == threads);
    check_once(pool, tasks);
  }
}

TEST_CASE("ThreadPool: one pool is reused across many calls of random sizes") {
  std::mt19937_64 rng(32);
  for (int threads : {2, 3, 5}) {
    ThreadPool pool(threads);
    const int calls = 200 * foremoe_test::seed_multiplier();
    std::int64_t want = 0;
    std::atomic<std::int64_t> sum{0};
    for (int c = 0; c < calls; ++c) {
      const auto tasks = static_cast<std::size_t>(rng() % 50);
      want += static_cast<std::int64_t>(tasks * (tasks + 1) / 2);
      pool.parallel_for(tasks, [&](std::size_t t, int) { sum += static_cast<std::int64_t>(t + 1); });
      if (c % 50 == 0) check_once(pool, tasks);
    }
    CHECK(sum.load() == want);
  }
}

TEST_CASE("ThreadPool: the lowest failing task's exception reaches the caller, every lower task ran (property)") {
  std::mt19937_64 rng(33);
  const int rounds = 60 * foremoe_test::seed_multiplier();
  for (int it = 0; it < rounds; ++it) {
    const int threads = 1 + static_cast<int>(rng() % 6);
    const std::size_t tasks = 1 + rng() % 300;
    std::set<std::size_t> failing;
    for (std::size_t f = 0, n = 1 + rng() % 4; f < n; ++f)
      failing.insert(rng() % tasks);
    CAPTURE(threads);
    CAPTURE(tasks);
    const std::size_t first = *failing.begin();
    ThreadPool pool(threads);
    std::vector<std::atomic<int>> runs(tasks);
    std::string what;
    try {
      pool.parallel_for(tasks, [&](std::size_t t, int) {
        runs[t].fetch_add(1);
        if (failing.count(t) != 0) throw std::runtime_error("task " + std::to_string(t));
      });
    } catch (const std::runtime_error &e) {
      what = e.what();
    }
    CHECK(what == "task " + std::to_string(first));
    for (std::size_t t = 0; t < tasks; ++t) {
      CHECK(runs[t].load() <= 1);
      if (t <= first) CHECK(runs[t].load() == 1);
    }
    // The failure leaves the pool usable.
    check_once(pool, static_cast<std::size_t>(rng() % 100));
  }
}

TEST_CASE("ThreadPool: a task calling parallel_for on its own pool runs the inner tasks, without deadlock") {
  std::mt19937_64 rng(34);
  const int rounds = 20 * foremoe_test::seed_multiplier();
  for (int it = 0; it < rounds; ++it) {
    const int threads = 2 + static_cast<int>(rng() % 4);
    const std::size_t outer = 1 + rng() % 20, inner = rng() % 20;
    ThreadPool pool(threads);
    std::vector<std::atomic<int>> runs(outer * inner);
    std::atomic<int> not_inline{0};
    pool.parallel_for(outer, [&](std::size_t i, int) {
      pool.parallel_for(inner, [&](std::size_t j, int w) {
        if (w != 0) ++not_inline; // the workers are busy with the outer call: inner tasks run inline
        runs[i * inner + j].fetch_add(1);
      });
    });
    if (outer > 1) CHECK(not_inline.load() == 0); // a single outer task runs inline and leaves the workers free
    for (const auto &r : runs)
      CHECK(r.load() == 1);
  }
  // An inner failure propagates through the outer call.
  ThreadPool pool(3);
  CHECK_THROWS_WITH_AS(pool.parallel_for(8,
                                         [&](std::size_t i, int) {
                                           pool.parallel_for(4, [&](std::size_t j, int) {
                                             if (i == 5 && j == 2) throw Error("inner 5/2");
                                           });
                                         }),
                       "inner 5/2", Error);
  check_once(pool, 64);
}

TEST_CASE("ThreadPool: concurrent callers on one pool all finish with every task run once") {
  ThreadPool pool(3);
  const int calls = 100 * foremoe_test::seed_multiplier();
  std::vector<std::int64_t> sums(4, 0);
  std::vector<std::thread> callers;
  for (std::size_t c = 0; c < sums.size(); ++c)
    callers.emplace_back([&, c] {
      for (int k = 0; k < calls; ++k) {
        std::atomic<std::int64_t> s{0};
        pool.parallel_for(33, [&](std::size_t t, int) { s += static_cast<std::int64_t>(t); });
        sums[c] += s.load();
      }
    });
  for (auto &t : callers)
    t.join();
  for (std::int64_t s : sums)
    CHECK(s == static_cast<std::int64_t>(calls) * (32 * 33 / 2));
}

TEST_CASE("ThreadPool: bad sizes are refused by name; lazy_pool starts one pool and keeps it") {
  CHECK_THROWS_WITH_AS(ThreadPool(0), "ThreadPool: num_threads must be >= 1, got 0", Error);
  CHECK_THROWS_AS(ThreadPool(-3), Error);
  std::unique_ptr<ThreadPool> p;
  ThreadPool &a = lazy_pool(p, 2);
  ThreadPool &b = lazy_pool(p, 2);
  CHECK(&a == &b);
  CHECK(a.num_threads() == 2);
  check_once(a, 10);
}

#if defined(__unix__)
TEST_CASE("ThreadPool: a process forked after the pool started runs its calls inline") {
  ThreadPool pool(3);
  check_once(pool, 50);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // No doctest checks here: the child reports through its exit status only.
    std::vector<int> runs(40, 0);
    int max_worker = 0;
    pool.parallel_for(runs.size(), [&](std::size_t t, int w) {
      ++runs[t];
      max_worker = std::max(max_worker, w);
    });
    const bool ok = max_worker == 0 && std::all_of(runs.begin(), runs.end(), [](int r) { return r == 1; });
    ::_exit(ok ? 0 : 1);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  check_once(pool, 50);
}
#endif

TEST_CASE("Planner: one planner reuses its pool over many micro-steps, plans equal one thread's (property)") {
  std::mt19937_64 rng(35);
  const int rounds = 4 * foremoe_test::seed_multiplier();
  for (int it = 0; it < rounds; ++it) {
    const int layers = 1 + static_cast<int>(rng() % 7), experts = 16;
    const Topology topo{2, 2, 6};
    PlannerOptions opts;
    opts.move_budget = 1;
    Planner one(layers, experts, topo, opts);
    opts.num_threads = 2 + static_cast<int>(rng() % 4);
    CAPTURE(opts.num_threads);
    Planner many(layers, experts, topo, opts);
    const Placement *res_one = nullptr, *res_many = nullptr;
    Placement p_one, p_many;
    for (int m = 0; m < 6; ++m) {
      std::vector<std::int64_t> loads(static_cast<std::size_t>(layers) * experts);
      for (auto &x : loads)
        x = static_cast<std::int64_t>(rng() % 500);
      const auto a = one.plan(loads, Stage::update, res_one);
      const auto b = many.plan(loads, Stage::update, res_many);
      REQUIRE(a.size() == b.size());
      for (std::size_t l = 0; l < a.size(); ++l) {
        CHECK(a[l].placement == b[l].placement);
        CHECK(a[l].slot_tokens == b[l].slot_tokens);
        CHECK(a[l].moves == b[l].moves);
      }
      p_one = to_placement(a);
      p_many = to_placement(b);
      res_one = &p_one;
      res_many = &p_many;
    }
  }
}
