// The daemon's compression seam: the ONLY daemon file family that uses kvd_kernels (this header
// and daemon/src/codec/). The rest of the daemon sees chunks as bytes plus a codec id.
//
// One ChunkCodec per model with a compression policy (compression_policy.h):
//
//   put bytes = raw chunk (layout.ChunkBytes(tokens), common/layout.h)
//               + W window queries: for each layer, W * num_q_heads * head_dim float32 (row
//                 w * num_q_heads + q = query head q of the w-th of the chunk's last W tokens,
//                 post-RoPE), layer after layer. W is 0 or the policy's window.
//   Encode()  -> the compact chunk (kernels/compact_chunk.h format) of exactly the policy's
//                budget, computed from that chunk's own K/V and its own last W queries only
//                (prefix-consistent: the same chunk always compresses to the same bytes,
//                whatever prompt it is part of).
//
// A chunk too short for the policy (fewer than sinks + window + 1 tokens, or a budget that cannot
// hold sinks + window: e.g. the last, partial chunk of a prompt) is stored losslessly in the
// same compact format (every token a slot of cardinality 1, codec stages "none", p_c 0), so
// every chunk under a compact codec id has one format.
//
// Ingest pool: `worker_threads` threads and at most `queue_depth` admitted chunks per model.
// Admission happens at Reserve (before any bytes move): Admit() fails with RESOURCE_EXHAUSTED
// and a retry hint when the pool is full, so a Commit never waits for queue space and nothing
// acknowledged is ever dropped. Work runs on the pool threads, never on the control plane.
//
// Codec id: policy.CodecId(calibration version in use), see compression_policy.h. Until VECTOR
// calibration completes (or for a policy that does not route) the version is 0 and chunks are
// compressed without routing.
//
// VECTOR calibration (policy route = vector): every raw put feeds streaming Gram/cross
// accumulators per (layer, KV head) before it is compressed; once `calibration_tokens` tokens
// per head were seen, W is solved, R^2 recorded per head (a head below `r2_threshold` routes
// nothing), the weights are saved (calibration_store.h) and the codec id changes to the new
// calibration version: chunks stored before are never served under it. While collecting, the
// accumulators are checkpointed to the same store every eighth of `calibration_tokens`, so a
// restart resumes from the last checkpoint (the tokens since it are lost); the checkpoint is
// removed once the weights are saved.
//
// Device (compression.device, ChooseIngestDevice): the pool compresses with the kernels' CPU plan
// (kernels::Compress) or their CUDA plan (kernels::DevicePlan). On CUDA each worker owns a
// DevicePlan with its own stream: the put's raw chunk and window queries are copied to the device
// once and only the compact chunk comes back. A chunk the CUDA plan fails on for a device reason
// (INTERNAL, RESOURCE_EXHAUSTED, UNAVAILABLE) is compressed by the CPU plan instead (counted in
// IngestStats::device_fallbacks; a WARNING log line for the first, then at most one a minute);
// bad input fails the put as on the CPU. On CUDA the stage times are device times.
//
// Stage times (Stats(), kvdctl stats, /metrics): every compressed chunk adds the kernels' per-stage
// times (CompressionStats::stage: convert, derotate, score, select, merge, route, encode; thread
// time of the stage summed over the chunk's (layer, KV head) pipelines) and the codec's own
// `serialize` (the compact chunk's bytes, kernels::EncodeCompactChunk). A chunk counts in a
// stage's `chunks` when that stage took time in it: a stage the policy does not run stays at 0,
// a lossless (too short) chunk counts in `serialize` only.
//
// Thread safety: every method is thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvd/common/status.h"
#include "kvd/daemon/calibration_store.h"
#include "kvd/daemon/config.h"

