// GGUF reader: every metadata type, tensor infos, alignment, and clear errors on bad input.
#include "kvd/llama/gguf.h"

#include <gtest/gtest.h>

#include "gguf_builder.h"

namespace kvd::llama {
namespace {

using testing::GgufBuilder;

std::string ValidImage() {
  GgufBuilder b;
  b.KvStr("general.architecture", "llama");
  b.KvU8("t.u8", 200);
  b.KvI8("t.i8", -100);
  b.KvU16("t.u16", 60000);
  b.KvI16("t.i16", -30000);
  b.KvU32("t.u32", 4000000000u);
  b.KvI32("t.i32", -2000000000);
  b.KvU64("t.u64", 1ull << 40);
  b.KvI64("t.i64", -(1ll << 40));
  b.KvF32("t.f32", 1.5f);
  b.KvF64("t.f64", -2.25);
  b.KvBool("t.bool", true);
  b.KvStrArray("t.strs", {"a", "bc", ""});
  b.KvI32Array("t.ints", {1, -2, 3});
  b.TensorF32("w", {4, 2}, {1, 2, 3, 4, 5, 6, 7, 8});
  b.TensorF32("n", {3}, {9, 10, 11});
  return b.Build();
}

TEST(GgufTest, ParsesEveryValueTypeAndTensors) {
  auto g = GgufFile::Parse(ValidImage());
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)->version(), 3u);
  EXPECT_EQ(*(*g)->GetString("general.architecture"), "llama");
  EXPECT_EQ(*(*g)->GetInt("t.u8"), 200);
  EXPECT_EQ(*(*g)->GetInt("t.i8"), -100);
  EXPECT_EQ(*(*g)->GetInt("t.u16"), 60000);
  EXPECT_EQ(*(*g)->GetInt("t.i16"), -30000);
  EXPECT_EQ(*(*g)->GetInt("t.u32"), 4000000000ll);
  EXPECT_EQ(*(*g)->GetInt("t.i32"), -2000000000);
  EXPECT_EQ(*(*g)->GetInt("t.u64"), 1ll << 40);
  EXPECT_EQ(*(*g)->GetInt("t.i64"), -(1ll << 40));
  EXPECT_FLOAT_EQ(*(*g)->GetFloat("t.f32"), 1.5);
  EXPECT_DOUBLE_EQ(*(*g)->GetFloat("t.f64"), -2.25);
  EXPECT_TRUE(*(*g)->GetBool("t.bool"));
  const GgufValue* strs = (*g)->Find("t.strs");
  ASSERT_NE(strs, nullptr);
  ASSERT_EQ(strs->array.size(), 3u);
  EXPECT_EQ(std::get<std::string>(strs->array[1].scalar), "bc");
  const GgufValue* ints = (*g)->Find("t.ints");
  ASSERT_EQ(ints->array.size(), 3u);
  EXPECT_EQ(std::get<int64_t>(ints->array[1].scalar), -2);

  const GgufTensorInfo* w = (*g)->FindTensor("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->dims, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(w->num_elements, 8);
  EXPECT_EQ(w->num_bytes, 32u);
  EXPECT_EQ((*g)->data_offset() % 32, 0u);
  float v[8];
  std::memcpy(v, w->data, sizeof(v));
  EXPECT_EQ(v[7], 8.0f);
  const GgufTensorInfo* n = (*g)->FindTensor("n");
  ASSERT_NE(n, nullptr);
  EXPECT_EQ(n->offset % 32, 0u);
  std::memcpy(v, n->data, 12);
  EXPECT_EQ(v[2], 11.0f);
}

TEST(GgufTest, TypedGettersReportKindAndAbsence) {
  auto g = GgufFile::Parse(ValidImage());
  ASSERT_TRUE(g.ok());
  auto missing = (*g)->GetInt("no.such.key");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("no.such.key"), std::string::npos);
  auto wrong = (*g)->GetInt("general.architecture");
  EXPECT_EQ(wrong.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.status().message().find("expected an integer"), std::string::npos);
  EXPECT_EQ(*(*g)->GetIntOr("no.such.key", 7), 7);
  EXPECT_DOUBLE_EQ(*(*g)->GetFloat("t.i32"), -2000000000.0);  // integers widen to float
}

