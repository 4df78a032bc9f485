// DiskTier (real RocksDB in a temp dir): round trip, restart, corruption, capacity, dedup.
#include "kvd/storage/disk_tier.h"

#include <gtest/gtest.h>
#include <rocksdb/db.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>

#include "../common/wal_damage.h"
#include "test_util.h"

namespace kvd::storage {
namespace {

using testing::Contains;
using testing::MakeKey;
using testing::RandomBytes;

class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() /
            ("kvd_disk_tier_test_" + std::to_string(rd()) + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string path() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

// The tier's database opened directly, to damage it behind the tier's back. handles():
// [0] data ("default"), [1] "meta", [2] "state". Closed at scope end.
class RawDb {
 public:
  explicit RawDb(const std::string& path) {
    std::vector<rocksdb::ColumnFamilyDescriptor> families = {
        {rocksdb::kDefaultColumnFamilyName, {}}, {"meta", {}}, {"state", {}}};
    rocksdb::DB* raw = nullptr;
    const rocksdb::Status s = rocksdb::DB::Open({}, path, families, &handles_, &raw);
    EXPECT_TRUE(s.ok()) << s.ToString();
    db_.reset(raw);
  }
  ~RawDb() {
    for (auto* h : handles_) EXPECT_TRUE(db_->DestroyColumnFamilyHandle(h).ok());
  }
  bool ok() const { return db_ != nullptr; }
  rocksdb::DB* db() const { return db_.get(); }
  const std::vector<rocksdb::ColumnFamilyHandle*>& handles() const { return handles_; }
  // The first entry (key, value) of column family `family` in key order; nullopt when empty.
  std::optional<std::pair<std::string, std::string>> First(size_t family) const {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator({}, handles_.at(family)));
    it->SeekToFirst();
    if (!it->Valid()) return std::nullopt;
    return std::pair{it->key().ToString(), it->value().ToString()};
  }

 private:
  std::unique_ptr<rocksdb::DB> db_;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;
};

class DiskTierTest : public ::testing::Test {
 protected:
  DiskTierOptions Options() const {
    DiskTierOptions o;
    o.path = dir_.path() + "/db";
    o.capacity_bytes = 1 << 20;
    o.use_wal = true;
    return o;
  }
  std::unique_ptr<DiskTier> Open(DiskTierOptions o) {
    auto t = DiskTier::Open(o);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? std::move(t).value() : nullptr;
  }
  Status Insert(DiskTier& t, uint64_t n, const std::vector<std::byte>& bytes) {
    return t.Insert(MakeKey(n), 256, Checksum64(bytes.data(), bytes.size()), bytes);
  }
  // Stores `bytes` as chunks `chunks` in a tier that is closed again, then runs `damage` on the
  // database opened directly (behind the tier's back). Call with ASSERT_NO_FATAL_FAILURE.
  void StoreThenDamage(std::initializer_list<uint64_t> chunks, const std::vector<std::byte>& bytes,
                       const std::function<void(RawDb&)>& damage) {
    {
      auto tier = Open(Options());
      ASSERT_TRUE(tier);
      for (uint64_t n : chunks) ASSERT_TRUE(Insert(*tier, n, bytes).ok());
    }
    RawDb raw(Options().path);
    ASSERT_TRUE(raw.ok());
    damage(raw);
  }
  TempDir dir_;
};

TEST_F(DiskTierTest, RejectsBadOptions) {
  DiskTierOptions o;
  auto t = DiskTier::Open(o);
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(t.status(), "path is required")) << t.status();
  o = Options();
  o.use_wal = false;
  o.sync_writes = true;
  EXPECT_EQ(DiskTier::Open(o).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(DiskTierTest, RoundTripAndErrors) {
  auto tier = Open(Options());
  ASSERT_TRUE(tier);
  const auto bytes = RandomBytes(10000, 1);
  ASSERT_TRUE(Insert(*tier, 1, bytes).ok());
  std::vector<std::byte> out(bytes.size());
  auto meta = tier->ReadInto(MakeKey(1), out);
  ASSERT_TRUE(meta.ok()) << meta.status();
  EXPECT_EQ(out, bytes);
  EXPECT_EQ(meta->tokens, 256u);
  EXPECT_EQ(meta->tier, TierKind::kDisk);
  Status s = Insert(*tier, 1, bytes);
  EXPECT_TRUE(IsDedup(s)) << s;
  s = tier->Insert(MakeKey(2), 1, 12345, bytes);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_FALSE(tier->Contains(MakeKey(2)));
  s = tier->ReadInto(MakeKey(3), out).status();
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(s, MakeKey(3).ToString())) << s;
  std::vector<std::byte> small(5);
  EXPECT_EQ(tier->ReadInto(MakeKey(1), small).status().code(), StatusCode::kOutOfRange);
  ASSERT_TRUE(tier->Remove(MakeKey(1)).ok());
  EXPECT_EQ(tier->ReadInto(MakeKey(1), out).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(tier->GetStats().used_bytes, 0u);
}

TEST_F(DiskTierTest, ChunksSurviveARestart) {
  std::vector<std::vector<std::byte>> payloads;
  {
    auto tier = Open(Options());
    ASSERT_TRUE(tier);
    for (uint64_t n = 0; n < 5; ++n) {
      payloads.push_back(RandomBytes(1000 + n * 100, static_cast<uint32_t>(n)));
      ASSERT_TRUE(tier->Insert(MakeKey(n, n % 2 ? "qwen" : "llama"), static_cast<uint32_t>(n),
                               Checksum64(payloads[n].data(), payloads[n].size()), payloads[n])
                      .ok());
    }
    ASSERT_TRUE(tier->Remove(MakeKey(4)).ok());
  }
  auto tier = Open(Options());
  ASSERT_TRUE(tier);
  EXPECT_EQ(tier->restored_chunks(), 4u);
  const TierStats s = tier->GetStats();
  EXPECT_EQ(s.chunk_count, 4u);
  EXPECT_EQ(s.used_bytes, 1000u + 1100 + 1200 + 1300);
  EXPECT_EQ(s.per_model.at("qwen").chunks, 2u);
  for (uint64_t n = 0; n < 4; ++n) {
    std::vector<std::byte> out(payloads[n].size());
    auto meta = tier->ReadInto(MakeKey(n, n % 2 ? "qwen" : "llama"), out);
    ASSERT_TRUE(meta.ok()) << meta.status();
    EXPECT_EQ(meta->tokens, n);
    EXPECT_EQ(out, payloads[n]);
  }
  EXPECT_FALSE(tier->Contains(MakeKey(4)));
}

TEST_F(DiskTierTest, WalOffStillSurvivesACleanFlush) {
  DiskTierOptions o = Options();
  o.use_wal = false;
  const auto bytes = RandomBytes(5000, 3);
  {
    auto tier = Open(o);
    ASSERT_TRUE(tier);
    ASSERT_TRUE(Insert(*tier, 7, bytes).ok());
    ASSERT_TRUE(tier->Flush().ok());
  }
  auto tier = Open(o);
  ASSERT_TRUE(tier);
  std::vector<std::byte> out(bytes.size());
  ASSERT_TRUE(tier->ReadInto(MakeKey(7), out).ok());
  EXPECT_EQ(out, bytes);
}

TEST_F(DiskTierTest, CorruptValueIsDataLossAndDropped) {
  const auto bytes = RandomBytes(4096, 4);
  // Flip one payload byte of the first chunk in key order.
  ASSERT_NO_FATAL_FAILURE(StoreThenDamage({1, 2}, bytes, [](RawDb& raw) {
    auto first = raw.First(0);
    ASSERT_TRUE(first.has_value());
    auto [key, value] = *first;
    value[100] ^= 0x01;
    ASSERT_TRUE(raw.db()->Put({}, raw.handles()[0], key, value).ok());
  }));
  auto tier = Open(Options());
  ASSERT_TRUE(tier);
  std::vector<std::byte> out(bytes.size());
  auto r1 = tier->ReadInto(MakeKey(1), out);
  auto r2 = tier->ReadInto(MakeKey(2), out);
  // Exactly one of the two (the first in key order) was corrupted.
  const bool first_bad = !r1.ok();
  const Status bad = first_bad ? r1.status() : r2.status();
  EXPECT_EQ(bad.code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(bad, "corrupt")) << bad;
  EXPECT_TRUE(first_bad ? r2.ok() : r1.ok());
  EXPECT_EQ(tier->GetStats().checksum_failures, 1u);
  EXPECT_EQ(tier->GetStats().chunk_count, 1u);  // the corrupt one was dropped
  EXPECT_EQ(tier->ReadInto(MakeKey(first_bad ? 1 : 2), out).status().code(), StatusCode::kNotFound);
}

TEST_F(DiskTierTest, MalformedMetadataRecordIsQuarantinedNotFatal) {
  const auto bytes = RandomBytes(4096, 5);
  // Two malformed metadata records: an undecodable key, and a good key with a truncated value.
  ASSERT_NO_FATAL_FAILURE(StoreThenDamage({1, 2}, bytes, [](RawDb& raw) {
    rocksdb::ColumnFamilyHandle* meta = raw.handles()[1];
    ASSERT_TRUE(raw.db()->Put({}, meta, "\xff garbage key", "\x01value").ok());
    auto first = raw.First(1);
    ASSERT_TRUE(first.has_value());
    ASSERT_TRUE(raw.db()->Put({}, meta, first->first, "\x01").ok());
  }));
  auto tier = Open(Options());  // opens: the bad records do not stop the good chunk
  ASSERT_TRUE(tier);
  EXPECT_EQ(tier->quarantined_records(), 2u);
  EXPECT_EQ(tier->restored_chunks(), 1u);
  std::vector<std::byte> out(bytes.size());
  const bool one = tier->ReadInto(MakeKey(1), out).ok();
  const bool two = tier->ReadInto(MakeKey(2), out).ok();
  EXPECT_NE(one, two);  // exactly the chunk whose record was intact is served
  EXPECT_EQ(out, bytes);
}

// Records that decode but that Insert could never have written (found by fuzz_disk_record): a key
// naming no model, and a record of an empty chunk. Both are quarantined, not indexed (an indexed
// one would be counted in used_bytes and could never be served).
TEST_F(DiskTierTest, RecordsInsertCouldNotHaveWrittenAreQuarantined) {
  const auto bytes = RandomBytes(4096, 6);
  ASSERT_NO_FATAL_FAILURE(StoreThenDamage({1}, bytes, [](RawDb& raw) {
    rocksdb::DB* db = raw.db();
    const auto& handles = raw.handles();
    auto first = raw.First(1);
    ASSERT_TRUE(first.has_value());
    const auto& [good_key, good_meta] = *first;
    ASSERT_EQ(good_meta.size(), 21u);  // u8 version, u32 tokens, u64 size, u64 checksum
    // Key [u16 0][u16 0][layout u64][codec u32][hash 2 x u64]: no namespace, no model.
    std::string no_model(32, '\0');
    no_model[4] = 1;  // another layout digest than the good key's, so no collision
    ASSERT_TRUE(db->Put({}, handles[1], no_model, good_meta).ok());
    // The good chunk's own key with a record claiming 0 bytes.
    std::string empty = good_meta;
    std::fill(empty.begin() + 5, empty.begin() + 13, '\0');
    ASSERT_TRUE(db->Put({}, handles[1], good_key, empty).ok());
  }));
  auto tier = Open(Options());
  ASSERT_TRUE(tier);
  EXPECT_EQ(tier->quarantined_records(), 2u);
  EXPECT_EQ(tier->restored_chunks(), 0u);
  EXPECT_EQ(tier->GetStats().used_bytes, 0u);
  EXPECT_EQ(tier->GetStats().chunk_count, 0u);
}

TEST_F(DiskTierTest, DamagedWalTailIsCountedAndWhatPrecedesItIsServed) {
  // 12 chunks written one at a time (synced WAL, no flush: the WAL is the only copy), then one
  // byte flipped two thirds into the log. Open succeeds, counts the damage, and serves every
  // chunk written wholly before it; nothing after it is served with other bytes.
  constexpr int kChunks = 12;
  constexpr size_t kBytes = 3000;  // < RocksDB's 32 KiB log block: one record per chunk
  DiskTierOptions o = Options();
  o.sync_writes = true;
  {
    auto tier = Open(o);
    ASSERT_TRUE(tier);
    for (int n = 0; n < kChunks; ++n) {
      ASSERT_TRUE(Insert(*tier, n, RandomBytes(kBytes, 100 + n)).ok());
    }
    EXPECT_EQ(tier->wal_corruptions(), 0u);
  }
  const std::filesystem::path wal = kvd::testing::FindWal(o.path, kChunks * kBytes);
  ASSERT_FALSE(wal.empty()) << "no write-ahead log with the chunks in " << o.path;
  const uint64_t wal_size = std::filesystem::file_size(wal);
  const uint64_t flip_at = wal_size * 2 / 3;
  ASSERT_TRUE(kvd::testing::FlipByte(wal, flip_at));
  auto tier = Open(o);
  ASSERT_TRUE(tier);
  EXPECT_EQ(tier->wal_corruptions(), 1u);
  // Served: a prefix of the write order, byte-exact; it reaches at least every chunk whose
  // record ends before the flipped byte (each record is a little over wal_size / kChunks).
  int served = 0;
  std::vector<std::byte> out(kBytes);
  for (int n = 0; n < kChunks; ++n) {
    auto r = tier->ReadInto(MakeKey(n), out);
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), StatusCode::kNotFound) << n << ": " << r.status();
      continue;
    }
    EXPECT_EQ(out, RandomBytes(kBytes, 100 + n)) << "chunk " << n;
    EXPECT_EQ(served, n) << "chunk " << n << " served after a missing one";
    served++;
  }
  const int before_damage = static_cast<int>(flip_at * kChunks / wal_size);
  EXPECT_GE(served, before_damage - 1);
  EXPECT_LT(served, kChunks);
  EXPECT_EQ(tier->restored_chunks(), static_cast<uint64_t>(served));
  // The recovered state was made durable at open: a second open finds no damage, same chunks.
  tier.reset();
  auto again = Open(o);
  ASSERT_TRUE(again);
  EXPECT_EQ(again->wal_corruptions(), 0u);
  EXPECT_EQ(again->restored_chunks(), static_cast<uint64_t>(served));
}

