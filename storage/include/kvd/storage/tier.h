// Tier: what every storage tier (GPU, host, disk) offers the TierManager and the admin surface.
//
// The core is copy-in / copy-out of whole chunks (Insert, ReadInto) plus inspection and removal.
// The zero-copy protocol of the host tier (reservations, leases, read views) lives on HostTier;
// a tier that cannot do something returns UNIMPLEMENTED rather than being special-cased here.
// The capability and placement queries below are all the TierManager asks of a tier besides its
// place in the manager's list (tier_manager.h); each has a default that suits a tier without the
// notion, so a new tier overrides only what it has.
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

  // Where the tier's bytes live (device, host memory, disk), as stats, listings and logs name it.
  virtual TierKind kind() const = 0;

  // ---- capabilities ----

  // Readers are served straight from this tier's memory (leases, read views of a region clients
  // map): the HostTier, and only it. A chunk found only in another tier is copied into it to be
  // served. Default false.
  virtual bool serves_in_place() const { return false; }
  // A copy here survives a kill -9 of the process (the disk tier): the TierManager writes every
  // committed chunk to each durable tier before the put is acknowledged. A durable tier's Insert
  // of a key whose write is still in progress waits for that write (and writes the bytes itself
  // if it failed) before it answers, so its dedup is as durable as its OK. Default false.
  virtual bool durable() const { return false; }
  // A durable tier refuses writes for now (the disk tier after a RocksDB background error);
  // TierManagerOptions::on_disk_error decides what a put then gets. Default false.
  virtual bool writes_stopped() const { return false; }

  // ---- placement queries (the TierManager's promotion and demotion) ----

  // Whether `key` is stored and visible here; counts no access. Default: Describe(key).ok().
  virtual bool Contains(const ChunkKey& key) const { return Describe(key).ok(); }
  // A lookup of `key` in this tier: true on a hit (the chunk becomes most recently used); counted
  // in the tier's lookups where it keeps them. Default: Contains(key).
  virtual bool Touch(const ChunkKey& key) { return Contains(key); }
  // Whether a chunk of `bytes` fits now without removing anything. Default true.
  virtual bool HasRoomFor(uint64_t bytes) const {
    (void)bytes;
    return true;
  }
  // Whether a chunk of `bytes` could be held at all (false: removing everything would still not
  // make room). Default true.
  virtual bool CanEverHold(uint64_t bytes) const {
    (void)bytes;
    return true;
  }
  // Occupied share of the capacity, in [0, 1], that the manager's watermarks compare. Default 0
  // (never above a watermark).
  virtual double Occupancy() const { return 0.0; }
  // Up to `max_chunks` unpinned chunks, least recently used first: what a demotion moves first.
  // Default: none.
  virtual std::vector<ChunkMeta> LeastRecentlyUsed(size_t max_chunks) const {
    (void)max_chunks;
    return {};
  }
  // The manager moved one of this tier's chunks down to a lower tier and removed it here: counted
  // as an eviction where the tier keeps stats. Default: nothing.
  virtual void CountDemotion() {}
  // Insert's contract with `device_src` a device pointer (`bytes` bytes) of this tier's device,
  // copied on the device; the checksum is recorded, not verified. Default UNIMPLEMENTED.
  virtual Status InsertFromDevice(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                                  const void* device_src, uint64_t bytes) {
    (void)key, (void)tokens, (void)checksum, (void)device_src, (void)bytes;
    return Status::Unimplemented(std::string(TierKindName(kind())) +
                                 " tier: no insert from device memory");
  }

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
