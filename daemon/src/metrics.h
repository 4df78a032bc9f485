// The daemon's metrics in one place: the stats snapshot that both `kvdctl stats` (StatsReply)
// and the Prometheus endpoint show, the request latency histograms, and the Prometheus text
// rendering. Private to daemon/.
//
// Threading: Metrics and the snapshot are touched on the io_context thread only (sessions
// record latencies there; the HTTP endpoint renders there).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kvd/daemon/chunk_codec.h"
#include "kvd/storage/stats.h"

namespace kvd::daemon {

class Server;

// Requests whose server-side latency is recorded: Lookup (request to reply), put (Commit request
// to its acknowledgement: bytes landed, checksum verified, stored) and Get (request to the reply
// after the bytes were sent).
enum class LatencyOp { kLookup = 0, kPut = 1, kGet = 2 };
inline constexpr int kLatencyOps = 3;
const char* LatencyOpName(LatencyOp op);

// A cumulative histogram over fixed bounds from 25 us to 10 s.
class LatencyHistogram {
 public:
  static constexpr std::array<double, 18> kBoundsSeconds = {
      25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3,
      25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1.0,  2.5,    5.0,  10.0};
  void Observe(int64_t nanos);
  // counts()[i]: observations <= kBoundsSeconds[i] (not cumulative); the last slot is +Inf.
  const std::array<uint64_t, kBoundsSeconds.size() + 1>& counts() const { return counts_; }
  uint64_t count() const { return count_; }
  double sum_seconds() const { return sum_seconds_; }

 private:
  std::array<uint64_t, kBoundsSeconds.size() + 1> counts_{};
  uint64_t count_ = 0;
  double sum_seconds_ = 0;
};

// What `kvdctl stats` and /metrics show, taken at one moment.
struct StatsSnapshot {
  std::string node_name;
  int64_t uptime_ms = 0;
  size_t sessions = 0;
  std::vector<storage::TierStats> tiers;  // host first
  // Occupancy over every tier.
  std::map<std::string, storage::UsageStats> per_model, per_namespace;
  // Daemon and host-tier counters (StatsReply.counters), in display order.
  std::vector<std::pair<std::string, uint64_t>> counters;
  // Per model with a compression policy (config order): its ingest's stage times
  // (StatsReply.compression).
  std::vector<std::pair<std::string, IngestStats>> compression;
  // Damage to stored data found since start, one reason per kind (empty: none); `kvdctl
  // health` is degraded with these reasons.
  std::vector<std::string> damage;
};

class Metrics {
 public:
  void Observe(LatencyOp op, int64_t nanos) { latency_[static_cast<int>(op)].Observe(nanos); }
  const LatencyHistogram& latency(LatencyOp op) const { return latency_[static_cast<int>(op)]; }

  // The Prometheus text exposition (format 0.0.4) of a snapshot and the histograms:
  //   kvd_up, kvd_uptime_seconds, kvd_sessions, kvd_degraded (1 while snapshot.damage is
  //   not empty)
  //   kvd_tier_{capacity,used,reserved,pinned}_bytes{tier}, kvd_tier_chunks{tier},
  //   kvd_tier_{evictions,hits,misses}_total{tier}
  //   kvd_model_{chunks,bytes}{model}, kvd_namespace_{chunks,bytes}{namespace}
  //   kvd_<counter>_total for every StatsReply counter (kvd_<name> for the gauges among them)
  //   kvd_compress_stage_seconds_total{model,stage}, kvd_compress_stage_chunks_total{model,stage}
  //     for every model with a compression policy and every stage (StatsReply.compression),
  //     kvd_ingest_device{model,device} (1) where its ingest compresses,
  //     kvd_expected_attention_queries{model} and kvd_expected_attention_active{model} (1 or 0)
  //     for a policy with an expected_attention stage
  //   kvd_request_duration_seconds{op="lookup"|"put"|"get"} histograms
  // Every series carries node="<node name>".
  std::string RenderPrometheus(const StatsSnapshot& snapshot) const;

 private:
  std::array<LatencyHistogram, kLatencyOps> latency_;
};

}  // namespace kvd::daemon
