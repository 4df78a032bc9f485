// A damaged disk tier degrades a real kvd instead of stopping it: one flipped byte in an SST
// data block, found by a compaction, stops RocksDB's writes, and kvd keeps acknowledging puts
// (in host memory) and serving the intact chunks on disk, health DEGRADED naming the error; the
// next start repairs. A damaged MANIFEST at start: kvd starts and serves every chunk.
#include <chrono>
#include <filesystem>
#include <thread>

#include "../common/rocksdb_damage.h"
#include "e2e_common.h"

namespace kvd::e2e {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kHi = 0xd15cda;
constexpr int kTokens = 64;  // 80 KiB of stories260k KV per chunk

// The value of the unlabelled (node-only) series `metric` in a /metrics scrape, or "".
std::string SeriesValue(const std::string& scrape, const std::string& metric) {
  const size_t at = scrape.find("\n" + metric + "{");
  if (at == std::string::npos) return "";
  const size_t close = scrape.find("} ", at);
  const size_t end = scrape.find('\n', at + 1);
  return close < end ? scrape.substr(close + 2, end - close - 2) : "";
}

class DiskDamageE2eTest : public ::testing::Test {
 protected:
  KvdConfig Config() const {
    KvdConfig c;
    c.disk_path = (dir_.path() / "db").string();
    c.metrics = true;
    return c;
  }
  std::string db() const { return (dir_.path() / "db").string(); }
  static Hash128 H(uint64_t i) { return Hash128{kHi, i}; }
  // Chunk i's bytes, or empty when kvd does not serve it (never other bytes: the client
  // verifies every chunk against its commit checksum).
  static std::vector<uint8_t> Fetch(client::Client& c, uint64_t i) {
    const Hash128 h = H(i);
    auto hit = c.Lookup({&h, 1});
    EXPECT_TRUE(hit.ok()) << hit.status();
    if (!hit.ok() || hit->matched_chunks == 0) return {};
    std::vector<uint8_t> out(c.options().layout.ChunkBytes(kTokens));
    auto g = c.Get(hit->lease_id, 0, out.data(), out.size());
    EXPECT_TRUE(c.ReleaseLease(hit->lease_id).ok());
    return g.ok() ? out : std::vector<uint8_t>{};
  }
  static std::vector<uint8_t> Bytes(client::Client& c, uint64_t i) {
    return RandomBytes(c.options().layout.ChunkBytes(kTokens), 7000 + i);
  }
  static bool Put(client::Client& c, uint64_t i) {
    const auto data = Bytes(c, i);
    return c.Put(H(i), kTokens, data.data(), data.size()).ok();
  }
  // Run r of kvd: start, put chunks r, r + 4, r + 8, r + 12, stop. Each start replays the
  // previous run's write-ahead log into a new level-0 table file; the files' key ranges
  // overlap, so that their compaction reads them (disjoint ones would be moved, not read).
  void RunAndPut(uint64_t r) {
    auto kvd = StartKvd(Config());
    ASSERT_TRUE(kvd);
    auto c = ConnectOrFail(kvd->EngineOptions());
    ASSERT_TRUE(c);
    for (uint64_t i = r; i < 16; i += 4) ASSERT_TRUE(Put(*c, i)) << i;
    EXPECT_EQ(kvd->Stop(), 0);
  }
  static std::string HealthStatus(client::Client& admin) {
    auto h = admin.GetHealth();
    EXPECT_TRUE(h.ok()) << h.status();
    return h.ok() ? h->status : std::string();
  }

