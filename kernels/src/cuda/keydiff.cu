// CUDA KeyDiff scores: a warp per row for the norms (zero-norm rows flagged), a thread per
// (head, dimension) for the float64 anchor, a thread per head for the unit anchor, a warp per row
// for -cos to the unit anchor; and the block-wise selection, a thread block per head. Every
// launcher takes `heads` independent [n, d] key matrices back to back (the device plan scores all
// (layer, KV head) rows of a chunk at once); the host-view twin is heads = 1.
#include <climits>
#include <cmath>
#include <cub/block/block_scan.cuh>
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

// inv_norm[i] = 1/|k_i| over `rows` rows of k [rows, d]; *bad_row = min row with |k_i|^2 < 1e-30
// (its inv_norm is 0).
__global__ void NormKernel(const float* __restrict__ k, float* __restrict__ inv_norm, int* bad_row,
                           int64_t rows, int d) {
  const int64_t row = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
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

// anchor[h][c] = sum_i k[h][i][c] * inv_norm[h][i] in float64, for h < heads, c < d.
__global__ void AnchorKernel(const float* __restrict__ k, const float* __restrict__ inv_norm,
                             double* __restrict__ anchor, int64_t heads, int64_t n, int d) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= heads * d) return;
  const int64_t h = idx / d, c = idx % d;
  const float* kh = k + h * n * d;
  const float* inv = inv_norm + h * n;
  double acc = 0.0;
  for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(kh[i * d + c] * inv[i]);
  anchor[idx] = acc;
}

// unit[h] = anchor[h] / |anchor[h]| rounded to float32, ok[h] = 1; when the keys cancel
// (|anchor[h]| <= 1e-6 n, keydiff.h) unit[h] = 0 and ok[h] = 0: every score of the head is 0.
// One thread per head: the norm is summed in dimension order, as the CPU does.
__global__ void UnitAnchorKernel(const double* __restrict__ anchor, float* __restrict__ unit,
                                 uint8_t* __restrict__ ok, int64_t heads, int64_t n, int d) {
  const int64_t h = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (h >= heads) return;
  const double* a = anchor + h * d;
  double norm = 0.0;
  for (int c = 0; c < d; ++c) norm += a[c] * a[c];
  norm = sqrt(norm);
  const bool good = norm > 1e-6 * static_cast<double>(n);
  for (int c = 0; c < d; ++c) unit[h * d + c] = good ? static_cast<float>(a[c] / norm) : 0.0f;
  ok[h] = good ? 1 : 0;
}

// scores[r] = -(k_r . unit[r / n]) inv_norm[r] for the heads * n rows; 0 for a head whose
// anchor is zero (ok[h] == 0).
__global__ void ScoreKernel(const float* __restrict__ k, const float* __restrict__ inv_norm,
                            const float* __restrict__ unit_anchor, const uint8_t* __restrict__ ok,
                            float* __restrict__ scores, int64_t rows, int64_t n, int d) {
  const int64_t row = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int64_t h = row / n;
  const float* a = unit_anchor + h * d;
  float dot = 0.0f;
  for (int c = lane; c < d; c += 32) dot = fmaf(k[row * d + c], a[c], dot);
  dot = WarpSum(dot);
  if (lane == 0) scores[row] = ok[h] ? -dot * inv_norm[row] : 0.0f;
}

