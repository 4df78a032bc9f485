// The quantize stage: validation, the sink and recent rows, per-head and per-chunk driving,
// dispatch between src/cpu/quantize.cc and src/cuda/quantize.cu (quantize.h).
#include "kvd/kernels/quantize.h"

#include <string>
#include <vector>

#include "compact_chunk_internal.h"
#include "quantize_backend.h"
#include "vector_backend.h"

namespace kvd::kernels {
namespace {

// INVALID_ARGUMENT when the rotation cannot apply to rows of d elements.
Status CheckRotation(const QuantDescription& q, int d, const char* what) {
  if (q.rotation == QuantRotation::kHadamard && (d < 1 || (d & (d - 1)) != 0)) {
    return Status::InvalidArgument(std::string(what) + ": the hadamard rotation needs a " +
                                   "power-of-two head_dim, got " + std::to_string(d));
  }
  return Status::Ok();
}

// A dense copy of the view's `rows` rows from row `first` on.
std::vector<float> Dense(ConstMatrixView m, int64_t first, int64_t rows) {
  std::vector<float> out(static_cast<size_t>(rows * m.cols));
  for (int64_t r = 0; r < rows; ++r) {
    std::copy(m.Row(first + r), m.Row(first + r) + m.cols, out.begin() + r * m.cols);
  }
  return out;
}

}  // namespace

Status ValidateQuantize(const QuantDescription& q) {
  if (!q.quantized()) return Status::InvalidArgument("quantize: format is none");
  CodecDescription c;
  c.quant = q;
  return internal::ValidateCodec(c);
}

Status QuantizeRows(ConstMatrixView rows, DType dtype, const QuantDescription& q, bool keys,
                    std::span<uint8_t> out, const ExecOptions& exec) {
  KVD_RETURN_IF_ERROR(ValidateQuantize(q));
  const int d = static_cast<int>(rows.cols);
  if (out.size() != QuantizedRowsBytes(rows.rows, d, dtype, q, keys)) {
    return Status::InvalidArgument(
        "QuantizeRows: output holds " + std::to_string(out.size()) + " bytes, expected " +
        std::to_string(QuantizedRowsBytes(rows.rows, d, dtype, q, keys)));
  }
  KVD_RETURN_IF_ERROR(CheckRotation(q, d, "QuantizeRows"));
  KVD_RETURN_IF_ERROR(CheckFinite(rows, "QuantizeRows input"));
  const QuantBlock b = BlockOf(q, keys, rows.rows, d);
  const int64_t lead = internal::SplitQuantRows(q, rows.rows).leading;
  const std::vector<float> x = Dense(rows, lead, b.rows);
  const size_t row_bytes = static_cast<size_t>(d) * DTypeSize(dtype);
  uint8_t* codes = out.data() + lead * row_bytes;
  int64_t bad = -1;
  if (exec.backend == Backend::kCuda) {
#if KVD_HAVE_CUDA
    KVD_RETURN_IF_ERROR(CudaBackendReady("QuantizeRows"));
    KVD_RETURN_IF_ERROR(cuda::QuantizeBlock(b, x.data(), codes, &bad, exec.cuda_stream));
#else
    return CudaBackendReady("QuantizeRows");
#endif
  } else if (b.rows > 0) {
    bad = cpu::QuantizeBlock(b, x.data(), codes);
  }
  if (bad >= 0) {
    return Status::OutOfRange("quantize: group " + std::to_string(bad) + " of the " +
                              (keys ? "keys" : "values") +
                              " has a minimum or scale beyond "
                              "float16 (values too large to quantize)");
  }
  for (int64_t r = 0; r < lead; ++r)
    ConvertFromFloat(dtype, rows.Row(r), out.data() + r * row_bytes, d);
  uint8_t* full = codes + b.Bytes();
  for (int64_t r = lead + b.rows; r < rows.rows; ++r) {
    ConvertFromFloat(dtype, rows.Row(r), full + (r - lead - b.rows) * row_bytes, d);
  }
  return Status::Ok();
}

Status DequantizeRows(std::span<const uint8_t> in, DType dtype, const QuantDescription& q,
                      bool keys, MatrixView out, const ExecOptions& exec) {
  KVD_RETURN_IF_ERROR(ValidateQuantize(q));
  const int d = static_cast<int>(out.cols);
  if (in.size() != QuantizedRowsBytes(out.rows, d, dtype, q, keys)) {
    return Status::InvalidArgument("DequantizeRows: input holds " + std::to_string(in.size()) +
                                   " bytes, expected " +
                                   std::to_string(QuantizedRowsBytes(out.rows, d, dtype, q, keys)));
  }
  KVD_RETURN_IF_ERROR(CheckRotation(q, d, "DequantizeRows"));
  const QuantBlock b = BlockOf(q, keys, out.rows, d);
  const int64_t lead = internal::SplitQuantRows(q, out.rows).leading;
  const size_t row_bytes = static_cast<size_t>(d) * DTypeSize(dtype);
  const uint8_t* codes = in.data() + lead * row_bytes;
  std::vector<float> x(static_cast<size_t>(b.rows) * d);
  if (exec.backend == Backend::kCuda) {
#if KVD_HAVE_CUDA
    KVD_RETURN_IF_ERROR(CudaBackendReady("DequantizeRows"));
    KVD_RETURN_IF_ERROR(cuda::DequantizeBlock(b, codes, x.data(), exec.cuda_stream));
#else
    return CudaBackendReady("DequantizeRows");
#endif
  } else if (b.rows > 0) {
    cpu::DequantizeBlock(b, codes, x.data());
  }
  for (int64_t r = 0; r < lead; ++r)
    ConvertToFloat(dtype, in.data() + r * row_bytes, out.Row(r), d);
  for (int64_t r = 0; r < b.rows; ++r) {
    std::copy(x.begin() + r * d, x.begin() + (r + 1) * d, out.Row(lead + r));
  }
  const uint8_t* full = codes + b.Bytes();
  for (int64_t r = lead + b.rows; r < out.rows; ++r) {
    ConvertToFloat(dtype, full + (r - lead - b.rows) * row_bytes, out.Row(r), d);
  }
  return Status::Ok();
}

StatusOr<CompactChunk> QuantizeChunk(const CompactChunk& chunk, const QuantDescription& q,
                                     const ExecOptions& exec) {
  KVD_RETURN_IF_ERROR(ValidateQuantize(q));
  KVD_RETURN_IF_ERROR(chunk.Validate());
  if (chunk.codec.quant.quantized()) {
    return Status::InvalidArgument("QuantizeChunk: the chunk is already quantized");
  }
  CompactChunk out = chunk;
  out.codec.quant = q;
  const int d = chunk.head_dim;
  for (size_t i = 0; i < chunk.heads.size(); ++i) {
    const CompactHead& src = chunk.heads[i];
    CompactHead& dst = out.heads[i];
    for (const bool keys : {true, false}) {
      const std::vector<uint8_t>& from = keys ? src.keys : src.values;
      const int64_t rows = keys ? src.slots() : src.value_slots();
      Matrix m(rows, d);
      ConvertToFloat(chunk.dtype, from.data(), m.values.data(), static_cast<size_t>(rows) * d);
      std::vector<uint8_t>& to = keys ? dst.keys : dst.values;
      to.assign(QuantizedRowsBytes(rows, d, chunk.dtype, q, keys), 0);
      KVD_RETURN_IF_ERROR(
          QuantizeRows(m.View(), chunk.dtype, q, keys, to, exec)
              .WithContext(internal::HeadName(static_cast<int64_t>(i), chunk.num_kv_heads)));
    }
  }
  return out;
}

StatusOr<CompactChunk> DequantizeChunk(const CompactChunk& chunk, const ExecOptions& exec) {
  KVD_RETURN_IF_ERROR(chunk.Validate());
  if (!chunk.codec.quant.quantized()) return chunk;
  CompactChunk out = chunk;
  out.codec.quant = {};
  const int d = chunk.head_dim;
  for (size_t i = 0; i < chunk.heads.size(); ++i) {
    const CompactHead& src = chunk.heads[i];
    CompactHead& dst = out.heads[i];
    for (const bool keys : {true, false}) {
      const int64_t rows = keys ? src.slots() : src.value_slots();
      Matrix m(rows, d);
      KVD_RETURN_IF_ERROR(DequantizeRows(keys ? src.keys : src.values, chunk.dtype,
                                         chunk.codec.quant, keys, m.View(), exec));
      std::vector<uint8_t>& to = keys ? dst.keys : dst.values;
      to.assign(static_cast<size_t>(rows) * d * DTypeSize(chunk.dtype), 0);
      ConvertFromFloat(chunk.dtype, m.values.data(), to.data(), static_cast<size_t>(rows) * d);
    }
  }
  return out;
}

}  // namespace kvd::kernels
