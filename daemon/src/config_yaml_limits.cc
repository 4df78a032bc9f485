// What clients may do, from the topology YAML: `auth:`, `quotas:`, `protocol:` and `limits:`.
#include <string>

#include "config_yaml_reader.h"
#include "quotas.h"

namespace kvd::daemon::config_yaml {
namespace {

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

}  // namespace

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

}  // namespace kvd::daemon::config_yaml
