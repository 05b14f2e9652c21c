// CUDA backend of load counting: one block per (token chunk, trace layer),
// a shared-memory histogram per micro-step segment, flushed with atomics.

#include <cuda_runtime.h>

#include <chrono>
#include <climits>
#include <cstdint>
#include <limits>
#include <thread>
#include <type_traits>
#include <vector>

#include "../backends.hpp"
#include "cuda_check.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {
namespace {

constexpr int count_threads = 256;
constexpr std::int64_t count_chunk_tokens = 2048;
constexpr int max_smem_experts = 12 * 1024; // 48 KiB of 32-bit bins

template <class T, bool SharedBins>
__global__ void count_kernel(const T *__restrict__ ids, std::int64_t num_tokens, int num_layers, int topk,
                             const int *__restrict__ moe_of, int num_moe_layers, int num_experts,
                             const std::int64_t *__restrict__ offsets, int num_micro_steps,
                             unsigned long long *__restrict__ out, unsigned long long *__restrict__ bad_flat,
                             unsigned long long none) {
  extern __shared__ unsigned int bins[];
  const int l = blockIdx.y;
  const int ml = moe_of[l];
  if (ml < 0) return;
  const std::int64_t c0 = static_cast<std::int64_t>(blockIdx.x) * count_chunk_tokens;
  if (c0 >= num_tokens) return;
  const std::int64_t c1 = c0 + count_chunk_tokens < num_tokens ? c0 + count_chunk_tokens : num_tokens;

  // Micro-step holding token c0: the last m with offsets[m] <= c0 < offsets[m+1].
  int lo = 0, hi = num_micro_steps - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= c0) lo = mid;
    else hi = mid - 1;
  }
  int m = lo;
  while (m < num_micro_steps && offsets[m + 1] <= c0) ++m;

  const unsigned long long e_count = static_cast<unsigned long long>(num_experts);
  std::int64_t seg0 = c0;
  while (seg0 < c1 && m < num_micro_steps) {
    const std::int64_t seg1 = offsets[m + 1] < c1 ? offsets[m + 1] : c1;
    unsigned long long *dst = out + (static_cast<std::size_t>(m) * num_moe_layers + ml) * num_experts;
    if constexpr (SharedBins) {
      for (int e = threadIdx.x; e < num_experts; e += blockDim.x) bins[e] = 0;
      __syncthreads();
    }
    const std::int64_t n = (seg1 - seg0) * topk;
    for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const std::int64_t t = seg0 + i / topk;
      const int k = static_cast<int>(i % topk);
      const std::int64_t flat = (t * num_layers + l) * topk + k;
      const auto u = static_cast<unsigned long long>(static_cast<long long>(ids[flat]));
      if (u < e_count) {
        if constexpr (SharedBins) atomicAdd(&bins[u], 1u);
        else atomicAdd(&dst[u], 1ull);
      } else if (u != none) {
        atomicMin(bad_flat, static_cast<unsigned long long>(flat));
      }
    }
    if constexpr (SharedBins) {
      __syncthreads();
      for (int e = threadIdx.x; e < num_experts; e += blockDim.x)
        if (bins[e] != 0) atomicAdd(&dst[e], static_cast<unsigned long long>(bins[e]));
      __syncthreads();
    }
    seg0 = seg1;
    ++m;
    while (m < num_micro_steps && offsets[m + 1] <= seg0) ++m; // skip empty micro-steps
  }
}

template <class T> unsigned long long none_value(int num_experts) {
  if constexpr (std::is_unsigned_v<T>)
    if (num_experts <= static_cast<int>(std::numeric_limits<T>::max())) return std::numeric_limits<T>::max();
  return std::numeric_limits<unsigned long long>::max();
}

/// Device scratch freed on every exit path.
struct DeviceBuffer {
  void *ptr = nullptr;
  explicit DeviceBuffer(std::size_t bytes) { FOREMOE_CUDA_CHECK(cudaMalloc(&ptr, bytes)); }
  DeviceBuffer(const DeviceBuffer &) = delete;
  DeviceBuffer &operator=(const DeviceBuffer &) = delete;
  ~DeviceBuffer() { FOREMOE_CUDA_ASSERT(cudaFree(ptr)); }
};

Status wait_stream(cudaStream_t stream, int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    const cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) return Status::success();
    if (q != cudaErrorNotReady) throw_cuda_error(q, "cudaStreamQuery(stream)", __FILE__, __LINE__);
    if (std::chrono::steady_clock::now() >= deadline)
      return {StatusCode::timed_out, "count_loads: device counting did not finish within " +
                                         std::to_string(timeout_ms) + " ms"};
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

} // namespace

