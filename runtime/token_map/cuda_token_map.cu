// CUDA backend of token mapping. Every routed (token, k) of the layer gets the key `source * E + expert`; a
// stable radix sort of the keys with the flat index as value puts each key's occurrences in (token, k) order, so
// an occurrence's rank is its sorted position minus the key's first position. A binary search of the rank in the
// copy prefix ranges (built on the host from the plan) gives the slot. The sort is stable and nothing depends on
// thread timing, so the result is deterministic and equals the CPU reference exactly. Enqueued through the workspace
// (workspace/cuda_workspace.hpp): the plan's ranges go up from pinned memory, ids and counts are checked on the
// device and reported by `Workspace::check`.

#include <cub/device/device_radix_sort.cuh>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "../device/cuda_check.hpp"
#include "../workspace/cuda_workspace.hpp"
#include "token_map_backends.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {
namespace {

constexpr int map_threads = 256;

template <class T> unsigned long long none_raw(int num_experts) {
  if constexpr (std::is_unsigned_v<T>)
    if (num_experts <= static_cast<int>(std::numeric_limits<T>::max())) return std::numeric_limits<T>::max();
  return std::numeric_limits<unsigned long long>::max();
}

unsigned grid_for(std::int64_t n) {
  const std::int64_t blocks = (n + map_threads - 1) / map_threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65535 * 16 ? 65535 * 16 : blocks));
}

/// Key of every (t, k) of the layer (`none_key` for no route or a bad id), its flat index, -1 in `out` where
/// nothing is routed.
template <class T>
__global__ void make_keys(const T *__restrict__ ids, std::int64_t n, int num_layers, int topk, int layer_idx,
                          int num_experts, const std::int64_t *__restrict__ so, int num_sources,
                          unsigned int *__restrict__ keys, int *__restrict__ vals, std::int32_t *__restrict__ out,
                          unsigned long long *__restrict__ bad_flat, unsigned long long none, unsigned int none_key) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t t = i / topk;
    const int k = static_cast<int>(i % topk);
    const std::int64_t flat = (t * num_layers + layer_idx) * topk + k;
    const auto u = static_cast<unsigned long long>(static_cast<long long>(ids[flat]));
    vals[i] = static_cast<int>(i);
    if (u >= static_cast<unsigned long long>(num_experts)) {
      if (u != none) atomicMin(bad_flat, static_cast<unsigned long long>(flat));
      keys[i] = none_key;
      out[i] = -1;
      continue;
    }
    // Source of token t: the last s with so[s] <= t (empty ranges before it are skipped).
    int lo = 0, hi = num_sources - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (so[mid] <= t)
        lo = mid;
      else
        hi = mid - 1;
    }
    keys[i] = static_cast<unsigned int>(lo) * static_cast<unsigned int>(num_experts) + static_cast<unsigned int>(u);
  }
}

/// First and one-past-last sorted position of every key present.
__global__ void key_bounds(const unsigned int *__restrict__ keys, std::int64_t n, unsigned int none_key,
                           std::int64_t *__restrict__ first, std::int64_t *__restrict__ last) {
  for (std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const unsigned int key = keys[j];
    if (key == none_key) continue;
    if (j == 0 || keys[j - 1] != key) first[key] = j;
    if (j == n - 1 || keys[j + 1] != key) last[key] = j + 1;
  }
}

/// Flags the smallest key whose routed count differs from the plan's total.
__global__ void check_counts(const std::int64_t *__restrict__ first, const std::int64_t *__restrict__ last,
                             const std::int32_t *__restrict__ copy_offsets, const std::int64_t *__restrict__ copy_end,
                             int num_copies, int num_experts, unsigned int num_keys,
                             unsigned long long *__restrict__ bad_key) {
  for (unsigned int key = blockIdx.x * blockDim.x + threadIdx.x; key < num_keys; key += gridDim.x * blockDim.x) {
    const unsigned int e = key % num_experts, s = key / num_experts;
    const std::int32_t c0 = copy_offsets[e], c1 = copy_offsets[e + 1];
    const std::int64_t want = c0 == c1 ? 0 : copy_end[static_cast<std::int64_t>(s) * num_copies + c1 - 1];
    if (last[key] - first[key] != want) atomicMin(bad_key, static_cast<unsigned long long>(key));
  }
}

