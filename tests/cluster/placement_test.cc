// The cluster's placement rule (cluster/placement.h): rendezvous hashing of a chain's first
// chunk hash over member ids.
#include "kvd/cluster/placement.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>

namespace kvd::cluster {
namespace {

Hash128 RandomHash(std::mt19937_64& rng) { return {rng(), rng()}; }

TEST(PlacementRuleTest, OrderIsAPermutationByScoreTheSameWhateverTheListOrder) {
  const std::vector<std::string> nodes = {"a", "b", "c", "d"};
  std::vector<std::string> reversed(nodes.rbegin(), nodes.rend());
  std::mt19937_64 rng(1);
  for (int i = 0; i < 200; ++i) {
    const Hash128 first = RandomHash(rng);
    auto order = RendezvousOrder(first, nodes);
    ASSERT_EQ(order.size(), nodes.size());
    std::vector<size_t> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(sorted, (std::vector<size_t>{0, 1, 2, 3}));
    for (size_t k = 1; k < order.size(); ++k) {
      EXPECT_GE(RendezvousScore(first, nodes[order[k - 1]]),
                RendezvousScore(first, nodes[order[k]]));
    }
    // Every kvd and client agrees, whatever order its member list is in.
    auto other = RendezvousOrder(first, reversed);
    for (size_t k = 0; k < order.size(); ++k) EXPECT_EQ(nodes[order[k]], reversed[other[k]]);
  }
  EXPECT_TRUE(RendezvousOrder({1, 2}, {}).empty());
}

TEST(PlacementRuleTest, ScoreDependsOnTheWholeFirstHashAndTheNode) {
  const Hash128 h{0x0123456789abcdefULL, 0xfedcba9876543210ULL};
  EXPECT_EQ(RendezvousScore(h, "a"), RendezvousScore(h, "a"));
  EXPECT_NE(RendezvousScore(h, "a"), RendezvousScore(h, "b"));
  EXPECT_NE(RendezvousScore(h, "a"), RendezvousScore({h.hi, h.lo ^ 1}, "a"));
  EXPECT_NE(RendezvousScore(h, "a"), RendezvousScore({h.hi ^ 1, h.lo}, "a"));
  EXPECT_NE(RendezvousScore({1, 2}, "a"), RendezvousScore({2, 1}, "a"));
}

TEST(PlacementRuleTest, ChainsSpreadOverTheMembersAndALeavingMemberMovesOnlyItsOwn) {
  const std::vector<std::string> three = {"decode-0", "decode-1", "decode-2"};
  const std::vector<std::string> two = {"decode-0", "decode-2"};
  std::mt19937_64 rng(7);
  constexpr int kChains = 3000;
  std::map<std::string, int> won;
  int moved_not_from_leaver = 0;
  for (int i = 0; i < kChains; ++i) {
    const Hash128 first = RandomHash(rng);
    const std::string& before = three[RendezvousOrder(first, three)[0]];
    const std::string& after = two[RendezvousOrder(first, two)[0]];
    ++won[before];
    if (before != "decode-1" && before != after) ++moved_not_from_leaver;
    // A chain the leaver won goes to its second choice.
    if (before == "decode-1") EXPECT_EQ(after, three[RendezvousOrder(first, three)[1]]);
  }
  EXPECT_EQ(moved_not_from_leaver, 0);
  for (const auto& n : three) {
    // A third each, give or take a wide margin (3000 draws: the spread of one count is ~26).
    EXPECT_GT(won[n], kChains / 4) << n;
    EXPECT_LT(won[n], kChains * 5 / 12) << n;
  }
}

}  // namespace
}  // namespace kvd::cluster
