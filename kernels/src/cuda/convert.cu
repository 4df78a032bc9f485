// CUDA gather/scatter between an engine tensor [N, H, d] and per-head float32 [H][N, d].
// The launchers (launch.cuh) take device pointers; the host-view twins (convert.h) stage through
// device memory and call them.
#include <vector>

#include "backend_a.h"
#include "cuda/cuda_common.cuh"
#include "cuda/elements.cuh"
#include "cuda/launch.cuh"

namespace kvd::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// `layers` tensors, layer l at element l * src_layer_stride of src: [N, H, d] of dtype;
// dst: [layers, H, N, d] float32.
__global__ void GatherKernel(const void* __restrict__ src, float* __restrict__ dst, int64_t n,
                             int64_t h, int64_t d, int dtype, int64_t layers,
                             int64_t src_layer_stride) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t per_layer = n * h * d;
  if (idx >= layers * per_layer) return;
  const int64_t l = idx / per_layer, r = idx % per_layer;
  const int64_t c = r % d, head = (r / d) % h, row = r / (d * h);
  dst[l * per_layer + (head * n + row) * d + c] = LoadElement(src, l * src_layer_stride + r, dtype);
}

__global__ void ScatterKernel(const float* __restrict__ src, void* __restrict__ dst, int64_t n,
                              int64_t h, int64_t d, int dtype) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= n * h * d) return;
  const int64_t c = idx % d, head = (idx / d) % h, row = idx / (d * h);
  StoreElement(dst, idx, src[(head * n + row) * d + c], dtype);
}

}  // namespace

Status LaunchGather(const void* src, float* dst, int64_t n, int64_t h, int64_t d, DType dtype,
                    cudaStream_t stream, int64_t layers, int64_t src_layer_stride) {
  const int64_t total = layers * n * h * d;
  if (total == 0) return Status::Ok();
  GatherKernel<<<Blocks(total, kThreads), kThreads, 0, stream>>>(
      src, dst, n, h, d, static_cast<int>(dtype), layers, src_layer_stride);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "GatherKernel");
  return Status::Ok();
}

Status LaunchScatter(const float* src, void* dst, int64_t n, int64_t h, int64_t d, DType dtype,
                     cudaStream_t stream) {
  const int64_t total = n * h * d;
  if (total == 0) return Status::Ok();
  ScatterKernel<<<Blocks(total, kThreads), kThreads, 0, stream>>>(src, dst, n, h, d,
                                                                  static_cast<int>(dtype));
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "ScatterKernel");
  return Status::Ok();
}

Status GatherHeads(const EngineTensorShape& shape, const void* src,
                   std::span<const MatrixView> heads, void* stream_ptr) {
  cudaStream_t stream = AsStream(stream_ptr);
  const int64_t n = shape.tokens, h = shape.num_heads, d = shape.head_dim, total = shape.Elements();
  if (total == 0) return Status::Ok();
  DeviceBuffer<unsigned char> dsrc;
  DeviceBuffer<float> ddst;
  KVD_RETURN_IF_ERROR(dsrc.Allocate(shape.Bytes()));
  KVD_RETURN_IF_ERROR(ddst.Allocate(static_cast<size_t>(total)));
  KVD_RETURN_IF_ERROR(dsrc.Upload(static_cast<const unsigned char*>(src), shape.Bytes(), stream));
  KVD_RETURN_IF_ERROR(LaunchGather(dsrc.get(), ddst.get(), n, h, d, shape.dtype, stream));
  for (int64_t head = 0; head < h; ++head) {
    const MatrixView& v = heads[static_cast<size_t>(head)];
    KVD_RETURN_IF_ERROR(DownloadRows(ddst.get() + head * n * d, n, d, v.data, v.ld, stream));
  }
  return FinishLaunch(stream, "GatherHeads");
}

Status ScatterHeads(const EngineTensorShape& shape, std::span<const ConstMatrixView> heads,
                    void* dst, void* stream_ptr) {
  cudaStream_t stream = AsStream(stream_ptr);
  const int64_t n = shape.tokens, h = shape.num_heads, d = shape.head_dim, total = shape.Elements();
  if (total == 0) return Status::Ok();
  DeviceBuffer<float> dsrc;
  DeviceBuffer<unsigned char> ddst;
  KVD_RETURN_IF_ERROR(dsrc.Allocate(static_cast<size_t>(total)));
  KVD_RETURN_IF_ERROR(ddst.Allocate(shape.Bytes()));
  for (int64_t head = 0; head < h; ++head) {
    const ConstMatrixView& v = heads[static_cast<size_t>(head)];
    KVD_RETURN_IF_ERROR(UploadRows(v.data, n, d, v.ld, dsrc.get() + head * n * d, stream));
  }
  KVD_RETURN_IF_ERROR(LaunchScatter(dsrc.get(), ddst.get(), n, h, d, shape.dtype, stream));
  KVD_RETURN_IF_ERROR(ddst.Download(static_cast<unsigned char*>(dst), shape.Bytes(), stream));
  return FinishLaunch(stream, "ScatterHeads");
}

}  // namespace kvd::kernels::cuda
