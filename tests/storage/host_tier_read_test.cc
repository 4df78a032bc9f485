// HostTier read protocol and eviction: lookup prefixes, leases, read pins, LRU under pressure.
#include <gtest/gtest.h>

#include <cstring>

#include "kvd/common/clock.h"
#include "kvd/storage/host_tier.h"
#include "test_util.h"

namespace kvd::storage {
namespace {

using namespace std::chrono_literals;
using testing::AlignedRegion;
using testing::ChainRequest;
using testing::Contains;
using testing::MakeKey;
using testing::PutChunk;
using testing::RandomBytes;

constexpr size_t kChunk = 1024;

// Room for exactly 4 chunks of kChunk bytes.
class HostTierReadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    HostTierOptions options;
    options.lease_ttl = 100ms;
    options.read_ttl = 200ms;
    auto tier = HostTier::Create(options, region_.span(), &clock_);
    ASSERT_TRUE(tier.ok()) << tier.status();
    tier_ = std::move(tier).value();
  }
  std::vector<std::byte> Put(uint64_t n) {
    auto bytes = RandomBytes(kChunk, static_cast<uint32_t>(n));
    Status s = PutChunk(*tier_, MakeKey(n), bytes);
    EXPECT_TRUE(s.ok()) << s;
    return bytes;
  }
  bool Stored(uint64_t n) { return tier_->Describe(MakeKey(n)).ok(); }

  AlignedRegion region_{4 * kChunk};
  ManualClock clock_{1'000'000'000};
  std::unique_ptr<HostTier> tier_;
};

TEST_F(HostTierReadTest, LeaseServesOnlyItsOwner) {
  const auto bytes = Put(0);
  LookupRequest req = ChainRequest(0, 1);
  req.owner = 7;
  auto r = tier_->Lookup(req);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->matched_chunks, 1u);
  // Another owner: the same answer as for an id never issued; the lease stays usable.
  auto stolen = tier_->Get(r->lease_id, 0, /*caller=*/8);
  EXPECT_EQ(stolen.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(stolen.status(), "is not held by this client")) << stolen.status();
  Status release = tier_->ReleaseLease(r->lease_id, /*caller=*/8);
  EXPECT_EQ(release.code(), StatusCode::kNotFound) << release;
  auto view = tier_->Get(r->lease_id, 0, /*caller=*/7);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(std::memcmp(view->data, bytes.data(), kChunk), 0);
  ASSERT_TRUE(tier_->ReleaseRead(view->read_id).ok());
  EXPECT_TRUE(tier_->ReleaseLease(r->lease_id, /*caller=*/7).ok());
}

TEST_F(HostTierReadTest, IdsAreUnpredictable) {
  // Ids come from the CSPRNG: consecutive ids are not neighbours, and they spread over 63 bits.
  Put(0);
  std::vector<uint64_t> ids;
  for (int i = 0; i < 64; ++i) {
    auto r = tier_->Lookup(ChainRequest(0, 1));
    ASSERT_TRUE(r.ok());
    ids.push_back(r->lease_id);
    ASSERT_TRUE(tier_->ReleaseLease(r->lease_id).ok());
  }
  uint64_t high = 0, neighbours = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_NE(ids[i], 0u);
    EXPECT_LT(ids[i], uint64_t{1} << 63);
    high += ids[i] >= (uint64_t{1} << 62);  // ~half of uniform 63-bit ids
    if (i > 0 && (ids[i] - ids[i - 1] < 1024 || ids[i - 1] - ids[i] < 1024)) neighbours++;
  }
  // P(high outside [8, 56] | uniform) < 1e-9; P(any neighbours | uniform) < 64 * 2^-52.
  EXPECT_GE(high, 8u);
  EXPECT_LE(high, 56u);
  EXPECT_EQ(neighbours, 0u);
}

TEST_F(HostTierReadTest, LookupReturnsTheLongestStoredPrefix) {
  for (uint64_t n : {0, 1, 2}) Put(n);
  ASSERT_TRUE(tier_->Evict(ChunkFilter::Key(MakeKey(2))).evicted == 1);
  Put(3);  // stored, but after a gap: must not count
  auto r = tier_->Lookup(ChainRequest(0, 5));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->matched_chunks, 2u);
  EXPECT_EQ(r->matched_tokens, 512u);
  ASSERT_EQ(r->chunks.size(), 2u);
  EXPECT_EQ(r->chunks[1].key, MakeKey(1));
  EXPECT_NE(r->lease_id, 0u);
  // A chain that starts with a missing chunk matches nothing, even if later ones are stored.
  EXPECT_EQ(tier_->Lookup(ChainRequest(2, 2))->matched_chunks, 0u);
  // Another layout digest, codec or namespace never shares chunks.
  LookupRequest other = ChainRequest(0, 2);
  other.layout_digest ^= 1;
  EXPECT_EQ(tier_->Lookup(other)->matched_chunks, 0u);
  other = ChainRequest(0, 2);
  other.codec_id = 9;
  EXPECT_EQ(tier_->Lookup(other)->matched_chunks, 0u);
  EXPECT_EQ(tier_->Lookup(ChainRequest(0, 2, "llama", "tenant2"))->matched_chunks, 0u);
  EXPECT_EQ(tier_->Lookup(ChainRequest(0, 0))->matched_chunks, 0u);
}

