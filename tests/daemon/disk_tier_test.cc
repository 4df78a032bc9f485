// The daemon with a RocksDB disk tier under the host tier: demotion above the high watermark,
// promotion on lookup, and chunks that survive a restart of the daemon.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "daemon_test_util.h"
#include "kvd/proto/convert.h"

namespace kvd::daemon::testing {
namespace {

class DiskTierDaemonTest : public DaemonTest {
 protected:
  DiskTierDaemonTest() {
    dir_ = ::testing::TempDir() + "kvd-daemon-disk-" + std::to_string(::getpid()) + "-" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    storage::DiskTierOptions disk;
    disk.path = dir_;
    disk.capacity_bytes = 64u << 20;
    config_.disk_tier = disk;
    // Three raw stories260k chunks of 256 tokens (320 KiB each) fill the host tier past 0.9.
    config_.host_tier.capacity_bytes = 1u << 20;
  }
  ~DiskTierDaemonTest() override {
    StopDaemon();
    std::filesystem::remove_all(dir_);
  }

  bool WaitHostOccupancyAtMost(double limit) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (std::chrono::steady_clock::now() < deadline) {
      if (server_->host_tier()->Occupancy() <= limit) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }

  uint64_t LookupTokens(Engine& e, const std::vector<Hash128>& chain, uint64_t* lease) {
    capnp::MallocMessageBuilder mb;
    BuildLookup(mb, chain);
    auto reply = e.conn->Call(mb);
    EXPECT_NE(reply, nullptr);
    if (reply == nullptr) return 0;
    EXPECT_TRUE(ResponseStatus(*reply).ok()) << ResponseStatus(*reply);
    auto l = reply->Root<proto::Response>().getLookup();
    if (lease) *lease = l.getLeaseId();
    return l.getMatchedTokens();
  }

  Status GetChunk(Engine& e, uint64_t lease, uint32_t index, std::vector<uint8_t>* out) {
    const uint64_t tag = 0xD15C00 + index;
    auto recv = e.transport->PostRecv(e.daemon_peer, tag, out->data(), out->size());
    KVD_RETURN_IF_ERROR(recv.status());
    capnp::MallocMessageBuilder mb;
    BuildGet(mb, lease, index, tag, out->size());
    auto reply = e.conn->Call(mb);  // loopback: the daemon's send completes inline
    Status w = e.transport->Wait(*recv, std::chrono::milliseconds(1000));
    e.transport->Release(*recv).IgnoreError();
    if (reply == nullptr) return Status::Unavailable("no reply");
    KVD_RETURN_IF_ERROR(ResponseStatus(*reply));
    return w;
  }

  std::string dir_;
};

TEST_F(DiskTierDaemonTest, DemotesPromotesAndSurvivesRestart) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  ASSERT_NE(server_->disk_tier(), nullptr);
  const size_t bytes = Layout().ChunkBytes(256);
  std::vector<std::vector<uint8_t>> chunks;
  {
    auto e = ConnectEngine();
    ASSERT_NE(e, nullptr);
    for (uint64_t i = 0; i < 6; ++i) {
      chunks.push_back(RandomBytes(bytes, 300 + i));
      ASSERT_TRUE(Put(*e, Hash128{30, i}, 256, chunks.back()).ok()) << i;
      // Demotion runs in the background after each commit; let it catch up so that the host
      // tier never has to drop a chunk to make room.
      ASSERT_TRUE(WaitHostOccupancyAtMost(config_.placement.high_watermark)) << i;
    }
    EXPECT_GE(server_->disk_tier()->GetStats().chunk_count, 3u);

    // Stats list both tiers, and per-model occupancy counts every chunk once.
    capnp::MallocMessageBuilder stats_req;
    stats_req.initRoot<proto::Request>().setStats();
    auto stats = e->conn->Call(stats_req);
    ASSERT_NE(stats, nullptr);
    auto st = stats->Root<proto::Response>().getStats();
    ASSERT_EQ(st.getTiers().size(), 2u);
    EXPECT_EQ(std::string(st.getTiers()[1].getName().cStr()), "disk");
    ASSERT_EQ(st.getModels().size(), 1u);
    EXPECT_EQ(st.getModels()[0].getChunks(), 6u);

    // The first chunk is only on disk now: a lookup promotes it; the get is byte-exact.
    uint64_t lease = 0;
    EXPECT_EQ(LookupTokens(*e, {Hash128{30, 0}}, &lease), 256u);
    std::vector<uint8_t> got(bytes);
    ASSERT_TRUE(GetChunk(*e, lease, 0, &got).ok());
    EXPECT_EQ(got, chunks[0]);
  }

  // Restart on the same disk path: the demoted chunks are still there.
  StopDaemon();
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  auto e = ConnectEngine();
  ASSERT_NE(e, nullptr);
  EXPECT_GE(server_->disk_tier()->restored_chunks(), 3u);
  uint64_t lease = 0;
  EXPECT_EQ(LookupTokens(*e, {Hash128{30, 1}}, &lease), 256u);
  std::vector<uint8_t> got(bytes);
  ASSERT_TRUE(GetChunk(*e, lease, 0, &got).ok());
  EXPECT_EQ(got, chunks[1]);
}

TEST_F(DiskTierDaemonTest, UnknownTransportBackendNamesTheKey) {
  config_.transport.backend = "rdma";
  auto server = Server::Create(config_, ServerDeps{});
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(server.status().message(), ::testing::HasSubstr("transport.backend \"rdma\""));
  EXPECT_THAT(server.status().message(), ::testing::HasSubstr("unknown transport backend 'rdma'"));
}

TEST_F(DiskTierDaemonTest, BadDiskPathFailsCreate) {
  config_.disk_tier->path = "/proc/kvd-cannot-create-this";
  auto server = Server::Create(config_, std::move(deps_));
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(server.status().message(), ::testing::HasSubstr("disk tier at /proc/"));
}

}  // namespace
}  // namespace kvd::daemon::testing
