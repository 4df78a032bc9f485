#include "kvd/common/log_limiter.h"

namespace kvd {

uint64_t LogLimiter::Occur() {
  const int64_t now = clock_->NowNanos();
  std::lock_guard<std::mutex> lock(mu_);
  ++held_;
  if (++total_ > 1 && now - last_record_ < interval_ns_) return 0;
  last_record_ = now;
  const uint64_t n = held_;
  held_ = 0;
  return n;
}

uint64_t LogLimiter::total() const {
  std::lock_guard<std::mutex> lock(mu_);
  return total_;
}

}  // namespace kvd
