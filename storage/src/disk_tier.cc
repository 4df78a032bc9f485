// DiskTier: RocksDB-backed chunk storage with an in-memory index rebuilt at open.
#include "kvd/storage/disk_tier.h"

#include <rocksdb/cache.h>
#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/table.h>
#include <rocksdb/write_batch.h>

#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <list>
#include <mutex>
#include <set>
#include <string>
#include <system_error>
#include <unordered_map>
#include <unordered_set>

#include "disk_health.h"
#include "disk_repair.h"
#include "disk_tier_faults.h"
#include "key_codec.h"
#include "kvd/common/hash.h"
#include "kvd/common/logging.h"

namespace kvd::storage {
namespace {

constexpr char kMetaFamily[] = "meta";
constexpr char kStateFamily[] = "state";

Status FromRocks(const rocksdb::Status& s, std::string_view what) {
  if (s.ok()) return Status::Ok();
  if (s.IsCorruption()) {
    return Status::DataLoss("disk tier: " + std::string(what) + ": " + s.ToString());
  }
  return Status::Unavailable("disk tier: " + std::string(what) + ": " + s.ToString());
}

}  // namespace

class DiskTier::Impl {
 public:
  struct Entry {
    ChunkMeta meta;
    std::list<Entry*>::iterator lru_it;
  };

  ~Impl() { CloseDb(); }

  // Stops the resumer, then closes the database (if open) and forgets the index.
  void CloseDb() {
    resumer_.reset();
    if (db_ != nullptr) {
      for (auto* h : handles_) db_->DestroyColumnFamilyHandle(h).PermitUncheckedError();
    }
    handles_.clear();
    db_.reset();
    std::lock_guard<std::mutex> lock(mu_);
    lru_.clear();
    index_.clear();
    per_model_.clear();
    per_namespace_.clear();
    used_bytes_ = restored_ = quarantined_ = over_capacity_ = over_capacity_bytes_ = 0;
  }
  // Opens the database at options_.path (see OpenCheckingWal) and rebuilds the index from it.
  // A damaged database is the RocksDB status IsDamage says so of; other errors are Status.
  rocksdb::Status OpenAndIndex(const rocksdb::DBOptions& db_options,
                               const std::vector<rocksdb::ColumnFamilyDescriptor>& families);
  // Rebuilds the index from the metadata family. REQUIRES the database open.
  rocksdb::Status RebuildIndex();

  // REQUIRES mu_.
  void AddLocked(std::unique_ptr<Entry> e) {
    Entry* p = e.get();
    used_bytes_ += p->meta.size_bytes;
    Account(p->meta, true);
    lru_.push_front(p);
    p->lru_it = lru_.begin();
    index_.emplace(p->meta.key, std::move(e));
  }
  // REQUIRES mu_.
  void EmitLocked(ChunkEventKind kind, RemoveReason reason, const ChunkMeta& meta) const {
    if (events_ != nullptr) {
      events_->OnChunkEvent(MakeChunkEvent(kind, reason, TierKind::kDisk, meta));
    }
  }
  // Removes from the index and the database. REQUIRES mu_.
  Status DropLocked(Entry* e, RemoveReason reason) {
    EmitLocked(ChunkEventKind::kRemoved, reason, e->meta);
    const std::string k = codec::EncodeKey(e->meta.key);
    rocksdb::WriteBatch batch;
    batch.Delete(data_cf(), k);
    batch.Delete(meta_cf(), k);
    Status s = FromRocks(db_->Write(write_options_, &batch), "delete");
    used_bytes_ -= e->meta.size_bytes;
    Account(e->meta, false);
    lru_.erase(e->lru_it);
    index_.erase(e->meta.key);  // destroys e
    return s;
  }
  void Account(const ChunkMeta& m, bool add) {
    for (auto* map : {&per_model_, &per_namespace_}) {
      const std::string& name = map == &per_model_ ? m.key.model : m.key.name_space;
      UsageStats& u = (*map)[name];
      if (add) {
        u.chunks++;
        u.bytes += m.size_bytes;
        u.tokens += m.tokens;
      } else {
        u.chunks--;
        u.bytes -= m.size_bytes;
        u.tokens -= m.tokens;
        if (u.chunks == 0) map->erase(name);
      }
    }
  }
  // Insert's steps. CheckInsert: the arguments, the capacity, whether writes are stopped, the
  // checksum of `bytes`. ClaimWrite: claims the key and `size` bytes of space (evicting for it)
  // under mu_, waiting for a write of the same key in progress; DEDUP when the key is on disk.
  // WriteClaimed: writes the claimed chunk without mu_. FinishWrite: releases the claim and, when
  // `written` is OK, indexes the chunk.
  Status CheckInsert(const ChunkKey& key, uint64_t checksum, std::span<const std::byte> bytes);
  Status ClaimWrite(const ChunkKey& key, uint64_t size);
  Status WriteClaimed(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                      std::span<const std::byte> bytes);
  Status FinishWrite(const ChunkKey& key, uint32_t tokens, uint64_t checksum, uint64_t size,
                     const Status& written);

