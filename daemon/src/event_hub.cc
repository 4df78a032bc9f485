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

std::shared_ptr<EventHub::Subscription> EventHub::Subscribe(std::string tenant,
                                                            std::optional<std::string> name_space,
                                                            uint32_t queue_limit,
                                                            std::function<void()> wake) {
  auto sub = std::make_shared<Subscription>();
  sub->tenant_ = std::move(tenant);
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
  auto it = std::find(subs_.begin(), subs_.end(), sub);
  if (it == subs_.end()) return;
  subs_.erase(it);
  ReleaseLocked(*sub, sub->events_queued_, sub->bytes_queued_);
}

void EventHub::ReleaseLocked(const Subscription& sub, uint64_t n, uint64_t bytes) {
  auto t = tenants_.find(sub.tenant_);
  if (t == tenants_.end()) return;
  t->second.events -= std::min(n, t->second.events);
  t->second.bytes -= std::min(bytes, t->second.bytes);
  if (t->second.events == 0) tenants_.erase(t);
}

uint64_t EventHub::QueuedBytes(const storage::ChunkEvent& event) {
  return sizeof(QueuedEvent) + event.key.name_space.size() + event.key.model.size();
}

void EventHub::Take(Subscription& sub, size_t max, std::vector<QueuedEvent>* out) {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t events = 0, bytes = 0;
  while (max-- > 0 && !sub.queue_.empty()) {
    if (sub.queue_.front().dropped == 0) {
      events++;
      bytes += QueuedBytes(sub.queue_.front().event);
    }
    out->push_back(std::move(sub.queue_.front()));
    sub.queue_.pop_front();
  }
  sub.events_queued_ -= events;
  sub.bytes_queued_ -= bytes;
  ReleaseLocked(sub, events, bytes);
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

uint64_t EventHub::dropped_for_quota() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_for_quota_;
}

uint64_t EventHub::tenant_queued_events(const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto t = tenants_.find(tenant);
  return t == tenants_.end() ? 0 : t->second.events;
}

uint64_t EventHub::tenant_queued_bytes(const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto t = tenants_.find(tenant);
  return t == tenants_.end() ? 0 : t->second.bytes;
}

void EventHub::OnChunkEvent(const storage::ChunkEvent& event) {
  const uint64_t bytes = QueuedBytes(event);
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& sub : subs_) {
    if (sub->name_space_ && *sub->name_space_ != event.key.name_space) continue;
    const uint64_t seq = sub->next_sequence_++;
    const storage::NamespaceQuota& quota = quotas_.For(sub->tenant_);
    TenantUsage& tenant = tenants_[sub->tenant_];
    const bool tenant_full =
        (quota.queued_events != 0 && tenant.events >= quota.queued_events) ||
        (quota.queued_event_bytes != 0 && tenant.bytes + bytes > quota.queued_event_bytes);
    if (tenant_full && sub->events_queued_ < sub->limit_) dropped_for_quota_++;
    if (sub->events_queued_ >= sub->limit_ || tenant_full) {
      if (tenant.events == 0) tenants_.erase(sub->tenant_);
      // Full: count it in the tail marker (a new one if the tail is an event).
      if (sub->queue_.empty() || sub->queue_.back().dropped == 0) {
        sub->queue_.push_back(QueuedEvent{seq, 0, {}});
      }
      sub->queue_.back().dropped++;
      dropped_total_++;
    } else {
      sub->queue_.push_back(QueuedEvent{seq, 0, event});
      sub->events_queued_++;
      sub->bytes_queued_ += bytes;
      tenant.events++;
      tenant.bytes += bytes;
      queued_total_++;
    }
    if (!sub->wake_pending_) {
      sub->wake_pending_ = true;
      sub->wake_();
    }
  }
}

}  // namespace kvd::daemon
