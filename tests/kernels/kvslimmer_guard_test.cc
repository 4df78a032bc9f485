// KVSlimmer merge weight guards (kvslimmer.h MergeGuard): kClamp, kAlphaFallback and kMean checked
// against an independent float64 computation of the closed form and of each guard's rule, on
// hand-made pairs (the clamp flaw alpha 0.05 / 0.40, a member near alpha 1/2, D <= 0) and on many
// random pairs; and the guards inside a KVSlimmer round (counters, plain-mean keys). The
// centred-similarity gate: CentredCosine / MeanCentredAdjacentCosine and one gated round against
// a float64 reference of which pairs merge and which slot each dropped pair keeps.
// Tolerances: the kernel computes the weights in float64 from float32 values and returns them as
// float32, so weights in [0, 1] agree to float32 rounding (1e-6 absolute); merged keys are one
// float32 FMA of two unit-scale keys (1e-6 absolute).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "kvd/kernels/kvslimmer.h"
#include "reference.h"

namespace kvd::kernels {
namespace {

using ::testing::HasSubstr;

// The reference: weights of the pair (0, 1) of a two-slot set with the given alphas, value
// means v_a, v_b and mean attended value o, for the kL2 closed form and each guard.
struct RefWeights {
  double wa = 0.5, wb = 0.5;
  bool clamp_to_less = false, fallback = false, clamped = false, alpha_fallback = false;
};
RefWeights Reference(const std::vector<double>& va, const std::vector<double>& vb,
                     const std::vector<double>& o, double alpha_a, double alpha_b, MergeGuard guard,
                     double margin) {
  double na = 0, nb = 0, nab = 0;
  for (size_t c = 0; c < o.size(); ++c) {
    na += (va[c] - o[c]) * (va[c] - o[c]);
    nb += (vb[c] - o[c]) * (vb[c] - o[c]);
    nab += (va[c] + vb[c] - 2 * o[c]) * (va[c] + vb[c] - 2 * o[c]);
  }
  const double a =
      std::abs(alpha_a * (1 - 2 * alpha_a)) * std::sqrt(na) - alpha_a * alpha_b * std::sqrt(nab);
  const double b =
      std::abs(alpha_b * (1 - 2 * alpha_b)) * std::sqrt(nb) - alpha_a * alpha_b * std::sqrt(nab);
  RefWeights r;
  const bool degenerate = !(a + b > 1e-30);
  const double wa = degenerate ? 0.5 : a / (a + b);
  const bool outside = !degenerate && (wa < 0 || wa > 1);
  // Clamped, all weight goes to one member: the flaw when that member is the less attended.
  if (outside) r.clamp_to_less = (wa > 1) == (alpha_a < alpha_b) && alpha_a != alpha_b;
  switch (guard) {
    case MergeGuard::kClamp:
      r.fallback = degenerate;
      r.clamped = outside;
      r.wa = std::clamp(wa, 0.0, 1.0);
      break;
    case MergeGuard::kAlphaFallback:
      r.alpha_fallback = degenerate || outside || std::abs(alpha_a - 0.5) < margin ||
                         std::abs(alpha_b - 0.5) < margin;
      r.wa = r.alpha_fallback ? (alpha_a + alpha_b > 0 ? alpha_a / (alpha_a + alpha_b) : 0.5) : wa;
      break;
    case MergeGuard::kMean:
      r.wa = 0.5;
      break;
  }
  r.wb = 1 - r.wa;
  return r;
}

// Two slots with value means va, vb (cardinality 1) and statistics set by hand.
struct Pair {
  SlotSet slots;
  PairStatistics st;
  Pair(const std::vector<double>& va, const std::vector<double>& vb, const std::vector<double>& o,
       double alpha_a, double alpha_b) {
    const int64_t d = static_cast<int64_t>(o.size());
    slots.keys_pre = Matrix(2, d);
    slots.value_sums = Matrix(2, d);
    for (int64_t c = 0; c < d; ++c) {
      slots.value_sums.Row(0)[c] = static_cast<float>(va[c]);
      slots.value_sums.Row(1)[c] = static_cast<float>(vb[c]);
    }
    slots.cardinality = {1, 1};
    slots.positions = {0, 1};
    st.alpha = {alpha_a, alpha_b};
    st.o = o;
  }
};

void ExpectMatches(const Pair& p, const std::vector<double>& va, const std::vector<double>& vb,
                   MergeGuard guard, double margin) {
  const MergeWeightResult got =
      ComputeMergeWeights(MergeNorm::kL2, p.slots, p.st, 0, guard, margin);
  const RefWeights want = Reference(va, vb, p.st.o, p.st.alpha[0], p.st.alpha[1], guard, margin);
  EXPECT_NEAR(got.pair.w_first, want.wa, 1e-6);
  EXPECT_NEAR(got.pair.w_second, want.wb, 1e-6);
  EXPECT_EQ(got.clamp_to_less, want.clamp_to_less);
  EXPECT_EQ(got.guard_fallback, want.fallback);
  EXPECT_EQ(got.guard_clamped, want.clamped);
  EXPECT_EQ(got.alpha_fallback, want.alpha_fallback);
}

TEST(KvSlimmerGuard, TheClampFlawAndHowEachGuardHandlesIt) {
  // alpha 0.05 / 0.40 with |v_a - o| = 2, |v_b - o| = 0.5 (same direction): c11 = 0.09,
  // c22 = 0.04, c12 = 0.05, so A = 0.04, B = -0.01, w_a = 4/3: the clamp gives (1, 0), all the
  // weight on the LESS attended key.
  const std::vector<double> va = {2, 0}, vb = {0.5, 0}, o = {0, 0};
  const Pair p(va, vb, o, 0.05, 0.40);
  const MergeWeightResult clamp = ComputeMergeWeights(MergeNorm::kL2, p.slots, p.st, 0);
  EXPECT_TRUE(clamp.guard_clamped);
  EXPECT_TRUE(clamp.clamp_to_less);
  EXPECT_EQ(clamp.pair.w_first, 1.0f);
  EXPECT_EQ(clamp.pair.w_second, 0.0f);
  const MergeWeightResult alpha =
      ComputeMergeWeights(MergeNorm::kL2, p.slots, p.st, 0, MergeGuard::kAlphaFallback, 0.1);
  EXPECT_TRUE(alpha.alpha_fallback);
  EXPECT_TRUE(alpha.clamp_to_less);  // counted whatever the guard: the flaw's frequency
  EXPECT_FALSE(alpha.guard_clamped);
  EXPECT_NEAR(alpha.pair.w_first, 0.05 / 0.45, 1e-7);
  EXPECT_NEAR(alpha.pair.w_second, 0.40 / 0.45, 1e-7);
  const MergeWeightResult mean =
      ComputeMergeWeights(MergeNorm::kL2, p.slots, p.st, 0, MergeGuard::kMean, 0.1);
  EXPECT_EQ(mean.pair.w_first, 0.5f);
  EXPECT_EQ(mean.pair.w_second, 0.5f);
  for (MergeGuard g : {MergeGuard::kClamp, MergeGuard::kAlphaFallback, MergeGuard::kMean}) {
    ExpectMatches(p, va, vb, g, 0.1);
  }
}

TEST(KvSlimmerGuard, NearHalfAlphaFallsBackOnlyUnderAlphaFallback) {
  // alpha 0.45 / 0.10 with v_a - o = (1, 0), v_b - o = (-0.8, 0): c11 = 0.045, c22 = 0.064,
  // c12 = 0.009, w_a = 0.036 / 0.091: inside [0, 1] (no clamp), but alpha_a is within 0.1 of 1/2,
  // where its coefficient alpha (1 - 2 alpha) no longer reflects its attention.
  const std::vector<double> va = {1, 0}, vb = {-0.8, 0}, o = {0, 0};
  const Pair p(va, vb, o, 0.45, 0.10);
  const MergeWeightResult clamp = ComputeMergeWeights(MergeNorm::kL2, p.slots, p.st, 0);
  EXPECT_FALSE(clamp.guard_clamped || clamp.guard_fallback || clamp.clamp_to_less);
  EXPECT_NEAR(clamp.pair.w_first, 0.036 / 0.091, 1e-6);
  const MergeWeightResult alpha =
      ComputeMergeWeights(MergeNorm::kL2, p.slots, p.st, 0, MergeGuard::kAlphaFallback, 0.1);
  EXPECT_TRUE(alpha.alpha_fallback);
  EXPECT_NEAR(alpha.pair.w_first, 0.45 / 0.55, 1e-7);
  // A margin of 0.04 leaves the pair to the closed form, equal to kClamp's weights here.
  const MergeWeightResult narrow =
      ComputeMergeWeights(MergeNorm::kL2, p.slots, p.st, 0, MergeGuard::kAlphaFallback, 0.04);
  EXPECT_FALSE(narrow.alpha_fallback);
  EXPECT_EQ(narrow.pair.w_first, clamp.pair.w_first);
  for (double margin : {0.1, 0.04}) {
    for (MergeGuard g : {MergeGuard::kClamp, MergeGuard::kAlphaFallback, MergeGuard::kMean}) {
      ExpectMatches(p, va, vb, g, margin);
    }
  }
  // D <= 0 (both alphas 1/2 zero c11 and c22): kClamp's mean fallback, kAlphaFallback's
  // alpha-weighted mean (also 1/2 here).
  const Pair half(va, vb, o, 0.5, 0.5);
  for (MergeGuard g : {MergeGuard::kClamp, MergeGuard::kAlphaFallback, MergeGuard::kMean}) {
    ExpectMatches(half, va, vb, g, 0.1);
  }
}

TEST(KvSlimmerGuard, RandomPairsMatchTheFloat64Reference) {
  std::mt19937 rng(17);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  int clamps = 0, to_less = 0, alpha_fallbacks = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    const int d = 8;
    std::vector<double> va(d), vb(d), o(d);
    for (int c = 0; c < d; ++c) {
      va[c] = static_cast<float>(normal(rng));  // the kernel reads float32 values
      vb[c] = static_cast<float>(normal(rng) * (trial % 3 == 0 ? 0.2 : 1.0));
      o[c] = 0.3 * normal(rng);
    }
    // Alphas over the whole range, many close to 1/2 (a heavy hitter in a short range).
    const double alpha_a = uni(rng) * (trial % 2 == 0 ? 0.6 : 0.1);
    const double alpha_b = uni(rng) * std::max(0.0, 1.0 - alpha_a);
    const Pair p(va, vb, o, alpha_a, alpha_b);
    SCOPED_TRACE("trial " + std::to_string(trial));
    for (MergeGuard g : {MergeGuard::kClamp, MergeGuard::kAlphaFallback, MergeGuard::kMean}) {
      ExpectMatches(p, va, vb, g, 0.1);
    }
    const RefWeights r = Reference(va, vb, o, alpha_a, alpha_b, MergeGuard::kAlphaFallback, 0.1);
    clamps += Reference(va, vb, o, alpha_a, alpha_b, MergeGuard::kClamp, 0.1).clamped;
    to_less += r.clamp_to_less;
    alpha_fallbacks += r.alpha_fallback;
  }
  // The draws reach every branch, so the comparison above tells the guards apart.
  EXPECT_GT(clamps, 20);
  EXPECT_GT(to_less, 5);
  EXPECT_GT(alpha_fallbacks, clamps);
}

// Inside KVSlimmer: a single round (budget S - 10) with each guard selects the same pairs (the
// ranking does not depend on the guard); kMean's merged keys are the plain means of the two
// pre-RoPE keys; the counters agree with the per-pair results.
TEST(KvSlimmerGuard, GuardsInsideOneRound) {
  const int64_t n = 40, d = 64, budget = 30;
  RopeConfig rc;
  auto rope = RopeTable::Create(rc, d);
  ASSERT_TRUE(rope.ok());
  const std::vector<int64_t> pos = testing::SequentialPositions(n);
  Matrix kpost = testing::RandomCorrelatedKeys(n, d, 5, 0.3f);
  Matrix values = testing::RandomMatrix(n, d, 6);
  Matrix q = testing::RandomMatrix(4, d, 7, 2.0f);  // peaked attention: alphas far apart
  const std::vector<int64_t> qpos(4, n + 1);
  KvSlimmerStats by_guard[3];
  std::vector<int32_t> cards[3];
  for (int gi = 0; gi < 3; ++gi) {
    const MergeGuard g = static_cast<MergeGuard>(gi);
    auto slots = SlotsFromTokens(*rope, kpost.View(), values.View(), pos);
    ASSERT_TRUE(slots.ok());
    const SlotSet tokens = *slots;
    KvSlimmerOptions opt;
    opt.sinks = 2;
    opt.guard = g;
    ASSERT_TRUE(KvSlimmerCompress(*rope, q.View(), qpos, budget, opt, &*slots, &by_guard[gi]).ok());
    ASSERT_EQ(slots->size(), budget);
    EXPECT_EQ(by_guard[gi].rounds, 1);
    cards[gi] = slots->cardinality;
    if (g != MergeGuard::kMean) continue;
    int64_t t = 0;
    for (int64_t j = 0; j < budget; ++j) {
      const int32_t l = slots->cardinality[j];
      if (l == 2) {
        for (int64_t c = 0; c < d; ++c) {
          const double mean =
              0.5 * (double(tokens.keys_pre.Row(t)[c]) + double(tokens.keys_pre.Row(t + 1)[c]));
          ASSERT_NEAR(slots->keys_pre.Row(j)[c], mean, 1e-6) << "slot " << j;
        }
      }
      t += l;
    }
  }
  EXPECT_EQ(cards[0], cards[1]);
  EXPECT_EQ(cards[0], cards[2]);
  // Same statistics in the one round: the flaw is counted alike under every guard, and the
  // alpha fallback covers every pair kClamp clamps or falls back on.
  EXPECT_EQ(by_guard[0].guard_clamp_to_less, by_guard[1].guard_clamp_to_less);
  EXPECT_EQ(by_guard[0].guard_clamp_to_less, by_guard[2].guard_clamp_to_less);
  EXPECT_GE(by_guard[1].guard_alpha_fallbacks,
            by_guard[0].guard_clamps + by_guard[0].guard_fallbacks);
  EXPECT_EQ(by_guard[1].guard_clamps + by_guard[1].guard_fallbacks, 0);
  EXPECT_EQ(
      by_guard[2].guard_clamps + by_guard[2].guard_fallbacks + by_guard[2].guard_alpha_fallbacks,
      0);
}

TEST(KvSlimmerGate, CentredCosinesMatchFloat64) {
  const int64_t n = 30, d = 16;
  const Matrix k = testing::RandomCorrelatedKeys(n, d, 11, 0.3f);
  std::vector<double> mu(d, 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < d; ++c) mu[c] += k.Row(i)[c] / double(n);
  auto ref_cos = [&](int64_t i, int64_t j) {
    double dot = 0, na = 0, nb = 0;
    for (int64_t c = 0; c < d; ++c) {
      const double x = k.Row(i)[c] - mu[c], y = k.Row(j)[c] - mu[c];
      dot += x * y, na += x * x, nb += y * y;
    }
    return dot / std::sqrt(na * nb);
  };
  double adjacent = 0;
  for (int64_t i = 0; i + 1 < n; ++i) adjacent += ref_cos(i, i + 1) / double(n - 1);
  std::vector<float> center;
  // The centre is float32 (rounded float64 mean): cosines agree to ~1e-6.
  EXPECT_NEAR(MeanCentredAdjacentCosine(k.View(), &center), adjacent, 1e-5);
  ASSERT_EQ(center.size(), static_cast<size_t>(d));
  for (int64_t c = 0; c < d; ++c) EXPECT_NEAR(center[c], mu[c], 1e-6);
  EXPECT_NEAR(CentredCosine(k.Row(3), k.Row(20), center, d), ref_cos(3, 20), 1e-5);
  // A vector equal to the centre is 0 after centring: cosine 0, not NaN.
  EXPECT_EQ(CentredCosine(k.Row(3), k.Row(4), std::span<const float>(k.Row(3), d), d), 0.0);
}

// One round (budget S - 10) without and with the gate (plain-mean keys, so a merged key is the
// mean of its two tokens): the ungated round shows which pairs the ranking selects; the gated
// round must merge exactly those whose centred cosine (float64 reference, centre = the tokens'
// mean key) reaches the threshold and, for the others, keep the member with the higher window
// mass (float64 reference; ties: the second) as it was.
TEST(KvSlimmerGate, OneGatedRoundMatchesTheFloat64Reference) {
  const int64_t n = 48, d = 32, budget = 38;
  RopeConfig rc;
  auto rope = RopeTable::Create(rc, d);
  ASSERT_TRUE(rope.ok());
  const std::vector<int64_t> pos = testing::SequentialPositions(n, 7);
  Matrix kpost = testing::RandomCorrelatedKeys(n, d, 21, 0.5f);
  Matrix values = testing::RandomMatrix(n, d, 22);
  Matrix q = testing::RandomMatrix(4, d, 23, 1.5f);
  const std::vector<int64_t> qpos(4, n + 7);
  auto tokens = SlotsFromTokens(*rope, kpost.View(), values.View(), pos);
  ASSERT_TRUE(tokens.ok());
  std::vector<float> center;
  MeanCentredAdjacentCosine(tokens->keys_pre.View(), &center);
  KvSlimmerOptions opt;
  opt.sinks = 2;
  opt.guard = MergeGuard::kMean;
  SlotSet plain = *tokens;
  KvSlimmerStats plain_stats;
  ASSERT_TRUE(KvSlimmerCompress(*rope, q.View(), qpos, budget, opt, &plain, &plain_stats).ok());
  ASSERT_EQ(plain_stats.rounds, 1);
  std::vector<char> pair_start(n, 0);
  for (int64_t j = 0, t = 0; j < plain.size(); t += plain.cardinality[j], ++j) {
    if (plain.cardinality[j] == 2) pair_start[t] = 1;
  }
  const testing::RefMatrix kp = testing::ToRef(kpost.View());
  const std::vector<double> mass = testing::RefAttentionMass(
      testing::ToRef(q.View()), 1, kp, {}, testing::RefMask::kByPosition, qpos, pos);
  std::vector<double> mu(d, 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < d; ++c) mu[c] += tokens->keys_pre.Row(i)[c] / double(n);
  std::vector<double> pair_cos(n, 0.0), sorted;
  for (int64_t t = 0; t + 1 < n; ++t) {
    if (!pair_start[t]) continue;
    double dot = 0, na = 0, nb = 0;
    for (int64_t c = 0; c < d; ++c) {
      const double x = tokens->keys_pre.Row(t)[c] - mu[c];
      const double y = tokens->keys_pre.Row(t + 1)[c] - mu[c];
      dot += x * y, na += x * x, nb += y * y;
    }
    pair_cos[t] = dot / std::sqrt(na * nb);
    sorted.push_back(pair_cos[t]);
  }
  // The threshold splits the selected pairs in two halves, so both outcomes occur.
  ASSERT_EQ(sorted.size(), 10u);
  std::sort(sorted.begin(), sorted.end());
  const double threshold = 0.5 * (sorted[4] + sorted[5]);
  // Expected slots: (first token, cardinality) in order.
  std::vector<std::pair<int64_t, int>> want;
  int merged = 0, dropped = 0, dropped_tokens = 0;
  for (int64_t t = 0; t < n;) {
    if (!pair_start[t]) {
      want.push_back({t, 1});
      ++t;
      continue;
    }
    const double cos = pair_cos[t];
    ASSERT_GT(std::abs(cos - threshold), 1e-4) << "pair at " << t << " too close to call";
    ASSERT_GT(std::abs(mass[t] - mass[t + 1]), 1e-5 * (mass[t] + mass[t + 1]));
    if (cos >= threshold) {
      want.push_back({t, 2});
      ++merged;
    } else {
      want.push_back({mass[t + 1] < mass[t] ? t : t + 1, 1});
      ++dropped, ++dropped_tokens;
    }
    t += 2;
  }
  ASSERT_GT(merged, 0);
  ASSERT_GT(dropped, 0);  // both outcomes occur, so the comparison tells them apart
  opt.gate_center = center;
  opt.gate_min_cos = threshold;
  SlotSet gated = *tokens;
  KvSlimmerStats stats;
  ASSERT_TRUE(KvSlimmerCompress(*rope, q.View(), qpos, budget, opt, &gated, &stats).ok());
  ASSERT_EQ(gated.size(), static_cast<int64_t>(want.size()));
  EXPECT_EQ(stats.pairs_merged, merged);
  EXPECT_EQ(stats.gate_evicted_slots, dropped);
  EXPECT_EQ(stats.gate_evicted_tokens, dropped_tokens);
  for (size_t j = 0; j < want.size(); ++j) {
    const auto [t, l] = want[j];
    ASSERT_EQ(gated.cardinality[j], l) << "slot " << j;
    EXPECT_EQ(gated.positions[j], pos[t + l - 1]) << "slot " << j;
    for (int64_t c = 0; c < d; ++c) {
      double key = 0, vsum = 0;
      for (int k = 0; k < l; ++k) {
        key += tokens->keys_pre.Row(t + k)[c] / l;
        vsum += tokens->value_sums.Row(t + k)[c];
      }
      ASSERT_NEAR(gated.keys_pre.Row(j)[c], key, 1e-6) << "slot " << j;
      ASSERT_NEAR(gated.value_sums.Row(j)[c], vsum, 1e-6) << "slot " << j;
    }
  }
  // A closed gate drops every selected pair: no merged slot, same slot count.
  opt.gate_evict_all = true;
  SlotSet closed = *tokens;
  KvSlimmerStats closed_stats;
  ASSERT_TRUE(KvSlimmerCompress(*rope, q.View(), qpos, budget, opt, &closed, &closed_stats).ok());
  EXPECT_EQ(closed.size(), budget);
  EXPECT_EQ(closed_stats.pairs_merged, 0);
  EXPECT_EQ(*std::max_element(closed.cardinality.begin(), closed.cardinality.end()), 1);
  // A centre of the wrong size is a specific error.
  opt.gate_center = std::span<const float>(center.data(), 5);
  SlotSet bad = *tokens;
  const Status s = KvSlimmerCompress(*rope, q.View(), qpos, budget, opt, &bad, &closed_stats);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("gate_center has 5 entries, head_dim is 32"));
}

TEST(KvSlimmerGuard, OptionChecks) {
  KvSlimmerOptions o;
  EXPECT_EQ(o.guard, MergeGuard::kClamp);  // documented default: the original weights
  EXPECT_EQ(o.guard_alpha_margin, 0.1);
  o.guard_alpha_margin = 0.6;
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(o.Validate().message(), HasSubstr("guard_alpha_margin must be in [0, 0.5]"));
  o.guard_alpha_margin = 0.1;
  o.guard = static_cast<MergeGuard>(7);
  EXPECT_THAT(o.Validate().message(), HasSubstr("unknown merge guard"));
  o.guard = MergeGuard::kClamp;
  o.gate_min_cos = 1.5;
  EXPECT_THAT(o.Validate().message(), HasSubstr("gate_min_cos must be in [-1, 1]"));
}

}  // namespace
}  // namespace kvd::kernels
