// Defaults and validation of the daemon config (YAML binding in config_yaml*.cc).
#include "kvd/daemon/config.h"

#include <pwd.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>

#include "kvd/common/utf8.h"
#include "listen_address.h"
#include "stage_policy.h"

namespace kvd::daemon {

std::string ListenOptions::DefaultUnixPath() {
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  struct stat st {};
  if (xdg != nullptr && xdg[0] != '\0' && ::stat(xdg, &st) == 0 && S_ISDIR(st.st_mode)) {
    return std::string(xdg) + "/kvd.sock";
  }
  std::string user;
  if (const char* u = std::getenv("USER"); u != nullptr && u[0] != '\0') {
    user = u;
  } else if (struct passwd* pw = ::getpwuid(::getuid()); pw != nullptr) {
    user = pw->pw_name;
  } else {
    user = std::to_string(::getuid());
  }
  return "/tmp/kvd-" + user + ".sock";
}

std::string ListenOptions::ResolvedUnixPath() const {
  return unix_path == "auto" ? DefaultUnixPath() : unix_path;
}

Status ListenOptions::Validate() const {
  if (tcp.empty() && unix_path.empty()) {
    return Status::InvalidArgument("listen: both tcp and unix are disabled; enable at least one");
  }
  if (!tcp.empty()) {
    auto parsed = ParseHostPort(tcp);
    if (!parsed.ok()) return parsed.status().WithContext("listen.tcp");
  }
  if (!unix_path.empty()) {
    std::string path = ResolvedUnixPath();
    if (path.size() >= sizeof(sockaddr_un{}.sun_path)) {
      return Status::InvalidArgument("listen.unix: path \"" + path + "\" is " +
                                     std::to_string(path.size()) + " bytes, the limit is " +
                                     std::to_string(sizeof(sockaddr_un{}.sun_path) - 1));
    }
  }
  return Status::Ok();
}

Status MetricsOptions::Validate() const {
  if (listen.empty()) return Status::Ok();
  auto parsed = ParseHostPort(listen);
  return parsed.ok() ? Status::Ok() : parsed.status().WithContext("metrics.listen");
}

Status CheckUtf8(const std::string& key, std::string_view value) {
  const size_t bad = FirstInvalidUtf8(value);
  if (bad == std::string_view::npos) return Status::Ok();
  char byte[8];
  std::snprintf(byte, sizeof byte, "0x%02x", static_cast<unsigned char>(value[bad]));
  return Status::InvalidArgument(key + ": not valid UTF-8 (byte " + byte + " at offset " +
                                 std::to_string(bad) + " of " + std::to_string(value.size()) +
                                 "); kvd sends it to clients as text");
}

Status LimitsOptions::Validate() const {
  if (max_frame_bytes < 4096 || max_frame_bytes > (256u << 20)) {
    return Status::InvalidArgument("limits.max_frame_bytes: " + std::to_string(max_frame_bytes) +
                                   " is outside [4096, 268435456]");
  }
  if (max_chunk_bytes == 0) return Status::InvalidArgument("limits.max_chunk_bytes: must be > 0");
  auto positive = [](const char* key, int64_t v) -> Status {
    if (v <= 0) {
      return Status::InvalidArgument(std::string("limits.") + key + ": " + std::to_string(v) +
                                     " must be > 0");
    }
    return Status::Ok();
  };
  KVD_RETURN_IF_ERROR(positive("reservation_ttl_ms", reservation_ttl_ms));
  KVD_RETURN_IF_ERROR(positive("lease_ttl_ms", lease_ttl_ms));
  KVD_RETURN_IF_ERROR(positive("transfer_timeout_ms", transfer_timeout_ms));
  KVD_RETURN_IF_ERROR(positive("max_sessions", max_sessions));
  KVD_RETURN_IF_ERROR(positive("max_inflight_per_session", max_inflight_per_session));
  KVD_RETURN_IF_ERROR(positive("max_leases_per_session", max_leases_per_session));
  KVD_RETURN_IF_ERROR(positive("max_chain_chunks", max_chain_chunks));
  KVD_RETURN_IF_ERROR(positive("handshake_timeout_ms", handshake_timeout_ms));
  KVD_RETURN_IF_ERROR(positive("frame_timeout_ms", frame_timeout_ms));
  KVD_RETURN_IF_ERROR(positive("max_sessions_per_peer", max_sessions_per_peer));
  if (max_lease_ttl_ms < lease_ttl_ms) {
    return Status::InvalidArgument("limits.max_lease_ttl_ms: " + std::to_string(max_lease_ttl_ms) +
                                   " is below limits.lease_ttl_ms " + std::to_string(lease_ttl_ms));
  }
  if (admin_reserve_sessions < 0) {
    return Status::InvalidArgument("limits.admin_reserve_sessions: must be >= 0");
  }
  if (max_frame_bytes_before_hello < 1024 || max_frame_bytes_before_hello > (256u << 20)) {
    return Status::InvalidArgument(
        "limits.max_frame_bytes_before_hello: " + std::to_string(max_frame_bytes_before_hello) +
        " is outside [1024, 268435456]");
  }
  if (frame_buffer_budget_bytes < uint64_t{max_frame_bytes} + 12) {
    return Status::InvalidArgument(
        "limits.frame_buffer_budget_bytes: " + std::to_string(frame_buffer_budget_bytes) +
        " cannot hold one frame of limits.max_frame_bytes " + std::to_string(max_frame_bytes) +
        " (+ its 12-byte header)");
  }
  if (!(unauthenticated_share > 0 && unauthenticated_share <= 1)) {
    return Status::InvalidArgument("limits.unauthenticated_share: " +
                                   std::to_string(unauthenticated_share) + " is outside (0, 1]");
  }
  if (idle_timeout_ms < 0) {
    return Status::InvalidArgument("limits.idle_timeout_ms: " + std::to_string(idle_timeout_ms) +
                                   " must be >= 0 (0 = never)");
  }
  return Status::Ok();
}

transport::TransportOptions DaemonConfig::DefaultTransportOptions() {
  transport::TransportOptions t;
  t.backend = "ucx";
  transport::UcxOptions& ucx = transport::MutableBackendOptions<transport::UcxOptions>(&t);
  ucx.ucx_tls = "sm,tcp";
  ucx.net_devices = "lo";
  return t;
}

storage::HostTierOptions DaemonConfig::DefaultHostTierOptions() {
  storage::HostTierOptions h;
  h.capacity_bytes = 1ull << 30;
  h.segment_bytes = 64ull << 20;
  return h;
}

// DaemonConfig::BuiltinModels() is in config_yaml.cc: the embedded default's `models`.

std::string DaemonConfig::ResolvedStateDir() const {
  if (!state_dir.empty()) return state_dir;
  return config_dir;
}

const ModelConfig* DaemonConfig::FindModel(std::string_view name) const {
  for (const auto& m : models) {
    if (m.name == name) return &m;
  }
  return nullptr;
}

std::optional<cluster::MembershipOptions> DaemonConfig::ResolvedCluster() const {
  if (!cluster) return std::nullopt;
  cluster::MembershipOptions resolved = *cluster;
  if (resolved.node.empty()) resolved.node = node_name;
  return resolved;
}

namespace {

// models[i]: a unique non-empty name, its layout, its compression policy, a full chunk within
// limits.max_chunk_bytes.
Status ValidateModel(const DaemonConfig& c, size_t i, std::set<std::string>* names) {
  const ModelConfig& m = c.models[i];
  std::string key = "models[" + std::to_string(i) + "]";
  if (m.name.empty()) return Status::InvalidArgument(key + ".name: must not be empty");
  KVD_RETURN_IF_ERROR(CheckUtf8(key + ".name", m.name));
  if (!names->insert(m.name).second) {
    return Status::InvalidArgument(key + ".name: \"" + m.name + "\" is registered twice");
  }
  KVD_RETURN_IF_ERROR(m.layout.Validate().WithContext(key + " (" + m.name + ").layout"));
  if (m.compression) {
    KVD_RETURN_IF_ERROR(m.compression->Validate(key + ".compression", c.chunk_tokens));
    const int d = m.layout.head_dim;
    if (m.compression->Quantizes() && PolicyKeyText(*m.compression, "quant_rotate") == "hadamard" &&
        (d & (d - 1)) != 0) {
      return Status::InvalidArgument(key +
                                     ".compression.quant_rotate: \"hadamard\" needs a "
                                     "power-of-two head_dim; " +
                                     m.name + " has " + std::to_string(d));
    }
  }
  uint64_t chunk = m.layout.ChunkBytes(c.chunk_tokens);
  if (chunk > c.limits.max_chunk_bytes) {
    return Status::InvalidArgument(key + " (" + m.name + "): a full chunk is " +
                                   std::to_string(chunk) + " bytes, over limits.max_chunk_bytes " +
                                   std::to_string(c.limits.max_chunk_bytes));
  }
  return Status::Ok();
}

// tiers.host: its options, the shared-memory path transport none needs, segments that hold a
// full chunk of every model, a capacity.
Status ValidateHostTier(const DaemonConfig& c) {
  const storage::HostTierOptions& host_tier = c.host_tier;
  KVD_RETURN_IF_ERROR(host_tier.Validate().WithContext("tiers.host"));
  const bool segmented = c.host_shared_memory && host_tier.segment_bytes < host_tier.capacity_bytes;
  if (c.transport.backend == "none" && !segmented) {
    return Status::InvalidArgument(
        "transport.backend: none serves engines only on the shared-memory path, which is off "
        "here: set tiers.host.shared_memory true and tiers.host.segment below "
        "tiers.host.capacity");
  }
  if (segmented) {
    if (host_tier.segment_bytes == 0 || host_tier.segment_bytes % 4096 != 0) {
      return Status::InvalidArgument(
          "tiers.host.segment: " + std::to_string(host_tier.segment_bytes) +
          " must be a non-zero multiple of the page size (4096)");
    }
    for (const auto& m : c.models) {
      const uint64_t chunk = m.layout.ChunkBytes(c.chunk_tokens);
      if (chunk > host_tier.segment_bytes) {
        return Status::InvalidArgument(
            "tiers.host.segment: " + std::to_string(host_tier.segment_bytes) +
            " bytes is smaller than a full chunk of model " + m.name + " (" +
            std::to_string(chunk) + " bytes); raise it or set tiers.host.shared_memory: false");
      }
    }
  }
  if (host_tier.capacity_bytes == 0) {
    return Status::InvalidArgument("tiers.host.capacity: must be > 0");
  }
  return Status::Ok();
}

}  // namespace

Status DaemonConfig::Validate() const {
  if (node_name.empty()) return Status::InvalidArgument("node: must not be empty");
  // Strings kvd sends to clients (Cap'n Proto Text, JSON) must be text.
  KVD_RETURN_IF_ERROR(CheckUtf8("node", node_name));
  KVD_RETURN_IF_ERROR(CheckUtf8("hash_seed", hash_seed));
  KVD_RETURN_IF_ERROR(listen.Validate());
  KVD_RETURN_IF_ERROR(metrics.Validate());
  KVD_RETURN_IF_ERROR(transport.Validate().WithContext("transport"));
  if (chunk_tokens < 1 || chunk_tokens > (1 << 20)) {
    return Status::InvalidArgument("chunk_tokens: " + std::to_string(chunk_tokens) +
                                   " is outside [1, 1048576]");
  }
  if (hash_seed.empty()) return Status::InvalidArgument("hash_seed: must not be empty");
  if (cluster) KVD_RETURN_IF_ERROR(ResolvedCluster()->Validate());
  if (kv_events) KVD_RETURN_IF_ERROR(kv_events->Validate());
  if (models.empty()) return Status::InvalidArgument("models: at least one model is required");
  std::set<std::string> names;
  for (size_t i = 0; i < models.size(); ++i) KVD_RETURN_IF_ERROR(ValidateModel(*this, i, &names));
  KVD_RETURN_IF_ERROR(ValidateHostTier(*this));
  if (disk_tier) KVD_RETURN_IF_ERROR(disk_tier->Validate().WithContext("tiers.disk"));
  if (gpu_tier) KVD_RETURN_IF_ERROR(gpu_tier->Validate().WithContext("tiers.gpu"));
  if (gpu_device < 0) {
    return Status::InvalidArgument("tiers.gpu.device: must be >= 0, got " +
                                   std::to_string(gpu_device));
  }
  KVD_RETURN_IF_ERROR(placement.Validate().WithContext("tiers.placement"));
  KVD_RETURN_IF_ERROR(limits.Validate());
  return Status::Ok();
}

StatusOr<uint64_t> ParseByteSize(std::string_view text) {
  std::string s;
  for (char c : text) {
    if (!std::isspace(static_cast<unsigned char>(c))) s.push_back(c);
  }
  auto bad = [&]() {
    return Status::InvalidArgument("\"" + std::string(text) +
                                   "\" is not a byte size (e.g. 4096, 512MiB, 1GiB, 2GB)");
  };
  if (s.empty()) return bad();
  size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  if (i == 0) return bad();
  std::string number = s.substr(0, i);
  std::string unit;
  for (char c : s.substr(i)) unit.push_back(static_cast<char>(std::tolower(c)));
  if (!unit.empty() && unit.back() == 'b') unit.pop_back();
  double mult;
  if (unit.empty()) {
    mult = 1;
  } else if (unit == "k" || unit == "ki") {
    mult = unit.size() == 2 ? 1024.0 : 1e3;
  } else if (unit == "m" || unit == "mi") {
    mult = unit.size() == 2 ? 1048576.0 : 1e6;
  } else if (unit == "g" || unit == "gi") {
    mult = unit.size() == 2 ? 1073741824.0 : 1e9;
  } else if (unit == "t" || unit == "ti") {
    mult = unit.size() == 2 ? 1099511627776.0 : 1e12;
  } else {
    return bad();
  }
  char* end = nullptr;
  double v = std::strtod(number.c_str(), &end);
  if (end != number.c_str() + number.size() || !std::isfinite(v) || v < 0) return bad();
  double bytes = v * mult;
  if (bytes > 1.8e19 || bytes != std::floor(bytes)) return bad();
  return static_cast<uint64_t>(bytes);
}

std::string FormatByteSize(uint64_t bytes) {
  static const char* kUnits[] = {"TiB", "GiB", "MiB", "KiB"};
  static const int kShifts[] = {40, 30, 20, 10};
  for (int i = 0; i < 4; ++i) {
    uint64_t unit = uint64_t{1} << kShifts[i];
    if (bytes != 0 && bytes % unit == 0) return std::to_string(bytes / unit) + kUnits[i];
  }
  return std::to_string(bytes) + "B";
}

}  // namespace kvd::daemon
