// The one conversion of CUDA runtime errors into kvd::Status.
#include "cuda/cuda_common.cuh"

namespace kvd::kernels::cuda {

Status CudaStatus(cudaError_t err, const char* what) {
  std::string msg =
      std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
  switch (err) {
    case cudaErrorMemoryAllocation:
      return Status::ResourceExhausted(std::move(msg));
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
      return Status::Unavailable(std::move(msg));
    default:
      return Status::Internal(std::move(msg));
  }
}

}  // namespace kvd::kernels::cuda