  TempDir dir_{"kvd-disk-damage-"};
};

TEST_F(DiskDamageE2eTest, FlippedSstByteKvdKeepsAcceptingPutsAndServingIntactChunks) {
  // Runs 0..2: their chunks in the log, then in level-0 files 1 and 2 (runs 0 and 1).
  for (uint64_t r : {0, 1, 2}) ASSERT_NO_FATAL_FAILURE(RunAndPut(r));
  const auto data = kvd::testing::ListSsts(db(), "default");
  ASSERT_EQ(data.size(), 2u);
  ASSERT_TRUE(kvd::testing::FlipByte(data[0].path, data[0].data_bytes / 2));  // run 0's chunks
  // Run 3 makes file 3 at its start; the fifth start makes file 4, whose flush starts the
  // compaction of all four level-0 files that reads the flipped block.
  ASSERT_NO_FATAL_FAILURE(RunAndPut(3));
  auto kvd = StartKvd(Config());
  ASSERT_TRUE(kvd);
  auto engine = ConnectOrFail(kvd->EngineOptions());
  auto admin = ConnectOrFail(kvd->AdminOptions());
  ASSERT_TRUE(engine && admin);
  std::string status;
  for (int i = 0; i < 150; ++i) {
    status = HealthStatus(*admin);
    if (status.find("disk tier writes stopped") != std::string::npos) break;
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_NE(status.find("disk tier writes stopped by a RocksDB background error"),
            std::string::npos)
      << status;
  EXPECT_NE(status.find(".sst"), std::string::npos) << status;  // names the damaged file

  // Puts are acknowledged (host memory) and served.
  int acknowledged = 0;
  for (uint64_t i = 100; i < 120; ++i) acknowledged += Put(*engine, i);
  EXPECT_EQ(acknowledged, 20);  // on the previous code: 0 of 20 (UNAVAILABLE from the disk)
  for (uint64_t i = 100; i < 120; ++i) EXPECT_EQ(Fetch(*engine, i), Bytes(*engine, i)) << i;
  // Intact chunks on disk are served byte-exact; the damaged file's (run 0: i % 4 == 0) are
  // byte-exact or a miss.
  int missed = 0;
  for (uint64_t i = 0; i < 16; ++i) {
    const auto got = Fetch(*engine, i);
    if (i % 4 != 0 || !got.empty()) EXPECT_EQ(got, Bytes(*engine, i)) << i;
    missed += got.empty();
  }
  EXPECT_GE(missed, 1);
  auto health = admin->GetHealth();
  ASSERT_TRUE(health.ok());
  EXPECT_TRUE(health->ok);
  EXPECT_TRUE(health->degraded);
  EXPECT_EQ(CounterValue(*admin, "disk_writes_stopped"), 1u);
  EXPECT_GE(CounterValue(*admin, "disk_writes_refused"), 20u);
  auto scrape = HttpGet(kvd->metrics_address(), "/metrics");
  ASSERT_TRUE(scrape.ok()) << scrape.status();
  EXPECT_EQ(SeriesValue(*scrape, "kvd_disk_writes_stopped"), "1");
  EXPECT_EQ(SeriesValue(*scrape, "kvd_degraded"), "1");
  EXPECT_EQ(kvd->Stop(), 0);

  // The next start repairs: kvd serves the intact chunks, writes to disk again, and says so.
  kvd = StartKvd(Config());
  ASSERT_TRUE(kvd) << "kvd did not start after the background corruption";
  engine = ConnectOrFail(kvd->EngineOptions());
  admin = ConnectOrFail(kvd->AdminOptions());
  ASSERT_TRUE(engine && admin);
  status = HealthStatus(*admin);
  EXPECT_NE(status.find("disk tier damaged at start"), std::string::npos) << status;
  EXPECT_NE(status.find(".quarantine-"), std::string::npos) << status;
  EXPECT_NE(kvd->Log().find("damaged database moved aside"), std::string::npos);
  EXPECT_EQ(CounterValue(*admin, "disk_writes_stopped"), 0u);
  EXPECT_EQ(CounterValue(*admin, "disk_start_repaired"), 1u);
  for (uint64_t i = 0; i < 16; ++i) {
    const auto got = Fetch(*engine, i);
    if (i % 4 != 0 || !got.empty()) EXPECT_EQ(got, Bytes(*engine, i)) << i;
  }
  ASSERT_TRUE(Put(*engine, 200));
  EXPECT_EQ(kvd->Stop(), 0);
  kvd = StartKvd(Config());  // durable again: on disk across a restart, and a clean start
  ASSERT_TRUE(kvd);
  engine = ConnectOrFail(kvd->EngineOptions());
  admin = ConnectOrFail(kvd->AdminOptions());
  ASSERT_TRUE(engine && admin);
  EXPECT_EQ(Fetch(*engine, 200), Bytes(*engine, 200));
  EXPECT_EQ(HealthStatus(*admin).rfind("serving", 0), 0u) << HealthStatus(*admin);
}

TEST_F(DiskDamageE2eTest, DamagedManifestKvdStartsAndServes) {
  for (uint64_t r : {0, 1}) ASSERT_NO_FATAL_FAILURE(RunAndPut(r));
  const std::filesystem::path manifest = kvd::testing::FindDbFile(db(), "MANIFEST-");
  ASSERT_FALSE(manifest.empty());
  ASSERT_TRUE(kvd::testing::FlipByte(manifest, std::filesystem::file_size(manifest) / 2));
  auto kvd = StartKvd(Config());  // on the previous code: exit 1, DATA_LOSS
  ASSERT_TRUE(kvd) << "kvd did not start on a damaged MANIFEST";
  auto engine = ConnectOrFail(kvd->EngineOptions());
  auto admin = ConnectOrFail(kvd->AdminOptions());
  ASSERT_TRUE(engine && admin);
  for (uint64_t i = 0; i < 16; ++i) {
    if (i % 4 < 2) EXPECT_EQ(Fetch(*engine, i), Bytes(*engine, i)) << i;  // runs 0 and 1
  }
  const std::string status = HealthStatus(*admin);
  EXPECT_NE(status.find("disk tier damaged at start"), std::string::npos) << status;
  EXPECT_NE(status.find(manifest.filename().string()), std::string::npos) << status;
  const auto quarantine = kvd::testing::QuarantineDirs(db());
  ASSERT_EQ(quarantine.size(), 1u);
  EXPECT_NE(kvd->Log().find(quarantine[0].string()), std::string::npos);  // named in the log
  EXPECT_TRUE(Put(*engine, 50));
  EXPECT_EQ(Fetch(*engine, 50), Bytes(*engine, 50));
  EXPECT_EQ(CounterValue(*admin, "disk_writes_stopped"), 0u);
}

}  // namespace
}  // namespace kvd::e2e
