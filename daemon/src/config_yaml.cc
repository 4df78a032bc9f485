// Binds the topology YAML to DaemonConfig. yaml-cpp throws; nothing thrown leaves this file.
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <optional>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kvd/common/logging.h"
#include "kvd/common/scalar_text.h"
#include "kvd/daemon/config.h"
#include "kvd/transport/registry.h"
#include "quotas.h"
#include "stage_policy.h"

namespace kvd::daemon {
namespace {

std::string Join(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}

Status Bad(const std::string& key, const std::string& value, const std::string& what) {
  return Status::InvalidArgument(key + ": \"" + value + "\" " + what);
}

// Requires `node` to be a map whose keys are all in `allowed`.
Status CheckMap(const YAML::Node& node, const std::string& path,
                std::span<const char* const> allowed) {
  if (!node.IsMap()) {
    return Status::InvalidArgument((path.empty() ? "document" : path) + ": must be a mapping");
  }
  for (const auto& kv : node) {
    std::string key = kv.first.as<std::string>();
    bool known = false;
    for (const char* a : allowed) known = known || key == a;
    if (!known) {
      std::string list;
      for (const char* a : allowed) list += std::string(list.empty() ? "" : ", ") + a;
      return Status::InvalidArgument(Join(path, key) + ": unknown key (known here: " + list + ")");
    }
  }
  return Status::Ok();
}
Status CheckMap(const YAML::Node& node, const std::string& path,
                std::initializer_list<const char*> allowed) {
  return CheckMap(node, path, std::span<const char* const>(allowed.begin(), allowed.size()));
}

// Reads a scalar as text; false if the key is absent.
StatusOr<bool> Scalar(const YAML::Node& map, const std::string& path, const char* key,
                      std::string* out) {
  YAML::Node n = map[key];
  if (!n.IsDefined() || n.IsNull()) return false;
  if (!n.IsScalar()) return Status::InvalidArgument(Join(path, key) + ": must be a scalar value");
  *out = n.Scalar();
  return true;
}

Status GetString(const YAML::Node& map, const std::string& path, const char* key,
                 std::string* out) {
  std::string text;
  KVD_ASSIGN_OR_RETURN(bool present, Scalar(map, path, key, &text));
  if (present) *out = text;
  return Status::Ok();
}

template <typename Int>
Status GetInt(const YAML::Node& map, const std::string& path, const char* key, Int* out,
              int64_t min_value, int64_t max_value) {
  std::string text;
  KVD_ASSIGN_OR_RETURN(bool present, Scalar(map, path, key, &text));
  if (!present) return Status::Ok();
  return ParseIntText(Join(path, key), text, min_value, max_value, out);
}

Status GetDouble(const YAML::Node& map, const std::string& path, const char* key, double* out) {
  std::string text;
  KVD_ASSIGN_OR_RETURN(bool present, Scalar(map, path, key, &text));
  if (!present) return Status::Ok();
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(v)) {
    return Bad(Join(path, key), text, "is not a finite number");
  }
  *out = v;
  return Status::Ok();
}

Status GetBool(const YAML::Node& map, const std::string& path, const char* key, bool* out) {
  std::string text;
  KVD_ASSIGN_OR_RETURN(bool present, Scalar(map, path, key, &text));
  if (!present) return Status::Ok();
  return ParseBoolText(Join(path, key), text, out);
}

template <typename Int>
Status GetBytes(const YAML::Node& map, const std::string& path, const char* key, Int* out) {
  std::string text;
  KVD_ASSIGN_OR_RETURN(bool present, Scalar(map, path, key, &text));
  if (!present) return Status::Ok();
  auto bytes = ParseByteSize(text);
  if (!bytes.ok())
    return Status::InvalidArgument(Join(path, key) + ": " + bytes.status().message());
  if (*bytes > static_cast<uint64_t>(std::numeric_limits<Int>::max())) {
    return Bad(Join(path, key), text, "is too large");
  }
  *out = static_cast<Int>(*bytes);
  return Status::Ok();
}

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

// The quantize stage's keys (`quantize` listed).
Status BindQuantizeKeys(const YAML::Node& node, const std::string& path, CompressionPolicy* p) {
  // `[quantize]` alone keeps every token unless p_c says otherwise (recency then evicts).
  if (p->score == "none" && p->merge == "none" && p->route == "none") p->p_c = 0.0;
  KVD_RETURN_IF_ERROR(GetString(node, path, "quant_format", &p->quant_format));
  if (p->quant_format == "none") {
    return Bad(Join(path, "quant_format"), p->quant_format,
               "is not int8, int4, int3, int2 or fp8_e4m3 (drop the quantize stage to store full "
               "precision)");
  }
  KVD_RETURN_IF_ERROR(GetInt(node, path, "quant_group", &p->quant_group, 1, 65536));
  KVD_RETURN_IF_ERROR(GetInt(node, path, "quant_key_group", &p->quant_key_group, 1, 65536));
  KVD_RETURN_IF_ERROR(GetInt(node, path, "quant_recent", &p->quant_recent, 0, 1 << 30));
  KVD_RETURN_IF_ERROR(GetString(node, path, "quant_rotate", &p->quant_rotate));
  return GetString(node, path, "quant_value_format", &p->quant_value_format);
}

// The expected_attention stage's keys (`expected_attention` listed).
Status BindExpectedAttentionKeys(const YAML::Node& node, const std::string& path,
                                 CompressionPolicy* p) {
  KVD_RETURN_IF_ERROR(
      GetInt(node, path, "ea_future_positions", &p->ea_future_positions, 1, int64_t{1} << 30));
  KVD_RETURN_IF_ERROR(
      GetInt(node, path, "ea_min_queries", &p->ea_min_queries, 1, int64_t{1} << 40));
  KVD_RETURN_IF_ERROR(GetBool(node, path, "ea_covariance", &p->ea_covariance));
  return GetDouble(node, path, "ea_keydiff_share", &p->ea_keydiff_share);
}

// The built-in keys that only one stage reads and that CompressionPolicy holds in fields of its
// own: bound when the stage is listed, refused otherwise. A stage registered with policy keys
// (kernels/stages.h StagePolicyKey) needs no row: BindRegisteredStageKeys binds those.
struct StageKeys {
  const char* stage;  // the registered stage (kernels/stages.h)
  std::vector<const char*> keys;
  Status (*bind)(const YAML::Node& node, const std::string& path, CompressionPolicy* p);
};

const std::vector<StageKeys>& StageKeyTable() {
  static const std::vector<StageKeys> table = {
      {"quantize",
       {"quant_format", "quant_group", "quant_key_group", "quant_recent", "quant_rotate",
        "quant_value_format"},
       BindQuantizeKeys},
      {"expected_attention",
       {"ea_future_positions", "ea_min_queries", "ea_covariance", "ea_keydiff_share"},
       BindExpectedAttentionKeys},
  };
  return table;
}

bool Listed(const CompressionPolicy& p, const kernels::StageRegistration* stage) {
  for (const kernels::StageRegistration* s : ListedStages(p)) {
    if (s == stage) return true;
  }
  return false;
}

// One registered stage key's value (its declaration's type), checked against the declaration.
Status BindRegisteredStageKey(const YAML::Node& node, const std::string& path,
                              const kernels::StagePolicyKey& key, CompressionPolicy* p) {
  double value = 0.0;
  if (key.type == kernels::PolicyKeyType::kBool) {
    bool b = false;
    KVD_RETURN_IF_ERROR(GetBool(node, path, key.name.c_str(), &b));
    value = b ? 1.0 : 0.0;
  } else {
    KVD_RETURN_IF_ERROR(GetDouble(node, path, key.name.c_str(), &value));
  }
  Status s = kernels::CheckStagePolicyKey(key, value);
  if (!s.ok()) return Status::InvalidArgument(path + "." + s.message());
  p->stage_keys[key.name] = value;
  return Status::Ok();
}

// The keys registered stages declare: bound into p->stage_keys when their stage is listed,
// refused otherwise.
Status BindRegisteredStageKeys(const YAML::Node& node, const std::string& path,
                               CompressionPolicy* p) {
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

Status BindStageKeys(const YAML::Node& node, const std::string& path, CompressionPolicy* p) {
  for (const StageKeys& sk : StageKeyTable()) {
    const kernels::StageRegistration* stage = kernels::StageRegistry::Global().Find(sk.stage);
    if (Listed(*p, stage)) {
      KVD_RETURN_IF_ERROR(sk.bind(node, path, p));
      continue;
    }
    for (const char* k : sk.keys) {
      if (node[k].IsDefined()) return StrayStageKey(path, k, *stage);
    }
  }
  return BindRegisteredStageKeys(node, path, p);
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
      // The quantize stage's value is its format: quant_format (BindQuantizeKeys).
      parts = {{s->kind, s->kind == kk::StageKind::kQuantize ? "int8" : method}};
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
                                       : p->quant_format) = name;
    }
  }
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
  for (const StageKeys& sk : StageKeyTable())
    allowed.insert(allowed.end(), sk.keys.begin(), sk.keys.end());
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

