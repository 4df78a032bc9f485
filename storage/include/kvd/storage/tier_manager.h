// TierManager: THE store path of committed chunks, and placement across an ordered list of tiers.
//
// Tiers: the manager is given its tiers fastest first (the daemon: GPU, host, disk, each when
// configured). Exactly one serves in place (Tier::serves_in_place: the HostTier, "host" below);
// what the manager does with every other tier follows from its place relative to host and from
// its capability queries (tier.h), never from its type:
// - a tier ABOVE host (the GPU tier) is a cache that chunks produced in the daemon land in first,
//   moved down to host under pressure and copied up on a hit;
// - a tier BELOW host is where host demotes to under pressure and promotes from on a hit; a
//   durable one (Tier::durable: the disk tier) also gets every committed chunk written through.
// A durable tier above host is refused. Below, "disk tier" reads "durable tiers" and "GPU tier"
// "tiers above host"; with several, each is written / probed in list order.
//
// Store contract (every store of a committed chunk goes through here):
// - Commit(reservation, checksum): commit of a host reservation (bytes written in place by the
//   caller or a peer). Insert(key, ...): a chunk produced inside the daemon (e.g. a compact chunk
//   made by the ingest pipeline), copied in.
// - Durability: with a disk tier, OK means the chunk was written to RocksDB (write-ahead log on)
//   BEFORE the call returned: an acknowledgement sent after OK survives host-tier pressure and a
//   kill -9 of the process (not a power loss unless DiskTierOptions::sync_writes). If the disk
//   write fails the call fails (UNAVAILABLE naming the key) and the chunk is not acknowledged.
//   While the disk tier's writes are stopped by a RocksDB background error
//   (Tier::writes_stopped), options.on_disk_error decides: kKeepInHost (default) makes OK
//   mean published in host memory only, as without a disk tier, and MaybeDemote drops nothing;
//   kFailPuts keeps the failure.
//   Without a disk tier, OK means published in host memory; under pressure the host tier then
//   evicts least-recently-used unpinned committed chunks (the documented policy).
// - No silent loss under pressure: with a disk tier every committed chunk in host memory has a
//   disk copy by the time its Commit/Insert returns (a chunk is pinned in host while its disk
//   write runs, so a concurrent Reserve cannot evict it), so the host tier's LRU eviction for a
//   reservation only ever drops copies. The disk tier's own capacity (DiskTierOptions::
//   capacity_bytes) bounds what is kept: above it the disk tier evicts its least-recently-used
//   chunks (documented policy, counted in its evictions).
// - Dedup: a key already stored returns ALREADY_EXISTS with Reason::kDedup (IsDedup); with a disk
//   tier the stored chunk is copied to disk first if it has no disk copy yet. A dedup is as
//   durable as an OK: while the first writer's disk write of a chunk is in progress, the chunk is
//   served but a host Reserve of its key is not a dedup (Durability::kPending), and a second
//   writer's Commit waits for that write (writing the chunk itself if it fails) before it returns.
//
// Placement:
// - MaybeDemote(): when the host tier's occupancy is above high_watermark, moves its
//   least-recently-used unpinned chunks to the first tier below host (copying any it lacks
//   first) until occupancy is at or below low_watermark, keeping room free for reservations.
//   The daemon calls it from a timer and after commits. Without a tier below host it does
//   nothing.
// - Lookup(): the host tier's Lookup, after promoting into host the chunks of the requested
//   prefix that are only in a tier below (when promote_on_hit), so the result and its lease cover
//   every tier. A chunk whose lower copy is corrupt stops the prefix there (it is dropped by the
//   disk tier, counted in its checksum_failures, logged) and is counted in promote_failures().
// - List / Evict / stats span every tier; List and Evict count a chunk once however many
//   tiers hold a copy of it.
//
// GPU tier (optional, above host; a node with a GPU and tiers.gpu in its topology):
// - Insert puts a chunk produced in the daemon (compact chunks) into the GPU tier (plus the disk
//   write-through above, when there is a disk tier), not into host. A GPU tier without room
//   first moves its least-recently-used chunks down to host (copy to host, then drop from the
//   GPU: never a drop without a copy); if it still cannot take the chunk (or its device fails),
//   the chunk takes the host path instead. A chunk the GPU tier can never hold (larger than its
//   capacity or max_chunk_bytes: Tier::CanEverHold) takes the host path at once, demoting
//   nothing, and is counted in gpu_skipped(). A key already in host is a dedup, as before.
// - Lookup: a chunk of the prefix that is only in the GPU tier is copied into host (the serve
//   path reads host memory) and stays in the GPU, most recently used; with promote_on_hit a host
//   hit is also copied up into the tier right above host when it has room now (no demotion).
// - PromoteFromDevice: a committed chunk whose bytes are also in device memory (a put that
//   arrived over NCCL) is copied device to device into the GPU tier (the tier above host whose
//   kind() is kGpu) when it has room now, the same eager copy up as a host hit's, without the
//   host round trip.
// - MaybeDemote first moves GPU chunks down to host while the GPU tier is above high_watermark
//   (to low_watermark), then runs the host pass.
//
// Thread safety: thread-safe (the tiers are). Demotion passes are serialized by demote_mu_;
// lookups and commits may run concurrently with a demotion: a chunk is on disk BEFORE it is
// removed from host, so a concurrent lookup finds it in at least one tier.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "kvd/common/log_limiter.h"
#include "kvd/common/status.h"
#include "kvd/storage/disk_tier.h"
#include "kvd/storage/gpu_tier.h"
#include "kvd/storage/host_tier.h"
#include "kvd/storage/options.h"

