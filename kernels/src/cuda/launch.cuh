// Device-pointer launchers of the CUDA kernels: the one copy of each kernel, used both by the
// host-view twins (they stage host views through device memory, then call these) and by the
// device-resident plan (plan_device.h), which chains them on one stream with no host round trip.
// Private to kernels/src/cuda.
//
// Contract of every launcher: all pointers are DEVICE memory, dense row-major unless a stride is
// given; inputs are already validated (shapes, finiteness) by the caller; the kernel is enqueued
// on `stream` and the launcher returns without synchronising (the Status only reports a launch
// error, via cudaGetLastError). Errors of the kernel itself surface at the next synchronisation.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_common.cuh"
#include "kvd/common/dtype.h"
#include "kvd/kernels/observation.h"
#include "kvd/kernels/rope.h"

namespace kvd::kernels::cuda {

// convert.cu. Gather: src [n, h, d] of dtype -> dst [h, n, d] float32, for `layers` tensors at
// once (tensor l at element l * src_layer_stride of src, to dst + l * n * h * d). Scatter: the
// inverse of one tensor (round to nearest even for float16/bfloat16).
Status LaunchGather(const void* src, float* dst, int64_t n, int64_t h, int64_t d, DType dtype,
                    cudaStream_t stream, int64_t layers = 1, int64_t src_layer_stride = 0);
Status LaunchScatter(const float* src, void* dst, int64_t n, int64_t h, int64_t d, DType dtype,
                     cudaStream_t stream);

// rope.cu. Rotates (sign +1) or de-rotates (sign -1) x [heads, n, d] in place, pairs per
// `interleaved`, the first 2*half dimensions. pos: [n] shared by the heads (pos_head_stride 0) or
// [heads, n] (pos_head_stride n). inv_freq: [half] float64. Angles and sin/cos in float64.
Status LaunchRope(float* x, const int64_t* pos, int64_t pos_head_stride, const double* inv_freq,
                  int64_t n, int64_t heads, int64_t d, int half, bool interleaved,
                  RopeDirection direction, cudaStream_t stream);

// observation.cu. mass[h][j] = sum over the rows of q[h] of softmax(q . k[h][j] * scale + bias[j])
// under `mask` (observation.h), for `heads` heads at once: q [heads, rows, d], k [heads, n, d],
// mass [heads, n] (zeroed here). bias [n], qpos [rows / group], kpos [n] are shared by the heads
// (null when unused: bias optional, positions only for kByPosition).
Status LaunchAttentionMass(const float* q, const float* k, const float* bias, const int64_t* qpos,
                           const int64_t* kpos, float* mass, int64_t heads, int64_t rows, int64_t n,
                           int d, int group, MaskKind mask, float scale, cudaStream_t stream);

// keydiff.cu, for `heads` key matrices k [heads, n, d] at once. Norms (over rows = heads * n
// rows): inv_norm [rows] = 1/|k_r|, *bad_row = min(*bad_row, r) for a row with |k_r|^2 < 1e-30
// (its inv_norm 0; the caller initialises *bad_row). Anchor: anchor [heads, d] = sum_i k_i
// inv_norm_i in float64. Unit anchor: unit_anchor [heads, d] = anchor / |anchor| in float32 and
// anchor_ok [heads] = 1, or 0 and 0 when the keys cancel (|anchor| <= 1e-6 n, keydiff.h).
// Scores: scores [heads, n] = -(k_i . unit_anchor) inv_norm_i, 0 where anchor_ok is 0.
Status LaunchKeyDiffNorms(const float* k, float* inv_norm, int* bad_row, int64_t rows, int d,
                          cudaStream_t stream);
Status LaunchKeyDiffAnchor(const float* k, const float* inv_norm, double* anchor, int64_t n, int d,
                           cudaStream_t stream, int64_t heads = 1);
Status LaunchKeyDiffUnitAnchor(const double* anchor, float* unit_anchor, uint8_t* anchor_ok,
                               int64_t n, int d, cudaStream_t stream, int64_t heads = 1);
Status LaunchKeyDiffScores(const float* k, const float* inv_norm, const float* unit_anchor,
                           const uint8_t* anchor_ok, float* scores, int64_t n, int d,
                           cudaStream_t stream, int64_t heads = 1);
// Block-wise KeyDiff selection (KeyDiffBlockwiseSelect, keydiff.h) of every head at once, one
// thread block per head: head r keeps budgets[r / heads_per_budget] tokens (>= the sinks and
// window it holds: the caller checked), sinks = min(N, sinks) and the effective window forced.
// inv_norm from LaunchKeyDiffNorms. Scratch: cand (int32) and cand_scores, [heads, cap] each with
// cap >= min(n, max budget + block). keep [heads, n] = 1 for the kept tokens, else 0. A zero-norm
// key among the scored candidates sets *bad = min(*bad, head * n + token) (caller initialises).
// INVALID_ARGUMENT for d > kMaxHeadDim, block < 1 or heads * n > INT_MAX.
Status LaunchKeyDiffBlockwiseSelect(const float* k, const float* inv_norm, const int64_t* budgets,
                                    int64_t heads_per_budget, int64_t heads, int64_t n, int d,
                                    int64_t sinks, int64_t window, int64_t block, int32_t* cand,
                                    float* cand_scores, int64_t cap, uint8_t* keep, int* bad,
                                    cudaStream_t stream);

// vector.cu. wt is W transposed ([d, d], wt[c, r] = W[r, c]). Residuals: residuals [n] =
// |(values_i - b) - W kpre_i|^2 (b = bias [d] of the head, float32 v - b rounded first as
// VectorResiduals does; bias null = 0), for `batch` heads at once (head b: kpre, values + b * n *
// d, wt + b * d * d, residuals + b * n, bias + b * d). Rebuild: out [n, d] = W kpre_i. Gram/cross:
// out [d, 2d] += kpre^T [kpre | values] in float64 (out zeroed by the caller); sums [d + 1] +=
// column sums of values and the sum of squares (zeroed by the caller).
Status LaunchVectorResiduals(const float* kpre, const float* wt, const float* values, int64_t n,
                             int d, float* residuals, cudaStream_t stream, int64_t batch = 1,
                             const float* bias = nullptr);
Status LaunchRebuildValues(const float* kpre, const float* wt, int64_t n, int d, float* out,
                           cudaStream_t stream);
Status LaunchVectorStats(const float* kpre, const float* values, int64_t n, int d,
                         double* gram_cross, double* sums, cudaStream_t stream);

// hybrid_merge.cu: the hybrid merge (plan.h "score + merge") of every (layer, KV head) row of a
// chunk after the pool is selected and gathered. Shapes: R = rows, n tokens, smax padded slots.
struct HybridMergeArgs {
  int64_t rows = 0, heads = 0, n = 0, smax = 0;  // heads: KV heads per layer (row / heads = layer)
  int d = 0;
  int64_t sinks = 0, window = 0;        // min(N, sinks) and the effective window
  int64_t max_group = 1;                // CompressionPlanOptions::hybrid_max_group (>= 1)
  double min_cos = 0.0;                 // hybrid_min_cos (<= 0: no gate)
  bool weighted_position = false;       // RepresentativePosition::kWeighted
  const int64_t* slots = nullptr;       // [L] S_l (the pool size of each layer's heads)
  const int32_t* slot_token = nullptr;  // [R, smax] the pool, ascending
  const float* kpre = nullptr;          // [R, n, d] de-rotated keys
  const float* values = nullptr;        // [R, n, d]
  const float* mass = nullptr;          // [R, n] window attention mass; null = uniform weights
  const int64_t* positions = nullptr;   // [n]
  const double* inv_freq = nullptr;     // RoPE [half]
  int half = 0;
  bool interleaved = false;
  // Scratch: owner, member [R, n]; range [R, smax, 2]; total_mass [R, smax]; merged_key_pre
  // [R, smax, d] (zeroed by the caller).
  int32_t* owner = nullptr;
  int32_t* member = nullptr;
  int32_t* range = nullptr;
  double* total_mass = nullptr;
  float* merged_key_pre = nullptr;
  // In/out: the gathered slots (GatherSlots); merged slots get their key, value sum and
  // position; card [R, smax] = cardinality (1 for a single slot).
  float* slot_keys = nullptr;         // [R, smax, d] post-RoPE
  float* slot_values = nullptr;       // [R, smax, d] value sums
  int64_t* slot_positions = nullptr;  // [R, smax]
  int32_t* card = nullptr;            // [R, smax]
};
Status LaunchHybridMerge(const HybridMergeArgs& args, cudaStream_t stream);

// kvslimmer.cu. Output slot o is src_a[o] copied (src_b[o] < 0) or the pair (src_a[o], src_b[o])
// merged: key w_a[o] k_a + w_b[o] k_b, value sum v_a + v_b. keys, values: [*, d]; out: [out_rows,
// d].
Status LaunchMerge(const float* keys, const float* values, const int64_t* src_a,
                   const int64_t* src_b, const float* w_a, const float* w_b, float* out_keys,
                   float* out_values, int64_t out_rows, int64_t d, cudaStream_t stream);

}  // namespace kvd::kernels::cuda