// One namespace's quotas: every key is a NamespaceQuota field (SetQuotaField).
Status BindQuota(const YAML::Node& node, const std::string& path, storage::NamespaceQuota* quota) {
  if (!node.IsMap()) return Status::InvalidArgument(path + ": must be a mapping");
  for (const auto& kv : node) {
    const std::string key = kv.first.as<std::string>();
    if (!kv.second.IsScalar()) {
      return Status::InvalidArgument(Join(path, key) + ": must be a scalar value");
    }
    KVD_RETURN_IF_ERROR(SetQuotaField(quota, key, kv.second.Scalar()).WithContext(path));
  }
  return Status::Ok();
}

Status BindQuotas(const YAML::Node& n, QuotaOptions* q) {
  KVD_RETURN_IF_ERROR(CheckMap(n, "quotas", {"default", "namespaces", "protect"}));
  KVD_RETURN_IF_ERROR(GetBool(n, "quotas", "protect", &q->protect));
  if (YAML::Node d = n["default"]; d.IsDefined() && !d.IsNull()) {
    KVD_RETURN_IF_ERROR(BindQuota(d, "quotas.default", &q->table.defaults));
  }
  if (YAML::Node ns = n["namespaces"]; ns.IsDefined() && !ns.IsNull()) {
    if (!ns.IsMap()) return Status::InvalidArgument("quotas.namespaces: must be a mapping");
    for (const auto& kv : ns) {
      const std::string name = kv.first.as<std::string>();
      storage::NamespaceQuota quota = q->table.defaults;  // unset fields: the default's
      KVD_RETURN_IF_ERROR(BindQuota(kv.second, "quotas.namespaces." + name, &quota));
      q->table.namespaces[name] = quota;
    }
  }
  return Status::Ok();
}

