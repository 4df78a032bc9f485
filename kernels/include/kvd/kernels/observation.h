// Observation statistics: how much attention the observation queries give each key (or slot).
//
// For one KV head with G query heads, queries Q[W*G, d] (row w*G + g = window query w of query
// head g, post-RoPE), keys K[N, d] (post-RoPE) and an optional additive bias b[N] (ln l_j for
// merged slots, docs/algorithms.md 1):
//   P[w, g, j] = softmax_j( Q[w*G+g] . K[j] * scale + b[j] )   over the keys visible to query w
//   mass[j]    = sum_{w, g} P[w, g, j]          (mean = mass / (W*G); see MassMean)
// scale defaults to 1/sqrt(d). Visibility (MaskKind):
//   kNone:         every query sees every key (queries of the NEXT chunk, AsymKV/KVSlimmer).
//   kCausalWindow: the queries are the LAST W tokens of the N keys: query w is at token N-W+w
//                  and sees keys 0..N-W+w (SnapKV one-shot). REQUIRES W <= N.
//   kByPosition:   query w sees key j iff key_positions[j] <= query_positions[w] (slots whose
//                  representative position is in the query's past). A query that sees no key
//                  contributes nothing.
// Memory (CPU): one query head's [W, N] score matrix and one transposed copy of K per call (never
// the [W*G, N] matrix of a whole group). The CUDA twin streams keys and keeps no [W, N] matrix.
// Softmax is computed in float32 with the max subtracted; mass is accumulated in float64 per
// head, returned as float32. The single-head form runs on the calling thread; the batched form
// runs heads in parallel (ExecOptions::num_threads).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvd/kernels/types.h"

namespace kvd::kernels {

enum class MaskKind : uint8_t { kNone = 0, kCausalWindow = 1, kByPosition = 2 };

struct ObservationOptions {
  MaskKind mask = MaskKind::kCausalWindow;  // see the file comment
  int group_size = 1;                       // G query heads per KV head, >= 1
  float scale = 0.0f;                       // 0 = 1/sqrt(d); otherwise used as given (> 0)

  Status Validate() const;
};

// One KV head's inputs. Views are host memory (kCuda stages them).
struct ObservationHead {
  ConstMatrixView queries;                   // [W*G, d] post-RoPE, row w*G + g
  ConstMatrixView keys;                      // [N, d] post-RoPE
  std::span<const float> key_bias;           // [N] additive bias (ln l_j) or empty = 0
  std::span<const int64_t> query_positions;  // [W], only for kByPosition
  std::span<const int64_t> key_positions;    // [N], only for kByPosition
};

// Computes mass[j] (sum over the W*G queries of P[., j]) for one KV head into `mass` (size N).
// Errors (INVALID_ARGUMENT unless noted): W*G not a multiple of group_size, head_dim mismatch or
// unsupported (CheckHeadDim), bias/positions of the wrong length, W > N for kCausalWindow
// ("window larger than keys"), NaN/Inf in queries, keys or bias (named "queries"/"keys"/"bias").
// kCuda: UNIMPLEMENTED without CUDA, UNAVAILABLE without a device.
Status ComputeAttentionMass(const ObservationHead& head, const ObservationOptions& options,
                            std::span<float> mass, const ExecOptions& exec = {});

// Batched over KV heads (parallel over heads on CPU): masses[h] is resized to heads[h].keys.rows.
Status ComputeAttentionMass(std::span<const ObservationHead> heads,
                            const ObservationOptions& options,
                            std::vector<std::vector<float>>* masses, const ExecOptions& exec = {});

// mass / (W*G): the SnapKV score before pooling.
inline void MassMean(std::span<float> mass, int64_t num_queries) {
  const float inv = num_queries > 0 ? 1.0f / static_cast<float>(num_queries) : 0.0f;
  for (float& m : mass) m *= inv;
}

}  // namespace kvd::kernels