TEST_F(DiskTierTest, MetadataWithoutValueIsForgottenOnRead) {
  const auto bytes = RandomBytes(2048, 8);
  // Delete the value but keep the metadata: the state a torn write would leave.
  ASSERT_NO_FATAL_FAILURE(StoreThenDamage({1}, bytes, [](RawDb& raw) {
    auto first = raw.First(0);
    ASSERT_TRUE(first.has_value());
    ASSERT_TRUE(raw.db()->Delete({}, raw.handles()[0], first->first).ok());
  }));
  auto tier = Open(Options());
  ASSERT_TRUE(tier);
  EXPECT_EQ(tier->restored_chunks(), 1u);
  std::vector<std::byte> out(bytes.size());
  Status s = tier->ReadInto(MakeKey(1), out).status();
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(s, "no value on disk")) << s;
  EXPECT_FALSE(tier->Contains(MakeKey(1)));
  EXPECT_EQ(tier->GetStats().used_bytes, 0u);
}

// A restart with a lower capacity: Open restores chunks (in key order) while they fit and leaves
// the others in the database unserved and counted, so used_bytes never exceeds the capacity; a
// later Open with room restores them byte-exact (nothing acknowledged is deleted by the restart).
TEST_F(DiskTierTest, ReopenWithALowerCapacityLeavesTheChunksThatDoNotFitOnDisk) {
  constexpr uint64_t kChunks = 3, kBytes = 4096;
  {
    auto tier = Open(Options());
    ASSERT_TRUE(tier);
    for (uint64_t n = 0; n < kChunks; ++n) {
      ASSERT_TRUE(Insert(*tier, n, RandomBytes(kBytes, 200 + n)).ok());
    }
  }
  auto served = [&](DiskTier& tier) {
    uint64_t count = 0;
    std::vector<std::byte> out(kBytes);
    for (uint64_t n = 0; n < kChunks; ++n) {
      auto r = tier.ReadInto(MakeKey(n), out);
      if (!r.ok()) {
        EXPECT_EQ(r.status().code(), StatusCode::kNotFound) << n << ": " << r.status();
        continue;
      }
      EXPECT_EQ(out, RandomBytes(kBytes, 200 + n)) << "chunk " << n;
      count++;
    }
    return count;
  };
  DiskTierOptions small = Options();
  small.capacity_bytes = 2 * kBytes + kBytes / 2;  // room for two of the three
  {
    auto tier = Open(small);
    ASSERT_TRUE(tier);
    EXPECT_EQ(tier->restored_chunks(), 2u);
    EXPECT_EQ(tier->over_capacity_records(), 1u);
    EXPECT_EQ(tier->quarantined_records(), 0u);
    EXPECT_EQ(tier->GetStats().used_bytes, 2 * kBytes);
    EXPECT_EQ(tier->GetStats().chunk_count, 2u);
    EXPECT_EQ(served(*tier), 2u);
  }
  DiskTierOptions tiny = Options();
  tiny.capacity_bytes = kBytes - 1;  // smaller than any one chunk
  {
    auto tier = Open(tiny);
    ASSERT_TRUE(tier);
    EXPECT_EQ(tier->restored_chunks(), 0u);
    EXPECT_EQ(tier->over_capacity_records(), kChunks);
    EXPECT_EQ(tier->GetStats().used_bytes, 0u);
    EXPECT_EQ(served(*tier), 0u);
  }
  {
    auto tier = Open(Options());  // the original capacity: every chunk is back
    ASSERT_TRUE(tier);
    EXPECT_EQ(tier->restored_chunks(), kChunks);
    EXPECT_EQ(tier->over_capacity_records(), 0u);
    EXPECT_EQ(tier->GetStats().used_bytes, kChunks * kBytes);
    EXPECT_EQ(served(*tier), kChunks);
  }
}