  rocksdb::ColumnFamilyHandle* data_cf() const { return handles_[0]; }
  rocksdb::ColumnFamilyHandle* meta_cf() const { return handles_[1]; }
  rocksdb::ColumnFamilyHandle* state_cf() const { return handles_[2]; }

  DiskTierOptions options_;
  Clock* clock_ = nullptr;
  std::unique_ptr<rocksdb::DB> db_;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;  // [default (data), meta, state]
  rocksdb::WriteOptions write_options_;
  rocksdb::ReadOptions read_options_;
  uint64_t restored_ = 0;
  uint64_t quarantined_ = 0;          // malformed metadata records skipped by Open
  uint64_t over_capacity_ = 0;        // records Open left unindexed: over capacity_bytes
  uint64_t over_capacity_bytes_ = 0;  // their payload bytes
  bool wal_damaged_ = false;          // Open replayed the logs up to damage
  DiskHealth health_;
  std::shared_ptr<DiskHealthListener> listener_;
  std::unique_ptr<DiskResumer> resumer_;  // while the database is open

  mutable std::mutex mu_;
  // Guarded by mu_:
  std::unordered_map<ChunkKey, std::unique_ptr<Entry>, ChunkKeyHasher> index_;
  std::list<Entry*> lru_;  // most recently used first
  uint64_t used_bytes_ = 0;
  std::unordered_set<ChunkKey, ChunkKeyHasher> pending_;  // keys being written without mu_
  uint64_t pending_bytes_ = 0;                            // their payload bytes
  std::condition_variable pending_done_;                  // notified when a key leaves pending_
  DiskWriteHook write_hook_;  // tests only (disk_tier_faults.h); set before concurrent use
  std::unordered_map<std::string, UsageStats> per_model_;
  std::unordered_map<std::string, UsageStats> per_namespace_;
  TierStats counters_;
  ChunkEventListener* events_ = nullptr;  // set before concurrent use (SetEventListener)
};

namespace {

rocksdb::DBOptions DatabaseOptions(const std::shared_ptr<rocksdb::EventListener>& listener) {
  rocksdb::DBOptions db_options;
  db_options.create_if_missing = true;
  db_options.create_missing_column_families = true;
  db_options.paranoid_checks = true;
  db_options.max_background_jobs = 2;
  // Flush data and metadata together, so that without a WAL a crash cannot leave metadata
  // without its value (or the reverse).
  db_options.atomic_flush = true;
  db_options.listeners.push_back(listener);
  return db_options;
}

std::vector<rocksdb::ColumnFamilyDescriptor> Families(const DiskTierOptions& options) {
  rocksdb::BlockBasedTableOptions table;
  table.block_cache = rocksdb::NewLRUCache(options.block_cache_bytes);
  rocksdb::ColumnFamilyOptions cf_options;
  cf_options.compression = rocksdb::kNoCompression;  // KV bytes barely compress; spend no CPU
  cf_options.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
  rocksdb::ColumnFamilyOptions data_options = cf_options;
  data_options.write_buffer_size = options.write_buffer_bytes;
  if (options.blob_files) {
    data_options.enable_blob_files = true;
    data_options.min_blob_size = 4096;
    data_options.blob_file_size = 256ull << 20;
    data_options.enable_blob_garbage_collection = true;
  }
  return {{rocksdb::kDefaultColumnFamilyName, data_options},
          {kMetaFamily, cf_options},
          {kStateFamily, cf_options}};
}

}  // namespace

rocksdb::Status DiskTier::Impl::OpenAndIndex(
    const rocksdb::DBOptions& db_options,
    const std::vector<rocksdb::ColumnFamilyDescriptor>& families) {
  CloseDb();
  OpenedDb opened;
  rocksdb::Status s = OpenCheckingWal(db_options, options_.path, families, &opened);
  if (!s.ok()) return s;
  db_.reset(opened.db);
  handles_ = std::move(opened.handles);
  wal_damaged_ = opened.wal_damaged;
  s = RebuildIndex();
  if (!s.ok()) {
    CloseDb();
    return s;
  }
  if (wal_damaged_) {
    KVD_LOG(ERROR) << "disk tier: damaged write-ahead log record; the logs were replayed up "
                      "to it and the records after it were dropped"
                   << Kv("path", options_.path) << Kv("rocksdb", opened.wal_damage);
  }
  resumer_ = std::make_unique<DiskResumer>(db_.get(), &health_, options_.resume_interval_ms,
                                           options_.max_resume_attempts);
  return s;
}

rocksdb::Status DiskTier::Impl::RebuildIndex() {
  const int64_t now = clock_->NowNanos();
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(read_options_, meta_cf()));
  std::lock_guard<std::mutex> lock(mu_);
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    StatusOr<ChunkKey> key = codec::DecodeKey(std::string_view(it->key().data(), it->key().size()));
    StatusOr<codec::MetaRecord> rec =
        key.ok() ? codec::DecodeMeta(std::string_view(it->value().data(), it->value().size()))
                 : StatusOr<codec::MetaRecord>(key.status());
    if (!rec.ok()) {
      // Quarantined: left in the database untouched (for inspection), not indexed, counted.
      // One bad record must not keep every good chunk from being served.
      if (quarantined_++ < 10) {
        KVD_LOG(WARNING) << "disk tier: malformed metadata record quarantined"
                         << Kv("path", options_.path) << Kv("key_bytes", it->key().size())
                         << Kv("status", rec.status());
      }
      continue;
    }
    if (used_bytes_ + rec->size_bytes > options_.capacity_bytes) {
      // The capacity was lowered since the chunk was written (or the chunk alone is larger than
      // it): indexing it would put used_bytes over capacity_bytes. Left in the database untouched
      // (an Open with room for it restores it), not served, counted and logged.
      over_capacity_bytes_ += rec->size_bytes;
      if (over_capacity_++ < 10) {
        KVD_LOG(WARNING) << "disk tier: chunk over the capacity left in the database, not served"
                         << Kv("path", options_.path) << Kv("key", key->ToString())
                         << Kv("bytes", rec->size_bytes) << Kv("used_bytes", used_bytes_)
                         << Kv("capacity", options_.capacity_bytes);
      }
      continue;
    }
    auto e = std::make_unique<Entry>();
    e->meta.key = std::move(*key);
    e->meta.tokens = rec->tokens;
    e->meta.size_bytes = rec->size_bytes;
    e->meta.checksum = rec->checksum;
    e->meta.created_ns = now;
    e->meta.last_access_ns = now;
    e->meta.tier = TierKind::kDisk;
    AddLocked(std::move(e));
    restored_++;
  }
  if (!it->status().ok()) return it->status();
  if (over_capacity_ > 0) {
    KVD_LOG(WARNING) << "disk tier: chunks found on disk do not fit the capacity; they stay in "
                        "the database unserved until it is opened with a capacity that holds them"
                     << Kv("path", options_.path) << Kv("chunks", over_capacity_)
                     << Kv("bytes", over_capacity_bytes_) << Kv("restored_bytes", used_bytes_)
                     << Kv("capacity", options_.capacity_bytes);
  }
  return rocksdb::Status::OK();
}