// `cluster.token_file`: the token is the file's content less one trailing newline (a mounted
// Kubernetes Secret), read once at load.
Status ReadClusterTokenFile(const std::string& path, std::string* token) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return Status::InvalidArgument("cluster.token_file: cannot read \"" + path + "\"");
  }
  std::ostringstream text;
  text << in.rdbuf();
  *token = text.str();
  if (!token->empty() && token->back() == '\n') token->pop_back();
  if (!token->empty() && token->back() == '\r') token->pop_back();
  if (token->empty()) {
    return Status::InvalidArgument("cluster.token_file: \"" + path + "\" is empty");
  }
  return Status::Ok();
}

// `cluster: {etcd: [host:port, ...], name, node, lease_ttl_s, token | token_file, peer_fetch,
// peer_timeout_ms}`; etcd may be one string.
Status BindCluster(const YAML::Node& n, cluster::MembershipOptions* o, PeerFetchOptions* peer) {
  KVD_RETURN_IF_ERROR(CheckMap(n, "cluster",
                               {"etcd", "name", "node", "lease_ttl_s", "token", "token_file",
                                "peer_fetch", "peer_timeout_ms"}));
  const YAML::Node etcd = n["etcd"];
  if (!etcd.IsDefined() || etcd.IsNull()) {
    // left empty: MembershipOptions::Validate names it
  } else if (etcd.IsScalar()) {
    o->etcd = {etcd.Scalar()};
  } else if (etcd.IsSequence()) {
    for (size_t i = 0; i < etcd.size(); ++i) {
      if (!etcd[i].IsScalar()) {
        return Status::InvalidArgument("cluster.etcd[" + std::to_string(i) +
                                       "]: must be an endpoint host:port");
      }
      o->etcd.push_back(etcd[i].Scalar());
    }
  } else {
    return Status::InvalidArgument("cluster.etcd: must be a list of endpoints host:port");
  }
  KVD_RETURN_IF_ERROR(GetString(n, "cluster", "name", &o->name));
  KVD_RETURN_IF_ERROR(GetString(n, "cluster", "node", &o->node));
  KVD_RETURN_IF_ERROR(GetInt(n, "cluster", "lease_ttl_s", &o->lease_ttl_s, 2, 3600));
  KVD_RETURN_IF_ERROR(GetString(n, "cluster", "token", &o->token));
  std::string token_file;
  KVD_RETURN_IF_ERROR(GetString(n, "cluster", "token_file", &token_file));
  if (!token_file.empty()) {
    if (!o->token.empty()) {
      return Status::InvalidArgument("cluster.token_file: give either token or token_file");
    }
    KVD_RETURN_IF_ERROR(ReadClusterTokenFile(token_file, &o->token));
  }
  std::string policy = "store";
  KVD_RETURN_IF_ERROR(GetString(n, "cluster", "peer_fetch", &policy));
  if (policy == "store") {
    peer->policy = PeerFetchOptions::Policy::kStore;
  } else if (policy == "serve") {
    peer->policy = PeerFetchOptions::Policy::kServe;
  } else if (policy == "off") {
    peer->policy = PeerFetchOptions::Policy::kOff;
  } else {
    return Status::InvalidArgument("cluster.peer_fetch: \"" + policy +
                                   "\" is not a policy (store, serve, off)");
  }
  KVD_RETURN_IF_ERROR(GetInt(n, "cluster", "peer_timeout_ms", &peer->timeout_ms, 10, 60000));
  return Status::Ok();
}

