// The element math of the quantize stage (docs/algorithms.md 6), one copy for the CPU kernel
// (src/cpu/quantize.cc) and its CUDA twin (src/cuda/quantize.cu): group parameters, codes and
// dequantized values. Every operation is IEEE-754 with round to nearest even (division, fmaf,
// rintf, float16 conversion), so both backends produce the same codes, scales and dequantized
// floats bit for bit. Private to kernels/src.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#include <cuda_fp16.h>
#define KVD_QHD __host__ __device__ __forceinline__
#else
#define KVD_QHD inline
#endif

#include "kvd/common/dtype.h"

namespace kvd::kernels::quant {

// How a format codes its elements: asymmetric integers (per group a float16 minimum then a
// float16 scale), symmetric integers or fp8 e4m3 (per group a float16 scale), zero-anchored
// integers (per group a float16 scale then a one-byte zero code).
enum class Coding : int { kAsymmetric = 0, kSymmetric = 1, kFp8 = 2, kZeroAnchored = 3 };
inline constexpr float kFp8Max = 448.0f;  // largest finite e4m3 value
// Symmetric scales tried per group: the one covering the group's largest |x| and 11 narrower.
inline constexpr int kSymCandidates = 12;

KVD_QHD float HalfBitsToFloat(uint16_t h) {
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half(h));
#else
  return HalfToFloat(h);
#endif
}

KVD_QHD uint16_t FloatToHalfBits(float f) {
#ifdef __CUDA_ARCH__
  return __half_as_ushort(__float2half_rn(f));
#else
  return FloatToHalf(f);
#endif
}

// The next float16 bit pattern towards +inf / -inf (finite input).
KVD_QHD uint16_t HalfNextUp(uint16_t h) {
  if (h == 0x8000u) return 0x0001u;
  return (h & 0x8000u) ? static_cast<uint16_t>(h - 1) : static_cast<uint16_t>(h + 1);
}
KVD_QHD uint16_t HalfNextDown(uint16_t h) {
  if (h == 0x0000u) return 0x8001u;
  return (h & 0x8000u) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h - 1);
}

// The smallest float16 >= f and the largest float16 <= f. Inf (0x7c00 / 0xfc00) when out of range.
KVD_QHD uint16_t HalfRoundUp(float f) {
  uint16_t h = FloatToHalfBits(f);
  if ((h & 0x7c00u) != 0x7c00u && HalfBitsToFloat(h) < f) h = HalfNextUp(h);
  return h;
}
KVD_QHD uint16_t HalfRoundDown(float f) {
  uint16_t h = FloatToHalfBits(f);
  if ((h & 0x7c00u) != 0x7c00u && HalfBitsToFloat(h) > f) h = HalfNextDown(h);
  return h;
}

KVD_QHD bool HalfFinite(uint16_t h) { return (h & 0x7c00u) != 0x7c00u; }

// a * b rounded once (never fused into an fma by the device compiler).
KVD_QHD float MulRn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// A float16 parameter stored little-endian.
KVD_QHD uint16_t LoadHalf(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (static_cast<unsigned>(p[1]) << 8));
}
KVD_QHD void StoreHalf(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v & 0xffu);
  p[1] = static_cast<uint8_t>(v >> 8);
}

// Integer formats (b bits, qmax = 2^b - 1), asymmetric per group: min = the largest float16 <=
// the group's minimum, scale = the smallest float16 >= (max - min) / qmax, so min + qmax * scale
// covers the group and round to nearest errs by at most scale / 2. Returns false when either does
// not fit a finite float16.
KVD_QHD bool IntGroupParams(float lo, float hi, int qmax, uint16_t* min_bits,
                            uint16_t* scale_bits) {
  const uint16_t mn = HalfRoundDown(lo);
  if (!HalfFinite(mn)) return false;
  const double step = (static_cast<double>(hi) - HalfBitsToFloat(mn)) / qmax;
  float s = static_cast<float>(step);
  if (static_cast<double>(s) < step) s = nextafterf(s, INFINITY);
  const uint16_t sc = HalfRoundUp(s);
  if (!HalfFinite(sc)) return false;
  *min_bits = mn;
  *scale_bits = sc;
  return true;
}

