// CUDA backend of the transfer engine: copy-engine paths only. Every local GPU has one non-blocking stream per path;
// host-mirror chunks are `cudaMemcpyAsync` from pinned memory, GPU-direct chunks are peer copies, each bracketed by
// timing events. Gates become `cudaStreamWaitEvent` on the copy streams (the host never blocks on compute), and
// `enqueue_wait` makes a compute stream wait on a host-written flag with a stream memory operation. With NCCL,
// paired transfers with GPUs of other processes are `ncclSend`/`ncclRecv` groups on the network stream, their
// headers staged through a small device buffer.
//
// The hot path allocates nothing and never blocks the host: timing events come from a per-device pool (grown
// geometrically), the checksum result and the peer headers use per-device buffers made at registration (headers
// grown geometrically, an outgrown buffer kept until destruction since queued work may still use it), pinned header
// blocks are reused, and the driver's stream-wait entry point is looked up once.

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#if defined(FOREMOE_HAVE_NCCL)
#include <nccl.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "../../device/cuda_check.hpp"
#include "../../transport_util.hpp"

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

// `dst[i] += src[i]` in `GradType`'s rule, element by element as `runtime::add_grads` (grad_add.hpp) on the host:
// float32 / float64 add in their type; bfloat16 / float16 add both operands converted to float32 in float32 and
// round the sum to nearest, ties to even (`__float2bfloat16_rn`, `__float2half_rn`).
__device__ inline void add_one(float &d, float s) { d += s; }
__device__ inline void add_one(double &d, double s) { d += s; }
__device__ inline void add_one(__nv_bfloat16 &d, __nv_bfloat16 s) {
  d = __float2bfloat16_rn(__bfloat162float(d) + __bfloat162float(s));
}
__device__ inline void add_one(__half &d, __half s) { d = __float2half_rn(__half2float(d) + __half2float(s)); }

template <class T> __global__ void accumulate_kernel(T *__restrict__ dst, const T *__restrict__ src, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    add_one(dst[i], src[i]);
}

template <class T> void launch_accumulate(void *dst, const void *src, std::int64_t n, cudaStream_t s) {
  // At least one block; the grid is named so that clang-format keeps the launch syntax whole.
  const int grid = std::max(1, static_cast<int>(std::min<std::int64_t>(2048, (n + 255) / 256)));
  accumulate_kernel<T><<<grid, 256, 0, s>>>(static_cast<T *>(dst), static_cast<const T *>(src), n);
}

// Fallback of enqueue_wait where stream memory operations are unsupported: one thread spins on the flag, bounded.
__global__ void wait_flag_kernel(const volatile std::uint32_t *flag, std::uint32_t value, long long max_cycles) {
  const long long t0 = clock64();
  while (static_cast<int>(*flag - value) < 0 && clock64() - t0 < max_cycles) {
  }
}

constexpr auto sync_timeout = std::chrono::seconds(30);

