// Policy names onto registered stages (stage_policy.h).
#include "stage_policy.h"

#include <algorithm>

namespace kvd::daemon {

namespace kk = kvd::kernels;

const kk::StageRegistration* PolicyStage(kk::StageKind kind, const std::string& name) {
  if (name == "none") return nullptr;  // recency, score code 0, is registered as "none"
  const kk::StageRegistration* s = kk::StageRegistry::Global().Find(name);
  return s != nullptr && s->kind == kind ? s : nullptr;
}

std::string PolicyMethodList(kk::StageKind kind) {
  std::string out;
  for (const kk::StageRegistration* s : kk::StageRegistry::Global().OfKind(kind)) {
    if (kind == kk::StageKind::kScore && s->code == 0) continue;
    out += (out.empty() ? "" : ", ") + s->name;
  }
  return out;
}

std::vector<const kk::StageRegistration*> ListedStages(const CompressionPolicy& p) {
  std::vector<const kk::StageRegistration*> out;
  for (const kk::StageRegistration* s :
       {PolicyStage(kk::StageKind::kScore, p.score), PolicyStage(kk::StageKind::kMerge, p.merge),
        PolicyStage(kk::StageKind::kRoute, p.route),
        PolicyStage(kk::StageKind::kQuantize, p.quantize)}) {
    if (s != nullptr) out.push_back(s);
  }
  return out;
}

namespace {

// Whether a listed stage has `capability` (a bool of StageRegistration).
bool AnyListedStageHas(const CompressionPolicy& p, bool kk::StageRegistration::*capability) {
  for (const kk::StageRegistration* s : ListedStages(p)) {
    if (s->*capability) return true;
  }
  return false;
}

}  // namespace

bool NeedsCalibration(const CompressionPolicy& p) {
  return AnyListedStageHas(p, &kk::StageRegistration::needs_calibration);
}

bool NeedsQueryStats(const CompressionPolicy& p) {
  return AnyListedStageHas(p, &kk::StageRegistration::needs_query_stats);
}

void SetPlanStages(const CompressionPolicy& p, kk::CompressionPlanOptions* o) {
  const kk::StageRegistration* score = PolicyStage(kk::StageKind::kScore, p.score);
  const kk::StageRegistration* merge = PolicyStage(kk::StageKind::kMerge, p.merge);
  const kk::StageRegistration* route = PolicyStage(kk::StageKind::kRoute, p.route);
  o->score = score != nullptr ? static_cast<kk::ScoreStage>(score->code) : kk::ScoreStage::kNone;
  o->merge = merge != nullptr ? static_cast<kk::MergeStage>(merge->code) : kk::MergeStage::kNone;
  o->route = route != nullptr ? static_cast<kk::RouteStage>(route->code) : kk::RouteStage::kNone;
  o->stage_keys = p.stage_keys;
  for (const kk::StageRegistration* s : ListedStages(p)) {
    if (s->apply_keys != nullptr) s->apply_keys(p.stage_keys, o);
  }
}

kk::CompressionPlanOptions PlanOptions(const CompressionPolicy& p) {
  kk::CompressionPlanOptions o;
  SetPlanStages(p, &o);  // the stages, their keys and the typed options they fill
  o.p_c = p.p_c;
  o.window = p.window;
  o.sinks = p.sinks;
  o.pooling_kernel = p.pooling_kernel;
  o.pooling = p.pooling == "max" ? kk::PoolingKind::kMax : kk::PoolingKind::kAvg;
  o.keydiff_block = p.keydiff_block;
  o.pyramid_beta = p.pyramid_beta;
  o.merge_norm = p.merge_norm == "l1code" ? kk::MergeNorm::kL1Code : kk::MergeNorm::kL2;
  o.position = p.position == "weighted" ? kk::RepresentativePosition::kWeighted
                                        : kk::RepresentativePosition::kLast;
  o.route_eps = p.route_eps;
  o.hybrid_max_group = p.max_group;
  o.hybrid_min_cos = p.min_cos;
  return o;
}

std::string StageExample(const kk::StageRegistration& s) {
  switch (s.kind) {
    case kk::StageKind::kQuantize:
      return "[keydiff, " + s.name + "]";
    case kk::StageKind::kRoute:
      return "[snapkv, " + s.name + "]";
    case kk::StageKind::kScore:
    case kk::StageKind::kMerge:
      break;
  }
  return "[" + s.name + "]";
}

Status StrayStageKey(const std::string& path, const std::string& key,
                     const kk::StageRegistration& owner) {
  return Status::InvalidArgument(path + "." + key + ": set, but stages has no " + owner.name +
                                 " stage (e.g. stages: " + StageExample(owner) + ")");
}

Status CheckStageKeys(const CompressionPolicy& p, const std::string& path) {
  const std::vector<const kk::StageRegistration*> listed = ListedStages(p);
  for (const auto& [name, value] : p.stage_keys) {
    const kk::StagePolicyKey* key = nullptr;
    const kk::StageRegistration* owner = kk::StageRegistry::Global().FindPolicyKey(name, &key);
    if (owner == nullptr) return Status::InvalidArgument(path + "." + name + ": unknown key");
    if (std::find(listed.begin(), listed.end(), owner) == listed.end()) {
      return StrayStageKey(path, name, *owner);
    }
    Status s = kk::CheckStagePolicyKey(*key, value);
    if (!s.ok()) return Status::InvalidArgument(path + "." + std::string(s.message()));
  }
  return Status::Ok();
}

std::string StageKeysCanonicalForm(const CompressionPolicy& p) {
  std::string out;
  for (const kk::StageRegistration* s : ListedStages(p)) {
    if (s->canonical_form != nullptr) out += s->canonical_form(p.stage_keys);
  }
  for (const auto& [name, value] : p.stage_keys) {
    const kk::StagePolicyKey* key = nullptr;
    if (kk::StageRegistry::Global().FindPolicyKey(name, &key) == nullptr) {
      out += " " + name + "=" + kk::StageKeyText({.name = name}, value);
    } else if (!key->in_stage_canonical_form) {
      out += " " + name + "=" + kk::StageKeyText(*key, value);
    }
  }
  return out;
}

std::string PolicyKeyText(const CompressionPolicy& p, std::string_view key) {
  const kk::StagePolicyKey* k = nullptr;
  if (kk::StageRegistry::Global().FindPolicyKey(key, &k) == nullptr) return "";
  return kk::StageKeyText(*k, kk::StageKeyValue(p.stage_keys, key));
}

std::string QuantizeName(const CompressionPolicy& p) {
  const kk::StageRegistration* s = PolicyStage(kk::StageKind::kQuantize, p.quantize);
  if (s == nullptr) return "none";
  const kk::StagePolicyKey* format = nullptr;
  return kk::StageRegistry::Global().FindPolicyKey("quant_format", &format) == s
             ? kk::StageKeyText(*format, kk::StageKeyValue(p.stage_keys, format->name))
             : s->name;
}

}  // namespace kvd::daemon
