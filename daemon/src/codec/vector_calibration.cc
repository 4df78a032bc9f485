// VECTOR calibration (policy route = vector): feeding the accumulators, solving, saving and
// reloading the weights and the progress checkpoints; ChunkCodec::Calibration and ::Weights.
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "codec/chunk_codec_impl.h"
#include "kvd/common/hex.h"
#include "kvd/common/logging.h"
#include "stage_policy.h"

namespace kvd::daemon {

Status ChunkCodec::Impl::Persist() {
  if (store == nullptr) return Status::Ok();
  return store->Save(record, weights_bytes);
}

void ChunkCodec::Impl::LoadSaved() {
  if (store == nullptr) return;
  LoadSavedWeights();
  if (weights == nullptr) LoadSavedProgress();
}

void ChunkCodec::Impl::LoadSavedProgress() {
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
      bad = Status::DataLoss("saved accumulators are for " + std::to_string(c->num_layers()) +
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

void ChunkCodec::Impl::LoadSavedWeights() {
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
    bad = Status::DataLoss(
        "saved weights are for " + std::to_string(w->num_layers) + " layers x " +
        std::to_string(w->num_kv_heads) + " KV heads x head_dim " + std::to_string(w->head_dim) +
        ", the model's layout has " + std::to_string(model.layout.num_layers) + " x " +
        std::to_string(model.layout.num_kv_heads) + " x " + std::to_string(model.layout.head_dim));
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

void ChunkCodec::Impl::Install(kk::VectorWeights w) {
  weights_bytes = w.Serialize();
  version = w.version;
  codec_id = policy.CodecId(w.version);
  weights = std::make_shared<const kk::VectorWeights>(std::move(w));
  calibrator.reset();
}

void ChunkCodec::Impl::Calibrate(std::span<const uint8_t> raw, std::span<const int64_t> positions) {
  std::lock_guard lock(cal_mu);
  if (!calibrator) return;
  kk::ExecOptions exec;
  exec.num_threads = 1;
  Status s = kk::CalibrateFromChunk(model.layout, raw, positions, &*calibrator, exec);
  if (!s.ok()) {
    KVD_LOG(WARNING) << "calibration skipped a chunk" << Kv("model", model.name) << Kv("status", s);
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
