// Host backend of the asynchronous calls: the work runs at once on the calling thread (the host is the device),
// and its outcome waits for `check`, as on a device.

#include <memory>

#include "../backends.hpp"
#include "../token_map/token_map_backends.hpp"
#include "workspace.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {
namespace {

class HostWorkspace final : public Workspace::Impl {
public:
  Status count(const CountRequest &req, int num_moe_layers, std::span<std::int64_t> out, void *,
               int num_threads) override {
    const int threads = num_threads < 1 ? 1 : num_threads;
    if (!pool_ || pool_->num_threads() != threads) pool_ = std::make_unique<ThreadPool>(threads);
    keep(host_count_loads(req, num_moe_layers, out.data(), *pool_));
    return Status::success();
  }
  Status map(const MapRequest &req, const TokenRanges &ranges, std::span<const std::int64_t> source_offsets,
             std::span<std::int32_t> out_slots, void *) override {
    keep(host_map_tokens(req, ranges, source_offsets, out_slots.data()));
    return Status::success();
  }
  Status check(int) override {
    Status s = std::move(first_);
    first_ = Status::success();
    return s;
  }

private:
  void keep(Status s) {
    if (first_.ok() && !s.ok()) first_ = std::move(s);
  }
  Status first_; // the first failure since the last check
  // The workspace is the runtime's object that lives across calls, so it keeps the counting threads between
  // them (restarted only when a call asks for another count); `count_loads` makes a workspace per call.
  std::unique_ptr<ThreadPool> pool_;
};

} // namespace

std::unique_ptr<Workspace::Impl> make_host_workspace() { return std::make_unique<HostWorkspace>(); }

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
