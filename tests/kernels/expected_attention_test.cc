// Expected-attention scores (expected_attention.h) against a float64 reference written from the
// formulas with full d x d matrices: the de-rotated queries' mean and covariance (kept on the RoPE
// pair blocks, as the header states), the rotation averaged by summing R(p) over the F future
// positions, z = m.k/sqrt d + k^T C k/(2d), softmax per query head, group mean, times |v|. Plus
// the rejections, the CUDA twin, and the plan's score stage (code 4, KeyDiff fallback).
#include "kvd/kernels/expected_attention.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "kvd/kernels/convert.h"
#include "kvd/kernels/keydiff.h"
#include "kvd/kernels/plan.h"
#include "kvd/kernels/scorers.h"
#include "kvd/kernels/snapkv.h"
#include "reference.h"

namespace kvd::kernels {
namespace {

using ::testing::HasSubstr;
using testing::RefMatrix;

struct Case {
  RopePairing pairing;
  int rotary_dim;  // 0 = head_dim
  int future;
  bool covariance;
  bool value_norm;
};

// The reference scores of kv_head for window queries q [W, n_q, d] at qpos, keys/values [N, d]
// whose last token is at last_position.
std::vector<double> RefScores(const RopeConfig& rc, int d, int n_q, int group, int kv_head,
                              const Matrix& q, std::span<const int64_t> qpos, const Matrix& keys,
                              const Matrix& values, int64_t last_position, const Case& c) {
  const int64_t W = q.rows, N = keys.rows;
  const int rd = rc.rotary_dim == 0 ? d : rc.rotary_dim;
  // partner of each dim (blocks of the covariance that are kept)
  std::vector<int> partner(d);
  for (int i = 0; i < d; ++i) partner[i] = i;
  for (int i = 0; i < rd / 2; ++i) {
    const int a = rc.pairing == RopePairing::kInterleaved ? 2 * i : i;
    const int b = rc.pairing == RopePairing::kInterleaved ? 2 * i + 1 : i + rd / 2;
    partner[a] = b;
    partner[b] = a;
  }
  // Rbar = mean over p of R(p), from RefRope applied to the basis: row j of RefRope(I) is
  // R(p) e_j, i.e. column j of R(p).
  RefMatrix rbar(d, d);
  RefMatrix eye(d, d);
  for (int j = 0; j < d; ++j) eye.at(j, j) = 1.0;
  for (int f = 0; f < c.future; ++f) {
    std::vector<int64_t> p(d, last_position + 1 + f);
    RefMatrix cols = testing::RefRope(rc, eye, p, +1);
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j) rbar.at(i, j) += cols.at(j, i) / c.future;
  }
  std::vector<double> acc(N, 0.0);
  for (int g = 0; g < group; ++g) {
    const int qh = kv_head * group + g;
    RefMatrix post(W, d);
    for (int64_t t = 0; t < W; ++t)
      for (int j = 0; j < d; ++j) post.at(t, j) = q.values[(t * n_q + qh) * d + j];
    RefMatrix pre = testing::RefRope(rc, post, qpos, -1);
    std::vector<double> mu(d, 0.0);
    for (int64_t t = 0; t < W; ++t)
      for (int j = 0; j < d; ++j) mu[j] += pre.at(t, j) / W;
    RefMatrix sigma(d, d);
    for (int64_t t = 0; t < W; ++t)
      for (int i = 0; i < d; ++i)
        for (int j = 0; j < d; ++j)
          if (j == i || j == partner[i])
            sigma.at(i, j) += (pre.at(t, i) - mu[i]) * (pre.at(t, j) - mu[j]) / W;
    std::vector<double> m(d, 0.0);
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j) m[i] += rbar.at(i, j) * mu[j];
    RefMatrix cov(d, d);  // Rbar Sigma Rbar^T
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j) {
        double s = 0.0;
        for (int a = 0; a < d; ++a)
          for (int b = 0; b < d; ++b) s += rbar.at(i, a) * sigma.at(a, b) * rbar.at(j, b);
        cov.at(i, j) = c.covariance ? s : 0.0;
      }
    std::vector<double> z(N);
    for (int64_t n = 0; n < N; ++n) {
      const float* k = keys.values.data() + n * d;
      double lin = 0.0, quad = 0.0;
      for (int i = 0; i < d; ++i) {
        lin += m[i] * k[i];
        for (int j = 0; j < d; ++j) quad += k[i] * cov.at(i, j) * k[j];
      }
      z[n] = lin / std::sqrt(d) + quad / (2.0 * d);
    }
    const double zmax = *std::max_element(z.begin(), z.end());
    double total = 0.0;
    for (double& x : z) total += (x = std::exp(x - zmax));
    for (int64_t n = 0; n < N; ++n) acc[n] += z[n] / total / group;
  }
  if (c.value_norm) {
    for (int64_t n = 0; n < N; ++n) {
      double ss = 0.0;
      for (int j = 0; j < d; ++j) ss += double{values.values[n * d + j]} * values.values[n * d + j];
      acc[n] *= std::sqrt(ss);
    }
  }
  return acc;
}

