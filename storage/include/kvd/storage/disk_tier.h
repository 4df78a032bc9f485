// DiskTier: the RocksDB tier. Chunks survive a restart: Open rebuilds the in-memory index from
// the database's metadata column family and serves what is there.
//
// Storage format (one RocksDB database at DiskTierOptions::path, three column families):
//   "default": key -> [u64 checksum][u32 tokens][u32 reserved][payload bytes]
//   "meta":    key -> [u8 version=1][u32 tokens][u64 size][u64 checksum]  (index rebuild)
//   "state":   name -> [u64 checksum of the bytes][bytes]   (daemon state other than chunks, e.g.
//              VECTOR calibration weights: PutState / GetState / RemoveState; never evicted,
//              not a chunk)
// The first two are written in one WriteBatch, so a chunk is either wholly present or absent. The
// key is a length-prefixed encoding of every ChunkKey field. Each value carries its own checksum,
// so a read is self-consistent and verified (DATA_LOSS on mismatch; the corrupt chunk is deleted).
//
// Eviction: least-recently-used (in-process order; after a restart, restored chunks start in
// key order) when an Insert would exceed capacity_bytes. used_bytes never exceeds capacity_bytes,
// also after a restart with a lower capacity: Open restores chunks in key order while they fit
// and leaves the rest in the database, unserved (over_capacity_records). The disk tier has no
// leases: readers copy out (ReadInto), and the TierManager promotes hits into the host tier where
// leases apply.
//
// Damage: a RocksDB background error (a compaction that hit a damaged block) stops writes, not
// reads (Health().writes_stopped; Insert refuses); a damaged database at Open is moved aside and
// what RocksDB's RepairDB recovers from a copy is served (Health().start). docs/reliability.md,
// "A disk tier that degrades".
//
// Thread safety: thread-safe. mu_ (in Impl) guards the in-memory index, the LRU list, the set
// of keys being written and the counters. An Insert claims its key and space under mu_, writes
// to RocksDB without it, then publishes under it (a concurrent Insert of the same key gets the
// dedup ALREADY_EXISTS, after waiting for that write: the dedup means on disk, and if that write
// failed the waiting Insert writes the chunk itself; the chunk is invisible until published).
// Deletes (Remove, eviction) are small and run under mu_. Reads and checksum verification run
// without it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvd/common/clock.h"
#include "kvd/common/status.h"
#include "kvd/storage/chunk.h"
#include "kvd/storage/options.h"
#include "kvd/storage/stats.h"
#include "kvd/storage/tier.h"

namespace kvd::storage {

// The state of the disk tier's database (DiskTier::Health()).
struct DiskHealthReport {
  // How Open found the database.
  enum class Start : uint8_t {
    kClean,     // opened as it was (a torn last write-ahead log record included)
    kRepaired,  // damaged (a file RocksDB reports corrupt or missing, or a background error
                // recorded by the previous run): moved aside to quarantine_path, and what
                // RocksDB's RepairDB recovered from it is served
    kEmpty,     // damaged and not repairable: moved aside to quarantine_path, started empty
  };
  Start start = Start::kClean;
  std::string start_damage;     // what was damaged (RocksDB's status, naming the file)
  std::string quarantine_path;  // the damaged database as it was found (kRepaired, kEmpty)
  // A RocksDB background error (a flush or compaction that hit a damaged file, an I/O error)
  // has stopped the database's writes: Insert refuses (FAILED_PRECONDITION), reads go on.
  bool writes_stopped = false;
  std::string stop_reason;         // RocksDB's status of that error (names the file where it does)
  uint64_t background_errors = 0;  // since Open
  uint64_t resumes = 0;            // writes that started again after a background error
  uint64_t writes_refused = 0;     // Inserts refused while writes were stopped
};

class DiskTier final : public Tier {
 public:
  // Opens (creating if missing) the database at options.path and rebuilds the index.
  // `clock` (not owned; nullptr = Clock::Real()) stamps created / last-access times.
  // Errors: INVALID_ARGUMENT (options), UNAVAILABLE (RocksDB could not open: path, lock held by
  // another process, ...; the message carries RocksDB's). A damaged database is not an error:
  // a file RocksDB reports corrupt (an SST block, the MANIFEST) or missing (a CURRENT naming
  // no MANIFEST), or a background corruption recorded by the previous run, makes Open move the
  // database aside into "<path>.quarantine-<UTC time>" (logged) and serve what RocksDB's
  // RepairDB recovers from a copy of it (files that do not read back whole are left out), or
  // start empty when that fails; Health().start says which. A malformed metadata record is
  // quarantined, not an error; so is a chunk that does not fit capacity_bytes (see
  // over_capacity_records).
  static StatusOr<std::unique_ptr<DiskTier>> Open(const DiskTierOptions& options,
                                                  Clock* clock = nullptr);
  ~DiskTier() override;  // flushes nothing extra: with use_wal=false, unflushed writes are lost
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  TierKind kind() const override { return TierKind::kDisk; }
  bool durable() const override { return true; }
  // Also: RESOURCE_EXHAUSTED when bytes > capacity_bytes; UNAVAILABLE on a RocksDB write error;
  // FAILED_PRECONDITION while writes are stopped (Health().writes_stopped; nothing written).
  Status Insert(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                std::span<const std::byte> bytes) override;
  StatusOr<ChunkMeta> ReadInto(const ChunkKey& key, std::span<std::byte> out) override;
  StatusOr<ChunkMeta> Describe(const ChunkKey& key) const override;
  // The disk tier never pins: Remove deletes at once.
  Status Remove(const ChunkKey& key) override;
  std::vector<ChunkMeta> List(const ChunkFilter& filter, size_t limit) const override;
  EvictResult Evict(const ChunkFilter& filter) override;
  TierStats GetStats() const override;
  void SetEventListener(ChunkEventListener* listener) override;

