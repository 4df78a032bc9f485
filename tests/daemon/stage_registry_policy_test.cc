// The daemon's policy reads the stage registry (kernels/stages.h): a toy score stage registered
// once (tests/kernels/key_norm_stage.h) is a `stages:` method, has a codec id of its own, and
// its chunks are compressed by the chunk codec and record its on-disk code; its policy key,
// declared in the same registration, is bound, checked, part of the codec id and reaches it. A
// toy merge stage (tests/kernels/pair_mean_stage.h) and a toy route stage
// (tests/kernels/mean_value_stage.h) are methods the same way.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "../kernels/key_norm_stage.h"
#include "../kernels/mean_value_stage.h"
#include "../kernels/pair_mean_stage.h"
#include "kvd/daemon/chunk_codec.h"
#include "kvd/daemon/config.h"
#include "kvd/kernels/compact_chunk.h"
#include "stage_policy.h"

namespace kvd::daemon {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kTokens = 64, kWindow = 4;

StatusOr<DaemonConfig> Parse(const std::string& policy) {
  return ParseConfigYaml(
      "models: [{name: m, layout: {layers: 2, kv_heads: 2, q_heads: 4, head_dim: 8, dtype: "
      "float32}, compression: " +
      policy + "}]");
}

// A put of kTokens tokens and kWindow window queries for the model of `m`, random float32.
std::vector<uint8_t> RandomPut(const ModelConfig& m, const ChunkCodec& codec) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v((m.layout.ChunkBytes(kTokens) + codec.QueryBytes(kWindow)) / sizeof(float));
  for (float& x : v) x = dist(rng);
  std::vector<uint8_t> put(v.size() * sizeof(float));
  std::memcpy(put.data(), v.data(), put.size());
  return put;
}

// RandomPut through a ChunkCodec of `m` and back out of the compact chunk's decoder.
struct Encoded {
  std::vector<uint8_t> put;
  kernels::CompactChunk chunk;
};
StatusOr<Encoded> EncodeRandomPut(const ModelConfig& m) {
  KVD_ASSIGN_OR_RETURN(auto codec, ChunkCodec::Create(m, kTokens, nullptr, "k", std::nullopt));
  Encoded out;
  out.put = RandomPut(m, *codec);
  KVD_ASSIGN_OR_RETURN(auto encoded, codec->Encode(out.put, kTokens, 0, kWindow));
  KVD_ASSIGN_OR_RETURN(out.chunk, kernels::DecodeCompactChunk(encoded.bytes));
  return out;
}

// A toy score stage whose own check (StageRegistration::validate) reads a plan field besides its
// policy key: `lookback`, the tokens before the window it would read, must fit in the window.
constexpr uint8_t kLookbackCode = 201;  // a score code no other stage of this binary uses
constexpr char kLookback[] = "lookback";

Status RecencyScores(const kernels::ScoreHeadInput&, std::span<float> scores) {
  for (size_t i = 0; i < scores.size(); ++i) scores[i] = static_cast<float>(i);
  return Status::Ok();
}

Status ValidateLookback(const kernels::CompressionPlanOptions& o) {
  const auto lookback = static_cast<int64_t>(kernels::StageKeyValue(o, kLookback));
  if (lookback <= o.window) return Status::Ok();
  return Status::InvalidArgument("plan: lookback " + std::to_string(lookback) + " exceeds window " +
                                 std::to_string(o.window));
}

Status RegisterLookbackStage() {
  static const Status registered = kernels::StageRegistry::Global().Register({
      .name = "lookback",
      .kind = kernels::StageKind::kScore,
      .code = kLookbackCode,
      .score = RecencyScores,
      .validate = ValidateLookback,
      .policy_keys =
          {{.name = kLookback, .type = kernels::PolicyKeyType::kInt, .min = 0, .max = 1 << 20}},
  });
  return registered;
}

TEST(StageRegistryPolicyTest, AToyScoreStageIsAPolicyMethodWithOneRegistration) {
  ASSERT_TRUE(kernels::testing::RegisterKeyNormStage().ok());
  auto config = Parse("{stages: [key_norm, quantize], window: 4, sinks: 2, device: cpu}");
  ASSERT_TRUE(config.ok()) << config.status();
  const ModelConfig& m = config->models[0];
  ASSERT_TRUE(m.compression);
  const CompressionPolicy& p = *m.compression;
  EXPECT_EQ(p.score, "key_norm");
  EXPECT_EQ(p.StagesName(), "key_norm+int8");
  EXPECT_FALSE(p.NeedsQueries());
  EXPECT_FALSE(p.KeepsPositions());
  EXPECT_THAT(p.CanonicalForm(), HasSubstr("score=key_norm "));
  CompressionPolicy keydiff = p;
  keydiff.score = "keydiff";
  EXPECT_NE(p.CodecId(0), keydiff.CodecId(0));

  auto encoded = EncodeRandomPut(m);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  const kernels::CompactChunk* chunk = &encoded->chunk;
  EXPECT_EQ(chunk->codec.score, kernels::testing::kKeyNorm);
  EXPECT_EQ(chunk->codec.quant.format, kernels::QuantFormat::kInt8);
  EXPECT_EQ(chunk->heads[0].slots(), kTokens / 2);
}

