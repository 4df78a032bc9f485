// The ChunkCodec's private parts, shared by the files of daemon/src/codec/: the codec's state
// (ChunkCodec::Impl) and what one put is made of. Each concept's methods live in a file of their
// own:
//   chunk_codec.cc         Create, the ingest pool, Encode (lossless or compressed), stage times
//   ingest_device.cc       which device a model's ingest compresses on (ChooseIngestDevice)
//   plan_runs.cc           one chunk's plan runs: the CUDA workers, the CPU fallback, weak heads
//   vector_calibration.cc  VECTOR calibration: feeding, solving, saving and reloading the weights
//   query_statistics.cc    the expected-attention query statistics: adding, saving, reloading
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "kvd/common/log_limiter.h"
#include "kvd/daemon/calibration_store.h"
#include "kvd/daemon/chunk_codec.h"
#include "kvd/kernels/compact_chunk.h"
#include "kvd/kernels/plan.h"
#include "kvd/kernels/plan_device.h"
#include "kvd/kernels/vector.h"

namespace kvd::daemon {

namespace kk = kvd::kernels;

// Index of each stage in IngestStageNames().
enum IngestStage : size_t {
  kConvert,
  kDerotate,
  kScore,
  kSelect,
  kMerge,
  kRoute,
  kEncode,
  kSerialize,
  kIngestStages
};

// One put as Encode splits it: the chunk's raw KV rows, then its window queries (float32 on the
// wire, empty when window is 0), and the absolute position of each token.
struct PutChunk {
  std::span<const uint8_t> raw;
  std::span<const uint8_t> window_queries;
  uint32_t window = 0;
  std::vector<int64_t> positions;
};

// One worker's CUDA plans (the pool hands one to each running Encode): without routing, and
// with the VECTOR weights of `routed_version`. Each owns its stream.
struct DeviceWorker {
  std::unique_ptr<kk::DevicePlan> plain;
  std::unique_ptr<kk::DevicePlan> routed;
  uint64_t routed_version = 0;
};

struct ChunkCodec::Impl {
  ModelConfig model;
  CompressionPolicy policy;
  kk::CompressionPlanOptions plan;
  IngestDevice device;

  // ---- CUDA plans (device.cuda) ----
  LogLimiter fallback_log{std::chrono::minutes(1)};  // counts IngestStats::device_fallbacks
  std::mutex dev_mu;
  std::vector<std::unique_ptr<DeviceWorker>> idle_devices;  // guarded by dev_mu

  std::unique_ptr<DeviceWorker> TakeDevice();
  void ReturnDevice(std::unique_ptr<DeviceWorker> w);

  // Compresses a chunk in host memory with the worker's CUDA plan for `options` (route none, or
  // vector with `weights`), creating or replacing that plan when needed.
  StatusOr<kk::CompactChunk> CompressOnDevice(DeviceWorker* w,
                                              const kk::CompressionPlanOptions& options,
                                              const kk::VectorWeights* weights,
                                              const kk::HostChunkInput& input,
                                              kk::CompressionStats* stats);

  std::unique_ptr<CalibrationStore> store;  // nullptr = not persisted
  std::string record;                       // the solved weights' record (CalibrationRecordName)
  std::string progress_record;              // the accumulators' record while collecting

  // ---- pool ----
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;  // guarded by mu
  bool stopping = false;                    // guarded by mu
  std::atomic<int> admitted{0};
  std::vector<std::thread> threads;

  // ---- calibration (route == vector) ----
  mutable std::mutex cal_mu;
  std::optional<kk::VectorCalibrator> calibrator;  // guarded by cal_mu; while collecting
  int64_t saved_count = 0;  // guarded by cal_mu; tokens per head in the last progress checkpoint
  std::shared_ptr<const kk::VectorWeights> weights;  // guarded by cal_mu; once calibrated
  std::vector<uint8_t> weights_bytes;                // guarded by cal_mu
  std::atomic<uint32_t> codec_id{0};
  std::atomic<uint64_t> version{0};

