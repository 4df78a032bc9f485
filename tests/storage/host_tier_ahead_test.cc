// HostTier reservations made ahead (ReserveAhead / NameReservation): unnamed until named, the
// dedup check at Commit, the headroom rule, expiry and owner reclaim like any reservation.
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

class HostTierAheadTest : public ::testing::Test {
 protected:
  void SetUp() override { Make(HostTierOptions{}); }
  void Make(HostTierOptions options) {
    options.reservation_ttl = 1000ms;
    auto tier = HostTier::Create(options, region_.span(), &clock_);
    ASSERT_TRUE(tier.ok()) << tier.status();
    tier_ = std::move(tier).value();
  }
  // Writes `bytes` into a reservation made ahead, names it `key` and commits it.
  Status WriteNameCommit(const Reservation& r, const ChunkKey& key,
                         const std::vector<std::byte>& bytes) {
    std::memcpy(r.data, bytes.data(), bytes.size());
    KVD_RETURN_IF_ERROR(tier_->NameReservation(r.id, key, 256));
    return tier_->Commit(r.id, Checksum64(bytes.data(), bytes.size()));
  }
  AlignedRegion region_{64 * 1024};
  ManualClock clock_{1'000'000'000};
  std::unique_ptr<HostTier> tier_;
};

TEST_F(HostTierAheadTest, AReservationMadeAheadIsStoredUnderTheNameGivenLater) {
  const auto bytes = RandomBytes(1000, 1);
  // The key's hash is a placeholder: the chunk it names later is another.
  auto r = tier_->ReserveAhead(MakeKey(99), bytes.size(), /*owner=*/1);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(tier_->GetStats().reserved_bytes, 1000u);
  ASSERT_TRUE(WriteNameCommit(*r, MakeKey(5), bytes).ok());
  EXPECT_EQ(tier_->GetByKey(MakeKey(99), 1).status().code(), StatusCode::kNotFound);
  auto view = tier_->GetByKey(MakeKey(5), 1);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->meta.tokens, 256u);
  EXPECT_EQ(view->meta.size_bytes, 1000u);
  EXPECT_EQ(std::memcmp(view->data, bytes.data(), bytes.size()), 0);
  EXPECT_EQ(tier_->GetStats().reserved_bytes, 0u);
}

TEST_F(HostTierAheadTest, CommitBeforeTheNameIsRefusedAndTheReservationStays) {
  const auto bytes = RandomBytes(512, 2);
  auto r = tier_->ReserveAhead(MakeKey(0), bytes.size(), 1);
  ASSERT_TRUE(r.ok()) << r.status();
  std::memcpy(r->data, bytes.data(), bytes.size());
  Status s = tier_->Commit(r->id, Checksum64(bytes.data(), bytes.size()));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(Contains(s, "names no chunk yet")) << s;
  EXPECT_EQ(tier_->Lookup(ChainRequest(0, 1))->matched_chunks, 0u);
  // Still open: named, it commits.
  ASSERT_TRUE(tier_->NameReservation(r->id, MakeKey(0), 256).ok());
  EXPECT_TRUE(tier_->Commit(r->id, Checksum64(bytes.data(), bytes.size())).ok());
  // A second name, or a name for a Reserve's reservation, is refused.
  s = tier_->NameReservation(r->id, MakeKey(1), 256);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;  // committed
  auto plain = tier_->Reserve(MakeKey(2), 64, 256, 1);
  ASSERT_TRUE(plain.ok());
  s = tier_->NameReservation(plain->id, MakeKey(3), 256);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(Contains(s, "not ahead")) << s;
  auto ahead = tier_->ReserveAhead(MakeKey(0), 64, 1);
  ASSERT_TRUE(ahead.ok());
  ASSERT_TRUE(tier_->NameReservation(ahead->id, MakeKey(4), 256).ok());
  s = tier_->NameReservation(ahead->id, MakeKey(5), 256);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(Contains(s, "names its chunk already")) << s;
}

TEST_F(HostTierAheadTest, TheNameMayChangeOnlyTheHash) {
  auto r = tier_->ReserveAhead(MakeKey(0, "llama", "tenant-a"), 64, 1);
  ASSERT_TRUE(r.ok());
  Status s = tier_->NameReservation(r->id, MakeKey(1, "llama", "tenant-b"), 256);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s, "differs in more than its hash")) << s;
  s = tier_->NameReservation(r->id, MakeKey(1, "qwen", "tenant-a"), 256);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  s = tier_->NameReservation(r->id, MakeKey(1, "llama", "tenant-a"), 0);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(tier_->NameReservation(r->id, MakeKey(1, "llama", "tenant-a"), 256).ok());
}

