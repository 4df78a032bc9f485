#include "disk_health.h"

#include <chrono>

#include "disk_repair.h"
#include "kvd/common/logging.h"

namespace kvd::storage {

void DiskHealth::SetStart(DiskHealthReport::Start start, std::string damage,
                          std::string quarantine) {
  std::lock_guard<std::mutex> lock(mu_);
  report_.start = start;
  report_.start_damage = std::move(damage);
  report_.quarantine_path = std::move(quarantine);
}

void DiskHealth::Stopped(const rocksdb::Status& error) {
  std::lock_guard<std::mutex> lock(mu_);
  report_.background_errors++;
  report_.writes_stopped = true;
  report_.stop_reason = error.ToString();
  severity_ = error.severity();
  corruption_ = error.IsCorruption();
  stopped_.store(true, std::memory_order_release);
}

void DiskHealth::Resumed() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!report_.writes_stopped) return;
  report_.writes_stopped = false;
  report_.resumes++;
  severity_ = rocksdb::Status::kNoError;
  stopped_.store(false, std::memory_order_release);
}

void DiskHealth::CountRefused() {
  std::lock_guard<std::mutex> lock(mu_);
  report_.writes_refused++;
}

bool DiskHealth::resumable() const {
  std::lock_guard<std::mutex> lock(mu_);
  return report_.writes_stopped && severity_ < rocksdb::Status::kFatalError && !corruption_;
}

DiskHealthReport DiskHealth::Report() const {
  std::lock_guard<std::mutex> lock(mu_);
  return report_;
}

void DiskHealthListener::OnBackgroundError(rocksdb::BackgroundErrorReason reason,
                                           rocksdb::Status* error) {
  if (error == nullptr || error->ok()) return;
  health_->Stopped(*error);
  const bool corrupt = error->IsCorruption();
  if (corrupt) WriteDamageMarker(path_, error->ToString());
  KVD_LOG(ERROR) << "disk tier: RocksDB stopped writing after a background error; puts are not "
                    "written to disk until it recovers, intact chunks on disk are still served"
                 << Kv("path", path_) << Kv("reason", static_cast<int>(reason))
                 << Kv("severity", static_cast<int>(error->severity()))
                 << Kv("repair_at_next_start", corrupt) << Kv("rocksdb", error->ToString());
}

void DiskHealthListener::OnErrorRecoveryEnd(const rocksdb::BackgroundErrorRecoveryInfo& info) {
  if (!info.new_bg_error.ok()) return;
  health_->Resumed();
  KVD_LOG(WARNING) << "disk tier: RocksDB recovered from its background error; writes resumed"
                   << Kv("path", path_) << Kv("error", info.old_bg_error.ToString());
}

DiskResumer::DiskResumer(rocksdb::DB* db, DiskHealth* health, uint32_t interval_ms,
                         uint32_t max_attempts)
    : db_(db), health_(health), interval_ms_(interval_ms), max_attempts_(max_attempts) {
  if (max_attempts_ > 0) thread_ = std::thread([this] { Run(); });
}

DiskResumer::~DiskResumer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void DiskResumer::Run() {
  uint32_t attempts = 0;      // Resume calls since writes were last up for a while
  uint32_t up_intervals = 0;  // intervals with writes up since the last resume
  std::unique_lock<std::mutex> lock(mu_);
  while (!wake_.wait_for(lock, std::chrono::milliseconds(interval_ms_), [&] { return stop_; })) {
    if (!health_->writes_stopped()) {
      if (++up_intervals >= 10) attempts = 0;
      continue;
    }
    up_intervals = 0;
    if (!health_->resumable() || attempts >= max_attempts_) continue;
    attempts++;
    lock.unlock();
    const rocksdb::Status s = db_->Resume();
    lock.lock();
    if (s.ok()) {
      health_->Resumed();
      KVD_LOG(WARNING) << "disk tier: writes resumed (DB::Resume)" << Kv("attempt", attempts);
    } else if (attempts == max_attempts_) {
      KVD_LOG(ERROR) << "disk tier: DB::Resume failed; no more attempts, writes stay stopped"
                     << Kv("attempts", attempts) << Kv("rocksdb", s.ToString());
    }
  }
}

}  // namespace kvd::storage
