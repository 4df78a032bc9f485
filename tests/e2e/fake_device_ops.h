// A stand-in for CUDA device memory in host-only tests of the client's staging logic
// (kvd/client/device.h): "device" buffers are host pages kept PROT_NONE except while the fake
// copies to or from them, so any host read or write of a device pointer that bypasses the copy
// ops (a memcpy, a checksum) crashes the test instead of passing silently.
#pragma once

#include <sys/mman.h>

#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <vector>

#include "kvd/client/device.h"

namespace kvd::e2e {

class FakeDeviceOps final : public client::DeviceMemoryOps {
 public:
  struct Copy {
    bool to_device = false;
    size_t bytes = 0;
    void* stream = nullptr;
  };

  ~FakeDeviceOps() override {
    for (auto& [p, n] : buffers_) ::munmap(p, n);
  }

  // A "device" buffer of `bytes` (rounded up to pages), PROT_NONE until a copy touches it.
  void* Allocate(size_t bytes) {
    const size_t n = (bytes + 4095) / 4096 * 4096;
    void* p = ::mmap(nullptr, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    buffers_[static_cast<std::byte*>(p)] = n;
    return p;
  }
  // Test-side access (the engine's own kernels, in a real process).
  void Write(void* device, const void* host, size_t bytes) { Access(device, host, bytes, true); }
  void Read(void* host, const void* device, size_t bytes) {
    Access(const_cast<void*>(device), host, bytes, false);
  }

  StatusOr<client::BufferLocation> Locate(const void* p) const override {
    std::lock_guard<std::mutex> lock(mu_);
    return Find(p) != nullptr ? client::BufferLocation::kCuda : client::BufferLocation::kHost;
  }
  Status CanCopy() const override { return can_copy; }
  Status CopyToHost(void* host_dst, const void* src, size_t bytes, void* stream) const override {
    if (IsDevice(host_dst) || !IsDevice(src)) {
      return Status::Internal("fake: CopyToHost with a host source or a device destination");
    }
    Access(const_cast<void*>(src), host_dst, bytes, false);
    std::lock_guard<std::mutex> lock(mu_);
    copies_.push_back({false, bytes, stream});
    return Status::Ok();
  }
  Status CopyToDevice(void* dst, const void* host_src, size_t bytes, void* stream) const override {
    if (!IsDevice(dst) || IsDevice(host_src)) {
      return Status::Internal("fake: CopyToDevice with a host destination or a device source");
    }
    Access(dst, host_src, bytes, true);
    std::lock_guard<std::mutex> lock(mu_);
    copies_.push_back({true, bytes, stream});
    return Status::Ok();
  }
  Status Pin(void* p, size_t bytes) const override {
    std::lock_guard<std::mutex> lock(mu_);
    pinned_[p] = bytes;
    ++pins_;
    return Status::Ok();
  }
  void Unpin(void* p) const override {
    std::lock_guard<std::mutex> lock(mu_);
    pinned_.erase(p);
  }

  std::vector<Copy> copies() const {
    std::lock_guard<std::mutex> lock(mu_);
    return copies_;
  }
  void ClearCopies() {
    std::lock_guard<std::mutex> lock(mu_);
    copies_.clear();
  }
  size_t pinned_now() const {
    std::lock_guard<std::mutex> lock(mu_);
    return pinned_.size();
  }
  int pins() const {
    std::lock_guard<std::mutex> lock(mu_);
    return pins_;
  }

  Status can_copy;  // what CanCopy answers (OK: a CUDA build with a device)

 private:
  // The buffer holding p, or null. REQUIRES mu_.
  const std::pair<std::byte* const, size_t>* Find(const void* p) const {
    auto b = static_cast<const std::byte*>(p);
    auto it = buffers_.upper_bound(const_cast<std::byte*>(b));
    if (it == buffers_.begin()) return nullptr;
    --it;
    return b < it->first + it->second ? &*it : nullptr;
  }
  bool IsDevice(const void* p) const {
    std::lock_guard<std::mutex> lock(mu_);
    return Find(p) != nullptr;
  }
  // Opens the buffer around `device` for the copy, then closes it again.
  void Access(void* device, const void* host_src_or_dst, size_t bytes, bool to_device) const {
    std::lock_guard<std::mutex> lock(mu_);
    const auto* b = Find(device);
    if (b == nullptr) return;
    ::mprotect(b->first, b->second, PROT_READ | PROT_WRITE);
    if (to_device) {
      std::memcpy(device, host_src_or_dst, bytes);
    } else {
      std::memcpy(const_cast<void*>(host_src_or_dst), device, bytes);
    }
    ::mprotect(b->first, b->second, PROT_NONE);
  }

  mutable std::mutex mu_;
  std::map<std::byte*, size_t> buffers_;
  mutable std::vector<Copy> copies_;
  mutable std::map<void*, size_t> pinned_;
  mutable int pins_ = 0;
};

}  // namespace kvd::e2e
