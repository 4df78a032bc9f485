// Float64 reference implementations and random-input generators for the kernel tests.
// Shared by every tests/kernels/*_test.cc (part A and part B): keep it generic and stable.
// Everything is header-only, deterministic for a given seed, and written for clarity, not speed.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>
#include <random>
#include <span>
#include <vector>

#include "kvd/common/layout.h"
#include "kvd/kernels/types.h"

namespace kvd::kernels::testing {

// Row-major float64 matrix for references.
struct RefMatrix {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<double> v;
  RefMatrix() = default;
  RefMatrix(int64_t r, int64_t c) : rows(r), cols(c), v(static_cast<size_t>(r * c), 0.0) {}
  double& at(int64_t i, int64_t j) { return v[static_cast<size_t>(i * cols + j)]; }
  double at(int64_t i, int64_t j) const { return v[static_cast<size_t>(i * cols + j)]; }
  const double* Row(int64_t i) const { return v.data() + i * cols; }
};

inline RefMatrix ToRef(ConstMatrixView m) {
  RefMatrix r(m.rows, m.cols);
  for (int64_t i = 0; i < m.rows; ++i)
    for (int64_t j = 0; j < m.cols; ++j) r.at(i, j) = m.Row(i)[j];
  return r;
}

// ---- random inputs ----

// [rows, cols] of N(mean, stddev^2) float32, deterministic in `seed`.
inline Matrix RandomMatrix(int64_t rows, int64_t cols, uint64_t seed, float stddev = 1.0f,
                           float mean = 0.0f) {
  Matrix m(rows, cols);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(mean, stddev);
  for (float& x : m.values) x = dist(rng);
  return m;
}

// Keys whose adjacent rows are similar (a random walk plus noise), like real K caches.
inline Matrix RandomCorrelatedKeys(int64_t rows, int64_t cols, uint64_t seed, float step = 0.2f) {
  Matrix m(rows, cols);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> state(static_cast<size_t>(cols));
  for (float& s : state) s = dist(rng);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      state[static_cast<size_t>(j)] += step * dist(rng);
      m.Row(i)[j] = state[static_cast<size_t>(j)];
    }
  }
  return m;
}

// first, first+1, ..., first+n-1.
inline std::vector<int64_t> SequentialPositions(int64_t n, int64_t first = 0) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[static_cast<size_t>(i)] = first + i;
  return p;
}

// n strictly increasing positions starting at `first`, random gaps in [1, max_gap].
inline std::vector<int64_t> RandomIncreasingPositions(int64_t n, uint64_t seed, int64_t first = 0,
                                                      int64_t max_gap = 7) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> gap(1, max_gap);
  std::vector<int64_t> p(static_cast<size_t>(n));
  int64_t cur = first;
  for (auto& x : p) {
    x = cur;
    cur += gap(rng);
  }
  return p;
}

// ---- tolerances ----
// How the kernel tests bound float errors (docs/reliability.md, "Numerical tolerances in the
// tests"): a float32 result is compared with a float64 reference computed from the same float32
// inputs, so the difference is the kernel's own rounding. With unit roundoff u, an n-term sum
// computed in any order (BLAS kernels and the 16-lane reductions reorder it) is within
// n * u * sum|terms| of the exact sum (worst case); random rounding errors add up like a random
// walk, about sqrt(n) * u * sum|terms|. A tolerance is the worst-case bound where the test can
// compute it cheaply, else the typical one times a margin that a real bug (a wrong position,
// mask, weight or dropped term) still exceeds by orders of magnitude. Magnitudes that vary are
// handled by scaling with sum|terms| or the reference's largest magnitude, never by a fixed
// absolute number. None of these depends on which kernels OpenBLAS picks (OPENBLAS_CORETYPE).
inline constexpr double kF32Unit = 0x1p-24;  // float32 unit roundoff, 5.96e-8
inline constexpr double kF64Unit = 0x1p-53;  // float64 unit roundoff, 1.11e-16

// Worst-case rounding error of an n-term sum (or dot product) whose terms' magnitudes sum to
// `abs_sum`, accumulated in a type of unit roundoff `u`, plus the final rounding of the result.
inline double SumErrorBound(int64_t n, double abs_sum, double u = kF32Unit) {
  return (static_cast<double>(n) + 1.0) * u * abs_sum;
}

// ---- comparisons ----

