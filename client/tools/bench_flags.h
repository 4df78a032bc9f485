// kvd-bench's command line (internal to client/tools): its flags, their checks, and the clients'
// options they make (see kvd_bench.cc's header comment and --help).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvd/client/client.h"
#include "util.h"

namespace CLI {
class App;
}  // namespace CLI

namespace kvd::tools::bench {

// The command line (see kvd_bench.cc's header comment and --help for each flag's meaning and
// default).
struct BenchFlags {
  kvd::tools::ConnectionFlags connection;
  std::string model, op = "both", ready_file, put_addr;
  int64_t count = 100, concurrency = 1, depth = 1, lookup_batch = 64, lookup_chain = 1, tokens = 0,
          chunk_bytes_arg = 0, daemon_pid = 0, warmup = 0, lookups = 0, pingpong_floor = 0;
  bool json = false, verify = false, no_shm = false, finite = false, retry_busy = false,
       in_place = false, reserve_ahead = false, cluster = false;
  int64_t inline_put_bytes = static_cast<int64_t>(kvd::client::ClientOptions().inline_put_bytes);
  int64_t shm_inline_put_bytes =
      static_cast<int64_t>(kvd::client::ClientOptions().shm_inline_put_bytes);
  int64_t reply_spin_us = kvd::client::ClientOptions().reply_spin_us;
  int64_t scatter_bytes = 0;
};

// Declares every flag of kvd-bench on `app`, bound to `f`.
void AddBenchOptions(CLI::App& app, BenchFlags* f);

// Checks the flags every --op shares, resolves --ready-file into f->daemon_pid and probes that
// pid. Empty when all is well, else the usage error.
std::string CheckFlags(BenchFlags* f);

// The chunks of a daemon run: tokens each and their size in bytes.
struct ChunkShape {
  int64_t tokens = 0;
  size_t chunk_bytes = 0;
};

// Asks kvd for the model's layout, sizes the chunks from --tokens or --chunk-bytes and fills the
// clients' options `base` (connection flags applied already). -1 when all is well, else the exit
// code (a usage error printed, or the failed lookup of the model).
int ConfigureClients(const CLI::App& app, const BenchFlags& f, kvd::client::ClientOptions* base,
                     ChunkShape* shape);

}  // namespace kvd::tools::bench
