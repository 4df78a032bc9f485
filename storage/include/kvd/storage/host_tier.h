// HostTier: the host-memory tier. Chunks live in ONE caller-provided region (an arena); the tier
// is the chunk index for that memory, with LRU eviction, two-phase writes and read leases.
//
// Write protocol (docs/architecture.md "Writes and reads"):
//   Reserve(key, bytes, ...) -> Reservation {id, offset, data}: space is taken, the chunk is
//       INVISIBLE (Lookup/Get do not see it). The bytes are written at `data` (by memcpy or by a
//       remote peer's RMA into the region at `offset`).
//   Commit(id, checksum): Checksum64 of the bytes in place must equal `checksum`; then the chunk
//       is published. Mismatch -> DATA_LOSS, the reservation is dropped and its space returned.
//   Abort(id), ReclaimOwner(owner) (a client disconnected), ExpireReservations() (TTL, driven by
//       the kvd::Clock) return the space of reservations that will never be committed.
// Read protocol:
//   Lookup(chain) -> number of leading chunks present + a lease pinning exactly those chunks
//       until ReleaseLease or lease TTL. A pinned chunk is NEVER evicted.
//   Get(lease, i) -> ReadView {pointer, offset, size, checksum}: the bytes stay valid and the chunk
//       pinned until ReleaseRead(read_id) (or read TTL / ReclaimOwner), even if the lease ends.
//
// Arena and segments (see arena.h, ARENA OWNERSHIP): the tier owns the allocation policy over the
// region it is given; the region's owner chooses the memory. With options.segment_bytes set, the
// region is cut into segments, each holding chunks of one namespace only. A segment whose last
// block is freed stays free, remembering the namespace that used it; a namespace that needs a
// free segment takes one it used last, else one never used, else one another namespace used
// last, and only then, before the segment is assigned, SegmentListener::OnSegmentHandover lets
// the owner replace its memory (the daemon swaps in a fresh memfd, so a client that mapped the
// segment for the old namespace can never see what the new one stores there, nor the new one
// the old one's bytes). A namespace taking back its own segment keeps its memory: no system
// call, and its clients' mappings stay valid.
//
// Eviction: when Reserve finds no free block large enough, it removes committed, unpinned chunks
// in least-recently-used order (a Lookup hit or a Get makes a chunk most recent) until the
// allocation fits. If even evicting everything unpinned cannot make room, Reserve fails with
// RESOURCE_EXHAUSTED naming capacity, used, reserved and pinned bytes, and evicts nothing.
//
// Ids: reservation, lease and read ids are drawn from the kernel's CSPRNG (getrandom), 63 bits,
// never 0 (0 means "none"), never equal to a live or remembered id: one client cannot guess
// another's. A lease belongs to the owner that took it: Get / ReleaseLease by another caller get
// NOT_FOUND, exactly as for an id never issued.
// An id that was retired (committed, aborted, expired, reclaimed) is remembered for a while
// (HostTierOptions::retired_id_memory) so its late use gets ABORTED with the reason; an id never
// issued (or long forgotten) gets NOT_FOUND.
//
// Thread safety: thread-safe. Every method may be called from any thread (the daemon calls from
// its Asio thread and its UCX progress thread). One mutex (Impl::mu_) guards the index, the LRU
// list, the arena allocator, reservations, leases, reads and counters; it is never held while
// checksumming or copying chunk bytes, and no method calls out to user code while holding it.
// Bytes of a reservation are written by the caller without any lock (only the reservation's owner
// writes them); bytes of a committed chunk never change until it is freed, which cannot happen
// while it is pinned.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvd/common/clock.h"
#include "kvd/common/hash.h"
#include "kvd/common/status.h"
#include "kvd/storage/arena.h"
#include "kvd/storage/chunk.h"
#include "kvd/storage/options.h"
#include "kvd/storage/stats.h"
#include "kvd/storage/tier.h"

