// HostTier: construction, the write protocol (reserve / commit / abort / reclaim / expiry) and
// the read protocol (lookup / get / release).
#include "kvd/storage/host_tier.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <string>
#include <unordered_set>
#include <utility>

#include "host_tier_impl.h"

namespace kvd::storage {
namespace {

int64_t Deadline(int64_t now, std::chrono::milliseconds ttl) {
  return now + std::chrono::duration_cast<std::chrono::nanoseconds>(ttl).count();
}

Status DedupStatus(const ChunkKey& key) {
  return storage::DedupStatus("chunk " + key.ToString() + " is already stored; skip sending it");
}

}  // namespace

// A quota counted in whole segments (SegmentHolds).
static Status SegmentQuotaExceeded(const std::string& ns, std::string_view limit, uint64_t value,
                                   uint64_t held_segments, uint64_t more_segments,
                                   uint64_t segment) {
  return Status(
      StatusCode::kResourceExhausted,
      "namespace \"" + ns + "\" is at its quota " + std::string(limit) + "=" +
          std::to_string(value) + ": it holds " + std::to_string(held_segments) +
          " arena segments of " + std::to_string(segment) + " bytes this way, " +
          std::to_string(more_segments) +
          " more asked (a segment holding one pinned chunk or reservation counts whole: no other "
          "namespace can use it); other namespaces are not affected",
      Reason::kQuotaExceeded);
}

size_t DistinctPrefix(std::span<const Hash128> hashes) {
  // Short chains (most lookups) without an allocation.
  constexpr size_t kSmall = 32;
  if (hashes.size() <= kSmall) {
    for (size_t i = 1; i < hashes.size(); ++i) {
      for (size_t j = 0; j < i; ++j) {
        if (hashes[j] == hashes[i]) return i;
      }
    }
    return hashes.size();
  }
  std::unordered_set<Hash128, Hash128Hasher> seen;
  seen.reserve(hashes.size());
  for (size_t i = 0; i < hashes.size(); ++i) {
    if (!seen.insert(hashes[i]).second) return i;
  }
  return hashes.size();
}

// ---------------------------------------------------------------- Impl helpers

HostTier::Impl::Impl(const HostTierOptions& options, std::byte* base, uint64_t capacity,
                     Clock* clock, SegmentListener* listener)
    : options_(options),
      base_(base),
      capacity_(capacity),
      clock_(clock),
      listener_(listener),
      arena_(capacity, options.alignment, options.segment_bytes),
      pinned_segments_(arena_.segment_count()),
      reserved_segments_(arena_.segment_count()) {
  counters_.kind = TierKind::kHost;
  // Full size from the start: growing it would rehash every remembered id on the thread that
  // retires one (0.1-0.8 ms at 10-40 thousand ids, inside a request's latency).
  retired_.reserve(options_.retired_id_memory);
}

const char* IdKindName(IdKind kind) {
  switch (kind) {
    case IdKind::kReservation:
      return "reservation";
    case IdKind::kLease:
      return "lease";
    case IdKind::kRead:
      return "read";
  }
  return "id";
}

uint64_t HostTier::Impl::NextIdLocked() {
  while (true) {
    if (random_left_ == 0) {
      size_t got = 0;
      auto* out = reinterpret_cast<char*>(random_ids_);
      while (got < sizeof(random_ids_)) {
        const ssize_t n = ::getrandom(out + got, sizeof(random_ids_) - got, 0);
        if (n > 0) got += static_cast<size_t>(n);
        // EINTR: retry. Other errors cannot happen with flags 0 on Linux >= 3.17.
      }
      random_left_ = std::size(random_ids_);
    }
    // 63 bits: ids stay positive in every signed representation a client may use.
    const uint64_t id = random_ids_[--random_left_] >> 1;
    if (id == 0 || reservations_.count(id) != 0 || leases_.count(id) != 0 ||
        reads_.count(id) != 0 || retired_.count(id) != 0) {
      continue;
    }
    return id;
  }
}

Status HostTier::Impl::CheckLeaseOwnerLocked(LeaseId id, const LeaseState& lease,
                                             OwnerId caller) const {
  if (caller == kAnyOwner || caller == lease.owner) return Status::Ok();
  // The same answer as for an id never issued, so a lease's existence does not leak.
  return Status::NotFound("lease " + std::to_string(id) + " is not held by this client");
}

void HostTier::Impl::RetireLocked(uint64_t id, IdKind kind, RetireReason reason) {
  if (options_.retired_id_memory == 0) return;
  if (retired_.emplace(id, Retired{kind, reason}).second) retired_order_.push_back(id);
  while (retired_order_.size() > options_.retired_id_memory) {
    retired_.erase(retired_order_.front());
    retired_order_.pop_front();
  }
}

Status HostTier::Impl::UnknownIdLocked(IdKind kind, uint64_t id) const {
  const std::string name = std::string(IdKindName(kind)) + " " + std::to_string(id);
  auto it = retired_.find(id);
  if (it == retired_.end()) {
    return Status::NotFound(name + " is unknown (never issued, or retired long ago)");
  }
  if (it->second.kind != kind) {
    return Status::NotFound(name + " is unknown: id " + std::to_string(id) + " was a " +
                            IdKindName(it->second.kind));
  }
  switch (it->second.reason) {
    case RetireReason::kCommitted:
      return Status::FailedPrecondition(name + " was already committed");
    case RetireReason::kAborted:
      return Status::Aborted(name + " was aborted");
    case RetireReason::kExpired:
      return Status::Aborted(name + " expired (its ttl passed before it was used)");
    case RetireReason::kReclaimed:
      return Status::Aborted(name + " was reclaimed: its owner disconnected");
    case RetireReason::kDataLoss:
      return Status::Aborted(name + " was dropped after a checksum mismatch");
    case RetireReason::kDedup:
      return Status::Aborted(name + " was dropped: its chunk was already stored (dedup)");
    case RetireReason::kReleased:
      return Status::Aborted(name + " was already released");
  }
  return Status::Internal(name + ": bad retire reason");
}

void HostTier::Impl::PinLocked(HostEntry* e) {
  if (e->pins++ == 0 && e->visible) {
    pinned_bytes_ += e->meta.size_bytes;
    pinned_arena_bytes_ += e->arena_bytes;
  }
}

void HostTier::Impl::UnpinLocked(HostEntry* e) {
  if (--e->pins > 0) return;
  if (e->visible) {
    pinned_bytes_ -= e->meta.size_bytes;
    pinned_arena_bytes_ -= e->arena_bytes;
    // A served-through chunk goes with its last pin (`e` is freed here).
    if (e->transient) DropEntryLocked(e, RemoveReason::kEvicted);
    return;
  }
  // A hidden entry's last pin: free it now.
  FreeBlockLocked(e->offset);
  hidden_arena_bytes_ -= e->arena_bytes;
  hidden_.erase(e);
}

void HostTier::Impl::LeasePinLocked(HostEntry* e) {
  if (e->lease_pins++ > 0) return;
  ns_pinned_[e->meta.key.name_space] += e->meta.size_bytes;
  pinned_segments_.Add(arena_.SegmentOf(e->offset), e->meta.key.name_space);
}

void HostTier::Impl::LeaseUnpinLocked(HostEntry* e) {
  if (--e->lease_pins > 0) return;
  pinned_segments_.Remove(arena_.SegmentOf(e->offset), e->meta.key.name_space);
  auto it = ns_pinned_.find(e->meta.key.name_space);
  if (it == ns_pinned_.end()) return;
  it->second -= e->meta.size_bytes;
  if (it->second == 0) ns_pinned_.erase(it);
}

void HostTier::Impl::TouchLocked(HostEntry* e, int64_t now) {
  e->meta.last_access_ns = now;
  if (e->visible) lru_.splice(lru_.begin(), lru_, e->lru_it);
}

void HostTier::Impl::AccountLocked(const ChunkMeta& m, bool add) {
  auto apply = [&](UsageStats& u) {
    if (add) {
      u.chunks += 1;
      u.bytes += m.size_bytes;
      u.tokens += m.tokens;
    } else {
      u.chunks -= 1;
      u.bytes -= m.size_bytes;
      u.tokens -= m.tokens;
    }
  };
  apply(per_model_[m.key.model]);
  apply(per_namespace_[m.key.name_space]);
  if (!add) {
    if (per_model_[m.key.model].chunks == 0) per_model_.erase(m.key.model);
    if (per_namespace_[m.key.name_space].chunks == 0) per_namespace_.erase(m.key.name_space);
  }
}

bool HostTier::Impl::DropEntryLocked(HostEntry* e, RemoveReason reason) {
  EmitLocked(ChunkEventKind::kRemoved, reason, e->meta);
  used_bytes_ -= e->meta.size_bytes;
  used_arena_bytes_ -= e->arena_bytes;
  if (e->pins > 0) {
    pinned_bytes_ -= e->meta.size_bytes;
    pinned_arena_bytes_ -= e->arena_bytes;
  }
  AccountLocked(e->meta, /*add=*/false);
  lru_.erase(e->lru_it);
  e->visible = false;
  auto node = index_.extract(e->meta.key);
  if (e->pins > 0) {
    hidden_arena_bytes_ += e->arena_bytes;
    hidden_.emplace(e, std::move(node.mapped()));
    return false;
  }
  FreeBlockLocked(e->offset);
  return true;  // `node` destroys the entry
}

void HostTier::Impl::DropReservationLocked(ReservationId id, RetireReason reason) {
  auto it = reservations_.find(id);
  if (it == reservations_.end()) return;
  reserved_segments_.Remove(arena_.SegmentOf(it->second.offset), it->second.key.name_space);
  FreeBlockLocked(it->second.offset);
  reserved_bytes_ -= it->second.size_bytes;
  reserved_arena_bytes_ -= it->second.arena_bytes;
  ReleaseNamespaceReservationLocked(it->second.key.name_space, it->second.size_bytes);
  reservations_.erase(it);
  RetireLocked(id, IdKind::kReservation, reason);
}

void HostTier::Impl::ReleaseLeaseLocked(LeaseId id, RetireReason reason) {
  auto it = leases_.find(id);
  if (it == leases_.end()) return;
  for (HostEntry* e : it->second.entries) {
    LeaseUnpinLocked(e);
    UnpinLocked(e);
  }
  if (auto n = ns_leases_.find(it->second.name_space); n != ns_leases_.end() && --n->second == 0) {
    ns_leases_.erase(n);
  }
  if (const OwnerId owner = it->second.owner; owner != 0) {
    if (auto n = leases_per_owner_.find(owner); n != leases_per_owner_.end() && --n->second == 0) {
      leases_per_owner_.erase(n);
    }
  }
  leases_.erase(it);
  RetireLocked(id, IdKind::kLease, reason);
}

void HostTier::Impl::ReleaseReadLocked(ReadId id, RetireReason reason) {
  auto it = reads_.find(id);
  if (it == reads_.end()) return;
  UnpinLocked(it->second.entry);
  reads_.erase(it);
  RetireLocked(id, IdKind::kRead, reason);
}

std::string HostTier::Impl::OccupancyLocked() const {
  return "capacity=" + std::to_string(capacity_) + " used=" + std::to_string(used_bytes_) +
         " reserved=" + std::to_string(reserved_bytes_) +
         " pinned=" + std::to_string(pinned_bytes_) +
         " pinned_evicted=" + std::to_string(hidden_arena_bytes_) + " bytes";
}

void HostTier::Impl::FreeBlockLocked(uint64_t offset) {
  arena_.Free(offset).IgnoreError();  // the offset is live by construction
}

Status HostTier::Impl::MakeRoomLocked(uint64_t bytes, const std::string& ns) {
  if (arena_.CanAllocate(bytes, ns)) return Status::Ok();
  const uint64_t need = arena_.RoundUp(bytes);
  const uint64_t evictable = used_arena_bytes_ - pinned_arena_bytes_;
  const uint64_t free_bytes = arena_.capacity() - arena_.allocated_bytes();
  if (free_bytes + evictable < need) {
    return Status::ResourceExhausted("host tier full: cannot reserve " + std::to_string(bytes) +
                                     " bytes even after evicting " + "every unpinned chunk (" +
                                     OccupancyLocked() + ")");
  }
  // Oldest first; pinned chunks are skipped, never evicted. Segmented: a first pass over the
  // namespace's own chunks (they make room in its segments), then everyone's (emptied segments).
  for (int pass = arena_.segmented() ? 0 : 1; pass < 2; ++pass) {
    auto it = lru_.end();
    while (!arena_.CanAllocate(bytes, ns) && it != lru_.begin()) {
      --it;
      HostEntry* e = *it;
      if (e->pins > 0 || (pass == 0 && e->meta.key.name_space != ns)) continue;
      auto next = it;  // the element after `it` survives the erase
      ++next;
      DropEntryLocked(e, RemoveReason::kEvicted);
      counters_.evictions++;
      it = next;
    }
  }
  if (!arena_.CanAllocate(bytes, ns)) {
    const ArenaStats a = arena_.Stats();
    return Status::ResourceExhausted(
        "host tier full: " + std::to_string(bytes) + " bytes do not fit; free space is " +
        "fragmented around pinned chunks and reservations (largest free block " +
        std::to_string(a.largest_free_block) + ", " + OccupancyLocked() + ")");
  }
  return Status::Ok();
}

void HostTier::Impl::ReleaseNamespaceReservationLocked(const std::string& ns, uint64_t bytes) {
  auto it = ns_reserved_.find(ns);
  if (it == ns_reserved_.end()) return;
  it->second -= bytes;
  if (it->second == 0) ns_reserved_.erase(it);
}

Status HostTier::Impl::EnforceQuotaLocked(const std::string& ns, uint64_t bytes) {
  const NamespaceQuota& q = options_.quotas.For(ns);
  auto r = ns_reserved_.find(ns);
  const uint64_t reserved = r == ns_reserved_.end() ? 0 : r->second;
  if (q.reserved_bytes != 0 && reserved + bytes > q.reserved_bytes) {
    return QuotaExceeded(ns, "reserved_bytes", q.reserved_bytes, reserved, bytes);
  }
  const uint64_t quota = q.stored_bytes;
  if (quota == 0) return Status::Ok();
  auto held = [&] {
    auto u = per_namespace_.find(ns);
    return (u == per_namespace_.end() ? 0 : u->second.bytes) + reserved;
  };
  auto over_quota = [&] { return QuotaExceeded(ns, "stored_bytes", quota, held(), bytes); };
  if (bytes > quota) return over_quota();
  if (held() + bytes <= quota) return Status::Ok();
  // Feasible only if enough of the namespace's own chunks are unpinned.
  uint64_t evictable = 0;
  for (const HostEntry* e : lru_) {
    if (e->pins == 0 && e->meta.key.name_space == ns) evictable += e->meta.size_bytes;
  }
  if (held() + bytes - evictable > quota) return over_quota();
  // Evict the namespace's own least recently used chunks (never another namespace's).
  auto it = lru_.end();
  while (held() + bytes > quota && it != lru_.begin()) {
    --it;
    HostEntry* e = *it;
    if (e->pins > 0 || e->meta.key.name_space != ns) continue;
    auto next = std::next(it);
    DropEntryLocked(e, RemoveReason::kEvicted);
    counters_.evictions++;
    counters_.quota_evictions++;
    it = next;
  }
  return held() + bytes <= quota ? Status::Ok() : over_quota();
}

Status HostTier::Impl::CheckLeaseQuotaLocked(const std::string& ns,
                                             const std::vector<HostEntry*>& entries) const {
  const NamespaceQuota& q = options_.quotas.For(ns);
  if (q.leases != 0) {
    auto n = ns_leases_.find(ns);
    const uint32_t open = n == ns_leases_.end() ? 0 : n->second;
    if (open >= q.leases) return QuotaExceeded(ns, "leases", q.leases, open, 1);
  }
  if (q.pinned_bytes != 0) {
    uint64_t more = 0;  // bytes this lease pins that no lease of the namespace pins yet
    for (const HostEntry* e : entries) {
      if (e->lease_pins == 0) more += e->meta.size_bytes;
    }
    auto p = ns_pinned_.find(ns);
    const uint64_t pinned = p == ns_pinned_.end() ? 0 : p->second;
    if (more > 0 && pinned + more > q.pinned_bytes) {
      return QuotaExceeded(ns, "pinned_bytes", q.pinned_bytes, pinned, more);
    }
    if (arena_.segmented()) {
      std::vector<uint32_t> fresh;  // segments this lease would be the first to pin
      for (const HostEntry* e : entries) {
        const uint32_t seg = arena_.SegmentOf(e->offset);
        if (e->lease_pins == 0 && !pinned_segments_.Held(seg) &&
            std::find(fresh.begin(), fresh.end(), seg) == fresh.end()) {
          fresh.push_back(seg);
        }
      }
      const uint32_t held = pinned_segments_.HeldBy(ns);
      if (!fresh.empty() && held + fresh.size() > SegmentsAllowed(q.pinned_bytes)) {
        return SegmentQuotaExceeded(ns, "pinned_bytes", q.pinned_bytes, held, fresh.size(),
                                    arena_.segment_bytes());
      }
    }
  }
  return Status::Ok();
}

uint32_t HostTier::Impl::SegmentsAllowed(uint64_t limit) const {
  return static_cast<uint32_t>(std::max<uint64_t>(1, limit / arena_.segment_bytes()));
}

Status HostTier::Impl::CheckReservedSegmentsLocked(const std::string& ns, uint32_t segment) const {
  const uint64_t limit = options_.quotas.For(ns).reserved_bytes;
  if (limit == 0 || !arena_.segmented() || reserved_segments_.Held(segment)) return Status::Ok();
  const uint32_t held = reserved_segments_.HeldBy(ns);
  if (held + 1 <= SegmentsAllowed(limit)) return Status::Ok();
  return SegmentQuotaExceeded(ns, "reserved_bytes", limit, held, 1, arena_.segment_bytes());
}

StatusOr<ReadView> HostTier::Impl::StartReadLocked(HostEntry* e, OwnerId owner, int64_t now) {
  const ReadId id = NextIdLocked();
  PinLocked(e);
  TouchLocked(e, now);
  reads_.emplace(id, ReadState{owner, Deadline(now, options_.read_ttl), e});
  ReadView view;
  view.read_id = id;
  view.meta = e->meta;
  view.offset = e->offset;
  view.data = base_ + e->offset;
  return view;
}

// ---------------------------------------------------------------- construction

StatusOr<std::unique_ptr<HostTier>> HostTier::Create(const HostTierOptions& options,
                                                     std::span<std::byte> region, Clock* clock,
                                                     SegmentListener* listener) {
  KVD_RETURN_IF_ERROR(options.Validate());
  if (region.data() == nullptr || region.size() < options.alignment) {
    return Status::InvalidArgument("host tier: region of " + std::to_string(region.size()) +
                                   " bytes is smaller than one alignment unit (" +
                                   std::to_string(options.alignment) + ")");
  }
  if (reinterpret_cast<uintptr_t>(region.data()) % options.alignment != 0) {
    return Status::InvalidArgument("host tier: region start is not aligned to " +
                                   std::to_string(options.alignment) + " bytes");
  }
  if (options.capacity_bytes > region.size()) {
    return Status::InvalidArgument("host tier: capacity_bytes " +
                                   std::to_string(options.capacity_bytes) +
                                   " exceeds the region size " + std::to_string(region.size()));
  }
  const uint64_t capacity = options.capacity_bytes == 0 ? region.size() : options.capacity_bytes;
  auto impl = std::make_unique<Impl>(options, region.data(), capacity,
                                     clock != nullptr ? clock : Clock::Real(), listener);
  return std::unique_ptr<HostTier>(new HostTier(std::move(impl)));
}

HostTier::HostTier(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HostTier::~HostTier() = default;

// ---------------------------------------------------------------- writes

StatusOr<Reservation> HostTier::Reserve(const ChunkKey& key, uint64_t bytes, uint32_t tokens,
                                        OwnerId owner, std::chrono::milliseconds ttl) {
  Impl& s = *impl_;
  const int64_t now = s.clock_->NowNanos();
  std::lock_guard<std::mutex> lock(s.mu_);
  return s.ReserveLocked(key, bytes, tokens, owner, ttl, now, /*ahead=*/false);
}

StatusOr<Reservation> HostTier::ReserveAhead(const ChunkKey& key, uint64_t bytes, OwnerId owner,
                                             std::chrono::milliseconds ttl) {
  Impl& s = *impl_;
  const int64_t now = s.clock_->NowNanos();
  std::lock_guard<std::mutex> lock(s.mu_);
  return s.ReserveLocked(key, bytes, /*tokens=*/0, owner, ttl, now, /*ahead=*/true);
}

StatusOr<Reservation> HostTier::Impl::ReserveLocked(const ChunkKey& key, uint64_t bytes,
                                                    uint32_t tokens, OwnerId owner,
                                                    std::chrono::milliseconds ttl, int64_t now,
                                                    bool ahead) {
  Impl& s = *this;
  if (bytes == 0) return Status::InvalidArgument("reserve: bytes must be > 0");
  if (key.model.empty()) return Status::InvalidArgument("reserve: the key's model is empty");
  if (s.options_.max_chunk_bytes != 0 && bytes > s.options_.max_chunk_bytes) {
    return Status::InvalidArgument("reserve: " + std::to_string(bytes) +
                                   " bytes exceed max_chunk_bytes " +
                                   std::to_string(s.options_.max_chunk_bytes));
  }
  if (ttl.count() <= 0) ttl = s.options_.reservation_ttl;
  if (auto stored = s.index_.find(key); !ahead && stored != s.index_.end()) {
    // A chunk whose disk copy is still being written is not "already stored" yet: this writer
    // reserves and sends its bytes, and its commit waits for (or makes) the durable copy.
    if (stored->second->durable) {
      stored->second->transient = false;  // this writer stores it too: it stays
      s.counters_.dedup_puts++;
      return DedupStatus(key);
    }
  }
  if (s.arena_.segmented() && s.arena_.RoundUp(bytes) > s.arena_.max_block_bytes()) {
    return Status::InvalidArgument("reserve: " + std::to_string(bytes) +
                                   " bytes exceed one arena segment (segment_bytes " +
                                   std::to_string(s.arena_.segment_bytes()) + ")");
  }
  if (s.arena_.RoundUp(bytes) > s.arena_.capacity()) {
    return Status::ResourceExhausted("host tier: " + std::to_string(bytes) +
                                     " bytes exceed the whole capacity (" + s.OccupancyLocked() +
                                     ")");
  }
  if (ahead) {
    const double max_share = HostTier::kReserveAheadMaxShare;
    const uint64_t held = s.reserved_arena_bytes_ + s.pinned_arena_bytes_ + s.hidden_arena_bytes_;
    if (static_cast<double>(held + s.arena_.RoundUp(bytes)) >
        max_share * static_cast<double>(s.capacity_)) {
      return Status::ResourceExhausted(
          "no headroom to reserve ahead: " + std::to_string(bytes) + " more bytes held would " +
          "leave less than half the capacity evictable (" + s.OccupancyLocked() + ")");
    }
    const NamespaceQuota& q = s.options_.quotas.For(key.name_space);
    const uint64_t quota = q.stored_bytes == 0 || q.reserved_bytes == 0
                               ? std::max(q.stored_bytes, q.reserved_bytes)
                               : std::min(q.stored_bytes, q.reserved_bytes);
    auto r = s.ns_reserved_.find(key.name_space);
    const uint64_t ns_held = r == s.ns_reserved_.end() ? 0 : r->second;
    if (quota != 0 &&
        static_cast<double>(ns_held + bytes) > max_share * static_cast<double>(quota)) {
      return Status::ResourceExhausted(
          "no headroom to reserve ahead: namespace \"" + key.name_space + "\" would hold " +
          std::to_string(ns_held + bytes) + " reserved bytes, over half its quota " +
          std::to_string(quota));
    }
  }
  KVD_RETURN_IF_ERROR(s.EnforceQuotaLocked(key.name_space, bytes));
  KVD_RETURN_IF_ERROR(s.MakeRoomLocked(bytes, key.name_space));
  const std::optional<SegmentedArena::Placement> place = s.arena_.Place(bytes, key.name_space);
  if (!place) return Status::Internal("host tier: no placement after making room");
  KVD_RETURN_IF_ERROR(s.CheckReservedSegmentsLocked(key.name_space, place->segment));
  if (place->handover && s.listener_ != nullptr) {
    KVD_RETURN_IF_ERROR(s.listener_->OnSegmentHandover(place->segment)
                            .WithContext("reserve: arena segment " +
                                         std::to_string(place->segment) + " for namespace \"" +
                                         key.name_space + "\""));
  }
  const std::optional<uint64_t> offset = s.arena_.AllocateAt(*place, bytes, key.name_space);
  if (!offset) return Status::Internal("host tier: allocation failed after making room");
  Impl::OpenReservation r;
  r.key = key;
  r.offset = *offset;
  r.size_bytes = bytes;
  r.arena_bytes = s.arena_.BlockSize(*offset);
  r.tokens = tokens;
  r.owner = owner;
  r.deadline_ns = Deadline(now, ttl);
  r.ahead = ahead;
  r.named = !ahead;
  s.reserved_bytes_ += bytes;
  s.reserved_arena_bytes_ += r.arena_bytes;
  s.ns_reserved_[key.name_space] += bytes;
  s.reserved_segments_.Add(place->segment, key.name_space);
  const ReservationId id = s.NextIdLocked();
  Reservation out{id, r.offset, s.base_ + r.offset, bytes, r.deadline_ns};
  s.reservations_.emplace(id, std::move(r));
  return out;
}

Status HostTier::NameReservation(ReservationId id, const ChunkKey& key, uint32_t tokens) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu_);
  auto it = s.reservations_.find(id);
  if (it == s.reservations_.end()) return s.UnknownIdLocked(IdKind::kReservation, id);
  Impl::OpenReservation& r = it->second;
  const std::string name = "reservation " + std::to_string(id);
  if (!r.ahead) {
    return Status::FailedPrecondition(
        name + " was made for its chunk (Reserve), not ahead: " + "it names its chunk already");
  }
  if (r.committing) return Status::FailedPrecondition(name + " is already being committed");
  if (r.named) return Status::FailedPrecondition(name + " names its chunk already");
  if (tokens == 0) return Status::InvalidArgument(name + ": tokens must be > 0");
  ChunkKey same = key;
  same.chain_hash = r.key.chain_hash;
  if (!(same == r.key)) {
    return Status::InvalidArgument(name + " was reserved ahead for " + r.key.ToString() +
                                   " (any hash); " + key.ToString() +
                                   " differs in more than its hash");
  }
  r.key = key;
  r.tokens = tokens;
  r.named = true;
  return Status::Ok();
}

