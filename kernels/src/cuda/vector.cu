// CUDA twins of the VECTOR ops (contracts in vector_backend.h). The launchers (launch.cuh) take
// device pointers; the twins take host views, stage them through device memory on the given
// stream, call the launchers and synchronise the stream before returning.
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "cuda/cuda_common.cuh"
#include "cuda/launch.cuh"
#include "vector_backend.h"

namespace kvd::kernels::cuda {
namespace {

constexpr int kTile = 16;           // accumulation tile (kTile x kTile outputs per block)
constexpr int kTokensPerBlock = 8;  // residual / rebuild: tokens sharing one pass over W

// out[r, c] += sum_i kpre[i, r] * x[i, c] for r < d, c < 2d, where x = [kpre | values].
// Products and sums in float64, as on the CPU.   // kpre, values: [n, d]; out: [d, 2d]
__global__ void GramCrossKernel(const float* __restrict__ kpre, const float* __restrict__ values,
                                int64_t n, int d, double* __restrict__ out) {
  __shared__ double a[kTile][kTile + 1];  // [i][r]
  __shared__ double b[kTile][kTile + 1];  // [i][c]
  const int r = blockIdx.y * kTile + threadIdx.y;
  const int c = blockIdx.x * kTile + threadIdx.x;
  double acc = 0.0;
  for (int64_t i0 = 0; i0 < n; i0 += kTile) {
    // Load a tile of kpre columns [blockIdx.y*kTile, +kTile) and of x columns.
    const int64_t i = i0 + threadIdx.y;
    const int ar = blockIdx.y * kTile + threadIdx.x;
    a[threadIdx.y][threadIdx.x] = (i < n && ar < d) ? static_cast<double>(kpre[i * d + ar]) : 0.0;
    double bv = 0.0;
    if (i < n && c < 2 * d) {
      bv =
          c < d ? static_cast<double>(kpre[i * d + c]) : static_cast<double>(values[i * d + c - d]);
    }
    b[threadIdx.y][threadIdx.x] = bv;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kTile; ++k) acc += a[k][threadIdx.y] * b[k][threadIdx.x];
    __syncthreads();
  }
  if (r < d && c < 2 * d) out[static_cast<int64_t>(r) * 2 * d + c] += acc;
}

// sums[c] = sum_i values[i, c] (c < d); sums[d] = sum_i |values_i|^2.  // values: [n, d]
__global__ void ValueSumsKernel(const float* __restrict__ values, int64_t n, int d,
                                double* __restrict__ sums) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= d) return;
  double s = 0.0, sq = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = values[i * d + c];
    s += v;
    sq += v * v;
  }
  sums[c] = s;
  atomicAdd(&sums[d], sq);
}

