#include "cluster_view.h"

#include <chrono>
#include <nlohmann/json.hpp>

#include "kvd/cluster/etcd_client.h"
#include "kvd/cluster/membership.h"
#include "util.h"

namespace kvd::tools {
namespace {

using Json = nlohmann::json;

struct Row {
  std::string key_node;  // the node id in the key
  StatusOr<cluster::MemberRecord> record = Status::NotFound("");
  cluster::LeaseInfo lease;
  std::string health;  // "up", or "refused: why"
};

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

Json RowJson(const Row& row, int64_t now_ms) {
  Json j{{"node", row.key_node},
         {"health", row.health},
         {"lease", row.lease.id},
         {"lease_ttl_s", row.lease.ttl_s},
         {"lease_granted_ttl_s", row.lease.granted_ttl_s}};
  if (!row.record.ok()) return j;
  const cluster::MemberRecord& r = *row.record;
  // Tiers and models as the record encodes them in etcd (MemberRecord::ToJson).
  const Json record = Json::parse(r.ToJson());
  j["control"] = r.control_address;
  j["version"] = r.version;
  j["registered_unix_ms"] = r.registered_unix_ms;
  j["registered_age_ms"] = now_ms - r.registered_unix_ms;
  j["tiers"] = record.at("tiers");
  j["models"] = record.at("models");
  return j;
}

std::vector<std::string> RowCells(const Row& row, int64_t now_ms) {
  std::vector<std::string> cells = {
      row.key_node,
      "",
      row.health,
      std::to_string(row.lease.ttl_s) + "s/" + std::to_string(row.lease.granted_ttl_s) + "s",
      "",
      "",
      ""};
  if (!row.record.ok()) return cells;
  const cluster::MemberRecord& r = *row.record;
  cells[1] = r.control_address.empty() ? "-" : r.control_address;
  cells[4] =
      HumanDuration(static_cast<uint64_t>(std::max<int64_t>(0, now_ms - r.registered_unix_ms)));
  std::string tiers, models;
  for (const auto& t : r.tiers) {
    tiers += (tiers.empty() ? "" : " ") + t.name + " " + HumanBytes(t.used_bytes) + "/" +
             HumanBytes(t.capacity_bytes);
  }
  for (const auto& m : r.models) models += (models.empty() ? "" : ",") + m.name;
  cells[5] = tiers;
  cells[6] = models;
  return cells;
}

}  // namespace

int ShowCluster(const ClusterViewOptions& options, std::ostream& out, std::ostream& err) {
  cluster::MembershipOptions membership;
  membership.etcd = options.etcd;
  membership.name = options.name;
  if (Status s = membership.Validate(); !s.ok()) {
    err << "kvdctl cluster: " << s.message() << "\n";
    return 2;
  }
  const std::chrono::milliseconds timeout(options.timeout_ms);
  cluster::EtcdClient etcd({options.etcd, timeout, timeout});
  const std::string prefix = membership.MembersPrefix();
  auto range = etcd.RangePrefix(prefix);
  if (!range.ok()) {
    if (options.json) {
      out << Json{{"cluster", options.name},
                  {"reachable", false},
                  {"error", range.status().ToString()}}
                 .dump()
          << "\n";
    } else {
      err << "kvdctl cluster: " << range.status() << "\n";
    }
    return 1;
  }
  const uint64_t token = cluster::TokenDigest(options.token);
  std::vector<Row> rows;
  for (const cluster::KeyValue& kv : range->kvs) {
    Row row;
    row.key_node = kv.key.substr(prefix.size());
    row.record = cluster::MemberRecord::FromJson(kv.value);
    row.lease.id = kv.lease;
    if (kv.lease != 0) {
      auto ttl = etcd.LeaseTimeToLive(kv.lease);
      if (ttl.ok()) row.lease = *ttl;
    }
    if (!row.record.ok()) {
      row.health = "refused: " + row.record.status().message();
    } else if (row.record->token_digest != token) {
      row.health = "refused: cluster token differs";
    } else if (kv.lease == 0) {
      row.health = "no lease";
    } else {
      row.health = row.lease.ttl_s > 0 ? "up" : "expiring";
    }
    rows.push_back(std::move(row));
  }
  const int64_t now_ms = NowUnixMs();
  if (options.json) {
    Json members = Json::array();
    for (const Row& row : rows) members.push_back(RowJson(row, now_ms));
    out << Json{{"cluster", options.name},
                {"reachable", true},
                {"revision", range->revision},
                {"members", members}}
               .dump()
        << "\n";
    return 0;
  }
  out << "cluster " << options.name << ": " << rows.size() << " node(s) registered in etcd\n";
  std::vector<std::vector<std::string>> cells;
  for (const Row& row : rows) cells.push_back(RowCells(row, now_ms));
  PrintTable(
      out,
      {"NODE", "CONTROL", "HEALTH", "LEASE LEFT", "REGISTERED FOR", "TIERS USED/CAP", "MODELS"},
      cells);
  return 0;
}

}  // namespace kvd::tools
