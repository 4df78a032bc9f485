// HostTier write protocol: reserve / commit / abort / expiry / owner reclaim / dedup.
#include <gtest/gtest.h>

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

class HostTierWriteTest : public ::testing::Test {
 protected:
  void SetUp() override {
    HostTierOptions options;
    options.reservation_ttl = 1000ms;
    auto tier = HostTier::Create(options, region_.span(), &clock_);
    ASSERT_TRUE(tier.ok()) << tier.status();
    tier_ = std::move(tier).value();
  }
  AlignedRegion region_{64 * 1024};
  ManualClock clock_{1'000'000'000};
  std::unique_ptr<HostTier> tier_;
};

TEST(HostTierCreateTest, RejectsBadOptionsAndRegions) {
  AlignedRegion region(4096);
  HostTierOptions bad;
  bad.alignment = 48;
  auto s = HostTier::Create(bad, region.span());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.status(), "alignment")) << s.status();

  HostTierOptions ttl;
  ttl.reservation_ttl = 0ms;
  EXPECT_EQ(HostTier::Create(ttl, region.span()).status().code(), StatusCode::kInvalidArgument);

  HostTierOptions too_big;
  too_big.capacity_bytes = 8192;
  s = HostTier::Create(too_big, region.span());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.status(), "exceeds the region size")) << s.status();

  s = HostTier::Create(HostTierOptions{}, region.span().subspan(8));
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.status(), "not aligned")) << s.status();
}

TEST_F(HostTierWriteTest, ReservedChunkIsInvisibleUntilCommitted) {
  const auto bytes = RandomBytes(1000, 1);
  auto r = tier_->Reserve(MakeKey(0), bytes.size(), 256, /*owner=*/1);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->data, tier_->region_base() + r->offset);
  EXPECT_EQ(r->offset % 64, 0u);
  std::memcpy(r->data, bytes.data(), bytes.size());

  auto before = tier_->Lookup(ChainRequest(0, 1));
  ASSERT_TRUE(before.ok());
  EXPECT_EQ(before->matched_chunks, 0u);
  EXPECT_EQ(before->lease_id, 0u);
  EXPECT_EQ(tier_->GetByKey(MakeKey(0), 1).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(tier_->GetStats().reserved_bytes, 1000u);
  EXPECT_EQ(tier_->GetStats().used_bytes, 0u);

  ASSERT_TRUE(tier_->Commit(r->id, Checksum64(bytes.data(), bytes.size())).ok());
  auto after = tier_->Lookup(ChainRequest(0, 1));
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->matched_chunks, 1u);
  EXPECT_EQ(after->matched_tokens, 256u);
  auto view = tier_->Get(after->lease_id, 0);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->meta.size_bytes, 1000u);
  EXPECT_EQ(view->meta.checksum, Checksum64(bytes.data(), bytes.size()));
  EXPECT_EQ(std::memcmp(view->data, bytes.data(), bytes.size()), 0);
  EXPECT_EQ(tier_->GetStats().reserved_bytes, 0u);
  EXPECT_EQ(tier_->GetStats().used_bytes, 1000u);
}

TEST_F(HostTierWriteTest, WrongChecksumIsDataLossAndSpaceReturned) {
  const auto bytes = RandomBytes(4096, 2);
  auto r = tier_->Reserve(MakeKey(0), bytes.size(), 256, 1);
  ASSERT_TRUE(r.ok());
  std::memcpy(r->data, bytes.data(), bytes.size());
  r->data[17] ^= std::byte{1};  // corrupted in flight
  Status s = tier_->Commit(r->id, Checksum64(bytes.data(), bytes.size()));
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(s, "checksum mismatch")) << s;
  const TierStats st = tier_->GetStats();
  EXPECT_EQ(st.reserved_bytes, 0u);
  EXPECT_EQ(st.arena_allocated_bytes, 0u);
  EXPECT_EQ(st.checksum_failures, 1u);
  EXPECT_EQ(st.chunk_count, 0u);
  EXPECT_EQ(tier_->Lookup(ChainRequest(0, 1))->matched_chunks, 0u);
  // The dropped reservation cannot be committed afterwards.
  s = tier_->Commit(r->id, Checksum64(bytes.data(), bytes.size()));
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_TRUE(Contains(s, "checksum mismatch")) << s;
}

