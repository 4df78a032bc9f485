// Per-namespace quotas through real kvd processes: one tenant reserving or pinning without limit
// cannot make another tenant's puts fail; a Lookup chain repeating one hash costs one lease entry;
// never-reading event subscribers of a tenant hold no more than the tenant's event budget; an
// engine's Stats shows its own namespace only.
#include <gmock/gmock.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <iostream>

#include "e2e_common.h"

namespace kvd::e2e {
namespace {

using client::KvEvent;
using client::KvEventKind;
using ::testing::HasSubstr;

class QuotaE2eTest : public TenantsE2eFixture {
 protected:
  QuotaE2eTest() : TenantsE2eFixture("namespace team-a tok-a\nnamespace team-b tok-b\n") {}
  // A 64 MiB host tier with the tokens file.
  KvdConfig Config() const {
    KvdConfig c;
    c.tokens_file = tokens_;
    c.host_capacity = "64MiB";
    return c;
  }
  client::ClientOptions Engine(const std::string& ns, bool unix_socket = false) {
    client::ClientOptions o =
        unix_socket ? kvd_->UnixEngineOptions("quota-" + ns) : kvd_->EngineOptions("quota-" + ns);
    o.name_space = ns;
    o.auth_token = ns == "team-a" ? "tok-a" : "tok-b";
    return o;
  }
  // The admin role over the unix socket (the tokens file has no admin token).
  client::ClientOptions LocalAdmin() {
    client::ClientOptions o = kvd_->AdminOptions();
    o.address = kvd_->unix_address();
    return o;
  }
  // Puts `n` full chunks of team-b and returns how many failed (with the first error).
  int VictimFailures(client::Client& b, int n, uint64_t seed, std::string* first_error) {
    int failures = 0;
    const auto data = RandomBytes(b.options().layout.ChunkBytes(256), seed);
    for (int i = 0; i < n; ++i) {
      auto r =
          b.Put({0xb0b, seed * 1000 + static_cast<uint64_t>(i)}, 256, data.data(), data.size());
      if (!r.ok()) {
        if (failures++ == 0) *first_error = r.status().ToString();
      }
    }
    return failures;
  }
};

// Team A holds shared-memory reservations (ReservePut, never committed) until kvd refuses;
// team B then puts 20 chunks. With the protective default (two namespaces in the tokens file) A
// is stopped at its reserved_bytes share and B's puts all succeed; with quotas.protect off A
// takes the whole tier and B's puts fail.
TEST_F(QuotaE2eTest, OneTenantReservingWithoutLimitCannotFailTheOthersPuts) {
  struct Run {
    int held = 0;         // reservations A got
    std::string refusal;  // the error that stopped A
    Reason refusal_reason = Reason::kNone;
    int failures = -1;  // of B's 20 puts
    std::string first_error;
  };
  auto run = [&](const std::string& extra_yaml) {
    Run out;
    KvdConfig c = Config();
    c.host_segment = "8MiB";
    c.extra_yaml = extra_yaml;
    kvd_ = StartKvd(c);
    if (kvd_ == nullptr) return out;
    auto a = ConnectOrFail(Engine("team-a", /*unix_socket=*/true));
    auto b = ConnectOrFail(Engine("team-b", /*unix_socket=*/true));
    if (!a || !b) return out;
    const size_t bytes = a->options().layout.ChunkBytes(256);
    std::vector<client::PutSlot> slots;
    for (uint64_t i = 0; i < 400; ++i) {
      auto slot = a->ReservePut({0xa11, i}, 256, bytes);
      if (!slot.ok()) {
        out.refusal = slot.status().ToString();
        out.refusal_reason = slot.status().reason();
        break;
      }
      slots.push_back(std::move(*slot));
    }
    out.held = static_cast<int>(slots.size());
    out.failures = VictimFailures(*b, 20, 1, &out.first_error);
    slots.clear();  // aborts A's reservations
    EXPECT_EQ(kvd_->Stop(), 0) << kvd_->Log();
    kvd_.reset();
    return out;
  };
  const Run protect = run("");
  const Run open = run("quotas:\n  protect: false\n");
  std::cout << "[ figures ] protective default: A held " << protect.held << " reservations ("
            << protect.refusal << "); B failed " << protect.failures << " of 20"
            << (protect.failures > 0 ? " (" + protect.first_error + ")" : "") << "\n"
            << "[ figures ] quotas.protect false: A held " << open.held << "; B failed "
            << open.failures << " of 20 (" << open.first_error << ")\n";
  EXPECT_EQ(protect.failures, 0) << protect.first_error;
  EXPECT_EQ(protect.refusal_reason, Reason::kQuotaExceeded);
  EXPECT_THAT(protect.refusal, HasSubstr("namespace \"team-a\" is at its quota reserved_bytes="));
  // 64 MiB / (2 x 2 namespaces) = 16 MiB: two whole 8 MiB segments of 25 reservations each.
  EXPECT_EQ(protect.held, 50);
  EXPECT_GT(open.failures, 0) << "without quotas A's reservations should starve B";
}

// Team A puts chunks and holds a lease on each until kvd refuses; team B then puts 20 chunks
// (one arena, over TCP: B must evict A's chunks to make room).
TEST_F(QuotaE2eTest, OneTenantPinningWithoutLimitCannotFailTheOthersPuts) {
  auto run = [&](const std::string& extra_yaml, int* leases, std::string* refusal,
                 std::string* first_error) {
    KvdConfig c = Config();
    c.extra_yaml = extra_yaml;
    kvd_ = StartKvd(c);
    if (kvd_ == nullptr) return -1;
    auto a = ConnectOrFail(Engine("team-a"));
    auto b = ConnectOrFail(Engine("team-b"));
    if (!a || !b) return -1;
    *leases = 0;
    const auto data = RandomBytes(a->options().layout.ChunkBytes(256), 7);
    for (uint64_t i = 0; i < 400; ++i) {
      const Hash128 h{0xa22, i};
      if (auto p = a->Put(h, 256, data.data(), data.size()); !p.ok()) {
        *refusal = p.status().ToString();  // the tier is all pinned
        break;
      }
      auto hit = a->Lookup({&h, 1});
      if (!hit.ok()) {
        *refusal = hit.status().ToString();
        break;
      }
      if (hit->matched_chunks == 0) break;  // evicted already: every chunk of A is leased
      ++*leases;
    }
    const int failures = VictimFailures(*b, 20, 2, first_error);
    EXPECT_EQ(kvd_->Stop(), 0) << kvd_->Log();
    kvd_.reset();
    return failures;
  };
  int leases_protect = 0, leases_open = 0;
  std::string refusal, refusal_open, error_protect, error_open;
  const int protect = run("", &leases_protect, &refusal, &error_protect);
  const int open = run("quotas:\n  protect: false\n", &leases_open, &refusal_open, &error_open);
  std::cout << "[ figures ] protective default: A leased " << leases_protect << " chunks ("
            << refusal << "); B failed " << protect << " of 20\n"
            << "[ figures ] quotas.protect false: A leased " << leases_open << " chunks; B failed "
            << open << " of 20 (" << error_open << ")\n";
  EXPECT_EQ(protect, 0) << error_protect;
  EXPECT_THAT(refusal, HasSubstr("namespace \"team-a\" is at its quota pinned_bytes="));
  EXPECT_GT(open, 0) << "without quotas A's leases should starve B";
}

// One stored chunk looked up as a chain of 65,536 copies of its hash, 512 leases held: each
// lease holds the chunk once, so kvd's memory does not grow with the chain. A lease that held
// the chain's entries would cost ~0.5 MiB (256 MiB for 512); what the bound allows besides one
// entry per lease is the allocator: each Lookup is a 1 MiB frame decoded into 2 MiB of keys on
// one of kvd's threads, and glibc keeps freed blocks of that size in per-thread arenas (a
// fresh-clone run on a busy machine measured +41 MiB). Warm-up lookups fill those arenas before
// the first reading; the bound is half of what the amplification would cost.
TEST_F(QuotaE2eTest, ALookupChainRepeatingOneHashCostsOneEntryPerLease) {
  KvdConfig c = Config();
  kvd_ = StartKvd(c);
  ASSERT_NE(kvd_, nullptr);
  auto a = ConnectOrFail(Engine("team-a"));
  ASSERT_NE(a, nullptr);
  const Hash128 h{0x4e9, 1};
  PutChunk(*a, h, 3, 4);
  const std::vector<Hash128> chain(65536, h);
  auto first = a->Lookup(chain);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->matched_chunks, 1u) << "the prefix ends before the first repeated hash";
  for (int i = 0; i < 32; ++i) {
    auto warm = a->Lookup(chain);
    ASSERT_TRUE(warm.ok()) << warm.status();
    ASSERT_TRUE(a->ReleaseLease(warm->lease_id).ok());
  }
  const uint64_t before = RssBytes(kvd_->pid());
  std::vector<uint64_t> leases;
  for (int i = 0; i < 512; ++i) {
    auto r = a->Lookup(chain);
    ASSERT_TRUE(r.ok()) << r.status();
    leases.push_back(r->lease_id);
  }
  const uint64_t after = RssBytes(kvd_->pid());
  const double grown_mib = (static_cast<double>(after) - static_cast<double>(before)) / (1 << 20);
  std::cout << "[ figures ] 512 leases of a 65,536-hash chain: kvd RSS +" << grown_mib << " MiB\n";
  EXPECT_LT(grown_mib, 128.0);
  // The lease serves the chunk.
  std::vector<uint8_t> out(a->options().layout.ChunkBytes(4));
  EXPECT_TRUE(a->Get(leases.back(), 0, out.data(), out.size()).ok());
  EXPECT_EQ(a->Get(leases.back(), 1, out.data(), out.size()).status().code(),
            StatusCode::kOutOfRange);
}

// Twenty engine subscribers of team A that never read, while A's puts make 2 events each
// (stored, and the eviction of an older chunk): kvd holds no more than A's queued_events budget
// for all of them, and a subscriber that finally reads finds a dropped marker.
TEST_F(QuotaE2eTest, SlowSubscribersOfOneTenantHoldOnlyItsEventBudget) {
  KvdConfig c = Config();
  kvd_ = StartKvd(c);
  ASSERT_NE(kvd_, nullptr);
  auto a = ConnectOrFail(Engine("team-a"));
  auto admin = ConnectOrFail(LocalAdmin());
  ASSERT_TRUE(a && admin);
  const size_t bytes = Stories260kLayout().ChunkBytes(1);
  const std::vector<uint8_t> data = RandomBytes(bytes, 9);
  uint64_t next = 0;
  auto put = [&](uint64_t n) {
    for (uint64_t done = 0; done < n; done += 64) {
      std::vector<client::PutItem> items(64);
      for (auto& it : items) it = {{0xe7, next++}, 1, data.data(), bytes};
      auto r = a->PutChunks(items);
      ASSERT_TRUE(r.ok()) << r.status();
    }
  };
  // Fill the host tier first (from here on every put evicts one chunk): kvd's own memory for
  // chunks stays flat while the subscribers' queues fill.
  put(80000);
  ASSERT_GT(HostTier(*admin).evictions, 0u);
  const uint64_t before = RssBytes(kvd_->pid());
  std::vector<std::unique_ptr<client::Client>> subscribers;
  for (int i = 0; i < 20; ++i) {
    auto s = ConnectOrFail(Engine("team-a", /*unix_socket=*/true));
    ASSERT_NE(s, nullptr);
    auto sub = s->SubscribeEvents({"", 65536});
    ASSERT_TRUE(sub.ok()) << sub.status();
    subscribers.push_back(std::move(s));
  }
  put(80000);  // 160,000 events for each subscriber
  const uint64_t after = RssBytes(kvd_->pid());
  const double grown_mib = (static_cast<double>(after) - static_cast<double>(before)) / (1 << 20);
  const uint64_t for_quota = CounterValue(*admin, "events_dropped_for_quota");
  std::cout << "[ figures ] 20 never-reading subscribers, 160,000 events each: kvd RSS +"
            << grown_mib << " MiB, " << for_quota << " events dropped for the tenant's quota\n";
  EXPECT_LT(grown_mib, 48.0);
  EXPECT_GT(for_quota, 0u);
  // The daemon kept serving, and a subscriber that reads now finds the marker.
  ExpectServes(*a, 12);
  bool marker = false;
  for (int polls = 0; polls < 2000 && !marker; ++polls) {
    auto batch = subscribers[0]->PollEvents(1000);
    ASSERT_TRUE(batch.ok()) << batch.status();
    if (batch->empty()) break;
    for (const KvEvent& e : *batch) marker = marker || e.kind == KvEventKind::kDropped;
  }
  EXPECT_TRUE(marker);
}

// Each tenant's Stats lists its own namespace only; the admin's lists both.
TEST_F(QuotaE2eTest, AnEngineStatsShowsItsOwnNamespaceOnly) {
  KvdConfig c = Config();
  kvd_ = StartKvd(c);
  ASSERT_NE(kvd_, nullptr);
  auto a = ConnectOrFail(Engine("team-a"));
  auto b = ConnectOrFail(Engine("team-b"));
  auto admin = ConnectOrFail(LocalAdmin());
  ASSERT_TRUE(a && b && admin);
  PutChunk(*a, {0x5a, 1}, 1, 16);
  PutChunk(*b, {0x5b, 1}, 2, 16);
  PutChunk(*b, {0x5b, 2}, 3, 16);
  auto names = [](const client::Stats& s) {
    std::vector<std::string> out;
    for (const auto& g : s.namespaces) out.push_back(g.name);
    return out;
  };
  auto sa = a->GetStats();
  ASSERT_TRUE(sa.ok()) << sa.status();
  EXPECT_EQ(names(*sa), std::vector<std::string>{"team-a"});
  auto sb = b->GetStats();
  ASSERT_TRUE(sb.ok()) << sb.status();
  EXPECT_EQ(names(*sb), std::vector<std::string>{"team-b"});
  ASSERT_EQ(sb->namespaces.size(), 1u);
  EXPECT_EQ(sb->namespaces[0].chunks, 2u);
  auto all = admin->GetStats();
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(names(*all), (std::vector<std::string>{"team-a", "team-b"}));
}

// A tokens file's quota words set that namespace's limits; a bad one is named at start.
TEST_F(QuotaE2eTest, TokensFileQuotaWordsSetLimitsAndBadOnesAreNamed) {
  std::ofstream(tokens_) << "namespace team-a tok-a leases=2\nnamespace team-b tok-b\n";
  KvdConfig c = Config();
  kvd_ = StartKvd(c);
  ASSERT_NE(kvd_, nullptr);
  auto a = ConnectOrFail(Engine("team-a"));
  auto b = ConnectOrFail(Engine("team-b"));
  ASSERT_TRUE(a && b);
  const Hash128 h{0x1ea5e, 1};
  PutChunk(*a, h, 1, 4);
  ASSERT_TRUE(a->Lookup({&h, 1}).ok());
  ASSERT_TRUE(a->Lookup({&h, 1}).ok());
  auto third = a->Lookup({&h, 1});
  EXPECT_EQ(third.status().code(), StatusCode::kResourceExhausted) << third.status();
  EXPECT_EQ(third.status().reason(), Reason::kQuotaExceeded) << third.status();
  EXPECT_THAT(third.status().message(), HasSubstr("namespace \"team-a\" is at its quota leases=2"));
  ExpectServes(*b, 5);  // team B is not limited by A's leases
  EXPECT_EQ(kvd_->Stop(), 0);
  kvd_.reset();

  std::ofstream(tokens_) << "namespace team-a tok-a leases=many\n";
  auto bad = KvdProcess::Start(c);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("line 1: namespace \"team-a\": leases: \"many\""));
}

}  // namespace
}  // namespace kvd::e2e
