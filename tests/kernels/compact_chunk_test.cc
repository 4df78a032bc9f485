// Compact chunk: validation, encode -> decode identity (random and plan-shaped chunks, extreme
// values), format v1 still read, and decode of damaged bytes: truncation at every byte, trailing
// bytes, and metadata corrupted behind a valid checksum (what a buggy or hostile writer makes).
#include "kvd/kernels/compact_chunk.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <utility>

#include "compact_chunk_golden.h"
#include "kvd/common/hash.h"
#include "kvd/kernels/quantize.h"

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

// A chunk shaped like a plan's output: per head, ascending disjoint groups of tokens starting at
// `first` (some evicted between them, position = last token or a token inside the group),
// cardinalities 1 for eviction, a few rebuild flags on single slots with a route stage; some
// heads without slots.
CompactChunk PlanShapedChunk(int layers, int heads, int d, bool merge, bool route, bool weighted,
                             int64_t first, uint64_t seed) {
  std::mt19937_64 rng(seed);
  CompactChunk c;
  c.num_layers = layers;
  c.num_kv_heads = heads;
  c.head_dim = d;
  c.dtype = DType::kBFloat16;
  c.original_tokens = 256;
  c.layout_digest = rng();
  c.codec = {
      .score = ScoreStage::kSnapKv,
      .merge = merge ? MergeStage::kKvSlimmer : MergeStage::kNone,
      .route = route ? RouteStage::kVector : RouteStage::kNone,
      .position = weighted ? RepresentativePosition::kWeighted : RepresentativePosition::kLast,
      .p_c = 0.5,
      .calibration_version = route ? rng() : 0};
  c.heads.resize(static_cast<size_t>(layers) * heads);
  for (CompactHead& h : c.heads) {
    if (rng() % 7 == 0) continue;  // no slots
    int64_t token = first;
    while (token < first + 256) {
      token += static_cast<int64_t>(rng() % 4 == 0 ? rng() % 9 : 0);  // evicted tokens
      const int32_t l = merge ? 1 + static_cast<int32_t>(rng() % 4) : 1;
      const int64_t last = token + l - 1;
      h.positions.push_back(weighted ? token + static_cast<int64_t>(rng() % l) : last);
      h.cardinality.push_back(l);
      h.flags.push_back(route && l == 1 && rng() % 3 == 0 ? kSlotRebuildValue : 0);
      token = last + 1;
    }
    h.keys.resize(h.slots() * d * 2);
    for (auto& b : h.keys) b = static_cast<uint8_t>(rng());
    h.values.resize(h.value_slots() * d * 2);
    for (auto& b : h.values) b = static_cast<uint8_t>(rng());
  }
  return c;
}

uint32_t MetadataBytes(const std::vector<uint8_t>& bytes) {
  uint32_t meta;
  std::memcpy(&meta, bytes.data() + 28, 4);
  return meta;
}

// `body` (a chunk without its trailer) with the header's total size and the trailer made to match,
// so that decoding gets past the size and checksum checks to the structure.
std::vector<uint8_t> Restamp(std::vector<uint8_t> body) {
  const uint64_t total = body.size() + 8;
  std::memcpy(body.data() + 72, &total, 8);
  const uint64_t sum = Checksum64(body.data(), body.size());
  body.resize(body.size() + 8);
  std::memcpy(body.data() + body.size() - 8, &sum, 8);
  return body;
}

// The bytes of a chunk decode to an equal chunk and encode back to the same bytes.
void ExpectRoundTrip(const CompactChunk& c) {
  ASSERT_TRUE(c.Validate().ok()) << c.Validate();
  auto bytes = EncodeCompactChunk(c);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto back = DecodeCompactChunk(*bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == c);
  EXPECT_EQ(back->HalfPairs(), c.HalfPairs());
  EXPECT_EQ(*EncodeCompactChunk(*back), *bytes);  // deterministic
}

