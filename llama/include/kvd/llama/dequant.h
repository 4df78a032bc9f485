// Dequantisation of ggml tensor blocks to float32 (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// Q4_K, Q5_K, Q6_K), bit-exact with ggml's reference dequantisers.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvd/common/status.h"

namespace kvd::llama {

// Dequantises `n` elements of type `type` (a GgmlType value) from `src` into `dst`.
// REQUIRES: n is a multiple of the type's block size and src holds n/block*block_bytes bytes.
// UNIMPLEMENTED for a type without a dequantiser; INVALID_ARGUMENT when n is not whole blocks.
Status Dequantize(uint32_t type, const void* src, float* dst, int64_t n);

}  // namespace kvd::llama
