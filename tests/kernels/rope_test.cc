// RoPE against a float64 reference (both pairings, every scaling, partial rotary dim) and the
// de-rotate/re-rotate identity.
// Tolerance, relative to the largest magnitude M of the reference (rotation keeps each pair's
// norm, so the inputs are within sqrt(2) M): the angle is formed in float64 and reduced in
// float64; the float32 sin/cos error is < 3e-7 (fast_math.h) and each output a c - b s is two
// float32 products and a difference, so |err| <= (|a| + |b|) (3e-7 + u) + u |x| < 1.1e-6 M.
// kRotateTol = 1.5e-6 per rotation, twice that for a round trip (observed: 1e-7 M).
#include "kvd/kernels/rope.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "reference.h"

namespace kvd::kernels {
namespace {

using ::testing::HasSubstr;

constexpr double kRotateTol = 1.5e-6;

RopeConfig Config(RopePairing pairing, RopeScaling scaling, int rotary_dim = 0) {
  RopeConfig c;
  c.theta = scaling == RopeScaling::kLlama3 ? 500000.0 : 10000.0;
  c.pairing = pairing;
  c.scaling = scaling;
  c.rotary_dim = rotary_dim;
  if (scaling == RopeScaling::kLinear) c.factor = 4.0;
  if (scaling == RopeScaling::kLlama3) {
    c.factor = 8.0;
    c.low_freq_factor = 1.0;
    c.high_freq_factor = 4.0;
    c.original_max_positions = 8192;
  }
  return c;
}

class RopeTest
    : public ::testing::TestWithParam<std::tuple<RopePairing, RopeScaling, int, int64_t>> {};

TEST_P(RopeTest, MatchesFloat64ReferenceBothDirections) {
  const auto [pairing, scaling, d, n] = GetParam();
  for (int rotary : {0, d / 2}) {
    const RopeConfig cfg = Config(pairing, scaling, rotary);
    auto table = RopeTable::Create(cfg, d);
    ASSERT_TRUE(table.ok()) << table.status();
    const std::vector<double> ref_f = testing::RefInvFreq(cfg, d);
    for (size_t i = 0; i < ref_f.size(); ++i)
      ASSERT_NEAR(table->inv_freq()[i], ref_f[i], 1e-15 * ref_f[0]);

    const std::vector<int64_t> pos = testing::RandomIncreasingPositions(n, 5 + n, 100, 200);
    Matrix k0 = testing::RandomMatrix(n, d, 42 + n);
    Matrix k1 = testing::RandomMatrix(n, d, 43 + n);
    const testing::RefMatrix ref0 = testing::RefRope(cfg, testing::ToRef(k0.View()), pos, +1);
    const testing::RefMatrix ref1 = testing::RefRope(cfg, testing::ToRef(k1.View()), pos, +1);
    Matrix orig0 = k0;
    std::vector<MatrixView> heads{k0.View(), k1.View()};
    ASSERT_TRUE(ApplyRope(*table, RopeDirection::kRotate, std::span<const int64_t>(pos), heads,
                          ExecOptions{Backend::kCpu, 2})
                    .ok());
    EXPECT_LE(testing::MaxRelDiff(k0.View(), ref0), kRotateTol);
    EXPECT_LE(testing::MaxRelDiff(k1.View(), ref1), kRotateTol);
    // De-rotation: int32 positions, against the reference's rotation by -angle of the rotated keys.
    std::vector<int32_t> pos32(pos.begin(), pos.end());
    const testing::RefMatrix back_ref = testing::RefRope(cfg, testing::ToRef(k0.View()), pos, -1);
    ASSERT_TRUE(
        ApplyRope(*table, RopeDirection::kDerotate, std::span<const int32_t>(pos32), heads).ok());
    EXPECT_LE(testing::MaxRelDiff(k0.View(), back_ref), kRotateTol);
    EXPECT_LE(testing::MaxRelDiff(k0.View(), testing::ToRef(orig0.View())), 2 * kRotateTol);
    if (rotary != 0) {  // dims >= rotary_dim pass through bit-exactly
      for (int64_t i = 0; i < n; ++i)
        for (int c = rotary; c < d; ++c) ASSERT_EQ(k0.Row(i)[c], orig0.Row(i)[c]);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Configs, RopeTest,
    ::testing::Combine(::testing::Values(RopePairing::kInterleaved, RopePairing::kHalves),
                       ::testing::Values(RopeScaling::kNone, RopeScaling::kLinear,
                                         RopeScaling::kLlama3),
                       ::testing::Values(64, 128),
                       ::testing::Values(int64_t{1}, int64_t{7}, int64_t{64}, int64_t{513})));

TEST(RopeTest, LargePositionsStayAccurate) {
  const RopeConfig cfg = Config(RopePairing::kHalves, RopeScaling::kNone);
  auto table = RopeTable::Create(cfg, 128);
  ASSERT_TRUE(table.ok());
  std::vector<int64_t> pos{0, 1, 131071, 1000000, 2147483647};
  Matrix k = testing::RandomMatrix(5, 128, 9);
  const testing::RefMatrix ref = testing::RefRope(cfg, testing::ToRef(k.View()), pos, +1);
  std::vector<MatrixView> heads{k.View()};
  ASSERT_TRUE(ApplyRope(*table, RopeDirection::kRotate, std::span<const int64_t>(pos), heads).ok());
  // position 2^31: the float64 angle itself carries ~2^31 * 2^-53 = 2.4e-7 rad of error and its
  // reduction by k pi/2 (k ~ 1.4e9, pi/2 rounded to 6e-17) ~1e-7 more: 2 * 3.4e-7 M on top.
  EXPECT_LE(testing::MaxRelDiff(k.View(), ref), kRotateTol + 7e-7);
}

TEST(RopeTest, OutOfPlaceFormMatchesInPlace) {
  auto table = RopeTable::Create(Config(RopePairing::kInterleaved, RopeScaling::kNone), 64);
  ASSERT_TRUE(table.ok());
  const std::vector<int64_t> pos = testing::SequentialPositions(64, 10);
  Matrix in = testing::RandomMatrix(64, 64, 1), out(64, 64), inplace = in;
  ASSERT_TRUE(ApplyRope(*table, RopeDirection::kRotate, pos, in.View(), out.View()).ok());
  std::vector<MatrixView> heads{inplace.View()};
  ASSERT_TRUE(ApplyRope(*table, RopeDirection::kRotate, std::span<const int64_t>(pos), heads).ok());
  EXPECT_EQ(testing::MaxAbsDiff(out.View(), inplace.View()), 0.0);
}

TEST(RopeTest, RejectsBadInput) {
  EXPECT_THAT(RopeTable::Create(RopeConfig{}, 100 + 1).status().message(),
              HasSubstr("unsupported head_dim 101"));
  EXPECT_EQ(RopeTable::Create(RopeConfig{}, 512).status().code(), StatusCode::kInvalidArgument);
  RopeConfig bad;
  bad.rotary_dim = 30;
  EXPECT_THAT(RopeTable::Create(bad, 16).status().message(), HasSubstr("rotary_dim"));
  auto table = RopeTable::Create(RopeConfig{}, 64);
  ASSERT_TRUE(table.ok());
  Matrix k = testing::RandomMatrix(3, 64, 1);
  std::vector<MatrixView> heads{k.View()};
  std::vector<int64_t> pos{0, -1, 2};
  Status neg = ApplyRope(*table, RopeDirection::kRotate, std::span<const int64_t>(pos), heads);
  EXPECT_EQ(neg.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(neg.message(), HasSubstr("negative position -1 at row 1"));
  std::vector<int64_t> two{0, 1};
  EXPECT_THAT(
      ApplyRope(*table, RopeDirection::kRotate, std::span<const int64_t>(two), heads).message(),
      HasSubstr("expected [2, 64]"));
  k.Row(2)[7] = std::numeric_limits<float>::infinity();
  std::vector<int64_t> ok_pos{0, 1, 2};
  Status inf = ApplyRope(*table, RopeDirection::kRotate, std::span<const int64_t>(ok_pos), heads);
  EXPECT_EQ(inf.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(inf.message(), HasSubstr("row 2 col 7"));
  ExecOptions cuda{Backend::kCuda};
  k.Row(2)[7] = 0.0f;
  Status c =
      ApplyRope(*table, RopeDirection::kRotate, std::span<const int64_t>(ok_pos), heads, cuda);
  if (!CudaDeviceAvailable()) {
    EXPECT_TRUE(c.code() == StatusCode::kUnavailable || c.code() == StatusCode::kUnimplemented)
        << c;
  }
}

TEST(RopeCudaTest, MatchesCpu) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  for (RopePairing pairing : {RopePairing::kInterleaved, RopePairing::kHalves}) {
    const RopeConfig cfg = Config(pairing, RopeScaling::kLlama3);
    auto table = RopeTable::Create(cfg, 128);
    ASSERT_TRUE(table.ok());
    const std::vector<int64_t> pos = testing::RandomIncreasingPositions(4096, 3, 0, 30);
    Matrix a = testing::RandomMatrix(4096, 128, 1), b = a;
    std::vector<MatrixView> ha{a.View()}, hb{b.View()};
    ASSERT_TRUE(
        ApplyRope(*table, RopeDirection::kDerotate, std::span<const int64_t>(pos), ha).ok());
    ASSERT_TRUE(ApplyRope(*table, RopeDirection::kDerotate, std::span<const int64_t>(pos), hb,
                          ExecOptions{Backend::kCuda})
                    .ok());
    EXPECT_LE(testing::MaxAbsDiff(a.View(), b.View()), 2e-5);
  }
}

}  // namespace
}  // namespace kvd::kernels
