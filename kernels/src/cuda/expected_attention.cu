// CUDA expected-attention scores (expected_attention.h): a thread per (query head, key) for
// z_g(i), a thread block per query head for its softmax over the keys (float64 max and sum), a
// thread per key for the mean over the group times |v_i|. Host views in and out, staged through
// the device (the CPU twin is src/cpu/expected_attention.cc).
#include <climits>
#include <cmath>

#include "cuda/cuda_common.cuh"
#include "expected_attention_backend.h"

namespace kvd::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// z [G, n] = sum_c k_c (m_c + (diag_c k_c + cross_c k_partner(c)) / (2 sqrt d)) / sqrt d.
// k [n, d]; mean, diag, cross [G, d]; partner [d].
__global__ void LogitKernel(const float* __restrict__ k, const float* __restrict__ mean,
                            const float* __restrict__ diag, const float* __restrict__ cross,
                            const int32_t* __restrict__ partner, double* __restrict__ z, int64_t n,
                            int d, int groups) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= n * groups) return;
  const int64_t g = idx / n, i = idx % n;
  const float inv_sqrt_d = 1.0f / sqrtf(static_cast<float>(d));
  const float* kr = k + i * d;
  const float* m = mean + g * d;
  const float* dg = diag + g * d;
  const float* cr = cross + g * d;
  float acc = 0.0f;
  for (int c = 0; c < d; ++c) {
    const float w = m[c] + (dg[c] * kr[c] + cr[c] * kr[partner[c]]) * (0.5f * inv_sqrt_d);
    acc = fmaf(kr[c], w, acc);
  }
  z[idx] = static_cast<double>(acc) * inv_sqrt_d;
}

// One block per query head g: z[g] <- softmax(z[g]) over the n keys, in float64.
__global__ void SoftmaxKernel(double* __restrict__ z, int64_t n) {
  __shared__ double red[kThreads];
  double* zg = z + blockIdx.x * n;
  double mx = -INFINITY;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) mx = fmax(mx, zg[i]);
  red[threadIdx.x] = mx;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) red[threadIdx.x] = fmax(red[threadIdx.x], red[threadIdx.x + s]);
    __syncthreads();
  }
  mx = red[0];
  __syncthreads();
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    zg[i] = exp(zg[i] - mx);
    sum += zg[i];
  }
  red[threadIdx.x] = sum;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  sum = red[0];
  for (int64_t i = threadIdx.x; i < n; i += kThreads) zg[i] /= sum;
}

// scores[i] = mean_g p[g][i] * |v_i| (v == nullptr: no rescaling).
__global__ void CombineKernel(const double* __restrict__ p, const float* __restrict__ v,
                              float* __restrict__ scores, int64_t n, int d, int groups) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  double s = 0.0;
  for (int g = 0; g < groups; ++g) s += p[g * n + i];
  s /= groups;
  if (v != nullptr) {
    float ss = 0.0f;
    for (int c = 0; c < d; ++c) ss = fmaf(v[i * d + c], v[i * d + c], ss);
    s *= sqrt(static_cast<double>(ss));
  }
  scores[i] = static_cast<float>(s);
}

}  // namespace

Status ExpectedAttentionScores(const ExpectedQueries& q, ConstMatrixView keys,
                               ConstMatrixView values, float* scores, void* stream_ptr) {
  cudaStream_t stream = AsStream(stream_ptr);
  const int64_t n = keys.rows;
  const int d = static_cast<int>(keys.cols), G = q.group_size;
  if (n * G > INT_MAX) {
    return Status::InvalidArgument("expected_attention: N too large for the CUDA kernel");
  }
  const size_t gd = static_cast<size_t>(G) * d;
  DeviceBuffer<float> dk, dv, dmean, ddiag, dcross, dscores;
  DeviceBuffer<int32_t> dpartner;
  DeviceBuffer<double> dz;
  KVD_RETURN_IF_ERROR(UploadMatrix(keys, &dk, stream));
  if (values.rows != 0) KVD_RETURN_IF_ERROR(UploadMatrix(values, &dv, stream));
  KVD_RETURN_IF_ERROR(dmean.Allocate(gd));
  KVD_RETURN_IF_ERROR(ddiag.Allocate(gd));
  KVD_RETURN_IF_ERROR(dcross.Allocate(gd));
  KVD_RETURN_IF_ERROR(dpartner.Allocate(static_cast<size_t>(d)));
  KVD_RETURN_IF_ERROR(dz.Allocate(static_cast<size_t>(n) * G));
  KVD_RETURN_IF_ERROR(dscores.Allocate(static_cast<size_t>(n)));
  KVD_RETURN_IF_ERROR(dmean.Upload(q.mean.data(), gd, stream));
  KVD_RETURN_IF_ERROR(ddiag.Upload(q.diag.data(), gd, stream));
  KVD_RETURN_IF_ERROR(dcross.Upload(q.cross.data(), gd, stream));
  KVD_RETURN_IF_ERROR(dpartner.Upload(q.partner.data(), static_cast<size_t>(d), stream));
  LogitKernel<<<Blocks(n * G, kThreads), kThreads, 0, stream>>>(
      dk.get(), dmean.get(), ddiag.get(), dcross.get(), dpartner.get(), dz.get(), n, d, G);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "expected_attention LogitKernel");
  SoftmaxKernel<<<static_cast<unsigned>(G), kThreads, 0, stream>>>(dz.get(), n);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "expected_attention SoftmaxKernel");
  CombineKernel<<<Blocks(n, kThreads), kThreads, 0, stream>>>(
      dz.get(), values.rows != 0 ? dv.get() : nullptr, dscores.get(), n, d, G);
  KVD_RETURN_IF_ERROR(dscores.Download(scores, static_cast<size_t>(n), stream));
  return FinishLaunch(stream, "ExpectedAttentionScores");
}

}  // namespace kvd::kernels::cuda
