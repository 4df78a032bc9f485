// The one place where libkvd_client classifies buffer pointers and copies between host and
// device memory (kvd/client/device.h).
#include "kvd/client/device.h"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

#include "kvd/common/shared_library.h"

#if KVD_HAVE_CUDA
#include "kvd/common/cuda_runtime.h"
#endif

namespace kvd::client {
namespace {

std::atomic<const DeviceMemoryOps*> g_test_ops{nullptr};

// Asks the CUDA driver whether a pointer is device memory, without loading anything: a device
// pointer can only exist in a process that has the driver (libcuda) loaded already, by the CUDA
// runtime of whoever allocated it (an engine, torch, or this library's own copies). A process
// without it classifies every pointer as host memory and maps no CUDA library.
class DriverProbe {
 public:
  bool IsDevice(const void* p) const {
    if (p == nullptr) return false;
    const Driver* d = Find();
    if (d == nullptr || d->get_attribute == nullptr) return false;
    constexpr int kMemoryType = 2;           // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
    constexpr int kIsManaged = 8;            // CU_POINTER_ATTRIBUTE_IS_MANAGED
    constexpr unsigned kMemoryTypeDevice = 2;  // CU_MEMORYTYPE_DEVICE
    const auto address = reinterpret_cast<uintptr_t>(p);
    unsigned type = 0, managed = 0;
    if (d->get_attribute(&type, kMemoryType, address) != 0 || type != kMemoryTypeDevice) {
      return false;
    }
    // Managed memory is readable by the host: it takes the host path.
    return d->get_attribute(&managed, kIsManaged, address) != 0 || managed == 0;
  }

 private:
  struct Driver {
    SharedLibrary lib;
    int (*get_attribute)(void*, int, unsigned long long) = nullptr;
  };
  // The driver once it is in the process (looked for on each call until then), else null.
  const Driver* Find() const {
    if (const Driver* d = driver_.load(std::memory_order_acquire)) return d;
    static constexpr const char* kDriver = "libcuda.so.1";
    if (!SharedLibrary::IsLoaded(kDriver)) return nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    if (const Driver* d = driver_.load(std::memory_order_acquire)) return d;
    auto lib = SharedLibrary::Open(kDriver);  // already loaded: takes a reference
    if (!lib.ok()) return nullptr;
    auto* d = new Driver{std::move(*lib)};  // kept for the process's lifetime
    int (*init)(unsigned) = nullptr;
    if (!d->lib.Resolve("cuInit", &init).ok() ||
        !d->lib.Resolve("cuPointerGetAttribute", &d->get_attribute).ok() || init(0) != 0) {
      d->get_attribute = nullptr;  // no usable driver: no device memory either
    }
    driver_.store(d, std::memory_order_release);
    return d;
  }
  mutable std::mutex mu_;
  mutable std::atomic<const Driver*> driver_{nullptr};
};

const DriverProbe& Probe() {
  static const DriverProbe probe;
  return probe;
}

#if KVD_HAVE_CUDA

std::string CudaError(const CudaRuntimeApi& rt, cudaError_t e) {
  return std::string(rt.GetErrorName(e)) + ": " + rt.GetErrorString(e);
}

// The CUDA runtime, loaded on the first device copy or pin (kvd/common/cuda_runtime.h).
class CudaOps final : public DeviceMemoryOps {
 public:
  StatusOr<BufferLocation> Locate(const void* p) const override {
    return Probe().IsDevice(p) ? BufferLocation::kCuda : BufferLocation::kHost;
  }
  Status CanCopy() const override { return Runtime().status(); }
  Status CopyToHost(void* dst, const void* src, size_t bytes, void* stream) const override {
    return Copy(dst, src, bytes, cudaMemcpyDeviceToHost, stream, "device to host");
  }
  Status CopyToDevice(void* dst, const void* src, size_t bytes, void* stream) const override {
    return Copy(dst, src, bytes, cudaMemcpyHostToDevice, stream, "host to device");
  }
  Status Pin(void* p, size_t bytes) const override {
    KVD_ASSIGN_OR_RETURN(const CudaRuntimeApi* rt, Runtime());
    cudaError_t e = rt->HostRegister(p, bytes, cudaHostRegisterDefault);
    if (e != cudaSuccess) {
      (void)rt->GetLastError();
      return Status::Unavailable("cudaHostRegister of " + std::to_string(bytes) +
                                 " bytes: " + CudaError(*rt, e));
    }
    return Status::Ok();
  }
  void Unpin(void* p) const override {
    auto rt = Runtime();
    if (rt.ok() && (*rt)->HostUnregister(p) != cudaSuccess) (void)(*rt)->GetLastError();
  }

