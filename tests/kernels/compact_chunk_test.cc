// Compact chunk: validation, encode -> decode identity, and decode of damaged bytes (fuzz).
#include "kvd/kernels/compact_chunk.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "kvd/common/hash.h"

namespace kvd::kernels {
namespace {

using ::testing::HasSubstr;

CompactChunk RandomChunk(int layers, int heads, int d, DType dtype, uint64_t seed) {
  std::mt19937_64 rng(seed);
  CompactChunk c;
  c.num_layers = layers;
  c.num_kv_heads = heads;
  c.head_dim = d;
  c.dtype = dtype;
  c.original_tokens = 1000;
  c.layout_digest = rng();
  c.codec = {.score = ScoreStage::kSnapKv,
             .merge = MergeStage::kKvSlimmer,
             .merge_norm = MergeNorm::kL1Code,
             .route = RouteStage::kVector,
             .position = RepresentativePosition::kWeighted,
             .p_c = 0.75,
             .calibration_version = rng()};
  c.heads.resize(static_cast<size_t>(layers) * heads);
  const size_t e = DTypeSize(dtype);
  for (CompactHead& h : c.heads) {
    const int64_t s = static_cast<int64_t>(rng() % 300);  // includes 0 slots
    h.flags.resize(s);
    h.cardinality.resize(s);
    h.positions.resize(s);
    for (int64_t j = 0; j < s; ++j) {
      h.flags[j] = (rng() % 3 == 0) ? kSlotRebuildValue : 0;
      h.cardinality[j] = 1 + static_cast<int32_t>(rng() % 5);
      h.positions[j] = static_cast<int64_t>(rng() % 100000);
    }
    h.keys.resize(s * d * e);
    for (auto& b : h.keys) b = static_cast<uint8_t>(rng());
    h.values.resize(h.value_slots() * d * e);
    for (auto& b : h.values) b = static_cast<uint8_t>(rng());
  }
  return c;
}

TEST(CompactChunk, EncodeDecodeIsIdentity) {
  uint64_t seed = 1;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (int d : {64, 128}) {
      CompactChunk c = RandomChunk(3, 2, d, dtype, seed++);
      ASSERT_TRUE(c.Validate().ok()) << c.Validate();
      auto bytes = EncodeCompactChunk(c);
      ASSERT_TRUE(bytes.ok()) << bytes.status();
      EXPECT_EQ(bytes->size() % 64, 8u);  // sections padded to 64, then the 8-byte trailer
      auto back = DecodeCompactChunk(*bytes);
      ASSERT_TRUE(back.ok()) << back.status();
      EXPECT_TRUE(*back == c);
      EXPECT_EQ(back->HalfPairs(), c.HalfPairs());
      // Encoding is deterministic.
      EXPECT_EQ(*EncodeCompactChunk(*back), *bytes);
    }
  }
}

TEST(CompactChunk, TrailerIsTheCommonChecksum) {
  CompactChunk c = RandomChunk(2, 2, 128, DType::kFloat16, 12);
  auto bytes = EncodeCompactChunk(c);
  ASSERT_TRUE(bytes.ok());
  uint64_t trailer;
  std::memcpy(&trailer, bytes->data() + bytes->size() - 8, 8);
  EXPECT_EQ(trailer, Checksum64(bytes->data(), bytes->size() - 8));
}

TEST(CompactChunk, SectionsAreAligned) {
  CompactChunk c = RandomChunk(1, 2, 64, DType::kBFloat16, 9);
  auto bytes = EncodeCompactChunk(c);
  ASSERT_TRUE(bytes.ok());
  for (int i = 0; i < 2; ++i) {
    uint64_t offset;
    std::memcpy(&offset, bytes->data() + 128 + 32 * i, 8);
    EXPECT_EQ(offset % 64, 0u);
    uint32_t slots;
    std::memcpy(&slots, bytes->data() + 128 + 32 * i + 8, 4);
    EXPECT_EQ(slots, c.heads[i].slots());
  }
}

TEST(CompactChunk, ValidateNamesTheBrokenField) {
  CompactChunk c = RandomChunk(1, 1, 64, DType::kFloat16, 4);
  c.heads[0].flags.push_back(0);
  Status s = c.Validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("layer 0 head 0"));
  c = RandomChunk(1, 1, 64, DType::kFloat16, 4);
  ASSERT_GT(c.heads[0].slots(), 0);
  c.heads[0].cardinality[0] = 0;
  EXPECT_THAT(c.Validate().message(), HasSubstr("cardinality < 1"));
  c = RandomChunk(1, 1, 64, DType::kFloat16, 4);
  c.codec.route = RouteStage::kNone;
  EXPECT_THAT(c.Validate().message(), HasSubstr("rebuild flag set"));
  c = RandomChunk(1, 1, 64, DType::kFloat16, 4);
  c.codec.p_c = 1.0;
  EXPECT_EQ(EncodeCompactChunk(c).status().code(), StatusCode::kInvalidArgument);
}

TEST(CompactChunk, DecodeRejectsDamage) {
  CompactChunk c = RandomChunk(2, 2, 64, DType::kBFloat16, 21);
  std::vector<uint8_t> good = *EncodeCompactChunk(c);

  auto bad = good;
  bad[0] = 'X';
  EXPECT_EQ(DecodeCompactChunk(bad).status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(DecodeCompactChunk(bad).status().message(), HasSubstr("bad magic"));

  bad = good;
  bad[4] = 2;
  EXPECT_THAT(DecodeCompactChunk(bad).status().message(),
              HasSubstr("unsupported compact chunk version 2"));

  auto cut = std::span(good).first(good.size() - 1);
  EXPECT_EQ(DecodeCompactChunk(cut).status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(DecodeCompactChunk(cut).status().message(), HasSubstr("size mismatch"));

  EXPECT_THAT(DecodeCompactChunk(std::span(good).first(10)).status().message(),
              HasSubstr("truncated"));

  bad = good;
  bad[good.size() / 2] ^= 1;
  EXPECT_EQ(DecodeCompactChunk(bad).status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(DecodeCompactChunk(bad).status().message(), HasSubstr("checksum mismatch"));
}

// Random truncations and bit flips: every outcome is the error the checks promise, never a crash.
TEST(CompactChunk, FuzzTruncationsAndBitFlips) {
  CompactChunk c = RandomChunk(2, 3, 64, DType::kFloat16, 33);
  const std::vector<uint8_t> good = *EncodeCompactChunk(c);
  std::mt19937_64 rng(77);
  for (int iter = 0; iter < 2000; ++iter) {
    std::vector<uint8_t> bytes = good;
    StatusCode expected;
    if (iter % 2 == 0) {
      bytes.resize(rng() % good.size());
      expected = StatusCode::kDataLoss;
    } else {
      const size_t at = rng() % good.size();
      bytes[at] ^= static_cast<uint8_t>(1u << (rng() % 8));
      // magic (0..3) and version (4..5) are checked before the checksum
      expected = at < 6 ? StatusCode::kInvalidArgument : StatusCode::kDataLoss;
    }
    auto r = DecodeCompactChunk(bytes);
    ASSERT_FALSE(r.ok()) << "iter " << iter;
    ASSERT_EQ(r.status().code(), expected) << r.status() << " iter " << iter;
  }
}

}  // namespace
}  // namespace kvd::kernels
