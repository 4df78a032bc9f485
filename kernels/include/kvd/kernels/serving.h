// Serving a compact chunk (docs/algorithms.md 1): the compact form (keys, mean values, a per-slot
// bias ln l_j) for engines whose attention takes an additive bias, and the dense expansion (slot j
// repeated l_j times with its mean value) for engines that cannot take one. Both give the same
// attention output:
//   softmax_j(s_j + ln l_j) . mean_j  ==  sum_j l_j exp(s_j) mean_j / sum_j l_j exp(s_j).
// The values of "rebuild me" slots are rebuilt by the chunk's route stage (stages.h RebuildFn,
// looked up by the route code the chunk records): VECTOR's as W RoPE^-1(k_j, pos_j).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvd/kernels/compact_chunk.h"
#include "kvd/kernels/rope.h"
#include "kvd/kernels/types.h"
#include "kvd/kernels/vector.h"

namespace kvd::kernels {

// Compact serving form of one (layer, KV head), float32.
struct ServingHead {
  Matrix keys;                       // [S, d] post-RoPE keys
  Matrix values;                     // [S, d] mean values Vsum_j / l_j (rebuilt where flagged)
  std::vector<float> bias;           // [S] ln l_j
  std::vector<int32_t> cardinality;  // [S] l_j
  std::vector<int64_t> positions;    // [S] representative positions
};

// Builds the compact form of (layer, head) of `chunk`. `rope` and `weights` are read only when
// the head has rebuild slots (they may be null otherwise): `weights` only for a route stage that
// needs a calibration (VECTOR; both are required then), `rope` by a stage that de-rotates keys.
// Errors: INVALID_ARGUMENT for a bad index or an invalid chunk (an unregistered route code among
// them), or a rope table of another head_dim; UNIMPLEMENTED when exec.backend is kCuda and the
// route stage has no device rebuild (StageRegistration::device_rebuild); for a stage that needs a
// calibration, FAILED_PRECONDITION "needs VECTOR weights" when rope/weights are missing,
// "calibration version mismatch" when weights->version != chunk.codec.calibration_version,
// "shape" when weights do not cover the head; the errors of the stage's rebuild (VECTOR's: those
// of ApplyRope and RebuildValues).
StatusOr<ServingHead> BuildServingHead(const CompactChunk& chunk, int layer, int head,
                                       const RopeTable* rope, const VectorWeights* weights,
                                       const ExecOptions& exec = {});

// Dense form of one head: T = sum_j l_j rows, slot j's key and mean value repeated l_j times in
// slot order.
struct DenseHead {
  Matrix keys;                     // [T, d]
  Matrix values;                   // [T, d]
  std::vector<int64_t> positions;  // [T] the slot's representative position, repeated
};

// INVALID_ARGUMENT if the head's sizes disagree or a cardinality is < 1.
StatusOr<DenseHead> ExpandDense(const ServingHead& head, const ExecOptions& exec = {});

// Whole chunk in the engine's raw layout (common/layout.h): for each layer K[T, H, d] then
// V[T, H, d] in chunk.dtype. Every head must expand to the same T (returned in *tokens), else
// FAILED_PRECONDITION "heads expand to different token counts" (eviction with per-head merging
// can make them differ; such chunks need the compact form). Other errors as BuildServingHead.
StatusOr<std::vector<uint8_t>> ExpandDenseChunk(const CompactChunk& chunk, const RopeTable* rope,
                                                const VectorWeights* weights, int64_t* tokens,
                                                const ExecOptions& exec = {});

// Reference attention over slots for queries [Q, d], keys [S, d], values [S, d], bias [S] (empty
// = no bias): out[q] = sum_j softmax_j(q . k_j * scale + bias_j) v_j, out [Q, d]. scale 0 means
// 1/sqrt(d). S == 0 gives zeros. Float32 with the max subtracted and float64 sums. CPU only: it
// is the yardstick serving forms are checked against, not a decode kernel.
// INVALID_ARGUMENT on shape mismatch or NaN/Inf in any input.
Status SlotAttention(ConstMatrixView queries, ConstMatrixView keys, ConstMatrixView values,
                     std::span<const float> bias, float scale, MatrixView out);

}  // namespace kvd::kernels
