// GpuTier (see gpu_tier.h): an index of chunks in one device allocation, an LRU list, pins for
// reads in flight. Inserts copy under the tier's lock (a chunk is published only once its bytes
// are on the device); reads pin and copy without it.
#include "kvd/storage/gpu_tier.h"

#include <algorithm>
#include <functional>
#include <list>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "kvd/common/hash.h"
#include "kvd/storage/arena.h"

namespace kvd::storage {
namespace {

struct GpuEntry {
  ChunkMeta meta;
  uint64_t offset = 0;
  uint32_t pins = 0;    // reads copying out of it
  bool visible = true;  // false once evicted while pinned: freed at the last unpin
  std::list<GpuEntry*>::iterator lru_it;  // valid iff visible
};

}  // namespace

Status GpuTierOptions::Validate() const {
  if (capacity_bytes == 0) {
    return Status::InvalidArgument("tiers.gpu.capacity must be > 0 (the device allocation)");
  }
  if (alignment < 8 || alignment > (1u << 20) || (alignment & (alignment - 1)) != 0) {
    return Status::InvalidArgument(
        "GpuTierOptions.alignment must be a power of two in [8, 1 MiB], got " +
        std::to_string(alignment));
  }
  if (capacity_bytes < alignment) {
    return Status::InvalidArgument("tiers.gpu.capacity (" + std::to_string(capacity_bytes) +
                                   " bytes) is below one alignment unit (" +
                                   std::to_string(alignment) + ")");
  }
  if (max_chunk_bytes > capacity_bytes) {
    return Status::InvalidArgument("GpuTierOptions.max_chunk_bytes (" +
                                   std::to_string(max_chunk_bytes) + ") exceeds capacity_bytes (" +
                                   std::to_string(capacity_bytes) + ")");
  }
  return Status::Ok();
}

class GpuTier::Impl {
 public:
  Impl(const GpuTierOptions& o, std::unique_ptr<DeviceMemory> d, Clock* c, std::byte* b)
      : options(o), device(std::move(d)), clock(c), base(b), arena(o.capacity_bytes, o.alignment) {}
  ~Impl() { device->Free(base).IgnoreError(); }

  // REQUIRE mu held.
  void FreeEntryLocked(GpuEntry* e) {
    arena.Free(e->offset).IgnoreError();  // our own block
  }
  void EmitLocked(ChunkEventKind kind, RemoveReason reason, const ChunkMeta& meta) const {
    if (events != nullptr) events->OnChunkEvent(MakeChunkEvent(kind, reason, TierKind::kGpu, meta));
  }
  void EraseVisibleLocked(GpuEntry* e, RemoveReason reason) {
    EmitLocked(ChunkEventKind::kRemoved, reason, e->meta);
    lru.erase(e->lru_it);
    auto it = index.find(e->meta.key);
    if (e->pins > 0) {  // a read is copying out of it: free at its unpin
      e->visible = false;
      hidden.insert(std::move(it->second));
    } else {
      FreeEntryLocked(e);
    }
    index.erase(it);
  }
  void TouchLocked(GpuEntry* e) {
    lru.splice(lru.begin(), lru, e->lru_it);
    e->meta.last_access_ns = clock->NowNanos();
  }
  std::string FullMessageLocked(uint64_t bytes) const {
    uint64_t pinned = 0;
    for (const auto& [k, e] : index) pinned += e->pins > 0 ? e->meta.size_bytes : 0;
    return "gpu tier on " + device->Describe() + " has no free block of " +
           std::to_string(arena.RoundUp(bytes)) + " bytes (capacity " +
           std::to_string(arena.capacity()) + ", allocated " +
           std::to_string(arena.allocated_bytes()) + ", pinned " + std::to_string(pinned) +
           "): demote to host first";
  }

