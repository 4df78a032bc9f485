// CUDA KeyDiff scores: a warp per row for the norms (zero-norm rows flagged), a thread per
// dimension for the float64 anchor, a warp per row for -cos to the unit anchor.
#include <climits>
#include <cmath>
#include <vector>

#include "backend_a.h"
#include "cuda/cuda_common.cuh"
#include "cuda/launch.cuh"

namespace kvd::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float WarpSum(float x) {
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// inv_norm[i] = 1/|k_i|; *bad_row = min row with |k_i|^2 < 1e-30.
__global__ void NormKernel(const float* __restrict__ k, float* __restrict__ inv_norm, int* bad_row,
                           int64_t n, int d) {
  const int64_t row = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  float ss = 0.0f;
  for (int c = lane; c < d; c += 32) ss = fmaf(k[row * d + c], k[row * d + c], ss);
  ss = WarpSum(ss);
  if (lane == 0) {
    if (!(ss >= 1e-30f)) {
      atomicMin(bad_row, static_cast<int>(row));
      inv_norm[row] = 0.0f;
    } else {
      inv_norm[row] = rsqrtf(ss);
    }
  }
}

// anchor[c] = sum_i k[i][c] * inv_norm[i] in float64.
__global__ void AnchorKernel(const float* __restrict__ k, const float* __restrict__ inv_norm,
                             double* __restrict__ anchor, int64_t n, int d) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= d) return;
  double acc = 0.0;
  for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(k[i * d + c] * inv_norm[i]);
  anchor[c] = acc;
}

__global__ void ScoreKernel(const float* __restrict__ k, const float* __restrict__ inv_norm,
                            const float* __restrict__ unit_anchor, float* __restrict__ scores,
                            int64_t n, int d) {
  const int64_t row = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  float dot = 0.0f;
  for (int c = lane; c < d; c += 32) dot = fmaf(k[row * d + c], unit_anchor[c], dot);
  dot = WarpSum(dot);
  if (lane == 0) scores[row] = -dot * inv_norm[row];
}

}  // namespace

Status LaunchKeyDiffNorms(const float* k, float* inv_norm, int* bad_row, int64_t n, int d,
                          cudaStream_t stream) {
  if (n == 0) return Status::Ok();
  NormKernel<<<Blocks(n * 32, kThreads), kThreads, 0, stream>>>(k, inv_norm, bad_row, n, d);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "NormKernel");
  return Status::Ok();
}

Status LaunchKeyDiffAnchor(const float* k, const float* inv_norm, double* anchor, int64_t n, int d,
                           cudaStream_t stream) {
  AnchorKernel<<<Blocks(d, 128), 128, 0, stream>>>(k, inv_norm, anchor, n, d);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "AnchorKernel");
  return Status::Ok();
}

Status LaunchKeyDiffScores(const float* k, const float* inv_norm, const float* unit_anchor,
                           float* scores, int64_t n, int d, cudaStream_t stream) {
  if (n == 0) return Status::Ok();
  ScoreKernel<<<Blocks(n * 32, kThreads), kThreads, 0, stream>>>(k, inv_norm, unit_anchor, scores,
                                                                 n, d);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "ScoreKernel");
  return Status::Ok();
}

Status KeyDiffScores(ConstMatrixView keys, float* scores, bool* zero_norm, int64_t* bad_row,
                     void* stream_ptr) {
  cudaStream_t stream = AsStream(stream_ptr);
  const int64_t n = keys.rows;
  const int d = static_cast<int>(keys.cols);
  *zero_norm = false;
  if (n > INT_MAX) return Status::InvalidArgument("keydiff: N too large for the CUDA kernel");
  DeviceBuffer<float> dk, dinv, dunit, dscores;
  DeviceBuffer<double> danchor;
  DeviceBuffer<int> dbad;
  KVD_RETURN_IF_ERROR(dk.Allocate(static_cast<size_t>(n * d)));
  KVD_RETURN_IF_ERROR(dinv.Allocate(static_cast<size_t>(n)));
  KVD_RETURN_IF_ERROR(dunit.Allocate(static_cast<size_t>(d)));
  KVD_RETURN_IF_ERROR(dscores.Allocate(static_cast<size_t>(n)));
  KVD_RETURN_IF_ERROR(danchor.Allocate(static_cast<size_t>(d)));
  KVD_RETURN_IF_ERROR(dbad.Allocate(1));
  KVD_RETURN_IF_ERROR(UploadRows(keys.data, n, d, keys.ld, dk.get(), stream));
  const int no_bad = INT_MAX;
  KVD_RETURN_IF_ERROR(dbad.Upload(&no_bad, 1, stream));
  KVD_RETURN_IF_ERROR(LaunchKeyDiffNorms(dk.get(), dinv.get(), dbad.get(), n, d, stream));
  KVD_RETURN_IF_ERROR(LaunchKeyDiffAnchor(dk.get(), dinv.get(), danchor.get(), n, d, stream));
  int bad = INT_MAX;
  std::vector<double> anchor(static_cast<size_t>(d));
  KVD_RETURN_IF_ERROR(dbad.Download(&bad, 1, stream));
  KVD_RETURN_IF_ERROR(danchor.Download(anchor.data(), static_cast<size_t>(d), stream));
  KVD_RETURN_IF_ERROR(FinishLaunch(stream, "KeyDiff anchor"));
  if (bad != INT_MAX) {
    *zero_norm = true;
    *bad_row = bad;
    return Status::Ok();
  }
  double norm = 0.0;
  for (double a : anchor) norm += a * a;
  norm = std::sqrt(norm);
  if (!(norm > 1e-6 * static_cast<double>(n))) {  // same contract as the CPU: all scores 0
    for (int64_t i = 0; i < n; ++i) scores[i] = 0.0f;
    return Status::Ok();
  }
  std::vector<float> unit(static_cast<size_t>(d));
  for (int c = 0; c < d; ++c)
    unit[static_cast<size_t>(c)] = static_cast<float>(anchor[static_cast<size_t>(c)] / norm);
  KVD_RETURN_IF_ERROR(dunit.Upload(unit.data(), static_cast<size_t>(d), stream));
  KVD_RETURN_IF_ERROR(
      LaunchKeyDiffScores(dk.get(), dinv.get(), dunit.get(), dscores.get(), n, d, stream));
  KVD_RETURN_IF_ERROR(dscores.Download(scores, static_cast<size_t>(n), stream));
  return FinishLaunch(stream, "KeyDiffScores");
}

}  // namespace kvd::kernels::cuda
