// The arena segments each namespace holds unevictable: segments with a chunk pinned by a lease,
// or with an open reservation. In a segmented arena such a segment cannot be emptied and go to
// another namespace whatever its free bytes, so HostTier's reserved_bytes and pinned_bytes
// quotas count it whole (see kvd/storage/quotas.h). Private to storage/. Not thread-safe (used
// under HostTier's mutex).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace kvd::storage {

class SegmentHolds {
 public:
  explicit SegmentHolds(uint32_t segments) : holds_(segments, 0) {}

  // One more / one less hold of `segment` by namespace `ns` (every block of a segment is of one
  // namespace).
  void Add(uint32_t segment, const std::string& ns) {
    if (holds_.at(segment)++ == 0) per_ns_[ns]++;
  }
  void Remove(uint32_t segment, const std::string& ns) {
    if (--holds_.at(segment) > 0) return;
    auto it = per_ns_.find(ns);
    if (it != per_ns_.end() && --it->second == 0) per_ns_.erase(it);
  }
  bool Held(uint32_t segment) const { return holds_.at(segment) > 0; }
  // Segments `ns` holds.
  uint32_t HeldBy(const std::string& ns) const {
    auto it = per_ns_.find(ns);
    return it == per_ns_.end() ? 0 : it->second;
  }

 private:
  std::vector<uint32_t> holds_;
  std::unordered_map<std::string, uint32_t> per_ns_;
};

}  // namespace kvd::storage
