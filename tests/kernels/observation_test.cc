// Attention mass against a float64 reference over d, N, G and every mask, with the ln(l) bias.
// Tolerance, relative to each key's mass (every error below is relative): a score
// s = q.k / sqrt(d) is a d-term float32 dot product in 16 lanes (depth d/16 + 16 = 24 for
// d = 128), off by <= 24 u sum|q_c k_c| / sqrt(d) ~ 2.3e-5 for these N(0, 1.5^2) inputs (worst
// case); exp turns that into the same relative error of the probability, the softmax sum adds it
// once more, the branch-free exp 2e-7, the float32 sums over N keys and W*G queries
// (N/16 + 16 + W*G) u < 3e-5. Total < 1e-4 relative; keys no query sees must have exactly 0
// (observed: 2.6e-6 relative). A wrong mask or a missing bias is off by O(1) relative.
#include "kvd/kernels/observation.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "reference.h"

namespace kvd::kernels {
namespace {

using ::testing::HasSubstr;

void ExpectMassNear(std::span<const float> got, const std::vector<double>& want, int64_t wg) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t j = 0; j < want.size(); ++j) {
    ASSERT_NEAR(got[j], want[j], 1e-4 * want[j]) << "key " << j << " of W*G " << wg;
  }
}

struct Case {
  int d;
  int64_t n;
  int g;
  int64_t w;
};

class ObservationTest : public ::testing::TestWithParam<std::tuple<int, int64_t, int>> {};

TEST_P(ObservationTest, MatchesReferenceForEveryMask) {
  const auto [d, n, g] = GetParam();
  const int64_t w = std::min<int64_t>(n, 16);
  Matrix q = testing::RandomMatrix(w * g, d, 100 + n + g, 1.5f);
  Matrix k = testing::RandomMatrix(n, d, 200 + n, 1.5f);
  std::vector<float> bias(static_cast<size_t>(n));
  std::vector<double> bias64(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    bias[static_cast<size_t>(j)] = std::log(static_cast<float>(1 + j % 5));
    bias64[static_cast<size_t>(j)] = bias[static_cast<size_t>(j)];  // the float32 value
  }
  const std::vector<int64_t> kpos = testing::RandomIncreasingPositions(n, 3, 0, 3);
  std::vector<int64_t> qpos(static_cast<size_t>(w));
  for (int64_t i = 0; i < w; ++i)
    qpos[static_cast<size_t>(i)] =
        kpos[static_cast<size_t>(n / 2)] + i;  // half the keys in the future
  const testing::RefMatrix rq = testing::ToRef(q.View()), rk = testing::ToRef(k.View());
  ObservationOptions opt;
  opt.group_size = g;
  for (MaskKind mask : {MaskKind::kNone, MaskKind::kCausalWindow, MaskKind::kByPosition}) {
    for (bool with_bias : {false, true}) {
      opt.mask = mask;
      ObservationHead head{q.View(), k.View(),
                           with_bias ? std::span<const float>(bias) : std::span<const float>(),
                           qpos, kpos};
      std::vector<float> mass(static_cast<size_t>(n));
      ASSERT_TRUE(ComputeAttentionMass(head, opt, mass).ok());
      const auto ref_mask = mask == MaskKind::kNone           ? testing::RefMask::kNone
                            : mask == MaskKind::kCausalWindow ? testing::RefMask::kCausalWindow
                                                              : testing::RefMask::kByPosition;
      const std::vector<double> want = testing::RefAttentionMass(
          rq, g, rk, with_bias ? std::span<const double>(bias64) : std::span<const double>(),
          ref_mask, qpos, kpos);
      ExpectMassNear(mass, want, w * g);
      // Property: each query row is a distribution, so the mass sums to W*G (every query sees a
      // key here: the first key is always visible).
      const double total = std::accumulate(mass.begin(), mass.end(), 0.0);
      EXPECT_NEAR(total, static_cast<double>(w * g), 1e-4 * w * g);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, ObservationTest,
                         ::testing::Combine(::testing::Values(64, 128),
                                            ::testing::Values(int64_t{1}, int64_t{7}, int64_t{64},
                                                              int64_t{513}),
                                            ::testing::Values(1, 4, 8)));

TEST(ObservationTest, LongContextBatchedOverHeads) {
  const int d = 128, g = 4;
  const int64_t n = 4096, w = 32;
  std::vector<Matrix> qs, ks;
  std::vector<ObservationHead> heads;
  for (int h = 0; h < 2; ++h) {
    qs.push_back(testing::RandomMatrix(w * g, d, 10 + h));
    ks.push_back(testing::RandomMatrix(n, d, 20 + h));
  }
  for (int h = 0; h < 2; ++h)
    heads.push_back(ObservationHead{qs[h].View(), ks[h].View(), {}, {}, {}});
  ObservationOptions opt;
  opt.group_size = g;
  std::vector<std::vector<float>> masses;
  ASSERT_TRUE(ComputeAttentionMass(heads, opt, &masses, ExecOptions{Backend::kCpu, 2}).ok());
  for (int h = 0; h < 2; ++h) {
    const auto want =
        testing::RefAttentionMass(testing::ToRef(qs[h].View()), g, testing::ToRef(ks[h].View()), {},
                                  testing::RefMask::kCausalWindow);
    ExpectMassNear(masses[static_cast<size_t>(h)], want, w * g);
  }
}

TEST(ObservationTest, QueryThatSeesNothingContributesNothing) {
  Matrix q = testing::RandomMatrix(2, 64, 1), k = testing::RandomMatrix(3, 64, 2);
  std::vector<int64_t> qpos{0, 10}, kpos{5, 6, 7};  // query 0 sees no key
  ObservationOptions opt;
  opt.mask = MaskKind::kByPosition;
  std::vector<float> mass(3);
  ASSERT_TRUE(
      ComputeAttentionMass(ObservationHead{q.View(), k.View(), {}, qpos, kpos}, opt, mass).ok());
  EXPECT_NEAR(mass[0] + mass[1] + mass[2], 1.0, 1e-6);
}

TEST(ObservationTest, RejectsBadInput) {
  Matrix q = testing::RandomMatrix(8, 64, 1), k = testing::RandomMatrix(6, 64, 2);
  std::vector<float> mass(6);
  ObservationOptions opt;
  opt.group_size = 1;
  // window (8 queries) larger than the keys (6) for the causal window
  Status s = ComputeAttentionMass(ObservationHead{q.View(), k.View()}, opt, mass);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("smaller than the window"));
  opt.mask = MaskKind::kNone;
  opt.group_size = 3;
  EXPECT_THAT(ComputeAttentionMass(ObservationHead{q.View(), k.View()}, opt, mass).message(),
              HasSubstr("not a multiple of group_size 3"));
  opt.group_size = 4;
  k.Row(4)[3] = std::numeric_limits<float>::quiet_NaN();
  s = ComputeAttentionMass(ObservationHead{q.View(), k.View()}, opt, mass);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("keys: non-finite value"));
  k.Row(4)[3] = 0.0f;
  q.Row(1)[0] = -std::numeric_limits<float>::infinity();
  EXPECT_THAT(ComputeAttentionMass(ObservationHead{q.View(), k.View()}, opt, mass).message(),
              HasSubstr("queries: non-finite value"));
  q.Row(1)[0] = 0.0f;
  std::vector<float> bias(6, 0.0f);
  bias[2] = std::numeric_limits<float>::infinity();
  EXPECT_THAT(ComputeAttentionMass(ObservationHead{q.View(), k.View(), bias}, opt, mass).message(),
              HasSubstr("bias: non-finite"));
  std::vector<float> short_bias(5, 0.0f);
  EXPECT_THAT(
      ComputeAttentionMass(ObservationHead{q.View(), k.View(), short_bias}, opt, mass).message(),
      HasSubstr("bias has 5 entries"));
  Matrix q7 = testing::RandomMatrix(4, 70 + 1, 1), k7 = testing::RandomMatrix(4, 71, 2);
  EXPECT_THAT(ComputeAttentionMass(ObservationHead{q7.View(), k7.View()}, opt,
                                   std::span<float>(mass.data(), 4))
                  .message(),
              HasSubstr("unsupported head_dim 71"));
  opt.mask = MaskKind::kByPosition;
  EXPECT_THAT(ComputeAttentionMass(ObservationHead{q.View(), k.View()}, opt, mass).message(),
              HasSubstr("kByPosition needs"));
}

