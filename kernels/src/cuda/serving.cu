// CUDA twin of the dense expansion (serving_backend.h): host views in and out, staged on device.
#include <cuda_runtime.h>

#include "cuda/cuda_common.cuh"
#include "cuda/slot_search.cuh"
#include "serving_backend.h"

namespace kvd::kernels::cuda {
namespace {

// One block per output row t: finds its slot j (offsets[j] <= t < offsets[j+1]) by binary
// search, then copies the d floats of key and value.
// keys, values: [S, d]; offsets: [S + 1]; keys_out, values_out: [T, d].
__global__ void ExpandDenseKernel(const float* __restrict__ keys, const float* __restrict__ values,
                                  const int64_t* __restrict__ offsets, int64_t s, int d,
                                  float* __restrict__ keys_out, float* __restrict__ values_out) {
  const int64_t t = blockIdx.x;
  const int64_t lo = SlotOfDenseRow(offsets, s, t);
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    keys_out[t * d + c] = keys[lo * d + c];
    values_out[t * d + c] = values[lo * d + c];
  }
}

}  // namespace

Status ExpandDense(ConstMatrixView keys, ConstMatrixView values, const int64_t* offsets,
                   MatrixView keys_out, MatrixView values_out, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t s = keys.rows;
  const int d = static_cast<int>(keys.cols);
  const int64_t t = offsets[s];
  DeviceBuffer<float> dk, dv, dko, dvo;
  DeviceBuffer<int64_t> doff;
  KVD_RETURN_IF_ERROR(UploadMatrix(keys, &dk, stream));
  KVD_RETURN_IF_ERROR(UploadMatrix(values, &dv, stream));
  KVD_RETURN_IF_ERROR(doff.Allocate(static_cast<size_t>(s + 1)));
  KVD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(doff.get(), offsets, (s + 1) * sizeof(int64_t),
                                           cudaMemcpyHostToDevice, stream),
                           "upload offsets");
  KVD_RETURN_IF_ERROR(dko.Allocate(static_cast<size_t>(t * d)));
  KVD_RETURN_IF_ERROR(dvo.Allocate(static_cast<size_t>(t * d)));
  ExpandDenseKernel<<<static_cast<unsigned>(t), 128, 0, stream>>>(dk.get(), dv.get(), doff.get(), s,
                                                                  d, dko.get(), dvo.get());
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "ExpandDenseKernel launch");
  KVD_RETURN_IF_ERROR(DownloadMatrix(dko.get(), keys_out, stream));
  KVD_RETURN_IF_ERROR(DownloadMatrix(dvo.get(), values_out, stream));
  KVD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "ExpandDense");
  return Status::Ok();
}

}  // namespace kvd::kernels::cuda
