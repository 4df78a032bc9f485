// DeviceMemory over the CUDA runtime (compiled as C++ against cudart; no kernels here). Without
// CUDA in the build, CreateCudaDeviceMemory says so.
#include <mutex>
#include <set>
#include <string>

#include "kvd/storage/device_memory.h"

#if KVD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kvd/common/cuda_device.h"
#endif

namespace kvd::storage {

#if KVD_HAVE_CUDA
namespace {

Status CudaError(cudaError_t e, const std::string& what) {
  std::string msg = what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
  if (e == cudaErrorMemoryAllocation) return Status::ResourceExhausted(msg);
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver ||
      e == cudaErrorDevicesUnavailable)
    return Status::Unavailable(msg);
  return Status::Internal(msg);
}

class CudaDeviceMemory final : public DeviceMemory {
 public:
  CudaDeviceMemory(int device, cudaStream_t stream, std::string name)
      : device_(device), stream_(stream), name_(std::move(name)) {}
  ~CudaDeviceMemory() override {
    cudaSetDevice(device_);
    for (void* p : live_) cudaFree(p);
    cudaStreamDestroy(stream_);
  }

  std::string Describe() const override { return name_; }

  StatusOr<void*> Allocate(uint64_t bytes) override {
    if (bytes == 0) return Status::InvalidArgument("device allocation of 0 bytes");
    std::lock_guard<std::mutex> lock(mu_);
    cudaSetDevice(device_);
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
      size_t free_bytes = 0, total = 0;
      cudaGetLastError();  // clear the sticky allocation error
      cudaMemGetInfo(&free_bytes, &total);
      return CudaError(e, "cudaMalloc(" + std::to_string(bytes) + " bytes) on " + name_ + ", " +
                              std::to_string(free_bytes) + " of " + std::to_string(total) +
                              " bytes free");
    }
    live_.insert(p);
    return p;
  }

  Status Free(void* device_ptr) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (live_.erase(device_ptr) == 0)
      return Status::NotFound("not a device allocation of " + name_);
    cudaSetDevice(device_);
    cudaError_t e = cudaFree(device_ptr);
    return e == cudaSuccess ? Status::Ok() : CudaError(e, "cudaFree");
  }

  Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes, cudaMemcpyHostToDevice, "host -> device");
  }
  Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes, cudaMemcpyDeviceToHost, "device -> host");
  }
  Status CopyOnDevice(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes, cudaMemcpyDeviceToDevice, "device -> device");
  }

 private:
  // One stream, serialized: copies of a GPU tier are whole chunks (hundreds of KiB to MiBs), so
  // the stream stays busy; the lock keeps the stream synchronize paired with its own copy.
  Status Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, const char* what) {
    if (bytes == 0) return Status::Ok();
    std::lock_guard<std::mutex> lock(mu_);
    cudaSetDevice(device_);
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, stream_);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream_);
    if (e != cudaSuccess) return CudaError(e, std::string("cudaMemcpy ") + what + " on " + name_);
    return Status::Ok();
  }

  const int device_;
  cudaStream_t stream_;
  const std::string name_;
  std::mutex mu_;
  std::set<void*> live_;  // GUARDED_BY(mu_)
};

}  // namespace

std::string CudaDeviceUnavailableReason(int device) { return CudaDeviceUnavailable(device); }

StatusOr<std::unique_ptr<DeviceMemory>> CreateCudaDeviceMemory(int device) {
  if (std::string why = CudaDeviceUnavailableReason(device); !why.empty()) {
    return Status::Unavailable(why);
  }
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return CudaError(e, "cudaSetDevice(" + std::to_string(device) + ")");
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, device);
  cudaStream_t stream = nullptr;
  e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (e != cudaSuccess) return CudaError(e, "cudaStreamCreate");
  return std::unique_ptr<DeviceMemory>(new CudaDeviceMemory(
      device, stream, "cuda:" + std::to_string(device) + " (" + prop.name + ")"));
}

#else  // !KVD_HAVE_CUDA

std::string CudaDeviceUnavailableReason(int) {
  return "built without CUDA (KVD_WITH_CUDA=OFF or no nvcc)";
}

StatusOr<std::unique_ptr<DeviceMemory>> CreateCudaDeviceMemory(int device) {
  return Status::Unavailable(CudaDeviceUnavailableReason(device));
}

#endif

}  // namespace kvd::storage
