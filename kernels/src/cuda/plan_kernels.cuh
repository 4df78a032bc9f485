// The device plan's own kernels (plan_device.cu composes them with the launchers of launch.cuh):
// the finiteness check, recency and SnapKV scores, the top-k selection, route selection,
// compaction, the slot gather and packing, with the constants they share with the plan. Included
// by plan_device.cu only.
#pragma once

#include <climits>
#include <cub/block/block_scan.cuh>

#include "cuda/cuda_common.cuh"
#include "cuda/elements.cuh"
#include "kvd/kernels/compact_chunk.h"
#include "kvd/kernels/snapkv.h"

namespace kvd::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kBadKeysValues = 1;  // error bits set on the device
constexpr int kBadQueries = 2;
// The error words: [0] the bits above, [1] the first layer with a non-finite element, [2] the
// score stage's own report (its row's report hook reads it), [3] a sink for a report that is not
// wanted.
constexpr int kErrWords = 4;
constexpr int kErrStage = 2;
constexpr int kErrUnused = 3;

// err[0] |= bit and err[1] = min(err[1], the layer) for any non-finite element of x[0, count);
// element i belongs to layer i / layer_elems.
__global__ void FiniteKernel(const float* __restrict__ x, int64_t count, int bit,
                             int64_t layer_elems, int* err) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= count || isfinite(x[i])) return;
  atomicOr(&err[0], bit);
  atomicMin(&err[1], static_cast<int>(i / layer_elems));
}

// scores [H, n] = i (recency: later tokens first).
__global__ void RecencyKernel(float* __restrict__ scores, int64_t heads, int64_t n) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= heads * n) return;
  scores[idx] = static_cast<float>(idx % n);
}

// SnapKV scores from the mass (snapkv.h): mean = mass * (1 / rows) (MassMean), pooled over the
// n - w middle keys (avg: zero padding, divided by the kernel; max: -inf padding), window +Inf.
// mass, scores: [H, n].
__global__ void SnapScoreKernel(const float* __restrict__ mass, float* __restrict__ scores,
                                int64_t heads, int64_t n, int64_t w, int64_t rows, int kernel,
                                int pooling) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= heads * n) return;
  const int64_t j = idx % n, h = idx / n, middle = n - w;
  if (j >= middle) {
    scores[idx] = INFINITY;
    return;
  }
  const float inv = rows > 0 ? 1.0f / static_cast<float>(rows) : 0.0f;
  const float* m = mass + h * n;
  const int64_t pad = kernel / 2;
  const int64_t lo = j - pad < 0 ? 0 : j - pad, hi = j + pad > middle - 1 ? middle - 1 : j + pad;
  if (pooling == static_cast<int>(PoolingKind::kAvg)) {
    float sum = 0.0f;
    for (int64_t i = lo; i <= hi; ++i) sum = __fadd_rn(sum, __fmul_rn(m[i], inv));
    scores[idx] = __fdiv_rn(sum, static_cast<float>(kernel));
  } else {
    float mx = -INFINITY;
    for (int64_t i = lo; i <= hi; ++i) mx = fmaxf(mx, __fmul_rn(m[i], inv));
    scores[idx] = mx;
  }
}

// Per-layer slot table (see the file comment): meta[l] = S_l, meta[L + l] = 2a_l,
// meta[2L + l] = the layer's first slot in the packed output, meta[3L + l] = its first value.
struct Meta {
  const int64_t* m;
  int64_t layers;
  __device__ int64_t Slots(int64_t l) const { return m[l]; }
  __device__ int64_t Rebuild(int64_t l) const { return m[layers + l]; }
  __device__ int64_t SlotOffset(int64_t l) const { return m[2 * layers + l]; }
  __device__ int64_t ValueOffset(int64_t l) const { return m[3 * layers + l]; }
};

// keep [R, n]: sinks, window, and the k = S_l - sinks - w middle tokens of [sinks, n - w) ranked
// best by score (higher first, ties to the lower index: SelectTopK). Rank by counting (exact).
__global__ void SelectKernel(const float* __restrict__ scores, uint8_t* __restrict__ keep,
                             int64_t rows, int64_t heads, int64_t n, int64_t sinks, int64_t w,
                             Meta meta) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= rows * n) return;
  const int64_t i = idx % n, row = idx / n;
  if (i < sinks || i >= n - w) {
    keep[idx] = 1;
    return;
  }
  const int64_t k = meta.Slots(row / heads) - sinks - w;
  const float* s = scores + row * n;
  const float si = s[i];
  int64_t rank = 0;
  for (int64_t j = sinks; j < n - w && rank < k; ++j) {
    const float sj = s[j];
    rank += (sj > si || (sj == si && j < i)) ? 1 : 0;
  }
  keep[idx] = rank < k ? 1 : 0;
}

