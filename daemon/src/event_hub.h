// EventHub: fans the tiers' chunk events (storage/chunk_events.h) out to subscribed sessions.
// Private to daemon/.
//
// Every subscription has a bounded queue. A tier's event is appended to the queue of every
// subscription whose namespace filter matches, numbered per subscription (1, 2, ...). A full
// queue never blocks the tier: the event is counted in a "dropped" marker at the queue's tail
// (one marker stands for a run of lost events and takes their numbers), and the subscriber
// resyncs with List. The queue may exceed its limit by that one marker.
//
// Threading: OnChunkEvent runs on whichever thread changed a tier, under that tier's lock; the
// rest on any thread. `wake` of a subscription is called (under the hub's lock: it must only
// post work, e.g. asio::post) when its queue goes from empty to non-empty.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kvd/common/status.h"
#include "kvd/storage/chunk_events.h"

namespace kvd::daemon {

struct EventHubOptions {
  // Queue of a subscription that asks for none (SubscribeRequest.queueLimit 0). Default 4096.
  uint32_t default_queue = 4096;
  // Largest queue a subscription may ask for. Default 65536.
  uint32_t max_queue = 65536;
  // INVALID_ARGUMENT unless 1 <= default_queue <= max_queue.
  Status Validate() const;
};

// One queued item: an event, or a marker for `dropped` lost events.
struct QueuedEvent {
  uint64_t sequence = 0;  // the event's number; a marker's first lost number
  uint64_t dropped = 0;   // > 0: a dropped marker
  storage::ChunkEvent event;
};

class EventHub final : public storage::ChunkEventListener {
 public:
  class Subscription;

  explicit EventHub(EventHubOptions options) : options_(options) {}

  // A subscription to the events of `name_space` (nullopt = all). `queue_limit` 0 = the default;
  // over max_queue: capped (Subscription::limit says what was granted).
  std::shared_ptr<Subscription> Subscribe(std::optional<std::string> name_space,
                                          uint32_t queue_limit, std::function<void()> wake);
  // Stops queueing for `sub` (idempotent).
  void Unsubscribe(const std::shared_ptr<Subscription>& sub);
  // Moves up to `max` queued items of `sub` to `out` (appended, in order). After it returns
  // with the queue empty, the next event calls `wake` again.
  void Take(Subscription& sub, size_t max, std::vector<QueuedEvent>* out);
  size_t subscribers() const;
  // Events queued for a subscriber / lost to a full queue, over all subscriptions so far.
  uint64_t queued_total() const;
  uint64_t dropped_total() const;

  void OnChunkEvent(const storage::ChunkEvent& event) override;

  class Subscription {
   public:
    uint32_t limit() const { return limit_; }

   private:
    friend class EventHub;
    std::optional<std::string> name_space_;
    uint32_t limit_ = 0;
    std::function<void()> wake_;
    // Guarded by the hub's mutex:
    std::deque<QueuedEvent> queue_;
    size_t events_queued_ = 0;  // items in queue_ that are events (not markers)
    uint64_t next_sequence_ = 1;
    bool wake_pending_ = false;
  };

 private:
  const EventHubOptions options_;
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<Subscription>> subs_;  // guarded by mu_
  uint64_t queued_total_ = 0;                        // guarded by mu_
  uint64_t dropped_total_ = 0;                       // guarded by mu_
};

}  // namespace kvd::daemon
