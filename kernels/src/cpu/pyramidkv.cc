// PyramidKV layer budgets (pyramidkv.h).
#include "kvd/kernels/pyramidkv.h"

#include <cmath>
#include <string>

namespace kvd::kernels {

Status PyramidKvOptions::Validate() const {
  if (window < 0) {
    return Status::InvalidArgument("pyramidkv: window must be >= 0, got " + std::to_string(window));
  }
  if (!(beta >= 1.0) || !std::isfinite(beta)) {
    return Status::InvalidArgument("pyramidkv: beta must be finite and >= 1, got " +
                                   std::to_string(beta));
  }
  return Status::Ok();
}

StatusOr<PyramidKvBudgets> PyramidKvLayerBudgets(int64_t n, int num_layers,
                                                 double compression_ratio,
                                                 const PyramidKvOptions& options) {
  KVD_RETURN_IF_ERROR(options.Validate());
  if (n < 1) return Status::InvalidArgument("pyramidkv: N must be >= 1, got " + std::to_string(n));
  if (num_layers < 1) {
    return Status::InvalidArgument("pyramidkv: num_layers must be >= 1, got " +
                                   std::to_string(num_layers));
  }
  if (!(compression_ratio >= 0.0 && compression_ratio < 1.0)) {
    return Status::OutOfRange("pyramidkv: compression ratio must be in [0, 1), got " +
                              std::to_string(compression_ratio));
  }
  const double nn = static_cast<double>(n), w = static_cast<double>(options.window);
  const double c = w + nn * (1.0 - compression_ratio);
  double min_num = (c - w) / options.beta;
  double max_num = 2.0 * (c - w) - min_num;
  if (max_num >= nn - w) {
    max_num = nn - w;
    min_num = 2.0 * (c - w) - max_num;
  }
  PyramidKvBudgets out;
  out.per_layer.resize(static_cast<size_t>(num_layers));
  if (num_layers == 1 || !(nn >= max_num && max_num >= min_num && min_num >= w)) {
    out.fell_back = true;
    const int64_t uniform = std::llround(nn * (1.0 - compression_ratio));
    for (auto& b : out.per_layer) b = uniform;
    return out;
  }
  const double steps = (max_num - min_num) / (num_layers - 1);
  for (int l = 0; l < num_layers; ++l) {
    out.per_layer[static_cast<size_t>(l)] = std::llround(max_num - l * steps);
  }
  return out;
}

}  // namespace kvd::kernels
