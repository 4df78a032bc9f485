// kvd-cluster-bench --op router-index (internal to client/tools): the memory of the index a
// KV-aware router keeps when it is fed every node's KV events (chunk hash -> the nodes holding
// it), built in this process and measured (see kvd_cluster_bench.cc's header comment).
#pragma once

#include <cstdint>

namespace kvd::tools::cluster_bench {

struct RouterIndexOptions {
  int64_t chunks = 1 << 20;   // distinct chunk hashes indexed
  int nodes = 3;              // nodes of the cluster
  int holders_per_chunk = 1;  // nodes holding each chunk (1..nodes)
  int chain_chunks = 16;      // chunks per chain (prefix tree only)
};

// Builds each index in turn (freeing the one before) and prints the bytes per chunk each took:
// heap bytes in use (mallinfo2) and resident memory (RSS). Returns the exit code.
int RunRouterIndex(const RouterIndexOptions& options, bool json);

}  // namespace kvd::tools::cluster_bench