Status HostTier::Commit(ReservationId id, uint64_t checksum, CommitCheck check) {
  return CommitPinned(id, checksum, nullptr, check);
}

void HostTier::MarkDurable(const ChunkKey& key) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu_);
  if (auto it = s.index_.find(key); it != s.index_.end()) it->second->durable = true;
}

Status HostTier::CommitPinned(ReservationId id, uint64_t checksum, ReadView* pinned,
                              CommitCheck check, Durability durability) {
  Impl& s = *impl_;
  const std::byte* data = nullptr;
  uint64_t size = 0;
  {
    std::lock_guard<std::mutex> lock(s.mu_);
    auto it = s.reservations_.find(id);
    if (it == s.reservations_.end()) return s.UnknownIdLocked(IdKind::kReservation, id);
    Impl::OpenReservation& r = it->second;
    if (r.committing) {
      return Status::FailedPrecondition("reservation " + std::to_string(id) +
                                        " is already being committed");
    }
    if (!r.named) {
      return Status::FailedPrecondition("reservation " + std::to_string(id) +
                                        " was reserved ahead and names no chunk yet "
                                        "(NameReservation before Commit)");
    }
    if (s.clock_->NowNanos() > r.deadline_ns) {
      s.DropReservationLocked(id, RetireReason::kExpired);
      s.counters_.reservations_expired++;
      return s.UnknownIdLocked(IdKind::kReservation, id);
    }
    r.committing = true;
    data = s.base_ + r.offset;
    size = r.size_bytes;
  }
  // Verify without the lock: the bytes are the reserver's, and the block cannot be freed while
  // `committing` is set (Abort / ReclaimOwner only mark it cancelled; expiry skips it).
  const uint64_t actual = check == CommitCheck::kVerify ? Checksum64(data, size) : checksum;
  const int64_t now = s.clock_->NowNanos();

  std::lock_guard<std::mutex> lock(s.mu_);
  auto it = s.reservations_.find(id);
  if (it == s.reservations_.end()) {
    return Status::Internal("reservation " + std::to_string(id) + " vanished while committing");
  }
  Impl::OpenReservation& r = it->second;
  if (r.cancelled) {
    const RetireReason reason = r.cancel_reason;
    s.DropReservationLocked(id, reason);
    return s.UnknownIdLocked(IdKind::kReservation, id);
  }
  if (actual != checksum) {
    const std::string key = r.key.ToString();
    s.DropReservationLocked(id, RetireReason::kDataLoss);
    s.counters_.checksum_failures++;
    char buf[96];
    std::snprintf(buf, sizeof(buf), "expected %016llx, bytes have %016llx",
                  static_cast<unsigned long long>(checksum),
                  static_cast<unsigned long long>(actual));
    return Status::DataLoss("commit of reservation " + std::to_string(id) + " (" + key +
                            "): checksum mismatch: " + buf + "; reservation dropped");
  }
  if (auto stored = s.index_.find(r.key); stored != s.index_.end()) {
    const ChunkKey key = r.key;
    HostEntry* existing = stored->second.get();
    if (!r.transient) existing->transient = false;  // an independent store: it stays
    s.DropReservationLocked(id, RetireReason::kDedup);
    s.counters_.dedup_puts++;
    if (pinned != nullptr) {
      KVD_ASSIGN_OR_RETURN(*pinned, s.StartReadLocked(existing, /*owner=*/0, now));
    }
    return DedupStatus(key);
  }
  auto entry = std::make_unique<HostEntry>();
  HostEntry* e = entry.get();
  e->meta.key = r.key;
  e->meta.tokens = r.tokens;
  e->meta.size_bytes = r.size_bytes;
  e->meta.checksum = checksum;
  e->meta.created_ns = now;
  e->meta.last_access_ns = now;
  e->meta.tier = TierKind::kHost;
  e->offset = r.offset;
  e->arena_bytes = r.arena_bytes;
  e->durable = durability == Durability::kDurable;
  e->transient = r.transient;
  s.reserved_bytes_ -= r.size_bytes;
  s.reserved_segments_.Remove(s.arena_.SegmentOf(r.offset), r.key.name_space);
  s.ReleaseNamespaceReservationLocked(r.key.name_space, r.size_bytes);
  s.reserved_arena_bytes_ -= r.arena_bytes;
  s.used_bytes_ += e->meta.size_bytes;
  s.used_arena_bytes_ += e->arena_bytes;
  s.AccountLocked(e->meta, /*add=*/true);
  s.lru_.push_front(e);
  e->lru_it = s.lru_.begin();
  s.index_.emplace(e->meta.key, std::move(entry));
  s.EmitLocked(ChunkEventKind::kStored, RemoveReason::kNone, e->meta);
  s.reservations_.erase(it);
  s.RetireLocked(id, IdKind::kReservation, RetireReason::kCommitted);
  s.counters_.commits++;
  if (pinned != nullptr) {
    KVD_ASSIGN_OR_RETURN(*pinned, s.StartReadLocked(e, /*owner=*/0, now));
  }
  return Status::Ok();
}