/// Slot of every sorted occurrence: the first copy whose range end exceeds the occurrence's rank.
__global__ void assign_slots(const unsigned int *__restrict__ keys, const int *__restrict__ vals, std::int64_t n,
                             unsigned int none_key, const std::int64_t *__restrict__ first,
                             const std::int32_t *__restrict__ copy_offsets, const std::int32_t *__restrict__ copy_slot,
                             const std::int64_t *__restrict__ copy_end, int num_copies, int num_experts,
                             std::int32_t *__restrict__ out) {
  for (std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const unsigned int key = keys[j];
    if (key == none_key) continue;
    const unsigned int e = key % num_experts, s = key / num_experts;
    const std::int64_t rank = j - first[key];
    const std::int64_t *end = copy_end + static_cast<std::int64_t>(s) * num_copies;
    int lo = copy_offsets[e], hi = copy_offsets[e + 1]; // first c in [lo, hi) with end[c] > rank
    const int stop = hi;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (end[mid] > rank)
        hi = mid;
      else
        lo = mid + 1;
    }
    out[vals[j]] = lo < stop ? copy_slot[lo] : -1; // past the plan's total: reported by check_counts
  }
}

std::size_t align_up(std::size_t x) { return (x + 255) / 256 * 256; }

} // namespace

Status CudaWorkspace::map(const MapRequest &req, const TokenRanges &ranges,
                          std::span<const std::int64_t> source_offsets, std::span<std::int32_t> out_slots,
                          void *stream_ptr) try {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  std::int32_t *out = out_slots.data();
  const std::int64_t n = req.num_tokens * req.topk;
  const int num_experts = ranges.num_experts, num_sources = ranges.num_sources, num_copies = ranges.num_copies();
  const std::int64_t num_keys64 = std::int64_t{num_sources} * num_experts;
  if (n >= INT_MAX || num_keys64 >= (std::int64_t{1} << 31))
    return {StatusCode::invalid_argument, "map_tokens: " + std::to_string(n) + " routed ids and " +
                                              std::to_string(num_keys64) +
                                              " (source, expert) keys exceed the device mapping's 2^31 limit"};
  const auto num_keys = static_cast<unsigned int>(num_keys64);
  const unsigned int none_key = num_keys; // sorts after every real key
  int end_bit = 1;
  while (end_bit < 32 && (none_key >> end_bit) != 0)
    ++end_bit;

  // The upload (one copy from pinned memory): the plan's ranges and the source offsets.
  std::size_t up_bytes = 0;
  auto take_up = [&up_bytes](std::size_t bytes) {
    const std::size_t at = up_bytes;
    up_bytes += align_up(bytes);
    return at;
  };
  const std::size_t u_coff = take_up(ranges.copy_offsets.size() * 4), u_cslot = take_up(ranges.copy_slot.size() * 4),
                    u_cend = take_up(ranges.copy_end.size() * 8), u_so = take_up(source_offsets.size() * 8);
  // Device scratch after the results: the upload, keys and values twice (sort in and out), key bounds, the sort's.
  const std::size_t ids_n = static_cast<std::size_t>(n);
  std::size_t sort_bytes = 0;
  FOREMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, sort_bytes, static_cast<const unsigned int *>(nullptr), static_cast<unsigned int *>(nullptr),
      static_cast<const int *>(nullptr), static_cast<int *>(nullptr), static_cast<int>(ids_n), 0, end_bit, stream));
  std::size_t off = up_bytes;
  auto take = [&off](std::size_t bytes) {
    const std::size_t at = off;
    off += align_up(bytes);
    return at;
  };
  const std::size_t o_keys_in = take(ids_n * 4), o_keys_out = take(ids_n * 4), o_vals_in = take(ids_n * 4),
                    o_vals_out = take(ids_n * 4), o_first = take(num_keys * 8ull), o_last = take(num_keys * 8ull),
                    o_sort = take(sort_bytes);

  Record *r = nullptr;
  if (Status st = begin(Record::Kind::map, stream, up_bytes, r); !st.ok())
    return {st.code(), "map_tokens: " + st.message()};
  unsigned char *up = upload(*r);
  std::memcpy(up + u_coff, ranges.copy_offsets.data(), ranges.copy_offsets.size() * 4);
  if (num_copies > 0) {
    std::memcpy(up + u_cslot, ranges.copy_slot.data(), ranges.copy_slot.size() * 4);
    std::memcpy(up + u_cend, ranges.copy_end.data(), ranges.copy_end.size() * 8);
  }
  std::memcpy(up + u_so, source_offsets.data(), source_offsets.size() * 8);
  r->dtype = req.dtype;
  r->num_layers = req.num_layers;
  r->topk = req.topk;
  r->layer_idx = req.layer_idx;
  r->num_experts = num_experts;
  r->ranges = ranges; // reuses the record's capacity

  unsigned char *res_base = scratch(off, stream);
  auto *d_res = reinterpret_cast<CallResults *>(res_base);
  unsigned char *base = res_base + results_bytes;
  auto *keys_in = reinterpret_cast<unsigned int *>(base + o_keys_in);
  auto *keys_out = reinterpret_cast<unsigned int *>(base + o_keys_out);
  auto *vals_in = reinterpret_cast<int *>(base + o_vals_in);
  auto *vals_out = reinterpret_cast<int *>(base + o_vals_out);
  auto *first = reinterpret_cast<std::int64_t *>(base + o_first);
  auto *last = reinterpret_cast<std::int64_t *>(base + o_last);
  auto *d_coff = reinterpret_cast<std::int32_t *>(base + u_coff);
  auto *d_cslot = reinterpret_cast<std::int32_t *>(base + u_cslot);
  auto *d_cend = reinterpret_cast<std::int64_t *>(base + u_cend);
  auto *d_so = reinterpret_cast<std::int64_t *>(base + u_so);

  FOREMOE_CUDA_CHECK(cudaMemcpyAsync(base, up, up_bytes, cudaMemcpyHostToDevice, stream));
  FOREMOE_CUDA_CHECK(cudaMemsetAsync(first, 0, num_keys * 8ull, stream));
  FOREMOE_CUDA_CHECK(cudaMemsetAsync(last, 0, num_keys * 8ull, stream));

  if (n > 0) {
    visit_id_dtype(req.dtype, [&](auto tag) {
      using T = decltype(tag);
      make_keys<T><<<grid_for(n), map_threads, 0, stream>>>(
          static_cast<const T *>(req.ids), n, req.num_layers, req.topk, req.layer_idx, num_experts, d_so, num_sources,
          keys_in, vals_in, out, &d_res->bad_flat, none_raw<T>(num_experts), none_key);
    });
    FOREMOE_CUDA_CHECK(cudaGetLastError());
    std::size_t sort_avail = sort_bytes;
    FOREMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(base + o_sort, sort_avail, keys_in, keys_out, vals_in, vals_out,
                                                       static_cast<int>(n), 0, end_bit, stream));
    key_bounds<<<grid_for(n), map_threads, 0, stream>>>(keys_out, n, none_key, first, last);
    FOREMOE_CUDA_CHECK(cudaGetLastError());
  }
  check_counts<<<grid_for(num_keys), map_threads, 0, stream>>>(first, last, d_coff, d_cend, num_copies, num_experts,
                                                               num_keys, &d_res->bad_key);
  FOREMOE_CUDA_CHECK(cudaGetLastError());
  if (n > 0) {
    assign_slots<<<grid_for(n), map_threads, 0, stream>>>(keys_out, vals_out, n, none_key, first, d_coff, d_cslot,
                                                          d_cend, num_copies, num_experts, out);
    FOREMOE_CUDA_CHECK(cudaGetLastError());
  }
  visit_id_dtype(req.dtype, [&](auto tag) {
    using T = decltype(tag);
    capture_results<T><<<1, 1, 0, stream>>>(static_cast<const T *>(req.ids), d_res, first, last);
  });
  FOREMOE_CUDA_CHECK(cudaGetLastError());
  finish(*r, stream, res_base);
  return Status::success();
} catch (const DeviceError &e) {
  return {StatusCode::device_error, e.what()};
} catch (const std::exception &e) {
  return {StatusCode::internal, std::string("map_tokens: ") + e.what()};
}

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