// `kv_events: {endpoint, replay_endpoint, topic, buffer_steps, max_batch_events, hwm}`.
Status BindKvEvents(const YAML::Node& n, KvEventsOptions* o) {
  KVD_RETURN_IF_ERROR(CheckMap(
      n, "kv_events",
      {"endpoint", "replay_endpoint", "topic", "buffer_steps", "max_batch_events", "hwm"}));
  KVD_RETURN_IF_ERROR(GetString(n, "kv_events", "endpoint", &o->endpoint));
  KVD_RETURN_IF_ERROR(GetString(n, "kv_events", "replay_endpoint", &o->replay_endpoint));
  KVD_RETURN_IF_ERROR(GetString(n, "kv_events", "topic", &o->topic));
  KVD_RETURN_IF_ERROR(GetInt(n, "kv_events", "buffer_steps", &o->buffer_steps, 1, 10000000));
  KVD_RETURN_IF_ERROR(GetInt(n, "kv_events", "max_batch_events", &o->max_batch_events, 1, 65536));
  KVD_RETURN_IF_ERROR(GetInt(n, "kv_events", "hwm", &o->hwm, 1, 10000000));
  return Status::Ok();
}

// The `transport:` section: its scalars go to the transport registry, whose backends bind their
// own keys (kvd/transport/registry.h).
Status BindTransport(const YAML::Node& n, transport::TransportOptions* t) {
  if (!n.IsMap()) return Status::InvalidArgument("transport: must be a mapping");
  transport::TransportSection section;
  for (const auto& kv : n) {
    std::string key = kv.first.as<std::string>();
    std::string text;
    KVD_ASSIGN_OR_RETURN(bool present, Scalar(n, "transport", key.c_str(), &text));
    section.emplace_back(key, present ? std::optional<std::string>(text) : std::nullopt);
  }
  return transport::BindTransportOptions(section, t);
}

// tiers.gpu: present and not null makes a GPU tier.
Status BindGpuTier(const YAML::Node& g, DaemonConfig* c) {
  KVD_RETURN_IF_ERROR(
      CheckMap(g, "tiers.gpu", {"capacity", "device", "alignment", "verify_checksums"}));
  storage::GpuTierOptions gpu;
  KVD_RETURN_IF_ERROR(GetBytes(g, "tiers.gpu", "capacity", &gpu.capacity_bytes));
  if (gpu.capacity_bytes == 0) return Status::InvalidArgument("tiers.gpu.capacity: required");
  KVD_RETURN_IF_ERROR(GetBytes(g, "tiers.gpu", "alignment", &gpu.alignment));
  KVD_RETURN_IF_ERROR(GetBool(g, "tiers.gpu", "verify_checksums", &gpu.verify_checksums));
  KVD_RETURN_IF_ERROR(GetInt(g, "tiers.gpu", "device", &c->gpu_device, 0, 1023));
  c->gpu_tier = gpu;
  return Status::Ok();
}

