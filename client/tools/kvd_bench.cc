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
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <thread>

#include "daemon_stats.h"
#include "kvd/client/client.h"
#include "kvd/common/cli.h"
#include "util.h"

namespace {

using Clock = std::chrono::steady_clock;
using kvd::Status;

struct PhaseResult {
  std::string name;
  uint64_t ops = 0, bytes = 0;
  double seconds = 0;       // wall time less the bench's own work (see the header comment)
  double wall_seconds = 0;  // wall time of the phase
  std::vector<double> latencies_us;
  uint64_t busy_retries = 0;                     // --retry-busy: puts refused for a full pool
  std::optional<kvd::tools::ProcSample> daemon;  // the daemon's counters during the phase
  double Percentile(double p) const {
    if (latencies_us.empty()) return 0;
    std::vector<double> v = latencies_us;
    size_t k = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
    std::nth_element(v.begin(), v.begin() + k, v.end());
    return v[k];
  }
  double Gbps() const { return seconds > 0 ? bytes / seconds / 1e9 : 0; }
  double GbpsWall() const { return wall_seconds > 0 ? bytes / wall_seconds / 1e9 : 0; }
};

// Fills a chunk deterministically from (run, index) so --verify can regenerate it.
void FillChunk(uint8_t* p, size_t n, uint64_t run, uint64_t index);

// --finite-values: sets the exponent field of every little-endian 16-bit word to that of 1.0
// (word = (word & 0x807F) | 0x3F80), keeping the sign and the other bits random. In a bfloat16
// value, and in the high half of a float32 value, that makes the magnitude [1, 2); in a float16
// value [1.875, 2). So every value is finite and no key is (near) zero, whatever the dtype.
void FillFiniteChunk(uint8_t* p, size_t n, uint64_t run, uint64_t index) {
  FillChunk(p, n, run, index);
  for (size_t i = 0; i + 1 < n; i += 2) {
    p[i] = static_cast<uint8_t>(p[i] | 0x80);                   // bit 7: exponent's low bit
    p[i + 1] = static_cast<uint8_t>((p[i + 1] & 0x80) | 0x3F);  // sign kept, exponent 0111111
  }
}

void FillChunk(uint8_t* p, size_t n, uint64_t run, uint64_t index) {
  uint64_t x = run * 0x9E3779B97F4A7C15ull ^ (index + 1) * 0xBF58476D1CE4E5B9ull;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(p + i, &x, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<uint8_t>(x >> (8 * (i % 8)));
}

kvd::Hash128 ChunkHash(uint64_t run, uint64_t index) {
  uint64_t words[2] = {run, index};
  return kvd::HashBytes(words, sizeof words, 0x6b76642d62656e63ull);
}

// The daemon's pid from kvd's --ready-file JSON ({"pid": N, ...}); 0 when absent.
int64_t PidFromReadyFile(const std::string& path, std::string* error) {
  std::error_code ec;
  std::ifstream in;
  if (std::filesystem::is_regular_file(path, ec)) in.open(path);
  if (!in.is_open()) {
    *error = "cannot read --ready-file " + path + " (not a readable file)";
    return 0;
  }
  auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("pid") || !j["pid"].is_number_integer()) {
    *error = "--ready-file " + path + " has no integer \"pid\"";
    return 0;
  }
  return j["pid"].get<int64_t>();
}

// One destination of `n` bytes mapped fresh (untouched pages); nullptr on failure.
uint8_t* MapFresh(size_t n) {
  void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
}

// A phase thread's own buffers (the sources of its puts, the destinations of its gets): made
// (allocated and first touched) at construction and freed at destruction, both counted as the
// bench's own work (added to `*own_seconds`), as an engine's KV buffers exist before it stores
// or loads from them. That work is not the data path's: for 32 MiB chunks it took as long as
// several puts here (a fresh 32 MiB buffer ~20 ms to fault in, ~3 ms to free).
class OwnBuffers {
 public:
  OwnBuffers(size_t n, size_t bytes, double* own_seconds) : own_seconds_(own_seconds) {
    const auto t0 = Clock::now();
    bufs_.resize(n);
    for (auto& b : bufs_) b.assign(bytes, 0);
    *own_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
  }
  ~OwnBuffers() {
    const auto t0 = Clock::now();
    bufs_.clear();
    *own_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
  }
  OwnBuffers(const OwnBuffers&) = delete;
  OwnBuffers& operator=(const OwnBuffers&) = delete;
  uint8_t* operator[](size_t i) { return bufs_[i].data(); }

