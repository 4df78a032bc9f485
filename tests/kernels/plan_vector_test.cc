// VECTOR variants of the compression plan: adaptive routing (plan.h, route_adaptive) with every
// decision checked against an independent float64 reference of the attention-weighted relative
// residual and of the budget rule, the R^2 floor, and the affine map served end to end
// (compress -> serve: rebuilt values carry the intercept).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <vector>

#include "kvd/kernels/plan.h"
#include "kvd/kernels/rope.h"
#include "kvd/kernels/serving.h"
#include "raw_layer.h"
#include "reference.h"

namespace kvd::kernels {
namespace {

using ::testing::HasSubstr;
using testing::RefMatrix;

constexpr int kHeads = 2, kGroup = 2, kDim = 16;
constexpr int64_t kN = 96, kWindow = 8, kSinks = 2, kFirstPosition = 100;

// One layer, two KV heads, float32 (the raw bytes are exactly the floats the reference reads).
// Keys share a mean direction; values are affine in the keys plus noise: head 0 little noise
// (high R^2), head 1 much (low R^2). Window queries are peaked (stddev 1.5) so that the window
// mass varies across tokens.
struct VectorChunk {
  ModelLayout layout = testing::Float32Layer(kHeads, kGroup, kDim);
  std::vector<int64_t> positions = testing::SequentialPositions(kN, kFirstPosition);
  std::vector<uint8_t> raw;
  std::vector<Matrix> kpre, keys_post, values, queries;  // per head
  std::vector<ConstMatrixView> query_views;

  VectorChunk(uint64_t seed, float value_offset, std::vector<float> noise) {
    auto rope = RopeTable::Create(layout.rope, kDim);
    EXPECT_TRUE(rope.ok());
    raw.assign(layout.ChunkBytes(static_cast<int>(kN)), 0);
    for (int h = 0; h < kHeads; ++h) {
      const uint64_t s = seed * 10 + h;
      const Matrix mu = testing::RandomMatrix(1, kDim, s + 50, 2.0f);
      Matrix kp = testing::RandomMatrix(kN, kDim, s);
      for (int64_t i = 0; i < kN; ++i)
        for (int c = 0; c < kDim; ++c) kp.Row(i)[c] += mu.Row(0)[c];
      const Matrix a = testing::RandomMatrix(kDim, kDim, s + 60, 0.3f);
      const Matrix e = testing::RandomMatrix(kN, kDim, s + 70, noise[h]);
      Matrix v(kN, kDim);
      for (int64_t i = 0; i < kN; ++i) {
        for (int r = 0; r < kDim; ++r) {
          double acc = value_offset;
          for (int c = 0; c < kDim; ++c) acc += double(a.Row(r)[c]) * kp.Row(i)[c];
          v.Row(i)[r] = static_cast<float>(acc) + e.Row(i)[r];
        }
      }
      Matrix kpost(kN, kDim);
      EXPECT_TRUE(
          ApplyRope(*rope, RopeDirection::kRotate, positions, kp.View(), kpost.View()).ok());
      queries.push_back(testing::RandomMatrix(kWindow * kGroup, kDim, s + 80, 1.5f));
      kpre.push_back(std::move(kp));
      keys_post.push_back(std::move(kpost));
      values.push_back(std::move(v));
    }
    testing::WriteFloat32Layer(layout, 0, kN, keys_post, values, &raw);
    for (const Matrix& q : queries) query_views.push_back(q.View());
  }

  StatusOr<VectorWeights> Calibrate(bool affine) const {
    return testing::CalibrateOnChunk(layout, raw, positions, {.ridge = 1e-6, .affine = affine});
  }

  CompressionInput Input(const VectorWeights* w) const {
    CompressionInput in;
    in.raw = raw;
    in.positions = positions;
    in.window_queries = query_views;
    in.weights = w;
    return in;
  }

