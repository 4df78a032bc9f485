// CPU KeyDiff scores: norms, anchor (float64 accumulation), -cos to the anchor.
#include <cmath>
#include <vector>

#include "backend_a.h"
#include "cpu/fast_math.h"

namespace kvd::kernels::cpu {

bool KeyDiffScores(ConstMatrixView keys, float* scores, int64_t* bad_row) {
  const int64_t n = keys.rows, d = keys.cols;
  std::vector<float> inv_norm(static_cast<size_t>(n));
  std::vector<double> anchor(static_cast<size_t>(d), 0.0);
  // Unit keys are summed in float32 over blocks of kBlock rows (vectorised), then into float64.
  constexpr int64_t kBlock = 256;
  std::vector<float> partial(static_cast<size_t>(d), 0.0f);
  float* __restrict acc = partial.data();
  for (int64_t i = 0; i < n; ++i) {
    const float* k = keys.Row(i);
    const float ss = LaneDot(k, k, d);
    if (!(ss >= 1e-30f)) {
      *bad_row = i;
      return false;
    }
    const float inv = 1.0f / std::sqrt(ss);
    inv_norm[static_cast<size_t>(i)] = inv;
    for (int64_t c = 0; c < d; ++c) acc[c] += k[c] * inv;
    if ((i + 1) % kBlock == 0 || i + 1 == n) {
      for (int64_t c = 0; c < d; ++c) {
        anchor[static_cast<size_t>(c)] += acc[c];
        acc[c] = 0.0f;
      }
    }
  }
  double anorm = 0.0;
  for (double a : anchor) anorm += a * a;
  anorm = std::sqrt(anorm);
  if (!(anorm > 1e-6 * static_cast<double>(n))) {  // keys cancel: no preferred direction
    for (int64_t i = 0; i < n; ++i) scores[i] = 0.0f;
    return true;
  }
  std::vector<float> unit_anchor(static_cast<size_t>(d));
  for (int64_t c = 0; c < d; ++c) {
    unit_anchor[static_cast<size_t>(c)] =
        static_cast<float>(anchor[static_cast<size_t>(c)] / anorm);
  }
  const float* a = unit_anchor.data();
  for (int64_t i = 0; i < n; ++i) {
    const float* k = keys.Row(i);
    const float dot = LaneDot(k, a, d);
    scores[i] = -dot * inv_norm[static_cast<size_t>(i)];
  }
  return true;
}

}  // namespace kvd::kernels::cpu
