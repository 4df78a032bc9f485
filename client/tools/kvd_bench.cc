// kvd-bench: put/get/lookup throughput and latency against a running kvd.
//
//   kvd-bench --addr ADDR --model M (--chunk-bytes B | --tokens T) --count N --concurrency C
//             --op put|get|both [--depth D] [--lookup-batch L] [--lookup-chain K] [--ucx-tls TLS]
//             [--net-devices DEV] [--no-shm] [--verify] [--daemon-pid PID | --ready-file F]
//             [--finite-values] [--retry-busy] [--inline-put-bytes B] [--warmup W]
//             [--shm-inline-put-bytes B] [--in-place] [--reserve-ahead] [--lookups N]
//             [--pingpong-floor N] [--reply-spin-us U] [--put-addr ADDR] [--cluster] [--json]
//   kvd-bench --op memcpy --chunk-bytes B --count N --concurrency C [--scatter-bytes S] [--json]
//   kvd-bench --op pingpong --count N [--json]
//
// Over a unix-socket address the clients use the shared-memory path when kvd grants it
// (reported as "shared_memory" in the output); --no-shm forces the transport (UCX) path.
// C client threads (one Client, one connection, one transport each) share N chunks of random
// bytes. Phases: put (Reserve -> send -> Commit; chunks of at most --inline-put-bytes, default
// the library's 64 KiB, in one InlinePut exchange instead; 0 = always three steps; on the
// shared-memory path also at most --shm-inline-put-bytes, default 32 KiB), lookup (one
// Lookup per K chunks, --lookup-chain, default 1; latency and the daemon's cost per Lookup call;
// --lookups N makes N Lookup calls in all instead, each thread going round its chunks as often as
// needed, so that a p99 has samples even when few chunks are stored),
// get (one Lookup per L chunks (default 64), then Gets of D chunks in flight per call,
// checksum-verified by the library). --warmup W first runs a phase "warmup": each client thread
// puts, looks up, gets and releases W chunks of its own, one at a time, with keys the timed
// phases never use, so the first use of each connection's mappings and of the daemon's memory
// (segment maps, page-table fills) is paid there, as a long-lived engine pays it once, and stays
// visible in that phase's figures (latency per round of put + lookup + get + release; its GB/s
// counts the bytes put and read back). Default 0: no warmup, the timed phases pay first use.
// Throughput (gbps) is bytes / time of the phase across all threads, not counting the bench's own
// work (allocating, first touching and freeing the put sources, the get destinations and the
// memcpy buffers, generating each chunk's bytes before a put, --verify's compare after a get):
// the time is the longest thread's wall time minus that thread's own work; gbps_wall counts it
// too (GB/s = 1e9 bytes/s). Latencies are per
// call (per batch of D with --depth > 1). --op get still stores the chunks first (untimed
// output).
//
// Peer fetch (a kvd cluster): --put-addr ADDR puts the chunks through another kvd of the cluster,
// and --cluster makes every Lookup cluster-scoped (LookupOptions::cluster): the lookup phase's
// lookups then copy the chunks from that peer into the --addr kvd, and its throughput counts the
// bytes fetched (LookupResult::fetched_chunks); the get phase then reads them there.
//
// --in-place (shared-memory path only): the zero-copy calls an engine that DMAs its KV uses. A put
// is ReservePut, a memcpy of the chunk's bytes from the thread's buffer into the slot (standing
// for the engine's own write, e.g. a device-to-host DMA), and CommitPut (one hashing pass); a get
// is ReadInPlace (one hashing pass to verify the checksum, no copy) and the view's release, per
// chunk (--depth must be 1; the release rides on the next request). --verify compares the view.
//
// Compressing models (a model with a compression policy that needs no window queries, e.g.
// KeyDiff): --finite-values makes every value of the random chunks finite, of magnitude ~1 (kvd
// refuses NaN/Inf K/V of a chunk it compresses, KeyDiff a zero key); --retry-busy retries a put
// that kvd refused because its ingest pool was full (RESOURCE_EXHAUSTED) every 2 ms until it is
// admitted, so a flood measures the pool's throughput: the put latency then counts the waits,
// "busy_retries" counts the refusals. Use --op put for such a model (its gets return compact
// chunks, not the bytes put).
//
// Daemon cost per operation: with --daemon-pid (or --ready-file, kvd's --ready-file output,
// which names the pid) each phase also reports the daemon's CPU time, context switches and
// read/write-family system calls during the phase, divided by the phase's operations
// (daemon_cpu_us_per_op, daemon_ctx_switches_per_op, daemon_rw_syscalls_per_op; see
// daemon_stats.h for what the kernel counts). The daemon must run on this machine.
//
// --op memcpy needs no daemon: the reference a same-node data path is measured against. Each
// client thread copies --chunk-bytes from its own warm source buffer --count / C times, phase
// "memcpy_fresh" into a destination freshly mapped for every copy (its page faults are part of
// the copy, as for a buffer an application has just allocated) and phase "memcpy_warm" into one
// destination buffer reused for every copy. Phase "memcpy_spread" copies each of --count
// distinct source chunks (count x chunk bytes in all, as a store holding the run's chunks; at
// most 1 GiB of sources, reused in turn beyond it) once into one reused destination: what a get
// of those chunks reads, so a source is in the cache only when all of them fit (memcpy_warm's
// one source stays cached up to a few MiB). Phase "memcpy_scatter" copies each thread's warm
// source --count / C times into distinct destinations in turn, --scatter-bytes of them in all
// (default count x chunk bytes; give kvd's arena size): what a put writes, a slot whose pages
// exist but whose bytes (those of the chunk evicted longest ago) are no longer in the cache,
// while memcpy_warm writes one destination that stays cached up to a few MiB. Reported like the
// other phases.
//
// --op pingpong needs no daemon either: the floor under one request/reply exchange on this
// machine. A child process echoes --count messages of 64 bytes over a unix socket pair, both
// sides blocking in read(2), one message in flight; phase "pingpong" reports each round trip.
// Two wake-ups of a sleeping process per round trip, as an exchange with kvd has (without
// kvd's work), so a lookup's latency tail can be held against the scheduler's on the same box.
// The two processes run where the scheduler puts them, which is usually one CPU (the child
// starts where its parent runs, and each wakes the other as it goes to sleep); phase
// "pingpong_cross_cpu" repeats the exchanges with the two pinned to two different CPUs (the
// first two this process may use; absent with only one), as a client and kvd's io thread are
// whenever the scheduler places them apart: a wake-up across CPUs can cost much more (2-3x per
// round trip on a 2-vCPU virtual machine), and an exchange with kvd pays the one that applies.
// --pingpong-floor N runs the same N exchanges (both phases) inside a daemon run, right before
// its lookup phase: the floor of that moment, next to the lookups it bounds.
//
// Exit 0 on success, 1 on a failed operation, 2 usage, 3 cannot connect.
#include <CLI/CLI.hpp>
#include <string>

