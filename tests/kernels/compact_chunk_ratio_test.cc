// What a compact chunk costs to store: for SmolLM2-135M's layout at 256 tokens per chunk (the
// daemon's default), every plan composition at p_c 0.5 / 0.75 / 0.9 encodes to within 2% of
// (1 - p_c) of the raw chunk, and within 1% of the exact budget its plan keeps. Also a round trip
// of real plan outputs (merges, VECTOR-routed slots, weighted positions).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "kvd/common/dtype.h"
#include "kvd/kernels/compact_chunk.h"
#include "kvd/kernels/plan.h"
#include "kvd/kernels/rope.h"
#include "kvd/kernels/vector.h"
#include "raw_layer.h"
#include "reference.h"

namespace kvd::kernels {
namespace {

using testing::RandomCorrelatedKeys;
using testing::RandomMatrix;

// SmolLM2-135M as deploy/configs/default.yaml declares it (model "smollm2-135m", the demo model).
ModelLayout SmolLm2Layout() {
  ModelLayout layout{.num_layers = 30,
                     .num_kv_heads = 3,
                     .num_q_heads = 9,
                     .head_dim = 64,
                     .dtype = DType::kBFloat16,
                     .rope = {.theta = 100000.0, .pairing = RopePairing::kInterleaved}};
  return layout;
}

constexpr int kTokens = 256;  // the daemon's default chunk_tokens
constexpr int64_t kWindow = 16;
constexpr int64_t kFirstPosition = 3 * kTokens;  // the fourth chunk of a prompt

// One raw chunk in the engine layout: per head, pre-RoPE keys and values as random walks (adjacent
// tokens similar, as in real caches), keys rotated to their positions; window queries of the last
// kWindow tokens; VECTOR weights calibrated on the chunk itself.
struct RawChunk {
  ModelLayout layout = SmolLm2Layout();
  std::vector<int64_t> positions = testing::SequentialPositions(kTokens, kFirstPosition);
  std::vector<uint8_t> raw;
  std::vector<Matrix> queries;
  std::vector<ConstMatrixView> query_views;
  VectorWeights weights;

