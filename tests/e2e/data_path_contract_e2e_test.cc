// The data-path contract: the same put / get / lease / abort / peer-death cases, through the
// public client API against a real kvd, on each of the three ways chunk bytes travel:
//   ucx_tcp    control over TCP, bytes over UCX's tcp transport (remote clients);
//   ucx_cma    control over the unix socket, bytes over UCX's shared-memory lanes (sm: cma/posix),
//              the client's shared-memory path turned off;
//   memfd_shm  control over the unix socket, bytes copied by the client straight into and out of
//              the daemon's memfd arena segments (the same-node shared-memory path).
// The shared-memory path is not a transport::Transport backend (the transport contract suite
// covers those), so its contract is checked here, one level up, where all three meet.
#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "e2e_common.h"

namespace kvd::e2e {
namespace {

using namespace std::chrono_literals;

enum class DataPath { kUcxTcp, kUcxCma, kMemfdShm };

std::string PathName(DataPath p) {
  switch (p) {
    case DataPath::kUcxTcp:
      return "ucx_tcp";
    case DataPath::kUcxCma:
      return "ucx_cma";
    case DataPath::kMemfdShm:
      return "memfd_shm";
  }
  return "?";
}

class DataPathContractTest : public ::testing::TestWithParam<DataPath> {
 protected:
  void SetUp() override { Start(BaseConfig()); }

  static KvdConfig BaseConfig() {
    KvdConfig config;
    config.host_capacity = "64MiB";
    config.host_segment = "8MiB";  // below the capacity: the daemon offers shared memory
    return config;
  }
  void Start(const KvdConfig& config) {
    admin_.reset();
    kvd_ = StartKvd(config);
    ASSERT_NE(kvd_, nullptr);
    admin_ = ConnectOrFail(kvd_->AdminOptions());
    ASSERT_NE(admin_, nullptr);
  }

  // Engine options of this test's path, in namespace `ns` ("" = default).
  client::ClientOptions Options(const std::string& id, const std::string& ns = "") const {
    client::ClientOptions o;
    switch (GetParam()) {
      case DataPath::kUcxTcp:
        o = kvd_->EngineOptions(id);
        transport::MutableBackendOptions<transport::UcxOptions>(&o.transport).ucx_tls = "tcp";
        break;
      case DataPath::kUcxCma:
        o = kvd_->UnixEngineOptions(id);
        o.shared_memory = false;
        break;
      case DataPath::kMemfdShm:
        o = kvd_->UnixEngineOptions(id);
        break;
    }
    o.name_space = ns;
    return o;
  }
  // A kvd-e2e-driver child in `mode` on this path, once it printed `ready`; nullptr (and a
  // test failure) otherwise.
  std::unique_ptr<ChildProcess> SpawnDriver(const std::string& mode, const std::string& ready) {
    const client::ClientOptions o = Options("driver");
    auto child = ChildProcess::Spawn(
        {KVD_E2E_DRIVER, mode, o.address, UcxTls(o), o.shared_memory ? "shm" : "noshm"});
    EXPECT_TRUE(child.ok()) << child.status();
    if (!child.ok()) return nullptr;
    auto line = (*child)->ReadLine(10s);
    EXPECT_TRUE(line.ok()) << line.status() << "\n" << kvd_->Log();
    if (!line.ok() || *line != ready) {
      ADD_FAILURE() << "the driver said \"" << (line.ok() ? *line : "") << "\", not " << ready;
      return nullptr;
    }
    return std::move(child).value();
  }
  // Spawns a driver in `mode` that, once it printed `ready`, holds a part of the host tier
  // (`held`: its reserved or pinned bytes), kills it (SIGKILL) and checks that kvd lets that go.
  // Returns the driver's pid, 0 (and a test failure) when it did not start.
  pid_t KillDriverHolding(const std::string& mode, const std::string& ready,
                          uint64_t client::TierStats::*held, const std::string& not_freed) {
    auto child = SpawnDriver(mode, ready);
    if (child == nullptr) return 0;
    EXPECT_GT(HostTier(*admin_).*held, 0u);
    const pid_t pid = child->pid();
    child->Kill();
    EXPECT_TRUE(Eventually([&] { return HostTier(*admin_).*held == 0; }, 5s)) << not_freed;
    return pid;
  }
  // Connects on this path and checks the path is the one asked for.
  std::unique_ptr<client::Client> Connect(const std::string& id, const std::string& ns = "") {
    auto c = ConnectOrFail(Options(id, ns));
    if (c != nullptr) {
      EXPECT_EQ(c->session().shared_memory, GetParam() == DataPath::kMemfdShm) << kvd_->Log();
    }
    return c;
  }

