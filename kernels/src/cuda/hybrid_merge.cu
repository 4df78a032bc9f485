// The hybrid merge of the device-resident plan (plan.h, "score + merge"): every token outside a
// head's pool joins its nearest non-forced pool token (the absorber; ties left), subject to the
// cosine gate and the group cap; a merged slot's pre-RoPE key is the mass-weighted mean of its
// tokens, its value sum the sum, its position per RepresentativePosition. The CPU twin is
// HeadPipeline::BuildHybrid + MergeGroup (plan_head.cc); the sums here are float64 in the same
// token order, with explicit round-to-nearest products and sums so that nvcc does not contract
// them into FMAs (with equal masses the merged pre-RoPE key and value sum are the CPU's bit for
// bit). Rows are (layer, KV head) pairs, row = layer * heads + head, as in plan_device.cu.
#include <cmath>

#include "cuda/cuda_common.cuh"
#include "cuda/launch.cuh"

namespace kvd::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// acc + x * y in float64, rounded once per operation (no FMA), as the CPU computes it.
__device__ __forceinline__ double AddProduct(double acc, double x, double y) {
  return __dadd_rn(acc, __dmul_rn(x, y));
}

// The pool of row `row`: slot_token [S] ascending, S = slots[row / heads]; its absorbers are the
// slots [sinks, S - window) (the sinks are a prefix, the window a suffix of the pool).
struct Pool {
  const int32_t* token;
  int64_t size;
  int64_t first_absorber;
  int64_t end_absorber;
};

__device__ Pool RowPool(const int32_t* slot_token, const int64_t* slots, int64_t row, int64_t heads,
                        int64_t smax, int64_t sinks, int64_t window) {
  const int64_t s = slots[row / heads];
  return {slot_token + row * smax, s, sinks, s - window};
}

// First index in [lo, hi) of `pool` whose token is >= t.
__device__ int64_t LowerBound(const int32_t* pool, int64_t lo, int64_t hi, int64_t t) {
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (pool[mid] < t) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// owner [R, n]: the slot of a pool token itself; for another token the slot of its nearest
// absorber (token distance, ties left), or -1 (evicted: no absorber, or the cosine gate
// cos(kpre_i, kpre_absorber) >= min_cos fails when min_cos > 0). member [R, n] = the slot of a
// pool token, -1 elsewhere (GroupKernel adds the members it keeps).
__global__ void OwnerKernel(const int32_t* __restrict__ slot_token,
                            const int64_t* __restrict__ slots, const float* __restrict__ kpre,
                            int32_t* __restrict__ owner, int32_t* __restrict__ member, int64_t rows,
                            int64_t heads, int64_t n, int64_t smax, int d, int64_t sinks,
                            int64_t window, double min_cos) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= rows * n) return;
  const int64_t i = idx % n, row = idx / n;
  const Pool p = RowPool(slot_token, slots, row, heads, smax, sinks, window);
  const int64_t at = LowerBound(p.token, 0, p.size, i);
  if (at < p.size && p.token[at] == i) {
    owner[idx] = static_cast<int32_t>(at);
    member[idx] = static_cast<int32_t>(at);
    return;
  }
  member[idx] = -1;
  int64_t best = -1;
  if (p.first_absorber < p.end_absorber) {
    const int64_t right = LowerBound(p.token, p.first_absorber, p.end_absorber, i);
    if (right > p.first_absorber) best = right - 1;
    if (right < p.end_absorber && (best < 0 || p.token[right] - i < i - p.token[best])) {
      best = right;
    }
  }
  if (best >= 0 && min_cos > 0.0) {
    const float* ki = kpre + (row * n + i) * d;
    const float* ka = kpre + (row * n + p.token[best]) * d;
    double qi = 0.0, qa = 0.0, dot = 0.0;
    for (int c = 0; c < d; ++c) qi = AddProduct(qi, ki[c], ki[c]);
    for (int c = 0; c < d; ++c) qa = AddProduct(qa, ka[c], ka[c]);
    for (int c = 0; c < d; ++c) dot = AddProduct(dot, ki[c], ka[c]);
    const double den = __dmul_rn(sqrt(qi), sqrt(qa));
    if (!(den > 0.0 && __ddiv_rn(dot, den) >= min_cos)) best = -1;
  }
  owner[idx] = static_cast<int32_t>(best);
}