  CompressionInput Input() const {
    return {.raw = raw, .positions = positions, .window_queries = query_views, .weights = &weights};
  }
};

const RawChunk& SharedChunk() {
  static const RawChunk* chunk = [] {
    auto* c = new RawChunk;
    const ModelLayout& l = c->layout;
    const int d = l.head_dim, group = l.num_q_heads / l.num_kv_heads;
    const size_t e = DTypeSize(l.dtype), token_bytes = l.TokenBytes();
    auto rope = RopeTable::Create(l.rope, d);
    EXPECT_TRUE(rope.ok()) << rope.status();
    c->raw.assign(l.ChunkBytes(kTokens), 0);
    for (int layer = 0; layer < l.num_layers; ++layer) {
      for (int h = 0; h < l.num_kv_heads; ++h) {
        const uint64_t seed = 1000 + 10 * layer + h;
        Matrix kpre = RandomCorrelatedKeys(kTokens, d, seed);
        Matrix v = RandomCorrelatedKeys(kTokens, d, seed + 500);
        Matrix k(kTokens, d);
        EXPECT_TRUE(
            ApplyRope(*rope, RopeDirection::kRotate, c->positions, kpre.View(), k.View()).ok());
        uint8_t* kb = c->raw.data() + l.LayerOffset(layer, kTokens);
        uint8_t* vb = kb + kTokens * token_bytes;
        for (int i = 0; i < kTokens; ++i) {
          ConvertFromFloat(l.dtype, k.Row(i), kb + i * token_bytes + h * d * e, d);
          ConvertFromFloat(l.dtype, v.Row(i), vb + i * token_bytes + h * d * e, d);
        }
        c->queries.push_back(RandomMatrix(kWindow * group, d, seed + 900));
      }
    }
    for (const Matrix& q : c->queries) c->query_views.push_back(q.View());
    auto w = testing::CalibrateOnChunk(l, c->raw, c->positions);
    EXPECT_TRUE(w.ok()) << w.status();
    c->weights = std::move(*w);
    return c;
  }();
  return *chunk;
}

struct Policy {
  const char* name;
  ScoreStage score;
  MergeStage merge;
  RouteStage route;
  RepresentativePosition position = RepresentativePosition::kLast;
  HeadBudget head_budget = HeadBudget::kUniform;
};

const Policy kPolicies[] = {
    // eviction only
    {"snapkv", ScoreStage::kSnapKv, MergeStage::kNone, RouteStage::kNone},
    {"keydiff", ScoreStage::kKeyDiff, MergeStage::kNone, RouteStage::kNone},
    {"pyramidkv", ScoreStage::kPyramidKv, MergeStage::kNone, RouteStage::kNone},
    {"snapkv-adaptive", ScoreStage::kSnapKv, MergeStage::kNone, RouteStage::kNone,
     RepresentativePosition::kLast, HeadBudget::kAdaptive},  // slot counts differ per head
    {"recency", ScoreStage::kNone, MergeStage::kNone, RouteStage::kNone},
    // merging
    {"kvslimmer", ScoreStage::kNone, MergeStage::kKvSlimmer, RouteStage::kNone},
    {"hybrid-snapkv", ScoreStage::kSnapKv, MergeStage::kKvSlimmer, RouteStage::kNone},
    {"hybrid-snapkv-weighted", ScoreStage::kSnapKv, MergeStage::kKvSlimmer, RouteStage::kNone,
     RepresentativePosition::kWeighted},
    // value routing
    {"snapkv+vector", ScoreStage::kSnapKv, MergeStage::kNone, RouteStage::kVector},
    {"hybrid-snapkv+vector", ScoreStage::kSnapKv, MergeStage::kKvSlimmer, RouteStage::kVector},
};

TEST(CompactChunkRatio, EncodedSizeIsWithinTwoPercentOfOneMinusPc) {
  const RawChunk& raw = SharedChunk();
  // Raw bytes as the daemon counts them: bf16 K and V of every layer and KV head.
  const double raw_bytes = static_cast<double>(raw.layout.ChunkBytes(kTokens));
  ASSERT_EQ(raw_bytes, static_cast<double>(raw.raw.size()));
  const int64_t heads = raw.layout.num_layers * raw.layout.num_kv_heads;
  for (double p_c : {0.5, 0.75, 0.9}) {
    const int64_t m = std::llround((1.0 - p_c) * kTokens);  // each head's budget, in pairs
    for (const Policy& p : kPolicies) {
      SCOPED_TRACE(std::string(p.name) + " p_c=" + std::to_string(p_c));
      CompressionPlanOptions o{.score = p.score,
                               .merge = p.merge,
                               .route = p.route,
                               .p_c = p_c,
                               .window = kWindow,
                               .position = p.position,
                               .head_budget = p.head_budget};
      CompressionStats stats;
      auto chunk = Compress(o, raw.layout, raw.Input(), &stats);
      ASSERT_TRUE(chunk.ok()) << chunk.status();
      ASSERT_EQ(chunk->HalfPairs(), 2 * m * heads);  // the plan's budget is exact
      if (p.merge != MergeStage::kNone) EXPECT_GT(stats.merged_tokens, 0);
      if (p.route != RouteStage::kNone) EXPECT_GT(stats.rebuild_slots, 0);
      auto bytes = EncodeCompactChunk(*chunk);
      ASSERT_TRUE(bytes.ok()) << bytes.status();
      auto back = DecodeCompactChunk(*bytes);
      ASSERT_TRUE(back.ok()) << back.status();
      EXPECT_TRUE(*back == *chunk);

      const double ratio = static_cast<double>(bytes->size()) / raw_bytes;
      const double budget_ratio = static_cast<double>(m) / kTokens;  // keys + values kept
      std::printf(
          "  %-24s p_c=%.2f  stored/raw=%.5f  (1-p_c)=%.3f  %+.2f%%  budget %+.2f%%  "
          "beyond keys+values %zu B\n",
          p.name, p_c, ratio, 1.0 - p_c, 100.0 * (ratio / (1.0 - p_c) - 1.0),
          100.0 * (ratio / budget_ratio - 1.0),
          bytes->size() - static_cast<size_t>(budget_ratio * raw_bytes));
      EXPECT_LE(std::abs(ratio / (1.0 - p_c) - 1.0), 0.02) << ratio;
      // The integer budget m is (1 - p_c) * 256 rounded; beyond it the format adds under 1%.
      EXPECT_GE(ratio, budget_ratio);
      EXPECT_LE(ratio / budget_ratio - 1.0, 0.01) << ratio;
    }
  }
}

}  // namespace
}  // namespace kvd::kernels
