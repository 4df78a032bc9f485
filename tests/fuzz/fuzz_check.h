// Helpers of the fuzz targets. Invariant checks: a broken invariant is a finding, reported like a
// crash (libFuzzer writes the input that broke it as the reproducer).
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#define KVD_FUZZ_CHECK(cond, ...)                                                            \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      std::fprintf(stderr, "%s:%d: fuzz invariant broken: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                                     \
      std::fprintf(stderr, "\n");                                                            \
      std::abort();                                                                          \
    }                                                                                        \
  } while (0)

namespace kvd::fuzz {

// Bytes for a parser that reads a path: an anonymous memfd holding `data`, read through
// /proc/self/fd (nothing is created in any file system). Closes the fd when destroyed.
class MemFile {
 public:
  MemFile(const void* data, size_t size) : fd_(::memfd_create("kvd-fuzz", MFD_CLOEXEC)) {
    KVD_FUZZ_CHECK(fd_ >= 0, "memfd_create failed");
    const auto* p = static_cast<const uint8_t*>(data);
    for (size_t done = 0; done < size;) {
      const ssize_t n = ::write(fd_, p + done, size - done);
      KVD_FUZZ_CHECK(n > 0, "write to memfd failed");
      done += static_cast<size_t>(n);
    }
  }
  ~MemFile() { ::close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  int fd_;
};

}  // namespace kvd::fuzz