inline double MaxAbsDiff(ConstMatrixView a, const RefMatrix& b) {
  double m = 0.0;
  for (int64_t i = 0; i < a.rows; ++i)
    for (int64_t j = 0; j < a.cols; ++j) m = std::max(m, std::fabs(a.Row(i)[j] - b.at(i, j)));
  return m;
}
inline double MaxAbsDiff(ConstMatrixView a, ConstMatrixView b) {
  double m = 0.0;
  for (int64_t i = 0; i < a.rows; ++i)
    for (int64_t j = 0; j < a.cols; ++j)
      m = std::max(m, std::fabs(double(a.Row(i)[j]) - b.Row(i)[j]));
  return m;
}
// max |a - b| / max |b|: the difference relative to the reference's scale (elementwise relative
// error is meaningless for outputs of sums that cancel).
inline double MaxRelDiff(ConstMatrixView a, const RefMatrix& b);
inline double MaxAbs(const RefMatrix& a) {
  double m = 0.0;
  for (double x : a.v) m = std::max(m, std::fabs(x));
  return m;
}
inline double MaxRelDiff(ConstMatrixView a, const RefMatrix& b) {
  return MaxAbsDiff(a, b) / std::max(MaxAbs(b), 1e-300);
}

// ---- RoPE (float64) ----

// Scaled inverse frequencies, written independently of RopeTable (HF _compute_llama3_parameters).
inline std::vector<double> RefInvFreq(const RopeConfig& c, int head_dim) {
  const int rd = c.rotary_dim == 0 ? head_dim : c.rotary_dim;
  std::vector<double> f(static_cast<size_t>(rd / 2));
  for (int i = 0; i < rd / 2; ++i) {
    double x = 1.0 / std::pow(c.theta, static_cast<double>(2 * i) / rd);
    if (c.scaling == RopeScaling::kLinear) x /= c.factor;
    if (c.scaling == RopeScaling::kLlama3) {
      const double wl = 2 * std::numbers::pi / x;
      const double low_wl = c.original_max_positions / c.low_freq_factor;
      const double high_wl = c.original_max_positions / c.high_freq_factor;
      if (wl > low_wl) {
        x = x / c.factor;
      } else if (!(wl < high_wl)) {
        const double smooth = (c.original_max_positions / wl - c.low_freq_factor) /
                              (c.high_freq_factor - c.low_freq_factor);
        x = (1 - smooth) * x / c.factor + smooth * x;
      }
    }
    f[static_cast<size_t>(i)] = x;
  }
  return f;
}

// Rotates (sign = +1) or de-rotates (sign = -1) every row i of `in` at positions[i].
inline RefMatrix RefRope(const RopeConfig& c, const RefMatrix& in,
                         std::span<const int64_t> positions, int sign) {
  const int d = static_cast<int>(in.cols);
  const int rd = c.rotary_dim == 0 ? d : c.rotary_dim;
  const std::vector<double> f = RefInvFreq(c, d);
  RefMatrix out = in;
  for (int64_t r = 0; r < in.rows; ++r) {
    for (int i = 0; i < rd / 2; ++i) {
      const double ang =
          sign * static_cast<double>(positions[static_cast<size_t>(r)]) * f[static_cast<size_t>(i)];
      const int ia = c.pairing == RopePairing::kInterleaved ? 2 * i : i;
      const int ib = c.pairing == RopePairing::kInterleaved ? 2 * i + 1 : i + rd / 2;
      const double a = in.at(r, ia), b = in.at(r, ib);
      out.at(r, ia) = a * std::cos(ang) - b * std::sin(ang);
      out.at(r, ib) = a * std::sin(ang) + b * std::cos(ang);
    }
  }
  return out;
}

// ---- attention (float64) ----

// Visibility of key j to window query w (W queries over N keys):
enum class RefMask { kNone, kCausalWindow, kByPosition };