StatusOr<std::unique_ptr<DiskTier>> DiskTier::Open(const DiskTierOptions& options, Clock* clock) {
  KVD_RETURN_IF_ERROR(options.Validate());
  std::error_code ec;
  std::filesystem::create_directories(options.path, ec);
  if (ec) {
    return Status::Unavailable("disk tier: cannot create directory " + options.path + ": " +
                               ec.message());
  }
  auto impl = std::make_unique<Impl>();
  impl->options_ = options;
  impl->clock_ = clock != nullptr ? clock : Clock::Real();
  impl->counters_.kind = TierKind::kDisk;
  impl->write_options_.disableWAL = !options.use_wal;
  impl->write_options_.sync = options.sync_writes;
  // RocksDB's block checksums are verified on every read (a corrupt block is a DATA_LOSS error,
  // never bytes), on top of kvd's own xxh3 checksum of each payload; paranoid checks stop a
  // corrupt database from being opened silently.
  impl->read_options_.verify_checksums = true;
  impl->listener_ = std::make_shared<DiskHealthListener>(&impl->health_, options.path);
  const rocksdb::DBOptions db_options = DatabaseOptions(impl->listener_);
  const std::vector<rocksdb::ColumnFamilyDescriptor> families = Families(options);

  // As found, unless the previous run recorded damage; then from a repaired copy; then empty.
  std::string damage = ReadDamageMarker(options.path);
  if (damage.empty()) {
    const rocksdb::Status s = impl->OpenAndIndex(db_options, families);
    if (s.ok()) return std::unique_ptr<DiskTier>(new DiskTier(std::move(impl)));
    if (!IsDamage(s)) return FromRocks(s, "open " + options.path);
    damage = s.ToString();
  }
  std::string quarantine;
  rocksdb::Status s = QuarantineAndRepair(options.path, db_options, families, &quarantine);
  if (quarantine.empty()) return FromRocks(s, "move the damaged " + options.path + " aside");
  DiskHealthReport::Start start = DiskHealthReport::Start::kRepaired;
  if (s.ok()) s = impl->OpenAndIndex(db_options, families);
  if (!s.ok()) {
    KVD_LOG(ERROR) << "disk tier: the damaged database could not be repaired; starting empty"
                   << Kv("path", options.path) << Kv("rocksdb", s.ToString());
    if (!EmptyDirectory(options.path)) {
      return Status::Unavailable("disk tier: cannot empty " + options.path);
    }
    start = DiskHealthReport::Start::kEmpty;
    KVD_RETURN_IF_ERROR(
        FromRocks(impl->OpenAndIndex(db_options, families), "open " + options.path));
  }
  KVD_LOG(ERROR) << "disk tier: damaged database moved aside; serving "
                 << (start == DiskHealthReport::Start::kEmpty ? "an empty database"
                                                              : "what RocksDB repaired from it")
                 << Kv("path", options.path) << Kv("quarantine", quarantine)
                 << Kv("restored_chunks", impl->restored_) << Kv("damage", damage);
  impl->health_.SetStart(start, std::move(damage), std::move(quarantine));
  return std::unique_ptr<DiskTier>(new DiskTier(std::move(impl)));
}

