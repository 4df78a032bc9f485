// The compression stage registry (stages.h): the built-in stages' on-disk codes and
// capabilities, registration errors, a toy score stage (key_norm_stage.h), a toy merge stage
// (pair_mean_stage.h) and a toy route stage (mean_value_stage.h) that run through the CPU plan,
// the chunk format and the device plan's support check with one registration each.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "key_norm_stage.h"
#include "kvd/kernels/plan_device.h"
#include "kvd/kernels/serving.h"
#include "kvd/kernels/stages.h"
#include "mean_value_stage.h"
#include "pair_mean_stage.h"
#include "raw_layer.h"
#include "reference.h"

namespace kvd::kernels {
namespace {

using ::testing::HasSubstr;

TEST(StageRegistryTest, BuiltinStagesKeepTheirOnDiskCodesAndCapabilities) {
  const StageRegistry& r = StageRegistry::Global();
  struct Expected {
    const char* name;
    StageKind kind;
    uint8_t code;
  };
  for (const Expected& e :
       {Expected{"snapkv", StageKind::kScore, 1}, Expected{"keydiff", StageKind::kScore, 2},
        Expected{"pyramidkv", StageKind::kScore, 3},
        Expected{"expected_attention", StageKind::kScore, 4},
        Expected{"kvslimmer", StageKind::kMerge, 1}, Expected{"vector", StageKind::kRoute, 1}}) {
    const StageRegistration* s = r.Find(e.name);
    ASSERT_NE(s, nullptr) << e.name;
    EXPECT_EQ(s->kind, e.kind) << e.name;
    EXPECT_EQ(s->code, e.code) << e.name;
    EXPECT_EQ(r.Find(e.kind, e.code), s) << e.name;
  }
  EXPECT_EQ(FindStage(ScoreStage::kSnapKv)->name, "snapkv");
  EXPECT_EQ(FindStage(ScoreStage::kExpectedAttention)->name, "expected_attention");
  EXPECT_EQ(FindStage(MergeStage::kKvSlimmer)->name, "kvslimmer");
  EXPECT_EQ(FindStage(RouteStage::kVector)->name, "vector");
  EXPECT_EQ(FindStage(ScoreStage::kNone)->name, "none");  // recency
  EXPECT_EQ(FindStage(MergeStage::kNone), nullptr);

  EXPECT_TRUE(r.Find("snapkv")->needs_window_queries);
  EXPECT_TRUE(r.Find("pyramidkv")->needs_window_queries);
  EXPECT_FALSE(r.Find("keydiff")->needs_window_queries);
  EXPECT_TRUE(r.Find("expected_attention")->needs_query_stats);
  EXPECT_FALSE(r.Find("expected_attention")->device);
  EXPECT_TRUE(r.Find("keydiff")->device);
  EXPECT_NE(r.Find("pyramidkv")->layer_budgets, nullptr);
  EXPECT_EQ(r.Find("snapkv")->layer_budgets, nullptr);
  EXPECT_TRUE(r.Find("vector")->needs_calibration);
  EXPECT_NE(r.Find("vector")->rebuild, nullptr);
  EXPECT_TRUE(r.Find("vector")->device_rebuild);
  EXPECT_TRUE(r.Find("kvslimmer")->keeps_positions);
  EXPECT_FALSE(r.Find("snapkv")->keeps_positions);
  EXPECT_EQ(r.Find("quantize")->kind, StageKind::kQuantize);
}

TEST(StageRegistryTest, RegisterRefusesTakenNamesAndCodesAndScoreStagesWithoutAScorer) {
  StageRegistry& r = StageRegistry::Global();
  Status taken_name = r.Register(
      {.name = "snapkv", .kind = StageKind::kScore, .code = 250, .score = testing::KeyNormScores});
  EXPECT_EQ(taken_name.code(), StatusCode::kAlreadyExists) << taken_name;
  Status taken_code = r.Register(
      {.name = "other", .kind = StageKind::kScore, .code = 2, .score = testing::KeyNormScores});
  EXPECT_EQ(taken_code.code(), StatusCode::kAlreadyExists) << taken_code;
  EXPECT_THAT(taken_code.message(), HasSubstr("keydiff"));
  Status no_scorer = r.Register({.name = "other", .kind = StageKind::kScore, .code = 251});
  EXPECT_EQ(no_scorer.code(), StatusCode::kInvalidArgument) << no_scorer;
  Status scorer_on_merge = r.Register(
      {.name = "other", .kind = StageKind::kMerge, .code = 9, .score = testing::KeyNormScores});
  EXPECT_EQ(scorer_on_merge.code(), StatusCode::kInvalidArgument) << scorer_on_merge;
  EXPECT_EQ(r.Find("other"), nullptr);
}

TEST(StageRegistryTest, AnUnregisteredScoreCodeIsRefusedByThePlan) {
  CompressionPlanOptions o;
  o.score = static_cast<ScoreStage>(201);
  Status s = o.Validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("unknown stage"));
}

// A one-layer float32 chunk of random keys and values (kHeads heads of [kTokens, kDim]).
struct ToyChunk {
  static constexpr int kHeads = 2, kDim = 8;
  static constexpr int64_t kTokens = 64;
  ModelLayout layout = testing::Float32Layer(kHeads, /*group=*/2, kDim);
  std::vector<Matrix> keys, values;
  std::vector<uint8_t> raw;
  std::vector<int64_t> positions = testing::SequentialPositions(kTokens, 1000);
  ToyChunk() {
    for (int h = 0; h < kHeads; ++h) {
      keys.push_back(testing::RandomMatrix(kTokens, kDim, 11 + h));
      values.push_back(testing::RandomMatrix(kTokens, kDim, 21 + h));
    }
    raw.assign(layout.ChunkBytes(kTokens), 0);
    testing::WriteFloat32Layer(layout, 0, kTokens, keys, values, &raw);
  }
  CompressionInput Input() const {  // no window queries: key_norm needs none
    CompressionInput in;
    in.raw = raw;
    in.positions = positions;
    return in;
  }
  // The positions key_norm keeps in head h: the sinks and the `kept - sinks` others whose keys
  // have the largest (smallest) norms, in float64.
  std::vector<int64_t> KeyNormPositions(int h, int64_t kept, int64_t sinks, bool smallest) const {
    std::vector<double> norm(kTokens);
    for (int64_t i = 0; i < kTokens; ++i) {
      for (int c = 0; c < kDim; ++c) norm[i] += double(keys[h].Row(i)[c]) * keys[h].Row(i)[c];
    }
    std::vector<int64_t> order(kTokens - sinks);
    std::iota(order.begin(), order.end(), sinks);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return smallest ? norm[a] < norm[b] : norm[a] > norm[b];
    });
    std::vector<int64_t> want;
    for (int64_t i = 0; i < sinks; ++i) want.push_back(1000 + i);
    for (int64_t j = 0; j < kept - sinks; ++j) want.push_back(1000 + order[j]);
    std::sort(want.begin(), want.end());
    return want;
  }
};

