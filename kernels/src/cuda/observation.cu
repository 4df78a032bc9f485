// CUDA attention mass: one block per tile of 8 query rows (one warp per query row), keys streamed
// through shared memory in tiles of 32; pass 1 is an online softmax (running max and sum per
// lane, merged across the warp), pass 2 recomputes the scores and adds the probabilities to the
// per-key mass (block-reduced in shared memory, one global atomicAdd per key per block).
// Never materialises a W x N matrix.
#include <cmath>

#include "backend_a.h"
#include "cuda/cuda_common.cuh"
#include "cuda/launch.cuh"

namespace kvd::kernels::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kKeyTile = 32;

__device__ __forceinline__ bool Visible(int mask, int64_t j, int64_t w, int64_t n, int64_t num_w,
                                        const int64_t* qpos, const int64_t* kpos) {
  if (mask == static_cast<int>(MaskKind::kCausalWindow)) return j <= n - num_w + w;
  if (mask == static_cast<int>(MaskKind::kByPosition)) return kpos[j] <= qpos[w];
  return true;
}

// Head blockIdx.y of q: [heads, R, d] (R = W*G), k: [heads, N, d], mass: [heads, N] (zeroed);
// bias: [N] or null, shared by the heads.
__global__ void MassKernel(const float* __restrict__ q, const float* __restrict__ k,
                           const float* __restrict__ bias, const int64_t* __restrict__ qpos,
                           const int64_t* __restrict__ kpos, float* __restrict__ mass, int64_t rows,
                           int64_t n, int d, int group, int mask, float scale) {
  extern __shared__ float smem[];
  q += static_cast<int64_t>(blockIdx.y) * rows * d;
  k += static_cast<int64_t>(blockIdx.y) * n * d;
  mass += static_cast<int64_t>(blockIdx.y) * n;
  float* sq = smem;                     // [kWarps, d]
  float* sk = sq + kWarps * d;          // [kKeyTile, d + 1]
  float* sm = sk + kKeyTile * (d + 1);  // [kKeyTile]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kWarps) + warp;
  const bool active = row < rows;
  const int64_t num_w = rows / group, w = row / group;
  for (int c = lane; c < d; c += 32) sq[warp * d + c] = active ? q[row * d + c] * scale : 0.0f;
  if (threadIdx.x < kKeyTile) sm[threadIdx.x] = 0.0f;

  float m = -INFINITY, l = 0.0f;
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t j0 = 0; j0 < n; j0 += kKeyTile) {
      __syncthreads();
      for (int idx = threadIdx.x; idx < kKeyTile * d; idx += blockDim.x) {
        const int r = idx / d, c = idx % d;
        sk[r * (d + 1) + c] = j0 + r < n ? k[(j0 + r) * d + c] : 0.0f;
      }
      __syncthreads();
      const int64_t j = j0 + lane;
      const bool vis = active && j < n && Visible(mask, j, w, n, num_w, qpos, kpos);
      float s = -INFINITY;
      if (vis) {
        float dot = 0.0f;
        const float* kr = sk + lane * (d + 1);
        const float* qr = sq + warp * d;
        for (int c = 0; c < d; ++c) dot = fmaf(qr[c], kr[c], dot);
        s = dot + (bias != nullptr ? bias[j] : 0.0f);
      }
      if (pass == 0) {
        if (vis) {
          if (s > m) {
            l = l * expf(m - s) + 1.0f;  // m = -inf -> l = 0 * 0 + 1
            m = s;
          } else {
            l += expf(s - m);
          }
        }
      } else {
        const float p = (vis && m > -INFINITY) ? expf(s - m) / l : 0.0f;
        if (p != 0.0f) atomicAdd(&sm[lane], p);
        __syncthreads();
        if (threadIdx.x < kKeyTile && j0 + threadIdx.x < n) {
          const float t = sm[threadIdx.x];
          if (t != 0.0f) atomicAdd(&mass[j0 + threadIdx.x], t);
          sm[threadIdx.x] = 0.0f;
        }
      }
    }
    if (pass == 0) {  // merge the lanes' (max, sum) into the warp's softmax normaliser
      for (int off = 16; off > 0; off /= 2) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
        const float l2 = __shfl_xor_sync(0xffffffffu, l, off);
        const float mm = fmaxf(m, m2);
        if (mm > -INFINITY) {
          l = (m > -INFINITY ? l * expf(m - mm) : 0.0f) +
              (m2 > -INFINITY ? l2 * expf(m2 - mm) : 0.0f);
        }
        m = mm;
      }
    }
  }
}

}  // namespace

