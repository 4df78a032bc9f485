// Shared helpers of the storage tests.
#pragma once

#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvd/common/hash.h"
#include "kvd/storage/chunk.h"
#include "kvd/storage/chunk_events.h"

namespace kvd::storage::testing {

// A 64-byte aligned heap buffer standing in for the daemon's transport-registered region.
class AlignedRegion {
 public:
  explicit AlignedRegion(size_t bytes, size_t alignment = 64)
      : data_(static_cast<std::byte*>(std::aligned_alloc(alignment, RoundUp(bytes, alignment)))),
        size_(bytes) {}
  ~AlignedRegion() { std::free(data_); }
  AlignedRegion(const AlignedRegion&) = delete;
  AlignedRegion& operator=(const AlignedRegion&) = delete;
  std::span<std::byte> span() { return {data_, size_}; }
  std::byte* data() { return data_; }

 private:
  static size_t RoundUp(size_t v, size_t a) { return (v + a - 1) / a * a; }
  std::byte* data_;
  size_t size_;
};

inline ChunkKey MakeKey(uint64_t n, std::string model = "llama", std::string ns = "default") {
  return ChunkKey{std::move(ns), std::move(model), 0xabcdef, kRawCodecId, Hash128{n, ~n}};
}

// Records every chunk event as "kind(reason) tier hi bytes" (called under a tier's lock, like
// the daemon's hub).
class Recorder final : public ChunkEventListener {
 public:
  void OnChunkEvent(const ChunkEvent& e) override {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::string(ChunkEventKindName(e.kind)) +
                      (e.reason == RemoveReason::kNone
                           ? ""
                           : "(" + std::string(RemoveReasonName(e.reason)) + ")") +
                      " " + std::string(TierKindName(e.tier)) + " " +
                      std::to_string(e.key.chain_hash.hi) + " " + std::to_string(e.bytes));
  }
  std::vector<std::string> Take() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::exchange(events_, {});
  }

 private:
  std::mutex mu_;
  std::vector<std::string> events_;
};

inline std::vector<std::byte> RandomBytes(size_t n, uint32_t seed) {
  std::vector<std::byte> out(n);
  std::mt19937 rng(seed);
  for (auto& b : out) b = static_cast<std::byte>(rng());
  return out;
}

}  // namespace kvd::storage::testing

#include "kvd/storage/host_tier.h"

namespace kvd::storage::testing {

// Reserve + write + commit with the right checksum.
inline Status PutChunk(HostTier& tier, const ChunkKey& key, std::span<const std::byte> bytes,
                       uint32_t tokens = 256, OwnerId owner = 1) {
  KVD_ASSIGN_OR_RETURN(Reservation r, tier.Reserve(key, bytes.size(), tokens, owner));
  std::memcpy(r.data, bytes.data(), bytes.size());
  return tier.Commit(r.id, Checksum64(bytes.data(), bytes.size()));
}

// A request for chunks `first .. first+count-1` of MakeKey's chain.
inline LookupRequest ChainRequest(uint64_t first, uint64_t count, std::string model = "llama",
                                  std::string ns = "default") {
  LookupRequest req;
  req.name_space = std::move(ns);
  req.model = std::move(model);
  req.layout_digest = 0xabcdef;
  for (uint64_t i = first; i < first + count; ++i) req.chunk_hashes.push_back(Hash128{i, ~i});
  return req;
}

inline bool Contains(const Status& s, std::string_view fragment) {
  return s.message().find(fragment) != std::string::npos;
}

}  // namespace kvd::storage::testing
