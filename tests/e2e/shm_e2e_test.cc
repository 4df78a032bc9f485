// The same-node shared-memory path: a real kvd whose arena is memfd segments, clients over its
// unix socket that copy chunk bytes in and out of their namespace's segments themselves. What
// every data path promises (leases, aborts, killed clients) is checked on this one too by
// DataPathContractTest (data_path_contract_e2e_test.cc); here is what only this path has.
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "e2e_common.h"

namespace kvd::e2e {
namespace {

using namespace std::chrono_literals;

class ShmE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KvdConfig config;
    config.host_capacity = "64MiB";
    config.host_segment = "8MiB";  // 8 segments; chunks: stories260k 320 KiB, smollm2 5.6 MiB
    config.lease_ttl_ms = 30000;
    kvd_ = StartKvd(config);
    ASSERT_NE(kvd_, nullptr);
    admin_ = ConnectOrFail(kvd_->AdminOptions());
    ASSERT_NE(admin_, nullptr);
  }
  client::ClientOptions ShmOptions(const std::string& ns, const std::string& id) {
    client::ClientOptions o = kvd_->UnixEngineOptions(id);
    o.name_space = ns;
    return o;
  }
  std::unique_ptr<KvdProcess> kvd_;
  std::unique_ptr<client::Client> admin_;
};

TEST_F(ShmE2eTest, PutAndGetAreByteExactAndSeenByTheTransportPath) {
  auto shm = ConnectOrFail(ShmOptions("", "shm"));
  ASSERT_NE(shm, nullptr);
  ASSERT_TRUE(shm->session().shared_memory) << kvd_->Log();
  client::ClientOptions tcp_options = kvd_->EngineOptions("tcp");  // TCP: the transport path
  auto tcp = ConnectOrFail(tcp_options);
  ASSERT_NE(tcp, nullptr);
  EXPECT_FALSE(tcp->session().shared_memory);

  const size_t bytes = shm->options().layout.ChunkBytes(256);
  std::vector<std::vector<uint8_t>> data;
  std::vector<client::PutItem> items;
  std::vector<Hash128> chain;
  for (uint64_t i = 0; i < 12; ++i) {
    data.push_back(RandomBytes(bytes, 100 + i));
    chain.push_back(Hash128{0x5111, i});
  }
  for (uint64_t i = 0; i < 12; ++i) items.push_back({chain[i], 256, data[i].data(), bytes});
  auto put = shm->PutChunks(items);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_FALSE(shm->SharedSegments().empty());

  for (client::Client* c : {shm.get(), tcp.get()}) {
    auto hit = c->Lookup(chain);
    ASSERT_TRUE(hit.ok()) << hit.status();
    ASSERT_EQ(hit->matched_chunks, 12u);
    std::vector<std::vector<uint8_t>> out(12, std::vector<uint8_t>(bytes));
    std::vector<client::GetItem> gets;
    for (uint32_t i = 0; i < 12; ++i) gets.push_back({i, out[i].data(), out[i].size()});
    auto got = c->GetChunks(hit->lease_id, gets);
    ASSERT_TRUE(got.ok()) << got.status();
    for (size_t i = 0; i < 12; ++i) EXPECT_EQ(out[i], data[i]) << "chunk " << i;
    EXPECT_TRUE(c->ReleaseLease(hit->lease_id).ok());
  }
  // And the other way: a chunk put over the transport, read through shared memory.
  auto tcp_data = PutChunk(*tcp, Hash128{0x7c9, 1}, 77);
  Hash128 h{0x7c9, 1};
  auto hit = shm->Lookup({&h, 1});
  ASSERT_TRUE(hit.ok() && hit->matched_chunks == 1u);
  std::vector<uint8_t> out(tcp_data.size());
  ASSERT_TRUE(shm->Get(hit->lease_id, 0, out.data(), out.size()).ok());
  EXPECT_EQ(out, tcp_data);
  EXPECT_TRUE(shm->ReleaseLease(hit->lease_id).ok());
  SendNextRequest(*shm);  // which carries the read's end and the lease's release
  // Every read was released: nothing stays pinned.
  EXPECT_TRUE(Eventually([&] { return HostTier(*admin_).pinned_bytes == 0; }, 5s));
}