TEST(StageRegistryPolicyTest, AStagePolicyKeyIsBoundCheckedAndReachesTheStage) {
  ASSERT_TRUE(kernels::testing::RegisterKeyNormStage().ok());
  auto config =
      Parse("{stages: [key_norm], key_norm_smallest: true, window: 4, sinks: 2, device: cpu}");
  ASSERT_TRUE(config.ok()) << config.status();
  const ModelConfig& m = config->models[0];
  const CompressionPolicy& p = *m.compression;
  EXPECT_EQ(p.stage_keys, (std::map<std::string, double, std::less<>>{{"key_norm_smallest", 1}}));
  EXPECT_THAT(p.CanonicalForm(), HasSubstr(" key_norm_smallest=1"));
  CompressionPolicy unset = p;
  unset.stage_keys.clear();
  EXPECT_EQ(unset.CanonicalForm().find("key_norm_smallest"), std::string::npos);
  EXPECT_NE(p.CodecId(0), unset.CodecId(0));

  // Layer 0, head 0 keeps the sinks, the window and the smallest key norms (float64) between.
  auto encoded = EncodeRandomPut(m);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  const std::vector<uint8_t>& put = encoded->put;
  const kernels::CompactChunk* chunk = &encoded->chunk;
  const int64_t heads = m.layout.num_kv_heads, d = m.layout.head_dim;
  const auto* k = reinterpret_cast<const float*>(put.data());  // layer 0: K[N, H, d] first
  std::vector<double> norm(kTokens, 0.0);
  for (uint32_t i = 0; i < kTokens; ++i) {
    for (int64_t c = 0; c < d; ++c) norm[i] += double(k[i * heads * d + c]) * k[i * heads * d + c];
  }
  std::vector<int64_t> middle(kTokens - kWindow - 2);
  std::iota(middle.begin(), middle.end(), 2);
  std::sort(middle.begin(), middle.end(), [&](int64_t a, int64_t b) { return norm[a] < norm[b]; });
  std::vector<int64_t> want = {0, 1};
  for (uint32_t i = kTokens - kWindow; i < kTokens; ++i) want.push_back(i);
  want.insert(want.end(), middle.begin(), middle.begin() + (kTokens / 2 - 2 - kWindow));
  std::sort(want.begin(), want.end());
  std::vector<int64_t> got = chunk->heads[0].positions;
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, want);
}

TEST(StageRegistryPolicyTest, AStagePolicyKeyIsRefusedWithoutItsStageOrWithABadValue) {
  ASSERT_TRUE(kernels::testing::RegisterKeyNormStage().ok());
  auto stray = Parse("{stages: [keydiff], key_norm_smallest: true}");
  ASSERT_FALSE(stray.ok());
  EXPECT_EQ(stray.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(stray.status().message(),
              HasSubstr("models[0].compression.key_norm_smallest: set, but stages has no key_norm "
                        "stage (e.g. stages: [key_norm])"));
  auto bad = Parse("{stages: [key_norm], key_norm_smallest: maybe}");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(),
              HasSubstr("models[0].compression.key_norm_smallest: \"maybe\" is not a boolean"));
  CompressionPolicy p;
  p.score = "key_norm";
  p.stage_keys["key_norm_smallest"] = 2;
  Status s = p.Validate("models[0].compression", 64);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(),
              HasSubstr("models[0].compression.key_norm_smallest: 2 is not a boolean"));
  p.score = "snapkv";
  p.stage_keys["key_norm_smallest"] = 1;
  s = p.Validate("models[0].compression", 64);
  EXPECT_THAT(s.message(), HasSubstr("key_norm_smallest: set, but stages has no key_norm stage"));
}

