// PyramidKV layer budgets (docs/algorithms.md 2): more tokens for lower layers, same total.
//   C = W + N (1 - p_c);  min = (C - W) / beta;  max = 2 (C - W) - min
//   if max >= N - W: max = N - W, min = 2 (C - W) - max
//   budget(l) = round(max - l (max - min) / (L - 1))
//   if not (N >= max >= min >= W) (or L == 1): every layer gets round(N (1 - p_c)).
// round() is half away from zero (std::llround), as Python's round on these values except exact
// .5 ties (documented difference).
#pragma once

#include <cstdint>
#include <vector>

#include "kvd/kernels/types.h"

namespace kvd::kernels {

struct PyramidKvOptions {
  int64_t window = 64;  // W, >= 0
  double beta = 20.0;   // >= 1

  Status Validate() const;
};

struct PyramidKvBudgets {
  std::vector<int64_t> per_layer;  // [L] tokens kept per KV head in layer l (includes the window)
  bool fell_back = false;          // true when the uniform fallback was used
};

// Errors: INVALID_ARGUMENT for n < 1 or num_layers < 1 or a bad option; OUT_OF_RANGE for
// compression_ratio outside [0, 1).
StatusOr<PyramidKvBudgets> PyramidKvLayerBudgets(int64_t n, int num_layers,
                                                 double compression_ratio,
                                                 const PyramidKvOptions& options = {});

}  // namespace kvd::kernels
