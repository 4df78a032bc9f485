// Dequantisers against blocks built by hand from ggml's block layouts.
#include "kvd/llama/dequant.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "kvd/common/dtype.h"
#include "kvd/llama/gguf.h"

namespace kvd::llama {
namespace {

void PutHalf(uint8_t* p, float f) {
  uint16_t h = FloatToHalf(f);
  std::memcpy(p, &h, 2);
}

TEST(DequantTest, Q4_0) {
  uint8_t b[18];
  PutHalf(b, 0.5f);
  for (int j = 0; j < 16; ++j) b[2 + j] = static_cast<uint8_t>((j & 0xF) | ((15 - j) << 4));
  float y[32];
  ASSERT_TRUE(Dequantize(static_cast<uint32_t>(GgmlType::kQ4_0), b, y, 32).ok());
  for (int j = 0; j < 16; ++j) {
    EXPECT_FLOAT_EQ(y[j], (j - 8) * 0.5f);
    EXPECT_FLOAT_EQ(y[j + 16], (15 - j - 8) * 0.5f);
  }
}

TEST(DequantTest, Q4_1) {
  uint8_t b[20];
  PutHalf(b, 0.25f);
  PutHalf(b + 2, -1.0f);
  for (int j = 0; j < 16; ++j) b[4 + j] = static_cast<uint8_t>(j | (j << 4));
  float y[32];
  ASSERT_TRUE(Dequantize(static_cast<uint32_t>(GgmlType::kQ4_1), b, y, 32).ok());
  for (int j = 0; j < 16; ++j) {
    EXPECT_FLOAT_EQ(y[j], j * 0.25f - 1.0f);
    EXPECT_FLOAT_EQ(y[j + 16], j * 0.25f - 1.0f);
  }
}

TEST(DequantTest, Q5_0AndQ5_1UseTheHighBits) {
  uint8_t b[22] = {};
  PutHalf(b, 1.0f);
  const uint32_t qh = 0x00010001u;  // high bit set for element 0 and element 16
  std::memcpy(b + 2, &qh, 4);
  for (int j = 0; j < 16; ++j) b[6 + j] = 0x33;  // low nibbles 3 everywhere
  float y[32];
  ASSERT_TRUE(Dequantize(static_cast<uint32_t>(GgmlType::kQ5_0), b, y, 32).ok());
  EXPECT_FLOAT_EQ(y[0], (3 + 16) - 16);
  EXPECT_FLOAT_EQ(y[1], 3 - 16);
  EXPECT_FLOAT_EQ(y[16], (3 + 16) - 16);
  EXPECT_FLOAT_EQ(y[17], 3 - 16);

  uint8_t c[24] = {};
  PutHalf(c, 2.0f);
  PutHalf(c + 2, 0.5f);
  std::memcpy(c + 4, &qh, 4);
  for (int j = 0; j < 16; ++j) c[8 + j] = 0x21;
  ASSERT_TRUE(Dequantize(static_cast<uint32_t>(GgmlType::kQ5_1), c, y, 32).ok());
  EXPECT_FLOAT_EQ(y[0], (1 + 16) * 2.0f + 0.5f);
  EXPECT_FLOAT_EQ(y[1], 1 * 2.0f + 0.5f);
  EXPECT_FLOAT_EQ(y[16], (2 + 16) * 2.0f + 0.5f);
}

TEST(DequantTest, Q8_0) {
  uint8_t b[34];
  PutHalf(b, 0.125f);
  for (int j = 0; j < 32; ++j) b[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(j * 8 - 128));
  float y[32];
  ASSERT_TRUE(Dequantize(static_cast<uint32_t>(GgmlType::kQ8_0), b, y, 32).ok());
  for (int j = 0; j < 32; ++j) EXPECT_FLOAT_EQ(y[j], (j * 8 - 128) * 0.125f);
}

TEST(DequantTest, Q6_K) {
  uint8_t b[210] = {};
  // ql low nibble 5, high nibble 9; qh bits 0b01 for every 2-bit field; scales j+1; d = 0.5.
  for (int i = 0; i < 128; ++i) b[i] = 0x95;
  for (int i = 0; i < 64; ++i) b[128 + i] = 0x55;
  for (int i = 0; i < 16; ++i) b[192 + i] = static_cast<uint8_t>(static_cast<int8_t>(i + 1));
  PutHalf(b + 208, 0.5f);
  float y[256];
  ASSERT_TRUE(Dequantize(static_cast<uint32_t>(GgmlType::kQ6_K), b, y, 256).ok());
  // Element e: half n = e/128, r = e%128, quarter k = r/32, l = r%32; scale index 8n + l/16 + 2k.
  for (int e = 0; e < 256; ++e) {
    const int n = e / 128, r = e % 128, k = r / 32, l = r % 32;
    const int low = (k < 2) ? 5 : 9;  // quarters 0,1 take low nibbles, 2,3 high nibbles
    const int q = (low | (1 << 4)) - 32;
    const int sc = 8 * n + l / 16 + 2 * k + 1;
    EXPECT_FLOAT_EQ(y[e], 0.5f * sc * q) << e;
  }
}

TEST(DequantTest, Q4_K) {
  uint8_t b[144] = {};
  PutHalf(b, 1.0f);      // d
  PutHalf(b + 2, 0.5f);  // dmin
  // Sub-blocks 0..3: scale j+1, min j; sub-blocks 4..7: scale (q[j+4]&0xF)|((q[j-4]>>6)<<4).
  for (int j = 0; j < 4; ++j) {
    b[4 + j] = static_cast<uint8_t>(j + 1);
    b[4 + j + 4] = static_cast<uint8_t>(j);
  }
  for (int j = 0; j < 4; ++j)
    b[4 + 8 + j] = static_cast<uint8_t>(0x20 | (j + 2));  // sc 4+j: j+2, m: 2
  for (int i = 0; i < 128; ++i) b[16 + i] = 0x73;         // low nibble 3, high nibble 7
  float y[256];
  ASSERT_TRUE(Dequantize(static_cast<uint32_t>(GgmlType::kQ4_K), b, y, 256).ok());
  for (int e = 0; e < 256; ++e) {
    const int sub = e / 32;
    const int q = (sub % 2 == 0) ? 3 : 7;
    const int sc = sub < 4 ? sub + 1 : (sub - 4) + 2;
    const int m = sub < 4 ? sub : 2;
    EXPECT_FLOAT_EQ(y[e], 1.0f * sc * q - 0.5f * m) << e;
  }
}

TEST(DequantTest, F16AndBF16) {
  const float src[4] = {1.0f, -2.5f, 65504.0f, 0.0f};
  uint16_t h[4], bf[4];
  for (int i = 0; i < 4; ++i) {
    h[i] = FloatToHalf(src[i]);
    bf[i] = FloatToBFloat16(src[i]);
  }
  float y[4];
  ASSERT_TRUE(Dequantize(static_cast<uint32_t>(GgmlType::kF16), h, y, 4).ok());
  for (int i = 0; i < 4; ++i) EXPECT_EQ(y[i], src[i]);
  ASSERT_TRUE(Dequantize(static_cast<uint32_t>(GgmlType::kBF16), bf, y, 4).ok());
  EXPECT_EQ(y[0], 1.0f);
  EXPECT_EQ(y[1], -2.5f);
}

TEST(DequantTest, RejectsPartialBlocksAndUnknownTypes) {
  uint8_t b[64] = {};
  float y[64];
  Status s = Dequantize(static_cast<uint32_t>(GgmlType::kQ8_0), b, y, 16);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("whole Q8_0 blocks"), std::string::npos);
  Status u = Dequantize(static_cast<uint32_t>(GgmlType::kQ3_K), b, y, 256);
  EXPECT_EQ(u.code(), StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace kvd::llama