// The policy's whole plan options are checked when the config loads (CompressionPlanOptions::
// Validate, which runs the score stage's own check): `lookback` is checked against the policy's
// window (8), not the plan's default (32), so the config is refused before kvd starts, not when
// the model's chunk codec is built.
TEST(StageRegistryPolicyTest, AStagesCheckSeesThePolicysWholePlanWhenTheConfigLoads) {
  ASSERT_TRUE(RegisterLookbackStage().ok());
  auto fits = Parse("{stages: [lookback], lookback: 8, window: 8, sinks: 2, device: cpu}");
  ASSERT_TRUE(fits.ok()) << fits.status();
  auto refused = Parse("{stages: [lookback], lookback: 16, window: 8, sinks: 2, device: cpu}");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("models[0].compression: plan: lookback 16 exceeds window 8"));
}

// A toy merge stage registered once (tests/kernels/pair_mean_stage.h) is a `stages:` method
// after a score method, and the chunk codec's chunks record its merge code.
TEST(StageRegistryPolicyTest, AToyMergeStageIsAPolicyMethodWithOneRegistration) {
  ASSERT_TRUE(kernels::testing::RegisterPairMeanStage().ok());
  auto config = Parse("{stages: [keydiff, pair_mean], window: 4, sinks: 2, device: cpu}");
  ASSERT_TRUE(config.ok()) << config.status();
  const ModelConfig& m = config->models[0];
  EXPECT_EQ(m.compression->merge, "pair_mean");
  EXPECT_EQ(m.compression->StagesName(), "keydiff+pair_mean");
  auto encoded = EncodeRandomPut(m);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  const kernels::CompactChunk* chunk = &encoded->chunk;
  EXPECT_EQ(chunk->codec.merge, kernels::testing::kPairMean);
  int64_t merged = 0;
  for (int32_t c : chunk->heads[0].cardinality) merged += c > 1 ? 1 : 0;
  EXPECT_GT(merged, 0);
}

// A toy route stage registered once (tests/kernels/mean_value_stage.h) is a `stages:` method
// after a score method, needs no calibration, and the chunk codec's chunks record its route code
// and drop the values it prices lowest: layer 0, head 0 checked slot by slot against a float64
// reference (the values nearest the head's mean value, never a sink's or a window token's).
TEST(StageRegistryPolicyTest, AToyRouteStageIsAPolicyMethodWithOneRegistration) {
  ASSERT_TRUE(kernels::testing::RegisterMeanValueStage().ok());
  auto config = Parse("{stages: [keydiff, mean_value], window: 4, sinks: 2, device: cpu}");
  ASSERT_TRUE(config.ok()) << config.status();
  const ModelConfig& m = config->models[0];
  EXPECT_EQ(m.compression->route, "mean_value");
  EXPECT_EQ(m.compression->StagesName(), "keydiff+mean_value");
  auto encoded = EncodeRandomPut(m);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  const kernels::CompactHead& head = encoded->chunk.heads[0];
  EXPECT_EQ(encoded->chunk.codec.route, kernels::testing::kMeanValue);
  const int64_t heads = m.layout.num_kv_heads, d = m.layout.head_dim;
  const auto* v = reinterpret_cast<const float*>(encoded->put.data()) + kTokens * heads * d;
  std::vector<double> mean(d, 0.0);  // layer 0: V[N, H, d] after K
  for (uint32_t i = 0; i < kTokens; ++i) {
    for (int64_t c = 0; c < d; ++c) mean[c] += double(v[i * heads * d + c]) / kTokens;
  }
  std::vector<std::pair<double, int64_t>> eligible;  // (price, slot)
  for (int64_t j = 0; j < head.slots(); ++j) {
    const int64_t t = head.positions[j];
    if (t < 2 || t >= kTokens - kWindow) continue;
    double price = 0.0;
    for (int64_t c = 0; c < d; ++c) price += std::pow(v[t * heads * d + c] - mean[c], 2);
    eligible.emplace_back(price, j);
  }
  std::sort(eligible.begin(), eligible.end());
  const int64_t dropped = head.slots() - head.value_slots();
  ASSERT_GT(dropped, 0);
  std::vector<uint8_t> want(head.slots(), 0);
  for (int64_t r = 0; r < dropped; ++r) want[eligible[r].second] = kernels::kSlotRebuildValue;
  EXPECT_EQ(head.flags, want);
}