// Waits for `s` without blocking forever.
Status wait_stream(cudaStream_t s, const char *what) {
  const auto deadline = std::chrono::steady_clock::now() + sync_timeout;
  for (;;) {
    const cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return Status::success();
    if (e != cudaErrorNotReady) return {StatusCode::device_error, std::string(what) + ": " + cudaGetErrorString(e)};
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
    const std::vector<int> &local = o.peers.local_gpus;
    const bool spmd = multi_process(o);
    dev_ = o.cuda_device_of_gpu;
    if (dev_.empty() && !spmd)
      for (int g = 0; g < num_gpus; ++g)
        dev_.push_back(g < n ? g : -1);
    if (dev_.empty()) {
      // Multi-process default: one local GPU runs on the current device (set by the trainer), several on 0, 1, ...
      int cur = 0;
      if (cudaGetDevice(&cur) != cudaSuccess) cur = 0;
      dev_.assign(static_cast<std::size_t>(num_gpus), -1);
      for (std::size_t i = 0; i < local.size(); ++i)
        dev_[local[i]] = local.size() == 1 ? cur : static_cast<int>(i);
    }
    if (spmd)
      for (int g = 0; g < num_gpus && g < static_cast<int>(dev_.size()); ++g)
        if (std::find(local.begin(), local.end(), g) == local.end()) dev_[g] = -1;
    if (static_cast<int>(dev_.size()) != num_gpus)
      return {StatusCode::invalid_argument, "TransferEngine: cuda_device_of_gpu has " + std::to_string(dev_.size()) +
                                                " entries for " + std::to_string(num_gpus) + " GPUs"};
    for (int g = 0; g < num_gpus; ++g)
      if (dev_[g] >= n)
        return {StatusCode::invalid_argument, "TransferEngine: GPU " + std::to_string(g) + " maps to device " +
                                                  std::to_string(dev_[g]) + " of " + std::to_string(n)};
    if (spmd && !o.peers.bridge) { // with a bridge, paired transfers never reach this transport
#if defined(FOREMOE_HAVE_NCCL)
      comms_.assign(static_cast<std::size_t>(num_gpus), nullptr);
      for (std::size_t g = 0; g < o.peers.nccl_comm_of_gpu.size() && g < comms_.size(); ++g)
        comms_[g] = static_cast<ncclComm_t>(o.peers.nccl_comm_of_gpu[g]);
      for (int g : local)
        if (comms_[g] == nullptr)
          return {StatusCode::invalid_argument, "TransferEngine: local GPU " + std::to_string(g) +
                                                    " has no NCCL communicator (peers.nccl_comm_of_gpu)"};
      rank_ = o.peers.nccl_rank_of_gpu;
      if (rank_.empty())
        for (int g = 0; g < num_gpus; ++g)
          rank_.push_back(g);
      if (static_cast<int>(rank_.size()) != num_gpus)
        return {StatusCode::invalid_argument, "TransferEngine: peers.nccl_rank_of_gpu has " +
                                                  std::to_string(rank_.size()) + " entries for " +
                                                  std::to_string(num_gpus) + " GPUs"};
#else
      return {StatusCode::unavailable,
              "TransferEngine: GPUs of other processes need NCCL, and this runtime was built without it"};
#endif
    }
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
      created_.fetch_add(1, std::memory_order_relaxed);
      dev_sum_.assign(static_cast<std::size_t>(n), nullptr);
      events_.resize(static_cast<std::size_t>(n));
      num_events_.assign(static_cast<std::size_t>(n), 0);
      for (int d = 0; d < n; ++d) {
        if (streams_[d][0] == nullptr) continue;
        FOREMOE_CUDA_CHECK(cudaSetDevice(d));
        FOREMOE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void **>(&dev_sum_[d]), sizeof(unsigned long long)));
        created_.fetch_add(1, std::memory_order_relaxed);
        grow_events(d); // the first block at registration
      }
#if defined(FOREMOE_HAVE_NCCL)
      hdr_.assign(static_cast<std::size_t>(n), HeaderBuffer{});
