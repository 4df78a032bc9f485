// HostTier: the Tier interface (copy-in / copy-out), listing, admin eviction and stats.
#include <chrono>
#include <cstring>
#include <string>

#include "host_tier_impl.h"
#include "kvd/storage/host_tier.h"

namespace kvd::storage {
namespace {

Status NotStored(const ChunkKey& key) {
  return Status::NotFound("chunk " + key.ToString() + " is not stored (never put, or evicted)");
}

}  // namespace

Status HostTier::Insert(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                        std::span<const std::byte> bytes) {
  KVD_ASSIGN_OR_RETURN(Reservation r, Reserve(key, bytes.size(), tokens, /*owner=*/0));
  std::memcpy(r.data, bytes.data(), bytes.size());
  return Commit(r.id, checksum);
}

Status HostTier::InsertTransient(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                                 std::span<const std::byte> bytes) {
  Impl& s = *impl_;
  const int64_t now = s.clock_->NowNanos();
  Reservation r;
  {
    std::lock_guard<std::mutex> lock(s.mu_);
    // Already stored: left as it is (a stored chunk never becomes transient).
    if (s.index_.contains(key)) {
      s.counters_.dedup_puts++;
      return storage::DedupStatus("chunk " + key.ToString() + " is already stored");
    }
    KVD_ASSIGN_OR_RETURN(r, s.ReserveLocked(key, bytes.size(), tokens, /*owner=*/0,
                                            std::chrono::milliseconds{0}, now, /*ahead=*/false));
    s.reservations_.at(r.id).transient = true;
  }
  std::memcpy(r.data, bytes.data(), bytes.size());
  return Commit(r.id, checksum);
}

StatusOr<ChunkMeta> HostTier::ReadInto(const ChunkKey& key, std::span<std::byte> out) {
  KVD_ASSIGN_OR_RETURN(ReadView view, GetByKey(key, /*owner=*/0));
  Status status;
  if (out.size() < view.meta.size_bytes) {
    status = Status::OutOfRange("read of " + key.ToString() + ": buffer of " +
                                std::to_string(out.size()) + " bytes < chunk of " +
                                std::to_string(view.meta.size_bytes));
  } else {
    std::memcpy(out.data(), view.data, view.meta.size_bytes);
  }
  ReleaseRead(view.read_id).IgnoreError();  // our own live read
  if (!status.ok()) return status;
  return view.meta;
}

StatusOr<ChunkMeta> HostTier::Describe(const ChunkKey& key) const {
  const Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu_);
  auto it = s.index_.find(key);
  if (it == s.index_.end()) {
    return NotStored(key);
  }
  return it->second->meta;
}

Status HostTier::Remove(const ChunkKey& key) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu_);
  auto it = s.index_.find(key);
  if (it == s.index_.end()) {
    return NotStored(key);
  }
  if (it->second->pins > 0) {
    return Status::FailedPrecondition("chunk " + key.ToString() + " is pinned by " +
                                      std::to_string(it->second->pins) + " lease(s)/read(s)");
  }
  s.DropEntryLocked(it->second.get(), RemoveReason::kMoved);
  return Status::Ok();
}

Status HostTier::DropCorrupt(const ChunkKey& key) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu_);
  auto it = s.index_.find(key);
  if (it == s.index_.end()) return NotStored(key);
  s.DropEntryLocked(it->second.get(), RemoveReason::kCorrupt);
  return Status::Ok();
}

std::vector<ChunkMeta> HostTier::List(const ChunkFilter& filter, size_t limit) const {
  const Impl& s = *impl_;
  std::vector<ChunkMeta> out;
  std::lock_guard<std::mutex> lock(s.mu_);
  if (filter.key) {
    auto it = s.index_.find(*filter.key);
    if (it != s.index_.end() && filter.Matches(it->first)) out.push_back(it->second->meta);
    return out;
  }
  for (const HostEntry* e : s.lru_) {
    if (limit != 0 && out.size() >= limit) break;
    if (filter.Matches(e->meta.key)) out.push_back(e->meta);
  }
  return out;
}

