// The affine VECTOR map v ~= W kpre + b (VectorSolveOptions::affine): the solve against an
// independent float64 least-squares solve of the augmented key [kpre; 1], residuals and rebuild
// with the intercept, and the versioned formats (affine weights are version 2, linear weights stay
// version 1, version-1 accumulators load but refuse the affine solve).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kvd/common/hash.h"
#include "kvd/kernels/vector.h"
#include "reference.h"

namespace kvd::kernels {
namespace {

using ::testing::HasSubstr;

// Keys with a shared mean direction (as real pre-RoPE keys have), values affine in them plus
// noise: v = A k + b0 + noise.
struct AffineData {
  Matrix k, v, a;
  std::vector<float> b0;
};

AffineData MakeData(int64_t n, int d, uint64_t seed, float noise) {
  AffineData x;
  const Matrix mu = testing::RandomMatrix(1, d, seed, 3.0f);
  x.k = testing::RandomMatrix(n, d, seed + 1);
  for (int64_t i = 0; i < n; ++i)
    for (int c = 0; c < d; ++c) x.k.Row(i)[c] += mu.Row(0)[c];
  x.a = testing::RandomMatrix(d, d, seed + 2, 1.0f / std::sqrt(float(d)));
  const Matrix b = testing::RandomMatrix(1, d, seed + 3, 2.0f);
  x.b0.assign(b.values.begin(), b.values.end());
  const Matrix e = testing::RandomMatrix(n, d, seed + 4, noise);
  x.v = Matrix(n, d);
  for (int64_t i = 0; i < n; ++i) {
    for (int r = 0; r < d; ++r) {
      double s = x.b0[r];
      for (int c = 0; c < d; ++c) s += double(x.a.Row(r)[c]) * x.k.Row(i)[c];
      x.v.Row(i)[r] = static_cast<float>(s) + e.Row(i)[r];
    }
  }
  return x;
}

// Float64 reference: minimise sum_i |v_i - W k_i - b|^2 + lambda |W|_F^2 (intercept unpenalised)
// through the normal equations of the augmented key [k; 1], solved by Gaussian elimination with
// partial pivoting; lambda = ridge * trace(centred Gram) / d (VectorSolveOptions with
// ridge_relative). Returns W [d, d] and b [d] in float64, and R^2 = 1 - SSE / SST.
struct RefFit {
  std::vector<double> w, b;
  double r2 = 0.0;
};

RefFit RefAffineSolve(const Matrix& k, const Matrix& v, double ridge) {
  const int64_t n = k.rows;
  const int d = static_cast<int>(k.cols), m = d + 1;
  std::vector<double> kmean(d, 0.0), vmean(d, 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int c = 0; c < d; ++c)
      kmean[c] += k.Row(i)[c] / double(n), vmean[c] += v.Row(i)[c] / double(n);
  double trace_c = 0.0;
  for (int64_t i = 0; i < n; ++i)
    for (int c = 0; c < d; ++c) trace_c += std::pow(k.Row(i)[c] - kmean[c], 2);
  const double lambda = ridge * trace_c / d;
  // [A | Y]: A = sum x x^T (+ lambda on the W block), Y = sum x v^T, x = [k; 1].
  std::vector<double> a(static_cast<size_t>(m) * m, 0.0), y(static_cast<size_t>(m) * d, 0.0);
  std::vector<double> x(m);
  for (int64_t i = 0; i < n; ++i) {
    for (int c = 0; c < d; ++c) x[c] = k.Row(i)[c];
    x[d] = 1.0;
    for (int r = 0; r < m; ++r) {
      for (int c = 0; c < m; ++c) a[r * m + c] += x[r] * x[c];
      for (int c = 0; c < d; ++c) y[r * d + c] += x[r] * v.Row(i)[c];
    }
  }
  for (int r = 0; r < d; ++r) a[r * m + r] += lambda;
  for (int col = 0; col < m; ++col) {
    int piv = col;
    for (int r = col + 1; r < m; ++r)
      if (std::abs(a[r * m + col]) > std::abs(a[piv * m + col])) piv = r;
    for (int c = 0; c < m; ++c) std::swap(a[col * m + c], a[piv * m + c]);
    for (int c = 0; c < d; ++c) std::swap(y[col * d + c], y[piv * d + c]);
    for (int r = 0; r < m; ++r) {
      if (r == col) continue;
      const double f = a[r * m + col] / a[col * m + col];
      for (int c = 0; c < m; ++c) a[r * m + c] -= f * a[col * m + c];
      for (int c = 0; c < d; ++c) y[r * d + c] -= f * y[col * d + c];
    }
  }
  RefFit fit;
  fit.w.assign(static_cast<size_t>(d) * d, 0.0);
  fit.b.assign(d, 0.0);
  for (int r = 0; r < m; ++r) {
    for (int c = 0; c < d; ++c) {
      const double sol = y[r * d + c] / a[r * m + r];  // X[r][c]: row r of [W^T; b^T]
      if (r < d)
        fit.w[c * d + r] = sol;
      else
        fit.b[c] = sol;
    }
  }
  double sse = 0.0, sst = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    for (int r = 0; r < d; ++r) {
      double p = fit.b[r];
      for (int c = 0; c < d; ++c) p += fit.w[r * d + c] * k.Row(i)[c];
      sse += std::pow(v.Row(i)[r] - p, 2);
      sst += std::pow(v.Row(i)[r] - vmean[r], 2);
    }
  }
  fit.r2 = 1.0 - sse / sst;
  return fit;
}

TEST(VectorAffine, SolveMatchesAFloat64AugmentedReference) {
  for (int d : {16, 64}) {
    for (double ridge : {0.0, 1e-3}) {
      const AffineData x = MakeData(4 * d + 3, d, 40 + d, 0.3f);
      auto cal = VectorCalibrator::Create(1, 1, d);
      ASSERT_TRUE(cal.ok());
      // Two batches: the key sums, like the Gram, add across batches.
      const int64_t half = x.k.rows / 2;
      ASSERT_TRUE(
          cal->Add(0, 0, {x.k.values.data(), half, d, d}, {x.v.values.data(), half, d, d}).ok());
      ASSERT_TRUE(cal->Add(0, 0, {x.k.Row(half), x.k.rows - half, d, d},
                           {x.v.Row(half), x.k.rows - half, d, d})
                      .ok());
      auto w = cal->Solve({.ridge = ridge, .affine = true});
      ASSERT_TRUE(w.ok()) << w.status();
      ASSERT_TRUE(w->affine());
      const RefFit ref = RefAffineSolve(x.k, x.v, ridge);
      const VectorHeadFit& fit = w->Head(0, 0);
      // Both solve well-conditioned float64 systems of the same float32 data (keys with mean 3
      // and spread 1: the centred Gram loses about one digit to cancellation, 1e-15 -> 1e-14);
      // the kernel then rounds W and b to float32 (relative 6e-8). |W| ~ 1/sqrt(d), |b| ~ 2.
      double w_err = 0.0, b_err = 0.0, b_mag = 0.0;
      for (int r = 0; r < d; ++r) {
        for (int c = 0; c < d; ++c) {
          w_err = std::max(w_err, std::abs(fit.w.Row(r)[c] - ref.w[r * d + c]));
        }
        b_err = std::max(b_err, std::abs(fit.bias[r] - ref.b[r]));
        b_mag = std::max(b_mag, std::abs(ref.b[r]));
      }
      EXPECT_LT(w_err, 1e-6) << "d=" << d << " ridge=" << ridge;
      EXPECT_LT(b_err, 1e-6 * (1.0 + b_mag)) << "d=" << d << " ridge=" << ridge;
      // R^2 from the centred accumulators against the direct float64 residual sum.
      EXPECT_NEAR(fit.r2, ref.r2, 1e-9) << "d=" << d << " ridge=" << ridge;
      EXPECT_GT(fit.r2, 0.5);
      // The linear fit of the same data cannot absorb the offset: its R^2 is lower.
      auto lin = cal->Solve({.ridge = ridge});
      ASSERT_TRUE(lin.ok());
      EXPECT_TRUE(lin->Head(0, 0).bias.empty());
      EXPECT_LT(lin->Head(0, 0).r2, fit.r2);
    }
  }
}

TEST(VectorAffine, ResidualsAndRebuildAddTheIntercept) {
  const int d = 32;
  const AffineData x = MakeData(77, d, 9, 0.5f);
  auto cal = VectorCalibrator::Create(1, 1, d);
  ASSERT_TRUE(cal->Add(0, 0, x.k.View(), x.v.View()).ok());
  auto w = cal->Solve({.affine = true});
  ASSERT_TRUE(w.ok()) << w.status();
  const VectorHeadFit& fit = w->Head(0, 0);
  std::vector<float> res(x.k.rows);
  Matrix out(x.k.rows, d);
  ASSERT_TRUE(VectorResiduals(x.k.View(), x.v.View(), fit, res).ok());
  ASSERT_TRUE(RebuildValues(x.k.View(), fit, out.View()).ok());
  for (int64_t i = 0; i < x.k.rows; ++i) {
    double ref = 0.0, scale = 0.0;
    for (int r = 0; r < d; ++r) {
      double p = fit.bias[r];
      for (int c = 0; c < d; ++c) p += double(fit.w.Row(r)[c]) * x.k.Row(i)[c];
      // float32 dot products of d = 32 terms with |k| ~ 3: ~d * 2^-24 * sum|w||k| ~ 1e-5.
      ASSERT_NEAR(out.Row(i)[r], p, 2e-5 * (1.0 + std::abs(p))) << i;
      ref += std::pow(x.v.Row(i)[r] - p, 2);
      scale += std::pow(x.v.Row(i)[r], 2) + p * p;
    }
    ASSERT_NEAR(res[i], ref, 1e-5 * scale) << i;
  }
  VectorHeadFit bad = fit;
  bad.bias.pop_back();
  Status s = RebuildValues(x.k.View(), bad, out.View());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("bias has 31 entries, expected 0 or 32"));
  bad = fit;
  bad.bias[3] = NAN;
  s = VectorResiduals(x.k.View(), x.v.View(), bad, res);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("non-finite bias"));
}

