// kvd-bench (internal to client/tools): what every phase shares: a phase's result and its
// report, the chunks' bytes, a phase thread's own buffers.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "daemon_stats.h"
#include "kvd/common/hash.h"

namespace kvd::tools::bench {

using Clock = std::chrono::steady_clock;

// What one phase did (summed over its threads).
struct PhaseResult {
  std::string name;
  uint64_t ops = 0, bytes = 0;
  double seconds = 0;  // wall time less the bench's own work (see kvd_bench.cc's header comment)
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
void FillFiniteChunk(uint8_t* p, size_t n, uint64_t run, uint64_t index);
// The key of chunk `index` of run `run`.
kvd::Hash128 ChunkHash(uint64_t run, uint64_t index);

// One destination of `n` bytes mapped fresh (untouched pages); nullptr on failure.
uint8_t* MapFresh(size_t n);

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
                 const std::string& title);

}  // namespace kvd::tools::bench
