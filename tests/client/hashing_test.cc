// Chain hashing, address parsing, options validation and raw-chunk gather/scatter.
#include "kvd/client/hashing.h"

#include <gtest/gtest.h>

#include <numeric>

#include "kvd/client/client.h"

namespace kvd::client {
namespace {

std::vector<int32_t> Tokens(int n, int32_t start = 1) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), start);
  return t;
}

TEST(ChainHasherTest, ChunkKeysAreTheLastBlockOfEachChunk) {
  ChainHasher h({16, 64}, "seed");
  auto tokens = Tokens(150);  // 2 full chunks + 22 tokens
  auto blocks = h.BlockHashes(tokens);
  ASSERT_EQ(blocks.size(), 10u);  // ceil(150 / 16)
  auto full = h.ChunkChain(tokens, false);
  ASSERT_EQ(full.size(), 2u);
  EXPECT_EQ(full[0], blocks[3]);
  EXPECT_EQ(full[1], blocks[7]);
  auto all = h.ChunkChain(tokens, true);
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[2], blocks[9]);
  EXPECT_EQ(h.ChunkTokens(150, 0), 64);
  EXPECT_EQ(h.ChunkTokens(150, 2), 22);
  EXPECT_EQ(h.ChunkTokens(150, 3), 0);
}

TEST(ChainHasherTest, MatchesChainHashBlockWithTheSeedDigest) {
  ChainHasher h({4, 8}, "my-seed");
  auto tokens = Tokens(8);
  Hash128 b0 = ChainHashBlock(Digest64("my-seed"), Hash128{}, std::span(tokens).subspan(0, 4));
  Hash128 b1 = ChainHashBlock(Digest64("my-seed"), b0, std::span(tokens).subspan(4, 4));
  EXPECT_EQ(h.ChunkChain(tokens, false), std::vector<Hash128>{b1});
}

TEST(ChainHasherTest, PrefixSharingAndSeedSensitivity) {
  ChainHasher a({16, 32}, "seed-a"), b({16, 32}, "seed-b");
  auto t1 = Tokens(96), t2 = t1;
  t2[40] = 999;  // differs inside the second chunk
  auto c1 = a.ChunkChain(t1, false), c2 = a.ChunkChain(t2, false);
  EXPECT_EQ(c1[0], c2[0]);
  EXPECT_NE(c1[1], c2[1]);
  EXPECT_NE(c1[2], c2[2]);  // the chain carries the divergence forward
  EXPECT_NE(a.ChunkChain(t1, false)[0], b.ChunkChain(t1, false)[0]);
  EXPECT_EQ(a.ChunkChain(t1, false), ChainHasher({16, 32}, "seed-a").ChunkChain(t1, false));
}

TEST(ChainHasherTest, EngineBlockHashesAreTakenAsIs) {
  ChainHasher h({16, 32}, "s");
  std::vector<Hash128> blocks;
  for (uint64_t i = 0; i < 5; ++i) blocks.push_back({i, i + 100});
  auto chain = h.ChunkChainFromBlockHashes(blocks, 70, true);
  ASSERT_TRUE(chain.ok()) << chain.status();
  EXPECT_EQ(*chain, (std::vector<Hash128>{{1, 101}, {3, 103}, {4, 104}}));
  auto bad = h.ChunkChainFromBlockHashes(blocks, 100, true);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("expected 7 block hashes"), std::string::npos);
}

TEST(ChainHasherTest, OptionsValidate) {
  EXPECT_EQ((ChainHasherOptions{16, 250}.Validate().code()), StatusCode::kInvalidArgument);
  EXPECT_NE((ChainHasherOptions{16, 250}.Validate().message().find("multiple of block_tokens")),
            std::string::npos);
  EXPECT_EQ((ChainHasherOptions{0, 256}.Validate().code()), StatusCode::kInvalidArgument);
  EXPECT_TRUE((ChainHasherOptions{16, 256}.Validate().ok()));
}