// Zero-anchored integer formats (b bits, qmax = 2^b - 1): the asymmetric grid min + q * scale
// with the minimum stored as a one-byte zero code z instead of a float16: min = -(z qmax scale) /
// 255 (the float32 product, exact for the integer z qmax, rounded once, then divided by 255 and
// rounded once). The grid spans [min(a, 0), max(b, 0)] for a group of minimum a and maximum b:
// scale = the smallest float16 >= (max(b, 0) - min(a, 0)) / qmax * 255 / 254, z = the smallest
// code whose min <= min(a, 0). The 255 / 254 pays for z's step of qmax scale / 255, so min +
// qmax * scale still reaches max(b, 0) and round to nearest errs by at most scale / 2. A group
// that holds 0 (a value row) pays 0.4% of scale for the byte saved; a group far from 0 (a key
// channel with an offset) pays its offset.
inline constexpr int kZeroCodeMax = 255;

KVD_QHD float ZeroAnchoredMin(int z, int qmax, float scale) {
  return -(MulRn(static_cast<float>(z * qmax), scale) / static_cast<float>(kZeroCodeMax));
}

KVD_QHD bool ZeroAnchoredParams(float lo, float hi, int qmax, uint16_t* scale_bits, uint8_t* zero) {
  const float a = lo < 0.0f ? lo : 0.0f, b = hi > 0.0f ? hi : 0.0f;
  const double step = (static_cast<double>(b) - a) / qmax * kZeroCodeMax / (kZeroCodeMax - 1);
  float s = static_cast<float>(step);
  if (static_cast<double>(s) < step) s = nextafterf(s, INFINITY);
  const uint16_t sc = HalfRoundUp(s);
  if (!HalfFinite(sc)) return false;
  const float scale = HalfBitsToFloat(sc);
  int z = 0;
  if (scale > 0.0f) {
    // One below the real-number answer, then up to the first z whose float32 minimum is <= a.
    const double exact =
        -static_cast<double>(a) * kZeroCodeMax / (qmax * static_cast<double>(scale));
    z = static_cast<int>(ceil(exact)) - 1;
    z = z < 0 ? 0 : z;
    while (z < kZeroCodeMax && ZeroAnchoredMin(z, qmax, scale) > a) ++z;
  }
  *scale_bits = sc;
  *zero = static_cast<uint8_t>(z);
  return true;
}

KVD_QHD uint8_t IntCode(float x, float mn, float scale, int qmax) {
  if (!(scale > 0.0f)) return 0;
  const float q = rintf((x - mn) / scale);
  return static_cast<uint8_t>(q < 0.0f ? 0.0f : (q > qmax ? static_cast<float>(qmax) : q));
}

KVD_QHD float IntValue(uint8_t code, float mn, float scale) {
  return fmaf(static_cast<float>(code), scale, mn);
}

// fp8 e4m3 (bias 7, 3 mantissa bits, no infinities, 448 the largest finite, subnormals 2^-9
// apart), symmetric per group: scale = the smallest float16 >= absmax / 448.
KVD_QHD bool Fp8GroupScale(float absmax, uint16_t* scale_bits) {
  const double step = static_cast<double>(absmax) / kFp8Max;
  float s = static_cast<float>(step);
  if (static_cast<double>(s) < step) s = nextafterf(s, INFINITY);
  const uint16_t sc = HalfRoundUp(s);
  if (!HalfFinite(sc)) return false;
  *scale_bits = sc;
  return true;
}

// Round to nearest even into e4m3, saturating at +-448.
KVD_QHD uint8_t FloatToE4M3(float x) {
  const uint8_t sign = x < 0.0f ? 0x80u : 0u;  // -0 encodes as +0
  const float a = fabsf(x);
  if (!(a < kFp8Max)) return sign | 0x7eu;
  int e2 = 0;
  frexpf(a, &e2);                   // a = m 2^e2, m in [0.5, 1)
  int e = e2 - 1;                   // a in [2^e, 2^(e+1))
  if (a == 0.0f || e < -6) e = -6;  // subnormal binade: spacing 2^-9
  const float spacing = ldexpf(1.0f, e - 3);
  float q = rintf(a / spacing);  // exact division by a power of two
  if (q >= 16.0f) {              // rounded up into the next binade
    q = 8.0f;
    ++e;
  }
  if (q < 8.0f) return sign | static_cast<uint8_t>(q);  // subnormal (e == -6) or zero
  const int bits = ((e + 7) << 3) | (static_cast<int>(q) - 8);
  return sign | static_cast<uint8_t>(bits > 0x7e ? 0x7e : bits);
}

