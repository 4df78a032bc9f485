// ChunkCodec: policy -> kernels plan options, Encode, the ingest pool, VECTOR calibration.
#include "kvd/daemon/chunk_codec.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "codec/query_stats_record.h"
#include "kvd/common/hex.h"
#include "kvd/common/log_limiter.h"
#include "kvd/common/logging.h"
#include "kvd/daemon/calibration_store.h"
#include "kvd/kernels/compact_chunk.h"
#include "kvd/kernels/plan.h"
#include "kvd/kernels/plan_device.h"
#include "kvd/kernels/vector.h"
#include "stage_policy.h"

namespace kvd::daemon {

namespace kk = kvd::kernels;

namespace {

// A validated quant_format / quant_value_format name (not "none" / "same").
kk::QuantFormat QuantFormatOf(const std::string& name) {
  if (name == "int4") return kk::QuantFormat::kInt4;
  if (name == "int3") return kk::QuantFormat::kInt3;
  if (name == "int2") return kk::QuantFormat::kInt2;
  if (name == "fp8_e4m3") return kk::QuantFormat::kFp8E4M3;
  return kk::QuantFormat::kInt8;
}

kk::CompressionPlanOptions PlanOptions(const CompressionPolicy& p) {
  kk::CompressionPlanOptions o;
  SetPlanStages(p, &o);
  o.expected_attention.future_positions = p.ea_future_positions;
  o.expected_attention_min_queries = p.ea_min_queries;
  o.expected_attention.use_covariance = p.ea_covariance;
  o.expected_attention.keydiff_share = p.ea_keydiff_share;
  o.p_c = p.p_c;
  o.window = p.window;
  o.sinks = p.sinks;
  o.pooling_kernel = p.pooling_kernel;
  o.pooling = p.pooling == "max" ? kk::PoolingKind::kMax : kk::PoolingKind::kAvg;
  o.keydiff_block = p.keydiff_block;
  o.pyramid_beta = p.pyramid_beta;
  o.merge_norm = p.merge_norm == "l1code" ? kk::MergeNorm::kL1Code : kk::MergeNorm::kL2;
  o.position = p.position == "weighted" ? kk::RepresentativePosition::kWeighted
                                        : kk::RepresentativePosition::kLast;
  o.route_eps = p.route_eps;
  o.hybrid_max_group = p.max_group;
  o.hybrid_min_cos = p.min_cos;
  if (p.Quantizes()) {
    const kk::QuantFormat keys = QuantFormatOf(p.quant_format);
    const kk::QuantFormat values =
        p.quant_value_format == "same" ? keys : QuantFormatOf(p.quant_value_format);
    o.quant = {.format = keys,
               .key_group =
                   static_cast<uint32_t>(p.quant_key_group > 0 ? p.quant_key_group : p.quant_group),
               .value_group = static_cast<uint32_t>(p.quant_group),
               .recent = static_cast<uint32_t>(p.quant_recent),
               .rotation = p.quant_rotate == "hadamard" ? kk::QuantRotation::kHadamard
                                                        : kk::QuantRotation::kNone,
               .value_format = values == keys ? kk::QuantFormat::kNone : values};
  }
  return o;
}

// Every token a slot of cardinality 1 (see the header: chunks too short for the policy).
kk::CompactChunk LosslessChunk(const ModelLayout& layout, std::span<const uint8_t> raw, int64_t n,
                               uint64_t first_position) {
  kk::CompactChunk c = kk::CompactChunk::ForLayout(layout, n);
  const int H = layout.num_kv_heads;
  const size_t row = static_cast<size_t>(layout.head_dim) * DTypeSize(layout.dtype);
  const size_t half = static_cast<size_t>(n) * H * row;  // K (or V) of one layer
  for (int l = 0; l < layout.num_layers; ++l) {
    const uint8_t* k = raw.data() + 2 * half * l;
    const uint8_t* v = k + half;
    for (int h = 0; h < H; ++h) {
      kk::CompactHead& head = c.Head(l, h);
      head.keys.resize(n * row);
      head.values.resize(n * row);
      head.flags.assign(n, 0);
      head.cardinality.assign(n, 1);
      head.positions.resize(n);
      for (int64_t i = 0; i < n; ++i) {
        std::memcpy(head.keys.data() + i * row, k + (i * H + h) * row, row);
        std::memcpy(head.values.data() + i * row, v + (i * H + h) * row, row);
        head.positions[i] = static_cast<int64_t>(first_position) + i;
      }
    }
  }
  return c;
}

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

}  // namespace

const std::vector<std::string>& IngestStageNames() {
  static const std::vector<std::string> names = {"convert", "derotate", "score",  "select",
                                                 "merge",   "route",    "encode", "serialize"};
  return names;
}

std::string IngestDevice::Name() const { return cuda ? "cuda:" + std::to_string(ordinal) : "cpu"; }

Status ProbeIngestDevice(int ordinal) { return kk::CheckDevicePlanDevice(ordinal); }

StatusOr<IngestDevice> ChooseIngestDevice(const CompressionPolicy& policy, const std::string& key,
                                          const Status& device_status) {
  IngestDevice d;
  if (policy.device == "cpu") {
    d.reason = "compression.device is cpu";
    return d;
  }
  const bool asked = policy.device != "auto";
  const int ordinal = asked ? policy.CudaOrdinal() : 0;
  std::string why;
  if (!device_status.ok()) {
    why = device_status.message();
  } else if (Status s = kk::CheckDevicePlanSupported(PlanOptions(policy)); !s.ok()) {
    why = "the CUDA plan does not implement " + policy.StagesName() + " (" + s.message() + ")";
  }
  if (why.empty()) {
    d.cuda = true;
    d.ordinal = ordinal;
    d.reason = (asked ? "compression.device is " + policy.device : std::string("auto")) +
               ": CUDA device " + std::to_string(ordinal) + " runs the CUDA plan of " +
               policy.StagesName();
    return d;
  }
  if (asked) {
    return Status::InvalidArgument(key + ".device: \"" + policy.device +
                                   "\" cannot be honoured: " + why);
  }
  d.reason = "auto: " + why;
  return d;
}

Status CheckIngestDevices(const DaemonConfig& config) {
  for (size_t i = 0; i < config.models.size(); ++i) {
    const ModelConfig& m = config.models[i];
    if (!m.compression) continue;
    if (NeedsCalibration(*m.compression)) {
      KVD_RETURN_IF_ERROR(kk::LoadBlas().WithContext("models[" + std::to_string(i) +
                                                     "].compression.route: vector"));
    }
    if (m.compression->device == "cpu") continue;
    const int ordinal = std::max(0, m.compression->CudaOrdinal());
    KVD_RETURN_IF_ERROR(ChooseIngestDevice(*m.compression,
                                           "models[" + std::to_string(i) + "].compression",
                                           ProbeIngestDevice(ordinal))
                            .status());
  }
  return Status::Ok();
}

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