// One thread per (row, slot j < S): the group of absorber j = itself and its owned tokens nearest
// first (distance, ties left), at most max_group (member[t] = j for those kept; the others stay
// evicted). Writes cardinality [R, smax], the group's token range [lo, hi] and its total mass
// (float64, token order; 0 = uniform weights: no mass, merge_guard kMean, or all masses 0), and
// for a merged slot its position (kLast: the latest; kWeighted: llround of the weighted mean).
__global__ void GroupKernel(const int32_t* __restrict__ slot_token,
                            const int64_t* __restrict__ slots, const int32_t* __restrict__ owner,
                            int32_t* __restrict__ member, const float* __restrict__ mass,
                            const int64_t* __restrict__ pos, int32_t* __restrict__ card,
                            int32_t* __restrict__ range, double* __restrict__ total_mass,
                            int64_t* __restrict__ spos, int64_t rows, int64_t heads, int64_t n,
                            int64_t smax, int64_t sinks, int64_t window, int64_t max_group,
                            int weighted_position) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= rows * smax) return;
  const int64_t j = idx % smax, row = idx / smax;
  const Pool p = RowPool(slot_token, slots, row, heads, smax, sinks, window);
  if (j >= p.size) return;
  const int64_t a = p.token[j];
  card[idx] = 1;
  range[2 * idx] = static_cast<int32_t>(a);
  range[2 * idx + 1] = static_cast<int32_t>(a);
  total_mass[idx] = 0.0;
  if (j < p.first_absorber || j >= p.end_absorber) return;  // sinks and window never absorb
  // Only tokens between the neighbouring absorbers can be nearest to this one.
  const int64_t lo = j > p.first_absorber ? p.token[j - 1] + 1 : 0;
  const int64_t hi = j + 1 < p.end_absorber ? p.token[j + 1] - 1 : n - 1;
  const int32_t* own = owner + row * n;
  int32_t* mem = member + row * n;
  int64_t count = 1;
  for (int64_t delta = 1; count < max_group && (a - delta >= lo || a + delta <= hi); ++delta) {
    if (a - delta >= lo && own[a - delta] == j) {
      mem[a - delta] = static_cast<int32_t>(j);
      if (++count == max_group) break;
    }
    if (a + delta <= hi && own[a + delta] == j) {
      mem[a + delta] = static_cast<int32_t>(j);
      ++count;
    }
  }
  card[idx] = static_cast<int32_t>(count);
  range[2 * idx] = static_cast<int32_t>(lo);
  range[2 * idx + 1] = static_cast<int32_t>(hi);
  if (count == 1) return;
  const float* m = mass != nullptr ? mass + row * n : nullptr;
  double total = 0.0;
  if (m != nullptr) {
    for (int64_t t = lo; t <= hi; ++t) {
      if (mem[t] == j) total = __dadd_rn(total, static_cast<double>(fmaxf(0.0f, m[t])));
    }
  }
  total_mass[idx] = total;
  double weighted = 0.0;
  int64_t last = 0;
  for (int64_t t = lo; t <= hi; ++t) {
    if (mem[t] != j) continue;
    const double w = total > 0.0 ? __ddiv_rn(static_cast<double>(fmaxf(0.0f, m[t])), total)
                                 : __ddiv_rn(1.0, static_cast<double>(count));
    weighted = AddProduct(weighted, w, static_cast<double>(pos[t]));
    last = pos[t] > last ? pos[t] : last;
  }
  spos[idx] = weighted_position ? llround(weighted) : last;
}

