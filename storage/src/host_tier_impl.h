// Private state of HostTier (see host_tier.h for the contract). Split across host_tier.cc (the
// write and read protocols), host_tier_impl.cc (the Impl's helpers) and host_tier_admin.cc
// (Tier interface, listing, eviction, stats).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvd/storage/host_tier.h"
#include "segment_holds.h"

namespace kvd::storage {

// A committed chunk in the arena.
struct HostEntry {
  ChunkMeta meta;
  uint64_t offset = 0;       // arena offset
  uint64_t arena_bytes = 0;  // arena block size (meta.size_bytes rounded up)
  uint32_t pins = 0;         // leases + reads holding it
  uint32_t lease_pins = 0;   // of `pins`, the leases (its namespace's pinned_bytes quota)
  // false once evicted (Evict/Remove) while pinned: out of the index and LRU, freed at the last
  // unpin. A hidden entry is owned by HostTier::Impl::hidden_.
  bool visible = true;
  // false while a lower tier's copy is being written (Durability::kPending): no dedup at Reserve.
  bool durable = true;
  // Served through (HostTier::InsertTransient): dropped at its last unpin, never offered for
  // demotion. Cleared when another writer stores the key (a Reserve or Commit that dedups on it).
  bool transient = false;
  std::list<HostEntry*>::iterator lru_it;  // valid iff visible
};

// The deadline `ttl` after `now` (Clock nanoseconds).
inline int64_t Deadline(int64_t now, std::chrono::milliseconds ttl) {
  return now + std::chrono::duration_cast<std::chrono::nanoseconds>(ttl).count();
}

// The three kinds of ids (one id space).
enum class IdKind : uint8_t { kReservation, kLease, kRead };
const char* IdKindName(IdKind kind);

// Why an id stopped being live (remembered so late use gets a precise error).
enum class RetireReason : uint8_t {
  kCommitted,
  kAborted,
  kExpired,
  kReclaimed,
  kDataLoss,
  kDedup,
  kReleased,
};

class HostTier::Impl {
 public:
  Impl(const HostTierOptions& options, std::byte* base, uint64_t capacity, Clock* clock,
       SegmentListener* listener);

  struct OpenReservation {
    ChunkKey key;
    uint64_t offset = 0;
    uint64_t size_bytes = 0;
    uint64_t arena_bytes = 0;
    uint32_t tokens = 0;
    OwnerId owner = 0;
    int64_t deadline_ns = 0;
    // Made by ReserveAhead: `key.hash` and `tokens` mean nothing until NameReservation.
    bool ahead = false;
    bool named = true;
    bool transient = false;   // made by InsertTransient: the entry it commits is transient
    bool committing = false;  // a Commit is verifying the bytes without the lock
    // Set when Abort / ReclaimOwner hit a committing reservation: that Commit then fails.
    bool cancelled = false;
    RetireReason cancel_reason = RetireReason::kAborted;
  };
  struct LeaseState {
    OwnerId owner = 0;
    int64_t deadline_ns = 0;
    std::vector<HostEntry*> entries;  // distinct, each pinned once by this lease
    std::string name_space;           // whose leases quota it counts in
  };
  // NOT_FOUND for a lease that `caller` does not own (kAnyOwner: no check).
  Status CheckLeaseOwnerLocked(LeaseId id, const LeaseState& lease, OwnerId caller) const;
  struct ReadState {
    OwnerId owner = 0;
    int64_t deadline_ns = 0;
    HostEntry* entry = nullptr;  // pinned once by this read
  };