  std::unique_ptr<DeviceWorker> TakeDevice() {
    std::lock_guard lock(dev_mu);
    if (idle_devices.empty()) return std::make_unique<DeviceWorker>();
    auto w = std::move(idle_devices.back());
    idle_devices.pop_back();
    return w;
  }
  void ReturnDevice(std::unique_ptr<DeviceWorker> w) {
    std::lock_guard lock(dev_mu);
    idle_devices.push_back(std::move(w));
  }

  // Compresses a chunk in host memory with the worker's CUDA plan for `options` (route none, or
  // vector with `weights`), creating or replacing that plan when needed.
  StatusOr<kk::CompactChunk> CompressOnDevice(DeviceWorker* w,
                                              const kk::CompressionPlanOptions& options,
                                              const kk::VectorWeights* weights,
                                              const kk::HostChunkInput& input,
                                              kk::CompressionStats* stats) {
    const kk::DevicePlanOptions o{
        .device = device.ordinal, .time_stages = true, .own_stream = true};
    std::unique_ptr<kk::DevicePlan>* slot = &w->plain;
    if (weights != nullptr) {
      slot = &w->routed;
      if (*slot != nullptr && w->routed_version != weights->version) slot->reset();
    }
    if (*slot == nullptr) {
      KVD_ASSIGN_OR_RETURN(*slot, kk::DevicePlan::Create(options, model.layout, weights, o));
      if (weights != nullptr) w->routed_version = weights->version;
    }
    return (*slot)->CompressHost(input, stats);
  }

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
  Status StartQueryStatistics() {
    KVD_ASSIGN_OR_RETURN(kk::RopeTable rope,
                         kk::RopeTable::Create(model.layout.rope, model.layout.head_dim));
    KVD_ASSIGN_OR_RETURN(kk::QueryStatistics queries,
                         kk::QueryStatistics::Create(model.layout.num_layers,
                                                     model.layout.num_q_heads, rope));
    if (store != nullptr) {
      auto bytes = store->Load(query_record);
      Status bad = bytes.ok() ? Status::Ok() : bytes.status();
      if (bad.ok()) {
        auto saved = DeserializeQueryStatistics(*bytes, model.layout.num_layers,
                                                model.layout.num_q_heads, rope);
        if (saved.ok()) {
          queries = std::move(*saved);
          query_saved = queries.MinCount();
          KVD_LOG(INFO) << "expected-attention query statistics reloaded" << Kv("model", model.name)
                        << Kv("record", store->Where(query_record)) << Kv("queries", query_saved)
                        << Kv("needed", policy.ea_min_queries);
        } else {
          bad = saved.status();
        }
      }
      if (!bad.ok() && bad.code() != StatusCode::kNotFound) {
        KVD_LOG(ERROR) << "saved expected-attention query statistics refused, collecting from zero"
                       << Kv("model", model.name) << Kv("record", store->Where(query_record))
                       << Kv("status", bad);
      }
    }
    query_snapshot = std::make_shared<const kk::QueryStatistics>(std::move(queries));
    return Status::Ok();
  }

