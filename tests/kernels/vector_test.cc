// VECTOR calibration, residuals, rebuild and routing against float64 references.
#include "kvd/kernels/vector.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "kvd/common/hash.h"
#include "reference.h"

namespace kvd::kernels {
namespace {

using ::testing::HasSubstr;

Matrix RandomMatrix(int64_t rows, int64_t cols, std::mt19937_64* rng, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  Matrix m(rows, cols);
  for (float& x : m.values) x = dist(*rng);
  return m;
}

// out = in A^T (row i: A in_i), computed in float64 then rounded.
Matrix ApplyMap(const Matrix& in, const Matrix& a) {
  Matrix out(in.rows, a.rows);
  for (int64_t i = 0; i < in.rows; ++i) {
    for (int64_t r = 0; r < a.rows; ++r) {
      double s = 0.0;
      for (int64_t c = 0; c < in.cols; ++c) s += double(a.Row(r)[c]) * in.Row(i)[c];
      out.Row(i)[r] = static_cast<float>(s);
    }
  }
  return out;
}

ConstMatrixView Rows(const Matrix& m, int64_t begin, int64_t count) {
  return {m.values.data() + begin * m.cols, count, m.cols, m.cols};
}

// -------------------------------------------------------------------------------------------
// Calibration

TEST(VectorCalibration, RecoversAnExactLinearMap) {
  for (int d : {64, 128}) {
    std::mt19937_64 rng(d);
    const int64_t n = 3 * d + 1;
    Matrix k = RandomMatrix(n, d, &rng);
    Matrix a = RandomMatrix(d, d, &rng, 1.0f / std::sqrt(float(d)));
    Matrix v = ApplyMap(k, a);
    auto cal = VectorCalibrator::Create(1, 1, d);
    ASSERT_TRUE(cal.ok());
    ASSERT_TRUE(cal->Add(0, 0, k.View(), v.View()).ok());
    auto w = cal->Solve({.ridge = 0.0});
    ASSERT_TRUE(w.ok()) << w.status();
    // V was rounded to float32 after an exact product (relative u = 6e-8 per entry) and the solve
    // is float64; for Gaussian keys with n = 3d the condition number of K is about
    // (1 + sqrt(1/3)) / (1 - sqrt(1/3)) ~ 3.7, so W is off A by ~3.7 u |A| (|A| < 0.6 here),
    // plus W's own float32 rounding u |A|: ~2e-7. 1e-6 leaves a margin; a float32 solve or a
    // dropped row gives 1e-5 and more.
    double max_err = 0.0;
    for (size_t i = 0; i < a.values.size(); ++i) {
      max_err = std::max(max_err, std::abs(double(w->Head(0, 0).w.values[i]) - a.values[i]));
    }
    EXPECT_LT(max_err, 1e-6) << "d=" << d;
    EXPECT_GT(w->Head(0, 0).r2, 1.0 - 1e-9);
    EXPECT_EQ(w->Head(0, 0).count, n);
    EXPECT_EQ(w->version, w->ComputeVersion());
  }
}

TEST(VectorCalibration, R2FromAccumulatorsMatchesDirectComputation) {
  const int d = 64;
  std::mt19937_64 rng(7);
  const int64_t n = 1001;
  Matrix k = RandomMatrix(n, d, &rng);
  Matrix a = RandomMatrix(d, d, &rng, 0.1f);
  Matrix v = ApplyMap(k, a);
  Matrix noise = RandomMatrix(n, d, &rng, 0.5f);
  for (size_t i = 0; i < v.values.size(); ++i) v.values[i] += noise.values[i];
  auto cal = VectorCalibrator::Create(1, 1, d);
  ASSERT_TRUE(cal->Add(0, 0, k.View(), v.View()).ok());
  auto w = cal->Solve({.ridge = 1e-3});
  ASSERT_TRUE(w.ok());
  // Direct float64 R^2 with the float32 W and float32 predictions; the accumulator form uses the
  // float64 W. At the least-squares optimum the error sum is stationary in W, so W's rounding
  // moves R^2 only to second order; rounding the predictions p (relative u each) moves
  // sse = sum (v - p)^2 by at most 2 u sum |v - p| |p| <= 2 u sqrt(sse * sum p^2) <= 2 u sst, so
  // R^2 by at most 2 u: 4 u leaves a margin for the float64 sums.
  Matrix pred = ApplyMap(k, w->Head(0, 0).w);
  double sse = 0, sst = 0;
  std::vector<double> mean(d, 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int c = 0; c < d; ++c) mean[c] += v.Row(i)[c] / double(n);
  for (int64_t i = 0; i < n; ++i) {
    for (int c = 0; c < d; ++c) {
      sse += std::pow(double(v.Row(i)[c]) - pred.Row(i)[c], 2);
      sst += std::pow(double(v.Row(i)[c]) - mean[c], 2);
    }
  }
  const double r2 = 1.0 - sse / sst;
  EXPECT_GT(r2, 0.05);
  EXPECT_LT(r2, 0.95);
  EXPECT_NEAR(w->Head(0, 0).r2, r2, 4 * testing::kF32Unit);
}

TEST(VectorCalibration, MergeOfPartialsEqualsOneCalibration) {
  const int d = 128;
  std::mt19937_64 rng(11);
  const int64_t n = 1237;  // odd, not a multiple of the 256-row block
  Matrix k = RandomMatrix(n, d, &rng);
  Matrix v = RandomMatrix(n, d, &rng);
  auto whole = VectorCalibrator::Create(2, 1, d);
  auto part1 = VectorCalibrator::Create(2, 1, d);
  auto part2 = VectorCalibrator::Create(2, 1, d);
  ASSERT_TRUE(whole->Add(1, 0, k.View(), v.View()).ok());
  const int64_t split = 613;
  ASSERT_TRUE(part1->Add(1, 0, Rows(k, 0, 1), Rows(v, 0, 1)).ok());
  ASSERT_TRUE(part1->Add(1, 0, Rows(k, 1, split - 1), Rows(v, 1, split - 1)).ok());
  ASSERT_TRUE(part2->Add(1, 0, Rows(k, split, n - split), Rows(v, split, n - split)).ok());
  ASSERT_TRUE(part1->Merge(*part2).ok());
  const VectorHeadStats& x = whole->Head(1, 0);
  const VectorHeadStats& y = part1->Head(1, 0);
  EXPECT_EQ(x.count, y.count);
  // Both are float64 sums (BLAS dsyrk/dgemm, blocked differently) of the same n float64-exact
  // products of float32 inputs, so each is within (n + 1) 2^-53 sum|terms| of the exact sum and
  // they differ by at most twice that. By Cauchy-Schwarz sum_i |k_ia k_ib| <= max_a sum_i k_ia^2
  // (the largest Gram diagonal) and sum_i |k_ia v_ib| <= sqrt(max_a G_aa * max_b sum_i v_ib^2).
  double k_sq = 0.0, v_sq = 0.0;
  for (int c = 0; c < d; ++c) {
    double ks = 0.0, vs = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      ks += double(k.Row(i)[c]) * k.Row(i)[c];
      vs += double(v.Row(i)[c]) * v.Row(i)[c];
    }
    k_sq = std::max(k_sq, ks);
    v_sq = std::max(v_sq, vs);
  }
  auto tol = [&](double abs_sum) {
    return 2 * testing::SumErrorBound(n, abs_sum, testing::kF64Unit);
  };
  for (size_t i = 0; i < x.gram.size(); ++i) ASSERT_NEAR(x.gram[i], y.gram[i], tol(k_sq)) << i;
  for (size_t i = 0; i < x.cross.size(); ++i) {
    ASSERT_NEAR(x.cross[i], y.cross[i], tol(std::sqrt(k_sq * v_sq))) << i;
  }
  for (int c = 0; c < d; ++c) ASSERT_NEAR(x.value_sum[c], y.value_sum[c], tol(std::sqrt(n * v_sq)));
  EXPECT_NEAR(x.value_sq_sum, y.value_sq_sum, tol(x.value_sq_sum));
  // Layer 0 got no data in either: the solve names it.
  auto w = part1->Solve();
  EXPECT_EQ(w.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(w.status().message(), HasSubstr("layer 0 head 0 has 0 tokens"));
}

TEST(VectorCalibration, MergeRejectsShapeMismatch) {
  auto a = VectorCalibrator::Create(1, 2, 64);
  auto b = VectorCalibrator::Create(1, 1, 64);
  EXPECT_EQ(a->Merge(*b).code(), StatusCode::kFailedPrecondition);
}

TEST(VectorCalibration, SingularGramNeedsARidge) {
  const int d = 64;
  std::mt19937_64 rng(3);
  Matrix k = RandomMatrix(500, d, &rng);
  for (int64_t i = 0; i < k.rows; ++i) k.Row(i)[d - 1] = 2.0f * k.Row(i)[0];  // rank d-1
  Matrix v = RandomMatrix(500, d, &rng);
  auto cal = VectorCalibrator::Create(1, 1, d);
  ASSERT_TRUE(cal->Add(0, 0, k.View(), v.View()).ok());
  auto w = cal->Solve({.ridge = 0.0});
  EXPECT_EQ(w.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(w.status().message(), HasSubstr("singular"));
  EXPECT_TRUE(cal->Solve({.ridge = 1e-6}).ok());
  // Fewer tokens than dimensions is singular too.
  auto few = VectorCalibrator::Create(1, 1, d);
  ASSERT_TRUE(few->Add(0, 0, Rows(k, 0, 10), Rows(v, 0, 10)).ok());
  EXPECT_EQ(few->Solve({.ridge = 0.0}).status().code(), StatusCode::kFailedPrecondition);
}

TEST(VectorCalibration, RejectsBadInput) {
  auto cal = VectorCalibrator::Create(1, 1, 64);
  std::mt19937_64 rng(1);
  Matrix k = RandomMatrix(4, 64, &rng);
  Matrix v = RandomMatrix(4, 64, &rng);
  k.Row(2)[5] = std::nanf("");
  Status s = cal->Add(0, 0, k.View(), v.View());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("kpre"));
  k.Row(2)[5] = 0.0f;
  v.Row(0)[0] = INFINITY;
  EXPECT_THAT(cal->Add(0, 0, k.View(), v.View()).message(), HasSubstr("values"));
  EXPECT_THAT(cal->Add(1, 0, k.View(), v.View()).message(), HasSubstr("out of range"));
  Matrix short_v = RandomMatrix(3, 64, &rng);
  EXPECT_EQ(cal->Add(0, 0, k.View(), short_v.View()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(VectorCalibrator::Create(0, 1, 64).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cal->Solve({.ridge = -1.0}).status().code(), StatusCode::kInvalidArgument);
}

// A 2 x 2 calibrator whose every head saw the same `tokens` random (kpre, value) rows.
VectorCalibrator FedCalibrator(int d, int64_t tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Matrix k = RandomMatrix(tokens, d, &rng);
  Matrix v = RandomMatrix(tokens, d, &rng);
  auto cal = VectorCalibrator::Create(2, 2, d);
  EXPECT_TRUE(cal.ok()) << cal.status();
  for (int l = 0; l < 2; ++l) {
    for (int h = 0; h < 2; ++h) EXPECT_TRUE(cal->Add(l, h, k.View(), v.View()).ok());
  }
  return std::move(*cal);
}

TEST(VectorCalibration, SerializationRoundTripsAndDetectsCorruption) {
  const int d = 64;
  std::optional<VectorCalibrator> cal = FedCalibrator(d, 300, 5);
  std::vector<uint8_t> bytes = cal->Serialize();
  auto back = VectorCalibrator::Deserialize(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->Head(1, 1).gram, cal->Head(1, 1).gram);
  EXPECT_EQ(back->Head(1, 1).cross, cal->Head(1, 1).cross);
  EXPECT_EQ(back->Head(1, 1).count, 300);

  auto w = cal->Solve();
  ASSERT_TRUE(w.ok());
  std::vector<uint8_t> wbytes = w->Serialize();
  auto wback = VectorWeights::Deserialize(wbytes);
  ASSERT_TRUE(wback.ok()) << wback.status();
  EXPECT_EQ(wback->version, w->version);
  EXPECT_EQ(wback->Head(1, 0).w.values, w->Head(1, 0).w.values);
  EXPECT_EQ(wback->Head(1, 0).r2, w->Head(1, 0).r2);

  std::vector<uint8_t> flipped = wbytes;
  flipped[wbytes.size() / 2] ^= 0x10;
  auto bad = VectorWeights::Deserialize(flipped);
  EXPECT_EQ(bad.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(bad.status().message(), HasSubstr("checksum"));
  auto cut = VectorCalibrator::Deserialize(std::span(bytes).first(bytes.size() - 100));
  EXPECT_EQ(cut.status().code(), StatusCode::kDataLoss);
  auto tiny = VectorWeights::Deserialize(std::span(wbytes).first(5));
  EXPECT_EQ(tiny.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(tiny.status().message(), HasSubstr("truncated"));
  // Weights bytes are not calibration bytes.
  auto wrong = VectorCalibrator::Deserialize(wbytes);
  EXPECT_EQ(wrong.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong.status().message(), HasSubstr("bad magic"));
  std::vector<uint8_t> future = wbytes;
  future[4] = 9;
  EXPECT_THAT(VectorWeights::Deserialize(future).status().message(), HasSubstr("version 9"));
}

// Rewrites the xxh3-64 trailer after a tamper, so the loader's checks behind the checksum run.
void FixChecksum(std::vector<uint8_t>* bytes) {
  const uint64_t sum = Checksum64(bytes->data(), bytes->size() - 8);
  std::memcpy(bytes->data() + bytes->size() - 8, &sum, 8);
}

// Saved weights or accumulators that Solve / Add never produce are refused with DATA_LOSS (the
// daemon then calibrates again) instead of being installed: non-finite W made every rebuild of a
// routed value fail at serve time. The writer here is a correct one (valid checksum and version
// digest), so only the value checks can refuse.
TEST(VectorCalibration, LoadersRefuseValuesSolveNeverWrites) {
  const int d = 4;
  std::optional<VectorCalibrator> cal = FedCalibrator(d, 64, 7);
  auto solved = cal->Solve();
  ASSERT_TRUE(solved.ok()) << solved.status();
  auto affine = cal->Solve({.affine = true});
  ASSERT_TRUE(affine.ok()) << affine.status();

  auto reload = [](VectorWeights w) {
    w.version = w.ComputeVersion();
    return VectorWeights::Deserialize(w.Serialize()).status();
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  ASSERT_TRUE(reload(*solved).ok());
  ASSERT_TRUE(reload(*affine).ok());

  VectorWeights w = *solved;
  w.heads[2].w.values[5] = nan;  // layer 1 head 0
  Status s = reload(w);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("non-finite W or bias entry in layer 1 head 0"));
  w = *solved;
  w.heads[0].w.values[0] = -inf;
  EXPECT_THAT(reload(w).message(), HasSubstr("non-finite W or bias entry in layer 0 head 0"));
  w = *affine;
  w.heads[3].bias[d - 1] = inf;
  s = reload(w);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("non-finite W or bias entry in layer 1 head 1"));
  w = *solved;
  w.heads[1].r2 = std::numeric_limits<double>::quiet_NaN();
  s = reload(w);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("non-finite R^2 in layer 0 head 1"));
  w = *solved;
  w.heads[1].count = -3;
  s = reload(w);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("negative token count in layer 0 head 1"));

  // Accumulators: header 24 bytes; per head count, value_sq_sum, value_sum [d], key_sum [d],
  // gram [d, d], cross [d, d] (8 bytes each).
  const std::vector<uint8_t> good = cal->Serialize();
  ASSERT_TRUE(VectorCalibrator::Deserialize(good).ok());
  const size_t per_head = 16 + 16 * d + 16 * d * d;
  const size_t gram0 = 24 + 16 + 16 * d;  // head 0's gram
  for (const size_t offset : {size_t{24 + 8}, gram0 + 8 * 3, 24 + 3 * per_head + 16 + 8}) {
    for (const double bad :
         {std::numeric_limits<double>::quiet_NaN(), -std::numeric_limits<double>::infinity()}) {
      std::vector<uint8_t> bytes = good;
      std::memcpy(bytes.data() + offset, &bad, 8);
      FixChecksum(&bytes);
      auto c = VectorCalibrator::Deserialize(bytes);
      EXPECT_EQ(c.status().code(), StatusCode::kDataLoss) << "offset " << offset;
      EXPECT_THAT(c.status().message(), HasSubstr("non-finite accumulator"));
    }
  }

  // Finite accumulators whose fit overflows float32 (a cross sum of 1e300 over a Gram of ~64):
  // Solve refuses instead of returning infinite W.
  std::vector<uint8_t> huge = good;
  const double big = 1e300;
  const size_t cross0 = gram0 + 8 * d * d;
  for (int i = 0; i < d * d; ++i) std::memcpy(huge.data() + cross0 + 8 * i, &big, 8);
  FixChecksum(&huge);
  auto loaded = VectorCalibrator::Deserialize(huge);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto overflow = loaded->Solve();
  EXPECT_EQ(overflow.status().code(), StatusCode::kFailedPrecondition) << overflow.status();
  EXPECT_THAT(overflow.status().message(),
              HasSubstr("fit of layer 0 head 0 is not finite in float32"));
}

// -------------------------------------------------------------------------------------------
// Residuals and rebuild

TEST(VectorResiduals, MatchFloat64Reference) {
  for (int d : {64, 128}) {
    for (int64_t n : {1, 17, 255, 257, 4096}) {
      std::mt19937_64 rng(n * 1000 + d);
      Matrix k = RandomMatrix(n, d, &rng);
      Matrix v = RandomMatrix(n, d, &rng);
      Matrix w = RandomMatrix(d, d, &rng, 1.0f / std::sqrt(float(d)));
      std::vector<float> res(n);
      ASSERT_TRUE(VectorResiduals(k.View(), v.View(), w.View(), res).ok());
      Matrix rebuilt(n, d);
      ASSERT_TRUE(RebuildValues(k.View(), w.View(), rebuilt.View()).ok());
      for (int64_t i = 0; i < n; ++i) {
        // Both are float32 sgemm (any BLAS kernel and blocking) against float64 sums of the same
        // float32 inputs: each p = sum_c w_rc k_c is a d-term dot product, within
        // (d + 1) u sum_c |w_rc k_c| (worst case, see reference.h). The residual is a d-term
        // float32 sum of squared differences, each difference off by that bound.
        double ref = 0.0, res_bound = 0.0;
        for (int r = 0; r < d; ++r) {
          double p = 0.0, l1 = 0.0;
          for (int c = 0; c < d; ++c) {
            p += double(w.Row(r)[c]) * k.Row(i)[c];
            l1 += std::abs(double(w.Row(r)[c]) * k.Row(i)[c]);
          }
          const double p_bound = testing::SumErrorBound(d, l1);
          ASSERT_NEAR(rebuilt.Row(i)[r], p, p_bound) << "d=" << d;
          const double diff = v.Row(i)[r] - p;
          ref += diff * diff;
          // (diff + e)^2 - diff^2 = 2 diff e + e^2, e <= p_bound + u |diff| (the subtraction).
          const double e = p_bound + testing::kF32Unit * std::abs(diff);
          res_bound += 2 * std::abs(diff) * e + e * e;
        }
        res_bound += testing::SumErrorBound(d, ref);
        ASSERT_NEAR(res[i], ref, res_bound) << "n=" << n << " i=" << i;
      }
    }
  }
}

TEST(VectorResiduals, RejectBadInput) {
  std::mt19937_64 rng(2);
  Matrix k = RandomMatrix(8, 64, &rng), v = RandomMatrix(8, 64, &rng),
         w = RandomMatrix(64, 64, &rng);
  std::vector<float> res(7);
  EXPECT_THAT(VectorResiduals(k.View(), v.View(), w.View(), res).message(), HasSubstr("residuals"));
  res.resize(8);
  w.values[3] = NAN;
  Status s = VectorResiduals(k.View(), v.View(), w.View(), res);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("w"));
  Matrix w2 = RandomMatrix(32, 64, &rng);
  Matrix out(8, 64);
  EXPECT_EQ(RebuildValues(k.View(), w2.View(), out.View()).code(), StatusCode::kInvalidArgument);
}

// -------------------------------------------------------------------------------------------
// Routing

TEST(VectorRouting, HalfPairBudgetIsExact) {
  for (double p_c : {0.25, 0.5, 0.75, 0.9}) {
    for (int64_t n : {1, 2, 3, 5, 7, 64, 100, 999, 4095, 4096}) {
      auto b = ComputeRouteBudget(n, 0, {.p_c = p_c});
      ASSERT_TRUE(b.ok()) << b.status();
      const int64_t m = std::llround((1.0 - p_c) * n);
      EXPECT_EQ(b->half_pairs(), 2 * m) << "p_c=" << p_c << " n=" << n;
      EXPECT_EQ(b->keys(), b->key_only + b->key_value);
      EXPECT_LE(b->pool, n);
      EXPECT_GE(b->key_value, 0);
      EXPECT_EQ(b->key_only % 2, 0);
    }
  }
  // The paper's p_a at N = 4096: 0.125, 0.25, 0.125, 0.05 -> key-only = 2 p_a N.
  const double expected_pa[] = {0.125, 0.25, 0.125, 0.05};
  const double ratios[] = {0.25, 0.5, 0.75, 0.9};
  for (int i = 0; i < 4; ++i) {
    auto b = ComputeRouteBudget(4096, 0, {.p_c = ratios[i]});
    EXPECT_EQ(b->key_only, 2 * std::llround(expected_pa[i] * 4096)) << ratios[i];
  }
}

TEST(VectorRouting, ForcedTokensShrinkTheApproximationNotTheBudget) {
  // n = 100, p_c = 0.5: M = 50, a = 25 would leave R = 25 < 30 forced: a clamps to 20.
  auto b = ComputeRouteBudget(100, 30, {.p_c = 0.5});
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->key_value, 30);
  EXPECT_EQ(b->key_only, 40);
  EXPECT_EQ(b->half_pairs(), 100);
  auto impossible = ComputeRouteBudget(100, 60, {.p_c = 0.5});
  EXPECT_EQ(impossible.status().code(), StatusCode::kOutOfRange);
  EXPECT_THAT(impossible.status().message(), HasSubstr("cannot keep the 60 forced"));
  EXPECT_EQ(ComputeRouteBudget(100, 0, {.p_c = 1.0}).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(ComputeRouteBudget(100, 0, {.p_c = 0.5, .eps = -1}).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(VectorRouting, DecisionsFollowScoresAndResiduals) {
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int64_t n : {1, 9, 101, 4096}) {
    for (double p_c : {0.25, 0.5, 0.75, 0.9}) {
      std::vector<float> score(n), res(n);
      for (auto& x : score) x = u(rng);
      for (auto& x : res) x = u(rng);
      std::vector<uint8_t> forced(n, 0);
      const int64_t sinks = std::min<int64_t>(n, 4) * (n >= 20);
      for (int64_t i = 0; i < sinks; ++i) forced[i] = 1;
      std::vector<RouteDecision> dec(n);
      auto b = RouteValues(score, res, forced, {.p_c = p_c}, dec);
      ASSERT_TRUE(b.ok()) << b.status();
      int64_t keys = 0, values = 0;
      float min_pool_score = INFINITY, max_evicted_score = -INFINITY;
      float max_key_only_res = -INFINITY, min_kv_res = INFINITY;
      for (int64_t i = 0; i < n; ++i) {
        if (forced[i]) {
          ASSERT_EQ(dec[i], RouteDecision::kKeyValue);
          continue;
        }
        keys += dec[i] != RouteDecision::kEvict;
        values += dec[i] == RouteDecision::kKeyValue;
        if (dec[i] == RouteDecision::kEvict)
          max_evicted_score = std::max(max_evicted_score, score[i]);
        else
          min_pool_score = std::min(min_pool_score, score[i]);
        if (dec[i] == RouteDecision::kKeyOnly)
          max_key_only_res = std::max(max_key_only_res, res[i]);
        if (dec[i] == RouteDecision::kKeyValue) min_kv_res = std::min(min_kv_res, res[i]);
      }
      keys += sinks;
      values += sinks;
      EXPECT_EQ(keys + values, 2 * std::llround((1.0 - p_c) * n));
      EXPECT_EQ(keys, b->keys());
      EXPECT_LE(max_evicted_score, min_pool_score);
      EXPECT_LE(max_key_only_res, min_kv_res);
    }
  }
}

TEST(VectorRouting, RejectsNaNAndSizeMismatch) {
  std::vector<float> score = {1, NAN, 3}, res = {1, 2, 3};
  std::vector<RouteDecision> dec(3);
  auto r = RouteValues(score, res, {}, {.p_c = 0.5}, dec);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("NaN base score at token 1"));
  score[1] = 2;
  std::vector<RouteDecision> short_dec(2);
  EXPECT_EQ(RouteValues(score, res, {}, {.p_c = 0.5}, short_dec).status().code(),
            StatusCode::kInvalidArgument);
}

// -------------------------------------------------------------------------------------------
// CPU vs CUDA (skipped without a device)

TEST(VectorCuda, MatchesCpu) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const ExecOptions gpu{.backend = Backend::kCuda};
  for (int d : {64, 128}) {
    for (int64_t n : {1, 13, 4096}) {
      std::mt19937_64 rng(n + d);
      Matrix k = RandomMatrix(n, d, &rng), v = RandomMatrix(n, d, &rng);
      Matrix w = RandomMatrix(d, d, &rng, 0.1f);
      std::vector<float> rc(n), rg(n);
      ASSERT_TRUE(VectorResiduals(k.View(), v.View(), w.View(), rc).ok());
      ASSERT_TRUE(VectorResiduals(k.View(), v.View(), w.View(), rg, gpu).ok());
      for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(rc[i], rg[i], 1e-4 * (1 + rc[i]));
      Matrix oc(n, d), og(n, d);
      ASSERT_TRUE(RebuildValues(k.View(), w.View(), oc.View()).ok());
      ASSERT_TRUE(RebuildValues(k.View(), w.View(), og.View(), gpu).ok());
      for (size_t i = 0; i < oc.values.size(); ++i) ASSERT_NEAR(oc.values[i], og.values[i], 1e-4);
      auto cc = VectorCalibrator::Create(1, 1, d), cg = VectorCalibrator::Create(1, 1, d);
      ASSERT_TRUE(cc->Add(0, 0, k.View(), v.View()).ok());
      ASSERT_TRUE(cg->Add(0, 0, k.View(), v.View(), gpu).ok());
      for (size_t i = 0; i < cc->Head(0, 0).gram.size(); ++i) {
        ASSERT_NEAR(cc->Head(0, 0).gram[i], cg->Head(0, 0).gram[i], 1e-9 * n);
        ASSERT_NEAR(cc->Head(0, 0).cross[i], cg->Head(0, 0).cross[i], 1e-9 * n);
      }
      EXPECT_NEAR(cc->Head(0, 0).value_sq_sum, cg->Head(0, 0).value_sq_sum, 1e-9 * n * d);
    }
  }
}

TEST(VectorCuda, UnavailableWithoutDevice) {
  if (CudaDeviceAvailable()) GTEST_SKIP() << "a CUDA device is present";
  Matrix k(2, 64), v(2, 64), w(64, 64);
  std::vector<float> res(2);
  Status s = VectorResiduals(k.View(), v.View(), w.View(), res, {.backend = Backend::kCuda});
#ifdef KVD_HAVE_CUDA
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
#else
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
#endif
}

}  // namespace
}  // namespace kvd::kernels

