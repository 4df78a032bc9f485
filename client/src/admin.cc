// Client: the admin calls (stats, list, evict, health), shared by both roles.
#include <string>

#include "client_impl.h"
#include "kvd/proto/convert.h"

namespace kvd::client::internal {
namespace {

GroupStats FromGroup(proto::GroupStats::Reader g) {
  return GroupStats{g.getName().cStr(), g.getChunks(), g.getBytes()};
}

}  // namespace

StatusOr<Stats> ClientImpl::GetStats() {
  std::lock_guard<std::mutex> lock(mu_);
  KVD_RETURN_IF_ERROR(CheckUsable(false));
  KVD_ASSIGN_OR_RETURN(auto reply, CallLocked([](proto::Request::Builder r) { r.setStats(); }));
  Stats out;
  KVD_RETURN_IF_ERROR(ReadReply(*reply, [&](proto::Response::Reader r) -> Status {
    if (!r.isStats()) return WrongReply("stats");
    auto s = r.getStats();
    out.node_name = s.getNodeName().cStr();
    out.uptime_ms = s.getUptimeMs();
    out.sessions = s.getSessions();
    for (auto t : s.getTiers()) {
      TierStats ts;
      ts.name = t.getName().cStr();
      ts.capacity_bytes = t.getCapacityBytes();
      ts.used_bytes = t.getUsedBytes();
      ts.reserved_bytes = t.getReservedBytes();
      ts.pinned_bytes = t.getPinnedBytes();
      ts.chunks = t.getChunks();
      ts.evictions = t.getEvictions();
      ts.hits = t.getHits();
      ts.misses = t.getMisses();
      out.tiers.push_back(std::move(ts));
    }
    for (auto g : s.getModels()) out.models.push_back(FromGroup(g));
    for (auto g : s.getNamespaces()) out.namespaces.push_back(FromGroup(g));
    for (auto m : s.getRegisteredModels()) {
      ModelInfo info;
      info.name = m.getName().cStr();
      auto layout = proto::FromProto(m.getLayout());
      if (layout.ok()) info.layout = *layout;
      info.chunk_bytes = m.getChunkBytes();
      out.registered_models.push_back(std::move(info));
    }
    for (auto c : s.getCounters()) out.counters.emplace_back(c.getName().cStr(), c.getValue());
    for (auto m : s.getCompression()) {
      ModelIngestStats ingest;
      ingest.model = m.getModel().cStr();
      ingest.device = m.getDevice().cStr();
      ingest.device_reason = m.getDeviceReason().cStr();
      ingest.ea_queries = m.getEaQueries();
      ingest.ea_min_queries = m.getEaMinQueries();
      for (auto t : m.getStages()) {
        ingest.stages.push_back({t.getStage().cStr(), t.getNanos(), t.getChunks()});
      }
      out.compression.push_back(std::move(ingest));
    }
    return Status::Ok();
  }));
  return out;
}

StatusOr<ListResult> ClientImpl::List(const ListFilter& filter) {
  std::lock_guard<std::mutex> lock(mu_);
  KVD_RETURN_IF_ERROR(CheckUsable(false));
  KVD_ASSIGN_OR_RETURN(auto reply, CallLocked([&](proto::Request::Builder r) {
                         auto l = r.initList();
                         l.setNamespace(filter.name_space);
                         l.setModel(filter.model);
                         l.setLimit(filter.limit);
                       }));
  ListResult out;
  KVD_RETURN_IF_ERROR(ReadReply(*reply, [&](proto::Response::Reader r) -> Status {
    if (!r.isList()) return WrongReply("list");
    auto l = r.getList();
    out.total = l.getTotal();
    for (auto c : l.getChunks()) {
      ChunkInfo info;
      info.name_space = c.getNamespace().cStr();
      info.model = c.getModel().cStr();
      info.hash = proto::FromProto(c.getHash());
      info.tokens = c.getTokens();
      info.bytes = c.getBytes();
      info.tier = c.getTier().cStr();
      info.age_ms = c.getAgeMs();
      info.idle_ms = c.getIdleMs();
      info.leases = c.getLeases();
      out.chunks.push_back(std::move(info));
    }
    return Status::Ok();
  }));
  return out;
}

StatusOr<EvictResult> ClientImpl::Evict(const EvictFilter& filter) {
  std::lock_guard<std::mutex> lock(mu_);
  KVD_RETURN_IF_ERROR(CheckUsable(false));
  KVD_ASSIGN_OR_RETURN(auto reply, CallLocked([&](proto::Request::Builder r) {
                         auto e = r.initEvict();
                         switch (filter.kind) {
                           case EvictFilter::Kind::kAll:
                             e.setAll();
                             break;
                           case EvictFilter::Kind::kNamespace:
                             e.setNamespace(filter.name);
                             break;
                           case EvictFilter::Kind::kModel:
                             e.setModel(filter.name);
                             break;
                           case EvictFilter::Kind::kChunk:
                             proto::ToProto(filter.chunk, e.initChunk());
                             break;
                         }
                       }));
  EvictResult out;
  KVD_RETURN_IF_ERROR(ReadReply(*reply, [&](proto::Response::Reader r) -> Status {
    if (!r.isEvict()) return WrongReply("evict");
    auto e = r.getEvict();
    out.chunks = e.getChunks();
    out.bytes = e.getBytes();
    out.skipped_pinned = e.getSkippedPinned();
    return Status::Ok();
  }));
  return out;
}

StatusOr<Health> ClientImpl::GetHealth() {
  std::lock_guard<std::mutex> lock(mu_);
  KVD_RETURN_IF_ERROR(CheckUsable(false));
  KVD_ASSIGN_OR_RETURN(auto reply, CallLocked([](proto::Request::Builder r) { r.setHealth(); }));
  Health out;
  KVD_RETURN_IF_ERROR(ReadReply(*reply, [&](proto::Response::Reader r) -> Status {
    if (!r.isHealth()) return WrongReply("health");
    auto h = r.getHealth();
    out.ok = h.getOk();
    out.degraded = h.getDegraded();
    out.status = h.getStatus().cStr();
    out.uptime_ms = h.getUptimeMs();
    out.transport = h.getTransport().cStr();
    for (auto t : h.getTiers())
      out.tiers.push_back({t.getName().cStr(), t.getOk(), t.getDetail().cStr()});
    return Status::Ok();
  }));
  return out;
}

StatusOr<std::vector<CalibrationInfo>> ClientImpl::GetCalibration(const std::string& model) {
  std::lock_guard<std::mutex> lock(mu_);
  KVD_RETURN_IF_ERROR(CheckUsable(false));
  KVD_ASSIGN_OR_RETURN(auto reply, CallLocked([&](proto::Request::Builder r) {
                         r.initCalibration().setModel(model);
                       }));
  std::vector<CalibrationInfo> out;
  KVD_RETURN_IF_ERROR(ReadReply(*reply, [&](proto::Response::Reader r) -> Status {
    if (!r.isCalibration()) return WrongReply("calibration");
    for (auto m : r.getCalibration().getModels()) {
      CalibrationInfo c;
      c.model = m.getModel().cStr();
      c.state = m.getState().cStr();
      c.tokens_seen = m.getTokensSeen();
      c.tokens_needed = m.getTokensNeeded();
      c.version = m.getVersion();
      c.codec_id = m.getCodecId();
      c.num_layers = m.getNumLayers();
      c.num_kv_heads = m.getNumKvHeads();
      c.r2_threshold = m.getR2Threshold();
      for (double v : m.getR2()) c.r2.push_back(v);
      for (bool v : m.getRoutes()) c.routes.push_back(v);
      out.push_back(std::move(c));
    }
    return Status::Ok();
  }));
  return out;
}

StatusOr<std::shared_ptr<const std::vector<uint8_t>>> ClientImpl::GetVectorWeights(
    uint64_t version) {
  std::lock_guard<std::mutex> lock(mu_);
  KVD_RETURN_IF_ERROR(CheckUsable(true));
  if (auto it = weights_.find(version); it != weights_.end()) return it->second;
  KVD_ASSIGN_OR_RETURN(auto reply, CallLocked([&](proto::Request::Builder r) {
                         r.initWeights().setVersion(version);
                       }));
  std::shared_ptr<const std::vector<uint8_t>> out;
  KVD_RETURN_IF_ERROR(ReadReply(*reply, [&](proto::Response::Reader r) -> Status {
    if (!r.isWeights()) return WrongReply("weights");
    auto w = r.getWeights().getWeights();
    out = std::make_shared<const std::vector<uint8_t>>(w.begin(), w.end());
    return Status::Ok();
  }));
  weights_[version] = out;
  return out;
}

}  // namespace kvd::client::internal