// Block-wise KeyDiff (KeyDiffBlockwiseSelect, keydiff.h), one thread block per head: the kept
// list and the candidates live in cand [cap] (ascending token indices), their scores in
// score [cap]. Per block of tokens: candidates = kept + block; if they fit the budget they are
// all kept, else the anchor of the candidates (float64, over their unit keys) scores them and
// SelectTopK's rule keeps `budget`: the candidates below `sinks` and from the window, then the
// best middle scores (higher first, ties to the lower index; rank by counting, exact). A
// zero-norm candidate sets *bad = min(*bad, head * n + token) (the CPU refuses the chunk).
// keep [n] gets 1 for the tokens kept at the end, 0 for the others.
__global__ void BlockwiseSelectKernel(const float* __restrict__ k,
                                      const float* __restrict__ inv_norm,
                                      const int64_t* __restrict__ budgets, int64_t heads_per_budget,
                                      int64_t n, int d, int64_t sinks, int64_t window,
                                      int64_t block, int32_t* __restrict__ cand_all,
                                      float* __restrict__ score_all, int64_t cap,
                                      uint8_t* __restrict__ keep_all, int* bad) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ double anchor[kMaxHeadDim];
  __shared__ float unit[kMaxHeadDim];
  __shared__ double norm;
  __shared__ int64_t kept_n, base, s_cand, w_cand;
  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, warps = kThreads / 32;
  const int64_t budget = budgets[row / heads_per_budget];
  const float* kr = k + row * n * d;
  const float* inv = inv_norm + row * n;
  int32_t* cand = cand_all + row * cap;
  float* score = score_all + row * cap;
  uint8_t* keep = keep_all + row * n;
  for (int64_t i = tid; i < n; i += kThreads) keep[i] = 0;
  if (tid == 0) kept_n = 0;
  __syncthreads();
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    const int64_t b1 = b0 + block < n ? b0 + block : n;
    const int64_t kept = kept_n;
    const int64_t c = kept + (b1 - b0);  // <= budget + block <= cap (the caller sizes cap)
    for (int64_t t = tid; t < b1 - b0; t += kThreads) cand[kept + t] = static_cast<int32_t>(b0 + t);
    __syncthreads();
    if (c <= budget) {
      if (tid == 0) kept_n = c;
      __syncthreads();
      continue;
    }
    for (int cc = tid; cc < d; cc += kThreads) {
      double acc = 0.0;
      for (int64_t i = 0; i < c; ++i) {
        const int64_t t = cand[i];
        acc += static_cast<double>(kr[t * d + cc] * inv[t]);
      }
      anchor[cc] = acc;
    }
    for (int64_t i = tid; i < c; i += kThreads) {
      if (inv[cand[i]] == 0.0f) atomicMin(bad, static_cast<int>(row * n + cand[i]));
    }
    __syncthreads();
    if (tid == 0) {
      double ss = 0.0;
      for (int cc = 0; cc < d; ++cc) ss += anchor[cc] * anchor[cc];
      norm = sqrt(ss);
      // Candidates are ascending: the sinks are a prefix, the window tokens a suffix.
      int64_t s = 0, w = 0;
      while (s < c && cand[s] < sinks) ++s;
      while (w < c - s && cand[c - 1 - w] >= n - window) ++w;
      s_cand = s;
      w_cand = w;
      base = 0;
    }
    __syncthreads();
    const bool good = norm > 1e-6 * static_cast<double>(c);
    for (int cc = tid; cc < d; cc += kThreads) {
      unit[cc] = good ? static_cast<float>(anchor[cc] / norm) : 0.0f;
    }
    __syncthreads();
    for (int64_t i = warp; i < c; i += warps) {
      const int64_t t = cand[i];
      float dot = 0.0f;
      for (int cc = lane; cc < d; cc += 32) dot = fmaf(kr[t * d + cc], unit[cc], dot);
      dot = WarpSum(dot);
      if (lane == 0) score[i] = good ? -dot * inv[t] : 0.0f;
    }
    __syncthreads();
    const int64_t s = s_cand, w = w_cand, k_mid = budget - s - w;
    for (int64_t t0 = 0; t0 < c; t0 += kThreads) {
      const int64_t i = t0 + tid;
      int pred = 0;
      int32_t tok = 0;
      if (i < c) {
        tok = cand[i];
        if (i < s || i >= c - w) {
          pred = 1;
        } else {
          const float si = score[i];
          int64_t rank = 0;
          for (int64_t j = s; j < c - w && rank < k_mid; ++j) {
            const float sj = score[j];
            rank += (sj > si || (sj == si && j < i)) ? 1 : 0;
          }
          pred = rank < k_mid ? 1 : 0;
        }
      }
      int rank = 0, total = 0;
      Scan(temp).ExclusiveSum(pred, rank, total);
      __syncthreads();  // every read of cand[t0, t0 + kThreads) before the writes below
      // The kept entries move left (base + rank <= i): nothing unread is overwritten.
      if (pred) cand[base + rank] = tok;
      __syncthreads();
      if (tid == 0) base += total;
      __syncthreads();
    }
    if (tid == 0) kept_n = base;
    __syncthreads();
  }
  for (int64_t i = tid; i < kept_n; i += kThreads) keep[cand[i]] = 1;
}

}  // namespace

Status LaunchKeyDiffNorms(const float* k, float* inv_norm, int* bad_row, int64_t rows, int d,
                          cudaStream_t stream) {
  if (rows == 0) return Status::Ok();
  NormKernel<<<Blocks(rows * 32, kThreads), kThreads, 0, stream>>>(k, inv_norm, bad_row, rows, d);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "NormKernel");
  return Status::Ok();
}

