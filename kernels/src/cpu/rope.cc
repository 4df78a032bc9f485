// CPU RoPE: the sin/cos of a row are computed once (float64 angle, float32 polynomial) and
// applied to every head; rows are split across threads in blocks.
#include <algorithm>
#include <vector>

#include "backend_a.h"
#include "cpu/fast_math.h"

namespace kvd::kernels::cpu {
namespace {
constexpr int64_t kRowsPerTask = 64;
}  // namespace

void ApplyRope(const RopeTable& table, RopeDirection direction, const int64_t* positions,
               std::span<const MatrixView> heads, int num_threads) {
  if (heads.empty()) return;
  const int64_t n = heads[0].rows;
  const int half = table.rotary_dim() / 2;
  const double* inv_freq = table.inv_freq().data();
  const float sign = direction == RopeDirection::kRotate ? 1.0f : -1.0f;
  const bool interleaved = table.pairing() == RopePairing::kInterleaved;
  const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
  ParallelFor(tasks, num_threads, [&](int64_t t) {
    std::vector<float> cos_buf(static_cast<size_t>(half)), sin_buf(static_cast<size_t>(half));
    float* __restrict c = cos_buf.data();
    float* __restrict s = sin_buf.data();
    const int64_t end = std::min(n, (t + 1) * kRowsPerTask);
    for (int64_t i = t * kRowsPerTask; i < end; ++i) {
      const double p = static_cast<double>(positions[i]);
      for (int k = 0; k < half; ++k) {
        float sv, cv;
        SinCosReduced(p * inv_freq[k], &sv, &cv);
        c[k] = cv;
        s[k] = sign * sv;
      }
      for (const MatrixView& head : heads) {
        float* __restrict x = head.Row(i);
        if (interleaved) {
          for (int k = 0; k < half; ++k) {
            const float a = x[2 * k], b = x[2 * k + 1];
            x[2 * k] = a * c[k] - b * s[k];
            x[2 * k + 1] = a * s[k] + b * c[k];
          }
        } else {
          float* __restrict y = x + half;
          for (int k = 0; k < half; ++k) {
            const float a = x[k], b = y[k];
            x[k] = a * c[k] - b * s[k];
            y[k] = a * s[k] + b * c[k];
          }
        }
      }
    }
  });
}

}  // namespace kvd::kernels::cpu
