// The start-up check of the tiers' capacities against what this machine has
// (DaemonConfig::CheckResources, MachineResources::Probe).
#include <sys/statvfs.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "kvd/daemon/config.h"

namespace kvd::daemon {

namespace {

// Free bytes for an unprivileged writer on the file system holding `path` (0 = unknown).
uint64_t FreeBytes(const std::string& path) {
  struct statvfs st {};
  if (::statvfs(path.c_str(), &st) != 0) return 0;
  return static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
}

// /proc/meminfo MemTotal in bytes (0 = unknown).
uint64_t MemTotal() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  uint64_t kib = 0;
  while (in >> key >> kib >> unit) {
    if (key == "MemTotal:") return kib * 1024;
  }
  return 0;
}

// The memory limit of this process's cgroup (v2 memory.max, else v1 memory.limit_in_bytes);
// 0 = none or unknown.
uint64_t CgroupLimit() {
  std::ifstream cg("/proc/self/cgroup");
  std::string line;
  while (std::getline(cg, line)) {
    // v2: "0::/path"; v1: "N:memory:/path" (or "N:...,memory,...:/path").
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    const std::string path = line.substr(b + 1);
    std::string file;
    if (controllers.empty()) {
      file = "/sys/fs/cgroup" + path + "/memory.max";
    } else if (("," + controllers + ",").find(",memory,") != std::string::npos) {
      file = "/sys/fs/cgroup/memory" + path + "/memory.limit_in_bytes";
    } else {
      continue;
    }
    std::ifstream in(file);
    std::string value;
    if (!(in >> value) || value == "max") continue;
    char* end = nullptr;
    const unsigned long long v = std::strtoull(value.c_str(), &end, 10);
    if (end != value.c_str() && v > 0 && v < (1ull << 62)) return v;
  }
  return 0;
}

// Bytes of the files under `dir` (what the disk tier's database already holds).
uint64_t TreeBytes(const std::string& dir) {
  uint64_t total = 0;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    std::error_code size_ec;
    if (it->is_regular_file(size_ec)) {
      const uint64_t n = it->file_size(size_ec);
      if (!size_ec) total += n;
    }
  }
  return total;
}

// Whether UCX may place a memory allocation of its own in /dev/shm: its shared-memory
// transports are enabled ("sm", "shm", "posix", "mm" or "all" in transport.ucx_tls).
bool UcxSharedMemory(const std::string& tls) {
  std::stringstream ss(tls);
  std::string t;
  while (std::getline(ss, t, ',')) {
    if (t == "sm" || t == "shm" || t == "posix" || t == "mm" || t == "all") return true;
  }
  return tls.empty();  // UCX's default is every transport
}

std::string OverrideHint() {
  return "; lower it, or set tiers.allow_overcommit: true to start anyway (see "
         "docs/reliability.md)";
}

}  // namespace

MachineResources MachineResources::Probe(const DaemonConfig& config) {
  MachineResources m;
  m.memory_bytes = MemTotal();
  m.memory_source = "physical memory (/proc/meminfo MemTotal)";
  if (const uint64_t limit = CgroupLimit();
      limit != 0 && (m.memory_bytes == 0 || limit < m.memory_bytes)) {
    m.memory_bytes = limit;
    m.memory_source = "the memory limit of kvd's cgroup";
  }
  m.dev_shm_free_bytes = FreeBytes("/dev/shm");
  if (config.disk_tier) {
    // The nearest existing directory on the way to the tier's path (it may not exist yet).
    std::filesystem::path p = std::filesystem::absolute(config.disk_tier->path);
    std::error_code ec;
    while (!p.empty() && !std::filesystem::exists(p, ec) && p != p.root_path()) p = p.parent_path();
    m.disk_free_bytes = FreeBytes(p.string());
    if (m.disk_free_bytes != 0) m.disk_free_bytes += TreeBytes(config.disk_tier->path);
  }
  return m;
}

bool DaemonConfig::SharedMemoryArena() const {
  return host_shared_memory && host_tier.segment_bytes != 0 &&
         host_tier.segment_bytes < host_tier.capacity_bytes;
}

Status DaemonConfig::CheckResources(const MachineResources& m) const {
  const uint64_t host = host_tier.capacity_bytes;
  if (m.memory_bytes != 0 && host > m.memory_bytes) {
    return Status::InvalidArgument("tiers.host.capacity: " + FormatByteSize(host) + " (" +
                                   std::to_string(host) + " bytes) is more than " +
                                   m.memory_source + ", " + std::to_string(m.memory_bytes) +
                                   " bytes" + OverrideHint());
  }
  const std::string tls = transport::BackendOptionsOf<transport::UcxOptions>(transport).ucx_tls;
  if (!SharedMemoryArena() && transport.backend == "ucx" && UcxSharedMemory(tls) &&
      m.dev_shm_free_bytes != 0 && host > m.dev_shm_free_bytes) {
    return Status::InvalidArgument(
        "tiers.host.capacity: " + FormatByteSize(host) + " (" + std::to_string(host) +
        " bytes) does not fit in the " + std::to_string(m.dev_shm_free_bytes) +
        " bytes free in /dev/shm, where UCX may place the host tier (the shared-memory path is "
        "off and transport.ucx_tls \"" +
        tls + "\" has shared-memory transports)" + OverrideHint());
  }
  if (disk_tier && m.disk_free_bytes != 0 && disk_tier->capacity_bytes > m.disk_free_bytes) {
    return Status::InvalidArgument(
        "tiers.disk.capacity: " + FormatByteSize(disk_tier->capacity_bytes) + " (" +
        std::to_string(disk_tier->capacity_bytes) + " bytes) is more than the " +
        std::to_string(m.disk_free_bytes) + " bytes free for the disk tier at " + disk_tier->path +
        " (free space plus what its database holds)" + OverrideHint());
  }
  return Status::Ok();
}

}  // namespace kvd::daemon