class ExpectedAttentionTest : public ::testing::TestWithParam<Case> {};

TEST_P(ExpectedAttentionTest, ScoresMatchReference) {
  const Case c = GetParam();
  const int d = 64, n_q = 6, group = 3, W = 40, N = 150;
  const RopeConfig rc{.theta = 10000.0, .rotary_dim = c.rotary_dim, .pairing = c.pairing};
  auto rope = RopeTable::Create(rc, d);
  ASSERT_TRUE(rope.ok()) << rope.status().ToString();
  // Queries with a mean (as real ones have) added in two puts at other positions.
  Matrix q = testing::RandomMatrix(W, n_q * d, 11, 1.0f, 0.6f);
  std::vector<int64_t> qpos = testing::RandomIncreasingPositions(W, 5, 300);
  auto stats = QueryStatistics::Create(2, n_q, *rope);
  ASSERT_TRUE(stats.ok());
  const size_t half = static_cast<size_t>(W / 2) * n_q * d;
  ASSERT_TRUE(stats
                  ->Add(1, std::span<const float>(q.values).first(half),
                        std::span<const int64_t>(qpos).first(W / 2))
                  .ok());
  ASSERT_TRUE(stats
                  ->Add(1, std::span<const float>(q.values).subspan(half),
                        std::span<const int64_t>(qpos).subspan(W / 2))
                  .ok());
  EXPECT_EQ(stats->count(1), W);
  EXPECT_EQ(stats->MinCount(), 0);  // layer 0 saw nothing
  Matrix keys = testing::RandomCorrelatedKeys(N, d, 21);
  Matrix values = testing::RandomMatrix(N, d, 22, 1.0f, 0.1f);
  const int64_t last = 2047;
  const ExpectedAttentionOptions eo{
      .future_positions = c.future, .use_covariance = c.covariance, .value_norm = c.value_norm};
  for (int kv = 0; kv < n_q / group; ++kv) {
    auto eq = ExpectedQueriesFor(*stats, 1, kv, group, last, eo);
    ASSERT_TRUE(eq.ok()) << eq.status().ToString();
    std::vector<float> got(N);
    ASSERT_TRUE(ExpectedAttentionScores(
                    *eq, keys.View(),
                    c.value_norm ? ConstMatrixView(values.View()) : ConstMatrixView{}, got)
                    .ok());
    const std::vector<double> want =
        RefScores(rc, d, n_q, group, kv, q, qpos, keys, values, last, c);
    const double top = *std::max_element(want.begin(), want.end());
    for (int64_t i = 0; i < N; ++i) {
      ASSERT_NEAR(got[i], want[i], 2e-4 * top) << "kv head " << kv << " key " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, ExpectedAttentionTest,
                         ::testing::Values(Case{RopePairing::kHalves, 0, 512, true, true},
                                           Case{RopePairing::kInterleaved, 0, 512, true, true},
                                           Case{RopePairing::kHalves, 48, 64, true, false},
                                           Case{RopePairing::kInterleaved, 32, 1, false, true},
                                           Case{RopePairing::kHalves, 0, 7, false, false}));

TEST(ExpectedAttentionTest, RejectsBadInput) {
  auto rope = RopeTable::Create(RopeConfig{}, 64);
  ASSERT_TRUE(rope.ok());
  auto stats = QueryStatistics::Create(1, 2, *rope);
  ASSERT_TRUE(stats.ok());
  std::vector<float> q(3 * 2 * 64, 0.5f);
  std::vector<int64_t> pos = {0, 1, 2};
  EXPECT_THAT(stats->Add(0, std::span<const float>(q).first(10), pos).message(),
              HasSubstr("query elements"));
  EXPECT_EQ(stats->Add(1, q, pos).code(), StatusCode::kInvalidArgument);
  q[7] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(stats->Add(0, q, pos).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(stats->count(0), 0);  // nothing added
  EXPECT_EQ(ExpectedQueriesFor(*stats, 0, 0, 2, 10, {}).status().code(),
            StatusCode::kFailedPrecondition);
  q[7] = 0.5f;
  ASSERT_TRUE(stats->Add(0, q, pos).ok());
  EXPECT_EQ(ExpectedQueriesFor(*stats, 0, 1, 2, 10, {}).status().code(),
            StatusCode::kInvalidArgument);  // query heads 2..3 do not exist
  EXPECT_THAT(ExpectedQueriesFor(*stats, 0, 0, 2, 10, {.future_positions = 0}).status().message(),
              HasSubstr("future_positions"));
  auto eq = ExpectedQueriesFor(*stats, 0, 0, 2, 10, {});
  ASSERT_TRUE(eq.ok());
  Matrix keys = testing::RandomMatrix(8, 64, 1);
  std::vector<float> scores(8);
  EXPECT_THAT(
      ExpectedAttentionScores(*eq, keys.View(), {}, std::span<float>(scores).first(7)).message(),
      HasSubstr("scores has 7"));
  Matrix short_v = testing::RandomMatrix(7, 64, 2);
  EXPECT_EQ(ExpectedAttentionScores(*eq, keys.View(), short_v.View(), scores).code(),
            StatusCode::kInvalidArgument);
  Matrix k32 = testing::RandomMatrix(8, 32, 1);
  EXPECT_EQ(ExpectedAttentionScores(*eq, k32.View(), {}, scores).code(),
            StatusCode::kInvalidArgument);
  keys.values[5] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(ExpectedAttentionScores(*eq, keys.View(), {}, scores).code(),
            StatusCode::kInvalidArgument);
}

TEST(ExpectedAttentionTest, StatisticsMergeAndRestore) {
  auto rope = RopeTable::Create(RopeConfig{}, 64);
  ASSERT_TRUE(rope.ok());
  auto a = QueryStatistics::Create(2, 3, *rope);
  auto b = QueryStatistics::Create(2, 3, *rope);
  ASSERT_TRUE(a.ok() && b.ok());
  Matrix q = testing::RandomMatrix(5, 3 * 64, 4);
  std::vector<int64_t> pos = testing::SequentialPositions(5, 100);
  ASSERT_TRUE(a->Add(0, q.values, pos).ok());
  ASSERT_TRUE(b->Add(1, q.values, pos).ok());
  ASSERT_TRUE(a->Merge(*b).ok());
  EXPECT_EQ(a->MinCount(), 5);
  auto c = QueryStatistics::Create(2, 3, *rope);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(c->Restore(a->counts(), a->all_sum(), a->all_sum_sq(), a->all_sum_cross()).ok());
  EXPECT_EQ(c->count(1), 5);
  EXPECT_EQ(std::vector<double>(c->sum(1, 2).begin(), c->sum(1, 2).end()),
            std::vector<double>(a->sum(1, 2).begin(), a->sum(1, 2).end()));
  std::vector<int64_t> bad_counts = {1};
  EXPECT_EQ(c->Restore(bad_counts, a->all_sum(), a->all_sum_sq(), a->all_sum_cross()).code(),
            StatusCode::kInvalidArgument);
  auto other = QueryStatistics::Create(1, 3, *rope);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(a->Merge(*other).code(), StatusCode::kInvalidArgument);
}

TEST(ExpectedAttentionCudaTest, MatchesCpu) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  auto rope = RopeTable::Create(RopeConfig{}, 128);
  ASSERT_TRUE(rope.ok());
  auto stats = QueryStatistics::Create(1, 8, *rope);
  ASSERT_TRUE(stats.ok());
  Matrix q = testing::RandomMatrix(64, 8 * 128, 9, 1.0f, 0.4f);
  ASSERT_TRUE(stats->Add(0, q.values, testing::SequentialPositions(64, 4000)).ok());
  auto eq = ExpectedQueriesFor(*stats, 0, 1, 4, 5000, {});
  ASSERT_TRUE(eq.ok());
  Matrix k = testing::RandomCorrelatedKeys(3000, 128, 3);
  Matrix v = testing::RandomMatrix(3000, 128, 5);
  for (const bool vnorm : {true, false}) {
    const ConstMatrixView vv = vnorm ? ConstMatrixView(v.View()) : ConstMatrixView{};
    std::vector<float> a(3000), b(3000);
    ASSERT_TRUE(ExpectedAttentionScores(*eq, k.View(), vv, a).ok());
    ASSERT_TRUE(ExpectedAttentionScores(*eq, k.View(), vv, b, ExecOptions{Backend::kCuda}).ok());
    const float top = *std::max_element(a.begin(), a.end());
    for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-5f * top) << i;
  }
}

// A raw float32 chunk of one layer set per layout: per layer K[N,H,d] then V[N,H,d].
std::vector<uint8_t> RawChunk(const ModelLayout& layout, int64_t n, uint64_t seed) {
  std::vector<uint8_t> raw(layout.ChunkBytes(static_cast<int>(n)));
  Matrix m = testing::RandomMatrix(static_cast<int64_t>(raw.size() / 4), 1, seed, 1.0f, 0.2f);
  std::memcpy(raw.data(), m.values.data(), raw.size());
  return raw;
}

// A 96-token float32 chunk of 2 layers x 2 KV heads (4 query heads, d 64) and query statistics
// of 32 window queries per layer.
class ExpectedAttentionPlanTest : public ::testing::Test {
 protected:
  static constexpr int64_t n = 96;
  void SetUp() override {
    layout.num_layers = 2;
    layout.num_kv_heads = 2;
    layout.num_q_heads = 4;
    layout.head_dim = 64;
    layout.dtype = DType::kFloat32;
    ASSERT_TRUE(layout.Validate().ok());
    raw = RawChunk(layout, n, 7);
    pos = testing::SequentialPositions(n, 512);
    auto rope = RopeTable::Create(layout.rope, layout.head_dim);
    ASSERT_TRUE(rope.ok());
    auto st = QueryStatistics::Create(2, 4, *rope);
    ASSERT_TRUE(st.ok());
    stats = std::move(*st);
    Matrix q = testing::RandomMatrix(32, 4 * 64, 8, 1.0f, 0.5f);
    for (int l = 0; l < 2; ++l) {
      ASSERT_TRUE(stats->Add(l, q.values, testing::SequentialPositions(32, 100)).ok());
    }
    o.expected_attention_min_queries = 32;
    in = CompressionInput{.raw = raw, .positions = pos};
    in.query_stats = &*stats;
  }
  // Keys and values of every KV head of layer l.
  void LayerHeads(int l, std::vector<Matrix>* keys, std::vector<Matrix>* vals) const {
    const EngineTensorShape shape{
        .tokens = n, .num_heads = 2, .head_dim = 64, .dtype = DType::kFloat32};
    auto k = GatherHeads(shape, raw.data() + layout.LayerOffset(l, static_cast<int>(n)));
    auto v = GatherHeads(shape, raw.data() + layout.LayerOffset(l, static_cast<int>(n)) +
                                    static_cast<size_t>(n) * layout.TokenBytes());
    ASSERT_TRUE(k.ok() && v.ok());
    *keys = std::move(*k);
    *vals = std::move(*v);
  }
  // The kernel's expected-attention scores of (l, h) under the plan's options.
  void Scores(int l, int h, const Matrix& keys, const Matrix& vals, std::vector<float>* s) const {
    auto eq = ExpectedQueriesFor(*stats, l, h, 2, pos.back(), o.expected_attention);
    ASSERT_TRUE(eq.ok());
    s->assign(n, 0.0f);
    ASSERT_TRUE(ExpectedAttentionScores(*eq, keys.View(), vals.View(), *s).ok());
  }
  ModelLayout layout;
  std::vector<uint8_t> raw;
  std::vector<int64_t> pos;
  std::optional<QueryStatistics> stats;
  CompressionPlanOptions o{.score = ScoreStage::kExpectedAttention, .p_c = 0.75, .sinks = 4};
  CompressionInput in;
};

TEST_F(ExpectedAttentionPlanTest, ScoreStageFourKeepsTheBestExpectedTokens) {
  auto chunk = Compress(o, layout, in);
  ASSERT_TRUE(chunk.ok()) << chunk.status().ToString();
  EXPECT_EQ(chunk->codec.score, ScoreStage::kExpectedAttention);
  EXPECT_EQ(static_cast<int>(chunk->codec.score), 4);
  // Kept tokens = SelectTopK of the kernel's scores on the same head.
  for (int l = 0; l < 2; ++l) {
    std::vector<Matrix> keys, vals;
    ASSERT_NO_FATAL_FAILURE(LayerHeads(l, &keys, &vals));
    for (int h = 0; h < 2; ++h) {
      std::vector<float> s;
      ASSERT_NO_FATAL_FAILURE(Scores(l, h, keys[h], vals[h], &s));
      auto kept = SelectTopK(s, 24, {.sinks = 4});
      ASSERT_TRUE(kept.ok());
      const std::vector<int64_t>& got = chunk->Head(l, h).positions;
      ASSERT_EQ(got.size(), kept->size());
      for (size_t j = 0; j < got.size(); ++j) EXPECT_EQ(got[j], pos[(*kept)[j]]) << l << " " << h;
    }
  }
  // Encoded and decoded, the chunk still says code 4.
  auto bytes = EncodeCompactChunk(*chunk);
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ((*bytes)[21], 4);
  auto back = DecodeCompactChunk(*bytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->codec.score, ScoreStage::kExpectedAttention);
  EXPECT_EQ(ScoreStageName(back->codec.score), "expected_attention");

  // Too few queries (and none at all): one-shot KeyDiff, recorded as such.
  o.expected_attention_min_queries = 33;
  auto fallback = Compress(o, layout, in);
  ASSERT_TRUE(fallback.ok());
  EXPECT_EQ(fallback->codec.score, ScoreStage::kKeyDiff);
  auto keydiff = Compress({.score = ScoreStage::kKeyDiff, .p_c = 0.75, .sinks = 4}, layout,
                          CompressionInput{.raw = raw, .positions = pos});
  ASSERT_TRUE(keydiff.ok());
  EXPECT_EQ(fallback->heads, keydiff->heads);
  // The stage's policy keys (which KeyDiff does not read) do not stop the fallback.
  CompressionPlanOptions with_keys = o;
  with_keys.stage_keys = {{"ea_keydiff_outlier_z", 2}, {"ea_min_queries", 33}};
  auto keyed = Compress(with_keys, layout, in);
  ASSERT_TRUE(keyed.ok()) << keyed.status();
  EXPECT_EQ(keyed->heads, keydiff->heads);
  in.query_stats = nullptr;
  auto none = Compress(o, layout, in);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->codec.score, ScoreStage::kKeyDiff);
  // Statistics of another model are refused.
  auto other = QueryStatistics::Create(2, 2, stats->rope());
  ASSERT_TRUE(other.ok());
  in.query_stats = &*other;
  EXPECT_EQ(Compress(o, layout, in).status().code(), StatusCode::kFailedPrecondition);
  o.expected_attention.future_positions = 0;
  EXPECT_THAT(Compress(o, layout, in).status().message(), HasSubstr("future_positions"));
}