  // ---- helpers; all REQUIRE mu_ held ----
  // A fresh id from the kernel's CSPRNG (getrandom), never 0 and never one live or remembered as
  // retired: ids cannot be guessed from one another.
  uint64_t NextIdLocked();
  void RetireLocked(uint64_t id, IdKind kind, RetireReason reason);
  // The error for a use of `id`, expected to be of `kind`, that is not live.
  Status UnknownIdLocked(IdKind kind, uint64_t id) const;
  void PinLocked(HostEntry* e);
  void UnpinLocked(HostEntry* e);
  void TouchLocked(HostEntry* e, int64_t now);
  // Removes a visible entry from index, LRU and accounting; frees it now if unpinned, otherwise
  // moves it to hidden_. Returns true if freed now. Tells the event listener why (`reason`).
  bool DropEntryLocked(HostEntry* e, RemoveReason reason);
  // Tells the event listener (if any) about `meta`.
  void EmitLocked(ChunkEventKind kind, RemoveReason reason, const ChunkMeta& meta) const {
    if (events_ != nullptr) {
      events_->OnChunkEvent(MakeChunkEvent(kind, reason, TierKind::kHost, meta));
    }
  }
  void DropReservationLocked(ReservationId id, RetireReason reason);
  void ReleaseLeaseLocked(LeaseId id, RetireReason reason);
  void ReleaseReadLocked(ReadId id, RetireReason reason);
  // Evicts LRU unpinned chunks until `bytes` can be allocated for namespace `ns` (segmented: the
  // namespace's own chunks first, they free room in its segments). RESOURCE_EXHAUSTED if
  // impossible.
  Status MakeRoomLocked(uint64_t bytes, const std::string& ns);
  // Returns a block to the arena (a segment left empty stays free, see SegmentedArena).
  void FreeBlockLocked(uint64_t offset);
  // With a stored_bytes quota, evicts the namespace's own LRU unpinned chunks until `bytes` more
  // fit under it; RESOURCE_EXHAUSTED (Reason::kQuotaExceeded) naming the namespace and quota if
  // they cannot. Before that, RESOURCE_EXHAUSTED (Reason::kQuotaExceeded) if `bytes` more reserved
  // would exceed its reserved_bytes quota.
  Status EnforceQuotaLocked(const std::string& ns, uint64_t bytes);
  // RESOURCE_EXHAUSTED (Reason::kQuotaExceeded) if a new lease pinning `entries` would exceed the
  // namespace's leases or pinned_bytes quota.
  Status CheckLeaseQuotaLocked(const std::string& ns, const std::vector<HostEntry*>& entries) const;
  // Segmented arena, a reserved_bytes quota: RESOURCE_EXHAUSTED (Reason::kQuotaExceeded) if a
  // reservation in `segment` would make the namespace hold more segments with reservations than the
  // quota allows (its bytes / segment_bytes, at least one).
  Status CheckReservedSegmentsLocked(const std::string& ns, uint32_t segment) const;
  // How many whole segments a quota of `limit` bytes allows (at least one).
  uint32_t SegmentsAllowed(uint64_t limit) const;
  // A lease's pin of `e` (counts its bytes in the namespace's pinned bytes at the first one).
  void LeasePinLocked(HostEntry* e);
  void LeaseUnpinLocked(HostEntry* e);
  void ReleaseNamespaceReservationLocked(const std::string& ns, uint64_t bytes);
  std::string OccupancyLocked() const;
  void AccountLocked(const ChunkMeta& m, bool add);
  StatusOr<ReadView> StartReadLocked(HostEntry* e, OwnerId owner, int64_t now);
  // ReserveLocked's steps. CheckFitsArenaLocked: INVALID_ARGUMENT when `bytes` exceed one
  // arena segment, RESOURCE_EXHAUSTED when they exceed the whole capacity.
  // CheckAheadHeadroomLocked: ReserveAhead's headroom rule (kReserveAheadMaxShare of the
  // capacity, and of the namespace's quota). AllocateLocked: the quota, room, a placement and
  // the block for `bytes` of key.name_space; its offset, and its segment in *segment.
  Status CheckFitsArenaLocked(uint64_t bytes) const;
  Status CheckAheadHeadroomLocked(const ChunkKey& key, uint64_t bytes) const;
  StatusOr<uint64_t> AllocateLocked(const ChunkKey& key, uint64_t bytes, uint32_t* segment);
  // CommitPinned's steps. BeginCommitLocked: marks reservation `id` committing and returns its
  // bytes (NOT_FOUND when not live or expired, FAILED_PRECONDITION when unnamed or committing).
  // ChecksumMismatchLocked: drops reservation `id`, whose bytes hash to `actual`, not
  // `expected`; the DATA_LOSS to return. StoreCommittedLocked: the committing reservation's chunk
  // as a new entry (the reservation retired as committed).
  StatusOr<std::span<const std::byte>> BeginCommitLocked(ReservationId id);
  Status ChecksumMismatchLocked(ReservationId id, uint64_t expected, uint64_t actual);
  HostEntry* StoreCommittedLocked(ReservationId id, uint64_t checksum, int64_t now, bool durable);
  // Reserve / ReserveAhead (`ahead`: no dedup check, the headroom rule, unnamed).
  StatusOr<Reservation> ReserveLocked(const ChunkKey& key, uint64_t bytes, uint32_t tokens,
                                      OwnerId owner, std::chrono::milliseconds ttl, int64_t now,
                                      bool ahead);

