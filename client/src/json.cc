#include "kvd/client/json.h"

#include <cstdio>
#include <nlohmann/json.hpp>

namespace kvd::client {
namespace {
using nlohmann::json;

json Groups(const std::vector<GroupStats>& groups) {
  json a = json::array();
  for (const auto& g : groups)
    a.push_back({{"name", g.name}, {"chunks", g.chunks}, {"bytes", g.bytes}});
  return a;
}
// Never throws on invalid UTF-8 from the daemon: bad bytes become U+FFFD.
std::string Dump(const json& j, int indent) {
  return j.dump(indent, ' ', false, json::error_handler_t::replace);
}
}  // namespace

std::string StatsToJson(const Stats& s, int indent) {
  json tiers = json::array();
  for (const auto& t : s.tiers) {
    tiers.push_back({{"name", t.name},
                     {"capacity_bytes", t.capacity_bytes},
                     {"used_bytes", t.used_bytes},
                     {"reserved_bytes", t.reserved_bytes},
                     {"pinned_bytes", t.pinned_bytes},
                     {"chunks", t.chunks},
                     {"evictions", t.evictions},
                     {"hits", t.hits},
                     {"misses", t.misses}});
  }
  json models = json::array();
  for (const auto& m : s.registered_models) {
    models.push_back(
        {{"name", m.name}, {"layout", m.layout.ToString()}, {"chunk_bytes", m.chunk_bytes}});
  }
  json counters = json::object();
  for (const auto& [name, value] : s.counters) counters[name] = value;
  json compression = json::array();
  for (const auto& m : s.compression) {
    json stages = json::array();
    for (const auto& t : m.stages) {
      stages.push_back({{"stage", t.stage}, {"nanos", t.nanos}, {"chunks", t.chunks}});
    }
    json ea = nullptr;
    if (m.ea_min_queries > 0) {
      ea = {{"queries", m.ea_queries},
            {"min_queries", m.ea_min_queries},
            {"state", m.ExpectedAttentionActive() ? "active" : "keydiff-fallback"}};
    }
    compression.push_back({{"model", m.model},
                           {"device", m.device},
                           {"device_reason", m.device_reason},
                           {"stages", stages},
                           {"expected_attention", ea}});
  }
  json j = {{"node", s.node_name},         {"uptime_ms", s.uptime_ms},
            {"sessions", s.sessions},      {"tiers", tiers},
            {"models", Groups(s.models)},  {"namespaces", Groups(s.namespaces)},
            {"registered_models", models}, {"counters", counters},
            {"compression", compression}};
  return Dump(j, indent);
}

std::string ListToJson(const ListResult& l, int indent) {
  json chunks = json::array();
  for (const auto& c : l.chunks) {
    chunks.push_back({{"namespace", c.name_space},
                      {"model", c.model},
                      {"hash", c.hash.ToHex()},
                      {"tokens", c.tokens},
                      {"bytes", c.bytes},
                      {"tier", c.tier},
                      {"age_ms", c.age_ms},
                      {"idle_ms", c.idle_ms},
                      {"leases", c.leases}});
  }
  return Dump(json{{"total", l.total}, {"chunks", chunks}}, indent);
}

std::string EvictToJson(const EvictResult& e, int indent) {
  return Dump(json{{"chunks", e.chunks}, {"bytes", e.bytes}, {"skipped_pinned", e.skipped_pinned}},
              indent);
}

std::string HealthToJson(const Health& h, int indent) {
  json tiers = json::array();
  for (const auto& t : h.tiers)
    tiers.push_back({{"name", t.name}, {"ok", t.ok}, {"detail", t.detail}});
  return Dump(json{{"ok", h.ok},
                   {"degraded", h.degraded},
                   {"status", h.status},
                   {"uptime_ms", h.uptime_ms},
                   {"transport", h.transport},
                   {"tiers", tiers}},
              indent);
}

std::string SessionToJson(const SessionInfo& s, int indent) {
  return Dump(json{{"session_id", s.session_id},
                   {"daemon_version", s.daemon_version},
                   {"node", s.node_name},
                   {"chunk_tokens", s.chunk_tokens},
                   {"max_frame_bytes", s.max_frame_bytes},
                   {"max_chunk_bytes", s.max_chunk_bytes},
                   {"transport", s.transport},
                   {"shared_memory", s.shared_memory},
                   {"read_only", s.read_only},
                   {"codec_id", s.codec_id},
                   {"policy", s.policy},
                   {"window_tokens", s.window_tokens},
                   {"needs_queries", s.needs_queries},
                   {"keeps_positions", s.keeps_positions},
                   {"nccl", s.nccl},
                   {"cluster_lookup", s.cluster_lookup},
                   {"cluster_placement", s.cluster_placement}},
              indent);
}

std::string HoldersToJson(const std::vector<PrefixHolder>& holders, int indent) {
  json out = json::array();
  for (const auto& h : holders) {
    json found_in = json::array();
    for (const auto& t : h.found_in) found_in.push_back({{"tier", t.tier}, {"chunks", t.chunks}});
    out.push_back({{"node", h.node},
                   {"matched_chunks", h.matched_chunks},
                   {"error", h.error},
                   {"found_in", found_in}});
  }
  return Dump(out, indent);
}

std::string CalibrationToJson(const std::vector<CalibrationInfo>& models, int indent) {
  json out = json::array();
  for (const auto& m : models) {
    json r2 = json::array(), routes = json::array();
    uint64_t routing = 0;
    const size_t heads = m.num_kv_heads;
    for (size_t l = 0; heads > 0 && (l + 1) * heads <= m.r2.size(); ++l) {
      json r2_row = json::array(), routes_row = json::array();
      for (size_t h = 0; h < heads; ++h) {
        const size_t i = l * heads + h;
        const bool route = i < m.routes.size() && m.routes[i];
        r2_row.push_back(m.r2[i]);
        routes_row.push_back(route);
        routing += route;
      }
      r2.push_back(std::move(r2_row));
      routes.push_back(std::move(routes_row));
    }
    char version[17] = "";
    if (m.version != 0)
      std::snprintf(version, sizeof version, "%016llx", static_cast<unsigned long long>(m.version));
    out.push_back({{"model", m.model},
                   {"state", m.state},
                   {"tokens_seen", m.tokens_seen},
                   {"tokens_needed", m.tokens_needed},
                   {"version", version},
                   {"codec_id", m.codec_id},
                   {"num_layers", m.num_layers},
                   {"num_kv_heads", m.num_kv_heads},
                   {"r2_threshold", m.r2_threshold},
                   {"r2", r2},
                   {"routes", routes},
                   {"routing_heads", routing}});
  }
  return Dump(json{{"models", out}}, indent);
}

static const char* KvEventKindName(KvEventKind kind) {
  switch (kind) {
    case KvEventKind::kStored:
      return "stored";
    case KvEventKind::kRemoved:
      return "removed";
    case KvEventKind::kDropped:
      return "dropped";
  }
  return "unknown";
}

std::string EventToJson(const KvEvent& e, int indent) {
  if (e.kind == KvEventKind::kDropped) {
    return Dump(json{{"seq", e.sequence}, {"event", "dropped"}, {"dropped", e.dropped}}, indent);
  }
  char digest[17];
  std::snprintf(digest, sizeof digest, "%016llx", static_cast<unsigned long long>(e.layout_digest));
  json j = {{"seq", e.sequence}, {"event", KvEventKindName(e.kind)}};
  if (e.kind == KvEventKind::kRemoved) j["reason"] = e.reason;
  j["tier"] = e.tier;
  j["namespace"] = e.name_space;
  j["model"] = e.model;
  j["codec_id"] = e.codec_id;
  j["layout_digest"] = digest;
  j["hash"] = e.hash.ToHex();
  j["tokens"] = e.tokens;
  j["bytes"] = e.bytes;
  return Dump(j, indent);
}

std::string EventToText(const KvEvent& e) {
  std::string out = std::to_string(e.sequence) + " " + KvEventKindName(e.kind);
  if (e.kind == KvEventKind::kDropped) {
    return out + " " + std::to_string(e.dropped) + " events (queue full; resync with kvdctl ls)";
  }
  if (e.kind == KvEventKind::kRemoved) out += "(" + e.reason + ")";
  return out + " " + e.tier + " " + e.name_space + "/" + e.model +
         " codec=" + std::to_string(e.codec_id) + " " + e.hash.ToHex() +
         " tokens=" + std::to_string(e.tokens) + " bytes=" + std::to_string(e.bytes);
}

std::string StatusToJson(const Status& s, int indent) {
  return Dump(json{{"code", std::string(StatusCodeName(s.code()))}, {"message", s.message()}},
              indent);
}

}  // namespace kvd::client