 private:
  double* own_seconds_;
  std::vector<std::vector<uint8_t>> bufs_;
};

// Prints the phases as a table, or with `json` as `header` plus one object per phase.
void PrintPhases(const std::vector<PhaseResult>& phases, nlohmann::json header, bool json,
                 const std::string& title) {
  auto per_op = [](const PhaseResult& p, double v) { return p.ops > 0 ? v / p.ops : 0.0; };
  if (json) {
    for (const auto& p : phases) {
      nlohmann::json o = {{"ops", p.ops},
                          {"bytes", p.bytes},
                          {"seconds", p.seconds},
                          {"gbps", p.Gbps()},
                          {"wall_seconds", p.wall_seconds},
                          {"gbps_wall", p.GbpsWall()},
                          {"ops_per_s", p.seconds > 0 ? p.ops / p.seconds : 0},
                          {"p50_us", p.Percentile(0.50)},
                          {"p90_us", p.Percentile(0.90)},
                          {"p99_us", p.Percentile(0.99)}};
      if (p.busy_retries > 0) o["busy_retries"] = p.busy_retries;
      if (p.daemon) {
        o["daemon_cpu_us_per_op"] = per_op(p, p.daemon->cpu_ns / 1e3);
        o["daemon_cpu_source"] = p.daemon->cpu_source;
        o["daemon_ctx_switches_per_op"] = per_op(p, p.daemon->context_switches);
        if (p.daemon->has_io) o["daemon_rw_syscalls_per_op"] = per_op(p, p.daemon->rw_syscalls);
      }
      header[p.name] = std::move(o);
    }
    std::cout << header.dump(2) << "\n";
    return;
  }
  std::cout << title << "\n";
  const bool daemon = !phases.empty() && phases[0].daemon.has_value();
  std::vector<std::vector<std::string>> rows;
  char buf[9][32];
  for (const auto& p : phases) {
    std::snprintf(buf[0], 32, "%.3f", p.Gbps());
    std::snprintf(buf[1], 32, "%.0f", p.seconds > 0 ? p.ops / p.seconds : 0);
    std::snprintf(buf[2], 32, "%.1f", p.Percentile(0.5));
    std::snprintf(buf[3], 32, "%.1f", p.Percentile(0.9));
    std::snprintf(buf[4], 32, "%.1f", p.Percentile(0.99));
    rows.push_back({p.name, std::to_string(p.ops), p.name == "lookup" ? "-" : buf[0], buf[1],
                    buf[2], buf[3], buf[4]});
    if (daemon) {
      std::snprintf(buf[5], 32, "%.1f", p.daemon ? per_op(p, p.daemon->cpu_ns / 1e3) : 0.0);
      std::snprintf(buf[6], 32, "%.2f", p.daemon ? per_op(p, p.daemon->context_switches) : 0.0);
      std::snprintf(buf[7], 32, "%.2f", p.daemon ? per_op(p, p.daemon->rw_syscalls) : 0.0);
      rows.back().insert(rows.back().end(), {buf[5], buf[6], buf[7]});
    }
  }
  std::vector<std::string> head = {"OP", "OPS", "GB/s", "OPS/s", "p50 us", "p90 us", "p99 us"};
  if (daemon) head.insert(head.end(), {"daemon CPU us/op", "ctx sw/op", "rw syscalls/op"});
  kvd::tools::PrintTable(std::cout, head, rows);
}

// The phases of --op memcpy, each a destination kind (see the header comment).
enum class MemcpyDst { kFresh, kWarm, kSpread, kScatter };

const char* MemcpyPhaseName(MemcpyDst mode) {
  return mode == MemcpyDst::kFresh    ? "memcpy_fresh"
         : mode == MemcpyDst::kWarm   ? "memcpy_warm"
         : mode == MemcpyDst::kSpread ? "memcpy_spread"
                                      : "memcpy_scatter";
}

// What --op memcpy copies from, made once for all its phases.
struct MemcpySources {
  size_t bytes = 0;   // one copy
  int64_t count = 0;  // copies in all, per phase
  int nthreads = 0;
  std::vector<std::vector<uint8_t>> src;     // per thread: its warm source
  std::vector<std::vector<uint8_t>> spread;  // memcpy_spread's: one per chunk (then reused)
  // memcpy_scatter's destinations: one region of scatter_per_thread x nthreads chunks, thread t
  // writing chunks t, t + nthreads, ... in turn (never another thread's).
  size_t scatter_per_thread = 0;
};

// `scatter_bytes`: memcpy_scatter's destinations in all (0: count x bytes).
MemcpySources MakeMemcpySources(size_t bytes, int64_t count, int64_t concurrency,
                                uint64_t scatter_bytes) {
  MemcpySources m;
  m.bytes = bytes;
  m.count = count;
  m.nthreads = static_cast<int>(std::min(concurrency, count));
  m.src.assign(m.nthreads, std::vector<uint8_t>(bytes));
  for (int t = 0; t < m.nthreads; ++t) FillChunk(m.src[t].data(), bytes, 1, t);
  // memcpy_spread's sources: one per chunk, at most kMaxSpreadBytes in all (then reused in turn).
  constexpr size_t kMaxSpreadBytes = size_t{1} << 30;
  const size_t spread_n = std::clamp<size_t>(kMaxSpreadBytes / std::max<size_t>(bytes, 1), 1,
                                             static_cast<size_t>(count));
  m.spread.assign(spread_n, std::vector<uint8_t>(bytes));
  for (size_t i = 0; i < spread_n; ++i) FillChunk(m.spread[i].data(), bytes, 2, i);
  const uint64_t scatter_total =
      scatter_bytes > 0 ? scatter_bytes : static_cast<uint64_t>(count) * bytes;
  m.scatter_per_thread = std::max<size_t>(1, scatter_total / bytes / m.nthreads);
  return m;
}

// What one thread of a memcpy phase did.
struct MemcpyThreadResult {
  std::vector<double> latencies_us;  // per copy
  uint64_t ops = 0;
  double busy_seconds = 0;  // wall time since the phase's start less its own work
  bool map_failed = false;  // a fresh destination could not be mapped (the thread stopped)
};

// Thread t's copies of one phase; `scatter`: memcpy_scatter's destination region.
void CopyOnThread(const MemcpySources& m, MemcpyDst mode, uint8_t* scatter, int t,
                  Clock::time_point start, MemcpyThreadResult* out) {
  const bool fresh = mode == MemcpyDst::kFresh;
  const size_t bytes = m.bytes;
  // mapping and unmapping, and the warm destination's allocation and first touch: not
  // part of the copy
  const auto alloc0 = Clock::now();
  std::vector<uint8_t> warm(mode == MemcpyDst::kWarm || mode == MemcpyDst::kSpread ? bytes : 0,
                            1);  // touched: its pages exist
  double own = std::chrono::duration<double>(Clock::now() - alloc0).count();
  size_t scatter_next = 0;  // this thread's next memcpy_scatter destination
  for (int64_t i = t; i < m.count; i += m.nthreads) {
    auto m0 = Clock::now();
    uint8_t* dst = fresh ? MapFresh(bytes) : warm.data();
    if (mode == MemcpyDst::kScatter) {
      dst = scatter + (scatter_next * m.nthreads + t) * bytes;
      scatter_next = (scatter_next + 1) % m.scatter_per_thread;
    }
    if (dst == nullptr) {
      out->map_failed = true;
      return;
    }
    auto t0 = Clock::now();
    const uint8_t* from =
        mode == MemcpyDst::kSpread ? m.spread[i % m.spread.size()].data() : m.src[t].data();
    std::memcpy(dst, from, bytes);
    auto t1 = Clock::now();
    out->latencies_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    if (fresh) ::munmap(dst, bytes);
    own += std::chrono::duration<double>(t0 - m0).count() +
           std::chrono::duration<double>(Clock::now() - t1).count();
    ++out->ops;
  }
  out->busy_seconds = std::chrono::duration<double>(Clock::now() - start).count() - own;
}

// One memcpy phase on every thread at once; `*map_failed` when a thread could not map.
PhaseResult RunMemcpyPhase(const MemcpySources& m, MemcpyDst mode, uint8_t* scatter,
                           bool* map_failed) {
  PhaseResult result;
  result.name = MemcpyPhaseName(mode);
  std::vector<MemcpyThreadResult> per_thread(m.nthreads);
  std::vector<std::thread> threads;
  const auto start = Clock::now();
  for (int t = 0; t < m.nthreads; ++t) {
    threads.emplace_back([&, t]() { CopyOnThread(m, mode, scatter, t, start, &per_thread[t]); });
  }
  for (auto& th : threads) th.join();
  result.wall_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  *map_failed = false;
  for (const MemcpyThreadResult& r : per_thread) {
    result.seconds = std::max(result.seconds, r.busy_seconds);
    result.ops += r.ops;
    result.latencies_us.insert(result.latencies_us.end(), r.latencies_us.begin(),
                               r.latencies_us.end());
    *map_failed = *map_failed || r.map_failed;
  }
  result.bytes = result.ops * m.bytes;
  return result;
}

// --op memcpy (see the header comment); `scatter_bytes`: memcpy_scatter's destinations in all
// (0: count x bytes). Returns the exit code.
int RunMemcpy(size_t bytes, int64_t count, int64_t concurrency, uint64_t scatter_bytes, bool json) {
  const MemcpySources m = MakeMemcpySources(bytes, count, concurrency, scatter_bytes);
  std::vector<PhaseResult> phases;
  bool failed = false;
  for (const MemcpyDst mode :
       {MemcpyDst::kFresh, MemcpyDst::kWarm, MemcpyDst::kSpread, MemcpyDst::kScatter}) {
    // memcpy_scatter's region: made (touched) before its phase and freed after it.
    uint8_t* scatter = nullptr;
    const size_t scatter_region = m.scatter_per_thread * m.nthreads * bytes;
    if (mode == MemcpyDst::kScatter) {
      scatter = MapFresh(scatter_region);
      if (scatter == nullptr) {
        std::cerr << "kvd-bench: mmap of " << scatter_region << " bytes failed\n";
        failed = true;
        break;
      }
      std::memset(scatter, 0, scatter_region);  // its pages exist, as a prefaulted arena's do
    }
    bool map_failed = false;
    PhaseResult result = RunMemcpyPhase(m, mode, scatter, &map_failed);
    if (scatter != nullptr) ::munmap(scatter, scatter_region);
    if (map_failed) {
      std::cerr << "kvd-bench: mmap of " << bytes << " bytes failed\n";
      failed = true;
    }
    phases.push_back(std::move(result));
  }
  nlohmann::json j = {{"chunk_bytes", bytes},
                      {"count", count},
                      {"concurrency", m.nthreads},
                      {"op", "memcpy"},
                      {"ok", !failed}};
  PrintPhases(phases, std::move(j), json,
              "kvd-bench: memcpy of " + kvd::tools::HumanBytes(bytes) + ", count " +
                  std::to_string(count) + ", concurrency " + std::to_string(m.nthreads));
  return failed ? 1 : 0;
}

// --in-place put of one chunk: reserve, write the slot (the engine's own write), commit.
Status PutInPlace(kvd::client::Client& c, const kvd::client::PutItem& item) {
  auto slot = c.ReservePut(item.hash, item.tokens, item.bytes);
  if (!slot.ok()) return slot.status();
  if (!slot->already_stored()) std::memcpy(slot->data(), item.data, item.bytes);
  return c.CommitPut(std::move(slot).value()).status();
}

// Reads or writes exactly `n` bytes (read when `out` is null); false on EOF or an error.
bool TransferAll(int fd, const uint8_t* out, uint8_t* in, size_t n) {
  size_t done = 0;
  while (done < n) {
    const ssize_t r =
        out != nullptr ? ::write(fd, out + done, n - done) : ::read(fd, in + done, n - done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    done += static_cast<size_t>(r);
  }
  return true;
}

// The ping-pong of --op pingpong and --pingpong-floor (see the header comment): `count` round
// trips into a phase "pingpong", or with `cpus` (two CPU numbers) the two processes pinned apart,
// this thread to cpus[0] (its own affinity restored afterwards) and the echo to cpus[1], into
// "pingpong_cross_cpu". False (with a message on stderr) if the echo could not start or ended
// early, or the pinning failed.
constexpr size_t kPingPongBytes = 64;  // one message of the ping-pong

bool PingPong(int64_t count, PhaseResult* result, const std::vector<int>& cpus = {}) {
  constexpr size_t kMessageBytes = kPingPongBytes;
  const bool pinned = cpus.size() == 2;
  cpu_set_t own_mask;
  if (pinned && ::sched_getaffinity(0, sizeof own_mask, &own_mask) != 0) {
    std::cerr << "kvd-bench: sched_getaffinity: " << std::strerror(errno) << "\n";
    return false;
  }
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    std::cerr << "kvd-bench: socketpair: " << std::strerror(errno) << "\n";
    return false;
  }
  const pid_t child = ::fork();
  if (child < 0) {
    std::cerr << "kvd-bench: fork: " << std::strerror(errno) << "\n";
    ::close(fds[0]);
    ::close(fds[1]);
    return false;
  }
  if (child == 0) {  // the echo (only async-signal-safe calls): until the parent closes its end
    ::close(fds[0]);
    if (pinned) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpus[1], &one);
      if (::sched_setaffinity(0, sizeof one, &one) != 0) ::_exit(1);
    }
    uint8_t msg[kMessageBytes];
    while (TransferAll(fds[1], nullptr, msg, sizeof msg) &&
           TransferAll(fds[1], msg, nullptr, sizeof msg)) {
    }
    ::_exit(0);
  }
  ::close(fds[1]);
  result->name = pinned ? "pingpong_cross_cpu" : "pingpong";
  uint8_t msg[kMessageBytes] = {1}, back[kMessageBytes];
  bool failed = false;
  if (pinned) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpus[0], &one);
    if (::sched_setaffinity(0, sizeof one, &one) != 0) {
      std::cerr << "kvd-bench: sched_setaffinity: " << std::strerror(errno) << "\n";
      failed = true;
    }
  }
  const auto start = Clock::now();
  for (int64_t i = 0; i < count && !failed; ++i) {
    const auto t0 = Clock::now();
    failed = !TransferAll(fds[0], msg, nullptr, sizeof msg) ||
             !TransferAll(fds[0], nullptr, back, sizeof back);
    result->latencies_us.push_back(
        std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    ++result->ops;
  }
  result->seconds = result->wall_seconds =
      std::chrono::duration<double>(Clock::now() - start).count();
  result->bytes = result->ops * 2 * kMessageBytes;
  ::close(fds[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  if (pinned) ::sched_setaffinity(0, sizeof own_mask, &own_mask);
  if (failed) std::cerr << "kvd-bench: the echo process ended early\n";
  return !failed;
}

// Two CPUs this process may run on (the first two of its affinity mask), for the cross-CPU
// ping-pong; empty with fewer.
std::vector<int> TwoCpus() {
  cpu_set_t mask;
  std::vector<int> out;
  if (::sched_getaffinity(0, sizeof mask, &mask) != 0) return out;
  for (int c = 0; c < CPU_SETSIZE && out.size() < 2; ++c) {
    if (CPU_ISSET(c, &mask)) out.push_back(c);
  }
  if (out.size() < 2) out.clear();
  return out;
}

// Both ping-pong phases (the cross-CPU one when two CPUs are allowed) into `phases`; false if
// one failed.
bool PingPongPhases(int64_t count, std::vector<PhaseResult>* phases) {
  PhaseResult as_scheduled;
  bool ok = PingPong(count, &as_scheduled);
  phases->push_back(std::move(as_scheduled));
  if (const std::vector<int> cpus = TwoCpus(); ok && !cpus.empty()) {
    PhaseResult apart;
    ok = PingPong(count, &apart, cpus);
    phases->push_back(std::move(apart));
  }
  return ok;
}

// --op pingpong (see the header comment). Returns the exit code.
int RunPingPong(int64_t count, bool json) {
  std::vector<PhaseResult> phases;
  const bool ok = PingPongPhases(count, &phases);
  nlohmann::json j = {
      {"count", count}, {"op", "pingpong"}, {"message_bytes", kPingPongBytes}, {"ok", ok}};
  PrintPhases(phases, std::move(j), json,
              "kvd-bench: unix socket pair ping-pong of " + std::to_string(kPingPongBytes) +
                  " B messages, count " + std::to_string(count));
  return ok ? 0 : 1;
}

// The command line (see the header comment and --help for each flag's meaning and default).
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
void AddBenchOptions(CLI::App& app, BenchFlags* f) {
  kvd::tools::AddConnectionOptions(app, &f->connection);
  app.add_option("--model", f->model, "a model registered in kvd (all ops but memcpy)");
  app.add_option("--chunk-bytes", f->chunk_bytes_arg,
                 "bytes per chunk (a whole number of the model's tokens)")
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--tokens", f->tokens, "tokens per chunk (exactly one of this and --chunk-bytes)")
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--count", f->count, "chunks (default 100)")->transform(CLI::AsSizeValue(false));
  app.add_option("--concurrency", f->concurrency,
                 "client threads, one connection each (default 1)");
  app.add_option("--op", f->op,
                 "put, get, both (default), or the references without a daemon: memcpy, "
                 "pingpong");
  app.add_option("--depth", f->depth, "chunks in flight per client call (default 1)");
  app.add_option("--lookup-batch", f->lookup_batch,
                 "chunks per Lookup of the get phase (default 64)");
  app.add_option("--lookup-chain", f->lookup_chain,
                 "chunks per Lookup of the lookup phase (default 1); its ops are Lookup calls");
  app.add_option("--lookups", f->lookups,
                 "Lookup calls of the lookup phase in all, going round the chunks (default 0: "
                 "one per --lookup-chain chunks)")
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--pingpong-floor", f->pingpong_floor,
                 "a unix socket pair ping-pong of this many exchanges right before the lookup "
                 "phase, reported as phases \"pingpong\" and \"pingpong_cross_cpu\" (default 0: "
                 "none)")
      ->transform(CLI::AsSizeValue(false));
  auto* pid_opt = app.add_option("--daemon-pid", f->daemon_pid,
                                 "report the daemon's CPU, context switches and read/write "
                                 "system calls per operation (kvd on this machine)")
                      ->check(CLI::PositiveNumber);
  app.add_option("--ready-file", f->ready_file, "kvd's --ready-file output, naming its pid")
      ->excludes(pid_opt);
  app.add_flag("--no-shm", f->no_shm, "force the transport (UCX) path over a unix socket");
  app.add_flag("--verify", f->verify, "compare every byte read back");
  app.add_flag("--finite-values", f->finite,
               "chunks of finite values of magnitude ~1 (bf16/fp16/fp32; for a compressing model)");
  app.add_flag("--retry-busy", f->retry_busy,
               "retry puts refused for a full ingest pool (RESOURCE_EXHAUSTED) every 2 ms");
  app.add_option("--inline-put-bytes", f->inline_put_bytes,
                 "puts of at most this many bytes in one exchange (default 64 KiB; 0 = off)")
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--warmup", f->warmup,
                 "untimed put + get rounds per client thread before the timed phases, with keys "
                 "of their own (default 0); reported as phase \"warmup\"")
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--shm-inline-put-bytes", f->shm_inline_put_bytes,
                 "on the shared-memory path, inline puts only up to this too (default 32 KiB)")
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--reply-spin-us", f->reply_spin_us,
                 "how long a client waiting for kvd's reply looks for it before it sleeps, "
                 "microseconds (ClientOptions::reply_spin_us; default 50; 0 = sleep at once)");
  app.add_option("--scatter-bytes", f->scatter_bytes,
                 "--op memcpy: memcpy_scatter's destinations in all (default count x chunk bytes; "
                 "give kvd's arena size)")
      ->transform(CLI::AsSizeValue(false));
  app.add_flag("--in-place", f->in_place,
               "zero-copy puts and gets (ReservePut/CommitPut, ReadInPlace; shared memory only)");
  app.add_flag("--reserve-ahead", f->reserve_ahead,
               "shared-memory puts: each commit reserves the next put's slot "
               "(ClientOptions::reserve_ahead; one exchange per put)");
  app.add_option("--put-addr", f->put_addr,
                 "put through the kvd at this address (another member of --addr's cluster)");
  app.add_flag("--cluster", f->cluster,
               "cluster-scope lookups: chunks a peer holds are fetched into --addr's kvd");
  app.add_flag("--json", f->json, "print one JSON object");
}

