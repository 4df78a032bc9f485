// The YAML key readers (config_yaml_reader.h).
#include "config_yaml_reader.h"

#include <cmath>
#include <cstdlib>

namespace kvd::daemon::config_yaml {
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

}  // namespace kvd::daemon::config_yaml