  // Adds a put's window queries (per layer [W, q_heads, d] float32, the last W of `positions`)
  // and returns the statistics to score it with. Saved every eighth of ea_min_queries (and
  // every put until then), so a restart resumes. A put whose queries cannot be added is scored
  // with the statistics as they were (logged).
  std::shared_ptr<const kk::QueryStatistics> AddQueries(std::span<const uint8_t> query_bytes,
                                                        uint32_t window,
                                                        std::span<const int64_t> positions) {
    std::lock_guard lock(query_mu);
    if (window == 0 || !query_snapshot) return query_snapshot;
    const size_t per_layer = query_bytes.size() / model.layout.num_layers;
    const std::span<const int64_t> qpos = positions.subspan(positions.size() - window);
    kk::QueryStatistics next = *query_snapshot;  // the one copy a put makes
    for (int l = 0; l < model.layout.num_layers; ++l) {
      const std::span<const float> q(
          reinterpret_cast<const float*>(query_bytes.data() + per_layer * l),
          per_layer / sizeof(float));
      if (Status s = next.Add(l, q, qpos); !s.ok()) {
        KVD_LOG(WARNING) << "expected-attention statistics skipped a put" << Kv("model", model.name)
                         << Kv("status", s);
        return query_snapshot;
      }
    }
    const bool became_ready = query_snapshot->MinCount() < policy.ea_min_queries &&
                              next.MinCount() >= policy.ea_min_queries;
    query_snapshot = std::make_shared<const kk::QueryStatistics>(std::move(next));
    const kk::QueryStatistics& queries = *query_snapshot;
    if (became_ready) {
      KVD_LOG(INFO) << "expected-attention query statistics ready: chunks are scored with them"
                    << Kv("model", model.name) << Kv("queries", queries.MinCount());
    }
    const int64_t step = std::max<int64_t>(1, policy.ea_min_queries / 8);
    const int64_t count = queries.MinCount();
    if (store != nullptr && (count < policy.ea_min_queries || count - query_saved >= step)) {
      if (Status p = store->Save(query_record, SerializeQueryStatistics(queries)); p.ok()) {
        query_saved = count;
      } else {
        KVD_LOG(WARNING) << "expected-attention query statistics not saved"
                         << Kv("model", model.name) << Kv("status", p);
      }
    }
    return query_snapshot;
  }

  // ---- stage times (Stats) ----
  std::array<std::atomic<uint64_t>, kIngestStages> stage_nanos{};
  std::array<std::atomic<uint64_t>, kIngestStages> stage_chunks{};

  // Adds one chunk's stage times (see the header: a stage counts when it took time).
  void AddStageTimes(const kk::CompressionStageTimes& t, int64_t serialize_ns) {
    const int64_t ns[kIngestStages] = {t.convert_ns, t.derotate_ns, t.score_ns,  t.select_ns,
                                       t.merge_ns,   t.route_ns,    t.encode_ns, serialize_ns};
    for (size_t i = 0; i < kIngestStages; ++i) {
      if (ns[i] <= 0) continue;
      stage_nanos[i].fetch_add(static_cast<uint64_t>(ns[i]), std::memory_order_relaxed);
      stage_chunks[i].fetch_add(1, std::memory_order_relaxed);
    }
  }

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