TEST_F(ShmE2eTest, SharedMemoryCanBeTurnedOffOnAUnixSocket) {
  client::ClientOptions o = ShmOptions("", "forced-ucx");
  o.shared_memory = false;
  auto c = ConnectOrFail(o);
  ASSERT_NE(c, nullptr);
  EXPECT_FALSE(c->session().shared_memory);
  ExpectServes(*c, 5);
  EXPECT_TRUE(c->SharedSegments().empty());
}

TEST_F(ShmE2eTest, NamespacesCannotReachEachOthersBytes) {
  auto a = ConnectOrFail(ShmOptions("tenant-a", "a"));
  auto b = ConnectOrFail(ShmOptions("tenant-b", "b"));
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(a->session().shared_memory && b->session().shared_memory);
  std::vector<std::vector<uint8_t>> secrets;
  for (uint64_t i = 0; i < 4; ++i) secrets.push_back(PutChunk(*a, Hash128{0xa, i}, 1000 + i));
  for (uint64_t i = 0; i < 4; ++i) {
    PutChunk(*b, Hash128{0xb, i}, 2000 + i);
    ExpectServes(*b, 3000 + i);  // b also reads: it maps what its gets need
  }
  std::set<uint32_t> segs_a, segs_b;
  for (const auto& s : a->SharedSegments()) segs_a.insert(s.index);
  for (const auto& s : b->SharedSegments()) segs_b.insert(s.index);
  ASSERT_FALSE(segs_a.empty());
  ASSERT_FALSE(segs_b.empty());
  for (uint32_t s : segs_b) EXPECT_EQ(segs_a.count(s), 0u) << "segment " << s << " is shared";
  // Nothing b has mapped holds any of a's bytes (a 256-byte probe of each chunk).
  for (const auto& seg : b->SharedSegments()) {
    for (const auto& secret : secrets) {
      EXPECT_EQ(memmem(seg.data, seg.size, secret.data() + 4096, 256), nullptr)
          << "a's bytes are visible in b's segment " << seg.index;
    }
  }
  // And b cannot look a's chunks up either.
  Hash128 ha{0xa, 0};
  EXPECT_EQ(Present(*b, ha), 0u);
  EXPECT_EQ(Present(*a, ha), 1u);
}

// Where `bytes` lie in a segment this client has mapped, or null.
std::byte* FindInSegments(client::Client& c, const std::vector<uint8_t>& bytes) {
  for (const auto& seg : c.SharedSegments()) {
    void* at = ::memmem(seg.data, seg.size, bytes.data(), bytes.size());
    if (at != nullptr) return static_cast<std::byte*>(at);
  }
  return nullptr;
}

// Writable mappings of kvd's arena segments ("rw-s" lines of /proc/self/maps naming a
// kvd-arena memfd) in this process.
int WritableArenaMappings() {
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("kvd-arena") != std::string::npos && line.find(" rw-s ") != std::string::npos) {
      ++n;
    }
  }
  return n;
}

TEST_F(ShmE2eTest, AWritersStrayWriteToACommittedChunkFaults) {
  // Either way a put writes its slot (a writable view only the library uses, or the slot's pages
  // of the read-only mapping opened for the copy), the mapping the client reads from stays
  // read-only: a write through it to a committed chunk faults.
  for (const bool view : {true, false}) {
    SCOPED_TRACE(view ? "shm_writable_view" : "mprotect per put");
    const int writable_before = WritableArenaMappings();
    client::ClientOptions o = ShmOptions("", view ? "writer-view" : "writer-mprotect");
    o.shm_writable_view = view;
    auto writer = ConnectOrFail(o);
    ASSERT_NE(writer, nullptr);
    ASSERT_TRUE(writer->session().shared_memory) << kvd_->Log();
    EXPECT_FALSE(writer->session().read_only);
    const Hash128 h{0x57a7, view ? 1u : 2u};
    const std::vector<uint8_t> data = PutChunk(*writer, h, view ? 4242 : 4244);
    std::byte* slot = FindInSegments(*writer, data);
    ASSERT_NE(slot, nullptr) << "the committed chunk is not in the writer's mapping";
    const int status = WaitStatusOfChild([slot] { *reinterpret_cast<volatile char*>(slot) ^= 1; });
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV)
        << "a write to a committed chunk did not fault (wait status " << status << ")";
    // The writable view exists only when asked for: one per segment the client mapped.
    EXPECT_EQ(WritableArenaMappings() - writable_before,
              view ? static_cast<int>(writer->SharedSegments().size()) : 0);
    // Later puts still write their own slots; the chunk is served unchanged.
    ExpectServes(*writer, view ? 4243 : 4245);
    EXPECT_EQ(FetchOne(*writer, h, data.size()), data);
  }
}

