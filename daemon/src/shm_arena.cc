#include "shm_arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "kvd/common/logging.h"

namespace kvd::daemon {
namespace {

std::string Errno(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

// A memfd of `size` bytes, or -1 (errno set).
int NewSegmentFd(uint32_t segment, uint64_t size) {
  const std::string name = "kvd-arena-" + std::to_string(segment);
  int fd = ::memfd_create(name.c_str(), MFD_CLOEXEC);
  if (fd < 0) return -1;
  // A memfd starts mode 0777: any user holding a read-only descriptor could re-open it
  // read-write through /proc/<pid>/fd. 0600 leaves that to the daemon's own user.
  if (::fchmod(fd, S_IRUSR | S_IWUSR) != 0 || ::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    const int e = errno;
    ::close(fd);
    errno = e;
    return -1;
  }
  return fd;
}

}  // namespace

StatusOr<std::unique_ptr<ShmArena>> ShmArena::Create(uint64_t capacity, uint64_t segment_bytes) {
  const long page = ::sysconf(_SC_PAGESIZE);
  const uint64_t p = page > 0 ? static_cast<uint64_t>(page) : 4096;
  if (capacity == 0 || segment_bytes == 0 || capacity % p != 0 || segment_bytes % p != 0) {
    return Status::InvalidArgument("shared-memory arena: capacity " + std::to_string(capacity) +
                                   " and segment " + std::to_string(segment_bytes) +
                                   " bytes must be non-zero multiples of the page size " +
                                   std::to_string(p));
  }
  std::unique_ptr<ShmArena> arena(new ShmArena());
  void* range =
      ::mmap(nullptr, capacity, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (range == MAP_FAILED) {
    return Status::ResourceExhausted(Errno("shared-memory arena: reserving the address range"));
  }
  arena->base_ = static_cast<std::byte*>(range);
  arena->capacity_ = capacity;
  arena->segment_bytes_ = segment_bytes;
  for (uint64_t start = 0; start < capacity; start += segment_bytes) {
    const uint32_t index = static_cast<uint32_t>(arena->segments_.size());
    const uint64_t size = std::min(segment_bytes, capacity - start);
    Segment seg;
    seg.size = size;
    seg.fd = NewSegmentFd(index, size);
    if (seg.fd < 0) return Status::ResourceExhausted(Errno("shared-memory arena: memfd_create"));
    arena->segments_.push_back(seg);  // owned now: the destructor closes it
    if (::mmap(arena->base_ + start, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, seg.fd,
               0) == MAP_FAILED) {
      return Status::ResourceExhausted(Errno("shared-memory arena: mapping a segment"));
    }
  }
  return arena;
}

ShmArena::~ShmArena() {
  for (const Segment& s : segments_) {
    if (s.fd >= 0) ::close(s.fd);
  }
  if (base_ != nullptr) ::munmap(base_, capacity_);
}

StatusOr<ShmArena::SegmentFd> ShmArena::DupSegment(uint32_t segment, bool read_only) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (segment >= segments_.size()) {
    return Status::InvalidArgument("arena segment " + std::to_string(segment) + " out of range");
  }
  const Segment& s = segments_[segment];
  int fd = -1;
  if (read_only) {
    // A dup would share the read-write open file description; a re-open makes a read-only one.
    const std::string path = "/proc/self/fd/" + std::to_string(s.fd);
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return Status::Internal(Errno("read-only re-open of an arena segment"));
  } else {
    fd = ::fcntl(s.fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return Status::Internal(Errno("dup of an arena segment"));
  }
  return SegmentFd{fd, s.generation, s.size};
}

void ShmArena::OnSegmentReleased(uint32_t segment) {
  std::lock_guard<std::mutex> lock(mu_);
  if (segment >= segments_.size()) return;
  Segment& s = segments_[segment];
  int fd = NewSegmentFd(segment, s.size);
  if (fd < 0 || ::mmap(base_ + uint64_t{segment} * segment_bytes_, s.size, PROT_READ | PROT_WRITE,
                       MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
    KVD_LOG(ERROR) << "cannot replace the memory of a released arena segment; clients that "
                      "mapped it keep seeing it"
                   << Kv("segment", segment) << Kv("error", std::strerror(errno));
    if (fd >= 0) ::close(fd);
    return;
  }
  // The old pages go now, whoever still maps them (they read zeros from here on).
  ::fallocate(s.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(s.size));
  ::close(s.fd);
  s.fd = fd;
  ++s.generation;
  ++replacements_;
}

uint64_t ShmArena::replacements() const {
  std::lock_guard<std::mutex> lock(mu_);
  return replacements_;
}

}  // namespace kvd::daemon
