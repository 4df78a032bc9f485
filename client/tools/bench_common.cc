#include "bench_common.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <iostream>

#include "util.h"

namespace kvd::tools::bench {

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

uint8_t* MapFresh(size_t n) {
  void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
}

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

}  // namespace kvd::tools::bench
