// End to end over UCX on loopback, with UCX_TLS=tcp and with shared memory: put, lookup with
// partial prefixes, byte-exact get, a second client process, big chunks, a dying daemon.
#include <signal.h>

#include "e2e_common.h"

namespace kvd::e2e {
namespace {

class RoundTripE2eTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    KvdConfig c;
    c.ucx_tls = GetParam();
    kvd_ = StartKvd(c);
    ASSERT_NE(kvd_, nullptr);
  }
  void TearDown() override {
    if (kvd_ && kvd_->Alive()) {
      EXPECT_EQ(kvd_->Stop(), 0) << "kvd did not shut down cleanly; log:\n" << kvd_->Log();
    }
  }
  std::unique_ptr<KvdProcess> kvd_;
};

TEST_P(RoundTripE2eTest, PutLookupPartialPrefixGetByteExact) {
  auto c = ConnectOrFail(kvd_->EngineOptions());
  ASSERT_NE(c, nullptr);
  EXPECT_NE(c->session().transport.find("ucx"), std::string::npos) << c->session().transport;
  const ModelLayout layout = c->options().layout;
  auto prompt = RandomTokens(700, 1);  // chunks of 256, 256, 188 tokens
  auto chain = c->hasher().ChunkChain(prompt, true);
  ASSERT_EQ(chain.size(), 3u);
  std::vector<std::vector<uint8_t>> data;
  for (int i = 0; i < 3; ++i) {
    data.push_back(RandomBytes(layout.ChunkBytes(c->hasher().ChunkTokens(700, i)), 10 + i));
  }
  // Chunk 0 from per-layer K/V pointers, chunks 1-2 pipelined from raw buffers.
  {
    const size_t half = 256 * layout.TokenBytes();
    std::vector<client::LayerKV> layers;
    for (int l = 0; l < layout.num_layers; ++l) {
      const uint8_t* k = data[0].data() + layout.LayerOffset(l, 256);
      layers.push_back({k, k + half});
    }
    auto r = c->PutLayers(chain[0], 256, layers);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  std::vector<client::PutItem> items = {{chain[1], 256, data[1].data(), data[1].size()},
                                        {chain[2], 188, data[2].data(), data[2].size()}};
  auto put = c->PutChunks(items);
  ASSERT_TRUE(put.ok()) << put.status();

  auto full = c->Lookup(chain);
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_EQ(full->matched_chunks, 3u);
  EXPECT_EQ(full->matched_tokens, 700u);

  // A prompt that diverges inside chunk 1 matches chunk 0 only; one that extends the first two
  // chunks differently matches 512 tokens.
  auto other = prompt;
  other[300] += 1;
  auto partial = c->Lookup(c->hasher().ChunkChain(other, true));
  ASSERT_TRUE(partial.ok());
  EXPECT_EQ(partial->matched_chunks, 1u);
  EXPECT_EQ(partial->matched_tokens, 256u);
  auto longer = prompt;
  longer.resize(1000);
  for (size_t i = 512; i < 1000; ++i) longer[i] = 7;
  auto two = c->Lookup(c->hasher().ChunkChain(longer, true));
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(two->matched_tokens, 512u);
  auto none = c->Lookup(c->hasher().ChunkChain(RandomTokens(300, 99), true));
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->matched_chunks, 0u);
  EXPECT_EQ(none->lease_id, 0u);

  std::vector<std::vector<uint8_t>> out(3);
  std::vector<client::GetItem> gets;
  for (uint32_t i = 0; i < 3; ++i) {
    out[i].assign(data[i].size(), 0);
    gets.push_back({i, out[i].data(), out[i].size()});
  }
  auto got = c->GetChunks(full->lease_id, gets);
  ASSERT_TRUE(got.ok()) << got.status();
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(out[i] == data[i]) << "chunk " << i << " differs";
  EXPECT_EQ((*got)[2].tokens, 188u);

  // Per-layer get of chunk 0.
  const size_t half = 256 * layout.TokenBytes();
  std::vector<std::vector<uint8_t>> k(layout.num_layers, std::vector<uint8_t>(half)), v = k;
  std::vector<client::MutableLayerKV> layers;
  for (int l = 0; l < layout.num_layers; ++l) layers.push_back({k[l].data(), v[l].data()});
  ASSERT_TRUE(c->GetLayers(full->lease_id, 0, layers, 256).ok());
  for (int l = 0; l < layout.num_layers; ++l) {
    const uint8_t* kk = data[0].data() + layout.LayerOffset(l, 256);
    EXPECT_EQ(0, std::memcmp(k[l].data(), kk, half)) << "layer " << l;
    EXPECT_EQ(0, std::memcmp(v[l].data(), kk + half, half)) << "layer " << l;
  }
  for (auto id : {full->lease_id, partial->lease_id, two->lease_id}) {
    EXPECT_TRUE(c->ReleaseLease(id).ok());
  }
  // Re-put of a stored chunk is deduplicated.
  auto again = c->Put(chain[1], 256, data[1].data(), data[1].size());
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->already_stored);
}

TEST_P(RoundTripE2eTest, SecondClientProcessAndLargeChunks) {
  // kvd-roundtrip is a separate client process (smollm2: 5.6 MiB chunks, rendezvous sizes).
  std::string out;
  int rc = RunProgram({KVD_ROUNDTRIP_BINARY, "--addr", kvd_->tcp_address(), "--ucx-tls", GetParam(),
                       "--net-devices", "lo", "--tokens", "600"},
                      &out, std::chrono::seconds(60));
  EXPECT_EQ(rc, 0) << out << "\nkvd log:\n" << kvd_->Log();
  EXPECT_NE(out.find("round trip OK"), std::string::npos) << out;
  // Meanwhile this process is served too, over the unix-socket control address.
  auto c = ConnectOrFail(kvd_->UnixEngineOptions("second"));
  ASSERT_NE(c, nullptr);
  ExpectServes(*c, 1);
  auto admin = ConnectOrFail(kvd_->AdminOptions());
  ASSERT_NE(admin, nullptr);
  auto stats = admin->GetStats();
  ASSERT_TRUE(stats.ok());
  uint64_t smollm_chunks = 0;
  for (const auto& m : stats->models) {
    if (m.name == "smollm2-135m") smollm_chunks = m.chunks;
  }
  EXPECT_EQ(smollm_chunks, 3u);  // 600 tokens = 256 + 256 + 88
}

TEST_P(RoundTripE2eTest, DeadDaemonGivesUnavailableNotAHang) {
  auto c = ConnectOrFail(kvd_->EngineOptions());
  ASSERT_NE(c, nullptr);
  ExpectServes(*c, 2);
  kvd_->Kill();
  Hash128 h{1, 2};
  auto t0 = std::chrono::steady_clock::now();
  auto r = c->Lookup({&h, 1});
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
  EXPECT_FALSE(c->connected());
  auto again = client::Client::Connect(kvd_->EngineOptions());
  EXPECT_EQ(again.status().code(), StatusCode::kUnavailable);
}

INSTANTIATE_TEST_SUITE_P(Tls, RoundTripE2eTest, ::testing::Values("tcp", "sm,tcp"),
                         [](const auto& info) {
                           return info.param == "tcp" ? std::string("Tcp")
                                                      : std::string("SharedMemory");
                         });

}  // namespace
}  // namespace kvd::e2e
