// Layout conversion at the entry and exit of every compression plan: an engine's KV tensor of one
// layer, [N, H, d] in float32 / float16 / bfloat16 (token-major, heads interleaved), to per-head
// float32 matrices [H][N, d], and back.
//
// Thread safety: the functions are reentrant; distinct calls may run concurrently on disjoint
// outputs. Backend kCuda: every pointer and view is HOST memory; the op stages through device
// memory (a device-resident plan is future work).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvd/common/dtype.h"
#include "kvd/kernels/types.h"

namespace kvd::kernels {

// Shape of one layer of an engine KV tensor: `tokens` rows of `num_heads` x `head_dim` elements.
struct EngineTensorShape {
  int64_t tokens = 0;     // N >= 0
  int64_t num_heads = 0;  // H >= 1 (KV heads)
  int64_t head_dim = 0;   // d, even, 2..kMaxHeadDim
  DType dtype = DType::kBFloat16;

  Status Validate() const;
  int64_t Elements() const { return tokens * num_heads * head_dim; }
  size_t Bytes() const { return static_cast<size_t>(Elements()) * DTypeSize(dtype); }
};

// Gathers `src` (// [N, H, d] of shape.dtype) into heads[h] (// [N, d] float32).
// `heads` must hold H views of N x d (any ld >= d). Converts once, here.
// Errors: INVALID_ARGUMENT for a bad shape, a null pointer or a view of the wrong size;
// INVALID_ARGUMENT "non-finite" if `check_finite` and a converted value is NaN/Inf (the first
// bad head/row/col is named). kCuda: UNIMPLEMENTED without CUDA, UNAVAILABLE without a device.
Status GatherHeads(const EngineTensorShape& shape, const void* src,
                   std::span<const MatrixView> heads, const ExecOptions& exec = {},
                   bool check_finite = true);

// Convenience: allocates the H matrices.
StatusOr<std::vector<Matrix>> GatherHeads(const EngineTensorShape& shape, const void* src,
                                          const ExecOptions& exec = {}, bool check_finite = true);

// Inverse of GatherHeads: writes heads[h] (// [N, d] float32) into `dst` (// [N, H, d] of
// shape.dtype), rounding to nearest even for float16/bfloat16 (values beyond float16 range
// become +-Inf, as the engine's own cast would). Same errors as GatherHeads (no finite check).
Status ScatterHeads(const EngineTensorShape& shape, std::span<const ConstMatrixView> heads,
                    void* dst, const ExecOptions& exec = {});

}  // namespace kvd::kernels
