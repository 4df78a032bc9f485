// Where an engine's buffer lives (host or CUDA device memory) and how libkvd_client moves bytes
// between the two. Every client entry point that takes a buffer pointer (Put/PutChunks,
// Get/GetChunks, the expansion in expand.h) accepts a plain pointer and classifies it here, in
// one place, so engines and the Python package (which passes DLPack data pointers) need no
// memory-kind argument.
//
//   host memory (pageable, pinned, managed)  -> used as it is;
//   CUDA device memory                       -> puts copy it to the daemon's host slot, gets copy
//                                               from the host slot to it, expansion runs on the
//                                               device (kernels on the caller's stream).
//
// Classification: a CUDA build asks cudaPointerGetAttributes (a process without a usable device
// has no device memory: host). A build without CUDA asks the driver (libcuda.so.1, loaded at
// run time when present) so that a device pointer is refused with UNIMPLEMENTED "built without
// CUDA" instead of being read as host memory (which would crash).
//
// Streams: `stream` is a cudaStream_t passed as void* (nullptr = the legacy default stream).
// Copies are queued on it after the caller's earlier work; the client waits for them before it
// uses the bytes (a put returns once its bytes left the device; a get returns once its bytes are
// on the device).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "kvd/common/status.h"

namespace kvd::client {

enum class BufferLocation { kHost, kCuda };
std::string_view BufferLocationName(BufferLocation l);  // "host", "cuda"

// The device-memory operations the client uses. The real one (CudaDeviceMemoryOps) wraps the
// CUDA runtime; tests put a fake behind the seam below to check the staging logic with host
// memory.
class DeviceMemoryOps {
 public:
  virtual ~DeviceMemoryOps() = default;
  // Where [p, p + 1) lives. Errors only for a pointer the driver knows but cannot describe.
  virtual StatusOr<BufferLocation> Locate(const void* p) const = 0;
  // OK when device buffers can be served (a CUDA build and a device); else the reason:
  // UNIMPLEMENTED "built without CUDA", UNAVAILABLE "no CUDA device".
  virtual Status CanCopy() const = 0;
  // cudaMemcpyAsync of `bytes` on `stream`, then waits for the stream. Errors name the copy.
  virtual Status CopyToHost(void* host_dst, const void* device_src, size_t bytes,
                            void* stream) const = 0;
  virtual Status CopyToDevice(void* device_dst, const void* host_src, size_t bytes,
                              void* stream) const = 0;
  // Page-locks [p, p + bytes) so copies to and from it are DMA transfers (best effort: callers
  // go on unpinned when it fails). Unpin undoes it.
  virtual Status Pin(void* p, size_t bytes) const = 0;
  virtual void Unpin(void* p) const = 0;
};

// The CUDA runtime's (or, in a build without CUDA, the refusing one). Never null.
const DeviceMemoryOps& CudaDeviceMemoryOps();

// The ops the client uses: CudaDeviceMemoryOps() unless a test installed others.
const DeviceMemoryOps& ActiveDeviceMemoryOps();
// Classifies with ActiveDeviceMemoryOps() and, for device memory, checks CanCopy(): the one
// check every entry point makes. `what` names the buffer in errors ("put data", ...).
StatusOr<BufferLocation> LocateForUse(const void* p, std::string_view what);

// Copies `bytes` from `src` (host or device memory, classified here) into host memory at
// `host_dst`: memcpy from host memory, DeviceMemoryOps::CopyToHost on `stream` from the device.
// Errors of LocateForUse and of the copy, naming `what`.
Status CopyToHostFrom(void* host_dst, const void* src, size_t bytes, void* stream,
                      std::string_view what);
// The other way: host memory at `host_src` into `dst` (host or device memory).
Status CopyFromHostTo(void* dst, const void* host_src, size_t bytes, void* stream,
                      std::string_view what);

// A growable host buffer page-locked for device copies (the client's staging buffers over the
// transport). Pinning is best effort: the buffer works unpinned when the ops cannot pin it.
// Not thread-safe.
class StagingBuffer {
 public:
  StagingBuffer() = default;
  ~StagingBuffer();
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;
  StagingBuffer(StagingBuffer&& other) noexcept;
  StagingBuffer& operator=(StagingBuffer&&) = delete;

  // Room for `bytes` (the buffer is kept while it is large enough). `for_device`: device copies
  // will use it, so it is pinned (ActiveDeviceMemoryOps()) if not yet; host-only use never
  // touches the device runtime.
  uint8_t* Reserve(size_t bytes, bool for_device);
  bool pinned() const { return pinned_by_ != nullptr; }

 private:
  void Release();
  std::unique_ptr<uint8_t[]> data_;
  size_t size_ = 0;
  const DeviceMemoryOps* pinned_by_ = nullptr;
  bool pin_tried_ = false;
};

// Test seam: installs `ops` for the whole process while alive (not thread-safe against
// concurrent client calls; install before any client call of the test).
class ScopedDeviceMemoryOpsForTesting {
 public:
  explicit ScopedDeviceMemoryOpsForTesting(const DeviceMemoryOps* ops);
  ~ScopedDeviceMemoryOpsForTesting();
  ScopedDeviceMemoryOpsForTesting(const ScopedDeviceMemoryOpsForTesting&) = delete;
  ScopedDeviceMemoryOpsForTesting& operator=(const ScopedDeviceMemoryOpsForTesting&) = delete;

 private:
  const DeviceMemoryOps* previous_;
};

}  // namespace kvd::client