  void WorkerLoop() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return stopping || !queue.empty(); });
        if (queue.empty()) return;  // stopping and drained
        job = std::move(queue.front());
        queue.pop_front();
      }
      job();
    }
  }

  Status Persist() {
    if (store == nullptr) return Status::Ok();
    return store->Save(record, weights_bytes);
  }

  // Installs the saved weights of this model and policy when there are usable ones. A record
  // that cannot be read, fails its checksums or has another shape is refused with one ERROR
  // line naming it and the reason: calibration then starts again (and its result replaces the
  // record). Never fatal, never used when refused.
  void LoadSaved() {
    if (store == nullptr) return;
    LoadSavedWeights();
    if (weights == nullptr) LoadSavedProgress();
  }

  // Resumes a calibration still collecting from its last checkpoint (the same refusal rules as
  // the weights: unreadable, damaged or another shape is logged and collection starts at zero).
  void LoadSavedProgress() {
    const std::string where = store->Where(progress_record);
    auto bytes = store->Load(progress_record);
    Status bad = bytes.ok() ? Status::Ok() : bytes.status();
    if (bad.code() == StatusCode::kNotFound) return;
    std::optional<kk::VectorCalibrator> saved;
    if (bad.ok()) {
      auto c = kk::VectorCalibrator::Deserialize(*bytes);
      if (!c.ok()) {
        bad = c.status();
      } else if (c->num_layers() != model.layout.num_layers ||
                 c->num_kv_heads() != model.layout.num_kv_heads ||
                 c->head_dim() != model.layout.head_dim) {
        bad =
            Status::DataLoss("saved accumulators are for " + std::to_string(c->num_layers()) +
                             " layers x " + std::to_string(c->num_kv_heads()) +
                             " KV heads x head_dim " + std::to_string(c->head_dim()) +
                             ", the model's layout has " + std::to_string(model.layout.num_layers) +
                             " x " + std::to_string(model.layout.num_kv_heads) + " x " +
                             std::to_string(model.layout.head_dim));
      } else {
        saved = std::move(*c);
      }
    }
    if (!bad.ok()) {
      KVD_LOG(ERROR) << "saved VECTOR calibration progress refused, collecting from zero"
                     << Kv("model", model.name) << Kv("record", where) << Kv("status", bad);
      return;
    }
    std::lock_guard lock(cal_mu);
    calibrator = std::move(*saved);
    saved_count = calibrator->Head(0, 0).count;
    KVD_LOG(INFO) << "VECTOR calibration progress reloaded" << Kv("model", model.name)
                  << Kv("record", where) << Kv("tokens_seen", saved_count)
                  << Kv("tokens_needed", policy.calibration_tokens);
  }

  void LoadSavedWeights() {
    const std::string where = store->Where(record);
    auto bytes = store->Load(record);
    if (!bytes.ok()) {
      if (bytes.status().code() != StatusCode::kNotFound) {
        KVD_LOG(ERROR) << "saved VECTOR calibration refused, calibrating again"
                       << Kv("model", model.name) << Kv("record", where)
                       << Kv("status", bytes.status());
      }
      return;
    }
    auto w = kk::VectorWeights::Deserialize(*bytes);
    Status bad = w.ok() ? Status::Ok() : w.status();
    if (bad.ok() &&
        (w->num_layers != model.layout.num_layers || w->num_kv_heads != model.layout.num_kv_heads ||
         w->head_dim != model.layout.head_dim)) {
      bad = Status::DataLoss("saved weights are for " + std::to_string(w->num_layers) +
                             " layers x " + std::to_string(w->num_kv_heads) +
                             " KV heads x head_dim " + std::to_string(w->head_dim) +
                             ", the model's layout has " + std::to_string(model.layout.num_layers) +
                             " x " + std::to_string(model.layout.num_kv_heads) + " x " +
                             std::to_string(model.layout.head_dim));
    }
    if (!bad.ok()) {
      KVD_LOG(ERROR) << "saved VECTOR calibration refused, calibrating again"
                     << Kv("model", model.name) << Kv("record", where) << Kv("status", bad);
      return;
    }
    std::lock_guard lock(cal_mu);
    Install(std::move(*w));
    KVD_LOG(INFO) << "VECTOR calibration reloaded" << Kv("model", model.name) << Kv("record", where)
                  << Kv("version", Hex64(version.load())) << Kv("codec_id", codec_id.load());
  }

  // REQUIRES cal_mu held.
  void Install(kk::VectorWeights w) {
    weights_bytes = w.Serialize();
    version = w.version;
    codec_id = policy.CodecId(w.version);
    weights = std::make_shared<const kk::VectorWeights>(std::move(w));
    calibrator.reset();
  }

  // Feeds calibration (route == vector, still collecting) and solves when enough tokens.
  void Calibrate(std::span<const uint8_t> raw, std::span<const int64_t> positions) {
    std::lock_guard lock(cal_mu);
    if (!calibrator) return;
    kk::ExecOptions exec;
    exec.num_threads = 1;
    Status s = kk::CalibrateFromChunk(model.layout, raw, positions, &*calibrator, exec);
    if (!s.ok()) {
      KVD_LOG(WARNING) << "calibration skipped a chunk" << Kv("model", model.name)
                       << Kv("status", s);
      return;
    }
    const int64_t count = calibrator->Head(0, 0).count;
    if (count < policy.calibration_tokens) {
      // Checkpoint every eighth of the way, so a restart resumes instead of starting over.
      const int64_t step = std::max<int64_t>(1, policy.calibration_tokens / 8);
      if (store != nullptr && count - saved_count >= step) {
        const std::vector<uint8_t> bytes = calibrator->Serialize();
        if (Status p = store->Save(progress_record, bytes); p.ok()) {
          saved_count = count;
        } else {
          KVD_LOG(WARNING) << "VECTOR calibration progress not saved" << Kv("model", model.name)
                           << Kv("status", p);
        }
      }
      return;
    }
    auto solved = calibrator->Solve();
    if (!solved.ok()) {
      KVD_LOG(WARNING) << "calibration solve failed; collecting more" << Kv("model", model.name)
                       << Kv("status", solved.status());
      return;
    }
    Install(std::move(*solved));
    Status p = Persist();
    KVD_LOG(INFO) << "VECTOR calibration complete" << Kv("model", model.name)
                  << Kv("version", Hex64(version.load())) << Kv("codec_id", codec_id.load())
                  << Kv("saved", store == nullptr ? std::string("no (no disk tier, no state_dir)")
                                 : p.ok()         ? store->Where(record)
                                                  : p.ToString());
    if (!p.ok()) {
      KVD_LOG(ERROR) << "VECTOR calibration not saved: a restart calibrates again"
                     << Kv("model", model.name) << Kv("status", p);
    } else if (store != nullptr) {
      if (Status r = store->Remove(progress_record); !r.ok()) {
        KVD_LOG(WARNING) << "VECTOR calibration progress record not removed (it is not used "
                            "while the weights load)"
                         << Kv("model", model.name) << Kv("status", r);
      }
    }
  }
};

