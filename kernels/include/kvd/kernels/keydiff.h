// KeyDiff scores (docs/algorithms.md 2, query-agnostic): anchor = mean_i(k_i / |k_i|),
// score_i = -cos(k_i, anchor). Keys most similar to the anchor score lowest and go first.
//
// Zero-norm keys: REJECTED with INVALID_ARGUMENT "zero-norm key" (a key whose squared norm is
// below 1e-30 carries no direction; an engine that writes such keys is broken or padded, and a
// silent cos 0 would keep it at a neutral rank). If the anchor is numerically zero (the keys
// cancel: |sum_i k_i/|k_i|| <= 1e-6 N) every score is 0 and ties keep the lower indices.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvd/kernels/scorers.h"
#include "kvd/kernels/types.h"

namespace kvd::kernels {

// scores[i] = -cos(keys[i], anchor), keys [N, d] (pre- or post-RoPE, as the caller chooses).
// Errors: INVALID_ARGUMENT for unsupported d, size mismatch, NaN/Inf ("keys"), zero-norm keys.
// kCuda: UNIMPLEMENTED without CUDA, UNAVAILABLE without a device.
Status KeyDiffScores(ConstMatrixView keys, std::span<float> scores, const ExecOptions& exec = {});

struct KeyDiffBlockOptions {
  int64_t block_size = 128;    // tokens per block, >= 1
  SelectionOptions selection;  // sinks kept always; window kept always (from the last block)

  Status Validate() const;
};

// Block-wise KeyDiff: walk the N tokens in blocks; after each block keep the `budget` best of
// (kept so far + new block), the anchor recomputed over that candidate set. Sinks and the
// window are always kept. Returns `budget` indices sorted ascending (N if budget >= N).
// Errors: those of KeyDiffScores and SelectTopK.
StatusOr<std::vector<int32_t>> KeyDiffBlockwiseSelect(ConstMatrixView keys, int64_t budget,
                                                      const KeyDiffBlockOptions& options,
                                                      const ExecOptions& exec = {});

}  // namespace kvd::kernels