#include "bench_flags.h"
#include "daemon_bench.h"
#include "kvd/common/cli.h"
#include "memcpy_bench.h"
#include "pingpong_bench.h"

using kvd::tools::bench::AddBenchOptions;
using kvd::tools::bench::BenchFlags;
using kvd::tools::bench::CheckFlags;
using kvd::tools::bench::RunAgainstDaemon;
using kvd::tools::bench::RunMemcpy;
using kvd::tools::bench::RunPingPong;

int main(int argc, char** argv) {
  CLI::App app{"kvd-bench: put/get/lookup throughput and latency against a running kvd",
               "kvd-bench"};
  app.footer(
      "kvd-bench --op memcpy --chunk-bytes B --count N --concurrency C [--json] and\n"
      "kvd-bench --op pingpong --count N [--json] need no daemon\n"
      "sizes and counts take K/M/G suffixes (1024-based)\n"
      "exit codes: 0 ok, 1 a failed operation, 2 usage, 3 cannot connect");
  BenchFlags flags;
  AddBenchOptions(app, &flags);
  if (int rc = kvd::cli::Parse(app, argc, argv); rc >= 0) return rc;
  if (std::string why = CheckFlags(&flags); !why.empty()) return kvd::cli::UsageError(app, why);
  if (flags.op == "pingpong") return RunPingPong(flags.count, flags.json);
  if (flags.op == "memcpy") {
    if (flags.chunk_bytes_arg <= 0 || flags.tokens > 0) {
      return kvd::cli::UsageError(app, "--op memcpy needs --chunk-bytes");
    }
    return RunMemcpy(static_cast<size_t>(flags.chunk_bytes_arg), flags.count, flags.concurrency,
                     static_cast<uint64_t>(flags.scatter_bytes), flags.json);
  }
  return RunAgainstDaemon(app, flags);
}