TEST_F(HostTierWriteTest, TrustWriterRecordsTheChecksumWithoutReadingTheBytes) {
  const auto bytes = RandomBytes(4096, 3);
  const uint64_t sum = Checksum64(bytes.data(), bytes.size());
  auto r = tier_->Reserve(MakeKey(0), bytes.size(), 256, 1);
  ASSERT_TRUE(r.ok());
  std::memcpy(r->data, bytes.data(), bytes.size());
  r->data[17] ^= std::byte{1};  // not what the checksum says: kVerify would refuse it
  ASSERT_TRUE(tier_->Commit(r->id, sum, CommitCheck::kTrustWriter).ok());
  EXPECT_EQ(tier_->GetStats().checksum_failures, 0u);
  // Published with the writer's checksum: a reader's check against it finds the change.
  auto hit = tier_->Lookup(ChainRequest(0, 1));
  ASSERT_TRUE(hit.ok() && hit->matched_chunks == 1u);
  auto view = tier_->Get(hit->lease_id, 0);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->meta.checksum, sum);
  EXPECT_NE(Checksum64(view->data, view->meta.size_bytes), view->meta.checksum);
  // The other commit steps are the same: a second commit of the id is refused.
  Status again = tier_->Commit(r->id, sum, CommitCheck::kTrustWriter);
  EXPECT_EQ(again.code(), StatusCode::kFailedPrecondition) << again;
}

TEST_F(HostTierWriteTest, CommitOfUnknownReservationIsNotFound) {
  Status s = tier_->Commit(424242, 0);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(s, "reservation 424242 is unknown")) << s;
  EXPECT_EQ(tier_->Abort(424242).code(), StatusCode::kNotFound);
}

TEST_F(HostTierWriteTest, CommitTwiceIsFailedPrecondition) {
  const auto bytes = RandomBytes(100, 3);
  auto r = tier_->Reserve(MakeKey(0), bytes.size(), 256, 1);
  ASSERT_TRUE(r.ok());
  std::memcpy(r->data, bytes.data(), bytes.size());
  ASSERT_TRUE(tier_->Commit(r->id, Checksum64(bytes.data(), bytes.size())).ok());
  Status s = tier_->Commit(r->id, 0);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(s, "already committed")) << s;
}

TEST_F(HostTierWriteTest, ExpiredReservationIsReclaimedAndLateCommitIsAborted) {
  const auto bytes = RandomBytes(2048, 4);
  auto r = tier_->Reserve(MakeKey(0), bytes.size(), 256, 1);
  ASSERT_TRUE(r.ok());
  std::memcpy(r->data, bytes.data(), bytes.size());
  clock_.AdvanceMillis(999);
  EXPECT_EQ(tier_->ExpireReservations(), 0u);  // not yet
  clock_.AdvanceMillis(2);
  EXPECT_EQ(tier_->ExpireReservations(), 1u);
  TierStats st = tier_->GetStats();
  EXPECT_EQ(st.reserved_bytes, 0u);
  EXPECT_EQ(st.arena_allocated_bytes, 0u);
  EXPECT_EQ(st.reservations_expired, 1u);
  Status s = tier_->Commit(r->id, Checksum64(bytes.data(), bytes.size()));
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_TRUE(Contains(s, "expired")) << s;
  EXPECT_EQ(tier_->Lookup(ChainRequest(0, 1))->matched_chunks, 0u);
}

TEST_F(HostTierWriteTest, CommitAfterDeadlineIsAbortedEvenBeforeTheSweep) {
  const auto bytes = RandomBytes(64, 5);
  auto r = tier_->Reserve(MakeKey(0), bytes.size(), 256, 1, /*ttl=*/10ms);
  ASSERT_TRUE(r.ok());
  std::memcpy(r->data, bytes.data(), bytes.size());
  clock_.AdvanceMillis(11);
  Status s = tier_->Commit(r->id, Checksum64(bytes.data(), bytes.size()));
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_TRUE(Contains(s, "expired")) << s;
  EXPECT_EQ(tier_->GetStats().arena_allocated_bytes, 0u);
}

TEST_F(HostTierWriteTest, AbortReturnsSpaceAndLateCommitSaysAborted) {
  auto r = tier_->Reserve(MakeKey(0), 500, 256, 1);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(tier_->Abort(r->id).ok());
  EXPECT_EQ(tier_->GetStats().arena_allocated_bytes, 0u);
  Status s = tier_->Commit(r->id, 0);
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_TRUE(Contains(s, "was aborted")) << s;
}

