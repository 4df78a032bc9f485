// The YAML key readers and the section binders of the topology YAML (config_yaml*.cc). Every
// reader takes the map, the key's dotted path (for errors) and the key; an absent or null key
// leaves `out` as it is. yaml-cpp throws; ParseConfigYaml catches. Private to daemon/.
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvd/common/scalar_text.h"
#include "kvd/daemon/config.h"

namespace kvd::daemon::config_yaml {

// `path.key`, or `key` at the document's top.
std::string Join(const std::string& path, const std::string& key);
// INVALID_ARGUMENT `key: "value" what`.
Status Bad(const std::string& key, const std::string& value, const std::string& what);

// Requires `node` to be a map whose keys are all in `allowed`.
Status CheckMap(const YAML::Node& node, const std::string& path,
                std::span<const char* const> allowed);
Status CheckMap(const YAML::Node& node, const std::string& path,
                std::initializer_list<const char*> allowed);

// Reads a scalar as text; false if the key is absent.
StatusOr<bool> Scalar(const YAML::Node& map, const std::string& path, const char* key,
                      std::string* out);

Status GetString(const YAML::Node& map, const std::string& path, const char* key, std::string* out);
// A finite number.
Status GetDouble(const YAML::Node& map, const std::string& path, const char* key, double* out);
Status GetBool(const YAML::Node& map, const std::string& path, const char* key, bool* out);

// An integer in [min_value, max_value].
template <typename Int>
Status GetInt(const YAML::Node& map, const std::string& path, const char* key, Int* out,
              int64_t min_value, int64_t max_value) {
  std::string text;
  KVD_ASSIGN_OR_RETURN(bool present, Scalar(map, path, key, &text));
  if (!present) return Status::Ok();
  return ParseIntText(Join(path, key), text, min_value, max_value, out);
}

// A byte size such as "64MiB" (ParseByteSize) that fits `Int`.
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

// ---- sections (each binds one key of the document; config_yaml_<section>.cc) ----

// `models:` (config_yaml_models.cc): each model's layout and compression policy.
Status BindModels(const YAML::Node& node, std::vector<ModelConfig>* models);
// `tiers:` (config_yaml_tiers.cc): the host tier, the optional GPU and disk tiers, placement.
Status BindTiers(const YAML::Node& n, DaemonConfig* c);
// `cluster:` and `kv_events:` (config_yaml_cluster.cc).
Status BindCluster(const YAML::Node& n, cluster::MembershipOptions* o, PeerFetchOptions* peer);
Status BindKvEvents(const YAML::Node& n, KvEventsOptions* o);
// `auth:`, `quotas:`, `protocol:`, `limits:` (config_yaml_limits.cc).
Status BindAuth(const YAML::Node& n, DaemonConfig* c);
Status BindQuotas(const YAML::Node& n, QuotaOptions* q);
Status BindProtocol(const YAML::Node& n, DaemonConfig* c);
Status BindLimits(const YAML::Node& n, DaemonConfig* c);

}  // namespace kvd::daemon::config_yaml
