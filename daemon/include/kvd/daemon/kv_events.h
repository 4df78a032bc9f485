// KV events for routers in vLLM's KVEvents wire format (YAML `kv_events`; docs/integrations.md
// "KV-aware routers"). kvd publishes its tiers' chunk events as msgpack EventBatch messages on a
// ZeroMQ PUB socket, numbered, with a ROUTER socket that replays recent batches to a subscriber
// that missed some. Absent: nothing is published.
#pragma once

#include <cstdint>
#include <string>

#include "kvd/common/status.h"

namespace kvd::daemon {

struct KvEventsOptions {
  // ZeroMQ endpoint the PUB socket binds, e.g. "tcp://127.0.0.1:5557" or "ipc:///run/kvd/ev".
  // Required.
  std::string endpoint;
  // ZeroMQ endpoint the replay ROUTER socket binds; "" (default) = no replay.
  std::string replay_endpoint;
  // First frame of every published message (subscribers filter on it). Default "" (vLLM's).
  std::string topic;
  // Batches kept for replay. Default 10000 (vLLM's); 1..10,000,000.
  int64_t buffer_steps = 10000;
  // Most events in one batch. Default 256; 1..65536.
  int64_t max_batch_events = 256;
  // ZeroMQ send high-water mark of the PUB socket (messages queued per subscriber before ZeroMQ
  // drops). Default 100000 (vLLM's); 1..10,000,000.
  int64_t hwm = 100000;
  // INVALID_ARGUMENT naming the key ("kv_events.endpoint: ...").
  Status Validate() const;
};

}  // namespace kvd::daemon
