// The compression stage registry (stages.h) and the built-in stages' registrations.
#include "kvd/kernels/stages.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "kvd/kernels/expected_attention.h"
#include "kvd/kernels/keydiff.h"
#include "kvd/kernels/snapkv.h"
#include "plan_internal.h"

namespace kvd::kernels {
namespace {

Status RecencyScores(const ScoreHeadInput& in, std::span<float> scores) {
  for (size_t i = 0; i < scores.size(); ++i) scores[i] = static_cast<float>(i);  // later first
  return Status::Ok();
}

// SnapKV and PyramidKV score alike (PyramidKV differs in its layer budgets).
Status SnapKvHeadScores(const ScoreHeadInput& in, std::span<float> scores) {
  SnapKvOptions so{.window = static_cast<int>(in.window),
                   .kernel_size = in.options->pooling_kernel,
                   .pooling = in.options->pooling,
                   .group_size = in.group_size};
  return SnapKvScores(in.queries, in.keys, so, scores, {.num_threads = 1});
}

Status KeyDiffHeadScores(const ScoreHeadInput& in, std::span<float> scores) {
  return KeyDiffScores(in.keys, scores, {.num_threads = 1});
}

Status ExpectedAttentionHeadScores(const ScoreHeadInput& in, std::span<float> scores) {
  if (in.expected == nullptr) {
    return Status::Internal("plan: expected_attention scores without expected queries");
  }
  const ExpectedAttentionOptions& ea = in.options->expected_attention;
  KVD_RETURN_IF_ERROR(ExpectedAttentionScores(*in.expected, in.keys,
                                              ea.value_norm ? in.values : ConstMatrixView{}, scores,
                                              {.num_threads = 1}));
  const double z = StageKeyValue(*in.options, internal::kEaOutlierZ);
  if (ea.keydiff_share <= 0.0 && ea.recent_share <= 0.0 && z <= 0.0) return Status::Ok();
  // Part of the evictable tokens by KeyDiff's rank and by recency, KeyDiff's outliers first
  // (expected_attention.h FuseKeyDiffRanks, ProtectKeyDiffOutliers).
  const int64_t n = in.keys.rows;
  const std::vector<float> expected_scores(scores.begin(), scores.end());
  std::vector<float> keydiff;
  if (ea.keydiff_share > 0.0 || z > 0.0) {
    keydiff.resize(static_cast<size_t>(n));
    KVD_RETURN_IF_ERROR(KeyDiffScores(in.keys, keydiff, {.num_threads = 1}));
  }
  const int64_t begin = std::min(in.options->sinks, n);
  const int64_t end = std::max(begin, n - in.window);
  // KeyDiff's rank of a token is its best neighbour's within ea_keydiff_pool tokens (max-pooled
  // over the evictable range), so the tokens beside a distinctive one go with it.
  const int pool = static_cast<int>(StageKeyValue(*in.options, internal::kEaKeyDiffPool));
  std::vector<float> pooled;
  if (pool > 1 && ea.keydiff_share > 0.0) {
    pooled = keydiff;
    const auto range = [&](auto& v) { return std::span(v).subspan(begin, end - begin); };
    KVD_RETURN_IF_ERROR(
        Pool1d(range(std::as_const(keydiff)), pool, PoolingKind::kMax, range(pooled)));
  }
  const std::vector<float>& keydiff_rank = ea.keydiff_share <= 0.0 ? expected_scores
                                           : pooled.empty()        ? keydiff
                                                                   : pooled;
  KVD_RETURN_IF_ERROR(FuseKeyDiffRanks(expected_scores, keydiff_rank, ea.keydiff_share,
                                       ea.recent_share, begin, end, scores));
  if (z <= 0.0) return Status::Ok();
  // The evictable tokens the head's budget keeps: its kept tokens less the sinks and window.
  const int64_t free = std::max<int64_t>(0, in.kept - begin - (n - end));
  const int64_t cap = std::llround(StageKeyValue(*in.options, internal::kEaOutlierShare) *
                                   static_cast<double>(free));
  return ProtectKeyDiffOutliers(keydiff, z, cap, begin, end, scores);
}

Status ValidateExpectedAttention(const CompressionPlanOptions& o) {
  KVD_RETURN_IF_ERROR(o.expected_attention.Validate().WithContext("plan"));
  if (o.expected_attention_min_queries < 1) {
    return Status::InvalidArgument("plan: expected_attention_min_queries must be >= 1, got " +
                                   std::to_string(o.expected_attention_min_queries));
  }
  const double pool = StageKeyValue(o, internal::kEaKeyDiffPool);
  if (pool != 1.0 && std::fmod(pool, 2.0) != 1.0) {
    return Status::InvalidArgument(
        "plan: ea_keydiff_pool must be odd (a token and as many "
        "neighbours on each side), got " +
        std::to_string(static_cast<int64_t>(pool)));
  }
  if (pool > 1.0 && o.expected_attention.keydiff_share <= 0.0) {
    return Status::InvalidArgument(
        "plan: ea_keydiff_pool pools KeyDiff's rank, which needs ea_keydiff_share > 0");
  }
  return Status::Ok();
}

std::vector<StageRegistration> BuiltinStages() {
  return {
      {.name = "none",
       .kind = StageKind::kScore,
       .code = 0,
       .device = true,
       .score = RecencyScores},
      {.name = "snapkv",
       .kind = StageKind::kScore,
       .code = 1,
       .needs_window_queries = true,
       .device = true,
       .score = SnapKvHeadScores},
      {.name = "keydiff",
       .kind = StageKind::kScore,
       .code = 2,
       .device = true,
       .score = KeyDiffHeadScores},
      {.name = "pyramidkv",
       .kind = StageKind::kScore,
       .code = 3,
       .needs_window_queries = true,
       .device = true,
       .score = SnapKvHeadScores,
       .layer_budgets = internal::ExactPyramidBudgets},
      {.name = "expected_attention",
       .kind = StageKind::kScore,
       .code = 4,
       .needs_query_stats = true,
       .score = ExpectedAttentionHeadScores,
       .validate = ValidateExpectedAttention,
       .policy_keys = internal::ExpectedAttentionKeys(),
       .apply_keys = internal::ApplyExpectedAttentionKeys,
       .canonical_form = internal::ExpectedAttentionCanonicalForm},
      // The device plan runs KVSlimmer only as the hybrid's merge (plan_device.h).
      {.name = "kvslimmer",
       .kind = StageKind::kMerge,
       .code = 1,
       .keeps_positions = true,
       .needs_window_queries = true,
       .device = true,
       .merge = internal::KvSlimmerMergeHead},
      {.name = "vector",
       .kind = StageKind::kRoute,
       .code = 1,
       .needs_calibration = true,
       .device = true,
       .route = internal::VectorRouteErrors,
       .rebuild = internal::VectorRebuild,
       .device_rebuild = true},
      {.name = "quantize",
       .kind = StageKind::kQuantize,
       .code = 0,
       .keeps_positions = true,
       .device = true,
       .policy_keys = internal::QuantizeKeys(),
       .apply_keys = internal::ApplyQuantizeKeys,
       .canonical_form = internal::QuantizeCanonicalForm},
  };
}

}  // namespace

std::string_view StageKindName(StageKind kind) {
  switch (kind) {
    case StageKind::kScore:
      return "score";
    case StageKind::kMerge:
      return "merge";
    case StageKind::kRoute:
      return "route";
    case StageKind::kQuantize:
      return "quantize";
  }
  return "unknown";
}

struct StageRegistry::Impl {
  mutable std::shared_mutex mu;
  std::deque<StageRegistration> stages;  // deque: pointers stay valid as it grows
};

StageRegistry::StageRegistry() : impl_(new Impl) {
  for (StageRegistration& r : BuiltinStages()) impl_->stages.push_back(std::move(r));
}

StageRegistry& StageRegistry::Global() {
  static StageRegistry* registry = new StageRegistry();  // never destroyed (stages.h)
  return *registry;
}

// Each kind's functions are there, and no other kind's.
Status CheckStageFunctions(const StageRegistration& r) {
  const bool score = r.kind == StageKind::kScore, merge = r.kind == StageKind::kMerge,
             route = r.kind == StageKind::kRoute;
  const std::string kind(StageKindName(r.kind));
  if ((score && r.score == nullptr) || (merge && r.merge == nullptr) ||
      (route && r.route == nullptr)) {
    return Status::InvalidArgument("stages: " + kind + " stage " + r.name + " has no " + kind +
                                   " function");
  }
  if (!score && (r.score != nullptr || r.layer_budgets != nullptr || r.validate != nullptr)) {
    return Status::InvalidArgument(
        "stages: " + r.name + " is not a score stage but has a score, budget or validate function");
  }
  if ((!merge && r.merge != nullptr) || (!route && r.route != nullptr)) {
    return Status::InvalidArgument("stages: " + r.name + " is a " + kind +
                                   " stage but has a merge or route function");
  }
  if (route && r.rebuild == nullptr) {
    return Status::InvalidArgument(
        "stages: route stage " + r.name +
        " has no rebuild function (serving rebuilds its dropped values)");
  }
  if (!route && (r.rebuild != nullptr || r.device_rebuild)) {
    return Status::InvalidArgument("stages: " + r.name + " is a " + kind +
                                   " stage but has a rebuild function or device_rebuild");
  }
  return Status::Ok();
}

// Each key named once, with a default that fits it (or a default_key of the stage and type) and
// a kChoice key's choices.
Status CheckPolicyKeys(const StageRegistration& r) {
  for (size_t i = 0; i < r.policy_keys.size(); ++i) {
    const StagePolicyKey& k = r.policy_keys[i];
    if (k.name.empty()) return Status::InvalidArgument("stages: " + r.name + " has a nameless key");
    if (k.type == PolicyKeyType::kChoice && k.choices.empty()) {
      return Status::InvalidArgument("stages: choice key " + k.name + " has no choices");
    }
    KVD_RETURN_IF_ERROR(CheckStagePolicyKey(k, k.default_value).WithContext("stages: default"));
    const auto followed =
        std::find_if(r.policy_keys.begin(), r.policy_keys.end(),
                     [&](const StagePolicyKey& o) { return o.name == k.default_key; });
    if (!k.default_key.empty() && (followed == r.policy_keys.end() || followed->type != k.type ||
                                   !followed->default_key.empty())) {
      return Status::InvalidArgument("stages: " + k.name + "'s default_key " + k.default_key +
                                     " is not a key of " + r.name + " of its type");
    }
    for (size_t j = 0; j < i; ++j) {
      if (r.policy_keys[j].name == k.name) {
        return Status::AlreadyExists("stages: " + r.name + " declares key " + k.name + " twice");
      }
    }
  }
  return Status::Ok();
}

Status StageRegistry::Register(StageRegistration r) {
  if (r.name.empty()) return Status::InvalidArgument("stages: a stage needs a name");
  KVD_RETURN_IF_ERROR(CheckStageFunctions(r));
  KVD_RETURN_IF_ERROR(CheckPolicyKeys(r));
  std::unique_lock lock(impl_->mu);
  for (const StageRegistration& s : impl_->stages) {
    if (s.name == r.name) return Status::AlreadyExists("stages: " + r.name + " is registered");
    for (const StagePolicyKey& k : r.policy_keys) {
      for (const StagePolicyKey& taken : s.policy_keys) {
        if (taken.name == k.name) {
          return Status::AlreadyExists("stages: policy key " + k.name + " is " + s.name + "'s");
        }
      }
    }
    if (s.kind == r.kind && s.code == r.code) {
      return Status::AlreadyExists("stages: " + std::string(StageKindName(r.kind)) + " code " +
                                   std::to_string(r.code) + " is " + s.name + "'s");
    }
  }
  impl_->stages.push_back(std::move(r));
  return Status::Ok();
}

const StageRegistration* StageRegistry::Find(StageKind kind, uint8_t code) const {
  std::shared_lock lock(impl_->mu);
  for (const StageRegistration& s : impl_->stages) {
    if (s.kind == kind && s.code == code) return &s;
  }
  return nullptr;
}

const StageRegistration* StageRegistry::Find(std::string_view name) const {
  std::shared_lock lock(impl_->mu);
  for (const StageRegistration& s : impl_->stages) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

std::vector<const StageRegistration*> StageRegistry::OfKind(StageKind kind) const {
  std::shared_lock lock(impl_->mu);
  std::vector<const StageRegistration*> out;
  for (const StageRegistration& s : impl_->stages) {
    if (s.kind == kind) out.push_back(&s);
  }
  return out;
}

const StageRegistration* StageRegistry::FindPolicyKey(std::string_view key,
                                                      const StagePolicyKey** out) const {
  std::shared_lock lock(impl_->mu);
  for (const StageRegistration& s : impl_->stages) {
    for (const StagePolicyKey& k : s.policy_keys) {
      if (k.name != key) continue;
      if (out != nullptr) *out = &k;
      return &s;
    }
  }
  return nullptr;
}

std::vector<std::string> StageRegistry::PolicyKeyNames() const {
  std::shared_lock lock(impl_->mu);
  std::vector<std::string> out;
  for (const StageRegistration& s : impl_->stages) {
    for (const StagePolicyKey& k : s.policy_keys) out.push_back(k.name);
  }
  return out;
}

const StageRegistration* FindStage(ScoreStage s) {
  return StageRegistry::Global().Find(StageKind::kScore, static_cast<uint8_t>(s));
}
const StageRegistration* FindStage(MergeStage s) {
  return StageRegistry::Global().Find(StageKind::kMerge, static_cast<uint8_t>(s));
}
const StageRegistration* FindStage(RouteStage s) {
  return StageRegistry::Global().Find(StageKind::kRoute, static_cast<uint8_t>(s));
}

}  // namespace kvd::kernels
