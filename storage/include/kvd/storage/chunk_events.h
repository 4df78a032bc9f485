// Chunk events: every tier tells a listener when a committed chunk becomes visible in it
// ("stored") and when it stops being visible ("removed", with why). The daemon streams them to
// routers (KV-cache-aware routing) so they can track which node holds which prefix.
//
// Contract of a tier with a listener set (Tier::SetEventListener):
// - kStored once per chunk that becomes visible in the tier: a commit or insert, a promotion or
//   demotion INTO the tier, a chunk restored from disk at start is NOT announced (a subscriber
//   resyncs with List). A dedup (the key was already there) announces nothing.
// - kRemoved once per chunk that stops being visible in the tier (lookups no longer find it
//   there), whatever the reason; a chunk evicted while pinned is announced when it is hidden,
//   not when its memory is freed.
// - The listener is called with the tier's lock held, so the events of one tier come in the
//   order the tier applied them. OnChunkEvent must therefore be quick, must not call any tier
//   and must not fail.
#pragma once

#include <cstdint>
#include <string_view>

#include "kvd/storage/chunk.h"

namespace kvd::storage {

enum class ChunkEventKind : uint8_t { kStored = 0, kRemoved = 1 };

// Why a chunk left a tier (kRemoved only).
enum class RemoveReason : uint8_t {
  kNone = 0,     // a kStored event
  kEvicted = 1,  // least-recently-used eviction to make room (capacity or namespace quota)
  kAdmin = 2,    // an admin evict (kvdctl evict)
  kMoved = 3,    // taken out by the daemon: demoted to a lower tier, or a store rolled back
  kCorrupt = 4,  // the stored copy failed its checksum or vanished from the medium
};

// "stored" / "removed".
std::string_view ChunkEventKindName(ChunkEventKind kind);
// "" (kNone), "evicted", "admin", "moved", "corrupt".
std::string_view RemoveReasonName(RemoveReason reason);

struct ChunkEvent {
  ChunkEventKind kind = ChunkEventKind::kStored;
  RemoveReason reason = RemoveReason::kNone;
  TierKind tier = TierKind::kHost;
  ChunkKey key;
  uint32_t tokens = 0;
  uint64_t bytes = 0;  // payload bytes of the chunk in this tier
};

class ChunkEventListener {
 public:
  virtual ~ChunkEventListener() = default;
  // See the file comment (called under the tier's lock).
  virtual void OnChunkEvent(const ChunkEvent& event) = 0;
};

// Builds the event of `meta` in `tier` (helper of the tiers).
inline ChunkEvent MakeChunkEvent(ChunkEventKind kind, RemoveReason reason, TierKind tier,
                                 const ChunkMeta& meta) {
  return ChunkEvent{kind, reason, tier, meta.key, meta.tokens, meta.size_bytes};
}

}  // namespace kvd::storage
