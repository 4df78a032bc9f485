// Integrity end to end (real kvd with a disk tier): a chunk whose bytes rotted on disk and a
// write-ahead log damaged mid-way are found, logged, counted in `kvdctl stats` and /metrics,
// make `kvdctl health` degraded with the reason, and never stop the other chunks from being
// served. And bytes changed in kvd's memory after the commit are DATA_LOSS on the get (the
// client verifies every chunk it receives against the checksum it was committed with).
#include <fcntl.h>
#include <rocksdb/db.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "../common/wal_damage.h"
#include "e2e_common.h"

namespace kvd::e2e {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kHi = 0x1e7e9;
constexpr int kTokens = 64;  // 80 KiB of stories260k KV per chunk

class TempDisk {
 public:
  TempDisk() {
    char tmpl[] = "/tmp/kvd-integrity-XXXXXX";
    path_ = ::mkdtemp(tmpl) != nullptr ? tmpl : "";
  }
  ~TempDisk() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  std::string db() const { return path_ + "/db"; }

 private:
  std::string path_;
};

// The value of an unlabelled series `kvd_<name>` in a /metrics scrape, or -1.
double MetricValue(const std::string& scrape, const std::string& metric) {
  const std::string prefix = metric + "{";
  for (size_t at = 0; (at = scrape.find(prefix, at)) != std::string::npos; ++at) {
    if (at != 0 && scrape[at - 1] != '\n') continue;
    const size_t close = scrape.find("} ", at);
    const size_t end = scrape.find('\n', at);
    if (close == std::string::npos || close > end) continue;
    return std::stod(scrape.substr(close + 2, end - close - 2));
  }
  return -1;
}

class IntegrityE2eTest : public ::testing::Test {
 protected:
  KvdConfig Config() const {
    KvdConfig c;
    c.disk_path = disk_.db();
    c.disk_extra = {"sync_writes: true"};
    c.metrics = true;
    return c;
  }
  // Starts kvd with `config` and puts `n` chunks one at a time (each acknowledged, so written
  // through to disk; a failed put is a test failure); `data` gets their bytes. nullptr (and a
  // test failure) when kvd did not start or did not take a client.
  std::unique_ptr<KvdProcess> StartAndPut(const KvdConfig& config, int n,
                                          std::vector<std::vector<uint8_t>>* data) {
    auto kvd = StartKvd(config);
    EXPECT_TRUE(kvd);
    if (!kvd) return nullptr;
    auto c = ConnectOrFail(kvd->EngineOptions());
    if (!c) return nullptr;
    data->clear();
    for (int i = 0; i < n; ++i) {
      data->push_back(PutChunk(*c, Hash128{kHi, static_cast<uint64_t>(i)}, 500 + i, kTokens));
    }
    return kvd;
  }
  // Lookup + Get of chunk i on its own: the bytes, or empty when kvd does not serve it.
  std::vector<uint8_t> Fetch(client::Client& c, int i) {
    const Hash128 h{kHi, static_cast<uint64_t>(i)};
    auto hit = c.Lookup({&h, 1});
    EXPECT_TRUE(hit.ok()) << hit.status();
    if (!hit.ok() || hit->matched_chunks == 0) return {};
    std::vector<uint8_t> out(c.options().layout.ChunkBytes(kTokens));
    auto g = c.Get(hit->lease_id, 0, out.data(), out.size());
    EXPECT_TRUE(g.ok()) << g.status();
    EXPECT_TRUE(c.ReleaseLease(hit->lease_id).ok());
    return g.ok() ? out : std::vector<uint8_t>{};
  }
  std::string KvdctlHealth(KvdProcess& kvd, int* rc) {
    std::string out;
    *rc = RunProgram({KVDCTL_BINARY, "--addr", kvd.tcp_address(), "health"}, &out);
    return out;
  }

