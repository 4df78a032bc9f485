// Backend entry points of the expected-attention scores (expected_attention.h). The public entry
// (src/expected_attention.cc) validates shapes and finiteness, then calls exactly one of these.
#pragma once

#include "kvd/common/status.h"
#include "kvd/kernels/expected_attention.h"
#include "kvd/kernels/types.h"

namespace kvd::kernels::cpu {
// scores [N]; keys [N, d]; values [N, d] or rows 0.
void ExpectedAttentionScores(const ExpectedQueries& q, ConstMatrixView keys, ConstMatrixView values,
                             float* scores);
}  // namespace kvd::kernels::cpu

#if KVD_HAVE_CUDA
namespace kvd::kernels::cuda {
// Same contract as the CPU twin; host pointers in and out, staged through the device.
Status ExpectedAttentionScores(const ExpectedQueries& q, ConstMatrixView keys,
                               ConstMatrixView values, float* scores, void* stream);
}  // namespace kvd::kernels::cuda
#endif
