// The quantize stage (quantize.h, docs/algorithms.md 6): the CPU kernel against a float64
// reference of the same rules, the error bounds argued from the format and group, the recent
// window, the errors, the composed plan and serving of a quantized chunk, and the CUDA twin
// against the CPU kernel bit for bit (skipped without a device).
#include "kvd/kernels/quantize.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "kvd/kernels/plan.h"
#include "kvd/kernels/rope.h"
#include "kvd/kernels/serving.h"
#include "reference.h"

namespace kvd::kernels {
namespace {

using ::testing::HasSubstr;
using testing::RandomCorrelatedKeys;
using testing::RandomMatrix;

// ---- float64 reference (the rules of quantize.h, written independently of the kernel) ----

// float16 grid spacing at |x| (normal: 2^(e - 10); subnormal: 2^-24).
double HalfUlp(double x) {
  const double a = std::fabs(x);
  if (a < std::ldexp(1.0, -14)) return std::ldexp(1.0, -24);
  return std::ldexp(1.0, static_cast<int>(std::floor(std::log2(a))) - 10);
}
double HalfDown(double x) {
  const double u = HalfUlp(x);
  double r = std::floor(x / u) * u;
  if (r > x) r -= u;
  return r;
}
double HalfUp(double x) {
  if (x <= 0.0) return -HalfDown(-x);
  const double u = HalfUlp(x);
  double r = std::ceil(x / u) * u;
  if (r < x) r += u;
  return r;
}

struct RefGroup {
  double min = 0, scale = 0;  // fp8: scale only
};

RefGroup RefIntGroup(const std::vector<double>& xs, int qmax) {
  double lo = xs[0], hi = xs[0];
  for (double x : xs) lo = std::min(lo, x), hi = std::max(hi, x);
  RefGroup g;
  g.min = HalfDown(lo);
  g.scale = HalfUp((hi - g.min) / qmax);
  return g;
}

double RefFp8Scale(const std::vector<double>& xs) {
  double m = 0;
  for (double x : xs) m = std::max(m, std::fabs(x));
  return HalfUp(m / 448.0);
}

// Nearest e4m3 value of y (ties to even), saturating at 448; `tie` set when y is within 2^-20
// relative of a midpoint (where float32 arithmetic may round either way).
double RefE4M3(double y, bool* tie) {
  const double a = std::min(std::fabs(y), 448.0);
  int e = a > 0 ? static_cast<int>(std::floor(std::log2(a))) : -6;
  e = std::max(e, -6);
  const double spacing = std::ldexp(1.0, e - 3);
  const double q = a / spacing;
  *tie = std::fabs(q - std::floor(q) - 0.5) < 1e-5;
  return std::copysign(std::nearbyint(q) * spacing, y);
}

// The rows of a matrix split into the groups of `keys` (per channel over `group` rows) or values
// (per row over `group` channels), as (row, col) lists.
std::vector<std::vector<std::pair<int64_t, int64_t>>> Groups(int64_t rows, int64_t d, int group,
                                                             bool keys) {
  std::vector<std::vector<std::pair<int64_t, int64_t>>> out;
  if (keys) {
    for (int64_t r0 = 0; r0 < rows; r0 += group) {
      for (int64_t c = 0; c < d; ++c) {
        out.emplace_back();
        for (int64_t r = r0; r < std::min<int64_t>(rows, r0 + group); ++r)
          out.back().push_back({r, c});
      }
    }
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c0 = 0; c0 < d; c0 += group) {
        out.emplace_back();
        for (int64_t c = c0; c < std::min<int64_t>(d, c0 + group); ++c)
          out.back().push_back({r, c});
      }
    }
  }
  return out;
}

// Rounds every element to bfloat16 (what a chunk stores) so that recent rows round-trip exactly.
Matrix Bf16(Matrix m) {
  for (float& x : m.values) x = BFloat16ToFloat(FloatToBFloat16(x));
  return m;
}

StatusOr<Matrix> RoundTrip(const Matrix& x, const QuantDescription& q, bool keys,
                           DType dtype = DType::kBFloat16, const ExecOptions& exec = {}) {
  std::vector<uint8_t> bytes(QuantizedRowsBytes(x.rows, static_cast<int>(x.cols), dtype, q, keys));
  KVD_RETURN_IF_ERROR(QuantizeRows(x.View(), dtype, q, keys, bytes, exec));
  Matrix out(x.rows, x.cols);
  KVD_RETURN_IF_ERROR(DequantizeRows(bytes, dtype, q, keys, out.View(), exec));
  return out;
}

struct Shape {
  int64_t rows;
  int d;
  int group;
};
const Shape kShapes[] = {{1, 64, 64},  {5, 64, 64}, {100, 64, 64}, {256, 64, 64},
                         {100, 64, 7}, {33, 7, 4},  {64, 64, 1},   {40, 64, 256}};

// The inputs: correlated keys with per-channel offsets, plain normal values, an offset far from
// zero (the float16 minimum's rounding matters there), and a group with constant elements.
std::vector<Matrix> Inputs(int64_t rows, int d, uint64_t seed) {
  std::vector<Matrix> out;
  out.push_back(Bf16(RandomCorrelatedKeys(rows, d, seed, 0.3f)));
  out.push_back(Bf16(RandomMatrix(rows, d, seed + 1, 2.0f, 0.5f)));
  out.push_back(Bf16(RandomMatrix(rows, d, seed + 2, 3.0f, -300.0f)));
  Matrix constant(rows, d);
  for (float& x : constant.values) x = 1.5f;
  out.push_back(constant);
  return out;
}

// Integer formats: each dequantized element equals the float64 reference's min + q * scale
// (within float32 rounding; at a rounding tie q may differ by one), and is within scale / 2 of
// the input, scale being at most the reference's: (max - min) / qmax widened by the float16
// minimum's rounding (<= one float16 ulp of the minimum) and rounded up to float16 (<= 2^-10).
int RefQmax(QuantFormat f) {
  switch (f) {
    case QuantFormat::kInt4:
    case QuantFormat::kInt4Zero:
      return 15;
    case QuantFormat::kInt3:
    case QuantFormat::kInt3Zero:
      return 7;
    case QuantFormat::kInt2:
    case QuantFormat::kInt2Zero:
      return 3;
    default:
      return 255;
  }
}