  // Float64 reference of e_j (plan.h) for every token of head h.
  std::vector<double> RefRouteError(int h, const VectorHeadFit& fit) const {
    const RefMatrix q = testing::ToRef(queries[h].View());
    const RefMatrix k = testing::ToRef(keys_post[h].View());
    const std::vector<double> mass =
        testing::RefAttentionMass(q, kGroup, k, {}, testing::RefMask::kCausalWindow);
    double mean_mass = 0.0;
    for (double m : mass) mean_mass += m / kN;
    std::vector<double> vmean(kDim, 0.0);
    for (int64_t i = 0; i < kN; ++i)
      for (int c = 0; c < kDim; ++c) vmean[c] += values[h].Row(i)[c] / double(kN);
    double sv = 0.0;
    for (int64_t i = 0; i < kN; ++i)
      for (int c = 0; c < kDim; ++c) sv += std::pow(values[h].Row(i)[c] - vmean[c], 2) / kN;
    std::vector<double> e(kN);
    for (int64_t i = 0; i < kN; ++i) {
      double res = 0.0;
      for (int r = 0; r < kDim; ++r) {
        double p = fit.bias.empty() ? 0.0 : fit.bias[r];
        for (int c = 0; c < kDim; ++c) p += double(fit.w.Row(r)[c]) * kpre[h].Row(i)[c];
        res += std::pow(values[h].Row(i)[r] - p, 2);
      }
      e[i] = mass[i] / mean_mass * res / sv;
    }
    return e;
  }
};

bool IsForced(int64_t i) { return i < kSinks || i >= kN - kWindow; }

// The recency pool of P slots: the sinks and the latest P - sinks tokens.
std::vector<int64_t> RecencyPool(int64_t p) {
  std::vector<int64_t> pool;
  for (int64_t i = 0; i < kSinks; ++i) pool.push_back(i);
  for (int64_t i = kN - (p - kSinks); i < kN; ++i) pool.push_back(i);
  return pool;
}

// Every decision of adaptive routing against the reference: with the recency score the pool of
// M + a' slots is known exactly, so the reference computes a' (the largest a' <= a whose pool has
// 2a' non-forced tokens with e_j <= threshold) and the routed set (the 2a' smallest e_j of them).
TEST(PlanAdaptiveRoute, EveryDecisionMatchesAFloat64Reference) {
  const VectorChunk chunk(7, 1.5f, {0.3f, 0.6f});
  int checked_sets = 0, lowered = 0, full = 0;
  for (bool affine : {false, true}) {
    auto w = chunk.Calibrate(affine);
    ASSERT_TRUE(w.ok()) << w.status();
    for (double p_c : {0.5, 0.75}) {
      for (double quantile : {0.1, 0.3, 0.6, 1.0}) {
        for (int h = 0; h < kHeads; ++h) {
          const std::vector<double> e = chunk.RefRouteError(h, w->Head(0, h));
          // Threshold halfway between two consecutive non-forced e_j (quantile 1: above all), so
          // that no token sits within float32 rounding of it.
          std::vector<double> sorted;
          for (int64_t i = 0; i < kN; ++i)
            if (!IsForced(i)) sorted.push_back(e[i]);
          std::sort(sorted.begin(), sorted.end());
          // (from the quantile upwards, the first gap of >= 1% between neighbours).
          size_t at = std::min(sorted.size() - 1, size_t(quantile * (sorted.size() - 1)));
          while (at + 1 < sorted.size() && sorted[at + 1] < 1.01 * sorted[at]) ++at;
          const double thr =
              at + 1 < sorted.size() ? 0.5 * (sorted[at] + sorted[at + 1]) : 2.0 * sorted.back();

          CompressionPlanOptions o{.score = ScoreStage::kNone,
                                   .route = RouteStage::kVector,
                                   .p_c = p_c,
                                   .window = kWindow,
                                   .sinks = kSinks};
          o.route_adaptive = true;
          o.route_max_error = thr;
          o.route_min_r2 = -1.0;
          CompressionStats stats;
          auto out = Compress(o, chunk.layout, chunk.Input(&*w), &stats);
          ASSERT_TRUE(out.ok()) << out.status();
          const CompactHead& ch = out->Head(0, h);

          const int64_t m = std::llround((1.0 - p_c) * kN);
          auto budget = ComputeRouteBudget(kN, kSinks + kWindow, {.p_c = p_c, .kept_pairs = m});
          ASSERT_TRUE(budget.ok());
          const int64_t a = budget->key_only / 2;
          auto passing = [&](int64_t pool) {
            std::vector<int64_t> pass;
            for (int64_t i : RecencyPool(pool))
              if (!IsForced(i) && e[i] <= thr) pass.push_back(i);
            return pass;
          };
          int64_t ap = a;
          while (ap > 0 && static_cast<int64_t>(passing(m + ap).size()) < 2 * ap) --ap;
          lowered += ap < a;
          full += ap == a;

          // Kept keys: exactly the pool of M + a' slots; half-pairs exactly 2M.
          std::set<int64_t> kept;
          for (int64_t j = 0; j < ch.slots(); ++j) kept.insert(ch.positions[j] - kFirstPosition);
          std::vector<int64_t> pool = RecencyPool(m + ap);
          ASSERT_EQ(kept, std::set<int64_t>(pool.begin(), pool.end()))
              << "affine=" << affine << " p_c=" << p_c << " q=" << quantile << " head " << h;
          ASSERT_EQ(ch.slots() + ch.value_slots(), 2 * m);

          // Routed: the 2a' smallest e_j among the passing pool tokens, each <= threshold.
          std::vector<int64_t> pass = passing(m + ap);
          std::sort(pass.begin(), pass.end(), [&](int64_t x, int64_t y) { return e[x] < e[y]; });
          std::set<int64_t> routed;
          for (int64_t j = 0; j < ch.slots(); ++j) {
            if (ch.flags[j] & kSlotRebuildValue) routed.insert(ch.positions[j] - kFirstPosition);
          }
          ASSERT_EQ(static_cast<int64_t>(routed.size()), 2 * ap);
          for (int64_t i : routed) ASSERT_LE(e[i], thr) << "token " << i;
          // The exact set, unless the 2a'-th and (2a'+1)-th errors are within float32 rounding.
          if (ap > 0 && (static_cast<int64_t>(pass.size()) == 2 * ap ||
                         e[pass[2 * ap]] - e[pass[2 * ap - 1]] > 1e-3 * e[pass[2 * ap]])) {
            EXPECT_EQ(routed, std::set<int64_t>(pass.begin(), pass.begin() + 2 * ap));
            ++checked_sets;
          }
        }
      }
    }
  }
  // The cases cover both outcomes of the budget rule, and most sets were compared exactly.
  EXPECT_GT(lowered, 4);
  EXPECT_GT(full, 4);
  EXPECT_GT(checked_sets, 20);
}

TEST(PlanAdaptiveRoute, HeadsBelowTheR2FloorRouteNothing) {
  const VectorChunk chunk(11, 1.0f, {0.2f, 3.0f});
  auto w = chunk.Calibrate(false);
  ASSERT_TRUE(w.ok()) << w.status();
  const double r2_good = w->Head(0, 0).r2, r2_bad = w->Head(0, 1).r2;
  ASSERT_GT(r2_good, r2_bad + 0.2);
  CompressionPlanOptions o{.score = ScoreStage::kSnapKv,
                           .route = RouteStage::kVector,
                           .p_c = 0.5,
                           .window = kWindow,
                           .sinks = kSinks};
  o.route_adaptive = true;
  o.route_max_error = 1e30;  // every token passes: only the floor decides
  o.route_min_r2 = 0.5 * (r2_good + r2_bad);
  CompressionStats stats;
  auto out = Compress(o, chunk.layout, chunk.Input(&*w), &stats);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(stats.route_floor_heads, 1);
  const int64_t m = kN / 2;
  // Head 0 routes the full 2a; head 1 is plain SnapKV eviction, slot for slot.
  auto budget = ComputeRouteBudget(kN, kSinks + kWindow, {.p_c = 0.5, .kept_pairs = m});
  EXPECT_EQ(out->Head(0, 0).slots() - out->Head(0, 0).value_slots(), budget->key_only);
  CompressionPlanOptions evict = o;
  evict.route = RouteStage::kNone;
  evict.route_adaptive = false;
  auto plain = Compress(evict, chunk.layout, chunk.Input(nullptr));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(out->Head(0, 1).positions, plain->Head(0, 1).positions);
  EXPECT_EQ(out->Head(0, 1).values, plain->Head(0, 1).values);
  for (uint8_t f : out->Head(0, 1).flags) EXPECT_EQ(f & kSlotRebuildValue, 0);
  for (int h = 0; h < kHeads; ++h) {
    EXPECT_EQ(out->Head(0, h).slots() + out->Head(0, h).value_slots(), 2 * m);
  }
  // A floor above every head: nothing is routed anywhere.
  o.route_min_r2 = 1.0;
  auto none = Compress(o, chunk.layout, chunk.Input(&*w), &stats);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->Head(0, 0).positions, plain->Head(0, 0).positions);
}

TEST(PlanAdaptiveRoute, ValidateRejectsBadOptions) {
  CompressionPlanOptions o;
  o.route_adaptive = true;
  Status s = o.Validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("route_adaptive needs route kVector"));
  o.route = RouteStage::kVector;
  EXPECT_TRUE(o.Validate().ok());
  o.route_max_error = -0.1;
  EXPECT_THAT(o.Validate().message(), HasSubstr("route_max_error must be finite and >= 0"));
  o.route_max_error = NAN;
  EXPECT_THAT(o.Validate().message(), HasSubstr("route_max_error"));
  o.route_max_error = 0.05;
  o.route_min_r2 = 1.5;
  EXPECT_THAT(o.Validate().message(), HasSubstr("route_min_r2 must be finite and <= 1"));
}

