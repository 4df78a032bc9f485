// Base scorers: selection (sinks, window, exact budget), SnapKV, KeyDiff (one-shot and block-wise),
// PyramidKV budgets, against float64 references and brute force.
// Tolerances: SnapKV scores are means of attention probabilities (see observation_test.cc:
// relative 1e-4; the 1e-7 floor only matters for pooled scores of keys no query sees). KeyDiff
// scores are cosines in [-1, 1] (an absolute tolerance is relative here): float32 norms and dot
// products in 16 lanes (depth d/16 + 16 <= 24, ~1.4e-6 worst case) and an anchor summed in float32
// over blocks of 256 unit keys then float64 (direction off by <= 256 u ~ 1.5e-5 times
// sum|k|/|sum k| ~ 3 worst case, sqrt(256) u ~ 1e-6 typical). 1e-5 is ~3x the typical error and
// 60x the observed 1.6e-7; a key left unnormalised or a wrong anchor is off by 1e-2 and more.
#include "kvd/kernels/scorers.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "kvd/kernels/keydiff.h"
#include "kvd/kernels/pyramidkv.h"
#include "kvd/kernels/snapkv.h"
#include "reference.h"

namespace kvd::kernels {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Brute-force selection: sinks, window, then the best middle by (score desc, index asc).
std::vector<int32_t> BruteSelect(const std::vector<double>& scores, int64_t budget, int64_t s,
                                 int64_t w) {
  const int64_t n = static_cast<int64_t>(scores.size());
  if (budget >= n) {
    std::vector<int32_t> all(static_cast<size_t>(n));
    std::iota(all.begin(), all.end(), 0);
    return all;
  }
  std::vector<int32_t> mid;
  for (int64_t i = s; i < n - w; ++i) mid.push_back(static_cast<int32_t>(i));
  std::stable_sort(mid.begin(), mid.end(),
                   [&](int32_t a, int32_t b) { return scores[a] > scores[b]; });
  mid.resize(static_cast<size_t>(budget - s - w));
  for (int64_t i = 0; i < s; ++i) mid.push_back(static_cast<int32_t>(i));
  for (int64_t i = n - w; i < n; ++i) mid.push_back(static_cast<int32_t>(i));
  std::sort(mid.begin(), mid.end());
  return mid;
}

TEST(SelectTopKTest, KeepsSinksWindowAndBestMiddleExactly) {
  std::vector<float> scores{0.9f, 0.1f, 0.5f, 0.5f, 0.7f, 0.2f, 0.0f, 0.3f};
  SelectionOptions opt{2, 2};
  auto r = SelectTopK(scores, 6, opt);
  ASSERT_TRUE(r.ok());
  EXPECT_THAT(*r, ElementsAre(0, 1, 2, 4, 6,
                              7));  // middle 2..5: best two are 4 (0.7) and 2 (tie 0.5, lower)
  auto all = SelectTopK(scores, 8, opt);
  EXPECT_EQ(all->size(), 8u);
  auto just = SelectTopK(scores, 4, opt);
  EXPECT_THAT(*just, ElementsAre(0, 1, 6, 7));
  for (double pc : {0.25, 0.5, 0.75, 0.9}) {
    std::vector<float> big(1000);
    for (size_t i = 0; i < big.size(); ++i) big[i] = std::sin(static_cast<float>(i) * 0.37f);
    const int64_t budget = *UniformBudget(1000, pc);
    auto k = SelectTopK(big, budget, SelectionOptions{4, 32});
    ASSERT_TRUE(k.ok());
    EXPECT_EQ(static_cast<int64_t>(k->size()), budget);
    EXPECT_TRUE(std::is_sorted(k->begin(), k->end()));
    std::vector<double> big64(big.begin(), big.end());
    EXPECT_EQ(*k, BruteSelect(big64, budget, 4, 32));
  }
}

TEST(SelectTopKTest, RejectsImpossibleRequests) {
  std::vector<float> scores(10, 1.0f);
  auto small = SelectTopK(std::span<const float>(scores.data(), 3), 3, SelectionOptions{4, 0});
  EXPECT_EQ(small.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(small.status().message(), HasSubstr("smaller than the sinks"));
  auto win = SelectTopK(std::span<const float>(scores.data(), 5), 5, SelectionOptions{0, 8});
  EXPECT_THAT(win.status().message(), HasSubstr("smaller than the window"));
  auto both = SelectTopK(scores, 10, SelectionOptions{6, 6});
  EXPECT_THAT(both.status().message(), HasSubstr("smaller than the sinks + the window"));
  auto budget = SelectTopK(scores, 5, SelectionOptions{4, 2});
  EXPECT_EQ(budget.status().code(), StatusCode::kOutOfRange);
  EXPECT_THAT(budget.status().message(), HasSubstr("cannot keep sinks + window"));
  scores[3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(SelectTopK(scores, 8, SelectionOptions{}).status().message(),
              HasSubstr("NaN) at index 3"));
  EXPECT_EQ(UniformBudget(10, 1.0).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(*UniformBudget(10, 0.75), 3);  // 2.5 rounds away from zero
}

class SnapKvTest : public ::testing::TestWithParam<std::tuple<int, int64_t, int, PoolingKind>> {};

TEST_P(SnapKvTest, ScoresMatchReference) {
  const auto [d, n, g, pooling] = GetParam();
  const int w = static_cast<int>(std::min<int64_t>(n, 8));
  SnapKvOptions opt;
  opt.window = w;
  opt.group_size = g;
  opt.pooling = pooling;
  opt.kernel_size = pooling == PoolingKind::kAvg ? 5 : 7;
  Matrix q = testing::RandomMatrix(w * g, d, 7 + n), k = testing::RandomMatrix(n, d, 8 + n);
  std::vector<float> scores(static_cast<size_t>(n));
  ASSERT_TRUE(SnapKvScores(q.View(), k.View(), opt, scores).ok());
  std::vector<double> mean = testing::RefAttentionMass(
      testing::ToRef(q.View()), g, testing::ToRef(k.View()), {}, testing::RefMask::kCausalWindow);
  for (double& m : mean) m /= static_cast<double>(w * g);
  const int64_t mid = n - w, pad = opt.kernel_size / 2;
  for (int64_t j = 0; j < n; ++j) {
    if (j >= mid) {
      EXPECT_EQ(scores[static_cast<size_t>(j)], std::numeric_limits<float>::infinity());
      continue;
    }
    double want = pooling == PoolingKind::kAvg ? 0.0 : -1.0;
    for (int64_t i = std::max<int64_t>(0, j - pad); i <= std::min(mid - 1, j + pad); ++i) {
      want = pooling == PoolingKind::kAvg ? want + mean[static_cast<size_t>(i)] / opt.kernel_size
                                          : std::max(want, mean[static_cast<size_t>(i)]);
    }
    ASSERT_NEAR(scores[static_cast<size_t>(j)], want, 1e-4 * want + 1e-7) << j;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, SnapKvTest,
    ::testing::Combine(::testing::Values(64, 128),
                       ::testing::Values(int64_t{7}, int64_t{64}, int64_t{513}),
                       ::testing::Values(1, 4, 8),
                       ::testing::Values(PoolingKind::kAvg, PoolingKind::kMax)));

TEST(SnapKvTest, SelectionKeepsSinksAndWindow) {
  const int64_t n = 300;
  SnapKvOptions opt;
  opt.window = 16;
  Matrix q = testing::RandomMatrix(16, 64, 1), k = testing::RandomMatrix(n, 64, 2);
  std::vector<float> scores(static_cast<size_t>(n));
  ASSERT_TRUE(SnapKvScores(q.View(), k.View(), opt, scores).ok());
  auto kept = SelectTopK(scores, 100, SelectionOptions{4, 16});
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(kept->size(), 100u);
  for (int32_t i = 0; i < 4; ++i) EXPECT_TRUE(std::binary_search(kept->begin(), kept->end(), i));
  for (int32_t i = n - 16; i < n; ++i)
    EXPECT_TRUE(std::binary_search(kept->begin(), kept->end(), i));
}

TEST(SnapKvTest, RejectsBadInput) {
  SnapKvOptions opt;
  opt.window = 8;
  Matrix q = testing::RandomMatrix(8, 64, 1), k = testing::RandomMatrix(5, 64, 2);
  std::vector<float> scores(5);
  Status s = SnapKvScores(q.View(), k.View(), opt, scores);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("smaller than the window"));
  opt.kernel_size = 4;
  EXPECT_THAT(SnapKvScores(q.View(), k.View(), opt, scores).message(),
              HasSubstr("kernel_size must be odd"));
  opt.kernel_size = 5;
  opt.group_size = 2;
  EXPECT_THAT(SnapKvScores(q.View(), k.View(), opt, scores).message(),
              HasSubstr("expected window*group_size = 16"));
  opt.group_size = 1;
  Matrix k2 = testing::RandomMatrix(20, 64, 2);
  k2.Row(11)[1] = std::numeric_limits<float>::infinity();
  std::vector<float> s20(20);
  EXPECT_THAT(SnapKvScores(q.View(), k2.View(), opt, s20).message(), HasSubstr("keys: non-finite"));
}

class KeyDiffTest : public ::testing::TestWithParam<std::tuple<int, int64_t>> {};

TEST_P(KeyDiffTest, ScoresMatchReference) {
  const auto [d, n] = GetParam();
  Matrix k = testing::RandomMatrix(n, d, 31 + n, 1.0f, 0.3f);
  std::vector<float> scores(static_cast<size_t>(n));
  ASSERT_TRUE(KeyDiffScores(k.View(), scores).ok());
  const std::vector<double> want = testing::RefKeyDiffScores(testing::ToRef(k.View()));
  for (int64_t i = 0; i < n; ++i)
    ASSERT_NEAR(scores[static_cast<size_t>(i)], want[static_cast<size_t>(i)], 1e-5) << i;
}

INSTANTIATE_TEST_SUITE_P(Shapes, KeyDiffTest,
                         ::testing::Combine(::testing::Values(64, 128),
                                            ::testing::Values(int64_t{1}, int64_t{7}, int64_t{513},
                                                              int64_t{4096})));

TEST(KeyDiffTest, BlockwiseMatchesBruteForceWalk) {
  const int64_t n = 700, budget = 200;
  Matrix k = testing::RandomCorrelatedKeys(n, 64, 5);
  KeyDiffBlockOptions opt;
  opt.block_size = 128;
  opt.selection = SelectionOptions{4, 16};
  auto got = KeyDiffBlockwiseSelect(k.View(), budget, opt);
  ASSERT_TRUE(got.ok()) << got.status();
  // Brute force in float64: same walk, float64 scores.
  std::vector<int32_t> kept;
  for (int64_t b0 = 0; b0 < n; b0 += 128) {
    std::vector<int32_t> cand = kept;
    for (int64_t i = b0; i < std::min(n, b0 + 128); ++i) cand.push_back(static_cast<int32_t>(i));
    if (static_cast<int64_t>(cand.size()) <= budget) {
      kept = cand;
      continue;
    }
    testing::RefMatrix ck(static_cast<int64_t>(cand.size()), 64);
    for (size_t r = 0; r < cand.size(); ++r)
      for (int c = 0; c < 64; ++c) ck.at(static_cast<int64_t>(r), c) = k.Row(cand[r])[c];
    const std::vector<double> sc = testing::RefKeyDiffScores(ck);
    const int64_t s = std::count_if(cand.begin(), cand.end(), [](int32_t i) { return i < 4; });
    const int64_t w =
        std::count_if(cand.begin(), cand.end(), [&](int32_t i) { return i >= n - 16; });
    std::vector<int32_t> local = BruteSelect(sc, budget, s, w);
    kept.clear();
    for (int32_t r : local) kept.push_back(cand[static_cast<size_t>(r)]);
  }
  EXPECT_EQ(*got, kept);
  EXPECT_EQ(got->size(), static_cast<size_t>(budget));
  for (int32_t i = 0; i < 4; ++i) EXPECT_EQ((*got)[static_cast<size_t>(i)], i);
  for (int32_t i = 0; i < 16; ++i)
    EXPECT_EQ((*got)[static_cast<size_t>(budget - 16 + i)], n - 16 + i);
}

TEST(KeyDiffTest, ZeroNormKeysAreRejectedAndCancellingKeysScoreZero) {
  Matrix k = testing::RandomMatrix(9, 64, 1);
  std::fill(k.Row(5), k.Row(5) + 64, 0.0f);
  std::vector<float> scores(9);
  Status s = KeyDiffScores(k.View(), scores);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("zero-norm key at row 5"));
  KeyDiffBlockOptions opt;
  opt.block_size = 4;
  opt.selection = SelectionOptions{0, 0};
  auto b = KeyDiffBlockwiseSelect(k.View(), 3, opt);
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(b.status().message(), HasSubstr("zero-norm key in block starting at token 4"));
  EXPECT_EQ(s.reason(), Reason::kZeroNormKey);
  EXPECT_EQ(b.status().reason(), Reason::kZeroNormKey);
  Matrix pair = testing::RandomMatrix(2, 64, 2);
  for (int c = 0; c < 64; ++c) pair.Row(1)[c] = -pair.Row(0)[c];
  std::vector<float> two(2, 7.0f);
  ASSERT_TRUE(KeyDiffScores(pair.View(), two).ok());
  EXPECT_THAT(two, ElementsAre(0.0f, 0.0f));
}

TEST(KeyDiffTest, RejectsBadInput) {
  Matrix k = testing::RandomMatrix(9, 64, 1);
  std::vector<float> scores(9);
  k.Row(2)[2] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(KeyDiffScores(k.View(), scores).message(),
              HasSubstr("keys: non-finite value (nan) at row 2 col 2"));
  Matrix odd = testing::RandomMatrix(9, 33, 1);
  EXPECT_THAT(KeyDiffScores(odd.View(), scores).message(), HasSubstr("unsupported head_dim 33"));
  Matrix ok = testing::RandomMatrix(9, 64, 1);
  KeyDiffBlockOptions opt;
  opt.selection = SelectionOptions{4, 4};
  auto r = KeyDiffBlockwiseSelect(ok.View(), 7, opt);
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfRange);
  auto small =
      KeyDiffBlockwiseSelect(ok.View(), 9, KeyDiffBlockOptions{128, SelectionOptions{10, 0}});
  EXPECT_THAT(small.status().message(), HasSubstr("smaller than the sinks"));
}

TEST(KeyDiffCudaTest, MatchesCpu) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  Matrix k = testing::RandomMatrix(4096, 128, 3, 1.0f, 0.2f);
  std::vector<float> a(4096), b(4096);
  ASSERT_TRUE(KeyDiffScores(k.View(), a).ok());
  ASSERT_TRUE(KeyDiffScores(k.View(), b, ExecOptions{Backend::kCuda}).ok());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-5);
  std::fill(k.Row(77), k.Row(77) + 128, 0.0f);
  EXPECT_THAT(KeyDiffScores(k.View(), b, ExecOptions{Backend::kCuda}).message(),
              HasSubstr("zero-norm key at row 77"));
}

