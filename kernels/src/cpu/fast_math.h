// Branch-free float math that GCC/Clang auto-vectorise (no libm calls in inner loops).
// Private to kernels/src.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvd::kernels::cpu {

// exp(x) for x <= 0 (softmax after max subtraction); relative error < 2e-7 for x >= -87,
// exactly 0 below. Cephes-style: x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial.
inline float FastExpNonPositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;  // ln2 split in two for an exact first product
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) << 23;
  float out;
  std::memcpy(&out, &bits, 4);
  return x <= -87.0f ? 0.0f : out;
}

// sin and cos of `angle` (radians, any magnitude): reduced modulo pi/2 in float64, polynomial in
// float32 on [-pi/4, pi/4]; absolute error < 3e-7.
inline void SinCosReduced(double angle, float* s, float* c) {
  const double k = std::nearbyint(angle * 0.63661977236758134308);  // 2/pi
  const double r64 = angle - k * 1.57079632679489661923;
  const float r = static_cast<float>(r64);
  const float r2 = r * r;
  float sp = -2.50521083854e-8f;
  sp = sp * r2 + 2.75573192240e-6f;
  sp = sp * r2 - 1.98412698413e-4f;
  sp = sp * r2 + 8.33333333333e-3f;
  sp = sp * r2 - 1.66666666667e-1f;
  const float sin_r = r + r * r2 * sp;
  float cp = 2.08767569879e-9f;
  cp = cp * r2 - 2.75573192240e-7f;
  cp = cp * r2 + 2.48015873016e-5f;
  cp = cp * r2 - 1.38888888889e-3f;
  cp = cp * r2 + 4.16666666667e-2f;
  const float cos_r = 1.0f - 0.5f * r2 + r2 * r2 * cp;
  const int64_t q = static_cast<int64_t>(k) & 3;
  const float sv = (q & 1) ? cos_r : sin_r;
  const float cv = (q & 1) ? sin_r : cos_r;
  *s = (q & 2) ? -sv : sv;
  *c = ((q + 1) & 2) ? -cv : cv;
}

inline bool IsFiniteBits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return (b & 0x7f800000u) != 0x7f800000u;
}

// Reductions with 16 independent lanes so the compiler vectorises them without -ffast-math.
inline float LaneMax(const float* x, int64_t n) {
  float lanes[16];
  for (float& l : lanes) l = -3.402823466e38f;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    for (int l = 0; l < 16; ++l) lanes[l] = lanes[l] > x[j + l] ? lanes[l] : x[j + l];
  }
  float m = -3.402823466e38f;
  for (; j < n; ++j) m = m > x[j] ? m : x[j];
  for (float l : lanes) m = m > l ? m : l;
  return m;
}

inline float LaneSum(const float* x, int64_t n) {
  float lanes[16] = {};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    for (int l = 0; l < 16; ++l) lanes[l] += x[j + l];
  }
  float s = 0.0f;
  for (; j < n; ++j) s += x[j];
  for (float l : lanes) s += l;
  return s;
}

inline float LaneDot(const float* a, const float* b, int64_t n) {
  float lanes[16] = {};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    for (int l = 0; l < 16; ++l) lanes[l] += a[j + l] * b[j + l];
  }
  float s = 0.0f;
  for (; j < n; ++j) s += a[j] * b[j];
  for (float l : lanes) s += l;
  return s;
}

}  // namespace kvd::kernels::cpu
