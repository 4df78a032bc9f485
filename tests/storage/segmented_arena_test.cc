#include <gtest/gtest.h>

#include <map>
#include <random>
#include <string>

#include "kvd/storage/arena.h"

namespace kvd::storage {
namespace {

TEST(SegmentedArenaTest, UnsegmentedIsOneBestFitArena) {
  SegmentedArena arena(4096, 64, 0);
  EXPECT_FALSE(arena.segmented());
  EXPECT_EQ(arena.segment_count(), 1u);
  auto a = arena.Allocate(1000, "a");
  auto b = arena.Allocate(1000, "b");  // namespaces share the one segment
  ASSERT_TRUE(a && b);
  EXPECT_EQ(arena.SegmentOf(*a), arena.SegmentOf(*b));
  EXPECT_EQ(arena.SegmentOwner(0), "");
  EXPECT_TRUE(arena.CheckConsistency().ok());
}

TEST(SegmentedArenaTest, NamespacesNeverShareASegment) {
  SegmentedArena arena(4 * 1024, 64, 1024);  // 4 segments of 1 KiB
  ASSERT_EQ(arena.segment_count(), 4u);
  auto a1 = arena.Allocate(256, "a");
  auto b1 = arena.Allocate(256, "b");
  auto a2 = arena.Allocate(256, "a");
  ASSERT_TRUE(a1 && b1 && a2);
  EXPECT_EQ(arena.SegmentOf(*a1), arena.SegmentOf(*a2));  // a fills its own segment first
  EXPECT_NE(arena.SegmentOf(*a1), arena.SegmentOf(*b1));
  EXPECT_EQ(arena.SegmentOwner(arena.SegmentOf(*a1)), "a");
  EXPECT_EQ(arena.SegmentOwner(arena.SegmentOf(*b1)), "b");
  // Every block stays inside its segment.
  for (auto off : {*a1, *b1, *a2}) {
    const uint32_t seg = arena.SegmentOf(off);
    EXPECT_GE(off, arena.SegmentStart(seg));
    EXPECT_LE(off + arena.BlockSize(off), arena.SegmentStart(seg) + arena.SegmentSize(seg));
  }
  EXPECT_TRUE(arena.CheckConsistency().ok());
}

TEST(SegmentedArenaTest, BlockLargerThanASegmentNeverFits) {
  SegmentedArena arena(4 * 1024, 64, 1024);
  EXPECT_EQ(arena.max_block_bytes(), 1024u);
  EXPECT_FALSE(arena.CanAllocate(1025, "a"));
  EXPECT_FALSE(arena.Allocate(1025, "a").has_value());
  EXPECT_TRUE(arena.CanAllocate(1024, "a"));
}

TEST(SegmentedArenaTest, FullNamespaceTakesAFreeSegmentAndGivesItBackWhenEmpty) {
  SegmentedArena arena(2 * 1024, 64, 1024);
  auto a1 = arena.Allocate(1024, "a");
  ASSERT_TRUE(a1);
  auto a2 = arena.Allocate(512, "a");  // own segment full: the free one
  ASSERT_TRUE(a2);
  EXPECT_NE(arena.SegmentOf(*a1), arena.SegmentOf(*a2));
  EXPECT_FALSE(arena.CanAllocate(64, "b"));  // both segments are a's, though one has room
  EXPECT_TRUE(arena.CanAllocate(512, "a"));
  std::optional<uint32_t> released;
  ASSERT_TRUE(arena.Free(*a2, &released).ok());
  ASSERT_TRUE(released.has_value());
  EXPECT_EQ(*released, arena.SegmentOf(*a2));
  EXPECT_EQ(arena.SegmentOwner(*released), "");
  EXPECT_EQ(arena.Free(*a2).code(), StatusCode::kNotFound);  // double free
  EXPECT_TRUE(arena.CanAllocate(1024, "b"));
  auto b = arena.Allocate(1024, "b");
  ASSERT_TRUE(b);
  EXPECT_EQ(arena.SegmentOwner(arena.SegmentOf(*b)), "b");
  EXPECT_TRUE(arena.CheckConsistency().ok());
}

TEST(SegmentedArenaTest, AFreeSegmentGoesBackToItsLastNamespaceBeforeANeverUsedOne) {
  SegmentedArena arena(4 * 1024, 64, 1024);  // 4 segments of 1 KiB
  auto a = arena.Allocate(1024, "a");
  auto b = arena.Allocate(1024, "b");
  auto c = arena.Allocate(1024, "c");
  ASSERT_TRUE(a && b && c);
  ASSERT_EQ(arena.SegmentOf(*c), 2u);
  for (uint64_t off : {*a, *b, *c}) ASSERT_TRUE(arena.Free(off).ok());
  EXPECT_EQ(arena.SegmentOwner(2), "");
  EXPECT_EQ(arena.SegmentLastOwner(2), "c");
  EXPECT_EQ(arena.SegmentLastOwner(3), "");
  // c's old segment, although segments 0, 1 (others') and 3 (never used) are free too.
  auto placed = arena.Place(512, "c");
  ASSERT_TRUE(placed.has_value());
  EXPECT_EQ(placed->segment, 2u);
  EXPECT_FALSE(placed->handover);
  auto c2 = arena.AllocateAt(*placed, 512, "c");
  ASSERT_TRUE(c2);
  EXPECT_EQ(arena.SegmentOf(*c2), 2u);
  // A new namespace: the never-used segment before any handover.
  placed = arena.Place(512, "d");
  ASSERT_TRUE(placed.has_value());
  EXPECT_EQ(placed->segment, 3u);
  EXPECT_FALSE(placed->handover);
  ASSERT_TRUE(arena.AllocateAt(*placed, 512, "d"));
  // Then the lowest segment another namespace used last: a handover.
  placed = arena.Place(512, "e");
  ASSERT_TRUE(placed.has_value());
  EXPECT_EQ(placed->segment, 0u);
  EXPECT_TRUE(placed->handover);
  ASSERT_TRUE(arena.AllocateAt(*placed, 512, "e"));
  EXPECT_EQ(arena.SegmentLastOwner(0), "e");
  // b's old segment is the last free one; b takes it back without a handover.
  placed = arena.Place(1024, "b");
  ASSERT_TRUE(placed.has_value());
  EXPECT_EQ(placed->segment, 1u);
  EXPECT_FALSE(placed->handover);
  ASSERT_TRUE(arena.AllocateAt(*placed, 1024, "b"));
  EXPECT_FALSE(arena.Place(64, "a").has_value());  // a's segment went to e
  EXPECT_FALSE(arena.CanAllocate(64, "a"));
  const SegmentedArena::SegmentCounters counters = arena.segment_counters();
  EXPECT_EQ(counters.first_uses, 4u);
  EXPECT_EQ(counters.reuses, 2u);
  EXPECT_EQ(counters.handovers, 1u);
  EXPECT_TRUE(arena.CheckConsistency().ok());
}

TEST(SegmentedArenaTest, AllocateAtRefusesASegmentOfAnotherNamespace) {
  SegmentedArena arena(2 * 1024, 64, 1024);
  auto a = arena.Allocate(256, "a");
  ASSERT_TRUE(a);
  const SegmentedArena::Placement own{arena.SegmentOf(*a), false};
  EXPECT_FALSE(arena.AllocateAt(own, 256, "b").has_value());
  EXPECT_FALSE(arena.AllocateAt({7, false}, 256, "b").has_value());  // past the region
  EXPECT_TRUE(arena.AllocateAt(own, 256, "a").has_value());
  EXPECT_TRUE(arena.CheckConsistency().ok());
}

TEST(SegmentedArenaTest, ShortLastSegmentAndTotals) {
  SegmentedArena arena(2500, 64, 1024);  // 1024 + 1024 + 452 -> 448 usable
  ASSERT_EQ(arena.segment_count(), 3u);
  EXPECT_EQ(arena.SegmentSize(2), 448u);
  EXPECT_EQ(arena.capacity(), 2496u);
  auto a = arena.Allocate(100, "a");
  ASSERT_TRUE(a);
  ArenaStats s = arena.Stats();
  EXPECT_EQ(s.capacity_bytes, 2496u);
  EXPECT_EQ(s.allocated_bytes, 128u);
  EXPECT_EQ(s.allocated_blocks, 1u);
  EXPECT_EQ(s.largest_free_block, 1024u);
}

TEST(SegmentedArenaTest, RandomOpsKeepInvariants) {
  SegmentedArena arena(64 * 1024, 64, 8 * 1024);
  std::mt19937 rng(7);
  std::map<uint64_t, std::string> live;
  const std::string names[] = {"a", "b", "c"};
  for (int step = 0; step < 4000; ++step) {
    if (live.empty() || rng() % 3 != 0) {
      const std::string& ns = names[rng() % 3];
      if (auto off = arena.Allocate(1 + rng() % 3000, ns)) {
        live[*off] = ns;
        ASSERT_EQ(arena.SegmentOwner(arena.SegmentOf(*off)), ns);
      }
    } else {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      ASSERT_TRUE(arena.Free(it->first).ok());
      live.erase(it);
    }
    if (step % 97 == 0) {
      ASSERT_TRUE(arena.CheckConsistency().ok()) << step;
    }
  }
  for (const auto& [off, ns] : live) EXPECT_EQ(arena.SegmentOwner(arena.SegmentOf(off)), ns);
  EXPECT_TRUE(arena.CheckConsistency().ok());
}

}  // namespace
}  // namespace kvd::storage
