// The vector route stage's steps: at compression (stages.h RouteFn) per slot the VECTOR residual
// |v - W kpre - b|^2, or with route_adaptive the attention-weighted relative residual e_j
// (plan.h); at serving (RebuildFn) the dropped values rebuilt as W RoPE^-1(k_j, pos_j).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kvd/kernels/rope.h"
#include "kvd/kernels/stages.h"
#include "kvd/kernels/vector.h"
#include "plan_internal.h"

namespace kvd::kernels::internal {
namespace {

// route_adaptive: s_v = mean_i |v_i - mean v|^2 over the head's N tokens (float64).
double ValueScale(ConstMatrixView values) {
  const int64_t n = values.rows, d = values.cols;
  std::vector<double> mean(static_cast<size_t>(d), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < d; ++c) mean[c] += values.Row(i)[c];
  for (double& m : mean) m /= static_cast<double>(n);
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < d; ++c) ss += std::pow(values.Row(i)[c] - mean[c], 2);
  return ss / static_cast<double>(n);
}

// route_adaptive: e_j of every eligible slot (res: their residuals), +Inf above route_max_error.
Status AdaptiveErrors(const RouteHeadInput& in, const HeadSlots& t,
                      const std::vector<int64_t>& eligible, const std::vector<float>& res,
                      std::vector<float>* err) {
  KVD_ASSIGN_OR_RETURN(const std::span<const float> mass, in.cache->Mass());
  const int64_t n = in.values.rows;
  const double value_scale = ValueScale(in.values);
  double total = 0.0;
  for (float m : mass) total += std::max(0.0f, m);
  const double mean_mass = mass.empty() ? 0.0 : total / static_cast<double>(n);
  for (size_t r = 0; r < eligible.size(); ++r) {
    const int64_t tok = t.token[eligible[r]];
    const double w = (mean_mass > 0.0 && tok >= 0) ? std::max(0.0f, mass[tok]) / mean_mass : 1.0;
    double rel;
    if (value_scale > 0.0) {
      rel = w * static_cast<double>(res[r]) / value_scale;
    } else {  // every value equal: only an exact rebuild is harmless
      rel = res[r] > 0.0f ? std::numeric_limits<double>::infinity() : 0.0;
    }
    if (rel <= in.options->route_max_error) (*err)[eligible[r]] = static_cast<float>(rel);
  }
  return Status::Ok();
}

}  // namespace

Status VectorRouteErrors(const RouteHeadInput& in, const HeadSlots& t, std::vector<float>* err) {
  const int64_t d = in.values.cols;
  err->assign(static_cast<size_t>(t.size()), std::numeric_limits<float>::infinity());
  std::vector<int64_t> eligible;
  for (int64_t j = 0; j < t.size(); ++j) {
    if (!t.forced[j] && t.cardinality[j] == 1) eligible.push_back(j);
  }
  const int64_t e = static_cast<int64_t>(eligible.size());
  if (e == 0) return Status::Ok();
  Matrix k(e, d), v(e, d);
  for (int64_t r = 0; r < e; ++r) {
    std::memcpy(k.Row(r), t.keys_pre.Row(eligible[r]), d * sizeof(float));
    std::memcpy(v.Row(r), t.value_sums.Row(eligible[r]), d * sizeof(float));
  }
  std::vector<float> res(static_cast<size_t>(e));
  KVD_RETURN_IF_ERROR(VectorResiduals(k.View(), v.View(), *in.fit, res, {.num_threads = 1}));
  if (!in.options->route_adaptive) {
    for (int64_t r = 0; r < e; ++r) (*err)[eligible[r]] = res[r];
    return Status::Ok();
  }
  return AdaptiveErrors(in, t, eligible, res, err);
}

// Serving (serving.cc) checked the weights' version and shape and the table's head_dim.
Status VectorRebuild(const RebuildHeadInput& in, MatrixView values) {
  const int64_t d = in.keys.cols;
  int64_t rebuild = 0;
  for (uint8_t f : in.flags) rebuild += (f & kSlotRebuildValue) ? 1 : 0;
  Matrix k(rebuild, d);
  std::vector<int64_t> pos(static_cast<size_t>(rebuild));
  std::vector<int64_t> slot(static_cast<size_t>(rebuild));
  int64_t r = 0;
  for (int64_t j = 0; j < in.keys.rows; ++j) {
    if (!(in.flags[j] & kSlotRebuildValue)) continue;
    std::memcpy(k.Row(r), in.keys.Row(j), d * sizeof(float));
    pos[r] = in.positions[j];
    slot[r] = j;
    ++r;
  }
  KVD_RETURN_IF_ERROR(
      ApplyRope(*in.rope, RopeDirection::kDerotate, pos, k.View(), k.View(), in.exec));
  Matrix v(rebuild, d);
  KVD_RETURN_IF_ERROR(
      RebuildValues(k.View(), in.weights->Head(in.layer, in.head), v.View(), in.exec));
  for (int64_t i = 0; i < rebuild; ++i) {
    std::memcpy(values.Row(slot[i]), v.Row(i), d * sizeof(float));
  }
  return Status::Ok();
}

}  // namespace kvd::kernels::internal
