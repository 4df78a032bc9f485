// HostTier::Impl's helpers: ids and their retirement, pins, accounting, room and quotas, and the
// start of a read (host_tier_impl.h has the state they work on).
#include "host_tier_impl.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <string>
#include <utility>

namespace kvd::storage {
namespace {

// A quota counted in whole segments (SegmentHolds).
Status SegmentQuotaExceeded(const std::string& ns, std::string_view limit, uint64_t value,
                            uint64_t held_segments, uint64_t more_segments, uint64_t segment) {
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

}  // namespace

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

}  // namespace kvd::storage
