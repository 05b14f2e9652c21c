// The engine's pool of completion flags and device staging blocks.

#include "pool.hpp"

#include <algorithm>

namespace foremoe {
inline namespace v0 {
namespace runtime::detail {

ResourcePool::~ResourcePool() {
  for (volatile std::uint32_t *b : flag_blocks_)
    transport_->free_flags(b);
  for (const Block &b : blocks_)
    transport_->free(b.gpu, b.p);
}

Status ResourcePool::take_flag(volatile std::uint32_t *&flag, std::uint32_t &value) {
  std::lock_guard lock(mu_);
  if (free_flags_.empty()) {
    const std::int64_t n = std::max<std::int64_t>(8, num_flags_); // doubles the pool
    volatile std::uint32_t *block = nullptr;
    allocations_.fetch_add(1, std::memory_order_relaxed);
    if (Status st = transport_->alloc_flags(n, block); !st.ok()) return st;
    flag_blocks_.push_back(block);
    num_flags_ += n;
    free_flags_.reserve(static_cast<std::size_t>(num_flags_));
    for (std::int64_t i = n - 1; i >= 0; --i)
      free_flags_.push_back({block + i, 0});
  }
  const Flag f = free_flags_.back();
  free_flags_.pop_back();
  flag = f.p;
  value = f.value + 1;
  return Status::success();
}

void ResourcePool::give_flag(volatile std::uint32_t *flag, std::uint32_t value) noexcept {
  std::lock_guard lock(mu_);
  free_flags_.push_back({flag, value}); // within the reserved capacity
}

Status ResourcePool::take_block(int gpu, std::int64_t bytes, std::byte *&out) {
  std::lock_guard lock(mu_);
  for (std::size_t i = 0; i < free_blocks_.size(); ++i)
    if (free_blocks_[i].gpu == gpu && free_blocks_[i].bytes == bytes) {
      out = free_blocks_[i].p;
      free_blocks_[i] = free_blocks_.back();
      free_blocks_.pop_back();
      return Status::success();
    }
  allocations_.fetch_add(1, std::memory_order_relaxed);
  blocks_.reserve(blocks_.size() + 1);
  free_blocks_.reserve(blocks_.size() + 1);
  if (Status st = transport_->alloc(gpu, bytes, out); !st.ok()) return st;
  blocks_.push_back({gpu, bytes, out});
  return Status::success();
}

void ResourcePool::give_block(int gpu, std::int64_t bytes, std::byte *p) noexcept {
  std::lock_guard lock(mu_);
  free_blocks_.push_back({gpu, bytes, p}); // within the reserved capacity
}

} // namespace runtime::detail
} // namespace v0
} // namespace foremoe
