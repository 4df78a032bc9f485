#include "kvd/common/dtype.h"

#include <string>

namespace kvd {

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
  }
  return "unknown";
}

StatusOr<DType> ParseDType(std::string_view n) {
  if (n == "float32" || n == "f32" || n == "fp32") return DType::kFloat32;
  if (n == "float16" || n == "f16" || n == "fp16" || n == "half") return DType::kFloat16;
  if (n == "bfloat16" || n == "bf16") return DType::kBFloat16;
  return Status::InvalidArgument("unknown dtype '" + std::string(n) +
                                 "' (expected float32, float16 or bfloat16)");
}

void ConvertToFloat(DType from, const void* src, float* dst, size_t n) {
  switch (from) {
    case DType::kFloat32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kFloat16: {
      auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = HalfToFloat(s[i]);
      return;
    }
    case DType::kBFloat16: {
      auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = BFloat16ToFloat(s[i]);
      return;
    }
  }
}

void ConvertFromFloat(DType to, const float* src, void* dst, size_t n) {
  switch (to) {
    case DType::kFloat32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kFloat16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = FloatToHalf(src[i]);
      return;
    }
    case DType::kBFloat16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = FloatToBFloat16(src[i]);
      return;
    }
  }
}

}  // namespace kvd
