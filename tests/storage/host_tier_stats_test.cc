// HostTier stats invariants, per model / namespace breakdowns, List and Evict filters.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <random>

#include "kvd/storage/host_tier.h"
#include "test_util.h"

namespace kvd::storage {
namespace {

using testing::AlignedRegion;
using testing::ChainRequest;
using testing::MakeKey;
using testing::PutChunk;
using testing::RandomBytes;

void ExpectInvariants(const TierStats& s) {
  EXPECT_EQ(s.hits + s.misses, s.lookups);
  EXPECT_LE(s.chunks_matched, s.chunks_requested);
  UsageStats by_model, by_ns;
  for (const auto& [name, u] : s.per_model) {
    by_model.chunks += u.chunks;
    by_model.bytes += u.bytes;
  }
  for (const auto& [name, u] : s.per_namespace) {
    by_ns.chunks += u.chunks;
    by_ns.bytes += u.bytes;
  }
  EXPECT_EQ(by_model.bytes, s.used_bytes);
  EXPECT_EQ(by_ns.bytes, s.used_bytes);
  EXPECT_EQ(by_model.chunks, s.chunk_count);
  EXPECT_EQ(by_ns.chunks, s.chunk_count);
  EXPECT_LE(s.used_bytes + s.reserved_bytes, s.capacity_bytes);
  EXPECT_LE(s.pinned_bytes, s.used_bytes);
  EXPECT_LE(s.used_bytes + s.reserved_bytes, s.arena_allocated_bytes);
}

TEST(HostTierStatsTest, InvariantsHoldThroughARandomWorkload) {
  AlignedRegion region(64 * 1024);
  HostTierOptions options;
  options.quotas.defaults.stored_bytes = 24 * 1024;  // exercise quota evictions too
  auto tier_or = HostTier::Create(options, region.span());
  ASSERT_TRUE(tier_or.ok());
  HostTier& tier = **tier_or;
  std::mt19937 rng(5);
  const char* models[] = {"llama", "qwen"};
  const char* spaces[] = {"a", "b", "c"};
  std::vector<LeaseId> leases;
  uint64_t lookups = 0;
  for (int step = 0; step < 2000; ++step) {
    const uint64_t n = rng() % 40;
    const std::string model = models[n % 2];
    const std::string ns = spaces[n % 3];
    switch (rng() % 5) {
      case 0:
      case 1: {
        Status s = PutChunk(tier, MakeKey(n, model, ns), RandomBytes(100 + rng() % 3000, n),
                            static_cast<uint32_t>(n));
        ASSERT_TRUE(s.ok() || IsDedup(s) || s.code() == StatusCode::kResourceExhausted) << s;
        break;
      }
      case 2: {
        auto r = tier.Lookup(ChainRequest(n, 1 + rng() % 3, model, ns));
        ASSERT_TRUE(r.ok());
        ++lookups;
        if (r->lease_id != 0) leases.push_back(r->lease_id);
        break;
      }
      case 3:
        if (!leases.empty()) {
          ASSERT_TRUE(tier.ReleaseLease(leases.back()).ok());
          leases.pop_back();
        }
        break;
      case 4:
        if (rng() % 10 == 0) tier.Evict(ChunkFilter::Namespace(ns));
        break;
    }
    if (step % 50 == 0) ExpectInvariants(tier.GetStats());
  }
  TierStats s = tier.GetStats();
  ExpectInvariants(s);
  EXPECT_EQ(s.lookups, lookups);
  EXPECT_GT(s.quota_evictions, 0u);
  for (const auto& [ns, u] : s.per_namespace) EXPECT_LE(u.bytes, 24u * 1024) << ns;
  for (LeaseId l : leases) ASSERT_TRUE(tier.ReleaseLease(l).ok());
  EXPECT_EQ(tier.GetStats().pinned_bytes, 0u);
  tier.Evict(ChunkFilter::All());
  s = tier.GetStats();
  EXPECT_EQ(s.chunk_count, 0u);
  EXPECT_EQ(s.arena_allocated_bytes, 0u);  // no leak: every block came back
  EXPECT_TRUE(s.per_model.empty());
  EXPECT_EQ(tier.GetArenaStats().free_blocks, 1u);
}

TEST(HostTierStatsTest, HitsMissesAndBreakdowns) {
  AlignedRegion region(16 * 1024);
  auto tier_or = HostTier::Create(HostTierOptions{}, region.span());
  ASSERT_TRUE(tier_or.ok());
  HostTier& tier = **tier_or;
  ASSERT_TRUE(PutChunk(tier, MakeKey(0, "llama", "a"), RandomBytes(100, 1), 256).ok());
  ASSERT_TRUE(PutChunk(tier, MakeKey(1, "llama", "a"), RandomBytes(200, 2), 256).ok());
  ASSERT_TRUE(PutChunk(tier, MakeKey(0, "qwen", "b"), RandomBytes(300, 3), 128).ok());
  ASSERT_TRUE(tier.Lookup(ChainRequest(0, 3, "llama", "a")).ok());  // hit, 2 of 3
  ASSERT_TRUE(tier.Lookup(ChainRequest(5, 1, "llama", "a")).ok());  // miss
  ASSERT_TRUE(tier.Lookup(ChainRequest(0, 1, "qwen", "a")).ok());   // miss (namespace)
  const TierStats s = tier.GetStats();
  EXPECT_EQ(s.lookups, 3u);
  EXPECT_EQ(s.hits, 1u);
  EXPECT_EQ(s.misses, 2u);
  EXPECT_EQ(s.chunks_requested, 5u);
  EXPECT_EQ(s.chunks_matched, 2u);
  EXPECT_EQ(s.used_bytes, 600u);
  EXPECT_EQ(s.pinned_bytes, 300u);
  EXPECT_EQ(s.leases_open, 1u);
  EXPECT_EQ(s.capacity_bytes, 16u * 1024);
  EXPECT_EQ(s.per_model.at("llama"), (UsageStats{2, 300, 512}));
  EXPECT_EQ(s.per_model.at("qwen"), (UsageStats{1, 300, 128}));
  EXPECT_EQ(s.per_namespace.at("a"), (UsageStats{2, 300, 512}));
  EXPECT_EQ(s.per_namespace.at("b"), (UsageStats{1, 300, 128}));
  ExpectInvariants(s);
}

TEST(HostTierStatsTest, ListFiltersLimitsAndOrdersMostRecentFirst) {
  AlignedRegion region(16 * 1024);
  auto tier_or = HostTier::Create(HostTierOptions{}, region.span());
  ASSERT_TRUE(tier_or.ok());
  HostTier& tier = **tier_or;
  for (uint64_t n = 0; n < 4; ++n) {
    ASSERT_TRUE(PutChunk(tier, MakeKey(n, n < 3 ? "llama" : "qwen"), RandomBytes(64, n)).ok());
  }
  auto all = tier.List(ChunkFilter::All(), 0);
  ASSERT_EQ(all.size(), 4u);
  EXPECT_EQ(all[0].key, MakeKey(3, "qwen"));  // most recent first
  EXPECT_EQ(all[3].key, MakeKey(0));
  EXPECT_EQ(all[0].tier, TierKind::kHost);
  EXPECT_EQ(tier.List(ChunkFilter::All(), 2).size(), 2u);
  EXPECT_EQ(tier.List(ChunkFilter::Model("llama"), 0).size(), 3u);
  EXPECT_EQ(tier.List(ChunkFilter::Namespace("nope"), 0).size(), 0u);
  auto one = tier.List(ChunkFilter::Key(MakeKey(1)), 0);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].checksum, Checksum64(RandomBytes(64, 1).data(), 64));

