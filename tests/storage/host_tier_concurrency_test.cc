// Concurrency smoke test: writers, readers, an expiry sweeper and an admin thread at once.
// Short (a few thousand operations per thread); the invariants are checked at the end.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "kvd/storage/host_tier.h"
#include "test_util.h"

namespace kvd::storage {
namespace {

using namespace std::chrono_literals;
using testing::AlignedRegion;
using testing::ChainRequest;
using testing::MakeKey;

TEST(HostTierConcurrencyTest, ManyThreadsReserveCommitLookupGet) {
  AlignedRegion region(256 * 1024);  // ~60 chunks of 4 KiB: constant eviction pressure
  HostTierOptions options;
  // Long enough that a writer never outlives its reservation (after expiry the space may be
  // handed out again: a late writer would corrupt its new owner; see HostTier::Reserve). Expiry
  // still runs concurrently: every 13th reservation is abandoned with a 1 ms ttl.
  options.reservation_ttl = 60000ms;
  auto tier_or = HostTier::Create(options, region.span());
  ASSERT_TRUE(tier_or.ok());
  HostTier& tier = **tier_or;
  constexpr int kThreads = 4;
  constexpr int kOps = 1500;
  std::atomic<uint64_t> bad_bytes{0}, unexpected{0}, committed{0}, reads{0};
  std::atomic<bool> stop{false};

  auto worker = [&](int t) {
    std::vector<std::byte> buf(4096);
    for (int i = 0; i < kOps; ++i) {
      const uint64_t n = (static_cast<uint64_t>(t) * 7 + i) % 200;
      // Content is a function of the key, so any reader can verify it.
      for (size_t j = 0; j < buf.size(); ++j) buf[j] = static_cast<std::byte>(n * 31 + j);
      if (i % 13 == 0) {
        auto abandoned = tier.Reserve(MakeKey(100000 + n), 512, 1, /*owner=*/t + 1, 1ms);
        if (!abandoned.ok() && abandoned.status().code() != StatusCode::kResourceExhausted) {
          unexpected++;
        }
      }
      auto r = tier.Reserve(MakeKey(n), buf.size(), 256, /*owner=*/t + 1);
      if (r.ok()) {
        std::memcpy(r->data, buf.data(), buf.size());
        Status s = (i % 11 == 0) ? tier.Abort(r->id)
                                 : tier.Commit(r->id, Checksum64(buf.data(), buf.size()));
        if (s.ok()) {
          committed++;
        } else if (!IsDedup(s) && s.code() != StatusCode::kAborted) {
          unexpected++;
        }
      } else if (!IsDedup(r.status()) && r.status().code() != StatusCode::kResourceExhausted) {
        unexpected++;
      }
      auto lease = tier.Lookup(ChainRequest(n, 3));
      if (!lease.ok()) {
        unexpected++;
        continue;
      }
      for (size_t c = 0; c < lease->matched_chunks; ++c) {
        auto view = tier.Get(lease->lease_id, c);
        if (!view.ok()) {
          unexpected++;
          continue;
        }
        reads++;
        const uint64_t m = view->meta.key.chain_hash.hi;
        for (size_t j = 0; j < view->meta.size_bytes; j += 97) {
          if (view->data[j] != static_cast<std::byte>(m * 31 + j)) bad_bytes++;
        }
        if (Checksum64(view->data, view->meta.size_bytes) != view->meta.checksum) bad_bytes++;
        if (!tier.ReleaseRead(view->read_id).ok()) unexpected++;
      }
      if (lease->lease_id != 0 && !tier.ReleaseLease(lease->lease_id).ok()) unexpected++;
    }
  };
  std::thread sweeper([&] {
    while (!stop.load()) {
      tier.ExpireReservations();
      tier.ExpireLeases();
      (void)tier.GetStats();
      (void)tier.List(ChunkFilter::All(), 10);
      std::this_thread::sleep_for(1ms);
    }
  });
  std::thread admin([&] {
    for (int i = 0; i < 20 && !stop.load(); ++i) {
      tier.Evict(ChunkFilter::Key(MakeKey(static_cast<uint64_t>(i * 9))));
      std::this_thread::sleep_for(2ms);
    }
  });
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t) workers.emplace_back(worker, t);
  for (auto& w : workers) w.join();
  stop = true;
  sweeper.join();
  admin.join();

  EXPECT_EQ(bad_bytes.load(), 0u);
  EXPECT_EQ(unexpected.load(), 0u);
  EXPECT_GT(committed.load(), 0u);
  EXPECT_GT(reads.load(), 0u);
  const TierStats s = tier.GetStats();
  EXPECT_EQ(s.hits + s.misses, s.lookups);
  EXPECT_EQ(s.lookups, static_cast<uint64_t>(kThreads) * kOps);
  std::this_thread::sleep_for(2ms);
  tier.ExpireReservations();  // abandoned ones younger than 1 ms at the sweeper's last pass
  const TierStats after = tier.GetStats();
  EXPECT_EQ(after.reservations_open, 0u);
  EXPECT_GT(after.reservations_expired, 0u);
  EXPECT_EQ(after.leases_open, 0u);
  EXPECT_EQ(after.reads_open, 0u);
  EXPECT_EQ(after.pinned_bytes, 0u);
  EXPECT_EQ(after.arena_allocated_bytes, tier.GetArenaStats().allocated_bytes);
  tier.Evict(ChunkFilter::All());
  EXPECT_EQ(tier.GetArenaStats().allocated_bytes, 0u);
}

}  // namespace
}  // namespace kvd::storage