Status cuda_count_loads(const CountRequest &req, int num_moe_layers, std::int64_t *out, void *stream_ptr,
                        int timeout_ms) try {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  std::vector<std::int64_t> offsets(req.microbatch_offsets.begin(), req.microbatch_offsets.end());
  if (offsets.empty()) offsets = {0, req.num_tokens};
  const int num_micro_steps = static_cast<int>(offsets.size() - 1);
  std::vector<int> moe_of(req.layer_map.begin(), req.layer_map.end());
  if (moe_of.empty())
    for (int l = 0; l < req.num_layers; ++l) moe_of.push_back(l);

  const std::size_t out_elems = static_cast<std::size_t>(num_micro_steps) * num_moe_layers * req.num_experts;
  const std::size_t off_bytes = offsets.size() * sizeof(std::int64_t);
  const std::size_t map_bytes = moe_of.size() * sizeof(int);
  DeviceBuffer scratch(off_bytes + map_bytes + sizeof(unsigned long long));
  auto *d_offsets = static_cast<std::int64_t *>(scratch.ptr);
  auto *d_bad = reinterpret_cast<unsigned long long *>(static_cast<char *>(scratch.ptr) + off_bytes);
  auto *d_map = reinterpret_cast<int *>(static_cast<char *>(scratch.ptr) + off_bytes + sizeof(unsigned long long));
  const unsigned long long no_bad = std::numeric_limits<unsigned long long>::max();
  FOREMOE_CUDA_CHECK(cudaMemcpyAsync(d_offsets, offsets.data(), off_bytes, cudaMemcpyHostToDevice, stream));
  FOREMOE_CUDA_CHECK(cudaMemcpyAsync(d_map, moe_of.data(), map_bytes, cudaMemcpyHostToDevice, stream));
  FOREMOE_CUDA_CHECK(cudaMemcpyAsync(d_bad, &no_bad, sizeof(no_bad), cudaMemcpyHostToDevice, stream));
  FOREMOE_CUDA_CHECK(cudaMemsetAsync(out, 0, out_elems * sizeof(std::int64_t), stream));

  if (req.num_tokens > 0) {
    const std::int64_t chunks = (req.num_tokens + count_chunk_tokens - 1) / count_chunk_tokens;
    if (chunks > INT_MAX)
      return {StatusCode::invalid_argument, "count_loads: " + std::to_string(req.num_tokens) + " tokens is too many"};
    const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(req.num_layers));
    const bool smem = req.num_experts <= max_smem_experts;
    const std::size_t smem_bytes = smem ? static_cast<std::size_t>(req.num_experts) * sizeof(unsigned int) : 0;
    auto *d_out = reinterpret_cast<unsigned long long *>(out);
    visit_id_dtype(req.dtype, [&](auto tag) {
      using T = decltype(tag);
      const T *ids = static_cast<const T *>(req.ids);
      const unsigned long long none = none_value<T>(req.num_experts);
      if (smem)
        count_kernel<T, true><<<grid, count_threads, smem_bytes, stream>>>(
            ids, req.num_tokens, req.num_layers, req.topk, d_map, num_moe_layers, req.num_experts, d_offsets,
            num_micro_steps, d_out, d_bad, none);
      else
        count_kernel<T, false><<<grid, count_threads, 0, stream>>>(ids, req.num_tokens, req.num_layers, req.topk,
                                                                   d_map, num_moe_layers, req.num_experts, d_offsets,
                                                                   num_micro_steps, d_out, d_bad, none);
    });
    FOREMOE_CUDA_CHECK(cudaGetLastError());
  }
  // Poll first: a device-to-pageable copy would block the host until the stream drains, past any deadline.
  if (Status st = wait_stream(stream, timeout_ms); !st.ok()) {
    scratch.ptr = nullptr; // still in use by the stream: leak it rather than block in cudaFree
    return st;
  }
  unsigned long long bad = no_bad;
  FOREMOE_CUDA_CHECK(cudaMemcpyAsync(&bad, d_bad, sizeof(bad), cudaMemcpyDeviceToHost, stream));
  FOREMOE_CUDA_CHECK(cudaStreamSynchronize(stream)); // only this one copy is left
  if (bad != no_bad) {
    const std::size_t id_bytes = static_cast<std::size_t>(id_dtype_bytes(req.dtype));
    unsigned char raw[8] = {};
    FOREMOE_CUDA_CHECK(cudaMemcpy(raw, static_cast<const unsigned char *>(req.ids) + bad * id_bytes, id_bytes,
                                  cudaMemcpyDeviceToHost));
    const RoutedView one(raw, req.dtype, 1, 1, 1);
    const std::int64_t value = one.at(0, 0, 0, req.num_experts);
    const auto k = static_cast<std::int64_t>(bad % req.topk);
    const auto l = static_cast<std::int64_t>((bad / req.topk) % req.num_layers);
    const auto t = static_cast<std::int64_t>(bad / (static_cast<unsigned long long>(req.topk) * req.num_layers));
    return {StatusCode::invalid_argument, "count_loads: expert id " + std::to_string(value) + " at token " +
                                              std::to_string(t) + ", layer " + std::to_string(l) + ", k " +
                                              std::to_string(k) + " is outside [0, " +
                                              std::to_string(req.num_experts) + ")"};
  }
  return Status::success();
} catch (const DeviceError &e) {
  return {StatusCode::device_error, e.what()};
}

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
