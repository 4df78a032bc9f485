// The error-aware hybrid (plan.h, hybrid_error_aware): each merge decision checked against an
// independent float64 reference that rebuilds the window queries' attention output from scratch
// (softmax over the kept tokens plus the merged slot) for "merge into the group" and "evict", on
// a small chunk where both decisions occur (with the mass-weighted merged key and with the plain
// mean of merge_guard kMean, and behind the centred-similarity gate of merge_gate); the gate's
// layer statistic; and the option checks.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "kvd/kernels/plan.h"
#include "kvd/kernels/rope.h"
#include "raw_layer.h"
#include "reference.h"

namespace kvd::kernels {
namespace {

using ::testing::HasSubstr;
using testing::RefMatrix;

constexpr int kHeads = 2, kGroup = 2, kDim = 16;
constexpr int64_t kN = 48, kWindow = 6, kSinks = 2;

// One layer, two KV heads, float32 (the raw bytes are the floats the reference reads). Head 0:
// random-walk keys (adjacent keys alike, where merging can win); head 1: independent keys.
struct SmallChunk {
  ModelLayout layout = testing::Float32Layer(kHeads, kGroup, kDim);
  std::vector<int64_t> positions = testing::SequentialPositions(kN, 100);
  std::vector<uint8_t> raw;
  std::vector<Matrix> keys_post, values, queries;  // per head
  std::vector<ConstMatrixView> query_views;

  explicit SmallChunk(uint64_t seed) {
    auto rope = RopeTable::Create(layout.rope, kDim);
    EXPECT_TRUE(rope.ok());
    raw.assign(layout.ChunkBytes(static_cast<int>(kN)), 0);
    for (int h = 0; h < kHeads; ++h) {
      const uint64_t s = seed * 10 + h;
      Matrix kpre = h == 0 ? testing::RandomCorrelatedKeys(kN, kDim, s, 0.35f)
                           : testing::RandomMatrix(kN, kDim, s);
      Matrix kpost(kN, kDim);
      EXPECT_TRUE(
          ApplyRope(*rope, RopeDirection::kRotate, positions, kpre.View(), kpost.View()).ok());
      values.push_back(testing::RandomMatrix(kN, kDim, s + 100));
      // Queries along the keys' drift so that attention is peaked, as on real heads.
      Matrix q = testing::RandomMatrix(kWindow * kGroup, kDim, s + 200, 1.5f);
      queries.push_back(std::move(q));
      keys_post.push_back(std::move(kpost));
    }
    testing::WriteFloat32Layer(layout, 0, kN, keys_post, values, &raw);
    for (const Matrix& q : queries) query_views.push_back(q.View());
  }

