// SnapKV scores (snapkv.h): observation mass with the causal window, mean, 1-D pooling.
#include "kvd/kernels/snapkv.h"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

namespace kvd::kernels {

Status SnapKvOptions::Validate() const {
  if (window < 1) {
    return Status::InvalidArgument("snapkv: window must be >= 1, got " + std::to_string(window));
  }
  if (kernel_size < 1 || kernel_size % 2 == 0) {
    return Status::InvalidArgument("snapkv: kernel_size must be odd and >= 1, got " +
                                   std::to_string(kernel_size));
  }
  if (pooling != PoolingKind::kAvg && pooling != PoolingKind::kMax) {
    return Status::InvalidArgument("snapkv: unknown pooling kind");
  }
  if (group_size < 1) {
    return Status::InvalidArgument("snapkv: group_size must be >= 1, got " +
                                   std::to_string(group_size));
  }
  return Status::Ok();
}

Status Pool1d(std::span<const float> in, int kernel_size, PoolingKind pooling,
              std::span<float> out) {
  if (kernel_size < 1 || kernel_size % 2 == 0) {
    return Status::InvalidArgument("pool1d: kernel_size must be odd and >= 1, got " +
                                   std::to_string(kernel_size));
  }
  if (in.size() != out.size()) {
    return Status::InvalidArgument("pool1d: input and output sizes differ");
  }
  if (in.data() == out.data() && kernel_size > 1) {
    return Status::InvalidArgument("pool1d: in and out alias");
  }
  const int64_t n = static_cast<int64_t>(in.size()), pad = kernel_size / 2;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t lo = std::max<int64_t>(0, j - pad), hi = std::min<int64_t>(n - 1, j + pad);
    if (pooling == PoolingKind::kAvg) {
      float sum = 0.0f;  // zero padding counted in the divisor (count_include_pad)
      for (int64_t i = lo; i <= hi; ++i) sum += in[static_cast<size_t>(i)];
      out[static_cast<size_t>(j)] = sum / static_cast<float>(kernel_size);
    } else {
      float mx = -std::numeric_limits<float>::infinity();  // -inf padding, as max_pool1d
      for (int64_t i = lo; i <= hi; ++i) mx = std::max(mx, in[static_cast<size_t>(i)]);
      out[static_cast<size_t>(j)] = mx;
    }
  }
  return Status::Ok();
}

Status SnapKvScores(ConstMatrixView queries, ConstMatrixView keys, const SnapKvOptions& options,
                    std::span<float> scores, const ExecOptions& exec) {
  KVD_RETURN_IF_ERROR(options.Validate());
  const int64_t n = keys.rows, w = options.window;
  if (queries.rows != w * options.group_size) {
    return Status::InvalidArgument(
        "snapkv: queries have " + std::to_string(queries.rows) +
        " rows, expected window*group_size = " + std::to_string(w * options.group_size));
  }
  if (n < w) {
    return Status::InvalidArgument("snapkv: N=" + std::to_string(n) +
                                   " is smaller than the window (" + std::to_string(w) + ")");
  }
  if (scores.size() != static_cast<size_t>(n)) {
    return Status::InvalidArgument("snapkv: scores has " + std::to_string(scores.size()) +
                                   " entries for N=" + std::to_string(n));
  }
  ObservationOptions obs;
  obs.mask = MaskKind::kCausalWindow;
  obs.group_size = options.group_size;
  ObservationHead head;
  head.queries = queries;
  head.keys = keys;
  std::vector<float> mass(static_cast<size_t>(n));
  KVD_RETURN_IF_ERROR(ComputeAttentionMass(head, obs, mass, exec));
  MassMean(mass, queries.rows);
  const size_t middle = static_cast<size_t>(n - w);
  KVD_RETURN_IF_ERROR(Pool1d(std::span<const float>(mass.data(), middle), options.kernel_size,
                             options.pooling, scores.subspan(0, middle)));
  std::fill(scores.begin() + static_cast<std::ptrdiff_t>(middle), scores.end(),
            std::numeric_limits<float>::infinity());
  return Status::Ok();
}

}  // namespace kvd::kernels