// Checks the flags every --op shares, resolves --ready-file into f->daemon_pid and probes that
// pid. Empty when all is well, else the usage error.
std::string CheckFlags(BenchFlags* f) {
  const std::string& op = f->op;
  if (op != "put" && op != "get" && op != "both" && op != "memcpy" && op != "pingpong")
    return "--op must be put, get, both, memcpy or pingpong";
  if (f->count <= 0 || f->concurrency <= 0 || f->depth <= 0 || f->lookup_batch <= 0 ||
      f->lookup_chain <= 0) {
    return "--count, --concurrency, --depth, --lookup-batch and --lookup-chain must be > 0";
  }
  if (f->warmup < 0) return "--warmup must be >= 0";
  if (f->lookups < 0 || f->pingpong_floor < 0) {
    return "--lookups and --pingpong-floor must be >= 0";
  }
  if ((f->lookups > 0 || f->pingpong_floor > 0) && op != "get" && op != "both") {
    return "--lookups and --pingpong-floor need a lookup phase (--op get or both)";
  }
  if (f->in_place && (f->depth != 1 || f->no_shm || op == "memcpy" || op == "pingpong")) {
    return "--in-place needs --depth 1 and the shared-memory path (not --no-shm)";
  }
  if (f->warmup > 0 && (op == "memcpy" || op == "pingpong")) {
    return "--warmup needs a daemon (not --op " + op + ")";
  }
  if (f->scatter_bytes < 0) return "--scatter-bytes must be >= 0";
  if (f->scatter_bytes > 0 && op != "memcpy") return "--scatter-bytes needs --op memcpy";
  if (!f->ready_file.empty()) {
    std::string why;
    f->daemon_pid = PidFromReadyFile(f->ready_file, &why);
    if (f->daemon_pid <= 0) return why;
  }
  if (f->daemon_pid > 0) {
    auto probe = kvd::tools::SampleProcess(static_cast<pid_t>(f->daemon_pid));
    if (!probe.ok()) {
      return "daemon pid " + std::to_string(f->daemon_pid) + ": " + probe.status().ToString();
    }
  }
  return "";
}

