// KVSlimmer: statistics and weights against float64 hand computations, the guard, pair selection,
// exact budgets, protected sinks/window, conservation of values and cardinalities, and the
// "identical keys merge exactly" property of compact attention.
// Tolerances (reference.h): statistics are float64 sums of float32 inputs, bounded by
// SumErrorBound with the float64 unit roundoff; merge weights are rounded to float32 (a few u);
// attention outputs through the compact form agree with the original up to the float32 rounding
// of the merged key and value sum (~u times the score magnitude ~10 and |v| < 5: ~1e-5 absolute
// on these unit-scale values, observed ~2e-8); value sums lose u per merge a token takes part in.
#include "kvd/kernels/kvslimmer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "reference.h"

namespace kvd::kernels {
namespace {

using ::testing::HasSubstr;

RopeTable Table(int d, RopePairing pairing = RopePairing::kHalves) {
  RopeConfig c;
  c.pairing = pairing;
  auto t = RopeTable::Create(c, d);
  EXPECT_TRUE(t.ok());
  return *t;
}

SlotSet RandomSlots(int64_t s, int64_t d, uint64_t seed) {
  SlotSet slots;
  slots.keys_pre = testing::RandomMatrix(s, d, seed);
  slots.value_sums = testing::RandomMatrix(s, d, seed + 1);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  for (int64_t j = 0; j < s; ++j) {
    slots.cardinality.push_back(1 + static_cast<int32_t>(rng() % 4));
    slots.positions.push_back(j * 5);
  }
  return slots;
}

TEST(KvSlimmerStatsTest, PairStatisticsMatchFloat64) {
  const int64_t s = 40, d = 64, begin = 4, end = 36;
  for (MergeNorm norm : {MergeNorm::kL2, MergeNorm::kL1Code}) {
    SlotSet slots = RandomSlots(s, d, 3);
    std::vector<float> mass(static_cast<size_t>(s));
    for (int64_t j = 0; j < s; ++j)
      mass[static_cast<size_t>(j)] = 0.1f + 0.01f * static_cast<float>((j * 7) % 13);
    PairStatistics st;
    ASSERT_TRUE(ComputePairStatistics(mass, begin, end, norm, &slots, &st).ok());
    double total = 0.0;
    for (int64_t j = begin; j < end; ++j) total += mass[static_cast<size_t>(j)];
    std::vector<double> o(static_cast<size_t>(d), 0.0), o_abs(static_cast<size_t>(d), 0.0);
    for (int64_t j = 0; j < s; ++j) {
      const double a = (j >= begin && j < end) ? mass[static_cast<size_t>(j)] / total : 0.0;
      // alpha = mass / (float64 sum of 32 masses): within 34 * 2^-53 * alpha of the reference.
      ASSERT_NEAR(st.alpha[static_cast<size_t>(j)], a,
                  2 * testing::SumErrorBound(end - begin + 1, a, testing::kF64Unit));
      for (int64_t c = 0; c < d; ++c) {
        const double t = a * slots.value_sums.Row(j)[c] / slots.cardinality[static_cast<size_t>(j)];
        o[static_cast<size_t>(c)] += t;
        o_abs[static_cast<size_t>(c)] += std::abs(t);
      }
    }
    // Both float64 sums of the same s terms (each term a product and a quotient: 2 more u).
    for (int64_t c = 0; c < d; ++c) {
      ASSERT_NEAR(
          st.o[static_cast<size_t>(c)], o[static_cast<size_t>(c)],
          2 * testing::SumErrorBound(s + 2, o_abs[static_cast<size_t>(c)], testing::kF64Unit));
    }
    if (norm == MergeNorm::kL1Code) {
      const int64_t j = 10;
      double dev = 0.0;
      for (int64_t c = 0; c < d; ++c)
        dev += std::fabs(slots.value_sums.Row(j)[c] / double(slots.cardinality[j]) -
                         o[static_cast<size_t>(c)]);
      const double a = st.alpha[j];
      // d-term float64 sums of |v_c - o_c|, where o carries the error bounded above (~1e-14):
      // 1e-11 covers both; h = a (1 - 2a) d_j adds three float64 roundings.
      EXPECT_NEAR(st.l1_dev[j], dev, 1e-11);
      EXPECT_NEAR(st.h[j], a * (1 - 2 * a) * dev, 1e-11);
      // h is a running mean over observations: a second observation with uniform mass.
      const double first = st.h[j];
      std::vector<float> flat(static_cast<size_t>(s), 1.0f);
      PairStatistics st2;
      ASSERT_TRUE(ComputePairStatistics(flat, begin, end, norm, &slots, &st2).ok());
      const double a2 = 1.0 / (end - begin);
      const double fresh = a2 * (1 - 2 * a2) * st2.l1_dev[j];
      // The running mean keeps h in the slot set as float32: its rounding u |h| / 2 < 1e-7.
      EXPECT_NEAR(st2.h[j], (first + fresh) / 2, 1e-7);
      EXPECT_EQ(slots.h_observations[j], 2);
    }
  }
}

TEST(KvSlimmerStatsTest, MergeWeightsBothVariantsAndGuard) {
  const int64_t d = 4;
  SlotSet slots;
  slots.keys_pre = Matrix(2, d);
  slots.value_sums = Matrix(2, d);
  const float va[4] = {1, 0, 0, 0}, vb[4] = {0, 2, 0, 0};
  std::copy(va, va + 4, slots.value_sums.Row(0));
  std::copy(vb, vb + 4, slots.value_sums.Row(1));
  slots.cardinality = {1, 2};
  slots.positions = {3, 9};
  PairStatistics st;
  st.alpha = {0.2, 0.1};
  st.o = {0.1, 0.1, 0.0, 0.0};
  // l2 by hand: v_b = Vsum/l = (0, 1, 0, 0)
  const double da[4] = {0.9, -0.1, 0, 0}, db[4] = {-0.1, 0.9, 0, 0};
  auto norm2 = [](const double* x) { return std::sqrt(x[0] * x[0] + x[1] * x[1]); };
  const double sum[4] = {0.8, 0.8, 0, 0};
  const double c11 = 0.2 * 0.6 * norm2(da), c22 = 0.1 * 0.8 * norm2(db), c12 = 0.02 * norm2(sum);
  MergeWeightResult r = ComputeMergeWeights(MergeNorm::kL2, slots, st, 0);
  // Weights in [0, 1] computed in float64 and stored as float32: off by u plus a few float64
  // roundings; 4 u allows a float32 step more, a wrong formula is off by 1e-2 and more.
  constexpr double kWeightTol = 4 * testing::kF32Unit;
  EXPECT_NEAR(r.pair.w_first, (c11 - c12) / (c11 + c22 - 2 * c12), kWeightTol);
  EXPECT_NEAR(r.pair.w_first + r.pair.w_second, 1.0, kWeightTol);
  EXPECT_FALSE(r.guard_fallback || r.guard_clamped);
  // l1_code: A = h_a - H12, B = h_b - H12 with H12 = alpha_a alpha_b (d_a + d_b)
  st.l1_dev = {1.0, 1.0};
  st.h = {0.12, 0.08};
  r = ComputeMergeWeights(MergeNorm::kL1Code, slots, st, 0);
  const double h12 = 0.02 * 2.0, A = 0.12 - h12, B = 0.08 - h12;
  EXPECT_NEAR(r.pair.w_first, A / (A + B), kWeightTol);
  EXPECT_NEAR(r.pair.h_merged,
              (A / (A + B)) * (A / (A + B)) * 0.12 + (B / (A + B)) * (B / (A + B)) * 0.08,
              kWeightTol);
  // Guard: D <= 0 (alpha = 0.5 zeroes c11 and c22) -> mean.
  st.alpha = {0.5, 0.5};
  r = ComputeMergeWeights(MergeNorm::kL2, slots, st, 0);
  EXPECT_TRUE(r.guard_fallback);
  EXPECT_EQ(r.pair.w_first, 0.5f);
  EXPECT_EQ(r.pair.w_second, 0.5f);
  // Guard: A < 0 < D -> clamped to (0, 1).
  st.h = {0.01, 0.5};
  st.alpha = {0.2, 0.1};
  r = ComputeMergeWeights(MergeNorm::kL1Code, slots, st, 0);
  EXPECT_TRUE(r.guard_clamped);
  EXPECT_EQ(r.pair.w_first, 0.0f);
  EXPECT_EQ(r.pair.w_second, 1.0f);
}

TEST(KvSlimmerStatsTest, RankAndDisjointSelection) {
  SlotSet slots = RandomSlots(10, 64, 1);
  std::vector<float> mass{5, 1, 2, 3, 1, 1, 4, 2, 2, 9};
  const double gamma = kKvSlimmerDefaultGamma;
  EXPECT_NEAR(gamma, 4096.0 / std::log(512.0), 1e-9);
  std::vector<double> rank = RankPairs(mass, slots, 2, 8, PairLambda::kAsymKv, gamma);
  ASSERT_EQ(rank.size(), 9u);
  for (size_t j = 0; j < 9; ++j) {
    if (j < 2 || j >= 7) {
      EXPECT_TRUE(std::isinf(rank[j])) << j;
      continue;
    }
    const double want = (mass[j] + mass[j + 1]) * std::exp(-(j + 1.0) / gamma) *
                        (slots.cardinality[j] + slots.cardinality[j + 1]);
    EXPECT_NEAR(rank[j], want, 1e-12 * want);  // float64, a handful of roundings (~1e-15)
  }
  std::vector<double> constant = RankPairs(mass, slots, 2, 8, PairLambda::kConstant, gamma);
  EXPECT_NEAR(constant[4], (mass[4] + mass[5]) * std::exp(-5.0 / gamma), 1e-12);
  // Disjointness on random ranks: greedy, sorted, no shared slot, as many as asked when possible.
  std::mt19937 rng(4);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<double> r(101);
    for (double& x : r) x = std::uniform_real_distribution<double>(0, 1)(rng);
    const std::vector<int64_t> chosen = SelectDisjointPairs(r, 30);
    ASSERT_EQ(chosen.size(), 30u);
    for (size_t i = 1; i < chosen.size(); ++i) ASSERT_GE(chosen[i], chosen[i - 1] + 2);
    // the globally smallest pair is always taken
    const int64_t best = std::min_element(r.begin(), r.end()) - r.begin();
    EXPECT_TRUE(std::binary_search(chosen.begin(), chosen.end(), best));
  }
  std::vector<double> all_inf(5, std::numeric_limits<double>::infinity());
  EXPECT_TRUE(SelectDisjointPairs(all_inf, 3).empty());
}

// Attention output of `slots` in the pre-RoPE space (queries pre-RoPE too), compact form.
std::vector<double> CompactOutput(const SlotSet& slots, std::span<const double> q) {
  std::vector<double> l(slots.cardinality.begin(), slots.cardinality.end());
  return testing::RefCompactAttention(q, testing::ToRef(slots.keys_pre.View()),
                                      testing::ToRef(slots.value_sums.View()), l);
}

TEST(KvSlimmerPropertyTest, IdenticalKeysMergeWithoutChangingAttention) {
  const int64_t n = 24, d = 64;
  SlotSet slots = RandomSlots(n, d, 9);
  std::fill(slots.cardinality.begin(), slots.cardinality.end(), 1);
  std::copy(slots.keys_pre.Row(10), slots.keys_pre.Row(10) + d, slots.keys_pre.Row(11));
  const SlotSet original = slots;
  std::vector<float> mass(static_cast<size_t>(n), 1.0f);
  mass[10] = 3.0f;
  PairStatistics st;
  ASSERT_TRUE(ComputePairStatistics(mass, 0, n, MergeNorm::kL2, &slots, &st).ok());
  const MergeWeightResult w = ComputeMergeWeights(MergeNorm::kL2, slots, st, 10);
  ASSERT_TRUE(
      ApplyMerges(std::vector<MergePair>{w.pair}, RepresentativePosition::kLast, &slots).ok());
  ASSERT_EQ(slots.size(), n - 1);
  EXPECT_EQ(slots.cardinality[10], 2);
  for (int trial = 0; trial < 5; ++trial) {
    Matrix q = testing::RandomMatrix(1, d, 100 + trial, 2.0f);
    std::vector<double> qd(q.values.begin(), q.values.end());
    const std::vector<double> a = CompactOutput(original, qd), b = CompactOutput(slots, qd);
    for (int64_t c = 0; c < d; ++c) EXPECT_NEAR(a[c], b[c], 1e-5);
  }
}

TEST(KvSlimmerPropertyTest, AllIdenticalKeysCompressWithoutChangingAttention) {
  const int64_t n = 64, d = 64;
  const RopeTable rope = Table(d);
  Matrix one = testing::RandomMatrix(1, d, 1);
  Matrix kpost(n, d);
  const std::vector<int64_t> pos = testing::SequentialPositions(n);
  Matrix values = testing::RandomMatrix(n, d, 2);
  // Same pre-RoPE key everywhere: rotate it to each position.
  for (int64_t i = 0; i < n; ++i) std::copy(one.Row(0), one.Row(0) + d, kpost.Row(i));
  std::vector<MatrixView> hv{kpost.View()};
  ASSERT_TRUE(ApplyRope(rope, RopeDirection::kRotate, std::span<const int64_t>(pos), hv).ok());
  auto slots = SlotsFromTokens(rope, kpost.View(), values.View(), pos);
  ASSERT_TRUE(slots.ok());
  const SlotSet original = *slots;
  Matrix q = testing::RandomMatrix(8, d, 3);
  std::vector<int64_t> qpos(8, n + 10);
  KvSlimmerOptions opt;
  opt.sinks = 2;
  KvSlimmerStats stats;
  ASSERT_TRUE(KvSlimmerCompress(rope, q.View(), qpos, 16, opt, &*slots, &stats).ok());
  EXPECT_EQ(slots->size(), 16);
  EXPECT_GE(stats.rounds, 2);
  std::vector<double> qd(q.Row(0), q.Row(0) + d);
  const std::vector<double> a = CompactOutput(original, qd), b = CompactOutput(*slots, qd);
  for (int64_t c = 0; c < d; ++c) EXPECT_NEAR(a[c], b[c], 2e-5);
}

class KvSlimmerBudgetTest
    : public ::testing::TestWithParam<std::tuple<double, MergeNorm, RepresentativePosition, int>> {
};

TEST_P(KvSlimmerBudgetTest, MeetsBudgetExactlyAndProtectsSinksAndWindow) {
  const auto [pc, norm, position, g] = GetParam();
  const int64_t n = 513, d = 64, w = 16;
  const RopeTable rope = Table(d);
  Matrix k = testing::RandomCorrelatedKeys(n, d, 5);
  Matrix v = testing::RandomMatrix(n, d, 6);
  const std::vector<int64_t> pos = testing::SequentialPositions(n, 1000);
  auto slots = SlotsFromTokens(rope, k.View(), v.View(), pos);
  ASSERT_TRUE(slots.ok()) << slots.status();
  const SlotSet original = *slots;
  Matrix q = testing::RandomMatrix(w * g, d, 7);
  std::vector<int64_t> qpos(static_cast<size_t>(w));
  for (int64_t i = 0; i < w; ++i)
    qpos[static_cast<size_t>(i)] = 1000 + n - w + i;  // the last W tokens
  KvSlimmerOptions opt;
  opt.norm = norm;
  opt.position = position;
  opt.group_size = g;
  opt.sinks = 4;
  opt.window = w;
  const int64_t budget = std::llround(n * (1.0 - pc));
  KvSlimmerStats stats;
  Status s = KvSlimmerCompress(rope, q.View(), qpos, budget, opt, &*slots, &stats);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(slots->size(), budget);
  EXPECT_EQ(stats.pairs_merged, n - budget);
  EXPECT_GE(stats.rounds, 1);
  // Cardinalities and value sums are conserved. A merge adds two float32 value sums (one
  // rounding, <= u times the merged slot's sum of |v|); the pairs of a round are disjoint, so a
  // token's value goes through at most `rounds` roundings: the float32 slot sums, summed in
  // float64, are within (rounds + 1) u sum_i |v_ic| of the float64 sum of the tokens' values.
  EXPECT_EQ(std::accumulate(slots->cardinality.begin(), slots->cardinality.end(), int64_t{0}), n);
  for (int64_t c = 0; c < d; ++c) {
    double a = 0, b = 0, a_abs = 0;
    for (int64_t i = 0; i < n; ++i) {
      a += v.Row(i)[c];
      a_abs += std::abs(v.Row(i)[c]);
    }
    for (int64_t j = 0; j < budget; ++j) b += slots->value_sums.Row(j)[c];
    ASSERT_NEAR(a, b, (stats.rounds + 1) * testing::kF32Unit * a_abs) << "rounds " << stats.rounds;
  }
  // Sinks and window untouched (bit-exact keys, l = 1, original positions).
  for (int64_t j = 0; j < budget; ++j) {
    const bool sink = j < 4, win = j >= budget - w;
    if (!sink && !win) continue;
    const int64_t src = sink ? j : n - (budget - j);
    EXPECT_EQ(slots->cardinality[static_cast<size_t>(j)], 1);
    EXPECT_EQ(slots->positions[static_cast<size_t>(j)], pos[static_cast<size_t>(src)]);
    for (int64_t c = 0; c < d; ++c)
      ASSERT_EQ(slots->keys_pre.Row(j)[c], original.keys_pre.Row(src)[c]);
  }
  // Positions stay within the merged span and increasing.
  for (int64_t j = 1; j < budget; ++j) EXPECT_LT(slots->positions[j - 1], slots->positions[j]);
  EXPECT_TRUE(slots->Validate(d).ok());
}

INSTANTIATE_TEST_SUITE_P(Ratios, KvSlimmerBudgetTest,
                         ::testing::Combine(::testing::Values(0.25, 0.5, 0.75, 0.9),
                                            ::testing::Values(MergeNorm::kL2, MergeNorm::kL1Code),
                                            ::testing::Values(RepresentativePosition::kLast,
                                                              RepresentativePosition::kWeighted),
                                            ::testing::Values(1, 4)));

TEST(KvSlimmerTest, WeightedPositionAndHeadsBatch) {
  const int64_t d = 128, n = 200;
  const RopeTable rope = Table(d, RopePairing::kInterleaved);
  SlotSet a = RandomSlots(6, d, 1);
  a.positions = {0, 10, 20, 30, 40, 50};
  MergePair p{2, 0.25f, 0.75f, 0.0f};
  ASSERT_TRUE(ApplyMerges(std::vector<MergePair>{p}, RepresentativePosition::kWeighted, &a).ok());
  EXPECT_EQ(a.positions[2], std::llround(0.25 * 20 + 0.75 * 30));
  // Batched heads equal sequential single-head calls.
  std::vector<Matrix> ks, vs, qs;
  std::vector<SlotSet> batch, single;
  const std::vector<int64_t> pos = testing::SequentialPositions(n);
  std::vector<int64_t> qpos(8, n + 3);
  for (int h = 0; h < 3; ++h) {
    ks.push_back(testing::RandomCorrelatedKeys(n, d, 10 + h));
    vs.push_back(testing::RandomMatrix(n, d, 20 + h));
    qs.push_back(testing::RandomMatrix(8 * 8, d, 30 + h));
    batch.push_back(*SlotsFromTokens(rope, ks[h].View(), vs[h].View(), pos));
  }
  single = batch;
  KvSlimmerOptions opt;
  opt.group_size = 8;
  std::vector<KvSlimmerHead> heads;
  for (int h = 0; h < 3; ++h) heads.push_back(KvSlimmerHead{qs[h].View(), qpos, &batch[h]});
  KvSlimmerStats bstats, sstats;
  ASSERT_TRUE(
      KvSlimmerCompressHeads(rope, heads, 50, opt, &bstats, ExecOptions{Backend::kCpu, 2}).ok());
  for (int h = 0; h < 3; ++h) {
    ASSERT_TRUE(KvSlimmerCompress(rope, qs[h].View(), qpos, 50, opt, &single[h], &sstats).ok());
    EXPECT_EQ(batch[h].positions, single[h].positions);
    EXPECT_EQ(testing::MaxAbsDiff(batch[h].keys_pre.View(), single[h].keys_pre.View()), 0.0);
  }
  EXPECT_EQ(bstats.pairs_merged, sstats.pairs_merged);
  EXPECT_EQ(bstats.pairs_merged, 3 * (n - 50));
}

TEST(KvSlimmerTest, RejectsBadInput) {
  const int64_t d = 64, n = 32;
  const RopeTable rope = Table(d);
  Matrix k = testing::RandomMatrix(n, d, 1), v = testing::RandomMatrix(n, d, 2),
         q = testing::RandomMatrix(4, d, 3);
  const std::vector<int64_t> pos = testing::SequentialPositions(n);
  std::vector<int64_t> qpos(4, n);
  v.Row(3)[3] = std::numeric_limits<float>::quiet_NaN();
  auto bad = SlotsFromTokens(rope, k.View(), v.View(), pos);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("values: non-finite"));
  v.Row(3)[3] = 0.0f;
  auto slots = SlotsFromTokens(rope, k.View(), v.View(), pos);
  ASSERT_TRUE(slots.ok());
  KvSlimmerOptions opt;
  opt.sinks = 4;
  opt.window = 8;
  KvSlimmerStats st;
  SlotSet s = *slots;
  Status r = KvSlimmerCompress(rope, q.View(), qpos, 12, opt, &s, &st);
  EXPECT_EQ(r.code(), StatusCode::kOutOfRange);
  EXPECT_THAT(r.message(), HasSubstr("slot budget 12 is unreachable: must be in [13, 32]"));
  EXPECT_EQ(KvSlimmerCompress(rope, q.View(), qpos, 33, opt, &s, &st).code(),
            StatusCode::kOutOfRange);
  EXPECT_TRUE(KvSlimmerCompress(rope, q.View(), qpos, 32, opt, &s, &st).ok());  // no-op
  EXPECT_EQ(s.size(), 32);
  opt.sinks = 40;
  EXPECT_THAT(KvSlimmerCompress(rope, q.View(), qpos, 20, opt, &s, &st).message(),
              HasSubstr("smaller than the sinks"));
  opt.sinks = 4;
  opt.window = 30;
  EXPECT_THAT(KvSlimmerCompress(rope, q.View(), qpos, 20, opt, &s, &st).message(),
              HasSubstr("smaller than the window"));
  opt.window = 0;
  q.Row(1)[2] = std::numeric_limits<float>::infinity();
  r = KvSlimmerCompress(rope, q.View(), qpos, 20, opt, &s, &st);
  EXPECT_EQ(r.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.message(), HasSubstr("queries: non-finite"));
  q.Row(1)[2] = 0.0f;
  EXPECT_THAT(KvSlimmerCompress(rope, Matrix(0, d).View(), {}, 20, opt, &s, &st).message(),
              HasSubstr("observation queries must be"));
  opt.mask = MaskKind::kCausalWindow;
  EXPECT_THAT(KvSlimmerCompress(rope, q.View(), qpos, 20, opt, &s, &st).message(),
              HasSubstr("mask must be"));
  opt.mask = MaskKind::kByPosition;
  const RopeTable rope128 = Table(128);
  EXPECT_THAT(KvSlimmerCompress(rope128, q.View(), qpos, 20, opt, &s, &st).message(),
              HasSubstr("expected 128"));
  SlotSet broken = s;
  broken.keys_pre.Row(5)[0] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(KvSlimmerCompress(rope, q.View(), qpos, 20, opt, &broken, &st).message(),
              HasSubstr("slots: keys"));
  std::vector<MergePair> overlap{{3, 0.5f, 0.5f, 0}, {4, 0.5f, 0.5f, 0}};
  Status o = ApplyMerges(overlap, RepresentativePosition::kLast, &s);
  EXPECT_EQ(o.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(o.message(), HasSubstr("overlaps"));
  std::vector<MergePair> tail{{31, 0.5f, 0.5f, 0}};
  EXPECT_THAT(ApplyMerges(tail, RepresentativePosition::kLast, &s).message(),
              HasSubstr("out of range"));
}

TEST(KvSlimmerCudaTest, ApplyMergesMatchesCpu) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  SlotSet a = RandomSlots(4096, 128, 5);
  a.h.assign(4096, 0.5f);
  a.h_observations.assign(4096, 1);
  SlotSet b = a;
  std::vector<MergePair> pairs;
  for (int64_t j = 3; j + 1 < 4096; j += 3) pairs.push_back(MergePair{j, 0.3f, 0.7f, 0.25f});
  ASSERT_TRUE(ApplyMerges(pairs, RepresentativePosition::kWeighted, &a).ok());
  Status s = ApplyMerges(pairs, RepresentativePosition::kWeighted, &b, ExecOptions{Backend::kCuda});
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(a.positions, b.positions);
  EXPECT_EQ(a.cardinality, b.cardinality);
  EXPECT_EQ(a.h, b.h);
  EXPECT_LE(testing::MaxAbsDiff(a.keys_pre.View(), b.keys_pre.View()), 1e-6);
  EXPECT_EQ(testing::MaxAbsDiff(a.value_sums.View(), b.value_sums.View()), 0.0);
}

}  // namespace
}  // namespace kvd::kernels
