// `models:` of the topology YAML: each model's layout (RoPE included) and compression policy
// (`compression:`: the stages list and the keys the listed stages read).
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "config_yaml_reader.h"
#include "kvd/kernels/stages.h"
#include "stage_policy.h"

namespace kvd::daemon::config_yaml {
namespace {

Status BindRope(const YAML::Node& node, const std::string& path, RopeConfig* rope) {
  KVD_RETURN_IF_ERROR(CheckMap(node, path,
                               {"theta", "rotary_dim", "pairing", "scaling", "factor",
                                "low_freq_factor", "high_freq_factor", "original_max_positions"}));
  KVD_RETURN_IF_ERROR(GetDouble(node, path, "theta", &rope->theta));
  KVD_RETURN_IF_ERROR(GetInt(node, path, "rotary_dim", &rope->rotary_dim, 0, 1024));
  std::string text;
  KVD_ASSIGN_OR_RETURN(bool has_pairing, Scalar(node, path, "pairing", &text));
  if (has_pairing) {
    if (text == "interleaved") {
      rope->pairing = RopePairing::kInterleaved;
    } else if (text == "halves") {
      rope->pairing = RopePairing::kHalves;
    } else {
      return Bad(Join(path, "pairing"), text, "is not one of interleaved, halves");
    }
  }
  KVD_ASSIGN_OR_RETURN(bool has_scaling, Scalar(node, path, "scaling", &text));
  if (has_scaling) {
    if (text == "none") {
      rope->scaling = RopeScaling::kNone;
    } else if (text == "linear") {
      rope->scaling = RopeScaling::kLinear;
    } else if (text == "llama3") {
      rope->scaling = RopeScaling::kLlama3;
    } else {
      return Bad(Join(path, "scaling"), text, "is not one of none, linear, llama3");
    }
  }
  KVD_RETURN_IF_ERROR(GetDouble(node, path, "factor", &rope->factor));
  KVD_RETURN_IF_ERROR(GetDouble(node, path, "low_freq_factor", &rope->low_freq_factor));
  KVD_RETURN_IF_ERROR(GetDouble(node, path, "high_freq_factor", &rope->high_freq_factor));
  KVD_RETURN_IF_ERROR(
      GetInt(node, path, "original_max_positions", &rope->original_max_positions, 1, 1 << 30));
  return Status::Ok();
}

Status BindLayout(const YAML::Node& node, const std::string& path, ModelLayout* layout) {
  KVD_RETURN_IF_ERROR(CheckMap(
      node, path,
      {"layers", "kv_heads", "q_heads", "head_dim", "dtype", "tp_rank", "tp_size", "rope"}));
  KVD_RETURN_IF_ERROR(GetInt(node, path, "layers", &layout->num_layers, 1, 1024));
  KVD_RETURN_IF_ERROR(GetInt(node, path, "kv_heads", &layout->num_kv_heads, 1, 1024));
  KVD_RETURN_IF_ERROR(GetInt(node, path, "q_heads", &layout->num_q_heads, 1, 65536));
  KVD_RETURN_IF_ERROR(GetInt(node, path, "head_dim", &layout->head_dim, 2, 1024));
  KVD_RETURN_IF_ERROR(GetInt(node, path, "tp_rank", &layout->tp_rank, 0, 65535));
  KVD_RETURN_IF_ERROR(GetInt(node, path, "tp_size", &layout->tp_size, 1, 65536));
  std::string text;
  KVD_ASSIGN_OR_RETURN(bool has_dtype, Scalar(node, path, "dtype", &text));
  if (has_dtype) {
    auto dtype = ParseDType(text);
    if (!dtype.ok()) return Bad(Join(path, "dtype"), text, "is not float32, float16 or bfloat16");
    layout->dtype = *dtype;
  }
  if (node["rope"].IsDefined()) {
    KVD_RETURN_IF_ERROR(BindRope(node["rope"], Join(path, "rope"), &layout->rope));
  }
  return Status::Ok();
}

bool Listed(const CompressionPolicy& p, const kernels::StageRegistration* stage) {
  for (const kernels::StageRegistration* s : ListedStages(p)) {
    if (s == stage) return true;
  }
  return false;
}

// An integer key's range end as an int64 (an infinite end: the int64 limit).
int64_t IntBound(double end) {
  constexpr double kLimit = 9.0e18;
  return static_cast<int64_t>(std::clamp(end, -kLimit, kLimit));
}

// One registered stage key's value, read as its declaration's type (a choice by name, an integer
// within its range) and checked against the declaration.
Status BindRegisteredStageKey(const YAML::Node& node, const std::string& path,
                              const kernels::StagePolicyKey& key, CompressionPolicy* p) {
  double value = 0.0;
  std::string text;
  switch (key.type) {
    case kernels::PolicyKeyType::kBool: {
      bool b = false;
      KVD_RETURN_IF_ERROR(GetBool(node, path, key.name.c_str(), &b));
      value = b ? 1.0 : 0.0;
      break;
    }
    case kernels::PolicyKeyType::kChoice: {
      KVD_RETURN_IF_ERROR(GetString(node, path, key.name.c_str(), &text));
      auto index = kernels::StageKeyChoice(key, text);
      if (!index.ok()) return Status::InvalidArgument(path + "." + index.status().message());
      value = *index;
      break;
    }
    case kernels::PolicyKeyType::kInt: {
      int64_t v = 0;
      KVD_RETURN_IF_ERROR(
          GetInt(node, path, key.name.c_str(), &v, IntBound(key.min), IntBound(key.max)));
      value = static_cast<double>(v);
      break;
    }
    case kernels::PolicyKeyType::kDouble:
      KVD_RETURN_IF_ERROR(GetDouble(node, path, key.name.c_str(), &value));
      break;
  }
  Status s = kernels::CheckStagePolicyKey(key, value);
  if (!s.ok()) return Status::InvalidArgument(path + "." + s.message());
  p->stage_keys[key.name] = value;
  return Status::Ok();
}

// The keys registered stages declare: bound into p->stage_keys when their stage is listed,
// refused otherwise.
Status BindStageKeys(const YAML::Node& node, const std::string& path, CompressionPolicy* p) {
  const kernels::StageRegistry& registry = kernels::StageRegistry::Global();
  for (const std::string& name : registry.PolicyKeyNames()) {
    if (!node[name].IsDefined()) continue;
    const kernels::StagePolicyKey* key = nullptr;
    const kernels::StageRegistration* owner = registry.FindPolicyKey(name, &key);
    if (!Listed(*p, owner)) return StrayStageKey(path, name, *owner);
    KVD_RETURN_IF_ERROR(BindRegisteredStageKey(node, path, *key, p));
  }
  return Status::Ok();
}

// The `stages` list into p's score, merge, route and quantize (order and method names are
// YAML-level facts, checked here). Methods are the registered stages (kernels/stages.h).
Status BindStages(const YAML::Node& node, const std::string& path, CompressionPolicy* p) {
  namespace kk = kvd::kernels;
  const YAML::Node stages = node["stages"];
  if (!stages.IsDefined() || !stages.IsSequence() || stages.size() == 0) {
    return Status::InvalidArgument(
        path +
        ".stages: required, a non-empty list of methods in the order "
        "score, merge, route, quantize (e.g. [snapkv], [snapkv, vector], "
        "[keydiff, quantize])");
  }
  p->score = "none";
  int last_stage = -1;
  for (size_t i = 0; i < stages.size(); ++i) {
    const std::string key = path + ".stages[" + std::to_string(i) + "]";
    if (!stages[i].IsScalar()) return Status::InvalidArgument(key + ": must be a method name");
    std::string method = stages[i].Scalar();
    std::vector<std::pair<kk::StageKind, std::string>> parts;  // (stage, method)
    const kk::StageRegistration* s = kk::StageRegistry::Global().Find(method);
    if (method == "hybrid") {
      parts = {{kk::StageKind::kScore, "snapkv"}, {kk::StageKind::kMerge, "kvslimmer"}};
    } else if (s != nullptr && PolicyStage(s->kind, method) != nullptr) {
      parts = {{s->kind, method}};
    } else {
      return Bad(key, method,
                 "is not a method (score: " + PolicyMethodList(kk::StageKind::kScore) +
                     "; merge: " + PolicyMethodList(kk::StageKind::kMerge) +
                     "; route: " + PolicyMethodList(kk::StageKind::kRoute) + "; quantize: " +
                     PolicyMethodList(kk::StageKind::kQuantize) + "; hybrid = snapkv + kvslimmer)");
    }
    for (const auto& [kind, name] : parts) {
      const int stage = static_cast<int>(kind);
      if (stage == last_stage) {
        return Bad(
            key, method,
            "is a second " + std::string(kk::StageKindName(kind)) + " method (one per stage)");
      }
      if (stage < last_stage) {
        return Bad(key, method,
                   "is a " + std::string(kk::StageKindName(kind)) + " method listed after the " +
                       std::string(kk::StageKindName(static_cast<kk::StageKind>(last_stage))) +
                       " stage; stages run in the order score, merge, route, quantize");
      }
      last_stage = stage;
      (kind == kk::StageKind::kScore   ? p->score
       : kind == kk::StageKind::kMerge ? p->merge
       : kind == kk::StageKind::kRoute ? p->route
                                       : p->quantize) = name;
    }
  }
  // `[quantize]` alone keeps every token unless p_c says otherwise (recency then evicts).
  if (p->score == "none" && p->merge == "none" && p->route == "none") p->p_c = 0.0;
  return Status::Ok();
}

// `compression: off` (raw) or a policy mapping (compression_policy.h). The stages and their keys
// are bound above; the rest is checked by CompressionPolicy::Validate.
Status BindCompression(const YAML::Node& node, const std::string& path,
                       std::optional<CompressionPolicy>* out) {
  if (node.IsScalar()) {
    const std::string text = node.Scalar();
    if (text == "off" || text == "false" || text == "none") {
      out->reset();
      return Status::Ok();
    }
    return Bad(path, text,
               "is not \"off\" or a policy mapping (e.g. {stages: [snapkv], p_c: 0.5})");
  }
  std::vector<const char*> allowed = {
      "stages",         "p_c",           "window",       "sinks",        "pooling",
      "pooling_kernel", "keydiff_block", "pyramid_beta", "merge_norm",   "position",
      "max_group",      "min_cos",       "route_eps",    "r2_threshold", "calibration_tokens",
      "worker_threads", "queue_depth",   "device"};
  const std::vector<std::string> registered = kernels::StageRegistry::Global().PolicyKeyNames();
  for (const std::string& k : registered) allowed.push_back(k.c_str());
  KVD_RETURN_IF_ERROR(CheckMap(node, path, allowed));
  CompressionPolicy p;
  KVD_RETURN_IF_ERROR(BindStages(node, path, &p));
  KVD_RETURN_IF_ERROR(BindStageKeys(node, path, &p));
  KVD_RETURN_IF_ERROR(GetDouble(node, path, "p_c", &p.p_c));
  KVD_RETURN_IF_ERROR(GetInt(node, path, "window", &p.window, 1, 1 << 20));
  KVD_RETURN_IF_ERROR(GetInt(node, path, "sinks", &p.sinks, 0, 1 << 20));
  KVD_RETURN_IF_ERROR(GetString(node, path, "pooling", &p.pooling));
  KVD_RETURN_IF_ERROR(GetInt(node, path, "pooling_kernel", &p.pooling_kernel, 1, 1023));
  KVD_RETURN_IF_ERROR(GetInt(node, path, "keydiff_block", &p.keydiff_block, 0, 1 << 20));
  KVD_RETURN_IF_ERROR(GetDouble(node, path, "pyramid_beta", &p.pyramid_beta));
  KVD_RETURN_IF_ERROR(GetString(node, path, "merge_norm", &p.merge_norm));
  KVD_RETURN_IF_ERROR(GetString(node, path, "position", &p.position));
  KVD_RETURN_IF_ERROR(GetInt(node, path, "max_group", &p.max_group, 1, 1 << 20));
  KVD_RETURN_IF_ERROR(GetDouble(node, path, "min_cos", &p.min_cos));
  KVD_RETURN_IF_ERROR(GetDouble(node, path, "route_eps", &p.route_eps));
  KVD_RETURN_IF_ERROR(GetDouble(node, path, "r2_threshold", &p.r2_threshold));
  KVD_RETURN_IF_ERROR(
      GetInt(node, path, "calibration_tokens", &p.calibration_tokens, 1, int64_t{1} << 40));
  KVD_RETURN_IF_ERROR(GetInt(node, path, "worker_threads", &p.worker_threads, 1, 256));
  KVD_RETURN_IF_ERROR(GetInt(node, path, "queue_depth", &p.queue_depth, 1, 65536));
  KVD_RETURN_IF_ERROR(GetString(node, path, "device", &p.device));
  *out = p;
  return Status::Ok();
}

}  // namespace

Status BindModels(const YAML::Node& node, std::vector<ModelConfig>* models) {
  if (!node.IsSequence()) return Status::InvalidArgument("models: must be a list");
  models->clear();
  for (size_t i = 0; i < node.size(); ++i) {
    std::string path = "models[" + std::to_string(i) + "]";
    const YAML::Node m = node[i];
    KVD_RETURN_IF_ERROR(CheckMap(m, path, {"name", "layout", "compression"}));
    ModelConfig model;
    KVD_RETURN_IF_ERROR(GetString(m, path, "name", &model.name));
    if (model.name.empty()) return Status::InvalidArgument(path + ".name: required");
    if (!m["layout"].IsDefined()) {
      return Status::InvalidArgument(path + " (" + model.name + ").layout: required");
    }
    KVD_RETURN_IF_ERROR(BindLayout(m["layout"], path + ".layout", &model.layout));
    if (YAML::Node c = m["compression"]; c.IsDefined() && !c.IsNull()) {
      KVD_RETURN_IF_ERROR(BindCompression(c, path + ".compression", &model.compression));
    }
    models->push_back(std::move(model));
  }
  return Status::Ok();
}

}  // namespace kvd::daemon::config_yaml
