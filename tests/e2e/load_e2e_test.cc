// Mixed load on a real kvd: 64 concurrent clients (threads of this process, each its own
// connection: half over the unix socket's shared-memory path, half over TCP + UCX) put, look up,
// get and release chunks of random sizes in 4 namespaces for KVD_LOAD_SECONDS (default 8),
// while `kvdctl health` runs every second. Asserted: every get byte-exact, no error other than
// the documented back-pressure (RESOURCE_EXHAUSTED), the daemon's counters equal what the
// clients did, nothing left open afterwards, kvd's memory flat over the second half, the daemon
// healthy and serving.
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "e2e_common.h"

namespace kvd::e2e {
namespace {

using namespace std::chrono_literals;

constexpr int kClients = 64;
constexpr int kNamespaces = 4;

// Chunks put so far in one namespace: hash -> (tokens, seed of the bytes).
struct Registry {
  std::mutex mu;
  std::vector<std::pair<Hash128, std::pair<int, uint64_t>>> chunks;
};

struct Totals {
  std::atomic<uint64_t> puts{0}, put_bytes{0}, lookups{0}, hits{0}, gets{0}, get_bytes{0};
  std::atomic<uint64_t> misses_after_eviction{0}, back_pressure{0}, mismatches{0};
  std::mutex mu;
  std::vector<std::string> errors;  // anything else: each is a failure
  void Error(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu);
    if (errors.size() < 20) errors.push_back(what);
  }
};

// RssAnon of `pid` in bytes (0 if unreadable): the process's private memory (sessions' buffers,
// heap). Not VmRSS: that also counts the host arena's shared-memory pages as kvd touches them
// (its start-up prefault, or puts into them), which grow up to the arena's capacity however
// the rest of kvd behaves; under load the arena was still filling at half time.
uint64_t AnonRssBytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string key;
  uint64_t kib = 0;
  while (in >> key) {
    if (key == "RssAnon:" && in >> kib) return kib * 1024;
    in.ignore(1 << 12, '\n');
  }
  return 0;
}

int LoadSeconds() {
  const char* env = std::getenv("KVD_LOAD_SECONDS");
  const int s = env != nullptr ? std::atoi(env) : 0;
  return s > 0 ? s : 8;
}

void RunClient(int id, const KvdProcess& kvd, std::chrono::steady_clock::time_point end,
               Registry* registries, Totals* totals) {
  client::ClientOptions o = kvd.EngineOptions("load-" + std::to_string(id));
  o.name_space = "ns" + std::to_string(id % kNamespaces);
  if (id % 2 == 0) o.address = kvd.unix_address();  // the shared-memory path
  auto connected = client::Client::Connect(o);
  if (!connected.ok()) {
    totals->Error("client " + std::to_string(id) + " connect: " + connected.status().ToString());
    return;
  }
  client::Client& c = **connected;
  Registry& reg = registries[id % kNamespaces];
  std::mt19937_64 rng(1000 + id);
  const size_t token_bytes = c.options().layout.ChunkBytes(1);
  std::vector<uint8_t> out;
  uint64_t next = 0;
  auto fail = [&](const std::string& op, const Status& s) {
    if (s.code() == StatusCode::kResourceExhausted) {
      totals->back_pressure++;
    } else {
      totals->Error("client " + std::to_string(id) + " " + op + ": " + s.ToString());
    }
  };
  while (std::chrono::steady_clock::now() < end) {
    const int op = static_cast<int>(rng() % 10);
    std::vector<std::pair<Hash128, std::pair<int, uint64_t>>> picked;
    if (op < 4) {  // put one chunk of 1..64 tokens (1.25..80 KiB)
      const int tokens = 1 + static_cast<int>(rng() % 64);
      const uint64_t seed = (static_cast<uint64_t>(id) << 32) | next;
      const Hash128 h{0x10ad0000ull + static_cast<uint64_t>(id), next++};
      const std::vector<uint8_t> data = RandomBytes(tokens * token_bytes, seed);
      auto r = c.Put(h, tokens, data.data(), data.size());
      if (!r.ok()) {
        fail("put", r.status());
        continue;
      }
      totals->puts++;
      totals->put_bytes += data.size();
      std::lock_guard<std::mutex> lock(reg.mu);
      reg.chunks.push_back({h, {tokens, seed}});
      continue;
    }
    {
      // Look up 1 chunk, or (op 9) a chain of 3 chunks of this namespace (any client's).
      std::lock_guard<std::mutex> lock(reg.mu);
      if (reg.chunks.empty()) continue;
      const size_t n = op == 9 ? 3 : 1;
      for (size_t i = 0; i < n; ++i) picked.push_back(reg.chunks[rng() % reg.chunks.size()]);
    }
    std::vector<Hash128> chain;
    for (const auto& p : picked) chain.push_back(p.first);
    auto hit = c.Lookup(chain);
    totals->lookups++;
    if (!hit.ok()) {
      fail("lookup", hit.status());
      continue;
    }
    if (hit->matched_chunks == 0) {
      // Host memory only: the least recently used chunks are evicted under pressure (the
      // documented policy of a node without a disk tier).
      totals->misses_after_eviction++;
      continue;
    }
    totals->hits++;
    for (uint32_t i = 0; i < hit->matched_chunks; ++i) {
      const auto& [tokens, seed] = picked[i].second;
      const std::vector<uint8_t> want = RandomBytes(tokens * token_bytes, seed);
      out.assign(want.size() + 64, 0);
      auto g = c.Get(hit->lease_id, i, out.data(), out.size());
      if (!g.ok()) {
        fail("get", g.status());
        continue;
      }
      totals->gets++;
      totals->get_bytes += g->bytes;
      if (g->bytes != want.size() || !std::equal(want.begin(), want.end(), out.begin())) {
        totals->mismatches++;
        totals->Error("client " + std::to_string(id) + " get: bytes differ from the put");
      }
    }
    if (Status s = c.ReleaseLease(hit->lease_id); !s.ok()) fail("release", s);
  }
}