namespace kvd::storage {

using OwnerId = uint64_t;        // a client / connection; 0 = no owner (never reclaimed by owner)
using ReservationId = uint64_t;  // 0 = none
using LeaseId = uint64_t;        // 0 = none (nothing matched)
using ReadId = uint64_t;         // 0 = none
// "Any caller": the ownership check of Get / ReleaseLease is skipped (in-process users).
inline constexpr OwnerId kAnyOwner = ~uint64_t{0};

// What Commit checks of the reserved bytes against the writer's checksum.
// How durable a committed chunk is when Commit publishes it.
enum class Durability {
  // As durable as the host tier makes it (published in memory). A Reserve of its key is the
  // dedup ALREADY_EXISTS: the writer may skip sending the bytes.
  kDurable,
  // Served at once, but a copy in a lower tier is still being written (the TierManager's
  // write-through to disk): until MarkDurable, a Reserve of its key reserves as for a new chunk,
  // so no second writer is told "already stored" before the chunk is as durable as promised.
  kPending,
};

enum class CommitCheck {
  // Checksum64 of the bytes must equal the checksum (one read of the whole chunk, without the
  // tier's lock); DATA_LOSS otherwise, nothing stored.
  kVerify,
  // The checksum is recorded as given, the bytes are not read: for a writer that computed it
  // over the bytes it wrote itself. kvd has two: the same-node shared-memory put (the client
  // hashes what it copies into the slot), and the daemon's receive of a transport put whose
  // transport copied the bytes into the slot itself, hashing each block as it landed, when that
  // checksum equals the one the client sent (otherwise the daemon commits with kVerify). The
  // bytes are still checked against it by every reader and wherever they leave host memory
  // (TierManager's demotion and GPU promotion, the daemon's transport send), so a wrong
  // checksum makes the chunk unreadable (DATA_LOSS), never served with other bytes.
  kTrustWriter,
};

// Where to write a reserved chunk. `data` == region base + `offset`; valid (and exclusively the
// reserver's to write) until Commit, Abort, expiry or ReclaimOwner.
struct Reservation {
  ReservationId id = 0;
  uint64_t offset = 0;  // byte offset inside the region given to HostTier::Create
  std::byte* data = nullptr;
  uint64_t size_bytes = 0;  // exactly the bytes asked for (the arena block may be larger)
  int64_t deadline_ns = 0;  // kvd::Clock time after which the reservation expires
};

struct LookupRequest {
  std::string name_space;
  std::string model;
  uint64_t layout_digest = 0;
  uint32_t codec_id = kRawCodecId;
  // Chain hash of the LAST block of each successive chunk of the prompt, in prompt order.
  std::vector<Hash128> chunk_hashes;
  OwnerId owner = 0;  // the lease's owner (ReclaimOwner releases it)
  // Lease TTL; 0 means HostTierOptions::lease_ttl.
  std::chrono::milliseconds lease_ttl{0};