TEST_F(HostTierAheadTest, AStoredChunkIsFoundAtCommitAndItsCopyDropped) {
  const auto stored = RandomBytes(300, 3);
  ASSERT_TRUE(PutChunk(*tier_, MakeKey(7), stored).ok());
  // No dedup check when reserving ahead (the chunk is not known yet) ...
  auto r = tier_->ReserveAhead(MakeKey(7), stored.size(), 1);
  ASSERT_TRUE(r.ok()) << r.status();
  // ... the bytes are written for nothing, and the commit finds the chunk.
  const auto copy = RandomBytes(300, 4);
  Status s = WriteNameCommit(*r, MakeKey(7), copy);
  EXPECT_TRUE(IsDedup(s)) << s;
  const TierStats st = tier_->GetStats();
  EXPECT_EQ(st.dedup_puts, 1u);
  EXPECT_EQ(st.reserved_bytes, 0u);
  EXPECT_EQ(st.chunk_count, 1u);
  auto view = tier_->GetByKey(MakeKey(7), 1);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(std::memcmp(view->data, stored.data(), stored.size()), 0);  // unchanged
}

TEST_F(HostTierAheadTest, ExpiresAndIsReclaimedLikeAnyReservation) {
  auto a = tier_->ReserveAhead(MakeKey(0), 128, /*owner=*/1);
  auto b = tier_->ReserveAhead(MakeKey(0), 128, /*owner=*/2);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(tier_->ReclaimOwner(2).reservations, 1u);
  Status s = tier_->NameReservation(b->id, MakeKey(1), 256);
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s;
  clock_.AdvanceMillis(1001);
  EXPECT_EQ(tier_->ExpireReservations(), 1u);
  s = tier_->NameReservation(a->id, MakeKey(1), 256);
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s;
  EXPECT_TRUE(Contains(s, "expired")) << s;
  EXPECT_EQ(tier_->GetStats().reserved_bytes, 0u);
  EXPECT_EQ(tier_->GetArenaStats().allocated_bytes, 0u);
}

TEST_F(HostTierAheadTest, RefusedWithoutHeadroomBeforeEvictingAnything) {
  // 64 KiB arena: a committed unpinned chunk is evictable and does not count ...
  ASSERT_TRUE(PutChunk(*tier_, MakeKey(0), RandomBytes(40 * 1024, 5)).ok());
  auto first = tier_->ReserveAhead(MakeKey(0), 16 * 1024, 1);
  ASSERT_TRUE(first.ok()) << first.status();
  // ... but open reservations do: 16 KiB held + 20 KiB would be over half of 64 KiB.
  auto plain = tier_->Reserve(MakeKey(1), 4 * 1024, 256, 1);
  ASSERT_TRUE(plain.ok());
  ASSERT_TRUE(PutChunk(*tier_, MakeKey(2), RandomBytes(8 * 1024, 6)).ok());  // evicts chunk 0
  const uint64_t evictions = tier_->GetStats().evictions;
  auto second = tier_->ReserveAhead(MakeKey(0), 20 * 1024, 1);
  EXPECT_EQ(second.status().code(), StatusCode::kResourceExhausted) << second.status();
  EXPECT_TRUE(Contains(second.status(), "no headroom to reserve ahead")) << second.status();
  EXPECT_EQ(tier_->GetStats().evictions, evictions);  // nothing evicted for it
  EXPECT_TRUE(tier_->Describe(MakeKey(2)).ok());
  // The same bytes through Reserve still fit (evicting chunk 2): the held space did not make
  // a put fail.
  EXPECT_TRUE(tier_->Reserve(MakeKey(3), 40 * 1024, 256, 1).ok());
}

TEST_F(HostTierAheadTest, RefusedOverHalfTheNamespaceQuota) {
  HostTierOptions options;
  options.quotas.defaults.stored_bytes = 16 * 1024;
  Make(options);
  auto a = tier_->ReserveAhead(MakeKey(0, "llama", "t"), 8 * 1024, 1);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = tier_->ReserveAhead(MakeKey(0, "llama", "t"), 64, 1);
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted) << b.status();
  EXPECT_TRUE(Contains(b.status(), "over half its quota")) << b.status();
  // Another namespace has its own quota.
  EXPECT_TRUE(tier_->ReserveAhead(MakeKey(0, "llama", "u"), 8 * 1024, 1).ok());
}

}  // namespace
}  // namespace kvd::storage