TEST_F(HostTierWriteTest, ReclaimOwnerDropsOnlyThatOwnersReservationsAndLeases) {
  ASSERT_TRUE(PutChunk(*tier_, MakeKey(100), RandomBytes(100, 6)).ok());
  auto a = tier_->Reserve(MakeKey(1), 1000, 256, /*owner=*/7);
  auto b = tier_->Reserve(MakeKey(2), 1000, 256, /*owner=*/7);
  auto c = tier_->Reserve(MakeKey(3), 64, 256, /*owner=*/8);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  LookupRequest req = ChainRequest(100, 1);
  req.owner = 7;
  auto lease = tier_->Lookup(req);
  ASSERT_TRUE(lease.ok());
  ASSERT_EQ(lease->matched_chunks, 1u);
  EXPECT_EQ(tier_->GetStats().pinned_bytes, 100u);

  const ReclaimResult rr = tier_->ReclaimOwner(7);
  EXPECT_EQ(rr.reservations, 2u);
  EXPECT_EQ(rr.leases, 1u);
  const TierStats st = tier_->GetStats();
  EXPECT_EQ(st.reserved_bytes, 64u);
  EXPECT_EQ(st.pinned_bytes, 0u);
  EXPECT_EQ(st.reservations_reclaimed, 2u);
  Status s = tier_->Commit(a->id, 0);
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_TRUE(Contains(s, "owner disconnected")) << s;
  EXPECT_EQ(tier_->Get(lease->lease_id, 0).status().code(), StatusCode::kAborted);
  // Owner 8 is untouched.
  std::vector<std::byte> zeros(64);
  std::memset(c->data, 0, 64);
  EXPECT_TRUE(tier_->Commit(c->id, Checksum64(zeros.data(), 64)).ok());
}

TEST_F(HostTierWriteTest, RePutOfStoredKeyIsDedup) {
  const auto bytes = RandomBytes(300, 7);
  ASSERT_TRUE(PutChunk(*tier_, MakeKey(0), bytes).ok());
  auto again = tier_->Reserve(MakeKey(0), bytes.size(), 256, 2);
  EXPECT_EQ(again.status().code(), StatusCode::kAlreadyExists);
  EXPECT_TRUE(IsDedup(again.status())) << again.status();
  EXPECT_TRUE(Contains(again.status(), "skip sending")) << again.status();
  EXPECT_EQ(tier_->GetStats().dedup_puts, 1u);
  EXPECT_EQ(tier_->GetStats().reserved_bytes, 0u);
  EXPECT_FALSE(IsDedup(Status::AlreadyExists("something else")));
}

TEST_F(HostTierWriteTest, RacingReservationsOfOneKeyFirstCommitWins) {
  const auto first = RandomBytes(256, 8);
  const auto second = RandomBytes(256, 9);
  auto a = tier_->Reserve(MakeKey(0), 256, 256, 1);
  auto b = tier_->Reserve(MakeKey(0), 256, 256, 2);
  ASSERT_TRUE(a.ok() && b.ok());
  std::memcpy(a->data, first.data(), 256);
  std::memcpy(b->data, second.data(), 256);
  ASSERT_TRUE(tier_->Commit(b->id, Checksum64(second.data(), 256)).ok());
  Status s = tier_->Commit(a->id, Checksum64(first.data(), 256));
  EXPECT_TRUE(IsDedup(s)) << s;
  const TierStats st = tier_->GetStats();
  EXPECT_EQ(st.chunk_count, 1u);
  EXPECT_EQ(st.reserved_bytes, 0u);
  EXPECT_EQ(st.arena_allocated_bytes, 256u);
  auto view = tier_->GetByKey(MakeKey(0), 1);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(std::memcmp(view->data, second.data(), 256), 0);
}

TEST_F(HostTierWriteTest, RejectsZeroBytesEmptyModelAndOversize) {
  auto s = tier_->Reserve(MakeKey(0), 0, 256, 1);
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.status(), "bytes must be > 0")) << s.status();
  s = tier_->Reserve(MakeKey(0, ""), 10, 256, 1);
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  s = tier_->Reserve(MakeKey(0), 64 * 1024 + 1, 256, 1);
  EXPECT_EQ(s.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(s.status(), "exceed the whole capacity")) << s.status();
}

TEST(HostTierRetiredIdsTest, ForgottenIdsAreNotFound) {
  AlignedRegion region(4096);
  HostTierOptions options;
  options.retired_id_memory = 2;
  auto tier = HostTier::Create(options, region.span());
  ASSERT_TRUE(tier.ok());
  std::vector<ReservationId> ids;
  for (int i = 0; i < 3; ++i) {
    auto r = (*tier)->Reserve(MakeKey(i), 64, 1, 1);
    ASSERT_TRUE(r.ok());
    ASSERT_TRUE((*tier)->Abort(r->id).ok());
    ids.push_back(r->id);
  }
  EXPECT_EQ((*tier)->Commit(ids[0], 0).code(), StatusCode::kNotFound);
  EXPECT_EQ((*tier)->Commit(ids[2], 0).code(), StatusCode::kAborted);
}

}  // namespace
}  // namespace kvd::storage
