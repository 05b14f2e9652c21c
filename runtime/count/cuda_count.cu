// CUDA backend of load counting: one block per (token chunk, trace layer),
// a shared-memory histogram per micro-step segment, flushed with atomics. Enqueued
// through the workspace (workspace/cuda_workspace.hpp): inputs from pinned memory, ids checked
// on the device and reported by `Workspace::check`.

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "../backends.hpp"
#include "../device/cuda_check.hpp"
#include "../workspace/cuda_workspace.hpp"

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
    if (offsets[mid] <= c0)
      lo = mid;
    else
      hi = mid - 1;
  }
  int m = lo;
  while (m < num_micro_steps && offsets[m + 1] <= c0)
    ++m;

  const unsigned long long e_count = static_cast<unsigned long long>(num_experts);
  std::int64_t seg0 = c0;
  while (seg0 < c1 && m < num_micro_steps) {
    const std::int64_t seg1 = offsets[m + 1] < c1 ? offsets[m + 1] : c1;
    unsigned long long *dst = out + (static_cast<std::size_t>(m) * num_moe_layers + ml) * num_experts;
    if constexpr (SharedBins) {
      for (int e = threadIdx.x; e < num_experts; e += blockDim.x)
        bins[e] = 0;
      __syncthreads();
    }
    const std::int64_t n = (seg1 - seg0) * topk;
    for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const std::int64_t t = seg0 + i / topk;
      const int k = static_cast<int>(i % topk);
      const std::int64_t flat = (t * num_layers + l) * topk + k;
      const auto u = static_cast<unsigned long long>(static_cast<long long>(ids[flat]));
      if (u < e_count) {
        if constexpr (SharedBins)
          atomicAdd(&bins[u], 1u);
        else
          atomicAdd(&dst[u], 1ull);
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
    while (m < num_micro_steps && offsets[m + 1] <= seg0)
      ++m; // skip empty micro-steps
  }
}

template <class T> unsigned long long none_value(int num_experts) {
  if constexpr (std::is_unsigned_v<T>)
    if (num_experts <= static_cast<int>(std::numeric_limits<T>::max())) return std::numeric_limits<T>::max();
  return std::numeric_limits<unsigned long long>::max();
}

} // namespace

Status CudaWorkspace::count(const CountRequest &req, int num_moe_layers, std::span<std::int64_t> out, void *stream_ptr,
                            int) try {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const std::size_t num_offsets = req.microbatch_offsets.empty() ? 2 : req.microbatch_offsets.size();
  const int num_micro_steps = static_cast<int>(num_offsets - 1);
  if (req.num_tokens > 0 && (req.num_tokens + count_chunk_tokens - 1) / count_chunk_tokens > INT_MAX)
    return {StatusCode::invalid_argument, "count_loads: " + std::to_string(req.num_tokens) + " tokens is too many"};

  // Upload (one copy from pinned memory): micro-step offsets, then the layer map.
  const std::size_t off_bytes = num_offsets * sizeof(std::int64_t);
  const std::size_t map_bytes = static_cast<std::size_t>(req.num_layers) * sizeof(int);
  Record *r = nullptr;
  if (Status st = begin(Record::Kind::count, stream, off_bytes + map_bytes, r); !st.ok())
    return {st.code(), "count_loads: " + st.message()};
  unsigned char *up = upload(*r);
  auto *h_offsets = reinterpret_cast<std::int64_t *>(up);
  if (req.microbatch_offsets.empty())
    h_offsets[0] = 0, h_offsets[1] = req.num_tokens;
  else
    std::memcpy(h_offsets, req.microbatch_offsets.data(), off_bytes);
  auto *h_map = reinterpret_cast<int *>(up + off_bytes);
  for (int l = 0; l < req.num_layers; ++l)
    h_map[l] = req.layer_map.empty() ? l : req.layer_map[l];
  r->dtype = req.dtype;
  r->num_layers = req.num_layers;
  r->topk = req.topk;
  r->num_experts = req.num_experts;

  unsigned char *base = scratch(off_bytes + map_bytes, stream);
  auto *d_res = reinterpret_cast<CallResults *>(base);
  auto *d_offsets = reinterpret_cast<std::int64_t *>(base + results_bytes);
  auto *d_map = reinterpret_cast<int *>(base + results_bytes + off_bytes);
  FOREMOE_CUDA_CHECK(cudaMemcpyAsync(d_offsets, up, off_bytes + map_bytes, cudaMemcpyHostToDevice, stream));
  FOREMOE_CUDA_CHECK(cudaMemsetAsync(out.data(), 0, out.size() * sizeof(std::int64_t), stream));

  if (req.num_tokens > 0) {
    const std::int64_t chunks = (req.num_tokens + count_chunk_tokens - 1) / count_chunk_tokens;
    const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(req.num_layers));
    const bool smem = req.num_experts <= max_smem_experts;
    const std::size_t smem_bytes = smem ? static_cast<std::size_t>(req.num_experts) * sizeof(unsigned int) : 0;
    auto *d_out = reinterpret_cast<unsigned long long *>(out.data());
    auto *d_bad = &d_res->bad_flat;
    visit_id_dtype(req.dtype, [&](auto tag) {
      using T = decltype(tag);
      const T *ids = static_cast<const T *>(req.ids);
      const unsigned long long none = none_value<T>(req.num_experts);
      if (smem)
        count_kernel<T, true><<<grid, count_threads, smem_bytes, stream>>>(
            ids, req.num_tokens, req.num_layers, req.topk, d_map, num_moe_layers, req.num_experts, d_offsets,
            num_micro_steps, d_out, d_bad, none);
      else
        count_kernel<T, false><<<grid, count_threads, 0, stream>>>(ids, req.num_tokens, req.num_layers, req.topk, d_map,
                                                                   num_moe_layers, req.num_experts, d_offsets,
                                                                   num_micro_steps, d_out, d_bad, none);
    });
    FOREMOE_CUDA_CHECK(cudaGetLastError());
    visit_id_dtype(req.dtype, [&](auto tag) {
      using T = decltype(tag);
      capture_results<T><<<1, 1, 0, stream>>>(static_cast<const T *>(req.ids), d_res, nullptr, nullptr);
    });
    FOREMOE_CUDA_CHECK(cudaGetLastError());
  }
  finish(*r, stream, base);
  return Status::success();
} catch (const DeviceError &e) {
  return {StatusCode::device_error, e.what()};
}

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