Status LaunchAttentionMass(const float* q, const float* k, const float* bias, const int64_t* qpos,
                           const int64_t* kpos, float* mass, int64_t heads, int64_t rows, int64_t n,
                           int d, int group, MaskKind mask, float scale, cudaStream_t stream) {
  if (heads == 0 || n == 0) return Status::Ok();
  if (heads > 65535) return Status::InvalidArgument("attention mass: too many heads in one launch");
  KVD_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(mass, 0, static_cast<size_t>(heads * n) * sizeof(float), stream),
      "cudaMemsetAsync");
  if (rows == 0) return Status::Ok();
  const size_t shared =
      static_cast<size_t>(kWarps * d + kKeyTile * (d + 1) + kKeyTile) * sizeof(float);
  const dim3 grid(Blocks(rows, kWarps), static_cast<unsigned>(heads));
  MassKernel<<<grid, kWarps * 32, shared, stream>>>(q, k, bias, qpos, kpos, mass, rows, n, d, group,
                                                    static_cast<int>(mask), scale);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "MassKernel");
  return Status::Ok();
}

Status AttentionMass(const ObservationHead& head, const ObservationOptions& options, float* mass,
                     void* stream_ptr) {
  cudaStream_t stream = AsStream(stream_ptr);
  const int64_t rows = head.queries.rows, n = head.keys.rows, d = head.keys.cols;
  const float scale =
      options.scale > 0.0f ? options.scale : 1.0f / std::sqrt(static_cast<float>(d));
  DeviceBuffer<float> dq, dk, dbias, dmass;
  DeviceBuffer<int64_t> dqpos, dkpos;
  KVD_RETURN_IF_ERROR(dq.Allocate(static_cast<size_t>(rows * d)));
  KVD_RETURN_IF_ERROR(dk.Allocate(static_cast<size_t>(n * d)));
  KVD_RETURN_IF_ERROR(dmass.Allocate(static_cast<size_t>(n)));
  KVD_RETURN_IF_ERROR(UploadRows(head.queries.data, rows, d, head.queries.ld, dq.get(), stream));
  KVD_RETURN_IF_ERROR(UploadRows(head.keys.data, n, d, head.keys.ld, dk.get(), stream));
  if (!head.key_bias.empty()) {
    KVD_RETURN_IF_ERROR(dbias.Allocate(static_cast<size_t>(n)));
    KVD_RETURN_IF_ERROR(dbias.Upload(head.key_bias.data(), static_cast<size_t>(n), stream));
  }
  if (options.mask == MaskKind::kByPosition) {
    KVD_RETURN_IF_ERROR(dqpos.Allocate(head.query_positions.size()));
    KVD_RETURN_IF_ERROR(dkpos.Allocate(head.key_positions.size()));
    KVD_RETURN_IF_ERROR(
        dqpos.Upload(head.query_positions.data(), head.query_positions.size(), stream));
    KVD_RETURN_IF_ERROR(dkpos.Upload(head.key_positions.data(), head.key_positions.size(), stream));
  }
  KVD_RETURN_IF_ERROR(LaunchAttentionMass(dq.get(), dk.get(), dbias.get(), dqpos.get(), dkpos.get(),
                                          dmass.get(), 1, rows, n, static_cast<int>(d),
                                          options.group_size, options.mask, scale, stream));
  KVD_RETURN_IF_ERROR(dmass.Download(mass, static_cast<size_t>(n), stream));
  return FinishLaunch(stream, "AttentionMass");
}

}  // namespace kvd::kernels::cuda