#endif
    } catch (const DeviceError &e) {
      return {StatusCode::device_error, e.what()};
    }
    // The driver entry point is looked up at run time so the library loads where no driver is installed.
    void *fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 12000, cudaEnableDefault, &found) == cudaSuccess &&
        found == cudaDriverEntryPointSuccess)
      wait_value_ = reinterpret_cast<WaitValueFn>(fn);
    (void)cudaGetLastError();
    return Status::success();
  }
  ~CudaTransport() override {
    for (auto &[h, op] : ops_) {
      FOREMOE_CUDA_ASSERT(cudaEventSynchronize(op.end));
      give_events(op);
    }
    for (std::size_t d = 0; d < streams_.size(); ++d)
      for (cudaStream_t s : streams_[d])
        if (s != nullptr) {
          FOREMOE_CUDA_ASSERT(cudaSetDevice(static_cast<int>(d)));
          // Bounded: a paired transfer whose peer never posted would block forever (its stream is then left to
          // the driver, and the communicator must be aborted by its owner).
          (void)wait_stream(s, "~CudaTransport");
          FOREMOE_CUDA_ASSERT(cudaStreamDestroy(s));
        }
    for (std::size_t d = 0; d < events_.size(); ++d)
      for (cudaEvent_t e : events_[d]) {
        FOREMOE_CUDA_ASSERT(cudaSetDevice(static_cast<int>(d)));
        FOREMOE_CUDA_ASSERT(cudaEventDestroy(e));
      }
    if (host_sum_ != nullptr) FOREMOE_CUDA_ASSERT(cudaFreeHost(host_sum_));
    for (std::size_t d = 0; d < dev_sum_.size(); ++d)
      if (dev_sum_[d] != nullptr) {
        FOREMOE_CUDA_ASSERT(cudaSetDevice(static_cast<int>(d)));
        FOREMOE_CUDA_ASSERT(cudaFree(dev_sum_[d]));
      }
#if defined(FOREMOE_HAVE_NCCL)
    for (auto &[bytes, p] : pinned_pool_)
      FOREMOE_CUDA_ASSERT(cudaFreeHost(p));
    for (std::size_t d = 0; d < hdr_.size(); ++d) {
      (void)cudaSetDevice(static_cast<int>(d));
      if (hdr_[d].p != nullptr) FOREMOE_CUDA_ASSERT(cudaFree(hdr_[d].p));
      for (std::uint64_t *p : hdr_[d].retired)
        FOREMOE_CUDA_ASSERT(cudaFree(p));
    }
#endif
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
      take_events(d, o);
      FOREMOE_CUDA_CHECK(cudaEventRecord(o.begin, s));
      if (op.src_gpu < 0 || dev_[op.src_gpu] == d)
        FOREMOE_CUDA_CHECK(
            cudaMemcpyAsync(op.dst, op.src, static_cast<std::size_t>(op.num_bytes), cudaMemcpyDefault, s));
      else
        FOREMOE_CUDA_CHECK(
            cudaMemcpyPeerAsync(op.dst, d, op.src, dev_[op.src_gpu], static_cast<std::size_t>(op.num_bytes), s));
      FOREMOE_CUDA_CHECK(cudaEventRecord(o.end, s));
      std::lock_guard lock(mu_);
      handle = next_++;
      ops_[handle] = o;
    } catch (const DeviceError &e) {
      return {StatusCode::device_error, e.what()};
    }
    return Status::success();
  }
  std::int64_t resources_created() const noexcept override { return created_.load(std::memory_order_relaxed); }
