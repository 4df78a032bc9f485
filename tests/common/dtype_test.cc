#include "kvd/common/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace kvd {
namespace {

TEST(DTypeTest, HalfRoundTripsEveryFiniteValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    uint16_t x = static_cast<uint16_t>(h);
    float f = HalfToFloat(x);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f))));
      continue;
    }
    EXPECT_EQ(FloatToHalf(f), x) << h;
  }
}

TEST(DTypeTest, HalfRoundsToNearest) {
  EXPECT_EQ(HalfToFloat(FloatToHalf(1.0f + 1.0f / 4096)), 1.0f);  // below half an ulp
  EXPECT_EQ(HalfToFloat(FloatToHalf(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(HalfToFloat(FloatToHalf(1e6f))));
  EXPECT_EQ(HalfToFloat(FloatToHalf(std::ldexp(1.0f, -24))), std::ldexp(1.0f, -24));
}

TEST(DTypeTest, BFloat16) {
  EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(1.5f)), 1.5f);
  // bfloat16 keeps 8 significant bits: in [2, 4) its neighbours 1/64 apart are exact float32
  // values, so the conversion is compared exactly (a tolerance of half that spacing would also
  // let truncation pass). 3.14159 is nearer 3.140625, 3.15 nearer 3.15625 (truncation: 3.140625).
  EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(3.14159f)), 3.140625f);
  EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(3.15f)), 3.15625f);
  EXPECT_TRUE(
      std::isnan(BFloat16ToFloat(FloatToBFloat16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(DTypeTest, Parse) {
  EXPECT_EQ(*ParseDType("bf16"), DType::kBFloat16);
  auto bad = ParseDType("int8");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("int8"), std::string::npos);
}

}  // namespace
}  // namespace kvd
