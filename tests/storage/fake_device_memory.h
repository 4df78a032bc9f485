// A DeviceMemory in host memory with fault injection: the seam that lets the GPU tier's logic run
// in tests on machines without a GPU. Counts every copy by direction.
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>

#include "kvd/storage/device_memory.h"

namespace kvd::storage::testing {

class FakeDeviceMemory final : public DeviceMemory {
 public:
  // `free_bytes`: what Allocate may hand out in total (RESOURCE_EXHAUSTED beyond).
  explicit FakeDeviceMemory(uint64_t free_bytes = uint64_t{1} << 30) : free_(free_bytes) {}
  ~FakeDeviceMemory() override {
    for (void* p : live_) std::free(p);
  }

  std::string Describe() const override { return "fake"; }

  StatusOr<void*> Allocate(uint64_t bytes) override {
    if (bytes == 0) return Status::InvalidArgument("device allocation of 0 bytes");
    std::lock_guard<std::mutex> lock(mu_);
    if (bytes > free_) {
      return Status::ResourceExhausted("fake device: " + std::to_string(bytes) + " bytes asked, " +
                                       std::to_string(free_) + " free");
    }
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    free_ -= bytes;
    live_.insert(p);
    return p;
  }
  Status Free(void* p) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (live_.erase(p) == 0) return Status::NotFound("not a fake device allocation");
    std::free(p);
    return Status::Ok();
  }
  Status CopyToDevice(void* dst, const void* src, size_t n) override {
    return Copy(dst, src, n, h2d);
  }
  Status CopyToHost(void* dst, const void* src, size_t n) override {
    return Copy(dst, src, n, d2h);
  }
  Status CopyOnDevice(void* dst, const void* src, size_t n) override {
    return Copy(dst, src, n, d2d);
  }

  // Allocations not yet freed.
  size_t live_count() {
    std::lock_guard<std::mutex> lock(mu_);
    return live_.size();
  }

  // The next `n` copies fail with INTERNAL.
  void FailNextCopies(int n) { fail_copies = n; }

  std::atomic<int> h2d{0}, d2h{0}, d2d{0};
  std::atomic<int> fail_copies{0};

 private:
  Status Copy(void* dst, const void* src, size_t n, std::atomic<int>& counter) {
    if (fail_copies.load() > 0) {
      fail_copies--;
      return Status::Internal("fake device: injected copy failure");
    }
    counter++;
    if (n > 0) std::memcpy(dst, src, n);
    return Status::Ok();
  }

  std::mutex mu_;
  uint64_t free_;         // GUARDED_BY(mu_)
  std::set<void*> live_;  // GUARDED_BY(mu_)
};

}  // namespace kvd::storage::testing