TEST_F(ShmE2eTest, AReadingSessionCannotWrite) {
  auto writer = ConnectOrFail(ShmOptions("", "writer"));
  client::ClientOptions ro = ShmOptions("", "reader");
  ro.read_only = true;
  auto reader = ConnectOrFail(ro);
  ASSERT_TRUE(writer && reader);
  ASSERT_TRUE(reader->session().shared_memory) << kvd_->Log();
  EXPECT_TRUE(reader->session().read_only);

  // Puts are refused, both the three-step one and the one-exchange one (InlinePut).
  for (int tokens : {256, 16}) {
    SCOPED_TRACE("tokens " + std::to_string(tokens));
    auto bytes = RandomBytes(reader->options().layout.ChunkBytes(tokens), 9);
    auto put = reader->Put(Hash128{0x4ead, static_cast<uint64_t>(tokens)}, tokens, bytes.data(),
                           bytes.size());
    ASSERT_FALSE(put.ok());
    EXPECT_EQ(put.status().code(), StatusCode::kPermissionDenied) << put.status();
    EXPECT_NE(put.status().message().find("readOnly"), std::string::npos) << put.status();
  }

  // It reads what the writer put through its own read-only mapping of the segment.
  const Hash128 h{0x4ead, 1000};
  const std::vector<uint8_t> data = PutChunk(*writer, h, 777);
  EXPECT_EQ(FetchOne(*reader, h, data.size()), data);
  std::byte* slot = FindInSegments(*reader, data);
  ASSERT_NE(slot, nullptr) << "the reader has not mapped the chunk's segment";

  // Its descriptor was read-only: no making the mapping writable ...
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  void* page_start = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(slot) & ~(page - 1));
  errno = 0;
  EXPECT_EQ(::mprotect(page_start, page, PROT_READ | PROT_WRITE), -1);
  EXPECT_EQ(errno, EACCES) << std::strerror(errno);
  // ... and a write faults.
  const int status = WaitStatusOfChild([slot] { *reinterpret_cast<volatile char*>(slot) ^= 1; });
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV)
      << "a reading session wrote into the arena (wait status " << status << ")";
  EXPECT_EQ(FetchOne(*writer, h, data.size()), data);
  EXPECT_EQ(CounterValue(*admin_, "puts_committed"), 1u);
}