  CompressionInput Input() const {
    CompressionInput in;
    in.raw = raw;
    in.positions = positions;
    in.window_queries = query_views;
    return in;
  }
};

// The reference's slots of one head: per pool token (in token order) the group it ends with.
struct RefHead {
  std::vector<std::vector<int64_t>> groups;
  int merged = 0, evicted_by_error = 0, gated = 0;
  double min_margin = 1e300;  // smallest |merge - evict| / max(merge, evict) over decisions
};

// Attention output of window query row r over the head with `removed` taken out and `slots`
// (post-RoPE key, value sum, cardinality) put in, computed from scratch (causal window: query w
// sees tokens 0..N-W+w; the slots and removed tokens are older than the window).
struct RefSlot {
  std::vector<double> key;
  std::vector<double> vsum;
  double l;
};
double RefOutputError(const RefMatrix& q, const RefMatrix& k, const RefMatrix& v,
                      const std::vector<int64_t>& removed, const std::vector<RefSlot>& slots) {
  double total = 0.0;
  for (int64_t r = 0; r < q.rows; ++r) {
    const int64_t visible = kN - kWindow + r / kGroup + 1;
    std::vector<double> qr(q.Row(r), q.Row(r) + kDim);
    RefMatrix fk(visible, kDim), fv(visible, kDim);
    for (int64_t t = 0; t < visible; ++t)
      for (int c = 0; c < kDim; ++c) fk.at(t, c) = k.at(t, c), fv.at(t, c) = v.at(t, c);
    const std::vector<double> full = testing::RefAttention(qr, fk, fv);
    std::vector<int64_t> kept;
    for (int64_t t = 0; t < visible; ++t)
      if (std::find(removed.begin(), removed.end(), t) == removed.end()) kept.push_back(t);
    const int64_t s = static_cast<int64_t>(kept.size() + slots.size());
    RefMatrix ck(s, kDim), cv(s, kDim);
    std::vector<double> card(static_cast<size_t>(s), 1.0);
    for (size_t j = 0; j < kept.size(); ++j)
      for (int c = 0; c < kDim; ++c) ck.at(j, c) = k.at(kept[j], c), cv.at(j, c) = v.at(kept[j], c);
    for (size_t j = 0; j < slots.size(); ++j) {
      const int64_t row = static_cast<int64_t>(kept.size() + j);
      for (int c = 0; c < kDim; ++c)
        ck.at(row, c) = slots[j].key[c], cv.at(row, c) = slots[j].vsum[c];
      card[static_cast<size_t>(row)] = slots[j].l;
    }
    const std::vector<double> out = testing::RefCompactAttention(qr, ck, cv, card);
    for (int c = 0; c < kDim; ++c) total += (out[c] - full[c]) * (out[c] - full[c]);
  }
  return total;
}

// The merged slot of `g` (token order): window-mass-weighted mean of the de-rotated keys (the
// plain mean with `mean_keys`), rotated to the group's last position; value sum; cardinality.
RefSlot RefMerge(const RopeConfig& rope, const RefMatrix& kpre, const RefMatrix& v,
                 const std::vector<double>& mass, const std::vector<int64_t>& pos,
                 const std::vector<int64_t>& g, bool mean_keys) {
  double total = 0.0;
  for (int64_t i : g) total += mean_keys ? 0.0 : std::max(0.0, mass[i]);
  RefMatrix key(1, kDim);
  RefSlot s{std::vector<double>(kDim, 0.0), std::vector<double>(kDim, 0.0),
            static_cast<double>(g.size())};
  int64_t last = 0;
  for (int64_t i : g) {
    const double w = total > 0 ? std::max(0.0, mass[i]) / total : 1.0 / g.size();
    for (int c = 0; c < kDim; ++c) key.at(0, c) += w * kpre.at(i, c), s.vsum[c] += v.at(i, c);
    last = std::max(last, pos[i]);
  }
  const RefMatrix post = testing::RefRope(rope, key, std::vector<int64_t>{last}, +1);
  for (int c = 0; c < kDim; ++c) s.key[c] = post.at(0, c);
  return s;
}

// gate: merge_gate_min_cos, NaN = no gate (a candidate whose centred cosine with its absorber is
// below it is evicted before the error-aware choice).
RefHead ReferenceHead(const SmallChunk& f, int h, const std::vector<int64_t>& pool, int64_t cap,
                      bool mean_keys, double gate) {
  const RefMatrix k = testing::ToRef(f.keys_post[h].View());
  const RefMatrix v = testing::ToRef(f.values[h].View());
  const RefMatrix q = testing::ToRef(f.queries[h].View());
  const RefMatrix kpre = testing::RefRope(f.layout.rope, k, f.positions, -1);
  const std::vector<double> mass =
      testing::RefAttentionMass(q, kGroup, k, {}, testing::RefMask::kCausalWindow);
  auto forced = [](int64_t i) { return i < kSinks || i >= kN - kWindow; };
  std::vector<double> mu(kDim, 0.0);
  for (int64_t i = 0; i < kN; ++i)
    for (int c = 0; c < kDim; ++c) mu[c] += kpre.at(i, c) / kN;
  auto centred_cos = [&](int64_t a, int64_t b) {
    double dot = 0, na = 0, nb = 0;
    for (int c = 0; c < kDim; ++c) {
      const double x = kpre.at(a, c) - mu[c], y = kpre.at(b, c) - mu[c];
      dot += x * y, na += x * x, nb += y * y;
    }
    return dot / std::sqrt(na * nb);
  };
  std::vector<int64_t> absorbers;
  for (int64_t i : pool)
    if (!forced(i)) absorbers.push_back(i);
  RefHead out;
  for (int64_t a : pool) {
    std::vector<int64_t> cand;  // tokens outside the pool whose nearest absorber (ties left) is a
    if (!forced(a)) {
      for (int64_t i = 0; i < kN; ++i) {
        if (std::find(pool.begin(), pool.end(), i) != pool.end()) continue;
        int64_t best = -1;
        for (int64_t b : absorbers) {
          if (best < 0 || std::llabs(b - i) < std::llabs(best - i)) best = b;
        }
        if (best != a) continue;
        if (!std::isnan(gate)) {
          const double c = centred_cos(i, a);
          out.min_margin = std::min(out.min_margin, std::abs(c - gate));
          if (c < gate) {
            ++out.gated;
            continue;
          }
        }
        cand.push_back(i);
      }
      std::stable_sort(cand.begin(), cand.end(),
                       [a](int64_t x, int64_t y) { return std::llabs(x - a) < std::llabs(y - a); });
    }
    std::vector<int64_t> group = {a};
    for (int64_t i : cand) {
      if (static_cast<int64_t>(group.size()) >= cap) break;
      std::vector<int64_t> trial = group;
      trial.push_back(i);
      std::sort(trial.begin(), trial.end());
      const RefSlot keep =
          group.size() == 1 ? RefSlot{std::vector<double>(k.Row(a), k.Row(a) + kDim),
                                      std::vector<double>(v.Row(a), v.Row(a) + kDim), 1.0}
                            : RefMerge(f.layout.rope, kpre, v, mass, f.positions, group, mean_keys);
      const double evict = RefOutputError(q, k, v, trial, {keep});
      const double merge = RefOutputError(
          q, k, v, trial, {RefMerge(f.layout.rope, kpre, v, mass, f.positions, trial, mean_keys)});
      out.min_margin = std::min(out.min_margin, std::abs(merge - evict) / std::max(merge, evict));
      if (merge < evict) {
        group = trial;
        ++out.merged;
      } else {
        ++out.evicted_by_error;
      }
    }
    out.groups.push_back(group);
  }
  return out;
}

// (merge guard, merge_gate_min_cos or NaN = no gate)
class PlanErrorAware : public ::testing::TestWithParam<std::tuple<MergeGuard, double>> {};

TEST_P(PlanErrorAware, EveryMergeDecisionMatchesAFloat64Reference) {
  constexpr int64_t kCap = 3;
  const SmallChunk f(5);
  const auto [guard, gate] = GetParam();
  const bool mean_keys = guard == MergeGuard::kMean;
  for (double p_c : {0.5, 0.75}) {
    SCOPED_TRACE("p_c=" + std::to_string(p_c) + (mean_keys ? " mean keys" : "") + " gate " +
                 std::to_string(gate));
    const int64_t m = std::llround((1.0 - p_c) * kN);
    // The pool is SnapKV's: the kept tokens of plain eviction at the same budget.
    CompressionPlanOptions evict{
        .score = ScoreStage::kSnapKv, .p_c = p_c, .window = kWindow, .sinks = kSinks};
    auto pool_chunk = Compress(evict, f.layout, f.Input());
    ASSERT_TRUE(pool_chunk.ok()) << pool_chunk.status();
    CompressionPlanOptions ea = evict;
    ea.merge = MergeStage::kKvSlimmer;
    ea.hybrid_max_group = kCap;
    ea.hybrid_error_aware = true;
    ea.merge_guard = guard;
    if (!std::isnan(gate)) {
      ea.merge_gate = true;
      ea.merge_gate_min_cos = gate;
      ea.merge_gate_layer_min = -1.0;  // the layer gate is tested below
    }
    CompressionStats stats;
    auto chunk = Compress(ea, f.layout, f.Input(), &stats);
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    EXPECT_EQ(chunk->HalfPairs(), 2 * m * kHeads);  // the budget does not change
    int merged = 0, rejected = 0, gated = 0;
    for (int h = 0; h < kHeads; ++h) {
      SCOPED_TRACE("head " + std::to_string(h));
      std::vector<int64_t> pool;
      for (int64_t p : pool_chunk->Head(0, h).positions) pool.push_back(p - f.positions[0]);
      ASSERT_EQ(static_cast<int64_t>(pool.size()), m);
      const RefHead ref = ReferenceHead(f, h, pool, kCap, mean_keys, gate);
      merged += ref.merged;
      rejected += ref.evicted_by_error;
      gated += ref.gated;
      // Decisions closer than this could flip between float32 inputs and float64 arithmetic;
      // the fixture's seed keeps every one well apart.
      EXPECT_GT(ref.min_margin, 1e-4);
      const CompactHead& got = chunk->Head(0, h);
      ASSERT_EQ(got.slots(), m);
      const RefMatrix k = testing::ToRef(f.keys_post[h].View());
      const RefMatrix v = testing::ToRef(f.values[h].View());
      const RefMatrix kpre = testing::RefRope(f.layout.rope, k, f.positions, -1);
      const std::vector<double> mass = testing::RefAttentionMass(
          testing::ToRef(f.queries[h].View()), kGroup, k, {}, testing::RefMask::kCausalWindow);
      for (int64_t j = 0; j < m; ++j) {
        const std::vector<int64_t>& g = ref.groups[j];
        EXPECT_EQ(got.cardinality[j], static_cast<int32_t>(g.size())) << "slot " << j;
        EXPECT_EQ(got.positions[j], f.positions[g.back()]) << "slot " << j;
        if (g.size() < 2 || got.cardinality[j] != static_cast<int32_t>(g.size())) continue;
        // Merged key: float32 kernel vs float64 reference, both from the same float32 post-RoPE
        // keys: de-rotation (< 1.1e-6 |k|, rope_test.cc), float32 weights (u) and a sum of at most
        // kCap keys (kCap u), with |k| < 4: < 6e-6. 1e-5 (observed 5.6e-7); a wrong weight or
        // position is off by 1e-2 and more.
        const RefSlot want = RefMerge(f.layout.rope, kpre, v, mass, f.positions, g, mean_keys);
        std::vector<float> key(kDim);
        std::memcpy(key.data(), got.keys.data() + j * kDim * 4, kDim * 4);
        for (int c = 0; c < kDim; ++c) EXPECT_NEAR(key[c], want.key[c], 1e-5) << "slot " << j;
      }
    }
    // Both decisions occur, so the test tells them apart; the kernel counts the rejections.
    EXPECT_GT(merged, 0);
    EXPECT_GT(rejected, 0);
    EXPECT_EQ(stats.error_aware_evicted, rejected);
    EXPECT_EQ(stats.gate_evicted_tokens, gated);
    if (!std::isnan(gate)) {
      EXPECT_GT(gated, 0);  // the gate acts on this chunk
    }
    std::printf("p_c %.2f%s: %d merges accepted, %d rejected\n", p_c,
                mean_keys ? " (mean keys)" : "", merged, rejected);
  }
}

// kClamp: the mass-weighted merged key (the original hybrid); kMean: the plain mean
// (kAlphaFallback merges hybrid groups like kClamp: plan.h).
INSTANTIATE_TEST_SUITE_P(Guards, PlanErrorAware,
                         ::testing::Values(std::tuple{MergeGuard::kClamp, std::nan("")},
                                           std::tuple{MergeGuard::kMean, std::nan("")},
                                           std::tuple{MergeGuard::kClamp, 0.3}));

// The layer gate: its statistic is the mean over the layer's heads of the mean centred cosine of
// adjacent de-rotated keys (float64 reference). A threshold just above it closes the layer (the
// hybrid becomes SnapKV eviction of its pool, slot for slot); just below opens it, and with a pair
// threshold of -1 the gated hybrid is the ungated one, byte for byte.
TEST(PlanMergeGate, LayerGateDerivedFromTheChunk) {
  const SmallChunk f(5);
  double stat = 0.0;
  for (int h = 0; h < kHeads; ++h) {
    const RefMatrix kpre =
        testing::RefRope(f.layout.rope, testing::ToRef(f.keys_post[h].View()), f.positions, -1);
    std::vector<double> mu(kDim, 0.0);
    for (int64_t i = 0; i < kN; ++i)
      for (int c = 0; c < kDim; ++c) mu[c] += kpre.at(i, c) / kN;
    double sum = 0.0;
    for (int64_t i = 0; i + 1 < kN; ++i) {
      double dot = 0, na = 0, nb = 0;
      for (int c = 0; c < kDim; ++c) {
        const double x = kpre.at(i, c) - mu[c], y = kpre.at(i + 1, c) - mu[c];
        dot += x * y, na += x * x, nb += y * y;
      }
      sum += dot / std::sqrt(na * nb);
    }
    stat += sum / (kN - 1) / kHeads;
  }
  CompressionPlanOptions evict{
      .score = ScoreStage::kSnapKv, .p_c = 0.75, .window = kWindow, .sinks = kSinks};
  CompressionPlanOptions hybrid = evict;
  hybrid.merge = MergeStage::kKvSlimmer;
  auto pool = Compress(evict, f.layout, f.Input());
  auto plain = Compress(hybrid, f.layout, f.Input());
  ASSERT_TRUE(pool.ok() && plain.ok());
  CompressionPlanOptions gated = hybrid;
  gated.merge_gate = true;
  gated.merge_gate_layer_min = stat + 1e-3;
  CompressionStats closed_stats;
  auto closed = Compress(gated, f.layout, f.Input(), &closed_stats);
  ASSERT_TRUE(closed.ok()) << closed.status();
  EXPECT_EQ(closed_stats.gate_closed_layers, 1);
  EXPECT_EQ(closed_stats.merged_tokens, 0);
  EXPECT_GT(closed_stats.gate_evicted_tokens, 0);
  gated.merge_gate_layer_min = stat - 1e-3;
  gated.merge_gate_min_cos = -1.0;
  CompressionStats open_stats;
  auto open = Compress(gated, f.layout, f.Input(), &open_stats);
  ASSERT_TRUE(open.ok()) << open.status();
  EXPECT_EQ(open_stats.gate_closed_layers, 0);
  EXPECT_EQ(open_stats.gate_evicted_tokens, 0);
  EXPECT_GT(open_stats.merged_tokens, 0);
  for (int h = 0; h < kHeads; ++h) {
    const CompactHead& c = closed->Head(0, h);
    EXPECT_EQ(c.positions, pool->Head(0, h).positions);
    EXPECT_EQ(c.keys, pool->Head(0, h).keys);
    EXPECT_EQ(c.values, pool->Head(0, h).values);
    EXPECT_EQ(c.cardinality, pool->Head(0, h).cardinality);
    EXPECT_EQ(open->Head(0, h).keys, plain->Head(0, h).keys);
    EXPECT_EQ(open->Head(0, h).cardinality, plain->Head(0, h).cardinality);
  }
}

TEST(PlanMergeGate, OptionChecks) {
  CompressionPlanOptions o;
  EXPECT_FALSE(o.merge_gate);  // documented defaults: off, pair 0.5, layer 0.3
  EXPECT_EQ(o.merge_gate_min_cos, 0.5);
  EXPECT_EQ(o.merge_gate_layer_min, 0.3);
  o.merge_gate = true;  // SnapKV eviction: nothing to gate
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(o.Validate().message(), HasSubstr("merge_gate needs a merge stage"));
  o.merge = MergeStage::kKvSlimmer;
  EXPECT_TRUE(o.Validate().ok());
  o.merge_gate_min_cos = -1.5;
  EXPECT_THAT(o.Validate().message(), HasSubstr("merge_gate_min_cos must be in [-1, 1]"));
  o.merge_gate_min_cos = 0.5;
  o.merge_gate_layer_min = 2.0;
  EXPECT_THAT(o.Validate().message(), HasSubstr("merge_gate_layer_min must be in [-1, 1]"));
}

TEST(PlanMergeGuard, OptionChecks) {
  CompressionPlanOptions o;
  EXPECT_EQ(o.merge_guard, MergeGuard::kClamp);  // documented default: the original weights
  EXPECT_EQ(o.merge_guard_alpha_margin, 0.1);
  o.merge_guard_alpha_margin = -0.1;
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(o.Validate().message(), HasSubstr("merge_guard_alpha_margin must be in [0, 0.5]"));
  o.merge_guard_alpha_margin = 0.5;
  EXPECT_TRUE(o.Validate().ok());
  o.merge_guard = static_cast<MergeGuard>(3);
  EXPECT_THAT(o.Validate().message(), HasSubstr("unknown merge_guard"));
}

// The plan hands its guard and margin to KVSlimmer: the same chunk merged alone (score kNone)
// meets the budget with each guard; with a margin of 1/2 every pair of kAlphaFallback is merged
// by the alpha-weighted mean; kMean counts no guard action and gives other keys than kClamp.
TEST(PlanMergeGuard, KvSlimmerPlanUsesTheGuard) {
  const SmallChunk f(5);
  KvSlimmerStats st[3];
  std::vector<uint8_t> keys[3];
  for (int gi = 0; gi < 3; ++gi) {
    CompressionPlanOptions o{.score = ScoreStage::kNone,
                             .merge = MergeStage::kKvSlimmer,
                             .p_c = 0.75,
                             .window = kWindow,
                             .sinks = kSinks};
    o.merge_guard = static_cast<MergeGuard>(gi);
    o.merge_guard_alpha_margin = 0.5;
    CompressionStats stats;
    auto chunk = Compress(o, f.layout, f.Input(), &stats);
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    EXPECT_EQ(chunk->HalfPairs(), 2 * std::llround(0.25 * kN) * kHeads);
    st[gi] = stats.kvslimmer;
    keys[gi] = chunk->Head(0, 0).keys;
  }
  EXPECT_EQ(st[0].guard_alpha_fallbacks, 0);
  EXPECT_GT(st[1].pairs_merged, 0);
  EXPECT_EQ(st[1].guard_alpha_fallbacks, st[1].pairs_merged);
  EXPECT_EQ(st[1].guard_clamps + st[1].guard_fallbacks, 0);
  EXPECT_EQ(st[2].guard_clamps + st[2].guard_fallbacks + st[2].guard_alpha_fallbacks, 0);
  EXPECT_EQ(st[0].pairs_merged, st[2].pairs_merged);
  EXPECT_NE(keys[0], keys[2]);
}

TEST(PlanErrorAwareOptions, OptionChecks) {
  CompressionPlanOptions o;
  EXPECT_FALSE(o.hybrid_error_aware);  // documented default: off
  o.hybrid_error_aware = true;         // SnapKV eviction, no merge stage
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(o.Validate().message(), HasSubstr("hybrid_error_aware needs the hybrid"));
  o.merge = MergeStage::kKvSlimmer;
  o.score = ScoreStage::kNone;  // KVSlimmer alone
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
  o.score = ScoreStage::kKeyDiff;
  EXPECT_TRUE(o.Validate().ok());
  // KeyDiff needs no queries, but the error estimate does.
  const SmallChunk f(6);
  o.window = kWindow;
  o.sinks = kSinks;
  CompressionInput in = f.Input();
  in.window_queries = {};
  auto chunk = Compress(o, f.layout, in);
  EXPECT_EQ(chunk.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(chunk.status().message(), HasSubstr("hybrid_error_aware needs window queries"));
  EXPECT_TRUE(Compress(o, f.layout, f.Input()).ok());
}

}  // namespace
}  // namespace kvd::kernels