#if defined(FOREMOE_HAVE_NCCL)
  static std::string nccl_error(const char *what, ncclResult_t r, ncclComm_t comm) {
    std::string m = std::string(what) + ": " + ncclGetErrorString(r);
    if (const char *last = comm != nullptr ? ncclGetLastError(comm) : nullptr; last != nullptr && *last != 0)
      m += std::string(" (") + last + ")";
    return m;
  }

  Status start_peer(std::span<PeerOp> ops, std::uint64_t &handle) override {
    PeerRec rec;
    rec.ops = ops;
    const std::size_t n = ops.size();
    for (const PeerOp &op : ops) {
      const int d = dev_[op.local_gpu];
      if (d < 0 || comms_[op.local_gpu] == nullptr)
        return {StatusCode::unavailable, "CUDA transport: GPU " + std::to_string(op.local_gpu) + " is not local"};
      if (std::find(rec.devs.begin(), rec.devs.end(), d) == rec.devs.end()) rec.devs.push_back(d);
    }
    try {
      // Headers: host staging (pinned) and device staging, one block of n headers per device.
      const std::size_t block = n * 2 * sizeof(std::uint64_t);
      rec.host_bytes = std::max<std::size_t>(block * rec.devs.size(), 4096);
      rec.host_hdr = take_pinned(rec.host_bytes);
      if (rec.host_hdr == nullptr)
        throw DeviceError("cudaMallocHost of " + std::to_string(rec.host_bytes) + " bytes failed");
      rec.dev_hdr.assign(rec.devs.size(), nullptr);
      for (std::size_t i = 0; i < n; ++i) {
        const std::size_t di = dev_index(rec, dev_[ops[i].local_gpu]);
        std::memcpy(rec.host_hdr + di * n * 2 + i * 2, ops[i].header, sizeof ops[i].header);
      }
      for (std::size_t di = 0; di < rec.devs.size(); ++di) {
        const int d = rec.devs[di];
        cudaStream_t s = streams_[d][static_cast<int>(transfer::Path::network)];
        FOREMOE_CUDA_CHECK(cudaSetDevice(d));
        rec.ev.emplace_back();
        take_events(d, rec.ev.back());
        rec.dev_hdr[di] = header_buffer(d, block);
        FOREMOE_CUDA_CHECK(
            cudaMemcpyAsync(rec.dev_hdr[di], rec.host_hdr + di * n * 2, block, cudaMemcpyHostToDevice, s));
        FOREMOE_CUDA_CHECK(cudaEventRecord(rec.ev[di].begin, s));
      }
      ncclComm_t last = nullptr;
      ncclResult_t r = ncclGroupStart();
      for (std::size_t i = 0; i < n && (r == ncclSuccess); ++i) {
        const PeerOp &op = ops[i];
        const int d = dev_[op.local_gpu];
        const std::size_t di = dev_index(rec, d);
        cudaStream_t s = streams_[d][static_cast<int>(transfer::Path::network)];
        ncclComm_t comm = comms_[op.local_gpu];
        last = comm;
        const int peer = rank_[op.peer_gpu];
        std::uint64_t *hdr = rec.dev_hdr[di] + i * 2;
        if (op.send) {
          r = ncclSend(op.buf, static_cast<std::size_t>(op.num_bytes), ncclUint8, peer, comm, s);
          if (r == ncclSuccess) r = ncclSend(hdr, 2 * sizeof(std::uint64_t), ncclUint8, peer, comm, s);
        } else {
          r = ncclRecv(op.buf, static_cast<std::size_t>(op.num_bytes), ncclUint8, peer, comm, s);
          if (r == ncclSuccess) r = ncclRecv(hdr, 2 * sizeof(std::uint64_t), ncclUint8, peer, comm, s);
        }
      }
      const ncclResult_t end = ncclGroupEnd();
      if (r == ncclSuccess) r = end;
      if (r == ncclInProgress) {
        // Non-blocking communicators: the operations are enqueued on the streams only once every communicator
        // of the group leaves "in progress" (connection setup may wait for the peer); bounded here.
        const auto deadline = std::chrono::steady_clock::now() + sync_timeout;
        for (const PeerOp &op : ops) {
          ncclResult_t a = ncclInProgress;
          while (a == ncclInProgress) {
            if (ncclCommGetAsyncError(comms_[op.local_gpu], &a) != ncclSuccess) a = ncclInternalError;
            if (a == ncclInProgress && std::chrono::steady_clock::now() > deadline) {
              free_peer(rec);
              return {StatusCode::timed_out,
                      "ncclSend/ncclRecv group: GPU " + std::to_string(op.peer_gpu) + " did not join within 30 s"};
            }
            if (a == ncclInProgress) std::this_thread::sleep_for(std::chrono::microseconds(10));
          }
          last = comms_[op.local_gpu];
          r = a;
          if (r != ncclSuccess) break;
        }
      }
      if (r != ncclSuccess) {
        free_peer(rec);
        return {StatusCode::device_error, nccl_error("ncclSend/ncclRecv group", r, last)};
      }
      for (std::size_t di = 0; di < rec.devs.size(); ++di) {
        const int d = rec.devs[di];
        cudaStream_t s = streams_[d][static_cast<int>(transfer::Path::network)];
        FOREMOE_CUDA_CHECK(cudaSetDevice(d));
        FOREMOE_CUDA_CHECK(
            cudaMemcpyAsync(rec.host_hdr + di * n * 2, rec.dev_hdr[di], block, cudaMemcpyDeviceToHost, s));
        FOREMOE_CUDA_CHECK(cudaEventRecord(rec.ev[di].end, s));
      }
    } catch (const DeviceError &e) {
      free_peer(rec);
      return {StatusCode::device_error, e.what()};
    }
    std::lock_guard lock(mu_);
    handle = next_++;
    peers_[handle] = std::move(rec);
    return Status::success();
  }