std::vector<int64_t> SortedPositions(const CompactHead& head) {
  std::vector<int64_t> got = head.positions;
  std::sort(got.begin(), got.end());
  return got;
}

// key_norm keeps the sinks and the tokens whose keys have the largest norms, records its own
// code in the chunk (which encodes and decodes), and is refused by the device plan (CPU only).
TEST(StageRegistryTest, AToyScoreStageRunsThroughTheCpuPlanWithOneRegistration) {
  ASSERT_TRUE(testing::RegisterKeyNormStage().ok()) << testing::RegisterKeyNormStage();
  const ToyChunk toy;
  CompressionPlanOptions o;
  o.score = testing::kKeyNorm;
  o.p_c = 0.5;
  o.sinks = 2;
  auto chunk = Compress(o, toy.layout, toy.Input());
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  EXPECT_EQ(chunk->codec.score, testing::kKeyNorm);
  EXPECT_EQ(ScoreStageName(chunk->codec.score), "key_norm");

  const int64_t kept = std::llround((1.0 - o.p_c) * ToyChunk::kTokens);  // no queries: no window
  for (int h = 0; h < ToyChunk::kHeads; ++h) {
    EXPECT_EQ(SortedPositions(chunk->heads[h]), toy.KeyNormPositions(h, kept, o.sinks, false))
        << "head " << h;
  }

  auto bytes = EncodeCompactChunk(*chunk);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto back = DecodeCompactChunk(*bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->codec.score, testing::kKeyNorm);

  Status device = CheckDevicePlanSupported(o);
  EXPECT_EQ(device.code(), StatusCode::kUnimplemented) << device;
  EXPECT_THAT(device.message(), HasSubstr("key_norm"));
}