TEST(DaemonAddressTest, ParsesTcpAndUnix) {
  auto a = ParseDaemonAddress("127.0.0.1:7400");
  ASSERT_TRUE(a.ok());
  EXPECT_FALSE(a->is_unix);
  EXPECT_EQ(a->host, "127.0.0.1");
  EXPECT_EQ(a->port, 7400);
  auto u = ParseDaemonAddress("unix:/tmp/kvd.sock");
  ASSERT_TRUE(u.ok());
  EXPECT_TRUE(u->is_unix);
  EXPECT_EQ(u->path, "/tmp/kvd.sock");
  auto v6 = ParseDaemonAddress("[::1]:9");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->host, "::1");
  for (const char* bad : {"localhost", "host:", ":80", "h:0", "h:70000", "h:12x", "unix:"}) {
    EXPECT_EQ(ParseDaemonAddress(bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

ModelLayout TinyLayout() {
  ModelLayout l;
  l.num_layers = 2;
  l.num_kv_heads = 2;
  l.num_q_heads = 4;
  l.head_dim = 8;
  l.dtype = DType::kFloat32;
  return l;
}

TEST(ClientOptionsTest, ValidateNamesTheField) {
  ClientOptions o;
  o.model = "tiny";
  o.layout = TinyLayout();
  EXPECT_TRUE(o.Validate().ok()) << o.Validate();
  o.chunk_tokens = 100;
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(o.Validate().message().find("chunk_tokens"), std::string::npos);
  o.chunk_tokens = 256;
  o.request_timeout_ms = 0;
  EXPECT_NE(o.Validate().message().find("request_timeout_ms"), std::string::npos);
  o.request_timeout_ms = 1000;
  o.reply_spin_us = ClientOptions::kMaxReplySpinUs;
  EXPECT_TRUE(o.Validate().ok()) << o.Validate();
  o.reply_spin_us = ClientOptions::kMaxReplySpinUs + 1;
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(o.Validate().message().find("reply_spin_us"), std::string::npos);
  o.reply_spin_us = 0;
  EXPECT_TRUE(o.Validate().ok()) << o.Validate();
  o.model.clear();
  EXPECT_NE(o.Validate().message().find("model is required"), std::string::npos);
  o.role = Role::kAdmin;
  EXPECT_TRUE(o.Validate().ok());
  o.address = "nowhere";
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
}

TEST(LayersTest, GatherThenScatterRoundTrips) {
  ModelLayout l = TinyLayout();
  const int tokens = 5;
  const size_t half = tokens * l.TokenBytes();
  std::vector<std::vector<uint8_t>> k(2, std::vector<uint8_t>(half)), v = k;
  for (int layer = 0; layer < 2; ++layer) {
    for (size_t i = 0; i < half; ++i) {
      k[layer][i] = static_cast<uint8_t>(i * 7 + layer);
      v[layer][i] = static_cast<uint8_t>(i * 13 + layer + 1);
    }
  }
  std::vector<LayerKV> in = {{k[0].data(), v[0].data()}, {k[1].data(), v[1].data()}};
  std::vector<uint8_t> raw(RawChunkBytes(l, tokens));
  ASSERT_TRUE(GatherLayers(l, tokens, in, raw.data()).ok());
  // Layer 1's V sits at LayerOffset(1) + tokens * TokenBytes.
  EXPECT_EQ(0, std::memcmp(raw.data() + l.LayerOffset(1, tokens) + half, v[1].data(), half));
  std::vector<std::vector<uint8_t>> k2(2, std::vector<uint8_t>(half)), v2 = k2;
  std::vector<MutableLayerKV> out = {{k2[0].data(), v2[0].data()}, {k2[1].data(), v2[1].data()}};
  ASSERT_TRUE(ScatterLayers(l, tokens, raw.data(), out).ok());
  EXPECT_EQ(k, k2);
  EXPECT_EQ(v, v2);
}

}  // namespace
}  // namespace kvd::client
