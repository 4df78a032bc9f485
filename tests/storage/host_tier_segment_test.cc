// HostTier over a segmented arena: one namespace per segment, the listener at a handover, limits.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "kvd/common/clock.h"
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

class RecordingListener : public SegmentListener {
 public:
  Status OnSegmentHandover(uint32_t segment) override {
    if (!fail_with.ok()) return fail_with;
    handed_over.push_back(segment);
    return Status::Ok();
  }
  std::vector<uint32_t> handed_over;
  Status fail_with;  // the answer to give instead (fault injection)
};

class HostTierSegmentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    HostTierOptions options;
    options.segment_bytes = 16 * 1024;  // 4 segments
    auto tier = HostTier::Create(options, region_.span(), &clock_, &listener_);
    ASSERT_TRUE(tier.ok()) << tier.status();
    tier_ = std::move(tier).value();
  }
  AlignedRegion region_{64 * 1024};
  ManualClock clock_{1'000'000'000};
  RecordingListener listener_;
  std::unique_ptr<HostTier> tier_;
};

TEST_F(HostTierSegmentTest, EachNamespaceLivesInItsOwnSegments) {
  ASSERT_EQ(tier_->segment_count(), 4u);
  auto a = tier_->Reserve(MakeKey(1, "llama", "a"), 4096, 16, 1);
  auto b = tier_->Reserve(MakeKey(2, "llama", "b"), 4096, 16, 2);
  auto a2 = tier_->Reserve(MakeKey(3, "llama", "a"), 4096, 16, 1);
  ASSERT_TRUE(a.ok() && b.ok() && a2.ok());
  const uint32_t sa = tier_->SegmentOf(a->offset), sb = tier_->SegmentOf(b->offset);
  EXPECT_NE(sa, sb);
  EXPECT_EQ(tier_->SegmentOf(a2->offset), sa);
  EXPECT_EQ(tier_->SegmentOwner(sa), "a");
  EXPECT_EQ(tier_->SegmentOwner(sb), "b");
  EXPECT_GE(b->offset, tier_->SegmentStart(sb));
  EXPECT_LE(b->offset + b->size_bytes, tier_->SegmentStart(sb) + tier_->SegmentSize(sb));
}

