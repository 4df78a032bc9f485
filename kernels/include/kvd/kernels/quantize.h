// The quantize stage (docs/algorithms.md 6): a compact chunk's keys and values stored in fewer
// bits, after score / merge / route, KIVI style. Keys are quantized per channel over groups of
// `key_group` consecutive slots (a key channel's outliers stay in their channel), values per
// slot over groups of `value_group` consecutive channels. Formats:
//   int8, int4, int3, int2  asymmetric: per group a float16 minimum (the largest float16 <= the
//               group's minimum) and a float16 scale (the smallest float16 >= (max - min) /
//               (2^b - 1)); x' = min + q * scale, q = round((x - min) / scale): |x - x'| <=
//               scale / 2.
//   int4s, int3s, int2s  symmetric: per group a float16 scale only, levels (q - h + 1/2) * scale
//               (h = 2^(b-1), q in [0, 2h)); the scale is the candidate with the least squared
//               error over the group among the smallest float16 >= absmax (20 - k) / 20 /
//               (h - 1/2), k = 0..11: |x - x'| <= scale / 2 for |x| <= h * scale, beyond that
//               (the clipped tails) x' is the outermost level.
//   int8z, int4z, int3z, int2z  zero-anchored: the asymmetric grid with its minimum stored as
//               a one-byte zero code z (min = -z (2^b - 1) scale / 255) after a float16 scale:
//               3 bytes per group instead of 4. For a group of smallest element lo and largest
//               hi the grid spans [min(lo, 0), max(hi, 0)]: scale = the smallest float16 >=
//               (max(hi, 0) - min(lo, 0)) / (2^b - 1) * 255 / 254, z the smallest code with
//               min <= min(lo, 0): |x - x'| <= scale / 2. For groups that hold 0 (value
//               rows); a key channel far from 0 pays its offset in scale.
//   fp8_e4m3    symmetric: per group a float16 scale (the smallest float16 >= absmax / 448), the
//               element x / scale rounded to nearest even e4m3: |x - x'| <= 2^-4 |x| for
//               |x| >= 2^-6 scale, <= 2^-10 scale below (the e4m3 subnormals).
// Values may take a format of their own (QuantDescription::value_format). With rotation kHadamard
// every quantized row x (head_dim a power of two, else INVALID_ARGUMENT) is replaced by
// H D x / sqrt(d) (D fixed random signs, docs/algorithms.md 6) before its groups are formed, and
// rotated back after dequantization: the row's L2 error is that of its rotated codes.
// The first `sinks` and the last `recent` key rows and value rows of every head stay in the
// chunk dtype, out of every group. Byte layout: docs/chunk-format.md (versions 3 to 5).
// Dequantization happens where chunks are served (BuildServingHead, ExpandDenseChunk,
// DeviceCompactChunk::Upload).
#pragma once

#include <cstdint>
#include <span>

#include "kvd/common/status.h"
#include "kvd/kernels/compact_chunk.h"
#include "kvd/kernels/types.h"

namespace kvd::kernels {

// INVALID_ARGUMENT naming the field when `q` is not a usable quantize stage: a known format other
// than kNone, key_group and value_group in [1, 65536], recent and sinks <= 2^30.
Status ValidateQuantize(const QuantDescription& q);

// Quantizes `rows` ([R, d] float32, finite, each value of the rows kept in `dtype` representable)
// into out (QuantizedRowsBytes(R, d, dtype, q, keys) bytes). OUT_OF_RANGE naming the group when
// a group's minimum or scale does not fit float16 (|values| beyond about 65504, or 2.9e7 for
// fp8); INVALID_ARGUMENT for sizes or non-finite input. exec.backend kCuda runs the CUDA twin.
Status QuantizeRows(ConstMatrixView rows, DType dtype, const QuantDescription& q, bool keys,
                    std::span<uint8_t> out, const ExecOptions& exec = {});

// The inverse: `in` (QuantizedRowsBytes(out.rows, ...) bytes) into out [R, d] float32.
// INVALID_ARGUMENT for sizes.
Status DequantizeRows(std::span<const uint8_t> in, DType dtype, const QuantDescription& q,
                      bool keys, MatrixView out, const ExecOptions& exec = {});

// A chunk with every head's keys and values quantized per `q`, codec.quant = q. The input must
// be unquantized and valid (INVALID_ARGUMENT otherwise); QuantizeRows's errors naming the head.
StatusOr<CompactChunk> QuantizeChunk(const CompactChunk& chunk, const QuantDescription& q,
                                     const ExecOptions& exec = {});

// The chunk with its keys and values dequantized and rounded to the chunk dtype, codec.quant
// reset (a chunk that is not quantized is returned as it is). INVALID_ARGUMENT when invalid.
StatusOr<CompactChunk> DequantizeChunk(const CompactChunk& chunk, const ExecOptions& exec = {});

}  // namespace kvd::kernels
