// ChunkCodec's device fallback: chunks the CUDA plan fails on are compressed by the CPU plan,
// counted, and logged once per interval rather than once per chunk.
#include "kvd/daemon/chunk_codec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kvd/daemon/config.h"
#include "kvd/kernels/compact_chunk.h"
#include "kvd/kernels/quantize.h"

namespace kvd::daemon {
namespace {

constexpr uint32_t kTokens = 64, kWindow = 4;

ModelConfig SnapKvModel() {
  auto config = ParseConfigYaml(
      "models: [{name: m, layout: {layers: 2, kv_heads: 1, q_heads: 2, head_dim: 8, dtype: "
      "float32}, compression: {stages: [snapkv], window: 4, sinks: 2, worker_threads: 1}}]");
  EXPECT_TRUE(config.ok()) << config.status();
  return config.ok() ? config->models[0] : ModelConfig{};
}

// A put's bytes: the raw float32 chunk, then float32 window queries (normal values: finite).
std::vector<uint8_t> PutBytes(const ChunkCodec& codec, const ModelConfig& m, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v((m.layout.ChunkBytes(kTokens) + codec.QueryBytes(kWindow)) / sizeof(float));
  for (float& x : v) x = dist(rng);
  std::vector<uint8_t> bytes(v.size() * sizeof(float));
  std::memcpy(bytes.data(), v.data(), bytes.size());
  return bytes;
}

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// A device that fails every chunk: an ordinal no machine has (cudaSetDevice fails; on a machine
// without a GPU, no device at all). Each chunk is stored as the CPU plan stores it, the
// fallbacks are counted, and the WARNING is written for the first one only (at most once a
// minute).
TEST(ChunkCodecTest, ChunksTheDeviceFailsOnAreCompressedOnTheCpuCountedAndLoggedOnce) {
  if (ProbeIngestDevice(0).code() == StatusCode::kUnimplemented) {
    GTEST_SKIP() << "built without CUDA: the CUDA plan is never tried";
  }
  const ModelConfig m = SnapKvModel();
  ASSERT_TRUE(m.compression);
  auto cpu = ChunkCodec::Create(m, kTokens, nullptr, "k", IngestDevice{.reason = "test"});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto broken = ChunkCodec::Create(m, kTokens, nullptr, "k",
                                   IngestDevice{.cuda = true, .ordinal = 999, .reason = "test"});
  ASSERT_TRUE(broken.ok()) << broken.status();

  constexpr int kChunks = 20;
  const auto start = std::chrono::steady_clock::now();
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < kChunks; ++i) {
    const std::vector<uint8_t> put = PutBytes(**cpu, m, 100 + i);
    auto on_cpu = (*cpu)->Encode(put, kTokens, 0, kWindow);
    auto fell_back = (*broken)->Encode(put, kTokens, 0, kWindow);
    ASSERT_TRUE(on_cpu.ok()) << on_cpu.status();
    ASSERT_TRUE(fell_back.ok()) << fell_back.status();
    EXPECT_FALSE(fell_back->lossless);
    EXPECT_EQ(fell_back->bytes, on_cpu->bytes) << "chunk " << i;
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  const auto minutes =
      std::chrono::duration_cast<std::chrono::minutes>(std::chrono::steady_clock::now() - start)
          .count();

  EXPECT_EQ((*broken)->Stats().device_fallbacks, uint64_t{kChunks});
  EXPECT_EQ((*cpu)->Stats().device_fallbacks, 0u);
  const size_t records = Count(log, "CUDA plan failed on a chunk");
  EXPECT_GE(records, 1u) << log;
  EXPECT_LE(records, 1u + static_cast<size_t>(minutes)) << log;  // not one per chunk
  EXPECT_THAT(log, ::testing::HasSubstr("chunks_since_last_record=1 chunks_total=1"));
  EXPECT_THAT(log, ::testing::HasSubstr("device=cuda:999"));
}

// The policy's quantize stage reaches the stored bytes: `[keydiff, quantize]` and `[quantize]`
// alone encode version 3 chunks with the policy's format, group and recent window, KeyDiff's
// slots (p_c 0.5) or every token (p_c 0), and fewer bytes than the unquantized policy.
TEST(ChunkCodecTest, TheQuantizeStageOfThePolicyIsInTheStoredChunk) {
  auto parse = [](const std::string& policy) {
    auto config = ParseConfigYaml(
        "models: [{name: m, layout: {layers: 2, kv_heads: 1, q_heads: 2, head_dim: 8, dtype: "
        "float32}, compression: " +
        policy + "}]");
    EXPECT_TRUE(config.ok()) << config.status();
    return config.ok() ? config->models[0] : ModelConfig{};
  };
  const ModelConfig plain = parse("{stages: [keydiff], window: 4, sinks: 2, device: cpu}");
  const ModelConfig quant = parse(
      "{stages: [keydiff, quantize], quant_format: int4, quant_group: 8, quant_recent: 4, "
      "window: 4, sinks: 2, device: cpu}");
  const ModelConfig alone = parse("{stages: [quantize], window: 4, sinks: 2, device: cpu}");
  auto plain_codec = ChunkCodec::Create(plain, kTokens, nullptr, "k", std::nullopt);
  auto quant_codec = ChunkCodec::Create(quant, kTokens, nullptr, "k", std::nullopt);
  auto alone_codec = ChunkCodec::Create(alone, kTokens, nullptr, "k", std::nullopt);
  ASSERT_TRUE(plain_codec.ok() && quant_codec.ok() && alone_codec.ok());
  const std::vector<uint8_t> put = PutBytes(**quant_codec, quant, 3);
  auto p = (*plain_codec)->Encode(put, kTokens, 0, kWindow);
  auto q = (*quant_codec)->Encode(put, kTokens, 0, kWindow);
  auto a = (*alone_codec)->Encode(put, kTokens, 0, kWindow);
  ASSERT_TRUE(p.ok() && q.ok() && a.ok()) << q.status() << a.status();
  EXPECT_NE(p->codec_id, q->codec_id);
  auto pc = kernels::DecodeCompactChunk(p->bytes);
  auto qc = kernels::DecodeCompactChunk(q->bytes);
  auto ac = kernels::DecodeCompactChunk(a->bytes);
  ASSERT_TRUE(pc.ok() && qc.ok() && ac.ok()) << qc.status() << ac.status();
  EXPECT_FALSE(pc->codec.quant.quantized());
  EXPECT_EQ(
      qc->codec.quant,
      (kernels::QuantDescription{
          .format = kernels::QuantFormat::kInt4, .key_group = 8, .value_group = 8, .recent = 4}));
  EXPECT_EQ(ac->codec.quant.format, kernels::QuantFormat::kInt8);
  EXPECT_EQ(ac->codec.quant.key_group, 64u);
  for (size_t i = 0; i < pc->heads.size(); ++i) {
    EXPECT_EQ(qc->heads[i].positions, pc->heads[i].positions);  // KeyDiff's slots
    EXPECT_EQ(ac->heads[i].slots(), kTokens);                   // alone: every token
  }
  EXPECT_EQ(qc->codec.score, kernels::ScoreStage::kKeyDiff);
  EXPECT_EQ(ac->codec.score, kernels::ScoreStage::kNone);
  EXPECT_LT(q->bytes.size(), p->bytes.size());
}

// quant_sinks: the chunk at the sequence's start keeps its first tokens' keys and values exact
// (version 5, their count recorded); a later chunk of the same sequence records none.
TEST(ChunkCodecTest, TheSequencesSinkTokensStayExactInItsFirstChunk) {
  auto config = ParseConfigYaml(
      "models: [{name: m, layout: {layers: 2, kv_heads: 1, q_heads: 2, head_dim: 8, dtype: "
      "float32}, compression: {stages: [quantize], quant_format: int4, quant_group: 8, "
      "quant_sinks: 2, window: 4, sinks: 2, device: cpu}}]");
  ASSERT_TRUE(config.ok()) << config.status();
  const ModelConfig& m = config->models[0];
  auto codec = ChunkCodec::Create(m, kTokens, nullptr, "k", std::nullopt);
  ASSERT_TRUE(codec.ok()) << codec.status();
  const std::vector<uint8_t> put = PutBytes(**codec, m, 9);
  for (const uint64_t first : {uint64_t{0}, uint64_t{kTokens}}) {
    auto e = (*codec)->Encode(put, kTokens, first, kWindow);
    ASSERT_TRUE(e.ok()) << e.status();
    uint16_t version;
    std::memcpy(&version, e->bytes.data() + 4, 2);
    EXPECT_EQ(version, first == 0 ? 5 : 3);
    auto c = kernels::DecodeCompactChunk(e->bytes);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->codec.quant.sinks, first == 0 ? 2u : 0u);
    auto plain = kernels::DequantizeChunk(*c);
    ASSERT_TRUE(plain.ok()) << plain.status();
    for (int layer = 0; layer < 2; ++layer) {
      // Layer `layer`'s K rows in the put, float32, one KV head of 8.
      const uint8_t* k = put.data() + m.layout.LayerOffset(layer, kTokens);
      const kernels::CompactHead& h = plain->Head(layer, 0);
      EXPECT_EQ(std::memcmp(h.keys.data(), k, 2 * 8 * sizeof(float)) == 0, first == 0) << layer;
    }
  }
}

// The rotation, a value format and a key group of their own reach the stored chunk (version 4),
// and the chunk decodes and dequantizes; so do the symmetric formats, named as the kernels' table
// names them.
TEST(ChunkCodecTest, TheRotationAndValueFormatOfThePolicyAreInTheStoredChunk) {
  namespace kk = kernels;
  const std::pair<const char*, kk::QuantDescription> cases[] = {
      {"quant_format: int3, quant_key_group: 5, quant_value_format: int2",
       {.format = kk::QuantFormat::kInt3,
        .key_group = 5,
        .value_group = 8,
        .rotation = kk::QuantRotation::kHadamard,
        .value_format = kk::QuantFormat::kInt2}},
      {"quant_format: int4s, quant_value_format: int2s",
       {.format = kk::QuantFormat::kInt4Sym,
        .key_group = 8,
        .value_group = 8,
        .rotation = kk::QuantRotation::kHadamard,
        .value_format = kk::QuantFormat::kInt2Sym}},
  };
  for (const auto& [policy, quant] : cases) {
    auto config = ParseConfigYaml(
        "models: [{name: m, layout: {layers: 2, kv_heads: 1, q_heads: 2, head_dim: 8, dtype: "
        "float32}, compression: {stages: [quantize], quant_group: 8, quant_rotate: hadamard, " +
        std::string(policy) + ", window: 4, sinks: 2, device: cpu}}]");
    ASSERT_TRUE(config.ok()) << config.status();
    const ModelConfig& m = config->models[0];
    auto codec = ChunkCodec::Create(m, kTokens, nullptr, "k", std::nullopt);
    ASSERT_TRUE(codec.ok()) << codec.status();
    auto e = (*codec)->Encode(PutBytes(**codec, m, 5), kTokens, 0, kWindow);
    ASSERT_TRUE(e.ok()) << e.status();
    uint16_t version;
    std::memcpy(&version, e->bytes.data() + 4, 2);
    EXPECT_EQ(version, 4) << policy;
    auto c = kernels::DecodeCompactChunk(e->bytes);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->codec.quant, quant) << policy;
    EXPECT_TRUE(kernels::DequantizeChunk(*c).ok()) << policy;
  }
}

