// CUDA workspace: records, pinned blocks, device scratch and the deferred error check of the asynchronous calls.

#include "cuda_workspace.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <string>
#include <thread>

#include "foremoe/core/error.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {

CudaWorkspace::~CudaWorkspace() {
  // Calls still in flight: waited for (bounded), else everything is left to them.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (Record *r : pending_)
    for (;;) {
      if (abandoned_) return;
      const cudaError_t e = cudaEventQuery(r->done);
      if (e != cudaErrorNotReady) break;
      if (std::chrono::steady_clock::now() > deadline) return;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  for (auto &r : records_) {
    if (r->done != nullptr) FOREMOE_CUDA_ASSERT(cudaEventDestroy(r->done));
    if (r->pinned != nullptr) FOREMOE_CUDA_ASSERT(cudaFreeHost(r->pinned));
  }
  for (void *p : retired_pinned_)
    FOREMOE_CUDA_ASSERT(cudaFreeHost(p));
  if (scratch_ != nullptr) FOREMOE_CUDA_ASSERT(cudaFree(scratch_));
  for (void *p : retired_device_)
    FOREMOE_CUDA_ASSERT(cudaFree(p));
}

Status CudaWorkspace::begin(Record::Kind kind, cudaStream_t stream, std::size_t upload_bytes, Record *&out) {
  int dev = 0;
  FOREMOE_CUDA_CHECK(cudaGetDevice(&dev));
  if (device_ >= 0 && dev != device_)
    return {StatusCode::invalid_argument, "the workspace's scratch lives on device " + std::to_string(device_) +
                                              ", the current device is " + std::to_string(dev)};
  if (!pending_.empty() && stream != stream_)
    return {StatusCode::invalid_argument,
            "a workspace serves one stream between checks: calls on another stream are still in flight"};
  if (free_.empty()) {
    auto r = std::make_unique<Record>();
    FOREMOE_CUDA_CHECK(cudaEventCreateWithFlags(&r->done, cudaEventDisableTiming));
    ++allocations_;
    free_.reserve(records_.size() + 1);
    pending_.reserve(records_.size() + 1);
    free_.push_back(r.get());
    records_.push_back(std::move(r));
  }
  Record &r = *free_.back();
  const std::size_t need = results_bytes + upload_bytes;
  if (r.pinned_bytes < need) {
    const std::size_t grown = std::max<std::size_t>({need, 2 * r.pinned_bytes, 4096});
    void *p = nullptr;
    FOREMOE_CUDA_CHECK(cudaMallocHost(&p, grown));
    ++allocations_;
    if (r.pinned != nullptr) retired_pinned_.push_back(r.pinned); // idle, but freeing pinned memory syncs
    r.pinned = static_cast<unsigned char *>(p);
    r.pinned_bytes = grown;
  }
  r.kind = kind;
  device_ = dev;
  out = &r;
  return Status::success();
}

unsigned char *CudaWorkspace::scratch(std::size_t bytes, cudaStream_t stream) {
  const std::size_t need = results_bytes + bytes;
  if (scratch_bytes_ < need) {
    const std::size_t grown = std::max<std::size_t>({need, 2 * scratch_bytes_, 1 << 16});
    void *p = nullptr;
    FOREMOE_CUDA_CHECK(cudaMalloc(&p, grown));
    ++allocations_;
    if (scratch_ != nullptr) retired_device_.push_back(scratch_);
    scratch_ = static_cast<unsigned char *>(p);
    scratch_bytes_ = grown;
  }
  FOREMOE_CUDA_CHECK(cudaMemsetAsync(scratch_, 0xff, 2 * sizeof(unsigned long long), stream)); // no error yet
  return scratch_;
}

void CudaWorkspace::finish(Record &r, cudaStream_t stream, const unsigned char *dev_scratch) {
  FOREMOE_CUDA_CHECK(cudaMemcpyAsync(r.pinned, dev_scratch, sizeof(CallResults), cudaMemcpyDeviceToHost, stream));
  FOREMOE_CUDA_CHECK(cudaEventRecord(r.done, stream));
  free_.pop_back(); // `r` is its back
  pending_.push_back(&r);
  stream_ = stream;
}

Status CudaWorkspace::message(const Record &r) const {
  CallResults res;
  std::memcpy(&res, r.pinned, sizeof res);
  constexpr unsigned long long none = std::numeric_limits<unsigned long long>::max();
  const char *what = r.kind == Record::Kind::count ? "count_loads" : "map_tokens";
  if (res.bad_flat != none) {
    unsigned char raw[8];
    std::memcpy(raw, &res.raw_id, sizeof raw);
    const std::int64_t value = RoutedView(raw, r.dtype, 1, 1, 1).at(0, 0, 0, r.num_experts);
    const auto k = static_cast<std::int64_t>(res.bad_flat % r.topk);
    const auto l = static_cast<std::int64_t>((res.bad_flat / r.topk) % r.num_layers);
    const auto t = static_cast<std::int64_t>(res.bad_flat / (static_cast<unsigned long long>(r.topk) * r.num_layers));
    if (r.kind == Record::Kind::count)
      return {StatusCode::invalid_argument,
              ::foremoe::detail::concat(what, ": expert id ", value, " at token ", t, ", layer ", l, ", k ", k,
                                        " is outside [0, ", r.num_experts, ")")};
    return {StatusCode::invalid_argument,
            ::foremoe::detail::concat(what, ": expert id ", value, " at token ", t, ", layer ", r.layer_idx, ", k ", k,
                                      " is outside [0, ", r.num_experts, ") (", to_string(r.dtype),
                                      " ids, -1 = no route)")};
  }
  if (r.kind == Record::Kind::map && res.bad_key != none) {
    try {
      ::foremoe::detail::fail_count_mismatch(r.ranges, r.layer_idx, static_cast<std::int64_t>(res.bad_key),
                                             res.last - res.first);
    } catch (const Error &e) {
      return {StatusCode::invalid_argument, e.what()};
    }
  }
  return Status::success();
}

Status CudaWorkspace::check(int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  cudaError_t failed = cudaSuccess;
  for (Record *r : pending_)
    for (;;) {
      const cudaError_t e = cudaEventQuery(r->done);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) {
        failed = e;
        break;
      }
      if (std::chrono::steady_clock::now() >= deadline) return {StatusCode::in_progress, ""};
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  const Record *bad = nullptr;
  for (Record *r : pending_) {
    if (failed == cudaSuccess && bad == nullptr && !message(*r).ok()) bad = r;
    free_.push_back(r); // within the reserved capacity
  }
  pending_.clear();
  if (failed != cudaSuccess)
    return {StatusCode::device_error,
            std::string("workspace call failed on the device: ") + cudaGetErrorString(failed)};
  return bad != nullptr ? message(*bad) : Status::success();
}

std::unique_ptr<Workspace::Impl> make_cuda_workspace() { return std::make_unique<CudaWorkspace>(); }

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
