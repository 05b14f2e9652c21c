// CUDA backend of the transfer engine: copy-engine paths only. Every local GPU has one non-blocking stream per path;
// host-mirror chunks are `cudaMemcpyAsync` from pinned memory, GPU-direct chunks are peer copies, each bracketed by
// timing events. Gates become `cudaStreamWaitEvent` on the copy streams (the host never blocks on compute), and
// `enqueue_wait` makes a compute stream wait on a host-written flag with a stream memory operation.

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "../transport.hpp"
#include "cuda_check.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {
namespace {

__global__ void checksum_kernel(const unsigned char *__restrict__ p, std::int64_t num_bytes,
                                unsigned long long *__restrict__ out) {
  const std::int64_t words = num_bytes / 8;
  unsigned long long sum = 0;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i <= words;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    std::uint64_t w = 0;
    if (i < words) {
      for (int b = 0; b < 8; ++b)
        w |= static_cast<std::uint64_t>(p[i * 8 + b]) << (8 * b);
    } else {
      const std::int64_t tail = num_bytes - words * 8;
      if (tail == 0) continue;
      for (int b = 0; b < tail; ++b)
        w |= static_cast<std::uint64_t>(p[i * 8 + b]) << (8 * b);
    }
    sum += mix64(w ^ mix64(static_cast<std::uint64_t>(i)));
  }
  // Wrap-around addition is order-free, so atomics give the CPU's value.
  for (int off = 16; off > 0; off /= 2)
    sum += __shfl_down_sync(0xffffffffu, sum, off);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, sum);
}

__global__ void accumulate_kernel(float *__restrict__ dst, const float *__restrict__ src, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    dst[i] += src[i];
}

// Fallback of enqueue_wait where stream memory operations are unsupported: one thread spins on the flag, bounded.
__global__ void wait_flag_kernel(const volatile std::uint32_t *flag, long long max_cycles) {
  const long long t0 = clock64();
  while (*flag == 0 && clock64() - t0 < max_cycles) {
  }
}

constexpr auto sync_timeout = std::chrono::seconds(30);