// A shared-memory get is one exchange: the reply names the pinned slot, the client copies and
// verifies, and the read's end goes out with the client's next request (Request.releaseReads)
// instead of a ReleaseRead exchange of its own. `apart`: the client ends each read with its own
// ReleaseRead exchange before GetChunks returns, as it does with a daemon older than
// releaseReads (and as an older client does with this daemon).
void ExpectGetsReleaseTheirReads(client::Client& admin, client::Client& c, uint64_t salt,
                                 bool apart) {
  const size_t bytes = c.options().layout.ChunkBytes(256);
  constexpr uint32_t kChunks = 6;
  std::vector<std::vector<uint8_t>> data;
  std::vector<Hash128> chain;
  for (uint64_t i = 0; i < kChunks; ++i) {
    chain.push_back(Hash128{0x9e7 + salt, i});
    data.push_back(PutChunk(c, chain.back(), 300 + salt * 10 + i));
  }
  auto hit = c.Lookup(chain);
  ASSERT_TRUE(hit.ok()) << hit.status();
  ASSERT_EQ(hit->matched_chunks, kChunks);
  const uint64_t frames_before = CounterValue(admin, "frames_in");
  std::vector<std::vector<uint8_t>> out(kChunks, std::vector<uint8_t>(bytes));
  std::vector<client::GetItem> gets;
  for (uint32_t i = 0; i < kChunks; ++i) gets.push_back({i, out[i].data(), out[i].size()});
  auto got = c.GetChunks(hit->lease_id, gets);
  ASSERT_TRUE(got.ok()) << got.status();
  // Frames kvd read in between: the client's, and the admin's second Stats request.
  const uint64_t frames = CounterValue(admin, "frames_in") - frames_before - 1;
  for (uint32_t i = 0; i < kChunks; ++i) EXPECT_EQ(out[i], data[i]) << "chunk " << i;
  if (apart) {
    EXPECT_EQ(frames, 2u * kChunks) << "a Get and a ReleaseRead per chunk";
    EXPECT_EQ(CounterValue(admin, "host_reads_open"), 0u) << "reads still open after GetChunks";
  } else {
    EXPECT_EQ(frames, uint64_t{kChunks}) << "one Get per chunk, nothing else";
    EXPECT_EQ(CounterValue(admin, "host_reads_open"), uint64_t{kChunks})
        << "the reads end with the next request, not before";
  }
  // The next request (any kind) ends them, and the released lease with it (with a kvd that
  // takes releaseLeases, ReleaseLease itself sends nothing); then nothing is pinned.
  ASSERT_TRUE(c.ReleaseLease(hit->lease_id).ok());
  SendNextRequest(c);
  EXPECT_EQ(CounterValue(admin, "host_reads_open"), 0u);
  EXPECT_EQ(CounterValue(admin, "host_leases_open"), 0u);
  EXPECT_EQ(HostTier(admin).pinned_bytes, 0u);
}

TEST_F(ShmE2eTest, AGetIsOneExchangeAndItsReadsEndWithTheNextRequest) {
  auto c = ConnectOrFail(ShmOptions("", "one-exchange"));
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->session().shared_memory) << kvd_->Log();
  EXPECT_TRUE(c->session().releases_on_requests);
  ExpectGetsReleaseTheirReads(*admin_, *c, 1, /*apart=*/false);
}

// FlushReleases ends the deferred reads and the deferred lease in one exchange, and sends
// nothing when nothing is pending; the C twin does the same.
TEST_F(ShmE2eTest, FlushReleasesEndsWhatRidesOnTheNextRequestInOneExchange) {
  auto c = ConnectOrFail(ShmOptions("", "flush"));
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->session().shared_memory) << kvd_->Log();
  ASSERT_TRUE(c->session().releases_on_requests);
  const size_t bytes = c->options().layout.ChunkBytes(256);
  constexpr uint32_t kChunks = 3;
  std::vector<Hash128> chain;
  std::vector<std::vector<uint8_t>> data;
  for (uint64_t i = 0; i < kChunks; ++i) {
    chain.push_back(Hash128{0xf105, i});
    data.push_back(PutChunk(*c, chain.back(), 700 + i));
  }
  auto hit = c->Lookup(chain);
  ASSERT_TRUE(hit.ok()) << hit.status();
  ASSERT_EQ(hit->matched_chunks, kChunks);
  std::vector<std::vector<uint8_t>> out(kChunks, std::vector<uint8_t>(bytes));
  std::vector<client::GetItem> gets;
  for (uint32_t i = 0; i < kChunks; ++i) gets.push_back({i, out[i].data(), out[i].size()});
  ASSERT_TRUE(c->GetChunks(hit->lease_id, gets).ok());
  for (uint32_t i = 0; i < kChunks; ++i) EXPECT_EQ(out[i], data[i]) << "chunk " << i;
  ASSERT_TRUE(c->ReleaseLease(hit->lease_id).ok());
  ASSERT_EQ(CounterValue(*admin_, "host_reads_open"), uint64_t{kChunks});
  ASSERT_EQ(CounterValue(*admin_, "host_leases_open"), 1u);
  ASSERT_GT(HostTier(*admin_).pinned_bytes, 0u);

  uint64_t before = CounterValue(*admin_, "frames_in");
  ASSERT_TRUE(c->FlushReleases().ok());
  // The flush's exchange, then the admin's second Stats request.
  EXPECT_EQ(CounterValue(*admin_, "frames_in") - before - 1, 1u) << "one exchange";
  EXPECT_EQ(CounterValue(*admin_, "host_reads_open"), 0u);
  EXPECT_EQ(CounterValue(*admin_, "host_leases_open"), 0u);
  EXPECT_EQ(HostTier(*admin_).pinned_bytes, 0u);

  before = CounterValue(*admin_, "frames_in");
  ASSERT_TRUE(c->FlushReleases().ok());
  EXPECT_EQ(CounterValue(*admin_, "frames_in") - before - 1, 0u) << "nothing pending, no exchange";
  EXPECT_NE(kvd_client_flush_releases(nullptr), KVD_OK);
}