// A chunk left unserved by a smaller capacity is stored again by a put of the same chunk (the new
// record replaces it) and counted once.
TEST_F(DiskTierTest, PutOfAChunkLeftOverCapacityStoresItAgain) {
  const auto a = RandomBytes(4096, 11), b = RandomBytes(4096, 12);
  {
    auto tier = Open(Options());
    ASSERT_TRUE(tier);
    ASSERT_TRUE(Insert(*tier, 1, a).ok());
    ASSERT_TRUE(Insert(*tier, 2, b).ok());
  }
  DiskTierOptions small = Options();
  small.capacity_bytes = 4096 + 100;
  uint64_t left = 0;
  {
    auto tier = Open(small);
    ASSERT_TRUE(tier);
    ASSERT_EQ(tier->over_capacity_records(), 1u);
    left = tier->Contains(MakeKey(1)) ? 2 : 1;
    ASSERT_FALSE(tier->Contains(MakeKey(left)));
    // Room for it: the chunk that was restored is evicted (LRU), the put is stored and served.
    ASSERT_TRUE(Insert(*tier, left, left == 1 ? a : b).ok());
    std::vector<std::byte> out(4096);
    ASSERT_TRUE(tier->ReadInto(MakeKey(left), out).ok());
    EXPECT_EQ(out, left == 1 ? a : b);
    EXPECT_EQ(tier->GetStats().chunk_count, 1u);
    EXPECT_EQ(tier->GetStats().evictions, 1u);
  }
  auto tier = Open(Options());
  ASSERT_TRUE(tier);
  EXPECT_EQ(tier->restored_chunks(), 1u);  // the evicted one is gone, the put one is there once
  EXPECT_TRUE(tier->Contains(MakeKey(left)));
}