TEST(ObservationCudaTest, MatchesCpu) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const int d = 128, g = 4;
  const int64_t n = 4096, w = 64;
  Matrix q = testing::RandomMatrix(w * g, d, 1), k = testing::RandomMatrix(n, d, 2);
  std::vector<float> bias(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) bias[static_cast<size_t>(j)] = std::log(1.0f + j % 3);
  const std::vector<int64_t> kpos = testing::SequentialPositions(n);
  std::vector<int64_t> qpos(static_cast<size_t>(w));
  for (int64_t i = 0; i < w; ++i) qpos[static_cast<size_t>(i)] = 2000 + 10 * i;
  for (MaskKind mask : {MaskKind::kNone, MaskKind::kCausalWindow, MaskKind::kByPosition}) {
    ObservationOptions opt;
    opt.group_size = g;
    opt.mask = mask;
    ObservationHead head{q.View(), k.View(), bias, qpos, kpos};
    std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n));
    ASSERT_TRUE(ComputeAttentionMass(head, opt, a).ok());
    Status s = ComputeAttentionMass(head, opt, b, ExecOptions{Backend::kCuda});
    ASSERT_TRUE(s.ok()) << s;
    for (int64_t j = 0; j < n; ++j)
      ASSERT_NEAR(a[static_cast<size_t>(j)], b[static_cast<size_t>(j)],
                  1e-4 * a[static_cast<size_t>(j)] + 1e-5);
  }
}

}  // namespace
}  // namespace kvd::kernels
