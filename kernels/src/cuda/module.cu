// The one exported symbol of libkvd_kernels_cuda.so (cuda_module.h): the table of its entry
// points.
#include "cuda/cuda_common.cuh"
#include "cuda_module.h"

namespace kvd::kernels::cuda {
namespace {

int DeviceCount(std::string* error) {
  int count = 0;  // cudaGetDeviceCount leaves it unwritten without a driver
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e == cudaSuccess) return count;
  cudaGetLastError();  // clear it
  if (error != nullptr) *error = std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
  return -1;
}

CudaKernelsApi MakeApi() {
  CudaKernelsApi api;
  api.DeviceCount = &DeviceCount;
  api.GatherHeads = &GatherHeads;
  api.ScatterHeads = &ScatterHeads;
  api.ApplyRope = &ApplyRope;
  api.AttentionMass = &AttentionMass;
  api.KeyDiffScores = &KeyDiffScores;
  api.ApplyMerges = &ApplyMerges;
  api.ExpandDense = &ExpandDense;
  api.AccumulateVectorStats = &AccumulateVectorStats;
  api.VectorResiduals = &VectorResiduals;
  api.RebuildValues = &RebuildValues;
  api.CreateDevicePlanState = &CreateDevicePlanState;
  api.HasDeviceSteps = &HasDeviceSteps;
  api.AllocatePinned = &AllocatePinned;
  api.FreePinned = &FreePinned;
  api.UploadImage = &UploadImage;
  api.FreeDevice = &FreeDevice;
  api.LaunchDenseHead = &LaunchDenseHead;
  api.LaunchCompactHead = &LaunchCompactHead;
  api.LaunchChecksum64 = &LaunchChecksum64;
  api.CopyToHostSync = &CopyToHostSync;
  api.QuantizeBlock = &QuantizeBlock;
  api.DequantizeBlock = &DequantizeBlock;
  api.ExpectedAttentionScores = &ExpectedAttentionScores;
  return api;
}

}  // namespace
}  // namespace kvd::kernels::cuda

extern "C" __attribute__((visibility("default"))) const kvd::kernels::CudaKernelsApi*
kvd_kernels_cuda_module() {
  static const kvd::kernels::CudaKernelsApi api = kvd::kernels::cuda::MakeApi();
  return &api;
}
