// HostTier: construction, the write protocol (reserve / commit / abort / reclaim / expiry) and
// the read protocol (lookup / get / release). The Impl's own helpers are in host_tier_impl.cc.
#include "kvd/storage/host_tier.h"

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

Status DedupStatus(const ChunkKey& key) {
  return storage::DedupStatus("chunk " + key.ToString() + " is already stored; skip sending it");
}

}  // namespace

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

Status HostTier::Impl::CheckFitsArenaLocked(uint64_t bytes) const {
  if (arena_.segmented() && arena_.RoundUp(bytes) > arena_.max_block_bytes()) {
    return Status::InvalidArgument("reserve: " + std::to_string(bytes) +
                                   " bytes exceed one arena segment (segment_bytes " +
                                   std::to_string(arena_.segment_bytes()) + ")");
  }
  if (arena_.RoundUp(bytes) > arena_.capacity()) {
    return Status::ResourceExhausted("host tier: " + std::to_string(bytes) +
                                     " bytes exceed the whole capacity (" + OccupancyLocked() +
                                     ")");
  }
  return Status::Ok();
}

Status HostTier::Impl::CheckAheadHeadroomLocked(const ChunkKey& key, uint64_t bytes) const {
  const double max_share = HostTier::kReserveAheadMaxShare;
  const uint64_t held = reserved_arena_bytes_ + pinned_arena_bytes_ + hidden_arena_bytes_;
  if (static_cast<double>(held + arena_.RoundUp(bytes)) >
      max_share * static_cast<double>(capacity_)) {
    return Status::ResourceExhausted(
        "no headroom to reserve ahead: " + std::to_string(bytes) + " more bytes held would " +
        "leave less than half the capacity evictable (" + OccupancyLocked() + ")");
  }
  const NamespaceQuota& q = options_.quotas.For(key.name_space);
  const uint64_t quota = q.stored_bytes == 0 || q.reserved_bytes == 0
                             ? std::max(q.stored_bytes, q.reserved_bytes)
                             : std::min(q.stored_bytes, q.reserved_bytes);
  auto r = ns_reserved_.find(key.name_space);
  const uint64_t ns_held = r == ns_reserved_.end() ? 0 : r->second;
  if (quota != 0 && static_cast<double>(ns_held + bytes) > max_share * static_cast<double>(quota)) {
    return Status::ResourceExhausted("no headroom to reserve ahead: namespace \"" + key.name_space +
                                     "\" would hold " + std::to_string(ns_held + bytes) +
                                     " reserved bytes, over half its quota " +
                                     std::to_string(quota));
  }
  return Status::Ok();
}