// Every shape of kShapes, keys and values, every input of Inputs(seed): x, its round trip through
// format f (groups of the shape's size), its groups and a name for messages.
template <typename Check>
void ForEachRoundTrip(QuantFormat f, uint64_t seed, Check check) {
  for (const Shape& s : kShapes) {
    for (const bool keys : {true, false}) {
      const QuantDescription q{.format = f,
                               .key_group = static_cast<uint32_t>(s.group),
                               .value_group = static_cast<uint32_t>(s.group)};
      int case_index = 0;
      for (const Matrix& x : Inputs(s.rows, s.d, seed + s.rows)) {
        const std::string where = std::string(QuantFormatName(f)) + (keys ? " keys" : " values") +
                                  " rows " + std::to_string(s.rows) + " d " + std::to_string(s.d) +
                                  " group " + std::to_string(s.group) + " input " +
                                  std::to_string(case_index++);
        auto y = RoundTrip(x, q, keys);
        ASSERT_TRUE(y.ok()) << where << ": " << y.status();
        check(x, *y, Groups(s.rows, s.d, s.group, keys), where);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

using GroupList = std::vector<std::vector<std::pair<int64_t, int64_t>>>;

TEST(QuantizeTest, IntFormatsMatchTheFloat64ReferenceWithinHalfAScale) {
  for (const QuantFormat f :
       {QuantFormat::kInt8, QuantFormat::kInt4, QuantFormat::kInt3, QuantFormat::kInt2}) {
    const int qmax = RefQmax(f);
    ForEachRoundTrip(
        f, 17,
        [&](const Matrix& x, const Matrix& y, const GroupList& groups, const std::string& where) {
          for (const auto& group : groups) {
            std::vector<double> xs;
            for (auto [r, c] : group) xs.push_back(x.Row(r)[c]);
            const RefGroup g = RefIntGroup(xs, qmax);
            double lo = xs[0], hi = xs[0];
            for (double v : xs) lo = std::min(lo, v), hi = std::max(hi, v);
            const double bound_scale =
                ((hi - lo) + HalfUlp(lo)) / qmax * (1 + std::ldexp(1.0, -10)) +
                std::ldexp(1.0, -24);
            ASSERT_LE(g.scale, bound_scale) << where;
            for (auto [r, c] : group) {
              const double xv = x.Row(r)[c], yv = y.Row(r)[c];
              const double t = g.scale > 0 ? (xv - g.min) / g.scale : 0.0;
              const double qr = std::clamp(std::nearbyint(t), 0.0, static_cast<double>(qmax));
              const double ref = g.min + qr * g.scale;
              const double fp = std::ldexp(1.0, -23) * (std::fabs(ref) + std::fabs(g.min));
              const bool tie = std::fabs(t - std::floor(t) - 0.5) < 1e-5;
              if (!tie) {
                ASSERT_LE(std::fabs(yv - ref), fp) << where << " at " << r << "," << c;
              }
              ASSERT_LE(std::fabs(yv - xv), g.scale / 2 * (1 + 1e-5) + fp)
                  << where << " at " << r << "," << c;
            }
          }
        });
  }
}

// Zero-anchored integer formats: the asymmetric grid with min = -z Q s / 255, z in [0, 255], for
// the group widened to hold 0 (a' = min(a, 0), b' = max(b, 0)): s = HalfUp((b' - a') / Q * 255 /
// 254), z the smallest code with min <= a'. Each dequantized element is min + q s of that grid (z
// may be one more or less where float32 and float64 disagree on min <= a', within 2^-20 of a'),
// and within s / 2 of the input.
struct RefZero {
  int qmax = 0;
  double Min(int z, double s) const { return -static_cast<double>(z) * qmax * s / 255.0; }
  double Scale(double a, double b) const {
    return HalfUp((std::max(b, 0.0) - std::min(a, 0.0)) / qmax * 255.0 / 254.0);
  }
  int Zero(double a, double s) const {
    int z = 0;
    while (z < 255 && Min(z, s) > std::min(a, 0.0)) ++z;
    return z;
  }
  double Value(double x, double mn, double s) const {
    if (!(s > 0)) return mn;
    return mn + std::clamp(std::nearbyint((x - mn) / s), 0.0, static_cast<double>(qmax)) * s;
  }
};

TEST(QuantizeTest, ZeroAnchoredFormatsMatchTheFloat64ReferenceWithinHalfAScale) {
  for (const QuantFormat f : {QuantFormat::kInt8Zero, QuantFormat::kInt4Zero,
                              QuantFormat::kInt3Zero, QuantFormat::kInt2Zero}) {
    const RefZero ref{RefQmax(f)};
    ForEachRoundTrip(
        f, 29,
        [&](const Matrix& x, const Matrix& y, const GroupList& groups, const std::string& where) {
          for (const auto& group : groups) {
            double lo = x.Row(group[0].first)[group[0].second], hi = lo;
            for (auto [r, c] : group)
              lo = std::min<double>(lo, x.Row(r)[c]), hi = std::max<double>(hi, x.Row(r)[c]);
            const double s = ref.Scale(lo, hi);
            ASSERT_LE(s, (std::max(hi, 0.0) - std::min(lo, 0.0)) / ref.qmax * 255 / 254 *
                                 (1 + std::ldexp(1.0, -10)) +
                             std::ldexp(1.0, -24))
                << where;
            const int z = ref.Zero(lo, s);
            const double a = std::min(lo, 0.0), slack = std::ldexp(1.0, -20) * (std::fabs(a) + s);
            const bool z_tie = std::fabs(ref.Min(z, s) - a) <= slack ||
                               (z > 0 && std::fabs(ref.Min(z - 1, s) - a) <= slack);
            for (auto [r, c] : group) {
              const double xv = x.Row(r)[c], yv = y.Row(r)[c];
              const double fp = std::ldexp(1.0, -22) * (std::fabs(xv) + ref.qmax * s);
              bool on_grid = false;
              for (int dz = z_tie ? -1 : 0; dz <= (z_tie ? 1 : 0) && !on_grid; ++dz) {
                if (z + dz < 0 || z + dz > 255) continue;
                const double mn = ref.Min(z + dz, s);
                const double t = s > 0 ? (xv - mn) / s : 0.0;
                const bool tie = std::fabs(t - std::floor(t) - 0.5) < 1e-5;
                on_grid = std::fabs(yv - ref.Value(xv, mn, s)) <= fp ||
                          (tie && std::fabs(std::fabs(yv - ref.Value(xv, mn, s)) - s) <= fp);
              }
              ASSERT_TRUE(on_grid) << where << " at " << r << "," << c << ": " << xv << " -> " << yv
                                   << ", scale " << s << ", zero code " << z;
              ASSERT_LE(std::fabs(yv - xv), s / 2 * (1 + 1e-5) + fp)
                  << where << " at " << r << "," << c;
            }
          }
        });
  }
}

// What the zero code buys and what it costs: a group of 64 value channels stores 3 bytes of
// parameters instead of 4 (int4: 35 bytes a slot instead of 36) and, since a value row holds 0,
// errs about as int4 does (its scale is wider by 255 / 254, about 1% more squared error); a key
// channel with an offset far from 0 pays the offset in its scale.
TEST(QuantizeTest, ZeroAnchoredValuesSaveAByteAGroupAtAboutInt4sError) {
  const QuantDescription i4{.format = QuantFormat::kInt4, .key_group = 64, .value_group = 64};
  QuantDescription z4 = i4;
  z4.format = QuantFormat::kInt4Zero;
  EXPECT_EQ(QuantizedRowsBytes(256, 64, DType::kBFloat16, i4, false), 256u * (32 + 4));
  EXPECT_EQ(QuantizedRowsBytes(256, 64, DType::kBFloat16, z4, false), 256u * (32 + 3));
  EXPECT_EQ(QuantizedRowsBytes(256, 64, DType::kBFloat16, z4, true), 256u * 32 + 4 * 64 * 3);
  const auto sse = [](const Matrix& x, const QuantDescription& q, bool keys) {
    auto y = RoundTrip(x, q, keys);
    EXPECT_TRUE(y.ok()) << y.status();
    double e = 0;
    for (size_t i = 0; i < x.values.size(); ++i)
      e += (y->values[i] - x.values[i]) * (y->values[i] - x.values[i]);
    return e;
  };
  const Matrix values = Bf16(RandomMatrix(256, 64, 43));
  const double ratio = sse(values, z4, false) / sse(values, i4, false);
  EXPECT_GT(ratio, 0.98);
  EXPECT_LT(ratio, 1.03);
  const Matrix offset = Bf16(RandomMatrix(256, 64, 47, 1.0f, 20.0f));
  EXPECT_GT(sse(offset, z4, true), 10 * sse(offset, i4, true));
}

// Symmetric integer formats (b bits, half = 2^(b-1)): levels (q + 1/2) s for q in [-half,
// half - 1], s the float16 scale among the candidates HalfUp(absmax (20 - k) / 20 / (half - 1/2)),
// k = 0..11, whose float64 squared error over the group is least (the first on ties; where two
// candidates are within 1e-4 of each other float32 may pick either, and only the error is
// compared). Each element is the reference's level (ties at a level boundary aside); inside the
// range (|x| <= half s) it errs by at most s / 2, beyond it takes the outermost level.
struct RefSym {
  int half = 0;
  double Level(double x, double s) const {
    if (!(s > 0)) return 0.0;
    const double q = std::clamp(std::floor(x / s), static_cast<double>(-half), half - 1.0);
    return (q + 0.5) * s;
  }
  double Sse(const std::vector<double>& xs, double s) const {
    double e = 0;
    for (double x : xs) e += (x - Level(x, s)) * (x - Level(x, s));
    return e;
  }
  // The least-error candidate scale of the group, its error and the next least error of another
  // scale.
  void Best(const std::vector<double>& xs, double* scale, double* best, double* runner_up) const {
    double absmax = 0;
    for (double x : xs) absmax = std::max(absmax, std::fabs(x));
    *runner_up = INFINITY;
    for (int k = 0; k < 12; ++k) {
      const double sk = HalfUp(absmax * (20 - k) / 20.0 / (half - 0.5));
      const double e = Sse(xs, sk);
      if (k == 0 || e < *best) {
        if (k > 0 && sk != *scale) *runner_up = std::min(*runner_up, *best);
        *best = e, *scale = sk;
      } else if (sk != *scale) {
        *runner_up = std::min(*runner_up, e);
      }
    }
  }
};

int SymHalf(QuantFormat f) {
  return f == QuantFormat::kInt4Sym ? 8 : f == QuantFormat::kInt3Sym ? 4 : 2;
}

TEST(QuantizeTest, SymmetricFormatsMatchTheFloat64ReferenceWithinHalfAScale) {
  for (const QuantFormat f :
       {QuantFormat::kInt4Sym, QuantFormat::kInt3Sym, QuantFormat::kInt2Sym}) {
    const RefSym ref{SymHalf(f)};
    ForEachRoundTrip(
        f, 23,
        [&](const Matrix& x, const Matrix& y, const GroupList& groups, const std::string& where) {
          for (const auto& group : groups) {
            std::vector<double> xs, ys;
            for (auto [r, c] : group) xs.push_back(x.Row(r)[c]), ys.push_back(y.Row(r)[c]);
            double s = 0, best = 0, runner_up = 0;
            ref.Best(xs, &s, &best, &runner_up);
            double got = 0;
            for (size_t i = 0; i < xs.size(); ++i) got += (ys[i] - xs[i]) * (ys[i] - xs[i]);
            ASSERT_LE(got, best * (1 + 1e-4) + 1e-12) << where;
            if (runner_up - best <= 1e-4 * best) continue;  // either scale is a valid choice
            for (size_t i = 0; i < xs.size(); ++i) {
              const double t = s > 0 ? xs[i] / s : 0.0;
              const bool tie = std::fabs(t - std::nearbyint(t)) < 1e-5;
              const double fp = std::ldexp(1.0, -22) * (std::fabs(xs[i]) + s);
              if (!tie) {
                ASSERT_LE(std::fabs(ys[i] - ref.Level(xs[i], s)), fp) << where;
              }
              if (std::fabs(xs[i]) <= ref.half * s) {
                ASSERT_LE(std::fabs(ys[i] - xs[i]), s / 2 * (1 + 1e-5) + fp) << where;
              } else {
                ASSERT_EQ(ys[i], std::copysign((ref.half - 0.5) * s, xs[i])) << where;
              }
            }
          }
        });
  }
}

// The point of the symmetric formats: rotated rows are near zero-mean, so one scale (2 bytes)
// serves where the asymmetric formats store a minimum too (4 bytes), and the least-squares scale
// clips the tails: on normal rows int2s errs less than int2 in fewer bytes.
TEST(QuantizeTest, SymmetricTwoBitsErrLessThanAsymmetricOnRotatedRows) {
  const Matrix x = Bf16(RandomMatrix(256, 64, 41));
  double err[2] = {0, 0};
  int i = 0;
  for (const QuantFormat f : {QuantFormat::kInt2, QuantFormat::kInt2Sym}) {
    const QuantDescription q{
        .format = f, .key_group = 256, .value_group = 64, .rotation = QuantRotation::kHadamard};
    auto y = RoundTrip(x, q, false);
    ASSERT_TRUE(y.ok()) << y.status();
    for (size_t e = 0; e < x.values.size(); ++e) {
      err[i] += (y->values[e] - x.values[e]) * (y->values[e] - x.values[e]);
    }
    ++i;
  }
  EXPECT_LT(err[1], err[0] * 0.9);
}

// fp8 e4m3: each element equals the float64 reference's e4m3(x / scale) * scale (ties aside), and
// errs by at most 2^-4 |x| (3 mantissa bits, round to nearest) or, among the subnormals, half their
// spacing 2^-9 times the scale.
TEST(QuantizeTest, Fp8MatchesTheFloat64ReferenceWithinItsRelativeError) {
  for (const Shape& s : kShapes) {
    for (const bool keys : {true, false}) {
      const QuantDescription q{.format = QuantFormat::kFp8E4M3,
                               .key_group = static_cast<uint32_t>(s.group),
                               .value_group = static_cast<uint32_t>(s.group)};
      for (const Matrix& x : Inputs(s.rows, s.d, 91 + s.rows)) {
        auto y = RoundTrip(x, q, keys);
        ASSERT_TRUE(y.ok()) << y.status();
        for (const auto& group : Groups(s.rows, s.d, s.group, keys)) {
          std::vector<double> xs;
          for (auto [r, c] : group) xs.push_back(x.Row(r)[c]);
          const double scale = RefFp8Scale(xs);
          for (auto [r, c] : group) {
            const double xv = x.Row(r)[c], yv = y->Row(r)[c];
            bool tie = false;
            const double ref = scale > 0 ? RefE4M3(xv / scale, &tie) * scale : 0.0;
            const double fp = std::ldexp(1.0, -22) * std::fabs(xv);
            if (!tie) ASSERT_LE(std::fabs(yv - ref), fp) << r << "," << c;
            ASSERT_LE(
                std::fabs(yv - xv),
                std::max(std::ldexp(1.0, -4) * std::fabs(xv), std::ldexp(1.0, -10) * scale) + fp)
                << "rows " << s.rows << " group " << s.group << " at " << r << "," << c;
          }
        }
      }
    }
  }
}

// The documented rotation in float64: y = H D x / sqrt(d), s_i = +-1 from the top bit of
// SplitMix64(seed + (i + 1) * golden), written here from the description in quantize.h.
std::vector<double> RefHadamard(const float* x, int d) {
  std::vector<double> y(x, x + d);
  for (int i = 0; i < d; ++i) {
    uint64_t z = 0x6b76642d68616431ull + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(i + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    if (z >> 63) y[i] = -y[i];
  }
  std::vector<double> out(d, 0.0);
  for (int r = 0; r < d; ++r) {  // H[r][c] = (-1)^popcount(r & c)
    for (int c = 0; c < d; ++c) out[r] += (__builtin_popcount(r & c) & 1 ? -1.0 : 1.0) * y[c];
    out[r] /= std::sqrt(static_cast<double>(d));
  }
  return out;
}

// Rotated integer formats. The codes hold the rotated rows: read back without the rotation they
// are within half a scale of the float64 rotation (the scale the float64 reference derives from
// its rotated group, widened by one float16 ulp: the kernel rotates in float32, within 2^-20
// relative of it, which may move the float16 minimum or scale by one step). Read back with it,
// the row errs by the inverse rotation of that error, an orthogonal map: its L2 norm is at most
// sqrt(sum (scale / 2)^2), plus float32 rounding of the two transforms (log2 d adds each).
TEST(QuantizeTest, HadamardRotationMatchesTheFloat64Reference) {
  for (const QuantFormat f :
       {QuantFormat::kInt8, QuantFormat::kInt4, QuantFormat::kInt3, QuantFormat::kInt2}) {
    const int qmax = RefQmax(f);
    for (const Shape& s : {Shape{100, 64, 64}, Shape{33, 64, 8}, Shape{64, 128, 32}, Shape{5, 8, 2},
                           Shape{17, 1, 4}}) {
      for (const bool keys : {true, false}) {
        QuantDescription q{.format = f,
                           .key_group = static_cast<uint32_t>(s.group),
                           .value_group = static_cast<uint32_t>(s.group),
                           .rotation = QuantRotation::kHadamard};
        QuantDescription plain = q;
        plain.rotation = QuantRotation::kNone;
        for (const Matrix& x : Inputs(s.rows, s.d, 300 + s.rows)) {
          const std::string where = std::string(QuantFormatName(f)) + (keys ? " keys" : " values") +
                                    " rows " + std::to_string(s.rows) + " d " +
                                    std::to_string(s.d) + " group " + std::to_string(s.group);
          std::vector<uint8_t> bytes(QuantizedRowsBytes(x.rows, s.d, DType::kBFloat16, q, keys));
          ASSERT_EQ(bytes.size(), QuantizedRowsBytes(x.rows, s.d, DType::kBFloat16, plain, keys));
          ASSERT_TRUE(QuantizeRows(x.View(), DType::kBFloat16, q, keys, bytes).ok()) << where;
          Matrix rotated(x.rows, s.d), back(x.rows, s.d);
          ASSERT_TRUE(DequantizeRows(bytes, DType::kBFloat16, plain, keys, rotated.View()).ok());
          ASSERT_TRUE(DequantizeRows(bytes, DType::kBFloat16, q, keys, back.View()).ok());
          Matrix y(x.rows, s.d);  // the float64 rotation, for the groups' ranges
          std::vector<std::vector<double>> yd;
          double largest = 0;
          for (int64_t r = 0; r < x.rows; ++r) {
            yd.push_back(RefHadamard(x.Row(r), s.d));
            for (double v : yd.back()) largest = std::max(largest, std::fabs(v));
          }
          std::vector<double> row_err2(x.rows, 0.0);
          for (const auto& group : Groups(s.rows, s.d, s.group, keys)) {
            std::vector<double> ys;
            for (auto [r, c] : group) ys.push_back(yd[r][c]);
            const RefGroup g = RefIntGroup(ys, qmax);
            const double scale = g.scale + HalfUlp(g.scale) + std::ldexp(1.0, -20) * largest;
            for (auto [r, c] : group) {
              const double err = std::fabs(rotated.Row(r)[c] - yd[r][c]);
              ASSERT_LE(err, scale / 2 * (1 + 1e-5) + HalfUlp(g.min) + 1e-5 * largest)
                  << where << " at " << r << "," << c;
              row_err2[r] += (scale / 2) * (scale / 2);
            }
          }
          for (int64_t r = 0; r < x.rows; ++r) {
            double norm2 = 0;
            for (int c = 0; c < s.d; ++c) {
              const double e = back.Row(r)[c] - x.Row(r)[c];
              norm2 += e * e;
            }
            ASSERT_LE(std::sqrt(norm2), std::sqrt(row_err2[r]) * (1 + 1e-5) + 1e-5 * largest)
                << where << " row " << r;
          }
        }
      }
    }
  }
}

TEST(QuantizeTest, HadamardRotationNeedsAPowerOfTwoHeadDim) {
  const QuantDescription q{.format = QuantFormat::kInt4,
                           .key_group = 4,
                           .value_group = 4,
                           .rotation = QuantRotation::kHadamard};
  const Matrix x = RandomMatrix(5, 96, 3);
  std::vector<uint8_t> out(QuantizedRowsBytes(5, 96, DType::kFloat32, q, true));
  const Status s = QuantizeRows(x.View(), DType::kFloat32, q, true, out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("power-of-two head_dim, got 96"));
  Matrix y(5, 96);
  EXPECT_THAT(DequantizeRows(out, DType::kFloat32, q, true, y.View()).message(),
              HasSubstr("power-of-two head_dim, got 96"));
}

// Keys and values in different formats: each part takes its own format's bytes and error.
TEST(QuantizeTest, ValuesMayTakeAnotherFormat) {
  const QuantDescription q{.format = QuantFormat::kInt4,
                           .key_group = 32,
                           .value_group = 32,
                           .value_format = QuantFormat::kInt2};
  EXPECT_EQ(QuantizedRowsBytes(64, 64, DType::kBFloat16, q, true), 64u * 32 + 2 * 64 * 4);
  EXPECT_EQ(QuantizedRowsBytes(64, 64, DType::kBFloat16, q, false), 64u * 16 + 64 * 2 * 4);
  const Matrix x = Bf16(RandomMatrix(64, 64, 9));
  auto k = RoundTrip(x, q, true);
  auto v = RoundTrip(x, q, false);
  QuantDescription i2 = q;
  i2.format = QuantFormat::kInt2;
  i2.value_format = QuantFormat::kNone;
  auto v2 = RoundTrip(x, i2, false);
  ASSERT_TRUE(k.ok() && v.ok() && v2.ok());
  EXPECT_EQ(v->values, v2->values);  // the values exactly as int2 alone
}

TEST(QuantizeTest, RecentRowsAreStoredExactlyAndTheRestQuantized) {
  const Matrix x = Bf16(RandomCorrelatedKeys(100, 64, 5));
  for (const bool keys : {true, false}) {
    for (const uint32_t recent : {0u, 1u, 36u, 100u, 500u}) {
      const QuantDescription q{
          .format = QuantFormat::kInt4, .key_group = 64, .value_group = 64, .recent = recent};
      auto y = RoundTrip(x, q, keys);
      ASSERT_TRUE(y.ok()) << y.status();
      const int64_t quantized = std::max<int64_t>(0, 100 - static_cast<int64_t>(recent));
      int64_t exact_rows = 0;
      for (int64_t r = 0; r < 100; ++r) {
        const bool exact = std::equal(x.Row(r), x.Row(r) + 64, y->Row(r));
        if (r >= quantized) {
          ASSERT_TRUE(exact) << "recent row " << r << " recent " << recent;
        }
        exact_rows += exact;
      }
      // A 4-bit row of 64 random-walk elements is never reproduced exactly.
      EXPECT_EQ(exact_rows, 100 - quantized) << "recent " << recent;
    }
  }
}

// The sink rows are stored exactly, first, and left out of every group: the bytes after them are
// those of the other rows quantized alone (then the recent rows).
TEST(QuantizeTest, SinkRowsAreStoredExactlyFirstAndOutOfTheGroups) {
  Matrix x = Bf16(RandomCorrelatedKeys(100, 64, 6));
  for (int c = 0; c < 64; ++c) x.Row(0)[c] *= 32.0f;  // a sink whose range no group should take
  for (const bool keys : {true, false}) {
    for (const uint32_t recent : {0u, 8u}) {
      const QuantDescription plain{.format = QuantFormat::kInt4,
                                   .key_group = 64,
                                   .value_group = 64,
                                   .recent = recent,
                                   .rotation = QuantRotation::kHadamard,
                                   .value_format = QuantFormat::kInt2Sym};
      QuantDescription sinks = plain;
      sinks.sinks = 4;
      std::vector<uint8_t> with(QuantizedRowsBytes(100, 64, DType::kBFloat16, sinks, keys));
      ASSERT_TRUE(QuantizeRows(x.View(), DType::kBFloat16, sinks, keys, with).ok());
      Matrix rest(96, 64);
      for (int64_t r = 0; r < 96; ++r) std::copy(x.Row(r + 4), x.Row(r + 4) + 64, rest.Row(r));
      std::vector<uint8_t> alone(QuantizedRowsBytes(96, 64, DType::kBFloat16, plain, keys));
      ASSERT_TRUE(QuantizeRows(rest.View(), DType::kBFloat16, plain, keys, alone).ok());
      ASSERT_EQ(with.size(), alone.size() + 4 * 128);
      std::vector<uint8_t> head(4 * 128);
      ConvertFromFloat(DType::kBFloat16, x.values.data(), head.data(), 4 * 64);
      EXPECT_TRUE(std::equal(head.begin(), head.end(), with.begin()));
      EXPECT_TRUE(std::equal(alone.begin(), alone.end(), with.begin() + 4 * 128));
      Matrix y(100, 64);
      ASSERT_TRUE(DequantizeRows(with, DType::kBFloat16, sinks, keys, y.View()).ok());
      for (int64_t r = 0; r < 100; ++r) {
        const bool exact = std::equal(x.Row(r), x.Row(r) + 64, y.Row(r));
        EXPECT_EQ(exact, r < 4 || r >= 100 - recent) << "row " << r << " recent " << recent;
      }
    }
  }
  // Fewer rows than sinks and recent: the sink rows first, then what is left is recent.
  const QuantDescription both{
      .format = QuantFormat::kInt8, .key_group = 64, .value_group = 64, .recent = 3, .sinks = 4};
  EXPECT_EQ(QuantizedRowsBytes(5, 64, DType::kBFloat16, both, true), 5u * 128);
  EXPECT_EQ(QuantizedRowsBytes(2, 64, DType::kBFloat16, both, false), 2u * 128);
  EXPECT_EQ(QuantizedRowsBytes(10, 64, DType::kBFloat16, both, false), 7u * 128 + 3 * 68);
  auto y = RoundTrip(Matrix(x), both, true);
  ASSERT_TRUE(y.ok()) << y.status();
}

TEST(QuantizeTest, RowsBytesFollowTheFormat) {
  const QuantDescription i4{.format = QuantFormat::kInt4, .key_group = 64, .value_group = 64};
  const QuantDescription i8{.format = QuantFormat::kInt8, .key_group = 64, .value_group = 64};
  const QuantDescription f8{.format = QuantFormat::kFp8E4M3, .key_group = 64, .value_group = 64};
  // 256 slots, d 64, bfloat16: 32768 raw bytes.
  EXPECT_EQ(QuantizedRowsBytes(256, 64, DType::kBFloat16, {}, true), 32768u);
  EXPECT_EQ(QuantizedRowsBytes(256, 64, DType::kBFloat16, i4, true), 256u * 32 + 4 * 64 * 4);
  EXPECT_EQ(QuantizedRowsBytes(256, 64, DType::kBFloat16, i4, false), 256u * 32 + 256 * 4);
  EXPECT_EQ(QuantizedRowsBytes(256, 64, DType::kBFloat16, i8, true), 256u * 64 + 4 * 64 * 4);
  EXPECT_EQ(QuantizedRowsBytes(256, 64, DType::kBFloat16, f8, false), 256u * 64 + 256 * 2);
  // A partial last key group has its own scales; recent rows are bfloat16.
  QuantDescription r = i4;
  r.recent = 32;
  EXPECT_EQ(QuantizedRowsBytes(100, 64, DType::kBFloat16, r, true),
            68u * 32 + 2 * 64 * 4 + 32 * 128);
  EXPECT_EQ(QuantizedRowsBytes(10, 64, DType::kBFloat16, r, false), 10u * 128);
  EXPECT_EQ(QuantizedRowsBytes(0, 64, DType::kBFloat16, r, false), 0u);
  // Odd d in 4 bits: rows end in a spare nibble.
  EXPECT_EQ(QuantizedRowsBytes(3, 7, DType::kFloat32, i4, false), 3u * 4 + 3 * 4);
  // 3 and 2 bits: ceil(d * bits / 8) bytes a row, the same float16 min and scale a group.
  const QuantDescription i3{.format = QuantFormat::kInt3, .key_group = 64, .value_group = 64};
  const QuantDescription i2{.format = QuantFormat::kInt2, .key_group = 64, .value_group = 64};
  EXPECT_EQ(QuantizedRowsBytes(256, 64, DType::kBFloat16, i3, true), 256u * 24 + 4 * 64 * 4);
  EXPECT_EQ(QuantizedRowsBytes(256, 64, DType::kBFloat16, i2, false), 256u * 16 + 256 * 4);
  EXPECT_EQ(QuantizedRowsBytes(3, 7, DType::kFloat32, i3, false), 3u * 3 + 3 * 4);
  EXPECT_EQ(QuantizedRowsBytes(3, 7, DType::kFloat32, i2, false), 3u * 2 + 3 * 4);
  // Symmetric: one float16 scale a group.
  const QuantDescription s4{.format = QuantFormat::kInt4Sym, .key_group = 256, .value_group = 64};
  const QuantDescription s2{.format = QuantFormat::kInt2Sym, .key_group = 256, .value_group = 64};
  const QuantDescription s3{.format = QuantFormat::kInt3Sym, .key_group = 64, .value_group = 64};
  EXPECT_EQ(QuantizedRowsBytes(256, 64, DType::kBFloat16, s4, true), 256u * 32 + 64 * 2);
  EXPECT_EQ(QuantizedRowsBytes(256, 64, DType::kBFloat16, s2, false), 256u * 16 + 256 * 2);
  EXPECT_EQ(QuantizedRowsBytes(3, 7, DType::kFloat32, s3, false), 3u * 3 + 3 * 2);
  // int4 keys over 256 slots, int2s values over 64 channels: 51 bytes a slot of 256 raw.
  const QuantDescription front{.format = QuantFormat::kInt4,
                               .key_group = 256,
                               .value_group = 64,
                               .value_format = QuantFormat::kInt2Sym};
  EXPECT_EQ(QuantizedRowsBytes(256, 64, DType::kBFloat16, front, true) +
                QuantizedRowsBytes(256, 64, DType::kBFloat16, front, false),
            256u * 51);
}

TEST(QuantizeTest, RefusesWhatItCannotQuantize) {
  const QuantDescription i8{.format = QuantFormat::kInt8, .key_group = 64, .value_group = 64};
  Matrix big(4, 8);
  for (float& x : big.values) x = 1.0f;
  big.Row(2)[3] = -1e6f;  // beyond float16: no minimum for its group
  std::vector<uint8_t> out(QuantizedRowsBytes(4, 8, DType::kFloat32, i8, false));
  Status s = QuantizeRows(big.View(), DType::kFloat32, i8, false, out);
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange) << s;
  EXPECT_THAT(s.message(), HasSubstr("group 2 of the values"));
  const QuantDescription f8{.format = QuantFormat::kFp8E4M3, .key_group = 2, .value_group = 8};
  big.Row(2)[3] = 1e8f;
  out.assign(QuantizedRowsBytes(4, 8, DType::kFloat32, f8, true), 0);
  s = QuantizeRows(big.View(), DType::kFloat32, f8, true, out);
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange) << s;
  EXPECT_THAT(s.message(), HasSubstr("group 11 of the keys"));  // row group 1, channel 3

  big.Row(0)[0] = std::nanf("");
  EXPECT_EQ(QuantizeRows(big.View(), DType::kFloat32, f8, true, out).code(),
            StatusCode::kInvalidArgument);
  out.resize(out.size() - 1);
  EXPECT_EQ(QuantizeRows(big.View(), DType::kFloat32, f8, true, out).code(),
            StatusCode::kInvalidArgument);

  EXPECT_THAT(
      ValidateQuantize({.format = QuantFormat::kInt8, .key_group = 0, .value_group = 4}).message(),
      HasSubstr("key_group 0"));
  EXPECT_EQ(ValidateQuantize({}).code(), StatusCode::kInvalidArgument);
  CompressionPlanOptions o;
  o.quant = {.format = QuantFormat::kInt4, .key_group = 64, .value_group = 70000};
  EXPECT_THAT(o.Validate().message(), HasSubstr("value_group 70000"));
  o.quant = {.format = QuantFormat::kNone, .recent = 3};
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
}

// ---- the stage in the plan, the format and serving ----

ModelLayout SmallLayout() {
  return {.num_layers = 2,
          .num_kv_heads = 2,
          .num_q_heads = 4,
          .head_dim = 64,
          .dtype = DType::kBFloat16,
          .rope = {.theta = 10000.0}};
}

// The bytes of `c` (EncodeCompactChunk) and their format version; they decode back to `c`.
std::pair<std::vector<uint8_t>, uint16_t> Encoded(const CompactChunk& c) {
  auto bytes = EncodeCompactChunk(c);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  if (!bytes.ok()) return {};
  uint16_t version;
  std::memcpy(&version, bytes->data() + 4, 2);
  auto back = DecodeCompactChunk(*bytes);
  EXPECT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back.ok() && *back == c) << "version " << version;
  return {*std::move(bytes), version};
}

struct PlanInput {
  ModelLayout layout = SmallLayout();
  static constexpr int kTokens = 256;
  std::vector<int64_t> positions = testing::SequentialPositions(kTokens);
  std::vector<uint8_t> raw;
  PlanInput() {
    const int d = layout.head_dim;
    const size_t e = DTypeSize(layout.dtype), tb = layout.TokenBytes();
    raw.assign(layout.ChunkBytes(kTokens), 0);
    for (int l = 0; l < layout.num_layers; ++l) {
      for (int h = 0; h < layout.num_kv_heads; ++h) {
        const Matrix k = RandomCorrelatedKeys(kTokens, d, 70 + 2 * l + h);
        const Matrix v = RandomMatrix(kTokens, d, 90 + 2 * l + h);
        uint8_t* kb = raw.data() + layout.LayerOffset(l, kTokens);
        for (int i = 0; i < kTokens; ++i) {
          ConvertFromFloat(layout.dtype, k.Row(i), kb + i * tb + h * d * e, d);
          ConvertFromFloat(layout.dtype, v.Row(i), kb + (kTokens + i) * tb + h * d * e, d);
        }
      }
    }
  }
  CompressionInput Input() const { return {.raw = raw, .positions = positions}; }
};

// KeyDiff at p_c 0.5, then rotated int4 keys over the whole chunk and int2s values.
CompressionPlanOptions KeyDiffThenRotatedInt4Int2s() {
  CompressionPlanOptions o;
  o.score = ScoreStage::kKeyDiff;
  o.p_c = 0.5;
  o.quant = {.format = QuantFormat::kInt4,
             .key_group = 256,
             .value_group = 64,
             .rotation = QuantRotation::kHadamard,
             .value_format = QuantFormat::kInt2Sym};
  return o;
}

// [keydiff, quantize]: the same slots as keydiff alone, keys and values within the format's
// error of keydiff's, the chunk written as version 3 and read back equal, stored bytes as
// QuantizedRowsBytes says; serving (compact and dense) dequantizes.
TEST(QuantizeTest, ComposesWithTheScoreStageAndServes) {
  const PlanInput in;
  CompressionPlanOptions base;
  base.score = ScoreStage::kKeyDiff;
  base.p_c = 0.5;
  CompressionPlanOptions quant = base;
  quant.quant = {.format = QuantFormat::kInt8, .key_group = 64, .value_group = 64, .recent = 16};
  auto plain = Compress(base, in.layout, in.Input());
  ASSERT_TRUE(plain.ok()) << plain.status();
  auto q = Compress(quant, in.layout, in.Input());
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->codec.quant, quant.quant);
  EXPECT_EQ(q->HalfPairs(), plain->HalfPairs());

  const auto [bytes, version] = Encoded(*q);
  EXPECT_EQ(version, 3);
  const auto [plain_bytes, plain_version] = Encoded(*plain);
  EXPECT_EQ(plain_version, 2);  // unquantized chunks keep the version 2 bytes
  size_t data = 0;
  for (const CompactHead& h : q->heads) {
    EXPECT_EQ(h.positions, plain->heads[&h - q->heads.data()].positions);
    data += QuantizedRowsBytes(h.slots(), 64, DType::kBFloat16, q->codec.quant, true) +
            QuantizedRowsBytes(h.value_slots(), 64, DType::kBFloat16, q->codec.quant, false);
  }
  // 128 slots of which 16 recent: (112 * 64 + 2 * 64 * 4 + 16 * 128) bytes of keys and the same
  // for values (112 * (64 + 4) + 16 * 128), against 2 * 128 * 128 unquantized.
  EXPECT_EQ(data, 4u * ((112 * 64 + 2 * 64 * 4 + 16 * 128) + (112 * 68 + 16 * 128)));
  EXPECT_LT(bytes.size(), plain_bytes.size() * 0.6);

  int64_t tokens_q = 0, tokens_plain = 0;
  auto dense_q = ExpandDenseChunk(*q, nullptr, nullptr, &tokens_q);
  auto dense_plain = ExpandDenseChunk(*plain, nullptr, nullptr, &tokens_plain);
  ASSERT_TRUE(dense_q.ok()) << dense_q.status();
  ASSERT_TRUE(dense_plain.ok());
  EXPECT_EQ(tokens_q, tokens_plain);
  auto dequantized = DequantizeChunk(*q);
  ASSERT_TRUE(dequantized.ok()) << dequantized.status();
  EXPECT_FALSE(dequantized->codec.quant.quantized());
  for (int l = 0; l < 2; ++l) {
    for (int h = 0; h < 2; ++h) {
      auto sq = BuildServingHead(*q, l, h, nullptr, nullptr);
      auto sp = BuildServingHead(*plain, l, h, nullptr, nullptr);
      auto sd = BuildServingHead(*dequantized, l, h, nullptr, nullptr);
      ASSERT_TRUE(sq.ok()) << sq.status();
      ASSERT_TRUE(sp.ok() && sd.ok());
      // A group spans at most 2 max|x| of its head, so round to nearest errs by at most
      // max|x| / 255 (and the float16 scale's rounding).
      for (const bool keys : {true, false}) {
        const std::vector<float>& a = keys ? sq->keys.values : sq->values.values;
        const std::vector<float>& b = keys ? sp->keys.values : sp->values.values;
        double worst = 0, largest = 0;
        for (size_t i = 0; i < a.size(); ++i) {
          worst = std::max<double>(worst, std::fabs(a[i] - b[i]));
          largest = std::max<double>(largest, std::fabs(b[i]));
        }
        EXPECT_GT(worst, 0.0);
        EXPECT_LE(worst, largest / 255 * 1.01) << (keys ? "keys" : "values");
      }
      for (size_t i = 0; i < sq->keys.values.size(); ++i) {
        // DequantizeChunk = BuildServingHead's float32 dequantization rounded to bfloat16.
        ASSERT_EQ(sd->keys.values[i], BFloat16ToFloat(FloatToBFloat16(sq->keys.values[i])));
        ASSERT_EQ(sd->values.values[i], BFloat16ToFloat(FloatToBFloat16(sq->values.values[i])));
      }
    }
  }
  // Quantizing a quantized chunk is refused.
  EXPECT_EQ(QuantizeChunk(*q, quant.quant).status().code(), StatusCode::kInvalidArgument);
}

// quant.sinks: the chunk holding the sequence's first tokens keeps their rows (its first rows,
// keys and values) exact, records how many, and is written as version 5 and read back equal; a
// chunk after them records 0 and is the plain quantized chunk, version 4; more quant sinks than
// the plan keeps are refused.
TEST(QuantizeTest, TheSequencesSinkRowsStayExactInTheChunkHoldingThem) {
  PlanInput in;
  CompressionPlanOptions o = KeyDiffThenRotatedInt4Int2s();
  o.quant.sinks = 4;
  CompressionPlanOptions plain = o;
  plain.quant = {};
  auto exact = Compress(plain, in.layout, in.Input());
  auto first = Compress(o, in.layout, in.Input());
  ASSERT_TRUE(exact.ok() && first.ok()) << first.status();
  EXPECT_EQ(first->codec.quant.sinks, 4u);
  const size_t row = static_cast<size_t>(in.layout.head_dim) * DTypeSize(in.layout.dtype);
  for (size_t i = 0; i < first->heads.size(); ++i) {
    const CompactHead& q = first->heads[i];
    const CompactHead& e = exact->heads[i];
    ASSERT_EQ(q.positions, e.positions);
    EXPECT_TRUE(std::equal(e.keys.begin(), e.keys.begin() + 4 * row, q.keys.begin()));
    EXPECT_TRUE(std::equal(e.values.begin(), e.values.begin() + 4 * row, q.values.begin()));
  }
  EXPECT_EQ(Encoded(*first).second, 5);
  auto served = DequantizeChunk(*first);
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_TRUE(std::equal(exact->heads[0].keys.begin(), exact->heads[0].keys.begin() + 4 * row,
                         served->heads[0].keys.begin()));

  for (int64_t& p : in.positions) p += 256;  // the sequence's second chunk
  auto later = Compress(o, in.layout, in.Input());
  ASSERT_TRUE(later.ok()) << later.status();
  EXPECT_EQ(later->codec.quant.sinks, 0u);
  EXPECT_EQ(Encoded(*later).second, 4);

  o.sinks = 2;
  const Status refused = Compress(o, in.layout, in.Input()).status();
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("quant_sinks (quant.sinks) 4 exceeds sinks 2"));
}

