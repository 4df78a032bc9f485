#include "disk_damage.h"

namespace kvd::daemon {

using storage::DiskHealthReport;

std::vector<std::pair<std::string, uint64_t>> DiskHealthCounters(const DiskHealthReport& h) {
  return {
      {"disk_writes_stopped", h.writes_stopped ? 1 : 0},
      {"disk_background_errors", h.background_errors},
      {"disk_resumes", h.resumes},
      {"disk_writes_refused", h.writes_refused},
      {"disk_start_repaired", h.start == DiskHealthReport::Start::kRepaired ? 1 : 0},
      {"disk_start_empty", h.start == DiskHealthReport::Start::kEmpty ? 1 : 0},
  };
}

std::vector<std::string> DiskHealthDamage(const DiskHealthReport& h,
                                          storage::TierManagerOptions::OnDiskError on_error) {
  std::vector<std::string> out;
  if (h.writes_stopped) {
    out.push_back("disk tier writes stopped by a RocksDB background error (" + h.stop_reason +
                  "); " +
                  (on_error == storage::TierManagerOptions::OnDiskError::kKeepInHost
                       ? "puts are kept in host memory only, intact chunks on disk are served"
                       : "puts fail (tiers.disk.on_error: fail_puts)") +
                  " [disk_writes_stopped]");
  }
  if (h.start != DiskHealthReport::Start::kClean) {
    out.push_back("disk tier damaged at start (" + h.start_damage + "); " +
                  (h.start == DiskHealthReport::Start::kRepaired
                       ? "serving what RocksDB repaired from it"
                       : "started empty") +
                  ", the damaged database is in " + h.quarantine_path + " [" +
                  (h.start == DiskHealthReport::Start::kRepaired ? "disk_start_repaired"
                                                                 : "disk_start_empty") +
                  "]");
  }
  return out;
}

}  // namespace kvd::daemon
