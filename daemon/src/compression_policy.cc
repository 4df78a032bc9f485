// Validation, canonical form and codec id of a compression policy.
#include "kvd/daemon/compression_policy.h"

#include <cmath>
#include <cstdio>
#include <initializer_list>

#include "kvd/common/hash.h"
#include "stage_policy.h"

namespace kvd::daemon {
namespace {

bool OneOf(const std::string& v, std::initializer_list<const char*> allowed) {
  for (const char* a : allowed) {
    if (v == a) return true;
  }
  return false;
}

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

Status Bad(const std::string& key, const std::string& value, const std::string& what) {
  return Status::InvalidArgument(key + ": \"" + value + "\" " + what);
}

// `method` is "none" or a registered stage of `kind` (stage_policy.h PolicyStage).
Status CheckMethod(const std::string& key, kernels::StageKind kind, const std::string& method) {
  if (method == "none" || PolicyStage(kind, method) != nullptr) return Status::Ok();
  return Bad(key + ".stages", method,
             "is not a " + std::string(kernels::StageKindName(kind)) + " method (" +
                 PolicyMethodList(kind) + ")");
}

// At least one stage, and a route stage only after a score or merge stage.
Status CheckStageChain(const CompressionPolicy& p, const std::string& key) {
  if (p.score == "none" && p.merge == "none" && p.route == "none" && !p.Quantizes()) {
    return Status::InvalidArgument(key +
                                   ".stages: no stage; omit `compression` (or write "
                                   "`compression: off`) for a raw model");
  }
  if (p.route != "none" && p.score == "none" && p.merge == "none") {
    return Bad(key + ".stages", p.route,
               "needs a score or merge stage before it (routing picks among the slots an "
               "earlier stage kept)");
  }
  return Status::Ok();
}

// What the score stages select with: the kept share, window, sinks, pooling, KeyDiff, pyramid.
Status CheckSelection(const CompressionPolicy& p, const std::string& key) {
  if (!(p.p_c >= 0.0 && p.p_c < 1.0)) return Bad(key + ".p_c", Num(p.p_c), "is outside [0, 1)");
  if (p.window < 1) return Bad(key + ".window", std::to_string(p.window), "must be >= 1");
  if (p.sinks < 0) return Bad(key + ".sinks", std::to_string(p.sinks), "must be >= 0");
  if (!OneOf(p.pooling, {"avg", "max"})) {
    return Bad(key + ".pooling", p.pooling, "is not avg or max");
  }
  if (p.pooling_kernel < 1 || p.pooling_kernel % 2 == 0) {
    return Bad(key + ".pooling_kernel", std::to_string(p.pooling_kernel), "must be odd and >= 1");
  }
  if (p.keydiff_block < 0) {
    return Bad(key + ".keydiff_block", std::to_string(p.keydiff_block), "must be >= 0");
  }
  if (!(p.pyramid_beta >= 1.0)) {
    return Bad(key + ".pyramid_beta", Num(p.pyramid_beta), "must be >= 1");
  }
  return Status::Ok();
}

// The merge and route stages' knobs and the calibration they run on.
Status CheckMergeAndRoute(const CompressionPolicy& p, const std::string& key) {
  if (!OneOf(p.merge_norm, {"l2", "l1code"})) {
    return Bad(key + ".merge_norm", p.merge_norm, "is not l2 or l1code");
  }
  if (!OneOf(p.position, {"last", "weighted"})) {
    return Bad(key + ".position", p.position, "is not last or weighted");
  }
  if (p.max_group < 1) return Bad(key + ".max_group", std::to_string(p.max_group), "must be >= 1");
  if (!(p.min_cos >= -1.0 && p.min_cos <= 1.0)) {
    return Bad(key + ".min_cos", Num(p.min_cos), "is outside [-1, 1]");
  }
  if (!(p.route_eps >= 0.0 && p.route_eps < 1.0)) {
    return Bad(key + ".route_eps", Num(p.route_eps), "is outside [0, 1)");
  }
  if (!(p.r2_threshold >= 0.0 && p.r2_threshold <= 1.0)) {
    return Bad(key + ".r2_threshold", Num(p.r2_threshold), "is outside [0, 1]");
  }
  if (p.calibration_tokens < 1) {
    return Bad(key + ".calibration_tokens", std::to_string(p.calibration_tokens), "must be >= 1");
  }
  return Status::Ok();
}

// Where and how wide the compression runs: worker threads, queue, device.
Status CheckExecution(const CompressionPolicy& p, const std::string& key) {
  if (p.worker_threads < 1 || p.worker_threads > 256) {
    return Bad(key + ".worker_threads", std::to_string(p.worker_threads), "is outside [1, 256]");
  }
  if (p.queue_depth < 1 || p.queue_depth > 65536) {
    return Bad(key + ".queue_depth", std::to_string(p.queue_depth), "is outside [1, 65536]");
  }
  if (!OneOf(p.device, {"auto", "cpu", "cuda"}) && p.CudaOrdinal() < 0) {
    return Bad(key + ".device", p.device, "is not auto, cpu, cuda or cuda:N (a device ordinal)");
  }
  return Status::Ok();
}

// A full chunk keeps at least sinks + window tokens.
Status CheckKeptTokens(const CompressionPolicy& p, const std::string& key, int chunk_tokens) {
  const long long kept = std::llround((1.0 - p.p_c) * chunk_tokens);
  if (kept < static_cast<long long>(p.sinks) + p.window) {
    return Bad(key + ".p_c", Num(p.p_c),
               "keeps " + std::to_string(kept) + " of a full chunk's " +
                   std::to_string(chunk_tokens) + " tokens, fewer than sinks (" +
                   std::to_string(p.sinks) + ") + window (" + std::to_string(p.window) +
                   "): lower p_c, sinks or window");
  }
  return Status::Ok();
}

// The rules across the plan's fields (quant_sinks <= sinks, a score stage's own check of its keys
// and the fields it reads): the kernels' plan checks the policy's whole plan options, once.
Status CheckPlan(const CompressionPolicy& p, const std::string& key) {
  const Status s = PlanOptions(p).Validate();
  if (s.ok()) return s;
  return Status::InvalidArgument(key + ": " + std::string(s.message()));
}

}  // namespace

bool CompressionPolicy::NeedsQueries() const {
  // A query-statistics stage (expected_attention) scores without the chunk's queries, but its
  // statistics are built from them: engines are asked to send them.
  for (const kernels::StageRegistration* s : ListedStages(*this)) {
    if (s->needs_window_queries || s->needs_query_stats) return true;
  }
  return false;
}

bool CompressionPolicy::KeepsPositions() const {
  if (p_c == 0.0) return true;
  // Recency (score none) evicts unless a merge stage keeps every token in a slot.
  const kernels::StageRegistration* m = PolicyStage(kernels::StageKind::kMerge, merge);
  return score == "none" && m != nullptr && m->keeps_positions;
}

std::string CompressionPolicy::StagesName() const {
  std::string out;
  auto add = [&](const std::string& s) {
    if (s == "none") return;
    out += (out.empty() ? "" : "+") + s;
  };
  add(score);
  add(merge);
  add(route);
  add(QuantizeName(*this));
  return out.empty() ? "recency" : out;
}

Status CompressionPolicy::Validate(const std::string& key, int chunk_tokens) const {
  KVD_RETURN_IF_ERROR(CheckMethod(key, kernels::StageKind::kScore, score));
  KVD_RETURN_IF_ERROR(CheckMethod(key, kernels::StageKind::kMerge, merge));
  KVD_RETURN_IF_ERROR(CheckMethod(key, kernels::StageKind::kRoute, route));
  KVD_RETURN_IF_ERROR(CheckMethod(key, kernels::StageKind::kQuantize, quantize));
  KVD_RETURN_IF_ERROR(CheckStageChain(*this, key));
  KVD_RETURN_IF_ERROR(CheckSelection(*this, key));
  KVD_RETURN_IF_ERROR(CheckMergeAndRoute(*this, key));
  KVD_RETURN_IF_ERROR(CheckExecution(*this, key));
  KVD_RETURN_IF_ERROR(CheckStageKeys(*this, key));
  KVD_RETURN_IF_ERROR(CheckPlan(*this, key));
  return CheckKeptTokens(*this, key, chunk_tokens);
}

std::string CompressionPolicy::CanonicalForm() const {
  return "v1 score=" + score + " merge=" + merge + " route=" + route + " p_c=" + Num(p_c) +
         " window=" + std::to_string(window) + " sinks=" + std::to_string(sinks) +
         " pooling=" + pooling + "/" + std::to_string(pooling_kernel) +
         " keydiff_block=" + std::to_string(keydiff_block) + " pyramid_beta=" + Num(pyramid_beta) +
         " merge_norm=" + merge_norm + " position=" + position +
         " max_group=" + std::to_string(max_group) + " min_cos=" + Num(min_cos) +
         " route_eps=" + Num(route_eps) + " r2_threshold=" + Num(r2_threshold) +
         " calibration_tokens=" + std::to_string(calibration_tokens) +
         // The listed stages' keys: each stage's own form, then those set (stage_policy.h).
         StageKeysCanonicalForm(*this);
}

int CompressionPolicy::CudaOrdinal() const {
  if (device == "cuda") return 0;
  if (device.rfind("cuda:", 0) != 0 || device.size() < 6 || device.size() > 9) return -1;
  int n = 0;
  for (char c : device.substr(5)) {
    if (c < '0' || c > '9') return -1;
    n = n * 10 + (c - '0');
  }
  return n;
}

uint64_t CompressionPolicy::Digest() const { return Digest64(CanonicalForm()); }

uint32_t CompressionPolicy::CodecId(uint64_t calibration_version) const {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(calibration_version));
  const uint64_t d = Digest64(CanonicalForm() + " calibration=" + buf);
  uint32_t id = static_cast<uint32_t>(d ^ (d >> 32));
  return id == 0 ? 1u : id;
}

}  // namespace kvd::daemon