// The affine map end to end: values that are exactly affine in the keys (offset 4) are rebuilt
// at serve time to float32 accuracy with affine weights; the linear map of the same data is off.
TEST(PlanAffine, RoutedValuesAreRebuiltWithTheIntercept) {
  const VectorChunk chunk(5, 4.0f, {0.0f, 0.0f});
  auto rope = RopeTable::Create(chunk.layout.rope, kDim);
  ASSERT_TRUE(rope.ok());
  double linear_worst = 0.0;
  for (bool affine : {true, false}) {
    auto w = chunk.Calibrate(affine);
    ASSERT_TRUE(w.ok()) << w.status();
    CompressionPlanOptions o{.score = ScoreStage::kSnapKv,
                             .route = RouteStage::kVector,
                             .p_c = 0.5,
                             .window = kWindow,
                             .sinks = kSinks};
    auto out = Compress(o, chunk.layout, chunk.Input(&*w));
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->codec.calibration_version, w->version);
    for (int h = 0; h < kHeads; ++h) {
      auto sh = BuildServingHead(*out, 0, h, &*rope, &*w);
      ASSERT_TRUE(sh.ok()) << sh.status();
      const CompactHead& ch = out->Head(0, h);
      int64_t rebuilt = 0;
      for (int64_t j = 0; j < ch.slots(); ++j) {
        if (!(ch.flags[j] & kSlotRebuildValue)) continue;
        ++rebuilt;
        const int64_t token = ch.positions[j] - kFirstPosition;
        for (int c = 0; c < kDim; ++c) {
          const double want = chunk.values[h].Row(token)[c];
          const double err = std::abs(sh->values.Row(j)[c] - want);
          // Affine: RoPE round trip + float32 solve and rebuild, ~1e-5 of |v| ~ 5.
          if (affine) ASSERT_LT(err, 1e-3 * (1.0 + std::abs(want))) << "slot " << j << " c " << c;
          if (!affine) linear_worst = std::max(linear_worst, err);
        }
      }
      EXPECT_GT(rebuilt, 0);
    }
  }
  // Without the intercept the keys' mean direction must stand in for it: visibly worse.
  EXPECT_GT(linear_worst, 0.05);
}

}  // namespace
}  // namespace kvd::kernels
