#include "progress_loop.h"

#include <algorithm>
#include <utility>

#include "kvd/common/logging.h"

namespace kvd::daemon {

using transport::TransferState;
using transport::TransferStatus;

ProgressLoop::ProgressLoop(transport::Transport* transport) : transport_(transport) {}

ProgressLoop::~ProgressLoop() { Stop(); }

void ProgressLoop::Start() {
  std::lock_guard<std::mutex> lock(mu_);
  if (running_) return;
  running_ = true;
  stop_requested_ = false;
  thread_ = std::thread([this] { Loop(); });
}

void ProgressLoop::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!running_) return;
    stop_requested_ = true;
  }
  cv_.notify_all();
  transport_->Wakeup();
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  running_ = false;
}

void ProgressLoop::Submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (running_ && !stop_requested_) {
      tasks_.push_back(std::move(task));
      transport_->Wakeup();
      return;
    }
  }
  task();
}

void ProgressLoop::Watch(transport::TransferHandle transfer, SteadyTime deadline,
                         WatchCallback done) {
  // Often already finished (a put's bytes usually arrive before its Commit): answer at once
  // rather than after the progress thread's next pass.
  if (TransferStatus st = transport_->Check(transfer); st.state != TransferState::kInProgress) {
    done(st);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (running_ && !stop_requested_) {
      new_watches_.push_back(WatchEntry{transfer, deadline, std::move(done)});
      ++watch_count_;
      transport_->Wakeup();
      return;
    }
  }
  TransferStatus st = transport_->Check(transfer);
  if (st.state == TransferState::kInProgress) {
    st.status = Status::Cancelled("daemon shutting down");
  }
  done(st);
}

size_t ProgressLoop::watch_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return watch_count_;
}

bool ProgressLoop::TakeWork(std::deque<std::function<void()>>* tasks) {
  std::lock_guard<std::mutex> lock(mu_);
  tasks->swap(tasks_);
  for (auto& w : new_watches_) watches_.push_back(std::move(w));
  new_watches_.clear();
  return stop_requested_;
}

void ProgressLoop::CollectFinishedWatches(Completed* completed) {
  if (watches_.empty()) return;
  auto now = std::chrono::steady_clock::now();
  size_t kept = 0;
  for (size_t i = 0; i < watches_.size(); ++i) {
    TransferStatus st = transport_->Check(watches_[i].transfer);
    if (st.state == TransferState::kInProgress && now < watches_[i].deadline) {
      if (kept != i) watches_[kept] = std::move(watches_[i]);
      ++kept;
      continue;
    }
    if (st.state == TransferState::kInProgress) {
      st.status = Status::DeadlineExceeded("transfer did not finish in time");
    }
    completed->emplace_back(std::move(watches_[i].done), std::move(st));
  }
  watches_.resize(kept);
}

void ProgressLoop::RunCompleted(Completed* completed) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    watch_count_ -= completed->size();
  }
  for (auto& [done, st] : *completed) done(st);
  completed->clear();
}

// Nothing progressed: sleep in the kernel until the transport has events (UCX: its worker's
// event fd), another thread hands us work (Submit/Watch wake the transport), or the next watch
// deadline. While transfers are expected the sleep is capped at kBusySlice, for backends whose
// lanes have no event fd (UCX shared memory with peer_failure_detection off); with nothing in
// flight it is capped at kIdleSlice, so an idle daemon wakes once a second.
void ProgressLoop::SleepUntilWork() {
  auto now = std::chrono::steady_clock::now();
  auto slice = (!watches_.empty() || expected_.load(std::memory_order_relaxed) > 0) ? kBusySlice
                                                                                    : kIdleSlice;
  for (const auto& w : watches_) {
    auto left = std::chrono::ceil<std::chrono::milliseconds>(w.deadline - now);
    slice = std::max(std::chrono::milliseconds(0), std::min(slice, left));
  }
  Status s = transport_->WaitForEvents(slice);
  if (!s.ok()) {
    KVD_LOG(WARNING) << "transport WaitForEvents failed" << Kv("status", s);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Shutdown: every remaining watch completes; transfers still in flight say so.
void ProgressLoop::CompleteWatchesAtShutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& w : new_watches_) watches_.push_back(std::move(w));
    new_watches_.clear();
    watch_count_ = 0;
  }
  for (auto& w : watches_) {
    TransferStatus st = transport_->Check(w.transfer);
    if (st.state == TransferState::kInProgress)
      st.status = Status::Cancelled("daemon shutting down");
    w.done(st);
  }
  watches_.clear();
}

void ProgressLoop::Loop() {
  std::deque<std::function<void()>> tasks;
  Completed completed;
  while (true) {
    const bool stopping = TakeWork(&tasks);
    bool busy = !tasks.empty();
    for (auto& task : tasks) task();
    tasks.clear();
    if (stopping) break;
    const int events = transport_->Progress();
    CollectFinishedWatches(&completed);
    if (!completed.empty()) {
      RunCompleted(&completed);
      busy = true;
    }
    if (events > 0 || busy) continue;
    SleepUntilWork();
  }
  CompleteWatchesAtShutdown();
}

}  // namespace kvd::daemon
