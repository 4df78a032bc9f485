// CUDA KVSlimmer merge-apply: keys (weighted) and value sums (added) of the chosen pairs are
// merged on the device, one thread per output element; the O(S) slot metadata (cardinality,
// representative position, h) is updated on the host with the same formulas as the CPU.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend_a.h"
#include "cuda/cuda_common.cuh"
#include "cuda/launch.cuh"

namespace kvd::kernels::cuda {
namespace {

// For output slot o: src_a[o] (and src_b[o] >= 0 for a merged pair, -1 for a copy), weights.
__global__ void MergeKernel(const float* __restrict__ keys, const float* __restrict__ values,
                            const int64_t* __restrict__ src_a, const int64_t* __restrict__ src_b,
                            const float* __restrict__ w_a, const float* __restrict__ w_b,
                            float* __restrict__ out_keys, float* __restrict__ out_values,
                            int64_t out_rows, int64_t d) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= out_rows * d) return;
  const int64_t o = idx / d, c = idx % d, a = src_a[o], b = src_b[o];
  if (b < 0) {
    out_keys[idx] = keys[a * d + c];
    out_values[idx] = values[a * d + c];
  } else {
    out_keys[idx] = w_a[o] * keys[a * d + c] + w_b[o] * keys[b * d + c];
    out_values[idx] = values[a * d + c] + values[b * d + c];
  }
}

}  // namespace

Status LaunchMerge(const float* keys, const float* values, const int64_t* src_a,
                   const int64_t* src_b, const float* w_a, const float* w_b, float* out_keys,
                   float* out_values, int64_t out_rows, int64_t d, cudaStream_t stream) {
  if (out_rows * d == 0) return Status::Ok();
  constexpr int kThreads = 256;
  MergeKernel<<<Blocks(out_rows * d, kThreads), kThreads, 0, stream>>>(
      keys, values, src_a, src_b, w_a, w_b, out_keys, out_values, out_rows, d);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "MergeKernel");
  return Status::Ok();
}

Status ApplyMerges(std::span<const MergePair> pairs, RepresentativePosition position,
                   SlotSet* slots, void* stream_ptr) {
  cudaStream_t stream = AsStream(stream_ptr);
  const int64_t s = slots->size(), d = slots->keys_pre.cols;
  const int64_t out_rows = s - static_cast<int64_t>(pairs.size());
  const bool has_h = slots->h.size() == static_cast<size_t>(s);
  std::vector<int64_t> src_a, src_b;
  std::vector<float> w_a, w_b;
  SlotSet meta;  // metadata of the result, built on the host
  src_a.reserve(static_cast<size_t>(out_rows));
  size_t p = 0;
  for (int64_t i = 0; i < s;) {
    const size_t is = static_cast<size_t>(i);
    if (p < pairs.size() && pairs[p].first == i) {
      const MergePair& mp = pairs[p++];
      src_a.push_back(i);
      src_b.push_back(i + 1);
      w_a.push_back(mp.w_first);
      w_b.push_back(mp.w_second);
      const int64_t pa = slots->positions[is], pb = slots->positions[is + 1];
      meta.positions.push_back(position == RepresentativePosition::kLast
                                   ? std::max(pa, pb)
                                   : std::llround(static_cast<double>(mp.w_first) * pa +
                                                  static_cast<double>(mp.w_second) * pb));
      meta.cardinality.push_back(slots->cardinality[is] + slots->cardinality[is + 1]);
      if (has_h) {
        meta.h.push_back(mp.h_merged);
        meta.h_observations.push_back(
            std::max(slots->h_observations[is], slots->h_observations[is + 1]));
      }
      i += 2;
    } else {
      src_a.push_back(i);
      src_b.push_back(-1);
      w_a.push_back(1.0f);
      w_b.push_back(0.0f);
      meta.positions.push_back(slots->positions[is]);
      meta.cardinality.push_back(slots->cardinality[is]);
      if (has_h) {
        meta.h.push_back(slots->h[is]);
        meta.h_observations.push_back(slots->h_observations[is]);
      }
      ++i;
    }
  }
  DeviceBuffer<float> dk, dv, dok, dov, dwa, dwb;
  DeviceBuffer<int64_t> da, db;
  KVD_RETURN_IF_ERROR(dk.Allocate(static_cast<size_t>(s * d)));
  KVD_RETURN_IF_ERROR(dv.Allocate(static_cast<size_t>(s * d)));
  KVD_RETURN_IF_ERROR(dok.Allocate(static_cast<size_t>(out_rows * d)));
  KVD_RETURN_IF_ERROR(dov.Allocate(static_cast<size_t>(out_rows * d)));
  KVD_RETURN_IF_ERROR(dwa.Allocate(w_a.size()));
  KVD_RETURN_IF_ERROR(dwb.Allocate(w_b.size()));
  KVD_RETURN_IF_ERROR(da.Allocate(src_a.size()));
  KVD_RETURN_IF_ERROR(db.Allocate(src_b.size()));
  KVD_RETURN_IF_ERROR(dk.Upload(slots->keys_pre.values.data(), static_cast<size_t>(s * d), stream));
  KVD_RETURN_IF_ERROR(
      dv.Upload(slots->value_sums.values.data(), static_cast<size_t>(s * d), stream));
  KVD_RETURN_IF_ERROR(dwa.Upload(w_a.data(), w_a.size(), stream));
  KVD_RETURN_IF_ERROR(dwb.Upload(w_b.data(), w_b.size(), stream));
  KVD_RETURN_IF_ERROR(da.Upload(src_a.data(), src_a.size(), stream));
  KVD_RETURN_IF_ERROR(db.Upload(src_b.data(), src_b.size(), stream));
  KVD_RETURN_IF_ERROR(LaunchMerge(dk.get(), dv.get(), da.get(), db.get(), dwa.get(), dwb.get(),
                                  dok.get(), dov.get(), out_rows, d, stream));
  Matrix keys(out_rows, d), values(out_rows, d);
  KVD_RETURN_IF_ERROR(dok.Download(keys.values.data(), static_cast<size_t>(out_rows * d), stream));
  KVD_RETURN_IF_ERROR(
      dov.Download(values.values.data(), static_cast<size_t>(out_rows * d), stream));
  KVD_RETURN_IF_ERROR(FinishLaunch(stream, "ApplyMerges"));
  slots->keys_pre = std::move(keys);
  slots->value_sums = std::move(values);
  slots->positions = std::move(meta.positions);
  slots->cardinality = std::move(meta.cardinality);
  if (has_h) {
    slots->h = std::move(meta.h);
    slots->h_observations = std::move(meta.h_observations);
  }
  return Status::Ok();
}

}  // namespace kvd::kernels::cuda
