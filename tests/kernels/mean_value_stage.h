// mean_value: a toy route stage, the worked example of docs/extending.md "A merge or route
// stage". The cost of dropping a slot's value is its squared distance (float64) from the mean
// value of the head's N tokens: the plan drops the values that lie nearest that mean. Only a
// single-token slot that is not a sink or window slot may drop its value (+Inf elsewhere). It
// needs no calibration, window queries or statistics. At serving, a dropped value is rebuilt as
// the mean value of the head's tokens whose values the chunk kept: the cardinality-weighted mean
// (float64) of the kept slots' mean values. A new route stage is its kernel pair and this one
// registration; the CPU plan and serving (BuildServingHead, ExpandDenseChunk, the client's
// CompactChunkReader) run it through the registry.
#pragma once

#include <limits>
#include <string>
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

// The rebuild: every dropped value of the head becomes sum_j l_j mean_j / sum_j l_j over the slots
// j that kept theirs (float64, rounded to float32 once). FAILED_PRECONDITION when the head kept
// no value.
inline Status MeanValueRebuild(const RebuildHeadInput& in, MatrixView values) {
  const int64_t s = values.rows, d = values.cols;
  std::vector<double> sum(static_cast<size_t>(d), 0.0);
  double tokens = 0.0;
  for (int64_t j = 0; j < s; ++j) {
    if (in.flags[j] & kSlotRebuildValue) continue;
    for (int64_t c = 0; c < d; ++c) sum[c] += double(values.Row(j)[c]) * in.cardinality[j];
    tokens += in.cardinality[j];
  }
  if (tokens == 0.0) {
    return Status::FailedPrecondition("mean_value: layer " + std::to_string(in.layer) + " head " +
                                      std::to_string(in.head) + " kept no value to rebuild from");
  }
  for (int64_t j = 0; j < s; ++j) {
    if (!(in.flags[j] & kSlotRebuildValue)) continue;
    for (int64_t c = 0; c < d; ++c) values.Row(j)[c] = static_cast<float>(sum[c] / tokens);
  }
  return Status::Ok();
}

// The registration (once per process; later calls return the first call's status).
inline Status RegisterMeanValueStage() {
  static const Status registered = StageRegistry::Global().Register({
      .name = "mean_value",
      .kind = StageKind::kRoute,
      .code = kMeanValueCode,
      .route = MeanValueRoute,      // no calibration, queries or statistics; CPU plan only
      .rebuild = MeanValueRebuild,  // no device rebuild: DeviceCompactChunk rebuilds on the host
  });
  return registered;
}

}  // namespace kvd::kernels::testing