  // Whether the chunk is in the index (cheap; no I/O).
  bool Contains(const ChunkKey& key) const override;
  // Chunks restored from the database by Open.
  uint64_t restored_chunks() const;
  // Metadata records Open could not decode: logged, left in the database untouched and not
  // served (a malformed record is never fatal to Open).
  uint64_t quarantined_records() const;
  // Chunks Open found on disk but did not index because they did not fit capacity_bytes (the
  // capacity was lowered since they were written): in key order, a chunk is restored while the
  // chunks restored before it leave room for it, else it is left in the database untouched,
  // not served and not counted in used_bytes, and logged (WARNING, the first ten by key and a
  // summary with their bytes). Never deleted by this: an Open with a capacity that holds them
  // restores them, and a put of the same chunk replaces the record.
  uint64_t over_capacity_records() const;
  // 1 when Open found the write-ahead logs damaged (a flipped byte, a bad length inside a log;
  // not the torn last record a crash leaves, which is the normal end of a log and opens
  // silently), else 0. Open first replays the logs tolerating only a torn tail; when RocksDB
  // reports damage it replays them up to the first damaged record and drops what follows
  // (point-in-time recovery), logging ERROR "damaged write-ahead log record" with RocksDB's status.
  // Everything written before the damage is served.
  uint64_t wal_corruptions() const;
  // The database's state (see DiskHealthReport). Thread-safe.
  DiskHealthReport Health() const;
  // Health().writes_stopped, cheaply.
  bool writes_stopped() const override;
  // Flushes memtables to SST files (tests, clean shutdown with use_wal=false).
  Status Flush();

  // Daemon state stored next to the chunks (the "state" family), keyed by a non-empty name.
  // PutState replaces the value; it is written with the WAL and synced whatever use_wal and
  // sync_writes say, so it is durable once PutState returns OK. State bytes count against no
  // capacity and are never evicted. Errors: INVALID_ARGUMENT (empty name), UNAVAILABLE (write).
  Status PutState(std::string_view name, std::span<const uint8_t> bytes);
  // NOT_FOUND when `name` was never put; DATA_LOSS when the stored bytes fail their checksum
  // (or the record is shorter than its checksum); UNAVAILABLE on a read error.
  StatusOr<std::vector<uint8_t>> GetState(std::string_view name) const;
  // Deletes the record (OK when there is none), durable like PutState. UNAVAILABLE on a write
  // error.
  Status RemoveState(std::string_view name);

 private:
  class Impl;
  friend struct DiskTierInternals;  // fault injection for tests (storage/src, not installed)
  explicit DiskTier(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvd::storage
