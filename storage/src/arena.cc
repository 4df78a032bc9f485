#include "kvd/storage/arena.h"

#include <iterator>
#include <string>

namespace kvd::storage {
namespace {
bool IsPowerOfTwo(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }
}  // namespace

ArenaAllocator::ArenaAllocator(uint64_t capacity_bytes, uint64_t alignment)
    : alignment_(IsPowerOfTwo(alignment) ? alignment : kDefaultAlignment) {
  capacity_ = capacity_bytes & ~(alignment_ - 1);
  if (capacity_ > 0) InsertFree(0, capacity_);
}

uint64_t ArenaAllocator::RoundUp(uint64_t bytes) const {
  if (bytes == 0) bytes = 1;
  if (bytes > UINT64_MAX - alignment_) return UINT64_MAX & ~(alignment_ - 1);
  return (bytes + alignment_ - 1) & ~(alignment_ - 1);
}

void ArenaAllocator::InsertFree(uint64_t offset, uint64_t size) {
  free_by_offset_.emplace(offset, size);
  free_by_size_.emplace(size, offset);
}

void ArenaAllocator::EraseFree(std::map<uint64_t, uint64_t>::iterator it) {
  free_by_size_.erase({it->second, it->first});
  free_by_offset_.erase(it);
}

std::optional<uint64_t> ArenaAllocator::Allocate(uint64_t bytes) {
  const uint64_t size = RoundUp(bytes);
  auto best = free_by_size_.lower_bound({size, 0});
  if (best == free_by_size_.end()) return std::nullopt;
  const uint64_t block_size = best->first;
  const uint64_t offset = best->second;
  EraseFree(free_by_offset_.find(offset));
  if (block_size > size) InsertFree(offset + size, block_size - size);
  live_.emplace(offset, size);
  allocated_ += size;
  return offset;
}

Status ArenaAllocator::Free(uint64_t offset) {
  auto live = live_.find(offset);
  if (live == live_.end()) {
    return Status::NotFound("arena: no allocated block starts at offset " + std::to_string(offset) +
                            " (double free or foreign offset)");
  }
  uint64_t start = offset;
  uint64_t size = live->second;
  live_.erase(live);
  allocated_ -= size;
  // Coalesce with the free block after, then the one before.
  auto next = free_by_offset_.lower_bound(start);
  if (next != free_by_offset_.end() && next->first == start + size) {
    size += next->second;
    EraseFree(next);
  }
  auto after = free_by_offset_.lower_bound(start);
  if (after != free_by_offset_.begin()) {
    auto prev = std::prev(after);
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      EraseFree(prev);
    }
  }
  InsertFree(start, size);
  return Status::Ok();
}

uint64_t ArenaAllocator::BlockSize(uint64_t offset) const {
  auto it = live_.find(offset);
  return it == live_.end() ? 0 : it->second;
}

bool ArenaAllocator::CanAllocate(uint64_t bytes) const {
  return free_by_size_.lower_bound({RoundUp(bytes), 0}) != free_by_size_.end();
}

ArenaStats ArenaAllocator::Stats() const {
  ArenaStats s;
  s.capacity_bytes = capacity_;
  s.allocated_bytes = allocated_;
  s.free_bytes = capacity_ - allocated_;
  s.largest_free_block = free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
  s.free_blocks = free_by_offset_.size();
  s.allocated_blocks = live_.size();
  s.fragmentation = s.free_bytes == 0 ? 0.0
                                      : 1.0 - static_cast<double>(s.largest_free_block) /
                                                  static_cast<double>(s.free_bytes);
  return s;
}

Status ArenaAllocator::CheckConsistency() const {
  uint64_t free_total = 0;
  uint64_t prev_end = 0;
  bool first = true;
  for (const auto& [offset, size] : free_by_offset_) {
    if (size == 0 || offset % alignment_ != 0 || size % alignment_ != 0) {
      return Status::Internal("arena: misaligned or empty free block at " + std::to_string(offset));
    }
    if (!first && offset < prev_end) {
      return Status::Internal("arena: overlapping free blocks at " + std::to_string(offset));
    }
    if (!first && offset == prev_end) {
      return Status::Internal("arena: uncoalesced free blocks at " + std::to_string(offset));
    }
    if (offset + size > capacity_) {
      return Status::Internal("arena: free block past capacity at " + std::to_string(offset));
    }
    if (free_by_size_.count({size, offset}) != 1) {
      return Status::Internal("arena: size index misses block at " + std::to_string(offset));
    }
    prev_end = offset + size;
    first = false;
    free_total += size;
  }
  if (free_by_size_.size() != free_by_offset_.size()) {
    return Status::Internal("arena: free indexes disagree");
  }
  uint64_t live_total = 0;
  for (const auto& [offset, size] : live_) {
    live_total += size;
    auto next_free = free_by_offset_.lower_bound(offset);
    if (next_free != free_by_offset_.end() && next_free->first < offset + size) {
      return Status::Internal("arena: live block overlaps free block at " + std::to_string(offset));
    }
    if (next_free != free_by_offset_.begin()) {
      auto prev = std::prev(next_free);
      if (prev->first + prev->second > offset) {
        return Status::Internal("arena: free block overlaps live block at " +
                                std::to_string(offset));
      }
    }
  }
  if (live_total != allocated_ || free_total + allocated_ != capacity_) {
    return Status::Internal("arena: accounting broken: live=" + std::to_string(live_total) +
                            " allocated=" + std::to_string(allocated_) + " free=" +
                            std::to_string(free_total) + " capacity=" + std::to_string(capacity_));
  }
  return Status::Ok();
}

}  // namespace kvd::storage