// The plan runs of one chunk (one, or two when weak heads are taken from the plan without
// routing), on the pool's CUDA worker when the codec has a device, else on the CPU; a CUDA
// failure that the CPU plan may recover from (internal, resource exhausted, unavailable) runs it
// on the CPU plan. Holds the worker until destroyed.
class ChunkCodec::Impl::PlanRuns {
 public:
  PlanRuns(Impl* impl, const PutChunk& put, const kk::QueryStatistics* query_stats,
           kk::CompressionStageTimes* stages)
      : impl_(impl), put_(put), query_stats_(query_stats), stages_(stages) {
    if (impl_->device.cuda) worker_ = impl_->TakeDevice();
  }
  ~PlanRuns() {
    if (worker_ != nullptr) impl_->ReturnDevice(std::move(worker_));
  }
  PlanRuns(const PlanRuns&) = delete;
  PlanRuns& operator=(const PlanRuns&) = delete;

  // One run of the plan for `o` (route none, or vector with `w`), its stage times added.
  StatusOr<kk::CompactChunk> Run(const kk::CompressionPlanOptions& o, const kk::VectorWeights* w) {
    if (worker_ != nullptr) {
      auto c = RunOnDevice(o, w);
      if (c.ok()) return c;
      const StatusCode code = c.status().code();
      if (code != StatusCode::kInternal && code != StatusCode::kResourceExhausted &&
          code != StatusCode::kUnavailable) {
        return c.status();
      }
      LogFallback(c.status());
    }
    return RunOnCpu(o, w);
  }

 private:
  StatusOr<kk::CompactChunk> RunOnDevice(const kk::CompressionPlanOptions& o,
                                         const kk::VectorWeights* w) {
    kk::CompressionStats stats;
    kk::HostChunkInput in{.raw = put_.raw,
                          .positions = put_.positions,
                          .window_queries = put_.window_queries,
                          .window_queries_float32 = true};
    auto c = impl_->CompressOnDevice(worker_.get(), o, w, in, &stats);
    if (c.ok()) *stages_ += stats.stage;
    return c;
  }

  void LogFallback(const Status& status) {
    if (const uint64_t chunks = impl_->fallback_log.Occur(); chunks > 0) {
      KVD_LOG(WARNING) << "CUDA plan failed on a chunk; the CPU plan compresses it (logged "
                          "at most once a minute)"
                       << Kv("model", impl_->model.name) << Kv("device", impl_->device.Name())
                       << Kv("status", status) << Kv("chunks_since_last_record", chunks)
                       << Kv("chunks_total", impl_->fallback_log.total());
    }
  }

  StatusOr<kk::CompactChunk> RunOnCpu(const kk::CompressionPlanOptions& o,
                                      const kk::VectorWeights* w) {
    KVD_RETURN_IF_ERROR(GatherCpuQueries());
    kk::CompressionInput input;
    input.raw = put_.raw;
    input.positions = put_.positions;
    input.window_queries = views_;
    input.weights = w;
    input.query_stats = query_stats_;
    kk::ExecOptions exec;
    exec.num_threads = 1;  // the pool's threads are the parallelism
    kk::CompressionStats stats;
    KVD_ASSIGN_OR_RETURN(auto c, kk::Compress(o, impl_->model.layout, input, &stats, exec));
    *stages_ += stats.stage;
    return c;
  }