KVD_QHD float E4M3ToFloat(uint8_t b) {
  const int exp = (b >> 3) & 0xf, mant = b & 7;
  const float mag = exp == 0 ? ldexpf(static_cast<float>(mant), -9)
                             : ldexpf(static_cast<float>(8 + mant), exp - 10);
  return (b & 0x80u) ? -mag : mag;
}

KVD_QHD uint8_t Fp8Code(float x, float scale) { return scale > 0.0f ? FloatToE4M3(x / scale) : 0; }

KVD_QHD float Fp8Value(uint8_t code, float scale) { return E4M3ToFloat(code) * scale; }

// The groups of a block of `rows` rows of d elements: keys per channel over `group` rows, group
// g = (row group, channel); values per row over `group` channels, g = (row, channel group).
struct GroupRange {
  int64_t r0, r1, c0, c1;  // rows [r0, r1) x channels [c0, c1)
};
KVD_QHD GroupRange RangeOf(bool keys, int64_t rows, int64_t d, int64_t group, int64_t g) {
  if (keys) {
    const int64_t r0 = (g / d) * group;
    return {r0, r0 + group < rows ? r0 + group : rows, g % d, g % d + 1};
  }
  const int64_t col_groups = (d + group - 1) / group, c0 = (g % col_groups) * group;
  return {g / col_groups, g / col_groups + 1, c0, c0 + group < d ? c0 + group : d};
}
KVD_QHD int64_t GroupIndex(bool keys, int64_t d, int64_t group, int64_t r, int64_t c) {
  return keys ? (r / group) * d + c : r * ((d + group - 1) / group) + c / group;
}

// Symmetric integer formats (b bits, half = 2^(b-1)): code q in [0, 2^b - 1] stands for
// (q - half + 1/2) * scale, the levels +-scale/2 ... +-(half - 1/2) scale (no zero level; rotated
// rows are near zero-mean, so no minimum is stored). Round to nearest: q = floor(x / scale) +
// half, clipped to the codes: |x - x'| <= scale / 2 for |x| <= half * scale; beyond, the
// outermost level.
KVD_QHD uint8_t SymCode(float x, float scale, int half) {
  if (!(scale > 0.0f)) return static_cast<uint8_t>(half);
  const float q = floorf(x / scale) + static_cast<float>(half);
  const float top = static_cast<float>(2 * half - 1);
  return static_cast<uint8_t>(q < 0.0f ? 0.0f : (q > top ? top : q));
}

KVD_QHD float SymValue(uint8_t code, float scale, int half) {
  return MulRn(static_cast<float>(code) - (static_cast<float>(half) - 0.5f), scale);
}

// Candidate k of a group whose largest |x| is absmax: the smallest float16 >= absmax (20 - k) /
// 20 / (half - 1/2) (k = 0: the outermost level covers the group). false when it is not finite.
KVD_QHD bool SymCandidate(float absmax, int k, int half, uint16_t* scale_bits) {
  const double step = static_cast<double>(absmax) * (20 - k) / 20.0 / (half - 0.5);
  float s = static_cast<float>(step);
  if (static_cast<double>(s) < step) s = nextafterf(s, INFINITY);
  const uint16_t sc = HalfRoundUp(s);
  if (!HalfFinite(sc)) return false;
  *scale_bits = sc;
  return true;
}

