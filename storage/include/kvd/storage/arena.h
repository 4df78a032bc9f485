// ArenaAllocator: offsets inside ONE contiguous region that the caller owns.
//
// The host tier stores chunk bytes in a single region provided by its owner (the daemon allocates
// it through the transport so remote peers can RMA into it; tests pass an aligned buffer). The
// allocator hands out [offset, offset + size) ranges of that region; it never touches the bytes
// and never allocates memory for them (its own bookkeeping is a few map nodes per block).
//
// Policy: best fit (smallest free block that is large enough, lowest offset on ties); a freed
// block is coalesced with its free neighbours at once, so two adjacent free blocks never exist.
// Every offset and every block size is a multiple of `alignment`.
//
// Thread safety: NOT thread-safe (thread-compatible). The owner serializes calls (HostTier calls
// it only under its mutex).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>
#include <utility>

#include "kvd/common/status.h"

namespace kvd::storage {

struct ArenaStats {
  uint64_t capacity_bytes = 0;   // usable bytes (region size rounded down to the alignment)
  uint64_t allocated_bytes = 0;  // sum of live block sizes (after rounding up to the alignment)
  uint64_t free_bytes = 0;       // capacity_bytes - allocated_bytes
  uint64_t largest_free_block = 0;
  uint64_t free_blocks = 0;  // number of (maximal, coalesced) free ranges
  uint64_t allocated_blocks = 0;
  // 1 - largest_free_block / free_bytes: 0 when all free space is one block (or none is free),
  // towards 1 when free space is shattered into small pieces.
  double fragmentation = 0.0;
};

class ArenaAllocator {
 public:
  static constexpr uint64_t kDefaultAlignment = 64;

  // An allocator over offsets [0, capacity_bytes rounded down to `alignment`).
  // REQUIRES: alignment is a power of two >= 1 (checked by Validate at construction sites:
  // HostTierOptions::Validate); an invalid alignment is replaced by kDefaultAlignment.
  explicit ArenaAllocator(uint64_t capacity_bytes, uint64_t alignment = kDefaultAlignment);

  ArenaAllocator(const ArenaAllocator&) = delete;
  ArenaAllocator& operator=(const ArenaAllocator&) = delete;
  ArenaAllocator(ArenaAllocator&&) = default;
  ArenaAllocator& operator=(ArenaAllocator&&) = default;

  // Allocates `bytes` (rounded up to the alignment; 0 is treated as one alignment unit).
  // Returns the offset, or nullopt if no free block is large enough (the caller may evict and
  // retry). O(log blocks).
  std::optional<uint64_t> Allocate(uint64_t bytes);

  // Frees the block starting at `offset`. Errors: NOT_FOUND if no live block starts there
  // (double free or a foreign offset; the allocator is unchanged). O(log blocks).
  Status Free(uint64_t offset);

  // Size of the live block at `offset` (after rounding), or 0 if none starts there.
  uint64_t BlockSize(uint64_t offset) const;
  // Whether an allocation of `bytes` would succeed now.
  bool CanAllocate(uint64_t bytes) const;
  // `bytes` rounded up to the alignment (what Allocate(bytes) consumes).
  uint64_t RoundUp(uint64_t bytes) const;

  ArenaStats Stats() const;
  uint64_t capacity() const { return capacity_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t allocated_bytes() const { return allocated_; }

  // Checks the internal invariants (free ranges disjoint, coalesced, accounted); for tests.
  Status CheckConsistency() const;

 private:
  void InsertFree(uint64_t offset, uint64_t size);
  void EraseFree(std::map<uint64_t, uint64_t>::iterator it);

  uint64_t capacity_ = 0;
  uint64_t alignment_ = kDefaultAlignment;
  uint64_t allocated_ = 0;
  std::map<uint64_t, uint64_t> free_by_offset_;           // offset -> size
  std::set<std::pair<uint64_t, uint64_t>> free_by_size_;  // (size, offset)
  std::unordered_map<uint64_t, uint64_t> live_;           // offset -> size
};

}  // namespace kvd::storage
