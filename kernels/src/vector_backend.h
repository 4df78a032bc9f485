// Backend entry points of the VECTOR ops. The public entry (src/vector.cc) validates shapes and
// finiteness, then calls exactly one of these; they assume valid input.
#pragma once

#include <string>

#include "kvd/common/status.h"
#include "kvd/kernels/types.h"
#include "kvd/kernels/vector.h"

namespace kvd::kernels {

// OK when the kCuda backend can run `op` now: UNIMPLEMENTED in a build without CUDA, UNAVAILABLE
// when no device is visible.
inline Status CudaBackendReady(const char* op) {
#ifdef KVD_HAVE_CUDA
  if (!CudaDeviceAvailable()) {
    return Status::Unavailable(std::string(op) +
                               ": kCuda backend requested but no CUDA device is visible");
  }
  return Status::Ok();
#else
  return Status::Unimplemented(std::string(op) +
                               ": kCuda backend requested but this build has no CUDA kernels");
#endif
}

}  // namespace kvd::kernels

namespace kvd::kernels::cpu {

// stats += batch (Gram, cross, value sums) in float64.
void AccumulateVectorStats(ConstMatrixView kpre, ConstMatrixView values, VectorHeadStats* stats);
// residuals[i] = |v_i - W kpre_i|^2.
void VectorResiduals(ConstMatrixView kpre, ConstMatrixView values, ConstMatrixView w,
                     float* residuals);
// out = kpre W^T.
void RebuildValues(ConstMatrixView kpre, ConstMatrixView w, MatrixView out);

}  // namespace kvd::kernels::cpu

namespace kvd::kernels::cuda {

// Same contracts as the CPU twins; host pointers in and out, staged through the device.
// Return INTERNAL with the CUDA error string on a device failure.
Status AccumulateVectorStats(ConstMatrixView kpre, ConstMatrixView values, VectorHeadStats* stats,
                             void* stream);
Status VectorResiduals(ConstMatrixView kpre, ConstMatrixView values, ConstMatrixView w,
                       float* residuals, void* stream);
Status RebuildValues(ConstMatrixView kpre, ConstMatrixView w, MatrixView out, void* stream);

}  // namespace kvd::kernels::cuda