DiskTier::DiskTier(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DiskTier::~DiskTier() = default;

Status DiskTier::Impl::CheckInsert(const ChunkKey& key, uint64_t checksum,
                                   std::span<const std::byte> bytes) {
  if (bytes.empty()) return Status::InvalidArgument("disk tier insert: no bytes");
  if (key.model.empty() || key.model.size() > 0xffff || key.name_space.size() > 0xffff) {
    return Status::InvalidArgument(
        "disk tier insert: model must be 1..65535 bytes and namespace "
        "<= 65535 bytes");
  }
  if (bytes.size() > options_.capacity_bytes) {
    return Status::ResourceExhausted("disk tier: chunk of " + std::to_string(bytes.size()) +
                                     " bytes exceeds the capacity " +
                                     std::to_string(options_.capacity_bytes));
  }
  if (health_.writes_stopped()) {
    health_.CountRefused();
    return Status::FailedPrecondition("disk tier: writes stopped by a RocksDB background error (" +
                                      health_.Report().stop_reason + "); " + key.ToString() +
                                      " not written");
  }
  const uint64_t actual = Checksum64(bytes.data(), bytes.size());
  if (actual != checksum) {
    std::lock_guard<std::mutex> lock(mu_);
    counters_.checksum_failures++;
    return Status::DataLoss("disk tier insert of " + key.ToString() +
                            ": checksum mismatch: expected " + std::to_string(checksum) +
                            ", bytes have " + std::to_string(actual));
  }
  return Status::Ok();
}

// Claim the key and the space under the lock; write without it. A write of the same key in
// progress is waited for: its outcome decides (on disk: dedup; failed: this one writes), so the
// dedup answer always means the chunk is on disk.
Status DiskTier::Impl::ClaimWrite(const ChunkKey& key, uint64_t size) {
  std::unique_lock<std::mutex> lock(mu_);
  pending_done_.wait(lock, [&] { return pending_.count(key) == 0; });
  if (index_.count(key) != 0) {
    counters_.dedup_puts++;
    return DedupStatus("chunk " + key.ToString() + " is already on disk");
  }
  while (used_bytes_ + pending_bytes_ + size > options_.capacity_bytes && !lru_.empty()) {
    KVD_RETURN_IF_ERROR(DropLocked(lru_.back(), RemoveReason::kEvicted));
    counters_.evictions++;
  }
  if (used_bytes_ + pending_bytes_ + size > options_.capacity_bytes) {
    return Status::ResourceExhausted("disk tier full: " + std::to_string(size) +
                                     " bytes do not fit next to " + std::to_string(pending_bytes_) +
                                     " bytes being written (capacity " +
                                     std::to_string(options_.capacity_bytes) + ")");
  }
  pending_.insert(key);
  pending_bytes_ += size;
  return Status::Ok();
}

Status DiskTier::Impl::WriteClaimed(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                                    std::span<const std::byte> bytes) {
  KVD_RETURN_IF_ERROR(write_hook_ ? write_hook_(key) : Status::Ok());
  // The value is written as two parts (header, payload): no copy of the payload is made here.
  char header[codec::kValueHeaderBytes];
  codec::EncodeValueHeader({checksum, tokens}, header);
  const std::string k = codec::EncodeKey(key);
  const rocksdb::Slice key_slice(k);
  const rocksdb::Slice value_parts[2] = {
      rocksdb::Slice(header, sizeof(header)),
      rocksdb::Slice(reinterpret_cast<const char*>(bytes.data()), bytes.size())};
  rocksdb::WriteBatch batch;
  batch.Put(data_cf(), rocksdb::SliceParts(&key_slice, 1), rocksdb::SliceParts(value_parts, 2));
  batch.Put(meta_cf(), k, codec::EncodeMeta({tokens, bytes.size(), checksum}));
  return FromRocks(db_->Write(write_options_, &batch), "write " + key.ToString());
}

Status DiskTier::Impl::FinishWrite(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                                   uint64_t size, const Status& written) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_.erase(key);
  pending_bytes_ -= size;
  pending_done_.notify_all();
  KVD_RETURN_IF_ERROR(written);
  auto e = std::make_unique<Impl::Entry>();
  const int64_t now = clock_->NowNanos();
  e->meta = ChunkMeta{key, tokens, size, checksum, now, now, TierKind::kDisk};
  EmitLocked(ChunkEventKind::kStored, RemoveReason::kNone, e->meta);
  AddLocked(std::move(e));
  counters_.commits++;
  return Status::Ok();
}