TEST_F(ShmE2eTest, ReadsEndedByTheirOwnExchangeAsWithAnOlderDaemonOrClient) {
  client::TestHooks hooks;
  hooks.release_reads_apart = true;
  hooks.release_leases_apart = true;
  auto c = ConnectOrFail(ShmOptions("", "apart"), hooks);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->session().shared_memory) << kvd_->Log();
  ExpectGetsReleaseTheirReads(*admin_, *c, 2, /*apart=*/true);
}

// Compatibility, both directions, with real processes on both sides.
// (a) A current kvd serving a client older than Request.releaseReads beside a current client.
// The older client is the current library with the seam TestHooks::release_reads_apart:
// on the wire that is what an older client sends (a ReleaseRead exchange per read, never the
// releaseReads field, whatever HelloReply.releasesOnRequests says). Both read the same chunks
// byte-exact; the older client's reads end with its own exchanges, the current one's with its
// next request, and nothing stays pinned: the chunks can be evicted afterwards.
TEST_F(ShmE2eTest, AnOlderClientBesideACurrentOneReadsByteExactAndItsReleasesAreHonoured) {
  auto writer = ConnectOrFail(ShmOptions("", "writer"));
  client::TestHooks older_hooks;
  older_hooks.release_reads_apart = true;
  older_hooks.release_leases_apart = true;  // nor Request.releaseLeases
  auto older = ConnectOrFail(ShmOptions("", "older"), older_hooks);
  auto current = ConnectOrFail(ShmOptions("", "current"));
  ASSERT_TRUE(writer && older && current);
  ASSERT_TRUE(older->session().shared_memory && current->session().shared_memory) << kvd_->Log();
  EXPECT_TRUE(older->session().releases_on_requests);  // offered, and ignored by the older one
  constexpr uint32_t kChunks = 4;
  std::vector<Hash128> chain;
  std::vector<std::vector<uint8_t>> data;
  for (uint64_t i = 0; i < kChunks; ++i) {
    chain.push_back(Hash128{0xc0a7, i});
    data.push_back(PutChunk(*writer, chain.back(), 900 + i));
  }
  const size_t bytes = data[0].size();
  auto read_all = [&](client::Client& c, uint64_t* lease) {
    auto hit = c.Lookup(chain);
    ASSERT_TRUE(hit.ok()) << hit.status();
    ASSERT_EQ(hit->matched_chunks, kChunks);
    *lease = hit->lease_id;
    std::vector<std::vector<uint8_t>> out(kChunks, std::vector<uint8_t>(bytes));
    std::vector<client::GetItem> gets;
    for (uint32_t i = 0; i < kChunks; ++i) gets.push_back({i, out[i].data(), out[i].size()});
    auto got = c.GetChunks(hit->lease_id, gets);
    ASSERT_TRUE(got.ok()) << got.status();
    for (uint32_t i = 0; i < kChunks; ++i) EXPECT_EQ(out[i], data[i]) << "chunk " << i;
  };
  uint64_t current_lease = 0, older_lease = 0;
  ASSERT_NO_FATAL_FAILURE(read_all(*current, &current_lease));
  EXPECT_EQ(CounterValue(*admin_, "host_reads_open"), uint64_t{kChunks})
      << "the current client's reads wait for its next request";
  ASSERT_NO_FATAL_FAILURE(read_all(*older, &older_lease));
  EXPECT_EQ(CounterValue(*admin_, "host_reads_open"), uint64_t{kChunks})
      << "the older client's ReleaseReads ended its reads, and only those";
  ASSERT_TRUE(older->ReleaseLease(older_lease).ok());
  ASSERT_TRUE(current->ReleaseLease(current_lease).ok());
  SendNextRequest(*current);  // carries the current client's ended reads and released lease
  EXPECT_EQ(CounterValue(*admin_, "host_reads_open"), 0u);
  EXPECT_EQ(HostTier(*admin_).pinned_bytes, 0u);
  client::EvictFilter all;
  auto evicted = admin_->Evict(all);
  ASSERT_TRUE(evicted.ok()) << evicted.status();
  EXPECT_EQ(evicted->skipped_pinned, 0u);
  EXPECT_GE(evicted->chunks, uint64_t{kChunks});
  EXPECT_EQ(Present(*current, chain[0]), 0u);
}

