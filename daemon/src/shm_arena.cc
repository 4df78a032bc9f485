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

// Gives up `fd` after a failed call: closes it, keeping that call's errno. Returns -1.
int CloseKeepingErrno(int fd) {
  const int e = errno;
  ::close(fd);
  errno = e;
  return -1;
}

// A memfd of `size` bytes named `name`, or -1 (errno set).
int NewMemfd(const std::string& name, uint64_t size) {
  int fd = ::memfd_create(name.c_str(), MFD_CLOEXEC);
  if (fd < 0) return -1;
  // A memfd starts mode 0777: any user holding a read-only descriptor could re-open it
  // read-write through /proc/<pid>/fd. 0600 leaves that to the daemon's own user.
  if (::fchmod(fd, S_IRUSR | S_IWUSR) != 0 || ::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    return CloseKeepingErrno(fd);
  }
  return fd;
}

int NewSegmentFd(uint32_t segment, uint64_t size) {
  return NewMemfd("kvd-arena-" + std::to_string(segment), size);
}

// A memfd of `size` bytes whose every page is allocated (and zeroed by the kernel), or -1.
int NewSpareFd(uint64_t size) {
  int fd = NewMemfd("kvd-arena-spare", size);
  if (fd < 0) return -1;
  if (::fallocate(fd, 0, 0, static_cast<off_t>(size)) != 0) return CloseKeepingErrno(fd);
  return fd;
}

// Frees the pages of a replaced memfd (whoever still maps it reads zeros) and closes it.
void RetireFd(int fd, uint64_t size) {
  ::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(size));
  ::close(fd);
}

}  // namespace

StatusOr<std::unique_ptr<ShmArena>> ShmArena::Create(uint64_t capacity, uint64_t segment_bytes,
                                                     uint32_t spare_segments) {
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
  arena->spare_target_ = spare_segments;
  if (spare_segments > 0) {
    ShmArena* a = arena.get();
    arena->spare_thread_ = std::thread([a] { a->SpareLoop(); });
  }
  return arena;
}

ShmArena::~ShmArena() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  if (spare_thread_.joinable()) spare_thread_.join();
  for (int fd : retired_) RetireFd(fd, segment_bytes_);
  for (int fd : spares_) ::close(fd);
  for (const Segment& s : segments_) {
    if (s.fd >= 0) ::close(s.fd);
  }
  if (base_ != nullptr) ::munmap(base_, capacity_);
}

void ShmArena::SpareLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [this] {
      return stop_ || !retired_.empty() || (!spares_failed_ && spares_.size() < spare_target_);
    });
    if (stop_) return;
    busy_ = true;
    if (!retired_.empty()) {
      // Replaced memfds first: their pages are memory the arena no longer uses.
      std::vector<int> retired;
      retired.swap(retired_);
      lock.unlock();
      for (int fd : retired) RetireFd(fd, segment_bytes_);
      lock.lock();
    } else {
      lock.unlock();
      const int fd = NewSpareFd(segment_bytes_);
      const int err = errno;
      lock.lock();
      if (fd >= 0) {
        spares_.push_back(fd);
      } else {
        spares_failed_ = true;
        KVD_LOG(WARNING) << "cannot prepare a spare arena segment; segments handed over to another "
                            "namespace get fresh memory whose pages the next put faults in"
                         << Kv("bytes", segment_bytes_) << Kv("error", std::strerror(err));
      }
    }
    busy_ = false;
    idle_cv_.notify_all();
  }
}

void ShmArena::WaitForSpares() const {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [this] {
    return spare_target_ == 0 || stop_ ||
           (!busy_ && retired_.empty() && (spares_failed_ || spares_.size() >= spare_target_));
  });
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

StatusOr<uint64_t> ShmArena::Generation(uint32_t segment) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (segment >= segments_.size()) {
    return Status::InvalidArgument("arena segment " + std::to_string(segment) + " out of range");
  }
  return segments_[segment].generation;
}

Status ShmArena::OnSegmentHandover(uint32_t segment) {
  std::lock_guard<std::mutex> lock(mu_);
  if (segment >= segments_.size()) {
    return Status::InvalidArgument("arena segment " + std::to_string(segment) + " out of range");
  }
  Segment& s = segments_[segment];
  // A spare has segment_bytes_; the arena's last segment may be shorter and gets a fresh memfd.
  const bool spare = s.size == segment_bytes_ && !spares_.empty();
  int fd = -1;
  if (spare) {
    fd = spares_.back();
    spares_.pop_back();
  } else {
    fd = NewSegmentFd(segment, s.size);
  }
  if (fd < 0 || ::mmap(base_ + uint64_t{segment} * segment_bytes_, s.size, PROT_READ | PROT_WRITE,
                       MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
    const Status error = Status::ResourceExhausted(
        Errno("cannot give an arena segment fresh memory for another namespace"));
    if (spare && fd >= 0) {
      spares_.push_back(fd);
    } else if (fd >= 0) {
      ::close(fd);
    }
    return error;
  }
  if (spare_thread_.joinable()) {
    // The old pages go shortly, on the spare thread (they then read zeros to whoever maps them).
    retired_.push_back(s.fd);
    work_cv_.notify_one();
  } else {
    RetireFd(s.fd, s.size);
  }
  s.fd = fd;
  ++s.generation;
  ++replacements_;
  if (spare) ++spares_used_;
  return Status::Ok();
}

uint64_t ShmArena::replacements() const {
  std::lock_guard<std::mutex> lock(mu_);
  return replacements_;
}

uint64_t ShmArena::spares_used() const {
  std::lock_guard<std::mutex> lock(mu_);
  return spares_used_;
}

}  // namespace kvd::daemon