Status HostTier::Abort(ReservationId id) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu_);
  auto it = s.reservations_.find(id);
  if (it == s.reservations_.end()) return s.UnknownIdLocked(IdKind::kReservation, id);
  if (it->second.committing) {
    it->second.cancelled = true;
    it->second.cancel_reason = RetireReason::kAborted;
    return Status::Ok();
  }
  s.DropReservationLocked(id, RetireReason::kAborted);
  return Status::Ok();
}

ReclaimResult HostTier::ReclaimOwner(OwnerId owner) {
  Impl& s = *impl_;
  ReclaimResult out;
  std::lock_guard<std::mutex> lock(s.mu_);
  std::vector<uint64_t> ids;
  for (auto& [id, r] : s.reservations_) {
    if (r.owner != owner) continue;
    out.reservations++;
    if (r.committing) {
      r.cancelled = true;
      r.cancel_reason = RetireReason::kReclaimed;
    } else {
      ids.push_back(id);
    }
  }
  for (uint64_t id : ids) s.DropReservationLocked(id, RetireReason::kReclaimed);
  s.counters_.reservations_reclaimed += out.reservations;
  ids.clear();
  for (const auto& [id, l] : s.leases_) {
    if (l.owner == owner) ids.push_back(id);
  }
  for (uint64_t id : ids) s.ReleaseLeaseLocked(id, RetireReason::kReclaimed);
  out.leases = ids.size();
  ids.clear();
  for (const auto& [id, r] : s.reads_) {
    if (r.owner == owner) ids.push_back(id);
  }
  for (uint64_t id : ids) s.ReleaseReadLocked(id, RetireReason::kReclaimed);
  out.reads = ids.size();
  return out;
}

