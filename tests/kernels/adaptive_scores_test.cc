// Head-wise budgets (plan.h HeadBudget::kAdaptive): the plan scores each head once, shares out
// the layer's budget by those scores and selects each head's pool with the same scores. A toy
// score stage counts its calls per head.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "kvd/kernels/plan.h"
#include "kvd/kernels/stages.h"
#include "raw_layer.h"
#include "reference.h"

namespace kvd::kernels {
namespace {

constexpr uint8_t kCountedCode = 240;  // a score code no other test registers or assumes free

// The calls of the toy stage per head (a head is known by its first key's first element).
std::mutex calls_mu;
std::map<float, int> calls;

// The toy stage: the key's L2 norm (higher = keep), counting its calls.
Status CountedKeyNormScores(const ScoreHeadInput& in, std::span<float> scores) {
  {
    std::lock_guard lock(calls_mu);
    ++calls[in.keys.Row(0)[0]];
  }
  for (int64_t i = 0; i < in.keys.rows; ++i) {
    double sum = 0.0;
    for (int64_t c = 0; c < in.keys.cols; ++c) sum += double(in.keys.Row(i)[c]) * in.keys.Row(i)[c];
    scores[static_cast<size_t>(i)] = static_cast<float>(std::sqrt(sum));
  }
  return Status::Ok();
}

TEST(AdaptiveScoresTest, EachHeadIsScoredOnce) {
  static const Status registered = [] {
    StageRegistration r;
    r.name = "counted_key_norm";
    r.kind = StageKind::kScore;
    r.code = kCountedCode;
    r.score = CountedKeyNormScores;
    return StageRegistry::Global().Register(std::move(r));
  }();
  ASSERT_TRUE(registered.ok()) << registered;
  constexpr int kHeads = 4, kDim = 8;
  constexpr int64_t kTokens = 96;
  const ModelLayout layout = testing::Float32Layer(kHeads, /*group=*/1, kDim);
  std::vector<Matrix> keys, values;
  for (int h = 0; h < kHeads; ++h) {
    // Heads of different spread, so that the shared-out budgets differ.
    keys.push_back(testing::RandomMatrix(kTokens, kDim, 31 + h, 0.5f + 0.5f * h));
    values.push_back(testing::RandomMatrix(kTokens, kDim, 41 + h));
  }
  std::vector<uint8_t> raw(layout.ChunkBytes(kTokens), 0);
  testing::WriteFloat32Layer(layout, 0, kTokens, keys, values, &raw);
  const std::vector<int64_t> positions = testing::SequentialPositions(kTokens, 100);
  CompressionInput in;
  in.raw = raw;
  in.positions = positions;
  CompressionPlanOptions o;
  o.score = static_cast<ScoreStage>(kCountedCode);
  o.p_c = 0.5;
  o.sinks = 2;
  o.head_budget = HeadBudget::kAdaptive;
  o.adaptive_floor = 0.0;
  calls.clear();
  auto chunk = Compress(o, layout, in);
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  bool differs = false;
  for (int h = 1; h < kHeads; ++h)
    differs |= chunk->Head(0, h).slots() != chunk->Head(0, 0).slots();
  EXPECT_TRUE(differs) << "the heads' budgets should differ";
  ASSERT_EQ(calls.size(), static_cast<size_t>(kHeads));
  for (const auto& [head, count] : calls) EXPECT_EQ(count, 1) << "head with first key " << head;
}

}  // namespace
}  // namespace kvd::kernels
