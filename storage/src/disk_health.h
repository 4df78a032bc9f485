// The disk tier's database health: background errors reported by RocksDB (its event listener),
// writes resumed after them, and what Open found. Private to storage/src.
#pragma once

#include <rocksdb/db.h>
#include <rocksdb/listener.h>
#include <rocksdb/status.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "kvd/storage/disk_tier.h"

namespace kvd::storage {

// Thread-safe. RocksDB calls the listener methods with its own lock held: they only record.
class DiskHealth {
 public:
  void SetStart(DiskHealthReport::Start start, std::string damage, std::string quarantine);
  // A background error stopped the database's writes (`error` carries RocksDB's severity).
  void Stopped(const rocksdb::Status& error);
  // Writes started again (RocksDB's own recovery or a DB::Resume). No-op unless stopped.
  void Resumed();
  void CountRefused();
  bool writes_stopped() const { return stopped_.load(std::memory_order_acquire); }
  // Stopped by an error DB::Resume can recover from: severity soft or hard, and no corruption
  // (resuming would run the compaction that hit the damaged block again; the next Open
  // repairs instead).
  bool resumable() const;
  DiskHealthReport Report() const;

 private:
  mutable std::mutex mu_;
  DiskHealthReport report_;                                         // guarded by mu_
  rocksdb::Status::Severity severity_ = rocksdb::Status::kNoError;  // guarded by mu_
  bool corruption_ = false;                                          // guarded by mu_
  std::atomic<bool> stopped_{false};
};

// RocksDB's event listener feeding a DiskHealth; a corruption found in the background is also
// recorded in the database directory (WriteDamageMarker) so that the next Open repairs it.
class DiskHealthListener final : public rocksdb::EventListener {
 public:
  DiskHealthListener(DiskHealth* health, std::string path)
      : health_(health), path_(std::move(path)) {}
  void OnBackgroundError(rocksdb::BackgroundErrorReason reason, rocksdb::Status* error) override;
  void OnErrorRecoveryEnd(const rocksdb::BackgroundErrorRecoveryInfo& info) override;

 private:
  DiskHealth* const health_;
  const std::string path_;
};

// Calls DB::Resume() every `interval_ms` while `health` says writes are stopped by a resumable
// error, at most `max_attempts` times in a row: the count starts again only once writes stayed
// up for ten intervals after a resume (an error that comes back at once is not retried
// forever). Stops (joins) in its destructor, which must run before the database is closed.
class DiskResumer {
 public:
  DiskResumer(rocksdb::DB* db, DiskHealth* health, uint32_t interval_ms, uint32_t max_attempts);
  ~DiskResumer();
  DiskResumer(const DiskResumer&) = delete;
  DiskResumer& operator=(const DiskResumer&) = delete;

 private:
  void Run();
  rocksdb::DB* const db_;
  DiskHealth* const health_;
  const uint32_t interval_ms_;
  const uint32_t max_attempts_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;  // guarded by mu_
  std::thread thread_;
};

}  // namespace kvd::storage
