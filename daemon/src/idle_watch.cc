#include "idle_watch.h"

namespace kvd::daemon {

void IdleWatch::Start(int64_t timeout_ms, std::function<bool()> busy,
                      std::function<void()> expire) {
  timeout_ = std::chrono::milliseconds(timeout_ms);
  busy_ = std::move(busy);
  expire_ = std::move(expire);
  running_ = true;
  Touch();
  Arm(timeout_);
}

void IdleWatch::Stop() {
  running_ = false;
  timer_.cancel();
  busy_ = nullptr;
  expire_ = nullptr;
}

void IdleWatch::Arm(std::chrono::steady_clock::duration after) {
  timer_.expires_after(after);
  timer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec || !running_) return;
    const auto idle = std::chrono::steady_clock::now() - last_;
    if (idle < timeout_) return Arm(timeout_ - idle);
    if (busy_()) {
      Touch();
      return Arm(timeout_);
    }
    running_ = false;
    auto expire = std::move(expire_);  // expire() may Stop() this watch
    expire();
  });
}

}  // namespace kvd::daemon