// The rank of i among [begin, end) by descending score, ties to the lower index, counted.
int64_t NaiveRank(std::span<const float> s, int64_t begin, int64_t end, int64_t i) {
  int64_t r = 0;
  for (int64_t j = begin; j < end; ++j) r += (s[j] > s[i] || (s[j] == s[i] && j < i)) ? 1 : 0;
  return r;
}

TEST(ExpectedAttentionFuseTest, FuseKeyDiffRanksMatchesTheRankFormula) {
  const int64_t n = 40, begin = 3, end = 31;
  Matrix a = testing::RandomMatrix(n, 1, 21, 1.0f, 0.0f);
  Matrix b = testing::RandomMatrix(n, 1, 22, 1.0f, 0.0f);
  a.values[10] = a.values[11];  // a tie: the lower index ranks first
  for (double s : {0.0, 0.25, 0.5, 0.7}) {
    std::vector<float> fused(n, 5.0f);
    ASSERT_TRUE(FuseKeyDiffRanks(a.values, b.values, s, 0.0, begin, end, fused).ok());
    for (int64_t i = 0; i < n; ++i) {
      double want = 0.0;
      if (i >= begin && i < end) {
        double depth = NaiveRank(a.values, begin, end, i) / (1.0 - s);
        if (s > 0) depth = std::min(depth, NaiveRank(b.values, begin, end, i) / s);
        want = -depth;
      }
      EXPECT_FLOAT_EQ(fused[i], static_cast<float>(want)) << s << " " << i;
    }
  }
  std::vector<float> fused(n);
  EXPECT_EQ(FuseKeyDiffRanks(a.values, b.values, 1.0, 0.0, begin, end, fused).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(FuseKeyDiffRanks(a.values, b.values, -0.1, 0.0, begin, end, fused).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(FuseKeyDiffRanks(a.values, b.values, 0.5, 0.0, 5, 41, fused).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(FuseKeyDiffRanks(a.values, std::span<const float>(b.values).first(39), 0.5, 0.0, begin,
                             end, fused)
                .code(),
            StatusCode::kInvalidArgument);
  a.values[4] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(FuseKeyDiffRanks(a.values, b.values, 0.5, 0.0, begin, end, fused).code(),
            StatusCode::kInvalidArgument);
  ExpectedAttentionOptions bad;
  bad.keydiff_share = 1.0;
  EXPECT_THAT(bad.Validate().message(), HasSubstr("keydiff_share"));
}

// ProtectKeyDiffOutliers against a float64 reference: the threshold mean + z std over [begin,
// end) in double, the outliers above it, the `cap` highest first (ties to the lower index).
TEST(ExpectedAttentionFuseTest, ProtectKeyDiffOutliersMatchesTheFloat64Reference) {
  const int64_t n = 60, begin = 4, end = 50;
  Matrix kd = testing::RandomMatrix(n, 1, 31, 1.0f, 0.0f);
  kd.values[20] = 9.0f;  // planted outliers, one tie
  kd.values[33] = 7.0f;
  kd.values[40] = 7.0f;
  kd.values[2] = 50.0f;  // a sink: outside the range, never protected
  for (double z : {1.0, 2.0, 3.0}) {
    for (int64_t cap : {0, 1, 2, 5, 100}) {
      std::vector<float> fused(n);
      for (int64_t i = 0; i < n; ++i) fused[i] = i >= begin && i < end ? -static_cast<float>(i) : 0;
      const std::vector<float> before = fused;
      ASSERT_TRUE(ProtectKeyDiffOutliers(kd.values, z, cap, begin, end, fused).ok());
      double mean = 0, var = 0;
      for (int64_t i = begin; i < end; ++i) mean += kd.values[i];
      mean /= end - begin;
      for (int64_t i = begin; i < end; ++i) var += (kd.values[i] - mean) * (kd.values[i] - mean);
      const double threshold = mean + z * std::sqrt(var / (end - begin));
      int64_t outliers = 0;
      for (int64_t i = begin; i < end; ++i) outliers += kd.values[i] > threshold ? 1 : 0;
      ASSERT_GE(outliers, z <= 2.0 ? 3 : 1) << z;
      for (int64_t i = 0; i < n; ++i) {
        const bool outlier = i >= begin && i < end && kd.values[i] > threshold;
        const int64_t r = outlier ? NaiveRank(kd.values, begin, end, i) : 0;
        const float want = outlier && r < cap ? static_cast<float>(1 + cap - r) : before[i];
        EXPECT_EQ(fused[i], want) << z << " " << cap << " " << i;
      }
    }
  }
  std::vector<float> fused(n);
  EXPECT_EQ(ProtectKeyDiffOutliers(kd.values, -1.0, 2, begin, end, fused).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ProtectKeyDiffOutliers(kd.values, 2.0, -1, begin, end, fused).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ProtectKeyDiffOutliers(kd.values, 2.0, 2, 5, 61, fused).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ProtectKeyDiffOutliers(kd.values, 2.0, 2, begin, end, std::span<float>(fused).first(59))
                .code(),
            StatusCode::kInvalidArgument);
}

// With a recency share r the top B are the union of the best by expected attention, the best by
// KeyDiff and the most recent: r_r(i) = end - 1 - i, checked against the float64 formula and, for
// every budget B, against that union built by brute force.
TEST(ExpectedAttentionFuseTest, FuseKeyDiffRanksKeepsTheMostRecentShare) {
  const int64_t n = 48, begin = 4, end = 36;
  Matrix a = testing::RandomMatrix(n, 1, 31, 1.0f, 0.0f);
  Matrix b = testing::RandomMatrix(n, 1, 32, 1.0f, 0.0f);
  struct Shares {
    double s, r;
  };
  for (Shares sh : {Shares{0.0, 0.2}, Shares{0.4, 0.2}, Shares{0.33, 0.33}, Shares{0.0, 0.9}}) {
    std::vector<float> fused(n, 5.0f);
    ASSERT_TRUE(FuseKeyDiffRanks(a.values, b.values, sh.s, sh.r, begin, end, fused).ok());
    std::vector<double> depth(n, 0.0);  // float64
    for (int64_t i = 0; i < n; ++i) {
      if (i >= begin && i < end) {
        depth[i] = NaiveRank(a.values, begin, end, i) / (1.0 - sh.s - sh.r);
        if (sh.s > 0) depth[i] = std::min(depth[i], NaiveRank(b.values, begin, end, i) / sh.s);
        depth[i] = std::min(depth[i], static_cast<double>(end - 1 - i) / sh.r);
      }
      EXPECT_FLOAT_EQ(fused[i], static_cast<float>(-depth[i])) << sh.s << " " << sh.r << " " << i;
    }
    // The top B by fused: every token in it is among the x (1 - s - r) best by expected
    // attention, the x s best by KeyDiff or the x r most recent, with x the B-th depth.
    auto top = SelectTopK(fused, begin + (n - end) + 10, {.sinks = begin, .window = n - end});
    ASSERT_TRUE(top.ok());
    std::vector<double> depths;
    for (int64_t i : *top) {
      if (i >= begin && i < end) depths.push_back(depth[i]);
    }
    ASSERT_EQ(depths.size(), 10u);
    const double x = *std::max_element(depths.begin(), depths.end());
    for (int64_t i : *top) {
      if (i < begin || i >= end) continue;
      const bool by_ea = NaiveRank(a.values, begin, end, i) <= x * (1.0 - sh.s - sh.r) + 1e-9;
      const bool by_kd = sh.s > 0 && NaiveRank(b.values, begin, end, i) <= x * sh.s + 1e-9;
      const bool by_recent = static_cast<double>(end - 1 - i) <= x * sh.r + 1e-9;
      EXPECT_TRUE(by_ea || by_kd || by_recent) << sh.s << " " << sh.r << " " << i;
    }
    for (int64_t i = begin; i < end; ++i) {  // and every token of a smaller depth is in it
      if (depth[i] < x - 1e-9) {
        EXPECT_NE(std::find(top->begin(), top->end(), i), top->end()) << sh.s << " " << sh.r;
      }
    }
    if (sh.r == 0.9) {
      // Almost all by recency: the 9 most recent evictable tokens are kept.
      for (int64_t i = end - 9; i < end; ++i) {
        EXPECT_NE(std::find(top->begin(), top->end(), i), top->end()) << i;
      }
    }
  }
  std::vector<float> fused(n);
  EXPECT_EQ(FuseKeyDiffRanks(a.values, b.values, 0.5, 0.5, begin, end, fused).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(FuseKeyDiffRanks(a.values, b.values, 0.2, -0.1, begin, end, fused).code(),
            StatusCode::kInvalidArgument);
  ExpectedAttentionOptions bad;
  bad.keydiff_share = 0.5;
  bad.recent_share = 0.5;
  EXPECT_THAT(bad.Validate().message(), HasSubstr("recent_share"));
  bad.recent_share = 0.4;
  EXPECT_TRUE(bad.Validate().ok());
}

// keydiff_share 0.5 in the plan: the kept middle tokens are, rank by rank, expected attention's
// and KeyDiff's next best (the lower index first at a rank), until the budget is full.
TEST_F(ExpectedAttentionPlanTest, KeyDiffShareKeepsBothOrdersTurnAbout) {
  const int64_t kept = 24, sinks = 4;
  o.expected_attention.keydiff_share = 0.5;
  auto chunk = Compress(o, layout, in);
  ASSERT_TRUE(chunk.ok()) << chunk.status().ToString();
  EXPECT_EQ(chunk->codec.score, ScoreStage::kExpectedAttention);
  int differs_from_expected = 0;
  for (int l = 0; l < 2; ++l) {
    std::vector<Matrix> keys, vals;
    ASSERT_NO_FATAL_FAILURE(LayerHeads(l, &keys, &vals));
    for (int h = 0; h < 2; ++h) {
      std::vector<float> ea, kd(n);
      ASSERT_NO_FATAL_FAILURE(Scores(l, h, keys[h], vals[h], &ea));
      ASSERT_TRUE(KeyDiffScores(keys[h].View(), kd).ok());
      // Each order's middle tokens, best first (ties to the lower index).
      auto order = [&](const std::vector<float>& s) {
        std::vector<int64_t> o(n - sinks);
        for (int64_t i = sinks; i < n; ++i) o[i - sinks] = i;
        std::stable_sort(o.begin(), o.end(), [&](int64_t x, int64_t y) { return s[x] > s[y]; });
        return o;
      };
      const std::vector<int64_t> by_ea = order(ea), by_kd = order(kd);
      std::vector<bool> take(n, false);
      for (int64_t i = 0; i < sinks; ++i) take[i] = true;
      int64_t taken = sinks;
      for (size_t r = 0; r < by_ea.size() && taken < kept; ++r) {
        for (int64_t t : {std::min(by_ea[r], by_kd[r]), std::max(by_ea[r], by_kd[r])}) {
          if (taken < kept && !take[t]) {
            take[t] = true;
            ++taken;
          }
        }
      }
      std::vector<int64_t> want;
      for (int64_t i = 0; i < n; ++i) {
        if (take[i]) want.push_back(pos[i]);
      }
      EXPECT_EQ(chunk->Head(l, h).positions, want) << l << " " << h;
      auto ea_only = SelectTopK(ea, kept, {.sinks = sinks});
      ASSERT_TRUE(ea_only.ok());
      std::vector<int64_t> ea_pos;
      for (int32_t i : *ea_only) ea_pos.push_back(pos[i]);
      differs_from_expected += ea_pos != want ? 1 : 0;
    }
  }
  EXPECT_GT(differs_from_expected, 0);  // the share changes what is kept
}

// The policy keys ea_keydiff_outlier_z / _share through the plan: the kept tokens are the top of
// expected attention with KeyDiff's outliers first, up to the share of the 20 evictable tokens
// the budget keeps (24 - 4 sinks, no window).
TEST_F(ExpectedAttentionPlanTest, OutlierKeysPutKeyDiffOutliersFirst) {
  const int64_t kept = 24, sinks = 4;
  o.stage_keys = {{"ea_keydiff_outlier_z", 1.5}, {"ea_keydiff_outlier_share", 0.25}};
  auto chunk = Compress(o, layout, in);
  ASSERT_TRUE(chunk.ok()) << chunk.status().ToString();
  EXPECT_EQ(chunk->codec.score, ScoreStage::kExpectedAttention);
  int differs_from_expected = 0;
  for (int l = 0; l < 2; ++l) {
    std::vector<Matrix> keys, vals;
    ASSERT_NO_FATAL_FAILURE(LayerHeads(l, &keys, &vals));
    for (int h = 0; h < 2; ++h) {
      std::vector<float> ea, kd(n), fused(n);
      ASSERT_NO_FATAL_FAILURE(Scores(l, h, keys[h], vals[h], &ea));
      ASSERT_TRUE(KeyDiffScores(keys[h].View(), kd).ok());
      ASSERT_TRUE(FuseKeyDiffRanks(ea, ea, 0.0, 0.0, sinks, n, fused).ok());
      ASSERT_TRUE(ProtectKeyDiffOutliers(kd, 1.5, 5, sinks, n, fused).ok());
      auto want = SelectTopK(fused, kept, {.sinks = sinks});
      auto ea_only = SelectTopK(ea, kept, {.sinks = sinks});
      ASSERT_TRUE(want.ok() && ea_only.ok());
      std::vector<int64_t> want_pos;
      for (int32_t i : *want) want_pos.push_back(pos[i]);
      EXPECT_EQ(chunk->Head(l, h).positions, want_pos) << l << " " << h;
      differs_from_expected += *want != *ea_only ? 1 : 0;
    }
  }
  EXPECT_GT(differs_from_expected, 0);  // the outliers change what is kept
  o.stage_keys = {{"ea_keydiff_outlier_z", -1.0}};
  EXPECT_EQ(Compress(o, layout, in).status().code(), StatusCode::kInvalidArgument);
}

// The policy key ea_keydiff_pool through the plan: KeyDiff's scores are max-pooled over 3
// tokens of the evictable range before the fused rank, so KeyDiff's best token goes with both
// neighbours; an even pool, or a pool without a KeyDiff share, is refused.
TEST_F(ExpectedAttentionPlanTest, PoolKeyKeepsKeyDiffsBestTokensWithTheirNeighbours) {
  const int64_t kept = 24, sinks = 4;
  o.expected_attention.keydiff_share = 0.5;
  auto plain = Compress(o, layout, in);
  o.stage_keys = {{"ea_keydiff_pool", 3}};
  auto chunk = Compress(o, layout, in);
  ASSERT_TRUE(chunk.ok() && plain.ok()) << chunk.status().ToString();
  int neighbours_dropped_unpooled = 0;
  for (int l = 0; l < 2; ++l) {
    std::vector<Matrix> keys, vals;
    ASSERT_NO_FATAL_FAILURE(LayerHeads(l, &keys, &vals));
    for (int h = 0; h < 2; ++h) {
      std::vector<float> ea, kd(n), pooled(n), fused(n);
      ASSERT_NO_FATAL_FAILURE(Scores(l, h, keys[h], vals[h], &ea));
      ASSERT_TRUE(KeyDiffScores(keys[h].View(), kd).ok());
      pooled = kd;
      const auto evictable = [&](auto& v) { return std::span(v).subspan(sinks, n - sinks); };
      ASSERT_TRUE(
          Pool1d(evictable(std::as_const(kd)), 3, PoolingKind::kMax, evictable(pooled)).ok());
      ASSERT_TRUE(FuseKeyDiffRanks(ea, pooled, 0.5, 0.0, sinks, n, fused).ok());
      auto want = SelectTopK(fused, kept, {.sinks = sinks});
      ASSERT_TRUE(want.ok());
      std::vector<int64_t> want_pos;
      for (int32_t i : *want) want_pos.push_back(pos[i]);
      EXPECT_EQ(chunk->Head(l, h).positions, want_pos) << l << " " << h;
      // KeyDiff's best evictable token not at the range's edge, and its neighbours.
      const int64_t best = std::max_element(kd.begin() + sinks + 1, kd.end() - 1) - kd.begin();
      const auto kept_in = [&](const CompactChunk& c, int64_t i) {
        const std::vector<int64_t>& p = c.Head(l, h).positions;
        return std::find(p.begin(), p.end(), pos[i]) != p.end();
      };
      for (int64_t i : {best - 1, best, best + 1}) EXPECT_TRUE(kept_in(*chunk, i)) << i;
      neighbours_dropped_unpooled +=
          !kept_in(*plain, best - 1) || !kept_in(*plain, best + 1) ? 1 : 0;
    }
  }
  EXPECT_GT(neighbours_dropped_unpooled, 0);  // without the pool a neighbour goes
  o.stage_keys = {{"ea_keydiff_pool", 4}};
  EXPECT_THAT(Compress(o, layout, in).status().message(), HasSubstr("must be odd"));
  o.stage_keys = {{"ea_keydiff_pool", 3}};
  o.expected_attention.keydiff_share = 0.0;
  EXPECT_THAT(Compress(o, layout, in).status().message(), HasSubstr("ea_keydiff_share > 0"));
}

}  // namespace
}  // namespace kvd::kernels