TEST(VectorAffine, WeightsFormatIsVersionedAndOldWeightsStillLoad) {
  const int d = 16;
  const AffineData x = MakeData(200, d, 3, 0.2f);
  auto cal = VectorCalibrator::Create(1, 2, d);
  ASSERT_TRUE(cal->Add(0, 0, x.k.View(), x.v.View()).ok());
  ASSERT_TRUE(cal->Add(0, 1, x.k.View(), x.v.View()).ok());
  auto lin = cal->Solve();
  auto aff = cal->Solve({.affine = true});
  ASSERT_TRUE(lin.ok() && aff.ok());
  // Linear weights keep the version-1 layout, so what older builds wrote and read is unchanged:
  // 32-byte header + 8 version digest, per head count + r2 + W, 8-byte checksum.
  const std::vector<uint8_t> lb = lin->Serialize();
  uint16_t version = 0;
  std::memcpy(&version, lb.data() + 4, 2);
  EXPECT_EQ(version, 1);
  EXPECT_EQ(lb.size(), 32u + 2 * (16 + 4 * d * d) + 8);
  const std::vector<uint8_t> ab = aff->Serialize();
  std::memcpy(&version, ab.data() + 4, 2);
  EXPECT_EQ(version, 2);
  EXPECT_EQ(ab.size(), 32u + 2 * (16 + 4 * d * d + 4 * d) + 8);
  auto back = VectorWeights::Deserialize(ab);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->Head(0, 1).bias, aff->Head(0, 1).bias);
  EXPECT_EQ(back->version, aff->version);
  auto lback = VectorWeights::Deserialize(lb);
  ASSERT_TRUE(lback.ok()) << lback.status();
  EXPECT_FALSE(lback->affine());
  // The version digest covers the intercept: a chunk compressed with one b is not served with
  // another.
  VectorWeights other = *aff;
  other.heads[1].bias[0] += 1.0f;
  EXPECT_NE(other.ComputeVersion(), aff->version);
  std::vector<uint8_t> tampered = ab;
  tampered[ab.size() - 8 - 1] ^= 0x01;  // a byte of the last head's b, then fix the checksum
  const uint64_t sum = Checksum64(tampered.data(), tampered.size() - 8);
  std::memcpy(tampered.data() + tampered.size() - 8, &sum, 8);
  auto t = VectorWeights::Deserialize(tampered);
  EXPECT_EQ(t.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(t.status().message(), HasSubstr("version digest"));
}