 private:
  // The runtime when the process sees at least one device (asked once), else why not:
  // UNAVAILABLE "CUDA runtime not loaded: ..." or "no CUDA device (...)".
  static StatusOr<const CudaRuntimeApi*> Runtime() {
    static const StatusOr<const CudaRuntimeApi*> rt = CudaRuntimeForDevice(-1);
    return rt;
  }
  static Status Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, void* stream,
                     const char* what) {
    if (bytes == 0) return Status::Ok();
    KVD_ASSIGN_OR_RETURN(const CudaRuntimeApi* rt, Runtime());
    auto s = static_cast<cudaStream_t>(stream);
    cudaError_t e = rt->MemcpyAsync(dst, src, bytes, kind, s);
    if (e == cudaSuccess) e = rt->StreamSynchronize(s);
    if (e != cudaSuccess) {
      (void)rt->GetLastError();
      return Status::Internal(std::string("copy of ") + std::to_string(bytes) + " bytes " + what +
                              " failed: " + CudaError(*rt, e));
    }
    return Status::Ok();
  }
};

#else  // !KVD_HAVE_CUDA

Status BuiltWithoutCuda() {
  return Status::Unimplemented(
      "libkvd_client was built without CUDA: it cannot read or write device memory (rebuild "
      "with -DKVD_WITH_CUDA=ON, or pass host buffers)");
}

// Refuses device pointers instead of reading them as host memory.
class NoCudaOps final : public DeviceMemoryOps {
 public:
  StatusOr<BufferLocation> Locate(const void* p) const override {
    return Probe().IsDevice(p) ? BufferLocation::kCuda : BufferLocation::kHost;
  }
  Status CanCopy() const override { return BuiltWithoutCuda(); }
  Status CopyToHost(void*, const void*, size_t, void*) const override { return BuiltWithoutCuda(); }
  Status CopyToDevice(void*, const void*, size_t, void*) const override {
    return BuiltWithoutCuda();
  }
  Status Pin(void*, size_t) const override { return BuiltWithoutCuda(); }
  void Unpin(void*) const override {}
};

#endif

}  // namespace

std::string_view BufferLocationName(BufferLocation l) {
  return l == BufferLocation::kCuda ? "cuda" : "host";
}

const DeviceMemoryOps& CudaDeviceMemoryOps() {
#if KVD_HAVE_CUDA
  static const CudaOps ops;
#else
  static const NoCudaOps ops;
#endif
  return ops;
}

const DeviceMemoryOps& ActiveDeviceMemoryOps() {
  const DeviceMemoryOps* t = g_test_ops.load(std::memory_order_acquire);
  return t != nullptr ? *t : CudaDeviceMemoryOps();
}

StatusOr<BufferLocation> LocateForUse(const void* p, std::string_view what) {
  const DeviceMemoryOps& ops = ActiveDeviceMemoryOps();
  KVD_ASSIGN_OR_RETURN(BufferLocation l, ops.Locate(p));
  if (l == BufferLocation::kCuda) {
    Status s = ops.CanCopy();
    if (!s.ok()) {
      return Status(s.code(), std::string(what) + " is CUDA device memory: " + s.message());
    }
  }
  return l;
}

Status CopyToHostFrom(void* host_dst, const void* src, size_t bytes, void* stream,
                      std::string_view what) {
  if (bytes == 0) return Status::Ok();
  KVD_ASSIGN_OR_RETURN(BufferLocation l, LocateForUse(src, what));
  if (l == BufferLocation::kHost) {
    std::memcpy(host_dst, src, bytes);
    return Status::Ok();
  }
  return ActiveDeviceMemoryOps().CopyToHost(host_dst, src, bytes, stream).WithContext(what);
}

Status CopyFromHostTo(void* dst, const void* host_src, size_t bytes, void* stream,
                      std::string_view what) {
  if (bytes == 0) return Status::Ok();
  KVD_ASSIGN_OR_RETURN(BufferLocation l, LocateForUse(dst, what));
  if (l == BufferLocation::kHost) {
    std::memcpy(dst, host_src, bytes);
    return Status::Ok();
  }
  return ActiveDeviceMemoryOps().CopyToDevice(dst, host_src, bytes, stream).WithContext(what);
}

StagingBuffer::~StagingBuffer() { Release(); }

StagingBuffer::StagingBuffer(StagingBuffer&& other) noexcept
    : data_(std::move(other.data_)),
      size_(other.size_),
      pinned_by_(other.pinned_by_),
      pin_tried_(other.pin_tried_) {
  other.size_ = 0;
  other.pinned_by_ = nullptr;
}

void StagingBuffer::Release() {
  if (pinned_by_ != nullptr) pinned_by_->Unpin(data_.get());
  pinned_by_ = nullptr;
  data_.reset();
  size_ = 0;
}

uint8_t* StagingBuffer::Reserve(size_t bytes, bool for_device) {
  if (bytes > size_ || !data_) {
    Release();
    size_ = bytes == 0 ? 1 : bytes;
    data_.reset(new uint8_t[size_]);
    pin_tried_ = false;
  }
  if (for_device && !pin_tried_) {
    pin_tried_ = true;
    const DeviceMemoryOps& ops = ActiveDeviceMemoryOps();
    if (ops.Pin(data_.get(), size_).ok()) pinned_by_ = &ops;
  }
  return data_.get();
}

ScopedDeviceMemoryOpsForTesting::ScopedDeviceMemoryOpsForTesting(const DeviceMemoryOps* ops)
    : previous_(g_test_ops.exchange(ops)) {}
ScopedDeviceMemoryOpsForTesting::~ScopedDeviceMemoryOpsForTesting() { g_test_ops.store(previous_); }

}  // namespace kvd::client
