// Reserve-ahead shared-memory puts (ClientOptions::reserve_ahead; kvd.capnp, Commit) against a
// real kvd: a put's commit takes the next put's slot, and a put that fits it is one exchange;
// mixed sizes byte-exact, a size that does not fit aborts the held slot in its Reserve's
// exchange, the held slot freed when the client exits or is killed and when its TTL passes, a
// chunk already stored found at the commit (copied for nothing), kvd declining when the held
// space could make another client's put fail, and a kvd without the feature.
// stories260k: 1280 bytes per token; smollm2-135m: 5.6 MiB per 256-token chunk.
#include <gmock/gmock.h>

#include "e2e_common.h"

namespace kvd::e2e {
namespace {

using namespace std::chrono_literals;

class ReserveAheadE2eTest : public ::testing::Test {
 protected:
  void Start(KvdConfig config = {}) {
    if (config.host_segment.empty()) config.host_segment = "8MiB";  // shm on the unix socket
    kvd_ = StartKvd(config);
    ASSERT_NE(kvd_, nullptr);
    admin_ = ConnectOrFail(kvd_->AdminOptions());
    ASSERT_NE(admin_, nullptr);
  }
  // A shared-memory engine client that reserves ahead; every put takes the slot path.
  std::unique_ptr<client::Client> Writer(const std::string& id, bool ahead = true) {
    auto o = kvd_->UnixEngineOptions(id);
    o.reserve_ahead = ahead;
    o.shm_inline_put_bytes = 0;
    auto c = ConnectOrFail(o);
    if (c != nullptr) EXPECT_TRUE(c->session().shared_memory);
    return c;
  }
  uint64_t Counter(const std::string& name) { return CounterValue(*admin_, name); }
  // Frames kvd read (every connection) since the last call, less this call's own stats request.
  uint64_t FramesSinceLast() {
    const uint64_t now = Counter("frames_in");
    const uint64_t d = now - frames_;
    frames_ = now;
    return d - 1;
  }

