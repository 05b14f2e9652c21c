#pragma once
// CUDA workspace of the asynchronous calls (internal, included by .cu files only). Each call enqueues, on the
// caller's stream: one upload of its host inputs from a pinned block, its kernels, a capture kernel that copies
// what an error message needs (the bad id's bytes, the bad key's count) next to the error flags, one copy of those
// results into the pinned block, and an event. `check` reads the pinned results once the events completed.
// Nothing in a steady state allocates (records, pinned blocks, events and the device scratch are reused; the
// scratch grows geometrically, an outgrown one kept until destruction since queued calls may still use it), and
// nothing blocks the host.

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "../device/cuda_check.hpp"
#include "workspace.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {

/// Device-side results of one call: error flags (max = none) and what a message about them needs.
struct CallResults {
  unsigned long long bad_flat; ///< smallest flat index of an id out of range
  unsigned long long bad_key;  ///< map: smallest (source, expert) key whose count differs from the plan
  unsigned long long raw_id;   ///< the bytes of the id at `bad_flat`
  long long first, last;       ///< map: sorted bounds of `bad_key`
};

/// Copies what an error message needs next to the flags: the bytes of the bad id, the bad key's sorted bounds.
template <class T>
__global__ void capture_results(const T *__restrict__ ids, CallResults *__restrict__ res,
                                const std::int64_t *__restrict__ first, const std::int64_t *__restrict__ last) {
  constexpr unsigned long long none = ~0ull;
  if (res->bad_flat != none) {
    unsigned long long raw = 0;
    const auto *b = reinterpret_cast<const unsigned char *>(ids + res->bad_flat);
    for (unsigned i = 0; i < sizeof(T); ++i)
      raw |= static_cast<unsigned long long>(b[i]) << (8 * i);
    res->raw_id = raw;
  }
  if (first != nullptr && res->bad_key != none) {
    res->first = first[res->bad_key];
    res->last = last[res->bad_key];
  }
}

class CudaWorkspace final : public Workspace::Impl {
public:
  ~CudaWorkspace() override;
  Status count(const CountRequest &req, int num_moe_layers, std::span<std::int64_t> out, void *stream,
               int num_threads) override;
  Status map(const MapRequest &req, const TokenRanges &ranges, std::span<const std::int64_t> source_offsets,
             std::span<std::int32_t> out_slots, void *stream) override;
  Status check(int timeout_ms) override;
  std::int64_t allocations() const noexcept override { return allocations_; }
  void abandon() noexcept override { abandoned_ = true; }

  static constexpr std::size_t results_bytes = 256; ///< `CallResults` at the start of scratch and pinned blocks

  struct Record {
    enum class Kind { count, map } kind = Kind::count;
    cudaEvent_t done = nullptr;
    unsigned char *pinned = nullptr; // results, then the upload
    std::size_t pinned_bytes = 0;
    // What a message needs.
    IdDtype dtype = IdDtype::i32;
    int num_layers = 0, topk = 0, layer_idx = 0, num_experts = 0;
    TokenRanges ranges;
  };
  /// A free record whose pinned block holds `upload_bytes` after the results (the call then fills
  /// `upload(r)`), or an error for a call from another stream or device than the calls in flight.
  Status begin(Record::Kind kind, cudaStream_t stream, std::size_t upload_bytes, Record *&out);
  static unsigned char *upload(Record &r) noexcept { return r.pinned + results_bytes; }
  /// Device scratch of at least `bytes`, its first `results_bytes` for the results (set to "none" on `stream`).
  unsigned char *scratch(std::size_t bytes, cudaStream_t stream);
  /// Enqueues the copy of the results into `r`'s pinned block and its event; `r` is then in flight.
  void finish(Record &r, cudaStream_t stream, const unsigned char *dev_scratch);

private:
  Status message(const Record &r) const;
  std::vector<std::unique_ptr<Record>> records_;
  std::vector<Record *> free_, pending_;
  unsigned char *scratch_ = nullptr;
  std::size_t scratch_bytes_ = 0;
  std::vector<void *> retired_device_, retired_pinned_;
  cudaStream_t stream_ = nullptr;
  int device_ = -1;
  std::int64_t allocations_ = 0;
  bool abandoned_ = false;
};

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