// (b) A current client and a kvd older than Request.releaseReads. The older kvd is a current one
// with protocol.releases_on_requests off: it does not set HelloReply.releasesOnRequests and
// ignores the field, as the older kvd did. The client must see that and end each read with
// ReleaseRead (were it to send the field, the reads would stay open and this test fail).
TEST_F(ShmE2eTest, ACurrentClientOfAnOlderKvdEndsItsReadsWithReleaseRead) {
  OlderKvd older = StartKvdWithout("releases_on_requests");
  ASSERT_TRUE(older.ok());
  auto& admin = older.admin;
  auto& c = older.engine;
  ASSERT_TRUE(c->session().shared_memory) << older.kvd->Log();
  EXPECT_FALSE(c->session().releases_on_requests);
  ExpectGetsReleaseTheirReads(*admin, *c, 3, /*apart=*/true);
}

// (c) A current client and a kvd older than Request.releaseLeases (a current one with
// protocol.lease_releases_on_requests off: no HelloReply.leaseReleasesOnRequests, the field
// ignored). The client must end a lease with a ReleaseLease exchange: the lease is gone when the
// call returns (had the client sent the field instead, the lease would stay until its TTL).
TEST_F(ShmE2eTest, ACurrentClientOfAnOlderKvdEndsItsLeasesWithReleaseLease) {
  OlderKvd older = StartKvdWithout("lease_releases_on_requests");
  ASSERT_TRUE(older.ok());
  auto& admin = older.admin;
  auto& c = older.engine;
  const Hash128 h{0x1ea5e0, 1};
  PutChunk(*c, h, 71);
  for (int i = 0; i < 2; ++i) {
    auto hit = c->Lookup({&h, 1});
    ASSERT_TRUE(hit.ok() && hit->matched_chunks == 1u);
    const uint64_t frames_before = CounterValue(*admin, "frames_in");
    ASSERT_TRUE(c->ReleaseLease(hit->lease_id).ok());
    EXPECT_EQ(CounterValue(*admin, "frames_in") - frames_before - 1, 1u) << "one ReleaseLease";
    EXPECT_EQ(CounterValue(*admin, "host_leases_open"), 0u);
  }
  EXPECT_EQ(HostTier(*admin).pinned_bytes, 0u);
}