// The chunks of a daemon run: tokens each and their size in bytes.
struct ChunkShape {
  int64_t tokens = 0;
  size_t chunk_bytes = 0;
};

// Asks kvd for the model's layout, sizes the chunks from --tokens or --chunk-bytes and fills the
// clients' options `base` (connection flags applied already). -1 when all is well, else the exit
// code (a usage error printed, or the failed lookup of the model).
int ConfigureClients(const CLI::App& app, const BenchFlags& f, kvd::client::ClientOptions* base,
                     ChunkShape* shape) {
  auto usage_error = [&](const std::string& why) { return kvd::cli::UsageError(app, why); };
  uint32_t chunk_tokens = 0;
  auto info = kvd::tools::FindModel(*base, f.model, &chunk_tokens);
  if (!info.ok()) {
    std::cerr << "kvd-bench: " << info.status() << "\n";
    return info.status().code() == kvd::StatusCode::kUnavailable ? 3 : 1;
  }
  const kvd::ModelLayout layout = info->layout;
  const size_t per_token = layout.ChunkBytes(1);
  shape->tokens = f.tokens;
  if (f.chunk_bytes_arg > 0) {
    if (f.chunk_bytes_arg % per_token != 0) {
      return usage_error("--chunk-bytes " + std::to_string(f.chunk_bytes_arg) +
                         " is not a whole number of tokens of " + f.model + " (" +
                         std::to_string(per_token) + " bytes per token)");
    }
    shape->tokens = f.chunk_bytes_arg / per_token;
  }
  if (shape->tokens > static_cast<int64_t>(chunk_tokens)) {
    return usage_error("a chunk holds at most " + std::to_string(chunk_tokens) + " tokens, asked " +
                       std::to_string(shape->tokens));
  }
  shape->chunk_bytes = layout.ChunkBytes(static_cast<int>(shape->tokens));
  base->model = f.model;
  base->layout = layout;
  base->chunk_tokens = static_cast<int>(chunk_tokens);
  base->block_tokens = std::gcd(16, static_cast<int>(chunk_tokens));
  base->max_in_flight = static_cast<int>(f.depth);
  base->shared_memory = !f.no_shm;
  base->reserve_ahead = f.reserve_ahead;
  base->inline_put_bytes = static_cast<size_t>(std::max<int64_t>(f.inline_put_bytes, 0));
  base->shm_inline_put_bytes = static_cast<size_t>(std::max<int64_t>(f.shm_inline_put_bytes, 0));
  if (f.reply_spin_us < 0) return usage_error("--reply-spin-us must be >= 0");
  // Validate() names a value above the limit.
  base->reply_spin_us = static_cast<uint32_t>(
      std::min<int64_t>(f.reply_spin_us, kvd::client::ClientOptions::kMaxReplySpinUs + int64_t{1}));
  if (Status v = base->Validate(); !v.ok()) return usage_error(v.message());
  return -1;
}

