// WindowErrorModel (window_error.h): the window queries' exact attention output of one head and
// its change under token -> slot replacements, in float64.
#include "window_error.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

namespace kvd::kernels::internal {

StatusOr<WindowErrorModel> WindowErrorModel::Create(ConstMatrixView queries, ConstMatrixView keys,
                                                    ConstMatrixView values, int group_size) {
  if (group_size < 1 || queries.rows % group_size != 0 || queries.cols != keys.cols ||
      values.rows != keys.rows || values.cols != keys.cols) {
    return Status::InvalidArgument("window error model: shape mismatch");
  }
  const int64_t w = queries.rows / group_size;
  if (w > keys.rows) {
    return Status::InvalidArgument("window error model: window " + std::to_string(w) +
                                   " larger than the " + std::to_string(keys.rows) + " keys");
  }
  WindowErrorModel m;
  m.queries_ = queries;
  m.values_ = values;
  m.rows_ = queries.rows;
  m.n_ = keys.rows;
  m.d_ = keys.cols;
  m.scale_ = 1.0 / std::sqrt(static_cast<double>(m.d_));
  m.max_.assign(static_cast<size_t>(m.rows_), -std::numeric_limits<double>::infinity());
  m.z_.assign(static_cast<size_t>(m.rows_), 0.0);
  m.e_.assign(static_cast<size_t>(m.rows_ * m.n_), 0.0);
  m.out_.assign(static_cast<size_t>(m.rows_ * m.d_), 0.0);
  for (int64_t r = 0; r < m.rows_; ++r) {
    const int64_t visible = m.n_ - w + r / group_size + 1;  // tokens 0..N-W+w
    const float* q = queries.Row(r);
    double* e = m.e_.data() + r * m.n_;
    for (int64_t t = 0; t < visible; ++t) {
      const float* k = keys.Row(t);
      double dot = 0.0;
      for (int64_t c = 0; c < m.d_; ++c) dot += static_cast<double>(q[c]) * k[c];
      e[t] = dot * m.scale_;
      m.max_[r] = std::max(m.max_[r], e[t]);
    }
    double* o = m.out_.data() + r * m.d_;
    for (int64_t t = 0; t < visible; ++t) {
      e[t] = std::exp(e[t] - m.max_[r]);
      m.z_[r] += e[t];
      const float* v = values.Row(t);
      for (int64_t c = 0; c < m.d_; ++c) o[c] += e[t] * v[c];
    }
    for (int64_t c = 0; c < m.d_; ++c) o[c] /= m.z_[r];
  }
  return m;
}

double WindowErrorModel::Error(std::span<const int64_t> removed,
                               std::span<const ReplacementSlot> slots) const {
  std::vector<double> dn(static_cast<size_t>(d_));
  double total = 0.0;
  for (int64_t r = 0; r < rows_; ++r) {
    std::fill(dn.begin(), dn.end(), 0.0);
    double dz = 0.0;
    const float* q = queries_.Row(r);
    for (const ReplacementSlot& s : slots) {
      double dot = 0.0;
      for (int64_t c = 0; c < d_; ++c) dot += static_cast<double>(q[c]) * s.key_post[c];
      const double e = std::exp(dot * scale_ - max_[r]);
      dz += static_cast<double>(s.cardinality) * e;
      for (int64_t c = 0; c < d_; ++c) dn[c] += e * s.value_sum[c];
    }
    const double* er = e_.data() + r * n_;
    for (int64_t t : removed) {
      const double e = er[t];
      dz -= e;
      const float* v = values_.Row(t);
      for (int64_t c = 0; c < d_; ++c) dn[c] -= e * v[c];
    }
    const double* o = out_.data() + r * d_;
    const double den = z_[r] + dz;
    double sq = 0.0;
    for (int64_t c = 0; c < d_; ++c) {
      const double diff = (dn[c] - o[c] * dz) / den;
      sq += diff * diff;
    }
    total += sq;
  }
  return total;
}

}  // namespace kvd::kernels::internal
