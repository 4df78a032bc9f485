// CUDA kernels of DeviceCompactChunk (device_serving.h): compact and dense serving forms written
// from a chunk image on the device into the caller's device buffers.
#include <cuda_runtime.h>

#include "cuda/cuda_common.cuh"
#include "cuda/elements.cuh"
#include "cuda/slot_search.cuh"
#include "device_serving_internal.h"

namespace kvd::kernels::cuda {
namespace {

constexpr int kThreads = 64;

// The float32 value of slot j, column c: a stored mean (chunk dtype) or a rebuilt value.
__device__ float SlotValue(const uint8_t* values, const float* rebuilt, int32_t source, int64_t d,
                           int64_t c, int dtype) {
  return source >= 0 ? LoadElement(values, source * d + c, dtype)
                     : rebuilt[static_cast<int64_t>(-source - 1) * d + c];
}

// One block per output token t: its slot j (offsets[j] <= t < offsets[j + 1]) by binary search,
// then the key and value rows through float32 into the chunk dtype, at (t, head, :).
__global__ void DenseHeadKernel(const uint8_t* __restrict__ keys,
                                const uint8_t* __restrict__ values,
                                const float* __restrict__ rebuilt,
                                const int32_t* __restrict__ source,
                                const int64_t* __restrict__ offsets, int64_t s, int64_t d,
                                int dtype, int64_t row_elems, int64_t head_elems,
                                uint8_t* __restrict__ k_out, uint8_t* __restrict__ v_out) {
  const int64_t t = blockIdx.x;
  const int64_t lo = SlotOfDenseRow(offsets, s, t);
  const int32_t src = source[lo];
  const int64_t out = t * row_elems + head_elems;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    StoreElement(k_out, out + c, LoadElement(keys, lo * d + c, dtype), dtype);
    StoreElement(v_out, out + c, SlotValue(values, rebuilt, src, d, c, dtype), dtype);
  }
}

// One block per slot j: float32 key and value rows, bias and position.
__global__ void CompactHeadKernel(
    const uint8_t* __restrict__ keys, const uint8_t* __restrict__ values,
    const float* __restrict__ rebuilt, const int32_t* __restrict__ source,
    const float* __restrict__ bias_in, const int64_t* __restrict__ positions_in, int64_t d,
    int dtype, float* __restrict__ keys_out, float* __restrict__ values_out,
    float* __restrict__ bias_out, int64_t* __restrict__ positions_out) {
  const int64_t j = blockIdx.x;
  const int32_t src = source[j];
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    keys_out[j * d + c] = LoadElement(keys, j * d + c, dtype);
    values_out[j * d + c] = SlotValue(values, rebuilt, src, d, c, dtype);
  }
  if (threadIdx.x == 0) {
    bias_out[j] = bias_in[j];
    if (positions_out != nullptr) positions_out[j] = positions_in[j];
  }
}

}  // namespace

StatusOr<void*> AllocatePinned(size_t bytes) {
  void* p = nullptr;
  KVD_CUDA_RETURN_IF_ERROR(cudaMallocHost(&p, bytes == 0 ? 1 : bytes), "cudaMallocHost");
  return p;
}

void FreePinned(void* p) {
  if (p != nullptr) cudaFreeHost(p);
}

StatusOr<void*> UploadImage(const void* pinned, size_t bytes, void* stream) {
  void* d = nullptr;
  KVD_CUDA_RETURN_IF_ERROR(cudaMalloc(&d, bytes == 0 ? 1 : bytes), "cudaMalloc (chunk image)");
  cudaError_t e = cudaMemcpyAsync(d, pinned, bytes, cudaMemcpyHostToDevice, AsStream(stream));
  if (e == cudaSuccess) e = cudaStreamSynchronize(AsStream(stream));
  if (e != cudaSuccess) {
    cudaFree(d);
    return CudaStatus(e, "uploading a compact chunk image");
  }
  return d;
}

void FreeDevice(void* p) {
  if (p != nullptr) cudaFree(p);
}

Status LaunchDenseHead(const uint8_t* image, const DeviceHeadLayout& h, int head_dim, DType dtype,
                       int64_t row_elems, int head, void* k, void* v, void* stream) {
  if (h.tokens == 0) return Status::Ok();
  DenseHeadKernel<<<static_cast<unsigned>(h.tokens), kThreads, 0, AsStream(stream)>>>(
      image + h.keys, image + h.values, reinterpret_cast<const float*>(image + h.rebuilt),
      reinterpret_cast<const int32_t*>(image + h.source),
      reinterpret_cast<const int64_t*>(image + h.offsets), h.slots, head_dim,
      static_cast<int>(dtype), row_elems, static_cast<int64_t>(head) * head_dim,
      static_cast<uint8_t*>(k), static_cast<uint8_t*>(v));
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "DenseHeadKernel launch");
  return Status::Ok();
}

Status LaunchCompactHead(const uint8_t* image, const DeviceHeadLayout& h, int head_dim, DType dtype,
                         float* keys, float* values, float* bias, int64_t* positions,
                         void* stream) {
  if (h.slots == 0) return Status::Ok();
  CompactHeadKernel<<<static_cast<unsigned>(h.slots), kThreads, 0, AsStream(stream)>>>(
      image + h.keys, image + h.values, reinterpret_cast<const float*>(image + h.rebuilt),
      reinterpret_cast<const int32_t*>(image + h.source),
      reinterpret_cast<const float*>(image + h.bias),
      reinterpret_cast<const int64_t*>(image + h.positions), head_dim, static_cast<int>(dtype),
      keys, values, bias, positions);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "CompactHeadKernel launch");
  return Status::Ok();
}

}  // namespace kvd::kernels::cuda