// Every format the kernels name is a choice of quant_format and quant_value_format, and each
// reaches the stored chunk as itself.
TEST(ChunkCodecTest, EveryNamedFormatOfThePolicyIsTheStoredChunksFormat) {
  namespace kk = kernels;
  for (kk::QuantFormat f : kk::QuantFormats()) {
    const std::string name(kk::QuantFormatName(f));
    const kk::QuantFormat other =
        f == kk::QuantFormat::kInt8 ? kk::QuantFormat::kInt4 : kk::QuantFormat::kInt8;
    const std::pair<std::string, std::pair<kk::QuantFormat, kk::QuantFormat>> cases[] = {
        {"quant_format: " + name, {f, kk::QuantFormat::kNone}},
        {"quant_format: " + std::string(kk::QuantFormatName(other)) +
             ", quant_value_format: " + name,
         {other, f}},
    };
    for (const auto& [policy, formats] : cases) {
      auto config = ParseConfigYaml(
          "models: [{name: m, layout: {layers: 2, kv_heads: 1, q_heads: 2, head_dim: 8, dtype: "
          "float32}, compression: {stages: [quantize], quant_group: 8, " +
          policy + ", window: 4, sinks: 2, device: cpu}}]");
      ASSERT_TRUE(config.ok()) << policy << ": " << config.status();
      const ModelConfig& m = config->models[0];
      auto codec = ChunkCodec::Create(m, kTokens, nullptr, "k", std::nullopt);
      ASSERT_TRUE(codec.ok()) << codec.status();
      auto e = (*codec)->Encode(PutBytes(**codec, m, 5), kTokens, 0, kWindow);
      ASSERT_TRUE(e.ok()) << policy << ": " << e.status();
      auto c = kernels::DecodeCompactChunk(e->bytes);
      ASSERT_TRUE(c.ok()) << c.status();
      EXPECT_EQ(c->codec.quant.format, formats.first) << policy;
      EXPECT_EQ(c->codec.quant.value_format, formats.second) << policy;
    }
  }
}

