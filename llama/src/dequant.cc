#include "kvd/llama/dequant.h"

#include <cstring>

#include "kvd/common/dtype.h"
#include "kvd/llama/gguf.h"

namespace kvd::llama {
namespace {

inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return HalfToFloat(h);
}

// Block layouts (ggml-common.h). Offsets in bytes.
void DequantQ4_0(const uint8_t* b, float* y) {  // d:f16, qs[16]
  const float d = Half(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((qs[j] & 0x0F) - 8) * d;
    y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

void DequantQ4_1(const uint8_t* b, float* y) {  // d:f16, m:f16, qs[16]
  const float d = Half(b), m = Half(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
    y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

void DequantQ5_0(const uint8_t* b, float* y) {  // d:f16, qh[4], qs[16]
  const float d = Half(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const uint8_t xh0 = ((qh >> j) << 4) & 0x10;
    const uint8_t xh1 = (qh >> (j + 12)) & 0x10;
    y[j] = static_cast<float>(((qs[j] & 0x0F) | xh0) - 16) * d;
    y[j + 16] = static_cast<float>(((qs[j] >> 4) | xh1) - 16) * d;
  }
}

void DequantQ5_1(const uint8_t* b, float* y) {  // d:f16, m:f16, qh[4], qs[16]
  const float d = Half(b), m = Half(b + 2);
  uint32_t qh;
  std::memcpy(&qh, b + 4, 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    const uint8_t xh0 = ((qh >> j) << 4) & 0x10;
    const uint8_t xh1 = (qh >> (j + 12)) & 0x10;
    y[j] = static_cast<float>((qs[j] & 0x0F) | xh0) * d + m;
    y[j + 16] = static_cast<float>((qs[j] >> 4) | xh1) * d + m;
  }
}

void DequantQ8_0(const uint8_t* b, float* y) {  // d:f16, qs[32] int8
  const float d = Half(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

inline void ScaleMinK4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

void DequantQ4_K(const uint8_t* b, float* y) {  // d, dmin: f16; scales[12]; qs[128]
  const float d = Half(b), dmin = Half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  int is = 0;
  for (int j = 0; j < 256; j += 64) {
    uint8_t sc, m;
    ScaleMinK4(is, scales, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    ScaleMinK4(is + 1, scales, &sc, &m);
    const float d2 = d * sc, m2 = dmin * m;
    for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0xF) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
    q += 32;
    is += 2;
  }
}

void DequantQ5_K(const uint8_t* b, float* y) {  // d, dmin: f16; scales[12]; qh[32]; qs[128]
  const float d = Half(b), dmin = Half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  int is = 0;
  uint8_t u1 = 1, u2 = 2;
  for (int j = 0; j < 256; j += 64) {
    uint8_t sc, m;
    ScaleMinK4(is, scales, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    ScaleMinK4(is + 1, scales, &sc, &m);
    const float d2 = d * sc, m2 = dmin * m;
    for (int l = 0; l < 32; ++l) {
      *y++ = d1 * static_cast<float>((ql[l] & 0xF) + ((qh[l] & u1) ? 16 : 0)) - m1;
    }
    for (int l = 0; l < 32; ++l) {
      *y++ = d2 * static_cast<float>((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
    }
    ql += 32;
    is += 2;
    u1 <<= 2;
    u2 <<= 2;
  }
}

void DequantQ6_K(const uint8_t* b, float* y) {  // ql[128], qh[64], scales[16] int8, d:f16
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = Half(b + 208);
  for (int n = 0; n < 256; n += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = static_cast<int>((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = static_cast<int>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = static_cast<int>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = static_cast<int>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * sc[is + 0] * q1;
      y[l + 32] = d * sc[is + 2] * q2;
      y[l + 64] = d * sc[is + 4] * q3;
      y[l + 96] = d * sc[is + 6] * q4;
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

}  // namespace

Status Dequantize(uint32_t type, const void* src, float* dst, int64_t n) {
  int64_t be = 0, bb = 0;
  if (!GgmlBlockInfo(type, &be, &bb)) {
    return Status::Unimplemented("no dequantiser for tensor type " + GgmlTypeName(type));
  }
  if (n % be != 0) {
    return Status::InvalidArgument(std::to_string(n) + " elements is not whole " +
                                   GgmlTypeName(type) + " blocks of " + std::to_string(be));
  }
  const auto* p = static_cast<const uint8_t*>(src);
  const int64_t blocks = n / be;
  void (*fn)(const uint8_t*, float*) = nullptr;
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return Status::Ok();
    case GgmlType::kF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = Half(p + 2 * i);
      return Status::Ok();
    case GgmlType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        dst[i] = BFloat16ToFloat(h);
      }
      return Status::Ok();
    case GgmlType::kQ4_0:
      fn = DequantQ4_0;
      break;
    case GgmlType::kQ4_1:
      fn = DequantQ4_1;
      break;
    case GgmlType::kQ5_0:
      fn = DequantQ5_0;
      break;
    case GgmlType::kQ5_1:
      fn = DequantQ5_1;
      break;
    case GgmlType::kQ8_0:
      fn = DequantQ8_0;
      break;
    case GgmlType::kQ4_K:
      fn = DequantQ4_K;
      break;
    case GgmlType::kQ5_K:
      fn = DequantQ5_K;
      break;
    case GgmlType::kQ6_K:
      fn = DequantQ6_K;
      break;
    default:
      return Status::Unimplemented("no dequantiser for tensor type " + GgmlTypeName(type));
  }
  for (int64_t i = 0; i < blocks; ++i) fn(p + i * bb, dst + i * be);
  return Status::Ok();
}

}  // namespace kvd::llama