TEST_F(DiskTierTest, CapacityEvictsLeastRecentlyUsed) {
  DiskTierOptions o = Options();
  o.capacity_bytes = 3000;
  auto tier = Open(o);
  ASSERT_TRUE(tier);
  const auto bytes = RandomBytes(1000, 5);
  for (uint64_t n = 0; n < 3; ++n) ASSERT_TRUE(Insert(*tier, n, bytes).ok());
  std::vector<std::byte> out(1000);
  ASSERT_TRUE(tier->ReadInto(MakeKey(0), out).ok());  // 1 is now the oldest
  ASSERT_TRUE(Insert(*tier, 3, bytes).ok());
  EXPECT_TRUE(tier->Contains(MakeKey(0)));
  EXPECT_FALSE(tier->Contains(MakeKey(1)));
  EXPECT_EQ(tier->GetStats().evictions, 1u);
  Status s = tier->Insert(MakeKey(9), 1, 0, RandomBytes(3001, 6));
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  const EvictResult ev = tier->Evict(ChunkFilter::All());
  EXPECT_EQ(ev.evicted, 3u);
  EXPECT_EQ(tier->GetStats().used_bytes, 0u);
}

TEST_F(DiskTierTest, ConcurrentInsertsOfOneKeyStoreItOnce) {
  DiskTierOptions o = Options();
  o.capacity_bytes = 64 * 4096;
  auto tier = Open(o);
  ASSERT_TRUE(tier);
  std::atomic<uint64_t> ok{0}, dedup{0}, other{0}, bad{0};
  auto worker = [&](int t) {
    for (uint64_t n = 0; n < 100; ++n) {
      std::vector<std::byte> b(4096);
      for (size_t j = 0; j < b.size(); ++j) b[j] = static_cast<std::byte>(n * 7 + j);
      Status s = tier->Insert(MakeKey(n), 1, Checksum64(b.data(), b.size()), b);
      if (s.ok()) {
        ok++;
      } else if (IsDedup(s)) {
        dedup++;
      } else {
        other++;
      }
      std::vector<std::byte> out(4096);
      auto m = tier->ReadInto(MakeKey((n + t) % 100), out);
      if (m.ok()) {
        const uint64_t k = (n + t) % 100;
        for (size_t j = 0; j < out.size(); j += 61) {
          if (out[j] != static_cast<std::byte>(k * 7 + j)) bad++;
        }
      } else if (m.status().code() != StatusCode::kNotFound) {
        other++;
      }
    }
  };
  std::thread a(worker, 0), b(worker, 1), c(worker, 2);
  a.join();
  b.join();
  c.join();
  EXPECT_EQ(other.load(), 0u);
  EXPECT_EQ(bad.load(), 0u);
  EXPECT_GE(ok.load(), 100u);  // each key stored at least once (evicted ones may be re-stored)
  EXPECT_EQ(ok.load() + dedup.load(), 300u);
  const TierStats st = tier->GetStats();
  EXPECT_LE(st.used_bytes, o.capacity_bytes);
  EXPECT_EQ(st.used_bytes, st.chunk_count * 4096);
  EXPECT_EQ(st.commits, ok.load());
}

}  // namespace
}  // namespace kvd::storage

