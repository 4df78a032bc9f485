// Loads and stores of one tensor element of a model dtype as float32, on the device: the one
// conversion every CUDA kernel uses (round to nearest even when storing float16/bfloat16).
// Private to kernels/src/cuda.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kvd/common/dtype.h"

namespace kvd::kernels::cuda {

__device__ __forceinline__ float LoadElement(const void* src, int64_t i, int dtype) {
  if (dtype == static_cast<int>(DType::kFloat32)) return static_cast<const float*>(src)[i];
  if (dtype == static_cast<int>(DType::kFloat16)) {
    return __half2float(static_cast<const __half*>(src)[i]);
  }
  return __bfloat162float(static_cast<const __nv_bfloat16*>(src)[i]);
}

__device__ __forceinline__ void StoreElement(void* dst, int64_t i, float x, int dtype) {
  if (dtype == static_cast<int>(DType::kFloat32)) {
    static_cast<float*>(dst)[i] = x;
  } else if (dtype == static_cast<int>(DType::kFloat16)) {
    static_cast<__half*>(dst)[i] = __float2half_rn(x);
  } else {
    static_cast<__nv_bfloat16*>(dst)[i] = __float2bfloat16_rn(x);
  }
}

}  // namespace kvd::kernels::cuda
