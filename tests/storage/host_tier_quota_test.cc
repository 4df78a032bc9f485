// HostTier per-namespace quotas (reserved bytes, pinned bytes, leases) and lookup chains that
// repeat a hash.
#include <gtest/gtest.h>

#include "kvd/storage/host_tier.h"
#include "test_util.h"

namespace kvd::storage {
namespace {

using testing::AlignedRegion;
using testing::ChainRequest;
using testing::Contains;
using testing::MakeKey;
using testing::PutChunk;
using testing::RandomBytes;

constexpr size_t kChunk = 1024;

class HostTierNamespaceQuotaTest : public ::testing::Test {
 protected:
  void Make(const NamespaceQuota& a) {
    HostTierOptions options;
    options.quotas.namespaces["a"] = a;
    auto tier = HostTier::Create(options, region_.span());
    ASSERT_TRUE(tier.ok()) << tier.status();
    tier_ = std::move(tier).value();
  }
  void Put(uint64_t n, const std::string& ns) {
    Status s =
        PutChunk(*tier_, MakeKey(n, "llama", ns), RandomBytes(kChunk, static_cast<uint32_t>(n)));
    ASSERT_TRUE(s.ok()) << s;
  }
  AlignedRegion region_{16 * kChunk};
  std::unique_ptr<HostTier> tier_;
};

TEST_F(HostTierNamespaceQuotaTest, ReservedBytesStopOnlyThatNamespace) {
  Make({.reserved_bytes = 2 * kChunk});
  ASSERT_TRUE(tier_->Reserve(MakeKey(0, "llama", "a"), kChunk, 256, 1).ok());
  ASSERT_TRUE(tier_->Reserve(MakeKey(1, "llama", "a"), kChunk, 256, 1).ok());
  auto over = tier_->Reserve(MakeKey(2, "llama", "a"), kChunk, 256, 1);
  EXPECT_EQ(over.status().reason(), Reason::kQuotaExceeded) << over.status();
  EXPECT_TRUE(Contains(over.status(),
                       "namespace \"a\" is at its quota reserved_bytes=2048: it "
                       "holds 2048, 1024 more asked"))
      << over.status();
  // The default (no limit) applies to namespace b.
  for (uint64_t n = 0; n < 8; ++n) {
    EXPECT_TRUE(tier_->Reserve(MakeKey(n, "llama", "b"), kChunk, 256, 1).ok());
  }
  // Reserving ahead counts too.
  EXPECT_EQ(tier_->ReserveAhead(MakeKey(0, "llama", "a"), kChunk, 1).status().code(),
            StatusCode::kResourceExhausted);  // the ahead headroom rule: half of 2 KiB
}

TEST_F(HostTierNamespaceQuotaTest, PinnedBytesCountEachChunkOnceOverLeases) {
  Make({.pinned_bytes = 2 * kChunk});
  for (uint64_t n = 0; n < 4; ++n) Put(n, "a");
  auto first = tier_->Lookup(ChainRequest(0, 2, "llama", "a"));
  ASSERT_TRUE(first.ok()) << first.status();
  // The same chunks again: nothing more pinned, so no quota problem.
  auto again = tier_->Lookup(ChainRequest(0, 2, "llama", "a"));
  ASSERT_TRUE(again.ok()) << again.status();
  auto more = tier_->Lookup(ChainRequest(2, 1, "llama", "a"));
  EXPECT_EQ(more.status().reason(), Reason::kQuotaExceeded) << more.status();
  EXPECT_TRUE(Contains(more.status(), "quota pinned_bytes=2048")) << more.status();
  // Nothing was pinned by the refused lookup.
  EXPECT_EQ(tier_->GetStats().pinned_bytes, 2 * kChunk);
  ASSERT_TRUE(tier_->ReleaseLease(first->lease_id).ok());
  EXPECT_FALSE(tier_->Lookup(ChainRequest(2, 1, "llama", "a")).ok());  // `again` still pins 0, 1
  ASSERT_TRUE(tier_->ReleaseLease(again->lease_id).ok());
  EXPECT_TRUE(tier_->Lookup(ChainRequest(2, 2, "llama", "a")).ok());
}

TEST_F(HostTierNamespaceQuotaTest, LeasesOfANamespaceOverAllOwners) {
  Make({.leases = 2});
  Put(0, "a");
  Put(0, "b");
  LookupRequest req = ChainRequest(0, 1, "llama", "a");
  req.owner = 1;
  ASSERT_TRUE(tier_->Lookup(req).ok());
  req.owner = 2;
  auto second = tier_->Lookup(req);
  ASSERT_TRUE(second.ok());
  req.owner = 3;
  auto third = tier_->Lookup(req);
  EXPECT_EQ(third.status().reason(), Reason::kQuotaExceeded) << third.status();
  EXPECT_TRUE(Contains(third.status(), "quota leases=2")) << third.status();
  // Another namespace is not limited; a released lease makes room again.
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(tier_->Lookup(ChainRequest(0, 1, "llama", "b")).ok());
  ASSERT_TRUE(tier_->ReleaseLease(second->lease_id).ok());
  EXPECT_TRUE(tier_->Lookup(req).ok());
}

// In a segmented arena a segment holding one pinned chunk cannot go to another namespace: the
// pinned_bytes and reserved_bytes quotas count such segments whole (at least one allowed).
TEST(HostTierSegmentQuotaTest, PinnedAndReservedSegmentsCountWhole) {
  AlignedRegion region(16 * kChunk);
  HostTierOptions options;
  options.segment_bytes = 4 * kChunk;  // 4 segments of 4 chunks
  options.quotas.namespaces["a"] = {.reserved_bytes = 4 * kChunk, .pinned_bytes = 4 * kChunk};
  auto tier_or = HostTier::Create(options, region.span());
  ASSERT_TRUE(tier_or.ok()) << tier_or.status();
  HostTier& tier = **tier_or;
  for (uint64_t n = 0; n < 8; ++n) {  // segments 0 and 1
    ASSERT_TRUE(PutChunk(tier, MakeKey(n, "llama", "a"), RandomBytes(kChunk, 1)).ok());
  }
  ASSERT_TRUE(tier.Lookup(ChainRequest(0, 1, "llama", "a")).ok());  // segment 0
  auto other = tier.Lookup(ChainRequest(4, 1, "llama", "a"));       // segment 1
  EXPECT_EQ(other.status().reason(), Reason::kQuotaExceeded) << other.status();
  EXPECT_TRUE(Contains(other.status(), "holds 1 arena segments of 4096 bytes")) << other.status();
  EXPECT_TRUE(tier.Lookup(ChainRequest(1, 1, "llama", "a")).ok());  // segment 0 again
  // Reservations: a hole in each of a's segments; the first reservation takes segment 0's, a
  // second one in segment 1 would hold one more segment (2 KiB is within the byte quota).
  ASSERT_TRUE(tier.DropCorrupt(MakeKey(3, "llama", "a")).ok());
  ASSERT_TRUE(tier.DropCorrupt(MakeKey(7, "llama", "a")).ok());
  ASSERT_TRUE(tier.Reserve(MakeKey(100, "llama", "a"), kChunk, 256, 1).ok());
  auto r = tier.Reserve(MakeKey(101, "llama", "a"), kChunk, 256, 1);
  EXPECT_EQ(r.status().reason(), Reason::kQuotaExceeded) << r.status();
  EXPECT_TRUE(Contains(r.status(), "quota reserved_bytes=4096: it holds 1 arena segments"))
      << r.status();
  // Namespace b takes the rest.
  EXPECT_TRUE(tier.Reserve(MakeKey(0, "llama", "b"), 3 * kChunk, 256, 1).ok());
}

TEST_F(HostTierNamespaceQuotaTest, AChainRepeatingAHashEndsBeforeTheRepeat) {
  Make({});
  Put(0, "a");
  Put(1, "a");
  LookupRequest req = ChainRequest(0, 2, "llama", "a");
  for (int i = 0; i < 1000; ++i) req.chunk_hashes.push_back(req.chunk_hashes[i % 2]);
  auto r = tier_->Lookup(req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->matched_chunks, 2u);
  EXPECT_EQ(r->chunks.size(), 2u);
  EXPECT_EQ(tier_->Get(r->lease_id, 2).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(DistinctPrefix(req.chunk_hashes), 2u);
  EXPECT_EQ(DistinctPrefix({}), 0u);
}

}  // namespace
}  // namespace kvd::storage
