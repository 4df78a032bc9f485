// The disk tier on a damaged database (real RocksDB files, real byte flips): a corrupt SST data
// block found by a compaction stops RocksDB's writes, not kvd (reads go on, the TierManager
// keeps puts in host), and the next Open repairs; a corrupt SST index block, MANIFEST or
// CURRENT at Open moves the database aside and serves what can be read; a torn last
// write-ahead log record (a crash) is no damage.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>

#include "../common/rocksdb_damage.h"
#include "host_disk_fixture.h"
#include "kvd/storage/disk_tier.h"
#include "kvd/storage/tier_manager.h"
#include "test_util.h"

namespace kvd::storage {
namespace {

using kvd::testing::FlipByte;
using kvd::testing::ListSsts;
using testing::MakeKey;
using testing::RandomBytes;

constexpr size_t kChunk = 16 * 1024;  // several 4 KiB RocksDB blocks per chunk

std::vector<std::byte> ChunkBytes(uint64_t n) { return RandomBytes(kChunk, 1000 + n); }

Status Insert(DiskTier& t, uint64_t n) {
  const auto bytes = ChunkBytes(n);
  return t.Insert(MakeKey(n), 16, Checksum64(bytes.data(), bytes.size()), bytes);
}

// Reads chunk n: "ok" (byte-exact), "miss" (NOT_FOUND or DATA_LOSS: never served), or what
// else happened (other bytes, another error).
std::string Read(DiskTier& t, uint64_t n) {
  std::vector<std::byte> out(kChunk);
  auto r = t.ReadInto(MakeKey(n), out);
  if (r.ok()) return out == ChunkBytes(n) ? "ok" : "OTHER BYTES";
  if (r.status().code() == StatusCode::kNotFound || r.status().code() == StatusCode::kDataLoss) {
    return "miss";
  }
  return r.status().ToString();
}

DiskTierOptions Options(const std::filesystem::path& dir) {
  DiskTierOptions o;
  o.path = (dir / "db").string();
  o.capacity_bytes = 64 << 20;
  o.resume_interval_ms = 50;
  return o;
}

std::unique_ptr<DiskTier> OpenOrFail(const DiskTierOptions& o) {
  auto t = DiskTier::Open(o);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(t).value() : nullptr;
}

// Chunks [first, first + count) inserted and flushed into one table file per family; the
// first error.
Status InsertAndFlush(DiskTier& t, uint64_t first, uint64_t count) {
  for (uint64_t n = first; n < first + count; ++n) {
    if (Status s = Insert(t, n); !s.ok()) return s;
  }
  return t.Flush();
}

// Waits up to 20 s for the tier's writes to stop.
bool WaitWritesStopped(const DiskTier& t) {
  for (int i = 0; i < 2000 && !t.writes_stopped(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return t.writes_stopped();
}

// Level-0 file k (0..3) of StopWritesOnACorruptDataBlock: chunks k, k + 4, ..., k + 16. The
// files' key ranges overlap, so that their compaction reads them (files of disjoint ranges would
// be moved down a level without a read).
// The flush's status: the compaction the fourth file starts may fail before its Flush returns.
Status InsertAndFlushFile(DiskTier& t, uint64_t k) {
  for (uint64_t n = k; n < 20; n += 4) {
    if (Status s = Insert(t, n); !s.ok()) return s;
  }
  return t.Flush();
}
bool InDamagedFile(uint64_t n) { return n % 4 == 0; }

// File 0 gets a flipped byte in its middle data block while the tier is closed; then files 1..3:
// the fourth level-0 file starts a compaction of all four, which reads the damaged block.
// Returns the tier once its writes stopped.
std::unique_ptr<DiskTier> StopWritesOnACorruptDataBlock(const DiskTierOptions& o) {
  {
    auto tier = OpenOrFail(o);
    if (!tier) return nullptr;
    EXPECT_TRUE(InsertAndFlushFile(*tier, 0).ok());
  }
  const auto data = ListSsts(o.path, "default");
  EXPECT_EQ(data.size(), 1u);
  if (data.size() != 1) return nullptr;
  EXPECT_TRUE(FlipByte(data[0].path, data[0].data_bytes / 2));
  auto tier = OpenOrFail(o);  // open reads no data block: no damage seen yet
  if (!tier) return nullptr;
  EXPECT_FALSE(tier->writes_stopped());
  EXPECT_EQ(tier->Health().start, DiskHealthReport::Start::kClean);
  for (uint64_t k = 1; k < 3; ++k) EXPECT_TRUE(InsertAndFlushFile(*tier, k).ok()) << k;
  InsertAndFlushFile(*tier, 3).IgnoreError();
  EXPECT_TRUE(WaitWritesStopped(*tier)) << "the compaction did not stop the writes";
  return tier;
}

// The tier under test is opened by each test at dir_/db (the fixture's own disk tier there is
// closed first).
class DiskDamageTest : public testing::HostDiskFixture {
 protected:
  DiskDamageTest() : HostDiskFixture(64 * kChunk) {}
  void SetUp() override {
    HostDiskFixture::SetUp();
    disk_.reset();
  }
  // Chunks 0..4 and 5..9 in two table files per family, then chunks 10 .. 10 + wal_only - 1 in
  // the write-ahead log only; the tier closed again.
  void StoreTwoFiles(uint64_t wal_only) {
    auto tier = OpenOrFail(Options(dir_));
    ASSERT_TRUE(tier);
    ASSERT_TRUE(InsertAndFlush(*tier, 0, 5).ok());
    ASSERT_TRUE(InsertAndFlush(*tier, 5, 5).ok());
    for (uint64_t n = 10; n < 10 + wal_only; ++n) ASSERT_TRUE(Insert(*tier, n).ok());
  }
};

TEST_F(DiskDamageTest, CorruptDataBlockFoundByACompactionStopsWritesNotReadsAndIsRepairedAtOpen) {
  const DiskTierOptions o = Options(dir_);
  auto tier = StopWritesOnACorruptDataBlock(o);
  ASSERT_TRUE(tier);
  DiskHealthReport h = tier->Health();
  EXPECT_TRUE(h.writes_stopped);
  EXPECT_GE(h.background_errors, 1u);
  EXPECT_NE(h.stop_reason.find(".sst"), std::string::npos) << h.stop_reason;  // names the file
  // Writes are refused with a typed outcome and counted; nothing is written.
  const Status refused = Insert(*tier, 100);
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << refused;
  EXPECT_FALSE(tier->Contains(MakeKey(100)));
  EXPECT_EQ(tier->Health().writes_refused, 1u);
  // Reads go on: every chunk of the three intact files byte-exact; the damaged file's chunks
  // byte-exact or a miss, never other bytes, and the damaged block's chunk a miss.
  int missed = 0;
  for (uint64_t n = 0; n < 20; ++n) {
    const std::string r = Read(*tier, n);
    if (!InDamagedFile(n)) EXPECT_EQ(r, "ok") << n;
    EXPECT_TRUE(r == "ok" || r == "miss") << n << ": " << r;
    missed += r == "miss";
  }
  EXPECT_GE(missed, 1);
  // A corruption cannot be resumed from: the writes stay stopped (the resumer leaves it).
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_TRUE(tier->writes_stopped());

  // The next Open repairs: the database is moved aside, a repaired copy is served.
  tier.reset();
  tier = OpenOrFail(o);
  ASSERT_TRUE(tier);
  h = tier->Health();
  EXPECT_EQ(h.start, DiskHealthReport::Start::kRepaired);
  EXPECT_FALSE(h.writes_stopped);
  EXPECT_FALSE(h.start_damage.empty());
  EXPECT_TRUE(std::filesystem::is_directory(h.quarantine_path)) << h.quarantine_path;
  EXPECT_EQ(kvd::testing::QuarantineDirs(o.path).size(), 1u);
  for (uint64_t n = 0; n < 20; ++n) {
    const std::string r = Read(*tier, n);
    if (!InDamagedFile(n)) EXPECT_EQ(r, "ok") << n;
    EXPECT_TRUE(r == "ok" || r == "miss") << n << ": " << r;
  }
  // Writable again, durably: a chunk put now is there after one more (clean) open.
  ASSERT_TRUE(Insert(*tier, 100).ok());
  tier.reset();
  tier = OpenOrFail(o);
  ASSERT_TRUE(tier);
  EXPECT_EQ(tier->Health().start, DiskHealthReport::Start::kClean);
  EXPECT_EQ(Read(*tier, 100), "ok");
}

TEST_F(DiskDamageTest, CorruptIndexBlockAtOpenIsMovedAsideAndTheOtherFilesAreServed) {
  const DiskTierOptions o = Options(dir_);
  ASSERT_NO_FATAL_FAILURE(StoreTwoFiles(0));
  const auto data = ListSsts(o.path, "default");
  ASSERT_EQ(data.size(), 2u);
  ASSERT_GT(data[0].index_bytes, 0u);
  ASSERT_TRUE(FlipByte(data[0].path, data[0].index_offset + data[0].index_bytes / 2));
  // The flip is in the index block: RocksDB cannot open that table any more.
  rocksdb::SstFileReader reader{rocksdb::Options()};
  ASSERT_FALSE(reader.Open(data[0].path.string()).ok());

  auto tier = OpenOrFail(o);  // on the previous code: DATA_LOSS
  ASSERT_TRUE(tier);
  const DiskHealthReport h = tier->Health();
  EXPECT_EQ(h.start, DiskHealthReport::Start::kRepaired);
  EXPECT_NE(h.start_damage.find(data[0].path.filename().string()), std::string::npos)
      << h.start_damage;
  // The quarantined copy is the database as it was found, the damaged table included.
  EXPECT_TRUE(
      std::filesystem::exists(std::filesystem::path(h.quarantine_path) / data[0].path.filename()));
  for (uint64_t n = 5; n < 10; ++n) EXPECT_EQ(Read(*tier, n), "ok") << n;
  for (uint64_t n = 0; n < 5; ++n) EXPECT_EQ(Read(*tier, n), "miss") << n;
  EXPECT_TRUE(Insert(*tier, 100).ok());
  EXPECT_EQ(Read(*tier, 100), "ok");
}

// A damaged MANIFEST or CURRENT (the files naming the tables): every table is intact, so the
// repair serves every chunk, the ones only in the write-ahead log included.
class DiskDamageMetadataTest : public DiskDamageTest,
                               public ::testing::WithParamInterface<const char*> {};

TEST_P(DiskDamageMetadataTest, DamagedFileAtOpenIsRepairedAndEveryChunkServed) {
  const DiskTierOptions o = Options(dir_);
  ASSERT_NO_FATAL_FAILURE(StoreTwoFiles(2));
  const std::filesystem::path file = kvd::testing::FindDbFile(o.path, GetParam());
  ASSERT_FALSE(file.empty()) << GetParam();
  const uint64_t size = std::filesystem::file_size(file);
  // CURRENT: its first byte, so that it names no MANIFEST; a MANIFEST: a byte in a record.
  ASSERT_TRUE(FlipByte(file, std::string(GetParam()) == "CURRENT" ? 0 : size / 2));

  auto tier = OpenOrFail(o);  // on the previous code: DATA_LOSS (MANIFEST), UNAVAILABLE (CURRENT)
  ASSERT_TRUE(tier);
  const DiskHealthReport h = tier->Health();
  EXPECT_EQ(h.start, DiskHealthReport::Start::kRepaired) << h.start_damage;
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(h.quarantine_path) / file.filename()));
  for (uint64_t n = 0; n < 12; ++n) EXPECT_EQ(Read(*tier, n), "ok") << n;
  EXPECT_TRUE(Insert(*tier, 100).ok());
}

INSTANTIATE_TEST_SUITE_P(Files, DiskDamageMetadataTest, ::testing::Values("MANIFEST-", "CURRENT"),
                         [](const auto& info) {
                           return std::string(info.param) == "CURRENT" ? "Current" : "Manifest";
                         });

TEST_F(DiskDamageTest, TornLastWalRecordOfACrashIsNoDamage) {
  // 12 chunks with a synced WAL, never flushed; the log cut in the middle of its last record,
  // as a kill -9 in the middle of a write leaves it. Not damage: no count, a clean start, the
  // 11 whole records served, the torn one absent.
  DiskTierOptions o = Options(dir_);
  o.sync_writes = true;
  {
    auto tier = OpenOrFail(o);
    ASSERT_TRUE(tier);
    for (uint64_t n = 0; n < 12; ++n) ASSERT_TRUE(Insert(*tier, n).ok());
  }
  const std::filesystem::path wal = kvd::testing::FindWal(o.path, 12 * kChunk);
  ASSERT_FALSE(wal.empty());
  std::filesystem::resize_file(wal, std::filesystem::file_size(wal) - kChunk / 2);

  auto tier = OpenOrFail(o);
  ASSERT_TRUE(tier);
  EXPECT_EQ(tier->wal_corruptions(), 0u);  // on the previous code: 1
  EXPECT_EQ(tier->Health().start, DiskHealthReport::Start::kClean);
  for (uint64_t n = 0; n < 11; ++n) EXPECT_EQ(Read(*tier, n), "ok") << n;
  EXPECT_EQ(Read(*tier, 11), "miss");
}

// The TierManager over a disk tier whose writes stopped: with on_disk_error kKeepInHost (the
// default) puts are acknowledged in host and served, chunks on disk are still promoted; with
// kFailPuts puts fail and nothing is acknowledged.
class TierManagerDiskStoppedTest : public testing::HostDiskFixture {
 protected:
  TierManagerDiskStoppedTest() : HostDiskFixture(64 * kChunk) {}
  void StopDiskWrites() {
    disk_.reset();
    disk_ = StopWritesOnACorruptDataBlock(Options(dir_));
    ASSERT_TRUE(disk_);
  }
  Status Put(uint64_t n) {
    const auto bytes = ChunkBytes(n);
    auto r = host_->Reserve(MakeKey(n), bytes.size(), 16, 0);
    if (!r.ok()) return r.status();
    std::memcpy(r->data, bytes.data(), bytes.size());
    return manager_->Commit(r->id, Checksum64(bytes.data(), bytes.size()));
  }
  // Lookup + read of chunk n through the manager (promotes from disk): "ok", "miss" or else.
  std::string Get(uint64_t n) {
    LookupRequest req;
    req.name_space = "default";
    req.model = "llama";
    req.layout_digest = 0xabcdef;
    req.codec_id = kRawCodecId;
    req.chunk_hashes = {Hash128{n, ~n}};
    auto l = manager_->Lookup(req);
    if (!l.ok()) return l.status().ToString();
    if (l->matched_chunks == 0) return "miss";
    auto view = host_->GetByKey(MakeKey(n), 0);
    std::string out = "OTHER BYTES";
    if (view.ok()) {
      if (view->meta.size_bytes == kChunk &&
          std::memcmp(view->data, ChunkBytes(n).data(), kChunk) == 0) {
        out = "ok";
      }
      host_->ReleaseRead(view->read_id).IgnoreError();
    }
    host_->ReleaseLease(l->lease_id).IgnoreError();
    return out;
  }
};

TEST_F(TierManagerDiskStoppedTest, PutsAreKeptInHostAndIntactChunksOnDiskServed) {
  ASSERT_NO_FATAL_FAILURE(StopDiskWrites());
  CreateManager(TierManagerOptions{});
  int acknowledged = 0;
  for (uint64_t n = 200; n < 220; ++n) {
    const Status s = Put(n);
    EXPECT_TRUE(s.ok()) << n << ": " << s;  // on the previous code: 20 of 20 fail
    acknowledged += s.ok();
  }
  EXPECT_EQ(acknowledged, 20);
  for (uint64_t n = 200; n < 220; ++n) EXPECT_EQ(Get(n), "ok") << n;
  for (uint64_t n = 1; n < 20; n += 4) EXPECT_EQ(Get(n), "ok") << n;  // promoted from disk
  EXPECT_EQ(disk_->Health().writes_refused, 20u);
  EXPECT_FALSE(disk_->Contains(MakeKey(200)));  // host only: nothing written to disk
  // A demotion pass drops no host-only chunk.
  auto demoted = manager_->MaybeDemote();
  ASSERT_TRUE(demoted.ok());
  EXPECT_EQ(demoted->demoted, 0u);
}

TEST_F(TierManagerDiskStoppedTest, WithFailPutsPutsFailAndNothingIsAcknowledged) {
  ASSERT_NO_FATAL_FAILURE(StopDiskWrites());
  TierManagerOptions options;
  options.on_disk_error = TierManagerOptions::OnDiskError::kFailPuts;
  CreateManager(options);
  const Status s = Put(200);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(Get(200), "miss");
  EXPECT_EQ(Get(1), "ok");
}

}  // namespace
}  // namespace kvd::storage
