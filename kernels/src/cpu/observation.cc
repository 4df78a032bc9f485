// CPU attention mass: per query head, S[W, N] = (scale Q_g) K^T by a register-blocked kernel
// (16-key tiles transposed once, 4 queries per pass), then a masked softmax per row with a
// branch-free exp, accumulated into the per-key mass. One [W, N] buffer per call.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "backend_a.h"
#include "cpu/fast_math.h"

namespace kvd::kernels::cpu {
namespace {

constexpr int kKeyTile = 16;
constexpr int kQueryBlock = 4;

// s[w * lds + j] = q[w] . keys[j] for w < num_q, j < N. q: [num_q, d] contiguous.
void QueryKeyScores(const float* q, int64_t num_q, int64_t d, ConstMatrixView keys, float* s,
                    int64_t lds) {
  std::vector<float> kt_buf(static_cast<size_t>(d * kKeyTile));
  float* __restrict kt = kt_buf.data();
  for (int64_t j0 = 0; j0 < keys.rows; j0 += kKeyTile) {
    const int64_t nj = std::min<int64_t>(kKeyTile, keys.rows - j0);
    for (int64_t l = 0; l < kKeyTile; ++l) {
      if (l < nj) {
        const float* row = keys.Row(j0 + l);
        for (int64_t k = 0; k < d; ++k) kt[k * kKeyTile + l] = row[k];
      } else {
        for (int64_t k = 0; k < d; ++k) kt[k * kKeyTile + l] = 0.0f;
      }
    }
    int64_t w0 = 0;
    for (; w0 + kQueryBlock <= num_q; w0 += kQueryBlock) {
      float acc[kQueryBlock][kKeyTile] = {};
      const float* q0 = q + w0 * d;
      for (int64_t k = 0; k < d; ++k) {
        const float* ktr = kt + k * kKeyTile;
        const float a0 = q0[k], a1 = q0[d + k], a2 = q0[2 * d + k], a3 = q0[3 * d + k];
        for (int l = 0; l < kKeyTile; ++l) {
          acc[0][l] += a0 * ktr[l];
          acc[1][l] += a1 * ktr[l];
          acc[2][l] += a2 * ktr[l];
          acc[3][l] += a3 * ktr[l];
        }
      }
      for (int r = 0; r < kQueryBlock; ++r) {
        float* out = s + (w0 + r) * lds + j0;
        for (int64_t l = 0; l < nj; ++l) out[l] = acc[r][l];
      }
    }
    for (; w0 < num_q; ++w0) {
      float acc[kKeyTile] = {};
      const float* qr = q + w0 * d;
      for (int64_t k = 0; k < d; ++k) {
        const float* ktr = kt + k * kKeyTile;
        for (int l = 0; l < kKeyTile; ++l) acc[l] += qr[k] * ktr[l];
      }
      float* out = s + w0 * lds + j0;
      for (int64_t l = 0; l < nj; ++l) out[l] = acc[l];
    }
  }
}

}  // namespace

void AttentionMass(const ObservationHead& head, const ObservationOptions& options, float* mass) {
  const ConstMatrixView& keys = head.keys;
  const int64_t n = keys.rows, d = keys.cols, g_count = options.group_size;
  const int64_t w_count = head.queries.rows / g_count;
  const float scale = options.scale > 0.0f ? options.scale : 1.0f / std::sqrt(static_cast<float>(d));
  const float* bias = head.key_bias.empty() ? nullptr : head.key_bias.data();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  std::vector<float> q(static_cast<size_t>(w_count * d));
  std::vector<float> scores(static_cast<size_t>(w_count * n));
  std::vector<float> group_mass(static_cast<size_t>(n));
  std::vector<double> total(static_cast<size_t>(n), 0.0);
  for (int64_t g = 0; g < g_count; ++g) {
    for (int64_t w = 0; w < w_count; ++w) {
      const float* src = head.queries.Row(w * g_count + g);
      for (int64_t k = 0; k < d; ++k) q[static_cast<size_t>(w * d + k)] = src[k] * scale;
    }
    QueryKeyScores(q.data(), w_count, d, keys, scores.data(), n);
    std::fill(group_mass.begin(), group_mass.end(), 0.0f);
    float* __restrict gm = group_mass.data();
    for (int64_t w = 0; w < w_count; ++w) {
      float* __restrict row = scores.data() + w * n;
      int64_t visible = n;
      if (options.mask == MaskKind::kCausalWindow) visible = n - w_count + w + 1;
      if (bias != nullptr) {
        for (int64_t j = 0; j < visible; ++j) row[j] += bias[j];
      }
      if (options.mask == MaskKind::kByPosition) {
        const int64_t qp = head.query_positions[static_cast<size_t>(w)];
        const int64_t* kp = head.key_positions.data();
        for (int64_t j = 0; j < n; ++j) row[j] = kp[j] <= qp ? row[j] : kNegInf;
      }
      const float mx = LaneMax(row, visible);
      if (!(mx > -1e38f)) continue;  // this query sees no key (all masked)
      for (int64_t j = 0; j < visible; ++j) row[j] = FastExpNonPositive(row[j] - mx);
      const float sum = LaneSum(row, visible);
      const float inv = 1.0f / sum;
      for (int64_t j = 0; j < visible; ++j) gm[j] += row[j] * inv;
    }
    for (int64_t j = 0; j < n; ++j) total[static_cast<size_t>(j)] += gm[j];
  }
  for (int64_t j = 0; j < n; ++j) mass[j] = static_cast<float>(total[static_cast<size_t>(j)]);
}

}  // namespace kvd::kernels::cpu
