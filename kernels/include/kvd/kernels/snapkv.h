// SnapKV scores (docs/algorithms.md 2): mean attention of the window queries on each key, smoothed
// by a 1-D pool; the window tokens score +Inf (always kept, counted in the budget).
#pragma once

#include <cstdint>
#include <span>

#include "kvd/kernels/observation.h"
#include "kvd/kernels/types.h"

namespace kvd::kernels {

enum class PoolingKind : uint8_t { kAvg = 0, kMax = 1 };

struct SnapKvOptions {
  int window = 64;      // W queries = the last W tokens (64 as kvpress; 32 in the paper), >= 1
  int kernel_size = 5;  // pooling kernel, odd, >= 1 (1 = no pooling); padding = kernel_size/2
  PoolingKind pooling = PoolingKind::kAvg;  // kAvg (kvpress) or kMax (original repo, kernel 7)
  int group_size = 1;                       // G query heads per KV head

  Status Validate() const;
};

// scores[j] for the N keys of one KV head. queries: [W*G, d] post-RoPE (the last W tokens'
// queries, row w*G+g); keys: [N, d] post-RoPE. Score = pool(mass/(W*G)) over the N-W
// non-window keys (the window keys are excluded from the pool's neighbourhood and set to +Inf).
// Average pooling divides by kernel_size (zero padding, count_include_pad, as F.avg_pool1d).
// Errors: those of ComputeAttentionMass with mask kCausalWindow; INVALID_ARGUMENT when
// queries.rows != window * group_size or N < window ("smaller than the window").
Status SnapKvScores(ConstMatrixView queries, ConstMatrixView keys, const SnapKvOptions& options,
                    std::span<float> scores, const ExecOptions& exec = {});

// The pooling step alone (exposed for tests and for PyramidKV): out[j] = pool(in)[j].
Status Pool1d(std::span<const float> in, int kernel_size, PoolingKind pooling,
              std::span<float> out);

}  // namespace kvd::kernels
