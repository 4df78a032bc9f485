// Opening the disk tier's RocksDB database when it may be damaged: telling a torn write-ahead
// log tail from damage, and moving a damaged database aside and repairing a copy of it.
// Private to storage/src.
#pragma once

#include <rocksdb/db.h>
#include <rocksdb/options.h>

#include <string>
#include <vector>

namespace kvd::storage {

// Whether a RocksDB status of an open or a read means a damaged database (a corrupt file, or a
// file the database needs that is missing), as opposed to an environment error (the lock held
// by another process, permissions, no space) that a repair would not fix.
bool IsDamage(const rocksdb::Status& s);

struct OpenedDb {
  rocksdb::DB* db = nullptr;  // owned by the caller on success
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  bool wal_damaged = false;  // the logs were replayed up to damage (point-in-time recovery)
  std::string wal_damage;    // RocksDB's status of that damage
};

// Opens the database replaying its write-ahead logs tolerating a torn last record only (a
// crash); if RocksDB reports corruption, opens it again with point-in-time recovery (replay up
// to the first damaged record, drop the rest) and says so in `out`. A database that neither
// mode opens gives the first open's status.
rocksdb::Status OpenCheckingWal(rocksdb::DBOptions options, const std::string& path,
                                const std::vector<rocksdb::ColumnFamilyDescriptor>& families,
                                OpenedDb* out);

// The marker a background corruption leaves in the database directory: the next Open repairs.
void WriteDamageMarker(const std::string& path, const std::string& what);
// The marker's text, or empty when there is none.
std::string ReadDamageMarker(const std::string& path);

// Renames `path` to a fresh "<path>.quarantine-<UTC time>" (returned in *quarantine), fills a
// new `path` with hard links (copies where links fail) to the quarantined table, blob and log
// files and runs rocksdb::RepairDB on it: the quarantined directory stays as it was found.
// Errors: the rename or link failure, or RepairDB's status (*quarantine is set once renamed).
rocksdb::Status QuarantineAndRepair(const std::string& path, const rocksdb::DBOptions& options,
                                    const std::vector<rocksdb::ColumnFamilyDescriptor>& families,
                                    std::string* quarantine);

// Empties `path` (after QuarantineAndRepair's copy could not be opened). false on failure.
bool EmptyDirectory(const std::string& path);

}  // namespace kvd::storage
