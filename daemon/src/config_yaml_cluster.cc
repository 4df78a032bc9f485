// `cluster:` (membership, peer fetch) and `kv_events:` of the topology YAML.
#include <fstream>
#include <sstream>
#include <string>

#include "config_yaml_reader.h"

namespace kvd::daemon::config_yaml {
namespace {

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

}  // namespace

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

}  // namespace kvd::daemon::config_yaml