uint64_t HostTier::ExpireReservations() {
  Impl& s = *impl_;
  const int64_t now = s.clock_->NowNanos();
  std::lock_guard<std::mutex> lock(s.mu_);
  std::vector<uint64_t> ids;
  for (const auto& [id, r] : s.reservations_) {
    // A reservation whose Commit is verifying was committed in time: let it finish.
    if (!r.committing && now > r.deadline_ns) ids.push_back(id);
  }
  for (uint64_t id : ids) s.DropReservationLocked(id, RetireReason::kExpired);
  s.counters_.reservations_expired += ids.size();
  return ids.size();
}

ReclaimResult HostTier::ExpireLeases() {
  Impl& s = *impl_;
  const int64_t now = s.clock_->NowNanos();
  ReclaimResult out;
  std::lock_guard<std::mutex> lock(s.mu_);
  std::vector<uint64_t> ids;
  for (const auto& [id, l] : s.leases_) {
    if (now > l.deadline_ns) ids.push_back(id);
  }
  for (uint64_t id : ids) s.ReleaseLeaseLocked(id, RetireReason::kExpired);
  out.leases = ids.size();
  s.counters_.leases_expired += ids.size();
  ids.clear();
  for (const auto& [id, r] : s.reads_) {
    if (now > r.deadline_ns) ids.push_back(id);
  }
  for (uint64_t id : ids) s.ReleaseReadLocked(id, RetireReason::kExpired);
  out.reads = ids.size();
  return out;
}

