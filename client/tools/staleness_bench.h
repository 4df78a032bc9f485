// kvd-cluster-bench --op staleness and --op member (internal to client/tools): how soon a
// cluster-scope lookup sees what changed on another node, measured against real kvds (see
// kvd_cluster_bench.cc's header comment).
#pragma once

#include <cstdint>
#include <string>

#include "kvd/client/client.h"

namespace kvd::tools::cluster_bench {

struct StalenessOptions {
  // Engine options of the reader (the kvd the cluster lookups go to) and of the writer (the kvd
  // the chunks are put to and evicted from); same model and layout.
  client::ClientOptions reader, writer;
  std::string holder;      // the writer's cluster.node, as the reader's holders name it
  std::string events;      // the writer's KV events endpoint; "" = no events comparison
  int64_t samples = 100;   // chunks put, seen, evicted and seen gone, one at a time
  int tokens = 1;          // tokens of each chunk
  int64_t wait_ms = 5000;  // the most a sample waits for each change to show
};

// Runs the samples and prints the report (JSON with `json`). Returns the exit code: 0, 1 when a
// call failed or a change did not show within wait_ms, 3 when a kvd cannot be reached.
int RunStaleness(const StalenessOptions& options, bool json);

struct MemberWatchOptions {
  client::ClientOptions reader;  // the kvd whose cluster lookups are watched
  std::string node;              // the member watched for
  bool absent = false;           // false: until a lookup lists it; true: until none does
  int64_t wait_ms = 30000;       // the most it waits
};

// Polls cluster lookups at the reader until the condition holds, then prints when (wall clock,
// ns since the epoch, to compare with when the script started or killed the member). Returns
// the exit code: 0, 1 when the condition did not hold within wait_ms, 3 when unreachable.
int RunMemberWatch(const MemberWatchOptions& options, bool json);

}  // namespace kvd::tools::cluster_bench
