// Serving a compact chunk into CUDA device memory: the device twin of serving.h's
// BuildServingHead (compact form) and ExpandDenseChunk (dense form), for engines whose KV
// buffers are on the GPU (kvd/client/expand.h picks it for device pointers).
//
//   auto dev = DeviceCompactChunk::Upload(chunk, rope, weights, stream).value();  // one H2D copy
//   dev->DenseLayer(0, k0, v0, stream);             // kernels write [T, H, d] of the chunk dtype
//   dev->CompactHead(0, h, keys, values, bias, positions, stream);  // float32 slots + ln l_j
//
// A quantized chunk (quantize.h) is first dequantized on the host and rounded to its dtype
// (DequantizeChunk); its compact form here is then that of DequantizeChunk(chunk), which differs
// from BuildServingHead's float32 dequantization by that rounding (at most 2^-9 relative for
// bfloat16). Upload packs the chunk's keys and stored values (as stored, in the chunk dtype) with
// small per-slot tables into one pinned host buffer and copies it to the device once. The kernels
// then do what the CPU serving does: dtype -> float32 conversion (compact form), slot j repeated
// l_j times with a float32 round trip to the dtype (dense form). The output equals the CPU's bit
// for bit for finite values: the conversions (src/cuda/elements.cuh) round to nearest even as
// common/dtype.h does (a NaN stored value may come out as another NaN bit pattern), and the two
// values computed with floating-point arithmetic, ln l_j and the rebuilt values of routed slots
// (the chunk's route stage's RebuildFn, stages.h; VECTOR's W RoPE^-1(k_j, pos_j)), are computed on
// the host by the CPU code and uploaded with the chunk (routed slots only; a chunk without routing
// uploads none), so any registered route stage serves here, with or without a device rebuild.
//
// Streams are cudaStream_t passed as void* (nullptr = the legacy default stream). Upload waits
// for its copy, so the image can be used from any stream afterwards; the layer calls only queue
// kernels on `stream` (the caller synchronises). Destroying the object frees the device memory
// (cudaFree waits for the device). Thread safety: const methods may run concurrently.
#pragma once

#include <cstdint>
#include <memory>

#include "kvd/common/status.h"
#include "kvd/kernels/compact_chunk.h"
#include "kvd/kernels/rope.h"
#include "kvd/kernels/vector.h"

namespace kvd::kernels {

class DeviceCompactChunk {
 public:
  // Errors: UNIMPLEMENTED "this build has no CUDA kernels"; UNAVAILABLE "no CUDA device";
  // INVALID_ARGUMENT of chunk.Validate() or non-finite keys (as BuildServingHead);
  // FAILED_PRECONDITION of BuildServingHead when routed slots lack rope/weights (the errors of
  // the route stage's rebuild);
  // RESOURCE_EXHAUSTED when device or pinned memory runs out.
  static StatusOr<std::unique_ptr<DeviceCompactChunk>> Upload(const CompactChunk& chunk,
                                                              const RopeTable* rope,
                                                              const VectorWeights* weights,
                                                              void* stream);
  ~DeviceCompactChunk();
  DeviceCompactChunk(const DeviceCompactChunk&) = delete;
  DeviceCompactChunk& operator=(const DeviceCompactChunk&) = delete;

  // T of the dense form; FAILED_PRECONDITION "heads expand to different token counts".
  StatusOr<int64_t> DenseTokens() const;

  // The dense form of `layer` into device buffers k, v: [T, num_kv_heads, head_dim] of the chunk
  // dtype (T = DenseTokens()), the same bytes as that layer of ExpandDenseChunk.
  // INVALID_ARGUMENT for a bad layer or null buffer; errors of DenseTokens; launch errors.
  Status DenseLayer(int layer, void* k, void* v, void* stream) const;

  // The compact form of (layer, head) into device buffers of S = slots rows: keys, values
  // [S, head_dim] float32, bias [S] float32, positions [S] (may be null). The same values as
  // BuildServingHead. INVALID_ARGUMENT for bad indices or a null buffer.
  Status CompactHead(int layer, int head, float* keys, float* values, float* bias,
                     int64_t* positions, void* stream) const;

  int64_t Slots(int layer, int head) const;
  size_t device_bytes() const;  // bytes of the device image

  struct Impl;

 private:
  explicit DeviceCompactChunk(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvd::kernels