// mass[j] = sum_{w,g} softmax_j(q.k_j * scale + bias_j) over visible keys.
// queries: [W*G, d] row w*G+g. scale 0 = 1/sqrt(d).
inline std::vector<double> RefAttentionMass(const RefMatrix& queries, int group_size,
                                            const RefMatrix& keys, std::span<const double> bias,
                                            RefMask mask,
                                            std::span<const int64_t> query_positions = {},
                                            std::span<const int64_t> key_positions = {},
                                            double scale = 0.0) {
  const int64_t n = keys.rows, d = keys.cols, wq = queries.rows / group_size;
  if (scale == 0.0) scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> mass(static_cast<size_t>(n), 0.0), s(static_cast<size_t>(n));
  for (int64_t w = 0; w < wq; ++w) {
    for (int g = 0; g < group_size; ++g) {
      const double* q = queries.Row(w * group_size + g);
      double mx = -std::numeric_limits<double>::infinity();
      std::vector<char> vis(static_cast<size_t>(n), 1);
      for (int64_t j = 0; j < n; ++j) {
        if (mask == RefMask::kCausalWindow) vis[static_cast<size_t>(j)] = j <= n - wq + w;
        if (mask == RefMask::kByPosition)
          vis[static_cast<size_t>(j)] =
              key_positions[static_cast<size_t>(j)] <= query_positions[static_cast<size_t>(w)];
        double dot = 0.0;
        for (int64_t c = 0; c < d; ++c) dot += q[c] * keys.at(j, c);
        s[static_cast<size_t>(j)] =
            dot * scale + (bias.empty() ? 0.0 : bias[static_cast<size_t>(j)]);
        if (vis[static_cast<size_t>(j)]) mx = std::max(mx, s[static_cast<size_t>(j)]);
      }
      if (!std::isfinite(mx)) continue;
      double sum = 0.0;
      for (int64_t j = 0; j < n; ++j)
        if (vis[static_cast<size_t>(j)]) sum += std::exp(s[static_cast<size_t>(j)] - mx);
      for (int64_t j = 0; j < n; ++j)
        if (vis[static_cast<size_t>(j)])
          mass[static_cast<size_t>(j)] += std::exp(s[static_cast<size_t>(j)] - mx) / sum;
    }
  }
  return mass;
}

// Attention output over compressed slots, compact form (docs/algorithms.md 1):
//   o = sum_j exp(s_j) Vsum_j / sum_j l_j exp(s_j),  s_j = q.k_j * scale.
inline std::vector<double> RefCompactAttention(std::span<const double> q, const RefMatrix& keys,
                                               const RefMatrix& value_sums,
                                               std::span<const double> cardinality,
                                               double scale = 0.0) {
  const int64_t n = keys.rows, d = keys.cols;
  if (scale == 0.0) scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> s(static_cast<size_t>(n));
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    double dot = 0.0;
    for (int64_t c = 0; c < d; ++c) dot += q[static_cast<size_t>(c)] * keys.at(j, c);
    s[static_cast<size_t>(j)] = dot * scale;
    mx = std::max(mx, s[static_cast<size_t>(j)]);
  }
  std::vector<double> out(static_cast<size_t>(value_sums.cols), 0.0);
  double den = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    const double e = std::exp(s[static_cast<size_t>(j)] - mx);
    den += cardinality[static_cast<size_t>(j)] * e;
    for (int64_t c = 0; c < value_sums.cols; ++c)
      out[static_cast<size_t>(c)] += e * value_sums.at(j, c);
  }
  for (double& x : out) x /= den;
  return out;
}

// Plain attention output softmax(q K^T * scale) V (every slot of cardinality 1).
inline std::vector<double> RefAttention(std::span<const double> q, const RefMatrix& keys,
                                        const RefMatrix& values, double scale = 0.0) {
  std::vector<double> ones(static_cast<size_t>(keys.rows), 1.0);
  return RefCompactAttention(q, keys, values, ones, scale);
}

// ---- KeyDiff (float64) ----

inline std::vector<double> RefKeyDiffScores(const RefMatrix& keys) {
  const int64_t n = keys.rows, d = keys.cols;
  std::vector<double> anchor(static_cast<size_t>(d), 0.0), norms(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    double ss = 0.0;
    for (int64_t c = 0; c < d; ++c) ss += keys.at(i, c) * keys.at(i, c);
    norms[static_cast<size_t>(i)] = std::sqrt(ss);
    for (int64_t c = 0; c < d; ++c)
      anchor[static_cast<size_t>(c)] += keys.at(i, c) / norms[static_cast<size_t>(i)];
  }
  double an = 0.0;
  for (double a : anchor) an += a * a;
  an = std::sqrt(an);
  std::vector<double> out(static_cast<size_t>(n), 0.0);
  if (an == 0.0) return out;
  for (int64_t i = 0; i < n; ++i) {
    double dot = 0.0;
    for (int64_t c = 0; c < d; ++c) dot += keys.at(i, c) * anchor[static_cast<size_t>(c)];
    out[static_cast<size_t>(i)] = -dot / (norms[static_cast<size_t>(i)] * an);
  }
  return out;
}

}  // namespace kvd::kernels::testing