// flags [R, smax]: of the eligible slots [sinks, S_l - w) of each row, the 2a_l with the smallest
// residual (ties to the lower slot) get kSlotRebuildValue, the other slots 0, padding
// (j >= S_l) kPadding.
constexpr uint8_t kPadding = 0x80;
__global__ void RouteSelectKernel(const float* __restrict__ residuals, uint8_t* __restrict__ flags,
                                  int64_t rows, int64_t heads, int64_t smax, int64_t sinks,
                                  int64_t w, Meta meta) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= rows * smax) return;
  const int64_t x = idx % smax, row = idx / smax, l = row / heads;
  const int64_t s = meta.Slots(l), r = meta.Rebuild(l);
  if (x >= s) {
    flags[idx] = kPadding;
    return;
  }
  if (r == 0 || x < sinks || x >= s - w) {
    flags[idx] = 0;
    return;
  }
  const float* res = residuals + row * smax;
  const float rx = res[x];
  int64_t rank = 0;
  for (int64_t y = sinks; y < s - w && rank < r; ++y) {
    const float ry = res[y];
    rank += (ry < rx || (ry == rx && y < x)) ? 1 : 0;
  }
  flags[idx] = rank < r ? kSlotRebuildValue : 0;
}

// One block per row: out[r * out_stride + rank] = i for the i in [0, count) with
// flags[r * count + i] == want, in increasing i (stream compaction by block scan); at most
// out_stride of them are written.
__global__ void CompactIndexKernel(const uint8_t* __restrict__ flags, int64_t count, uint8_t want,
                                   int32_t* __restrict__ out, int64_t out_stride) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ int base;
  const uint8_t* f = flags + blockIdx.x * count;
  int32_t* o = out + blockIdx.x * out_stride;
  if (threadIdx.x == 0) base = 0;
  __syncthreads();
  for (int64_t t0 = 0; t0 < count; t0 += kThreads) {
    const int64_t i = t0 + threadIdx.x;
    const int pred = (i < count && f[i] == want) ? 1 : 0;
    int rank = 0, total = 0;
    Scan(temp).ExclusiveSum(pred, rank, total);
    // More than out_stride hits only happen with non-finite scores (reported after the chunk).
    if (pred && base + rank < out_stride) o[base + rank] = static_cast<int32_t>(i);
    __syncthreads();
    if (threadIdx.x == 0) base += total;
    __syncthreads();
  }
}

// Slot j of row r (j < S_l) is token slot_token[r, j]: copies its key and value into
// [R, smax, d] and its position into [R, smax].
__global__ void GatherSlotsKernel(const float* __restrict__ kf, const float* __restrict__ vf,
                                  const int64_t* __restrict__ pos,
                                  const int32_t* __restrict__ slot_token, float* __restrict__ sk,
                                  float* __restrict__ sv, int64_t* __restrict__ spos, int64_t rows,
                                  int64_t heads, int64_t n, int64_t smax, int d, Meta meta) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= rows * smax * d) return;
  const int64_t c = idx % d, slot = (idx / d) % smax, row = idx / (d * smax);
  if (slot >= meta.Slots(row / heads)) return;
  int64_t tok = slot_token[row * smax + slot];
  if (tok < 0 || tok >= n) tok = 0;  // only with non-finite scores (reported after the chunk)
  sk[idx] = kf[(row * n + tok) * d + c];
  sv[idx] = vf[(row * n + tok) * d + c];
  if (c == 0) spos[row * smax + slot] = pos[tok];
}

// The packed compact arrays: slot j of row r = (layer l, head h) is output slot
// SlotOffset(l) + h * S_l + j (key in the model dtype, position, flags, cardinality); stored value
// v < S_l - 2a_l is output value ValueOffset(l) + h * (S_l - 2a_l) + v, the mean of slot
// value_slot[r, v]: its value sum times 1/cardinality in float32, as Encode (plan_head.cc) does
// (card null: every cardinality is 1 and the mean of a single token is its value).
__global__ void PackKernel(const float* __restrict__ sk, const float* __restrict__ sv,
                           const int64_t* __restrict__ spos, const uint8_t* __restrict__ flags,
                           const int32_t* __restrict__ value_slot, const int32_t* __restrict__ card,
                           void* __restrict__ out_keys, void* __restrict__ out_values,
                           int64_t* __restrict__ out_pos, uint8_t* __restrict__ out_flags,
                           int32_t* __restrict__ out_card, int64_t rows, int64_t heads,
                           int64_t smax, int d, int dtype, Meta meta) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= rows * smax * d) return;
  const int64_t c = idx % d, j = (idx / d) % smax, row = idx / (d * smax);
  const int64_t l = row / heads, h = row % heads, s = meta.Slots(l), nv = s - meta.Rebuild(l);
  if (j >= s) return;
  const int64_t o = meta.SlotOffset(l) + h * s + j;
  StoreElement(out_keys, o * d + c, sk[idx], dtype);
  if (c == 0) {
    out_pos[o] = spos[row * smax + j];
    out_flags[o] = flags[row * smax + j];
    if (card != nullptr) out_card[o] = card[row * smax + j];
  }
  if (j < nv) {
    const int64_t slot = value_slot[row * smax + j];
    float v = sv[(row * smax + slot) * d + c];
    if (card != nullptr) {
      v = __fmul_rn(v, __fdiv_rn(1.0f, static_cast<float>(card[row * smax + slot])));
    }
    StoreElement(out_values, (meta.ValueOffset(l) + h * nv + j) * d + c, v, dtype);
  }
}

}  // namespace
}  // namespace kvd::kernels::cuda
