// Clock seam: everything in kvd that expires (reservations, leases, timeouts) reads time through
// a Clock so tests can drive it by hand.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace kvd {

class Clock {
 public:
  virtual ~Clock() = default;
  // Monotonic nanoseconds since an arbitrary origin. Thread-safe.
  virtual int64_t NowNanos() const = 0;
  int64_t NowMillis() const { return NowNanos() / 1000000; }
  // The process-wide steady clock.
  static Clock* Real();
};

// A clock that moves only when told. Thread-safe.
class ManualClock : public Clock {
 public:
  explicit ManualClock(int64_t start_nanos = 0) : now_(start_nanos) {}
  int64_t NowNanos() const override { return now_.load(); }
  void AdvanceNanos(int64_t d) { now_.fetch_add(d); }
  void AdvanceMillis(int64_t ms) { AdvanceNanos(ms * 1000000); }

 private:
  std::atomic<int64_t> now_;
};

}  // namespace kvd