// Ids on Request.releaseReads that are no open read of this connection (another session's,
// already ended, never issued) end nothing and fail nothing: another client's read stays.
TEST_F(ShmE2eTest, ReleaseReadsOfAnotherConnectionEndNothing) {
  auto a = ConnectOrFail(ShmOptions("", "a"));
  auto b = ConnectOrFail(ShmOptions("", "b"));
  ASSERT_TRUE(a && b);
  const Hash128 h{0x9e70, 1};
  const std::vector<uint8_t> data = PutChunk(*a, h, 99);
  auto hit = a->Lookup({&h, 1});
  ASSERT_TRUE(hit.ok() && hit->matched_chunks == 1u);
  std::vector<uint8_t> out(data.size());
  ASSERT_TRUE(a->Get(hit->lease_id, 0, out.data(), out.size()).ok());
  EXPECT_EQ(out, data);
  ASSERT_EQ(CounterValue(*admin_, "host_reads_open"), 1u);  // a's read, deferred
  // b reads the same chunk and ends its own read, twice (the second: an id no longer open).
  for (int round = 0; round < 2; ++round) {
    auto hb = b->Lookup({&h, 1});
    ASSERT_TRUE(hb.ok() && hb->matched_chunks == 1u);
    ASSERT_TRUE(b->Get(hb->lease_id, 0, out.data(), out.size()).ok());
    ASSERT_TRUE(b->ReleaseLease(hb->lease_id).ok());
  }
  SendNextRequest(*b);  // b's last read and lease end
  EXPECT_EQ(CounterValue(*admin_, "host_reads_open"), 1u) << "b ended a's read";
  ASSERT_TRUE(a->ReleaseLease(hit->lease_id).ok());
  SendNextRequest(*a);
  EXPECT_EQ(CounterValue(*admin_, "host_reads_open"), 0u);
}

nlohmann::json SessionJson(kvd_client* c) {
  char* text = nullptr;
  EXPECT_EQ(kvd_client_session_json(c, &text), KVD_OK) << kvd_last_error();
  if (text == nullptr) return {};
  nlohmann::json j = nlohmann::json::parse(text);
  kvd_free_string(text);
  return j;
}

TEST_F(ShmE2eTest, TheCApiOpensReadingSessionsAndCanDeclineSharedMemory) {
  auto writer = ConnectOrFail(ShmOptions("", "writer"));
  ASSERT_NE(writer, nullptr);
  const Hash128 h{0xc0ab1, 7};
  const std::vector<uint8_t> data = PutChunk(*writer, h, 4711);
  const client::ClientOptions o = ShmOptions("", "c-reader");

  for (const bool shm : {true, false}) {
    SCOPED_TRACE(shm ? "shared memory" : "shared memory declined");
    kvd_config c = CConfig(o);
    c.read_only = 1;
    c.shared_memory = shm ? 0 : -1;
    kvd_client* reader = nullptr;
    ASSERT_EQ(kvd_client_connect(&c, &reader), KVD_OK) << kvd_last_error();
    const nlohmann::json session = SessionJson(reader);
    EXPECT_EQ(session.value("shared_memory", !shm), shm) << session.dump();
    EXPECT_EQ(session.value("read_only", false), true) << session.dump();

    // Its puts are refused, and nothing is stored.
    const kvd_hash128 mine{0xc0ab1, 100};
    int already = -1;
    std::vector<uint8_t> bytes(data.size(), 3);
    EXPECT_EQ(kvd_client_put(reader, mine, 256, bytes.data(), bytes.size(), &already),
              KVD_PERMISSION_DENIED);
    EXPECT_NE(std::string(kvd_last_error()).find("readOnly"), std::string::npos)
        << kvd_last_error();
    // It reads what the writer put, byte for byte.
    const kvd_hash128 chain{h.hi, h.lo};
    kvd_lookup_result hit;
    kvd_lookup_result_init(&hit);
    ASSERT_EQ(kvd_client_lookup(reader, &chain, 1, &hit), KVD_OK) << kvd_last_error();
    ASSERT_EQ(hit.matched_chunks, 1u);
    std::vector<uint8_t> out(data.size());
    kvd_get_result got;
    kvd_get_result_init(&got);
    ASSERT_EQ(kvd_client_get(reader, hit.lease_id, 0, out.data(), out.size(), &got), KVD_OK)
        << kvd_last_error();
    EXPECT_EQ(got.bytes, data.size());
    EXPECT_EQ(out, data);
    EXPECT_EQ(kvd_client_release_lease(reader, hit.lease_id), KVD_OK) << kvd_last_error();
    kvd_client_close(reader);
  }
  EXPECT_EQ(CounterValue(*admin_, "puts_committed"), 1u);
}

}  // namespace
}  // namespace kvd::e2e
