// Rate limit for a log record that can repeat at a high rate (a failure per chunk, per request):
//
//   LogLimiter limiter(std::chrono::minutes(1));
//   if (uint64_t n = limiter.Occur(); n > 0) {
//     KVD_LOG(WARNING) << "device failed; the CPU compresses" << Kv("occurrences", n);
//   }
//
// The first occurrence is logged, then at most one record per `interval`, which stands for the
// occurrences held back since the previous record. Occurrences after the last record are not
// logged until the next one comes: count them in a metric as well.
// Thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>

#include "kvd/common/clock.h"

namespace kvd {

class LogLimiter {
 public:
  // REQUIRES: interval >= 0 (0 logs every occurrence); `clock` outlives the limiter.
  explicit LogLimiter(std::chrono::nanoseconds interval, const Clock* clock = Clock::Real())
      : interval_ns_(interval.count()), clock_(clock) {}

  // Counts one occurrence. Returns how many occurrences a record written now stands for (this
  // one and those held back since the previous record, >= 1), or 0 when this one is held back.
  uint64_t Occur();
  // Occurrences since construction.
  uint64_t total() const;

 private:
  const int64_t interval_ns_;
  const Clock* const clock_;
  mutable std::mutex mu_;
  uint64_t total_ = 0;       // GUARDED_BY(mu_)
  uint64_t held_ = 0;        // occurrences since the last record; GUARDED_BY(mu_)
  int64_t last_record_ = 0;  // NowNanos() of the last record; GUARDED_BY(mu_)
};

}  // namespace kvd
