// ChunkCodec: Create, the ingest pool, Encode (a put stored lossless or compressed by the plan)
// and the stage times. The rest of the codec is in the files chunk_codec_impl.h lists.
#include "kvd/daemon/chunk_codec.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "codec/chunk_codec_impl.h"
#include "kvd/common/logging.h"
#include "stage_policy.h"

namespace kvd::daemon {

namespace {

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

}  // namespace

const std::vector<std::string>& IngestStageNames() {
  static const std::vector<std::string> names = {"convert", "derotate", "score",  "select",
                                                 "merge",   "route",    "encode", "serialize"};
  return names;
}

void ChunkCodec::Impl::AddStageTimes(const kk::CompressionStageTimes& t, int64_t serialize_ns) {
  const int64_t ns[kIngestStages] = {t.convert_ns, t.derotate_ns, t.score_ns,  t.select_ns,
                                     t.merge_ns,   t.route_ns,    t.encode_ns, serialize_ns};
  for (size_t i = 0; i < kIngestStages; ++i) {
    if (ns[i] <= 0) continue;
    stage_nanos[i].fetch_add(static_cast<uint64_t>(ns[i]), std::memory_order_relaxed);
    stage_chunks[i].fetch_add(1, std::memory_order_relaxed);
  }
}

void ChunkCodec::Impl::WorkerLoop() {
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
    s.ea_min_queries = static_cast<uint64_t>(impl_->plan.expected_attention_min_queries);
    std::lock_guard lock(impl_->query_mu);
    if (impl_->query_snapshot) {
      s.ea_queries = static_cast<uint64_t>(impl_->query_snapshot->MinCount());
    }
  }
  return s;
}

}  // namespace kvd::daemon
