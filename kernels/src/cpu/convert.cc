// CPU gather/scatter between an engine tensor [N, H, d] and per-head float32 matrices.
// float16 uses F16C (8 lanes per instruction) when the build targets it; bfloat16 is a shift that
// the compiler vectorises.
#include <algorithm>
#include <cstring>

#include "backend_a.h"
#include "kvd/common/dtype.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace kvd::kernels::cpu {
namespace {

constexpr int64_t kRowsPerTask = 256;

inline void HalfRowToFloat(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) dst[i] = HalfToFloat(src[i]);
}

inline void FloatRowToHalf(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
#endif
  for (; i < n; ++i) dst[i] = FloatToHalf(src[i]);
}

inline void BF16RowToFloat(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, 4);
  }
}

inline void FloatRowToBF16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t x;
    std::memcpy(&x, src + i, 4);
    const bool nan = (x & 0x7fffffffu) > 0x7f800000u;
    const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    dst[i] = static_cast<uint16_t>(nan ? ((x >> 16) | 0x40u) : rounded);
  }
}

}  // namespace

void GatherHeads(const EngineTensorShape& shape, const void* src, std::span<const MatrixView> heads,
                 int num_threads) {
  const int64_t n = shape.tokens, hcount = shape.num_heads, d = shape.head_dim;
  const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
  ParallelFor(tasks, num_threads, [&](int64_t t) {
    const int64_t end = std::min(n, (t + 1) * kRowsPerTask);
    for (int64_t i = t * kRowsPerTask; i < end; ++i) {
      for (int64_t h = 0; h < hcount; ++h) {
        const int64_t off = (i * hcount + h) * d;
        float* dst = heads[h].Row(i);
        switch (shape.dtype) {
          case DType::kFloat32:
            std::memcpy(dst, static_cast<const float*>(src) + off, d * sizeof(float));
            break;
          case DType::kFloat16:
            HalfRowToFloat(static_cast<const uint16_t*>(src) + off, dst, d);
            break;
          case DType::kBFloat16:
            BF16RowToFloat(static_cast<const uint16_t*>(src) + off, dst, d);
            break;
        }
      }
    }
  });
}

void ScatterHeads(const EngineTensorShape& shape, std::span<const ConstMatrixView> heads, void* dst,
                  int num_threads) {
  const int64_t n = shape.tokens, hcount = shape.num_heads, d = shape.head_dim;
  const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
  ParallelFor(tasks, num_threads, [&](int64_t t) {
    const int64_t end = std::min(n, (t + 1) * kRowsPerTask);
    for (int64_t i = t * kRowsPerTask; i < end; ++i) {
      for (int64_t h = 0; h < hcount; ++h) {
        const int64_t off = (i * hcount + h) * d;
        const float* row = heads[h].Row(i);
        switch (shape.dtype) {
          case DType::kFloat32:
            std::memcpy(static_cast<float*>(dst) + off, row, d * sizeof(float));
            break;
          case DType::kFloat16:
            FloatRowToHalf(row, static_cast<uint16_t*>(dst) + off, d);
            break;
          case DType::kBFloat16:
            FloatRowToBF16(row, static_cast<uint16_t*>(dst) + off, d);
            break;
        }
      }
    }
  });
}

}  // namespace kvd::kernels::cpu
