#include "kvd/storage/chunk.h"

#include <gtest/gtest.h>

#include <unordered_set>

#include "test_util.h"

namespace kvd::storage {
namespace {

using testing::MakeKey;

TEST(ChunkKeyTest, EqualityAndHashCoverEveryField) {
  const ChunkKey base = MakeKey(7);
  std::vector<ChunkKey> variants(5, base);
  variants[0].name_space = "other";
  variants[1].model = "qwen";
  variants[2].layout_digest ^= 1;
  variants[3].codec_id = 3;
  variants[4].chain_hash.lo ^= 1;
  std::unordered_set<uint64_t> hashes{base.Hash()};
  for (const ChunkKey& v : variants) {
    EXPECT_FALSE(v == base) << v.ToString();
    hashes.insert(v.Hash());
  }
  EXPECT_EQ(hashes.size(), 6u);
  EXPECT_EQ(MakeKey(7).Hash(), base.Hash());  // deterministic
}

TEST(ChunkKeyTest, ToStringNamesEveryField) {
  ChunkKey k = MakeKey(1, "m1", "ns1");
  k.codec_id = 5;
  const std::string s = k.ToString();
  EXPECT_EQ(s.rfind("ns1/m1/layout=0000000000abcdef/codec=5/", 0), 0u) << s;
  EXPECT_NE(s.find(k.chain_hash.ToHex()), std::string::npos) << s;
}

TEST(ChunkFilterTest, Matches) {
  const ChunkKey a = MakeKey(1, "m1", "ns1");
  const ChunkKey b = MakeKey(2, "m2", "ns1");
  EXPECT_TRUE(ChunkFilter::All().Matches(a));
  EXPECT_TRUE(ChunkFilter::Namespace("ns1").Matches(b));
  EXPECT_FALSE(ChunkFilter::Namespace("ns2").Matches(b));
  EXPECT_TRUE(ChunkFilter::Model("m1").Matches(a));
  EXPECT_FALSE(ChunkFilter::Model("m1").Matches(b));
  EXPECT_TRUE(ChunkFilter::Key(a).Matches(a));
  EXPECT_FALSE(ChunkFilter::Key(a).Matches(b));
  EXPECT_EQ(ChunkFilter::All().ToString(), "all");
  EXPECT_EQ(ChunkFilter::Model("m1").ToString(), "model=m1");
}

}  // namespace
}  // namespace kvd::storage