// The scale of a symmetric group (elements x[r * d + c], r in [r0, r1), c in [c0, c1)): among
// the kSymCandidates candidates, the one whose codes' squared error over the group (float32,
// fmaf in row-major order) is least, the first on ties. false when candidate 0 does not fit.
KVD_QHD bool SymGroupScale(const float* x, int64_t d, int64_t r0, int64_t r1, int64_t c0,
                           int64_t c1, float absmax, int half, uint16_t* scale_bits) {
  uint16_t best_bits = 0;
  if (!SymCandidate(absmax, 0, half, &best_bits)) return false;
  float best = INFINITY;
  uint16_t prev = 0xffffu;
  for (int k = 0; k < kSymCandidates; ++k) {
    uint16_t sc = 0;
    SymCandidate(absmax, k, half, &sc);  // no larger than candidate 0: finite
    if (sc == prev) continue;
    prev = sc;
    const float scale = HalfBitsToFloat(sc);
    float err = 0.0f;
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = c0; c < c1; ++c) {
        const float v = x[r * d + c];
        const float e = v - SymValue(SymCode(v, scale, half), scale, half);
        err = fmaf(e, e, err);
      }
    }
    if (err < best) best = err, best_bits = sc;
  }
  *scale_bits = best_bits;
  return true;
}

// The minimum, maximum and largest magnitude of a group's elements: started at its first
// element (absmax at 0), then every element added in the group's order (keys down the rows of
// their channel, values along their row), the first included.
struct GroupStats {
  float lo, hi, absmax;
};
KVD_QHD GroupStats StartStats(float first) { return {first, first, 0.0f}; }
KVD_QHD void AddToStats(GroupStats* s, float v) {
  s->lo = v < s->lo ? v : s->lo;
  s->hi = v > s->hi ? v : s->hi;
  s->absmax = fabsf(v) > s->absmax ? fabsf(v) : s->absmax;
}

// The parameters of a group of the codings that need only its statistics (asymmetric: the
// float16 minimum and scale; zero-anchored: the float16 scale and the zero code; fp8: the scale
// covering absmax), stored at `param`. false when a parameter does not fit float16.
KVD_QHD bool FitStats(Coding coding, int bits, GroupStats st, uint8_t* param) {
  uint16_t mn = 0, sc = 0;
  if (coding == Coding::kZeroAnchored) {
    uint8_t z = 0;
    if (!ZeroAnchoredParams(st.lo, st.hi, (1 << bits) - 1, &sc, &z)) return false;
    StoreHalf(param, sc);
    param[2] = z;
    return true;
  }
  if (coding == Coding::kFp8) {
    if (!Fp8GroupScale(st.absmax, &sc)) return false;
    StoreHalf(param, sc);
    return true;
  }
  if (!IntGroupParams(st.lo, st.hi, (1 << bits) - 1, &mn, &sc)) return false;
  StoreHalf(param, mn);
  StoreHalf(param + 2, sc);
  return true;
}

// The parameters of a group (elements as SymGroupScale's) stored at `param`: symmetric the
// least-error scale, the other codings FitStats's. false when a parameter does not fit float16.
KVD_QHD bool FitGroup(Coding coding, int bits, const float* x, int64_t d, int64_t r0, int64_t r1,
                      int64_t c0, int64_t c1, uint8_t* param) {
  GroupStats st = StartStats(x[r0 * d + c0]);
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t c = c0; c < c1; ++c) AddToStats(&st, x[r * d + c]);
  }
  if (coding != Coding::kSymmetric) return FitStats(coding, bits, st, param);
  uint16_t sc = 0;
  if (!SymGroupScale(x, d, r0, r1, c0, c1, st.absmax, 1 << (bits - 1), &sc)) return false;
  StoreHalf(param, sc);
  return true;
}

// A group's parameters as FitGroup stored them (min 0 where none is stored).
struct GroupParams {
  float min = 0.0f, scale = 0.0f;
};
KVD_QHD GroupParams LoadParams(Coding coding, int bits, const uint8_t* param) {
  if (coding == Coding::kZeroAnchored) {
    const float scale = HalfBitsToFloat(LoadHalf(param));
    return {ZeroAnchoredMin(param[2], (1 << bits) - 1, scale), scale};
  }
  if (coding != Coding::kAsymmetric) return {0.0f, HalfBitsToFloat(LoadHalf(param))};
  return {HalfBitsToFloat(LoadHalf(param)), HalfBitsToFloat(LoadHalf(param + 2))};
}

