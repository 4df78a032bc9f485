// Options of the storage tiers. Plain structs; every field says its effect and default. The
// topology file binds to these (daemon/), once. None can change at runtime: build a new tier.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "kvd/common/status.h"
#include "kvd/storage/quotas.h"

namespace kvd::storage {

struct HostTierOptions {
  // Bytes of the arena the tier may use. 0 (default) means the whole region passed to the
  // HostTier constructor; otherwise it must be <= that region's size. Reaching it makes Reserve
  // evict least-recently-used unpinned chunks.
  uint64_t capacity_bytes = 0;
  // Alignment of every chunk's offset and size in the arena (power of two, 8..1 MiB; default 64,
  // a cache line). The region's start address must be aligned to it too.
  uint64_t alignment = 64;
  // How long a reservation may stay uncommitted before ExpireReservations reclaims its space
  // (and a late Commit gets ABORTED). Default 30 s. Must be > 0.
  std::chrono::milliseconds reservation_ttl{30000};
  // How long a lease from Lookup pins its chunks if never released. Default 30 s. Must be > 0.
  std::chrono::milliseconds lease_ttl{30000};
  // How long a read view from Get pins its chunk if ReleaseRead is never called (a stuck peer).
  // Default 60 s. Must be > 0.
  std::chrono::milliseconds read_ttl{60000};
  // Per-namespace quotas (kvd/storage/quotas.h): stored, reserved and pinned bytes and leases of
  // each namespace. A Reserve or Lookup over one fails RESOURCE_EXHAUSTED with
  // Reason::kQuotaExceeded, naming the namespace and the limit (a Reserve over stored_bytes first
  // evicts that namespace's own least-recently-used unpinned chunks, never another's). Default:
  // none.
  QuotaTable quotas;
  // Cut the arena into segments of this many bytes (a multiple of `alignment`); every chunk lies
  // inside one segment and a segment holds chunks of ONE namespace only (assigned on first use,
  // free again once empty; see SegmentedArena). The daemon sets it to back each segment with its
  // own memfd, so a same-node client maps only its namespace's bytes. Costs: no chunk may exceed
  // a segment, and a namespace's free space is only in its own (or free) segments. 0 (default):
  // one segment spanning the arena, namespaces share it.
  uint64_t segment_bytes = 0;
  // Leases one owner (a connection; owner 0 is never limited) may hold at once: a Lookup that
  // would create one more fails RESOURCE_EXHAUSTED. 0 (default) = no limit.
  uint32_t max_leases_per_owner = 0;
  // Largest single chunk accepted by Reserve (bytes). 0 (default) means no limit beyond capacity.
  uint64_t max_chunk_bytes = 0;
  // How many retired reservation / lease ids are remembered so that a late Commit or Get can say
  // "expired" / "reclaimed" (ABORTED) instead of "unknown" (NOT_FOUND). Default 65536.
  uint32_t retired_id_memory = 65536;

  // INVALID_ARGUMENT naming the first bad field.
  Status Validate() const;
};

struct DiskTierOptions {
  // Directory of the RocksDB database; created (with its parents) if missing. Required.
  std::string path;
  // Payload bytes the tier may hold; Insert evicts least-recently-used chunks above it.
  // Default 64 GiB. Must be > 0.
  uint64_t capacity_bytes = 64ull << 30;
  // Write-ahead log: true (default) makes every Insert durable against a process crash once it
  // returns; false is ~2x faster for bulk puts but loses the last unflushed writes on a crash
  // (the checksum still detects nothing partial is served: a lost chunk is simply absent).
  bool use_wal = true;
  // fsync the WAL on every write (durability against power loss). Default false. Requires use_wal.
  bool sync_writes = false;
  // Verify the stored checksum of a chunk on every read (DATA_LOSS on mismatch). Default true;
  // false is only for benchmarks.
  bool verify_checksums = true;
  // Store payloads in RocksDB blob files (integrated BlobDB) instead of SST blocks: no rewrite
  // of large values by compaction. Default false (see storage_bench for the figures).
  bool blob_files = false;
  // RocksDB memtable size of the data column family (bytes). Default 128 MiB.
  uint64_t write_buffer_bytes = 128ull << 20;
  // RocksDB block cache bytes for the metadata column family and data. Default 64 MiB.
  uint64_t block_cache_bytes = 64ull << 20;
  // While a RocksDB background error has stopped the database's writes (DiskTier::Health()),
  // the tier calls DB::Resume() every resume_interval_ms when RocksDB says the error can be
  // resumed from (severity soft or hard, not a corruption), at most max_resume_attempts times
  // in a row (counted again once writes stayed up for ten intervals). Defaults 5000 ms and 60
  // (five minutes). max_resume_attempts 0: never. resume_interval_ms >= 10.
  uint32_t resume_interval_ms = 5000;
  uint32_t max_resume_attempts = 60;

  Status Validate() const;
};

// TierManager: placement across its tiers (tier_manager.h).
struct TierManagerOptions {
  // When the host tier's used + reserved bytes exceed this fraction of its capacity, its
  // least-recently-used unpinned chunks are copied to the tier below host (disk) and dropped from
  // host until usage is back under low_watermark; a tier above host (GPU) is moved down to host
  // the same way above its own. Default 0.90. Range (0, 1].
  double high_watermark = 0.90;
  // Target of a demotion pass. Default 0.75. Range [0, high_watermark].
  double low_watermark = 0.75;
  // Copy a chunk found only below host (on disk) back to host memory on a Lookup hit, and a host
  // hit up into the tier right above host when it has room. Default true.
  bool promote_on_hit = true;
  // What a put gets while the disk tier's writes are stopped (DiskTier::Health().writes_stopped:
  // a RocksDB background error). kKeepInHost (default): the put is acknowledged once it is in
  // host memory, as on a node without a disk tier (lost at a restart or under host-memory
  // pressure), and intact chunks on disk are still served. kFailPuts: the put fails UNAVAILABLE
  // naming the disk error (nothing is acknowledged that is not on disk).
  enum class OnDiskError : uint8_t { kKeepInHost, kFailPuts };
  OnDiskError on_disk_error = OnDiskError::kKeepInHost;

  Status Validate() const;
};

}  // namespace kvd::storage