// Rotated int4 keys and int2s values after keydiff: written as version 4 and read back equal;
// serving (compact and dense) dequantizes to what DequantizeChunk gives.
TEST(QuantizeTest, SymmetricValuesRoundTripTheChunkAndServe) {
  const PlanInput in;
  CompressionPlanOptions o = KeyDiffThenRotatedInt4Int2s();
  o.quant.recent = 4;
  auto q = Compress(o, in.layout, in.Input());
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(Encoded(*q).second, 4);
  auto dequantized = DequantizeChunk(*q);
  ASSERT_TRUE(dequantized.ok()) << dequantized.status();
  int64_t tokens = 0, tokens_d = 0;
  auto dense = ExpandDenseChunk(*q, nullptr, nullptr, &tokens);
  auto dense_d = ExpandDenseChunk(*dequantized, nullptr, nullptr, &tokens_d);
  ASSERT_TRUE(dense.ok()) << dense.status();
  ASSERT_TRUE(dense_d.ok()) << dense_d.status();
  EXPECT_EQ(tokens, tokens_d);
  EXPECT_EQ(*dense, *dense_d);
  for (int l = 0; l < 2; ++l) {
    for (int h = 0; h < 2; ++h) {
      auto sq = BuildServingHead(*q, l, h, nullptr, nullptr);
      auto sd = BuildServingHead(*dequantized, l, h, nullptr, nullptr);
      ASSERT_TRUE(sq.ok() && sd.ok()) << sq.status();
      for (size_t i = 0; i < sq->values.values.size(); ++i) {
        ASSERT_EQ(sd->values.values[i], BFloat16ToFloat(FloatToBFloat16(sq->values.values[i])));
      }
    }
  }
}