  std::unique_ptr<KvdProcess> kvd_;
  std::unique_ptr<client::Client> admin_;
  uint64_t frames_ = 0;
};

TEST_F(ReserveAheadE2eTest, MixedSizesAreByteExactAndAPutIntoTheHeldSlotIsOneExchange) {
  ASSERT_NO_FATAL_FAILURE(Start());
  auto c = Writer("ahead");
  ASSERT_NE(c, nullptr);
  const ModelLayout& layout = c->options().layout;
  struct Step {
    int tokens;
    bool fits;  // the slot held since the previous put has this put's size
  };
  const std::vector<Step> steps = {{256, false}, {256, true},  {256, true},
                                   {100, false}, {100, true},  {256, false},
                                   {1, false},   {256, false}, {256, true}};
  std::vector<std::vector<uint8_t>> data;
  FramesSinceLast();
  uint64_t aborted = 0, into_held = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    SCOPED_TRACE("put " + std::to_string(i) + ", " + std::to_string(steps[i].tokens) + " tokens");
    data.push_back(RandomBytes(layout.ChunkBytes(steps[i].tokens), 100 + i));
    auto r = c->Put(Hash128{0xa4ead, i}, steps[i].tokens, data[i].data(), data[i].size());
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_FALSE(r->already_stored);
    EXPECT_EQ(r->bytes, data[i].size());
    // Into the held slot: the Commit alone. Otherwise Reserve (aborting a held slot of another
    // size in the same exchange: Reserve.abortFirst) and Commit.
    EXPECT_EQ(FramesSinceLast(), steps[i].fits ? 1u : 2u);
    into_held += steps[i].fits ? 1 : 0;
    aborted += (i > 0 && !steps[i].fits) ? 1 : 0;
    EXPECT_EQ(Counter("puts_reserved_ahead"), into_held);
    EXPECT_EQ(Counter("reserve_ahead_aborted"), aborted);
    EXPECT_EQ(Counter("reserve_ahead_granted"), i + 1);
    FramesSinceLast();
    // Between puts the client holds exactly one slot, of this put's size.
    const client::TierStats host = HostTier(*admin_);
    EXPECT_EQ(host.reserved_bytes, data[i].size());
    FramesSinceLast();
  }
  EXPECT_EQ(Counter("puts_committed"), steps.size());
  EXPECT_EQ(Counter("reserve_ahead_declined"), 0u);
  for (size_t i = 0; i < steps.size(); ++i) {
    EXPECT_EQ(FetchOne(*c, Hash128{0xa4ead, i}, data[i].size()), data[i]) << "put " << i;
  }
  // PutChunks: the window's first chunk goes into the held slot, its last commit takes the next.
  std::vector<client::PutItem> items;
  std::vector<std::vector<uint8_t>> window;
  for (uint64_t j = 0; j < 5; ++j) window.push_back(RandomBytes(layout.ChunkBytes(256), 200 + j));
  for (uint64_t j = 0; j < 5; ++j) {
    items.push_back({Hash128{0xa4eae, j}, 256, window[j].data(), window[j].size()});
  }
  FramesSinceLast();
  auto r = c->PutChunks(items);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(FramesSinceLast(), 4u + 5u);  // 4 Reserves, 5 Commits
  EXPECT_EQ(Counter("puts_reserved_ahead"), into_held + 1);
  for (uint64_t j = 0; j < 5; ++j) {
    EXPECT_EQ(FetchOne(*c, Hash128{0xa4eae, j}, window[j].size()), window[j]) << "chunk " << j;
  }
  // The client goes: its held slot goes with its session.
  c.reset();
  EXPECT_TRUE(Eventually([&] { return HostTier(*admin_).reserved_bytes == 0; }, 5s));
  EXPECT_EQ(CounterValue(*admin_, "host_reservations_open"), 0u);
}

TEST_F(ReserveAheadE2eTest, AKilledWriterLeavesNoChunkAndItsHeldSlotIsReclaimed) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const client::ClientOptions o = kvd_->UnixEngineOptions("driver");
  auto child = ChildProcess::Spawn({KVD_E2E_DRIVER, "put-ahead", o.address, UcxTls(o)});
  ASSERT_TRUE(child.ok()) << child.status();
  auto line = (*child)->ReadLine(10s);
  ASSERT_TRUE(line.ok()) << line.status() << "\n" << kvd_->Log();
  ASSERT_EQ(*line, "HELD");
  const uint64_t chunk_bytes = o.layout.ChunkBytes(256);
  EXPECT_EQ(HostTier(*admin_).reserved_bytes, chunk_bytes);  // the slot held for its next put
  EXPECT_EQ(HostTier(*admin_).chunks, 1u);
  const pid_t pid = (*child)->pid();
  (*child)->Kill();
  EXPECT_TRUE(Eventually([&] { return HostTier(*admin_).reserved_bytes == 0; }, 5s))
      << "the killed writer's held slot was not reclaimed";
  EXPECT_EQ(Counter("reservations_reclaimed"), 1u);
  auto c = Writer("good");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(HostTier(*admin_).chunks, 1u);  // only the chunk it committed
  EXPECT_EQ(Present(*c, Hash128{0xa11ead, static_cast<uint64_t>(pid)}), 1u);
  ExpectServes(*c, 7);
}

TEST_F(ReserveAheadE2eTest, AHeldSlotExpiresWithTheReservationTtlAndIsNotUsedLate) {
  KvdConfig config;
  config.reservation_ttl_ms = 1000;
  ASSERT_NO_FATAL_FAILURE(Start(config));
  auto c = Writer("idle");
  ASSERT_NE(c, nullptr);
  const size_t bytes = c->options().layout.ChunkBytes(256);
  const auto first = PutChunk(*c, Hash128{0x77e, 1}, 1);
  EXPECT_EQ(HostTier(*admin_).reserved_bytes, bytes);
  EXPECT_TRUE(Eventually([&] { return HostTier(*admin_).reserved_bytes == 0; }, 10s))
      << "the idle client's held slot did not expire";
  EXPECT_EQ(Counter("reservations_expired"), 1u);
  // The next put does not use the expired slot (past half its TTL): it reserves, and lands.
  const auto second = PutChunk(*c, Hash128{0x77e, 2}, 2);
  EXPECT_EQ(Counter("puts_reserved_ahead"), 0u);
  EXPECT_EQ(Counter("reserve_ahead_aborted"), 0u);  // the expired id was skipped
  EXPECT_EQ(FetchOne(*c, Hash128{0x77e, 1}, bytes), first);
  EXPECT_EQ(FetchOne(*c, Hash128{0x77e, 2}, bytes), second);
}