TEST(PyramidKvTest, BudgetsFollowTheFormula) {
  auto b = PyramidKvLayerBudgets(4096, 32, 0.5, PyramidKvOptions{64, 20.0});
  ASSERT_TRUE(b.ok());
  EXPECT_FALSE(b->fell_back);
  EXPECT_EQ(b->per_layer.front(), 3994);  // max = 2*2048 - 102.4
  EXPECT_EQ(b->per_layer.back(), 102);    // min = 2048 / 20
  EXPECT_TRUE(std::is_sorted(b->per_layer.rbegin(), b->per_layer.rend()));
  const int64_t total = std::accumulate(b->per_layer.begin(), b->per_layer.end(), int64_t{0});
  // Same total as uniform up to rounding: each of the 32 budgets is rounded to an integer, off by
  // at most 1/2 from its real value.
  EXPECT_NEAR(static_cast<double>(total), 32 * 2048.0, 32 * 0.5);
  // max capped at N - W: p_c = 0.1 -> max = 4032, min = 2 * 3686.4 - 4032 = 3340.8
  auto capped = PyramidKvLayerBudgets(4096, 32, 0.1, PyramidKvOptions{64, 20.0});
  ASSERT_TRUE(capped.ok());
  EXPECT_EQ(capped->per_layer.front(), 4032);
  EXPECT_EQ(capped->per_layer.back(), 3341);
  // min < W: fallback to uniform round(512 * 0.1) = 51
  auto fb = PyramidKvLayerBudgets(512, 4, 0.9, PyramidKvOptions{64, 20.0});
  ASSERT_TRUE(fb.ok());
  EXPECT_TRUE(fb->fell_back);
  EXPECT_THAT(fb->per_layer, ElementsAre(51, 51, 51, 51));
  auto one = PyramidKvLayerBudgets(4096, 1, 0.5);
  EXPECT_TRUE(one->fell_back);
  EXPECT_EQ(PyramidKvLayerBudgets(4096, 32, 1.0).status().code(), StatusCode::kOutOfRange);
  EXPECT_THAT(PyramidKvLayerBudgets(4096, 32, 0.5, PyramidKvOptions{64, 0.5}).status().message(),
              HasSubstr("beta must be"));
  EXPECT_EQ(PyramidKvLayerBudgets(0, 32, 0.5).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvd::kernels
