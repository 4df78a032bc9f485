#include "kvd/storage/tier_manager.h"

#include <algorithm>
#include <optional>
#include <string>
#include <unordered_set>

#include "kvd/common/hash.h"
#include "kvd/common/logging.h"

namespace kvd::storage {

namespace {

std::string TierName(const Tier& tier) { return std::string(TierKindName(tier.kind())); }

}  // namespace

StatusOr<std::unique_ptr<TierManager>> TierManager::Create(const TierManagerOptions& options,
                                                           std::vector<Tier*> tiers) {
  KVD_RETURN_IF_ERROR(options.Validate());
  std::optional<size_t> serving;
  std::unordered_set<const Tier*> seen;
  for (size_t i = 0; i < tiers.size(); ++i) {
    const Tier* t = tiers[i];
    const std::string at = "tier manager: tier " + std::to_string(i);
    if (t == nullptr) return Status::InvalidArgument(at + " is null");
    if (!seen.insert(t).second) return Status::InvalidArgument(at + " is listed twice");
    if (!t->serves_in_place()) continue;
    if (serving) return Status::InvalidArgument(at + ": a second tier that serves in place");
    if (dynamic_cast<const HostTier*>(t) == nullptr) {
      return Status::InvalidArgument(at + " serves in place but is not a HostTier");
    }
    serving = i;
  }
  if (!serving) return Status::InvalidArgument("tier manager: a host tier is required");
  for (size_t i = 0; i < *serving; ++i) {
    if (tiers[i]->durable()) {
      return Status::InvalidArgument("tier manager: tier " + std::to_string(i) + " (" +
                                     TierName(*tiers[i]) + ") is durable but above host");
    }
  }
  return std::unique_ptr<TierManager>(new TierManager(options, std::move(tiers), *serving));
}

TierManager::TierManager(const TierManagerOptions& options, std::vector<Tier*> tiers,
                         size_t serving)
    : options_(options),
      tiers_(std::move(tiers)),
      host_(static_cast<HostTier*>(tiers_[serving])),
      above_(tiers_.begin(), tiers_.begin() + static_cast<std::ptrdiff_t>(serving)),
      below_(tiers_.begin() + static_cast<std::ptrdiff_t>(serving) + 1, tiers_.end()) {
  for (Tier* t : below_) {
    if (t->durable()) durable_.push_back(t);
  }
  for (Tier* t : tiers_) {
    if (disk_ == nullptr) disk_ = dynamic_cast<DiskTier*>(t);
    if (gpu_ == nullptr) gpu_ = dynamic_cast<GpuTier*>(t);
  }
}

Status TierManager::Commit(ReservationId id, uint64_t checksum, CommitCheck check) {
  if (durable_.empty()) return host_->Commit(id, checksum, check);
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
  bool host_only = false;  // KeepInHost: as durable as the disk's state allows (host only)
  Status d = WriteThrough(key, pinned.meta.tokens, pinned.meta.checksum,
                          std::span<const std::byte>(pinned.data, pinned.meta.size_bytes),
                          /*only_missing=*/!s.ok(), &host_only);
  host_->ReleaseRead(pinned.read_id).IgnoreError();  // our own live read
  if (d.ok() || IsDedup(d)) {
    host_->MarkDurable(key);
    return s;
  }
  if (!s.ok()) return d.WithContext("write-through of the already stored " + key.ToString());
  // Not durable: not acknowledged either. Take it back out of host unless a reader pinned it.
  host_->Remove(key).IgnoreError();
  return d.WithContext("write-through of " + key.ToString() + " to the disk tier");
}

Status TierManager::WriteThrough(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                                 std::span<const std::byte> bytes, bool only_missing,
                                 bool* host_only) {
  Status dedup = Status::Ok();
  bool all_dedup = true;
  for (Tier* t : durable_) {
    if (only_missing && t->Contains(key)) {
      all_dedup = false;
      continue;
    }
    Status w = t->Insert(key, tokens, checksum, bytes);
    if (IsDedup(w)) {
      dedup = std::move(w);
      continue;
    }
    all_dedup = false;
    if (KeepInHost(*t, w)) {
      *host_only = true;
    } else if (!w.ok()) {
      return w;
    }
  }
  return all_dedup ? dedup : Status::Ok();
}

bool TierManager::KeepInHost(const Tier& tier, const Status& write) const {
  return !write.ok() && !IsDedup(write) && tier.writes_stopped() &&
         options_.on_disk_error == TierManagerOptions::OnDiskError::kKeepInHost;
}

Status TierManager::InsertAbove(Tier& above, const ChunkKey& key, uint32_t tokens,
                                uint64_t checksum, std::span<const std::byte> bytes) {
  while (!above.HasRoomFor(bytes.size())) {
    const std::vector<ChunkMeta> lru = above.LeastRecentlyUsed(1);
    if (lru.empty()) break;  // everything left is being read: Insert says RESOURCE_EXHAUSTED
    KVD_RETURN_IF_ERROR(DemoteToHost(above, lru.front()));
  }
  return above.Insert(key, tokens, checksum, bytes);
}

Status TierManager::PromoteFromDevice(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                                      const void* device_src, uint64_t bytes) {
  auto device = std::find_if(above_.begin(), above_.end(),
                             [](const Tier* t) { return t->kind() == TierKind::kGpu; });
  if (device == above_.end()) return Status::FailedPrecondition("no gpu tier");
  Tier& gpu = **device;
  if (gpu.Contains(key)) return Status::AlreadyExists(key.ToString() + " is in the gpu tier");
  if (!gpu.HasRoomFor(bytes)) {
    return Status::ResourceExhausted("the gpu tier has no room for " + std::to_string(bytes) +
                                     " bytes now");
  }
  return gpu.InsertFromDevice(key, tokens, checksum, device_src, bytes);
}

Status TierManager::DemoteToHost(Tier& above, const ChunkMeta& meta) {
  // Through a host reservation: the tier copies straight into the host arena (verified), and
  // Commit verifies again; only then does the upper copy go.
  Status moved = PromoteToHost(above, meta.key);
  if (!moved.ok() && !IsDedup(moved)) {
    return moved.WithContext("demote from the " + TierName(above) + " tier");
  }
  Status r = above.Remove(meta.key);
  if (!r.ok()) return r;  // being read (FAILED_PRECONDITION) or already gone: not a demotion
  above.CountDemotion();
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
  for (Tier* above : above_) {
    if (!bytes.empty() && !above->CanEverHold(bytes.size())) {
      // Demoting would empty the tier and still not make room: the next tier (host) directly.
      std::lock_guard<std::mutex> lock(counters_mu_);
      if (gpu_skipped_++ == 0) {
        KVD_LOG(WARNING) << "a chunk is larger than a tier above host can ever hold; such chunks "
                            "are stored below it (counted in gpu_skipped)"
                         << Kv("tier", TierName(*above)) << Kv("key", key.ToString())
                         << Kv("bytes", bytes.size())
                         << Kv("capacity", above->GetStats().capacity_bytes);
      }
      continue;
    }
    if (host_->Describe(key).ok()) break;  // a dedup in host, below
    Status g = InsertAbove(*above, key, tokens, checksum, bytes);
    if (g.code() == StatusCode::kDataLoss || g.code() == StatusCode::kInvalidArgument) return g;
    if (g.ok() || IsDedup(g)) {
      if (durable_.empty()) return g;
      bool host_only = false;  // in the tier above only while disk writes are stopped
      Status d = WriteThrough(key, tokens, checksum, bytes, /*only_missing=*/false, &host_only);
      if (host_only) return g;
      if (d.ok() || IsDedup(d)) return IsDedup(g) && IsDedup(d) ? g : Status::Ok();
      if (g.ok()) above->Remove(key).IgnoreError();  // not durable: not acknowledged either
      return d.WithContext("insert of " + key.ToString());
    }
    // No room even after demoting, or the device failed: the host path below.
    KVD_LOG(WARNING) << "tier above host could not take a chunk; storing it below"
                     << Kv("tier", TierName(*above)) << Kv("key", key.ToString())
                     << Kv("status", g);
  }
  if (durable_.empty()) return host_->Insert(key, tokens, checksum, bytes);
  bool host_only = false;
  Status d = WriteThrough(key, tokens, checksum, bytes, /*only_missing=*/false, &host_only);
  if (host_only) return host_->Insert(key, tokens, checksum, bytes);
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

Tier* TierManager::FindForLookup(const ChunkKey& key) {
  for (Tier* t : above_) {
    if (t->Touch(key)) return t;  // copied down for the serve path; the tier keeps it
  }
  if (!options_.promote_on_hit) return nullptr;
  for (Tier* t : below_) {
    if (t->Contains(key)) return t;
  }
  return nullptr;
}

StatusOr<LookupResult> TierManager::Lookup(const LookupRequest& request) {
  const bool from_below = !below_.empty() && options_.promote_on_hit;
  if (!from_below && above_.empty()) {
    StatusOr<LookupResult> result = host_->Lookup(request);
    if (result.ok()) result->found_in.assign(result->matched_chunks, TierKind::kHost);
    return result;
  }
  // Walk the prefix: chunks in host are pinned by a short read, others are promoted (and then
  // pinned), so promoting chunk i cannot evict chunks 0..i-1 of the same prefix.
  // Up to the first repeated hash, where HostTier::Lookup ends the prefix too.
  std::vector<ReadId> pins;
  std::vector<TierKind> found_in;
  const size_t distinct = DistinctPrefix(request.chunk_hashes);
  for (size_t i = 0; i < distinct; ++i) {
    const ChunkKey key = request.KeyAt(i);
    auto view = host_->GetByKey(key, request.owner);
    TierKind origin = TierKind::kHost;
    if (!view.ok()) {
      Tier* from = FindForLookup(key);
      if (from == nullptr) break;
      origin = from->kind();
      if (Status p = PromoteToHost(*from, key); !p.ok() && !IsDedup(p)) {
        // No room in host, or corrupt / unreadable in that tier: the prefix ends here.
        {
          std::lock_guard<std::mutex> lock(counters_mu_);
          promote_failures_++;
          if (p.code() != StatusCode::kResourceExhausted) promote_errors_++;
        }
        KVD_LOG(WARNING) << "copy into host failed; lookup prefix shortened"
                         << Kv("from", TierName(*from)) << Kv("key", key.ToString())
                         << Kv("status", p);
        break;
      }
      view = host_->GetByKey(key, request.owner);
      if (!view.ok()) break;
    } else if (!above_.empty() && options_.promote_on_hit && !above_.back()->Touch(key) &&
               above_.back()->HasRoomFor(view->meta.size_bytes)) {
      // A host hit goes up into the tier right above host when it has room now (best effort),
      // unless its host copy changed after the commit: then it is dropped and the prefix ends.
      if (!VerifyLeavingHost(*view, TierName(*above_.back()).c_str())) break;
      above_.back()
          ->Insert(key, view->meta.tokens, view->meta.checksum,
                   std::span<const std::byte>(view->data, view->meta.size_bytes))
          .IgnoreError();
    }
    pins.push_back(view->read_id);
    found_in.push_back(origin);
  }
  StatusOr<LookupResult> result = host_->Lookup(request);       // the lease pins what it matched
  for (ReadId id : pins) host_->ReleaseRead(id).IgnoreError();  // our own live reads
  if (result.ok()) {
    found_in.resize(result->matched_chunks, TierKind::kHost);
    result->found_in = std::move(found_in);
  }
  return result;
}

StatusOr<DemoteResult> TierManager::MaybeDemote() {
  DemoteResult out;
  std::lock_guard<std::mutex> pass(demote_mu_);
  for (Tier* above : above_) {
    if (above->Occupancy() <= options_.high_watermark) continue;
    while (above->Occupancy() > options_.low_watermark) {
      const std::vector<ChunkMeta> lru = above->LeastRecentlyUsed(1);
      if (lru.empty() || !DemoteToHost(*above, lru.front()).ok()) break;  // all read / host full
      out.demoted_to_host++;
    }
  }
  out.occupancy_before = host_->Occupancy();
  out.occupancy_after = out.occupancy_before;
  if (below_.empty() || out.occupancy_before <= options_.high_watermark) return out;
  // Stopped disk writes: the host copies are the only ones of some chunks; none is dropped.
  for (const Tier* t : below_) {
    if (t->writes_stopped()) return out;
  }
  Status s = DemoteHost(*below_.front(), out);
  out.occupancy_after = host_->Occupancy();
  if (!s.ok()) return s;
  std::lock_guard<std::mutex> lock(counters_mu_);
  demotions_ += out.demoted;
  return out;
}

Status TierManager::DemoteHost(Tier& below, DemoteResult& out) {
  while (host_->Occupancy() > options_.low_watermark) {
    const std::vector<ChunkMeta> batch = host_->LeastRecentlyUsed(16);
    if (batch.empty()) break;  // everything left is pinned
    bool progressed = false;
    for (const ChunkMeta& m : batch) {
      if (host_->Occupancy() <= options_.low_watermark) break;
      if (!below.Contains(m.key)) {  // written through already in the common case
        auto view = host_->GetByKey(m.key, 0);
        if (!view.ok()) {
          out.skipped++;
          continue;
        }
        if (!VerifyLeavingHost(*view, TierName(below).c_str())) {
          out.corrupt_dropped++;
          progressed = true;  // its space is free (or will be at its last unpin)
          continue;
        }
        Status s = below.Insert(m.key, view->meta.tokens, view->meta.checksum,
                                std::span<const std::byte>(view->data, view->meta.size_bytes));
        host_->ReleaseRead(view->read_id).IgnoreError();  // our own live read
        if (!s.ok() && !IsDedup(s)) return s.WithContext("demote " + m.key.ToString());
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
  return Status::Ok();
}

std::vector<ChunkMeta> TierManager::List(const ChunkFilter& filter, size_t limit) const {
  // A chunk with copies in two tiers (host + its disk copy, GPU + host) is listed once, as the
  // highest tier's copy; the limit counts distinct chunks.
  std::vector<ChunkMeta> out;
  std::unordered_set<ChunkKey, ChunkKeyHasher> seen;
  for (const Tier* t : tiers_) {
    for (ChunkMeta& m : t->List(filter, 0)) {
      if (limit != 0 && out.size() >= limit) return out;
      if (seen.insert(m.key).second) out.push_back(std::move(m));
    }
  }
  return out;
}

std::vector<ChunkMeta> TierManager::ListCopies(const ChunkFilter& filter) const {
  std::vector<ChunkMeta> out;
  for (const Tier* t : tiers_) {
    std::vector<ChunkMeta> copies = t->List(filter, 0);
    out.insert(out.end(), std::make_move_iterator(copies.begin()),
               std::make_move_iterator(copies.end()));
  }
  return out;
}

EvictResult TierManager::Evict(const ChunkFilter& filter) {
  // Per chunk, so that a chunk with copies in two tiers counts once. The other tiers go first,
  // from the bottom up: once their copies are gone, a concurrent lookup cannot copy the chunk
  // back into host between the removals.
  std::vector<Tier*> order(below_.rbegin(), below_.rend());
  order.insert(order.end(), above_.rbegin(), above_.rend());
  order.push_back(host_);
  EvictResult out;
  for (const ChunkMeta& m : List(filter, 0)) {
    const ChunkFilter one = ChunkFilter::Key(m.key);
    bool deferred = false, removed = false;
    for (Tier* t : order) {
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
  for (const Tier* t : tiers_) out.push_back(t->GetStats());
  return out;
}

void TierManager::SetEventListener(ChunkEventListener* listener) {
  for (Tier* t : tiers_) t->SetEventListener(listener);
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
