// Where the daemon saves a model's solved VECTOR weights so that a restart serves under the same
// calibration (same W bytes, same R^2, same codec id) instead of collecting again.
//
//   with a disk tier:    in the disk tier's RocksDB database, "state" column family
//                        (storage::DiskTier::PutState / GetState; WAL on and synced);
//   without one:         a file <state_dir>/<name> (written to <name>.tmp, then renamed), where
//                        state_dir is DaemonConfig::ResolvedStateDir();
//   neither:             not saved (a restart calibrates again).
//
// Record names come from CalibrationRecordName(): they carry the model's name, its layout digest
// and the policy digest, so a changed layout or policy never finds another one's state. The
// bytes are kernels' VectorWeights::Serialize() (solved weights) or VectorCalibrator::Serialize()
// (accumulators of a calibration still collecting), both versioned and checksummed
// (docs/chunk-format.md).
//
// Thread safety: implementations are thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvd/common/status.h"

namespace kvd::storage {
class DiskTier;
}

namespace kvd::daemon {

class CalibrationStore {
 public:
  virtual ~CalibrationStore() = default;
  // Where record `name` lives, for log lines ("rocksdb /var/lib/kvd/disk state <name>", a path).
  virtual std::string Where(const std::string& name) const = 0;
  // NOT_FOUND when nothing was saved under `name`; DATA_LOSS for bytes the store itself finds
  // damaged (checksum); UNAVAILABLE for I/O errors.
  virtual StatusOr<std::vector<uint8_t>> Load(const std::string& name) const = 0;
  // Replaces the record; durable once it returns OK. UNAVAILABLE for I/O errors.
  virtual Status Save(const std::string& name, std::span<const uint8_t> bytes) = 0;
  // Deletes the record; OK when there is none. UNAVAILABLE for I/O errors.
  virtual Status Remove(const std::string& name) = 0;
};

// "<kind>/<model>/<layout digest, 16 hex>/<policy digest, 16 hex>"; kind "vector-weights" (the
// solved weights, VectorWeights::Serialize) or "vector-accumulators" (a calibration still
// collecting, VectorCalibrator::Serialize: checkpoints so a restart resumes it).
std::string CalibrationRecordName(const std::string& kind, const std::string& model,
                                  uint64_t layout_digest, uint64_t policy_digest);

// Records in `disk`'s "state" family. `disk` (not owned) must outlive the store.
std::unique_ptr<CalibrationStore> MakeDiskCalibrationStore(storage::DiskTier* disk);
// Records as files under `dir` (a record name's '/' become '-'); the directory is created on
// the first Save.
std::unique_ptr<CalibrationStore> MakeFileCalibrationStore(std::string dir);

}  // namespace kvd::daemon
