// GatherHeads / ScatterHeads against a scalar float64 reference, for every dtype.
// Tolerance: gather is exact (every float16/bfloat16 value is a float32); scatter must equal
// the common/dtype.h scalar rounding bit for bit (round to nearest even).
#include "kvd/kernels/convert.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "reference.h"

namespace kvd::kernels {
namespace {

using ::testing::HasSubstr;

std::vector<uint8_t> MakeEngineTensor(const EngineTensorShape& s, uint64_t seed) {
  Matrix src = testing::RandomMatrix(s.tokens * s.num_heads, s.head_dim, seed, 3.0f);
  std::vector<uint8_t> bytes(s.Bytes());
  ConvertFromFloat(s.dtype, src.values.data(), bytes.data(), src.values.size());
  return bytes;
}

float ElementAt(const EngineTensorShape& s, const std::vector<uint8_t>& bytes, int64_t i, int64_t h,
                int64_t c) {
  const size_t idx = static_cast<size_t>((i * s.num_heads + h) * s.head_dim + c);
  float out;
  ConvertToFloat(s.dtype, bytes.data() + idx * DTypeSize(s.dtype), &out, 1);
  return out;
}

class ConvertTest : public ::testing::TestWithParam<std::tuple<DType, int64_t, int64_t>> {};

TEST_P(ConvertTest, GatherMatchesScalarAndScatterRoundTrips) {
  const auto [dtype, n, d] = GetParam();
  EngineTensorShape shape{n, 8, d, dtype};
  const std::vector<uint8_t> bytes = MakeEngineTensor(shape, 7 + n);
  ExecOptions exec;
  exec.num_threads = 2;
  auto heads = GatherHeads(shape, bytes.data(), exec);
  ASSERT_TRUE(heads.ok()) << heads.status();
  ASSERT_EQ(heads->size(), 8u);
  for (int64_t h = 0; h < 8; ++h)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < d; ++c)
        ASSERT_EQ((*heads)[h].Row(i)[c], ElementAt(shape, bytes, i, h, c))
            << h << " " << i << " " << c;
  std::vector<ConstMatrixView> views;
  for (const Matrix& m : *heads) views.push_back(m.View());
  std::vector<uint8_t> back(shape.Bytes());
  ASSERT_TRUE(ScatterHeads(shape, views, back.data(), exec).ok());
  EXPECT_EQ(0, std::memcmp(back.data(), bytes.data(), bytes.size()));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ConvertTest,
    ::testing::Combine(::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                       ::testing::Values(int64_t{1}, int64_t{7}, int64_t{64}, int64_t{513}),
                       ::testing::Values(int64_t{64}, int64_t{128})));

TEST(ConvertTest, ScatterRoundsLikeTheScalarConversion) {
  for (DType dt : {DType::kFloat16, DType::kBFloat16}) {
    EngineTensorShape shape{33, 2, 64, dt};
    std::vector<Matrix> heads{testing::RandomMatrix(33, 64, 1, 100.0f),
                              testing::RandomMatrix(33, 64, 2, 1e-3f)};
    heads[0].Row(3)[5] = 1e6f;   // beyond float16 range: +Inf in float16, finite in bfloat16
    heads[1].Row(4)[6] = 3e-8f;  // float16 subnormal
    std::vector<ConstMatrixView> views{heads[0].View(), heads[1].View()};
    std::vector<uint16_t> out(33 * 2 * 64);
    ASSERT_TRUE(ScatterHeads(shape, views, out.data()).ok());
    for (int64_t i = 0; i < 33; ++i)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t c = 0; c < 64; ++c) {
          const float x = heads[static_cast<size_t>(h)].Row(i)[c];
          const uint16_t want = dt == DType::kFloat16 ? FloatToHalf(x) : FloatToBFloat16(x);
          ASSERT_EQ(out[static_cast<size_t>((i * 2 + h) * 64 + c)], want) << x;
        }
  }
}

TEST(ConvertTest, RejectsNonFiniteWithPosition) {
  EngineTensorShape shape{5, 2, 64, DType::kBFloat16};
  std::vector<uint8_t> bytes = MakeEngineTensor(shape, 3);
  const uint16_t nan = FloatToBFloat16(std::numeric_limits<float>::quiet_NaN());
  std::memcpy(bytes.data() + ((3 * 2 + 1) * 64 + 9) * 2, &nan, 2);
  auto r = GatherHeads(shape, bytes.data());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("head 1"));
  EXPECT_THAT(r.status().message(), HasSubstr("row 3 col 9"));
  EXPECT_TRUE(GatherHeads(shape, bytes.data(), {}, /*check_finite=*/false).ok());
}

TEST(ConvertTest, RejectsBadShapes) {
  std::vector<uint8_t> bytes(1024);
  auto odd = GatherHeads(EngineTensorShape{1, 1, 63, DType::kFloat32}, bytes.data());
  EXPECT_EQ(odd.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(odd.status().message(), HasSubstr("unsupported head_dim 63"));
  auto big = GatherHeads(EngineTensorShape{1, 1, 258, DType::kFloat32}, bytes.data());
  EXPECT_THAT(big.status().message(), HasSubstr("unsupported head_dim 258"));
  auto heads0 = GatherHeads(EngineTensorShape{1, 0, 64, DType::kFloat32}, bytes.data());
  EXPECT_THAT(heads0.status().message(), HasSubstr("num_heads"));
  Matrix m(4, 64);
  std::vector<MatrixView> views{m.View()};
  Status wrong = GatherHeads(EngineTensorShape{5, 1, 64, DType::kFloat32}, bytes.data(), views);
  EXPECT_EQ(wrong.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong.message(), HasSubstr("expected [5, 64]"));
  EXPECT_THAT(GatherHeads(EngineTensorShape{1, 1, 64, DType::kFloat32}, nullptr).status().message(),
              HasSubstr("null source"));
}

TEST(ConvertTest, CudaBackendReportsWhyItCannotRun) {
  EngineTensorShape shape{3, 1, 64, DType::kFloat32};
  std::vector<uint8_t> bytes(shape.Bytes());
  ExecOptions exec{Backend::kCuda};
  auto r = GatherHeads(shape, bytes.data(), exec);
  if (CudaDeviceAvailable()) GTEST_SKIP() << "a device is present: covered by the CPU-vs-CUDA test";
#if KVD_HAVE_CUDA
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
#else
  EXPECT_EQ(r.status().code(), StatusCode::kUnimplemented);
#endif
}

TEST(ConvertCudaTest, MatchesCpu) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    EngineTensorShape shape{515, 8, 128, dt};
    const std::vector<uint8_t> bytes = MakeEngineTensor(shape, 11);
    auto cpu = GatherHeads(shape, bytes.data());
    auto gpu = GatherHeads(shape, bytes.data(), ExecOptions{Backend::kCuda});
    ASSERT_TRUE(cpu.ok() && gpu.ok()) << gpu.status();
    for (size_t h = 0; h < 8; ++h)
      EXPECT_EQ(testing::MaxAbsDiff((*cpu)[h].View(), (*gpu)[h].View()), 0.0);
    std::vector<ConstMatrixView> views;
    for (const Matrix& m : *gpu) views.push_back(m.View());
    std::vector<uint8_t> back(shape.Bytes());
    ASSERT_TRUE(ScatterHeads(shape, views, back.data(), ExecOptions{Backend::kCuda}).ok());
    EXPECT_EQ(0, std::memcmp(back.data(), bytes.data(), bytes.size()));
  }
}

}  // namespace
}  // namespace kvd::kernels