  EvictResult ev = tier.Evict(ChunkFilter::Model("llama"));
  EXPECT_EQ(ev.evicted, 3u);
  EXPECT_EQ(ev.bytes, 192u);
  EXPECT_EQ(tier.GetStats().admin_evictions, 3u);
  EXPECT_EQ(tier.GetStats().evictions, 0u);  // capacity evictions are counted apart
  EXPECT_EQ(tier.List(ChunkFilter::All(), 0).size(), 1u);
  EXPECT_EQ(tier.Evict(ChunkFilter::Key(MakeKey(3))).evicted, 0u);  // model differs
  EXPECT_EQ(tier.Evict(ChunkFilter::Key(MakeKey(3, "qwen"))).evicted, 1u);
}

// Long-run shape (users' ask: no leaks or fragmentation in long runs): with mixed chunk sizes
// and no pins, a Reserve never fails, eviction keeps the arena well used (it does not evict far
// more than a reservation needs), and everything returns to one free block at the end.
TEST(HostTierSoakTest, MixedSizesNeverFailWithoutPinsAndDoNotLeak) {
  constexpr uint64_t kCapacity = 4 << 20;
  AlignedRegion region(kCapacity);
  auto tier_or = HostTier::Create(HostTierOptions{}, region.span());
  ASSERT_TRUE(tier_or.ok());
  HostTier& tier = **tier_or;
  std::mt19937 rng(11);
  double min_used = 1.0, sum_used = 0.0;
  int steady = 0;
  for (uint64_t n = 0; n < 5000; ++n) {
    // Full chunks (64 KiB) most of the time, a partial last chunk of a prompt otherwise.
    const uint64_t bytes = rng() % 4 == 0 ? 1 + rng() % (64 << 10) : (64 << 10);
    auto r = tier.Reserve(MakeKey(n), bytes, 256, 1);
    ASSERT_TRUE(r.ok()) << "step " << n << ": " << r.status();
    ASSERT_TRUE(tier.Commit(r->id, Checksum64(r->data, bytes)).ok());
    if (n >= 200) {  // past the first fill
      const double used = static_cast<double>(tier.GetStats().used_bytes) / kCapacity;
      min_used = std::min(min_used, used);
      sum_used += used;
      ++steady;
    }
  }
  const TierStats s = tier.GetStats();
  const ArenaStats a = tier.GetArenaStats();
  std::printf(
      "soak: payload occupancy mean %.3f min %.3f; at end %llu chunks, %llu free blocks, "
      "fragmentation %.2f, %llu evictions\n",
      sum_used / steady, min_used, static_cast<unsigned long long>(s.chunk_count),
      static_cast<unsigned long long>(a.free_blocks), a.fragmentation,
      static_cast<unsigned long long>(s.evictions));
  EXPECT_GT(min_used, 0.75);
  EXPECT_GT(sum_used / steady, 0.9);
  EXPECT_EQ(a.allocated_bytes, s.arena_allocated_bytes);
  tier.Evict(ChunkFilter::All());
  EXPECT_EQ(tier.GetArenaStats().free_blocks, 1u);
  EXPECT_EQ(tier.GetArenaStats().allocated_bytes, 0u);
}

}  // namespace
}  // namespace kvd::storage
