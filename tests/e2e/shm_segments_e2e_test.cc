// Shared-memory arena segments changing hands, through a real kvd: a segment freed by a namespace
// keeps its memory when the same namespace takes it back (no new memfd, the clients' mappings
// stay valid), and gets fresh memory when it passes to another namespace (whose clients then
// never find the old one's bytes, nor the old one's clients the new one's).
#include <sys/mman.h>

#include <algorithm>
#include <string>
#include <vector>

#include "e2e_common.h"

namespace kvd::e2e {
namespace {

using namespace std::chrono_literals;

constexpr uint32_t kSegments = 8;  // 64 MiB in 8 MiB segments

class ShmSegmentsE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KvdConfig config;
    config.host_capacity = "64MiB";
    config.host_segment = "8MiB";  // a 5.6 MiB smollm2 chunk per segment
    kvd_ = StartKvd(config);
    ASSERT_NE(kvd_, nullptr);
    admin_ = ConnectOrFail(kvd_->AdminOptions());
    ASSERT_NE(admin_, nullptr);
  }
  // A shared-memory engine of namespace `ns` putting smollm2 chunks: one fills most of a
  // segment, so every eviction empties one.
  std::unique_ptr<client::Client> Engine(const std::string& ns) {
    client::ClientOptions o = kvd_->UnixEngineOptions(ns);
    o.name_space = ns;
    o.model = "smollm2-135m";
    o.layout = Smollm2Layout();
    auto c = ConnectOrFail(o);
    EXPECT_TRUE(c != nullptr && c->session().shared_memory) << kvd_->Log();
    return c;
  }
  std::unique_ptr<KvdProcess> kvd_;
  std::unique_ptr<client::Client> admin_;
};

// Whether `bytes` (a 256-byte probe inside them) lie anywhere in `segments`.
bool FoundIn(const std::vector<client::SharedSegment>& segments,
             const std::vector<uint8_t>& bytes) {
  for (const auto& seg : segments) {
    if (::memmem(seg.data, seg.size, bytes.data() + 4096, 256) != nullptr) return true;
  }
  return false;
}

bool AllZero(const client::SharedSegment& seg) {
  return std::all_of(seg.data, seg.data + seg.size, [](std::byte b) { return b == std::byte{0}; });
}

TEST_F(ShmSegmentsE2eTest, OneNamespaceChurningThroughTheArenaKeepsItsSegmentsMemory) {
  auto c = Engine("churn");
  ASSERT_NE(c, nullptr);
  const size_t bytes = c->options().layout.ChunkBytes(256);
  // Three arenas' worth: from the 9th put on, each evicts the oldest chunk, which empties its
  // segment, and the put takes that segment back.
  constexpr uint64_t kPuts = 3 * kSegments;
  std::vector<std::vector<uint8_t>> data;
  for (uint64_t i = 0; i < kPuts; ++i) {
    data.push_back(RandomBytes(bytes, 500 + i));
    auto put = c->Put(Hash128{0xc4, i}, 256, data[i].data(), bytes);
    ASSERT_TRUE(put.ok()) << "put " << i << ": " << put.status();
  }
  EXPECT_EQ(CounterValue(*admin_, "host_segments_reused"), kPuts - kSegments);
  EXPECT_EQ(CounterValue(*admin_, "host_segments_handed_over"), 0u);
  EXPECT_EQ(CounterValue(*admin_, "shm_segment_replacements"), 0u) << "memory replaced";
  // The client still maps the first memfd of every segment: nothing was remapped.
  const auto segments = c->SharedSegments();
  EXPECT_EQ(segments.size(), kSegments);
  for (const auto& seg : segments) EXPECT_EQ(seg.generation, 1u) << "segment " << seg.index;
  // The last arena's worth is served byte-exact; the rest was evicted.
  for (uint64_t i = 0; i < kPuts; ++i) {
    const Hash128 h{0xc4, i};
    if (i < kPuts - kSegments) {
      EXPECT_EQ(Present(*c, h), 0u) << "chunk " << i;
    } else {
      EXPECT_EQ(FetchOne(*c, h, bytes), data[i]) << "chunk " << i;
    }
  }
}

TEST_F(ShmSegmentsE2eTest, NamespacesTakingTurnsNeverSeeEachOthersBytes) {
  std::unique_ptr<client::Client> engines[2] = {Engine("tenant-a"), Engine("tenant-b")};
  ASSERT_TRUE(engines[0] && engines[1]);
  const size_t bytes = engines[0]->options().layout.ChunkBytes(256);
  std::vector<std::vector<uint8_t>> previous;  // what the other namespace put last round
  for (uint64_t round = 0; round < 4; ++round) {
    client::Client& writer = *engines[round % 2];
    client::Client& other = *engines[(round + 1) % 2];
    SCOPED_TRACE("round " + std::to_string(round) + ", writer " + writer.options().name_space);
    if (round > 0) {
      // Every segment becomes free, last used by the other namespace.
      auto evicted =
          admin_->Evict({client::EvictFilter::Kind::kNamespace, other.options().name_space, {}});
      ASSERT_TRUE(evicted.ok()) << evicted.status();
      ASSERT_EQ(evicted->chunks, kSegments);
    }
    std::vector<std::vector<uint8_t>> data;
    for (uint64_t i = 0; i < kSegments; ++i) {
      data.push_back(RandomBytes(bytes, 7000 + 100 * round + i));
      auto put = writer.Put(Hash128{0x7a + round, i}, 256, data[i].data(), bytes);
      ASSERT_TRUE(put.ok()) << "put " << i << ": " << put.status();
    }
    for (uint64_t i = 0; i < kSegments; ++i) {
      EXPECT_EQ(FetchOne(writer, Hash128{0x7a + round, i}, bytes), data[i]) << "chunk " << i;
    }
    ASSERT_TRUE(writer.FlushReleases().ok());  // nothing stays pinned for the next round
    // The writer maps the segments' new memory (a handover gives each a new generation).
    const auto mine = writer.SharedSegments();
    EXPECT_EQ(mine.size(), kSegments);
    for (const auto& seg : mine) EXPECT_EQ(seg.generation, round + 1) << "segment " << seg.index;
    if (round == 0) {
      previous = std::move(data);
      continue;
    }
    // The other namespace still maps every segment's old memory: none of the writer's bytes is
    // there, ever, and its own old bytes go (zeros) once kvd has freed that memory.
    const auto stale = other.SharedSegments();
    EXPECT_EQ(stale.size(), kSegments);
    for (const auto& d : data) EXPECT_FALSE(FoundIn(stale, d)) << "the writer's bytes leaked";
    for (const auto& seg : stale) {
      EXPECT_EQ(seg.generation, round) << "segment " << seg.index;
      EXPECT_TRUE(Eventually([&] { return AllZero(seg); }, 10s))
          << "segment " << seg.index << " still holds the old namespace's bytes";
    }
    // Nor does the writer find the other namespace's bytes in its new memory.
    for (const auto& d : previous) EXPECT_FALSE(FoundIn(mine, d)) << "the old bytes leaked";
    previous = std::move(data);
  }
  EXPECT_EQ(CounterValue(*admin_, "host_segments_handed_over"), 3 * kSegments);
  EXPECT_EQ(CounterValue(*admin_, "shm_segment_replacements"), 3 * kSegments);
  EXPECT_EQ(CounterValue(*admin_, "host_segments_reused"), 0u);
}

}  // namespace
}  // namespace kvd::e2e