TEST_F(HostTierReadTest, CapacityPressureEvictsLeastRecentlyUsedAndGetMakesRecent) {
  for (uint64_t n = 0; n < 4; ++n) Put(n);
  // Touch chunk 0 by a read: now chunk 1 is the least recently used.
  auto view = tier_->GetByKey(MakeKey(0), 1);
  ASSERT_TRUE(view.ok());
  ASSERT_TRUE(tier_->ReleaseRead(view->read_id).ok());
  Put(4);
  EXPECT_TRUE(Stored(0));
  EXPECT_FALSE(Stored(1));
  EXPECT_TRUE(Stored(2) && Stored(3) && Stored(4));
  Put(5);
  EXPECT_FALSE(Stored(2));
  EXPECT_EQ(tier_->GetStats().evictions, 2u);
  Status s = tier_->GetByKey(MakeKey(1), 1).status();
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(s, MakeKey(1).ToString())) << s;
}

TEST_F(HostTierReadTest, LeasedChunkIsNeverEvictedBeforeItsReadCompletes) {
  const auto bytes0 = Put(0);
  for (uint64_t n = 1; n < 4; ++n) Put(n);
  auto lease = tier_->Lookup(ChainRequest(0, 1));
  ASSERT_TRUE(lease.ok());
  ASSERT_EQ(lease->matched_chunks, 1u);
  // Chunk 0 is now the most recent anyway; make it the oldest to be sure pinning is what saves it.
  for (uint64_t n = 1; n < 4; ++n) {
    auto v = tier_->GetByKey(MakeKey(n), 1);
    ASSERT_TRUE(v.ok());
    ASSERT_TRUE(tier_->ReleaseRead(v->read_id).ok());
  }
  for (uint64_t n = 10; n < 20; ++n) Put(n);  // heavy pressure
  EXPECT_TRUE(Stored(0));
  auto view = tier_->Get(lease->lease_id, 0);
  ASSERT_TRUE(view.ok()) << view.status();
  // The lease ends but the read is in flight: still pinned.
  ASSERT_TRUE(tier_->ReleaseLease(lease->lease_id).ok());
  for (uint64_t n = 20; n < 30; ++n) Put(n);
  EXPECT_TRUE(Stored(0));
  EXPECT_EQ(std::memcmp(view->data, bytes0.data(), kChunk), 0);
  EXPECT_EQ(tier_->GetStats().pinned_bytes, kChunk);
  ASSERT_TRUE(tier_->ReleaseRead(view->read_id).ok());
  EXPECT_EQ(tier_->GetStats().pinned_bytes, 0u);
  for (uint64_t n = 30; n < 34; ++n) Put(n);
  EXPECT_FALSE(Stored(0));  // evictable once the read completed
}

TEST_F(HostTierReadTest, AllPinnedMeansResourceExhaustedNamingTheBytes) {
  for (uint64_t n = 0; n < 4; ++n) Put(n);
  auto lease = tier_->Lookup(ChainRequest(0, 4));
  ASSERT_EQ(lease->matched_chunks, 4u);
  auto r = tier_->Reserve(MakeKey(9), kChunk, 256, 1);
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(r.status(), "capacity=4096")) << r.status();
  EXPECT_TRUE(Contains(r.status(), "pinned=4096")) << r.status();
  EXPECT_TRUE(Contains(r.status(), "used=4096")) << r.status();
  EXPECT_EQ(tier_->GetStats().evictions, 0u);
  for (uint64_t n = 0; n < 4; ++n) EXPECT_TRUE(Stored(n));
  ASSERT_TRUE(tier_->ReleaseLease(lease->lease_id).ok());
  EXPECT_TRUE(tier_->Reserve(MakeKey(9), kChunk, 256, 1).ok());
}

TEST_F(HostTierReadTest, InfeasibleReserveEvictsNothing) {
  for (uint64_t n = 0; n < 4; ++n) Put(n);
  auto lease = tier_->Lookup(ChainRequest(0, 3));  // 3 of 4 pinned: 1 chunk evictable
  ASSERT_EQ(lease->matched_chunks, 3u);
  auto r = tier_->Reserve(MakeKey(9), 2 * kChunk, 256, 1);
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Stored(3));  // not sacrificed for a reservation that could not fit anyway
}