// LoadBlas loads the CBLAS library the VECTOR kernels call (kvd calls it at start for a policy
// that routes): OK, the library is mapped afterwards, and a second call is OK without loading
// another.
TEST(VectorBlas, LoadBlasMapsTheLibraryTheKernelsCall) {
  const auto blas_mappings = [] {
    std::ifstream maps("/proc/self/maps");
    std::string line;
    int n = 0;
    while (std::getline(maps, line)) {
      if (line.find("blas") != std::string::npos) ++n;
    }
    return n;
  };
  ASSERT_TRUE(kvd::kernels::LoadBlas().ok());
  const int mapped = blas_mappings();
  EXPECT_GT(mapped, 0) << "LoadBlas returned OK but no BLAS library is mapped";
  ASSERT_TRUE(kvd::kernels::LoadBlas().ok());
  EXPECT_EQ(blas_mappings(), mapped);
}

// The kernels parallelize over heads themselves: when they bring OpenBLAS into the process,
// each BLAS call runs on the calling thread (one thread) unless the environment chose a count.
// This binary does not link a BLAS library, so the kernels are the ones loading it.
TEST(VectorBlas, OneBlasThreadPerCallUnlessTheEnvironmentChooses) {
  ASSERT_TRUE(kvd::kernels::LoadBlas().ok());
  const int threads = kvd::kernels::BlasThreads();
  if (threads == 0) GTEST_SKIP() << "the CBLAS library does not report its thread count";
  for (const char* name : {"OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"}) {
    if (std::getenv(name) != nullptr) GTEST_SKIP() << name << " is set: the library follows it";
  }
  EXPECT_EQ(threads, 1);
}