TEST_F(ReserveAheadE2eTest, AChunkAlreadyStoredIsFoundAtTheCommitAndCountedAsCopiedForNothing) {
  ASSERT_NO_FATAL_FAILURE(Start());
  auto c = Writer("dup");
  ASSERT_NE(c, nullptr);
  const Hash128 h{0xd0b, 1};
  const auto stored = PutChunk(*c, h, 1);  // leaves a held slot
  const uint64_t dedup_before = Counter("puts_deduplicated");
  const auto other = RandomBytes(stored.size(), 2);
  auto r = c->Put(h, 256, other.data(), other.size());  // into the held slot
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->already_stored);
  EXPECT_EQ(Counter("puts_copied_for_nothing"), 1u);
  EXPECT_EQ(Counter("puts_reserved_ahead"), 1u);
  EXPECT_EQ(Counter("puts_deduplicated"), dedup_before + 1);
  EXPECT_EQ(Counter("puts_committed"), 1u);
  EXPECT_EQ(Counter("reserve_ahead_granted"), 2u);    // the dedup commit took the next slot too
  EXPECT_EQ(FetchOne(*c, h, stored.size()), stored);  // the stored chunk is unchanged
  EXPECT_EQ(HostTier(*admin_).chunks, 1u);
}

TEST_F(ReserveAheadE2eTest, HeldSlotsNeverMakeAnotherClientsPutFail) {
  // Two 8 MiB segments, 5.6 MiB chunks: a held slot fills a segment. Three writers in turn; if
  // two could hold slots, the third would find no room (RESOURCE_EXHAUSTED).
  KvdConfig config;
  config.host_capacity = "16MiB";
  config.host_segment = "8MiB";
  ASSERT_NO_FATAL_FAILURE(Start(config));
  std::vector<std::unique_ptr<client::Client>> writers;
  for (int w = 0; w < 3; ++w) {
    auto o = kvd_->UnixEngineOptions("w" + std::to_string(w));
    o.model = "smollm2-135m";
    o.layout = Smollm2Layout();
    o.reserve_ahead = true;
    writers.push_back(ConnectOrFail(o));
    ASSERT_NE(writers.back(), nullptr);
  }
  const size_t bytes = Smollm2Layout().ChunkBytes(256);
  std::vector<uint8_t> last;
  for (uint64_t n = 0; n < 12; ++n) {
    SCOPED_TRACE("put " + std::to_string(n));
    client::Client& c = *writers[n % 3];
    last = RandomBytes(bytes, n);
    auto r = c.Put(Hash128{0x5ace, n}, 256, last.data(), last.size());
    ASSERT_TRUE(r.ok()) << r.status();
    // At most one slot held at a time (half the arena).
    EXPECT_LE(HostTier(*admin_).reserved_bytes, bytes);
  }
  EXPECT_GT(Counter("reserve_ahead_declined"), 0u);
  EXPECT_GT(Counter("puts_reserved_ahead"), 0u);
  EXPECT_EQ(FetchOne(*writers[11 % 3], Hash128{0x5ace, 11}, bytes), last);
}

TEST_F(ReserveAheadE2eTest, AKvdWithoutReserveAheadServesTheClientWithTwoExchanges) {
  OlderKvd older = StartKvdWithout("reserve_ahead");
  ASSERT_TRUE(older.ok());
  auto o = older.kvd->UnixEngineOptions("wants-ahead");
  o.reserve_ahead = true;
  o.shm_inline_put_bytes = 0;
  auto c = ConnectOrFail(o);
  ASSERT_NE(c, nullptr);
  for (uint64_t i = 0; i < 3; ++i) {
    const auto data = PutChunk(*c, Hash128{0x01d, i}, i);
    EXPECT_EQ(FetchOne(*c, Hash128{0x01d, i}, data.size()), data);
    EXPECT_EQ(HostTier(*older.admin).reserved_bytes, 0u);
  }
  EXPECT_EQ(CounterValue(*older.admin, "reserve_ahead_granted"), 0u);
  EXPECT_EQ(CounterValue(*older.admin, "puts_committed"), 3u);
}

}  // namespace
}  // namespace kvd::e2e
