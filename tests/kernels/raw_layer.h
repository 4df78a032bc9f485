// Small hand-built chunks of the plan tests: the layout of one float32 layer, its raw bytes in
// the engine layout (common/layout.h: K[N, H, d] then V[N, H, d]) from per-KV-head post-RoPE keys
// and values, and VECTOR weights calibrated on a chunk itself.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "kvd/common/layout.h"
#include "kvd/kernels/plan.h"
#include "kvd/kernels/types.h"
#include "kvd/kernels/vector.h"

namespace kvd::kernels::testing {

// One float32 layer (tp 0/1, default RoPE) of `num_kv_heads` KV heads, each shared by `group`
// query heads.
inline ModelLayout Float32Layer(int num_kv_heads, int group, int head_dim) {
  return ModelLayout{.num_layers = 1,
                     .num_kv_heads = num_kv_heads,
                     .num_q_heads = num_kv_heads * group,
                     .head_dim = head_dim,
                     .dtype = DType::kFloat32,
                     .tp_rank = 0,
                     .tp_size = 1,
                     .rope = {}};
}

// REQUIRES: layout.dtype == kFloat32, raw holds layout.ChunkBytes(n), keys/values have
// layout.num_kv_heads matrices of [n, head_dim].
inline void WriteFloat32Layer(const ModelLayout& layout, int layer, int64_t n,
                              std::span<const Matrix> keys, std::span<const Matrix> values,
                              std::vector<uint8_t>* raw) {
  const int64_t d = layout.head_dim;
  uint8_t* kb = raw->data() + layout.LayerOffset(layer, static_cast<int>(n));
  uint8_t* vb = kb + n * layout.TokenBytes();
  for (int64_t i = 0; i < n; ++i) {
    for (size_t h = 0; h < keys.size(); ++h) {
      std::memcpy(kb + i * layout.TokenBytes() + h * d * 4, keys[h].Row(i), d * 4);
      std::memcpy(vb + i * layout.TokenBytes() + h * d * 4, values[h].Row(i), d * 4);
    }
  }
}

// VECTOR weights fitted on the chunk's own keys and values (CalibrateFromChunk, then Solve).
inline StatusOr<VectorWeights> CalibrateOnChunk(const ModelLayout& layout,
                                                std::span<const uint8_t> raw,
                                                std::span<const int64_t> positions,
                                                const VectorSolveOptions& options = {}) {
  KVD_ASSIGN_OR_RETURN(
      VectorCalibrator cal,
      VectorCalibrator::Create(layout.num_layers, layout.num_kv_heads, layout.head_dim));
  KVD_RETURN_IF_ERROR(CalibrateFromChunk(layout, raw, positions, &cal));
  return cal.Solve(options);
}

}  // namespace kvd::kernels::testing
