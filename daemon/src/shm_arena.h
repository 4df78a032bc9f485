// ShmArena: the host tier's region in memfd shared memory, one memfd per arena segment, so that
// same-node clients can map the segments of their own namespace (and nothing else) and copy
// chunk bytes themselves. Private to daemon/.
//
// Layout: one contiguous virtual range (the HostTier's region) in which segment i
// ([i * segment_bytes, ...)) is a MAP_SHARED mapping of memfd i. HostTier assigns each segment to
// one namespace (HostTierOptions::segment_bytes); a session hands its client, over the unix
// socket (SCM_RIGHTS), the memfd of a segment only when a reservation or read of the client's
// namespace lies in it.
//
// Protection: the memfds are created mode 0600 (only the daemon's user may re-open them by
// path); reading sessions get read-only descriptors (DupSegment).
//
// Release: when a segment's last block goes (SegmentListener), the segment gets a NEW memfd,
// mapped over the old range (MAP_FIXED: the daemon's addresses do not change), and the old
// memfd's pages are punched out and its fd closed. Clients still mapping the old memfd see zeros
// there and never the bytes another namespace writes into the segment next. Each replacement
// bumps the segment's generation, so a session knows its client needs the new fd.
//
// Thread safety: thread-safe (one mutex). OnSegmentReleased runs under the tier's lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "kvd/common/status.h"
#include "kvd/storage/host_tier.h"

namespace kvd::daemon {

class ShmArena final : public storage::SegmentListener {
 public:
  // `capacity` and `segment_bytes` multiples of the page size (segment_bytes > 0). Maps every
  // segment; memory is committed lazily (or by the daemon's prefault pass).
  // INVALID_ARGUMENT (sizes), RESOURCE_EXHAUSTED (memfd_create / mmap failed, with errno text).
  static StatusOr<std::unique_ptr<ShmArena>> Create(uint64_t capacity, uint64_t segment_bytes);
  ~ShmArena() override;
  ShmArena(const ShmArena&) = delete;
  ShmArena& operator=(const ShmArena&) = delete;

  std::byte* base() const { return base_; }
  uint64_t capacity() const { return capacity_; }
  uint64_t segment_bytes() const { return segment_bytes_; }

  // A new descriptor (close-on-exec; the caller closes it) of segment `segment`'s memfd and its
  // generation. `read_only` false: a dup (read-write: the holder may map the segment writable).
  // `read_only` true: the memfd re-opened O_RDONLY through /proc/self/fd, a new open file
  // description whose holder can map the segment PROT_READ only (mmap or mprotect asking for
  // PROT_WRITE on it fails with EACCES). The memfds are mode 0600, so a holder running as
  // another user cannot re-open a read-only descriptor read-write through /proc either.
  // INVALID_ARGUMENT for a segment out of range, INTERNAL if dup / open fails.
  struct SegmentFd {
    int fd = -1;
    uint64_t generation = 0;
    uint64_t size = 0;
  };
  StatusOr<SegmentFd> DupSegment(uint32_t segment, bool read_only = false) const;

  // SegmentListener: swaps in a fresh memfd (see above). Logs (never fails) if the kernel refuses;
  // then the old memfd stays, and the segment's generation does not change.
  void OnSegmentReleased(uint32_t segment) override;

  // Times a segment's memory was replaced (for stats and tests).
  uint64_t replacements() const;

 private:
  ShmArena() = default;
  struct Segment {
    int fd = -1;
    uint64_t generation = 1;
    uint64_t size = 0;
  };
  std::byte* base_ = nullptr;
  uint64_t capacity_ = 0;
  uint64_t segment_bytes_ = 0;
  mutable std::mutex mu_;
  std::vector<Segment> segments_;  // GUARDED_BY(mu_)
  uint64_t replacements_ = 0;      // GUARDED_BY(mu_)
};

}  // namespace kvd::daemon
