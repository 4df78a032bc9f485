// The arena segments this client has mapped (segment_table.h).
#include "segment_table.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "kvd/client/device.h"

namespace kvd::client::internal {
namespace {

// A segment's page tables are filled as its slots are first used, a granule at a time, not all
// at the first map: filling a whole 64 MiB segment (MAP_POPULATE) took 40-50 ms on a loaded
// 2-core box, a stall on whichever put or get first touched the segment. One
// MADV_POPULATE_READ per slot still spares the copy a fault per page (a write fault per 4 KiB
// page cost ~4x more here); shmem needs no write notification, so once ProtectSlot opens a
// slot for writing its PTEs are writable and a put's stores do not fault either.
constexpr uint64_t kPopulateGranule = uint64_t{256} << 10;

// Fills the page tables of the granules of [offset, offset + bytes) of `data` not filled yet
// (`filled`, one flag per granule), in one madvise call. Best effort: where the kernel lacks
// MADV_POPULATE_* (before Linux 5.14) the copy faults the pages in.
void PopulateGranules(std::byte* data, uint64_t size, std::vector<bool>& filled, uint64_t offset,
                      uint64_t bytes, int advice) {
  if (bytes == 0) return;
  const uint64_t first = offset / kPopulateGranule, last = (offset + bytes - 1) / kPopulateGranule;
  uint64_t from = last + 1, to = first;
  for (uint64_t g = first; g <= last; ++g) {
    if (!filled[g]) {
      from = std::min(from, g);
      to = std::max(to, g);
    }
  }
  if (from > to) return;
  const uint64_t begin = from * kPopulateGranule;
  const uint64_t end = std::min(size, (to + 1) * kPopulateGranule);
  ::madvise(data + begin, end - begin, advice);
  for (uint64_t g = from; g <= to; ++g) filled[g] = true;
}

}  // namespace

Status ProtectSlot(std::byte* slot, uint64_t bytes, bool writable) {
  if (bytes == 0) return Status::Ok();
  static const uintptr_t page = static_cast<uintptr_t>(std::max<long>(::sysconf(_SC_PAGESIZE), 1));
  const uintptr_t start = reinterpret_cast<uintptr_t>(slot) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(slot) + bytes + page - 1) & ~(page - 1);
  if (::mprotect(reinterpret_cast<void*>(start), end - start,
                 writable ? PROT_READ | PROT_WRITE : PROT_READ) != 0) {
    return Status::Internal(std::string("making a shared-memory slot ") +
                            (writable ? "writable" : "read-only") + ": " + std::strerror(errno));
  }
  return Status::Ok();
}

SegmentMapping::~SegmentMapping() {
  if (pinned) ActiveDeviceMemoryOps().Unpin(data);
  ::munmap(data, size);
  if (writable != nullptr) ::munmap(writable, size);
}

Status SegmentTable::Map(int fd, uint32_t segment, uint64_t generation) {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size <= 0) {
    ::close(fd);
    return Status::Internal("the arena memfd from kvd has no size");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  // Read-only: committed chunks are immutable here; a put opens its own slot (ProtectSlot).
  // The page tables are filled per slot (kPopulateGranule).
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  // The puts' writable view; without it (refused, or a read-only descriptor) puts take the
  // mprotect route.
  void* w = MAP_FAILED;
  if (p != MAP_FAILED && writable_view_) {
    w = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  ::close(fd);
  if (p == MAP_FAILED) {
    return Status::ResourceExhausted(std::string("mapping an arena segment of kvd: ") +
                                     std::strerror(err));
  }
  MappedSegment& seg = segments_[segment];
  seg = MappedSegment();  // an earlier mapping is let go (unmapped once no view holds it)
  seg.generation = generation;
  const uint64_t granules = (size + kPopulateGranule - 1) / kPopulateGranule;
  seg.populated.assign(granules, false);
  if (w != MAP_FAILED) seg.writable_populated.assign(granules, false);
  seg.mapping = std::make_shared<SegmentMapping>(
      static_cast<std::byte*>(p), w != MAP_FAILED ? static_cast<std::byte*>(w) : nullptr, size);
  return Status::Ok();
}

StatusOr<std::byte*> SegmentTable::Slot(uint32_t segment, uint64_t generation, uint64_t offset,
                                        uint64_t bytes, bool populate) {
  auto it = segments_.find(segment);
  if (it == segments_.end() || it->second.generation != generation) {
    return Status::Internal("kvd named arena segment " + std::to_string(segment) + " (generation " +
                            std::to_string(generation) + ") that this client has not mapped");
  }
  MappedSegment& seg = it->second;
  const SegmentMapping& m = *seg.mapping;
  if (offset > m.size || bytes > m.size - offset) {
    return Status::Internal("kvd named a slot outside arena segment " + std::to_string(segment));
  }
  if (populate) PopulateGranules(m.data, m.size, seg.populated, offset, bytes, MADV_POPULATE_READ);
  return m.data + offset;
}

std::byte* SegmentTable::WritableSlot(uint32_t segment, uint64_t offset, uint64_t bytes) {
  auto it = segments_.find(segment);
  if (it == segments_.end() || it->second.mapping->writable == nullptr) return nullptr;
  MappedSegment& seg = it->second;
  const SegmentMapping& m = *seg.mapping;
  // Write-populated: the copy's stores then take no fault at all.
  PopulateGranules(m.writable, m.size, seg.writable_populated, offset, bytes, MADV_POPULATE_WRITE);
  return m.writable + offset;
}

void SegmentTable::Pin(uint32_t segment) {
  auto it = segments_.find(segment);
  if (it == segments_.end() || it->second.pin_tried) return;
  it->second.pin_tried = true;
  SegmentMapping& m = *it->second.mapping;
  m.pinned = ActiveDeviceMemoryOps().Pin(m.data, m.size).ok();
}

std::vector<SharedSegment> SegmentTable::List() const {
  std::vector<SharedSegment> out;
  for (const auto& [index, seg] : segments_) {
    out.push_back(SharedSegment{index, seg.generation, seg.mapping->data, seg.mapping->size});
  }
  return out;
}

}  // namespace kvd::client::internal
