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
// Handover: a segment's memory holds the bytes of the namespace that used it last, also while
// the segment is free. When HostTier is about to give a free segment to ANOTHER namespace
// (SegmentListener::OnSegmentHandover), the segment gets a NEW memfd, mapped over the old range
// (MAP_FIXED: the daemon's addresses do not change), and the old memfd's pages are punched out
// and its fd closed. Clients of the old namespace still mapping the old memfd see zeros there and
// never the bytes the new namespace writes (those go to the new memfd); the new namespace's
// clients only ever get the new memfd. Each replacement bumps the segment's generation, so a
// session knows its client needs the new fd. A segment taken back by the namespace that used it
// last keeps its memfd and generation: its clients' mappings (and filled page tables) stay valid
// and nothing is allocated, zeroed or freed (the memory holds that namespace's own old bytes,
// which only its own clients could map anyway).
//
// Spare segments: a fresh memfd's pages would be allocated and zeroed as the clients' puts first
// touch them, i.e. on the put path, after every handover; and freeing the old memfd's pages
// (64 MiB by default) would hold the tier's lock (the handover runs inside a Reserve). So, with
// `spare_segments` > 0, a background thread keeps that many memfds of segment_bytes with every page
// allocated (fallocate) ready, and a replacement takes one (when none is ready, it creates a fresh
// one as before). The same thread punches out and closes the replaced memfds, off the tier's lock;
// until it has, clients of the old namespace that still map the old memfd may read its old bytes
// (their own), never another namespace's. Each spare is segment_bytes of resident memory on top of
// the arena.
//
// Thread safety: thread-safe (one mutex). OnSegmentHandover runs under the tier's lock.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "kvd/common/status.h"
#include "kvd/storage/host_tier.h"

namespace kvd::daemon {

class ShmArena final : public storage::SegmentListener {
 public:
  // `capacity` and `segment_bytes` multiples of the page size (segment_bytes > 0). Maps every
  // segment; memory is committed lazily (or by the daemon's prefault pass). `spare_segments`:
  // prepared memfds kept ready for replacements (see above; 0 = none, no thread).
  // INVALID_ARGUMENT (sizes), RESOURCE_EXHAUSTED (memfd_create / mmap failed, with errno text).
  static StatusOr<std::unique_ptr<ShmArena>> Create(uint64_t capacity, uint64_t segment_bytes,
                                                    uint32_t spare_segments = 0);
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
  // The generation DupSegment would give now, without a descriptor (a session whose client
  // already maps that generation sends none). INVALID_ARGUMENT for a segment out of range.
  StatusOr<uint64_t> Generation(uint32_t segment) const;

  // SegmentListener: swaps in a spare or fresh memfd (see Handover above). If the kernel refuses
  // (memfd_create or mmap fails), RESOURCE_EXHAUSTED with the errno text: the old memfd stays,
  // the generation does not change, and HostTier fails the Reserve that asked (so the segment
  // never passes to the new namespace with the old one's memory). INVALID_ARGUMENT for a
  // segment out of range.
  Status OnSegmentHandover(uint32_t segment) override;

  // Times a segment's memory was replaced (handovers), and how many of those took a prepared
  // spare (for stats and tests).
  uint64_t replacements() const;
  uint64_t spares_used() const;

  // Blocks until the background thread has retired every replaced memfd and holds
  // `spare_segments` spares (or gave up preparing them). For tests; returns at once without spares.
  void WaitForSpares() const;

 private:
  ShmArena() = default;
  void SpareLoop();
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
  uint64_t spares_used_ = 0;       // GUARDED_BY(mu_)
  uint32_t spare_target_ = 0;
  std::vector<int> spares_;     // GUARDED_BY(mu_): memfds of segment_bytes_, pages allocated
  std::vector<int> retired_;    // GUARDED_BY(mu_): replaced memfds to punch out and close
  bool busy_ = false;           // GUARDED_BY(mu_): the thread works outside the lock
  bool stop_ = false;           // GUARDED_BY(mu_)
  bool spares_failed_ = false;  // GUARDED_BY(mu_): preparing a spare failed; none are made
  mutable std::condition_variable work_cv_;  // wakes the thread
  mutable std::condition_variable idle_cv_;  // wakes WaitForSpares
  std::thread spare_thread_;
};

}  // namespace kvd::daemon