// Waits for `s` without blocking forever.
Status wait_stream(cudaStream_t s, const char *what) {
  const auto deadline = std::chrono::steady_clock::now() + sync_timeout;
  for (;;) {
    const cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return Status::success();
    if (e != cudaErrorNotReady)
      return {StatusCode::device_error, std::string(what) + ": " + cudaGetErrorString(e)};
    if (std::chrono::steady_clock::now() > deadline)
      return {StatusCode::timed_out, std::string(what) + ": the device did not finish within 30 s"};
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

class CudaTransport final : public Transport {
public:
  Status init(const EngineOptions &o) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
      (void)cudaGetLastError();
      return {StatusCode::unavailable, "TransferEngine: no CUDA device"};
    }
    const int num_gpus = o.topology.num_gpus();
    dev_ = o.cuda_device_of_gpu;
    if (dev_.empty())
      for (int g = 0; g < num_gpus; ++g)
        dev_.push_back(g < n ? g : -1);
    if (static_cast<int>(dev_.size()) != num_gpus)
      return {StatusCode::invalid_argument, "TransferEngine: cuda_device_of_gpu has " + std::to_string(dev_.size()) +
                                                " entries for " + std::to_string(num_gpus) + " GPUs"};
    for (int g = 0; g < num_gpus; ++g)
      if (dev_[g] >= n)
        return {StatusCode::invalid_argument, "TransferEngine: GPU " + std::to_string(g) + " maps to device " +
                                                  std::to_string(dev_[g]) + " of " + std::to_string(n)};
    try {
      streams_.resize(static_cast<std::size_t>(n));
      for (int d = 0; d < n; ++d) {
        if (std::find(dev_.begin(), dev_.end(), d) == dev_.end()) continue;
        FOREMOE_CUDA_CHECK(cudaSetDevice(d));
        for (int p = 0; p < transfer::num_paths + 1; ++p) // the last one runs checksums and accumulations
          FOREMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&streams_[d][p], cudaStreamNonBlocking));
        for (int e = 0; e < n; ++e) {
          int can = 0;
          if (e != d && cudaDeviceCanAccessPeer(&can, d, e) == cudaSuccess && can) {
            const cudaError_t err = cudaDeviceEnablePeerAccess(e, 0);
            if (err != cudaSuccess && err != cudaErrorPeerAccessAlreadyEnabled) FOREMOE_CUDA_CHECK(err);
            (void)cudaGetLastError();
          }
        }
      }
      FOREMOE_CUDA_CHECK(cudaMallocHost(&host_sum_, sizeof(unsigned long long)));
    } catch (const DeviceError &e) {
      return {StatusCode::device_error, e.what()};
    }
    return Status::success();
  }
  ~CudaTransport() override {
    for (auto &[h, op] : ops_) {
      FOREMOE_CUDA_ASSERT(cudaEventSynchronize(op.end));
      FOREMOE_CUDA_ASSERT(cudaEventDestroy(op.begin));
      FOREMOE_CUDA_ASSERT(cudaEventDestroy(op.end));
    }
    for (std::size_t d = 0; d < streams_.size(); ++d)
      for (cudaStream_t s : streams_[d])
        if (s != nullptr) {
          FOREMOE_CUDA_ASSERT(cudaSetDevice(static_cast<int>(d)));
          FOREMOE_CUDA_ASSERT(cudaStreamSynchronize(s));
          FOREMOE_CUDA_ASSERT(cudaStreamDestroy(s));
        }
    if (host_sum_ != nullptr) FOREMOE_CUDA_ASSERT(cudaFreeHost(host_sum_));
  }

  Status start(const CopyOp &op, std::uint64_t &handle) override {
    const int d = dev_[op.dst_gpu];
    if (d < 0 || (op.src_gpu >= 0 && dev_[op.src_gpu] < 0))
      return {StatusCode::unavailable, "CUDA transport: GPU " + std::to_string(d < 0 ? op.dst_gpu : op.src_gpu) +
                                           " belongs to another process; cross-process NCCL moves are not built in"};
    try {
      FOREMOE_CUDA_CHECK(cudaSetDevice(d));
      cudaStream_t s = streams_[d][static_cast<int>(op.path)];
      Op o;
      FOREMOE_CUDA_CHECK(cudaEventCreate(&o.begin));
      FOREMOE_CUDA_CHECK(cudaEventCreate(&o.end));
      FOREMOE_CUDA_CHECK(cudaEventRecord(o.begin, s));
      if (op.src_gpu < 0 || dev_[op.src_gpu] == d)
        FOREMOE_CUDA_CHECK(cudaMemcpyAsync(op.dst, op.src, static_cast<std::size_t>(op.num_bytes), cudaMemcpyDefault, s));
      else
        FOREMOE_CUDA_CHECK(cudaMemcpyPeerAsync(op.dst, d, op.src, dev_[op.src_gpu],
                                               static_cast<std::size_t>(op.num_bytes), s));
      FOREMOE_CUDA_CHECK(cudaEventRecord(o.end, s));
      std::lock_guard lock(mu_);
      handle = next_++;
      ops_[handle] = o;
    } catch (const DeviceError &e) {
      return {StatusCode::device_error, e.what()};
    }
    return Status::success();
  }
  Status query(std::uint64_t handle, double &seconds) override {
    Op o;
    {
      std::lock_guard lock(mu_);
      auto it = ops_.find(handle);
      if (it == ops_.end()) return {StatusCode::invalid_argument, "CUDA transport: unknown copy handle"};
      o = it->second;
    }
    const cudaError_t e = cudaEventQuery(o.end);
    if (e == cudaErrorNotReady) return {StatusCode::in_progress, ""};
    Status st = e != cudaSuccess ? Status(StatusCode::device_error, std::string("CUDA copy failed: ") +
                                                                           cudaGetErrorString(e))
                                 : Status::success();
    if (e == cudaSuccess) {
      float ms = 0;
      if (cudaEventElapsedTime(&ms, o.begin, o.end) == cudaSuccess) seconds = ms * 1e-3;
    }
    FOREMOE_CUDA_ASSERT(cudaEventDestroy(o.begin));
    FOREMOE_CUDA_ASSERT(cudaEventDestroy(o.end));
    std::lock_guard lock(mu_);
    ops_.erase(handle);
    return st;
  }
  bool cancel(std::uint64_t) override { return false; } // enqueued copies always run to the end
  Status gate(const Gate &g, bool &ready) override {
    ready = true;
    if (g.host != nullptr) ready = g.host->is_set();
    if (g.cuda_event == nullptr || !ready) return Status::success();
    try {
      for (std::size_t d = 0; d < streams_.size(); ++d)
        for (int p = 0; p < transfer::num_paths; ++p)
          if (streams_[d][p] != nullptr) {
            FOREMOE_CUDA_CHECK(cudaSetDevice(static_cast<int>(d)));
            FOREMOE_CUDA_CHECK(cudaStreamWaitEvent(streams_[d][p], static_cast<cudaEvent_t>(g.cuda_event), 0));
          }
    } catch (const DeviceError &e) {
      return {StatusCode::device_error, e.what()};
    }
    return Status::success();
  }
  Status checksum(int gpu, const std::byte *p, std::int64_t n, std::uint64_t &out) override {
    if (gpu < 0) {
      out = runtime::checksum({p, static_cast<std::size_t>(n)});
      return Status::success();
    }
    const int d = dev_[gpu];
    if (d < 0) return {StatusCode::unavailable, "checksum: GPU " + std::to_string(gpu) + " is not local"};
    try {
      FOREMOE_CUDA_CHECK(cudaSetDevice(d));
      cudaStream_t s = streams_[d][transfer::num_paths];
      unsigned long long *dsum = nullptr;
      FOREMOE_CUDA_CHECK(cudaMallocAsync(&dsum, sizeof *dsum, s));
      FOREMOE_CUDA_CHECK(cudaMemsetAsync(dsum, 0, sizeof *dsum, s));
      const std::int64_t words = n / 8 + 1;
      const int blocks = static_cast<int>(std::min<std::int64_t>(1024, (words + 255) / 256));
      checksum_kernel<<<blocks, 256, 0, s>>>(reinterpret_cast<const unsigned char *>(p), n, dsum);
      FOREMOE_CUDA_CHECK(cudaGetLastError());
      std::lock_guard lock(sum_mu_);
      FOREMOE_CUDA_CHECK(cudaMemcpyAsync(host_sum_, dsum, sizeof *dsum, cudaMemcpyDeviceToHost, s));
      FOREMOE_CUDA_CHECK(cudaFreeAsync(dsum, s));
      if (Status st = wait_stream(s, "checksum"); !st.ok()) return st;
      out = mix64(static_cast<std::uint64_t>(n)) + *host_sum_;
    } catch (const DeviceError &e) {
      return {StatusCode::device_error, e.what()};
    }
    return Status::success();
  }
  Status accumulate(int gpu, float *dst, const float *src, std::int64_t n) override {
    const int d = dev_[gpu];
    if (d < 0) return {StatusCode::unavailable, "accumulate: GPU " + std::to_string(gpu) + " is not local"};
    try {
      FOREMOE_CUDA_CHECK(cudaSetDevice(d));
      cudaStream_t s = streams_[d][transfer::num_paths];
      const int blocks = static_cast<int>(std::min<std::int64_t>(2048, (n + 255) / 256));
      accumulate_kernel<<<blocks > 0 ? blocks : 1, 256, 0, s>>>(dst, src, n);
      FOREMOE_CUDA_CHECK(cudaGetLastError());
      return wait_stream(s, "accumulate");
    } catch (const DeviceError &e) {
      return {StatusCode::device_error, e.what()};
    }
  }
  Status alloc(int gpu, std::int64_t n, std::byte *&out) override {
    const int d = dev_[gpu];
    if (d < 0) return {StatusCode::unavailable, "alloc: GPU " + std::to_string(gpu) + " is not local"};
    try {
      FOREMOE_CUDA_CHECK(cudaSetDevice(d));
      void *p = nullptr;
      FOREMOE_CUDA_CHECK(cudaMalloc(&p, static_cast<std::size_t>(n)));
      out = static_cast<std::byte *>(p);
    } catch (const DeviceError &e) {
      return {StatusCode::device_error, e.what()};
    }
    return Status::success();
  }
  void free(int, std::byte *p) noexcept override { FOREMOE_CUDA_ASSERT(cudaFree(p)); }
  Status alloc_flag(volatile std::uint32_t *&flag) override {
    void *p = nullptr;
    if (cudaHostAlloc(&p, sizeof(std::uint32_t), cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess)
      return {StatusCode::device_error, "alloc_flag: cudaHostAlloc failed"};
    flag = static_cast<volatile std::uint32_t *>(p);
    *flag = 0;
    return Status::success();
  }
  void free_flag(volatile std::uint32_t *flag) noexcept override {
    FOREMOE_CUDA_ASSERT(cudaFreeHost(const_cast<std::uint32_t *>(flag)));
  }
  Status enqueue_wait(void *stream, volatile std::uint32_t *flag) override {
    auto s = static_cast<cudaStream_t>(stream);
    void *dptr = nullptr;
    if (cudaHostGetDevicePointer(&dptr, const_cast<std::uint32_t *>(flag), 0) != cudaSuccess)
      return {StatusCode::device_error, "enqueue_wait: the completion flag is not mapped"};
    // The driver entry point is looked up at run time so the library loads where no driver is installed.
    using wait_value_fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
    void *fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 12000, cudaEnableDefault, &found) ==
            cudaSuccess &&
        found == cudaDriverEntryPointSuccess && fn != nullptr &&
        reinterpret_cast<wait_value_fn>(fn)(s, reinterpret_cast<CUdeviceptr>(dptr), 1, CU_STREAM_WAIT_VALUE_GEQ) ==
            CUDA_SUCCESS)
      return Status::success();
    (void)cudaGetLastError();
    // No stream memory operations here: a one-thread kernel waits, bounded to about a minute at 2 GHz.
    wait_flag_kernel<<<1, 1, 0, s>>>(static_cast<const volatile std::uint32_t *>(dptr), 120'000'000'000LL);
    if (cudaGetLastError() != cudaSuccess) return {StatusCode::device_error, "enqueue_wait: launch failed"};
    return Status::success();
  }

private:
  struct Op {
    cudaEvent_t begin = nullptr, end = nullptr;
  };
  std::vector<int> dev_;
  std::vector<std::array<cudaStream_t, transfer::num_paths + 1>> streams_;
  std::mutex mu_, sum_mu_;
  std::uint64_t next_ = 1;
  std::unordered_map<std::uint64_t, Op> ops_;
  unsigned long long *host_sum_ = nullptr;
};

} // namespace

Status make_cuda_transport(const EngineOptions &opts, std::unique_ptr<Transport> &out) {
  auto t = std::make_unique<CudaTransport>();
  if (Status st = t->init(opts); !st.ok()) return st;
  out = std::move(t);
  return Status::success();
}

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
