// The transport progress thread of the daemon, and its bridge to the Asio io_context.
//
// The transport's threading contract (transport.h): any thread may post, check and release; one
// thread should loop { Progress(); if idle WaitForEvents(timeout); }. This loop is that thread:
// it sleeps in WaitForEvents whenever a pass found nothing, and Submit/Watch wake it
// (Transport::Wakeup).
// It also
//   - watches transfers for the io_context: Watch(handle, deadline, callback) calls the callback
//     (on the progress thread) once the transfer is no longer in progress, or at the deadline
//     (state still kInProgress, status DEADLINE_EXCEEDED) - so the io_context thread never waits
//     on a transfer;
//   - runs blocking transport calls (Connect, Disconnect) off the io_context thread (Submit).
//
// Thread safety: Submit and Watch are thread-safe. Start/Stop from one owner thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "kvd/transport/transport.h"

namespace kvd::daemon {

class ProgressLoop {
 public:
  using SteadyTime = std::chrono::steady_clock::time_point;
  using WatchCallback = std::function<void(const transport::TransferStatus&)>;
  // Longest sleep with nothing in flight (an idle daemon wakes this often).
  static constexpr std::chrono::milliseconds kIdleSlice{1000};
  // Longest sleep while transfers are expected or watched.
  static constexpr std::chrono::milliseconds kBusySlice{1};

  // `transport` is not owned and must outlive the loop.
  explicit ProgressLoop(transport::Transport* transport);
  ~ProgressLoop();  // Stop()s
  ProgressLoop(const ProgressLoop&) = delete;
  ProgressLoop& operator=(const ProgressLoop&) = delete;

  void Start();
  // Stops the thread: runs the tasks still queued, then completes every remaining watch with
  // state kInProgress and CANCELLED "daemon shutting down" (the transfer may still be in flight:
  // its buffer must not be freed). Idempotent.
  void Stop();

  // Runs `task` on the progress thread soon. After Stop, runs it on the caller's thread.
  void Submit(std::function<void()> task);

  // Calls `done` when `transfer` finishes (kDone / kError) or when `deadline` passes
  // (kInProgress, DEADLINE_EXCEEDED): inline if it already finished, else on the progress
  // thread. Calls it exactly once. The caller keeps ownership of the handle (Release it after
  // the callback).
  void Watch(transport::TransferHandle transfer, SteadyTime deadline, WatchCallback done);

  // Transfers posted and expected to move soon without a Watch yet (a put's receive between
  // Reserve and Commit). While any are expected, or any watch is registered, the loop's sleeps in
  // WaitForEvents are capped at kBusySlice (for lanes without an event fd); otherwise at
  // kIdleSlice. Either way the loop sleeps in the kernel whenever a Progress pass found nothing:
  // it never spins. Thread-safe.
  void ExpectTransfers(int64_t delta) { expected_.fetch_add(delta); }

  // Watches currently registered (for stats and tests).
  size_t watch_count() const;

 private:
  struct WatchEntry {
    transport::TransferHandle transfer;
    SteadyTime deadline;
    WatchCallback done;
  };
  using Completed = std::vector<std::pair<WatchCallback, transport::TransferStatus>>;
  void Loop();
  // The progress thread's steps: takes the queued tasks and new watches (true when stopping);
  // moves finished or expired watches to `completed`; runs their callbacks; sleeps until the
  // transport has events, work arrives or the next watch deadline; completes every watch left at
  // shutdown.
  bool TakeWork(std::deque<std::function<void()>>* tasks);
  void CollectFinishedWatches(Completed* completed);
  void RunCompleted(Completed* completed);
  void SleepUntilWork();
  void CompleteWatchesAtShutdown();

  transport::Transport* transport_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool running_ = false;                     // GUARDED_BY(mu_)
  bool stop_requested_ = false;              // GUARDED_BY(mu_)
  std::deque<std::function<void()>> tasks_;  // GUARDED_BY(mu_)
  std::vector<WatchEntry> new_watches_;      // GUARDED_BY(mu_)
  size_t watch_count_ = 0;                   // GUARDED_BY(mu_)
  std::atomic<int64_t> expected_{0};
  std::vector<WatchEntry> watches_;  // owned by the progress thread
  std::thread thread_;
};

}  // namespace kvd::daemon
