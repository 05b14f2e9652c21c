#pragma once
// The host fabric's matching engine (internal): paired send/receive operations between GPUs of engines that stand for
// separate processes, matched per (source GPU, destination GPU) in posting order, like NCCL point-to-point.

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "foremoe/runtime/testing.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime {

struct HostFabric::Impl {
  /// One posted group: done when every operation in it was matched and delivered.
  struct Group {
    explicit Group(int n) : remaining(n) {}
    std::atomic<int> remaining;
    std::mutex mu;
    std::string error; // first failure, under `mu`
    std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
    std::chrono::steady_clock::time_point t1{};
  };
  struct Pending {
    PeerOp *op = nullptr;
    std::shared_ptr<Group> group;
    const void *owner = nullptr;
  };

  /// Posts `op` (it must stay alive until its group is done or `drop(owner)` ran).
  void post(PeerOp *op, const std::shared_ptr<Group> &g, const void *owner);
  /// Forgets every operation `owner` posted that is still unmatched (its engine is going away).
  void drop(const void *owner);

private:
  static void complete(Group &g, const std::string &error);
  std::mutex mu_;
  std::map<std::pair<int, int>, std::deque<Pending>> sends_, recvs_; // key: (source GPU, destination GPU)
};

} // namespace runtime
} // namespace v0
} // namespace foremoe
