#pragma once
// Transport resources the engine reuses across batches, so that a steady state creates none: completion flags
// (epoch counters: a reused flag only ever grows, so a stream still waiting on an old epoch is released, never
// held) and device staging blocks. Flags are allocated in blocks of geometrically growing size. Tickets give back
// what they took in their destructor, which may run on any thread and after the engine is gone; the pool frees
// everything when the last holder lets go.

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "foremoe/runtime/transport.hpp"

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {

class ResourcePool {
public:
  explicit ResourcePool(std::shared_ptr<Transport> t) : transport_(std::move(t)) {}
  ~ResourcePool();
  ResourcePool(const ResourcePool &) = delete;
  ResourcePool &operator=(const ResourcePool &) = delete;

  /// A flag and the value it will hold once its batch ended (one past what it holds now).
  [[nodiscard]] Status take_flag(volatile std::uint32_t *&flag, std::uint32_t &value);
  /// Gives back a flag whose batch ended at `value`.
  void give_flag(volatile std::uint32_t *flag, std::uint32_t value) noexcept;
  /// `bytes` of device memory on GPU `gpu`.
  [[nodiscard]] Status take_block(int gpu, std::int64_t bytes, std::byte *&out);
  void give_block(int gpu, std::int64_t bytes, std::byte *p) noexcept;
  /// Transport `alloc`/`alloc_flags` calls made so far.
  [[nodiscard]] std::int64_t allocations() const noexcept { return allocations_.load(std::memory_order_relaxed); }
  [[nodiscard]] Transport &transport() noexcept { return *transport_; }

private:
  struct Flag {
    volatile std::uint32_t *p;
    std::uint32_t value;
  };
  struct Block {
    int gpu;
    std::int64_t bytes;
    std::byte *p;
  };
  std::shared_ptr<Transport> transport_;
  std::mutex mu_;
  std::vector<volatile std::uint32_t *> flag_blocks_;
  std::vector<Flag> free_flags_; // capacity: every flag, so giving back never allocates
  std::int64_t num_flags_ = 0;
  std::vector<Block> blocks_, free_blocks_;
  std::atomic<std::int64_t> allocations_{0};
};

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