EvictResult HostTier::Evict(const ChunkFilter& filter) {
  Impl& s = *impl_;
  EvictResult out;
  std::lock_guard<std::mutex> lock(s.mu_);
  std::vector<HostEntry*> victims;
  if (filter.key) {
    auto it = s.index_.find(*filter.key);
    if (it != s.index_.end() && filter.Matches(it->first)) victims.push_back(it->second.get());
  } else {
    for (HostEntry* e : s.lru_) {
      if (filter.Matches(e->meta.key)) victims.push_back(e);
    }
  }
  for (HostEntry* e : victims) {
    const uint64_t bytes = e->meta.size_bytes;
    if (s.DropEntryLocked(e, RemoveReason::kAdmin)) {
      out.evicted++;
      out.bytes += bytes;
    } else {
      out.deferred++;
    }
  }
  s.counters_.admin_evictions += victims.size();
  return out;
}

void HostTier::SetEventListener(ChunkEventListener* listener) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  impl_->events_ = listener;
}

TierStats HostTier::GetStats() const {
  const Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu_);
  TierStats out = s.counters_;
  out.kind = TierKind::kHost;
  out.capacity_bytes = s.capacity_;
  out.used_bytes = s.used_bytes_;
  out.reserved_bytes = s.reserved_bytes_;
  out.pinned_bytes = s.pinned_bytes_;
  out.arena_allocated_bytes = s.arena_.allocated_bytes();
  out.chunk_count = s.index_.size();
  out.reservations_open = s.reservations_.size();
  out.leases_open = s.leases_.size();
  out.reads_open = s.reads_.size();
  out.fragmentation = s.arena_.Stats().fragmentation;
  const SegmentedArena::SegmentCounters segments = s.arena_.segment_counters();
  out.segments_reused = segments.reuses;
  out.segments_handed_over = segments.handovers;
  out.per_model = {s.per_model_.begin(), s.per_model_.end()};
  out.per_namespace = {s.per_namespace_.begin(), s.per_namespace_.end()};
  return out;
}

std::vector<ChunkMeta> HostTier::LeastRecentlyUsed(size_t max_chunks) const {
  const Impl& s = *impl_;
  std::vector<ChunkMeta> out;
  std::lock_guard<std::mutex> lock(s.mu_);
  for (auto it = s.lru_.rbegin(); it != s.lru_.rend() && out.size() < max_chunks; ++it) {
    if ((*it)->pins == 0 && !(*it)->transient) out.push_back((*it)->meta);
  }
  return out;
}

double HostTier::Occupancy() const {
  const Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu_);
  return s.arena_.capacity() == 0 ? 1.0
                                  : static_cast<double>(s.arena_.allocated_bytes()) /
                                        static_cast<double>(s.arena_.capacity());
}

ArenaStats HostTier::GetArenaStats() const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return impl_->arena_.Stats();
}

std::byte* HostTier::region_base() const { return impl_->base_; }
uint64_t HostTier::capacity_bytes() const { return impl_->capacity_; }
const HostTierOptions& HostTier::options() const { return impl_->options_; }

uint64_t HostTier::segment_bytes() const { return impl_->arena_.segment_bytes(); }
uint32_t HostTier::segment_count() const { return impl_->arena_.segment_count(); }
uint32_t HostTier::SegmentOf(uint64_t offset) const { return impl_->arena_.SegmentOf(offset); }
uint64_t HostTier::SegmentStart(uint32_t segment) const {
  return impl_->arena_.SegmentStart(segment);
}
uint64_t HostTier::SegmentSize(uint32_t segment) const {
  return impl_->arena_.SegmentSize(segment);
}
std::string HostTier::SegmentOwner(uint32_t segment) const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return segment < impl_->arena_.segment_count() ? impl_->arena_.SegmentOwner(segment) : "";
}
std::string HostTier::SegmentLastOwner(uint32_t segment) const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return segment < impl_->arena_.segment_count() ? impl_->arena_.SegmentLastOwner(segment) : "";
}

}  // namespace kvd::storage