// tiers.disk: present and not null makes a disk tier; on_error sets the placement's policy.
Status BindDiskTier(const YAML::Node& d, DaemonConfig* c) {
  KVD_RETURN_IF_ERROR(CheckMap(d, "tiers.disk",
                               {"path", "capacity", "use_wal", "sync_writes", "verify_checksums",
                                "block_cache", "on_error"}));
  storage::DiskTierOptions disk;
  KVD_RETURN_IF_ERROR(GetString(d, "tiers.disk", "path", &disk.path));
  if (disk.path.empty()) return Status::InvalidArgument("tiers.disk.path: required");
  KVD_RETURN_IF_ERROR(GetBytes(d, "tiers.disk", "capacity", &disk.capacity_bytes));
  KVD_RETURN_IF_ERROR(GetBool(d, "tiers.disk", "use_wal", &disk.use_wal));
  KVD_RETURN_IF_ERROR(GetBool(d, "tiers.disk", "sync_writes", &disk.sync_writes));
  KVD_RETURN_IF_ERROR(GetBool(d, "tiers.disk", "verify_checksums", &disk.verify_checksums));
  KVD_RETURN_IF_ERROR(GetBytes(d, "tiers.disk", "block_cache", &disk.block_cache_bytes));
  std::string on_error = "keep_in_host";
  KVD_RETURN_IF_ERROR(GetString(d, "tiers.disk", "on_error", &on_error));
  if (on_error == "keep_in_host") {
    c->placement.on_disk_error = storage::TierManagerOptions::OnDiskError::kKeepInHost;
  } else if (on_error == "fail_puts") {
    c->placement.on_disk_error = storage::TierManagerOptions::OnDiskError::kFailPuts;
  } else {
    return Status::InvalidArgument("tiers.disk.on_error: \"" + on_error +
                                   "\" is not keep_in_host or fail_puts");
  }
  c->disk_tier = std::move(disk);
  return Status::Ok();
}

Status BindPlacement(const YAML::Node& p, DaemonConfig* c) {
  KVD_RETURN_IF_ERROR(
      CheckMap(p, "tiers.placement", {"high_watermark", "low_watermark", "promote_on_hit"}));
  KVD_RETURN_IF_ERROR(
      GetDouble(p, "tiers.placement", "high_watermark", &c->placement.high_watermark));
  KVD_RETURN_IF_ERROR(
      GetDouble(p, "tiers.placement", "low_watermark", &c->placement.low_watermark));
  KVD_RETURN_IF_ERROR(
      GetBool(p, "tiers.placement", "promote_on_hit", &c->placement.promote_on_hit));
  return Status::Ok();
}

Status BindHostTier(const YAML::Node& h, DaemonConfig* c) {
  KVD_RETURN_IF_ERROR(CheckMap(h, "tiers.host",
                               {"capacity", "alignment", "read_ttl_ms", "prefault", "shared_memory",
                                "segment", "verify_shm_commits"}));
  KVD_RETURN_IF_ERROR(GetBool(h, "tiers.host", "shared_memory", &c->host_shared_memory));
  KVD_RETURN_IF_ERROR(GetBytes(h, "tiers.host", "segment", &c->host_tier.segment_bytes));
  KVD_RETURN_IF_ERROR(GetBool(h, "tiers.host", "prefault", &c->host_prefault));
  KVD_RETURN_IF_ERROR(GetBool(h, "tiers.host", "verify_shm_commits", &c->host_verify_shm_commits));
  KVD_RETURN_IF_ERROR(GetBytes(h, "tiers.host", "capacity", &c->host_tier.capacity_bytes));
  KVD_RETURN_IF_ERROR(GetBytes(h, "tiers.host", "alignment", &c->host_tier.alignment));
  int64_t read_ttl = c->host_tier.read_ttl.count();
  KVD_RETURN_IF_ERROR(GetInt(h, "tiers.host", "read_ttl_ms", &read_ttl, 1, 86400000));
  c->host_tier.read_ttl = std::chrono::milliseconds(read_ttl);
  return Status::Ok();
}

