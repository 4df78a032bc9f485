// CPU serving ops: dense expansion (row copies) and the reference slot attention.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "serving_backend.h"

namespace kvd::kernels::cpu {

void ExpandDense(ConstMatrixView keys, ConstMatrixView values, const int64_t* offsets,
                 MatrixView keys_out, MatrixView values_out) {
  const size_t row_bytes = static_cast<size_t>(keys.cols) * sizeof(float);
  for (int64_t j = 0; j < keys.rows; ++j) {
    for (int64_t t = offsets[j]; t < offsets[j + 1]; ++t) {
      std::memcpy(keys_out.Row(t), keys.Row(j), row_bytes);
      std::memcpy(values_out.Row(t), values.Row(j), row_bytes);
    }
  }
}

void SlotAttention(ConstMatrixView queries, ConstMatrixView keys, ConstMatrixView values,
                   const float* bias, float scale, MatrixView out) {
  const int64_t s = keys.rows;
  const int64_t d = keys.cols;
  std::vector<float> logits(static_cast<size_t>(s));
  std::vector<double> acc(static_cast<size_t>(d));
  for (int64_t q = 0; q < queries.rows; ++q) {
    const float* qv = queries.Row(q);
    float max_logit = -INFINITY;
    for (int64_t j = 0; j < s; ++j) {
      const float* k = keys.Row(j);
      float dot = 0.0f;
      for (int64_t c = 0; c < d; ++c) dot += qv[c] * k[c];
      logits[j] = dot * scale + (bias != nullptr ? bias[j] : 0.0f);
      max_logit = std::max(max_logit, logits[j]);
    }
    std::fill(acc.begin(), acc.end(), 0.0);
    double denom = 0.0;
    for (int64_t j = 0; j < s; ++j) {
      const double p = std::exp(static_cast<double>(logits[j] - max_logit));
      denom += p;
      const float* v = values.Row(j);
      for (int64_t c = 0; c < d; ++c) acc[c] += p * v[c];
    }
    float* o = out.Row(q);
    for (int64_t c = 0; c < d; ++c) o[c] = s > 0 ? static_cast<float>(acc[c] / denom) : 0.0f;
  }
}

}  // namespace kvd::kernels::cpu
