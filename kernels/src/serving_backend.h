// Backend entry points of the serving ops (serving.h). Inputs validated by src/serving.cc.
#pragma once

#include <cstdint>

#include "kvd/common/status.h"
#include "kvd/kernels/types.h"

namespace kvd::kernels::cpu {

// Row t of keys_out/values_out = row j of keys/values for offsets[j] <= t < offsets[j + 1].
// keys, values: [S, d]; offsets: [S + 1] exclusive prefix sums of the cardinalities;
// keys_out, values_out: [offsets[S], d].
void ExpandDense(ConstMatrixView keys, ConstMatrixView values, const int64_t* offsets,
                 MatrixView keys_out, MatrixView values_out);

// out[q] = softmax_j(q.k_j * scale + bias_j) v_j; bias may be null.
void SlotAttention(ConstMatrixView queries, ConstMatrixView keys, ConstMatrixView values,
                   const float* bias, float scale, MatrixView out);

}  // namespace kvd::kernels::cpu

#if KVD_HAVE_CUDA
namespace kvd::kernels::cuda {
Status ExpandDense(ConstMatrixView keys, ConstMatrixView values, const int64_t* offsets,
                   MatrixView keys_out, MatrixView values_out, void* stream);
}  // namespace kvd::kernels::cuda
#endif
