// The one place where libkvd_client classifies buffer pointers and copies between host and
// device memory (kvd/client/device.h).
#include "kvd/client/device.h"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

#if KVD_HAVE_CUDA
#include <cuda_runtime.h>
#else
#include <dlfcn.h>
#endif

namespace kvd::client {
namespace {

std::atomic<const DeviceMemoryOps*> g_test_ops{nullptr};

#if KVD_HAVE_CUDA

std::string CudaError(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

class CudaOps final : public DeviceMemoryOps {
 public:
  StatusOr<BufferLocation> Locate(const void* p) const override {
    if (p == nullptr || !Devices().ok()) return BufferLocation::kHost;  // no device memory here
    cudaPointerAttributes a{};
    cudaError_t e = cudaPointerGetAttributes(&a, p);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // an unregistered host pointer on old runtimes: not sticky
      return BufferLocation::kHost;
    }
    // Managed memory is readable by the host: it takes the host path.
    return a.type == cudaMemoryTypeDevice ? BufferLocation::kCuda : BufferLocation::kHost;
  }
  Status CanCopy() const override { return Devices(); }
  Status CopyToHost(void* dst, const void* src, size_t bytes, void* stream) const override {
    return Copy(dst, src, bytes, cudaMemcpyDeviceToHost, stream, "device to host");
  }
  Status CopyToDevice(void* dst, const void* src, size_t bytes, void* stream) const override {
    return Copy(dst, src, bytes, cudaMemcpyHostToDevice, stream, "host to device");
  }
  Status Pin(void* p, size_t bytes) const override {
    KVD_RETURN_IF_ERROR(Devices());
    cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterDefault);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return Status::Unavailable("cudaHostRegister of " + std::to_string(bytes) +
                                 " bytes: " + CudaError(e));
    }
    return Status::Ok();
  }
  void Unpin(void* p) const override {
    if (cudaHostUnregister(p) != cudaSuccess) (void)cudaGetLastError();
  }

 private:
  // OK when the process sees at least one device (asked once).
  static Status Devices() {
    static const Status status = [] {
      int n = 0;
      cudaError_t e = cudaGetDeviceCount(&n);
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return Status::Unavailable("no CUDA device (cudaGetDeviceCount: " + CudaError(e) + ")");
      }
      if (n == 0) return Status::Unavailable("no CUDA device (cudaGetDeviceCount: 0)");
      return Status::Ok();
    }();
    return status;
  }
  static Status Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, void* stream,
                     const char* what) {
    if (bytes == 0) return Status::Ok();
    auto s = static_cast<cudaStream_t>(stream);
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, s);
    if (e == cudaSuccess) e = cudaStreamSynchronize(s);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return Status::Internal(std::string("copy of ") + std::to_string(bytes) + " bytes " + what +
                              " failed: " + CudaError(e));
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

// Asks the driver (when one is installed) whether a pointer is device memory, so that a build
// without CUDA refuses device pointers instead of reading them as host memory.
class DriverProbe {
 public:
  DriverProbe() {
    void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return;
    auto init = reinterpret_cast<int (*)(unsigned)>(::dlsym(lib, "cuInit"));
    get_attribute_ = reinterpret_cast<int (*)(void*, int, unsigned long long)>(
        ::dlsym(lib, "cuPointerGetAttribute"));
    if (init == nullptr || get_attribute_ == nullptr || init(0) != 0) get_attribute_ = nullptr;
  }
  bool IsDevice(const void* p) const {
    if (get_attribute_ == nullptr || p == nullptr) return false;
    constexpr int kMemoryTypeAttribute = 2;    // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
    constexpr unsigned kMemoryTypeDevice = 2;  // CU_MEMORYTYPE_DEVICE
    unsigned type = 0;
    return get_attribute_(&type, kMemoryTypeAttribute, reinterpret_cast<uintptr_t>(p)) == 0 &&
           type == kMemoryTypeDevice;
  }

 private:
  int (*get_attribute_)(void*, int, unsigned long long) = nullptr;
};

class NoCudaOps final : public DeviceMemoryOps {
 public:
  StatusOr<BufferLocation> Locate(const void* p) const override {
    static const DriverProbe probe;
    return probe.IsDevice(p) ? BufferLocation::kCuda : BufferLocation::kHost;
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
