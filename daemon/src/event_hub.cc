#include "event_hub.h"

#include <algorithm>

namespace kvd::daemon {

Status EventHubOptions::Validate() const {
  if (default_queue < 1 || default_queue > max_queue) {
    return Status::InvalidArgument("event queue: default_queue (" + std::to_string(default_queue) +
                                   ") must be in [1, max_queue = " + std::to_string(max_queue) +
                                   "]");
  }
  return Status::Ok();
}

std::shared_ptr<EventHub::Subscription> EventHub::Subscribe(std::optional<std::string> name_space,
                                                            uint32_t queue_limit,
                                                            std::function<void()> wake) {
  auto sub = std::make_shared<Subscription>();
  sub->name_space_ = std::move(name_space);
  sub->limit_ =
      queue_limit == 0 ? options_.default_queue : std::min(queue_limit, options_.max_queue);
  sub->wake_ = std::move(wake);
  std::lock_guard<std::mutex> lock(mu_);
  subs_.push_back(sub);
  return sub;
}

void EventHub::Unsubscribe(const std::shared_ptr<Subscription>& sub) {
  std::lock_guard<std::mutex> lock(mu_);
  subs_.erase(std::remove(subs_.begin(), subs_.end(), sub), subs_.end());
}

void EventHub::Take(Subscription& sub, size_t max, std::vector<QueuedEvent>* out) {
  std::lock_guard<std::mutex> lock(mu_);
  while (max-- > 0 && !sub.queue_.empty()) {
    if (sub.queue_.front().dropped == 0) sub.events_queued_--;
    out->push_back(std::move(sub.queue_.front()));
    sub.queue_.pop_front();
  }
  if (sub.queue_.empty()) sub.wake_pending_ = false;
}

size_t EventHub::subscribers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return subs_.size();
}

uint64_t EventHub::queued_total() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queued_total_;
}

uint64_t EventHub::dropped_total() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_total_;
}

void EventHub::OnChunkEvent(const storage::ChunkEvent& event) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& sub : subs_) {
    if (sub->name_space_ && *sub->name_space_ != event.key.name_space) continue;
    const uint64_t seq = sub->next_sequence_++;
    if (sub->events_queued_ >= sub->limit_) {
      // Full: count it in the tail marker (a new one if the tail is an event).
      if (sub->queue_.empty() || sub->queue_.back().dropped == 0) {
        sub->queue_.push_back(QueuedEvent{seq, 0, {}});
      }
      sub->queue_.back().dropped++;
      dropped_total_++;
    } else {
      sub->queue_.push_back(QueuedEvent{seq, 0, event});
      sub->events_queued_++;
      queued_total_++;
    }
    if (!sub->wake_pending_) {
      sub->wake_pending_ = true;
      sub->wake_();
    }
  }
}

}  // namespace kvd::daemon
