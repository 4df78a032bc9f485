// The CUDA kernels are a module of their own (libkvd_kernels_cuda.so, next to the library or
// program that uses them, in <libdir>/kvd/), loaded on first device use: a process that never
// runs a kernel on the device maps neither the module nor the CUDA runtime it links. The host
// side of kvd_kernels calls the cuda:: entry points (backend_a.h, serving_backend.h,
// vector_backend.h, quantize_backend.h, expected_attention_backend.h, plan_device_internal.h, device_serving_internal.h and the
// two below) as
// before; src/cuda_module.cc defines them as calls through this table, which the module's one
// exported symbol hands out. Private to kvd_kernels.
//
// Which module: $KVD_KERNELS_CUDA_MODULE when set (a path), else kvd/libkvd_kernels_cuda.so in
// the folder of the binary holding these kernels (libkvd_client, a program), else in ../lib/ of
// it (programs in <prefix>/bin). Errors: UNAVAILABLE naming every path tried and why.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "backend_a.h"
#include "device_serving_internal.h"
#include "expected_attention_backend.h"
#include "plan_device_internal.h"
#include "quantize_backend.h"
#include "serving_backend.h"
#include "vector_backend.h"
#include "xxh3_blocked.h"

namespace kvd::kernels {

#if KVD_HAVE_CUDA
namespace cuda {
// kernels/src/cuda/checksum.cu. REQUIRES bytes > xxh3::kMidSizeMax.
StatusOr<uint64_t> LaunchChecksum64(const void* device_data, size_t bytes,
                                    const xxh3::Secret& secret, void* stream);
Status CopyToHostSync(void* host, const void* device, size_t bytes, void* stream);
}  // namespace cuda

// Raised with every change of CudaKernelsApi: the module and its loader are built together, a
// module of another build is refused.
inline constexpr int kCudaKernelsApiVersion = 4;

struct CudaKernelsApi {
  int version = kCudaKernelsApiVersion;
  // cudaGetDeviceCount through the module's runtime: the count, or the runtime's error (< 0).
  int (*DeviceCount)(std::string* error) = nullptr;
  decltype(&cuda::GatherHeads) GatherHeads = nullptr;
  decltype(&cuda::ScatterHeads) ScatterHeads = nullptr;
  decltype(&cuda::ApplyRope) ApplyRope = nullptr;
  decltype(&cuda::AttentionMass) AttentionMass = nullptr;
  decltype(&cuda::KeyDiffScores) KeyDiffScores = nullptr;
  decltype(&cuda::ApplyMerges) ApplyMerges = nullptr;
  decltype(&cuda::ExpandDense) ExpandDense = nullptr;
  decltype(&cuda::AccumulateVectorStats) AccumulateVectorStats = nullptr;
  decltype(&cuda::VectorResiduals) VectorResiduals = nullptr;
  decltype(&cuda::RebuildValues) RebuildValues = nullptr;
  decltype(&cuda::CreateDevicePlanState) CreateDevicePlanState = nullptr;
  decltype(&cuda::HasDeviceSteps) HasDeviceSteps = nullptr;
  decltype(&cuda::AllocatePinned) AllocatePinned = nullptr;
  decltype(&cuda::FreePinned) FreePinned = nullptr;
  decltype(&cuda::UploadImage) UploadImage = nullptr;
  decltype(&cuda::FreeDevice) FreeDevice = nullptr;
  decltype(&cuda::LaunchDenseHead) LaunchDenseHead = nullptr;
  decltype(&cuda::LaunchCompactHead) LaunchCompactHead = nullptr;
  decltype(&cuda::LaunchChecksum64) LaunchChecksum64 = nullptr;
  decltype(&cuda::CopyToHostSync) CopyToHostSync = nullptr;
  decltype(&cuda::QuantizeBlock) QuantizeBlock = nullptr;
  decltype(&cuda::DequantizeBlock) DequantizeBlock = nullptr;
  decltype(&cuda::ExpectedAttentionScores) ExpectedAttentionScores = nullptr;
};

// The module's table, loading it on the first call (once per process).
StatusOr<const CudaKernelsApi*> LoadCudaKernels();
// Why the kernels cannot run on CUDA device `device` (-1: any device) in this process, or "" when
// they can: the module or its CUDA runtime does not load, "no CUDA device (...)", "no CUDA
// device 3 (this machine has 1)".
std::string CudaKernelsUnavailable(int device);

}  // namespace kvd::kernels

// The module's one exported symbol.
extern "C" const kvd::kernels::CudaKernelsApi* kvd_kernels_cuda_module();
#else
}  // namespace kvd::kernels
#endif