// For kTokensPerBlock tokens per block, thread r computes p[t][r] = sum_c wt[c, r] kpre[t, c]
// (wt = W^T so that threads read consecutive addresses). Then either writes p (rebuild) or
// reduces |v_t - p_t|^2 (residuals).   // kpre, values, out: [n, d]; wt: [d, d]; residuals: [n]
template <bool kResidual>
__global__ void ProjectKernel(const float* __restrict__ kpre, const float* __restrict__ wt,
                              const float* __restrict__ values, int64_t n, int d,
                              float* __restrict__ out, float* __restrict__ residuals,
                              const float* __restrict__ bias) {
  extern __shared__ float shared[];  // [kTokensPerBlock, d] keys, then [kTokensPerBlock] sums
  // Head blockIdx.y of a batch: rows [n, d] of kpre/values/out, [n] of residuals, its own W^T.
  const int64_t head = blockIdx.y;
  kpre += head * n * d;
  wt += head * d * d;
  if (values != nullptr) values += head * n * d;
  if (out != nullptr) out += head * n * d;
  if (residuals != nullptr) residuals += head * n;
  if (bias != nullptr) bias += head * d;
  float* keys = shared;
  float* sums = shared + kTokensPerBlock * d;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTokensPerBlock;
  const int tokens = static_cast<int>(n - t0 < kTokensPerBlock ? n - t0 : kTokensPerBlock);
  for (int k = threadIdx.x; k < kTokensPerBlock * d; k += blockDim.x) {
    const int t = k / d;
    keys[k] = t < tokens ? kpre[(t0 + t) * d + (k % d)] : 0.0f;
  }
  if (threadIdx.x < kTokensPerBlock) sums[threadIdx.x] = 0.0f;
  __syncthreads();
  const int r = threadIdx.x;
  if (r < d) {
    float acc[kTokensPerBlock] = {};
    for (int c = 0; c < d; ++c) {
      const float w = wt[static_cast<int64_t>(c) * d + r];
#pragma unroll
      for (int t = 0; t < kTokensPerBlock; ++t) acc[t] += w * keys[t * d + c];
    }
    for (int t = 0; t < tokens; ++t) {
      if (kResidual) {
        // An affine head: (v - b) rounded to float32 first, as the CPU's shifted values.
        const float v = values[(t0 + t) * d + r];
        const float shifted = bias != nullptr ? __fsub_rn(v, bias[r]) : v;
        const float diff = shifted - acc[t];
        atomicAdd(&sums[t], diff * diff);
      } else {
        out[(t0 + t) * d + r] = acc[t];
      }
    }
  }
  if (kResidual) {
    __syncthreads();
    if (threadIdx.x < tokens) residuals[t0 + threadIdx.x] = sums[threadIdx.x];
  }
}

int ThreadsFor(int d) { return std::min(1024, (d + 31) / 32 * 32); }

Status UploadTransposed(ConstMatrixView w, DeviceBuffer<float>* buf, cudaStream_t stream,
                        std::vector<float>* host) {
  const int64_t d = w.rows;
  host->resize(static_cast<size_t>(d * d));
  for (int64_t r = 0; r < d; ++r) {
    for (int64_t c = 0; c < d; ++c) (*host)[c * d + r] = w.Row(r)[c];
  }
  return UploadMatrix(ConstMatrixView{host->data(), d, d, d}, buf, stream);
}

template <bool kResidual>
Status LaunchProject(const float* kpre, const float* wt, const float* values, int64_t n, int d,
                     float* out, float* residuals, cudaStream_t stream, int64_t batch = 1,
                     const float* bias = nullptr) {
  if (n == 0 || batch == 0) return Status::Ok();
  if (batch > 65535) return Status::InvalidArgument("VECTOR project: batch too large");
  const dim3 blocks(static_cast<unsigned>((n + kTokensPerBlock - 1) / kTokensPerBlock),
                    static_cast<unsigned>(batch));
  const size_t smem = (static_cast<size_t>(kTokensPerBlock) * d + kTokensPerBlock) * sizeof(float);
  ProjectKernel<kResidual>
      <<<blocks, ThreadsFor(d), smem, stream>>>(kpre, wt, values, n, d, out, residuals, bias);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "VECTOR project kernel launch");
  return Status::Ok();
}

template <bool kResidual>
Status Project(ConstMatrixView kpre, ConstMatrixView w, ConstMatrixView values, MatrixView out,
               float* residuals, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t n = kpre.rows;
  const int d = static_cast<int>(kpre.cols);
  DeviceBuffer<float> dk, dw, dv, dout;
  std::vector<float> wt;
  KVD_RETURN_IF_ERROR(UploadMatrix(kpre, &dk, stream));
  KVD_RETURN_IF_ERROR(UploadTransposed(w, &dw, stream, &wt));
  if (kResidual) {
    KVD_RETURN_IF_ERROR(UploadMatrix(values, &dv, stream));
    KVD_RETURN_IF_ERROR(dout.Allocate(static_cast<size_t>(n)));
  } else {
    KVD_RETURN_IF_ERROR(dout.Allocate(static_cast<size_t>(n * d)));
  }
  KVD_RETURN_IF_ERROR(LaunchProject<kResidual>(dk.get(), dw.get(), kResidual ? dv.get() : nullptr,
                                               n, d, kResidual ? nullptr : dout.get(),
                                               kResidual ? dout.get() : nullptr, stream));
  if (kResidual) {
    KVD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(residuals, dout.get(), n * sizeof(float), cudaMemcpyDeviceToHost, stream),
        "download residuals");
  } else {
    KVD_RETURN_IF_ERROR(DownloadMatrix(dout.get(), out, stream));
  }
  KVD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "VECTOR project");
  return Status::Ok();
}

}  // namespace

