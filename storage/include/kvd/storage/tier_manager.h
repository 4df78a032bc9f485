// TierManager: placement across the host tier and (optionally) the disk tier.
//
// - Writes land in the host tier (the daemon uses HostTier's Reserve / Commit directly).
// - MaybeDemote(): when the host tier's occupancy is above high_watermark, copies its
//   least-recently-used unpinned chunks to disk and removes them from host until occupancy is
//   at or below low_watermark. The daemon calls it from a timer and after commits. Without a
//   disk tier it does nothing. NOTE: the host tier's own eviction (a Reserve that finds it
//   full) DROPS chunks without copying them to disk; call MaybeDemote often enough (and keep
//   high_watermark below 1) that it rarely comes to that.
// - Lookup(): the host tier's Lookup, after promoting into host the chunks of the requested
//   prefix that are only on disk (when promote_on_hit), so the result and its lease cover both
//   tiers. A chunk whose disk copy is corrupt stops the prefix there (it is dropped by the disk
//   tier and counted in its checksum_failures).
// - List / Evict / stats span both tiers.
//
// Thread safety: thread-safe (the tiers are). Demotion passes are serialized by demote_mu_;
// lookups may run concurrently with a demotion: a chunk is copied to disk BEFORE it is removed
// from host, so a concurrent lookup finds it in at least one tier.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "kvd/common/status.h"
#include "kvd/storage/disk_tier.h"
#include "kvd/storage/host_tier.h"
#include "kvd/storage/options.h"

namespace kvd::storage {

struct DemoteResult {
  uint64_t demoted = 0;  // chunks copied to disk and dropped from host
  uint64_t bytes = 0;    // their payload bytes
  uint64_t skipped = 0;  // chunks that became pinned or vanished meanwhile
  double occupancy_before = 0.0;
  double occupancy_after = 0.0;
};

class TierManager {
 public:
  // `host` is required; `disk` may be null (host only). Neither is owned; both outlive this.
  // Errors: INVALID_ARGUMENT (options.Validate(), null host).
  static StatusOr<std::unique_ptr<TierManager>> Create(const TierManagerOptions& options,
                                                       HostTier* host, DiskTier* disk);

  // See the file comment. Errors are the host tier's Lookup errors; promotion failures (no room
  // in host, corrupt disk copy) shorten the match instead of failing the lookup.
  StatusOr<LookupResult> Lookup(const LookupRequest& request);

  // One demotion pass (see the file comment). UNAVAILABLE if a disk write fails (what was
  // demoted before stays demoted).
  StatusOr<DemoteResult> MaybeDemote();

  // Chunks of both tiers (host first), up to `limit` (0 = no limit).
  std::vector<ChunkMeta> List(const ChunkFilter& filter, size_t limit) const;
  // Evicts matching chunks from both tiers; results summed.
  EvictResult Evict(const ChunkFilter& filter);
  // Host stats first, then disk if present.
  std::vector<TierStats> GetStats() const;

  uint64_t promotions() const;
  uint64_t demotions() const;

  HostTier* host() const { return host_; }
  DiskTier* disk() const { return disk_; }

 private:
  TierManager(const TierManagerOptions& options, HostTier* host, DiskTier* disk);
  // Copies `key` from disk into host. REQUIRES: disk_ != nullptr.
  Status Promote(const ChunkKey& key);

  const TierManagerOptions options_;
  HostTier* const host_;
  DiskTier* const disk_;
  std::mutex demote_mu_;  // serializes MaybeDemote passes; guards nothing else
  mutable std::mutex counters_mu_;
  uint64_t promotions_ = 0;  // guarded by counters_mu_
  uint64_t demotions_ = 0;   // guarded by counters_mu_
};

}  // namespace kvd::storage
