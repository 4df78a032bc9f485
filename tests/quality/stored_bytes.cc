#include "stored_bytes.h"

#include <vector>

#include "kvd/common/dtype.h"

namespace kvd::quality {
namespace {

// `bytes` of float32 elements as bfloat16 elements.
std::vector<uint8_t> FloatBytesToBf16(const std::vector<uint8_t>& bytes) {
  const size_t n = bytes.size() / sizeof(float);
  std::vector<uint8_t> out(n * DTypeSize(DType::kBFloat16));
  ConvertFromFloat(DType::kBFloat16, reinterpret_cast<const float*>(bytes.data()), out.data(), n);
  return out;
}

}  // namespace

int64_t RawBf16Bytes(const kernels::CompactChunk& chunk) {
  return int64_t{2} * chunk.num_layers * chunk.original_tokens * chunk.num_kv_heads *
         chunk.head_dim * DTypeSize(DType::kBFloat16);
}

StatusOr<double> StoredBytesFraction(const kernels::CompactChunk& chunk) {
  const int64_t raw = RawBf16Bytes(chunk);
  if (raw <= 0) return Status::InvalidArgument("stored bytes of an empty chunk");
  std::vector<uint8_t> encoded;
  if (chunk.dtype == DType::kBFloat16) {
    KVD_ASSIGN_OR_RETURN(encoded, kernels::EncodeCompactChunk(chunk));
  } else if (chunk.codec.quant.quantized()) {
    return Status::FailedPrecondition(
        "stored bytes: a quantized chunk must be bfloat16 (the harness quantizes bfloat16 "
        "chunks), got " +
        std::string(DTypeName(chunk.dtype)));
  } else {
    if (chunk.dtype != DType::kFloat32) {
      return Status::FailedPrecondition("stored bytes: chunk dtype " +
                                        std::string(DTypeName(chunk.dtype)) +
                                        " (float32 or bfloat16 expected)");
    }
    kernels::CompactChunk bf16 = chunk;
    bf16.dtype = DType::kBFloat16;
    for (kernels::CompactHead& h : bf16.heads) {
      h.keys = FloatBytesToBf16(h.keys);
      h.values = FloatBytesToBf16(h.values);
    }
    KVD_ASSIGN_OR_RETURN(encoded, kernels::EncodeCompactChunk(bf16));
  }
  return static_cast<double>(encoded.size()) / static_cast<double>(raw);
}

}  // namespace kvd::quality