#endif

  Status query(std::uint64_t handle, double &seconds) override {
#if defined(FOREMOE_HAVE_NCCL)
    {
      std::unique_lock lock(mu_);
      if (auto pi = peers_.find(handle); pi != peers_.end()) {
        PeerRec &rec = pi->second;
        std::string failed;
        for (std::size_t di = 0; di < rec.devs.size(); ++di) {
          const cudaError_t e = cudaEventQuery(rec.ev[di].end);
          if (e == cudaErrorNotReady) {
            // Still running: report a communicator error rather than waiting on a transfer that cannot end.
            for (const PeerOp &op : rec.ops) {
              ncclResult_t a = ncclSuccess;
              if (ncclCommGetAsyncError(comms_[op.local_gpu], &a) == ncclSuccess && a != ncclSuccess &&
                  a != ncclInProgress)
                return {StatusCode::device_error, nccl_error("NCCL communicator", a, comms_[op.local_gpu])};
            }
            return {StatusCode::in_progress, ""};
          }
          if (e != cudaSuccess) failed = std::string("NCCL transfer: ") + cudaGetErrorString(e);
        }
        Status st = failed.empty() ? Status::success() : Status(StatusCode::device_error, failed);
        const std::size_t n = rec.ops.size();
        for (std::size_t i = 0; i < n; ++i)
          if (!rec.ops[i].send) {
            const std::size_t di = dev_index(rec, dev_[rec.ops[i].local_gpu]);
            std::memcpy(rec.ops[i].header, rec.host_hdr + di * n * 2 + i * 2, sizeof rec.ops[i].header);
          }
        float ms = 0;
        if (st.ok() && cudaEventElapsedTime(&ms, rec.ev[0].begin, rec.ev[0].end) == cudaSuccess) seconds = ms * 1e-3;
        free_peer(rec);
        peers_.erase(pi);
        return st;
      }
    }
#endif
    Op o;
    {
      std::lock_guard lock(mu_);
      auto it = ops_.find(handle);
      if (it == ops_.end()) return {StatusCode::invalid_argument, "CUDA transport: unknown copy handle"};
      o = it->second;
    }
    const cudaError_t e = cudaEventQuery(o.end);
    if (e == cudaErrorNotReady) return {StatusCode::in_progress, ""};
    Status st = e != cudaSuccess
                    ? Status(StatusCode::device_error, std::string("CUDA copy failed: ") + cudaGetErrorString(e))
                    : Status::success();
    if (e == cudaSuccess) {
      float ms = 0;
      if (cudaEventElapsedTime(&ms, o.begin, o.end) == cudaSuccess) seconds = ms * 1e-3;
    }
    std::lock_guard lock(mu_);
    give_events(o);
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
      unsigned long long *dsum = dev_sum_[d]; // the checksum stream runs one checksum at a time
      FOREMOE_CUDA_CHECK(cudaMemsetAsync(dsum, 0, sizeof *dsum, s));
      const std::int64_t words = n / 8 + 1;
      const int blocks = static_cast<int>(std::min<std::int64_t>(1024, (words + 255) / 256));
      checksum_kernel<<<blocks, 256, 0, s>>>(reinterpret_cast<const unsigned char *>(p), n, dsum);
      FOREMOE_CUDA_CHECK(cudaGetLastError());
      std::lock_guard lock(sum_mu_);
      FOREMOE_CUDA_CHECK(cudaMemcpyAsync(host_sum_, dsum, sizeof *dsum, cudaMemcpyDeviceToHost, s));
      if (Status st = wait_stream(s, "checksum"); !st.ok()) return st;
      out = mix64(static_cast<std::uint64_t>(n)) + *host_sum_;
    } catch (const DeviceError &e) {
      return {StatusCode::device_error, e.what()};
    }
    return Status::success();
  }
  Status accumulate(int gpu, void *dst, const void *src, std::int64_t n, GradType type) override {
    const int d = dev_[gpu];
    if (d < 0) return {StatusCode::unavailable, "accumulate: GPU " + std::to_string(gpu) + " is not local"};
    try {
      FOREMOE_CUDA_CHECK(cudaSetDevice(d));
      cudaStream_t s = streams_[d][transfer::num_paths];
      switch (type) {
      case GradType::f32: launch_accumulate<float>(dst, src, n, s); break;
      case GradType::f64: launch_accumulate<double>(dst, src, n, s); break;
      case GradType::bf16: launch_accumulate<__nv_bfloat16>(dst, src, n, s); break;
      case GradType::f16: launch_accumulate<__half>(dst, src, n, s); break;
      }
      FOREMOE_CUDA_CHECK(cudaGetLastError());
      return wait_stream(s, "accumulate");
    } catch (const DeviceError &e) {
      return {StatusCode::device_error, e.what()};
    }
  }
  Status zero(int gpu, void *dst, std::int64_t num_bytes) override {
    const int d = dev_[gpu];
    if (d < 0) return {StatusCode::unavailable, "zero: GPU " + std::to_string(gpu) + " is not local"};
    try {
      FOREMOE_CUDA_CHECK(cudaSetDevice(d));
      cudaStream_t s = streams_[d][transfer::num_paths];
      FOREMOE_CUDA_CHECK(cudaMemsetAsync(dst, 0, static_cast<std::size_t>(num_bytes), s));
      return wait_stream(s, "zero");
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
  Status alloc_flags(std::int64_t n, volatile std::uint32_t *&flags) override {
    void *p = nullptr;
    const std::size_t bytes = static_cast<std::size_t>(n) * sizeof(std::uint32_t);
    if (cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess)
      return {StatusCode::device_error, "alloc_flags: cudaHostAlloc of " + std::to_string(bytes) + " bytes failed"};
    std::memset(p, 0, bytes);
    flags = static_cast<volatile std::uint32_t *>(p);
    return Status::success();
  }
  void free_flags(volatile std::uint32_t *flags) noexcept override {
    FOREMOE_CUDA_ASSERT(cudaFreeHost(const_cast<std::uint32_t *>(flags)));
  }
  Status enqueue_wait(void *stream, volatile std::uint32_t *flag, std::uint32_t value) override {
    auto s = static_cast<cudaStream_t>(stream);
    void *dptr = nullptr;
    if (cudaHostGetDevicePointer(&dptr, const_cast<std::uint32_t *>(flag), 0) != cudaSuccess)
      return {StatusCode::device_error, "enqueue_wait: the completion flag is not mapped"};
    if (wait_value_ != nullptr &&
        wait_value_(s, reinterpret_cast<CUdeviceptr>(dptr), value, CU_STREAM_WAIT_VALUE_GEQ) == CUDA_SUCCESS)
      return Status::success();
    (void)cudaGetLastError();
    // No stream memory operations here: a one-thread kernel waits, bounded to about a minute at 2 GHz.
    wait_flag_kernel<<<1, 1, 0, s>>>(static_cast<const volatile std::uint32_t *>(dptr), value, 120'000'000'000LL);
    if (cudaGetLastError() != cudaSuccess) return {StatusCode::device_error, "enqueue_wait: launch failed"};
    return Status::success();
  }

private:
  struct Op {
    cudaEvent_t begin = nullptr, end = nullptr;
    int dev = 0;
  };
  using WaitValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
  // Creates another block of timing events on device `d` (the current device), doubling its pool; the caller holds
  // `ev_mu_` or is the constructor.
  void grow_events(int d) {
    const int n = std::max(16, num_events_[d]);
    events_[d].reserve(static_cast<std::size_t>(num_events_[d] + n));
    for (int i = 0; i < n; ++i) {
      cudaEvent_t e = nullptr;
      FOREMOE_CUDA_CHECK(cudaEventCreate(&e));
      created_.fetch_add(1, std::memory_order_relaxed);
      events_[d].push_back(e);
      ++num_events_[d];
    }
  }
  // Two events of device `d` (current) for a copy; pooled, so a steady state creates none.
  void take_events(int d, Op &o) {
    std::lock_guard lock(ev_mu_);
    if (events_[d].size() < 2) grow_events(d);
    o.dev = d;
    o.end = events_[d].back();
    events_[d].pop_back();
    o.begin = events_[d].back();
    events_[d].pop_back();
  }
  // Gives a finished copy's events back (within the pool's reserved capacity).
  void give_events(const Op &o) noexcept {
    std::lock_guard lock(ev_mu_);
    events_[o.dev].push_back(o.begin);
    events_[o.dev].push_back(o.end);
  }
#if defined(FOREMOE_HAVE_NCCL)
  struct PeerRec {
    std::span<PeerOp> ops;
    std::vector<int> devs;
    std::uint64_t *host_hdr = nullptr;
    std::size_t host_bytes = 0;
    std::vector<std::uint64_t *> dev_hdr; // per device: its headers in `hdr_` (stream-ordered reuse)
    std::vector<Op> ev;                   // per device: timing events from the pool
  };
  // Device header staging of device `d`, one buffer per device reused by every group in stream order on its
  // network stream; grown geometrically, an outgrown one kept until destruction (queued groups may still use it).
  struct HeaderBuffer {
    std::uint64_t *p = nullptr;
    std::size_t bytes = 0;
    std::vector<std::uint64_t *> retired;
  };
  std::uint64_t *header_buffer(int d, std::size_t bytes) {
    HeaderBuffer &h = hdr_[d];
    if (bytes <= h.bytes) return h.p;
    const std::size_t grown = std::max<std::size_t>({bytes, 2 * h.bytes, 4096});
    void *p = nullptr;
    FOREMOE_CUDA_CHECK(cudaMalloc(&p, grown));
    created_.fetch_add(1, std::memory_order_relaxed);
    if (h.p != nullptr) h.retired.push_back(h.p);
    h.p = static_cast<std::uint64_t *>(p);
    h.bytes = grown;
    return h.p;
  }
  static std::size_t dev_index(const PeerRec &rec, int d) {
    return static_cast<std::size_t>(std::find(rec.devs.begin(), rec.devs.end(), d) - rec.devs.begin());
  }
  void free_peer(PeerRec &rec) noexcept {
    for (std::size_t di = 0; di < rec.devs.size(); ++di) {
      if (di < rec.ev.size()) give_events(rec.ev[di]);
    }
    if (rec.host_hdr != nullptr) {
      std::lock_guard lock(pool_mu_);
      pinned_pool_.emplace_back(rec.host_bytes, rec.host_hdr);
    }
    rec = PeerRec{};
  }
  // Pinned header blocks are reused: allocating and freeing pinned memory per group would stall the device.
  std::uint64_t *take_pinned(std::size_t bytes) {
    {
      std::lock_guard lock(pool_mu_);
      for (std::size_t i = 0; i < pinned_pool_.size(); ++i)
        if (pinned_pool_[i].first >= bytes) {
          std::uint64_t *p = pinned_pool_[i].second;
          pinned_pool_.erase(pinned_pool_.begin() + static_cast<std::ptrdiff_t>(i));
          return p;
        }
    }
    void *p = nullptr;
    if (cudaMallocHost(&p, bytes) != cudaSuccess) return nullptr;
    created_.fetch_add(1, std::memory_order_relaxed);
    return static_cast<std::uint64_t *>(p);
  }
  std::mutex pool_mu_;
  std::vector<std::pair<std::size_t, std::uint64_t *>> pinned_pool_;
  std::vector<HeaderBuffer> hdr_; // per device
  std::vector<ncclComm_t> comms_;
  std::vector<int> rank_;
  std::unordered_map<std::uint64_t, PeerRec> peers_;
#endif
  std::vector<int> dev_;
  std::vector<std::array<cudaStream_t, transfer::num_paths + 1>> streams_;
  std::vector<std::vector<cudaEvent_t>> events_; // per device: free timing events
  std::vector<int> num_events_;                  // per device: events created
  std::vector<unsigned long long *> dev_sum_;    // per device: the checksum's accumulator
  std::atomic<std::int64_t> created_{0};
  WaitValueFn wait_value_ = nullptr;
  std::mutex mu_, sum_mu_, ev_mu_;
  std::uint64_t next_ = 1;
  std::unordered_map<std::uint64_t, Op> ops_;
  unsigned long long *host_sum_ = nullptr;
};

} // namespace

void register_builtin_transport_cuda() {
  add_builtin_transport("cuda", [](const EngineOptions &opts, std::unique_ptr<Transport> &out) {
    auto t = std::make_unique<CudaTransport>();
    if (Status st = t->init(opts); !st.ok()) return st;
    out = std::move(t);
    return Status::success();
  });
}

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
