// CPU attention mass: per query head, S[W, N] = (scale Q_g) K^T by a register-blocked kernel
// (keys transposed once into 16-key tiles; AVX-512: 8 queries x 16 keys per pass), then a masked
// softmax per row with a branch-free exp, accumulated into the per-key mass. One [W, N] buffer per
// call.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "backend_a.h"
#include "cpu/fast_math.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvd::kernels::cpu {
namespace {

constexpr int kKeyTile = 16;

// Keys re-laid out in tiles of 16 transposed rows: tile t holds kt[t][k][l] = K[16t + l][k]
// (zero for l past N), so one vector load gives one dimension of 16 keys. Built once per call
// and reused by every query head of the group.
std::vector<float> TransposeKeyTiles(ConstMatrixView keys) {
  const int64_t d = keys.cols, tiles = (keys.rows + kKeyTile - 1) / kKeyTile;
  std::vector<float> kt(static_cast<size_t>(tiles * d * kKeyTile), 0.0f);
  for (int64_t j = 0; j < keys.rows; ++j) {
    const float* row = keys.Row(j);
    float* tile = kt.data() + (j / kKeyTile) * d * kKeyTile + (j % kKeyTile);
    for (int64_t k = 0; k < d; ++k) tile[k * kKeyTile] = row[k];
  }
  return kt;
}

// s[w * lds + j] = q[w] . K[j] for w < num_q, j < n. q: [num_q, d] contiguous; kt from
// TransposeKeyTiles.
void QueryKeyScores(const float* q, int64_t num_q, int64_t d, const float* kt, int64_t n, float* s,
                    int64_t lds) {
  for (int64_t j0 = 0; j0 < n; j0 += kKeyTile) {
    const int64_t nj = std::min<int64_t>(kKeyTile, n - j0);
    const float* tile = kt + (j0 / kKeyTile) * d * kKeyTile;
    int64_t w0 = 0;
#if defined(__AVX512F__)
    // 8 queries x 16 keys in eight zmm accumulators: one load and eight broadcast-FMAs per dim.
    const __mmask16 store_mask = static_cast<__mmask16>((1u << nj) - 1u);
    for (; w0 + 8 <= num_q; w0 += 8) {
      __m512 acc[8];
      for (auto& a : acc) a = _mm512_setzero_ps();
      const float* q0 = q + w0 * d;
      for (int64_t k = 0; k < d; ++k) {
        const __m512 kv = _mm512_loadu_ps(tile + k * kKeyTile);
        for (int r = 0; r < 8; ++r) {
          acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q0[r * d + k]), kv, acc[r]);
        }
      }
      for (int r = 0; r < 8; ++r) {
        _mm512_mask_storeu_ps(s + (w0 + r) * lds + j0, store_mask, acc[r]);
      }
    }
#endif
    for (; w0 < num_q; ++w0) {
      float acc[kKeyTile] = {};
      const float* qr = q + w0 * d;
      for (int64_t k = 0; k < d; ++k) {
        const float* ktr = tile + k * kKeyTile;
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
  const float scale =
      options.scale > 0.0f ? options.scale : 1.0f / std::sqrt(static_cast<float>(d));
  const float* bias = head.key_bias.empty() ? nullptr : head.key_bias.data();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  std::vector<float> q(static_cast<size_t>(w_count * d));
  std::vector<float> scores(static_cast<size_t>(w_count * n));
  std::vector<float> group_mass(static_cast<size_t>(n));
  std::vector<double> total(static_cast<size_t>(n), 0.0);
  const std::vector<float> kt = TransposeKeyTiles(keys);
  for (int64_t g = 0; g < g_count; ++g) {
    for (int64_t w = 0; w < w_count; ++w) {
      const float* src = head.queries.Row(w * g_count + g);
      for (int64_t k = 0; k < d; ++k) q[static_cast<size_t>(w * d + k)] = src[k] * scale;
    }
    QueryKeyScores(q.data(), w_count, d, kt.data(), n, scores.data(), n);
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
