// The same-node shared-memory path: a real kvd whose arena is memfd segments, clients over its
// unix socket that copy chunk bytes in and out of their namespace's segments themselves. What
// every data path promises (leases, aborts, killed clients) is checked on this one too by
// DataPathContractTest (data_path_contract_e2e_test.cc); here is what only this path has.
#include <sys/mman.h>

#include <algorithm>
#include <cstring>
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

}  // namespace
}  // namespace kvd::e2e
