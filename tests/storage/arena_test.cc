#include "kvd/storage/arena.h"

#include <gtest/gtest.h>

#include <map>
#include <random>

namespace kvd::storage {
namespace {

TEST(ArenaTest, AllocatesAlignedAndRoundsUp) {
  ArenaAllocator arena(1024, 64);
  auto a = arena.Allocate(1);
  auto b = arena.Allocate(65);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(*a % 64, 0u);
  EXPECT_EQ(*b % 64, 0u);
  EXPECT_EQ(arena.BlockSize(*a), 64u);
  EXPECT_EQ(arena.BlockSize(*b), 128u);
  EXPECT_EQ(arena.allocated_bytes(), 192u);
  EXPECT_TRUE(arena.CheckConsistency().ok());
}

TEST(ArenaTest, CapacityIsRoundedDownAndEnforced) {
  ArenaAllocator arena(1000, 64);  // 15 units of 64
  EXPECT_EQ(arena.capacity(), 960u);
  EXPECT_FALSE(arena.Allocate(961).has_value());
  auto a = arena.Allocate(960);
  ASSERT_TRUE(a);
  EXPECT_FALSE(arena.Allocate(1).has_value());
  EXPECT_FALSE(arena.CanAllocate(1));
}

TEST(ArenaTest, DoubleFreeIsNotFound) {
  ArenaAllocator arena(1024);
  auto a = arena.Allocate(100);
  ASSERT_TRUE(a);
  ASSERT_TRUE(arena.Free(*a).ok());
  Status s = arena.Free(*a);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find("double free"), std::string::npos) << s;
  EXPECT_EQ(arena.Free(12345).code(), StatusCode::kNotFound);
  EXPECT_TRUE(arena.CheckConsistency().ok());
}

TEST(ArenaTest, CoalescesNeighboursInAnyOrder) {
  ArenaAllocator arena(64 * 4);
  auto a = arena.Allocate(64), b = arena.Allocate(64), c = arena.Allocate(64),
       d = arena.Allocate(64);
  ASSERT_TRUE(a && b && c && d);
  ASSERT_TRUE(arena.Free(*a).ok());
  ASSERT_TRUE(arena.Free(*c).ok());
  EXPECT_EQ(arena.Stats().free_blocks, 2u);
  EXPECT_EQ(arena.Stats().largest_free_block, 64u);
  EXPECT_DOUBLE_EQ(arena.Stats().fragmentation, 0.5);
  EXPECT_FALSE(arena.CanAllocate(128));  // free space is split
  ASSERT_TRUE(arena.Free(*b).ok());      // joins a, b, c
  EXPECT_EQ(arena.Stats().free_blocks, 1u);
  EXPECT_EQ(arena.Stats().largest_free_block, 192u);
  EXPECT_DOUBLE_EQ(arena.Stats().fragmentation, 0.0);
  ASSERT_TRUE(arena.Free(*d).ok());
  EXPECT_EQ(arena.Stats().free_blocks, 1u);
  EXPECT_EQ(arena.Stats().largest_free_block, 256u);
  EXPECT_TRUE(arena.CheckConsistency().ok());
}

TEST(ArenaTest, BestFitPicksTheSmallestBlockThatFits) {
  ArenaAllocator arena(64 * 10);
  auto a = arena.Allocate(64 * 3);  // [0,3)
  auto sep1 = arena.Allocate(64);   // [3,4)
  auto b = arena.Allocate(64);      // [4,5)
  auto sep2 = arena.Allocate(64);   // [5,6), then [6,10) free
  ASSERT_TRUE(a && sep1 && b && sep2);
  ASSERT_TRUE(arena.Free(*a).ok());
  ASSERT_TRUE(arena.Free(*b).ok());
  // Free: 3 units at 0, 1 unit at 4*64, 4 units at 6*64. A 1-unit request takes the 1-unit hole.
  auto c = arena.Allocate(64);
  ASSERT_TRUE(c);
  EXPECT_EQ(*c, 4u * 64);
  // A 3-unit request takes the 3-unit hole, not the 4-unit tail.
  auto d = arena.Allocate(64 * 3);
  ASSERT_TRUE(d);
  EXPECT_EQ(*d, 0u);
  EXPECT_TRUE(arena.CheckConsistency().ok());
}

TEST(ArenaTest, RandomizedAgainstReferenceStaysConsistent) {
  ArenaAllocator arena(64 * 1000);
  std::mt19937 rng(42);
  std::map<uint64_t, uint64_t> live;  // offset -> rounded size
  uint64_t expected_allocated = 0;
  for (int step = 0; step < 5000; ++step) {
    if (live.empty() || rng() % 3 != 0) {
      const uint64_t want = 1 + rng() % (64 * 20);
      auto off = arena.Allocate(want);
      if (!off) continue;
      const uint64_t size = arena.RoundUp(want);
      // No overlap with any live block.
      auto next = live.lower_bound(*off);
      if (next != live.end()) {
        ASSERT_LE(*off + size, next->first);
      }
      if (next != live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + prev->second, *off);
      }
      live.emplace(*off, size);
      expected_allocated += size;
    } else {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      ASSERT_TRUE(arena.Free(it->first).ok());
      expected_allocated -= it->second;
      live.erase(it);
    }
    ASSERT_EQ(arena.allocated_bytes(), expected_allocated);
    if (step % 97 == 0) {
      ASSERT_TRUE(arena.CheckConsistency().ok()) << "step " << step;
    }
  }
  for (const auto& [off, size] : live) ASSERT_TRUE(arena.Free(off).ok());
  const ArenaStats s = arena.Stats();
  EXPECT_EQ(s.free_blocks, 1u);  // everything coalesced back into one block
  EXPECT_EQ(s.largest_free_block, arena.capacity());
  EXPECT_EQ(s.allocated_blocks, 0u);
  EXPECT_TRUE(arena.CheckConsistency().ok());
}

}  // namespace
}  // namespace kvd::storage