  // The CPU plan's input, built on first use: the window queries rearranged per (layer, KV head).
  Status GatherCpuQueries() {
    if (cpu_queries_ready_ || put_.window == 0) return Status::Ok();
    const ModelLayout& layout = impl_->model.layout;
    ModelLayout f32 = layout;
    f32.dtype = DType::kFloat32;
    const uint64_t per_layer = put_.window_queries.size() / layout.num_layers;
    for (int l = 0; l < layout.num_layers; ++l) {
      KVD_ASSIGN_OR_RETURN(
          auto m,
          kk::GatherWindowQueries(f32, put_.window_queries.data() + per_layer * l, put_.window));
      for (auto& mat : m) queries_.push_back(std::move(mat));
    }
    for (const auto& m : queries_) views_.push_back(m.View());
    cpu_queries_ready_ = true;
    return Status::Ok();
  }

  Impl* impl_;
  const PutChunk& put_;
  const kk::QueryStatistics* query_stats_;
  kk::CompressionStageTimes* stages_;
  std::unique_ptr<DeviceWorker> worker_;  // null when the codec has no CUDA device
  std::vector<kk::Matrix> queries_;
  std::vector<kk::ConstMatrixView> views_;
  bool cpu_queries_ready_ = false;
};

ChunkCodec::Impl::ChunkContext ChunkCodec::Impl::Observe(const PutChunk& put) {
  if (NeedsCalibration(policy)) Calibrate(put.raw, put.positions);
  ChunkContext context;
  if (NeedsQueryStats(policy)) {
    context.query_stats = AddQueries(put.window_queries, put.window, put.positions);
  }
  std::lock_guard lock(cal_mu);
  context.weights = weights;
  return context;
}

bool ChunkCodec::Impl::StoresLossless(int64_t tokens, uint32_t window) const {
  const int64_t forced = policy.sinks + (window > 0 ? policy.window : 0);
  const int64_t kept = std::llround((1.0 - policy.p_c) * static_cast<double>(tokens));
  return tokens < policy.sinks + policy.window + 1 || kept < forced;
}

StatusOr<kk::CompactChunk> ChunkCodec::Impl::CompressChunk(const PutChunk& put,
                                                           const ChunkContext& context,
                                                           kk::CompressionStageTimes* stages) {
  PlanRuns runs(this, put, context.query_stats.get(), stages);
  const kk::VectorWeights* w = context.weights.get();
  kk::CompressionPlanOptions options = plan;
  if (w == nullptr) options.route = kk::RouteStage::kNone;
  KVD_ASSIGN_OR_RETURN(kk::CompactChunk chunk, runs.Run(options, w));
  if (w == nullptr) return chunk;
  // Heads whose calibration fit is below the threshold route nothing: take them from the same
  // plan without routing (each head meets its budget on its own, so the total stays).
  std::vector<size_t> weak;
  for (size_t i = 0; i < w->heads.size(); ++i) {
    if (w->heads[i].r2 < policy.r2_threshold) weak.push_back(i);
  }
  if (!weak.empty()) {
    options.route = kk::RouteStage::kNone;
    KVD_ASSIGN_OR_RETURN(kk::CompactChunk plain, runs.Run(options, nullptr));
    for (size_t i : weak) chunk.heads[i] = std::move(plain.heads[i]);
  }
  chunk.codec.calibration_version = w->version;
  return chunk;
}

Status ChunkCodec::Impl::Serialize(const kk::CompactChunk& chunk, int64_t tokens,
                                   const kk::CompressionStageTimes& stages, EncodedChunk* out) {
  const ModelLayout& layout = model.layout;
  out->half_pairs = chunk.HalfPairs();
  out->raw_half_pairs = 2 * tokens * layout.num_layers * layout.num_kv_heads;
  const auto start = std::chrono::steady_clock::now();
  KVD_ASSIGN_OR_RETURN(out->bytes, kk::EncodeCompactChunk(chunk));
  const auto end = std::chrono::steady_clock::now();
  AddStageTimes(stages,
                std::max<int64_t>(
                    1, std::chrono::duration_cast<std::chrono::nanoseconds>(end - start).count()));
  return Status::Ok();
}