namespace kvd::storage {
namespace {

TEST_F(DiskTierTest, StateRecordsSurviveARestartAndADamagedOneIsDataLoss) {
  const auto bytes = RandomBytes(3000, 8);
  const std::vector<uint8_t> state(reinterpret_cast<const uint8_t*>(bytes.data()),
                                   reinterpret_cast<const uint8_t*>(bytes.data()) + bytes.size());
  {
    auto tier = Open(Options());
    ASSERT_TRUE(tier);
    EXPECT_EQ(tier->GetState("weights/a").status().code(), StatusCode::kNotFound);
    EXPECT_EQ(tier->PutState("", state).code(), StatusCode::kInvalidArgument);
    ASSERT_TRUE(tier->PutState("weights/a", std::vector<uint8_t>{1, 2, 3}).ok());
    ASSERT_TRUE(tier->PutState("weights/a", state).ok());  // replaces
    ASSERT_TRUE(tier->PutState("weights/b", {}).ok());     // empty bytes are a value too
    ASSERT_TRUE(Insert(*tier, 1, bytes).ok());
  }
  {
    auto tier = Open(Options());
    ASSERT_TRUE(tier);
    auto a = tier->GetState("weights/a");
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_TRUE(*a == state);
    auto b = tier->GetState("weights/b");
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_TRUE(b->empty());
    // State is not a chunk: not indexed, not counted.
    EXPECT_EQ(tier->restored_chunks(), 1u);
    EXPECT_EQ(tier->quarantined_records(), 0u);
    EXPECT_EQ(tier->GetStats().chunk_count, 1u);
  }
  {
    // Flip one byte of record a behind the tier's back; cut record b below its checksum.
    RawDb raw(Options().path);
    ASSERT_TRUE(raw.ok());
    rocksdb::DB* db = raw.db();
    const auto& handles = raw.handles();
    std::string value;
    ASSERT_TRUE(db->Get({}, handles[2], "weights/a", &value).ok());
    value[200] ^= 0x01;
    ASSERT_TRUE(db->Put({}, handles[2], "weights/a", value).ok());
    ASSERT_TRUE(db->Put({}, handles[2], "weights/b", "abc").ok());
  }
  auto tier = Open(Options());
  ASSERT_TRUE(tier);
  auto a = tier->GetState("weights/a");
  EXPECT_EQ(a.status().code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(a.status(), "checksum mismatch")) << a.status();
  auto b = tier->GetState("weights/b");
  EXPECT_EQ(b.status().code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(b.status(), "shorter than its checksum")) << b.status();
  // RemoveState: gone (also after a restart); removing what is not there is OK.
  ASSERT_TRUE(tier->RemoveState("weights/a").ok());
  ASSERT_TRUE(tier->RemoveState("weights/a").ok());
  EXPECT_EQ(tier->GetState("weights/a").status().code(), StatusCode::kNotFound);
  tier.reset();
  tier = Open(Options());
  ASSERT_TRUE(tier);
  EXPECT_EQ(tier->GetState("weights/a").status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvd::storage