// key_norm's policy key, declared in its registration, reaches its scores through
// CompressionPlanOptions::stage_keys (key_norm_smallest keeps the smallest norms), and the plan
// checks it against the declaration.
TEST(StageRegistryTest, AStagePolicyKeyReachesTheStageAndIsChecked) {
  ASSERT_TRUE(testing::RegisterKeyNormStage().ok()) << testing::RegisterKeyNormStage();
  const StagePolicyKey* key = nullptr;
  EXPECT_EQ(StageRegistry::Global().FindPolicyKey("key_norm_smallest", &key),
            StageRegistry::Global().Find("key_norm"));
  ASSERT_NE(key, nullptr);
  EXPECT_EQ(key->type, PolicyKeyType::kBool);
  const ToyChunk toy;
  CompressionPlanOptions o;
  o.score = testing::kKeyNorm;
  o.sinks = 2;
  EXPECT_EQ(StageKeyValue(o, testing::kKeyNormSmallest), 0.0);  // the default
  o.stage_keys[testing::kKeyNormSmallest] = 1.0;
  auto chunk = Compress(o, toy.layout, toy.Input());
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  const int64_t kept = std::llround((1.0 - o.p_c) * ToyChunk::kTokens);
  for (int h = 0; h < ToyChunk::kHeads; ++h) {
    EXPECT_EQ(SortedPositions(chunk->heads[h]), toy.KeyNormPositions(h, kept, o.sinks, true))
        << "head " << h;
  }

  o.stage_keys[testing::kKeyNormSmallest] = 0.5;
  Status not_bool = o.Validate();
  EXPECT_EQ(not_bool.code(), StatusCode::kInvalidArgument) << not_bool;
  EXPECT_THAT(not_bool.message(), HasSubstr("key_norm_smallest: 0.5 is not a boolean"));
  o.stage_keys[testing::kKeyNormSmallest] = 1.0;
  o.score = ScoreStage::kKeyDiff;  // the key's stage is not the plan's
  Status stray = o.Validate();
  EXPECT_EQ(stray.code(), StatusCode::kInvalidArgument) << stray;
  EXPECT_THAT(stray.message(), HasSubstr("key_norm_smallest is not a key of the plan's"));
  o.stage_keys = {{"no_such_key", 1.0}};
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
}

TEST(StageRegistryTest, RegisterRefusesATakenPolicyKeyAndADefaultOutsideItsRange) {
  ASSERT_TRUE(testing::RegisterKeyNormStage().ok()) << testing::RegisterKeyNormStage();
  StageRegistry& r = StageRegistry::Global();
  Status taken = r.Register({.name = "other",
                             .kind = StageKind::kScore,
                             .code = 252,
                             .score = testing::KeyNormScores,
                             .policy_keys = {{.name = "key_norm_smallest"}}});
  EXPECT_EQ(taken.code(), StatusCode::kAlreadyExists) << taken;
  EXPECT_THAT(taken.message(), HasSubstr("key_norm"));
  Status bad_default = r.Register({.name = "other",
                                   .kind = StageKind::kScore,
                                   .code = 252,
                                   .score = testing::KeyNormScores,
                                   .policy_keys = {{.name = "other_k",
                                                    .type = PolicyKeyType::kInt,
                                                    .min = 1,
                                                    .max = 8,
                                                    .default_value = 0}}});
  EXPECT_EQ(bad_default.code(), StatusCode::kInvalidArgument) << bad_default;
  EXPECT_THAT(bad_default.message(), HasSubstr("outside [1, 8]"));
  EXPECT_EQ(r.Find("other"), nullptr);
}