TEST(StageRegistryPolicyTest, MethodErrorsNameTheRegisteredStages) {
  auto unknown = Parse("{stages: [nope]}");
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.status().message(),
              HasSubstr("\"nope\" is not a method (score: snapkv, keydiff, pyramidkv, "
                        "expected_attention"));
  // (Toy stages this binary registers follow the built-in ones in their kind's list.)
  EXPECT_THAT(unknown.status().message(), HasSubstr("; merge: kvslimmer"));
  EXPECT_THAT(unknown.status().message(), HasSubstr("; route: vector"));
  EXPECT_THAT(unknown.status().message(),
              HasSubstr("; quantize: quantize; hybrid = snapkv + kvslimmer)"));
  // Recency is the score stage `none`, not a method a policy lists.
  auto none = Parse("{stages: [none]}");
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(none.status().message(), HasSubstr("is not a method"));
  auto order = Parse("{stages: [vector, keydiff]}");
  ASSERT_FALSE(order.ok());
  EXPECT_THAT(order.status().message(),
              HasSubstr("\"keydiff\" is a score method listed after the route stage"));
  auto second = Parse("{stages: [keydiff, snapkv]}");
  ASSERT_FALSE(second.ok());
  EXPECT_THAT(second.status().message(), HasSubstr("is a second score method (one per stage)"));
  auto stray = Parse("{stages: [keydiff], ea_min_queries: 8}");
  ASSERT_FALSE(stray.ok());
  EXPECT_THAT(stray.status().message(),
              HasSubstr("ea_min_queries: set, but stages has no expected_attention stage (e.g. "
                        "stages: [expected_attention])"));
}

// CompressionPolicy::Validate on a policy built in code (not from YAML): a method that is no
// registered stage of its kind is named with the kind and the registered methods.
TEST(StageRegistryPolicyTest, ValidateNamesTheKindOfAnUnregisteredMethod) {
  const std::string key = "models[0].compression";
  CompressionPolicy p;
  p.score = "vector";  // a route stage
  Status s = p.Validate(key, 64);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(key + ".stages: \"vector\" is not a score method (snapkv, "));
  p.score = "snapkv";
  p.merge = "nope";
  s = p.Validate(key, 64);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("\"nope\" is not a merge method (kvslimmer"));
  p.merge = "none";
  p.route = "kvslimmer";
  s = p.Validate(key, 64);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("\"kvslimmer\" is not a route method (vector"));
}

// The expected_attention stage's own keys (KeyDiff's outliers first): bound with the stage, part
// of the codec id when set and absent from it when not, refused without the stage.
TEST(StageRegistryPolicyTest, TheOutlierKeysBelongToExpectedAttention) {
  auto config = Parse(
      "{stages: [expected_attention, quantize], ea_keydiff_share: 0.5, ea_keydiff_outlier_z: 2, "
      "ea_keydiff_outlier_share: 0.75, device: cpu}");
  ASSERT_TRUE(config.ok()) << config.status();
  const CompressionPolicy& p = *config->models[0].compression;
  EXPECT_EQ(p.stage_keys,
            (std::map<std::string, double, std::less<>>{{"ea_keydiff_outlier_share", 0.75},
                                                        {"ea_keydiff_outlier_z", 2},
                                                        {"ea_keydiff_share", 0.5}}));
  EXPECT_THAT(p.CanonicalForm(), HasSubstr(" ea_keydiff_outlier_z=2"));
  auto unset =
      Parse("{stages: [expected_attention, quantize], ea_keydiff_share: 0.5, device: cpu}");
  ASSERT_TRUE(unset.ok()) << unset.status();
  EXPECT_EQ(unset->models[0].compression->CanonicalForm().find("outlier"), std::string::npos);
  EXPECT_NE(p.CodecId(0), unset->models[0].compression->CodecId(0));
  auto stray = Parse("{stages: [keydiff], ea_keydiff_outlier_z: 2}");
  EXPECT_THAT(stray.status().message(), HasSubstr("ea_keydiff_outlier_z: set, but stages has no"));
  EXPECT_FALSE(Parse("{stages: [expected_attention], ea_keydiff_outlier_z: -1}").ok());
  EXPECT_FALSE(Parse("{stages: [expected_attention], ea_keydiff_outlier_share: 1.5}").ok());
}

// ea_keydiff_pool (KeyDiff's rank pooled over neighbours): part of the codec id when set; an even
// pool, or one without a KeyDiff share to pool, is refused with the reason.
TEST(StageRegistryPolicyTest, ThePoolKeyBelongsToExpectedAttentionsKeyDiffShare) {
  auto config = Parse(
      "{stages: [expected_attention, quantize], ea_keydiff_share: 0.5, ea_keydiff_pool: 3, "
      "device: cpu}");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_THAT(config->models[0].compression->CanonicalForm(), HasSubstr(" ea_keydiff_pool=3"));
  auto even = Parse("{stages: [expected_attention], ea_keydiff_share: 0.5, ea_keydiff_pool: 4}");
  EXPECT_THAT(even.status().message(), HasSubstr("ea_keydiff_pool must be odd"));
  auto alone = Parse("{stages: [expected_attention], ea_keydiff_pool: 3}");
  EXPECT_THAT(alone.status().message(), HasSubstr("needs ea_keydiff_share > 0"));
  auto stray = Parse("{stages: [keydiff], ea_keydiff_pool: 3}");
  EXPECT_THAT(stray.status().message(), HasSubstr("ea_keydiff_pool: set, but stages has no"));
}