  const HostTierOptions options_;
  std::byte* const base_;
  const uint64_t capacity_;
  Clock* const clock_;
  SegmentListener* const listener_;
  ChunkEventListener* events_ = nullptr;  // set before concurrent use (SetEventListener)

  mutable std::mutex mu_;
  // Everything below is guarded by mu_.
  SegmentedArena arena_;
  std::unordered_map<ChunkKey, std::unique_ptr<HostEntry>, ChunkKeyHasher> index_;  // visible
  std::unordered_map<HostEntry*, std::unique_ptr<HostEntry>> hidden_;  // evicted while pinned
  std::list<HostEntry*> lru_;  // visible entries, most recently used first
  std::unordered_map<ReservationId, OpenReservation> reservations_;
  std::unordered_map<LeaseId, LeaseState> leases_;
  std::unordered_map<OwnerId, uint32_t> leases_per_owner_;  // open leases by owner (owner != 0)
  std::unordered_map<ReadId, ReadState> reads_;
  struct Retired {
    IdKind kind;
    RetireReason reason;
  };
  std::unordered_map<uint64_t, Retired> retired_;  // bounded by options_.retired_id_memory
  std::deque<uint64_t> retired_order_;             // FIFO of retired_ keys
  // One id space for reservations, leases and reads; random bits are drawn in batches.
  uint64_t random_ids_[64] = {};
  size_t random_left_ = 0;

  // Accounting (payload bytes unless named arena_).
  uint64_t used_bytes_ = 0;          // visible entries
  uint64_t reserved_bytes_ = 0;      // open reservations
  uint64_t pinned_bytes_ = 0;        // visible entries with pins > 0
  uint64_t used_arena_bytes_ = 0;    // visible entries' arena blocks
  uint64_t pinned_arena_bytes_ = 0;  // visible pinned entries' arena blocks
  uint64_t reserved_arena_bytes_ = 0;
  uint64_t hidden_arena_bytes_ = 0;
  std::unordered_map<std::string, UsageStats> per_model_;
  std::unordered_map<std::string, UsageStats> per_namespace_;
  std::unordered_map<std::string, uint64_t> ns_reserved_;  // open reservations' payload bytes
  std::unordered_map<std::string, uint64_t> ns_pinned_;    // bytes of entries with lease_pins
  std::unordered_map<std::string, uint32_t> ns_leases_;    // open leases
  SegmentHolds pinned_segments_;                           // segments with a lease-pinned entry
  SegmentHolds reserved_segments_;                         // segments with an open reservation
  TierStats counters_;                                     // only the counter fields are used
};

}  // namespace kvd::storage