TEST_F(HostTierReadTest, ExpiredLeaseUnpinsAndLateGetIsAborted) {
  for (uint64_t n = 0; n < 4; ++n) Put(n);
  auto lease = tier_->Lookup(ChainRequest(0, 1));
  ASSERT_EQ(lease->matched_chunks, 1u);
  clock_.AdvanceMillis(101);
  const ReclaimResult expired = tier_->ExpireLeases();
  EXPECT_EQ(expired.leases, 1u);
  EXPECT_EQ(tier_->GetStats().pinned_bytes, 0u);
  Status s = tier_->Get(lease->lease_id, 0).status();
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_TRUE(Contains(s, "lease")) << s;
  EXPECT_TRUE(Contains(s, "expired")) << s;
}

TEST_F(HostTierReadTest, GetAfterLeaseDeadlineIsAbortedWithoutSweep) {
  Put(0);
  auto lease = tier_->Lookup(ChainRequest(0, 1));
  clock_.AdvanceMillis(101);
  Status s = tier_->Get(lease->lease_id, 0).status();
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_TRUE(Contains(s, "expired")) << s;
  EXPECT_EQ(tier_->GetStats().pinned_bytes, 0u);
}

TEST_F(HostTierReadTest, StuckReadExpires) {
  Put(0);
  auto view = tier_->GetByKey(MakeKey(0), 1);
  ASSERT_TRUE(view.ok());
  clock_.AdvanceMillis(201);
  EXPECT_EQ(tier_->ExpireLeases().reads, 1u);
  EXPECT_EQ(tier_->ReleaseRead(view->read_id).code(), StatusCode::kAborted);
  EXPECT_EQ(tier_->GetStats().pinned_bytes, 0u);
}

TEST_F(HostTierReadTest, LookupHitMakesChunksRecent) {
  for (uint64_t n = 0; n < 4; ++n) Put(n);
  auto lease = tier_->Lookup(ChainRequest(0, 2));  // 0 and 1 become the most recent
  ASSERT_EQ(lease->matched_chunks, 2u);
  ASSERT_TRUE(tier_->ReleaseLease(lease->lease_id).ok());
  Put(4);
  Put(5);
  EXPECT_TRUE(Stored(0) && Stored(1));
  EXPECT_FALSE(Stored(2) || Stored(3));
}

TEST_F(HostTierReadTest, PerRequestLeaseTtlOverridesTheDefault) {
  Put(0);
  LookupRequest req = ChainRequest(0, 1);
  req.lease_ttl = 500ms;  // default is 100 ms in this fixture
  auto lease = tier_->Lookup(req);
  ASSERT_EQ(lease->matched_chunks, 1u);
  EXPECT_EQ(lease->lease_deadline_ns, clock_.NowNanos() + 500'000'000);
  clock_.AdvanceMillis(200);
  EXPECT_EQ(tier_->ExpireLeases().leases, 0u);
  EXPECT_TRUE(tier_->Get(lease->lease_id, 0).ok());
  clock_.AdvanceMillis(301);
  EXPECT_EQ(tier_->ExpireLeases().leases, 1u);
}

TEST(HostTierQuotaTest, NamespaceQuotaEvictsOnlyThatNamespaceAndNamesIt) {
  AlignedRegion region(8 * kChunk);
  HostTierOptions options;
  options.quotas.defaults.stored_bytes = 2 * kChunk;
  auto tier_or = HostTier::Create(options, region.span());
  ASSERT_TRUE(tier_or.ok());
  HostTier& tier = **tier_or;
  auto put = [&](uint64_t n, const std::string& ns) {
    return PutChunk(tier, MakeKey(n, "llama", ns), RandomBytes(kChunk, static_cast<uint32_t>(n)));
  };
  ASSERT_TRUE(put(0, "b").ok());
  ASSERT_TRUE(put(1, "a").ok());
  ASSERT_TRUE(put(2, "a").ok());
  ASSERT_TRUE(put(3, "a").ok());  // over quota: a's oldest (1) goes, b's chunk 0 stays
  EXPECT_FALSE(tier.Describe(MakeKey(1, "llama", "a")).ok());
  EXPECT_TRUE(tier.Describe(MakeKey(0, "llama", "b")).ok());
  TierStats s = tier.GetStats();
  EXPECT_EQ(s.per_namespace.at("a").bytes, 2 * kChunk);
  EXPECT_EQ(s.quota_evictions, 1u);
  EXPECT_EQ(s.evictions, 1u);

  // Open reservations count too, and pinned chunks are never evicted for the quota.
  auto lease = tier.Lookup(ChainRequest(2, 2, "llama", "a"));
  ASSERT_EQ(lease->matched_chunks, 2u);
  auto r = tier.Reserve(MakeKey(4, "llama", "a"), kChunk, 256, 1);
  EXPECT_EQ(r.status().reason(), Reason::kQuotaExceeded);
  EXPECT_TRUE(Contains(r.status(), "namespace \"a\" is at its quota stored_bytes")) << r.status();
  EXPECT_TRUE(tier.Reserve(MakeKey(4, "llama", "b"), kChunk, 256, 1).ok());  // b has room
  ASSERT_TRUE(tier.ReleaseLease(lease->lease_id).ok());
  r = tier.Reserve(MakeKey(4, "llama", "a"), 3 * kChunk, 256, 1);
  EXPECT_EQ(r.status().reason(), Reason::kQuotaExceeded);
  EXPECT_TRUE(Contains(r.status(), "stored_bytes=2048")) << r.status();
}

