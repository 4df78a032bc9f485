// kvd-bench against a running kvd (--op put, get, both; internal to client/tools): its clients,
// its phases in order, and the report (see kvd_bench.cc's header comment).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "bench_common.h"
#include "bench_flags.h"
#include "kvd/client/client.h"

namespace CLI {
class App;
}  // namespace CLI

namespace kvd::tools::bench {

// What one phase thread did: its latencies (us), operations and bytes.
struct ThreadTally {
  std::vector<double> latencies_us;
  uint64_t ops = 0, bytes = 0;
};

// A run against kvd (--op put, get, both): its clients, the phases in order, and the report.
class DaemonBench {
 public:
  DaemonBench(const BenchFlags& flags, const kvd::client::ClientOptions& base, ChunkShape shape)
      : f_(flags),
        base_(base),
        tokens_(shape.tokens),
        chunk_bytes_(shape.chunk_bytes),
        run_(static_cast<uint64_t>(Clock::now().time_since_epoch().count()) ^
             (static_cast<uint64_t>(::getpid()) << 32)),
        nthreads_(static_cast<int>(std::min(flags.concurrency, flags.count))),
        lookup_options_{.cluster = flags.cluster},
        fill_(flags.finite ? FillFiniteChunk : FillChunk),
        busy_retries_(nthreads_, 0),
        own_s_(nthreads_, 0.0) {}

  // Connects one client per thread to --addr (and as many to --put-addr). -1 when all are
  // connected, else the exit code.
  int Connect();
  // The phases in order (warmup, put, the ping-pong floor, lookup, get), each only while no
  // earlier one failed.
  void RunPhases();
  // Closes the clients, prints the phases and returns the exit code.
  int Report();

 private:
  using PhaseBody = std::function<Status(int t, ThreadTally& tally)>;

  // Runs `body` on every client thread at once and sums what they did into one phase; the first
  // error lands in first_error_.
  PhaseResult RunPhase(const std::string& name, const PhaseBody& body);
  Status WarmupThread(int t, ThreadTally& tally);
  Status PutThread(int t, ThreadTally& tally);
  Status LookupThread(int t, ThreadTally& tally);
  Status GetThread(int t, ThreadTally& tally);
  // The get phase's reads of one leased batch of `nb` chunks starting at idx[b].
  Status ReadBatchInPlace(int t, const std::vector<uint64_t>& idx, size_t b, size_t nb,
                          uint64_t lease_id, OwnBuffers& expect, ThreadTally& tally);
  Status ReadBatchCopies(int t, const std::vector<uint64_t>& idx, size_t b, size_t nb,
                         uint64_t lease_id, OwnBuffers& bufs, OwnBuffers& expect,
                         ThreadTally& tally);
  // The put phase's client of thread t: its --addr client, or its --put-addr one.
  kvd::client::Client& Writer(int t) {
    return put_clients_.empty() ? *clients_[t] : *put_clients_[t];
  }
  // Chunk indices of thread t: t, t + nthreads, ...
  std::vector<uint64_t> Indices(int t) const {
    std::vector<uint64_t> v;
    for (uint64_t i = t; i < static_cast<uint64_t>(f_.count); i += nthreads_) v.push_back(i);
    return v;
  }
  // One PutChunks call, retried while kvd's ingest pool is full with --retry-busy.
  kvd::StatusOr<std::vector<kvd::client::PutResult>> PutChunks(
      int t, std::span<const kvd::client::PutItem> items);
  // Adds the busy retries counted since the last call to the latest phase.
  void TakeBusyRetries() {
    for (uint64_t& b : busy_retries_) phases_.back().busy_retries += std::exchange(b, 0);
  }

  const BenchFlags& f_;
  const kvd::client::ClientOptions base_;
  const int64_t tokens_;
  const size_t chunk_bytes_;
  const uint64_t run_;
  const int nthreads_;
  const kvd::client::LookupOptions lookup_options_;
  void (*const fill_)(uint8_t*, size_t, uint64_t, uint64_t);
  std::vector<std::unique_ptr<kvd::client::Client>> clients_;
  // The put phase's clients: none (clients_ put), or as many of the --put-addr kvd.
  std::vector<std::unique_ptr<kvd::client::Client>> put_clients_;
  std::vector<uint64_t> busy_retries_;  // per thread, since the last TakeBusyRetries
  std::vector<double> own_s_;           // per thread: seconds of the bench's own work
  std::mutex mu_;
  Status first_error_;  // GUARDED_BY(mu_) while a phase runs
  std::vector<PhaseResult> phases_;
};

// --op put, get or both (flags checked by CheckFlags). Returns the exit code.
int RunAgainstDaemon(const CLI::App& app, const BenchFlags& f);

}  // namespace kvd::tools::bench
