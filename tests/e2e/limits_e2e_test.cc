// Exhaustion attempts against a real kvd: silent and stalled connections, half-written frames,
// connection floods, lease hoarding, oversized chains and over-long leases. Each case checks the
// specific refusal and that the daemon keeps serving.
#include <gmock/gmock.h>

#include <thread>

#include "e2e_common.h"

namespace kvd::e2e {
namespace {

using ::testing::HasSubstr;

TEST(LimitsE2eTest, SilentAndStalledConnectionsAreClosedIdleSessionsAreNot) {
  KvdConfig c;
  c.extra_limits = {"handshake_timeout_ms: 300", "frame_timeout_ms: 300"};
  auto kvd = StartKvd(c);
  ASSERT_NE(kvd, nullptr);
  auto good = ConnectOrFail(kvd->EngineOptions());
  ASSERT_NE(good, nullptr);
  // No Hello at all.
  auto silent = RawConnection::Open(kvd->tcp_address());
  ASSERT_TRUE(silent.ok());
  // A header promising 1 MiB, a few bytes, then silence (before Hello).
  auto stalled = RawConnection::Open(kvd->tcp_address());
  ASSERT_TRUE(stalled.ok());
  uint8_t header[proto::kFrameHeaderBytes];
  proto::EncodeFrameHeader(1u << 20, header);
  ASSERT_TRUE((*stalled)->Write(header, sizeof header).ok());
  ASSERT_TRUE((*stalled)->Write("0123456789", 10).ok());
  // After a Hello: an idle connection stays; one that stalls inside a frame does not.
  auto idle = RawConnection::Open(kvd->tcp_address());
  auto mid_frame = RawConnection::Open(kvd->tcp_address());
  ASSERT_TRUE(idle.ok() && mid_frame.ok());
  const auto hello = AdminHelloFrame();
  for (auto* r : {&*idle, &*mid_frame}) {
    ASSERT_TRUE((*r)->Write(hello.data(), hello.size()).ok());
    ASSERT_TRUE((*r)->ReadResponseStatus(std::chrono::seconds(3)).ok());
  }
  ASSERT_TRUE((*mid_frame)->Write(header, sizeof header).ok());
  EXPECT_TRUE((*silent)->ClosedByPeer(std::chrono::seconds(5)));
  EXPECT_TRUE((*stalled)->ClosedByPeer(std::chrono::seconds(5)));
  EXPECT_TRUE((*mid_frame)->ClosedByPeer(std::chrono::seconds(5)));
  EXPECT_FALSE((*idle)->ClosedByPeer(std::chrono::milliseconds(800)));  // > both deadlines
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  ExpectServes(*good, 1);  // an engine idle for longer than the deadlines keeps its session
  EXPECT_THAT(kvd->Log(), HasSubstr("no Hello within limits.handshake_timeout_ms"));
  EXPECT_THAT(kvd->Log(), HasSubstr("frame payload not complete within limits.frame_timeout_ms"));
}

TEST(LimitsE2eTest, HalfWrittenFramesDoNotReserveTheirDeclaredSize) {
  KvdConfig c;  // max_frame_bytes 4 MiB: 100 headers declare 400 MiB
  c.host_capacity = "16MiB";
  // A budget that takes all 100 (the default, 64 MiB, would refuse the 17th: AdmissionE2eTest).
  c.extra_limits = {"frame_buffer_budget_bytes: 512MiB"};
  auto kvd = StartKvd(c);
  ASSERT_NE(kvd, nullptr);
  auto good = ConnectOrFail(kvd->EngineOptions());
  ASSERT_NE(good, nullptr);
  ExpectServes(*good, 1);
  const uint64_t before = RssBytes(kvd->pid());
  std::vector<std::unique_ptr<RawConnection>> conns;
  uint8_t header[proto::kFrameHeaderBytes];
  proto::EncodeFrameHeader((4u << 20) - 64, header);
  // Each authenticates first: before Hello, frames over 16 KiB are refused.
  for (int i = 0; i < 100; ++i) {
    auto r = OpenAuthenticated(*kvd);
    ASSERT_NE(r, nullptr);
    ASSERT_TRUE(r->Write(header, sizeof header).ok());
    ASSERT_TRUE(r->Write("twenty bytes of data", 20).ok());
    conns.push_back(std::move(r));
  }
  ExpectServes(*good, 2);  // the daemon has read all it was sent by now
  const uint64_t after = RssBytes(kvd->pid());
  std::printf("rss before %.1f MiB, with 100 half-written 4 MiB frames %.1f MiB\n",
              before / 1048576.0, after / 1048576.0);
  // Declared: 400 MiB. Received: 2 KiB: a frame buffer's pages are resident only once written.
  EXPECT_LT(after, before + (32u << 20));
}

TEST(LimitsE2eTest, ConnectionFloodLeavesTheAdminReserveAndPerPeerCap) {
  KvdConfig c;
  c.extra_limits = {"max_sessions: 100", "max_sessions_per_peer: 1000"};
  auto kvd = StartKvd(c);
  ASSERT_NE(kvd, nullptr);
  // 100 authenticated sessions fill max_sessions (connections that never send a Hello would be
  // displaced instead: AdmissionE2eTest).
  std::vector<std::unique_ptr<RawConnection>> flood;
  for (int i = 0; i < 100; ++i) {
    auto r = OpenAuthenticated(*kvd);
    ASSERT_NE(r, nullptr);
    flood.push_back(std::move(r));
  }
  auto admin = kvd->AdminOptions();
  admin.address = kvd->tcp_address();
  auto refused = client::Client::Connect(admin);
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("limits.max_sessions=100"));
  // kvdctl on the node still gets in over the unix socket.
  std::string out;
  const int rc = RunProgram({KVDCTL_BINARY, "--addr", kvd->unix_address(), "health"}, &out);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_THAT(out, HasSubstr("serving"));
  flood.clear();
}

TEST(LimitsE2eTest, PerPeerSessionCap) {
  KvdConfig c;
  c.extra_limits = {"max_sessions_per_peer: 4"};
  auto kvd = StartKvd(c);
  ASSERT_NE(kvd, nullptr);
  std::vector<std::unique_ptr<RawConnection>> conns;
  for (int i = 0; i < 4; ++i) {
    auto r = OpenAuthenticated(*kvd);
    ASSERT_NE(r, nullptr);
    conns.push_back(std::move(r));
  }
  auto refused = client::Client::Connect(kvd->EngineOptions());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(refused.status().message(),
              HasSubstr("too many sessions from tcp:loopback: limits.max_sessions_per_peer=4"));
  conns.pop_back();  // one slot back
  ASSERT_TRUE(Eventually([&] { return client::Client::Connect(kvd->EngineOptions()).ok(); },
                         std::chrono::seconds(5)));
}

TEST(LimitsE2eTest, LeaseHoardingLongChainsAndLongLeasesAreBounded) {
  KvdConfig c;
  c.extra_limits = {"max_leases_per_session: 4", "max_chain_chunks: 8", "max_lease_ttl_ms: 40000"};
  auto kvd = StartKvd(c);
  ASSERT_NE(kvd, nullptr);
  auto o = kvd->EngineOptions();
  o.lease_ttl_ms = 3000000;  // 100x the default: cut to max_lease_ttl_ms
  auto e = ConnectOrFail(o);
  ASSERT_NE(e, nullptr);
  const Hash128 h{0x1ea5e, 1};
  PutChunk(*e, h, 5, 64);
  std::vector<uint64_t> leases;
  for (int i = 0; i < 4; ++i) {
    auto r = e->Lookup({&h, 1});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->lease_ttl_ms, 40000u);
    leases.push_back(r->lease_id);
  }
  auto fifth = e->Lookup({&h, 1});
  EXPECT_EQ(fifth.status().code(), StatusCode::kResourceExhausted) << fifth.status();
  EXPECT_THAT(fifth.status().message(), HasSubstr("already holds 4 leases (limit 4)"));
  // Another connection has its own budget.
  auto other = ConnectOrFail(kvd->EngineOptions("other"));
  ASSERT_NE(other, nullptr);
  EXPECT_EQ(Present(*other, h), 1u);
  ASSERT_TRUE(e->ReleaseLease(leases.back()).ok());
  auto again = e->Lookup({&h, 1});
  ASSERT_TRUE(again.ok()) << again.status();
  std::vector<Hash128> chain(9, h);
  auto long_chain = other->Lookup(chain);
  EXPECT_EQ(long_chain.status().code(), StatusCode::kOutOfRange) << long_chain.status();
  EXPECT_THAT(long_chain.status().message(),
              HasSubstr("lookup chain of 9 chunks is over limits.max_chain_chunks 8"));
  ExpectServes(*other, 3);
}

}  // namespace
}  // namespace kvd::e2e
