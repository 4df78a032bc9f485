// ArenaAllocator: offsets inside ONE contiguous region that the caller owns.
//
// The host tier stores chunk bytes in a single region provided by its owner; the allocators here
// hand out [offset, offset + size) ranges of that region; they never touch the bytes and never
// allocate memory for them (their own bookkeeping is a few map nodes per block).
//
// ARENA OWNERSHIP (the contract between the host tier and whoever provides its memory):
//   - HostTier owns the allocation POLICY (these classes) over the region it is given, and is the
//     only one that decides which offsets hold which chunk.
//   - Where the region's memory comes from is the region owner's choice, invisible behind
//     HostTier's Reserve / Commit / Lookup / Get / lease API (which everybody keeps calling
//     unchanged): the daemon backs it with memfd shared memory, one memfd per segment (see
//     SegmentedArena), so that same-node clients can map their namespace's segments and copy
//     chunk bytes themselves; remote peers reach the same bytes through the transport; tests pass
//     an aligned heap buffer.
//   - With segments, the region owner replaces the memory behind a free segment before it passes
//     to a namespace other than the one that used it last (HostTier asks it through
//     SegmentListener, while nothing of the tier's lives there); a segment taken again by the
//     namespace that used it last keeps its memory.
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
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

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

// SegmentedArena: the host tier's allocation policy, ArenaAllocator per SEGMENT.
//
// The region is cut into segments of `segment_bytes` (the last one may be shorter). Every block
// lies inside one segment, and a segment holds blocks of ONE namespace only: it is assigned to a
// namespace when the first block of that namespace lands in it and becomes free again (for any
// namespace, see Policy) when its last block is freed. This is what lets the region's owner back
// each segment with its own memory object (the daemon: one memfd per segment, replaced at every
// handover) and hand a same-node client the segments of its own namespace and nothing else: the
// bytes of another namespace are never inside anything the client can map. With segment_bytes == 0
// there is one segment spanning the region and namespaces are ignored (plain best fit over the
// whole region).
//
// Each segment remembers the namespace that held blocks in it LAST (SegmentLastOwner; "" for a
// segment never used), also while it is free: its memory may still hold that namespace's bytes.
//
// Policy: a block goes to the namespace's own segments first (first segment, in ascending
// order, that has room; best fit inside it), then to a free segment, preferring (lowest index
// first within each kind):
//   1. one the same namespace used last (its memory holds only that namespace's old bytes:
//      nothing to replace, and its clients' mappings and page tables stay valid);
//   2. one never used;
//   3. one another namespace used last: a HANDOVER (Placement::handover). Its memory holds the
//      other namespace's bytes, so the region owner must replace it before anything of the new
//      namespace is written or mapped there (HostTier asks SegmentListener::OnSegmentHandover).
// A request larger than a segment can never be satisfied (CanAllocate is false; callers say so).
//
// Thread safety: NOT thread-safe, like ArenaAllocator (HostTier calls it under its mutex).
class SegmentedArena {
 public:
  // `segment_bytes` 0 = one segment; otherwise it must be a multiple of `alignment` (checked by
  // HostTierOptions::Validate; an unaligned value is rounded down, a value 0 after rounding
  // means one segment).
  SegmentedArena(uint64_t capacity_bytes, uint64_t alignment, uint64_t segment_bytes);

  // Where a block of `bytes` for namespace `ns` goes (the policy above), without allocating it.
  struct Placement {
    uint32_t segment = 0;
    // The segment is free and another namespace held blocks in it last (see Policy, 3).
    bool handover = false;
  };
  // nullopt iff CanAllocate(bytes, ns) is false. Unsegmented: always segment 0, no handover.
  std::optional<Placement> Place(uint64_t bytes, const std::string& ns) const;
  // Allocates the block in `placement.segment`, which Place(bytes, ns) returned with no call
  // changing the arena in between; assigns the segment to `ns` if it was free (counted in
  // SegmentCounters). Its offset in the region; nullopt only if that contract was broken.
  std::optional<uint64_t> AllocateAt(const Placement& placement, uint64_t bytes,
                                     const std::string& ns);
  // Place + AllocateAt: a block of `bytes` (rounded up to the alignment) for namespace `ns`; its
  // offset in the region, or nullopt if no own or free segment has room. A caller whose region
  // owner must replace a handed-over segment's memory uses Place and AllocateAt instead.
  std::optional<uint64_t> Allocate(uint64_t bytes, const std::string& ns);
  // NOT_FOUND if no live block starts at `offset`. Returns the segment that became free (its
  // last block went), if any, through `released_segment` (may be null); the segment remembers
  // its namespace as SegmentLastOwner.
  Status Free(uint64_t offset, std::optional<uint32_t>* released_segment = nullptr);
  bool CanAllocate(uint64_t bytes, const std::string& ns) const;
  uint64_t BlockSize(uint64_t offset) const;
  uint64_t RoundUp(uint64_t bytes) const { return segments_.front().RoundUp(bytes); }

  // Sum over segments (largest_free_block: the largest anywhere; fragmentation from those).
  ArenaStats Stats() const;
  uint64_t capacity() const { return capacity_; }
  uint64_t alignment() const { return segments_.front().alignment(); }
  uint64_t allocated_bytes() const { return allocated_; }
  // The largest block one segment can hold (a chunk above it can never be stored).
  uint64_t max_block_bytes() const { return segments_.front().capacity(); }

  bool segmented() const { return segment_bytes_ != 0; }
  // segment_bytes as given (0: unsegmented), the number of segments, and segment i's range.
  uint64_t segment_bytes() const { return segment_bytes_; }
  uint32_t segment_count() const { return static_cast<uint32_t>(segments_.size()); }
  uint32_t SegmentOf(uint64_t offset) const;
  uint64_t SegmentStart(uint32_t segment) const;
  uint64_t SegmentSize(uint32_t segment) const { return segments_.at(segment).capacity(); }
  // The namespace a segment is assigned to; empty if free (or unsegmented).
  const std::string& SegmentOwner(uint32_t segment) const;
  // The namespace that held blocks in the segment last (its owner while assigned; kept while
  // free); empty if it was never used (or unsegmented).
  const std::string& SegmentLastOwner(uint32_t segment) const { return last_owner_.at(segment); }

  // How free segments were taken since construction (segmented arenas only).
  struct SegmentCounters {
    uint64_t first_uses = 0;  // a segment never used before
    uint64_t reuses = 0;      // by the namespace that used it last (memory kept)
    uint64_t handovers = 0;   // by another namespace than the one that used it last
  };
  SegmentCounters segment_counters() const { return counters_; }

  // Every segment's allocator consistent, ownership matching occupancy, totals adding up.
  Status CheckConsistency() const;

 private:
  uint64_t segment_bytes_ = 0;  // 0: one segment
  uint64_t capacity_ = 0;       // sum of the segments' capacities
  uint64_t allocated_ = 0;
  std::vector<ArenaAllocator> segments_;
  // The namespace that used each segment last: its owner while it holds blocks (not in
  // free_segments_), kept while it is free; "" = never used.
  std::vector<std::string> last_owner_;
  std::map<std::string, std::vector<uint32_t>> by_owner_;  // ascending segment indexes
  std::set<uint32_t> free_segments_;                       // ascending
  SegmentCounters counters_;
};

}  // namespace kvd::storage
