#include "memcpy_bench.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.h"
#include "util.h"

namespace kvd::tools::bench {
namespace {

// The phases of --op memcpy, each a destination kind (see kvd_bench.cc's header comment).
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

}  // namespace

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

}  // namespace kvd::tools::bench