TEST(GgufTest, RejectsNonGgufMagic) {
  auto g = GgufFile::Parse(std::string("PK\x03\x04 this is a zip file, not a model"));
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(g.status().message().find("not a GGUF file"), std::string::npos);
  auto tiny = GgufFile::Parse("GG");
  EXPECT_EQ(tiny.status().code(), StatusCode::kInvalidArgument);
}

TEST(GgufTest, RejectsVersionOneAndFutureVersions) {
  GgufBuilder v1(1);
  auto g1 = GgufFile::Parse(v1.Build());
  EXPECT_EQ(g1.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(g1.status().message().find("version 1"), std::string::npos);
  GgufBuilder v9(9);
  auto g9 = GgufFile::Parse(v9.Build());
  EXPECT_EQ(g9.status().code(), StatusCode::kUnimplemented);
}

TEST(GgufTest, EveryTruncationIsACleanError) {
  const std::string full = ValidImage();
  auto ok = GgufFile::Parse(full);
  ASSERT_TRUE(ok.ok());
  for (size_t len = 0; len < full.size(); ++len) {
    auto g = GgufFile::Parse(full.substr(0, len));
    ASSERT_FALSE(g.ok()) << "prefix of " << len << " bytes parsed";
    if (len >= 4) {
      EXPECT_EQ(g.status().code(), StatusCode::kDataLoss) << len << ": " << g.status();
    }
  }
}

TEST(GgufTest, UnsupportedTensorTypeIsUnimplemented) {
  GgufBuilder b;
  b.Tensor("q2k", {256}, /*Q2_K=*/10, std::string(84, '\0'));
  auto g = GgufFile::Parse(b.Build());
  EXPECT_EQ(g.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(g.status().message().find("Q2_K"), std::string::npos);
  GgufBuilder c;
  c.Tensor("weird", {4}, 77, std::string(16, '\0'));
  auto h = GgufFile::Parse(c.Build());
  EXPECT_EQ(h.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(h.status().message().find("type77"), std::string::npos);
}

TEST(GgufTest, TensorDataOutOfBoundsIsDataLoss) {
  GgufBuilder b;
  b.TensorF32("w", {8}, std::vector<float>(8, 1.0f));
  auto g = GgufFile::Parse(b.Build(/*data_offset_shift=*/64));
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(g.status().message().find("outside the file"), std::string::npos);
}

TEST(GgufTest, RejectsBadShapesAndCounts) {
  GgufBuilder rowlen;
  rowlen.Tensor("q", {48}, /*Q4_0=*/2, std::string(27, '\0'));  // 48 is not whole blocks of 32
  EXPECT_EQ(GgufFile::Parse(rowlen.Build()).status().code(), StatusCode::kInvalidArgument);

  GgufBuilder dims;
  dims.Tensor("z", {0}, 0, "");
  EXPECT_EQ(GgufFile::Parse(dims.Build()).status().code(), StatusCode::kOutOfRange);

  // A metadata count far beyond what the bytes can hold fails fast, without allocating.
  std::string img = ValidImage();
  uint64_t huge = 1ull << 60;
  std::memcpy(&img[16], &huge, 8);
  auto g = GgufFile::Parse(img);
  EXPECT_EQ(g.status().code(), StatusCode::kDataLoss);

  GgufBuilder dup;
  dup.TensorF32("a", {1}, {1});
  dup.TensorF32("a", {1}, {2});
  EXPECT_EQ(GgufFile::Parse(dup.Build()).status().code(), StatusCode::kInvalidArgument);
}

TEST(GgufTest, HonoursGeneralAlignment) {
  GgufBuilder b;
  b.KvU32("general.alignment", 64);
  b.TensorF32("w", {2}, {1, 2});
  // The builder pads to 32; with alignment 64 the data section moves to the next multiple of 64.
  std::string img = b.Build();
  auto g = GgufFile::Parse(img + std::string(64, '\0'));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)->alignment(), 64u);
  EXPECT_EQ((*g)->data_offset() % 64, 0u);

  GgufBuilder bad;
  bad.KvU32("general.alignment", 48);
  auto h = GgufFile::Parse(bad.Build());
  EXPECT_EQ(h.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(h.status().message().find("power of two"), std::string::npos);
}

TEST(GgufTest, MissingFileIsNotFound) {
  auto g = GgufFile::Open("/nonexistent/model.gguf");
  EXPECT_EQ(g.status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvd::llama
