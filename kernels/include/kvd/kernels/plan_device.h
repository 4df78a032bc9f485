// Device-resident compression plan: the compression of plan.h for a chunk whose K/V (and window
// queries) are already in DEVICE memory, as a prefill engine or a UCX/NCCL receive leaves them.
// Every stage runs as device kernels enqueued on ONE stream (the worker's): conversion to float32,
// the score (attention mass of the window queries, mean, pooling; or KeyDiff's norms, anchor and
// cosines, or its block-wise walk), the per-head top-k selection, the hybrid merge,
// the gather of the kept slots, VECTOR de-rotation, residuals and routing, and the encode to the
// model dtype. Nothing is copied to the host between stages; the only device-to-host copy is the
// compact chunk's arrays at the end (one synchronisation per chunk).
//
// Semantics: those of Compress (plan.h) for the supported options, slot for slot:
//   - the same budgets (uniform M = llround((1 - p_c) N), PyramidKV's exact layer budgets, the
//     VECTOR route budget and its reduction), the same forced tokens (sinks, window);
//   - selection: sinks + window + the top (pool - sinks - window) middle tokens by score, ties to
//     the lower token index (SelectTopK); routing: the 2a eligible slots with the smallest
//     residual drop their value, ties to the lower slot;
//   - kept keys/values are copied, then converted back to the model dtype (round to nearest even):
//     for a bf16/fp16 chunk they are bit-identical to the CPU plan's for the same selection;
//   - the hybrid merge (merge kKvSlimmer after a score stage, plan.h): the same absorbers (nearest
//     non-forced pool token, ties left), cosine gate, group cap (nearest first, ties left) and
//     weights (window attention mass, uniform without queries or with merge_guard kMean); the
//     merged pre-RoPE key and value sum are float64 sums in token order as on the CPU (bit for bit
//     when the weights are), the key rotated to the slot's position by the device's RoPE, the
//     stored value the value sum times 1/cardinality.
// Scores and residuals are float32 sums formed in another order than on the CPU (the attention
// mass adds probabilities with atomics; the CPU accumulates in float64; KeyDiff's anchor is summed
// in float64 on the device, in float32 blocks then float64 on the CPU), so they differ from the
// CPU plan's in the last bits, and two middle tokens whose scores are that close may be chosen
// differently. The CPU/device comparison (tests/kernels/plan_device_test.cc) bounds the difference.
//
// Supported: the score stages registered with `device` (stages.h): kNone, kSnapKv, kPyramidKv,
// kKeyDiff (one-shot and block-wise keydiff_block;
// a zero-norm key is refused as by Compress); merge kNone, or kKvSlimmer after a score stage (the
// hybrid, with hybrid_max_group, hybrid_min_cos, position and merge_guard; without routing,
// hybrid_error_aware or merge_gate); route kNone, kVector (linear or affine weights: the residual
// of an affine head is |(v - b) - W k|^2, as VectorResiduals; with route_adaptive off);
// head_budget kUniform; any pooling and kernel. Anything else (KVSlimmer's pairwise rounds without
// a score stage among them) is UNIMPLEMENTED naming the option (use Compress). Thread safety: a
// DevicePlan owns its scratch memory: one per worker thread/stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvd/common/layout.h"
#include "kvd/kernels/compact_chunk.h"
#include "kvd/kernels/plan.h"
#include "kvd/kernels/types.h"
#include "kvd/kernels/vector.h"

