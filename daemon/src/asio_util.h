// Boost.Asio (1.74) helpers of the daemon: coroutines that await callbacks from other threads,
// and a one-thread event. Private to daemon/.
#pragma once

// Boost 1.74's asio/awaitable.hpp lacks #include <utility> under GCC 12: it must come first.
// clang-format off
#include <utility>
// clang-format on

#include <boost/asio.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>

namespace kvd::daemon {

namespace asio = boost::asio;

// Suspends the calling coroutine until `complete(value)` is called - from ANY thread, exactly
// once - by whatever `start(complete)` set in motion. The coroutine resumes on `io`'s thread;
// until then the io_context is kept from running out of work.
// `start` is called inline with a copyable std::function<void(T)>.
template <typename T, typename Start>
asio::awaitable<T> AwaitCallback(asio::io_context& io, Start start) {
  return asio::async_initiate<decltype(asio::use_awaitable), void(T)>(
      [&io, start = std::move(start)](auto handler) mutable {
        using Handler = decltype(handler);
        auto state = std::make_shared<std::optional<Handler>>(std::move(handler));
        auto work = std::make_shared<asio::executor_work_guard<asio::io_context::executor_type>>(
            io.get_executor());
        start(std::function<void(T)>([&io, state, work](T value) {
          asio::post(io, [state, work, value = std::move(value)]() mutable {
            if (!state->has_value()) return;
            Handler h = std::move(**state);
            state->reset();
            std::move(h)(std::move(value));
            work->reset();
          });
        }));
      },
      asio::use_awaitable);
}

// Runs `fn` (returning T) on `pool` and awaits its result on `io`'s thread.
template <typename T, typename Fn>
asio::awaitable<T> OffloadTo(asio::thread_pool& pool, asio::io_context& io, Fn fn) {
  return AwaitCallback<T>(io, [&pool, fn = std::move(fn)](std::function<void(T)> complete) mutable {
    asio::post(pool,
               [fn = std::move(fn), complete = std::move(complete)]() mutable { complete(fn()); });
  });
}

// A level-triggered wake-up for coroutines of ONE io_context thread (a condition variable
// without a mutex): waiters re-check their predicate after Wait returns.
class Event {
 public:
  explicit Event(asio::io_context& io) : timer_(io) { timer_.expires_at(Clock::time_point::max()); }
  // Returns after Notify() (or spuriously); REQUIRES: called on the io_context thread.
  asio::awaitable<void> Wait() {
    boost::system::error_code ec;
    co_await timer_.async_wait(asio::redirect_error(asio::use_awaitable, ec));
  }
  // Wakes every current waiter.
  void Notify() { timer_.cancel(); }

 private:
  using Clock = std::chrono::steady_clock;
  asio::steady_timer timer_;
};

}  // namespace kvd::daemon
