// mean_value: a toy route stage, the worked example of docs/extending.md "A merge or route
// stage". The cost of dropping a slot's value is its squared distance (float64) from the mean
// value of the head's N tokens: the plan drops the values that lie nearest that mean. Only a
// single-token slot that is not a sink or window slot may drop its value (+Inf elsewhere). It
// needs no calibration, window queries or statistics. A new route stage is its kernel and this
// one registration; the CPU plan runs it through the registry. Serving rebuilds dropped values
// from VECTOR weights only (kernels/src/serving.cc), so this stage's chunks are compressed and
// encoded, not served.
#pragma once

#include <limits>
#include <vector>

#include "kvd/kernels/stages.h"

namespace kvd::kernels::testing {

// The on-disk route code of mean_value (any code no other route stage uses).
inline constexpr uint8_t kMeanValueCode = 200;
inline constexpr RouteStage kMeanValue = static_cast<RouteStage>(kMeanValueCode);

// The kernel: per slot, |value - mean value of the head|^2, or +Inf where the slot keeps it.
inline Status MeanValueRoute(const RouteHeadInput& in, const HeadSlots& slots,
                             std::vector<float>* err) {
  const int64_t n = in.values.rows, d = in.values.cols;
  std::vector<double> mean(static_cast<size_t>(d), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < d; ++c) mean[c] += in.values.Row(i)[c] / static_cast<double>(n);
  }
  err->assign(static_cast<size_t>(slots.size()), std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < slots.size(); ++j) {
    if (slots.forced[j] || slots.cardinality[j] != 1) continue;
    double sum = 0.0;
    for (int64_t c = 0; c < d; ++c) {
      const double diff = slots.value_sums.Row(j)[c] - mean[c];
      sum += diff * diff;
    }
    (*err)[j] = static_cast<float>(sum);
  }
  return Status::Ok();
}

// The registration (once per process; later calls return the first call's status).
inline Status RegisterMeanValueStage() {
  static const Status registered = StageRegistry::Global().Register({
      .name = "mean_value",
      .kind = StageKind::kRoute,
      .code = kMeanValueCode,
      .route = MeanValueRoute,  // no calibration, queries or statistics; CPU plan only
  });
  return registered;
}

}  // namespace kvd::kernels::testing
