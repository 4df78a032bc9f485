// WindowErrorModel (window_error.h): the window queries' exact attention output of one head and
// its change under token -> slot replacements, in float64.
#include "window_error.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

namespace kvd::kernels::internal {
namespace {

// sum_c a[c] b[c] in float64 with 8 partial sums (vectorisable; a fixed order, so deterministic).
template <typename T>
double Dot(const float* a, const T* b, int64_t d) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t c = 0;
  for (; c + 8 <= d; c += 8) {
    for (int k = 0; k < 8; ++k) acc[k] += static_cast<double>(a[c + k]) * b[c + k];
  }
  double tail = 0.0;
  for (; c < d; ++c) tail += static_cast<double>(a[c]) * b[c];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
}

}  // namespace

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
      e[t] = Dot(q, keys.Row(t), m.d_) * m.scale_;
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

double WindowErrorModel::SlotWeight(int64_t r, const float* key_post) const {
  return std::exp(Dot(queries_.Row(r), key_post, d_) * scale_ - max_[r]);
}

void WindowErrorModel::Start(int64_t a, Group* g) const {
  g->removed_v.assign(static_cast<size_t>(rows_ * d_), 0.0);
  g->removed_z.assign(static_cast<size_t>(rows_), 0.0);
  g->slot_e.assign(static_cast<size_t>(rows_), 0.0);
  g->slot_v.assign(static_cast<size_t>(d_), 0.0);
  const float* v = values_.Row(a);
  for (int64_t c = 0; c < d_; ++c) g->slot_v[c] = v[c];
  g->cardinality = 1;
  for (int64_t r = 0; r < rows_; ++r) {
    const double e = e_[r * n_ + a];
    g->removed_z[r] = e;
    g->slot_e[r] = e;  // the slot is token a itself
    double* rv = g->removed_v.data() + r * d_;
    for (int64_t c = 0; c < d_; ++c) rv[c] = e * v[c];
  }
}

void WindowErrorModel::Compare(const Group& g, int64_t i, const ReplacementSlot& merged,
                               double* evict, double* merge) const {
  std::vector<double> base(static_cast<size_t>(d_));
  const float* vi = values_.Row(i);
  const double lg = static_cast<double>(g.cardinality);
  const double lm = static_cast<double>(merged.cardinality);
  // |dN - o dZ|^2 / (Z + dZ)^2 with dN = e V + base, dZ = l e + base_z; 4 partial sums.
  auto error = [&](const double* o, double e, const double* vsum, double dz, double den) {
    double sq[4] = {0, 0, 0, 0};
    int64_t c = 0;
    for (; c + 4 <= d_; c += 4) {
      for (int k = 0; k < 4; ++k) {
        const double diff = e * vsum[c + k] + base[c + k] - o[c + k] * dz;
        sq[k] += diff * diff;
      }
    }
    for (; c < d_; ++c) {
      const double diff = e * vsum[c] + base[c] - o[c] * dz;
      sq[0] += diff * diff;
    }
    return ((sq[0] + sq[1]) + (sq[2] + sq[3])) / (den * den);
  };
  double ev = 0.0, mg = 0.0;
  for (int64_t r = 0; r < rows_; ++r) {
    const double ei = e_[r * n_ + i];
    const double* rv = g.removed_v.data() + r * d_;
    for (int64_t c = 0; c < d_; ++c) base[c] = -rv[c] - ei * vi[c];
    const double base_z = -g.removed_z[r] - ei;
    const double* o = out_.data() + r * d_;
    const double dz_e = lg * g.slot_e[r] + base_z;
    ev += error(o, g.slot_e[r], g.slot_v.data(), dz_e, z_[r] + dz_e);
    const double em = SlotWeight(r, merged.key_post);
    const double dz_m = lm * em + base_z;
    mg += error(o, em, merged.value_sum, dz_m, z_[r] + dz_m);
  }
  *evict = ev;
  *merge = mg;
}

void WindowErrorModel::Accept(int64_t i, const ReplacementSlot& merged, Group* g) const {
  const float* vi = values_.Row(i);
  for (int64_t r = 0; r < rows_; ++r) {
    const double ei = e_[r * n_ + i];
    g->removed_z[r] += ei;
    double* rv = g->removed_v.data() + r * d_;
    for (int64_t c = 0; c < d_; ++c) rv[c] += ei * vi[c];
    g->slot_e[r] = SlotWeight(r, merged.key_post);
  }
  for (int64_t c = 0; c < d_; ++c) g->slot_v[c] = merged.value_sum[c];
  g->cardinality = merged.cardinality;
}

}  // namespace kvd::kernels::internal
