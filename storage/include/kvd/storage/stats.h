// Occupancy and traffic counters of a tier, as `kvdctl stats` shows them.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "kvd/storage/chunk.h"

namespace kvd::storage {

// Occupancy of one slice (a model or a namespace) of a tier.
struct UsageStats {
  uint64_t chunks = 0;
  uint64_t bytes = 0;  // payload bytes of committed chunks
  uint64_t tokens = 0;
  bool operator==(const UsageStats&) const = default;
};

// A snapshot of a tier. Invariants (tested):
//   hits + misses == lookups
//   used_bytes == sum over per_model of bytes == sum over per_namespace of bytes
//   chunk_count == sum over per_model of chunks
//   used_bytes + reserved_bytes <= capacity_bytes (host: in arena bytes, see below)
//   pinned_bytes <= used_bytes
struct TierStats {
  TierKind kind = TierKind::kHost;
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;      // payload bytes of committed (visible) chunks
  uint64_t reserved_bytes = 0;  // bytes held by open (uncommitted) reservations
  uint64_t pinned_bytes = 0;    // payload bytes of committed chunks pinned by a lease or read
  uint64_t arena_allocated_bytes = 0;  // host: arena bytes in use incl. alignment padding
  uint64_t chunk_count = 0;
  uint64_t reservations_open = 0;
  uint64_t leases_open = 0;
  uint64_t reads_open = 0;
  // Counters since the tier was created.
  uint64_t lookups = 0;           // Lookup calls
  uint64_t hits = 0;              // lookups that matched at least one leading chunk
  uint64_t misses = 0;            // lookups that matched none
  uint64_t chunks_requested = 0;  // chunk hashes asked for by all lookups
  uint64_t chunks_matched = 0;    // chunks returned by all lookups
  uint64_t evictions = 0;         // chunks removed to make room (capacity pressure)
  uint64_t quota_evictions = 0;   // of `evictions`, those made to keep a namespace quota
  uint64_t admin_evictions = 0;   // chunks removed by Evict(filter)
  uint64_t commits = 0;
  uint64_t dedup_puts = 0;         // Reserve / Commit found the key already stored
  uint64_t checksum_failures = 0;  // Commit or read found the bytes corrupt
  uint64_t reservations_expired = 0;
  uint64_t reservations_reclaimed = 0;  // by ReclaimOwner
  uint64_t leases_expired = 0;
  // Host, segmented arena: free segments taken again by the namespace that used them last
  // (memory kept), and passed to another namespace (memory replaced first, SegmentListener).
  uint64_t segments_reused = 0;
  uint64_t segments_handed_over = 0;
  double fragmentation = 0.0;  // host: ArenaStats::fragmentation
  std::map<std::string, UsageStats> per_model;
  std::map<std::string, UsageStats> per_namespace;
};

}  // namespace kvd::storage
