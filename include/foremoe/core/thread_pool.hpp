#pragma once
/// @file
/// One persistent thread pool for the library's fork/join loops (planner layers, EP groups, synthetic traces,
/// host load counting): threads start once and are reused by every `parallel_for`.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "foremoe/core/error.hpp"

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#define FOREMOE_THREAD_POOL_PID 1
#endif

namespace foremoe {
inline namespace v0 {

/// `num_threads - 1` worker threads, started once; the thread that calls `parallel_for` is the last participant.
/// One `parallel_for` uses the workers at a time: a call made while they are busy (from a task of this pool, or
/// concurrently from another thread) runs its tasks inline on the calling thread, so nested and concurrent use
/// never deadlocks and never waits on a lock held by a task. A pool used in a process forked after it started its
/// threads (whose workers do not exist there) runs inline too. Not copyable or movable (workers point at it);
/// hold it by `std::unique_ptr` in a movable owner.
class ThreadPool {
public:
  /// `num_threads` >= 1 participants: the caller plus `num_threads - 1` workers.
  explicit ThreadPool(int num_threads) : num_threads_(num_threads) {
    detail::require(num_threads >= 1, "ThreadPool: num_threads must be >= 1, got ", num_threads);
    threads_->reserve(static_cast<std::size_t>(num_threads - 1));
    try {
      for (int w = 1; w < num_threads; ++w)
        threads_->emplace_back([this] { work(); });
    } catch (...) {
      stop(); // the ones already started must not outlive the half-built pool
      throw;
    }
  }
  ThreadPool(const ThreadPool &) = delete;
  ThreadPool &operator=(const ThreadPool &) = delete;
  ThreadPool(ThreadPool &&) = delete;
  ThreadPool &operator=(ThreadPool &&) = delete;
  ~ThreadPool() {
#if defined(FOREMOE_THREAD_POOL_PID)
    if (forked()) {
      // The workers were not copied into this process and their lock may have been copied held: joining them
      // would hang, destroying joinable handles would terminate, so the handles are left behind unowned.
      const std::vector<std::thread> *left = threads_.release();
      static_cast<void>(left);
      return;
    }
#endif
    stop();
  }

  /// Participants of one `parallel_for` at most (the caller included).
  [[nodiscard]] int num_threads() const noexcept { return num_threads_; }

  /// Runs `fn(task_idx, worker_idx)` once for every task in `[0, num_tasks)`, tasks handed out in increasing
  /// order, `worker_idx` in `[0, min(num_threads(), num_tasks))` and never used by two tasks of this call at once
  /// (index the call's per-worker scratch with it). Returns when every task has finished. If tasks throw, no task is
  /// started after the first failure and the exception of the lowest failing task is rethrown: every lower task was
  /// handed out before it and ran, so when failures depend on the task alone it is the one a serial loop would throw.
  template <class Fn> void parallel_for(std::size_t num_tasks, Fn &&fn) {
    if (num_tasks == 0) return;
    const int workers = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(num_threads_), num_tasks));
    if (workers == 1 || forked() || busy_.exchange(true, std::memory_order_acquire)) {
      for (std::size_t t = 0; t < num_tasks; ++t)
        fn(t, 0);
      return;
    }
    using F = std::remove_reference_t<Fn>;
    Job job;
    job.num_tasks = num_tasks;
    job.max_joined = workers - 1;
    job.fn = const_cast<void *>(static_cast<const void *>(std::addressof(fn)));
    job.call = [](void *f, std::size_t t, int w) { (*static_cast<F *>(f))(t, w); };
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      job_ = &job;
      ++generation_;
    }
    wake_.notify_all();
    run(job, 0);
    {
      std::unique_lock<std::mutex> lock(mutex_);
      job_ = nullptr; // a worker that wakes from now on finds nothing to join
      done_.wait(lock, [&] { return job.active == 0; });
    }
    busy_.store(false, std::memory_order_release);
    if (job.error) std::rethrow_exception(job.error);
  }

private:
  struct Job {
    std::size_t num_tasks = 0;
    int max_joined = 0; ///< workers that may join besides the caller
    void *fn = nullptr;
    void (*call)(void *, std::size_t, int) = nullptr;
    std::atomic<std::size_t> next{0};
    std::atomic<bool> failed{false};
    int joined = 0, active = 0; ///< under the pool's mutex
    std::mutex error_mutex;
    std::size_t error_task = std::numeric_limits<std::size_t>::max();
    std::exception_ptr error;
  };

  static void run(Job &job, int worker) {
    while (!job.failed.load(std::memory_order_relaxed)) {
      const std::size_t t = job.next.fetch_add(1, std::memory_order_relaxed);
      if (t >= job.num_tasks) return;
      try {
        job.call(job.fn, t, worker);
      } catch (...) {
        const std::lock_guard<std::mutex> lock(job.error_mutex);
        if (t < job.error_task) {
          job.error_task = t;
          job.error = std::current_exception();
        }
        job.failed.store(true, std::memory_order_relaxed);
      }
    }
  }

  void work() {
    std::unique_lock<std::mutex> lock(mutex_);
    std::uint64_t seen = 0;
    for (;;) {
      wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      Job *job = job_;
      if (job == nullptr || job->joined >= job->max_joined) continue;
      const int worker = ++job->joined;
      ++job->active;
      lock.unlock();
      run(*job, worker);
      lock.lock();
      if (--job->active == 0) done_.notify_all();
    }
  }

  void stop() noexcept {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (std::thread &t : *threads_)
      t.join();
    threads_->clear();
  }

  [[nodiscard]] bool forked() const noexcept {
#if defined(FOREMOE_THREAD_POOL_PID)
    return threads_ && !threads_->empty() && ::getpid() != pid_;
#else
    return false;
#endif
  }

  int num_threads_;
#if defined(FOREMOE_THREAD_POOL_PID)
  ::pid_t pid_ = ::getpid();
#endif
  // Behind a pointer so that a forked child can leave the handles without destroying them.
  std::unique_ptr<std::vector<std::thread>> threads_ = std::make_unique<std::vector<std::thread>>();
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::uint64_t generation_ = 0; ///< under `mutex_`: bumped per job, so a worker joins each job at most once
  Job *job_ = nullptr;           ///< under `mutex_`: the job in flight, null between jobs
  bool stopping_ = false;        ///< under `mutex_`
  std::atomic<bool> busy_{false};
};

/// `pool`, made with `num_threads` on first use, so that an owner which never runs in parallel starts no threads.
[[nodiscard]] inline ThreadPool &lazy_pool(std::unique_ptr<ThreadPool> &pool, int num_threads) {
  if (!pool) pool = std::make_unique<ThreadPool>(num_threads);
  return *pool;
}

} // namespace v0
} // namespace foremoe
