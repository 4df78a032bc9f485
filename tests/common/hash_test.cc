#include "kvd/common/hash.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "kvd/common/copy_checksum.h"

namespace kvd {
namespace {

TEST(HashTest, ChainIsDeterministicAndOrderSensitive) {
  std::vector<int32_t> a = {1, 2, 3, 4}, b = {1, 2, 3, 5};
  Hash128 h1 = ChainHashBlock(42, {}, a);
  EXPECT_EQ(h1, ChainHashBlock(42, {}, a));
  EXPECT_NE(h1, ChainHashBlock(42, {}, b));
  EXPECT_NE(h1, ChainHashBlock(43, {}, a));  // seed matters
  Hash128 h2 = ChainHashBlock(42, h1, a);
  EXPECT_NE(h2, h1);  // the chain matters
  EXPECT_NE(h2, ChainHashBlock(42, h1, a, "lora:7"));
}

TEST(HashTest, KnownValueIsStableAcrossBuilds) {
  // Pinned so that a change of hash layout (which would silently zero every cache hit between
  // old clients and new daemons) fails loudly here.
  std::vector<int32_t> t = {1, 2, 3};
  Hash128 h = ChainHashBlock(0, {}, t);
  Hash128 again;
  ASSERT_TRUE(Hash128::FromHex(h.ToHex(), &again));
  EXPECT_EQ(h, again);
  unsigned char bytes[16 + 12] = {};
  bytes[16] = 1;
  bytes[20] = 2;
  bytes[24] = 3;
  EXPECT_EQ(h, HashBytes(bytes, sizeof bytes, 0));
}

TEST(HashTest, HexRejectsGarbage) {
  Hash128 h;
  EXPECT_FALSE(Hash128::FromHex("xyz", &h));
  EXPECT_FALSE(Hash128::FromHex(std::string(32, 'g'), &h));
}

TEST(HashTest, StreamingChecksumMatchesOneShot) {
  std::vector<uint8_t> data(10000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 31);
  Checksum64Stream s;
  s.Update(data.data(), 1234);
  s.Update(data.data() + 1234, data.size() - 1234);
  EXPECT_EQ(s.Digest(), Checksum64(data.data(), data.size()));
}

// Values from Debian's libxxhash (XXH3_64bits, seed 0) on the same bytes: Checksum64 must give them
// on every code path (baseline or AVX2), since daemons and clients on different CPUs compare them.
TEST(HashTest, Checksum64EqualsReferenceXxh3ForEverySizeClass) {
  struct Case {
    size_t size;
    uint64_t xxh3;
  };
  const Case cases[] = {
      {0, 0x2d06800538d394c2ull},    {1, 0xc44bdff4074eecdbull},
      {3, 0x6811538b444fc6dcull},    {16, 0x0a0ec5ae8679cb7full},
      {17, 0x57c52d21ce492c1eull},   {128, 0x696069c4f1e6a91aull},
      {129, 0xb1ada52285757bebull},  {240, 0xb80284837259eee4ull},
      {241, 0x44dbd3180a664e27ull},  {1024, 0xcc338a494acf74beull},
      {4099, 0x113763146121c4b3ull}, {1048579, 0x8af1459f490dbeb8ull},
  };
  std::vector<uint8_t> buf((1 << 20) + 3);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(i * 131 + (i >> 9));
  for (const Case& c : cases) EXPECT_EQ(Checksum64(buf.data(), c.size), c.xxh3) << c.size;
}

// The fused copy must copy exactly the bytes (nothing past the end: guard bytes) and give the
// same value as Checksum64 of them, for sizes across the short forms, the 32 KiB blocks and the
// non-temporal thresholds (32 KiB for a destination not read soon, 8 MiB otherwise), at aligned
// and unaligned source and destination addresses, with either destination hint.
TEST(HashTest, CopyWithChecksum64EqualsCopyThenChecksum64) {
  constexpr size_t kMib = size_t{1} << 20;
  const size_t sizes[] = {0,          1,        3,        16,           17,       63,
                          64,         65,       129,      240,          241,      1023,
                          1024,       1025,     4099,     32767,        32768,    32769,
                          65536 + 17, 1 * kMib, 2 * kMib, 8 * kMib - 1, 8 * kMib, 8 * kMib + 4099};
  struct Offsets {
    size_t src, dst;
  };
  const Offsets offsets[] = {{0, 0}, {1, 7}, {13, 51}, {32, 5}, {63, 0}};
  constexpr size_t kSlack = 128;  // room for the offsets, then guard bytes
  std::vector<uint8_t> src(8 * kMib + 4099 + kSlack);
  for (size_t i = 0; i < src.size(); ++i) {
    src[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
  }
  std::vector<uint8_t> dst(src.size() + kSlack);
  for (const CopyDestination hint : {CopyDestination::kReadSoon, CopyDestination::kNotReadSoon}) {
    const int h = static_cast<int>(hint);
    for (size_t size : sizes) {
      for (const Offsets& o : offsets) {
        std::fill(dst.begin(), dst.end(), uint8_t{0xA5});
        const uint8_t* from = src.data() + o.src;
        uint8_t* to = dst.data() + o.dst;
        const uint64_t sum = CopyWithChecksum64(to, from, size, hint);
        EXPECT_EQ(sum, Checksum64(from, size)) << "size " << size << " src+" << o.src << " " << h;
        EXPECT_EQ(std::memcmp(to, from, size), 0)
            << "size " << size << " dst+" << o.dst << " " << h;
        for (size_t i = 0; i < o.dst; ++i) ASSERT_EQ(dst[i], 0xA5) << "byte before the copy";
        for (size_t i = o.dst + size; i < o.dst + size + 64; ++i) {
          ASSERT_EQ(dst[i], 0xA5) << "byte " << i - o.dst << " after a copy of " << size << " "
                                  << h;
        }
      }
    }
  }
  EXPECT_EQ(CopyWithChecksum64(nullptr, nullptr, 0), Checksum64(nullptr, 0));
}

}  // namespace
}  // namespace kvd