ChunkCodec::ChunkCodec(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ChunkCodec::~ChunkCodec() {
  {
    std::lock_guard lock(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  for (auto& t : impl_->threads) t.join();
}

StatusOr<std::unique_ptr<ChunkCodec>> ChunkCodec::Create(const ModelConfig& model, int chunk_tokens,
                                                         std::unique_ptr<CalibrationStore> store,
                                                         const std::string& key,
                                                         std::optional<IngestDevice> device) {
  if (!model.compression) {
    return Status::InvalidArgument("model " + model.name + " has no compression policy");
  }
  auto impl = std::make_unique<Impl>();
  impl->model = model;
  impl->policy = *model.compression;
  impl->plan = PlanOptions(impl->policy);
  KVD_RETURN_IF_ERROR(impl->plan.Validate().WithContext("compression policy of " + model.name));
  if (device) {
    impl->device = *device;
  } else {
    const Status probe = impl->policy.device == "cpu"
                             ? Status::Ok()
                             : ProbeIngestDevice(std::max(0, impl->policy.CudaOrdinal()));
    KVD_ASSIGN_OR_RETURN(impl->device, ChooseIngestDevice(impl->policy, key, probe));
  }
  KVD_LOG(INFO) << "ingest device" << Kv("model", model.name) << Kv("device", impl->device.Name())
                << Kv("reason", impl->device.reason);
  (void)chunk_tokens;
  impl->codec_id = impl->policy.CodecId(0);
  if (NeedsCalibration(impl->policy) || NeedsQueryStats(impl->policy)) {
    impl->store = std::move(store);
  }
  if (NeedsQueryStats(impl->policy)) {
    // The statistics score chunks but never change how a chunk is served: the codec id stays.
    impl->query_record = CalibrationRecordName("query-statistics", model.name,
                                               model.layout.Digest(), impl->policy.Digest());
    KVD_RETURN_IF_ERROR(impl->StartQueryStatistics().WithContext("model " + model.name));
  }
  if (NeedsCalibration(impl->policy)) {
    impl->record = CalibrationRecordName("vector-weights", model.name, model.layout.Digest(),
                                         impl->policy.Digest());
    impl->progress_record = CalibrationRecordName("vector-accumulators", model.name,
                                                  model.layout.Digest(), impl->policy.Digest());
    impl->LoadSaved();
    if (impl->weights == nullptr && !impl->calibrator) {
      KVD_ASSIGN_OR_RETURN(
          auto cal, kk::VectorCalibrator::Create(model.layout.num_layers, model.layout.num_kv_heads,
                                                 model.layout.head_dim));
      impl->calibrator = std::move(cal);
    }
  }
  for (int i = 0; i < impl->policy.worker_threads; ++i) {
    impl->threads.emplace_back([p = impl.get()] { p->WorkerLoop(); });
  }
  return std::unique_ptr<ChunkCodec>(new ChunkCodec(std::move(impl)));
}

const CompressionPolicy& ChunkCodec::policy() const { return impl_->policy; }
const IngestDevice& ChunkCodec::device() const { return impl_->device; }
uint32_t ChunkCodec::codec_id() const { return impl_->codec_id.load(); }
uint64_t ChunkCodec::calibration_version() const { return impl_->version.load(); }

uint64_t ChunkCodec::QueryBytes(uint32_t window) const {
  const ModelLayout& l = impl_->model.layout;
  return uint64_t{window} * l.num_layers * l.num_q_heads * l.head_dim * sizeof(float);
}

Status ChunkCodec::CheckPut(uint32_t tokens, uint32_t window) const {
  const CompressionPolicy& p = impl_->policy;
  if (window != 0 && window != static_cast<uint32_t>(p.window)) {
    return Status::InvalidArgument("windowTokens " + std::to_string(window) +
                                   " is neither 0 nor the policy's window " +
                                   std::to_string(p.window) + " of model " + impl_->model.name);
  }
  if (window > tokens) {
    return Status::InvalidArgument("windowTokens " + std::to_string(window) + " > tokens " +
                                   std::to_string(tokens));
  }
  if (window == 0 && p.NeedsQueries()) {
    return Status::FailedPrecondition(
        "model " + impl_->model.name + "'s compression policy (" + p.StagesName() +
        ") needs the window queries: send the post-RoPE queries of the chunk's last " +
        std::to_string(p.window) +
        " tokens with the put (windowTokens=" + std::to_string(p.window) + ")");
  }
  return Status::Ok();
}

StatusOr<ChunkCodec::Ticket> ChunkCodec::Admit() {
  const int depth = impl_->policy.queue_depth;
  int cur = impl_->admitted.load();
  while (true) {
    if (cur >= depth) {
      return Status::ResourceExhausted("ingest queue of model " + impl_->model.name + " is full (" +
                                       std::to_string(cur) + " chunks admitted, queue_depth " +
                                       std::to_string(depth) + "); retry the put after ~50 ms");
    }
    if (impl_->admitted.compare_exchange_weak(cur, cur + 1)) break;
  }
  Impl* impl = impl_.get();
  return Ticket(static_cast<void*>(impl), [impl](void*) { impl->admitted.fetch_sub(1); });
}

void ChunkCodec::Submit(Ticket ticket, std::function<void()> job) {
  {
    std::lock_guard lock(impl_->mu);
    impl_->queue.push_back([ticket = std::move(ticket), job = std::move(job)]() mutable {
      job();
      ticket.reset();
    });
  }
  impl_->cv.notify_one();
}

StatusOr<EncodedChunk> ChunkCodec::Encode(std::span<const uint8_t> put_bytes, uint32_t tokens,
                                          uint64_t first_position, uint32_t window) {
  const auto start = std::chrono::steady_clock::now();
  const uint64_t raw_bytes = impl_->model.layout.ChunkBytes(static_cast<int>(tokens));
  if (put_bytes.size() != raw_bytes + QueryBytes(window)) {
    return Status::InvalidArgument("put of " + std::to_string(put_bytes.size()) +
                                   " bytes != " + std::to_string(raw_bytes) + " raw + " +
                                   std::to_string(QueryBytes(window)) + " window-query bytes");
  }
  KVD_RETURN_IF_ERROR(CheckPut(tokens, window));
  PutChunk put{.raw = put_bytes.first(raw_bytes),
               .window_queries = put_bytes.subspan(raw_bytes),
               .window = window,
               .positions = std::vector<int64_t>(tokens)};
  for (int64_t i = 0; i < int64_t{tokens}; ++i) {
    put.positions[i] = static_cast<int64_t>(first_position) + i;
  }
  const Impl::ChunkContext context = impl_->Observe(put);
  EncodedChunk out;
  out.codec_id = impl_->policy.CodecId(context.weights ? context.weights->version : 0);
  kk::CompactChunk chunk;
  kk::CompressionStageTimes stages;  // summed over the plan runs of this chunk
  if (impl_->StoresLossless(tokens, window)) {
    chunk = LosslessChunk(impl_->model.layout, put.raw, tokens, first_position);
    out.lossless = true;
  } else {
    KVD_ASSIGN_OR_RETURN(chunk, impl_->CompressChunk(put, context, &stages));
  }
  KVD_RETURN_IF_ERROR(impl_->Serialize(chunk, tokens, stages, &out));
  const auto end = std::chrono::steady_clock::now();
  out.compress_ms = std::chrono::duration<double, std::milli>(end - start).count();
  return out;
}

IngestStats ChunkCodec::Stats() const {
  IngestStats s;
  s.device = impl_->device.Name();
  s.device_reason = impl_->device.reason;
  s.device_fallbacks = impl_->fallback_log.total();
  const auto& names = IngestStageNames();
  for (size_t i = 0; i < kIngestStages; ++i) {
    s.stages.push_back({names[i], impl_->stage_nanos[i].load(std::memory_order_relaxed),
                        impl_->stage_chunks[i].load(std::memory_order_relaxed)});
  }
  if (NeedsQueryStats(impl_->policy)) {
    s.ea_min_queries = static_cast<uint64_t>(impl_->policy.ea_min_queries);
    std::lock_guard lock(impl_->query_mu);
    if (impl_->query_snapshot) {
      s.ea_queries = static_cast<uint64_t>(impl_->query_snapshot->MinCount());
    }
  }
  return s;
}

CalibrationStatus ChunkCodec::Calibration() const {
  CalibrationStatus s;
  const CompressionPolicy& p = impl_->policy;
  s.tokens_needed = static_cast<uint64_t>(p.calibration_tokens);
  std::lock_guard lock(impl_->cal_mu);
  if (!NeedsCalibration(p)) {
    s.state = "not-routing";
    return s;
  }
  if (impl_->weights) {
    s.state = "calibrated";
    s.version = impl_->weights->version;
    for (const auto& h : impl_->weights->heads) {
      s.r2.push_back(h.r2);
      s.routes.push_back(h.r2 >= p.r2_threshold);
    }
    s.tokens_seen = impl_->weights->heads.empty() ? 0 : impl_->weights->heads[0].count;
  } else {
    s.state = "collecting";
    s.tokens_seen = impl_->calibrator ? impl_->calibrator->Head(0, 0).count : 0;
  }
  return s;
}

StatusOr<std::vector<uint8_t>> ChunkCodec::Weights(uint64_t version) const {
  std::lock_guard lock(impl_->cal_mu);
  if (!impl_->weights || impl_->weights->version != version) {
    return Status::NotFound(
        "model " + impl_->model.name + " has no VECTOR weights of version " + Hex64(version) +
        " (current: " + (impl_->weights ? Hex64(impl_->weights->version) : "none") + ")");
  }
  return impl_->weights_bytes;
}

}  // namespace kvd::daemon