// ---- the CUDA twin ----

TEST(QuantizeCuda, MatchesTheCpuKernelBitForBit) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const ExecOptions cuda{.backend = Backend::kCuda};
  for (const QuantFormat f : QuantFormats()) {
    for (const Shape& s : kShapes) {
      for (const bool keys : {true, false}) {
        for (const QuantRotation rot : {QuantRotation::kNone, QuantRotation::kHadamard}) {
          if (rot == QuantRotation::kHadamard && (s.d & (s.d - 1)) != 0) continue;
          const QuantDescription q{.format = f,
                                   .key_group = static_cast<uint32_t>(s.group),
                                   .value_group = static_cast<uint32_t>(s.group),
                                   .recent = s.rows > 10 ? 3u : 0u,
                                   .sinks = s.rows > 4 ? 2u : 0u,
                                   .rotation = rot};
          for (const Matrix& x : Inputs(s.rows, s.d, 7 + s.rows)) {
            const size_t n = QuantizedRowsBytes(x.rows, s.d, DType::kBFloat16, q, keys);
            std::vector<uint8_t> cpu(n), gpu(n, 0xAA);
            ASSERT_TRUE(QuantizeRows(x.View(), DType::kBFloat16, q, keys, cpu).ok());
            Status st = QuantizeRows(x.View(), DType::kBFloat16, q, keys, gpu, cuda);
            ASSERT_TRUE(st.ok()) << st;
            ASSERT_EQ(cpu, gpu) << QuantFormatName(f) << " rows " << s.rows << " group " << s.group
                                << (keys ? " keys" : " values") << " " << QuantRotationName(rot);
            Matrix a(x.rows, s.d), b(x.rows, s.d);
            ASSERT_TRUE(DequantizeRows(cpu, DType::kBFloat16, q, keys, a.View()).ok());
            ASSERT_TRUE(DequantizeRows(cpu, DType::kBFloat16, q, keys, b.View(), cuda).ok());
            ASSERT_EQ(a.values, b.values);
          }
        }
      }
    }
  }
  Matrix big(4, 8);
  big.Row(1)[5] = -1e6f;
  const QuantDescription i8{.format = QuantFormat::kInt8, .key_group = 64, .value_group = 4};
  std::vector<uint8_t> out(QuantizedRowsBytes(4, 8, DType::kFloat32, i8, false));
  Status s = QuantizeRows(big.View(), DType::kFloat32, i8, false, out, cuda);
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange) << s;
  EXPECT_THAT(s.message(), HasSubstr("group 3 of the values"));
}

TEST(QuantizeCuda, WithoutADeviceTheCudaBackendIsRefused) {
  if (CudaDeviceAvailable()) GTEST_SKIP() << "a CUDA device is present: QuantizeCuda runs";
  const QuantDescription i8{.format = QuantFormat::kInt8, .key_group = 4, .value_group = 4};
  Matrix x(4, 8);
  std::vector<uint8_t> out(QuantizedRowsBytes(4, 8, DType::kFloat32, i8, true));
  const Status s =
      QuantizeRows(x.View(), DType::kFloat32, i8, true, out, {.backend = Backend::kCuda});
  EXPECT_TRUE(s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kUnimplemented) << s;
}

}  // namespace
}  // namespace kvd::kernels