// CompressionPolicy::KeepsPositions (HelloReply.keepsPositions: what vLLM's connector serves)
// says what the stored chunks are: with it every head's slots expand to the chunk's tokens,
// without it some tokens are gone. Real encodes of each kind of policy.
TEST(ChunkCodecTest, KeepsPositionsIsWhatTheStoredChunksExpandTo) {
  const std::vector<std::pair<std::string, bool>> policies = {
      {"{stages: [quantize]}", true},
      {"{stages: [quantize], quant_format: int4}", true},
      {"{stages: [kvslimmer]}", true},
      {"{stages: [kvslimmer, quantize]}", true},
      {"{stages: [keydiff], p_c: 0}", true},
      {"{stages: [keydiff]}", false},
      {"{stages: [snapkv]}", false},
      {"{stages: [keydiff, quantize]}", false},
      {"{stages: [quantize], p_c: 0.5}", false},
      {"{stages: [hybrid], max_group: 2, p_c: 0.75}", false},
  };
  for (const auto& [policy, keeps] : policies) {
    auto config = ParseConfigYaml(
        "models: [{name: m, layout: {layers: 2, kv_heads: 2, q_heads: 4, head_dim: 8, dtype: "
        "float32}, compression: " +
        policy.substr(0, policy.size() - 1) + ", window: 4, sinks: 2, device: cpu}}]");
    ASSERT_TRUE(config.ok()) << policy << ": " << config.status();
    const ModelConfig& m = config->models[0];
    EXPECT_EQ(m.compression->KeepsPositions(), keeps) << policy;
    auto codec = ChunkCodec::Create(m, kTokens, nullptr, "k", std::nullopt);
    ASSERT_TRUE(codec.ok()) << policy << ": " << codec.status();
    auto encoded = (*codec)->Encode(PutBytes(**codec, m, 5), kTokens, 0, kWindow);
    ASSERT_TRUE(encoded.ok()) << policy << ": " << encoded.status();
    auto chunk = kernels::DecodeCompactChunk(encoded->bytes);
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    bool every_head_whole = true;
    for (const kernels::CompactHead& h : chunk->heads) {
      int64_t tokens = 0;
      for (int32_t l : h.cardinality) tokens += l;
      every_head_whole = every_head_whole && tokens == kTokens;
    }
    EXPECT_EQ(every_head_whole, keeps) << policy;
  }
}

}  // namespace
}  // namespace kvd::daemon
