// storage_bench: throughput and latency of the storage tiers on this machine, next to the
// baselines that bound them (memcpy and Checksum64 of the same bytes), measured in the same run.
// Not run by ctest. Usage: storage_bench [--chunk-mib=2 | --chunk-bytes=N] [--iters=200]
//                                       [--disk-dir=/tmp]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "kvd/common/cli.h"
#include "kvd/storage/disk_tier.h"
#include "kvd/storage/host_tier.h"
#include "test_util.h"

namespace kvd::storage {
namespace {

using Clock = std::chrono::steady_clock;
using testing::AlignedRegion;
using testing::ChainRequest;
using testing::MakeKey;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

void PrintRate(const char* what, size_t bytes, int iters, double seconds) {
  std::printf("%-44s %8.2f GB/s  %8.1f us/op\n", what,
              static_cast<double>(bytes) * iters / seconds / 1e9, seconds / iters * 1e6);
}

void PrintLatency(const char* what, std::vector<double>& ns) {
  std::sort(ns.begin(), ns.end());
  auto pct = [&](double p) {
    return ns[std::min(ns.size() - 1, static_cast<size_t>(p * ns.size()))];
  };
  std::printf("%-44s p50 %7.2f us  p99 %7.2f us  (n=%zu)\n", what, pct(0.50) / 1e3, pct(0.99) / 1e3,
              ns.size());
}

int Run(size_t chunk, int iters, const std::string& disk_dir) {
  std::vector<std::byte> src = testing::RandomBytes(chunk, 1);
  std::vector<std::byte> dst(chunk);
  const uint64_t checksum = Checksum64(src.data(), chunk);

  // Baselines over the same working set as the host tier below (16 chunk slots), so both
  // see the same cache behaviour (a 2 MiB chunk fits in L2/L3; 16 of them do not).
  AlignedRegion ring(16 * chunk);
  std::memset(ring.data(), 1, 16 * chunk);  // fault the pages in, as the tier's warm-up does
  auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    std::memcpy(ring.data() + (i % 16) * chunk, src.data(), chunk);
  }
  PrintRate("baseline memcpy into a 16-chunk ring", chunk, iters, Seconds(t0, Clock::now()));
  volatile uint64_t sink = 0;
  t0 = Clock::now();
  for (int i = 0; i < iters; ++i) sink = sink + Checksum64(ring.data() + (i % 16) * chunk, chunk);
  PrintRate("baseline Checksum64 (xxh3-64) over the ring", chunk, iters, Seconds(t0, Clock::now()));
  t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    std::byte* slot = ring.data() + (i % 16) * chunk;
    std::memcpy(slot, src.data(), chunk);
    sink = sink + Checksum64(slot, chunk);
  }
  PrintRate("baseline memcpy + Checksum64 (= a put's work)", chunk, iters,
            Seconds(t0, Clock::now()));