// tiers: the host tier, the optional GPU and disk tiers, and placement between them.
Status BindTiers(const YAML::Node& n, DaemonConfig* c) {
  KVD_RETURN_IF_ERROR(
      CheckMap(n, "tiers", {"host", "disk", "gpu", "placement", "allow_overcommit"}));
  KVD_RETURN_IF_ERROR(GetBool(n, "tiers", "allow_overcommit", &c->allow_overcommit));
  if (YAML::Node g = n["gpu"]; g.IsDefined() && !g.IsNull()) {
    KVD_RETURN_IF_ERROR(BindGpuTier(g, c));
  }
  if (YAML::Node d = n["disk"]; d.IsDefined() && !d.IsNull()) {
    KVD_RETURN_IF_ERROR(BindDiskTier(d, c));
  }
  if (YAML::Node p = n["placement"]; p.IsDefined()) {
    KVD_RETURN_IF_ERROR(BindPlacement(p, c));
  }
  if (YAML::Node h = n["host"]; h.IsDefined()) {
    KVD_RETURN_IF_ERROR(BindHostTier(h, c));
  }
  return Status::Ok();
}

Status BindAuth(const YAML::Node& n, DaemonConfig* c) {
  KVD_RETURN_IF_ERROR(CheckMap(n, "auth", {"tokens_file", "allow_unauthenticated"}));
  KVD_RETURN_IF_ERROR(GetString(n, "auth", "tokens_file", &c->auth.tokens_file));
  KVD_RETURN_IF_ERROR(GetBool(n, "auth", "allow_unauthenticated", &c->auth.allow_unauthenticated));
  return Status::Ok();
}

Status BindProtocol(const YAML::Node& n, DaemonConfig* c) {
  KVD_RETURN_IF_ERROR(CheckMap(
      n, "protocol",
      {"releases_on_requests", "inline_put", "lease_releases_on_requests", "reserve_ahead"}));
  KVD_RETURN_IF_ERROR(GetBool(n, "protocol", "lease_releases_on_requests",
                              &c->protocol.lease_releases_on_requests));
  KVD_RETURN_IF_ERROR(
      GetBool(n, "protocol", "releases_on_requests", &c->protocol.releases_on_requests));
  KVD_RETURN_IF_ERROR(GetBool(n, "protocol", "inline_put", &c->protocol.inline_put));
  KVD_RETURN_IF_ERROR(GetBool(n, "protocol", "reserve_ahead", &c->protocol.reserve_ahead));
  return Status::Ok();
}

Status BindLimits(const YAML::Node& n, DaemonConfig* c) {
  KVD_RETURN_IF_ERROR(CheckMap(
      n, "limits",
      {"max_frame_bytes", "max_chunk_bytes", "reservation_ttl_ms", "lease_ttl_ms",
       "transfer_timeout_ms", "max_sessions", "max_inflight_per_session", "max_lease_ttl_ms",
       "max_leases_per_session", "max_chain_chunks", "handshake_timeout_ms", "frame_timeout_ms",
       "max_sessions_per_peer", "admin_reserve_sessions", "max_frame_bytes_before_hello",
       "frame_buffer_budget_bytes", "unauthenticated_share", "unauthenticated_grace_ms",
       "idle_timeout_ms"}));
  auto& l = c->limits;
  KVD_RETURN_IF_ERROR(GetBytes(n, "limits", "max_frame_bytes", &l.max_frame_bytes));
  KVD_RETURN_IF_ERROR(GetBytes(n, "limits", "max_chunk_bytes", &l.max_chunk_bytes));
  constexpr int64_t kDay = 86400000;
  KVD_RETURN_IF_ERROR(GetInt(n, "limits", "reservation_ttl_ms", &l.reservation_ttl_ms, 1, kDay));
  KVD_RETURN_IF_ERROR(GetInt(n, "limits", "lease_ttl_ms", &l.lease_ttl_ms, 1, kDay));
  KVD_RETURN_IF_ERROR(GetInt(n, "limits", "transfer_timeout_ms", &l.transfer_timeout_ms, 1, kDay));
  KVD_RETURN_IF_ERROR(GetInt(n, "limits", "max_sessions", &l.max_sessions, 1, 1 << 20));
  KVD_RETURN_IF_ERROR(
      GetInt(n, "limits", "max_inflight_per_session", &l.max_inflight_per_session, 1, 1 << 16));
  KVD_RETURN_IF_ERROR(GetInt(n, "limits", "max_lease_ttl_ms", &l.max_lease_ttl_ms, 1, kDay));
  KVD_RETURN_IF_ERROR(
      GetInt(n, "limits", "max_leases_per_session", &l.max_leases_per_session, 1, 1 << 24));
  KVD_RETURN_IF_ERROR(GetInt(n, "limits", "max_chain_chunks", &l.max_chain_chunks, 1, 1 << 24));
  KVD_RETURN_IF_ERROR(
      GetInt(n, "limits", "handshake_timeout_ms", &l.handshake_timeout_ms, 1, kDay));
  KVD_RETURN_IF_ERROR(GetInt(n, "limits", "frame_timeout_ms", &l.frame_timeout_ms, 1, kDay));
  KVD_RETURN_IF_ERROR(
      GetInt(n, "limits", "max_sessions_per_peer", &l.max_sessions_per_peer, 1, 1 << 20));
  KVD_RETURN_IF_ERROR(
      GetInt(n, "limits", "admin_reserve_sessions", &l.admin_reserve_sessions, 0, 1 << 16));
  KVD_RETURN_IF_ERROR(
      GetBytes(n, "limits", "max_frame_bytes_before_hello", &l.max_frame_bytes_before_hello));
  KVD_RETURN_IF_ERROR(
      GetBytes(n, "limits", "frame_buffer_budget_bytes", &l.frame_buffer_budget_bytes));
  KVD_RETURN_IF_ERROR(GetDouble(n, "limits", "unauthenticated_share", &l.unauthenticated_share));
  KVD_RETURN_IF_ERROR(
      GetInt(n, "limits", "unauthenticated_grace_ms", &l.unauthenticated_grace_ms, 0, kDay));
  KVD_RETURN_IF_ERROR(GetInt(n, "limits", "idle_timeout_ms", &l.idle_timeout_ms, 0, kDay));
  return Status::Ok();
}