  std::unique_ptr<KvdProcess> kvd_;
  std::unique_ptr<client::Client> admin_;
};

TEST_P(DataPathContractTest, PutAndGetAreByteExactAtEverySize) {
  auto c = Connect("exact");
  ASSERT_NE(c, nullptr);
  // Partial chunks (1 and 17 tokens), a full one, and a window larger than max_in_flight.
  const std::vector<int> tokens = {1, 17, 256, 256, 100, 256, 3, 256, 256, 255, 256, 64};
  std::vector<std::vector<uint8_t>> data;
  std::vector<client::PutItem> items;
  std::vector<Hash128> chain;
  for (size_t i = 0; i < tokens.size(); ++i) {
    data.push_back(RandomBytes(c->options().layout.ChunkBytes(tokens[i]), 700 + i));
    chain.push_back(Hash128{0xc0de, i});
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    items.push_back({chain[i], tokens[i], data[i].data(), data[i].size()});
  }
  auto put = c->PutChunks(items);
  ASSERT_TRUE(put.ok()) << put.status();
  for (size_t i = 0; i < tokens.size(); ++i) {
    EXPECT_FALSE((*put)[i].already_stored);
    EXPECT_EQ((*put)[i].bytes, data[i].size());
  }
  // Each chunk on its own (a one-chunk lookup each: the chain above is not a token prefix).
  for (size_t i = 0; i < tokens.size(); ++i) {
    auto hit = c->Lookup({&chain[i], 1});
    ASSERT_TRUE(hit.ok()) << hit.status();
    ASSERT_EQ(hit->matched_chunks, 1u) << "chunk " << i;
    std::vector<uint8_t> out(data[i].size() + 13, 0xee);  // a larger buffer is fine
    auto got = c->Get(hit->lease_id, 0, out.data(), out.size());
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->bytes, data[i].size());
    EXPECT_TRUE(std::equal(data[i].begin(), data[i].end(), out.begin())) << "chunk " << i;
    EXPECT_TRUE(std::all_of(out.begin() + data[i].size(), out.end(), [](uint8_t b) {
      return b == 0xee;
    })) << "a get wrote past the chunk";
    // A buffer one byte short is refused, naming both sizes, and nothing is left pinned.
    std::vector<uint8_t> small(data[i].size() - 1);
    auto short_get = c->Get(hit->lease_id, 0, small.data(), small.size());
    EXPECT_EQ(short_get.status().code(), StatusCode::kOutOfRange) << short_get.status();
    EXPECT_NE(short_get.status().message().find(std::to_string(data[i].size())), std::string::npos)
        << short_get.status();
    EXPECT_TRUE(c->ReleaseLease(hit->lease_id).ok());
  }
  // A second put of the same key is deduplicated, never written over.
  auto again = RandomBytes(data[2].size(), 9999);
  auto dup = c->Put(chain[2], 256, again.data(), again.size());
  ASSERT_TRUE(dup.ok()) << dup.status();
  EXPECT_TRUE(dup->already_stored);
  auto hit = c->Lookup({&chain[2], 1});
  ASSERT_TRUE(hit.ok() && hit->matched_chunks == 1u);
  std::vector<uint8_t> out(data[2].size());
  ASSERT_TRUE(c->Get(hit->lease_id, 0, out.data(), out.size()).ok());
  EXPECT_EQ(out, data[2]);
  EXPECT_TRUE(c->ReleaseLease(hit->lease_id).ok());
  SendNextRequest(*c);  // the release (and a shared-memory read's end) goes out with it
  EXPECT_TRUE(Eventually([&] { return HostTier(*admin_).pinned_bytes == 0; }, 5s));
  EXPECT_EQ(HostTier(*admin_).reserved_bytes, 0u);
}

TEST_P(DataPathContractTest, ALeasePinsItsChunksUntilReleasedThenItIsGone) {
  auto c = Connect("lease");
  ASSERT_NE(c, nullptr);
  const Hash128 h{0x1ea5e, 1};
  const auto data = PutChunk(*c, h, 31);
  auto hit = c->Lookup({&h, 1});
  ASSERT_TRUE(hit.ok() && hit->matched_chunks == 1u);
  EXPECT_GT(HostTier(*admin_).pinned_bytes, 0u);
  // Pressure: 80 MiB more chunks into a 64 MiB arena evicts others, never the leased chunk.
  const uint64_t evictions_before = HostTier(*admin_).evictions;
  for (uint64_t i = 0; i < 256; ++i) PutChunk(*c, Hash128{0xf111, i}, 5000 + i);
  EXPECT_GT(HostTier(*admin_).evictions, evictions_before);
  std::vector<uint8_t> out(data.size());
  auto got = c->Get(hit->lease_id, 0, out.data(), out.size());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(out, data);
  // An index past the lease: OUT_OF_RANGE; the session keeps serving.
  auto past = c->Get(hit->lease_id, 1, out.data(), out.size());
  EXPECT_EQ(past.status().code(), StatusCode::kOutOfRange) << past.status();
  // Released: the lease is gone for good, with the reason.
  ASSERT_TRUE(c->ReleaseLease(hit->lease_id).ok());
  auto late = c->Get(hit->lease_id, 0, out.data(), out.size());
  EXPECT_EQ(late.status().code(), StatusCode::kAborted) << late.status();
  EXPECT_NE(late.status().message().find("was already released"), std::string::npos)
      << late.status();
  EXPECT_TRUE(Eventually([&] { return HostTier(*admin_).pinned_bytes == 0; }, 5s));
  ExpectServes(*c, 32);
}

// ReleaseLease of a live lease costs no exchange: kvd reads nothing until the client's next
// request, which ends it. With the exchange forced (as with a kvd older than
// Request.releaseLeases) kvd reads one ReleaseLease and the lease ends before the call
// returns. An id this client does not hold is always an exchange, with kvd's error.
TEST_P(DataPathContractTest, AReleasedLeaseEndsWithTheNextRequest) {
  for (const bool apart : {false, true}) {
    SCOPED_TRACE(apart ? "ReleaseLease exchange" : "release on the next request");
    client::ClientOptions o = Options(apart ? "lease-apart" : "lease-next");
    client::TestHooks hooks;
    hooks.release_leases_apart = apart;
    auto c = ConnectOrFail(o, hooks);
    ASSERT_NE(c, nullptr);
    const Hash128 h{0x1ea5e, apart ? 11u : 10u};
    PutChunk(*c, h, 44);
    auto hit = c->Lookup({&h, 1});
    ASSERT_TRUE(hit.ok() && hit->matched_chunks == 1u);
    const uint64_t frames_before = CounterValue(*admin_, "frames_in");
    ASSERT_TRUE(c->ReleaseLease(hit->lease_id).ok());
    // Frames kvd read in between: the client's, and the admin's second Stats request.
    EXPECT_EQ(CounterValue(*admin_, "frames_in") - frames_before - 1, apart ? 1u : 0u);
    EXPECT_EQ(CounterValue(*admin_, "host_leases_open"), apart ? 0u : 1u);
    SendNextRequest(*c);
    EXPECT_EQ(CounterValue(*admin_, "host_leases_open"), 0u);
    EXPECT_EQ(HostTier(*admin_).pinned_bytes, 0u);
    // Released twice: the second is an exchange, and kvd says the lease ended.
    Status again = c->ReleaseLease(hit->lease_id);
    EXPECT_EQ(again.code(), StatusCode::kAborted) << again;
    EXPECT_NE(again.message().find("was already released"), std::string::npos) << again;
    Status unknown = c->ReleaseLease(987654321);
    EXPECT_EQ(unknown.code(), StatusCode::kNotFound) << unknown;
  }
}

TEST_P(DataPathContractTest, AnExpiredLeaseIsRefusedWithItsReason) {
  client::ClientOptions o = Options("short-lease");
  o.lease_ttl_ms = 300;
  auto c = ConnectOrFail(o);
  ASSERT_NE(c, nullptr);
  const Hash128 h{0x1ea5e, 2};
  const auto data = PutChunk(*c, h, 33);
  auto hit = c->Lookup({&h, 1});
  ASSERT_TRUE(hit.ok() && hit->matched_chunks == 1u);
  EXPECT_EQ(hit->lease_ttl_ms, 300u);
  ASSERT_TRUE(Eventually([&] { return HostTier(*admin_).pinned_bytes == 0; }, 10s))
      << "the lease did not expire";
  std::vector<uint8_t> out(data.size());
  auto late = c->Get(hit->lease_id, 0, out.data(), out.size());
  EXPECT_EQ(late.status().code(), StatusCode::kAborted) << late.status();
  EXPECT_NE(late.status().message().find("expired"), std::string::npos) << late.status();
  ExpectServes(*c, 34);
}

TEST_P(DataPathContractTest, ARefusedCommitStoresNothingAndFreesItsSlot) {
  if (GetParam() == DataPath::kMemfdShm) {
    // A shared-memory commit is verified by kvd only with tiers.host.verify_shm_commits; by
    // default the writer's checksum is checked by the readers instead (IntegrityE2eTest,
    // AWrongChecksumOfASharedMemoryPutIsNeverServed).
    KvdConfig config = BaseConfig();
    config.host_extra = {"verify_shm_commits: true"};
    ASSERT_NO_FATAL_FAILURE(Start(config));
  }
  client::ClientOptions o = Options("bad-checksum");
  client::TestHooks hooks;
  hooks.corrupt_checksum = 0x1;  // the daemon's verification must refuse it
  auto bad = ConnectOrFail(o, hooks);
  ASSERT_NE(bad, nullptr);
  const Hash128 h{0xbad, 1};
  auto data = RandomBytes(bad->options().layout.ChunkBytes(256), 41);
  auto put = bad->Put(h, 256, data.data(), data.size());
  EXPECT_EQ(put.status().code(), StatusCode::kDataLoss) << put.status();
  EXPECT_NE(put.status().message().find("checksum mismatch"), std::string::npos) << put.status();
  EXPECT_EQ(CounterValue(*admin_, "host_checksum_failures"), 1u);
  auto good = Connect("good");
  ASSERT_NE(good, nullptr);
  EXPECT_EQ(Present(*good, h), 0u) << "a refused commit became visible";
  EXPECT_TRUE(Eventually([&] { return HostTier(*admin_).reserved_bytes == 0; }, 5s));
  EXPECT_EQ(HostTier(*admin_).chunks, 0u);
  // The key is free: a correct put of it is stored, not deduplicated.
  auto ok = good->Put(h, 256, data.data(), data.size());
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_FALSE(ok->already_stored);
  ExpectServes(*good, 42);
}

TEST_P(DataPathContractTest, ACommitAfterTheReservationExpiredIsRefused) {
  KvdConfig config = BaseConfig();
  config.reservation_ttl_ms = 500;
  Start(config);
  client::ClientOptions o = Options("late");
  client::Client* admin = admin_.get();
  bool reclaimed = false;
  // The client stops between writing its bytes and committing until kvd took the slot back.
  client::TestHooks hooks;
  hooks.before_commit = [&] {
    reclaimed = Eventually([&] { return HostTier(*admin).reserved_bytes == 0; }, 10s);
  };
  auto late = ConnectOrFail(o, hooks);
  ASSERT_NE(late, nullptr);
  const Hash128 h{0x1a7e, 1};
  auto data = RandomBytes(late->options().layout.ChunkBytes(256), 51);
  auto put = late->Put(h, 256, data.data(), data.size());
  EXPECT_TRUE(reclaimed) << "the reservation was not reclaimed";
  EXPECT_EQ(put.status().code(), StatusCode::kAborted) << put.status();
  EXPECT_NE(put.status().message().find("expired"), std::string::npos) << put.status();
  EXPECT_GE(CounterValue(*admin_, "reservations_expired"), 1u);
  auto good = Connect("good");
  ASSERT_NE(good, nullptr);
  EXPECT_EQ(Present(*good, h), 0u) << "an expired reservation's bytes became visible";
  ExpectServes(*good, 52);
}

TEST_P(DataPathContractTest, AClientKilledWhileWritingLeavesNoVisibleChunk) {
  auto good = Connect("good");
  ASSERT_NE(good, nullptr);
  // The driver reserves, writes its bytes, prints SENT and waits before Commit.
  const pid_t pid = KillDriverHolding("hold", "SENT", &client::TierStats::reserved_bytes,
                                      "the killed writer's reservation was not reclaimed");
  ASSERT_NE(pid, 0);
  EXPECT_EQ(Present(*good, Hash128{0xdead, static_cast<uint64_t>(pid)}), 0u);
  EXPECT_EQ(HostTier(*admin_).chunks, 0u);
  ExpectServes(*good, 61);
}

TEST_P(DataPathContractTest, AClientKilledHoldingALeaseReleasesItsPins) {
  auto good = Connect("good");
  ASSERT_NE(good, nullptr);
  const pid_t pid = KillDriverHolding("lease", "HELD", &client::TierStats::pinned_bytes,
                                      "the killed reader's lease still pins its chunk");
  ASSERT_NE(pid, 0);
  // Its read ended too (on the shared-memory path still open when it died: a get's read ends
  // with the client's next request, which never came).
  EXPECT_TRUE(Eventually([&] { return CounterValue(*admin_, "host_reads_open") == 0; }, 5s));
  // Its chunk stays stored and readable by others; the daemon keeps serving.
  EXPECT_EQ(Present(*good, Hash128{0x1ea5e, static_cast<uint64_t>(pid)}), 1u);
  ExpectServes(*good, 71);
}

// kvd holds a transport endpoint to a client only once the client moved bytes over the transport
// (never on the shared-memory path, nor for a session that only looks up), closes it for good
// when the client goes (killed, or ending with Bye), and then makes no further attempt to reach
// it: no UCX reconnects to an exited client's address.
TEST_P(DataPathContractTest, AnEndedClientLeavesNoTransportEndpointBehind) {
  const uint64_t want_open = GetParam() == DataPath::kMemfdShm ? 0 : 1;
  auto open = [&] { return CounterValue(*admin_, "transport_peers_open"); };
  ASSERT_EQ(open(), 0u);
  const size_t log_before = kvd_->Log().size();
  for (int i = 0; i < 3; ++i) {  // sessions that only look up: no endpoint on any path
    auto c = Connect("lookups");
    ASSERT_NE(c, nullptr);
    const Hash128 h{0xe7d, 9};
    auto hit = c->Lookup({&h, 1});
    ASSERT_TRUE(hit.ok()) << hit.status();
    EXPECT_EQ(open(), 0u);
  }
  {
    auto c = Connect("bye");
    ASSERT_NE(c, nullptr);
    PutChunk(*c, Hash128{0xe7d, 1}, 101);
    ExpectServes(*c, 102);
    EXPECT_EQ(open(), want_open);
  }  // Bye, and the client's transport is destroyed
  EXPECT_TRUE(Eventually([&] { return open() == 0; }, 5s)) << "the ended session's endpoint";
  // A client process killed while it holds a lease.
  auto child = SpawnDriver("lease", "HELD");
  ASSERT_NE(child, nullptr);
  EXPECT_EQ(open(), want_open);
  child->Kill();
  EXPECT_TRUE(Eventually([&] { return open() == 0; }, 5s)) << "the killed client's endpoint";
  EXPECT_EQ(CounterValue(*admin_, "transport_connects"), 2 * want_open);
  EXPECT_EQ(CounterValue(*admin_, "transport_disconnects"), 2 * want_open);
  // Nothing tried to reach the gone clients, then or since (kvd's keepalive runs every 500 ms
  // here): UCX logs each failed connect() of a reconnect attempt.
  std::this_thread::sleep_for(1500ms);
  const std::string log = kvd_->Log().substr(log_before);
  EXPECT_EQ(log.find("connect("), std::string::npos) << log;
  auto after = Connect("after");  // and kvd keeps serving
  ASSERT_NE(after, nullptr);
  ExpectServes(*after, 103);
}

TEST_P(DataPathContractTest, NamespacesAreIsolated) {
  auto a = Connect("a", "tenant-a");
  auto b = Connect("b", "tenant-b");
  ASSERT_TRUE(a && b);
  const Hash128 h{0x15, 1};
  const auto bytes_a = PutChunk(*a, h, 81);
  EXPECT_EQ(Present(*b, h), 0u) << "b sees a's chunk";
  // The same key in b is b's own chunk; each reads back its own bytes.
  const auto bytes_b = PutChunk(*b, h, 82);
  for (auto [c, want] : {std::pair{a.get(), &bytes_a}, std::pair{b.get(), &bytes_b}}) {
    auto hit = c->Lookup({&h, 1});
    ASSERT_TRUE(hit.ok() && hit->matched_chunks == 1u);
    std::vector<uint8_t> out(want->size());
    ASSERT_TRUE(c->Get(hit->lease_id, 0, out.data(), out.size()).ok());
    EXPECT_EQ(out, *want);
    EXPECT_TRUE(c->ReleaseLease(hit->lease_id).ok());
  }
  // A lease is its connection's: b cannot read through a's lease id.
  auto hit_a = a->Lookup({&h, 1});
  ASSERT_TRUE(hit_a.ok() && hit_a->matched_chunks == 1u);
  std::vector<uint8_t> out(bytes_a.size());
  auto stolen = b->Get(hit_a->lease_id, 0, out.data(), out.size());
  EXPECT_EQ(stolen.status().code(), StatusCode::kNotFound) << stolen.status();
  EXPECT_NE(stolen.status().message().find("is not held by this client"), std::string::npos)
      << stolen.status();
  EXPECT_NE(out, bytes_a) << "b read a's bytes through a's lease";
  EXPECT_TRUE(a->ReleaseLease(hit_a->lease_id).ok());
}

TEST_P(DataPathContractTest, TheDaemonDyingFailsTheNextOperationInsteadOfHanging) {
  auto c = Connect("orphan");
  ASSERT_NE(c, nullptr);
  const Hash128 h{0xdead2, 1};
  PutChunk(*c, h, 91);
  kvd_->Kill();
  auto data = RandomBytes(c->options().layout.ChunkBytes(256), 92);
  const auto start = std::chrono::steady_clock::now();
  auto put = c->Put(Hash128{0xdead2, 2}, 256, data.data(), data.size());
  EXPECT_FALSE(put.ok());
  EXPECT_EQ(put.status().code(), StatusCode::kUnavailable) << put.status();
  auto hit = c->Lookup({&h, 1});
  EXPECT_EQ(hit.status().code(), StatusCode::kUnavailable) << hit.status();
  EXPECT_FALSE(c->connected());
  // Well within the request timeout (5 s): the broken connection is seen, not waited out.
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

INSTANTIATE_TEST_SUITE_P(Paths, DataPathContractTest,
                         ::testing::Values(DataPath::kUcxTcp, DataPath::kUcxCma,
                                           DataPath::kMemfdShm),
                         [](const ::testing::TestParamInfo<DataPath>& info) {
                           return PathName(info.param);
                         });

}  // namespace
}  // namespace kvd::e2e