TEST(LoadE2eTest, SixtyFourClientsMixedOpsByteExactCountersAddUpHealthy) {
  KvdConfig config;
  config.host_capacity = "96MiB";
  config.host_segment = "8MiB";  // 12 segments: the 4 namespaces and room to move
  config.extra_limits = {"max_sessions: 128"};
  auto kvd = StartKvd(config);
  ASSERT_TRUE(kvd);
  auto admin = ConnectOrFail(kvd->AdminOptions());
  ASSERT_TRUE(admin);

  Registry registries[kNamespaces];
  Totals totals;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(LoadSeconds());
  std::atomic<int> health_runs{0}, health_bad{0};
  std::string health_last;
  std::thread health([&] {
    while (std::chrono::steady_clock::now() < end) {
      std::string out;
      // The health verdict is asserted, not its speed: kvdctl's default 3 s connect timeout
      // missed the handshake once on a 2-core box at load 13-15 (64 clients beside a parallel
      // ctest), with kvd serving normally. 9 s, inside RunProgram's 10 s.
      const int rc = RunProgram(
          {KVDCTL_BINARY, "--addr", kvd->unix_address(), "--timeout-ms", "9000", "health"}, &out,
          10s);
      health_runs++;
      if (rc != 0 || out.rfind("OK  serving", 0) != 0) {
        health_bad++;
        health_last = "exit " + std::to_string(rc) + ": " + out;
      }
      std::this_thread::sleep_for(1s);
    }
  });
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back(RunClient, i, std::cref(*kvd), end, registries, &totals);
  }
  // kvd's private memory at half time and at the end: it must stay flat under steady load.
  std::this_thread::sleep_until(end - std::chrono::seconds(LoadSeconds()) / 2);
  const uint64_t rss_half = AnonRssBytes(kvd->pid());
  for (auto& t : clients) t.join();
  health.join();
  const uint64_t rss_end = AnonRssBytes(kvd->pid());

  for (const std::string& e : totals.errors) ADD_FAILURE() << e;
  EXPECT_EQ(totals.mismatches.load(), 0u);
  EXPECT_GT(health_runs.load(), 0);
  EXPECT_EQ(health_bad.load(), 0) << health_last;
  EXPECT_GT(totals.puts.load(), static_cast<uint64_t>(kClients));
  EXPECT_GT(totals.gets.load(), static_cast<uint64_t>(kClients));
  std::cout << "load: " << kClients << " clients, " << LoadSeconds() << " s: " << totals.puts
            << " puts (" << totals.put_bytes / 1024 << " KiB), " << totals.lookups << " lookups ("
            << totals.hits << " hits, " << totals.misses_after_eviction << " evicted), "
            << totals.gets << " gets (" << totals.get_bytes / 1024 << " KiB), "
            << totals.back_pressure << " back-pressure answers, " << health_runs
            << " kvdctl health runs; kvd RssAnon " << rss_half / (1 << 20) << " MiB at half time, "
            << rss_end / (1 << 20) << " MiB at the end\n";
  // Flat: the second half of the load (as many operations again) may not grow kvd by more
  // than a quarter of its host tier (sessions' buffers are bounded; the arena is full already).
  // Under AddressSanitizer (tests/sanitizers/run.sh asan builds this test and kvd alike) kvd's freed
  // blocks wait in ASan's quarantine, 256 MiB by default, before their memory is reused, so its
  // RSS grows by up to that much more: measured 286 -> 457 MiB with the default quarantine,
  // 82 -> 89 MiB with ASAN_OPTIONS=quarantine_size_mb=0, under the same load.
#if defined(__SANITIZE_ADDRESS__)
  constexpr uint64_t kAsanQuarantine = 256ull << 20;
#else
  constexpr uint64_t kAsanQuarantine = 0;
#endif
  EXPECT_LT(rss_end, rss_half + (24ull << 20) + kAsanQuarantine)
      << "kvd grew from " << rss_half << " to " << rss_end << " bytes";

  // The daemon's counters equal what the clients saw, and nothing is left open.
  ASSERT_TRUE(Eventually(
      [&] {
        auto s = admin->GetStats();
        return s.ok() && s->sessions == 1;
      },
      10s));
  auto stats = admin->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(CounterValue(*stats, "puts_committed") + CounterValue(*stats, "puts_deduplicated"),
            totals.puts.load());
  EXPECT_EQ(CounterValue(*stats, "gets"), totals.gets.load());
  EXPECT_EQ(CounterValue(*stats, "get_bytes"), totals.get_bytes.load());
  EXPECT_EQ(CounterValue(*stats, "host_leases_open"), 0u);
  EXPECT_EQ(CounterValue(*stats, "host_reservations_open"), 0u);
  EXPECT_EQ(CounterValue(*stats, "host_reads_open"), 0u);
  EXPECT_EQ(CounterValue(*stats, "errors_sent"), totals.back_pressure.load());
  auto health_after = admin->GetHealth();
  ASSERT_TRUE(health_after.ok()) << health_after.status();
  EXPECT_TRUE(health_after->ok);
  EXPECT_FALSE(health_after->degraded) << health_after->status;
  auto engine = ConnectOrFail(kvd->EngineOptions("after"));
  ASSERT_TRUE(engine);
  ExpectServes(*engine, 4242);
  EXPECT_EQ(kvd->Stop(), 0) << kvd->Log().substr(0, 4000);
}

}  // namespace
}  // namespace kvd::e2e