// One element's code and its dequantized value.
KVD_QHD uint8_t ElementCode(Coding coding, int bits, float x, GroupParams g) {
  switch (coding) {
    case Coding::kFp8:
      return Fp8Code(x, g.scale);
    case Coding::kSymmetric:
      return SymCode(x, g.scale, 1 << (bits - 1));
    default:
      return IntCode(x, g.min, g.scale, (1 << bits) - 1);
  }
}
KVD_QHD float ElementValue(Coding coding, int bits, uint8_t code, GroupParams g) {
  switch (coding) {
    case Coding::kFp8:
      return Fp8Value(code, g.scale);
    case Coding::kSymmetric:
      return SymValue(code, g.scale, 1 << (bits - 1));
    default:
      return IntValue(code, g.min, g.scale);
  }
}

// Codes of `bits` (8, 4, 3 or 2) packed into a row as a little-endian bit stream: element i takes
// bits [i * bits, (i + 1) * bits) counted from bit 0 of byte 0 (4 bits: element 2k in the low
// nibble of byte k, 2k+1 in the high nibble; 3 bits: an element may straddle two bytes). A row of
// d codes takes ceil(d * bits / 8) bytes; the bits after the last code are 0.
KVD_QHD uint8_t GetCode(const uint8_t* row, int64_t i, int bits) {
  if (bits == 8) return row[i];
  const int64_t bit = i * bits;
  const int shift = static_cast<int>(bit & 7);
  unsigned v = row[bit >> 3];
  if (shift + bits > 8) v |= static_cast<unsigned>(row[(bit >> 3) + 1]) << 8;
  return static_cast<uint8_t>((v >> shift) & ((1u << bits) - 1));
}

// Sets the code of element i in a row whose bits for it are still 0.
KVD_QHD void OrCode(uint8_t* row, int64_t i, int bits, uint8_t code) {
  if (bits == 8) {
    row[i] = code;
    return;
  }
  const int64_t bit = i * bits;
  const int shift = static_cast<int>(bit & 7);
  row[bit >> 3] = static_cast<uint8_t>(row[bit >> 3] | ((code << shift) & 0xffu));
  if (shift + bits > 8) {
    row[(bit >> 3) + 1] = static_cast<uint8_t>(row[(bit >> 3) + 1] | (code >> (8 - shift)));
  }
}

// The randomized Hadamard rotation R = H D / sqrt(d) of a row of d = 2^k floats (H the Sylvester
// Hadamard matrix, D = diag(s), s_i = +-1 the top bit of SplitMix64(kHadamardSeed + i)). R is
// orthogonal, R^-1 = D H / sqrt(d). Adds, subtractions, sign flips and one multiplication per
// element in a fixed order (no fused operations), so both backends agree bit for bit.
inline constexpr uint64_t kHadamardSeed = 0x6b76642d68616431ull;  // "kvd-had1"

KVD_QHD bool HadamardSignNegative(int i) {
  uint64_t z = kHadamardSeed + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(i + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return (z >> 63) != 0;
}

// The fast Walsh-Hadamard transform of x (unnormalized, in place; d a power of two).
KVD_QHD void WalshHadamard(float* x, int d) {
  for (int h = 1; h < d; h *= 2) {
    for (int i = 0; i < d; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
}

KVD_QHD float HadamardScale(int d) {
  return static_cast<float>(1.0 / sqrt(static_cast<double>(d)));
}

// x <- R x (forward) or R^-1 x. The inverse folds D into the scale: x (-s) is -(x s) exactly.
KVD_QHD void HadamardRotate(float* x, int d, bool inverse) {
  const float scale = HadamardScale(d);
  if (!inverse) {
    for (int i = 0; i < d; ++i) x[i] = HadamardSignNegative(i) ? -x[i] : x[i];
    WalshHadamard(x, d);
    for (int i = 0; i < d; ++i) x[i] = x[i] * scale;
    return;
  }
  WalshHadamard(x, d);
  for (int i = 0; i < d; ++i) x[i] = x[i] * (HadamardSignNegative(i) ? -scale : scale);
}

}  // namespace kvd::kernels::quant
