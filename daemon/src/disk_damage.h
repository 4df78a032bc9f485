// What `kvdctl health` and /metrics say about the disk tier's database (DiskTier::Health()).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kvd/storage/disk_tier.h"
#include "kvd/storage/options.h"

namespace kvd::daemon {

// The StatsReply counters of a disk tier's health, in display order:
// disk_writes_stopped (gauge: 1 while RocksDB's writes are stopped), disk_background_errors,
// disk_resumes, disk_writes_refused, disk_start_repaired and disk_start_empty (1 when Open
// found the database damaged and served a repaired copy, or started empty).
std::vector<std::pair<std::string, uint64_t>> DiskHealthCounters(
    const storage::DiskHealthReport& health);

// Degraded-health reasons from the disk tier's health (empty when none), each naming RocksDB's
// report and its counter: writes stopped (and what a put gets meanwhile, from `on_error`), a
// database repaired or started empty at start (and where the damaged one was moved).
std::vector<std::string> DiskHealthDamage(const storage::DiskHealthReport& health,
                                          storage::TierManagerOptions::OnDiskError on_error);

}  // namespace kvd::daemon