TEST_F(HostTierSegmentTest, AFreedSegmentStaysWithItsNamespaceUntilAnotherOneTakesIt) {
  auto bytes = RandomBytes(4096, 1);
  ASSERT_TRUE(PutChunk(*tier_, MakeKey(1, "llama", "a"), bytes).ok());
  ASSERT_TRUE(PutChunk(*tier_, MakeKey(2, "llama", "a"), bytes).ok());
  auto r = tier_->Reserve(MakeKey(3, "llama", "b"), 4096, 16, 7);
  ASSERT_TRUE(r.ok());
  const uint32_t sb = tier_->SegmentOf(r->offset);
  ASSERT_TRUE(tier_->Abort(r->id).ok());  // b's only block: its segment is free again
  EXPECT_EQ(tier_->SegmentOwner(sb), "");
  EXPECT_EQ(tier_->SegmentLastOwner(sb), "b");
  // b comes back: its own segment again, no handover.
  r = tier_->Reserve(MakeKey(4, "llama", "b"), 4096, 16, 7);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(tier_->SegmentOf(r->offset), sb);
  EXPECT_TRUE(listener_.handed_over.empty());
  ASSERT_TRUE(tier_->Abort(r->id).ok());
  // A pinned chunk keeps its segment until the read ends.
  auto lookup = tier_->Lookup(ChainRequest(1, 1, "llama", "a"));
  ASSERT_TRUE(lookup.ok());
  ASSERT_EQ(lookup->matched_chunks, 1u);
  auto view = tier_->Get(lookup->lease_id, 0);
  ASSERT_TRUE(view.ok());
  const uint32_t sa = tier_->SegmentOf(view->offset);
  ASSERT_TRUE(tier_->Remove(MakeKey(2, "llama", "a")).ok());
  EXPECT_EQ(tier_->Remove(MakeKey(1, "llama", "a")).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(tier_->ReleaseLease(lookup->lease_id).ok());
  ASSERT_TRUE(tier_->ReleaseRead(view->read_id).ok());
  EXPECT_EQ(tier_->SegmentOwner(sa), "a");  // chunk 1 is still stored there
  ASSERT_TRUE(tier_->Remove(MakeKey(1, "llama", "a")).ok());
  EXPECT_EQ(tier_->SegmentOwner(sa), "");
  EXPECT_EQ(tier_->SegmentLastOwner(sa), "a");
  // c and d take the two segments never used; e then takes a freed one: a handover, told to the
  // listener before the reservation exists.
  std::vector<uint32_t> taken;
  for (const char* ns : {"c", "d", "e"}) {
    auto c = tier_->Reserve(MakeKey(5, "llama", ns), 4096, 16, 8);
    ASSERT_TRUE(c.ok()) << ns << ": " << c.status();
    taken.push_back(tier_->SegmentOf(c->offset));
  }
  EXPECT_NE(taken[0], sa);
  EXPECT_NE(taken[0], sb);
  EXPECT_NE(taken[1], sa);
  EXPECT_NE(taken[1], sb);
  EXPECT_EQ(taken[2], std::min(sa, sb));  // the lowest of the two freed ones
  EXPECT_EQ(listener_.handed_over, std::vector<uint32_t>{taken[2]});
  EXPECT_EQ(tier_->SegmentLastOwner(taken[2]), "e");
  const TierStats stats = tier_->GetStats();
  EXPECT_EQ(stats.segments_reused, 1u);
  EXPECT_EQ(stats.segments_handed_over, 1u);
}

TEST_F(HostTierSegmentTest, AHandoverTheListenerRefusesReservesNothing) {
  ASSERT_TRUE(PutChunk(*tier_, MakeKey(1, "llama", "a"), RandomBytes(4096, 1)).ok());
  std::vector<uint32_t> others;
  for (const char* ns : {"b", "c", "d"}) {
    auto r = tier_->Reserve(MakeKey(2, "llama", ns), 4096, 16, 2);
    ASSERT_TRUE(r.ok()) << r.status();
    others.push_back(tier_->SegmentOf(r->offset));
    ASSERT_TRUE(tier_->Abort(r->id).ok());
  }
  // Every segment is a's or last used by b, c or d: a new namespace needs a handover.
  listener_.fail_with = Status::ResourceExhausted("memfd_create: Too many open files");
  auto refused = tier_->Reserve(MakeKey(3, "llama", "e"), 4096, 16, 3);
  ASSERT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(refused.status(), "Too many open files")) << refused.status();
  EXPECT_TRUE(Contains(refused.status(), "namespace \"e\"")) << refused.status();
  EXPECT_EQ(tier_->GetStats().reservations_open, 0u);
  EXPECT_EQ(tier_->GetStats().segments_handed_over, 0u);
  for (uint32_t i = 0; i < others.size(); ++i) {
    EXPECT_EQ(tier_->SegmentOwner(others[i]), "");
    EXPECT_EQ(tier_->SegmentLastOwner(others[i]), std::string(1, static_cast<char>('b' + i)));
  }
  // Namespaces that take back their own segments need no listener at all.
  auto b = tier_->Reserve(MakeKey(4, "llama", "b"), 4096, 16, 2);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(tier_->SegmentOf(b->offset), others[0]);
  listener_.fail_with = Status::Ok();
  auto e = tier_->Reserve(MakeKey(3, "llama", "e"), 4096, 16, 3);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(listener_.handed_over, std::vector<uint32_t>{tier_->SegmentOf(e->offset)});
}

TEST_F(HostTierSegmentTest, ChunkLargerThanASegmentIsRefused) {
  auto r = tier_->Reserve(MakeKey(1), 16 * 1024 + 1, 16, 1);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(r.status(), "segment_bytes 16384")) << r.status();
}

TEST_F(HostTierSegmentTest, FullArenaEvictsToFreeASegmentForANewNamespace) {
  // Namespace a fills all four segments; a Reserve of b must evict a's LRU chunks until one
  // segment is empty (a's chunks elsewhere stay).
  auto bytes = RandomBytes(8192, 2);
  for (uint64_t i = 0; i < 8; ++i) {
    ASSERT_TRUE(PutChunk(*tier_, MakeKey(i, "llama", "a"), bytes).ok()) << i;
  }
  auto r = tier_->Reserve(MakeKey(100, "llama", "b"), 8192, 16, 2);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(tier_->SegmentOwner(tier_->SegmentOf(r->offset)), "b");
  EXPECT_EQ(listener_.handed_over, std::vector<uint32_t>{tier_->SegmentOf(r->offset)});
  EXPECT_EQ(tier_->GetStats().chunk_count, 6u);  // two of a's eight went, the oldest
  EXPECT_TRUE(tier_->Describe(MakeKey(7, "llama", "a")).ok());
}

TEST(HostTierSegmentOptionsTest, SegmentBytesMustBeAMultipleOfTheAlignment) {
  AlignedRegion region(64 * 1024);
  HostTierOptions options;
  options.segment_bytes = 1000;
  auto tier = HostTier::Create(options, region.span());
  EXPECT_EQ(tier.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(tier.status(), "segment_bytes 1000")) << tier.status();
}

}  // namespace
}  // namespace kvd::storage
