// Compression plans: exact half-pair budgets for every composition, sinks/window kept, VECTOR
// end to end (compress -> encode -> decode -> serve), and input errors.
#include "kvd/kernels/plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "kvd/kernels/serving.h"
#include "raw_layer.h"
#include "reference.h"

namespace kvd::kernels {
namespace {

using ::testing::HasSubstr;
using testing::RandomCorrelatedKeys;
using testing::RandomMatrix;

// A synthetic chunk: per head, pre-RoPE keys as a random walk, values = A_h kpre + noise, keys
// stored post-RoPE in the engine layout; window queries for the last W tokens.
struct ChunkFixture {
  ModelLayout layout;
  int64_t n = 0;
  int64_t window = 16;
  std::vector<int64_t> positions;
  std::vector<uint8_t> raw;
  std::vector<Matrix> kpre;     // [L*H] of [N, d]
  std::vector<Matrix> values;   // [L*H] of [N, d]
  std::vector<Matrix> queries;  // [L*H] of [W*G, d]
  std::vector<ConstMatrixView> query_views;
  VectorWeights weights;

  CompressionInput Input(bool with_queries = true) const {
    CompressionInput in;
    in.raw = raw;
    in.positions = positions;
    if (with_queries) in.window_queries = query_views;
    in.weights = &weights;
    return in;
  }
};

ChunkFixture MakeChunk(int64_t n, int d, DType dtype, float noise, uint64_t seed, int G = 4) {
  ChunkFixture f;
  f.layout = {
      .num_layers = 2, .num_kv_heads = 2, .num_q_heads = 2 * G, .head_dim = d, .dtype = dtype};
  f.layout.rope.theta = 10000.0;
  f.n = n;
  f.positions = testing::SequentialPositions(n, 1000);
  const int L = 2, H = 2;
  auto rope = RopeTable::Create(f.layout.rope, d);
  f.raw.assign(f.layout.ChunkBytes(static_cast<int>(n)), 0);
  const size_t e = DTypeSize(dtype);
  for (int l = 0; l < L; ++l) {
    for (int h = 0; h < H; ++h) {
      const uint64_t s = seed * 100 + l * 10 + h;
      Matrix kp = RandomCorrelatedKeys(n, d, s);
      Matrix a = RandomMatrix(d, d, s + 1, 1.0f / std::sqrt(float(d)));
      Matrix v(n, d);
      Matrix eps = RandomMatrix(n, d, s + 2, noise);
      for (int64_t i = 0; i < n; ++i)
        for (int r = 0; r < d; ++r) {
          double acc = 0;
          for (int c = 0; c < d; ++c) acc += double(a.Row(r)[c]) * kp.Row(i)[c];
          v.Row(i)[r] = static_cast<float>(acc) + eps.Row(i)[r];
        }
      Matrix kpost(n, d);
      EXPECT_TRUE(
          ApplyRope(*rope, RopeDirection::kRotate, f.positions, kp.View(), kpost.View()).ok());
      uint8_t* kb = f.raw.data() + f.layout.LayerOffset(l, static_cast<int>(n));
      uint8_t* vb = kb + n * f.layout.TokenBytes();
      for (int64_t i = 0; i < n; ++i) {
        ConvertFromFloat(dtype, kpost.Row(i), kb + i * f.layout.TokenBytes() + h * d * e, d);
        ConvertFromFloat(dtype, v.Row(i), vb + i * f.layout.TokenBytes() + h * d * e, d);
      }
      f.kpre.push_back(std::move(kp));
      f.values.push_back(std::move(v));
      f.queries.push_back(RandomMatrix(f.window * G, d, s + 3));
    }
  }
  for (const Matrix& q : f.queries) f.query_views.push_back(q.View());
  auto w = testing::CalibrateOnChunk(f.layout, f.raw, f.positions);
  EXPECT_TRUE(w.ok()) << w.status();
  f.weights = std::move(*w);
  return f;
}

struct Composition {
  const char* name;
  ScoreStage score;
  MergeStage merge;
  int64_t keydiff_block;
};

const Composition kCompositions[] = {
    {"snapkv", ScoreStage::kSnapKv, MergeStage::kNone, 0},
    {"keydiff", ScoreStage::kKeyDiff, MergeStage::kNone, 0},
    {"keydiff-block", ScoreStage::kKeyDiff, MergeStage::kNone, 64},
    {"pyramidkv", ScoreStage::kPyramidKv, MergeStage::kNone, 0},
    {"recency", ScoreStage::kNone, MergeStage::kNone, 0},
    {"kvslimmer", ScoreStage::kNone, MergeStage::kKvSlimmer, 0},
    {"hybrid-snapkv", ScoreStage::kSnapKv, MergeStage::kKvSlimmer, 0},
    {"hybrid-keydiff", ScoreStage::kKeyDiff, MergeStage::kKvSlimmer, 0},
};

TEST(Plan, HalfPairBudgetIsExactForEveryComposition) {
  const ChunkFixture f = MakeChunk(301, 64, DType::kBFloat16, 0.3f, 1);
  for (double p_c : {0.25, 0.5, 0.75, 0.9}) {
    const int64_t m = std::llround((1.0 - p_c) * f.n);
    for (const Composition& c : kCompositions) {
      for (RouteStage route : {RouteStage::kNone, RouteStage::kVector}) {
        CompressionPlanOptions o{.score = c.score,
                                 .merge = c.merge,
                                 .route = route,
                                 .p_c = p_c,
                                 .window = f.window,
                                 .keydiff_block = c.keydiff_block};
        CompressionStats stats;
        auto chunk = Compress(o, f.layout, f.Input(), &stats);
        SCOPED_TRACE(std::string(c.name) + (route == RouteStage::kVector ? "+vector" : "") +
                     " p_c=" + std::to_string(p_c));
        ASSERT_TRUE(chunk.ok()) << chunk.status();
        EXPECT_EQ(chunk->HalfPairs(), 2 * m * 4);
        EXPECT_EQ(stats.half_pairs, stats.budget_half_pairs);
        if (c.score != ScoreStage::kPyramidKv) {
          for (const CompactHead& h : chunk->heads) EXPECT_EQ(h.slots() + h.value_slots(), 2 * m);
        }
        // Routing needs single (l = 1) slots; heavy merging can leave none, and then a shrinks
        // (down to 0) while the budget stays exact.
        if (route == RouteStage::kVector && c.merge == MergeStage::kNone) {
          EXPECT_GT(stats.rebuild_slots, 0);
          EXPECT_EQ(stats.route_reductions, 0);
        }
        if (route == RouteStage::kVector && stats.route_reductions == 0) {
          EXPECT_GT(stats.rebuild_slots, 0);
        }
        if (c.merge != MergeStage::kNone) EXPECT_GT(stats.merged_tokens, 0);
        // Sinks and the window are kept as single slots with their values, at their positions.
        for (const CompactHead& h : chunk->heads) {
          ASSERT_GE(h.slots(), 4 + f.window);
          for (int j = 0; j < 4; ++j) {
            EXPECT_EQ(h.positions[j], f.positions[j]);
            EXPECT_EQ(h.cardinality[j], 1);
            EXPECT_EQ(h.flags[j], 0);
          }
          for (int64_t w = 0; w < f.window; ++w) {
            const int64_t j = h.slots() - f.window + w;
            EXPECT_EQ(h.positions[j], f.positions[f.n - f.window + w]);
            EXPECT_EQ(h.cardinality[j], 1);
            EXPECT_EQ(h.flags[j], 0);
          }
          for (int64_t j = 1; j < h.slots(); ++j) EXPECT_LT(h.positions[j - 1], h.positions[j]);
        }
        auto bytes = EncodeCompactChunk(*chunk);
        ASSERT_TRUE(bytes.ok());
        auto back = DecodeCompactChunk(*bytes);
        ASSERT_TRUE(back.ok());
        EXPECT_TRUE(*back == *chunk);
      }
    }
  }
}

// Stage times: every stage a plan runs has time, the stages it does not run have none, and on one
// thread (no parallel heads) the exclusive stage times sum to at most the wall total. Also with
// two threads the times are filled (their sum is thread time and may exceed the wall total).
TEST(Plan, StageTimesAreFilledPerStageAndSumToAtMostTheTotal) {
  const ChunkFixture f = MakeChunk(301, 64, DType::kBFloat16, 0.3f, 1);
  for (int threads : {1, 2}) {
    for (const Composition& c : kCompositions) {
      for (RouteStage route : {RouteStage::kNone, RouteStage::kVector}) {
        CompressionPlanOptions o{.score = c.score,
                                 .merge = c.merge,
                                 .route = route,
                                 .p_c = 0.5,
                                 .window = f.window,
                                 .keydiff_block = c.keydiff_block};
        CompressionStats stats;
        auto chunk = Compress(o, f.layout, f.Input(), &stats, {.num_threads = threads});
        SCOPED_TRACE(std::string(c.name) + (route == RouteStage::kVector ? "+vector" : "") +
                     " threads=" + std::to_string(threads));
        ASSERT_TRUE(chunk.ok()) << chunk.status();
        const CompressionStageTimes& t = stats.stage;
        EXPECT_GT(stats.total_ns, 0);
        EXPECT_GT(t.convert_ns, 0);
        EXPECT_GT(t.encode_ns, 0);
        // The score stage runs unless block-wise KeyDiff (which scores inside its selection) or
        // merge-only KVSlimmer (no pool selection at all).
        const bool merge_only = c.score == ScoreStage::kNone && c.merge != MergeStage::kNone;
        const bool scores = c.keydiff_block == 0 && !merge_only;
        EXPECT_EQ(t.score_ns > 0, scores);
        EXPECT_EQ(t.select_ns > 0, !merge_only);
        EXPECT_EQ(t.merge_ns > 0, c.merge != MergeStage::kNone);
        // De-rotation: VECTOR routing and the hybrid's merged keys (merge-only KVSlimmer
        // de-rotates inside its own merge stage).
        const bool hybrid = c.merge != MergeStage::kNone && !merge_only;
        EXPECT_EQ(t.derotate_ns > 0, route == RouteStage::kVector || hybrid);
        EXPECT_EQ(t.route_ns > 0, stats.rebuild_slots > 0);
        if (route == RouteStage::kNone) EXPECT_EQ(t.route_ns, 0);
        if (threads == 1) {
          EXPECT_LE(t.Sum(), stats.total_ns);
        }
      }
    }
  }
}

// The hybrid's group cap: no slot holds more than hybrid_max_group tokens, the budget stays exact,
// and without the cap groups do grow past it (so the cap is what bounds them).
TEST(Plan, HybridCapBoundsEverySlotAndKeepsTheBudget) {
  const ChunkFixture f = MakeChunk(301, 64, DType::kBFloat16, 0.3f, 1);
  for (double p_c : {0.25, 0.5, 0.75, 0.9}) {
    const int64_t m = std::llround((1.0 - p_c) * f.n);
    for (int64_t cap : {int64_t{2}, int64_t{4}, int64_t{8}, int64_t{1} << 40}) {
      for (RouteStage route : {RouteStage::kNone, RouteStage::kVector}) {
        CompressionPlanOptions o{.score = ScoreStage::kSnapKv,
                                 .merge = MergeStage::kKvSlimmer,
                                 .route = route,
                                 .p_c = p_c,
                                 .window = f.window};
        o.hybrid_max_group = cap;
        CompressionStats stats;
        auto chunk = Compress(o, f.layout, f.Input(), &stats);
        SCOPED_TRACE("cap=" + std::to_string(cap) + " p_c=" + std::to_string(p_c) +
                     (route == RouteStage::kVector ? " +vector" : ""));
        ASSERT_TRUE(chunk.ok()) << chunk.status();
        EXPECT_EQ(chunk->HalfPairs(), 2 * m * 4);
        EXPECT_EQ(stats.half_pairs, stats.budget_half_pairs);
        int32_t max_l = 0;
        int64_t covered = 0;
        for (const CompactHead& h : chunk->heads) {
          EXPECT_EQ(h.slots() + h.value_slots(), 2 * m);
          for (int32_t l : h.cardinality) {
            max_l = std::max(max_l, l);
            covered += l;
          }
          for (int64_t j = 1; j < h.slots(); ++j) EXPECT_LT(h.positions[j - 1], h.positions[j]);
        }
        EXPECT_EQ(covered + stats.evicted_tokens, f.n * 4);
        if (cap < 100) {
          EXPECT_LE(max_l, cap);
          EXPECT_GT(stats.merged_tokens, 0);
        }
        // Uncapped at 0.9 (M = 30 of 301, 20 forced): ~10 absorbers share ~270 tokens.
        if (cap > 100 && p_c == 0.9) {
          EXPECT_GT(max_l, 8);
        }
        if (cap == 2 && p_c >= 0.75) {
          EXPECT_GT(stats.evicted_tokens, 0);
        }
      }
    }
  }
}

// Cap 1 = no merging: the same slots, keys and values as plain SnapKV eviction, all l = 1.
TEST(Plan, HybridCapOneIsPlainEviction) {
  const ChunkFixture f = MakeChunk(301, 64, DType::kBFloat16, 0.3f, 6);
  for (double p_c : {0.5, 0.9}) {
    CompressionPlanOptions evict{.score = ScoreStage::kSnapKv, .p_c = p_c, .window = f.window};
    CompressionPlanOptions hybrid = evict;
    hybrid.merge = MergeStage::kKvSlimmer;
    hybrid.hybrid_max_group = 1;
    CompressionStats hs;
    auto a = Compress(evict, f.layout, f.Input());
    auto b = Compress(hybrid, f.layout, f.Input(), &hs);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(hs.merged_tokens, 0);
    ASSERT_EQ(a->heads.size(), b->heads.size());
    for (size_t i = 0; i < a->heads.size(); ++i) {
      SCOPED_TRACE("head " + std::to_string(i) + " p_c=" + std::to_string(p_c));
      EXPECT_EQ(a->heads[i].positions, b->heads[i].positions);
      EXPECT_EQ(b->heads[i].cardinality, std::vector<int32_t>(b->heads[i].slots(), 1));
      EXPECT_EQ(a->heads[i].keys, b->heads[i].keys);
      EXPECT_EQ(a->heads[i].values, b->heads[i].values);
    }
  }
}

// The similarity gate only removes members: fewer merged tokens, budget unchanged; a gate of 1
// (cos >= 1 never holds for distinct random-walk keys) leaves only singles.
TEST(Plan, HybridCosineGateRemovesDissimilarMembers) {
  const ChunkFixture f = MakeChunk(301, 64, DType::kBFloat16, 0.3f, 7);
  const int64_t m = std::llround(0.25 * f.n);
  int64_t merged_prev = -1;
  for (double gate : {0.0, 0.9, 1.0}) {
    CompressionPlanOptions o{.score = ScoreStage::kSnapKv,
                             .merge = MergeStage::kKvSlimmer,
                             .p_c = 0.75,
                             .window = f.window};
    o.hybrid_min_cos = gate;
    CompressionStats stats;
    auto chunk = Compress(o, f.layout, f.Input(), &stats);
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    EXPECT_EQ(chunk->HalfPairs(), 2 * m * 4);
    if (merged_prev >= 0) {
      EXPECT_LE(stats.merged_tokens, merged_prev) << gate;
    }
    if (gate == 0.0) {
      EXPECT_GT(stats.merged_tokens, 0);
    }
    if (gate == 1.0) {
      EXPECT_EQ(stats.merged_tokens, 0);
    }
    merged_prev = stats.merged_tokens;
  }
}

TEST(Plan, ValidateRejectsBadHybridOptions) {
  CompressionPlanOptions o;
  EXPECT_EQ(o.hybrid_max_group, 4);
  EXPECT_TRUE(o.Validate().ok());
  o.hybrid_max_group = 0;
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(o.Validate().message(), HasSubstr("hybrid_max_group must be >= 1"));
  o.hybrid_max_group = 1;
  EXPECT_TRUE(o.Validate().ok());
  o.hybrid_min_cos = 1.5;
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(o.Validate().message(), HasSubstr("hybrid_min_cos"));
}

TEST(Plan, NothingToCompressKeepsTheChunk) {
  const ChunkFixture f = MakeChunk(64, 64, DType::kFloat32, 0.3f, 2);
  CompressionPlanOptions o{.score = ScoreStage::kSnapKv, .p_c = 0.0, .window = f.window};
  auto chunk = Compress(o, f.layout, f.Input());
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  int64_t tokens = 0;
  auto dense = ExpandDenseChunk(*chunk, nullptr, nullptr, &tokens);
  ASSERT_TRUE(dense.ok()) << dense.status();
  EXPECT_EQ(tokens, 64);
  EXPECT_EQ(*dense, f.raw);  // float32, all tokens kept: bit-identical engine bytes
}

// Values that are exactly linear in the pre-RoPE keys are rebuilt exactly after routing.
TEST(Plan, VectorRoutedValuesAreRebuiltAtServeTime) {
  for (int d : {64, 128}) {
    const ChunkFixture f = MakeChunk(257, d, DType::kFloat32, 0.0f, 3);
    EXPECT_GT(f.weights.Head(1, 1).r2, 1.0 - 1e-6);
    CompressionPlanOptions o{.score = ScoreStage::kKeyDiff,
                             .route = RouteStage::kVector,
                             .p_c = 0.5,
                             .window = f.window};
    auto chunk = Compress(o, f.layout, f.Input(false));
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    auto rope = RopeTable::Create(f.layout.rope, d);
    for (int l = 0; l < 2; ++l) {
      for (int h = 0; h < 2; ++h) {
        auto sh = BuildServingHead(*chunk, l, h, &*rope, &f.weights);
        ASSERT_TRUE(sh.ok()) << sh.status();
        const CompactHead& ch = chunk->Head(l, h);
        int64_t rebuilt = 0;
        for (int64_t j = 0; j < ch.slots(); ++j) {
          const int64_t token = ch.positions[j] - 1000;
          const Matrix& v = f.values[l * 2 + h];
          double err = 0, mag = 0;
          for (int c = 0; c < d; ++c) {
            err = std::max(err, std::abs(double(sh->values.Row(j)[c]) - v.Row(token)[c]));
            mag = std::max(mag, std::abs(double(v.Row(token)[c])));
          }
          // Relative to the value scale. Rounding alone (RoPE round trip ~1e-6 of |k|, float32
          // rebuild of d terms, see vector_test.cc) is ~1e-6; the fit adds more: the default
          // relative ridge (1e-6 trace(G)/d) shrinks W along the weak directions of these
          // random-walk keys, whose Gram is ill conditioned, and the calibration regresses on
          // de-rotated keys that carry the round-trip error. Observed 7.2e-5 under every
          // OPENBLAS_CORETYPE; 3e-4 leaves 4x, a value not rebuilt or rebuilt from the wrong
          // position is off by O(1).
          ASSERT_LT(err, 3e-4 * mag) << "slot " << j;
          rebuilt += (ch.flags[j] & kSlotRebuildValue) ? 1 : 0;
        }
        EXPECT_EQ(rebuilt, 2 * std::llround(0.25 * 257));
      }
    }
    // The wrong W set is refused.
    VectorWeights other = f.weights;
    other.heads[0].w.values[0] += 1.0f;
    other.version = other.ComputeVersion();
    EXPECT_EQ(BuildServingHead(*chunk, 0, 0, &*rope, &other).status().code(),
              StatusCode::kFailedPrecondition);
  }
}

TEST(Plan, GqaGroupSizes) {
  for (int g : {1, 4, 8}) {
    const ChunkFixture f = MakeChunk(129, 64, DType::kBFloat16, 0.3f, 20 + g, g);
    for (const Composition& c : kCompositions) {
      CompressionPlanOptions o{.score = c.score,
                               .merge = c.merge,
                               .route = RouteStage::kVector,
                               .p_c = 0.5,
                               .window = f.window,
                               .keydiff_block = c.keydiff_block};
      auto chunk = Compress(o, f.layout, f.Input());
      ASSERT_TRUE(chunk.ok()) << chunk.status() << " G=" << g << " " << c.name;
      EXPECT_EQ(chunk->HalfPairs(), 4 * 2 * std::llround(0.5 * 129)) << c.name;
    }
  }
}

TEST(Plan, TinyAndOddChunksMeetTheBudget) {
  for (int64_t n : {1, 2, 7, 33}) {
    const ChunkFixture f = MakeChunk(n, 64, DType::kFloat16, 0.3f, 10 + n);
    for (double p_c : {0.25, 0.5, 0.75, 0.9}) {
      for (ScoreStage score : {ScoreStage::kKeyDiff, ScoreStage::kNone}) {
        CompressionPlanOptions o{
            .score = score, .route = RouteStage::kVector, .p_c = p_c, .sinks = 0};
        auto chunk = Compress(o, f.layout, f.Input(false));
        ASSERT_TRUE(chunk.ok()) << chunk.status() << " n=" << n << " p_c=" << p_c;
        EXPECT_EQ(chunk->HalfPairs(), 4 * 2 * std::llround((1.0 - p_c) * n)) << n << " " << p_c;
      }
    }
  }
}

TEST(Plan, PyramidBudgetsDifferPerLayerButSumExactly) {
  const ChunkFixture f = MakeChunk(301, 64, DType::kBFloat16, 0.3f, 4);
  // beta = 2 keeps PyramidKV's min layer budget above the window (beta = 20 falls back to
  // uniform budgets for 2 layers of 301 tokens).
  CompressionPlanOptions o{
      .score = ScoreStage::kPyramidKv, .p_c = 0.75, .window = f.window, .pyramid_beta = 2.0};
  auto chunk = Compress(o, f.layout, f.Input());
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  EXPECT_GT(chunk->Head(0, 0).slots(), chunk->Head(1, 0).slots());
  EXPECT_EQ(chunk->HalfPairs(), 4 * 2 * std::llround(0.25 * 301));
}

TEST(Plan, RejectsBadInput) {
  const ChunkFixture f = MakeChunk(40, 64, DType::kBFloat16, 0.3f, 5);
  CompressionPlanOptions o{.score = ScoreStage::kSnapKv, .p_c = 0.5, .window = f.window};

  auto no_q = Compress(o, f.layout, f.Input(false));
  EXPECT_EQ(no_q.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(no_q.status().message(), HasSubstr("snapkv needs window queries"));

  CompressionPlanOptions slim{
      .score = ScoreStage::kNone, .merge = MergeStage::kKvSlimmer, .window = f.window};
  EXPECT_THAT(Compress(slim, f.layout, f.Input(false)).status().message(),
              HasSubstr("kvslimmer needs window queries"));

  CompressionPlanOptions route = o;
  route.route = RouteStage::kVector;
  CompressionInput in = f.Input();
  in.weights = nullptr;
  EXPECT_EQ(Compress(route, f.layout, in).status().code(), StatusCode::kFailedPrecondition);

  in = f.Input();
  in.raw = std::span(f.raw).first(f.raw.size() - 2);
  EXPECT_THAT(Compress(o, f.layout, in).status().message(), HasSubstr("raw chunk has"));

  CompressionPlanOptions tight = o;
  tight.p_c = 0.9;  // M = 4 < 4 sinks + 16 window
  auto oor = Compress(tight, f.layout, f.Input());
  EXPECT_EQ(oor.status().code(), StatusCode::kOutOfRange);
  EXPECT_THAT(oor.status().message(), HasSubstr("layer 0 head 0"));

  CompressionPlanOptions wide = o;
  wide.window = 40;
  wide.sinks = 4;
  std::vector<Matrix> big_q(4, Matrix(40 * 4, 64));
  std::vector<ConstMatrixView> big_views;
  for (const Matrix& m : big_q) big_views.push_back(m.View());
  in = f.Input();
  in.window_queries = big_views;
  auto small = Compress(wide, f.layout, in);
  EXPECT_EQ(small.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(small.status().message(), HasSubstr("smaller than sinks"));

  std::vector<uint8_t> nan_raw = f.raw;
  const uint16_t nan_bf16 = 0x7fc0;
  std::memcpy(nan_raw.data() + 10 * 2, &nan_bf16, 2);
  in = f.Input();
  in.raw = nan_raw;
  auto nan = Compress(o, f.layout, in);
  EXPECT_EQ(nan.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(nan.status().message(), HasSubstr("non-finite"));

  CompressionPlanOptions bad_pc = o;
  bad_pc.p_c = 1.0;
  EXPECT_EQ(Compress(bad_pc, f.layout, f.Input()).status().code(), StatusCode::kOutOfRange);
}

TEST(Plan, GatherWindowQueriesGroupsQueryHeadsByKvHead) {
  const ModelLayout layout = testing::Float32Layer(2, 2, 4);
  std::vector<float> q(3 * 4 * 4);
  for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(i);
  auto out = GatherWindowQueries(layout, q.data(), 3);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), 2u);
  // KV head 1, window row 2, group member 1 = query head 3 of token 2.
  EXPECT_EQ((*out)[1].Row(2 * 2 + 1)[0], q[(2 * 4 + 3) * 4]);
}

}  // namespace
}  // namespace kvd::kernels

namespace kvd::kernels {
namespace {

// An independent reference of the kAdaptive split: after the per-head floor, hand out the layer's
// remaining slots one at a time to the head whose best unused candidate scores highest (ties:
// lower index, then lower head), in float64.
std::vector<int64_t> ReferenceAdaptive(const std::vector<std::vector<float>>& scores, int64_t kept,
                                       int64_t sinks, int64_t window, double floor) {
  const int64_t n = static_cast<int64_t>(scores[0].size()), heads = scores.size();
  const int64_t forced = sinks + window, share = kept - forced;
  const int64_t fl = static_cast<int64_t>(std::floor(floor * share));
  std::vector<std::vector<std::pair<double, int64_t>>> order(heads);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = sinks; i < n - window; ++i) order[h].push_back({scores[h][i], i});
    std::stable_sort(order[h].begin(), order[h].end(),
                     [](const auto& a, const auto& b) { return a.first > b.first; });
  }
  std::vector<int64_t> taken(heads, fl);
  for (int64_t k = 0; k < heads * (share - fl); ++k) {
    int64_t best = -1;
    for (int64_t h = 0; h < heads; ++h) {
      if (taken[h] >= static_cast<int64_t>(order[h].size())) continue;
      if (best < 0) {
        best = h;
        continue;
      }
      const auto& a = order[h][taken[h]];
      const auto& b = order[best][taken[best]];
      if (a.first > b.first || (a.first == b.first && a.second < b.second)) best = h;
    }
    ++taken[best];
  }
  std::vector<int64_t> out(heads);
  for (int64_t h = 0; h < heads; ++h) out[h] = forced + taken[h];
  return out;
}

TEST(AdaptiveHeadBudgets, MatchesAGreedyReferenceAndSumsExactly) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    const int64_t heads = 1 + trial % 5, n = 40 + trial * 3, sinks = trial % 3, window = 4;
    std::vector<std::vector<float>> scores(heads, std::vector<float>(n));
    // Per-head scales differ (a peaky head and flat heads), and a few exact ties.
    for (int64_t h = 0; h < heads; ++h) {
      std::exponential_distribution<float> e(1.0f + h);
      for (auto& x : scores[h]) x = std::round(e(rng) * 64.0f) / 64.0f;
    }
    for (double floor : {0.0, 0.2, 0.5, 1.0}) {
      const int64_t kept = sinks + window + 1 + (trial * 7) % (n - sinks - window);
      auto got = AdaptiveHeadBudgets(scores, kept, sinks, window, floor);
      ASSERT_TRUE(got.ok()) << got.status();
      SCOPED_TRACE("trial " + std::to_string(trial) + " floor " + std::to_string(floor));
      EXPECT_EQ(*got, ReferenceAdaptive(scores, kept, sinks, window, floor));
      EXPECT_EQ(std::accumulate(got->begin(), got->end(), int64_t{0}), heads * kept);
      const int64_t fl = static_cast<int64_t>(std::floor(floor * (kept - sinks - window)));
      for (int64_t m : *got) {
        EXPECT_GE(m, sinks + window + fl);
        EXPECT_LE(m, n);
      }
      if (floor == 1.0) {
        EXPECT_EQ(*got, std::vector<int64_t>(heads, kept));
      }
    }
  }
  // Identical heads split evenly; a budget that cannot hold the forced tokens is passed through.
  std::vector<std::vector<float>> same(3, std::vector<float>(50));
  for (int i = 0; i < 50; ++i) same[0][i] = same[1][i] = same[2][i] = static_cast<float>(i % 7);
  EXPECT_EQ(*AdaptiveHeadBudgets(same, 20, 4, 8, 0.0), std::vector<int64_t>(3, 20));
  EXPECT_EQ(*AdaptiveHeadBudgets(same, 10, 4, 8, 0.2), std::vector<int64_t>(3, 10));
  // Errors.
  EXPECT_THAT(AdaptiveHeadBudgets({}, 10, 4, 8, 0.2).status().message(), HasSubstr("no heads"));
  std::vector<std::vector<float>> ragged = {std::vector<float>(50), std::vector<float>(49)};
  EXPECT_THAT(AdaptiveHeadBudgets(ragged, 20, 4, 8, 0.2).status().message(),
              HasSubstr("different token counts"));
  same[1][10] = std::nanf("");
  EXPECT_THAT(AdaptiveHeadBudgets(same, 20, 4, 8, 0.2).status().message(), HasSubstr("NaN"));
  EXPECT_THAT(AdaptiveHeadBudgets(ragged, 20, 4, 8, 1.5).status().message(),
              HasSubstr("floor must be in [0, 1]"));
}