  // ---- expected-attention query statistics (score == expected_attention) ----
  std::string query_record;  // CalibrationRecordName("query-statistics", ...)
  mutable std::mutex query_mu;
  // guarded by query_mu: every query seen so far, the statistics chunks are scored with; a put
  // replaces it (readers keep the one they took). Null until StartQueryStatistics.
  std::shared_ptr<const kk::QueryStatistics> query_snapshot;
  int64_t query_saved = 0;  // guarded by query_mu; queries per layer in the saved record

  // Creates the statistics, reloading the saved record when there is a usable one (a record
  // that cannot be read, fails its checksum or has another shape is refused with one ERROR line
  // and accumulation starts at zero, as VECTOR's).
  Status StartQueryStatistics();

  // Adds a put's window queries (per layer [W, q_heads, d] float32, the last W of `positions`)
  // and returns the statistics to score it with. Saved every eighth of ea_min_queries (and
  // every put until then), so a restart resumes. A put whose queries cannot be added is scored
  // with the statistics as they were (logged).
  std::shared_ptr<const kk::QueryStatistics> AddQueries(std::span<const uint8_t> query_bytes,
                                                        uint32_t window,
                                                        std::span<const int64_t> positions);

  // ---- stage times (Stats) ----
  std::array<std::atomic<uint64_t>, kIngestStages> stage_nanos{};
  std::array<std::atomic<uint64_t>, kIngestStages> stage_chunks{};

  // Adds one chunk's stage times (see the header: a stage counts when it took time).
  void AddStageTimes(const kk::CompressionStageTimes& t, int64_t serialize_ns);

  // ---- one chunk's encoding (Encode) ----
  // What a chunk is compressed with: the query statistics it is scored with (null unless the
  // policy scores with expected attention) and the VECTOR weights (null until calibrated).
  struct ChunkContext {
    std::shared_ptr<const kk::QueryStatistics> query_stats;
    std::shared_ptr<const kk::VectorWeights> weights;
  };
  class PlanRuns;

  // Feeds the put to calibration and to the query statistics where the policy needs them, and
  // returns the context its chunk is compressed with.
  ChunkContext Observe(const PutChunk& put);
  // True when a chunk of `tokens` cannot keep more than its sinks and window: it is stored
  // lossless.
  bool StoresLossless(int64_t tokens, uint32_t window) const;
  // Runs the plan on the chunk (routed when there are weights, with weakly calibrated heads taken
  // from the plan without routing), adding the stage times to `stages`.
  StatusOr<kk::CompactChunk> CompressChunk(const PutChunk& put, const ChunkContext& context,
                                           kk::CompressionStageTimes* stages);
  // Serializes `chunk`, compressed from `tokens` raw tokens, into `out` (bytes and half-pair
  // counts) and records the chunk's stage times, serialization included.
  Status Serialize(const kk::CompactChunk& chunk, int64_t tokens,
                   const kk::CompressionStageTimes& stages, EncodedChunk* out);

  // Runs the pool's jobs until stopping and the queue is drained (each pool thread).
  void WorkerLoop();

  // Saves the solved weights to the store (OK when there is none).
  Status Persist();

  // Installs the saved weights of this model and policy when there are usable ones. A record
  // that cannot be read, fails its checksums or has another shape is refused with one ERROR
  // line naming it and the reason: calibration then starts again (and its result replaces the
  // record). Never fatal, never used when refused.
  void LoadSaved();

  // Resumes a calibration still collecting from its last checkpoint (the same refusal rules as
  // the weights: unreadable, damaged or another shape is logged and collection starts at zero).
  void LoadSavedProgress();

  void LoadSavedWeights();

  // REQUIRES cal_mu held.
  void Install(kk::VectorWeights w);

  // Feeds calibration (route == vector, still collecting) and solves when enough tokens.
  void Calibrate(std::span<const uint8_t> raw, std::span<const int64_t> positions);
};

}  // namespace kvd::daemon