// ---------------------------------------------------------------- reads

StatusOr<LookupResult> HostTier::Lookup(const LookupRequest& request) {
  Impl& s = *impl_;
  if (request.model.empty()) return Status::InvalidArgument("lookup: model is empty");
  const std::chrono::milliseconds ttl =
      request.lease_ttl.count() > 0 ? request.lease_ttl : s.options_.lease_ttl;
  const int64_t now = s.clock_->NowNanos();
  LookupResult out;
  ChunkKey key{request.name_space, request.model, request.layout_digest, request.codec_id, {}};
  std::lock_guard<std::mutex> lock(s.mu_);
  std::vector<HostEntry*> matched;
  const size_t distinct = DistinctPrefix(request.chunk_hashes);
  for (size_t i = 0; i < distinct; ++i) {
    key.chain_hash = request.chunk_hashes[i];
    auto it = s.index_.find(key);
    if (it == s.index_.end()) break;
    matched.push_back(it->second.get());
  }
  s.counters_.lookups++;
  s.counters_.chunks_requested += request.chunk_hashes.size();
  s.counters_.chunks_matched += matched.size();
  if (matched.empty()) {
    s.counters_.misses++;
    return out;
  }
  if (const uint32_t cap = s.options_.max_leases_per_owner; cap != 0 && request.owner != 0) {
    auto held = s.leases_per_owner_.find(request.owner);
    if (held != s.leases_per_owner_.end() && held->second >= cap) {
      return Status::ResourceExhausted("lookup: this client already holds " +
                                       std::to_string(held->second) + " leases (limit " +
                                       std::to_string(cap) + "); release some first");
    }
  }
  KVD_RETURN_IF_ERROR(s.CheckLeaseQuotaLocked(request.name_space, matched));
  s.counters_.hits++;
  // Touch in reverse so the first chunk of the prefix ends up most recent: a prefix is useless
  // without its head, so the head should outlive the tail under pressure.
  for (auto e = matched.rbegin(); e != matched.rend(); ++e) {
    s.PinLocked(*e);
    s.LeasePinLocked(*e);
    s.TouchLocked(*e, now);
  }
  out.matched_chunks = matched.size();
  out.chunks.reserve(matched.size());
  for (HostEntry* e : matched) {
    out.matched_tokens += e->meta.tokens;
    out.chunks.push_back(e->meta);
  }
  out.lease_id = s.NextIdLocked();
  out.lease_deadline_ns = Deadline(now, ttl);
  s.leases_.emplace(out.lease_id, Impl::LeaseState{request.owner, out.lease_deadline_ns,
                                                   std::move(matched), request.name_space});
  s.ns_leases_[request.name_space]++;
  if (request.owner != 0) s.leases_per_owner_[request.owner]++;
  return out;
}

