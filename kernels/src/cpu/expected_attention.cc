// CPU expected-attention scores (expected_attention.h): z_g(i) per query head, a softmax over the
// keys per head in float64, the mean over the group, times |v_i|.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/fast_math.h"
#include "expected_attention_backend.h"

namespace kvd::kernels::cpu {

void ExpectedAttentionScores(const ExpectedQueries& q, ConstMatrixView keys, ConstMatrixView values,
                             float* scores) {
  const int64_t n = keys.rows, d = keys.cols;
  const int G = q.group_size;
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<double> z(static_cast<size_t>(n));
  std::vector<double> acc(static_cast<size_t>(n), 0.0);
  std::vector<float> w(static_cast<size_t>(d));  // per-channel quadratic term, this key
  for (int g = 0; g < G; ++g) {
    const float* m = q.mean.data() + static_cast<size_t>(g) * d;
    const float* diag = q.diag.data() + static_cast<size_t>(g) * d;
    const float* cross = q.cross.data() + static_cast<size_t>(g) * d;
    double zmax = -INFINITY;
    for (int64_t i = 0; i < n; ++i) {
      const float* k = keys.Row(i);
      // z = sum_c k_c (m_c + (diag_c k_c + cross_c k_partner(c)) / (2 sqrt d)) / sqrt d
      for (int64_t c = 0; c < d; ++c) {
        w[c] = m[c] + (diag[c] * k[c] + cross[c] * k[q.partner[c]]) * (0.5f * inv_sqrt_d);
      }
      const double zi = static_cast<double>(LaneDot(k, w.data(), d)) * inv_sqrt_d;
      z[i] = zi;
      zmax = std::max(zmax, zi);
    }
    double total = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      z[i] = std::exp(z[i] - zmax);
      total += z[i];
    }
    for (int64_t i = 0; i < n; ++i) acc[i] += z[i] / total;
  }
  for (int64_t i = 0; i < n; ++i) {
    double s = acc[i] / G;
    if (values.rows != 0) {
      const float* v = values.Row(i);
      s *= std::sqrt(static_cast<double>(LaneDot(v, v, d)));
    }
    scores[i] = static_cast<float>(s);
  }
}

}  // namespace kvd::kernels::cpu
