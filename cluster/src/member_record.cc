// MembershipOptions and MemberRecord: validation and the record's JSON. nlohmann's exceptions
// stay in this file.
#include <nlohmann/json.hpp>

#include "base64.h"
#include "kvd/cluster/etcd_client.h"
#include "kvd/cluster/membership.h"
#include "kvd/common/hash.h"
#include "kvd/common/hex.h"

namespace kvd::cluster {
namespace {

using Json = nlohmann::json;

bool IsIdChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

Status CheckId(const char* key, const std::string& value) {
  if (value.empty()) return Status::InvalidArgument(std::string(key) + ": required");
  for (char c : value) {
    if (!IsIdChar(c)) {
      return Status::InvalidArgument(std::string(key) + ": \"" + value +
                                     "\" may hold only letters, digits, '.', '_' and '-'");
    }
  }
  return Status::Ok();
}

// Digests travel as 16 hex digits (Hex64; JSON numbers lose 64-bit integers in many readers).
bool ParseHex64(const std::string& text, uint64_t* out) {
  if (text.empty() || text.size() > 16) return false;
  char* end = nullptr;
  *out = std::strtoull(text.c_str(), &end, 16);
  return end == text.c_str() + text.size();
}

}  // namespace

Status MembershipOptions::Validate() const {
  if (etcd.empty()) {
    return Status::InvalidArgument("cluster.etcd: required, a list of etcd endpoints host:port");
  }
  EtcdClientOptions client;
  client.endpoints = etcd;
  if (Status s = client.Validate(); !s.ok()) {
    return Status::InvalidArgument("cluster.etcd: " + s.message());
  }
  KVD_RETURN_IF_ERROR(CheckId("cluster.name", name));
  if (!node.empty()) KVD_RETURN_IF_ERROR(CheckId("cluster.node", node));
  if (lease_ttl_s < 2 || lease_ttl_s > 3600) {
    return Status::InvalidArgument("cluster.lease_ttl_s: \"" + std::to_string(lease_ttl_s) +
                                   "\" is outside [2, 3600]");
  }
  if (etcd_timeout.count() <= 0 || retry_interval.count() <= 0 || refresh_interval.count() <= 0) {
    return Status::InvalidArgument("cluster: timeouts and intervals must be > 0 ms");
  }
  return Status::Ok();
}

std::string MembershipOptions::MembersPrefix() const { return "/kvd/" + name + "/members/"; }

uint64_t TokenDigest(std::string_view token) {
  if (token.empty()) return 0;
  return Digest64("kvd-cluster-token\n" + std::string(token));
}

std::string MemberRecord::ToJson() const {
  Json tiers_json = Json::array();
  for (const Tier& t : tiers) {
    tiers_json.push_back(
        {{"name", t.name}, {"capacity_bytes", t.capacity_bytes}, {"used_bytes", t.used_bytes}});
  }
  Json models_json = Json::array();
  for (const Model& m : models) {
    models_json.push_back({{"name", m.name}, {"layout_digest", Hex64(m.layout_digest)}});
  }
  Json j{{"node", node},
         {"control", control_address},
         {"transport", Base64Encode(transport_address)},
         {"tiers", tiers_json},
         {"models", models_json},
         {"version", version},
         {"token_digest", token_digest == 0 ? std::string() : Hex64(token_digest)},
         {"registered_unix_ms", registered_unix_ms}};
  return j.dump();
}

StatusOr<MemberRecord> MemberRecord::FromJson(std::string_view json) {
  Json j = Json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::InvalidArgument("member record: not a JSON object");
  }
  MemberRecord r;
  try {
    r.node = j.at("node").get<std::string>();
    r.control_address = j.value("control", std::string());
    KVD_ASSIGN_OR_RETURN(r.transport_address, Base64Decode(j.value("transport", std::string())));
    for (const Json& t : j.value("tiers", Json::array())) {
      r.tiers.push_back({t.at("name").get<std::string>(), t.value("capacity_bytes", uint64_t{0}),
                         t.value("used_bytes", uint64_t{0})});
    }
    for (const Json& m : j.value("models", Json::array())) {
      Model model{m.at("name").get<std::string>(), 0};
      if (!ParseHex64(m.value("layout_digest", std::string()), &model.layout_digest)) {
        return Status::InvalidArgument("member record: model " + model.name +
                                       ": layout_digest is not 16 hex digits");
      }
      r.models.push_back(std::move(model));
    }
    r.version = j.value("version", std::string());
    const std::string digest = j.value("token_digest", std::string());
    if (!digest.empty() && !ParseHex64(digest, &r.token_digest)) {
      return Status::InvalidArgument("member record: token_digest is not 16 hex digits");
    }
    r.registered_unix_ms = j.value("registered_unix_ms", int64_t{0});
  } catch (const Json::exception& e) {
    return Status::InvalidArgument(std::string("member record: ") + e.what());
  }
  return r;
}

}  // namespace kvd::cluster
