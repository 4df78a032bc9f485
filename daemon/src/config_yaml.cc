// Binds the topology YAML to DaemonConfig: the document walker (which section goes where), the
// checks on the text as a whole (one document, no key twice) and the file's loading. The sections
// are bound in config_yaml_<section>.cc. yaml-cpp throws; nothing thrown leaves these files.
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <string>

#include "config_yaml_reader.h"
#include "kvd/common/logging.h"
#include "kvd/daemon/config.h"
#include "kvd/transport/registry.h"

namespace kvd::daemon {
namespace config_yaml {
namespace {

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
}  // namespace config_yaml

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
      status = config_yaml::BindModels(root["models"], &parsed);
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
      if (status.ok()) status = config_yaml::BindDocument(root, &config);
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
