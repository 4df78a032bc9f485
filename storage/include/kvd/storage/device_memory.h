// DeviceMemory: the seam between the GPU tier's logic and the device it stores bytes on.
//
// The GPU tier (gpu_tier.h) allocates ONE region through it at creation and sub-allocates that
// region itself (ArenaAllocator); every byte it moves goes through the copy methods. Two
// implementations: CUDA (CreateCudaDeviceMemory: cudaMalloc on one device, copies on a stream of
// its own, synchronous to the caller) and, in tests, a host-memory fake with fault injection
// (tests/storage/fake_device_memory.h), so the tier's logic is tested on machines without a GPU.
//
// Pointers returned by Allocate are device addresses: only the copy methods may dereference
// them. Thread safety: every implementation is thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kvd/common/status.h"

namespace kvd::storage {

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;

  // "cuda:0 (NVIDIA H200)", "fake": for stats and messages.
  virtual std::string Describe() const = 0;

  // Allocates `bytes` (> 0) of device memory, aligned to at least 256 bytes.
  // RESOURCE_EXHAUSTED (the device has not that much free; the message says how much it has),
  // INVALID_ARGUMENT (0 bytes).
  virtual StatusOr<void*> Allocate(uint64_t bytes) = 0;
  // Frees what Allocate returned. NOT_FOUND for a pointer it did not return.
  virtual Status Free(void* device_ptr) = 0;

  // Copies `bytes`, finished (visible to the destination's readers) when the call returns.
  // INTERNAL (the device reported an error; message names it) or UNAVAILABLE (device lost).
  virtual Status CopyToDevice(void* device_dst, const void* host_src, size_t bytes) = 0;
  virtual Status CopyToHost(void* host_dst, const void* device_src, size_t bytes) = 0;
  virtual Status CopyOnDevice(void* device_dst, const void* device_src, size_t bytes) = 0;
};

// Why this process cannot use CUDA device `device`, or "" when it can: "built without CUDA",
// "no CUDA device (cudaGetDeviceCount: ...)", "device 3 of 1". For clean skips and startup errors.
std::string CudaDeviceUnavailableReason(int device);

// DeviceMemory on CUDA device `device` (cudaMalloc; cudaMemcpyAsync on a stream it owns, then a
// stream synchronize). UNAVAILABLE with CudaDeviceUnavailableReason when there is no such device
// or the build has no CUDA.
StatusOr<std::unique_ptr<DeviceMemory>> CreateCudaDeviceMemory(int device);

}  // namespace kvd::storage
