#include "metrics.h"

#include <cstdio>
#include <set>

namespace kvd::daemon {

namespace {

// Counters of StatsReply that are levels, not running totals.
const std::set<std::string>& GaugeCounters() {
  static const std::set<std::string> gauges = {
      "host_reservations_open",     "host_leases_open",    "host_reads_open",
      "host_arena_allocated_bytes", "disk_writes_stopped", "transport_peers_open",
      "cluster_reachable",          "cluster_members",     "cluster_refused"};
  return gauges;
}

// A label value with \, " and newline escaped (exposition format).
std::string Escape(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string Number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

class Writer {
 public:
  explicit Writer(const std::string& node) : node_("node=\"" + Escape(node) + "\"") {}
  // # HELP / # TYPE once per family.
  void Family(const std::string& name, const char* type, const std::string& help) {
    out_ += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  }
  void Sample(const std::string& name, const std::string& labels, const std::string& value) {
    out_ += name + "{" + node_ + (labels.empty() ? "" : "," + labels) + "} " + value + "\n";
  }
  void Sample(const std::string& name, const std::string& labels, uint64_t value) {
    Sample(name, labels, std::to_string(value));
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string node_;
  std::string out_;
};

std::string Label(const char* key, const std::string& value) {
  return std::string(key) + "=\"" + Escape(value) + "\"";
}

// kvd_up, the uptime, the open sessions and whether damage was found.
void WriteDaemonState(Writer& w, const StatsSnapshot& s) {
  w.Family("kvd_up", "gauge", "1 while the daemon serves");
  w.Sample("kvd_up", "", 1);
  w.Family("kvd_uptime_seconds", "gauge", "Seconds since the daemon started");
  w.Sample("kvd_uptime_seconds", "", Number(static_cast<double>(s.uptime_ms) / 1000.0));
  w.Family("kvd_sessions", "gauge", "Open control connections");
  w.Sample("kvd_sessions", "", s.sessions);
  w.Family("kvd_degraded", "gauge",
           "1 while damage to stored data found since start is counted (kvdctl health says "
           "what)");
  w.Sample("kvd_degraded", "", s.damage.empty() ? 0 : 1);
}

// One family per tier counter, one sample per tier.
void WriteTiers(Writer& w, const StatsSnapshot& s) {
  struct TierField {
    const char* name;
    const char* type;
    const char* help;
    uint64_t storage::TierStats::*field;
  };
  static const TierField kTierFields[] = {
      {"kvd_tier_capacity_bytes", "gauge", "Capacity of the tier",
       &storage::TierStats::capacity_bytes},
      {"kvd_tier_used_bytes", "gauge", "Payload bytes of committed chunks",
       &storage::TierStats::used_bytes},
      {"kvd_tier_reserved_bytes", "gauge", "Bytes held by open reservations",
       &storage::TierStats::reserved_bytes},
      {"kvd_tier_pinned_bytes", "gauge", "Bytes of chunks pinned by a lease or read",
       &storage::TierStats::pinned_bytes},
      {"kvd_tier_chunks", "gauge", "Committed chunks in the tier",
       &storage::TierStats::chunk_count},
      {"kvd_tier_evictions_total", "counter", "Chunks evicted to make room",
       &storage::TierStats::evictions},
      {"kvd_tier_hits_total", "counter", "Lookups that matched at least one chunk",
       &storage::TierStats::hits},
      {"kvd_tier_misses_total", "counter", "Lookups that matched no chunk",
       &storage::TierStats::misses},
  };
  for (const TierField& f : kTierFields) {
    w.Family(f.name, f.type, f.help);
    for (const auto& t : s.tiers) {
      w.Sample(f.name, Label("tier", std::string(storage::TierKindName(t.kind))), t.*(f.field));
    }
  }
}

// kvd_<label>_chunks and kvd_<label>_bytes, one sample per model or namespace.
void WriteUsageGroups(Writer& w, const char* label,
                      const std::map<std::string, storage::UsageStats>& g) {
  const std::string chunks = std::string("kvd_") + label + "_chunks";
  const std::string bytes = std::string("kvd_") + label + "_bytes";
  w.Family(chunks, "gauge", std::string("Committed chunks per ") + label + " (all tiers)");
  for (const auto& [name, u] : g) w.Sample(chunks, Label(label, name), u.chunks);
  w.Family(bytes, "gauge", std::string("Payload bytes per ") + label + " (all tiers)");
  for (const auto& [name, u] : g) w.Sample(bytes, Label(label, name), u.bytes);
}

// StatsReply's counters: running totals as counters (_total), levels as gauges.
void WriteCounters(Writer& w, const StatsSnapshot& s) {
  for (const auto& [name, value] : s.counters) {
    const bool gauge = GaugeCounters().count(name) > 0;
    const std::string metric = "kvd_" + name + (gauge ? "" : "_total");
    w.Family(metric, gauge ? "gauge" : "counter", "kvdctl stats counter " + name);
    w.Sample(metric, "", value);
  }
}

// Each model's ingest: the device it compresses on and the time and chunks of each stage.
void WriteIngest(Writer& w, const StatsSnapshot& s) {
  w.Family("kvd_ingest_device", "gauge",
           "1 for the device a model's ingest compresses on (device=\"cpu\" or \"cuda:N\")");
  for (const auto& [model, ingest] : s.compression) {
    w.Sample("kvd_ingest_device", Label("model", model) + "," + Label("device", ingest.device), 1);
  }
  w.Family("kvd_expected_attention_queries", "gauge",
           "Window queries per layer a model's expected-attention statistics hold");
  w.Family("kvd_expected_attention_active", "gauge",
           "1 once the statistics score chunks (ea_min_queries reached), 0 while KeyDiff does");
  for (const auto& [model, ingest] : s.compression) {
    if (ingest.ea_min_queries == 0) continue;
    w.Sample("kvd_expected_attention_queries", Label("model", model), ingest.ea_queries);
    w.Sample("kvd_expected_attention_active", Label("model", model),
             ingest.ea_queries >= ingest.ea_min_queries ? 1 : 0);
  }
  const std::string stage_seconds = "kvd_compress_stage_seconds_total";
  const std::string stage_chunks = "kvd_compress_stage_chunks_total";
  w.Family(stage_seconds, "counter",
           "Time spent in each compression stage of a model's ingest (kvdctl stats)");
  for (const auto& [model, ingest] : s.compression) {
    for (const IngestStageTime& t : ingest.stages) {
      w.Sample(stage_seconds, Label("model", model) + "," + Label("stage", t.stage),
               Number(static_cast<double>(t.nanos) * 1e-9));
    }
  }
  w.Family(stage_chunks, "counter", "Chunks in which a compression stage of a model took time");
  for (const auto& [model, ingest] : s.compression) {
    for (const IngestStageTime& t : ingest.stages) {
      w.Sample(stage_chunks, Label("model", model) + "," + Label("stage", t.stage), t.chunks);
    }
  }
}

// The request latency histogram, one series per operation.
void WriteLatency(Writer& w, const Metrics& m) {
  const std::string h = "kvd_request_duration_seconds";
  w.Family(h, "histogram",
           "Server-side latency of lookup, put (commit to acknowledgement) and get requests");
  for (int op = 0; op < kLatencyOps; ++op) {
    const LatencyHistogram& hist = m.latency(static_cast<LatencyOp>(op));
    const std::string op_label = Label("op", LatencyOpName(static_cast<LatencyOp>(op)));
    uint64_t cumulative = 0;
    for (size_t i = 0; i < LatencyHistogram::kBoundsSeconds.size(); ++i) {
      cumulative += hist.counts()[i];
      w.Sample(h + "_bucket",
               op_label + ",le=\"" + Number(LatencyHistogram::kBoundsSeconds[i]) + "\"",
               cumulative);
    }
    w.Sample(h + "_bucket", op_label + ",le=\"+Inf\"", hist.count());
    w.Sample(h + "_sum", op_label, Number(hist.sum_seconds()));
    w.Sample(h + "_count", op_label, hist.count());
  }
}

}  // namespace

const char* LatencyOpName(LatencyOp op) {
  switch (op) {
    case LatencyOp::kLookup:
      return "lookup";
    case LatencyOp::kPut:
      return "put";
    case LatencyOp::kGet:
      return "get";
  }
  return "?";
}

void LatencyHistogram::Observe(int64_t nanos) {
  const double seconds = nanos < 0 ? 0.0 : static_cast<double>(nanos) * 1e-9;
  size_t i = 0;
  while (i < kBoundsSeconds.size() && seconds > kBoundsSeconds[i]) ++i;
  ++counts_[i];
  ++count_;
  sum_seconds_ += seconds;
}

std::string Metrics::RenderPrometheus(const StatsSnapshot& s) const {
  Writer w(s.node_name);
  WriteDaemonState(w, s);
  WriteTiers(w, s);
  WriteUsageGroups(w, "model", s.per_model);
  WriteUsageGroups(w, "namespace", s.per_namespace);
  WriteCounters(w, s);
  WriteIngest(w, s);
  WriteLatency(w, *this);
  return w.Take();
}

}  // namespace kvd::daemon