// What one phase thread did: its latencies (us), operations and bytes.
struct ThreadTally {
  std::vector<double> latencies_us;
  uint64_t ops = 0, bytes = 0;
};

double MicrosSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

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

int DaemonBench::Connect() {
  clients_.resize(nthreads_);
  for (int t = 0; t < nthreads_; ++t) {
    auto c = kvd::client::Client::Connect(base_);
    if (!c.ok()) {
      std::cerr << "kvd-bench: connect: " << c.status() << "\n";
      return c.status().code() == kvd::StatusCode::kUnavailable ? 3 : 1;
    }
    clients_[t] = std::move(c).value();
  }
  put_clients_.resize(f_.put_addr.empty() ? 0 : nthreads_);
  for (auto& pc : put_clients_) {
    kvd::client::ClientOptions o = base_;
    o.address = f_.put_addr;
    auto c = kvd::client::Client::Connect(o);
    if (!c.ok()) {
      std::cerr << "kvd-bench: connect to --put-addr: " << c.status() << "\n";
      return c.status().code() == kvd::StatusCode::kUnavailable ? 3 : 1;
    }
    pc = std::move(c).value();
  }
  return -1;
}

PhaseResult DaemonBench::RunPhase(const std::string& name, const PhaseBody& body) {
  PhaseResult result;
  result.name = name;
  std::vector<std::thread> threads;
  std::fill(own_s_.begin(), own_s_.end(), 0.0);
  std::vector<double> busy_s(nthreads_, 0.0);
  std::optional<kvd::tools::ProcSample> before;
  if (f_.daemon_pid > 0) {
    auto s = kvd::tools::SampleProcess(static_cast<pid_t>(f_.daemon_pid));
    if (s.ok()) before = *s;
  }
  auto start = Clock::now();
  for (int t = 0; t < nthreads_; ++t) {
    threads.emplace_back([&, t]() {
      ThreadTally tally;
      Status s = body(t, tally);
      busy_s[t] = std::chrono::duration<double>(Clock::now() - start).count() - own_s_[t];
      std::lock_guard<std::mutex> lock(mu_);
      if (!s.ok() && first_error_.ok()) first_error_ = s.WithContext(name);
      result.latencies_us.insert(result.latencies_us.end(), tally.latencies_us.begin(),
                                 tally.latencies_us.end());
      result.ops += tally.ops;
      result.bytes += tally.bytes;
    });
  }
  for (auto& th : threads) th.join();
  result.wall_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  result.seconds = *std::max_element(busy_s.begin(), busy_s.end());
  if (before) {
    auto after = kvd::tools::SampleProcess(static_cast<pid_t>(f_.daemon_pid));
    if (after.ok()) result.daemon = kvd::tools::Delta(*before, *after);
  }
  return result;
}

