// Session requests for kvdctl: stats, list, evict, health (any role).
#include "kvd/common/logging.h"
#include "kvd/proto/convert.h"
#include "kvd/storage/host_tier.h"
#include "responses.h"
#include "session.h"

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
  storage::TierStats host = server_->tier()->GetStats();
  const DaemonCounters& c = server_->counters();
  const std::vector<std::pair<const char*, uint64_t>> counters = {
      {"sessions_accepted", c.sessions_accepted},
      {"sessions_refused", c.sessions_refused},
      {"frames_in", c.frames_in},
      {"frames_out", c.frames_out},
      {"bad_frames", c.bad_frames},
      {"errors_sent", c.errors_sent},
      {"puts_committed", c.puts_committed},
      {"puts_deduplicated", c.puts_deduplicated},
      {"put_bytes", c.put_bytes},
      {"gets", c.gets},
      {"get_bytes", c.get_bytes},
      {"transfer_timeouts", c.transfer_timeouts},
      {"reservations_expired", c.reservations_expired},
      {"reservations_reclaimed", c.reservations_reclaimed},
      {"host_lookups", host.lookups},
      {"host_chunks_requested", host.chunks_requested},
      {"host_chunks_matched", host.chunks_matched},
      {"host_commits", host.commits},
      {"host_dedup_puts", host.dedup_puts},
      {"host_checksum_failures", host.checksum_failures},
      {"host_admin_evictions", host.admin_evictions},
      {"host_reservations_open", host.reservations_open},
      {"host_leases_open", host.leases_open},
      {"host_reads_open", host.reads_open},
      {"host_leases_expired", host.leases_expired},
      {"host_arena_allocated_bytes", host.arena_allocated_bytes},
  };
  Complete(seq, MakeResponse(rid, [&](proto::Response::Builder r) {
             auto reply = r.initStats();
             reply.setNodeName(config.node_name);
             reply.setUptimeMs(static_cast<uint64_t>(server_->UptimeMs()));
             reply.setSessions(static_cast<uint32_t>(server_->session_count()));
             auto tiers = reply.initTiers(1);
             auto t = tiers[0];
             t.setName("host");
             t.setCapacityBytes(host.capacity_bytes);
             t.setUsedBytes(host.used_bytes);
             t.setReservedBytes(host.reserved_bytes);
             t.setPinnedBytes(host.pinned_bytes);
             t.setChunks(host.chunk_count);
             t.setEvictions(host.evictions);
             t.setHits(host.hits);
             t.setMisses(host.misses);
             FillGroups(host.per_model, reply.initModels(host.per_model.size()));
             FillGroups(host.per_namespace, reply.initNamespaces(host.per_namespace.size()));
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
           }));
}

void Session::HandleList(uint64_t seq, uint64_t rid, proto::ListRequest::Reader list) {
  std::string name_space = list.getNamespace();
  std::string model = list.getModel();
  const uint32_t limit = list.getLimit();
  storage::ChunkFilter filter;
  if (!name_space.empty()) filter.name_space = name_space;
  if (!model.empty()) filter.model = model;
  std::vector<storage::ChunkMeta> chunks = server_->tier()->List(filter, 0);
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
  storage::HostTier* tier = server_->tier();
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
      return CompleteError(seq, rid,
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

void Session::HandleHealth(uint64_t seq, uint64_t rid) {
  storage::TierStats host = server_->tier()->GetStats();
  const bool host_ok = host.capacity_bytes > 0;
  Complete(seq, MakeResponse(rid, [&](proto::Response::Builder r) {
             auto reply = r.initHealth();
             reply.setOk(host_ok);
             reply.setStatus(host_ok ? "serving" : "host tier unavailable");
             reply.setUptimeMs(static_cast<uint64_t>(server_->UptimeMs()));
             reply.setTransport(server_->transport_description());
             auto tiers = reply.initTiers(1);
             tiers[0].setName("host");
             tiers[0].setOk(host_ok);
             tiers[0].setDetail(std::to_string(host.chunk_count) + " chunks, " +
                                std::to_string(host.used_bytes) + "/" +
                                std::to_string(host.capacity_bytes) + " bytes used");
           }));
}

}  // namespace kvd::daemon
