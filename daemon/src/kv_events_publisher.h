// KvEventsPublisher: the tiers' chunk events (via the EventHub) published for KV-aware routers in
// vLLM's KVEvents wire format (vllm.distributed.kv_events). Private to daemon/.
//
// Wire (docs/integrations.md "KV-aware routers"):
// - PUB socket, one message per batch, three frames: topic, sequence number (8 bytes, big-endian,
//   0, 1, 2, ...), payload = msgpack of EventBatch, an array [ts (float64 seconds since the
//   epoch), events, data_parallel_rank (0)].
// - Each event is a msgpack map tagged by "type": BlockStored {block_hashes, parent_block_hash,
//   token_ids, block_size, lora_id, medium, lora_name}, BlockRemoved {block_hashes, medium} or
//   AllBlocksCleared {}.
// - Resync: the first batches after start, and those after events were lost to a full queue,
//   are AllBlocksCleared followed by a BlockStored for every copy the tiers hold then (split
//   into batches of max_batch_events), so that a router's index of the node is exact again.
//   The events queued before the loss are superseded by it and not sent; those after follow.
// - ROUTER socket (replay_endpoint): a request [identity, "", start sequence (8 bytes,
//   big-endian)] gets every kept batch numbered >= start as [identity, "", topic, sequence,
//   payload], then the end marker [identity, "", "", -1 (8 bytes), ""].
//
// Threading: one thread of its own takes events from its hub subscription, publishes them and
// answers replay requests; the sockets never leave it. It sleeps in zmq_poll on an eventfd the
// hub's wake callback writes (and on the replay socket), so an idle publisher costs no CPU.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "event_hub.h"
#include "kvd/common/status.h"
#include "kvd/daemon/kv_events.h"

namespace kvd::daemon {

// msgpack of one EventBatch holding `events` (dropped markers are skipped), stamped `ts`,
// preceded by an AllBlocksCleared event when `cleared_first`.
std::string EncodeKvEventBatch(double ts, bool cleared_first,
                               const std::vector<QueuedEvent>& events);

// Every chunk copy the node holds now, each with its tier (TierManager::ListCopies).
using ListCopiesFn = std::function<std::vector<storage::ChunkMeta>()>;

class KvEventsPublisher {
 public:
  // Binds the sockets (UNAVAILABLE naming the endpoint when a bind fails), subscribes to `hub`
  // and starts the thread, which first publishes a resync from `list_copies` (called on the
  // publisher's thread; thread-safe). `hub` must outlive the publisher.
  static StatusOr<std::unique_ptr<KvEventsPublisher>> Start(const KvEventsOptions& options,
                                                            EventHub* hub,
                                                            ListCopiesFn list_copies);
  ~KvEventsPublisher();
  // Unsubscribes, stops the thread and closes the sockets (idempotent).
  void Stop();

  // Batches published so far.
  uint64_t published() const { return next_sequence_.load(); }
  // Events the hub's queue lost (each loss is followed by a resync).
  uint64_t dropped() const { return dropped_.load(); }
  // Resyncs published (the one at start included).
  uint64_t resyncs() const { return resyncs_.load(); }

 private:
  KvEventsPublisher(KvEventsOptions options, EventHub* hub, ListCopiesFn list_copies);
  Status Bind();
  // Wakes the thread (the hub's wake callback; Stop). Thread-safe.
  void Wake();
  void Run();
  // Publishes `events` as one batch (and keeps it for replay).
  void Publish(bool cleared_first, const std::vector<QueuedEvent>& events);
  // Publishes AllBlocksCleared and the tiers' copies now (see the file comment).
  void Resync();
  // Answers one replay request waiting on the ROUTER socket.
  void ServeReplay();

  const KvEventsOptions options_;
  EventHub* const hub_;
  const ListCopiesFn list_copies_;
  std::shared_ptr<EventHub::Subscription> sub_;
  int wake_fd_ = -1;                                   // eventfd: Wake -> the thread
  void* context_ = nullptr;                            // zmq context
  void* pub_ = nullptr;                                // zmq PUB socket
  void* replay_ = nullptr;                             // zmq ROUTER socket, or null
  std::deque<std::pair<uint64_t, std::string>> kept_;  // (sequence, payload), thread only
  std::atomic<uint64_t> next_sequence_{0};
  std::atomic<uint64_t> dropped_{0};
  std::atomic<uint64_t> resyncs_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace kvd::daemon