  ChunkKey KeyAt(size_t i) const {
    return ChunkKey{name_space, model, layout_digest, codec_id, chunk_hashes[i]};
  }
};

// How many leading hashes of `hashes` are distinct (the length before the first repeat).
size_t DistinctPrefix(std::span<const Hash128> hashes);

struct LookupResult {
  size_t matched_chunks = 0;    // leading chunks of the request that are stored and now pinned
  uint64_t matched_tokens = 0;  // sum of their tokens
  LeaseId lease_id = 0;         // 0 iff matched_chunks == 0 (no lease is created for a miss)
  int64_t lease_deadline_ns = 0;
  std::vector<ChunkMeta> chunks;  // metadata of the matched chunks, in order
  // TierManager::Lookup only: per matched chunk, the tier it was found in (host, or the tier it
  // was copied into host from by this lookup). Empty from HostTier::Lookup.
  std::vector<TierKind> found_in;
};

// A pinned, read-only view of a committed chunk. `data` stays valid until ReleaseRead(read_id).
struct ReadView {
  ReadId read_id = 0;
  ChunkMeta meta;       // key, tokens, size_bytes, checksum
  uint64_t offset = 0;  // byte offset inside the region (for RMA by a peer)
  const std::byte* data = nullptr;
};

// What ReclaimOwner / expiry removed.
struct ReclaimResult {
  uint64_t reservations = 0;
  uint64_t leases = 0;
  uint64_t reads = 0;
};

// The region owner's part in the segments' isolation (segmented arenas only).
class SegmentListener {
 public:
  virtual ~SegmentListener() = default;
  // Segment `segment` is free (no chunk, reservation or read lives in it) and is about to pass
  // to a namespace other than the one that held blocks in it last (HostTier::SegmentLastOwner).
  // The owner must make the memory behind it fresh now: whoever maps the segment from here on
  // must not find the old namespace's bytes, and whoever mapped it before must not find the new
  // namespace's (the daemon swaps in another memfd). Never called for a segment never used, nor
  // for one taken back by the namespace that used it last (its memory is kept).
  // Called by Reserve with the tier's lock held, before the segment is assigned and before the
  // reservation exists (nothing can be written or mapped there until it returns): it must be
  // quick (a few system calls; the daemon keeps a prepared spare) and must not call the tier.
  // An error fails that Reserve with it (nothing is reserved; the segment stays free, still
  // remembering its old namespace).
  virtual Status OnSegmentHandover(uint32_t segment) = 0;
};

class HostTier final : public Tier {
 public:
  // Creates a tier over `region` (not owned; must outlive the tier; start aligned to
  // options.alignment). `clock` (not owned; nullptr = Clock::Real()) drives every TTL.
  // `listener` (not owned; may be null) hears of segments becoming free (segmented arenas only).
  // Errors: INVALID_ARGUMENT (options.Validate(), misaligned region, capacity > region size,
  //   region smaller than one alignment unit).
  static StatusOr<std::unique_ptr<HostTier>> Create(const HostTierOptions& options,
                                                    std::span<std::byte> region,
                                                    Clock* clock = nullptr,
                                                    SegmentListener* listener = nullptr);
  ~HostTier() override;
  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  // ---- writes ----

  // Takes `bytes` of arena space for `key`, evicting LRU unpinned chunks if needed.
  // `tokens` is recorded in the chunk's metadata. `ttl` 0 means options.reservation_ttl.
  // Several reservations of the same key may be open at once (the first commit wins).
  // The writer MUST be done writing (a posted receive completed or cancelled) before the
  // deadline: once expired or reclaimed, the space may at once be given to another reservation,
  // and a late write would corrupt that one. Pick `ttl` well above the transfer timeout.
  // Errors: ALREADY_EXISTS with Reason::kDedup (key already committed and durable, see Durability;
  //   nothing reserved),
  //   INVALID_ARGUMENT (bytes == 0 or > max_chunk_bytes, empty model),
  //   INVALID_ARGUMENT also when bytes exceed one segment (segmented arenas),
  //   RESOURCE_EXHAUSTED (cannot fit even after evicting every unpinned chunk; message names
  //   capacity, used, reserved and pinned bytes), RESOURCE_EXHAUSTED with Reason::kQuotaExceeded
  //   (over the namespace's options.quotas reserved_bytes, or stored_bytes after evicting its own
  //   unpinned chunks; message names the namespace and the limit), or the SegmentListener's error
  //   when the block needs a segment handed over from another namespace and its memory could not be
  //   replaced.
  StatusOr<Reservation> Reserve(const ChunkKey& key, uint64_t bytes, uint32_t tokens, OwnerId owner,
                                std::chrono::milliseconds ttl = {});

