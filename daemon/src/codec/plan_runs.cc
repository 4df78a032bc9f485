// One chunk's plan runs: the pool's CUDA workers, the CPU plan (and the CPU fallback of a
// failed CUDA run), and the heads a weak calibration takes from the plan without routing.
#include <memory>
#include <utility>
#include <vector>

#include "codec/chunk_codec_impl.h"
#include "kvd/common/logging.h"
#include "stage_policy.h"

namespace kvd::daemon {

std::unique_ptr<DeviceWorker> ChunkCodec::Impl::TakeDevice() {
  std::lock_guard lock(dev_mu);
  if (idle_devices.empty()) return std::make_unique<DeviceWorker>();
  auto w = std::move(idle_devices.back());
  idle_devices.pop_back();
  return w;
}

void ChunkCodec::Impl::ReturnDevice(std::unique_ptr<DeviceWorker> w) {
  std::lock_guard lock(dev_mu);
  idle_devices.push_back(std::move(w));
}

StatusOr<kk::CompactChunk> ChunkCodec::Impl::CompressOnDevice(
    DeviceWorker* w, const kk::CompressionPlanOptions& options, const kk::VectorWeights* weights,
    const kk::HostChunkInput& input, kk::CompressionStats* stats) {
  const kk::DevicePlanOptions o{.device = device.ordinal, .time_stages = true, .own_stream = true};
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

StatusOr<kk::CompactChunk> ChunkCodec::Impl::CompressChunk(const PutChunk& put,
                                                           const ChunkContext& context,
                                                           kk::CompressionStageTimes* stages) {
  PlanRuns runs(this, put, context.query_stats.get(), stages);
  const kk::VectorWeights* w = context.weights.get();
  kk::CompressionPlanOptions options = plan;
  // A route stage that needs a calibration (VECTOR) routes nothing until its weights exist.
  if (w == nullptr && NeedsCalibration(policy)) options.route = kk::RouteStage::kNone;
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

}  // namespace kvd::daemon