Status LaunchVectorResiduals(const float* kpre, const float* wt, const float* values, int64_t n,
                             int d, float* residuals, cudaStream_t stream, int64_t batch,
                             const float* bias) {
  return LaunchProject<true>(kpre, wt, values, n, d, nullptr, residuals, stream, batch, bias);
}

Status LaunchRebuildValues(const float* kpre, const float* wt, int64_t n, int d, float* out,
                           cudaStream_t stream) {
  return LaunchProject<false>(kpre, wt, nullptr, n, d, out, nullptr, stream);
}

Status LaunchVectorStats(const float* kpre, const float* values, int64_t n, int d,
                         double* gram_cross, double* sums, cudaStream_t stream) {
  if (n == 0) return Status::Ok();
  const dim3 block(kTile, kTile);
  const dim3 grid((2 * d + kTile - 1) / kTile, (d + kTile - 1) / kTile);
  GramCrossKernel<<<grid, block, 0, stream>>>(kpre, values, n, d, gram_cross);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "GramCrossKernel launch");
  ValueSumsKernel<<<(d + 127) / 128, 128, 0, stream>>>(values, n, d, sums);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "ValueSumsKernel launch");
  return Status::Ok();
}

Status AccumulateVectorStats(ConstMatrixView kpre, ConstMatrixView values, VectorHeadStats* stats,
                             void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t n = kpre.rows;
  const int d = static_cast<int>(kpre.cols);
  if (n == 0) return Status::Ok();
  DeviceBuffer<float> dk, dv;
  DeviceBuffer<double> dout, dsums;
  KVD_RETURN_IF_ERROR(UploadMatrix(kpre, &dk, stream));
  KVD_RETURN_IF_ERROR(UploadMatrix(values, &dv, stream));
  KVD_RETURN_IF_ERROR(dout.Allocate(static_cast<size_t>(d) * 2 * d));
  KVD_RETURN_IF_ERROR(dsums.Allocate(static_cast<size_t>(d) + 1));
  KVD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dout.get(), 0, dout.size() * sizeof(double), stream),
                           "memset");
  KVD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dsums.get(), 0, dsums.size() * sizeof(double), stream),
                           "memset");
  KVD_RETURN_IF_ERROR(LaunchVectorStats(dk.get(), dv.get(), n, d, dout.get(), dsums.get(), stream));
  std::vector<double> host(dout.size()), sums(dsums.size());
  KVD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host.data(), dout.get(), host.size() * sizeof(double),
                                           cudaMemcpyDeviceToHost, stream),
                           "download Gram");
  KVD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sums.data(), dsums.get(), sums.size() * sizeof(double),
                                           cudaMemcpyDeviceToHost, stream),
                           "download sums");
  KVD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "AccumulateVectorStats");
  for (int r = 0; r < d; ++r) {
    for (int c = 0; c < d; ++c) {
      stats->gram[r * d + c] += host[static_cast<size_t>(r) * 2 * d + c];
      stats->cross[r * d + c] += host[static_cast<size_t>(r) * 2 * d + d + c];
    }
  }
  for (int c = 0; c < d; ++c) stats->value_sum[c] += sums[c];
  stats->value_sq_sum += sums[d];
  stats->count += n;
  return Status::Ok();
}

Status VectorResiduals(ConstMatrixView kpre, ConstMatrixView values, ConstMatrixView w,
                       float* residuals, void* stream) {
  return Project<true>(kpre, w, values, MatrixView{}, residuals, stream);
}

Status RebuildValues(ConstMatrixView kpre, ConstMatrixView w, MatrixView out, void* stream) {
  return Project<false>(kpre, w, ConstMatrixView{}, out, nullptr, stream);
}

}  // namespace kvd::kernels::cuda
