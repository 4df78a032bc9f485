// Chaos: kill -9 of kvd in a loop during puts with a disk tier. Every acknowledged chunk must be
// served byte-exact after each restart, and no chunk may ever be visible with other bytes than
// the ones put (no torn chunk); the driver alternates one-exchange (inline) and three-step puts.
// A second test puts the same chunk from two writers and kills kvd right after the second one's
// acknowledgement. Label `chaos`; KVD_CHAOS_CYCLES sets the cycle count (default 20).
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <set>
#include <thread>

#include "e2e_common.h"

namespace kvd::e2e {
namespace {

int Cycles() {
  const char* v = std::getenv("KVD_CHAOS_CYCLES");
  return v != nullptr && std::atoi(v) > 0 ? std::atoi(v) : 20;
}

struct Verdict {
  uint64_t checked = 0, lost = 0, torn = 0, present_unacked = 0;
};

// Looks up and reads every chunk in `ns` one at a time (promotes from disk through a small host
// tier). `must_exist` chunks that are absent count as lost; any present chunk whose bytes differ
// from what was put counts as torn.
Verdict Verify(client::Client& c, const std::set<uint64_t>& ns, const std::set<uint64_t>& acked) {
  Verdict v;
  const size_t bytes = c.options().layout.ChunkBytes(kChaosTokens);
  std::vector<uint8_t> out(bytes);
  for (uint64_t n : ns) {
    const Hash128 h{kChaosHi, n};
    const bool must = acked.count(n) != 0;
    v.checked++;
    auto r = c.Lookup({&h, 1});
    if (!r.ok()) {
      ADD_FAILURE() << "lookup of chunk " << n << ": " << r.status();
      v.lost += must;
      continue;
    }
    if (r->matched_chunks == 0) {
      v.lost += must;
      if (must) ADD_FAILURE() << "acknowledged chunk " << n << " lost";
      continue;
    }
    if (!must) v.present_unacked++;
    auto g = c.Get(r->lease_id, 0, out.data(), out.size());
    if (!g.ok() || out != RandomBytes(bytes, n)) {
      v.torn++;
      ADD_FAILURE() << "chunk " << n << " served with other bytes than put"
                    << (g.ok() ? std::string() : ": " + g.status().ToString());
    }
    EXPECT_TRUE(c.ReleaseLease(r->lease_id).ok());
  }
  return v;
}

// "SEND n" / "ACK n" from the driver; false for any other line.
bool ParseDriverLine(const std::string& line, bool* ack, uint64_t* n) {
  unsigned long long v = 0;
  char word[8] = {};
  if (std::sscanf(line.c_str(), "%7s %llu", word, &v) != 2) return false;
  *ack = std::string(word) == "ACK";
  if (!*ack && std::string(word) != "SEND") return false;
  *n = v;
  return true;
}

TEST(ChaosE2eTest, KillNineDuringPutsWithADiskTierLosesNoAcknowledgedChunk) {
  const int cycles = Cycles();
  std::random_device rd;
  const TempDir dir("kvd-chaos-");
  KvdConfig config;
  config.ucx_tls = "tcp";         // no shared-memory segments left behind by the kill -9
  config.host_capacity = "2MiB";  // 51 chunks of 40 KiB: constant host pressure
  config.disk_path = (dir.path() / "db").string();
  config.disk_capacity = "1GiB";  // far above what 20 cycles put: no disk-capacity eviction
  std::set<uint64_t> acked, sent, last_cycle;
  uint64_t next = 1;
  Verdict total;
  std::mt19937 rng(rd());
  for (int cycle = 0; cycle < cycles; ++cycle) {
    auto kvd = StartKvd(config);
    ASSERT_NE(kvd, nullptr);
    {
      // What the previous cycle sent is checked after each restart (acknowledged: present and
      // byte-exact; not acknowledged: absent or byte-exact); everything again at the end.
      auto c = ConnectOrFail(kvd->EngineOptions("chaos-verify"));
      ASSERT_NE(c, nullptr);
      const Verdict v = Verify(*c, last_cycle, acked);
      last_cycle.clear();
      total.checked += v.checked;
      total.lost += v.lost;
      total.torn += v.torn;
      ASSERT_EQ(v.lost + v.torn, 0u) << "cycle " << cycle << "\n" << kvd->Log();
    }
    auto driver = ChildProcess::Spawn(
        {KVD_E2E_DRIVER, "chaos", kvd->tcp_address(), config.ucx_tls, std::to_string(next)});
    ASSERT_TRUE(driver.ok()) << driver.status();
    // Let it put for a random while (some cycles kill before the first ack), then kill -9.
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::milliseconds(std::uniform_int_distribution<int>(50, 600)(rng));
    while (std::chrono::steady_clock::now() < until) {
      auto line = (*driver)->ReadLine(std::chrono::milliseconds(50));
      if (!line.ok()) {
        if (line.status().code() == StatusCode::kDeadlineExceeded) continue;
        FAIL() << "driver: " << line.status() << "\n" << kvd->Log();
      }
      bool ack = false;
      uint64_t n = 0;
      if (!ParseDriverLine(*line, &ack, &n)) continue;
      if (!ack) {
        sent.insert(n);
        last_cycle.insert(n);
      } else {
        acked.insert(n);
      }
      next = std::max(next, n + 1);
    }
    kvd->Kill();
    // Acks the driver printed before it saw the daemon die are acknowledged too.
    while (true) {
      auto line = (*driver)->ReadLine(std::chrono::milliseconds(2000));
      if (!line.ok()) break;
      bool ack = false;
      uint64_t n = 0;
      if (!ParseDriverLine(*line, &ack, &n)) continue;
      if (ack) {
        acked.insert(n);
      } else {
        sent.insert(n);
        last_cycle.insert(n);
      }
      next = std::max(next, n + 1);
    }
    (*driver)->Kill();
  }
  {
    auto kvd = StartKvd(config);
    ASSERT_NE(kvd, nullptr);
    auto c = ConnectOrFail(kvd->EngineOptions("chaos-verify"));
    ASSERT_NE(c, nullptr);
    const Verdict v = Verify(*c, sent, acked);
    total.checked += v.checked;
    total.lost += v.lost;
    total.torn += v.torn;
    std::printf(
        "chaos: cycles=%d acknowledged=%zu sent=%zu sent_unacknowledged=%zu lost=%llu torn=%llu "
        "present_unacknowledged=%llu (final check)\n",
        cycles, acked.size(), sent.size(), sent.size() - acked.size(),
        static_cast<unsigned long long>(v.lost), static_cast<unsigned long long>(v.torn),
        static_cast<unsigned long long>(v.present_unacked));
    RecordProperty("acknowledged", static_cast<int>(acked.size()));
    RecordProperty("lost", static_cast<int>(v.lost));
    EXPECT_EQ(v.lost, 0u);
    EXPECT_EQ(v.torn, 0u);
    EXPECT_GE(acked.size(), static_cast<size_t>(cycles));  // the puts really ran
    auto admin = ConnectOrFail(kvd->AdminOptions());
    ASSERT_NE(admin, nullptr);
    auto stats = admin->GetStats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    for (const auto& t : stats->tiers) {
      if (t.name == "disk") EXPECT_EQ(t.evictions, 0u) << "the disk tier was sized too small";
    }
    admin.reset();
    c.reset();
    EXPECT_EQ(kvd->Stop(), 0) << kvd->Log();
  }
}

// Two writers of one chunk, kill -9 right after the second writer's acknowledgement: writer A
// puts the chunk; writer B looks it up until kvd serves it (A's commit published it in host; its
// disk write may still be in progress), then puts it too, and the moment B's put returns OK, kvd
// is killed. After the restart the chunk must be there, byte-exact: B was acknowledged, so it
// was on disk. With sync_writes the disk write (WAL + fsync) takes long enough that B comes while
// it is in progress in most cycles (printed as `raced`).
TEST(ChaosE2eTest, SameChunkFromTwoWritersKilledAfterTheSecondAckLosesNothing) {
  const int cycles = Cycles();
  const TempDir dir("kvd-chaos-same-");
  KvdConfig config;
  config.ucx_tls = "tcp";  // no shared-memory segments left behind by the kill -9
  config.disk_path = (dir.path() / "db").string();
  config.disk_extra = {"sync_writes: true"};
  constexpr uint64_t kHi = 0x5a3ec4;
  constexpr int kTokens = 256;
  uint64_t acknowledged = 0, raced = 0;
  std::vector<uint64_t> to_check;
  for (int cycle = 0; cycle <= cycles; ++cycle) {
    auto kvd = StartKvd(config);
    ASSERT_NE(kvd, nullptr);
    auto b = ConnectOrFail(kvd->EngineOptions("writer-b"));
    ASSERT_NE(b, nullptr);
    const size_t bytes = b->options().layout.ChunkBytes(kTokens);
    std::vector<uint8_t> out(bytes);
    for (uint64_t n : to_check) {  // every chunk acknowledged to B so far
      const Hash128 h{kHi, n};
      auto r = b->Lookup({&h, 1});
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_EQ(r->matched_chunks, 1u)
          << "cycle " << cycle << ": chunk " << n << " was acknowledged to its second writer "
          << "before kvd was killed, and is lost\n" << kvd->Log();
      auto g = b->Get(r->lease_id, 0, out.data(), out.size());
      ASSERT_TRUE(g.ok()) << g.status();
      ASSERT_EQ(out, RandomBytes(bytes, n)) << "chunk " << n;
      ASSERT_TRUE(b->ReleaseLease(r->lease_id).ok());
    }
    if (cycle == cycles) break;
    const uint64_t n = static_cast<uint64_t>(cycle) + 1;
    const Hash128 h{kHi, n};
    const std::vector<uint8_t> payload = RandomBytes(bytes, n);
    auto a = ConnectOrFail(kvd->EngineOptions("writer-a"));
    ASSERT_NE(a, nullptr);
    std::atomic<bool> a_done{false};
    std::thread writer_a([&] {
      (void)a->Put(h, kTokens, payload.data(), payload.size());
      a_done = true;
    });
    bool seen = false;
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!seen && std::chrono::steady_clock::now() < give_up) {
      auto r = b->Lookup({&h, 1});
      ASSERT_TRUE(r.ok()) << r.status();
      seen = r->matched_chunks == 1;
      if (seen) ASSERT_TRUE(b->ReleaseLease(r->lease_id).ok());
    }
    ASSERT_TRUE(seen) << "writer A's chunk never became visible\n" << kvd->Log();
    const bool a_was_done = a_done;
    auto put = b->Put(h, kTokens, payload.data(), payload.size());
    if (put.ok()) kvd->Kill();  // at once: nothing more may reach the disk after this ack
    writer_a.join();
    ASSERT_TRUE(put.ok()) << put.status() << "\n" << kvd->Log();
    acknowledged++;
    raced += !a_was_done;
    to_check.push_back(n);
    a.reset();
    b.reset();
    kvd.reset();
  }
  std::printf("chaos same chunk: cycles=%d acknowledged=%llu raced=%llu lost=0\n", cycles,
              static_cast<unsigned long long>(acknowledged),
              static_cast<unsigned long long>(raced));
  RecordProperty("raced", static_cast<int>(raced));
}

}  // namespace
}  // namespace kvd::e2e
