// Backend entry points of the quantize stage (quantize.h): the quantized part of one head's keys
// or values (the recent rows are converted by src/quantize.cc). Inputs validated there.
// Private to kernels/src.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kvd/common/status.h"
#include "kvd/kernels/compact_chunk.h"

namespace kvd::kernels {

// The quantized rows of one matrix: `rows` rows of `d` floats, keys per channel over `group`
// rows, values per row over `group` channels, after the rotation (if any) of every row. Layout
// of the bytes: codes [rows, CodeRow()] (fewer than 8 bits: a bit stream, quant::GetCode), then
// Groups() parameter records of ParamBytes() (asymmetric int: float16 min, float16 scale;
// symmetric int and fp8: float16 scale; zero-anchored int: float16 scale, uint8 zero code),
// keys in (row group, channel) order, values in (row, channel group) order.
struct QuantBlock {
  QuantFormat format = QuantFormat::kInt8;
  bool keys = true;
  int64_t rows = 0;
  int d = 0;
  int group = 1;
  QuantRotation rotation = QuantRotation::kNone;

  bool fp8() const { return format == QuantFormat::kFp8E4M3; }
  bool symmetric() const {
    return format == QuantFormat::kInt4Sym || format == QuantFormat::kInt3Sym ||
           format == QuantFormat::kInt2Sym;
  }
  bool zero_anchored() const {
    return format == QuantFormat::kInt8Zero || format == QuantFormat::kInt4Zero ||
           format == QuantFormat::kInt3Zero || format == QuantFormat::kInt2Zero;
  }
  // quant::Coding's value: 0 asymmetric, 1 symmetric, 2 fp8, 3 zero-anchored.
  int coding() const { return fp8() ? 2 : symmetric() ? 1 : zero_anchored() ? 3 : 0; }
  bool rotated() const { return rotation != QuantRotation::kNone; }
  int bits() const {
    switch (format) {
      case QuantFormat::kInt4:
      case QuantFormat::kInt4Sym:
      case QuantFormat::kInt4Zero:
        return 4;
      case QuantFormat::kInt3:
      case QuantFormat::kInt3Sym:
      case QuantFormat::kInt3Zero:
        return 3;
      case QuantFormat::kInt2:
      case QuantFormat::kInt2Sym:
      case QuantFormat::kInt2Zero:
        return 2;
      default:
        return 8;
    }
  }
  size_t CodeRow() const { return (static_cast<size_t>(d) * bits() + 7) / 8; }
  size_t CodeBytes() const { return static_cast<size_t>(rows) * CodeRow(); }
  int ParamBytes() const { return fp8() || symmetric() ? 2 : zero_anchored() ? 3 : 4; }
  int64_t RowGroups() const { return (rows + group - 1) / group; }  // keys
  int64_t ColGroups() const { return (d + group - 1) / group; }     // values
  int64_t Groups() const { return keys ? RowGroups() * d : rows * ColGroups(); }
  size_t Bytes() const { return CodeBytes() + static_cast<size_t>(Groups()) * ParamBytes(); }
};

namespace internal {

// How a head's `rows` key or value rows split under a quantize stage (quantize.h): the first
// `leading` (the sink rows) and the last `trailing` (the recent rows) in the chunk dtype, the
// `quantized` rows between them. Sink rows come first when a head has fewer rows than both.
struct QuantRowSplit {
  int64_t leading = 0;
  int64_t quantized = 0;
  int64_t trailing = 0;
};
inline QuantRowSplit SplitQuantRows(const QuantDescription& q, int64_t rows) {
  QuantRowSplit s;
  if (rows <= 0) return s;
  s.leading = std::min<int64_t>(q.sinks, rows);
  s.trailing = std::min<int64_t>(q.recent, rows - s.leading);
  s.quantized = rows - s.leading - s.trailing;
  return s;
}

}  // namespace internal

// The quantized block of a head's `rows` key rows (`keys`) or value rows of `d` elements under
// `q`: the rows between its sink rows and its recent rows (internal::SplitQuantRows).
inline QuantBlock BlockOf(const QuantDescription& q, bool keys, int64_t rows, int d) {
  return {.format = q.FormatOf(keys),
          .keys = keys,
          .rows = internal::SplitQuantRows(q, rows).quantized,
          .d = d,
          .group = static_cast<int>(std::max<uint32_t>(keys ? q.key_group : q.value_group, 1)),
          .rotation = q.rotation};
}

namespace cpu {
// x: [rows, d] dense float32, finite. Writes block.Bytes() bytes to out. Returns -1, or the index
// of the first group whose parameters do not fit float16 (nothing meaningful written then).
int64_t QuantizeBlock(const QuantBlock& block, const float* x, uint8_t* out);
// in: block.Bytes() bytes; out: [rows, d] dense float32.
void DequantizeBlock(const QuantBlock& block, const uint8_t* in, float* out);
}  // namespace cpu

#if KVD_HAVE_CUDA
namespace cuda {
// Same contracts, host pointers in and out, staged through device memory on `stream`. *bad_group
// as cpu::QuantizeBlock's result.
Status QuantizeBlock(const QuantBlock& block, const float* x, uint8_t* out, int64_t* bad_group,
                     void* stream);
Status DequantizeBlock(const QuantBlock& block, const uint8_t* in, float* out, void* stream);
}  // namespace cuda
#endif

}  // namespace kvd::kernels