TEST(CompactChunk, ForLayoutFillsTheHeaderAndEmptyHeads) {
  ModelLayout layout;
  layout.num_layers = 3;
  layout.num_kv_heads = 2;
  layout.num_q_heads = 4;
  layout.head_dim = 16;
  layout.dtype = DType::kFloat16;
  ASSERT_TRUE(layout.Validate().ok());
  const CodecDescription codec{.score = ScoreStage::kKeyDiff, .p_c = 0.5};
  CompactChunk c = CompactChunk::ForLayout(layout, 40, codec);
  EXPECT_EQ(c.num_layers, 3);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.dtype, DType::kFloat16);
  EXPECT_EQ(c.original_tokens, 40);
  EXPECT_EQ(c.layout_digest, layout.Digest());
  EXPECT_EQ(c.codec, codec);
  ASSERT_EQ(c.heads.size(), 6u);
  for (const CompactHead& h : c.heads) EXPECT_EQ(h, CompactHead{});
  // Heads without slots are a valid chunk: it encodes and decodes to itself.
  auto bytes = EncodeCompactChunk(c);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto back = DecodeCompactChunk(*bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, c);
  EXPECT_EQ(CompactChunk::ForLayout(layout, 40).codec, CodecDescription{});
}

TEST(CompactChunk, EncodeDecodeIsIdentity) {
  uint64_t seed = 1;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (int d : {64, 128}) {
      SCOPED_TRACE(seed);
      ExpectRoundTrip(RandomChunk(3, 2, d, dtype, seed++));  // unordered positions
    }
  }
  for (bool merge : {false, true}) {
    for (bool route : {false, true}) {
      for (bool weighted : {false, true}) {
        for (int64_t first : {int64_t{0}, int64_t{4096}, int64_t{1} << 40}) {
          SCOPED_TRACE(seed);
          ExpectRoundTrip(PlanShapedChunk(4, 3, 16, merge, route, weighted, first, seed++));
        }
      }
    }
  }
}

TEST(CompactChunk, ExtremeValuesRoundTrip) {
  CompactChunk c = PlanShapedChunk(1, 3, 8, true, true, false, 0, 5);
  for (CompactHead& h : c.heads) {
    if (h.slots() < 3) continue;
    h.positions[0] = 0;
    h.cardinality[0] = std::numeric_limits<int32_t>::max();  // position base far below 0
    h.positions[1] = std::numeric_limits<int64_t>::max();
    h.positions[2] = 0;
  }
  ExpectRoundTrip(c);
  c.heads[0] = {};  // first head empty, then one with every slot flagged
  CompactHead& h = c.heads[1];
  h.cardinality.assign(h.slots(), 1);
  h.flags.assign(h.slots(), kSlotRebuildValue);
  h.values.clear();
  ExpectRoundTrip(c);
}

TEST(CompactChunk, LayoutIsHeaderMetadataThenAlignedKeysAndValues) {
  const CompactChunk c = PlanShapedChunk(2, 2, 64, true, true, false, 512, 9);
  auto bytes = EncodeCompactChunk(c);
  ASSERT_TRUE(bytes.ok());
  uint16_t version;
  std::memcpy(&version, bytes->data() + 4, 2);
  EXPECT_EQ(version, 2);
  int64_t base;
  std::memcpy(&base, bytes->data() + 64, 8);
  EXPECT_EQ(base, 512);  // the first token a slot stands for
  size_t at = (80 + MetadataBytes(*bytes) + 63) / 64 * 64;
  for (const CompactHead& h : c.heads) {
    ASSERT_LE(at + h.keys.size() + h.values.size(), bytes->size());
    EXPECT_TRUE(std::equal(h.keys.begin(), h.keys.end(), bytes->begin() + at));
    at += h.keys.size();
    EXPECT_TRUE(std::equal(h.values.begin(), h.values.end(), bytes->begin() + at));
    at += h.values.size();
  }
  EXPECT_EQ(at + 8, bytes->size());
}

TEST(CompactChunk, TrailerIsTheCommonChecksum) {
  CompactChunk c = RandomChunk(2, 2, 128, DType::kFloat16, 12);
  auto bytes = EncodeCompactChunk(c);
  ASSERT_TRUE(bytes.ok());
  uint64_t trailer;
  std::memcpy(&trailer, bytes->data() + bytes->size() - 8, 8);
  EXPECT_EQ(trailer, Checksum64(bytes->data(), bytes->size() - 8));
}