StatusOr<ReadView> HostTier::Get(LeaseId lease, size_t index, OwnerId caller) {
  Impl& s = *impl_;
  const int64_t now = s.clock_->NowNanos();
  std::lock_guard<std::mutex> lock(s.mu_);
  auto it = s.leases_.find(lease);
  if (it == s.leases_.end()) return s.UnknownIdLocked(IdKind::kLease, lease);
  KVD_RETURN_IF_ERROR(s.CheckLeaseOwnerLocked(lease, it->second, caller));
  if (now > it->second.deadline_ns) {
    s.ReleaseLeaseLocked(lease, RetireReason::kExpired);
    s.counters_.leases_expired++;
    return s.UnknownIdLocked(IdKind::kLease, lease);
  }
  if (index >= it->second.entries.size()) {
    return Status::OutOfRange("get: lease " + std::to_string(lease) + " holds " +
                              std::to_string(it->second.entries.size()) + " chunks, index " +
                              std::to_string(index) + " asked");
  }
  return s.StartReadLocked(it->second.entries[index], it->second.owner, now);
}

StatusOr<ReadView> HostTier::GetByKey(const ChunkKey& key, OwnerId owner) {
  Impl& s = *impl_;
  const int64_t now = s.clock_->NowNanos();
  std::lock_guard<std::mutex> lock(s.mu_);
  auto it = s.index_.find(key);
  if (it == s.index_.end()) {
    return Status::NotFound("chunk " + key.ToString() + " is not stored (never put, or evicted)");
  }
  return s.StartReadLocked(it->second.get(), owner, now);
}

Status HostTier::ReleaseRead(ReadId read) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu_);
  if (s.reads_.count(read) == 0) return s.UnknownIdLocked(IdKind::kRead, read);
  s.ReleaseReadLocked(read, RetireReason::kReleased);
  return Status::Ok();
}

Status HostTier::ReleaseLease(LeaseId lease, OwnerId caller) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu_);
  auto it = s.leases_.find(lease);
  if (it == s.leases_.end()) return s.UnknownIdLocked(IdKind::kLease, lease);
  KVD_RETURN_IF_ERROR(s.CheckLeaseOwnerLocked(lease, it->second, caller));
  s.ReleaseLeaseLocked(lease, RetireReason::kReleased);
  return Status::Ok();
}

}  // namespace kvd::storage