namespace kvd::kernels {

// One chunk whose tensors are in device memory.
struct DeviceChunkInput {
  // DEVICE memory, layout.ChunkBytes(N) bytes: per layer K[N, H, d] then V[N, H, d]
  // (common/layout.h).
  const void* raw = nullptr;
  size_t raw_bytes = 0;
  // HOST memory, [N] original positions >= 0 (N * 8 bytes, uploaded once per chunk).
  std::span<const int64_t> positions;
  // DEVICE memory or null: the post-RoPE queries of the chunk's last `window` tokens, every layer
  // in the engine layout of the model dtype, [L, window, num_q_heads, d] (per layer what
  // GatherWindowQueries takes). Null = no window queries (then SnapKV/PyramidKV fail, and the
  // window is not forced, as in Compress).
  const void* window_queries = nullptr;
  // The window queries are float32 (kvd's wire layout, docs/wire-format.md) instead of the model
  // dtype; same [L, window, num_q_heads, d] order. Default false.
  bool window_queries_float32 = false;
};

// One chunk whose tensors are in HOST memory (what kvd's ingest receives): DevicePlan::
// CompressHost copies it to the device once (into buffers the plan keeps between chunks) and
// compresses it there; only the compact chunk comes back.
struct HostChunkInput {
  std::span<const uint8_t> raw;        // layout.ChunkBytes(N) bytes, as DeviceChunkInput::raw
  std::span<const int64_t> positions;  // [N] original positions >= 0
  // Empty = no window queries; else L * window * num_q_heads * d elements of the model dtype (or
  // float32 with window_queries_float32), as DeviceChunkInput::window_queries.
  std::span<const uint8_t> window_queries;
  bool window_queries_float32 = false;
};

struct DevicePlanOptions {
  void* cuda_stream = nullptr;  // cudaStream_t every stage runs on; nullptr = the default stream
  int device = -1;              // CUDA device ordinal; -1 = the calling thread's current device
  // Records CUDA events between the stages and reports their device time in
  // CompressionStats::stage (convert: K/V to float32 and the finiteness check; score; select:
  // top-k, compaction and the slot gather; derotate and route: VECTOR; encode: to the model
  // dtype), summed over layers. Off by default (no events).
  bool time_stages = false;
  // With cuda_stream == nullptr: the plan creates its own non-blocking stream (destroyed with it)
  // instead of using the legacy default stream, so plans of several worker threads overlap.
  // Default false.
  bool own_stream = false;
};

// OK when this process can run DevicePlan on CUDA device `device` (>= 0). UNIMPLEMENTED
// "built without CUDA (this build has no CUDA kernels)"; UNAVAILABLE "no CUDA device
// (cudaGetDeviceCount: ...)" or "no CUDA device 3 (this machine has 1)". Messages are ready to
// quote after a caller's own context.
Status CheckDevicePlanDevice(int device);

// The slot counts of one chunk of N tokens, per layer (every head of a layer has the same): what
// Compress produces for these options. Computed on the host from sizes only.
struct DevicePlanBudget {
  int64_t window = 0;                  // effective window (0 without window queries)
  int64_t forced = 0;                  // sinks + window
  std::vector<int64_t> kept_pairs;     // [L] M of the layer (2M half-pairs per head)
  std::vector<int64_t> slots;          // [L] S: keys kept per head (M + a)
  std::vector<int64_t> rebuild_slots;  // [L] 2a: slots per head whose value is dropped (VECTOR)
  std::vector<uint8_t> reduced;        // [L] 1 when a was lowered for lack of eligible slots
};

// OK when the device plan implements `options`; UNIMPLEMENTED naming the first unsupported one.
// (Validate() errors of the options are returned first.)
Status CheckDevicePlanSupported(const CompressionPlanOptions& options);

// The budgets of a chunk of N tokens (see DevicePlanBudget); routing iff `routing`. Errors as
// Compress: INVALID_ARGUMENT when N < sinks + window, OUT_OF_RANGE when a budget cannot hold the
// sinks and window, the errors of the PyramidKV and route budgets.
StatusOr<DevicePlanBudget> ComputeDevicePlanBudget(const CompressionPlanOptions& options,
                                                   int num_layers, int64_t n, bool have_queries,
                                                   bool routing);

class DevicePlan {
 public:
  // Validates (options, support, layout, head_dim, VECTOR weights: required and of the layout's
  // shape when route == kVector, a bias empty or of head_dim finite floats) and uploads what every
  // chunk reuses (RoPE frequencies, W^T and the intercept of every head). Errors: those of Validate
  // / CheckDevicePlanSupported / ModelLayout::Validate; FAILED_PRECONDITION for missing or
  // mis-shaped weights; UNIMPLEMENTED when the build has no CUDA; UNAVAILABLE when no device is
  // visible; RESOURCE_EXHAUSTED when device memory is short.
  static StatusOr<std::unique_ptr<DevicePlan>> Create(const CompressionPlanOptions& options,
                                                      const ModelLayout& layout,
                                                      const VectorWeights* weights = nullptr,
                                                      const DevicePlanOptions& device = {});
  ~DevicePlan();
  DevicePlan(const DevicePlan&) = delete;
  DevicePlan& operator=(const DevicePlan&) = delete;

  // Compresses one chunk (see the file comment). Errors: INVALID_ARGUMENT for a null raw
  // pointer, a raw size that does not match the layout, no tokens, a negative position,
  // non-finite keys/values/queries (checked on the device, reported after the chunk), a
  // zero-norm key under KeyDiff (the layer, head and token named); the
  // FAILED_PRECONDITION of Compress when SnapKV/PyramidKV lack window queries; the budget errors
  // of ComputeDevicePlanBudget; INTERNAL / RESOURCE_EXHAUSTED for CUDA errors. Blocks until the
  // compact chunk is on the host. `stats` as Compress fills them; `stage` holds device times only
  // with DevicePlanOptions::time_stages (else zero); total_ns is the wall time of the call.
  StatusOr<CompactChunk> Compress(const DeviceChunkInput& input, CompressionStats* stats = nullptr);

  // Compress of a chunk in host memory (HostChunkInput): one host-to-device copy of the raw chunk
  // and the window queries on the plan's stream, then Compress. Errors: INVALID_ARGUMENT when
  // the window queries' size is not L * window * num_q_heads * d elements; those of Compress.
  StatusOr<CompactChunk> CompressHost(const HostChunkInput& input,
                                      CompressionStats* stats = nullptr);

  // The per-token scores of the latest Compress, [L][H][N] flattened (window tokens +Inf, as
  // SnapKvScores; recency i for score kNone; KeyDiff -cos to the anchor for every token, as
  // KeyDiffScores; 0 for block-wise KeyDiff, whose scores exist per block only), copied from the
  // device: for tests and diagnostics.
  StatusOr<std::vector<float>> LastScores() const;

  struct State;  // device buffers (defined in the CUDA sources)

 private:
  DevicePlan() = default;
  CompressionPlanOptions options_;
  ModelLayout layout_;
  bool routing_ = false;
  uint64_t calibration_version_ = 0;
  std::unique_ptr<State> state_;
};

}  // namespace kvd::kernels
