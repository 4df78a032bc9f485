// Why this process cannot use CUDA device `device`, or "" when it can: "no CUDA device
// (cudaGetDeviceCount: cudaErrorInsufficientDriver)", "no CUDA device 3 (this machine has 1)".
// Header-only on purpose: include it only from files compiled against the CUDA runtime (the GPU
// tier's DeviceMemory, the nccl backend); kvd_common itself does not link cudart.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace kvd {

inline std::string CudaDeviceUnavailable(int device) {
  int count = 0;  // cudaGetDeviceCount leaves it unwritten without a driver
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear it
    return std::string("no CUDA device (cudaGetDeviceCount: ") + cudaGetErrorName(e) + ")";
  }
  if (device < 0 || device >= count) {
    return "no CUDA device " + std::to_string(device) + " (this machine has " +
           std::to_string(count) + ")";
  }
  return "";
}

}  // namespace kvd
