// The host image of a compact chunk that DeviceCompactChunk uploads (device_serving.h), and the
// CUDA entry points that copy it and run the serving kernels over it. Private to kvd_kernels.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "kvd/common/status.h"
#include "kvd/kernels/compact_chunk.h"
#include "kvd/kernels/rope.h"
#include "kvd/kernels/vector.h"

namespace kvd::kernels {

// Where the sections of one (layer, head) lie in the image: byte offsets, each 16-byte aligned.
//   keys      [S, d] chunk dtype (as stored)       values   [V, d] chunk dtype (as stored)
//   rebuilt   [R, d] float32 (routed slots)        source   [S] int32: stored value row v >= 0,
//   offsets   [S + 1] int64 prefix sums of l_j                or -(r + 1) for rebuilt row r
//   bias      [S] float32 ln l_j                   positions [S] int64
struct DeviceHeadLayout {
  int64_t slots = 0;
  int64_t tokens = 0;  // sum of l_j
  size_t keys = 0, values = 0, rebuilt = 0, source = 0, offsets = 0, bias = 0, positions = 0;
};

// Validates `chunk` (and its keys, as BuildServingHead does), computes the layout and the bytes
// of the image, writing them through `alloc(total_bytes)` (which returns the destination, e.g.
// pinned memory; null = RESOURCE_EXHAUSTED). Rebuilt values come from BuildServingHead.
StatusOr<std::vector<DeviceHeadLayout>> PackDeviceImage(
    const CompactChunk& chunk, const RopeTable* rope, const VectorWeights* weights,
    const std::function<uint8_t*(size_t total_bytes)>& alloc);

namespace cuda {
// Pinned host memory (cudaMallocHost) and device memory of `bytes`; frees accept null.
StatusOr<void*> AllocatePinned(size_t bytes);
void FreePinned(void* p);
// cudaMalloc + cudaMemcpyAsync(H2D) on `stream` + cudaStreamSynchronize.
StatusOr<void*> UploadImage(const void* pinned, size_t bytes, void* stream);
void FreeDevice(void* p);
// Queue one head's kernels on `stream`. `row_elems` = H * d, `head` the head index (dense
// output element (t, head, c) sits at t * row_elems + head * d + c).
Status LaunchDenseHead(const uint8_t* image, const DeviceHeadLayout& h, int head_dim, DType dtype,
                       int64_t row_elems, int head, void* k, void* v, void* stream);
Status LaunchCompactHead(const uint8_t* image, const DeviceHeadLayout& h, int head_dim, DType dtype,
                         float* keys, float* values, float* bias, int64_t* positions, void* stream);
}  // namespace cuda

}  // namespace kvd::kernels
