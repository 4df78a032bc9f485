// Token selection (scorers.h): sinks + window + top-k of the middle, exact budget.
#include "kvd/kernels/scorers.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

namespace kvd::kernels {

Status SelectionOptions::Validate() const {
  if (sinks < 0) {
    return Status::InvalidArgument("selection: sinks must be >= 0, got " + std::to_string(sinks));
  }
  if (window < 0) {
    return Status::InvalidArgument("selection: window must be >= 0, got " + std::to_string(window));
  }
  return Status::Ok();
}

StatusOr<std::vector<int32_t>> SelectTopK(std::span<const float> scores, int64_t budget,
                                          const SelectionOptions& options) {
  KVD_RETURN_IF_ERROR(options.Validate());
  const int64_t n = static_cast<int64_t>(scores.size());
  const int64_t s = options.sinks, w = options.window;
  if (n > INT32_MAX) return Status::InvalidArgument("selection: N too large for int32 indices");
  if (n < s) {
    return Status::InvalidArgument("selection: N=" + std::to_string(n) +
                                   " is smaller than the sinks (" + std::to_string(s) + ")");
  }
  if (n < w) {
    return Status::InvalidArgument("selection: N=" + std::to_string(n) +
                                   " is smaller than the window (" + std::to_string(w) + ")");
  }
  if (n < s + w) {
    return Status::InvalidArgument("selection: N=" + std::to_string(n) +
                                   " is smaller than the sinks + the window (" + std::to_string(s) +
                                   " + " + std::to_string(w) + ")");
  }
  if (budget < 0 || budget < s + w) {
    return Status::OutOfRange("selection: budget " + std::to_string(budget) +
                              " cannot keep sinks + window (" + std::to_string(s) + " + " +
                              std::to_string(w) + ")");
  }
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(scores[static_cast<size_t>(i)])) {
      return Status::InvalidArgument("selection: non-finite score (NaN) at index " +
                                     std::to_string(i));
    }
  }
  std::vector<int32_t> kept;
  if (budget >= n) {
    kept.resize(static_cast<size_t>(n));
    std::iota(kept.begin(), kept.end(), 0);
    return kept;
  }
  kept.reserve(static_cast<size_t>(budget));
  for (int64_t i = 0; i < s; ++i) kept.push_back(static_cast<int32_t>(i));
  std::vector<int32_t> middle(static_cast<size_t>(n - s - w));
  std::iota(middle.begin(), middle.end(), static_cast<int32_t>(s));
  const size_t k = static_cast<size_t>(budget - s - w);
  auto better = [&](int32_t a, int32_t b) {
    const float sa = scores[static_cast<size_t>(a)], sb = scores[static_cast<size_t>(b)];
    return sa > sb || (sa == sb && a < b);
  };
  if (k < middle.size()) {
    std::nth_element(middle.begin(), middle.begin() + static_cast<std::ptrdiff_t>(k), middle.end(),
                     better);
    middle.resize(k);
  }
  std::sort(middle.begin(), middle.end());
  kept.insert(kept.end(), middle.begin(), middle.end());
  for (int64_t i = n - w; i < n; ++i) kept.push_back(static_cast<int32_t>(i));
  return kept;
}

StatusOr<int64_t> UniformBudget(int64_t n, double compression_ratio) {
  if (!(compression_ratio >= 0.0 && compression_ratio < 1.0)) {
    return Status::OutOfRange("compression ratio must be in [0, 1), got " +
                              std::to_string(compression_ratio));
  }
  if (n < 0) return Status::InvalidArgument("negative token count " + std::to_string(n));
  return static_cast<int64_t>(std::llround(static_cast<double>(n) * (1.0 - compression_ratio)));
}

}  // namespace kvd::kernels
