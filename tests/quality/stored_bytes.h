// What a compact chunk costs to store, as kvd stores it: the bytes of EncodeCompactChunk
// (header, bit-packed slot metadata, quantization scales, 64-byte padding, checksum) over the
// raw chunk's bytes, both in bfloat16 (the dtype kvd's models are stored in).
#pragma once

#include "kvd/common/status.h"
#include "kvd/kernels/compact_chunk.h"

namespace kvd::quality {

// The raw chunk's bytes in bfloat16: layers * (K + V) * original_tokens * kv_heads * head_dim * 2.
int64_t RawBf16Bytes(const kernels::CompactChunk& chunk);

// Encoded bytes of `chunk` over RawBf16Bytes(chunk). A chunk in another dtype that is not
// quantized (the reference engine's float32 cache) is converted to bfloat16 first, so every
// method is measured on the chunk kvd would store. FAILED_PRECONDITION for a quantized chunk
// whose dtype is not bfloat16 (the harness quantizes bfloat16 chunks only); INVALID_ARGUMENT
// for an empty or invalid chunk (EncodeCompactChunk's errors).
StatusOr<double> StoredBytesFraction(const kernels::CompactChunk& chunk);

}  // namespace kvd::quality