// The chunk of compact_chunk_golden.h.
CompactChunk GoldenChunk() {
  CompactChunk c;
  c.num_layers = 1;
  c.num_kv_heads = 2;
  c.head_dim = 4;
  c.dtype = DType::kFloat16;
  c.original_tokens = 16;
  c.layout_digest = 0x0123456789abcdefull;
  c.codec = {.score = ScoreStage::kSnapKv,
             .merge = MergeStage::kKvSlimmer,
             .merge_norm = MergeNorm::kL2,
             .route = RouteStage::kVector,
             .position = RepresentativePosition::kLast,
             .p_c = 0.75,
             .calibration_version = 0xfeedbeefull};
  c.heads.resize(2);
  c.heads[0].flags = {0, kSlotRebuildValue, 0};
  c.heads[0].cardinality = {1, 1, 5};
  c.heads[0].positions = {1000, 1007, 1015};
  c.heads[1].flags = {0, 0};
  c.heads[1].cardinality = {3, 1};
  c.heads[1].positions = {1002, 1015};
  uint8_t b = 1;
  for (CompactHead& h : c.heads) {
    h.keys.resize(h.slots() * 4 * 2);
    for (auto& x : h.keys) x = b++;
    h.values.resize(h.value_slots() * 4 * 2);
    for (auto& x : h.values) x = b++;
  }
  return c;
}

// The v2 bytes are pinned: a change to the writer that changes them is a format change.
TEST(CompactChunk, FormatVersion2BytesAreStable) {
  const CompactChunk c = GoldenChunk();
  const std::span<const uint8_t> golden(testing::kCompactChunkV2Golden);
  auto bytes = EncodeCompactChunk(c);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_TRUE(std::equal(bytes->begin(), bytes->end(), golden.begin(), golden.end()));
  EXPECT_EQ(MetadataBytes(*bytes), 9u);
  auto decoded = DecodeCompactChunk(golden);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_TRUE(*decoded == c);
}