// One thread per (row, slot, dimension) of a merged slot (cardinality > 1): key_pre [R, smax, d]
// = sum_t w_t kpre_t and value_sum [R, smax, d] = sum_t v_t over its members in token order
// (float64, then float32), w_t = max(0, mass_t) / total or 1 / cardinality.
__global__ void MergeKernel(const float* __restrict__ kpre, const float* __restrict__ values,
                            const float* __restrict__ mass, const int32_t* __restrict__ member,
                            const int32_t* __restrict__ card, const int32_t* __restrict__ range,
                            const double* __restrict__ total_mass,
                            const int64_t* __restrict__ slots, float* __restrict__ key_pre,
                            float* __restrict__ value_sum, int64_t rows, int64_t heads, int64_t n,
                            int64_t smax, int d) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= rows * smax * d) return;
  const int64_t c = idx % d, slot = idx / d, j = slot % smax, row = slot / smax;
  if (j >= slots[row / heads] || card[slot] <= 1) return;
  const double total = total_mass[slot];
  const double uniform = __ddiv_rn(1.0, static_cast<double>(card[slot]));
  const int32_t* mem = member + row * n;
  const float* m = mass != nullptr ? mass + row * n : nullptr;
  double key = 0.0, vsum = 0.0;
  for (int64_t t = range[2 * slot]; t <= range[2 * slot + 1]; ++t) {
    if (mem[t] != j) continue;
    const double w =
        total > 0.0 ? __ddiv_rn(static_cast<double>(fmaxf(0.0f, m[t])), total) : uniform;
    key = AddProduct(key, w, static_cast<double>(kpre[(row * n + t) * d + c]));
    vsum = __dadd_rn(vsum, static_cast<double>(values[(row * n + t) * d + c]));
  }
  key_pre[idx] = static_cast<float>(key);
  value_sum[idx] = static_cast<float>(vsum);
}

// keys [R, smax, d] of the merged slots = rotated [R, smax, d] (the single slots keep their
// engine key, copied bit for bit).
__global__ void TakeMergedKeysKernel(const float* __restrict__ rotated,
                                     const int32_t* __restrict__ card,
                                     const int64_t* __restrict__ slots, float* __restrict__ keys,
                                     int64_t rows, int64_t heads, int64_t smax, int d) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= rows * smax * d) return;
  const int64_t slot = idx / d, j = slot % smax, row = slot / smax;
  if (j < slots[row / heads] && card[slot] > 1) keys[idx] = rotated[idx];
}

}  // namespace

Status LaunchHybridMerge(const HybridMergeArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.n == 0) return Status::Ok();
  if (a.n > INT32_MAX || a.max_group < 1) {
    return Status::InvalidArgument("hybrid merge: N above int32 or max_group < 1");
  }
  OwnerKernel<<<Blocks(a.rows * a.n, kThreads), kThreads, 0, stream>>>(
      a.slot_token, a.slots, a.kpre, a.owner, a.member, a.rows, a.heads, a.n, a.smax, a.d, a.sinks,
      a.window, a.min_cos);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "OwnerKernel");
  GroupKernel<<<Blocks(a.rows * a.smax, kThreads), kThreads, 0, stream>>>(
      a.slot_token, a.slots, a.owner, a.member, a.mass, a.positions, a.card, a.range, a.total_mass,
      a.slot_positions, a.rows, a.heads, a.n, a.smax, a.sinks, a.window, a.max_group,
      a.weighted_position ? 1 : 0);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "GroupKernel");
  const int64_t cells = a.rows * a.smax * a.d;
  MergeKernel<<<Blocks(cells, kThreads), kThreads, 0, stream>>>(
      a.kpre, a.values, a.mass, a.member, a.card, a.range, a.total_mass, a.slots, a.merged_key_pre,
      a.slot_values, a.rows, a.heads, a.n, a.smax, a.d);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "MergeKernel");
  // The merged keys at their slot positions (slots of cardinality 1 are rotated too and ignored).
  KVD_RETURN_IF_ERROR(LaunchRope(a.merged_key_pre, a.slot_positions, a.smax, a.inv_freq, a.smax,
                                 a.rows, a.d, a.half, a.interleaved, RopeDirection::kRotate,
                                 stream));
  TakeMergedKeysKernel<<<Blocks(cells, kThreads), kThreads, 0, stream>>>(
      a.merged_key_pre, a.card, a.slots, a.slot_keys, a.rows, a.heads, a.smax, a.d);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "TakeMergedKeysKernel");
  return Status::Ok();
}

}  // namespace kvd::kernels::cuda
