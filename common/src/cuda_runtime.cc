// Loading the CUDA runtime on first use (cuda_runtime.h).
#include "kvd/common/cuda_runtime.h"

#include <vector>

#include "kvd/common/logging.h"
#include "kvd/common/shared_library.h"

namespace kvd {
namespace {

// The build's soname, then its path at build time.
std::vector<std::string> Defaults() {
  std::vector<std::string> names{KVD_CUDART_SONAME};
#ifdef KVD_CUDART_PATH
  names.emplace_back(KVD_CUDART_PATH);
#endif
  return names;
}

StatusOr<CudaRuntimeApi> Resolve(const SharedLibrary& lib) {
  CudaRuntimeApi api;
  // cudaGetDeviceCount and friends keep their names across runtime versions (no _v2 aliases).
  KVD_RETURN_IF_ERROR(lib.Resolve("cudaGetDeviceCount", &api.GetDeviceCount));
  KVD_RETURN_IF_ERROR(lib.Resolve("cudaGetDeviceProperties", &api.GetDeviceProperties));
  KVD_RETURN_IF_ERROR(lib.Resolve("cudaSetDevice", &api.SetDevice));
  KVD_RETURN_IF_ERROR(lib.Resolve("cudaGetLastError", &api.GetLastError));
  KVD_RETURN_IF_ERROR(lib.Resolve("cudaGetErrorName", &api.GetErrorName));
  KVD_RETURN_IF_ERROR(lib.Resolve("cudaGetErrorString", &api.GetErrorString));
  KVD_RETURN_IF_ERROR(lib.Resolve("cudaMalloc", &api.Malloc));
  KVD_RETURN_IF_ERROR(lib.Resolve("cudaFree", &api.Free));
  KVD_RETURN_IF_ERROR(lib.Resolve("cudaMallocHost", &api.MallocHost));
  KVD_RETURN_IF_ERROR(lib.Resolve("cudaFreeHost", &api.FreeHost));
  KVD_RETURN_IF_ERROR(lib.Resolve("cudaHostRegister", &api.HostRegister));
  KVD_RETURN_IF_ERROR(lib.Resolve("cudaHostUnregister", &api.HostUnregister));
  KVD_RETURN_IF_ERROR(lib.Resolve("cudaMemGetInfo", &api.MemGetInfo));
  KVD_RETURN_IF_ERROR(lib.Resolve("cudaMemcpyAsync", &api.MemcpyAsync));
  KVD_RETURN_IF_ERROR(lib.Resolve("cudaStreamCreate", &api.StreamCreate));
  KVD_RETURN_IF_ERROR(lib.Resolve("cudaStreamCreateWithFlags", &api.StreamCreateWithFlags));
  KVD_RETURN_IF_ERROR(lib.Resolve("cudaStreamDestroy", &api.StreamDestroy));
  KVD_RETURN_IF_ERROR(lib.Resolve("cudaStreamSynchronize", &api.StreamSynchronize));
  KVD_RETURN_IF_ERROR(lib.Resolve("cudaEventCreateWithFlags", &api.EventCreateWithFlags));
  KVD_RETURN_IF_ERROR(lib.Resolve("cudaEventDestroy", &api.EventDestroy));
  KVD_RETURN_IF_ERROR(lib.Resolve("cudaEventRecord", &api.EventRecord));
  KVD_RETURN_IF_ERROR(lib.Resolve("cudaEventQuery", &api.EventQuery));
  return api;
}

struct Loaded {
  Status status;
  CudaRuntimeApi api;
};

const Loaded& Load() {
  static const Loaded loaded = [] {
    Loaded l;
    const std::vector<std::string> defaults = Defaults();
    auto lib = SharedLibrary::OpenChosen("KVD_CUDA_RUNTIME", defaults, "CUDA runtime not loaded");
    if (!lib.ok()) {
      l.status = lib.status();
      return l;
    }
    auto api = Resolve(*lib);
    if (!api.ok()) {
      l.status = api.status().WithContext("CUDA runtime not usable");
      return l;
    }
    l.api = *api;
    lib->Leak();  // the table is called until exit
    return l;
  }();
  return loaded;
}

}  // namespace

StatusOr<const CudaRuntimeApi*> LoadCudaRuntime() {
  const Loaded& l = Load();
  if (!l.status.ok()) return l.status;
  return &l.api;
}

StatusOr<const CudaRuntimeApi*> CudaRuntimeForDevice(int device) {
  KVD_ASSIGN_OR_RETURN(const CudaRuntimeApi* rt, LoadCudaRuntime());
  int count = 0;  // cudaGetDeviceCount leaves it unwritten without a driver
  cudaError_t e = rt->GetDeviceCount(&count);
  if (e != cudaSuccess) {
    rt->GetLastError();  // clear it
    return Status::Unavailable(std::string("no CUDA device (cudaGetDeviceCount: ") +
                               rt->GetErrorName(e) + ": " + rt->GetErrorString(e) + ")");
  }
  if (count == 0) return Status::Unavailable("no CUDA device (cudaGetDeviceCount: 0)");
  if (device >= count || device < -1) {
    return Status::Unavailable("no CUDA device " + std::to_string(device) +
                               " (this machine has " + std::to_string(count) + ")");
  }
  return rt;
}

const CudaRuntimeApi& Cudart() {
  const Loaded& l = Load();
  if (!l.status.ok()) KVD_LOG(FATAL) << "the CUDA runtime is used before it loaded: " << l.status;
  return l.api;
}

std::string CudaDeviceUnavailable(int device) {
  auto rt = CudaRuntimeForDevice(device);
  return rt.ok() ? "" : rt.status().message();
}

Status CudaErrorStatus(cudaError_t e, const std::string& what) {
  const CudaRuntimeApi& rt = Cudart();
  rt.GetLastError();
  std::string msg = what + ": " + rt.GetErrorName(e) + " (" + rt.GetErrorString(e) + ")";
  if (e == cudaErrorMemoryAllocation) return Status::ResourceExhausted(std::move(msg));
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver ||
      e == cudaErrorDevicesUnavailable) {
    return Status::Unavailable(std::move(msg));
  }
  return Status::Internal(std::move(msg));
}

}  // namespace kvd