  // Host tier sized for 16 chunks (each rounded up to 4 KiB, more than the tier's alignment), so
  // the steady state evicts one chunk per put.
  const size_t slot = (chunk + 4095) / 4096 * 4096;
  AlignedRegion region(16 * slot);
  std::memset(region.data(), 1, 16 * slot);
  auto tier_or = HostTier::Create(HostTierOptions{}, region.span());
  if (!tier_or.ok()) return std::fprintf(stderr, "%s\n", tier_or.status().ToString().c_str()), 1;
  HostTier& tier = **tier_or;
  std::vector<double> reserve_ns;
  t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    auto a = Clock::now();
    auto r = tier.Reserve(MakeKey(i), chunk, 256, 1);
    reserve_ns.push_back(std::chrono::duration<double, std::nano>(Clock::now() - a).count());
    if (!r.ok()) return std::fprintf(stderr, "%s\n", r.status().ToString().c_str()), 1;
    std::memcpy(r->data, src.data(), chunk);
    Status s = tier.Commit(r->id, checksum);
    if (!s.ok()) return std::fprintf(stderr, "%s\n", s.ToString().c_str()), 1;
  }
  PrintRate("host reserve+memcpy+commit (verifies)", chunk, iters, Seconds(t0, Clock::now()));
  PrintLatency("host Reserve (incl. LRU eviction)", reserve_ns);

  // Lookup latency: 16-chunk chains, all hits, and all misses (lease released each time).
  std::vector<double> hit_ns, miss_ns;
  const LookupRequest hit = ChainRequest(static_cast<uint64_t>(iters) - 16, 16);
  const LookupRequest miss = ChainRequest(1u << 30, 16);
  for (int i = 0; i < 20000; ++i) {
    auto a = Clock::now();
    auto r = tier.Lookup(hit);
    hit_ns.push_back(std::chrono::duration<double, std::nano>(Clock::now() - a).count());
    if (!r.ok() || r->matched_chunks != 16) return std::fprintf(stderr, "lookup miss\n"), 1;
    tier.ReleaseLease(r->lease_id).IgnoreError();
    a = Clock::now();
    auto m = tier.Lookup(miss);
    miss_ns.push_back(std::chrono::duration<double, std::nano>(Clock::now() - a).count());
  }
  PrintLatency("host Lookup, 16-chunk chain, all hit", hit_ns);
  PrintLatency("host Lookup, 16-chunk chain, miss", miss_ns);
  auto lease = tier.Lookup(hit);
  t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    auto v = tier.Get(lease->lease_id, static_cast<size_t>(i % 16));
    std::memcpy(dst.data(), v->data, chunk);
    tier.ReleaseRead(v->read_id).IgnoreError();
  }
  PrintRate("host Get+memcpy out+ReleaseRead", chunk, iters, Seconds(t0, Clock::now()));

  for (int config = 0; config < 4; ++config) {
    const bool wal = config % 2 == 0;
    const bool blob = config >= 2;
    const std::string label =
        std::string(wal ? "WAL on" : "WAL off") + (blob ? ", blob files" : "");
    const std::string path = disk_dir + "/kvd_storage_bench_" + std::to_string(config);
    std::filesystem::remove_all(path);
    DiskTierOptions o;
    o.path = path;
    o.use_wal = wal;
    o.blob_files = blob;
    auto disk_or = DiskTier::Open(o);
    if (!disk_or.ok()) return std::fprintf(stderr, "%s\n", disk_or.status().ToString().c_str()), 1;
    DiskTier& disk = **disk_or;
    const int n = std::max(1, iters / 2);
    t0 = Clock::now();
    for (int i = 0; i < n; ++i) {
      Status s = disk.Insert(MakeKey(i), 256, checksum, src);
      if (!s.ok()) return std::fprintf(stderr, "%s\n", s.ToString().c_str()), 1;
    }
    PrintRate(("disk Insert (" + label + ")").c_str(), chunk, n, Seconds(t0, Clock::now()));
    t0 = Clock::now();
    for (int i = 0; i < n; ++i) {
      auto m = disk.ReadInto(MakeKey(i), dst);
      if (!m.ok()) return std::fprintf(stderr, "%s\n", m.status().ToString().c_str()), 1;
    }
    PrintRate(("disk ReadInto, verified (" + label + ")").c_str(), chunk, n,
              Seconds(t0, Clock::now()));
    disk_or = Status::Cancelled("closing");
    std::filesystem::remove_all(path);
  }
  return 0;
}

}  // namespace
}  // namespace kvd::storage

int main(int argc, char** argv) {
  size_t chunk_bytes = size_t{2} << 20;
  int iters = 200;
  std::string disk_dir = std::filesystem::temp_directory_path().string();
  size_t chunk_mib = 0;
  CLI::App app{"storage_bench: throughput and latency of the storage tiers", "storage_bench"};
  auto* mib = app.add_option("--chunk-mib", chunk_mib, "chunk size in MiB (default 2)")
                  ->check(CLI::Range(size_t{1}, size_t{1024}));
  app.add_option("--chunk-bytes", chunk_bytes, "chunk size in bytes")
      ->check(CLI::Range(size_t{1}, size_t{1} << 30))
      ->excludes(mib);
  app.add_option("--iters", iters, "iterations (at least 32)")->capture_default_str();
  app.add_option("--disk-dir", disk_dir, "folder of the disk tier's RocksDB")
      ->capture_default_str();
  if (int rc = kvd::cli::Parse(app, argc, argv); rc >= 0) return rc;
  if (chunk_mib > 0) chunk_bytes = chunk_mib << 20;
  if (iters < 32) iters = 32;
  if (chunk_bytes == 0) return std::fprintf(stderr, "chunk size must be > 0\n"), 2;
  std::printf("storage_bench: chunk %zu bytes, %d iterations\n", chunk_bytes, iters);
  return kvd::storage::Run(chunk_bytes, iters, disk_dir);
}
