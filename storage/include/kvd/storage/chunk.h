// What kvd stores: a chunk of KV cache, addressed by a ChunkKey, described by a ChunkMeta.
//
// A chunk holds the KV of `chunk_tokens` consecutive tokens (default 256) of one model layout, in
// one codec (raw or a compressed form). Its key names everything that must match for two chunks
// to be interchangeable (see docs/architecture.md "Addressing").
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "kvd/common/hash.h"

namespace kvd::storage {

// Where a chunk lives.
enum class TierKind : uint8_t { kGpu = 0, kHost = 1, kDisk = 2 };
// "gpu", "host", "disk".
std::string_view TierKindName(TierKind kind);

// Codec id of uncompressed KV in the raw chunk layout of common/layout.h.
inline constexpr uint32_t kRawCodecId = 0;

// The address of a chunk: (namespace, model, layout digest, codec id, chain hash of the chunk's
// last block). A value type; cheap to copy for small strings. Thread-compatible.
struct ChunkKey {
  std::string name_space;      // tenant / namespace ("default" by convention)
  std::string model;           // model name as registered in the topology
  uint64_t layout_digest = 0;  // ModelLayout::Digest()
  uint32_t codec_id = kRawCodecId;
  Hash128 chain_hash;  // chain hash of the LAST block of the chunk

  bool operator==(const ChunkKey&) const = default;
  // "ns/model/layout=0123456789abcdef/codec=0/<32 hex digits>": stable, used in messages and logs.
  std::string ToString() const;
  // Deterministic 64-bit hash of every field (not seeded per process).
  uint64_t Hash() const;
};

struct ChunkKeyHasher {
  size_t operator()(const ChunkKey& k) const { return static_cast<size_t>(k.Hash()); }
};

// Description of a stored (committed) chunk. Times are kvd::Clock nanoseconds (monotonic, this
// process); `created_ns` of a chunk restored from disk is the time it was restored.
struct ChunkMeta {
  ChunkKey key;
  uint32_t tokens = 0;         // tokens of KV the chunk holds
  uint64_t size_bytes = 0;     // payload bytes (not counting arena alignment padding)
  uint64_t checksum = 0;       // Checksum64 (xxh3-64, seed 0) of the payload bytes
  int64_t created_ns = 0;      // commit time
  int64_t last_access_ns = 0;  // last lookup hit or read
  TierKind tier = TierKind::kHost;
};

// Selects chunks for List and Evict. Unset fields match everything; `key`, when set, matches
// exactly that chunk (the other fields must then agree with it or nothing matches).
struct ChunkFilter {
  std::optional<std::string> name_space;
  std::optional<std::string> model;
  std::optional<ChunkKey> key;

  static ChunkFilter All() { return {}; }
  static ChunkFilter Namespace(std::string ns);
  static ChunkFilter Model(std::string model);
  static ChunkFilter Key(ChunkKey key);
  bool Matches(const ChunkKey& key) const;
  // "all", "namespace=x", "model=y namespace=x", "key=...".
  std::string ToString() const;
};

}  // namespace kvd::storage
