#include <algorithm>
#include <string>

#include "kvd/storage/arena.h"

namespace kvd::storage {

SegmentedArena::SegmentedArena(uint64_t capacity_bytes, uint64_t alignment,
                               uint64_t segment_bytes) {
  const uint64_t align = ArenaAllocator(0, alignment).alignment();
  segment_bytes_ = segment_bytes & ~(align - 1);
  if (segment_bytes_ >= capacity_bytes) segment_bytes_ = 0;
  if (segment_bytes_ == 0) {
    segments_.emplace_back(capacity_bytes, align);
  } else {
    for (uint64_t start = 0; start + align <= capacity_bytes; start += segment_bytes_) {
      segments_.emplace_back(std::min(segment_bytes_, capacity_bytes - start), align);
    }
  }
  last_owner_.resize(segments_.size());
  for (uint32_t i = 0; i < segments_.size(); ++i) {
    capacity_ += segments_[i].capacity();
    free_segments_.insert(i);
  }
}

uint32_t SegmentedArena::SegmentOf(uint64_t offset) const {
  return segment_bytes_ == 0 ? 0 : static_cast<uint32_t>(offset / segment_bytes_);
}

uint64_t SegmentedArena::SegmentStart(uint32_t segment) const {
  return uint64_t{segment} * segment_bytes_;
}

std::optional<SegmentedArena::Placement> SegmentedArena::Place(uint64_t bytes,
                                                               const std::string& ns) const {
  if (segment_bytes_ == 0) {
    if (!segments_[0].CanAllocate(bytes)) return std::nullopt;
    return Placement{0, false};
  }
  if (auto own = by_owner_.find(ns); own != by_owner_.end()) {
    for (uint32_t seg : own->second) {
      if (segments_[seg].CanAllocate(bytes)) return Placement{seg, false};
    }
  }
  // Free segments: the namespace's own last ones, then never used ones, then handovers. A free
  // segment is empty, so any of them has room unless the block exceeds its size.
  std::optional<Placement> never_used, handover;
  for (uint32_t seg : free_segments_) {
    if (!segments_[seg].CanAllocate(bytes)) continue;
    const std::string& last = last_owner_[seg];
    if (last == ns) return Placement{seg, false};
    if (last.empty()) {
      if (!never_used) never_used = Placement{seg, false};
    } else if (!handover) {
      handover = Placement{seg, true};
    }
  }
  return never_used ? never_used : handover;
}

std::optional<uint64_t> SegmentedArena::AllocateAt(const Placement& placement, uint64_t bytes,
                                                   const std::string& ns) {
  const uint32_t seg = placement.segment;
  if (seg >= segments_.size()) return std::nullopt;
  const bool was_free = segment_bytes_ != 0 && free_segments_.count(seg) != 0;
  if (segment_bytes_ != 0 && !was_free && last_owner_[seg] != ns) return std::nullopt;
  auto off = segments_[seg].Allocate(bytes);
  if (!off) return std::nullopt;
  allocated_ += segments_[seg].BlockSize(*off);
  if (was_free) {
    std::string& last = last_owner_[seg];
    if (last.empty()) {
      counters_.first_uses++;
    } else if (last == ns) {
      counters_.reuses++;
    } else {
      counters_.handovers++;
    }
    free_segments_.erase(seg);
    last = ns;
    auto& list = by_owner_[ns];
    list.insert(std::upper_bound(list.begin(), list.end(), seg), seg);
  }
  return SegmentStart(seg) + *off;
}

std::optional<uint64_t> SegmentedArena::Allocate(uint64_t bytes, const std::string& ns) {
  const std::optional<Placement> placement = Place(bytes, ns);
  if (!placement) return std::nullopt;
  return AllocateAt(*placement, bytes, ns);
}

Status SegmentedArena::Free(uint64_t offset, std::optional<uint32_t>* released_segment) {
  if (released_segment != nullptr) released_segment->reset();
  const uint32_t seg = SegmentOf(offset);
  if (seg >= segments_.size()) {
    return Status::NotFound("arena: offset " + std::to_string(offset) + " is past the region");
  }
  const uint64_t local = offset - SegmentStart(seg);
  const uint64_t size = segments_[seg].BlockSize(local);
  KVD_RETURN_IF_ERROR(segments_[seg].Free(local));
  allocated_ -= size;
  if (segment_bytes_ != 0 && segments_[seg].allocated_bytes() == 0) {
    const std::string& ns = last_owner_[seg];  // kept: the segment remembers it while free
    auto& list = by_owner_[ns];
    list.erase(std::find(list.begin(), list.end(), seg));
    if (list.empty()) by_owner_.erase(ns);
    free_segments_.insert(seg);
    if (released_segment != nullptr) *released_segment = seg;
  }
  return Status::Ok();
}

const std::string& SegmentedArena::SegmentOwner(uint32_t segment) const {
  static const std::string kFree;
  const std::string& last = last_owner_.at(segment);
  return free_segments_.count(segment) != 0 ? kFree : last;
}

bool SegmentedArena::CanAllocate(uint64_t bytes, const std::string& ns) const {
  return Place(bytes, ns).has_value();
}

uint64_t SegmentedArena::BlockSize(uint64_t offset) const {
  const uint32_t seg = SegmentOf(offset);
  if (seg >= segments_.size()) return 0;
  return segments_[seg].BlockSize(offset - SegmentStart(seg));
}

ArenaStats SegmentedArena::Stats() const {
  ArenaStats total;
  for (const auto& s : segments_) {
    const ArenaStats a = s.Stats();
    total.capacity_bytes += a.capacity_bytes;
    total.allocated_bytes += a.allocated_bytes;
    total.free_bytes += a.free_bytes;
    total.largest_free_block = std::max(total.largest_free_block, a.largest_free_block);
    total.free_blocks += a.free_blocks;
    total.allocated_blocks += a.allocated_blocks;
  }
  total.fragmentation = total.free_bytes == 0
                            ? 0.0
                            : 1.0 - static_cast<double>(total.largest_free_block) /
                                        static_cast<double>(total.free_bytes);
  return total;
}

Status SegmentedArena::CheckConsistency() const {
  uint64_t allocated = 0;
  for (uint32_t i = 0; i < segments_.size(); ++i) {
    KVD_RETURN_IF_ERROR(
        segments_[i].CheckConsistency().WithContext("segment " + std::to_string(i)));
    allocated += segments_[i].allocated_bytes();
    if (segment_bytes_ == 0) continue;
    const bool used = segments_[i].allocated_bytes() != 0;
    const bool is_free = free_segments_.count(i) != 0;
    if (used == is_free || (used && last_owner_[i].empty())) {
      return Status::Internal("arena: segment " + std::to_string(i) +
                              " ownership disagrees with its occupancy");
    }
    if (used) {
      auto it = by_owner_.find(last_owner_[i]);
      if (it == by_owner_.end() || std::count(it->second.begin(), it->second.end(), i) != 1) {
        return Status::Internal("arena: segment " + std::to_string(i) +
                                " missing from its namespace's list");
      }
    }
  }
  if (allocated != allocated_) {
    return Status::Internal("arena: segment totals " + std::to_string(allocated) +
                            " != allocated " + std::to_string(allocated_));
  }
  return Status::Ok();
}

}  // namespace kvd::storage
