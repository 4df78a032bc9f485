// Policy names onto registered stages (stage_policy.h).
#include "stage_policy.h"

namespace kvd::daemon {

namespace kk = kvd::kernels;

const kk::StageRegistration* PolicyStage(kk::StageKind kind, const std::string& name) {
  if (name == "none") return nullptr;
  const kk::StageRegistration* s = kk::StageRegistry::Global().Find(name);
  if (s == nullptr || s->kind != kind) return nullptr;
  if (kind == kk::StageKind::kScore && s->code == 0) return nullptr;  // recency is "none"
  return s;
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
        p.Quantizes() ? kk::StageRegistry::Global().Find("quantize") : nullptr}) {
    if (s != nullptr) out.push_back(s);
  }
  return out;
}

bool NeedsCalibration(const CompressionPolicy& p) {
  for (const kk::StageRegistration* s : ListedStages(p)) {
    if (s->needs_calibration) return true;
  }
  return false;
}

bool NeedsQueryStats(const CompressionPolicy& p) {
  for (const kk::StageRegistration* s : ListedStages(p)) {
    if (s->needs_query_stats) return true;
  }
  return false;
}

void SetPlanStages(const CompressionPolicy& p, kk::CompressionPlanOptions* o) {
  const kk::StageRegistration* score = PolicyStage(kk::StageKind::kScore, p.score);
  const kk::StageRegistration* merge = PolicyStage(kk::StageKind::kMerge, p.merge);
  const kk::StageRegistration* route = PolicyStage(kk::StageKind::kRoute, p.route);
  o->score = score != nullptr ? static_cast<kk::ScoreStage>(score->code) : kk::ScoreStage::kNone;
  o->merge = merge != nullptr ? static_cast<kk::MergeStage>(merge->code) : kk::MergeStage::kNone;
  o->route = route != nullptr ? static_cast<kk::RouteStage>(route->code) : kk::RouteStage::kNone;
}

}  // namespace kvd::daemon