namespace kvd::storage {

struct DemoteResult {
  uint64_t demoted_to_host = 0;  // chunks copied from the tiers above host to host, dropped there
  uint64_t demoted = 0;          // chunks copied to the tier below host and dropped from host
  uint64_t bytes = 0;            // their payload bytes
  uint64_t skipped = 0;          // chunks that became pinned or vanished meanwhile
  uint64_t corrupt_dropped = 0;  // host copies whose bytes no longer matched their checksum
  double occupancy_before = 0.0;
  double occupancy_after = 0.0;
};

class TierManager {
 public:
  // `tiers` fastest first (see the file comment); none is owned, all outlive this.
  // Errors: INVALID_ARGUMENT (options.Validate(), a null or repeated tier, not exactly one tier
  // that serves in place, a serving tier that is not a HostTier, a durable tier above it).
  static StatusOr<std::unique_ptr<TierManager>> Create(const TierManagerOptions& options,
                                                       std::vector<Tier*> tiers);

  // Commit of host reservation `id` (HostTier::Commit's errors), then, with a disk tier, the
  // durable disk write (UNAVAILABLE / RESOURCE_EXHAUSTED from the disk tier, with context; the
  // chunk is then removed from host again unless a reader pinned it meanwhile). `check` as for
  // HostTier::Commit, except that with a disk tier the bytes are always verified: the write
  // through copies them out of host memory, where they are checked.
  Status Commit(ReservationId id, uint64_t checksum, CommitCheck check = CommitCheck::kVerify);

  // Stores a chunk produced in the daemon (Tier::Insert's contract and errors). With a disk
  // tier the disk copy is written first, then the host copy; a host tier too full to take it
  // (everything pinned) still leaves it stored on disk (OK).
  Status Insert(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                std::span<const std::byte> bytes);

  // After Commit: copies the committed chunk `key` from `device_src` (`bytes` in device memory
  // of the GPU tier's device, equal to the committed bytes, whose Checksum64 is `checksum`, as
  // verified by the commit) into the GPU tier, when it has room now (no demotion for it). Best
  // effort, like a host hit's promotion: the host copy stays either way. OK when copied;
  // FAILED_PRECONDITION (no GPU tier), ALREADY_EXISTS (the GPU holds it), RESOURCE_EXHAUSTED (no
  // room now) or the copy's error otherwise, for the caller's log.
  Status PromoteFromDevice(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                           const void* device_src, uint64_t bytes);

  // See the file comment. Errors are the host tier's Lookup errors; promotion failures (no room
  // in host, corrupt disk copy) shorten the match instead of failing the lookup.
  StatusOr<LookupResult> Lookup(const LookupRequest& request);

  // One demotion pass (see the file comment). UNAVAILABLE if a disk write fails (what was
  // demoted before stays demoted). A host copy about to be written to disk is verified first
  // against its commit checksum: one that changed after its commit (a stray write through a
  // shared-memory mapping, a memory fault) is dropped from host (a miss from then on), logged
  // and counted in host_corrupt_dropped(), and the pass goes on.
  StatusOr<DemoteResult> MaybeDemote();

  // Matching chunks of every tier, each chunk ONCE (a chunk with copies in two tiers is listed
  // as its highest tier's copy, in list order: GPU, then host, then disk), up to `limit`
  // distinct chunks (0 = no limit).
  std::vector<ChunkMeta> List(const ChunkFilter& filter, size_t limit) const;
  // Every copy of every matching chunk, per tier (a chunk in host and on disk is listed twice,
  // each with its `tier`), in list order: what the tiers' chunk events have announced as stored
  // and not removed.
  std::vector<ChunkMeta> ListCopies(const ChunkFilter& filter) const;
  // Evicts matching chunks from every tier (the tiers other than host from the bottom of the
  // list up, then host, so that a concurrent lookup cannot copy a chunk back up meanwhile). Counted
  // per chunk, not per copy: `deferred` = chunks with a copy pinned by a lease or read (hidden now,
  // freed at the last unpin), `evicted` and `bytes` = the other chunks removed (their payload bytes
  // once).
  EvictResult Evict(const ChunkFilter& filter);
  // One per tier, in list order (GPU, host, disk for the daemon's tiers).
  std::vector<TierStats> GetStats() const;

