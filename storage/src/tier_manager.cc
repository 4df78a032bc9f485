#include "kvd/storage/tier_manager.h"

#include <algorithm>
#include <unordered_set>

#include "kvd/common/hash.h"
#include "kvd/common/logging.h"

namespace kvd::storage {

StatusOr<std::unique_ptr<TierManager>> TierManager::Create(const TierManagerOptions& options,
                                                           HostTier* host, DiskTier* disk,
                                                           GpuTier* gpu) {
  KVD_RETURN_IF_ERROR(options.Validate());
  if (host == nullptr) return Status::InvalidArgument("tier manager: a host tier is required");
  return std::unique_ptr<TierManager>(new TierManager(options, host, disk, gpu));
}

TierManager::TierManager(const TierManagerOptions& options, HostTier* host, DiskTier* disk,
                         GpuTier* gpu)
    : options_(options), host_(host), disk_(disk), gpu_(gpu) {}

Status TierManager::Commit(ReservationId id, uint64_t checksum, CommitCheck check) {
  if (disk_ == nullptr) return host_->Commit(id, checksum, check);
  // The write-through below copies the bytes out of host memory: verified here, whatever `check`.
  (void)check;
  ReadView pinned;
  // Published pending: served at once, but no Reserve of the key is told "already stored"
  // before its disk copy is written (MarkDurable below).
  Status s = host_->CommitPinned(id, checksum, &pinned, CommitCheck::kVerify, Durability::kPending);
  if (pinned.read_id == 0) return s;  // failed (nothing stored), or dedup without a pin
  // Pinned (our chunk, or on dedup the stored one): no Reserve can evict it while it has no
  // disk copy. On dedup the stored chunk's disk write may still be in progress (its writer
  // committed first): the disk Insert waits for it and writes these bytes itself if it failed,
  // so OK and dedup alike mean the chunk is on disk before this commit is acknowledged.
  const ChunkKey key = pinned.meta.key;
  Status d = Status::Ok();
  if (s.ok() || !disk_->Contains(key)) {
    d = disk_->Insert(key, pinned.meta.tokens, pinned.meta.checksum,
                      std::span<const std::byte>(pinned.data, pinned.meta.size_bytes));
  }
  host_->ReleaseRead(pinned.read_id).IgnoreError();  // our own live read
  if (d.ok() || IsDedup(d) || KeepInHost(d)) {
    host_->MarkDurable(key);  // as durable as the disk's state allows (KeepInHost: host only)
    return s;
  }
  if (!s.ok()) return d.WithContext("write-through of the already stored " + key.ToString());
  // Not durable: not acknowledged either. Take it back out of host unless a reader pinned it.
  host_->Remove(key).IgnoreError();
  return d.WithContext("write-through of " + key.ToString() + " to the disk tier");
}

bool TierManager::KeepInHost(const Status& disk_write) const {
  return !disk_write.ok() && !IsDedup(disk_write) && disk_->writes_stopped() &&
         options_.on_disk_error == TierManagerOptions::OnDiskError::kKeepInHost;
}

Status TierManager::InsertIntoGpu(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                                  std::span<const std::byte> bytes) {
  while (!gpu_->HasRoomFor(bytes.size())) {
    const std::vector<ChunkMeta> lru = gpu_->LeastRecentlyUsed(1);
    if (lru.empty()) break;  // everything left is being read: Insert says RESOURCE_EXHAUSTED
    KVD_RETURN_IF_ERROR(DemoteFromGpu(lru.front()));
  }
  return gpu_->Insert(key, tokens, checksum, bytes);
}

Status TierManager::PromoteFromDevice(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                                      const void* device_src, uint64_t bytes) {
  if (gpu_ == nullptr) return Status::FailedPrecondition("no gpu tier");
  if (gpu_->Contains(key)) return Status::AlreadyExists(key.ToString() + " is in the gpu tier");
  if (!gpu_->HasRoomFor(bytes)) {
    return Status::ResourceExhausted("the gpu tier has no room for " + std::to_string(bytes) +
                                     " bytes now");
  }
  return gpu_->InsertFromDevice(key, tokens, checksum, device_src, bytes);
}

Status TierManager::DemoteFromGpu(const ChunkMeta& meta) {
  // Through a host reservation: the GPU copies straight into the host arena (verified), and
  // Commit verifies again; only then does the GPU copy go.
  Status moved = PromoteToHost(*gpu_, meta.key);
  if (!moved.ok() && !IsDedup(moved)) return moved.WithContext("demote from the gpu tier");
  Status r = gpu_->Remove(meta.key);
  if (!r.ok()) return r;  // being read (FAILED_PRECONDITION) or already gone: not a demotion
  gpu_->CountDemotion();
  std::lock_guard<std::mutex> lock(counters_mu_);
  demotions_++;
  return Status::Ok();
}

bool TierManager::VerifyLeavingHost(const ReadView& view, const char* destination) {
  const uint64_t actual = Checksum64(view.data, view.meta.size_bytes);
  if (actual == view.meta.checksum) return true;
  host_->ReleaseRead(view.read_id).IgnoreError();   // our own live read
  host_->DropCorrupt(view.meta.key).IgnoreError();  // gone already: nothing left to drop
  uint64_t count = 0;
  {
    std::lock_guard<std::mutex> lock(counters_mu_);
    count = ++host_corrupt_dropped_;
  }
  // One record per chunk would flood the log when memory goes bad under a busy daemon: the
  // first, then at most one a minute (the counter host_corrupt_dropped has them all).
  if (const uint64_t chunks = corrupt_log_.Occur(); chunks > 0) {
    KVD_LOG(WARNING) << "chunk changed in host memory after its commit; dropped, not copied "
                        "(logged at most once a minute)"
                     << Kv("key", view.meta.key.ToString()) << Kv("to", destination)
                     << Kv("checksum", actual) << Kv("committed", view.meta.checksum)
                     << Kv("chunks_since_last_record", chunks) << Kv("host_corrupt_dropped", count);
  }
  return false;
}

Status TierManager::Insert(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                           std::span<const std::byte> bytes) {
  if (gpu_ != nullptr && !bytes.empty() && !gpu_->CanEverHold(bytes.size())) {
    // Demoting would empty the GPU tier and still not make room: host (and disk) directly.
    std::lock_guard<std::mutex> lock(counters_mu_);
    if (gpu_skipped_++ == 0) {
      KVD_LOG(WARNING) << "a chunk is larger than the gpu tier can ever hold; such chunks are "
                          "stored in host (counted in gpu_skipped)"
                       << Kv("key", key.ToString()) << Kv("bytes", bytes.size())
                       << Kv("gpu_capacity", gpu_->capacity_bytes());
    }
  } else if (gpu_ != nullptr && !host_->Describe(key).ok()) {
    Status g = InsertIntoGpu(key, tokens, checksum, bytes);
    if (g.code() == StatusCode::kDataLoss || g.code() == StatusCode::kInvalidArgument) return g;
    if (g.ok() || IsDedup(g)) {
      if (disk_ == nullptr) return g;
      Status d = disk_->Insert(key, tokens, checksum, bytes);
      if (d.ok() || IsDedup(d)) return IsDedup(g) && IsDedup(d) ? g : Status::Ok();
      if (KeepInHost(d)) return g;  // in the GPU tier only while disk writes are stopped
      if (g.ok()) gpu_->Remove(key).IgnoreError();  // not durable: not acknowledged either
      return d.WithContext("insert of " + key.ToString());
    }
    // No room even after demoting, or the device failed: the host path below.
    KVD_LOG(WARNING) << "gpu tier could not take a chunk; storing it in host"
                     << Kv("key", key.ToString()) << Kv("status", g);
  }
  if (disk_ == nullptr) return host_->Insert(key, tokens, checksum, bytes);
  Status d = disk_->Insert(key, tokens, checksum, bytes);
  if (KeepInHost(d)) return host_->Insert(key, tokens, checksum, bytes);
  if (!d.ok() && !IsDedup(d)) return d.WithContext("insert of " + key.ToString());
  Status h = host_->Insert(key, tokens, checksum, bytes);
  if (IsDedup(h)) host_->MarkDurable(key);  // a host copy committed pending: on disk now
  if (h.ok() || IsDedup(h)) return IsDedup(d) && IsDedup(h) ? h : Status::Ok();
  if (h.code() == StatusCode::kResourceExhausted) return Status::Ok();  // durable on disk
  return h;
}

Status TierManager::PromoteToHost(Tier& from, const ChunkKey& key) {
  KVD_ASSIGN_OR_RETURN(ChunkMeta meta, from.Describe(key));
  // Read straight into the host arena: reserve, fill from the tier (verified), commit (verified).
  KVD_ASSIGN_OR_RETURN(Reservation r, host_->Reserve(key, meta.size_bytes, meta.tokens, 0));
  auto read = from.ReadInto(key, std::span<std::byte>(r.data, r.size_bytes));
  if (!read.ok()) {
    host_->Abort(r.id).IgnoreError();  // our own open reservation
    return read.status();
  }
  Status s = host_->Commit(r.id, read->checksum);
  if (!s.ok() && !IsDedup(s)) return s;
  std::lock_guard<std::mutex> lock(counters_mu_);
  promotions_++;
  return Status::Ok();
}

StatusOr<LookupResult> TierManager::Lookup(const LookupRequest& request) {
  const bool from_disk = disk_ != nullptr && options_.promote_on_hit;
  if (!from_disk && gpu_ == nullptr) return host_->Lookup(request);
  // Walk the prefix: chunks in host are pinned by a short read, disk-only ones are promoted
  // (and then pinned), so promoting chunk i cannot evict chunks 0..i-1 of the same prefix.
  // Up to the first repeated hash, where HostTier::Lookup ends the prefix too.
  std::vector<ReadId> pins;
  const size_t distinct = DistinctPrefix(request.chunk_hashes);
  for (size_t i = 0; i < distinct; ++i) {
    const ChunkKey key = request.KeyAt(i);
    auto view = host_->GetByKey(key, request.owner);
    if (!view.ok()) {
      Tier* from = nullptr;
      if (gpu_ != nullptr && gpu_->Touch(key)) {
        from = gpu_;  // copied down for the serve path; the GPU keeps it
      } else if (from_disk && disk_->Contains(key)) {
        from = disk_;
      } else {
        break;
      }
      if (Status p = PromoteToHost(*from, key); !p.ok() && !IsDedup(p)) {
        // No room in host, or corrupt / unreadable in that tier: the prefix ends here.
        {
          std::lock_guard<std::mutex> lock(counters_mu_);
          promote_failures_++;
          if (p.code() != StatusCode::kResourceExhausted) promote_errors_++;
        }
        KVD_LOG(WARNING) << "copy into host failed; lookup prefix shortened"
                         << Kv("from", TierKindName(from->kind())) << Kv("key", key.ToString())
                         << Kv("status", p);
        break;
      }
      view = host_->GetByKey(key, request.owner);
      if (!view.ok()) break;
    } else if (gpu_ != nullptr && options_.promote_on_hit && !gpu_->Touch(key) &&
               gpu_->HasRoomFor(view->meta.size_bytes)) {
      // A host hit goes up into the GPU tier when it has room now (best effort), unless its
      // host copy changed after the commit: then it is dropped and the prefix ends here.
      if (!VerifyLeavingHost(*view, "gpu")) break;
      gpu_->Insert(key, view->meta.tokens, view->meta.checksum,
                   std::span<const std::byte>(view->data, view->meta.size_bytes))
          .IgnoreError();
    }
    pins.push_back(view->read_id);
  }
  StatusOr<LookupResult> result = host_->Lookup(request);       // the lease pins what it matched
  for (ReadId id : pins) host_->ReleaseRead(id).IgnoreError();  // our own live reads
  return result;
}

StatusOr<DemoteResult> TierManager::MaybeDemote() {
  DemoteResult out;
  std::lock_guard<std::mutex> pass(demote_mu_);
  if (gpu_ != nullptr && gpu_->Occupancy() > options_.high_watermark) {
    while (gpu_->Occupancy() > options_.low_watermark) {
      const std::vector<ChunkMeta> lru = gpu_->LeastRecentlyUsed(1);
      if (lru.empty() || !DemoteFromGpu(lru.front()).ok()) break;  // all read, or host full
      out.gpu_demoted++;
    }
  }
  out.occupancy_before = host_->Occupancy();
  out.occupancy_after = out.occupancy_before;
  if (disk_ == nullptr || out.occupancy_before <= options_.high_watermark) return out;
  // Stopped disk writes: the host copies are the only ones of some chunks; none is dropped.
  if (disk_->writes_stopped()) return out;
  while (host_->Occupancy() > options_.low_watermark) {
    const std::vector<ChunkMeta> batch = host_->LeastRecentlyUsed(16);
    if (batch.empty()) break;  // everything left is pinned
    bool progressed = false;
    for (const ChunkMeta& m : batch) {
      if (host_->Occupancy() <= options_.low_watermark) break;
      if (!disk_->Contains(m.key)) {  // written through already in the common case
        auto view = host_->GetByKey(m.key, 0);
        if (!view.ok()) {
          out.skipped++;
          continue;
        }
        if (!VerifyLeavingHost(*view, "disk")) {
          out.corrupt_dropped++;
          progressed = true;  // its space is free (or will be at its last unpin)
          continue;
        }
        Status s = disk_->Insert(m.key, view->meta.tokens, view->meta.checksum,
                                 std::span<const std::byte>(view->data, view->meta.size_bytes));
        host_->ReleaseRead(view->read_id).IgnoreError();  // our own live read
        if (!s.ok() && !IsDedup(s)) {
          out.occupancy_after = host_->Occupancy();
          return s.WithContext("demote " + m.key.ToString());
        }
      }
      // Copied: drop it from host unless somebody pinned it meanwhile (then it stays in both).
      if (host_->Remove(m.key).ok()) {
        out.demoted++;
        out.bytes += m.size_bytes;
        progressed = true;
      } else {
        out.skipped++;
      }
    }
    if (!progressed) break;
  }
  out.occupancy_after = host_->Occupancy();
  std::lock_guard<std::mutex> lock(counters_mu_);
  demotions_ += out.demoted;
  return out;
}

std::vector<ChunkMeta> TierManager::List(const ChunkFilter& filter, size_t limit) const {
  // A chunk with copies in two tiers (host + its disk copy, GPU + host) is listed once, as the
  // highest tier's copy; the limit counts distinct chunks.
  std::vector<ChunkMeta> out;
  std::unordered_set<ChunkKey, ChunkKeyHasher> seen;
  for (const Tier* t : {static_cast<const Tier*>(gpu_), static_cast<const Tier*>(host_),
                        static_cast<const Tier*>(disk_)}) {
    if (t == nullptr) continue;
    for (ChunkMeta& m : t->List(filter, 0)) {
      if (limit != 0 && out.size() >= limit) return out;
      if (seen.insert(m.key).second) out.push_back(std::move(m));
    }
  }
  return out;
}

EvictResult TierManager::Evict(const ChunkFilter& filter) {
  // Per chunk, so that a chunk with copies in two tiers counts once. The lower tiers go first:
  // once the disk and GPU copies are gone, a concurrent lookup cannot copy the chunk back into
  // host between the removals.
  EvictResult out;
  for (const ChunkMeta& m : List(filter, 0)) {
    const ChunkFilter one = ChunkFilter::Key(m.key);
    bool deferred = false, removed = false;
    for (Tier* t :
         {static_cast<Tier*>(disk_), static_cast<Tier*>(gpu_), static_cast<Tier*>(host_)}) {
      if (t == nullptr) continue;
      const EvictResult r = t->Evict(one);
      deferred = deferred || r.deferred > 0;
      removed = removed || r.evicted > 0;
    }
    if (deferred) {
      out.deferred++;  // hidden now, its pinned copy freed at the last unpin
    } else if (removed) {
      out.evicted++;
      out.bytes += m.size_bytes;
    }
  }
  return out;
}

std::vector<TierStats> TierManager::GetStats() const {
  std::vector<TierStats> out;
  if (gpu_ != nullptr) out.push_back(gpu_->GetStats());
  out.push_back(host_->GetStats());
  if (disk_ != nullptr) out.push_back(disk_->GetStats());
  return out;
}

void TierManager::SetEventListener(ChunkEventListener* listener) {
  host_->SetEventListener(listener);
  if (disk_ != nullptr) disk_->SetEventListener(listener);
  if (gpu_ != nullptr) gpu_->SetEventListener(listener);
}

uint64_t TierManager::promotions() const {
  std::lock_guard<std::mutex> lock(counters_mu_);
  return promotions_;
}

uint64_t TierManager::promote_failures() const {
  std::lock_guard<std::mutex> lock(counters_mu_);
  return promote_failures_;
}

uint64_t TierManager::promote_errors() const {
  std::lock_guard<std::mutex> lock(counters_mu_);
  return promote_errors_;
}

uint64_t TierManager::gpu_skipped() const {
  std::lock_guard<std::mutex> lock(counters_mu_);
  return gpu_skipped_;
}

uint64_t TierManager::host_corrupt_dropped() const {
  std::lock_guard<std::mutex> lock(counters_mu_);
  return host_corrupt_dropped_;
}

uint64_t TierManager::demotions() const {
  std::lock_guard<std::mutex> lock(counters_mu_);
  return demotions_;
}

}  // namespace kvd::storage