// The built-in stages' keys are registry keys declared on their stage's registration: the
// parser binds them into stage_keys (a choice as the index of its name) and the plan options are
// filled from them in one place (SetPlanStages, through the stage's apply_keys).
TEST(StageRegistryPolicyTest, TheQuantizeAndExpectedAttentionKeysAreRegistryKeys) {
  const kernels::StageRegistry& registry = kernels::StageRegistry::Global();
  for (const char* key : {"quant_format", "quant_group", "quant_key_group", "quant_recent",
                          "quant_sinks", "quant_rotate", "quant_value_format"}) {
    const kernels::StageRegistration* owner = registry.FindPolicyKey(key);
    ASSERT_NE(owner, nullptr) << key;
    EXPECT_EQ(owner->name, "quantize") << key;
  }
  for (const char* key : {"ea_future_positions", "ea_min_queries", "ea_covariance",
                          "ea_keydiff_share", "ea_recent_share"}) {
    const kernels::StageRegistration* owner = registry.FindPolicyKey(key);
    ASSERT_NE(owner, nullptr) << key;
    EXPECT_EQ(owner->name, "expected_attention") << key;
  }
  auto config = Parse(
      "{stages: [expected_attention, quantize], ea_min_queries: 32, ea_covariance: false, "
      "quant_format: int4, quant_rotate: hadamard, quant_value_format: int2, quant_group: 16}");
  ASSERT_TRUE(config.ok()) << config.status();
  const CompressionPolicy& p = *config->models[0].compression;
  EXPECT_EQ(p.quantize, "quantize");
  EXPECT_EQ(p.StagesName(), "expected_attention+int4");
  EXPECT_EQ(p.stage_keys.size(), 6u);
  kernels::CompressionPlanOptions o;
  SetPlanStages(p, &o);
  EXPECT_EQ(o.quant, (kernels::QuantDescription{.format = kernels::QuantFormat::kInt4,
                                                .key_group = 16,
                                                .value_group = 16,
                                                .rotation = kernels::QuantRotation::kHadamard,
                                                .value_format = kernels::QuantFormat::kInt2}));
  EXPECT_EQ(o.expected_attention_min_queries, 32);
  EXPECT_FALSE(o.expected_attention.use_covariance);
  EXPECT_EQ(o.expected_attention.future_positions, 512);
  EXPECT_TRUE(o.Validate().ok()) << o.Validate();
}

// The expected_attention stage's recency share (ExpectedAttentionOptions::recent_share) is a
// policy key: bound, checked with ea_keydiff_share, handed to the plan, and part of the codec id
// only when set (so the codec ids of policies without it stay).
TEST(StageRegistryPolicyTest, TheExpectedAttentionRecencyShareIsAPolicyKey) {
  auto config =
      Parse("{stages: [expected_attention], ea_keydiff_share: 0.4, ea_recent_share: 0.2}");
  ASSERT_TRUE(config.ok()) << config.status();
  const CompressionPolicy& p = *config->models[0].compression;
  EXPECT_THAT(p.CanonicalForm(), HasSubstr(" ea=512/256 ea_keydiff_share=0.40000000000000002 "
                                           "ea_recent_share=0.20000000000000001"));
  kernels::CompressionPlanOptions o;
  SetPlanStages(p, &o);
  EXPECT_EQ(o.expected_attention.recent_share, 0.2);
  EXPECT_EQ(o.expected_attention.keydiff_share, 0.4);
  auto unset = Parse("{stages: [expected_attention], ea_keydiff_share: 0.4}");
  ASSERT_TRUE(unset.ok()) << unset.status();
  const CompressionPolicy& u = *unset->models[0].compression;
  EXPECT_EQ(u.CanonicalForm().find("ea_recent_share"), std::string::npos);
  EXPECT_NE(p.CodecId(0), u.CodecId(0));
  kernels::CompressionPlanOptions uo;
  SetPlanStages(u, &uo);
  EXPECT_EQ(uo.expected_attention.recent_share, 0.0);
  auto over = Parse("{stages: [expected_attention], ea_keydiff_share: 0.6, ea_recent_share: 0.4}");
  ASSERT_FALSE(over.ok());
  EXPECT_THAT(over.status().message(), HasSubstr("keydiff_share + recent_share < 1"));
}

}  // namespace
}  // namespace kvd::daemon