kvd::StatusOr<std::vector<kvd::client::PutResult>> DaemonBench::PutChunks(
    int t, std::span<const kvd::client::PutItem> items) {
  auto r = Writer(t).PutChunks(items);
  while (f_.retry_busy && !r.ok() && r.status().code() == kvd::StatusCode::kResourceExhausted) {
    ++busy_retries_[t];
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    r = Writer(t).PutChunks(items);
  }
  return r;
}

// Each round: put, look up, get and release one chunk of this thread's own warmup keys (those of
// another run value, never the timed phases').
Status DaemonBench::WarmupThread(int t, ThreadTally& tally) {
  const uint64_t warmup_run = run_ ^ 0x7761726d75702121ull;
  OwnBuffers buf(2, chunk_bytes_, &own_s_[t]);  // the put's source, the get's destination
  for (int64_t i = 0; i < f_.warmup; ++i) {
    const uint64_t index = static_cast<uint64_t>(t) * f_.warmup + i;
    const kvd::Hash128 hash = ChunkHash(warmup_run, index);
    auto fill0 = Clock::now();
    fill_(buf[0], chunk_bytes_, warmup_run, index);
    const kvd::client::PutItem item{hash, static_cast<int>(tokens_), buf[0], chunk_bytes_};
    auto t0 = Clock::now();
    own_s_[t] += std::chrono::duration<double>(t0 - fill0).count();
    auto r = PutChunks(t, {&item, 1});
    if (!r.ok()) return r.status();
    auto l = clients_[t]->Lookup({&hash, 1});
    if (!l.ok()) return l.status();
    if (l->matched_chunks != 1) {
      return Status::NotFound("warmup chunk " + std::to_string(index) +
                              " missing right after its put");
    }
    const kvd::client::GetItem get{0, buf[1], chunk_bytes_};
    auto g = clients_[t]->GetChunks(l->lease_id, {&get, 1});
    if (!g.ok()) return g.status();
    KVD_RETURN_IF_ERROR(clients_[t]->ReleaseLease(l->lease_id));
    tally.latencies_us.push_back(MicrosSince(t0));
    ++tally.ops;
    tally.bytes += 2 * chunk_bytes_;
  }
  return Status::Ok();
}