  // Sets the chunk event listener of every tier (chunk_events.h; not owned, null = nobody):
  // the listener hears "stored" / "removed" per tier, so a chunk demoted from host to disk is
  // "stored" in disk, then "removed" (moved) from host. Call before concurrent use.
  void SetEventListener(ChunkEventListener* listener);

  uint64_t promotions() const;
  uint64_t demotions() const;
  // Promotions into host that failed (corrupt lower copy, read error, no room in host).
  uint64_t promote_failures() const;
  // Of promote_failures(), those that were not a lack of room in host: a corrupt or unreadable
  // copy in the lower tier (damage, not load).
  uint64_t promote_errors() const;
  // The host copy `view` pins is about to leave host memory for `destination` (a word for the
  // log: "disk", "gpu", "transport", "nccl"): true when its bytes still match its commit checksum.
  // Otherwise releases the pin, drops the host copy (hidden now if someone else pins it, freed
  // at the last unpin), logs one line and counts it in host_corrupt_dropped(). Thread-safe.
  bool VerifyLeavingHost(const ReadView& view, const char* destination);

  // Inserts that skipped a tier above host because it can never hold the chunk (see the file
  // comment).
  uint64_t gpu_skipped() const;
  // Host copies found changed after their commit when they were about to leave host memory
  // (demotion to disk, a copy up into the GPU tier) and dropped instead (never written on).
  uint64_t host_corrupt_dropped() const;

  // The serving tier, and the first DiskTier / GpuTier of the list (null when there is none),
  // for callers that use what only those classes offer.
  HostTier* host() const { return host_; }
  DiskTier* disk() const { return disk_; }
  GpuTier* gpu() const { return gpu_; }

 private:
  TierManager(const TierManagerOptions& options, std::vector<Tier*> tiers, size_t serving);
  // Copies `key` from `from` (a tier above or below) into host. REQUIRES: `from` holds it (else
  // NOT_FOUND).
  Status PromoteToHost(Tier& from, const ChunkKey& key);
  // Insert into `above` (a tier above host), first moving its LRU chunks to host until it fits.
  Status InsertAbove(Tier& above, const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                     std::span<const std::byte> bytes);
  // Writes the chunk to every durable tier (skipping those that hold it when `only_missing`).
  // OK when each stored it (the dedup status when each held it already), else the first failure;
  // a failure KeepInHost allows sets *host_only and is passed over.
  Status WriteThrough(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                      std::span<const std::byte> bytes, bool only_missing, bool* host_only);
  // Whether a failed write of a put to durable tier `tier` leaves the put acknowledged in host
  // only: the tier's writes are stopped and options_.on_disk_error says kKeepInHost.
  bool KeepInHost(const Tier& tier, const Status& write) const;
  // Moves one chunk of `above` to host (copy, then drop from `above`). OK if moved; else why not.
  Status DemoteToHost(Tier& above, const ChunkMeta& meta);
  // The tier a lookup copies `key` into host from: the first tier above host that holds it
  // (Touch), else, with promote_on_hit, the first below. Null when none does.
  Tier* FindForLookup(const ChunkKey& key);
  // The host pass of MaybeDemote into `below`.
  Status DemoteHost(Tier& below, DemoteResult& out);

  const TierManagerOptions options_;
  const std::vector<Tier*> tiers_;  // fastest first
  HostTier* const host_;            // tiers_[serving]
  const std::vector<Tier*> above_;  // the tiers before host, in list order
  const std::vector<Tier*> below_;  // the tiers after host, in list order
  std::vector<Tier*> durable_;      // of below_, the durable ones (set once, by the constructor)
  DiskTier* disk_ = nullptr;        // set once, by the constructor
  GpuTier* gpu_ = nullptr;          // set once, by the constructor
  std::mutex demote_mu_;            // serializes MaybeDemote passes; guards nothing else
  mutable std::mutex counters_mu_;
  uint64_t promotions_ = 0;            // guarded by counters_mu_
  uint64_t demotions_ = 0;             // guarded by counters_mu_
  uint64_t promote_failures_ = 0;      // guarded by counters_mu_
  uint64_t promote_errors_ = 0;        // guarded by counters_mu_
  uint64_t gpu_skipped_ = 0;           // guarded by counters_mu_
  uint64_t host_corrupt_dropped_ = 0;  // guarded by counters_mu_

  LogLimiter corrupt_log_{std::chrono::minutes(1)};  // the VerifyLeavingHost warning
};

}  // namespace kvd::storage