StatusOr<uint64_t> HostTier::Impl::AllocateLocked(const ChunkKey& key, uint64_t bytes,
                                                  uint32_t* segment) {
  KVD_RETURN_IF_ERROR(EnforceQuotaLocked(key.name_space, bytes));
  KVD_RETURN_IF_ERROR(MakeRoomLocked(bytes, key.name_space));
  const std::optional<SegmentedArena::Placement> place = arena_.Place(bytes, key.name_space);
  if (!place) return Status::Internal("host tier: no placement after making room");
  KVD_RETURN_IF_ERROR(CheckReservedSegmentsLocked(key.name_space, place->segment));
  if (place->handover && listener_ != nullptr) {
    KVD_RETURN_IF_ERROR(listener_->OnSegmentHandover(place->segment)
                            .WithContext("reserve: arena segment " +
                                         std::to_string(place->segment) + " for namespace \"" +
                                         key.name_space + "\""));
  }
  const std::optional<uint64_t> offset = arena_.AllocateAt(*place, bytes, key.name_space);
  if (!offset) return Status::Internal("host tier: allocation failed after making room");
  *segment = place->segment;
  return *offset;
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
  KVD_RETURN_IF_ERROR(s.CheckFitsArenaLocked(bytes));
  if (ahead) KVD_RETURN_IF_ERROR(s.CheckAheadHeadroomLocked(key, bytes));
  uint32_t segment = 0;
  KVD_ASSIGN_OR_RETURN(const uint64_t offset, s.AllocateLocked(key, bytes, &segment));
  Impl::OpenReservation r;
  r.key = key;
  r.offset = offset;
  r.size_bytes = bytes;
  r.arena_bytes = s.arena_.BlockSize(offset);
  r.tokens = tokens;
  r.owner = owner;
  r.deadline_ns = Deadline(now, ttl);
  r.ahead = ahead;
  r.named = !ahead;
  s.reserved_bytes_ += bytes;
  s.reserved_arena_bytes_ += r.arena_bytes;
  s.ns_reserved_[key.name_space] += bytes;
  s.reserved_segments_.Add(segment, key.name_space);
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

StatusOr<std::span<const std::byte>> HostTier::Impl::BeginCommitLocked(ReservationId id) {
  auto it = reservations_.find(id);
  if (it == reservations_.end()) return UnknownIdLocked(IdKind::kReservation, id);
  OpenReservation& r = it->second;
  if (r.committing) {
    return Status::FailedPrecondition("reservation " + std::to_string(id) +
                                      " is already being committed");
  }
  if (!r.named) {
    return Status::FailedPrecondition("reservation " + std::to_string(id) +
                                      " was reserved ahead and names no chunk yet "
                                      "(NameReservation before Commit)");
  }
  if (clock_->NowNanos() > r.deadline_ns) {
    DropReservationLocked(id, RetireReason::kExpired);
    counters_.reservations_expired++;
    return UnknownIdLocked(IdKind::kReservation, id);
  }
  r.committing = true;
  return std::span<const std::byte>(base_ + r.offset, r.size_bytes);
}

Status HostTier::Impl::ChecksumMismatchLocked(ReservationId id, uint64_t expected,
                                              uint64_t actual) {
  const std::string key = reservations_.at(id).key.ToString();
  DropReservationLocked(id, RetireReason::kDataLoss);
  counters_.checksum_failures++;
  char buf[96];
  std::snprintf(buf, sizeof(buf), "expected %016llx, bytes have %016llx",
                static_cast<unsigned long long>(expected), static_cast<unsigned long long>(actual));
  return Status::DataLoss("commit of reservation " + std::to_string(id) + " (" + key +
                          "): checksum mismatch: " + buf + "; reservation dropped");
}

HostEntry* HostTier::Impl::StoreCommittedLocked(ReservationId id, uint64_t checksum, int64_t now,
                                                bool durable) {
  auto it = reservations_.find(id);
  OpenReservation& r = it->second;
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
  e->durable = durable;
  e->transient = r.transient;
  reserved_bytes_ -= r.size_bytes;
  reserved_segments_.Remove(arena_.SegmentOf(r.offset), r.key.name_space);
  ReleaseNamespaceReservationLocked(r.key.name_space, r.size_bytes);
  reserved_arena_bytes_ -= r.arena_bytes;
  used_bytes_ += e->meta.size_bytes;
  used_arena_bytes_ += e->arena_bytes;
  AccountLocked(e->meta, /*add=*/true);
  lru_.push_front(e);
  e->lru_it = lru_.begin();
  index_.emplace(e->meta.key, std::move(entry));
  EmitLocked(ChunkEventKind::kStored, RemoveReason::kNone, e->meta);
  reservations_.erase(it);
  RetireLocked(id, IdKind::kReservation, RetireReason::kCommitted);
  counters_.commits++;
  return e;
}

Status HostTier::CommitPinned(ReservationId id, uint64_t checksum, ReadView* pinned,
                              CommitCheck check, Durability durability) {
  Impl& s = *impl_;
  std::span<const std::byte> bytes;
  {
    std::lock_guard<std::mutex> lock(s.mu_);
    KVD_ASSIGN_OR_RETURN(bytes, s.BeginCommitLocked(id));
  }
  // Verify without the lock: the bytes are the reserver's, and the block cannot be freed while
  // `committing` is set (Abort / ReclaimOwner only mark it cancelled; expiry skips it).
  const uint64_t actual =
      check == CommitCheck::kVerify ? Checksum64(bytes.data(), bytes.size()) : checksum;
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
  if (actual != checksum) return s.ChecksumMismatchLocked(id, checksum, actual);
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
  HostEntry* e = s.StoreCommittedLocked(id, checksum, now, durability == Durability::kDurable);
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
