// The CUDA runtime (libcudart), loaded on first device use instead of linked: a process that
// never touches device memory never maps it, and the runtime an engine (torch) brings is the one
// used when it has the same soname. Every caller of the runtime outside the CUDA kernels module
// (the client's copies, the GPU tier, the nccl backend) goes through this table.
//
// Which library: $KVD_CUDA_RUNTIME when set (a soname or a path), else the soname this build was
// compiled against (libcudart.so.<major>), else that library's configure-time path.
// Errors: UNAVAILABLE, "CUDA runtime not loaded: ..." naming every library tried and why, or
// "no CUDA device (cudaGetDeviceCount: cudaErrorNoDevice: ...)". Never a crash.
// Only files compiled against the CUDA headers include this (KVD_HAVE_CUDA builds); kvd_common
// itself does not link the runtime. Thread safety: any thread; the load happens once.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "kvd/common/status.h"

namespace kvd {

// The runtime entry points kvd calls; the signatures are cuda_runtime_api.h's.
struct CudaRuntimeApi {
  decltype(&cudaGetDeviceCount) GetDeviceCount = nullptr;
  decltype(&cudaGetDeviceProperties) GetDeviceProperties = nullptr;
  decltype(&cudaSetDevice) SetDevice = nullptr;
  decltype(&cudaGetLastError) GetLastError = nullptr;
  decltype(&cudaGetErrorName) GetErrorName = nullptr;
  decltype(&cudaGetErrorString) GetErrorString = nullptr;
  decltype(&cudaMalloc) Malloc = nullptr;
  decltype(&cudaFree) Free = nullptr;
  decltype(&cudaMallocHost) MallocHost = nullptr;
  decltype(&cudaFreeHost) FreeHost = nullptr;
  decltype(&cudaHostRegister) HostRegister = nullptr;
  decltype(&cudaHostUnregister) HostUnregister = nullptr;
  decltype(&cudaMemGetInfo) MemGetInfo = nullptr;
  decltype(&cudaMemcpyAsync) MemcpyAsync = nullptr;
  decltype(&cudaStreamCreate) StreamCreate = nullptr;
  decltype(&cudaStreamCreateWithFlags) StreamCreateWithFlags = nullptr;
  decltype(&cudaStreamDestroy) StreamDestroy = nullptr;
  decltype(&cudaStreamSynchronize) StreamSynchronize = nullptr;
  decltype(&cudaEventCreateWithFlags) EventCreateWithFlags = nullptr;
  decltype(&cudaEventDestroy) EventDestroy = nullptr;
  decltype(&cudaEventRecord) EventRecord = nullptr;
  decltype(&cudaEventQuery) EventQuery = nullptr;
};

// The runtime's table, loading it on the first call.
StatusOr<const CudaRuntimeApi*> LoadCudaRuntime();
// LoadCudaRuntime(), and CUDA device `device` exists (-1: any device).
StatusOr<const CudaRuntimeApi*> CudaRuntimeForDevice(int device);
// The loaded table: only where LoadCudaRuntime() has succeeded (aborts otherwise).
const CudaRuntimeApi& Cudart();

// Why this process cannot use CUDA device `device`, or "" when it can.
std::string CudaDeviceUnavailable(int device);
// `what: cudaErrorX (text)`: RESOURCE_EXHAUSTED for out of memory, UNAVAILABLE for a missing or
// broken device, INTERNAL otherwise. Clears the runtime's last error.
Status CudaErrorStatus(cudaError_t e, const std::string& what);

}  // namespace kvd