// A choice key: its value is the index of a name, the error for another name lists the names,
// its text is the name; a key may take another key's value as its default (default_key).
TEST(StageRegistryTest, AChoiceKeyTravelsAsAnIndexAndReadsAsItsName) {
  const StagePolicyKey rotate = {.name = "toy_rotate",
                                 .type = PolicyKeyType::kChoice,
                                 .default_value = 0,
                                 .choices = {"none", "hadamard"}};
  EXPECT_EQ(StageKeyChoice(rotate, "hadamard").value(), 1.0);
  StatusOr<double> walsh = StageKeyChoice(rotate, "walsh");
  EXPECT_EQ(walsh.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(walsh.status().message(), "toy_rotate: \"walsh\" is not one of none, hadamard");
  EXPECT_EQ(StageKeyText(rotate, 1), "hadamard");
  EXPECT_TRUE(CheckStagePolicyKey(rotate, 1).ok());
  EXPECT_THAT(CheckStagePolicyKey(rotate, 2).message(), HasSubstr("is not a choice index"));
  EXPECT_THAT(CheckStagePolicyKey(rotate, 0.5).message(), HasSubstr("is not a choice index"));
  const StagePolicyKey share = {.name = "toy_share", .min = 0, .max = 1, .max_open = true};
  EXPECT_TRUE(CheckStagePolicyKey(share, 0.5).ok());
  EXPECT_EQ(CheckStagePolicyKey(share, 1).message(), "toy_share: 1 is outside [0, 1)");

  // The quantize stage's quant_format lists the kernels' format names (compact_chunk.h).
  const StagePolicyKey* format = nullptr;
  ASSERT_NE(StageRegistry::Global().FindPolicyKey("quant_format", &format), nullptr);
  EXPECT_EQ(StageKeyText(*format, format->default_value), "int8");
  for (QuantFormat f : {QuantFormat::kInt8, QuantFormat::kInt4, QuantFormat::kFp8E4M3,
                        QuantFormat::kInt3, QuantFormat::kInt2}) {
    EXPECT_TRUE(StageKeyChoice(*format, QuantFormatName(f)).ok()) << QuantFormatName(f);
  }
  EXPECT_FALSE(StageKeyChoice(*format, "none").ok());
  // quant_key_group follows quant_group unless set.
  EXPECT_EQ(StageKeyValue(StageKeyValues{}, "quant_key_group"), 64.0);
  EXPECT_EQ(StageKeyValue(StageKeyValues{{"quant_group", 32}}, "quant_key_group"), 32.0);
  EXPECT_EQ(
      StageKeyValue(StageKeyValues{{"quant_group", 32}, {"quant_key_group", 5}}, "quant_key_group"),
      5.0);
}

TEST(StageRegistryTest, RegisterRefusesAChoiceKeyWithoutChoicesAndAStrayDefaultKey) {
  StageRegistry& r = StageRegistry::Global();
  Status empty = r.Register({.name = "toy_choice",
                             .kind = StageKind::kScore,
                             .code = 251,
                             .score = testing::KeyNormScores,
                             .policy_keys = {{.name = "toy_c", .type = PolicyKeyType::kChoice}}});
  EXPECT_EQ(empty.code(), StatusCode::kInvalidArgument) << empty;
  EXPECT_THAT(empty.message(), HasSubstr("has no choices"));
  Status stray = r.Register({.name = "toy_choice",
                             .kind = StageKind::kScore,
                             .code = 251,
                             .score = testing::KeyNormScores,
                             .policy_keys = {{.name = "toy_g", .default_key = "quant_group"}}});
  EXPECT_EQ(stray.code(), StatusCode::kInvalidArgument) << stray;
  EXPECT_THAT(stray.message(), HasSubstr("default_key quant_group"));
  EXPECT_EQ(r.Find("toy_choice"), nullptr);
}

// pair_mean (pair_mean_stage.h) merges each kept token with its evicted right neighbour; checked
// slot by slot against the eviction plan's pool and a float64 mean, through the chunk format,
// and refused by the device plan (CPU only).
TEST(StageRegistryTest, AToyMergeStageRunsThroughTheCpuPlanWithOneRegistration) {
  ASSERT_TRUE(testing::RegisterPairMeanStage().ok()) << testing::RegisterPairMeanStage();
  const ToyChunk toy;
  CompressionPlanOptions o;
  o.score = ScoreStage::kKeyDiff;
  o.p_c = 0.5;
  o.sinks = 2;
  auto pool_chunk = Compress(o, toy.layout, toy.Input());  // the pool: eviction's slots
  ASSERT_TRUE(pool_chunk.ok()) << pool_chunk.status();
  o.merge = testing::kPairMean;
  CompressionStats stats;
  auto chunk = Compress(o, toy.layout, toy.Input(), &stats);
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  EXPECT_EQ(chunk->codec.merge, testing::kPairMean);
  constexpr int64_t d = ToyChunk::kDim;
  int64_t merged = 0;
  for (int h = 0; h < ToyChunk::kHeads; ++h) {
    const std::vector<int64_t> pool = SortedPositions(pool_chunk->heads[h]);
    const CompactHead& head = chunk->heads[h];
    ASSERT_EQ(head.slots(), static_cast<int64_t>(pool.size()));
    std::vector<float> keys(head.keys.size() / sizeof(float)), values(keys.size());
    std::memcpy(keys.data(), head.keys.data(), head.keys.size());
    ASSERT_EQ(head.values.size(), head.keys.size());  // no routing: every slot stores its value
    std::memcpy(values.data(), head.values.data(), head.values.size());
    for (size_t j = 0; j < pool.size(); ++j) {
      const int64_t a = pool[j] - 1000, b = a + 1;
      const bool pair = a >= o.sinks && b < ToyChunk::kTokens &&
                        !std::binary_search(pool.begin(), pool.end(), 1000 + b);
      ASSERT_EQ(head.cardinality[j], pair ? 2 : 1) << "head " << h << " slot " << j;
      EXPECT_EQ(head.positions[j], 1000 + (pair ? b : a));
      for (int64_t c = 0; c < d; ++c) {
        const double ka = toy.keys[h].Row(a)[c], va = toy.values[h].Row(a)[c];
        const double want_key = pair ? 0.5 * (ka + toy.keys[h].Row(b)[c]) : ka;
        const double want_value = pair ? 0.5 * (va + toy.values[h].Row(b)[c]) : va;
        EXPECT_NEAR(keys[j * d + c], want_key, 1e-6) << "head " << h << " slot " << j;
        EXPECT_NEAR(values[j * d + c], want_value, 1e-6) << "head " << h << " slot " << j;
      }
      merged += pair ? 2 : 0;
    }
  }
  EXPECT_GT(merged, 0);
  EXPECT_EQ(stats.merged_tokens, merged);
  EXPECT_EQ(stats.half_pairs, stats.budget_half_pairs);

  auto bytes = EncodeCompactChunk(*chunk);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto back = DecodeCompactChunk(*bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->codec.merge, testing::kPairMean);

  Status device = CheckDevicePlanSupported(o);
  EXPECT_EQ(device.code(), StatusCode::kUnimplemented) << device;
  EXPECT_THAT(device.message(), HasSubstr("merge pair_mean"));
  o.score = ScoreStage::kNone;  // the merge alone: pair_mean needs a pool
  EXPECT_EQ(Compress(o, toy.layout, toy.Input()).status().code(), StatusCode::kFailedPrecondition);
}

// mean_value's price (mean_value_stage.h) of dropping the value of each of head h's `tokens`, in
// float64: the squared distance of the token's value from the mean value of the head's tokens.
std::vector<double> MeanValueCosts(const ToyChunk& toy, int h, const std::vector<int64_t>& tokens) {
  constexpr int64_t d = ToyChunk::kDim;
  std::vector<double> mean(d, 0.0);
  for (int64_t i = 0; i < ToyChunk::kTokens; ++i) {
    for (int64_t c = 0; c < d; ++c) mean[c] += double(toy.values[h].Row(i)[c]) / ToyChunk::kTokens;
  }
  std::vector<double> cost;
  for (int64_t a : tokens) {
    double sum = 0.0;
    for (int64_t c = 0; c < d; ++c) sum += std::pow(toy.values[h].Row(a)[c] - mean[c], 2);
    cost.push_back(sum);
  }
  return cost;
}

// The toy chunk's plan with mean_value: keydiff keeps half the half-pairs, two sinks.
CompressionPlanOptions MeanValuePlan() {
  CompressionPlanOptions o;
  o.score = ScoreStage::kKeyDiff;
  o.p_c = 0.5;
  o.sinks = 2;
  o.route = testing::kMeanValue;
  return o;
}

// mean_value (mean_value_stage.h) drops the values nearest the head's mean value: checked slot by
// slot against a float64 reference (the slots that drop their value are the non-sink slots of
// lowest cost, every other slot stores its token's value, the budget is exact), through the
// chunk format, and refused by the device plan (CPU only).
TEST(StageRegistryTest, AToyRouteStageRunsThroughTheCpuPlanWithOneRegistration) {
  ASSERT_TRUE(testing::RegisterMeanValueStage().ok()) << testing::RegisterMeanValueStage();
  const ToyChunk toy;
  const CompressionPlanOptions o = MeanValuePlan();
  CompressionStats stats;
  auto chunk = Compress(o, toy.layout, toy.Input(), &stats);
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  EXPECT_EQ(chunk->codec.route, testing::kMeanValue);
  constexpr int64_t d = ToyChunk::kDim, kept = ToyChunk::kTokens / 2;  // p_c 0.5
  int64_t dropped = 0;
  for (int h = 0; h < ToyChunk::kHeads; ++h) {
    const CompactHead& head = chunk->heads[h];
    EXPECT_EQ(head.slots() + head.value_slots(), 2 * kept) << "head " << h;
    std::vector<int64_t> tokens;
    for (int64_t p : head.positions) tokens.push_back(p - 1000);
    const std::vector<double> cost = MeanValueCosts(toy, h, tokens);
    std::vector<int64_t> eligible;  // cheapest first, ties to the lower slot
    for (int64_t j = 0; j < head.slots(); ++j) {
      ASSERT_EQ(head.cardinality[j], 1);
      if (tokens[j] >= o.sinks) eligible.push_back(j);
    }
    std::stable_sort(eligible.begin(), eligible.end(),
                     [&](int64_t x, int64_t y) { return cost[x] < cost[y]; });
    const int64_t r = head.slots() - head.value_slots();
    std::vector<uint8_t> want_flag(head.slots(), 0);
    for (int64_t i = 0; i < r; ++i) want_flag[eligible[i]] = kSlotRebuildValue;
    EXPECT_EQ(head.flags, want_flag) << "head " << h;
    std::vector<float> values(head.values.size() / sizeof(float));
    std::memcpy(values.data(), head.values.data(), head.values.size());
    int64_t v = 0;
    for (int64_t j = 0; j < head.slots(); ++j) {
      if (want_flag[j]) continue;
      for (int64_t c = 0; c < d; ++c) {
        EXPECT_EQ(values[v * d + c], toy.values[h].Row(tokens[j])[c])
            << "head " << h << " slot " << j;
      }
      ++v;
    }
    dropped += r;
  }
  EXPECT_GT(dropped, 0);
  EXPECT_EQ(stats.rebuild_slots, dropped);
  EXPECT_EQ(stats.half_pairs, stats.budget_half_pairs);

  auto bytes = EncodeCompactChunk(*chunk);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto back = DecodeCompactChunk(*bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->codec.route, testing::kMeanValue);
  EXPECT_EQ(back->heads[0].flags, chunk->heads[0].flags);

  Status device = CheckDevicePlanSupported(o);
  EXPECT_EQ(device.code(), StatusCode::kUnimplemented) << device;
  EXPECT_THAT(device.message(), HasSubstr("route mean_value"));
}

// mean_value's chunks are served through its rebuild (mean_value_stage.h MeanValueRebuild),
// without RoPE or weights: through BuildServingHead every slot that kept its value serves its
// token's value as stored and every dropped value is the float64 mean of the values of the
// head's kept tokens (each kept slot holds one token); ExpandDenseChunk writes the same keys and
// values in the engine's layout. The CUDA backend is refused: the stage has no device rebuild.
TEST(StageRegistryTest, AToyRouteStagesChunksAreServedThroughItsRebuild) {
  ASSERT_TRUE(testing::RegisterMeanValueStage().ok()) << testing::RegisterMeanValueStage();
  const ToyChunk toy;
  auto chunk = Compress(MeanValuePlan(), toy.layout, toy.Input());
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  constexpr int64_t d = ToyChunk::kDim, heads = ToyChunk::kHeads;
  int64_t t = 0;
  auto dense = ExpandDenseChunk(*chunk, nullptr, nullptr, &t);
  ASSERT_TRUE(dense.ok()) << dense.status();
  ASSERT_EQ(t, chunk->heads[0].slots());                                // every slot one token
  const auto* dense_k = reinterpret_cast<const float*>(dense->data());  // K[T, H, d], V[T, H, d]
  const float* dense_v = dense_k + t * heads * d;
  int64_t rebuilt = 0;
  for (int h = 0; h < heads; ++h) {
    auto served = BuildServingHead(*chunk, 0, h, nullptr, nullptr);
    ASSERT_TRUE(served.ok()) << served.status();
    const CompactHead& head = chunk->heads[h];
    std::vector<double> mean(d, 0.0);
    for (int64_t j = 0; j < head.slots(); ++j) {
      if (head.flags[j] & kSlotRebuildValue) continue;
      for (int64_t c = 0; c < d; ++c) {
        mean[c] += toy.values[h].Row(head.positions[j] - 1000)[c] / double(head.value_slots());
      }
    }
    for (int64_t j = 0; j < head.slots(); ++j) {
      const bool dropped = head.flags[j] & kSlotRebuildValue;
      rebuilt += dropped ? 1 : 0;
      for (int64_t c = 0; c < d; ++c) {
        const float got = served->values.Row(j)[c];
        if (dropped) {
          EXPECT_FLOAT_EQ(got, static_cast<float>(mean[c])) << "head " << h << " slot " << j;
        } else {
          EXPECT_EQ(got, toy.values[h].Row(head.positions[j] - 1000)[c]) << "slot " << j;
        }
        EXPECT_EQ(dense_v[(j * heads + h) * d + c], got) << "head " << h << " slot " << j;
        EXPECT_EQ(dense_k[(j * heads + h) * d + c], served->keys.Row(j)[c]);
      }
    }
  }
  EXPECT_GT(rebuilt, 0);
  auto device = BuildServingHead(*chunk, 0, 0, nullptr, nullptr, {.backend = Backend::kCuda});
  EXPECT_EQ(device.status().code(), StatusCode::kUnimplemented) << device.status();
  EXPECT_THAT(device.status().message(), HasSubstr("route stage mean_value has no device rebuild"));
}

// A chunk whose route code no stage of this process registers cannot be served: UNIMPLEMENTED
// naming the code (the chunk is well-formed), in the compact and the dense form.
TEST(StageRegistryTest, AnUnregisteredRouteCodeIsRefusedWhenServed) {
  ASSERT_TRUE(testing::RegisterMeanValueStage().ok()) << testing::RegisterMeanValueStage();
  const ToyChunk toy;
  auto chunk = Compress(MeanValuePlan(), toy.layout, toy.Input());
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  chunk->codec.route = static_cast<RouteStage>(201);
  auto served = BuildServingHead(*chunk, 0, 0, nullptr, nullptr);
  EXPECT_EQ(served.status().code(), StatusCode::kUnimplemented) << served.status();
  EXPECT_THAT(served.status().message(), HasSubstr("route 201 is not registered"));
  int64_t t = 0;
  auto dense = ExpandDenseChunk(*chunk, nullptr, nullptr, &t);
  EXPECT_EQ(dense.status().code(), StatusCode::kUnimplemented) << dense.status();
  EXPECT_THAT(dense.status().message(), HasSubstr("route 201 is not registered"));
}

TEST(StageRegistryTest, RegisterRefusesAMergeOrRouteStageWithoutItsFunction) {
  StageRegistry& r = StageRegistry::Global();
  Status no_merge = r.Register({.name = "other", .kind = StageKind::kMerge, .code = 9});
  EXPECT_EQ(no_merge.code(), StatusCode::kInvalidArgument) << no_merge;
  EXPECT_THAT(no_merge.message(), HasSubstr("merge stage other has no merge function"));
  Status no_route = r.Register({.name = "other", .kind = StageKind::kRoute, .code = 9});
  EXPECT_EQ(no_route.code(), StatusCode::kInvalidArgument) << no_route;
  Status merge_on_route = r.Register(
      {.name = "other", .kind = StageKind::kRoute, .code = 9, .merge = testing::PairMeanMerge});
  EXPECT_EQ(merge_on_route.code(), StatusCode::kInvalidArgument) << merge_on_route;
  Status no_rebuild = r.Register(
      {.name = "other", .kind = StageKind::kRoute, .code = 9, .route = testing::MeanValueRoute});
  EXPECT_EQ(no_rebuild.code(), StatusCode::kInvalidArgument) << no_rebuild;
  EXPECT_THAT(no_rebuild.message(), HasSubstr("route stage other has no rebuild function"));
  Status rebuild_on_merge = r.Register({.name = "other",
                                        .kind = StageKind::kMerge,
                                        .code = 9,
                                        .merge = testing::PairMeanMerge,
                                        .rebuild = testing::MeanValueRebuild});
  EXPECT_EQ(rebuild_on_merge.code(), StatusCode::kInvalidArgument) << rebuild_on_merge;
  EXPECT_EQ(r.Find("other"), nullptr);
}

}  // namespace
}  // namespace kvd::kernels