Status BindDocument(const YAML::Node& root, DaemonConfig* c) {
  if (root.IsNull() || !root.IsDefined()) return Status::Ok();  // an empty file: all defaults
  KVD_RETURN_IF_ERROR(CheckMap(
      root, "",
      {"node", "listen", "metrics", "transport", "chunk_tokens", "hash_seed", "models", "tiers",
       "limits", "auth", "quotas", "state_dir", "protocol", "cluster", "kv_events"}));
  KVD_RETURN_IF_ERROR(GetString(root, "", "state_dir", &c->state_dir));
  KVD_RETURN_IF_ERROR(GetString(root, "", "node", &c->node_name));
  if (YAML::Node n = root["listen"]; n.IsDefined()) {
    KVD_RETURN_IF_ERROR(CheckMap(n, "listen", {"tcp", "unix"}));
    KVD_RETURN_IF_ERROR(GetString(n, "listen", "tcp", &c->listen.tcp));
    KVD_RETURN_IF_ERROR(GetString(n, "listen", "unix", &c->listen.unix_path));
  }
  if (YAML::Node n = root["metrics"]; n.IsDefined()) {
    KVD_RETURN_IF_ERROR(CheckMap(n, "metrics", {"listen"}));
    KVD_RETURN_IF_ERROR(GetString(n, "metrics", "listen", &c->metrics.listen));
  }
  if (YAML::Node n = root["transport"]; n.IsDefined()) {
    KVD_RETURN_IF_ERROR(BindTransport(n, &c->transport));
  }
  KVD_RETURN_IF_ERROR(GetInt(root, "", "chunk_tokens", &c->chunk_tokens, 1, 1 << 20));
  KVD_RETURN_IF_ERROR(GetString(root, "", "hash_seed", &c->hash_seed));
  if (YAML::Node n = root["models"]; n.IsDefined()) {
    KVD_RETURN_IF_ERROR(BindModels(n, &c->models));
  }
  if (YAML::Node n = root["tiers"]; n.IsDefined()) {
    KVD_RETURN_IF_ERROR(BindTiers(n, c));
  }
  if (YAML::Node n = root["auth"]; n.IsDefined()) {
    KVD_RETURN_IF_ERROR(BindAuth(n, c));
  }
  if (YAML::Node n = root["cluster"]; n.IsDefined() && !n.IsNull()) {
    cluster::MembershipOptions cluster;
    KVD_RETURN_IF_ERROR(BindCluster(n, &cluster, &c->peer_fetch));
    c->cluster = std::move(cluster);
  }
  if (YAML::Node n = root["kv_events"]; n.IsDefined() && !n.IsNull()) {
    KvEventsOptions kv_events;
    KVD_RETURN_IF_ERROR(BindKvEvents(n, &kv_events));
    c->kv_events = std::move(kv_events);
  }
  if (YAML::Node n = root["quotas"]; n.IsDefined() && !n.IsNull()) {
    KVD_RETURN_IF_ERROR(BindQuotas(n, &c->quotas));
  }
  if (YAML::Node n = root["protocol"]; n.IsDefined()) {
    KVD_RETURN_IF_ERROR(BindProtocol(n, c));
  }
  if (YAML::Node n = root["limits"]; n.IsDefined()) {
    KVD_RETURN_IF_ERROR(BindLimits(n, c));
  }
  return Status::Ok();
}

}  // namespace