namespace kvd::daemon {

// What Encode produced.
struct EncodedChunk {
  std::vector<uint8_t> bytes;  // the compact chunk
  uint32_t codec_id = 0;       // the codec id it must be stored under
  bool lossless = false;       // the chunk was too short for the policy (see the file comment)
  int64_t half_pairs = 0;      // keys + stored values, summed over heads
  int64_t raw_half_pairs = 0;  // 2 * tokens * layers * kv heads
  double compress_ms = 0;      // time spent in Encode
};

// Calibration state of a model (kvdctl calibration).
struct CalibrationStatus {
  std::string state;  // "collecting", "calibrated", "not-routing"
  uint64_t tokens_seen = 0;
  uint64_t tokens_needed = 0;
  uint64_t version = 0;
  std::vector<double> r2;    // [layers * kv heads] once calibrated
  std::vector<bool> routes;  // r2 >= threshold
};

// Accumulated time of one compression stage since start (see the file comment).
struct IngestStageTime {
  std::string stage;    // convert | derotate | score | select | merge | route | encode | serialize
  uint64_t nanos = 0;   // summed over chunks
  uint64_t chunks = 0;  // chunks in which the stage took time
};

// Where a model's ingest compresses (ChooseIngestDevice).
struct IngestDevice {
  bool cuda = false;         // false: the CPU plan
  int ordinal = -1;          // the CUDA device when `cuda`
  std::string reason;        // why, one line: logged at start, shown by kvdctl stats
  std::string Name() const;  // "cpu" or "cuda:N"
};

// The choice for `policy` (compression.device, see compression_policy.h); `key` names the policy
// in errors (e.g. "models[0].compression"). `device_status` is what ProbeIngestDevice answered
// for the ordinal the policy names (device 0 for auto); tests pass their own. Order of the
// checks for auto and cuda: the device (UNIMPLEMENTED: built without CUDA; UNAVAILABLE: no
// device), then whether the CUDA plan implements the policy's stages (it does snapkv, pyramidkv,
// keydiff, recency, vector, the hybrid without vector; not kvslimmer alone, the hybrid with
// vector). auto falls back to the CPU plan with the
// reason; cuda[:N] is refused with INVALID_ARGUMENT "<key>.device: \"cuda\" cannot be honoured:
// <reason>". cpu is always the CPU plan.
StatusOr<IngestDevice> ChooseIngestDevice(const CompressionPolicy& policy, const std::string& key,
                                          const Status& device_status);
// OK when this process can run the CUDA plan on device `ordinal`; else UNIMPLEMENTED (built
// without CUDA) or UNAVAILABLE (no such device) naming the reason.
Status ProbeIngestDevice(int ordinal);
// ChooseIngestDevice for every model of `config` with a policy (keys models[i].compression): the
// first refusal; for a policy that routes (route: vector) also kernels::LoadBlas, so that a
// machine without a CBLAS library is refused at start (FAILED_PRECONDITION naming the libraries
// tried), not at the first chunk it compresses. kvd checks this before it starts (exit 2).
Status CheckIngestDevices(const DaemonConfig& config);

// What a model's ingest did since start (kvdctl stats).
struct IngestStats {
  std::string device;         // IngestDevice::Name()
  std::string device_reason;  // IngestDevice::reason
  // Chunks the CUDA plan failed on (a device error, out of device memory) that the CPU plan
  // compressed instead. The first is logged (WARNING), then at most one record a minute with the
  // count since the previous one.
  uint64_t device_fallbacks = 0;
  // Every stage of IngestStageNames(), in that order (zeros included).
  std::vector<IngestStageTime> stages;
  // A policy with an expected_attention stage: its query statistics hold `ea_queries` window
  // queries per layer (the fewest over layers, reloaded ones included) and score chunks from
  // `ea_min_queries` (the policy's) on; below, chunks are scored with KeyDiff. Both 0 for a policy
  // without that stage.
  uint64_t ea_queries = 0;
  uint64_t ea_min_queries = 0;
};

// The stage names of IngestStats::stages, in pipeline order.
const std::vector<std::string>& IngestStageNames();

class ChunkCodec {
 public:
  // A held admission (see the file comment); releasing it (destruction) frees the slot.
  using Ticket = std::shared_ptr<void>;

  // REQUIRES: model.compression is set and the config validated. The device is
  // ChooseIngestDevice(policy, key, ProbeIngestDevice(...)) (INVALID_ARGUMENT when refused) unless
  // `device` is given (tests). `store` is where solved VECTOR
  // weights are saved and, at Create, reloaded from (nullptr = not saved: a restart calibrates
  // again). A saved record that cannot be read, fails its checksums or has another shape is
  // refused with an ERROR log line naming it and the reason, and calibration starts again (never
  // an error of Create, never used). Errors: INVALID_ARGUMENT for a policy the kernels refuse.
  static StatusOr<std::unique_ptr<ChunkCodec>> Create(
      const ModelConfig& model, int chunk_tokens, std::unique_ptr<CalibrationStore> store,
      const std::string& key = "compression", std::optional<IngestDevice> device = std::nullopt);
  ~ChunkCodec();

  const CompressionPolicy& policy() const;
  const IngestDevice& device() const;
  // The codec id chunks are stored under and served from now.
  uint32_t codec_id() const;
  uint64_t calibration_version() const;

  // Bytes of W window-query tokens (all layers).
  uint64_t QueryBytes(uint32_t window) const;
  // Checks a put before bytes move: W must be 0 or the policy's window (INVALID_ARGUMENT naming
  // both), a policy that needs queries refuses W == 0 (FAILED_PRECONDITION naming the missing
  // queries), W <= tokens.
  Status CheckPut(uint32_t tokens, uint32_t window) const;

  // Takes an admission slot or returns RESOURCE_EXHAUSTED with a retry hint.
  StatusOr<Ticket> Admit();
  // Runs `job` on the pool; the ticket is released after it ran.
  void Submit(Ticket ticket, std::function<void()> job);

  // Compresses one put (raw chunk + window queries, see the file comment). Feeds VECTOR
  // calibration first when the policy routes and calibration is still collecting.
  // Errors: INVALID_ARGUMENT (sizes, NaN/Inf in K/V/queries), the kernels' errors.
  StatusOr<EncodedChunk> Encode(std::span<const uint8_t> put_bytes, uint32_t tokens,
                                uint64_t first_position, uint32_t window);

  // Stage times since start (see the file comment) and the query statistics' count.
  IngestStats Stats() const;

  CalibrationStatus Calibration() const;
  // Serialized VECTOR weights of `version`; NOT_FOUND unless that is the calibrated version.
  StatusOr<std::vector<uint8_t>> Weights(uint64_t version) const;

  struct Impl;

 private:
  explicit ChunkCodec(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvd::daemon