TEST_F(HostTierReadTest, GetErrors) {
  Put(0);
  EXPECT_EQ(tier_->Get(777, 0).status().code(), StatusCode::kNotFound);
  auto lease = tier_->Lookup(ChainRequest(0, 1));
  Status s = tier_->Get(lease->lease_id, 1).status();
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_TRUE(Contains(s, "holds 1 chunks")) << s;
  ASSERT_TRUE(tier_->ReleaseLease(lease->lease_id).ok());
  s = tier_->ReleaseLease(lease->lease_id);
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_TRUE(Contains(s, "already released")) << s;
  EXPECT_EQ(tier_->ReleaseRead(4242).code(), StatusCode::kNotFound);
  // A retired lease id used as a reservation id is "unknown", not "aborted".
  s = tier_->Commit(lease->lease_id, 0);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(s, "was a lease")) << s;
}

TEST_F(HostTierReadTest, AdminEvictOfPinnedChunkIsDeferredUntilItsReadEnds) {
  const auto bytes = Put(0);
  Put(1);
  auto view = tier_->GetByKey(MakeKey(0), 1);
  ASSERT_TRUE(view.ok());
  const EvictResult ev = tier_->Evict(ChunkFilter::All());
  EXPECT_EQ(ev.evicted, 1u);
  EXPECT_EQ(ev.deferred, 1u);
  EXPECT_FALSE(Stored(0));  // hidden at once
  EXPECT_EQ(tier_->Lookup(ChainRequest(0, 1))->matched_chunks, 0u);
  TierStats st = tier_->GetStats();
  EXPECT_EQ(st.used_bytes, 0u);
  EXPECT_EQ(st.arena_allocated_bytes, kChunk);  // still held by the read
  EXPECT_EQ(std::memcmp(view->data, bytes.data(), kChunk), 0);
  ASSERT_TRUE(tier_->ReleaseRead(view->read_id).ok());
  EXPECT_EQ(tier_->GetStats().arena_allocated_bytes, 0u);
  // A fresh put of the same key works after the hidden copy is gone.
  Put(0);
  EXPECT_TRUE(Stored(0));
}

TEST_F(HostTierReadTest, RemoveRefusesPinnedChunks) {
  Put(0);
  auto lease = tier_->Lookup(ChainRequest(0, 1));
  Status s = tier_->Remove(MakeKey(0));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(s, "pinned")) << s;
  ASSERT_TRUE(tier_->ReleaseLease(lease->lease_id).ok());
  EXPECT_TRUE(tier_->Remove(MakeKey(0)).ok());
  EXPECT_EQ(tier_->Remove(MakeKey(0)).code(), StatusCode::kNotFound);
}

TEST_F(HostTierReadTest, InsertAndReadIntoCopy) {
  const auto bytes = RandomBytes(kChunk, 99);
  ASSERT_TRUE(tier_->Insert(MakeKey(5), 128, Checksum64(bytes.data(), kChunk), bytes).ok());
  EXPECT_EQ(tier_->Insert(MakeKey(6), 128, 1, bytes).code(), StatusCode::kDataLoss);
  std::vector<std::byte> out(kChunk);
  auto meta = tier_->ReadInto(MakeKey(5), out);
  ASSERT_TRUE(meta.ok()) << meta.status();
  EXPECT_EQ(meta->tokens, 128u);
  EXPECT_EQ(out, bytes);
  std::vector<std::byte> small(10);
  Status s = tier_->ReadInto(MakeKey(5), small).status();
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_TRUE(Contains(s, "buffer of 10 bytes")) << s;
  EXPECT_EQ(tier_->GetStats().reads_open, 0u);
}

}  // namespace
}  // namespace kvd::storage