  // Pins `key` for a copy out. REQUIRES capacity check by the caller's size.
  StatusOr<GpuEntry*> PinForRead(const ChunkKey& key, uint64_t capacity) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = index.find(key);
    if (it == index.end()) return Status::NotFound("chunk not in the gpu tier: " + key.ToString());
    GpuEntry* e = it->second.get();
    if (capacity < e->meta.size_bytes) {
      return Status::OutOfRange("read buffer of " + std::to_string(capacity) +
                                " bytes is smaller than the chunk (" +
                                std::to_string(e->meta.size_bytes) + " bytes)");
    }
    e->pins++;
    TouchLocked(e);
    return e;
  }
  // Unpins; `corrupt` drops the chunk (DATA_LOSS seen by the reader).
  void Unpin(GpuEntry* e, bool corrupt) {
    std::lock_guard<std::mutex> lock(mu);
    e->pins--;
    if (corrupt) {
      checksum_failures++;
      if (e->visible) {  // frees it now if this was the last pin, else at the last unpin
        EraseVisibleLocked(e, RemoveReason::kCorrupt);
        return;
      }
    }
    if (!e->visible && e->pins == 0) {
      FreeEntryLocked(e);
      for (auto it = hidden.begin(); it != hidden.end(); ++it) {
        if (it->get() == e) {
          hidden.erase(it);
          break;
        }
      }
    }
  }

  Status InsertCopy(const ChunkKey& key, uint32_t tokens, uint64_t checksum, uint64_t bytes,
                    const std::function<Status(void* dst)>& copy) {
    if (bytes == 0) return Status::InvalidArgument("gpu tier: empty chunk " + key.ToString());
    if (key.model.empty()) return Status::InvalidArgument("gpu tier: chunk key without a model");
    if (options.max_chunk_bytes != 0 && bytes > options.max_chunk_bytes) {
      return Status::InvalidArgument("chunk of " + std::to_string(bytes) +
                                     " bytes exceeds the gpu tier's max_chunk_bytes (" +
                                     std::to_string(options.max_chunk_bytes) + ")");
    }
    std::lock_guard<std::mutex> lock(mu);
    if (index.count(key) != 0) {
      dedup_puts++;
      return DedupStatus(key.ToString() + " is already in the gpu tier");
    }
    std::optional<uint64_t> offset = arena.Allocate(bytes);
    if (!offset) return Status::ResourceExhausted(FullMessageLocked(bytes));
    Status s = copy(base + *offset);
    if (!s.ok()) {
      arena.Free(*offset).IgnoreError();
      return s.WithContext("gpu tier insert of " + key.ToString());
    }
    auto e = std::make_unique<GpuEntry>();
    e->meta.key = key;
    e->meta.tokens = tokens;
    e->meta.size_bytes = bytes;
    e->meta.checksum = checksum;
    e->meta.created_ns = e->meta.last_access_ns = clock->NowNanos();
    e->meta.tier = TierKind::kGpu;
    e->offset = *offset;
    lru.push_front(e.get());
    e->lru_it = lru.begin();
    EmitLocked(ChunkEventKind::kStored, RemoveReason::kNone, e->meta);
    index.emplace(key, std::move(e));
    commits++;
    return Status::Ok();
  }

  const GpuTierOptions options;
  const std::unique_ptr<DeviceMemory> device;
  Clock* const clock;
  std::byte* const base;  // device address of the one allocation

  mutable std::mutex mu;
  ArenaAllocator arena;                                                           // GUARDED_BY(mu)
  std::unordered_map<ChunkKey, std::unique_ptr<GpuEntry>, ChunkKeyHasher> index;  // GUARDED_BY(mu)
  std::list<GpuEntry*> lru;                              // most recent first; GUARDED_BY(mu)
  std::unordered_set<std::unique_ptr<GpuEntry>> hidden;  // evicted while pinned; GUARDED_BY(mu)
  uint64_t lookups = 0, hits = 0, misses = 0, evictions = 0, admin_evictions = 0, commits = 0,
           dedup_puts = 0, checksum_failures = 0;  // GUARDED_BY(mu)
  ChunkEventListener* events = nullptr;            // GUARDED_BY(mu); set before concurrent use
};

