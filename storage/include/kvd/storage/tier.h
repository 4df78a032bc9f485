// Tier: what every storage tier (GPU, host, disk) offers the TierManager and the admin surface.
//
// The core is copy-in / copy-out of whole chunks (Insert, ReadInto) plus inspection and removal.
// The zero-copy protocol of the host tier (reservations, leases, read views) lives on HostTier;
// a tier that cannot do something returns UNIMPLEMENTED rather than being special-cased here.
//
// Thread safety: every implementation is thread-safe (all methods may be called concurrently).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvd/common/status.h"
#include "kvd/storage/chunk.h"
#include "kvd/storage/chunk_events.h"
#include "kvd/storage/stats.h"

namespace kvd::storage {

struct EvictResult {
  uint64_t evicted = 0;   // chunks removed now
  uint64_t deferred = 0;  // chunks pinned by a lease/read: hidden now, freed at their last unpin
  uint64_t bytes = 0;     // payload bytes removed now
};

// The ALREADY_EXISTS a Reserve/Commit/Insert returns when the key is already stored (as durably
// as the put asks): the client may skip sending the bytes, the chunk is there.
inline Status DedupStatus(std::string message) {
  return Status(StatusCode::kAlreadyExists, std::move(message), Reason::kDedup);
}
inline bool IsDedup(const Status& status) { return status.reason() == Reason::kDedup; }

class Tier {
 public:
  virtual ~Tier() = default;

  virtual TierKind kind() const = 0;

  // Stores a complete chunk by copying `bytes`. The checksum of `bytes` is computed and must
  // equal `checksum`. Errors: DATA_LOSS (checksum mismatch), ALREADY_EXISTS with Reason::kDedup
  // (IsDedup: the key is already stored, nothing changed), RESOURCE_EXHAUSTED (no room even after
  // evicting everything evictable), INVALID_ARGUMENT (empty bytes, over max size).
  virtual Status Insert(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                        std::span<const std::byte> bytes) = 0;

  // Copies a chunk's bytes into `out` (REQUIRES: out.size() >= the chunk's size) and returns its
  // metadata; verifies the checksum where the tier's options say so. Counts as an access (LRU).
  // Errors: NOT_FOUND naming the key, OUT_OF_RANGE (out too small; message gives both sizes),
  // DATA_LOSS (stored bytes corrupt; the chunk is dropped).
  virtual StatusOr<ChunkMeta> ReadInto(const ChunkKey& key, std::span<std::byte> out) = 0;

  // Metadata of a visible chunk, without counting an access. NOT_FOUND naming the key.
  virtual StatusOr<ChunkMeta> Describe(const ChunkKey& key) const = 0;

  // Removes one chunk now if it is unpinned. NOT_FOUND (absent), FAILED_PRECONDITION (pinned).
  virtual Status Remove(const ChunkKey& key) = 0;

  // Metadata of up to `limit` visible chunks matching `filter` (0 = no limit), most recently
  // used first.
  virtual std::vector<ChunkMeta> List(const ChunkFilter& filter, size_t limit) const = 0;

  // Admin eviction of every chunk matching `filter`. Pinned chunks are hidden at once (lookup no
  // longer finds them) and freed when their last pin goes.
  virtual EvictResult Evict(const ChunkFilter& filter) = 0;

  virtual TierStats GetStats() const = 0;

  // Tells `listener` (not owned; null = nobody) of every chunk that becomes visible in this tier
  // or stops being visible (chunk_events.h). Set it before the tier is used concurrently (the
  // daemon sets it at start).
  virtual void SetEventListener(ChunkEventListener* listener) = 0;
};

}  // namespace kvd::storage