// Chunks written by earlier builds (format v1) still decode.
TEST(CompactChunk, ReadsFormatVersion1) {
  const CompactChunk c = GoldenChunk();
  const std::span<const uint8_t> v1(testing::kCompactChunkV1Golden);
  auto decoded = DecodeCompactChunk(v1);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_TRUE(*decoded == c);
  // Re-encoding writes v2, which reads back the same.
  auto v2 = EncodeCompactChunk(*decoded);
  ASSERT_TRUE(v2.ok());
  EXPECT_LT(v2->size(), v1.size());
  EXPECT_TRUE(*DecodeCompactChunk(*v2) == c);

  std::vector<uint8_t> bad(v1.begin(), v1.end());
  bad[200] ^= 1;
  EXPECT_THAT(DecodeCompactChunk(bad).status().message(), HasSubstr("checksum mismatch"));
  EXPECT_THAT(DecodeCompactChunk(v1.first(100)).status().message(),
              HasSubstr("truncated: 100 bytes, the v1 header"));
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
  bad[4] = 6;
  EXPECT_EQ(DecodeCompactChunk(bad).status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(DecodeCompactChunk(bad).status().message(),
              HasSubstr("unsupported compact chunk version 6 (this build reads 1 to 5)"));

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

// A well-formed chunk (its checksum valid) whose score, merge or route code no stage of this
// process registers is not corrupt: UNIMPLEMENTED naming the code, never DATA_LOSS (which readers
// may take as "drop the chunk"). A merge norm or position code outside its enum still is.
TEST(CompactChunk, AStageCodeThisProcessDoesNotRegisterIsUnimplementedNotCorrupt) {
  const std::vector<uint8_t> good = *EncodeCompactChunk(RandomChunk(1, 2, 8, DType::kFloat16, 3));
  const std::vector<uint8_t> body(good.begin(), good.end() - 8);
  // The header's stage codes: score (21), merge (22), merge norm (23), route (24), position (25).
  for (const auto& [offset, what] :
       {std::pair<size_t, const char*>{21, "score 201"}, {22, "merge 201"}, {24, "route 201"}}) {
    auto bad = body;
    bad[offset] = 201;
    auto r = DecodeCompactChunk(Restamp(bad));
    EXPECT_EQ(r.status().code(), StatusCode::kUnimplemented) << offset << " " << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(std::string(what) + " is not registered"));
  }
  for (const size_t offset : {23, 25}) {
    auto bad = body;
    bad[offset] = 201;
    EXPECT_EQ(DecodeCompactChunk(Restamp(bad)).status().code(), StatusCode::kDataLoss) << offset;
  }
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

// Every prefix of a chunk is refused as truncated (or with a size mismatch), never a crash; every
// prefix re-stamped with a matching size and checksum is refused as corrupt.
// Every prefix of `good` is refused as truncated (or with a size mismatch); every prefix longer
// than the header re-stamped with a matching size and checksum is refused as corrupt.
void ExpectEveryPrefixRefused(const std::vector<uint8_t>& good, size_t header_bytes) {
  for (size_t n = 0; n < good.size(); ++n) {
    auto r = DecodeCompactChunk(std::span(good).first(n));
    ASSERT_FALSE(r.ok()) << n;
    ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << n << " " << r.status();
    ASSERT_THAT(r.status().message(), ::testing::AnyOf(HasSubstr("compact chunk truncated"),
                                                       HasSubstr("compact chunk size mismatch")))
        << n;
  }
  for (size_t n = header_bytes; n < good.size() - 8; ++n) {
    auto r = DecodeCompactChunk(Restamp({good.begin(), good.begin() + n}));
    ASSERT_FALSE(r.ok()) << n;
    ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << n << " " << r.status();
    ASSERT_THAT(r.status().message(), HasSubstr("corrupt compact chunk")) << n;
  }
}

TEST(CompactChunk, TruncationAtEveryByteIsAnError) {
  const CompactChunk c = PlanShapedChunk(2, 3, 8, true, true, false, 256, 41);
  ExpectEveryPrefixRefused(*EncodeCompactChunk(c), 80);
}

TEST(CompactChunk, OverlongInputIsAnError) {
  const CompactChunk c = PlanShapedChunk(2, 2, 8, false, false, false, 0, 43);
  const std::vector<uint8_t> good = *EncodeCompactChunk(c);
  std::vector<uint8_t> body(good.begin(), good.end() - 8);

  auto longer = good;
  longer.push_back(0);
  EXPECT_THAT(DecodeCompactChunk(longer).status().message(), HasSubstr("size mismatch"));

  auto extra = body;
  extra.insert(extra.end(), 16, 0);  // data the slots do not account for
  auto r = DecodeCompactChunk(Restamp(extra));
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(r.status().message(),
              HasSubstr("corrupt compact chunk: 16 bytes of data beyond what the slots hold"));

  // The header claims one more byte of metadata than the heads use.
  auto meta = body;
  const uint32_t m = MetadataBytes(good) + 1;
  std::memcpy(meta.data() + 28, &m, 4);
  r = DecodeCompactChunk(Restamp(meta));
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(r.status().message(), HasSubstr("corrupt compact chunk"));

  auto padding = body;
  padding[80 + MetadataBytes(good)] = 1;  // the zero bytes between metadata and data
  ASSERT_LT(80 + MetadataBytes(good), (80 + MetadataBytes(good) + 63) / 64 * 64);
  EXPECT_THAT(DecodeCompactChunk(Restamp(padding)).status().message(),
              HasSubstr("nonzero padding before the data section"));

  auto reserved = body;
  reserved[26] = 1;
  EXPECT_THAT(DecodeCompactChunk(Restamp(reserved)).status().message(),
              HasSubstr("reserved bytes not zero"));
}

// Bit flips and random bytes in the slot metadata behind a valid checksum: each decode either
// fails with DATA_LOSS "corrupt compact chunk: ..." or yields a chunk that passes Validate().
TEST(CompactChunk, CorruptMetadataBehindAValidChecksumIsAnError) {
  const CompactChunk c = PlanShapedChunk(3, 2, 8, true, true, true, 300, 47);
  const std::vector<uint8_t> good = *EncodeCompactChunk(c);
  const std::vector<uint8_t> body(good.begin(), good.end() - 8);
  const size_t meta = MetadataBytes(good);
  auto check = [](const std::vector<uint8_t>& bytes, const std::string& what) {
    auto r = DecodeCompactChunk(bytes);
    if (r.ok()) {
      EXPECT_TRUE(r->Validate().ok()) << what;
    } else {
      EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << what << " " << r.status();
      EXPECT_THAT(r.status().message(), HasSubstr("corrupt compact chunk")) << what;
    }
    return r.ok();
  };
  int decoded = 0;
  for (size_t bit = 0; bit < meta * 8; ++bit) {
    auto bytes = body;
    bytes[80 + bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    decoded += check(Restamp(bytes), "bit " + std::to_string(bit));
  }
  std::mt19937_64 rng(53);
  for (int iter = 0; iter < 3000; ++iter) {
    auto bytes = body;
    const size_t from = 80 + rng() % meta, n = 1 + rng() % 8;
    for (size_t i = from; i < std::min(from + n, 80 + meta); ++i) {
      bytes[i] = static_cast<uint8_t>(rng());
    }
    if (iter % 3 == 0) {  // and a random metadata length
      const uint32_t m = static_cast<uint32_t>(rng() % (meta + 16));
      std::memcpy(bytes.data() + 28, &m, 4);
    }
    decoded += check(Restamp(bytes), "iter " + std::to_string(iter));
  }
  // Most damage is caught; what decodes is still a valid chunk (a flipped key bit would be too).
  EXPECT_LT(decoded, 3000);
}

}  // namespace
}  // namespace kvd::kernels

namespace kvd::kernels {
namespace {

// A plan-shaped chunk with finite keys and values, quantized (int4, keys over 4 slots, values over
// 3 channels, the last 2 rows of each head kept): the version 3 format.
CompactChunk QuantizedChunk(uint64_t seed, QuantDescription q = {.format = QuantFormat::kInt4,
                                                                 .key_group = 4,
                                                                 .value_group = 3,
                                                                 .recent = 2}) {
  CompactChunk c = PlanShapedChunk(2, 3, 8, true, true, false, 256, seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  for (CompactHead& h : c.heads) {
    for (std::vector<uint8_t>* rows : {&h.keys, &h.values}) {
      for (size_t i = 0; i + 1 < rows->size(); i += 2) {
        const uint16_t b = FloatToBFloat16(dist(rng));
        std::memcpy(rows->data() + i, &b, 2);
      }
    }
  }
  auto quantized = QuantizeChunk(c, q);
  EXPECT_TRUE(quantized.ok()) << quantized.status();
  return *quantized;
}

TEST(CompactChunkV3, QuantizedChunksRoundTripAsVersion3) {
  const CompactChunk c = QuantizedChunk(61);
  ExpectRoundTrip(c);
  const std::vector<uint8_t> bytes = *EncodeCompactChunk(c);
  uint16_t version, header;
  std::memcpy(&version, bytes.data() + 4, 2);
  std::memcpy(&header, bytes.data() + 6, 2);
  EXPECT_EQ(version, 3);
  EXPECT_EQ(header, 96);
  EXPECT_EQ(bytes[26], static_cast<uint8_t>(QuantFormat::kInt4));
  uint32_t fields[4];
  std::memcpy(fields, bytes.data() + 80, 16);
  EXPECT_EQ(fields[0], 4u);
  EXPECT_EQ(fields[1], 3u);
  EXPECT_EQ(fields[2], 2u);
  EXPECT_EQ(fields[3], 0u);
  size_t data = 0;
  for (const CompactHead& h : c.heads) data += h.keys.size() + h.values.size();
  EXPECT_EQ(bytes.size(), (96 + MetadataBytes(bytes) + 63) / 64 * 64 + data + 8);
}

// One byte of a chunk's body set to `value`, the chunk restamped: DATA_LOSS "corrupt compact
// chunk" with `message`.
struct Damage {
  size_t offset;
  uint8_t value;
  const char* message;
};
void ExpectDamageRefused(const std::vector<uint8_t>& good, std::span<const Damage> cases) {
  const std::vector<uint8_t> body(good.begin(), good.end() - 8);
  for (const Damage& d : cases) {
    auto bad = body;
    bad[d.offset] = d.value;
    auto r = DecodeCompactChunk(Restamp(bad));
    ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << d.offset << " " << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr("corrupt compact chunk")) << d.offset;
    EXPECT_THAT(r.status().message(), HasSubstr(d.message)) << d.offset << " " << r.status();
  }
}

TEST(CompactChunkV3, TruncationAndDamageAreErrors) {
  const CompactChunk c = QuantizedChunk(62);
  const std::vector<uint8_t> good = *EncodeCompactChunk(c);
  ExpectEveryPrefixRefused(good, 96);
  const Damage cases[] = {
      {26, 0, "version 3 without a quant format"},
      {26, 13, "unknown quant format"},  // 13: the first code of no format
      {27, 1, "reserved bytes not zero"},
      {93, 1, "reserved bytes not zero"},
      {80, 0, "quant key_group 0"},  // key_group 4 -> 0 (its low byte)
      {84, 0, "value_group 0"},
      {88, 3, "corrupt compact chunk"},  // recent 2 -> 3: the rows no longer add up
      {6, 80, "header size"},
  };
  ExpectDamageRefused(good, cases);
}

// Version 4: a rotation, int3 / int2 or a value format of its own. The fields sit in version 3's
// reserved bytes (27: rotation; 92: value format); version 3 stays what plain int8 / int4 / fp8
// chunks are written as.
const QuantDescription kV4Quant{.format = QuantFormat::kInt3,
                                .key_group = 4,
                                .value_group = 8,
                                .recent = 1,
                                .rotation = QuantRotation::kHadamard,
                                .value_format = QuantFormat::kInt2};

TEST(CompactChunkV4, RotatedAndNarrowChunksRoundTripAsVersion4) {
  const CompactChunk c = QuantizedChunk(63, kV4Quant);
  ExpectRoundTrip(c);
  const std::vector<uint8_t> bytes = *EncodeCompactChunk(c);
  uint16_t version;
  std::memcpy(&version, bytes.data() + 4, 2);
  EXPECT_EQ(version, 4);
  EXPECT_EQ(bytes[26], static_cast<uint8_t>(QuantFormat::kInt3));
  EXPECT_EQ(bytes[27], static_cast<uint8_t>(QuantRotation::kHadamard));
  EXPECT_EQ(bytes[92], static_cast<uint8_t>(QuantFormat::kInt2));
  for (const QuantDescription& q :
       {QuantDescription{.format = QuantFormat::kInt2, .key_group = 4, .value_group = 8},
        QuantDescription{.format = QuantFormat::kInt4,
        .key_group = 4,
        .value_group = 8,
        .rotation = QuantRotation::kHadamard},
        QuantDescription{.format = QuantFormat::kInt8,
        .key_group = 4,
        .value_group = 8,
        .value_format = QuantFormat::kInt4},
        QuantDescription{.format = QuantFormat::kInt4Sym, .key_group = 4, .value_group = 8},
        QuantDescription{.format = QuantFormat::kInt4,
        .key_group = 4,
        .value_group = 8,
        .rotation = QuantRotation::kHadamard,
        .value_format = QuantFormat::kInt2Sym},
        QuantDescription{.format = QuantFormat::kInt3Sym,
        .key_group = 4,
        .value_group = 8,
        .value_format = QuantFormat::kInt2Sym},
        QuantDescription{.format = QuantFormat::kInt4,
        .key_group = 4,
        .value_group = 8,
        .value_format = QuantFormat::kInt4Zero},
        QuantDescription{.format = QuantFormat::kInt2Zero, .key_group = 4, .value_group = 8}}) {
    const CompactChunk one = QuantizedChunk(64, q);
    ExpectRoundTrip(one);
    const std::vector<uint8_t> b = *EncodeCompactChunk(one);
    std::memcpy(&version, b.data() + 4, 2);
    EXPECT_EQ(version, 4) << QuantFormatName(q.format);
  }
  // The rotation needs a power-of-two head_dim; a value format equal to the key format is
  // written as none (one encoding per chunk).
  CompactChunk odd = c;
  odd.head_dim = 6;
  EXPECT_THAT(odd.Validate().message(), HasSubstr("power-of-two head_dim, got 6"));
  CompactChunk same = c;
  same.codec.quant.value_format = QuantFormat::kInt3;
  EXPECT_THAT(same.Validate().message(), HasSubstr("value format equal to the key format"));
}

// The one table of format names: every format by its name, nothing else.
TEST(CompactChunkV4, QuantFormatNamesComeFromOneTable) {
  for (uint8_t code = 0; code <= static_cast<uint8_t>(QuantFormat::kInt2Zero); ++code) {
    const auto f = static_cast<QuantFormat>(code);
    EXPECT_EQ(QuantFormatFromName(QuantFormatName(f)), f) << int{code};
  }
  EXPECT_EQ(QuantFormatName(QuantFormat::kInt2Sym), "int2s");
  EXPECT_EQ(QuantFormatFromName("int5"), std::nullopt);
  EXPECT_EQ(QuantFormatName(QuantFormat::kInt4Zero), "int4z");
  EXPECT_EQ(QuantFormatNameList(),
            "int8, int4, int3, int2, int8z, int4z, int3z, int2z, int4s, int3s, int2s or fp8_e4m3");
  std::string listed;
  for (QuantFormat f : QuantFormats())
    listed += std::string(listed.empty() ? "" : " ") += QuantFormatName(f);
  EXPECT_EQ(listed, "int8 int4 int3 int2 int8z int4z int3z int2z int4s int3s int2s fp8_e4m3");
  ASSERT_EQ(QuantRotations().size(), 2u);
  EXPECT_EQ(QuantRotationName(QuantRotations()[1]), "hadamard");
}

TEST(CompactChunkV4, DamageIsAnError) {
  const std::vector<uint8_t> good = *EncodeCompactChunk(QuantizedChunk(65, kV4Quant));
  ExpectEveryPrefixRefused(good, 96);
  const Damage cases[] = {
      {27, 7, "unknown quant rotation"},
      {92, 13, "unknown quant format"},  // 13: the first code of no format
      {92, 4, "value format equal to the key format"},
      {93, 1, "value format"},
      {26, 0, "version 4 without a quant format"},
  };
  ExpectDamageRefused(good, cases);
  // A version 4 header for what version 3 records (int4, no rotation, one format): not what an
  // encoder writes. Sizes still add up (int4 keys and values over the same groups).
  const std::vector<uint8_t> v3 = *EncodeCompactChunk(QuantizedChunk(66));
  auto bad = std::vector<uint8_t>(v3.begin(), v3.end() - 8);
  bad[4] = 4;
  auto r = DecodeCompactChunk(Restamp(bad));
  ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("version 4 for a quantize stage that version 3"));
}

// Version 5: version 4 with the count of sink rows (stored unquantized, first) at offset 96 and a
// reserved word at 100; written only when a chunk holds sink rows.
const QuantDescription kV5Quant{.format = QuantFormat::kInt4,
                                .key_group = 4,
                                .value_group = 8,
                                .recent = 1,
                                .sinks = 2,
                                .value_format = QuantFormat::kInt2Sym};

TEST(CompactChunkV5, ChunksWithSinkRowsRoundTripAsVersion5) {
  const CompactChunk c = QuantizedChunk(71, kV5Quant);
  ExpectRoundTrip(c);
  const std::vector<uint8_t> bytes = *EncodeCompactChunk(c);
  uint16_t version, header;
  uint32_t sinks;
  std::memcpy(&version, bytes.data() + 4, 2);
  std::memcpy(&header, bytes.data() + 6, 2);
  std::memcpy(&sinks, bytes.data() + 96, 4);
  EXPECT_EQ(version, 5);
  EXPECT_EQ(header, 104);
  EXPECT_EQ(sinks, 2u);
  // The same rows without sink rows: version 4 (the value format), 8 header bytes fewer.
  QuantDescription v4 = kV5Quant;
  v4.sinks = 0;
  const std::vector<uint8_t> b4 = *EncodeCompactChunk(QuantizedChunk(71, v4));
  std::memcpy(&version, b4.data() + 4, 2);
  EXPECT_EQ(version, 4);
  // Sinks without a format are refused like the other quant fields.
  CompactChunk none = QuantizedChunk(72);
  none.codec.quant = {.sinks = 1};
  EXPECT_THAT(none.Validate().message(), HasSubstr("sinks"));
}

TEST(CompactChunkV5, DamageIsAnError) {
  const std::vector<uint8_t> good = *EncodeCompactChunk(QuantizedChunk(73, kV5Quant));
  ExpectEveryPrefixRefused(good, 104);
  const Damage cases[] = {
      {96, 0, "version 5 without sink rows"},
      {96, 3, "corrupt compact chunk"},  // sinks 2 -> 3: the rows no longer add up
      {100, 1, "reserved bytes not zero"},
      {6, 96, "header size"},
  };
  ExpectDamageRefused(good, cases);
}

}  // namespace
}  // namespace kvd::kernels