StatusOr<std::unique_ptr<GpuTier>> GpuTier::Create(const GpuTierOptions& options,
                                                   std::unique_ptr<DeviceMemory> device,
                                                   Clock* clock) {
  KVD_RETURN_IF_ERROR(options.Validate());
  if (device == nullptr) return Status::InvalidArgument("gpu tier: no device memory");
  KVD_ASSIGN_OR_RETURN(void* base, device->Allocate(options.capacity_bytes));
  auto impl = std::make_unique<Impl>(options, std::move(device), clock ? clock : Clock::Real(),
                                     static_cast<std::byte*>(base));
  return std::unique_ptr<GpuTier>(new GpuTier(std::move(impl)));
}

GpuTier::GpuTier(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GpuTier::~GpuTier() = default;

Status GpuTier::Insert(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                       std::span<const std::byte> bytes) {
  if (!bytes.empty()) {
    const uint64_t actual = Checksum64(bytes.data(), bytes.size());
    if (actual != checksum) {
      std::lock_guard<std::mutex> lock(impl_->mu);
      impl_->checksum_failures++;
      return Status::DataLoss("gpu tier insert of " + key.ToString() + ": checksum " +
                              std::to_string(actual) +
                              " of the bytes != " + std::to_string(checksum) + " given");
    }
  }
  return impl_->InsertCopy(key, tokens, checksum, bytes.size(), [&](void* dst) {
    return impl_->device->CopyToDevice(dst, bytes.data(), bytes.size());
  });
}

Status GpuTier::InsertFromDevice(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                                 const void* device_src, uint64_t bytes) {
  if (device_src == nullptr && bytes > 0) {
    return Status::InvalidArgument("gpu tier: null device source for " + key.ToString());
  }
  return impl_->InsertCopy(key, tokens, checksum, bytes, [&](void* dst) {
    return impl_->device->CopyOnDevice(dst, device_src, bytes);
  });
}

StatusOr<ChunkMeta> GpuTier::ReadInto(const ChunkKey& key, std::span<std::byte> out) {
  KVD_ASSIGN_OR_RETURN(GpuEntry * e, impl_->PinForRead(key, out.size()));
  const ChunkMeta meta = e->meta;  // immutable while pinned
  Status s = impl_->device->CopyToHost(out.data(), impl_->base + e->offset, meta.size_bytes);
  bool corrupt = false;
  if (s.ok() && impl_->options.verify_checksums) {
    const uint64_t actual = Checksum64(out.data(), meta.size_bytes);
    if (actual != meta.checksum) {
      corrupt = true;
      s = Status::DataLoss("gpu tier copy of " + key.ToString() + " is corrupt (checksum " +
                           std::to_string(actual) + ", stored " + std::to_string(meta.checksum) +
                           "): dropped");
    }
  }
  impl_->Unpin(e, corrupt);
  if (!s.ok()) return s;
  return meta;
}

StatusOr<ChunkMeta> GpuTier::ReadIntoDevice(const ChunkKey& key, void* device_dst,
                                            uint64_t capacity) {
  if (device_dst == nullptr) return Status::InvalidArgument("gpu tier: null device destination");
  KVD_ASSIGN_OR_RETURN(GpuEntry * e, impl_->PinForRead(key, capacity));
  const ChunkMeta meta = e->meta;
  Status s = impl_->device->CopyOnDevice(device_dst, impl_->base + e->offset, meta.size_bytes);
  impl_->Unpin(e, false);
  if (!s.ok()) return s;
  return meta;
}

StatusOr<ChunkMeta> GpuTier::Describe(const ChunkKey& key) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->index.find(key);
  if (it == impl_->index.end()) {
    return Status::NotFound("chunk not in the gpu tier: " + key.ToString());
  }
  return it->second->meta;
}

Status GpuTier::Remove(const ChunkKey& key) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->index.find(key);
  if (it == impl_->index.end()) {
    return Status::NotFound("chunk not in the gpu tier: " + key.ToString());
  }
  if (it->second->pins > 0) {
    return Status::FailedPrecondition("gpu tier chunk " + key.ToString() + " is being read");
  }
  impl_->EraseVisibleLocked(it->second.get(), RemoveReason::kMoved);
  return Status::Ok();
}

std::vector<ChunkMeta> GpuTier::List(const ChunkFilter& filter, size_t limit) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<ChunkMeta> out;
  for (const GpuEntry* e : impl_->lru) {
    if (limit != 0 && out.size() >= limit) break;
    if (filter.Matches(e->meta.key)) out.push_back(e->meta);
  }
  return out;
}

