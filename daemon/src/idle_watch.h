// Closes a session that sent nothing for limits.idle_timeout_ms. Private to daemon/.
//
// The reader only stamps the time of each read (Touch: no timer work on the request path); one
// timer per session wakes when the timeout could have passed and then checks. A session that is
// busy (the `busy` callback: requests in flight, puts pending, an event subscription) is never
// closed; the watch looks again a timeout later.
//
// Threading: io_context thread only.
#pragma once

#include <chrono>
#include <functional>

#include "asio_util.h"

namespace kvd::daemon {

class IdleWatch {
 public:
  explicit IdleWatch(asio::io_context& io) : timer_(io) {}

  // Starts watching with `timeout_ms` (> 0). `busy()` true: not idle. `expire()` closes the
  // session (called at most once, on the io_context thread, while the watch is running).
  // The owner must Stop() before it goes.
  void Start(int64_t timeout_ms, std::function<bool()> busy, std::function<void()> expire);
  void Touch() { last_ = std::chrono::steady_clock::now(); }
  void Stop();

 private:
  void Arm(std::chrono::steady_clock::duration after);

  asio::steady_timer timer_;
  std::chrono::steady_clock::duration timeout_{};
  std::chrono::steady_clock::time_point last_{};
  std::function<bool()> busy_;
  std::function<void()> expire_;
  bool running_ = false;
};

}  // namespace kvd::daemon
