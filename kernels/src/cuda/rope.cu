// CUDA RoPE: one thread per (row, rotated pair), looping over heads; the angle is formed and
// reduced in float64 (as on the CPU), sin/cos in float64 then rounded.
#include <vector>

#include "backend_a.h"
#include "cuda/cuda_common.cuh"
#include "cuda/launch.cuh"

namespace kvd::kernels::cuda {
namespace {

// x: [H, N, d] dense; pos: [N] (pos_stride 0) or [H, N] (pos_stride N); inv_freq: [half].
__global__ void RopeKernel(float* __restrict__ x, const int64_t* __restrict__ pos,
                           int64_t pos_stride, const double* __restrict__ inv_freq, int64_t n,
                           int64_t num_heads, int64_t d, int half, bool interleaved, float sign) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= n * half) return;
  const int64_t row = idx / half;
  const int k = static_cast<int>(idx % half);
  const int ia = interleaved ? 2 * k : k;
  const int ib = interleaved ? 2 * k + 1 : k + half;
  float s = 0.0f, c = 1.0f;
  for (int64_t h = 0; h < num_heads; ++h) {
    if (h == 0 || pos_stride != 0) {
      double s64, c64;
      sincos(static_cast<double>(pos[h * pos_stride + row]) * inv_freq[k], &s64, &c64);
      s = sign * static_cast<float>(s64);
      c = static_cast<float>(c64);
    }
    float* r = x + (h * n + row) * d;
    const float a = r[ia], b = r[ib];
    r[ia] = a * c - b * s;
    r[ib] = a * s + b * c;
  }
}

}  // namespace

Status LaunchRope(float* x, const int64_t* pos, int64_t pos_head_stride, const double* inv_freq,
                  int64_t n, int64_t heads, int64_t d, int half, bool interleaved,
                  RopeDirection direction, cudaStream_t stream) {
  if (n == 0 || heads == 0 || half == 0) return Status::Ok();
  constexpr int kThreads = 256;
  RopeKernel<<<Blocks(n * half, kThreads), kThreads, 0, stream>>>(
      x, pos, pos_head_stride, inv_freq, n, heads, d, half, interleaved,
      direction == RopeDirection::kRotate ? 1.0f : -1.0f);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "RopeKernel");
  return Status::Ok();
}

Status ApplyRope(const RopeTable& table, RopeDirection direction, const int64_t* positions,
                 std::span<const MatrixView> heads, void* stream_ptr) {
  cudaStream_t stream = AsStream(stream_ptr);
  if (heads.empty() || heads[0].rows == 0) return Status::Ok();
  const int64_t n = heads[0].rows, d = table.head_dim(), h = static_cast<int64_t>(heads.size());
  const int half = table.rotary_dim() / 2;
  DeviceBuffer<float> dx;
  DeviceBuffer<int64_t> dpos;
  DeviceBuffer<double> dfreq;
  KVD_RETURN_IF_ERROR(dx.Allocate(static_cast<size_t>(h * n * d)));
  KVD_RETURN_IF_ERROR(dpos.Allocate(static_cast<size_t>(n)));
  KVD_RETURN_IF_ERROR(dfreq.Allocate(static_cast<size_t>(half)));
  for (int64_t i = 0; i < h; ++i) {
    const MatrixView& v = heads[static_cast<size_t>(i)];
    KVD_RETURN_IF_ERROR(UploadRows(v.data, n, d, v.ld, dx.get() + i * n * d, stream));
  }
  KVD_RETURN_IF_ERROR(dpos.Upload(positions, static_cast<size_t>(n), stream));
  KVD_RETURN_IF_ERROR(dfreq.Upload(table.inv_freq().data(), static_cast<size_t>(half), stream));
  KVD_RETURN_IF_ERROR(LaunchRope(dx.get(), dpos.get(), 0, dfreq.get(), n, h, d, half,
                                 table.pairing() == RopePairing::kInterleaved, direction, stream));
  for (int64_t i = 0; i < h; ++i) {
    const MatrixView& v = heads[static_cast<size_t>(i)];
    KVD_RETURN_IF_ERROR(DownloadRows(dx.get() + i * n * d, n, d, v.data, v.ld, stream));
  }
  return FinishLaunch(stream, "ApplyRope");
}

}  // namespace kvd::kernels::cuda
