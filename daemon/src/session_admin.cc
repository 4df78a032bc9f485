// Session requests for kvdctl: stats, list, evict, health (any role).
#include "kvd/common/logging.h"
#include "kvd/proto/convert.h"
#include "kvd/storage/host_tier.h"
#include "kvd/storage/tier_manager.h"
#include "responses.h"
#include "session.h"
#include "stage_policy.h"

namespace kvd::daemon {

namespace {

void FillGroups(const std::map<std::string, storage::UsageStats>& groups,
                capnp::List<proto::GroupStats>::Builder out) {
  unsigned i = 0;
  for (const auto& [name, usage] : groups) {
    out[i].setName(name);
    out[i].setChunks(usage.chunks);
    out[i].setBytes(usage.bytes);
    ++i;
  }
}

}  // namespace

void Session::HandleStats(uint64_t seq, uint64_t rid) {
  const DaemonConfig& config = server_->config();
  const StatsSnapshot snap = server_->Snapshot();
  const auto& tiers = snap.tiers;
  const auto& counters = snap.counters;
  std::map<std::string, storage::UsageStats> namespaces = snap.per_namespace;
  if (engine_) {
    std::erase_if(namespaces, [&](const auto& entry) { return entry.first != name_space_; });
  }
  Complete(seq, MakeResponse(rid, [&](proto::Response::Builder r) {
             auto reply = r.initStats();
             reply.setNodeName(snap.node_name);
             reply.setUptimeMs(static_cast<uint64_t>(snap.uptime_ms));
             reply.setSessions(static_cast<uint32_t>(snap.sessions));
             auto out_tiers = reply.initTiers(static_cast<unsigned>(tiers.size()));
             for (unsigned i = 0; i < tiers.size(); ++i) {
               const storage::TierStats& ts = tiers[i];
               auto t = out_tiers[i];
               t.setName(std::string(storage::TierKindName(ts.kind)));
               t.setCapacityBytes(ts.capacity_bytes);
               t.setUsedBytes(ts.used_bytes);
               t.setReservedBytes(ts.reserved_bytes);
               t.setPinnedBytes(ts.pinned_bytes);
               t.setChunks(ts.chunk_count);
               t.setEvictions(ts.evictions);
               t.setHits(ts.hits);
               t.setMisses(ts.misses);
             }
             FillGroups(snap.per_model, reply.initModels(snap.per_model.size()));
             // An engine sees its own namespace only: other tenants' names and usage are theirs.
             FillGroups(namespaces, reply.initNamespaces(namespaces.size()));
             auto models = reply.initRegisteredModels(config.models.size());
             for (unsigned i = 0; i < config.models.size(); ++i) {
               models[i].setName(config.models[i].name);
               proto::ToProto(config.models[i].layout, models[i].initLayout());
               models[i].setChunkBytes(config.models[i].layout.ChunkBytes(config.chunk_tokens));
             }
             auto out = reply.initCounters(counters.size());
             for (unsigned i = 0; i < counters.size(); ++i) {
               out[i].setName(counters[i].first);
               out[i].setValue(counters[i].second);
             }
             auto compression = reply.initCompression(snap.compression.size());
             for (unsigned i = 0; i < snap.compression.size(); ++i) {
               const auto& [model, ingest] = snap.compression[i];
               compression[i].setModel(model);
               compression[i].setDevice(ingest.device);
               compression[i].setDeviceReason(ingest.device_reason);
               compression[i].setEaQueries(ingest.ea_queries);
               compression[i].setEaMinQueries(ingest.ea_min_queries);
               auto stages = compression[i].initStages(ingest.stages.size());
               for (unsigned j = 0; j < ingest.stages.size(); ++j) {
                 stages[j].setStage(ingest.stages[j].stage);
                 stages[j].setNanos(ingest.stages[j].nanos);
                 stages[j].setChunks(ingest.stages[j].chunks);
               }
             }
           }));
}

void Session::HandleList(uint64_t seq, uint64_t rid, proto::ListRequest::Reader list) {
  std::string name_space = list.getNamespace();
  std::string model = list.getModel();
  const uint32_t limit = list.getLimit();
  if (Status s = RequireAdmin("List"); !s.ok()) return CompleteError(seq, rid, s);
  storage::ChunkFilter filter;
  if (!name_space.empty()) filter.name_space = name_space;
  if (!model.empty()) filter.model = model;
  std::vector<storage::ChunkMeta> chunks = server_->tier_manager()->List(filter, 0);
  const int64_t now = server_->clock()->NowNanos();
  const size_t shown = limit == 0 ? chunks.size() : std::min<size_t>(limit, chunks.size());
  Complete(seq, MakeResponse(rid, [&](proto::Response::Builder r) {
             auto reply = r.initList();
             reply.setTotal(chunks.size());
             auto out = reply.initChunks(static_cast<unsigned>(shown));
             for (unsigned i = 0; i < shown; ++i) {
               const auto& m = chunks[i];
               out[i].setNamespace(m.key.name_space);
               out[i].setModel(m.key.model);
               proto::ToProto(m.key.chain_hash, out[i].initHash());
               out[i].setTokens(m.tokens);
               out[i].setBytes(m.size_bytes);
               out[i].setTier(std::string(storage::TierKindName(m.tier)));
               out[i].setAgeMs(static_cast<uint64_t>(std::max<int64_t>(0, now - m.created_ns)) /
                               1000000);
               out[i].setIdleMs(
                   static_cast<uint64_t>(std::max<int64_t>(0, now - m.last_access_ns)) / 1000000);
               out[i].setLeases(0);
             }
           }));
}

void Session::HandleEvict(uint64_t seq, uint64_t rid, proto::EvictRequest::Reader evict) {
  if (Status s = RequireAdmin("Evict"); !s.ok()) return CompleteError(seq, rid, s);
  storage::TierManager* tier = server_->tier_manager();
  storage::EvictResult total;
  std::string what;
  switch (evict.which()) {
    case proto::EvictRequest::ALL:
      what = "all";
      total = tier->Evict(storage::ChunkFilter::All());
      break;
    case proto::EvictRequest::NAMESPACE: {
      std::string ns = evict.getNamespace();
      what = "namespace=" + ns;
      total = tier->Evict(storage::ChunkFilter::Namespace(ns));
      break;
    }
    case proto::EvictRequest::MODEL: {
      std::string model = evict.getModel();
      what = "model=" + model;
      total = tier->Evict(storage::ChunkFilter::Model(model));
      break;
    }
    case proto::EvictRequest::CHUNK: {
      Hash128 hash = proto::FromProto(evict.getChunk());
      what = "chunk=" + hash.ToHex();
      // A hash names a chunk in every namespace/model that stores it.
      for (const auto& meta : tier->List(storage::ChunkFilter::All(), 0)) {
        if (meta.key.chain_hash != hash) continue;
        storage::EvictResult one = tier->Evict(storage::ChunkFilter::Key(meta.key));
        total.evicted += one.evicted;
        total.deferred += one.deferred;
        total.bytes += one.bytes;
      }
      break;
    }
    default:
      return CompleteError(
          seq, rid,
          Status::InvalidArgument("unknown evict selector " +
                                  std::to_string(static_cast<int>(evict.which()))));
  }
  KVD_LOG(INFO) << "evict" << Kv("session", id_) << Kv("client", client_id_) << Kv("filter", what)
                << Kv("chunks", total.evicted) << Kv("bytes", total.bytes)
                << Kv("deferred_pinned", total.deferred);
  Complete(seq, MakeResponse(rid, [&](proto::Response::Builder r) {
             auto reply = r.initEvict();
             reply.setChunks(total.evicted);
             reply.setBytes(total.bytes);
             reply.setSkippedPinned(total.deferred);
           }));
}

void Session::HandleCalibration(uint64_t seq, uint64_t rid,
                                proto::CalibrationRequest::Reader request) {
  const std::string model = request.getModel();
  struct Row {
    std::string model;
    const ModelConfig* config;
    ChunkCodec* codec;
    CalibrationStatus status;
  };
  std::vector<Row> rows;
  for (const ModelConfig& m : server_->config().models) {
    if (!model.empty() && m.name != model) continue;
    ChunkCodec* codec = server_->codec(m.name);
    if (codec == nullptr) {
      if (!model.empty()) {
        return CompleteError(
            seq, rid,
            Status::FailedPrecondition("model " + model +
                                       " has no compression policy: nothing to calibrate"));
      }
      continue;
    }
    if (model.empty() && !NeedsCalibration(codec->policy())) continue;
    rows.push_back({m.name, &m, codec, codec->Calibration()});
  }
  if (!model.empty() && rows.empty()) {
    return CompleteError(seq, rid, Status::NotFound("unknown model \"" + model + "\""));
  }
  Complete(seq, MakeResponse(rid, [&](proto::Response::Builder r) {
             auto out = r.initCalibration().initModels(static_cast<unsigned>(rows.size()));
             for (unsigned i = 0; i < rows.size(); ++i) {
               const Row& row = rows[i];
               out[i].setModel(row.model);
               out[i].setState(row.status.state);
               out[i].setTokensSeen(row.status.tokens_seen);
               out[i].setTokensNeeded(row.status.tokens_needed);
               out[i].setVersion(row.status.version);
               out[i].setCodecId(row.codec->codec_id());
               out[i].setNumLayers(static_cast<uint32_t>(row.config->layout.num_layers));
               out[i].setNumKvHeads(static_cast<uint32_t>(row.config->layout.num_kv_heads));
               out[i].setR2Threshold(row.codec->policy().r2_threshold);
               auto r2 = out[i].initR2(static_cast<unsigned>(row.status.r2.size()));
               for (unsigned j = 0; j < row.status.r2.size(); ++j) r2.set(j, row.status.r2[j]);
               auto routes = out[i].initRoutes(static_cast<unsigned>(row.status.routes.size()));
               for (unsigned j = 0; j < row.status.routes.size(); ++j) {
                 routes.set(j, row.status.routes[j]);
               }
             }
           }));
}

void Session::HandleWeights(uint64_t seq, uint64_t rid, proto::WeightsRequest::Reader request) {
  const uint64_t version = request.getVersion();
  if (Status s = RequireEngine("Weights"); !s.ok()) return CompleteError(seq, rid, s);
  if (codec_ == nullptr) {
    return CompleteError(seq, rid,
                         Status::FailedPrecondition("model " + model_->name +
                                                    " has no compression policy: no weights"));
  }
  auto bytes = codec_->Weights(version);
  if (!bytes.ok()) return CompleteError(seq, rid, bytes.status());
  const uint64_t limit = server_->config().limits.max_frame_bytes;
  if (bytes->size() + 1024 > limit) {
    return CompleteError(seq, rid,
                         Status::OutOfRange("VECTOR weights are " + std::to_string(bytes->size()) +
                                            " bytes, over limits.max_frame_bytes " +
                                            std::to_string(limit) + " (raise it)"));
  }
  Complete(seq, MakeResponse(rid, [&](proto::Response::Builder r) {
             auto reply = r.initWeights();
             reply.setVersion(version);
             reply.setWeights(
                 kj::arrayPtr(reinterpret_cast<const capnp::byte*>(bytes->data()), bytes->size()));
           }));
}

void Session::HandleHealth(uint64_t seq, uint64_t rid) {
  const StatsSnapshot snap = server_->Snapshot();
  const std::vector<storage::TierStats>& tiers = snap.tiers;
  bool all_ok = true;
  for (const auto& t : tiers) all_ok = all_ok && t.capacity_bytes > 0;
  const std::vector<std::string>& damage = snap.damage;
  std::string status = all_ok ? "serving" : "a tier has no capacity";
  if (!damage.empty()) {
    status = all_ok ? "degraded:" : status + "; degraded:";
    for (size_t i = 0; i < damage.size(); ++i) status += (i == 0 ? " " : "; ") + damage[i];
  }
  Complete(seq, MakeResponse(rid, [&](proto::Response::Builder r) {
             auto reply = r.initHealth();
             reply.setOk(all_ok);
             reply.setDegraded(!damage.empty());
             reply.setStatus(status);
             reply.setUptimeMs(static_cast<uint64_t>(server_->UptimeMs()));
             reply.setTransport(server_->transport_description());
             auto out = reply.initTiers(static_cast<unsigned>(tiers.size()));
             for (unsigned i = 0; i < tiers.size(); ++i) {
               const auto& t = tiers[i];
               out[i].setName(std::string(storage::TierKindName(t.kind)));
               out[i].setOk(t.capacity_bytes > 0);
               out[i].setDetail(std::to_string(t.chunk_count) + " chunks, " +
                                std::to_string(t.used_bytes) + "/" +
                                std::to_string(t.capacity_bytes) + " bytes used");
             }
           }));
}

}  // namespace kvd::daemon
