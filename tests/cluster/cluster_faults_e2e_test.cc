// Cluster faults during peer fetches, with three real kvds (127.0.0.2-4, UCX over tcp) on a
// real etcd-server: etcd stopped and restarted while a node fetches from a peer, and randomized
// fault cycles (a kvd SIGKILLed and restarted, etcd SIGKILLed and restarted, or none, each
// landing during a fetch). Every fetch is checked byte for byte and timed. Skipped when etcd is
// not installed.
//
// The fault cycles: KVD_FAULT_CYCLES (default 50) cycles, KVD_FAULT_SEED (default 1) seeds them.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>

#include "peer_cluster.h"

namespace kvd::e2e {
namespace {

class ClusterFaultsE2eTest : public PeerClusterTest {};

// What a run of cluster-scope lookups on a reader saw.
struct FetchCounts {
  int fetches = 0;       // lookups asked
  int whole = 0;         // every chunk of the chain matched and read back
  int partial = 0;       // some leading chunks
  int misses = 0;        // none
  int wrong_bytes = 0;   // chunks read back that differ from what was put: must stay 0
  int failed = 0;        // lookups or gets that returned an error
  double longest_s = 0;  // the slowest lookup and its gets
  int hung = 0;          // calls that took over kHungS: must stay 0
};

// A call that takes this long is hung: every client call is bounded by its timeouts (5 s in
// the harness's options) and every peer step by kPeerTimeoutMs.
constexpr double kHungS = 15.0;

// One cluster-scope lookup of `chain` on `reader` and a Get of every matched chunk, checked
// against `bytes`.
void FetchAndCheck(client::Client& reader, const std::vector<Hash128>& chain,
                   const std::vector<std::vector<uint8_t>>& bytes, FetchCounts* counts) {
  const auto start = std::chrono::steady_clock::now();
  ++counts->fetches;
  auto hit = reader.Lookup(chain, {.cluster = true});
  if (!hit.ok()) {
    ++counts->failed;
    const double took_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (took_s > kHungS) ++counts->hung;
    return;
  }
  for (uint32_t k = 0; k < hit->matched_chunks; ++k) {
    std::vector<uint8_t> out(bytes[k].size());
    auto got = reader.Get(hit->lease_id, k, out.data(), out.size());
    if (!got.ok()) {
      ++counts->failed;
    } else if (out != bytes[k]) {
      ++counts->wrong_bytes;
    }
  }
  if (hit->lease_id != 0) reader.ReleaseLease(hit->lease_id).IgnoreError();
  if (hit->matched_chunks == chain.size()) {
    ++counts->whole;
  } else if (hit->matched_chunks == 0) {
    ++counts->misses;
  } else {
    ++counts->partial;
  }
  const double took_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  counts->longest_s = std::max(counts->longest_s, took_s);
  if (took_s > kHungS) ++counts->hung;
}

// Stops a thread's loop and joins it however the test ends: a failed ASSERT returns early, and a
// joinable std::thread destroyed would end the process (leaving its kvds' folders behind).
struct StopAndJoin {
  std::atomic<bool>& stop;
  std::thread& thread;
  ~StopAndJoin() {
    stop.store(true);
    if (thread.joinable()) thread.join();
  }
};

void Print(const char* phase, const FetchCounts& c) {
  std::printf(
      "[cluster-faults] %-24s %3d fetches: %3d whole, %d partial, %d misses, %d wrong bytes, "
      "%d failed calls, %d hung; slowest %.3f s\n",
      phase, c.fetches, c.whole, c.partial, c.misses, c.wrong_bytes, c.failed, c.hung, c.longest_s);
}

// etcd is SIGKILLed and restarted while a fetches chains from b. What the code does: the data
// path needs no etcd. While etcd is away every kvd keeps its last member list (reachable 0 on
// /metrics; Place and cluster-scope lookups say membership_current false) and a keeps fetching
// from b through it; once etcd is back every kvd registers again and the list is current.
// Phases: 0 from the start through the kill until every kvd reports etcd unreachable, 1 from then
// through the restart until every kvd has registered again, 2 after that.
TEST_F(ClusterFaultsE2eTest, EtcdKilledAndRestartedDuringPeerFetchesNoWrongBytesNoHang) {
  constexpr int kPhases = 3;
  constexpr int kPerPhase = 60;  // at most; the fetcher waits for the next phase when done
  constexpr int kChains = kPhases * kPerPhase;
  auto writer = ConnectOrFail(kvds_[1]->EngineOptions("writer-b"));
  auto reader = ConnectOrFail(kvds_[0]->EngineOptions("reader-a"));
  ASSERT_TRUE(writer && reader);
  std::vector<std::vector<Hash128>> chains;
  std::vector<std::vector<std::vector<uint8_t>>> bytes;
  for (int i = 0; i < kChains; ++i) {
    chains.push_back(reader->hasher().ChunkChain(RandomTokens(256, 3000 + i), true));
    bytes.push_back(PutPrefix(*writer, chains.back(), 1, 7000 + i));
  }
  writer.reset();

  std::atomic<int> phase{0};
  std::atomic<bool> stop{false};
  FetchCounts counts[kPhases];
  std::atomic<int> done[kPhases] = {0, 0, 0};
  std::thread fetcher([&] {
    int next = 0;
    while (!stop.load()) {
      const int p = phase.load();
      if (done[p].load() >= kPerPhase) {
        std::this_thread::sleep_for(milliseconds(5));
        continue;
      }
      FetchAndCheck(*reader, chains[next], bytes[next], &counts[p]);
      ++next;
      done[p].fetch_add(1);
      std::this_thread::sleep_for(milliseconds(50));
    }
  });
  StopAndJoin join_fetcher{stop, fetcher};  // also when a failed ASSERT returns early
  auto after_fetches = [&](int p, int n) {
    return Eventually([&] { return done[p].load() >= n; }, milliseconds(20000));
  };

  EXPECT_TRUE(after_fetches(0, 10));
  etcd_->Kill();
  EXPECT_TRUE(AllSee(-1, 0, milliseconds(5000)));
  phase.store(1);
  auto placed = reader->Place(chains[0]);
  ASSERT_TRUE(placed.ok()) << placed.status();
  EXPECT_FALSE(placed->membership_current);
  EXPECT_GT(placed->membership_age_ms, 0u);
  EXPECT_EQ(placed->targets.size(), 3u);
  // A cluster-scope lookup says so too: its holders come from the last member list seen, which
  // is older than the moment etcd was killed.
  auto seen = reader->Lookup(chains[0], {.cluster = true});
  ASSERT_TRUE(seen.ok()) << seen.status();
  EXPECT_FALSE(seen->membership_current);
  EXPECT_GT(seen->membership_age_ms, 0u);
  EXPECT_EQ(seen->holders.size(), 3u);
  reader->ReleaseLease(seen->lease_id).IgnoreError();
  EXPECT_TRUE(after_fetches(1, 20));

  ASSERT_TRUE(etcd_->Restart().ok());
  EXPECT_TRUE(AllSee(3, 1, milliseconds(15000)));
  phase.store(2);
  EXPECT_TRUE(after_fetches(2, 10));
  stop.store(true);
  fetcher.join();
  placed = reader->Place(chains[0]);
  ASSERT_TRUE(placed.ok()) << placed.status();
  EXPECT_TRUE(placed->membership_current);
  EXPECT_EQ(placed->membership_age_ms, 0u);
  seen = reader->Lookup(chains[0], {.cluster = true});
  ASSERT_TRUE(seen.ok()) << seen.status();
  EXPECT_TRUE(seen->membership_current);
  EXPECT_EQ(seen->membership_age_ms, 0u);
  reader->ReleaseLease(seen->lease_id).IgnoreError();
  for (auto& kvd : kvds_) EXPECT_GE(MetricValue(*kvd, "kvd_cluster_registrations_total"), 2);

  const char* names[kPhases] = {"etcd up, then killed:", "etcd seen away:", "registered again:"};
  for (int p = 0; p < kPhases; ++p) {
    Print(names[p], counts[p]);
    EXPECT_EQ(counts[p].wrong_bytes, 0) << names[p];
    EXPECT_EQ(counts[p].failed, 0) << names[p];
    // b never went away: every fetch is whole, etcd or not.
    EXPECT_EQ(counts[p].whole, counts[p].fetches) << names[p];
    EXPECT_GE(counts[p].fetches, 10) << names[p];
    // No hang: a generous bound, not a speed (each peer step is bounded by kPeerTimeoutMs).
    EXPECT_LT(counts[p].longest_s, 10.0) << names[p];
  }
}

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

enum class Fault { kNone, kKillWriter, kKillOther, kEtcd };
constexpr const char* kFaultNames[] = {"none", "kill -9 the writer", "kill -9 another kvd",
                                       "kill -9 etcd"};

// Randomized fault cycles. Each cycle: a random kvd (the writer) puts a fresh 2-chunk chain;
// another (the reader) asks a cluster-scope lookup of it and reads every matched chunk; a fault
// drawn at random lands 0-15 ms into that fetch: the writer SIGKILLed, the third kvd
// SIGKILLed, etcd SIGKILLed, or none. Then whatever was killed is restarted (a kvd: a fresh
// process, same node id and IP, empty tiers) and the next cycle starts once the members
// see each other again (or 5 s have passed: then its misses count). Nothing may serve wrong
// bytes and no call may hang; misses and failed calls (the reader's own kvd killed, a peer
// mid-fetch) are counted.
TEST_F(ClusterFaultsE2eTest, RandomizedFaultCyclesServeNoWrongBytesAndNoCallHangs) {
  const int cycles = EnvInt("KVD_FAULT_CYCLES", 50);
  const int seed = EnvInt("KVD_FAULT_SEED", 1);
  std::mt19937_64 rng(static_cast<uint64_t>(seed));
  FetchCounts counts;
  int faults[4] = {0, 0, 0, 0};
  int put_failures = 0, restarts = 0, slow_to_converge = 0;
  const auto started = std::chrono::steady_clock::now();
  for (int cycle = 0; cycle < cycles; ++cycle) {
    const int w = static_cast<int>(rng() % 3);
    const int r = (w + 1 + static_cast<int>(rng() % 2)) % 3;
    const int other = 3 - w - r;
    const Fault fault = static_cast<Fault>(rng() % 4);
    const int delay_ms = static_cast<int>(rng() % 16);
    ++faults[static_cast<int>(fault)];

    auto writer = ConnectOrFail(kvds_[w]->EngineOptions("writer"));
    auto reader = ConnectOrFail(kvds_[r]->EngineOptions("reader"));
    ASSERT_TRUE(writer && reader) << "cycle " << cycle;
    auto chain = writer->hasher().ChunkChain(RandomTokens(2 * 256, 50000 + cycle), true);
    std::vector<std::vector<uint8_t>> bytes;
    for (size_t k = 0; k < chain.size(); ++k) {
      auto data = RandomBytes(writer->options().layout.ChunkBytes(256), 90000 + 10 * cycle + k);
      auto put = writer->Put(chain[k], 256, data.data(), data.size());
      if (!put.ok()) ++put_failures;
      bytes.push_back(std::move(data));
    }
    writer.reset();

    std::thread injector([&] {
      std::this_thread::sleep_for(milliseconds(delay_ms));
      switch (fault) {
        case Fault::kKillWriter:
          kvds_[w]->Kill();
          break;
        case Fault::kKillOther:
          kvds_[other]->Kill();
          break;
        case Fault::kEtcd:
          etcd_->Kill();
          break;
        case Fault::kNone:
          break;
      }
    });
    FetchAndCheck(*reader, chain, bytes, &counts);
    injector.join();
    reader.reset();

    // Restore: restart what was killed, then wait for the membership to settle.
    for (int i = 0; i < 3; ++i) {
      if (kvds_[i]->Alive()) continue;
      kvds_[i].reset();
      kvds_[i] =
          StartNode(std::string(1, static_cast<char>('a' + i)), 2 + i, kToken, i == 2 ? 16 : 8);
      ASSERT_NE(kvds_[i], nullptr) << "cycle " << cycle;
      ++restarts;
    }
    if (fault == Fault::kEtcd) ASSERT_TRUE(etcd_->Restart().ok()) << "cycle " << cycle;
    if (!AllSee(3, 1, milliseconds(5000))) ++slow_to_converge;
  }
  const double took_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::printf("[fault-cycles] %d cycles (seed %d) in %.0f s; faults: ", cycles, seed, took_s);
  for (int f = 0; f < 4; ++f)
    std::printf("%s %d%s", kFaultNames[f], faults[f], f < 3 ? ", " : "\n");
  Print("fault cycles:", counts);
  std::printf(
      "[fault-cycles] %d kvd restarts, %d failed puts, %d cycles whose membership took over "
      "5 s to settle\n",
      restarts, put_failures, slow_to_converge);
  EXPECT_EQ(counts.wrong_bytes, 0);
  EXPECT_EQ(counts.hung, 0);
  EXPECT_EQ(counts.fetches, cycles);
  // The cycles without a fault on the writer's side fetch: a run that fetches nothing tests
  // nothing.
  EXPECT_GE(counts.whole, cycles / 5);
}

}  // namespace
}  // namespace kvd::e2e
