// EventHub: fans the tiers' chunk events (storage/chunk_events.h) out to subscribed sessions.
// Private to daemon/.
//
// Every subscription has a bounded queue. A tier's event is appended to the queue of every
// subscription whose namespace filter matches, numbered per subscription (1, 2, ...). A full
// queue never blocks the tier: the event is counted in a "dropped" marker at the queue's tail
// (one marker stands for a run of lost events and takes their numbers), and the subscriber
// resyncs with List. The queue may exceed its limit by that one marker.
//
// Every subscription also counts against its tenant (the namespace of an engine session, "" for
// the admin role): the events queued for all of a tenant's subscriptions, and their bytes, are
// bounded by the tenant's queued_events / queued_event_bytes quota (kvd/storage/quotas.h). At
// that bound the tenant's subscriptions get dropped markers instead of events: many slow
// subscribers of one tenant hold no more than one tenant's budget, and never slow anyone else's.
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
#include <unordered_map>
#include <vector>

#include "kvd/common/status.h"
#include "kvd/storage/chunk_events.h"
#include "kvd/storage/quotas.h"

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

  // The tenants' queued_events / queued_event_bytes quotas. Set before concurrent use.
  void SetQuotas(storage::QuotaTable quotas) { quotas_ = std::move(quotas); }

  // A subscription of `tenant` to the events of `name_space` (nullopt = all). `queue_limit` 0 =
  // the default; over max_queue: capped (Subscription::limit says what was granted).
  std::shared_ptr<Subscription> Subscribe(std::string tenant, std::optional<std::string> name_space,
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
  // Of dropped_total, those lost because the tenant was at its queued-events quota.
  uint64_t dropped_for_quota() const;
  // Events / bytes queued now for `tenant`'s subscriptions.
  uint64_t tenant_queued_events(const std::string& tenant) const;
  uint64_t tenant_queued_bytes(const std::string& tenant) const;
  // What one queued event counts against its tenant's queued_event_bytes.
  static uint64_t QueuedBytes(const storage::ChunkEvent& event);

  void OnChunkEvent(const storage::ChunkEvent& event) override;

  class Subscription {
   public:
    uint32_t limit() const { return limit_; }

   private:
    friend class EventHub;
    std::string tenant_;
    std::optional<std::string> name_space_;
    uint32_t limit_ = 0;
    std::function<void()> wake_;
    // Guarded by the hub's mutex:
    std::deque<QueuedEvent> queue_;
    size_t events_queued_ = 0;   // items in queue_ that are events (not markers)
    uint64_t bytes_queued_ = 0;  // QueuedBytes of those events
    uint64_t next_sequence_ = 1;
    bool wake_pending_ = false;
  };

 private:
  struct TenantUsage {
    uint64_t events = 0;
    uint64_t bytes = 0;
  };
  // Takes `n` events of `bytes` off `sub`'s tenant. REQUIRES mu_.
  void ReleaseLocked(const Subscription& sub, uint64_t n, uint64_t bytes);

  const EventHubOptions options_;
  storage::QuotaTable quotas_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, TenantUsage> tenants_;  // guarded by mu_
  uint64_t dropped_for_quota_ = 0;                        // guarded by mu_
  std::vector<std::shared_ptr<Subscription>> subs_;       // guarded by mu_
  uint64_t queued_total_ = 0;                             // guarded by mu_
  uint64_t dropped_total_ = 0;                            // guarded by mu_
};

}  // namespace kvd::daemon