TEST(Plan, AdaptiveHeadBudgetsKeepTheLayerBudgetForEveryScorer) {
  const ChunkFixture f = MakeChunk(301, 64, DType::kBFloat16, 0.3f, 9);
  for (ScoreStage score : {ScoreStage::kSnapKv, ScoreStage::kKeyDiff, ScoreStage::kPyramidKv}) {
    for (RouteStage route : {RouteStage::kNone, RouteStage::kVector}) {
      for (double p_c : {0.5, 0.9}) {
        SCOPED_TRACE("score " + std::to_string(int(score)) + " route " +
                     std::to_string(int(route)) + " p_c " + std::to_string(p_c));
        CompressionPlanOptions uni{.score = score, .route = route, .p_c = p_c, .window = f.window};
        CompressionPlanOptions ada = uni;
        ada.head_budget = HeadBudget::kAdaptive;
        ada.adaptive_floor = 0.0;
        auto u = Compress(uni, f.layout, f.Input());
        auto a = Compress(ada, f.layout, f.Input());
        ASSERT_TRUE(u.ok()) << u.status();
        ASSERT_TRUE(a.ok()) << a.status();
        EXPECT_EQ(a->HalfPairs(), u->HalfPairs());  // exact chunk budget
        bool differs = false;
        for (int l = 0; l < 2; ++l) {
          // Per layer the same half-pairs; per head they may move.
          int64_t hu = 0, ha = 0;
          for (int h = 0; h < 2; ++h) {
            const CompactHead& x = u->Head(l, h);
            const CompactHead& y = a->Head(l, h);
            hu += x.slots() + x.value_slots();
            ha += y.slots() + y.value_slots();
            differs |= x.slots() != y.slots();
          }
          EXPECT_EQ(ha, hu) << "layer " << l;
        }
        if (route == RouteStage::kNone) {
          EXPECT_TRUE(differs);
        }
        // A floor of 1 is the uniform plan, slot for slot.
        ada.adaptive_floor = 1.0;
        auto one = Compress(ada, f.layout, f.Input());
        ASSERT_TRUE(one.ok()) << one.status();
        for (size_t i = 0; i < u->heads.size(); ++i) EXPECT_EQ(one->heads[i], u->heads[i]);
      }
    }
  }
}

TEST(Plan, ValidateRejectsBadHeadBudgetOptions) {
  CompressionPlanOptions o{.score = ScoreStage::kNone, .head_budget = HeadBudget::kAdaptive};
  EXPECT_THAT(o.Validate().message(), HasSubstr("kAdaptive needs a score stage"));
  o.score = ScoreStage::kKeyDiff;
  o.keydiff_block = 64;
  EXPECT_THAT(o.Validate().message(), HasSubstr("not supported with block-wise KeyDiff"));
  o.keydiff_block = 0;
  EXPECT_TRUE(o.Validate().ok());
  o.adaptive_floor = -0.1;
  EXPECT_THAT(o.Validate().message(), HasSubstr("adaptive_floor must be in [0, 1]"));
}

}  // namespace
}  // namespace kvd::kernels