  // ---- reserving ahead: a reservation that does not name its chunk yet ----
  // A writer that puts chunk after chunk may take the space of its NEXT put while committing
  // this one (the daemon's reserve-ahead put, docs/wire-format.md), before that chunk's hash is
  // known. ReserveAhead takes `bytes` for a chunk of key.name_space / key.model / layout / codec
  // like Reserve (same eviction, quota, segments, TTL and owner; key.hash is ignored), with no
  // dedup check: the key is given later by NameReservation, and the dedup check is made at
  // Commit (a chunk already stored is then ALREADY_EXISTS with Reason::kDedup after its bytes were
  // written for nothing). Commit of a reservation not named yet fails (FAILED_PRECONDITION).
  // Headroom: the space is held while the writer is idle, so it is refused, before anything is
  // evicted, when it could make a later Reserve fail: when the space no eviction can free
  // (open reservations, pinned chunks, chunks hidden while pinned) would with it exceed
  // kReserveAheadMaxShare of the capacity, or (with a namespace quota stored_bytes or
  // reserved_bytes) the namespace's open reservations with it would exceed kReserveAheadMaxShare
  // of the smaller of them.
  // Errors: those of Reserve but ALREADY_EXISTS, and RESOURCE_EXHAUSTED "no headroom to reserve
  // ahead: ..." for the refusal above.
  static constexpr double kReserveAheadMaxShare = 0.5;
  StatusOr<Reservation> ReserveAhead(const ChunkKey& key, uint64_t bytes, OwnerId owner,
                                     std::chrono::milliseconds ttl = {});
  // Names the chunk of open reservation `id` made by ReserveAhead: its key and tokens. The
  // reservation's byte count stays (the caller checks the chunk has it). The key's namespace,
  // model, layout digest and codec id must be those reserved (only the hash is new).
  // Errors: NOT_FOUND / ABORTED as for Commit; FAILED_PRECONDITION (not made by ReserveAhead,
  //   already named, or being committed); INVALID_ARGUMENT (the key differs in more than its
  //   hash; tokens == 0).
  Status NameReservation(ReservationId id, const ChunkKey& key, uint32_t tokens);

  // Verifies Checksum64 of the reservation's bytes == `checksum` (with CommitCheck::kVerify;
  // kTrustWriter records `checksum` without reading the bytes) and publishes the chunk.
  // The checksum is computed without holding the tier's lock.
  // Errors: NOT_FOUND (id never issued / forgotten), ABORTED (expired, aborted, reclaimed, or
  //   expired while this commit was verifying; message says which), FAILED_PRECONDITION (already
  //   committed, or a Commit of the same id is in progress), DATA_LOSS (checksum mismatch: the
  //   reservation is dropped and its space returned; message gives both checksums),
  //   ALREADY_EXISTS with Reason::kDedup (another reservation of the key committed first, or a
  //   reservation made ahead named a stored chunk; this one's space is returned, the stored
  //   chunk is unchanged). FAILED_PRECONDITION also for a ReserveAhead not named yet.
  Status Commit(ReservationId id, uint64_t checksum, CommitCheck check = CommitCheck::kVerify);
  // Commit, and on OK also a read (owner 0) pinning the new chunk, returned in `*pinned` under
  // the same lock (so no Reserve can evict it before the caller is done): the TierManager copies
  // it to disk, then calls ReleaseRead(pinned->read_id). Same errors as Commit; on the dedup
  // ALREADY_EXISTS `*pinned` pins the chunk already stored instead; on other errors
  // pinned->read_id stays 0.
  // `durability` as for Durability (kPending: the caller calls MarkDurable once the lower
  // tier's copy is written, or Remove if it failed).
  Status CommitPinned(ReservationId id, uint64_t checksum, ReadView* pinned,
                      CommitCheck check = CommitCheck::kVerify,
                      Durability durability = Durability::kDurable);
  // The chunk `key` committed with Durability::kPending now has its lower-tier copy: from now on
  // a Reserve of its key is the dedup ALREADY_EXISTS. No-op when the key is not stored (removed
  // meanwhile) or already durable.
  void MarkDurable(const ChunkKey& key);

  // Drops an open reservation and returns its space. NOT_FOUND / ABORTED as for Commit.
  // Aborting a reservation whose Commit is verifying makes that Commit return ABORTED.
  Status Abort(ReservationId id);

  // A client went away: drops all its open reservations, leases and reads (pins released).
  ReclaimResult ReclaimOwner(OwnerId owner);

  // Drops every reservation whose deadline is < Clock::NowNanos(). Returns how many.
  uint64_t ExpireReservations();
  // Releases every lease and read whose deadline passed. Late use gets ABORTED.
  ReclaimResult ExpireLeases();

  // ---- reads ----

  // Longest stored prefix of `request.chunk_hashes`; pins the matched chunks under a new lease
  // and makes them most recently used. Counts one lookup, and a hit iff matched_chunks > 0.
  // The prefix also ends before a hash that repeats an earlier one of the request (a chain hash
  // commits to its whole prefix, so a repeat is never a real prompt): a lease holds each chunk
  // once, and its memory is bounded by the distinct chunks stored.
  // Errors: INVALID_ARGUMENT (empty model); RESOURCE_EXHAUSTED with Reason::kQuotaExceeded when the
  // lease would take the namespace over its options.quotas leases or pinned_bytes (nothing pinned
  // then).
  StatusOr<LookupResult> Lookup(const LookupRequest& request);

