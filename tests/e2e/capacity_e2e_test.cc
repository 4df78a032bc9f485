// Capacity pressure, leases and reservation expiry in a real kvd with a tiny host tier
// (1 MiB = three 320 KiB stories260k chunks).
#include <thread>

#include "e2e_common.h"

namespace kvd::e2e {
namespace {

class CapacityE2eTest : public ::testing::Test {
 protected:
  void Start(KvdConfig c) {
    c.host_capacity = "1MiB";
    kvd_ = StartKvd(c);
    ASSERT_NE(kvd_, nullptr);
    engine_ = ConnectOrFail(kvd_->EngineOptions());
    admin_ = ConnectOrFail(kvd_->AdminOptions());
    ASSERT_NE(engine_, nullptr);
    ASSERT_NE(admin_, nullptr);
  }
  void TearDown() override {
    engine_.reset();
    admin_.reset();
    if (kvd_ && kvd_->Alive()) {
      EXPECT_EQ(kvd_->Stop(), 0) << kvd_->Log();
    }
  }
  std::unique_ptr<KvdProcess> kvd_;
  std::unique_ptr<client::Client> engine_, admin_;
};

TEST_F(CapacityE2eTest, PressureEvictsTheLeastRecentlyUsedChunk) {
  ASSERT_NO_FATAL_FAILURE(Start({}));
  const Hash128 a{1, 1}, b{2, 2}, c{3, 3}, d{4, 4};
  auto da = PutChunk(*engine_, a, 1);
  PutChunk(*engine_, b, 2);
  PutChunk(*engine_, c, 3);
  EXPECT_EQ(HostTier(*admin_).chunks, 3u);
  // Read A: it becomes the most recent, so B is now the least recently used.
  auto hit = engine_->Lookup({&a, 1});
  ASSERT_TRUE(hit.ok());
  std::vector<uint8_t> out(da.size());
  ASSERT_TRUE(engine_->Get(hit->lease_id, 0, out.data(), out.size()).ok());
  ASSERT_TRUE(engine_->ReleaseLease(hit->lease_id).ok());
  PutChunk(*engine_, d, 4);
  EXPECT_EQ(Present(*engine_, b), 0u) << "B was the LRU chunk and should have been evicted";
  EXPECT_EQ(Present(*engine_, a), 1u);
  EXPECT_EQ(Present(*engine_, c), 1u);
  EXPECT_EQ(Present(*engine_, d), 1u);
  auto host = HostTier(*admin_);
  EXPECT_EQ(host.chunks, 3u);
  EXPECT_GE(host.evictions, 1u);
  EXPECT_LE(host.used_bytes, host.capacity_bytes);
}

TEST_F(CapacityE2eTest, LeasedChunkIsNeverEvictedBeforeItsGet) {
  ASSERT_NO_FATAL_FAILURE(Start({}));
  const Hash128 a{1, 1}, b{2, 2}, c{3, 3}, d{4, 4}, e{5, 5}, f{6, 6};
  auto da = PutChunk(*engine_, a, 1);
  PutChunk(*engine_, b, 2);
  PutChunk(*engine_, c, 3);
  auto lease = engine_->Lookup({&a, 1});  // A: oldest, but leased from here on
  ASSERT_TRUE(lease.ok());
  ASSERT_EQ(lease->matched_chunks, 1u);
  EXPECT_GT(HostTier(*admin_).pinned_bytes, 0u);
  PutChunk(*engine_, d, 4);
  PutChunk(*engine_, e, 5);  // two evictions: B and C, never the leased A
  std::vector<uint8_t> out(da.size());
  auto g = engine_->Get(lease->lease_id, 0, out.data(), out.size());
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(out, da);
  EXPECT_EQ(Present(*engine_, b), 0u);
  EXPECT_EQ(Present(*engine_, c), 0u);
  // With every chunk leased, a put cannot make room.
  std::vector<Hash128> all = {a, d, e};
  auto pin_all = engine_->Lookup(all);
  ASSERT_TRUE(pin_all.ok());
  ASSERT_EQ(pin_all->matched_chunks, 3u);
  auto data = RandomBytes(engine_->options().layout.ChunkBytes(256), 6);
  auto r = engine_->Put(f, 256, data.data(), data.size());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status();
  ASSERT_TRUE(engine_->ReleaseLease(pin_all->lease_id).ok());
  ASSERT_TRUE(engine_->ReleaseLease(lease->lease_id).ok());
  EXPECT_TRUE(engine_->Put(f, 256, data.data(), data.size()).ok());  // room again
}

TEST_F(CapacityE2eTest, UncommittedReservationIsReclaimedAndItsCommitAborted) {
  KvdConfig cfg;
  cfg.reservation_ttl_ms = 300;
  ASSERT_NO_FATAL_FAILURE(Start(cfg));
  auto o = kvd_->EngineOptions("slow-writer");
  client::TestHooks hooks;
  hooks.before_commit = [&] {
    // The reservation is visible as reserved bytes until it expires.
    EXPECT_GT(HostTier(*admin_).reserved_bytes, 0u);
    std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  };
  auto slow = ConnectOrFail(o, hooks);
  ASSERT_NE(slow, nullptr);
  const Hash128 h{9, 9};
  auto data = RandomBytes(o.layout.ChunkBytes(256), 9);
  auto r = slow->Put(h, 256, data.data(), data.size());
  EXPECT_EQ(r.status().code(), StatusCode::kAborted) << r.status();
  EXPECT_TRUE(
      Eventually([&] { return HostTier(*admin_).reserved_bytes == 0; }, std::chrono::seconds(3)));
  EXPECT_EQ(Present(*engine_, h), 0u) << "an expired reservation must never become visible";
  // Its space came back: three full chunks fit again.
  for (uint64_t i = 0; i < 3; ++i) PutChunk(*engine_, {20, i}, 20 + i);
  EXPECT_EQ(HostTier(*admin_).evictions, 0u);
}

TEST_F(CapacityE2eTest, GetOfAnEvictedChunkSendsNoBytes) {
  KvdConfig cfg;
  cfg.lease_ttl_ms = 300;
  ASSERT_NO_FATAL_FAILURE(Start(cfg));
  const Hash128 a{1, 1};
  auto da = PutChunk(*engine_, a, 1);
  auto lease = engine_->Lookup({&a, 1});
  ASSERT_TRUE(lease.ok());
  ASSERT_EQ(lease->matched_chunks, 1u);
  // Evicting a leased chunk hides it from lookups at once but keeps its bytes for the lease
  // (reported as skipped_pinned); once the lease expired (300 ms) the bytes are gone too.
  auto e = admin_->Evict({client::EvictFilter::Kind::kChunk, "", a});
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->chunks, 0u);
  EXPECT_EQ(e->skipped_pinned, 1u);
  EXPECT_EQ(Present(*engine_, a), 0u);
  auto open_leases = [&]() -> uint64_t {
    auto s = admin_->GetStats();
    return s.ok() ? CounterValue(*s, "host_leases_open") : ~0ull;
  };
  ASSERT_TRUE(Eventually([&] { return open_leases() == 0; }, std::chrono::seconds(3)));
  std::vector<uint8_t> out(da.size());
  auto g = engine_->Get(lease->lease_id, 0, out.data(), out.size());
  // The lease that pinned it expired first: the daemon says so (ABORTED), it sends no bytes.
  EXPECT_EQ(g.status().code(), StatusCode::kAborted) << g.status();
  EXPECT_NE(g.status().message().find("expired"), std::string::npos) << g.status();

  // A chunk evicted after its lease was released: the lease is gone, so is the chunk.
  const Hash128 b{2, 2};
  PutChunk(*engine_, b, 2);
  auto lease_b = engine_->Lookup({&b, 1});
  ASSERT_TRUE(lease_b.ok());
  ASSERT_TRUE(engine_->ReleaseLease(lease_b->lease_id).ok());
  SendNextRequest(*engine_);  // the release goes out with it
  auto eb = admin_->Evict({client::EvictFilter::Kind::kChunk, "", b});
  ASSERT_TRUE(eb.ok());
  EXPECT_EQ(eb->chunks, 1u);
  g = engine_->Get(lease_b->lease_id, 0, out.data(), out.size());
  EXPECT_EQ(g.status().code(), StatusCode::kAborted) << g.status();
  EXPECT_NE(g.status().message().find("released"), std::string::npos) << g.status();
  // A lease the daemon never issued.
  g = engine_->Get(987654321, 0, out.data(), out.size());
  EXPECT_EQ(g.status().code(), StatusCode::kNotFound) << g.status();
  ExpectServes(*engine_, 3);  // the session is still fine
}

}  // namespace
}  // namespace kvd::e2e
