// Admission's decisions (daemon/src/admission.h) on their own: displacement order, refusals,
// and how peers are counted.
#include "admission.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kvd::daemon {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
namespace ip = boost::asio::ip;

LimitsOptions Limits(int max_sessions, int per_peer, double share) {
  LimitsOptions l;
  l.max_sessions = max_sessions;
  l.max_sessions_per_peer = per_peer;
  l.unauthenticated_share = share;
  l.admin_reserve_sessions = 1;
  l.unauthenticated_grace_ms = 0;  // every handshaking connection may be displaced at once
  return l;
}

TEST(AdmissionTest, EveryLoopbackAddressIsOnePeerAndUnixPeersAreUids) {
  EXPECT_EQ(Admission::TcpPeer(ip::make_address("127.0.0.1")), "tcp:loopback");
  EXPECT_EQ(Admission::TcpPeer(ip::make_address("127.3.2.1")), "tcp:loopback");
  EXPECT_EQ(Admission::TcpPeer(ip::make_address("::1")), "tcp:loopback");
  EXPECT_EQ(Admission::TcpPeer(ip::make_address("::ffff:127.0.0.2")), "tcp:loopback");
  EXPECT_EQ(Admission::TcpPeer(ip::make_address("::ffff:10.1.2.3")), "tcp:10.1.2.3");
  EXPECT_EQ(Admission::TcpPeer(ip::make_address("10.1.2.3")), "tcp:10.1.2.3");
  EXPECT_EQ(Admission::UnixPeer(1000), "uid:1000");
  EXPECT_EQ(Admission::UnixPeer(-1), "uid:?");
}

// A burst: connections younger than the grace go over the share instead of displacing each
// other; once the oldest waited the grace, a newcomer displaces it.
TEST(AdmissionTest, HandshakingConnectionsYoungerThanTheGraceAreNotDisplacedForTheShare) {
  LimitsOptions l = Limits(100, 100, 0.02);  // 2 handshaking at most by the share
  l.unauthenticated_grace_ms = 1000;
  Admission a(l);
  for (uint64_t id = 1; id <= 6; ++id) {
    auto d = a.Admit(id, "tcp:loopback", false, 100 + static_cast<int64_t>(id));
    EXPECT_TRUE(d.refusal.empty() && d.displaced.empty()) << id;
  }
  EXPECT_EQ(a.handshaking(), 6u);
  // 1 arrived at 101 and waited the grace at 1101: displaced; 2 (at 102) has not yet.
  EXPECT_THAT(a.Admit(7, "tcp:loopback", false, 1101).displaced, ElementsAre(1u));
  EXPECT_TRUE(a.Admit(8, "tcp:loopback", false, 1101).displaced.empty());
  // At max_sessions the oldest goes whatever its age.
  LimitsOptions small = Limits(4, 100, 0.5);
  small.unauthenticated_grace_ms = 1000;
  Admission b(small);
  for (uint64_t id = 1; id <= 4; ++id) b.Admit(id, "tcp:loopback", false, 100);
  EXPECT_THAT(b.Admit(5, "tcp:loopback", false, 100).displaced, ElementsAre(1u));
}

TEST(AdmissionTest, HandshakingShareFullDisplacesTheOldest) {
  Admission a(Limits(8, 100, 0.25));  // 2 handshaking at most
  EXPECT_EQ(a.handshaking_cap(), 2u);
  EXPECT_TRUE(a.Admit(1, "tcp:a", false, 0).displaced.empty());
  EXPECT_TRUE(a.Admit(2, "tcp:b", false, 0).displaced.empty());
  EXPECT_THAT(a.Admit(3, "tcp:c", false, 0).displaced, ElementsAre(1u));
  a.Authenticated(2);
  EXPECT_TRUE(a.Admit(4, "tcp:d", false, 0).displaced.empty());
  EXPECT_EQ(a.handshaking(), 2u);
  EXPECT_EQ(a.sessions(), 3u);
  a.Remove(1);  // displaced already: no-op
  EXPECT_EQ(a.sessions(), 3u);
}

TEST(AdmissionTest, FullTableOfAuthenticatedSessionsRefusesTcpButKeepsTheUnixReserve) {
  Admission a(Limits(2, 100, 1.0));
  a.Admit(1, "tcp:a", false, 0);
  a.Authenticated(1);
  a.Admit(2, "tcp:a", false, 0);
  a.Authenticated(2);
  auto d = a.Admit(3, "tcp:b", false, 0);
  EXPECT_THAT(d.refusal, HasSubstr("too many sessions: limits.max_sessions=2"));
  EXPECT_TRUE(a.Admit(4, "uid:0", true, 0).refusal.empty());  // admin_reserve_sessions 1
  EXPECT_THAT(a.Admit(5, "uid:0", true, 0).displaced, ElementsAre(4u));  // table full: oldest
}

TEST(AdmissionTest, PerPeerLimitDisplacesThatPeersOwnHandshakingConnectionFirst) {
  Admission a(Limits(100, 2, 1.0));
  a.Admit(1, "tcp:loopback", false, 0);
  a.Admit(2, "tcp:other", false, 0);
  a.Admit(3, "tcp:loopback", false, 0);
  EXPECT_THAT(a.Admit(4, "tcp:loopback", false, 0).displaced, ElementsAre(1u));
  a.Authenticated(3);
  a.Authenticated(4);
  auto d = a.Admit(5, "tcp:loopback", false, 0);
  EXPECT_THAT(d.refusal,
              HasSubstr("too many sessions from tcp:loopback: limits.max_sessions_per_peer=2"));
  EXPECT_TRUE(d.displaced.empty());
  a.Remove(3);
  EXPECT_TRUE(a.Admit(6, "tcp:loopback", false, 0).refusal.empty());
}

}  // namespace
}  // namespace kvd::daemon