  // A read view of chunk `index` (0-based, < matched_chunks) of lease `lease`, pinned until
  // ReleaseRead. The read's owner is the lease's owner. Makes the chunk most recently used.
  // `caller` must be the lease's owner (kAnyOwner skips the check).
  // Errors: NOT_FOUND (lease never issued, or owned by another caller), ABORTED (lease released,
  //   expired or reclaimed), OUT_OF_RANGE (index >= matched_chunks).
  StatusOr<ReadView> Get(LeaseId lease, size_t index, OwnerId caller = kAnyOwner);

  // A read view of `key` without a lease (admin reads, tests). NOT_FOUND naming the key.
  StatusOr<ReadView> GetByKey(const ChunkKey& key, OwnerId owner);

  // Ends a read. NOT_FOUND (unknown id), ABORTED (already expired or reclaimed).
  Status ReleaseRead(ReadId read);
  // Ends a lease (its pins go; reads already started keep theirs). NOT_FOUND (also: owned by
  // another caller) / ABORTED.
  Status ReleaseLease(LeaseId lease, OwnerId caller = kAnyOwner);

  // Drops `key` because its bytes no longer match its commit checksum (event reason "corrupt"):
  // freed now, or, when a lease or read pins it, hidden now and freed at its last unpin.
  // NOT_FOUND if it is not stored.
  Status DropCorrupt(const ChunkKey& key);

  // Insert (below), but the chunk is served through, not kept: it is dropped (event reason
  // "evicted") as soon as no lease or read pins it after one has (a chunk never pinned stays
  // until LRU eviction), and LeastRecentlyUsed never offers it for demotion. A key already stored
  // is the dedup ALREADY_EXISTS and stays as it is. Another writer storing the key (a Reserve or
  // Commit that dedups on it) makes it an ordinary chunk. Errors: those of Insert.
  Status InsertTransient(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                         std::span<const std::byte> bytes);

  // ---- Tier ----
  TierKind kind() const override { return TierKind::kHost; }
  bool serves_in_place() const override { return true; }
  Status Insert(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                std::span<const std::byte> bytes) override;
  StatusOr<ChunkMeta> ReadInto(const ChunkKey& key, std::span<std::byte> out) override;
  StatusOr<ChunkMeta> Describe(const ChunkKey& key) const override;
  Status Remove(const ChunkKey& key) override;
  std::vector<ChunkMeta> List(const ChunkFilter& filter, size_t limit) const override;
  EvictResult Evict(const ChunkFilter& filter) override;
  TierStats GetStats() const override;
  void SetEventListener(ChunkEventListener* listener) override;

  // ---- for the TierManager ----

  // Up to `max_chunks` committed, unpinned chunks in least-recently-used order (oldest first).
  std::vector<ChunkMeta> LeastRecentlyUsed(size_t max_chunks) const override;
  // used_bytes + reserved bytes in arena terms (incl. padding) / capacity, in [0, 1].
  double Occupancy() const override;

  ArenaStats GetArenaStats() const;
  // Segments (options.segment_bytes; 0 = one segment spanning the arena). A chunk at region
  // offset `o` lies in segment SegmentOf(o), i.e. [SegmentStart(s), SegmentStart(s) +
  // SegmentSize(s)); SegmentOwner is the namespace the segment holds ("" = free);
  // SegmentLastOwner the one that held blocks in it last ("" = never used).
  uint64_t segment_bytes() const;
  uint32_t segment_count() const;
  uint32_t SegmentOf(uint64_t offset) const;
  uint64_t SegmentStart(uint32_t segment) const;
  uint64_t SegmentSize(uint32_t segment) const;
  std::string SegmentOwner(uint32_t segment) const;
  std::string SegmentLastOwner(uint32_t segment) const;
  std::byte* region_base() const;
  uint64_t capacity_bytes() const;
  const HostTierOptions& options() const;

 private:
  class Impl;
  explicit HostTier(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvd::storage
