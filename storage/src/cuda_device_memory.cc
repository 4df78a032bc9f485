// DeviceMemory over the CUDA runtime (its table, loaded on first use: kvd/common/cuda_runtime.h;
// no kernels here). Without CUDA in the build, CreateCudaDeviceMemory says so.
#include <mutex>
#include <set>
#include <string>

#include "kvd/storage/device_memory.h"

#if KVD_HAVE_CUDA
#include "kvd/common/cuda_runtime.h"
#endif

namespace kvd::storage {

#if KVD_HAVE_CUDA
namespace {

class CudaDeviceMemory final : public DeviceMemory {
 public:
  CudaDeviceMemory(int device, cudaStream_t stream, std::string name)
      : device_(device), stream_(stream), name_(std::move(name)) {}
  ~CudaDeviceMemory() override {
    Cudart().SetDevice(device_);
    for (void* p : live_) Cudart().Free(p);
    Cudart().StreamDestroy(stream_);
  }

  std::string Describe() const override { return name_; }

  StatusOr<void*> Allocate(uint64_t bytes) override {
    if (bytes == 0) return Status::InvalidArgument("device allocation of 0 bytes");
    std::lock_guard<std::mutex> lock(mu_);
    Cudart().SetDevice(device_);
    void* p = nullptr;
    cudaError_t e = Cudart().Malloc(&p, bytes);
    if (e != cudaSuccess) {
      size_t free_bytes = 0, total = 0;
      Cudart().GetLastError();  // clear the sticky allocation error
      Cudart().MemGetInfo(&free_bytes, &total);
      return CudaErrorStatus(e, "cudaMalloc(" + std::to_string(bytes) + " bytes) on " + name_ + ", " +
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
    Cudart().SetDevice(device_);
    cudaError_t e = Cudart().Free(device_ptr);
    return e == cudaSuccess ? Status::Ok() : CudaErrorStatus(e, "cudaFree");
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
    Cudart().SetDevice(device_);
    cudaError_t e = Cudart().MemcpyAsync(dst, src, bytes, kind, stream_);
    if (e == cudaSuccess) e = Cudart().StreamSynchronize(stream_);
    if (e != cudaSuccess) return CudaErrorStatus(e, std::string("cudaMemcpy ") + what + " on " + name_);
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
  cudaError_t e = Cudart().SetDevice(device);
  if (e != cudaSuccess) return CudaErrorStatus(e, "cudaSetDevice(" + std::to_string(device) + ")");
  cudaDeviceProp prop{};
  Cudart().GetDeviceProperties(&prop, device);
  cudaStream_t stream = nullptr;
  e = Cudart().StreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (e != cudaSuccess) return CudaErrorStatus(e, "cudaStreamCreate");
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