Status DiskTier::Insert(const ChunkKey& key, uint32_t tokens, uint64_t checksum,
                        std::span<const std::byte> bytes) {
  Impl& s = *impl_;
  KVD_RETURN_IF_ERROR(s.CheckInsert(key, checksum, bytes));
  KVD_RETURN_IF_ERROR(s.ClaimWrite(key, bytes.size()));
  const Status written = s.WriteClaimed(key, tokens, checksum, bytes);
  return s.FinishWrite(key, tokens, checksum, bytes.size(), written);
}

StatusOr<ChunkMeta> DiskTier::ReadInto(const ChunkKey& key, std::span<std::byte> out) {
  Impl& s = *impl_;
  ChunkMeta meta;
  {
    std::lock_guard<std::mutex> lock(s.mu_);
    auto it = s.index_.find(key);
    if (it == s.index_.end()) {
      return Status::NotFound("chunk " + key.ToString() +
                              " is not on disk (never stored, or evicted)");
    }
    meta = it->second->meta;
  }
  if (out.size() < meta.size_bytes) {
    return Status::OutOfRange("read of " + key.ToString() + ": buffer of " +
                              std::to_string(out.size()) + " bytes < chunk of " +
                              std::to_string(meta.size_bytes));
  }
  rocksdb::PinnableSlice value;
  rocksdb::Status rs = s.db_->Get(s.read_options_, s.data_cf(), codec::EncodeKey(key), &value);
  if (rs.IsNotFound()) {
    // Either removed meanwhile, or indexed without its value (a ghost): forget it either way.
    std::lock_guard<std::mutex> lock(s.mu_);
    auto it = s.index_.find(key);
    if (it != s.index_.end() && it->second->meta.checksum == meta.checksum) {
      // NOT_FOUND is what the caller needs.
      s.DropLocked(it->second.get(), RemoveReason::kCorrupt).IgnoreError();
    }
    return Status::NotFound("chunk " + key.ToString() + " has no value on disk (removed)");
  }
  Status status = FromRocks(rs, "read " + key.ToString());
  if (status.ok()) {
    if (value.size() != codec::kValueHeaderBytes + meta.size_bytes) {
      status = Status::DataLoss("disk tier: chunk " + key.ToString() + " has " +
                                std::to_string(value.size()) + " stored bytes, expected " +
                                std::to_string(codec::kValueHeaderBytes + meta.size_bytes));
    } else {
      const codec::ValueHeader h = codec::DecodeValueHeader(value.data());
      meta.tokens = h.tokens;
      const char* payload = value.data() + codec::kValueHeaderBytes;
      if (s.options_.verify_checksums) {
        const uint64_t actual = Checksum64(payload, meta.size_bytes);
        if (actual != h.checksum || h.checksum != meta.checksum) {
          status =
              Status::DataLoss("disk tier: chunk " + key.ToString() + " is corrupt: checksum " +
                               std::to_string(actual) + ", stored " + std::to_string(h.checksum) +
                               ", indexed " + std::to_string(meta.checksum) + "; chunk dropped");
        }
      }
      if (status.ok()) std::memcpy(out.data(), payload, meta.size_bytes);
    }
  }
  std::lock_guard<std::mutex> lock(s.mu_);
  auto it = s.index_.find(key);
  if (status.code() == StatusCode::kDataLoss) {
    s.counters_.checksum_failures++;
    if (it != s.index_.end() && it->second->meta.checksum == meta.checksum) {
      // The DATA_LOSS is what the caller needs.
      s.DropLocked(it->second.get(), RemoveReason::kCorrupt).IgnoreError();
    }
    return status;
  }
  KVD_RETURN_IF_ERROR(status);
  if (it != s.index_.end()) {
    it->second->meta.last_access_ns = s.clock_->NowNanos();
    s.lru_.splice(s.lru_.begin(), s.lru_, it->second->lru_it);
    meta.last_access_ns = it->second->meta.last_access_ns;
  }
  return meta;
}