  TempDisk disk_;
};

TEST_F(IntegrityE2eTest, CorruptChunkOnDiskIsCountedDegradesHealthAndOthersAreServed) {
  constexpr int kChunks = 6;
  std::vector<std::vector<uint8_t>> data;
  {
    auto kvd = StartAndPut(Config(), kChunks, &data);
    ASSERT_TRUE(kvd);
    int rc = -1;
    const std::string healthy = KvdctlHealth(*kvd, &rc);
    EXPECT_EQ(rc, 0) << healthy;
    EXPECT_EQ(healthy.rfind("OK  serving", 0), 0u) << healthy;
    auto scrape = HttpGet(kvd->metrics_address(), "/metrics");
    ASSERT_TRUE(scrape.ok()) << scrape.status();
    EXPECT_EQ(MetricValue(*scrape, "kvd_degraded"), 0.0);
    EXPECT_EQ(kvd->Stop(), 0) << kvd->Log();
  }
  {
    // Rot one payload byte of the first chunk in key order behind kvd's back (its header and
    // the RocksDB record stay intact: only kvd's own checksum can tell).
    rocksdb::DB* raw = nullptr;
    std::vector<std::string> names;  // every family the tier has ("default" = chunk values)
    ASSERT_TRUE(rocksdb::DB::ListColumnFamilies({}, disk_.db(), &names).ok());
    std::vector<rocksdb::ColumnFamilyDescriptor> families;
    for (const std::string& n : names) families.push_back({n, {}});
    ASSERT_EQ(names[0], rocksdb::kDefaultColumnFamilyName);
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
    ASSERT_TRUE(rocksdb::DB::Open({}, disk_.db(), families, &handles, &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    std::unique_ptr<rocksdb::Iterator> it(db->NewIterator({}, handles[0]));
    it->SeekToFirst();
    ASSERT_TRUE(it->Valid());
    const std::string key = it->key().ToString();
    std::string value = it->value().ToString();
    it.reset();
    ASSERT_GT(value.size(), 1000u);
    value[1000] = static_cast<char>(value[1000] ^ 0x10);
    ASSERT_TRUE(db->Put({}, handles[0], key, value).ok());
    for (auto* h : handles) ASSERT_TRUE(db->DestroyColumnFamilyHandle(h).ok());
  }
  auto kvd = StartKvd(Config());
  ASSERT_TRUE(kvd);
  auto engine = ConnectOrFail(kvd->EngineOptions());
  auto admin = ConnectOrFail(kvd->AdminOptions());
  ASSERT_TRUE(engine && admin);
  EXPECT_EQ(CounterValue(*admin, "disk_checksum_failures"), 0u);  // found on read, not at start

  int corrupt = -1;
  for (int i = 0; i < kChunks; ++i) {
    const std::vector<uint8_t> got = Fetch(*engine, i);
    if (got.empty()) {
      EXPECT_EQ(corrupt, -1) << "chunks " << corrupt << " and " << i << " both missing";
      corrupt = i;
      continue;
    }
    EXPECT_EQ(got, data[i]) << "chunk " << i << " served with other bytes";
  }
  ASSERT_NE(corrupt, -1) << "the rotted chunk was served";
  // The damage is logged with the chunk's key and the reason.
  EXPECT_NE(kvd->Log().find("is corrupt: checksum"), std::string::npos) << kvd->Log();
  EXPECT_NE(kvd->Log().find("lookup prefix shortened"), std::string::npos);

  // Dropped, not retried: a second lookup is a plain miss, and counts nothing more.
  EXPECT_TRUE(Fetch(*engine, corrupt).empty());
  EXPECT_EQ(CounterValue(*admin, "disk_checksum_failures"), 1u);
  EXPECT_EQ(CounterValue(*admin, "promote_failures"), 1u);
  EXPECT_EQ(CounterValue(*admin, "promote_errors"), 1u);
  // A chain through the corrupt chunk stops right before it.
  std::vector<Hash128> chain;
  for (int i = 0; i < kChunks; ++i) chain.push_back(Hash128{kHi, static_cast<uint64_t>(i)});
  auto prefix = engine->Lookup(chain);
  ASSERT_TRUE(prefix.ok()) << prefix.status();
  EXPECT_EQ(prefix->matched_chunks, static_cast<uint32_t>(corrupt));
  if (prefix->lease_id) {
    EXPECT_TRUE(engine->ReleaseLease(prefix->lease_id).ok());
  }

  auto health = admin->GetHealth();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_TRUE(health->ok);
  EXPECT_TRUE(health->degraded);
  EXPECT_NE(health->status.find("degraded: 1 corrupt chunk(s) found on disk"), std::string::npos)
      << health->status;
  EXPECT_NE(health->status.find("1 promotion(s) into host failed"), std::string::npos)
      << health->status;
  int rc = -1;
  const std::string text = KvdctlHealth(*kvd, &rc);
  EXPECT_EQ(rc, 0) << text;  // degraded still serves
  EXPECT_EQ(text.rfind("DEGRADED  degraded: 1 corrupt chunk(s)", 0), 0u) << text;

  auto scrape = HttpGet(kvd->metrics_address(), "/metrics");
  ASSERT_TRUE(scrape.ok()) << scrape.status();
  EXPECT_EQ(MetricValue(*scrape, "kvd_disk_checksum_failures_total"), 1.0);
  EXPECT_EQ(MetricValue(*scrape, "kvd_promote_errors_total"), 1.0);
  EXPECT_EQ(MetricValue(*scrape, "kvd_disk_wal_corruptions_total"), 0.0);
  EXPECT_EQ(MetricValue(*scrape, "kvd_degraded"), 1.0);

  // Still serving: a new put and every intact chunk.
  ExpectServes(*engine, 77);
  EXPECT_EQ(Fetch(*engine, (corrupt + 1) % kChunks), data[(corrupt + 1) % kChunks]);
}

TEST_F(IntegrityE2eTest, DamagedWalTailKvdStartsCountsItAndServesWhatPrecedesIt) {
  // Puts acknowledged with a synced WAL, then kill -9 (nothing flushed: the WAL is the only
  // copy), one byte flipped two thirds into the log, restart.
  constexpr int kChunks = 24;
  std::vector<std::vector<uint8_t>> data;
  {
    auto kvd = StartAndPut(Config(), kChunks, &data);
    ASSERT_TRUE(kvd);
    kvd->Kill();
  }
  const uint64_t chunk_bytes = data[0].size();
  const std::filesystem::path wal = kvd::testing::FindWal(disk_.db(), kChunks * chunk_bytes);
  ASSERT_FALSE(wal.empty()) << "no write-ahead log holding the chunks in " << disk_.db();
  const uint64_t wal_size = std::filesystem::file_size(wal);
  const uint64_t flip_at = wal_size * 2 / 3;
  ASSERT_TRUE(kvd::testing::FlipByte(wal, flip_at));
  auto kvd = StartKvd(Config());
  ASSERT_TRUE(kvd) << "kvd did not start on a damaged WAL";
  EXPECT_NE(kvd->Log().find("damaged write-ahead log record"), std::string::npos) << kvd->Log();
  auto engine = ConnectOrFail(kvd->EngineOptions());
  auto admin = ConnectOrFail(kvd->AdminOptions());
  ASSERT_TRUE(engine && admin);
  EXPECT_EQ(CounterValue(*admin, "disk_wal_corruptions"), 1u);
  auto health = admin->GetHealth();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_TRUE(health->ok);
  EXPECT_TRUE(health->degraded);
  EXPECT_NE(health->status.find("1 damaged write-ahead log(s)"), std::string::npos)
      << health->status;

  // Served: a prefix of the put order, byte-exact, reaching at least every chunk whose record
  // ends before the flipped byte (a record is a little over wal_size / kChunks); nothing after
  // the damage is served with other bytes.
  int served = 0;
  for (int i = 0; i < kChunks; ++i) {
    const std::vector<uint8_t> got = Fetch(*engine, i);
    if (got.empty()) continue;
    EXPECT_EQ(got, data[i]) << "chunk " << i;
    EXPECT_EQ(served, i) << "chunk " << i << " served after a missing one";
    served++;
  }
  EXPECT_GE(served, static_cast<int>(flip_at * kChunks / wal_size) - 1);
  EXPECT_LT(served, kChunks);
  ExpectServes(*engine, 78);
  EXPECT_EQ(kvd->Stop(), 0);
}

// A restart with a lower tiers.disk.capacity: kvd serves the chunks that fit, leaves the others
// on disk (counted, logged, not damage: health stays clean), and a restart with the old capacity
// serves every chunk again, byte-exact.
TEST_F(IntegrityE2eTest, ALowerDiskCapacityAtRestartKeepsWhatDoesNotFitOnDisk) {
  constexpr int kChunks = 4;
  std::vector<std::vector<uint8_t>> data;
  {
    auto kvd = StartAndPut(Config(), kChunks, &data);
    ASSERT_TRUE(kvd);
    EXPECT_EQ(kvd->Stop(), 0);
  }
  const uint64_t chunk_bytes = data[0].size();
  auto count_served = [&](KvdProcess& kvd) {
    auto engine = ConnectOrFail(kvd.EngineOptions());
    if (!engine) return -1;
    int served = 0;
    for (int i = 0; i < kChunks; ++i) {
      const std::vector<uint8_t> got = Fetch(*engine, i);
      if (got.empty()) continue;
      EXPECT_EQ(got, data[i]) << "chunk " << i;
      served++;
    }
    return served;
  };
  {
    KvdConfig small = Config();
    small.disk_capacity = std::to_string(2 * chunk_bytes + chunk_bytes / 2);  // room for two
    auto kvd = StartKvd(small);
    ASSERT_TRUE(kvd);
    EXPECT_NE(kvd->Log().find("chunk over the capacity left in the database"), std::string::npos)
        << kvd->Log();
    auto admin = ConnectOrFail(kvd->AdminOptions());
    ASSERT_TRUE(admin);
    EXPECT_EQ(CounterValue(*admin, "disk_over_capacity_records"), 2u);
    auto health = admin->GetHealth();
    ASSERT_TRUE(health.ok()) << health.status();
    EXPECT_TRUE(health->ok);
    EXPECT_FALSE(health->degraded) << health->status;
    EXPECT_EQ(count_served(*kvd), 2);
    EXPECT_EQ(kvd->Stop(), 0);
  }
  auto kvd = StartKvd(Config());
  ASSERT_TRUE(kvd);
  auto admin = ConnectOrFail(kvd->AdminOptions());
  ASSERT_TRUE(admin);
  EXPECT_EQ(CounterValue(*admin, "disk_over_capacity_records"), 0u);
  EXPECT_EQ(count_served(*kvd), kChunks);
  EXPECT_EQ(kvd->Stop(), 0);
}

// Flips the byte `offset` bytes after the first occurrence of `needle` in kvd's shared-memory
// arena (its memfd segments, reached through /proc/<pid>/fd). false if not found.
bool FlipInArena(pid_t pid, const std::vector<uint8_t>& needle, size_t offset) {
  const std::string fds = "/proc/" + std::to_string(pid) + "/fd";
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(fds, ec)) {
    std::error_code link_ec;
    const std::string target = std::filesystem::read_symlink(e.path(), link_ec).string();
    if (link_ec || target.rfind("/memfd:kvd-arena-", 0) != 0) continue;
    const int fd = ::open(e.path().c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) continue;
    const off_t size = ::lseek(fd, 0, SEEK_END);
    void* map = size > 0 ? ::mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE,
                                  MAP_SHARED, fd, 0)
                         : MAP_FAILED;
    ::close(fd);
    if (map == MAP_FAILED) continue;
    auto* base = static_cast<uint8_t*>(map);
    void* at = ::memmem(base, static_cast<size_t>(size), needle.data(), needle.size());
    const bool found = at != nullptr && static_cast<uint8_t*>(at) + offset < base + size;
    if (found) static_cast<uint8_t*>(at)[offset] ^= 0x20;
    ::munmap(map, static_cast<size_t>(size));
    if (found) return true;
  }
  return false;
}

TEST_F(IntegrityE2eTest, BytesChangedInMemoryAreDataLossOnTheGetOnBothPaths) {
  KvdConfig c;
  c.host_capacity = "64MiB";
  c.host_segment = "8MiB";  // the shared-memory path: the arena is memfd segments
  std::vector<std::vector<uint8_t>> data;
  auto kvd = StartAndPut(c, 3, &data);
  ASSERT_TRUE(kvd);
  // A bit flips in memory after the commit (a RAM fault, a stray write).
  ASSERT_TRUE(FlipInArena(kvd->pid(), data[1], 1000)) << "chunk 1 not found in kvd's arena";
  auto shm = ConnectOrFail(kvd->UnixEngineOptions("shm"));
  auto tcp = ConnectOrFail(kvd->EngineOptions("tcp"));
  ASSERT_TRUE(shm && tcp);
  ASSERT_TRUE(shm->session().shared_memory);
  for (client::Client* cl : {shm.get(), tcp.get()}) {
    SCOPED_TRACE(cl == shm.get() ? "shared-memory path" : "transport path");
    const Hash128 h{kHi, 1};
    auto hit = cl->Lookup({&h, 1});
    ASSERT_TRUE(hit.ok()) << hit.status();
    ASSERT_EQ(hit->matched_chunks, 1u);
    std::vector<uint8_t> out(data[1].size());
    auto g = cl->Get(hit->lease_id, 0, out.data(), out.size());
    ASSERT_FALSE(g.ok()) << "a changed chunk was served";
    EXPECT_EQ(g.status().code(), StatusCode::kDataLoss) << g.status();
    EXPECT_NE(g.status().message().find("checksum mismatch"), std::string::npos) << g.status();
    EXPECT_TRUE(cl->ReleaseLease(hit->lease_id).ok());
    // The neighbours are intact and served.
    EXPECT_EQ(Fetch(*cl, 0), data[0]);
    EXPECT_EQ(Fetch(*cl, 2), data[2]);
  }
  // kvd itself checked the bytes before sending them over the transport: the chunk is dropped
  // (a miss from now on), logged and counted; the shared-memory get was the client's check.
  auto admin = ConnectOrFail(kvd->AdminOptions());
  ASSERT_TRUE(admin);
  EXPECT_EQ(CounterValue(*admin, "host_corrupt_dropped"), 1u);
  EXPECT_NE(kvd->Log().find("to=transport"), std::string::npos) << kvd->Log();
  EXPECT_EQ(Present(*tcp, Hash128{kHi, 1}), 0u);
  EXPECT_EQ(Present(*shm, Hash128{kHi, 1}), 0u);
  ExpectServes(*tcp, 79);
}

// A shared-memory put's checksum is its writer's: by default (tiers.host.verify_shm_commits
// off) kvd records it at the commit without reading the bytes. One that does not match them
// (here a client that corrupts the checksum it sends) is acknowledged, but never served: the
// shared-memory reader's check fails the get, and kvd's check before a transport send fails it
// too and drops the chunk. With a disk tier the write-through checks it at the commit (the bytes
// leave host memory there): the put fails and nothing is stored.
TEST_F(IntegrityE2eTest, AWrongChecksumOfASharedMemoryPutIsNeverServed) {
  for (const bool with_disk : {false, true}) {
    SCOPED_TRACE(with_disk ? "with a disk tier" : "host memory only");
    KvdConfig c = with_disk ? Config() : KvdConfig{};
    c.host_capacity = "64MiB";
    c.host_segment = "8MiB";
    auto kvd = StartKvd(c);
    ASSERT_TRUE(kvd);
    client::TestHooks hooks;
    hooks.corrupt_checksum = 0x1;
    auto bad = ConnectOrFail(kvd->UnixEngineOptions("corrupting"), hooks);
    auto shm = ConnectOrFail(kvd->UnixEngineOptions("shm"));
    auto tcp = ConnectOrFail(kvd->EngineOptions("tcp"));
    auto admin = ConnectOrFail(kvd->AdminOptions());
    ASSERT_TRUE(bad && shm && tcp && admin);
    ASSERT_TRUE(bad->session().shared_memory && shm->session().shared_memory);
    const Hash128 h{kHi, 7};
    const auto data = RandomBytes(bad->options().layout.ChunkBytes(kTokens), 707);
    auto put = bad->Put(h, kTokens, data.data(), data.size());
    if (with_disk) {
      EXPECT_EQ(put.status().code(), StatusCode::kDataLoss) << put.status();
      EXPECT_NE(put.status().message().find("checksum mismatch"), std::string::npos)
          << put.status();
      EXPECT_EQ(CounterValue(*admin, "host_checksum_failures"), 1u);
      EXPECT_EQ(Present(*shm, h), 0u) << "a refused commit became visible";
      ExpectServes(*shm, 81);
      continue;
    }
    ASSERT_TRUE(put.ok()) << put.status();  // nothing read the bytes at the commit
    EXPECT_EQ(CounterValue(*admin, "host_checksum_failures"), 0u);
    for (client::Client* cl : {shm.get(), tcp.get()}) {
      SCOPED_TRACE(cl == shm.get() ? "shared-memory reader" : "transport reader");
      auto hit = cl->Lookup({&h, 1});
      ASSERT_TRUE(hit.ok()) << hit.status();
      ASSERT_EQ(hit->matched_chunks, 1u);
      std::vector<uint8_t> out(data.size());
      auto g = cl->Get(hit->lease_id, 0, out.data(), out.size());
      EXPECT_EQ(g.status().code(), StatusCode::kDataLoss) << "served: " << g.status();
      EXPECT_NE(g.status().message().find("checksum mismatch"), std::string::npos) << g.status();
      EXPECT_TRUE(cl->ReleaseLease(hit->lease_id).ok());
    }
    // kvd's check before the transport send dropped it: a miss from now on, for everyone.
    EXPECT_EQ(CounterValue(*admin, "host_corrupt_dropped"), 1u);
    EXPECT_EQ(Present(*shm, h), 0u);
    ExpectServes(*shm, 80);
    ExpectServes(*tcp, 82);
  }
}

// A writer holding a read-write descriptor of its namespace's segment can still make its
// mapping writable (mprotect) and change a chunk after its commit. The chunk's checksum catches
// it where the bytes leave host memory: at the demotion to disk the chunk is dropped (never
// written to disk, a miss from then on), logged and counted; every other chunk is served.
TEST_F(IntegrityE2eTest, AChunkChangedAfterItsCommitIsDroppedAtDemotionAndCounted) {
  // Host: 12 MiB in two 6 MiB segments (a full smollm2 chunk must fit one), chunks of 80 KiB.
  // The put of chunk kChunks - 1 takes host over the default high watermark (0.90) first; the
  // disk holds all chunks but one, so that same put's write-through evicts chunk 0's disk copy
  // (its LRU) just before the demotion pass that puts it first in line.
  constexpr uint64_t kChunkKiB = 80, kHostKiB = 12 * 1024;
  constexpr int kChunks = static_cast<int>(kHostKiB * 9 / 10 / kChunkKiB) + 1;  // 139
  KvdConfig c = Config();
  c.disk_extra = {};
  c.host_capacity = std::to_string(kHostKiB) + "KiB";
  c.host_segment = "6MiB";
  c.disk_capacity = std::to_string((kChunks - 1) * kChunkKiB + kChunkKiB / 2) + "KiB";
  auto kvd = StartKvd(c);
  ASSERT_TRUE(kvd);
  auto writer = ConnectOrFail(kvd->UnixEngineOptions("writer"));
  auto admin = ConnectOrFail(kvd->AdminOptions());
  ASSERT_TRUE(writer && admin);
  ASSERT_TRUE(writer->session().shared_memory) << kvd->Log();

  std::vector<std::vector<uint8_t>> data;
  data.push_back(PutChunk(*writer, Hash128{kHi, 0}, 500, kTokens));
  ASSERT_EQ(data[0].size(), kChunkKiB * 1024);
  // The misbehaving writer: it opens its read-only mapping again and flips one byte of chunk 0.
  bool flipped = false;
  for (const auto& seg : writer->SharedSegments()) {
    auto* base = const_cast<std::byte*>(seg.data);
    void* at = ::memmem(base, seg.size, data[0].data(), data[0].size());
    if (at == nullptr) continue;
    ASSERT_EQ(::mprotect(base, seg.size, PROT_READ | PROT_WRITE), 0) << std::strerror(errno);
    static_cast<uint8_t*>(at)[1000] ^= 0x20;
    ASSERT_EQ(::mprotect(base, seg.size, PROT_READ), 0) << std::strerror(errno);
    flipped = true;
  }
  ASSERT_TRUE(flipped) << "chunk 0 not found in the writer's mapping";
  for (int i = 1; i < kChunks; ++i) {
    data.push_back(PutChunk(*writer, Hash128{kHi, static_cast<uint64_t>(i)}, 500 + i, kTokens));
  }
  // Host is over its high watermark now: the demotion pass starts from the LRU end, chunk 0.
  // (That chunk 0 was dropped, and not just taken out of host, shows it had no disk copy left.)
  EXPECT_TRUE(Eventually([&] { return CounterValue(*admin, "host_corrupt_dropped") == 1; }, 10s))
      << kvd->Log();
  EXPECT_TRUE(Eventually([&] { return CounterValue(*admin, "demotions") >= 1; }, 10s));
  EXPECT_NE(kvd->Log().find("chunk changed in host memory after its commit; dropped, not copied"),
            std::string::npos)
      << kvd->Log();
  EXPECT_EQ(CounterValue(*admin, "disk_checksum_failures"), 0u);  // the disk copies are sound

  auto reader = ConnectOrFail(kvd->EngineOptions("reader"));
  ASSERT_TRUE(reader);
  EXPECT_TRUE(Fetch(*reader, 0).empty()) << "the changed chunk was served";
  for (int i = 1; i < kChunks; ++i) EXPECT_EQ(Fetch(*reader, i), data[i]) << "chunk " << i;

  auto health = admin->GetHealth();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_TRUE(health->degraded);
  EXPECT_NE(health->status.find("1 chunk(s) changed in host memory after their commit"),
            std::string::npos)
      << health->status;
  auto scrape = HttpGet(kvd->metrics_address(), "/metrics");
  ASSERT_TRUE(scrape.ok()) << scrape.status();
  EXPECT_EQ(MetricValue(*scrape, "kvd_host_corrupt_dropped_total"), 1.0);
  int rc = -1;
  std::string stats;
  rc = RunProgram({KVDCTL_BINARY, "--addr", kvd->tcp_address(), "stats"}, &stats);
  EXPECT_EQ(rc, 0) << stats;
  EXPECT_NE(stats.find("host_corrupt_dropped"), std::string::npos) << stats;
  ExpectServes(*writer, 80);
}

}  // namespace
}  // namespace kvd::e2e
