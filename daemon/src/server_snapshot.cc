// Server::Impl::Snapshot: what `kvdctl stats` and /metrics show, gathered from the daemon's
// counters, its transport and NCCL link, the event hub, every tier and every codec.
#include <string>
#include <utility>
#include <vector>

#include "cluster_member.h"
#include "disk_damage.h"
#include "kvd/storage/host_tier.h"
#include "kvd/storage/tier_manager.h"
#include "peer_fetch.h"
#include "server_impl.h"

namespace kvd::daemon {

namespace {

using CounterList = std::vector<std::pair<std::string, uint64_t>>;

void Append(CounterList more, CounterList* to) {
  for (auto& counter : more) to->push_back(std::move(counter));
}

// The tiers' figures by kind: zero for a tier the node does not have.
struct TiersByKind {
  storage::TierStats host, disk, gpu;
};

TiersByKind ByKind(const std::vector<storage::TierStats>& tiers) {
  TiersByKind out;
  for (const storage::TierStats& t : tiers) {
    (t.kind == storage::TierKind::kHost   ? out.host
     : t.kind == storage::TierKind::kDisk ? out.disk
                                          : out.gpu) = t;
  }
  return out;
}

// Occupancy per model and namespace, each chunk once: with a disk tier every committed chunk is
// written through to disk (the host tier holds copies of some), so the disk tier's figures are
// the stored set; without one, the host tier's. `lowest` is the last tier of GetStats.
void AddOccupancy(const storage::TierStats& lowest, StatsSnapshot* s) {
  for (const auto& [name, u] : lowest.per_model) {
    s->per_model[name].chunks += u.chunks;
    s->per_model[name].bytes += u.bytes;
  }
  for (const auto& [name, u] : lowest.per_namespace) {
    s->per_namespace[name].chunks += u.chunks;
    s->per_namespace[name].bytes += u.bytes;
  }
}

// The daemon's own counters (DaemonCounters), in the order stats shows them.
CounterList DaemonCounterList(const DaemonCounters& c) {
  return {
      {"sessions_accepted", c.sessions_accepted},
      {"sessions_refused", c.sessions_refused},
      {"read_timeouts", c.read_timeouts},
      {"frames_in", c.frames_in},
      {"frames_out", c.frames_out},
      {"bad_frames", c.bad_frames},
      {"errors_sent", c.errors_sent},
      {"puts_committed", c.puts_committed},
      {"puts_deduplicated", c.puts_deduplicated},
      {"puts_inline", c.puts_inline},
      {"reserve_ahead_granted", c.reserve_ahead_granted},
      {"reserve_ahead_declined", c.reserve_ahead_declined},
      {"reserve_ahead_aborted", c.reserve_ahead_aborted},
      {"puts_reserved_ahead", c.puts_reserved_ahead},
      {"puts_copied_for_nothing", c.puts_copied_for_nothing},
      {"put_bytes", c.put_bytes},
      {"gets", c.gets},
      {"get_bytes", c.get_bytes},
      {"transfer_timeouts", c.transfer_timeouts},
      {"reservations_expired", c.reservations_expired},
      {"reservations_reclaimed", c.reservations_reclaimed},
      {"chunks_compressed", c.chunks_compressed},
      {"compressed_raw_bytes", c.compressed_raw_bytes},
      {"compressed_bytes", c.compressed_bytes},
      {"compress_us", c.compress_us},
      {"ingest_rejected", c.ingest_rejected},
  };
}

// Peers of the transport, the NCCL link's staging and the event hub.
CounterList LinkCounterList(const DaemonCounters& c, const transport::PeerCounts& peers,
                            const NcclLink& nccl, const EventHub& events) {
  return {
      // Endpoints to clients' transports: one per transport-path session, none for a
      // shared-memory session; a session's endpoint is closed for good when it ends.
      {"transport_peers_open", peers.open},
      {"transport_connects", peers.connects},
      {"transport_disconnects", peers.disconnects},
      {"transport_peers_vanished", peers.vanished},
      {"nccl_links", c.nccl_links},
      {"nccl_refused", c.nccl_refused},
      {"nccl_staging_in_use", nccl.staging_in_use()},
      {"nccl_staging_allocated", nccl.staging_allocated()},
      {"events_queued", events.queued_total()},
      {"events_dropped", events.dropped_total()},
      // Of events_dropped, those lost because the tenant was at its queued-events quota.
      {"events_dropped_for_quota", events.dropped_for_quota()},
  };
}

}  // namespace

CounterList Server::Impl::TierCounterList(const storage::TierStats& host,
                                          const storage::TierStats& disk,
                                          const storage::TierStats& gpu) const {
  return {
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
      // Shared-memory arena segments (docs/reliability.md "Namespaces in shared memory"): free
      // segments taken back by their last namespace (memory kept), passed to another one, and
      // the memory replacements those handovers made.
      {"host_segments_reused", host.segments_reused},
      {"host_segments_handed_over", host.segments_handed_over},
      {"shm_segment_replacements", shm_ != nullptr ? shm_->replacements() : 0},
      {"promotions", manager_->promotions()},
      {"demotions", manager_->demotions()},
      // Integrity (docs/reliability.md): damage found in stored data since start.
      {"promote_failures", manager_->promote_failures()},
      {"promote_errors", manager_->promote_errors()},
      {"host_corrupt_dropped", manager_->host_corrupt_dropped()},
      {"disk_checksum_failures", disk.checksum_failures},
      {"disk_quarantined_records", disk_ != nullptr ? disk_->quarantined_records() : 0},
      {"disk_wal_corruptions", disk_ != nullptr ? disk_->wal_corruptions() : 0},
      {"gpu_checksum_failures", gpu.checksum_failures},
      // Capacity (docs/reliability.md): chunks a tier could not take for its size.
      {"disk_over_capacity_records", disk_ != nullptr ? disk_->over_capacity_records() : 0},
      {"gpu_skipped", manager_->gpu_skipped()},
  };
}

StatsSnapshot Server::Impl::Snapshot() {
  StatsSnapshot s;
  s.node_name = config_.node_name;
  s.uptime_ms = UptimeMs();
  s.sessions = session_count();
  s.tiers = manager_->GetStats();
  const TiersByKind tiers = ByKind(s.tiers);
  AddOccupancy(s.tiers.back(), &s);
  s.counters = DaemonCounterList(counters_);
  Append(LinkCounterList(counters_, transport_->peer_counts(), *nccl_, events_), &s.counters);
  Append(TierCounterList(tiers.host, tiers.disk, tiers.gpu), &s.counters);
  // The disk tier's database (docs/reliability.md "A disk tier that degrades").
  const storage::DiskHealthReport disk_health =
      disk_ != nullptr ? disk_->Health() : storage::DiskHealthReport{};
  Append(DiskHealthCounters(disk_health), &s.counters);
  if (membership_) Append(ClusterCounters(*membership_), &s.counters);
  if (peer_fetcher_) Append(PeerFetchCounters(peer_fetcher_->counts()), &s.counters);
  for (const ModelConfig& m : config_.models) {
    if (const ChunkCodec* codec = this->codec(m.name); codec != nullptr) {
      s.compression.emplace_back(m.name, codec->Stats());
    }
  }
  uint64_t fallbacks = 0;
  for (const auto& [model, ingest] : s.compression) fallbacks += ingest.device_fallbacks;
  s.counters.emplace_back("ingest_device_fallbacks", fallbacks);
  s.damage = DamageFound(s);
  for (std::string& reason : DiskHealthDamage(disk_health, config_.placement.on_disk_error)) {
    s.damage.push_back(std::move(reason));
  }
  return s;
}

std::vector<std::string> Server::Impl::DamageFound(const StatsSnapshot& snapshot) {
  auto counter = [&](std::string_view name) -> uint64_t {
    for (const auto& [n, v] : snapshot.counters) {
      if (n == name) return v;
    }
    return 0;
  };
  struct Kind {
    const char* counter;
    const char* what;
  };
  static const Kind kKinds[] = {
      {"disk_checksum_failures", "corrupt chunk(s) found on disk (dropped, never served)"},
      {"gpu_checksum_failures", "corrupt chunk(s) found in the gpu tier (never served)"},
      {"disk_quarantined_records", "malformed metadata record(s) quarantined at start"},
      {"disk_wal_corruptions",
       "damaged write-ahead log(s) at start (replayed up to the damage, the rest dropped)"},
      {"promote_errors", "promotion(s) into host failed on a corrupt or unreadable copy"},
      {"host_corrupt_dropped",
       "chunk(s) changed in host memory after their commit (dropped, never copied on)"},
  };
  std::vector<std::string> out;
  for (const Kind& k : kKinds) {
    if (const uint64_t n = counter(k.counter); n > 0) {
      out.push_back(std::to_string(n) + " " + k.what + " [" + k.counter + "]");
    }
  }
  return out;
}

}  // namespace kvd::daemon
