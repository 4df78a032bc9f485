// `tiers:` of the topology YAML: the host tier, the optional GPU and disk tiers, and placement
// between them.
#include <chrono>
#include <utility>

#include "config_yaml_reader.h"

namespace kvd::daemon::config_yaml {
namespace {

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

}  // namespace

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

}  // namespace kvd::daemon::config_yaml