EvictResult GpuTier::Evict(const ChunkFilter& filter) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  EvictResult out;
  std::vector<GpuEntry*> victims;
  if (filter.key) {  // one chunk: no scan
    auto it = impl_->index.find(*filter.key);
    if (it != impl_->index.end() && filter.Matches(it->first)) victims.push_back(it->second.get());
  } else {
    for (GpuEntry* e : impl_->lru) {
      if (filter.Matches(e->meta.key)) victims.push_back(e);
    }
  }
  for (GpuEntry* e : victims) {
    if (e->pins > 0) {
      out.deferred++;
    } else {
      out.evicted++;
      out.bytes += e->meta.size_bytes;
    }
    impl_->admin_evictions++;
    impl_->EraseVisibleLocked(e, RemoveReason::kAdmin);
  }
  return out;
}

void GpuTier::SetEventListener(ChunkEventListener* listener) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->events = listener;
}

TierStats GpuTier::GetStats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  TierStats s;
  s.kind = TierKind::kGpu;
  s.capacity_bytes = impl_->arena.capacity();
  s.arena_allocated_bytes = impl_->arena.allocated_bytes();
  for (const auto& [key, e] : impl_->index) {
    s.used_bytes += e->meta.size_bytes;
    if (e->pins > 0) s.pinned_bytes += e->meta.size_bytes;
    s.chunk_count++;
    for (UsageStats* u : {&s.per_model[key.model], &s.per_namespace[key.name_space]}) {
      u->chunks++;
      u->bytes += e->meta.size_bytes;
      u->tokens += e->meta.tokens;
    }
  }
  s.reads_open = 0;
  for (const auto& [key, e] : impl_->index) s.reads_open += e->pins;
  for (const auto& e : impl_->hidden) s.reads_open += e->pins;
  s.lookups = impl_->lookups;
  s.hits = impl_->hits;
  s.misses = impl_->misses;
  s.chunks_requested = impl_->lookups;
  s.chunks_matched = impl_->hits;
  s.evictions = impl_->evictions;
  s.admin_evictions = impl_->admin_evictions;
  s.commits = impl_->commits;
  s.dedup_puts = impl_->dedup_puts;
  s.checksum_failures = impl_->checksum_failures;
  s.fragmentation = impl_->arena.Stats().fragmentation;
  return s;
}

bool GpuTier::Contains(const ChunkKey& key) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->index.count(key) != 0;
}

bool GpuTier::Touch(const ChunkKey& key) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->lookups++;
  auto it = impl_->index.find(key);
  if (it == impl_->index.end()) {
    impl_->misses++;
    return false;
  }
  impl_->hits++;
  impl_->TouchLocked(it->second.get());
  return true;
}

std::vector<ChunkMeta> GpuTier::LeastRecentlyUsed(size_t max_chunks) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<ChunkMeta> out;
  for (auto it = impl_->lru.rbegin(); it != impl_->lru.rend() && out.size() < max_chunks; ++it) {
    if ((*it)->pins == 0) out.push_back((*it)->meta);
  }
  return out;
}

double GpuTier::Occupancy() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return static_cast<double>(impl_->arena.allocated_bytes()) /
         static_cast<double>(std::max<uint64_t>(impl_->arena.capacity(), 1));
}

bool GpuTier::HasRoomFor(uint64_t bytes) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->arena.CanAllocate(bytes);
}

bool GpuTier::CanEverHold(uint64_t bytes) const {
  const GpuTierOptions& o = impl_->options;
  if (bytes == 0 || (o.max_chunk_bytes != 0 && bytes > o.max_chunk_bytes)) return false;
  std::lock_guard<std::mutex> lock(impl_->mu);  // the arena is guarded (its sizes are fixed)
  return impl_->arena.RoundUp(bytes) <= impl_->arena.capacity();
}

void GpuTier::CountDemotion() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->evictions++;
}

std::string GpuTier::device_name() const { return impl_->device->Describe(); }
uint64_t GpuTier::capacity_bytes() const { return impl_->arena.capacity(); }

}  // namespace kvd::storage