StatusOr<ChunkMeta> DiskTier::Describe(const ChunkKey& key) const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  auto it = impl_->index_.find(key);
  if (it == impl_->index_.end()) {
    return Status::NotFound("chunk " + key.ToString() +
                            " is not on disk (never stored, or evicted)");
  }
  return it->second->meta;
}

bool DiskTier::Contains(const ChunkKey& key) const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return impl_->index_.count(key) != 0;
}

Status DiskTier::Remove(const ChunkKey& key) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  auto it = impl_->index_.find(key);
  if (it == impl_->index_.end()) {
    return Status::NotFound("chunk " + key.ToString() +
                            " is not on disk (never stored, or evicted)");
  }
  return impl_->DropLocked(it->second.get(), RemoveReason::kMoved);
}

std::vector<ChunkMeta> DiskTier::List(const ChunkFilter& filter, size_t limit) const {
  std::vector<ChunkMeta> out;
  std::lock_guard<std::mutex> lock(impl_->mu_);
  for (const Impl::Entry* e : impl_->lru_) {
    if (limit != 0 && out.size() >= limit) break;
    if (filter.Matches(e->meta.key)) out.push_back(e->meta);
  }
  return out;
}

EvictResult DiskTier::Evict(const ChunkFilter& filter) {
  EvictResult out;
  std::lock_guard<std::mutex> lock(impl_->mu_);
  std::vector<Impl::Entry*> victims;
  if (filter.key) {  // one chunk: no scan
    auto it = impl_->index_.find(*filter.key);
    if (it != impl_->index_.end() && filter.Matches(it->first)) victims.push_back(it->second.get());
  } else {
    for (Impl::Entry* e : impl_->lru_) {
      if (filter.Matches(e->meta.key)) victims.push_back(e);
    }
  }
  for (Impl::Entry* e : victims) {
    out.bytes += e->meta.size_bytes;
    // A failed delete leaves garbage on disk, not in the index.
    impl_->DropLocked(e, RemoveReason::kAdmin).IgnoreError();
    out.evicted++;
  }
  impl_->counters_.admin_evictions += out.evicted;
  return out;
}