// This thread's chunks, --depth per PutChunks call (or one in place).
Status DaemonBench::PutThread(int t, ThreadTally& tally) {
  const size_t depth = static_cast<size_t>(f_.depth);
  auto idx = Indices(t);
  OwnBuffers bufs(depth, chunk_bytes_, &own_s_[t]);
  for (size_t i = 0; i < idx.size(); i += depth) {
    size_t n = std::min<size_t>(depth, idx.size() - i);
    std::vector<kvd::client::PutItem> items(n);
    auto fill0 = Clock::now();
    for (size_t j = 0; j < n; ++j) {
      fill_(bufs[j], chunk_bytes_, run_, idx[i + j]);
      items[j] = {ChunkHash(run_, idx[i + j]), static_cast<int>(tokens_), bufs[j], chunk_bytes_};
    }
    auto t0 = Clock::now();
    own_s_[t] += std::chrono::duration<double>(t0 - fill0).count();
    if (f_.in_place) {  // n == 1
      KVD_RETURN_IF_ERROR(PutInPlace(Writer(t), items[0]));
      tally.latencies_us.push_back(MicrosSince(t0));
      ++tally.ops;
      tally.bytes += chunk_bytes_;
      continue;
    }
    auto r = PutChunks(t, items);
    tally.latencies_us.push_back(MicrosSince(t0));
    if (!r.ok()) return r.status();
    tally.ops += n;
    tally.bytes += n * chunk_bytes_;
  }
  return Status::Ok();
}

// One Lookup per --lookup-chain chunks of this thread, or its share of --lookups calls.
Status DaemonBench::LookupThread(int t, ThreadTally& tally) {
  const size_t lookup_chain = static_cast<size_t>(f_.lookup_chain);
  const int64_t lookups = f_.lookups;
  auto idx = Indices(t);
  // The chain starts of this thread, in turn, as many as --lookups asks of it (the
  // threads share the calls: thread t makes lookups / nthreads, one more for t below
  // the remainder); by default each chain once.
  std::vector<size_t> starts;
  for (size_t b = 0; b < idx.size(); b += lookup_chain) starts.push_back(b);
  const size_t calls = lookups == 0
                           ? starts.size()
                           : static_cast<size_t>(lookups / nthreads_ + (t < lookups % nthreads_));
  for (size_t c = 0; c < calls && !starts.empty(); ++c) {
    const size_t b = starts[c % starts.size()];
    size_t nb = std::min<size_t>(lookup_chain, idx.size() - b);
    std::vector<kvd::Hash128> chain(nb);
    for (size_t j = 0; j < nb; ++j) chain[j] = ChunkHash(run_, idx[b + j]);
    auto t0 = Clock::now();
    auto r = clients_[t]->Lookup(chain, lookup_options_);
    tally.latencies_us.push_back(MicrosSince(t0));
    if (!r.ok()) return r.status();
    if (r->matched_chunks != nb) {
      return Status::NotFound("chunk " + std::to_string(idx[b + r->matched_chunks]) +
                              " missing at lookup (evicted? "
                              "the host tier may be smaller than count x chunk bytes)");
    }
    ++tally.ops;
    tally.bytes += r->fetched_chunks * chunk_bytes_;
    KVD_RETURN_IF_ERROR(clients_[t]->ReleaseLease(r->lease_id));
  }
  return Status::Ok();
}

// As an engine reads a prompt: one Lookup (one lease) for a run of up to --lookup-batch chunks,
// then Gets of --depth chunks per call, then one ReleaseLease. The latency is per Get call; the
// throughput counts the whole phase (lookups and releases included).
Status DaemonBench::GetThread(int t, ThreadTally& tally) {
  const size_t lookup_batch = static_cast<size_t>(f_.lookup_batch);
  auto idx = Indices(t);
  OwnBuffers bufs(f_.depth, chunk_bytes_, &own_s_[t]);
  OwnBuffers expect(f_.verify ? 1 : 0, chunk_bytes_, &own_s_[t]);
  for (size_t b = 0; b < idx.size(); b += lookup_batch) {
    size_t nb = std::min<size_t>(lookup_batch, idx.size() - b);
    std::vector<kvd::Hash128> chain(nb);
    for (size_t j = 0; j < nb; ++j) chain[j] = ChunkHash(run_, idx[b + j]);
    auto l = clients_[t]->Lookup(chain, lookup_options_);
    if (!l.ok()) return l.status();
    if (l->matched_chunks != nb) {
      return Status::NotFound("only " + std::to_string(l->matched_chunks) + " of " +
                              std::to_string(nb) + " chunks found at get");
    }
    if (f_.in_place) {
      KVD_RETURN_IF_ERROR(ReadBatchInPlace(t, idx, b, nb, l->lease_id, expect, tally));
    } else {
      KVD_RETURN_IF_ERROR(ReadBatchCopies(t, idx, b, nb, l->lease_id, bufs, expect, tally));
    }
    KVD_RETURN_IF_ERROR(clients_[t]->ReleaseLease(l->lease_id));
  }
  return Status::Ok();
}

Status DaemonBench::ReadBatchInPlace(int t, const std::vector<uint64_t>& idx, size_t b, size_t nb,
                                     uint64_t lease_id, OwnBuffers& expect, ThreadTally& tally) {
  for (size_t i = 0; i < nb; ++i) {
    auto t0 = Clock::now();
    auto v = clients_[t]->ReadInPlace(lease_id, static_cast<uint32_t>(i));
    if (!v.ok()) return v.status();
    tally.latencies_us.push_back(MicrosSince(t0));
    if (f_.verify) {
      auto v0 = Clock::now();
      fill_(expect[0], chunk_bytes_, run_, idx[b + i]);
      if (v->size() != chunk_bytes_ || std::memcmp(expect[0], v->data(), chunk_bytes_) != 0) {
        return Status::DataLoss("chunk " + std::to_string(idx[b + i]) + " differs");
      }
      own_s_[t] += std::chrono::duration<double>(Clock::now() - v0).count();
    }
    v->Release();  // ends the read with the next request
    ++tally.ops;
    tally.bytes += chunk_bytes_;
  }
  return Status::Ok();
}

