// Token selection shared by the base scorers (docs/algorithms.md 2): given per-token scores
// (higher = more important), keep the sinks (first S tokens), the window (last W tokens) and the
// best of the rest, up to an exact budget. See snapkv.h, keydiff.h and pyramidkv.h for the scores.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvd/kernels/types.h"

namespace kvd::kernels {

struct SelectionOptions {
  int64_t sinks = 4;   // first `sinks` tokens are always kept (AsymKV uses 32), >= 0
  int64_t window = 0;  // last `window` tokens are always kept (SnapKV's W), >= 0

  Status Validate() const;
};

// Returns the kept token indices, sorted ascending, exactly `budget` of them (or N if budget >= N).
// The sinks and the window come first; the remaining budget - S - W are the highest-scoring
// middle tokens (ties: lower index wins, so the result is deterministic).
// Errors:
//   INVALID_ARGUMENT "smaller than the sinks" / "smaller than the window": N < S + W;
//   OUT_OF_RANGE "budget ... cannot keep sinks + window": budget < S + W (or budget < 0);
//   INVALID_ARGUMENT "non-finite score" for NaN (an +Inf score is allowed and means "keep").
StatusOr<std::vector<int32_t>> SelectTopK(std::span<const float> scores, int64_t budget,
                                          const SelectionOptions& options);

// round(N * (1 - compression_ratio)): the uniform per-head budget of eviction at ratio p_c.
// REQUIRES 0 <= compression_ratio < 1 (OUT_OF_RANGE otherwise).
StatusOr<int64_t> UniformBudget(int64_t n, double compression_ratio);

}  // namespace kvd::kernels
