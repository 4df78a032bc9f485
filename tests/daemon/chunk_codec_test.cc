// ChunkCodec's device fallback: chunks the CUDA plan fails on are compressed by the CPU plan,
// counted, and logged once per interval rather than once per chunk.
#include "kvd/daemon/chunk_codec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvd/daemon/config.h"

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

}  // namespace
}  // namespace kvd::daemon