Status DaemonBench::ReadBatchCopies(int t, const std::vector<uint64_t>& idx, size_t b, size_t nb,
                                    uint64_t lease_id, OwnBuffers& bufs, OwnBuffers& expect,
                                    ThreadTally& tally) {
  const size_t depth = static_cast<size_t>(f_.depth);
  for (size_t i = 0; i < nb; i += depth) {
    size_t n = std::min<size_t>(depth, nb - i);
    std::vector<kvd::client::GetItem> items(n);
    for (size_t j = 0; j < n; ++j) {
      items[j] = {static_cast<uint32_t>(i + j), bufs[j], chunk_bytes_};
    }
    auto t0 = Clock::now();
    auto r = clients_[t]->GetChunks(lease_id, items);
    tally.latencies_us.push_back(MicrosSince(t0));
    if (!r.ok()) return r.status();
    if (f_.verify) {
      auto v0 = Clock::now();
      for (size_t j = 0; j < n; ++j) {
        fill_(expect[0], chunk_bytes_, run_, idx[b + i + j]);
        if (std::memcmp(expect[0], bufs[j], chunk_bytes_) != 0) {
          return Status::DataLoss("chunk " + std::to_string(idx[b + i + j]) + " differs");
        }
      }
      own_s_[t] += std::chrono::duration<double>(Clock::now() - v0).count();
    }
    tally.ops += n;
    tally.bytes += n * chunk_bytes_;
  }
  return Status::Ok();
}

void DaemonBench::RunPhases() {
  if (f_.warmup > 0) {
    phases_.push_back(
        RunPhase("warmup", [this](int t, ThreadTally& tally) { return WarmupThread(t, tally); }));
    TakeBusyRetries();
  }
  if (first_error_.ok()) {
    phases_.push_back(
        RunPhase("put", [this](int t, ThreadTally& tally) { return PutThread(t, tally); }));
    TakeBusyRetries();
  }
  const bool reads = f_.op != "put";
  if (reads && first_error_.ok() && f_.pingpong_floor > 0 &&
      !PingPongPhases(f_.pingpong_floor, &phases_)) {
    first_error_ = Status::Internal("the --pingpong-floor ping-pong failed");
  }
  if (reads && first_error_.ok()) {
    phases_.push_back(
        RunPhase("lookup", [this](int t, ThreadTally& tally) { return LookupThread(t, tally); }));
  }
  if (reads && first_error_.ok()) {
    phases_.push_back(
        RunPhase("get", [this](int t, ThreadTally& tally) { return GetThread(t, tally); }));
  }
}

int DaemonBench::Report() {
  const bool shm_used = !clients_.empty() && clients_[0] && clients_[0]->session().shared_memory;
  clients_.clear();
  put_clients_.clear();

  nlohmann::json j = {
      {"model", f_.model}, {"chunk_bytes", chunk_bytes_},        {"tokens", tokens_},
      {"count", f_.count}, {"concurrency", nthreads_},           {"depth", f_.depth},
      {"op", f_.op},       {"ucx_tls", base_.transport.ucx_tls}, {"ok", first_error_.ok()}};
  const size_t inline_limit = shm_used
                                  ? std::min(base_.inline_put_bytes, base_.shm_inline_put_bytes)
                                  : base_.inline_put_bytes;
  j["shared_memory"] = shm_used;
  j["in_place"] = f_.in_place;
  j["inline_put_bytes"] = inline_limit;
  j["inline_puts"] = chunk_bytes_ <= inline_limit;
  j["lookup_chain"] = f_.lookup_chain;
  j["cluster"] = f_.cluster;
  if (!f_.put_addr.empty()) j["put_addr"] = f_.put_addr;
  j["reply_spin_us"] = base_.reply_spin_us;
  if (f_.lookups > 0) j["lookups"] = f_.lookups;
  if (f_.pingpong_floor > 0) j["pingpong_floor"] = f_.pingpong_floor;
  if (f_.daemon_pid > 0) j["daemon_pid"] = f_.daemon_pid;
  if (!first_error_.ok()) j["error"] = first_error_.ToString();
  if (f_.warmup > 0) j["warmup_rounds"] = f_.warmup;
  if (f_.op == "get") {  // the untimed put
    phases_.erase(std::remove_if(phases_.begin(), phases_.end(),
                                 [](const PhaseResult& p) { return p.name == "put"; }),
                  phases_.end());
  }
  PrintPhases(phases_, std::move(j), f_.json,
              "kvd-bench: model " + f_.model + ", " + kvd::tools::HumanBytes(chunk_bytes_) +
                  " chunks (" + std::to_string(tokens_) + " tokens), count " +
                  std::to_string(f_.count) + ", concurrency " + std::to_string(nthreads_) +
                  ", depth " + std::to_string(f_.depth) + ", ucx_tls '" + base_.transport.ucx_tls +
                  "'" + (shm_used ? ", shared memory" : "") + (f_.in_place ? ", in place" : "") +
                  (chunk_bytes_ <= inline_limit ? ", inline puts" : ""));
  if (!first_error_.ok()) {
    std::cerr << "kvd-bench: " << first_error_ << "\n";
    return 1;
  }
  return 0;
}

// --op put, get or both (flags checked by CheckFlags). Returns the exit code.
int RunAgainstDaemon(const CLI::App& app, const BenchFlags& f) {
  if (f.model.empty()) return kvd::cli::UsageError(app, "--model is required");
  if ((f.tokens > 0) == (f.chunk_bytes_arg > 0)) {
    return kvd::cli::UsageError(app, "give exactly one of --chunk-bytes and --tokens");
  }
  kvd::client::ClientOptions base;
  kvd::tools::ApplyConnectionFlags(f.connection, &base);
  ChunkShape shape;
  if (int rc = ConfigureClients(app, f, &base, &shape); rc >= 0) return rc;
  DaemonBench bench(f, base, shape);
  if (int rc = bench.Connect(); rc >= 0) return rc;
  bench.RunPhases();
  return bench.Report();
}

}  // namespace

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
