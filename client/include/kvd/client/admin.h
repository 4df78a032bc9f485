// The values of the Client's admin calls (Stats, List, Evict, Health) and of its KV cache event
// stream (SubscribeEvents / PollEvents), mirroring proto/kvd.capnp (part of client.h; include
// that). Plain structs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvd/common/hash.h"
#include "kvd/common/layout.h"

namespace kvd::client {

// ---- admin views (mirror proto/kvd.capnp StatsReply etc.) ----
struct TierStats {
  std::string name;
  uint64_t capacity_bytes = 0, used_bytes = 0, reserved_bytes = 0, pinned_bytes = 0;
  uint64_t chunks = 0, evictions = 0, hits = 0, misses = 0;
};
struct GroupStats {
  std::string name;
  uint64_t chunks = 0, bytes = 0;
};
struct ModelInfo {
  std::string name;
  ModelLayout layout;
  uint64_t chunk_bytes = 0;
};
// Time of one compression stage of a model's ingest since the daemon started (StatsReply
// .compression): `nanos` summed over chunks, `chunks` the chunks in which the stage took time.
struct IngestStageTime {
  std::string stage;  // convert | derotate | score | select | merge | route | encode | serialize
  uint64_t nanos = 0;
  uint64_t chunks = 0;
};
struct ModelIngestStats {
  std::string model;
  std::vector<IngestStageTime> stages;  // pipeline order
  std::string device;                   // where it compresses: "cpu" or "cuda:N"
  std::string device_reason;            // why (compression.device, what kvd found at start)
  // A policy with an expected_attention stage (ea_min_queries > 0): the window queries per layer
  // its query statistics hold; they score chunks once ea_queries >= ea_min_queries, KeyDiff does
  // before. Both 0 for a policy without that stage.
  uint64_t ea_queries = 0;
  uint64_t ea_min_queries = 0;
  bool ExpectedAttentionActive() const {
    return ea_min_queries > 0 && ea_queries >= ea_min_queries;
  }
};
struct Stats {
  std::string node_name;
  uint64_t uptime_ms = 0;
  uint32_t sessions = 0;
  std::vector<TierStats> tiers;
  std::vector<GroupStats> models, namespaces;
  std::vector<ModelInfo> registered_models;
  std::vector<std::pair<std::string, uint64_t>> counters;
  std::vector<ModelIngestStats> compression;  // models with a compression policy
};
struct ListFilter {
  std::string name_space;  // "" = any
  std::string model;       // "" = any
  uint32_t limit = 100;
};
struct ChunkInfo {
  std::string name_space, model;
  Hash128 hash;
  uint32_t tokens = 0;
  uint64_t bytes = 0;
  std::string tier;
  uint64_t age_ms = 0, idle_ms = 0;
  uint32_t leases = 0;
};
struct ListResult {
  std::vector<ChunkInfo> chunks;
  uint64_t total = 0;  // matching chunks; `chunks` may be cut at the limit
};
struct EvictFilter {
  enum class Kind { kAll, kNamespace, kModel, kChunk } kind = Kind::kAll;
  std::string name;  // namespace or model
  Hash128 chunk;
};
struct EvictResult {
  uint64_t chunks = 0, bytes = 0, skipped_pinned = 0;
};
struct Health {
  bool ok = false;
  // Serving (ok), but damaged stored data was found since start: corrupt chunks (dropped, never
  // served), quarantined metadata records, a damaged write-ahead log, failed promotions.
  // `status` then names each reason ("degraded: ...").
  bool degraded = false;
  std::string status;
  uint64_t uptime_ms = 0;
  std::string transport;
  struct Tier {
    std::string name;
    bool ok = false;
    std::string detail;
  };
  std::vector<Tier> tiers;
};

// ---- KV cache events (SubscribeEvents / PollEvents; docs/wire-format.md "Events") ----

enum class KvEventKind : uint8_t {
  kStored = 0,   // the chunk became visible in `tier`
  kRemoved = 1,  // it left `tier`; `reason` says why
  kDropped = 2,  // the daemon's queue for this subscriber was full: `dropped` events were lost
                 // here (resync with List on an admin connection)
};

// One event of a subscription. Sequence numbers are per subscription, from 1, without gaps: a
// kDropped marker takes the numbers of the `dropped` events it stands for.
struct KvEvent {
  uint64_t sequence = 0;
  KvEventKind kind = KvEventKind::kStored;
  std::string reason;  // kRemoved: "evicted" (LRU, capacity or quota), "admin" (evict),
                       // "moved" (demoted to a lower tier / store rolled back), "corrupt"
  std::string tier;    // "gpu", "host", "disk"
  std::string name_space, model;
  uint32_t codec_id = 0;
  uint64_t layout_digest = 0;
  Hash128 hash;  // the chunk's key (chain hash of its last block, hashing.h)
  uint32_t tokens = 0;
  uint64_t bytes = 0;    // bytes of the chunk in that tier
  uint64_t dropped = 0;  // kDropped: events lost
};

struct SubscribeOptions {
  // Admin role: "" (default) = every namespace, else that one. Engine role: "" or the client's
  // own namespace (another one is PERMISSION_DENIED): an engine sees its namespace only.
  std::string name_space;
  // Events the daemon queues for this subscriber before it drops (0 = the daemon's default,
  // 4096; capped at 65536).
  uint32_t queue_limit = 0;
};

struct SubscriptionInfo {
  uint32_t queue_limit = 0;  // granted
  std::string name_space;    // the namespace seen ("" = all)
};

}  // namespace kvd::client
