// HostTier over a segmented arena: one namespace per segment, listener on release, limits.
#include <gtest/gtest.h>

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
  void OnSegmentReleased(uint32_t segment) override { released.push_back(segment); }
  std::vector<uint32_t> released;
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

TEST_F(HostTierSegmentTest, ListenerHearsWhenTheLastChunkOfASegmentGoes) {
  auto bytes = RandomBytes(4096, 1);
  ASSERT_TRUE(PutChunk(*tier_, MakeKey(1, "llama", "a"), bytes).ok());
  ASSERT_TRUE(PutChunk(*tier_, MakeKey(2, "llama", "a"), bytes).ok());
  auto r = tier_->Reserve(MakeKey(3, "llama", "b"), 4096, 16, 7);
  ASSERT_TRUE(r.ok());
  const uint32_t sb = tier_->SegmentOf(r->offset);
  ASSERT_TRUE(tier_->Abort(r->id).ok());  // b's only block: its segment is free again
  ASSERT_EQ(listener_.released, std::vector<uint32_t>{sb});
  EXPECT_EQ(tier_->SegmentOwner(sb), "");
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
  EXPECT_EQ(listener_.released.size(), 1u);  // chunk 1 is still stored there
  EXPECT_EQ(tier_->SegmentOwner(sa), "a");
  ASSERT_TRUE(tier_->Remove(MakeKey(1, "llama", "a")).ok());
  EXPECT_EQ(listener_.released, (std::vector<uint32_t>{sb, sa}));
  EXPECT_EQ(tier_->SegmentOwner(sa), "");
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
  EXPECT_FALSE(listener_.released.empty());
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