Status LaunchKeyDiffAnchor(const float* k, const float* inv_norm, double* anchor, int64_t n, int d,
                           cudaStream_t stream, int64_t heads) {
  if (heads == 0) return Status::Ok();
  AnchorKernel<<<Blocks(heads * d, 128), 128, 0, stream>>>(k, inv_norm, anchor, heads, n, d);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "AnchorKernel");
  return Status::Ok();
}

Status LaunchKeyDiffUnitAnchor(const double* anchor, float* unit_anchor, uint8_t* anchor_ok,
                               int64_t n, int d, cudaStream_t stream, int64_t heads) {
  if (heads == 0) return Status::Ok();
  UnitAnchorKernel<<<Blocks(heads, 64), 64, 0, stream>>>(anchor, unit_anchor, anchor_ok, heads, n,
                                                         d);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "UnitAnchorKernel");
  return Status::Ok();
}

Status LaunchKeyDiffScores(const float* k, const float* inv_norm, const float* unit_anchor,
                           const uint8_t* anchor_ok, float* scores, int64_t n, int d,
                           cudaStream_t stream, int64_t heads) {
  if (n == 0 || heads == 0) return Status::Ok();
  ScoreKernel<<<Blocks(heads * n * 32, kThreads), kThreads, 0, stream>>>(
      k, inv_norm, unit_anchor, anchor_ok, scores, heads * n, n, d);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "ScoreKernel");
  return Status::Ok();
}

Status LaunchKeyDiffBlockwiseSelect(const float* k, const float* inv_norm, const int64_t* budgets,
                                    int64_t heads_per_budget, int64_t heads, int64_t n, int d,
                                    int64_t sinks, int64_t window, int64_t block, int32_t* cand,
                                    float* cand_scores, int64_t cap, uint8_t* keep, int* bad,
                                    cudaStream_t stream) {
  if (heads == 0 || n == 0) return Status::Ok();
  if (d > kMaxHeadDim || block < 1 || heads_per_budget < 1 || n > INT_MAX || heads * n > INT_MAX) {
    return Status::InvalidArgument("keydiff: block-wise selection shape out of range");
  }
  BlockwiseSelectKernel<<<static_cast<unsigned>(heads), kThreads, 0, stream>>>(
      k, inv_norm, budgets, heads_per_budget, n, d, sinks, window, block, cand, cand_scores, cap,
      keep, bad);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "BlockwiseSelectKernel");
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
  DeviceBuffer<uint8_t> dok;
  DeviceBuffer<int> dbad;
  KVD_RETURN_IF_ERROR(dk.Allocate(static_cast<size_t>(n * d)));
  KVD_RETURN_IF_ERROR(dinv.Allocate(static_cast<size_t>(n)));
  KVD_RETURN_IF_ERROR(dunit.Allocate(static_cast<size_t>(d)));
  KVD_RETURN_IF_ERROR(dscores.Allocate(static_cast<size_t>(n)));
  KVD_RETURN_IF_ERROR(danchor.Allocate(static_cast<size_t>(d)));
  KVD_RETURN_IF_ERROR(dok.Allocate(1));
  KVD_RETURN_IF_ERROR(dbad.Allocate(1));
  KVD_RETURN_IF_ERROR(UploadRows(keys.data, n, d, keys.ld, dk.get(), stream));
  const int no_bad = INT_MAX;
  KVD_RETURN_IF_ERROR(dbad.Upload(&no_bad, 1, stream));
  KVD_RETURN_IF_ERROR(LaunchKeyDiffNorms(dk.get(), dinv.get(), dbad.get(), n, d, stream));
  KVD_RETURN_IF_ERROR(LaunchKeyDiffAnchor(dk.get(), dinv.get(), danchor.get(), n, d, stream));
  KVD_RETURN_IF_ERROR(LaunchKeyDiffUnitAnchor(danchor.get(), dunit.get(), dok.get(), n, d, stream));
  KVD_RETURN_IF_ERROR(LaunchKeyDiffScores(dk.get(), dinv.get(), dunit.get(), dok.get(),
                                          dscores.get(), n, d, stream));
  int bad = INT_MAX;
  KVD_RETURN_IF_ERROR(dbad.Download(&bad, 1, stream));
  KVD_RETURN_IF_ERROR(dscores.Download(scores, static_cast<size_t>(n), stream));
  KVD_RETURN_IF_ERROR(FinishLaunch(stream, "KeyDiffScores"));
  if (bad != INT_MAX) {
    *zero_norm = true;
    *bad_row = bad;
  }
  return Status::Ok();
}

}  // namespace kvd::kernels::cuda