// Version-1 accumulator bytes (no key sums) from a version-2 serialisation: drop each head's key
// sums, set the version, recompute the checksum.
std::vector<uint8_t> AsVersion1(const std::vector<uint8_t>& v2, int heads, int d) {
  constexpr size_t kHeader = 4 + 2 + 2 + 4 * 4;
  std::vector<uint8_t> out(v2.begin(), v2.begin() + kHeader);
  const uint16_t one = 1;
  std::memcpy(out.data() + 4, &one, 2);
  size_t off = kHeader;
  for (int h = 0; h < heads; ++h) {
    const size_t lead = 16 + 8 * d;  // count, value_sq_sum, value_sum
    out.insert(out.end(), v2.begin() + off, v2.begin() + off + lead);
    off += lead + 8 * d;                // skip key_sum
    const size_t tail = 16ull * d * d;  // gram, cross
    out.insert(out.end(), v2.begin() + off, v2.begin() + off + tail);
    off += tail;
  }
  const uint64_t sum = Checksum64(out.data(), out.size());
  out.resize(out.size() + 8);
  std::memcpy(out.data() + out.size() - 8, &sum, 8);
  return out;
}

TEST(VectorAffine, Version1AccumulatorsLoadButRefuseTheAffineSolve) {
  const int d = 16;
  const AffineData x = MakeData(100, d, 5, 0.2f);
  auto cal = VectorCalibrator::Create(1, 1, d);
  ASSERT_TRUE(cal->Add(0, 0, x.k.View(), x.v.View()).ok());
  const std::vector<uint8_t> v2 = cal->Serialize();
  auto back2 = VectorCalibrator::Deserialize(v2);
  ASSERT_TRUE(back2.ok()) << back2.status();
  EXPECT_TRUE(back2->key_sums_known());
  EXPECT_EQ(back2->Head(0, 0).key_sum, cal->Head(0, 0).key_sum);

  auto back1 = VectorCalibrator::Deserialize(AsVersion1(v2, 1, d));
  ASSERT_TRUE(back1.ok()) << back1.status();
  EXPECT_FALSE(back1->key_sums_known());
  EXPECT_EQ(back1->Head(0, 0).gram, cal->Head(0, 0).gram);
  auto lin = back1->Solve();
  ASSERT_TRUE(lin.ok()) << lin.status();
  EXPECT_EQ(lin->Head(0, 0).w.values, cal->Solve()->Head(0, 0).w.values);
  auto aff = back1->Solve({.affine = true});
  EXPECT_EQ(aff.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(aff.status().message(), HasSubstr("affine fit needs key sums"));
  // Merging version-1 statistics into fresh ones taints the result the same way.
  auto fresh = VectorCalibrator::Create(1, 1, d);
  ASSERT_TRUE(fresh->Merge(*back1).ok());
  EXPECT_FALSE(fresh->key_sums_known());
}

}  // namespace
}  // namespace kvd::kernels
