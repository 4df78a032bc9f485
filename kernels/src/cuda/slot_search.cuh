// The slot a dense row comes from, shared by the dense expansion kernels. Private to
// kernels/src/cuda.
#pragma once

#include <cstdint>

namespace kvd::kernels::cuda {

// The slot j of dense row t: offsets[j] <= t < offsets[j + 1], where offsets [s + 1] are the
// exclusive prefix sums of the slot cardinalities (binary search; REQUIRES t < offsets[s]).
__device__ inline int64_t SlotOfDenseRow(const int64_t* __restrict__ offsets, int64_t s,
                                         int64_t t) {
  int64_t lo = 0, hi = s;  // invariant: offsets[lo] <= t < offsets[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (offsets[mid] <= t)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

}  // namespace kvd::kernels::cuda