void DiskTier::SetEventListener(ChunkEventListener* listener) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  impl_->events_ = listener;
}

TierStats DiskTier::GetStats() const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  TierStats out = impl_->counters_;
  out.kind = TierKind::kDisk;
  out.capacity_bytes = impl_->options_.capacity_bytes;
  out.used_bytes = impl_->used_bytes_;
  out.chunk_count = impl_->index_.size();
  out.per_model = {impl_->per_model_.begin(), impl_->per_model_.end()};
  out.per_namespace = {impl_->per_namespace_.begin(), impl_->per_namespace_.end()};
  return out;
}

uint64_t DiskTier::restored_chunks() const { return impl_->restored_; }
uint64_t DiskTier::quarantined_records() const { return impl_->quarantined_; }
uint64_t DiskTier::over_capacity_records() const { return impl_->over_capacity_; }
uint64_t DiskTier::wal_corruptions() const { return impl_->wal_damaged_ ? 1 : 0; }
DiskHealthReport DiskTier::Health() const { return impl_->health_.Report(); }
bool DiskTier::writes_stopped() const { return impl_->health_.writes_stopped(); }

Status DiskTier::Flush() {
  return FromRocks(impl_->db_->Flush(rocksdb::FlushOptions(), impl_->handles_), "flush");
}

}  // namespace kvd::storage

namespace kvd::storage {

Status DiskTier::PutState(std::string_view name, std::span<const uint8_t> bytes) {
  if (name.empty()) return Status::InvalidArgument("disk tier state: empty name");
  char header[8];
  const uint64_t checksum = Checksum64(bytes.data(), bytes.size());
  std::memcpy(header, &checksum, sizeof(header));
  const rocksdb::Slice key(name.data(), name.size());
  const rocksdb::Slice parts[2] = {
      rocksdb::Slice(header, sizeof(header)),
      rocksdb::Slice(reinterpret_cast<const char*>(bytes.data()), bytes.size())};
  rocksdb::WriteBatch batch;
  KVD_RETURN_IF_ERROR(FromRocks(
      batch.Put(impl_->state_cf(), rocksdb::SliceParts(&key, 1), rocksdb::SliceParts(parts, 2)),
      "state " + std::string(name)));
  rocksdb::WriteOptions durable;  // WAL on and synced: state is rare and must survive a crash
  durable.sync = true;
  return FromRocks(impl_->db_->Write(durable, &batch), "write state " + std::string(name));
}

Status DiskTier::RemoveState(std::string_view name) {
  rocksdb::WriteOptions durable;
  durable.sync = true;
  return FromRocks(
      impl_->db_->Delete(durable, impl_->state_cf(), rocksdb::Slice(name.data(), name.size())),
      "delete state " + std::string(name));
}

StatusOr<std::vector<uint8_t>> DiskTier::GetState(std::string_view name) const {
  std::string value;
  rocksdb::Status s = impl_->db_->Get(impl_->read_options_, impl_->state_cf(),
                                      rocksdb::Slice(name.data(), name.size()), &value);
  if (s.IsNotFound()) {
    return Status::NotFound("disk tier state " + std::string(name) + ": not stored");
  }
  KVD_RETURN_IF_ERROR(FromRocks(s, "read state " + std::string(name)));
  if (value.size() < 8) {
    return Status::DataLoss("disk tier state " + std::string(name) + ": record of " +
                            std::to_string(value.size()) + " bytes is shorter than its checksum");
  }
  uint64_t expected = 0;
  std::memcpy(&expected, value.data(), sizeof(expected));
  std::vector<uint8_t> out(value.begin() + 8, value.end());
  const uint64_t actual = Checksum64(out.data(), out.size());
  if (actual != expected) {
    return Status::DataLoss("disk tier state " + std::string(name) +
                            ": checksum mismatch (stored " + std::to_string(expected) +
                            ", bytes have " + std::to_string(actual) + ")");
  }
  return out;
}

void DiskTierInternals::SetWriteHook(DiskTier& tier, DiskWriteHook hook) {
  tier.impl_->write_hook_ = std::move(hook);
}

}  // namespace kvd::storage