// yaml-cpp keeps the first of two equal keys silently: refuse any map with a key twice.
Status CheckNoDuplicateKeys(const YAML::Node& node, const std::string& path) {
  if (node.IsMap()) {
    std::set<std::string> seen;
    for (const auto& kv : node) {
      const std::string key = kv.first.Scalar();
      const std::string here = path.empty() ? key : path + "." + key;
      if (!seen.insert(key).second) {
        return Status::InvalidArgument(here + ": duplicate key (line " +
                                       std::to_string(kv.first.Mark().line + 1) +
                                       "); each key may appear once");
      }
      KVD_RETURN_IF_ERROR(CheckNoDuplicateKeys(kv.second, here));
    }
  } else if (node.IsSequence()) {
    for (size_t i = 0; i < node.size(); ++i) {
      KVD_RETURN_IF_ERROR(CheckNoDuplicateKeys(node[i], path + "[" + std::to_string(i) + "]"));
    }
  }
  return Status::Ok();
}

namespace {

// Parser events are not needed: only how many documents the text holds.
class DocumentCounter : public YAML::EventHandler {
 public:
  void OnDocumentStart(const YAML::Mark&) override {}
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t,
                const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
};

// Documents in `yaml`, counted up to 2. Not YAML::LoadAll: yaml-cpp 0.7's LoadAll never returns
// on some malformed text (",iB": the parser yields empty documents without consuming the stray
// ','), growing its result until memory runs out.
int CountDocumentsUpTo2(const std::string& yaml) {
  std::istringstream in(yaml);
  YAML::Parser parser(in);
  DocumentCounter counter;
  int documents = 0;
  while (documents < 2 && parser.HandleNextDocument(counter)) ++documents;
  return documents;
}

}  // namespace

// The built-in models are the `models` of the embedded default (deploy/configs/default.yaml,
// compiled in verbatim): written once, there. Parsed on first use; the embedded default is
// checked by the tests, so a failure here is a broken build and stops the process.
std::vector<ModelConfig> DaemonConfig::BuiltinModels() {
  static const std::vector<ModelConfig> models = [] {
    std::vector<ModelConfig> parsed;
    Status status;
    try {
      YAML::Node root = YAML::Load(std::string(EmbeddedDefaultConfigYaml()));
      status = BindModels(root["models"], &parsed);
    } catch (const std::exception& e) {
      status = Status::Internal(std::string("YAML error: ") + e.what());
    }
    if (!status.ok()) {
      KVD_LOG(FATAL) << "the embedded default config's models do not parse: " << status;
    }
    return parsed;
  }();
  return models;
}

StatusOr<DaemonConfig> ParseConfigYaml(std::string_view yaml, std::string_view source) {
  DaemonConfig config;
  Status status;
  try {
    const std::string text(yaml);
    if (CountDocumentsUpTo2(text) > 1) {
      status = Status::InvalidArgument(
          "the file holds more than one YAML document (a second \"---\", or text the YAML "
          "parser reads as one, such as a stray ','); a topology is one");
    } else {
      YAML::Node root = YAML::Load(text);
      status = CheckNoDuplicateKeys(root, "");
      if (status.ok()) status = BindDocument(root, &config);
    }
  } catch (const YAML::Exception& e) {
    std::ostringstream os;
    os << "YAML error at line " << e.mark.line + 1 << ", column " << e.mark.column + 1 << ": "
       << e.msg;
    status = Status::InvalidArgument(os.str());
  } catch (const std::exception& e) {
    status = Status::InvalidArgument(std::string("YAML error: ") + e.what());
  }
  if (status.ok()) status = config.Validate();
  if (!status.ok()) return status.WithContext(source);
  return config;
}

StatusOr<DaemonConfig> LoadConfigFile(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return Status::InvalidArgument("config file \"" + path +
                                   "\" is a directory; give the topology YAML file");
  }
  std::ifstream in(path);
  if (!in) return Status::NotFound("cannot read config file \"" + path + "\"");
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseConfigYaml(ss.str(), path);
}

}  // namespace kvd::daemon
