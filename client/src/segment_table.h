// This client's mappings of kvd's shared-memory arena: the segments of its namespace, mapped
// from the memfds kvd passes with its replies, shared by the shared-memory path (shm_path.h)
// and the zero-copy views and slots (in_place.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "kvd/client/types.h"
#include "kvd/common/status.h"

namespace kvd::client::internal {

// One mapping of an arena segment (read-only, plus the puts' writable view when there is one),
// unmapped (and unpinned) when the client's segment table and every view and slot into it have
// let go: a view outlives a remap of its segment and its Client without its bytes vanishing.
struct SegmentMapping {
  SegmentMapping(std::byte* d, std::byte* w, uint64_t s) : data(d), writable(w), size(s) {}
  ~SegmentMapping();
  SegmentMapping(const SegmentMapping&) = delete;
  SegmentMapping& operator=(const SegmentMapping&) = delete;
  std::byte* const data;
  std::byte* const writable;  // null: none
  const uint64_t size;
  bool pinned = false;  // page-locked for device copies (device.h); set under ClientImpl::mu_
};

// Makes the pages under [slot, slot + bytes) of a segment mapping writable, or read-only again.
// kvd page-aligns slots, so these pages hold this slot only. INTERNAL with the kernel's reason
// when it refuses (EACCES: the segment came as a read-only descriptor).
Status ProtectSlot(std::byte* slot, uint64_t bytes, bool writable);

// Not thread-safe: used under the owning ClientImpl's mutex.
class SegmentTable {
 public:
  // `writable_view`: map every segment a second time, read-write, for puts
  // (ClientOptions::shm_writable_view on a session that may put).
  explicit SegmentTable(bool writable_view) : writable_view_(writable_view) {}
  // Puts may write through the writable view (WritableSlot), as constructed.
  bool writable_view() const { return writable_view_; }

  // Maps arena segment `segment` of `generation` from its memfd `fd` (taken: closed here),
  // read-only (plus the writable view), in place of an earlier mapping of that index.
  // INTERNAL for a memfd without a size; RESOURCE_EXHAUSTED when mmap refuses.
  Status Map(int fd, uint32_t segment, uint64_t generation);
  // The address of [offset, offset + bytes) in the read-only mapping of `segment`, its pages
  // mapped in unless `populate` is false (a put writing through the writable view does not read
  // the read-only mapping). INTERNAL for a segment or generation not mapped, or a slot outside.
  StatusOr<std::byte*> Slot(uint32_t segment, uint64_t generation, uint64_t offset, uint64_t bytes,
                            bool populate = true);
  // The writable view of [offset, offset + bytes) of a mapped segment (its page tables filled
  // on first use), or null when the segment has none. REQUIRES: Slot accepted the range.
  std::byte* WritableSlot(uint32_t segment, uint64_t offset, uint64_t bytes);
  // Page-locks a mapped segment the first time a device buffer is copied to or from it (best
  // effort: an unpinned segment still works, the driver stages the copy).
  void Pin(uint32_t segment);
  // The mapping of a mapped segment, to share with a view or slot into it. REQUIRES: mapped.
  const std::shared_ptr<SegmentMapping>& mapping(uint32_t segment) const {
    return segments_.at(segment).mapping;
  }
  std::vector<SharedSegment> List() const;
  // Lets go of every mapping (unmapped unless a view or slot still holds it).
  void Clear() { segments_.clear(); }

 private:
  struct MappedSegment {
    uint64_t generation = 0;
    bool pin_tried = false;  // page-locked for device copies on first use (device.h)
    // Owns the mappings (read-only `data`; `writable`, the segment mapped a second time,
    // read-write, for puts only: null when off, or when that mapping failed); shared with the
    // views and slots into the segment.
    std::shared_ptr<SegmentMapping> mapping;
    std::vector<bool> populated;  // per kPopulateGranule (segment_table.cc): page tables filled
    std::vector<bool> writable_populated;  // as `populated`, for mapping->writable
  };

  const bool writable_view_;
  std::map<uint32_t, MappedSegment> segments_;
};

}  // namespace kvd::client::internal
