#include "kvd/storage/chunk.h"

#include <cinttypes>
#include <cstdio>

#include "kvd/storage/chunk_events.h"

namespace kvd::storage {

std::string_view TierKindName(TierKind kind) {
  switch (kind) {
    case TierKind::kGpu:
      return "gpu";
    case TierKind::kHost:
      return "host";
    case TierKind::kDisk:
      return "disk";
  }
  return "unknown";
}

std::string_view ChunkEventKindName(ChunkEventKind kind) {
  return kind == ChunkEventKind::kStored ? "stored" : "removed";
}

std::string_view RemoveReasonName(RemoveReason reason) {
  switch (reason) {
    case RemoveReason::kNone:
      return "";
    case RemoveReason::kEvicted:
      return "evicted";
    case RemoveReason::kAdmin:
      return "admin";
    case RemoveReason::kMoved:
      return "moved";
    case RemoveReason::kCorrupt:
      return "corrupt";
  }
  return "unknown";
}

std::string ChunkKey::ToString() const {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "/layout=%016" PRIx64 "/codec=%" PRIu32 "/", layout_digest,
                codec_id);
  std::string out;
  out.reserve(name_space.size() + model.size() + 96);
  out.append(name_space).append("/").append(model).append(buf).append(chain_hash.ToHex());
  return out;
}

uint64_t ChunkKey::Hash() const {
  // Fold every field through xxh3 (HashBytes) with the previous value as the seed.
  uint64_t h = 0x6b76645f63686b31ull;  // "kvd_chk1"
  h = HashBytes(name_space.data(), name_space.size(), h).lo;
  h = HashBytes(model.data(), model.size(), h).lo;
  const uint64_t words[4] = {layout_digest, codec_id, chain_hash.hi, chain_hash.lo};
  return HashBytes(words, sizeof(words), h).lo;
}

ChunkFilter ChunkFilter::Namespace(std::string ns) {
  ChunkFilter f;
  f.name_space = std::move(ns);
  return f;
}

ChunkFilter ChunkFilter::Model(std::string model) {
  ChunkFilter f;
  f.model = std::move(model);
  return f;
}

ChunkFilter ChunkFilter::Key(ChunkKey key) {
  ChunkFilter f;
  f.key = std::move(key);
  return f;
}

bool ChunkFilter::Matches(const ChunkKey& k) const {
  if (name_space && *name_space != k.name_space) return false;
  if (model && *model != k.model) return false;
  if (key && !(*key == k)) return false;
  return true;
}

std::string ChunkFilter::ToString() const {
  std::string out;
  auto add = [&out](std::string_view part) {
    if (!out.empty()) out += ' ';
    out += part;
  };
  if (name_space) add("namespace=" + *name_space);
  if (model) add("model=" + *model);
  if (key) add("key=" + key->ToString());
  return out.empty() ? "all" : out;
}

}  // namespace kvd::storage
