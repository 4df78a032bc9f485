// Membership in-process against a real etcd-server: nodes see each other, leave, refuse a
// foreign token, and survive etcd going away (skipped when etcd is not installed).
#include "kvd/cluster/membership.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <set>
#include <thread>

#include "etcd_server.h"
#include "kvd/cluster/etcd_client.h"

namespace kvd::cluster {
namespace {

using std::chrono::milliseconds;

template <typename Pred>
bool Within(milliseconds timeout, Pred pred) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    usleep(20000);
  }
  return pred();
}

std::set<std::string> Nodes(const MembershipState& s) {
  std::set<std::string> nodes;
  for (const Member& m : s.members) nodes.insert(m.record.node);
  return nodes;
}

class MembershipTest : public cluster_test::EtcdTest {
 protected:
  MembershipOptions Options(const std::string& node, const std::string& token = "") {
    MembershipOptions o;
    o.etcd = {etcd_->endpoint()};
    o.name = "test";
    o.node = node;
    o.lease_ttl_s = 3;
    o.token = token;
    o.etcd_timeout = milliseconds(500);
    o.retry_interval = milliseconds(100);
    o.refresh_interval = milliseconds(200);
    return o;
  }
  static MemberRecord Record(uint64_t used) {
    MemberRecord r;
    r.control_address = "127.0.0.1:7400";
    r.transport_address = std::string("\x01\x00\xfe", 3);
    r.tiers = {{"host", 1 << 20, used}};
    r.models = {{"m", 0x0123456789abcdefULL}};
    return r;
  }
};

TEST_F(MembershipTest, NodesSeeEachOtherAndOneThatStopsLeavesAtOnce) {
  auto a = Membership::Start(Options("a"), [] { return Record(1); });
  auto b = Membership::Start(Options("b"), [] { return Record(2); });
  ASSERT_TRUE(a.ok() && b.ok());
  const std::set<std::string> both = {"a", "b"};
  ASSERT_TRUE(Within(milliseconds(5000),
                     [&] { return Nodes((*a)->state()) == both && Nodes((*b)->state()) == both; }));
  MembershipState s = (*a)->state();
  EXPECT_TRUE(s.reachable);
  EXPECT_EQ(s.registrations, 1);
  EXPECT_NE(s.lease, 0);
  const Member& mb = s.members[1];
  EXPECT_EQ(mb.record.node, "b");
  EXPECT_EQ(mb.record.transport_address, std::string("\x01\x00\xfe", 3));
  EXPECT_EQ(mb.record.models[0].layout_digest, 0x0123456789abcdefULL);
  EXPECT_EQ(mb.record.tiers[0].used_bytes, 2u);
  EXPECT_GT(mb.record.registered_unix_ms, 0);

  // Stop revokes the lease: a sees b leave well before b's TTL (3 s) would.
  const auto stop = std::chrono::steady_clock::now();
  (*b)->Stop();
  ASSERT_TRUE(Within(milliseconds(5000),
                     [&] { return Nodes((*a)->state()) == std::set<std::string>{"a"}; }));
  EXPECT_LT(std::chrono::steady_clock::now() - stop, std::chrono::seconds(2));
}

TEST_F(MembershipTest, ChangedRecordIsPublishedAgain) {
  std::atomic<uint64_t> used{10};
  auto a = Membership::Start(Options("a"), [&] { return Record(used.load()); });
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(Within(milliseconds(5000), [&] { return (*a)->state().members.size() == 1; }));
  used = 77;
  EXPECT_TRUE(Within(milliseconds(5000), [&] {
    auto s = (*a)->state();
    return s.members.size() == 1 && s.members[0].record.tiers[0].used_bytes == 77;
  }));
}

TEST_F(MembershipTest, ForeignTokenIsRefusedNamingWhy) {
  auto a = Membership::Start(Options("a", "secret-1"), [] { return Record(1); });
  auto b = Membership::Start(Options("b", "secret-2"), [] { return Record(1); });
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(Within(milliseconds(5000), [&] { return (*a)->state().refused.size() == 1; }));
  MembershipState s = (*a)->state();
  EXPECT_EQ(Nodes(s), std::set<std::string>{"a"});
  EXPECT_EQ(s.refused[0], "b: cluster token differs from this node's");
}

TEST_F(MembershipTest, EtcdGoneIsReportedThenRegisteredAgain) {
  auto a = Membership::Start(Options("a"), [] { return Record(1); });
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(Within(milliseconds(5000), [&] { return (*a)->state().reachable; }));
  etcd_->Kill();
  ASSERT_TRUE(Within(milliseconds(5000), [&] { return !(*a)->state().reachable; }));
  MembershipState down = (*a)->state();
  EXPECT_EQ(Nodes(down), std::set<std::string>{"a"});  // the last list seen
  EXPECT_NE(down.last_error.find("UNAVAILABLE"), std::string::npos) << down.last_error;
  // The list ages from etcd's last answer on: past it by the time the outage is seen, and on.
  EXPECT_GT(down.age, milliseconds(0));
  std::this_thread::sleep_for(milliseconds(100));
  EXPECT_GE((*a)->state().age, down.age + milliseconds(100));
  ASSERT_TRUE(etcd_->Restart().ok());
  ASSERT_TRUE(Within(milliseconds(10000), [&] { return (*a)->state().reachable; }));
  MembershipState up = (*a)->state();
  EXPECT_EQ(up.registrations, 2);
  EXPECT_EQ(up.age, milliseconds(0));  // current again
  EXPECT_NE(up.lease, down.lease);
  // The record is in etcd again, on the new lease.
  EtcdClient etcd({.endpoints = {etcd_->endpoint()}});
  auto range = etcd.RangePrefix("/kvd/test/members/");
  ASSERT_TRUE(range.ok()) << range.status();
  ASSERT_EQ(range->kvs.size(), 1u);
  EXPECT_EQ(range->kvs[0].lease, up.lease);
}

TEST_F(MembershipTest, LostLeaseIsReplacedAndTheRecordPutAgain) {
  auto a = Membership::Start(Options("a"), [] { return Record(1); });
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(Within(milliseconds(5000), [&] { return (*a)->state().members.size() == 1; }));
  const int64_t first = (*a)->state().lease;
  EtcdClient etcd({.endpoints = {etcd_->endpoint()}});
  ASSERT_TRUE(etcd.LeaseRevoke(first).ok());  // the record goes with it
  // The next keepalive (every TTL / 3 = 1 s) finds the lease gone: registered again.
  ASSERT_TRUE(Within(milliseconds(5000), [&] { return (*a)->state().registrations == 2; }));
  MembershipState s = (*a)->state();
  EXPECT_NE(s.lease, first);
  ASSERT_TRUE(Within(milliseconds(2000), [&] {
    auto range = etcd.RangePrefix("/kvd/test/members/");
    return range.ok() && range->kvs.size() == 1 && range->kvs[0].lease == s.lease;
  }));
  // The record put again reaches the member list through the watch, a moment after etcd has it.
  EXPECT_TRUE(Within(milliseconds(2000),
                     [&] { return Nodes((*a)->state()) == std::set<std::string>{"a"}; }))
      << "members: " << (*a)->state().members.size();
}

TEST_F(MembershipTest, StartsWithoutEtcdAndRegistersOnceItAnswers) {
  MembershipOptions o = Options("late");
  etcd_->Kill();
  auto a = Membership::Start(o, [] { return Record(1); });
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(Within(milliseconds(3000), [&] { return !(*a)->state().last_error.empty(); }));
  EXPECT_FALSE((*a)->state().reachable);
  EXPECT_EQ((*a)->state().registrations, 0);
  ASSERT_TRUE(etcd_->Restart().ok());
  EXPECT_TRUE(Within(milliseconds(10000), [&] { return (*a)->state().registrations == 1; }));
}

TEST(MembershipOptions, ValidateNamesTheKey) {
  MembershipOptions o;
  EXPECT_NE(o.Validate().message().find("cluster.etcd"), std::string::npos);
  o.etcd = {"127.0.0.1:2379"};
  EXPECT_NE(o.Validate().message().find("cluster.name"), std::string::npos);
  o.name = "bad/name";
  EXPECT_NE(o.Validate().message().find("cluster.name"), std::string::npos);
  o.name = "prod";
  o.lease_ttl_s = 1;
  EXPECT_NE(o.Validate().message().find("cluster.lease_ttl_s"), std::string::npos);
  o.lease_ttl_s = 10;
  EXPECT_TRUE(o.Validate().ok());
  EXPECT_EQ(Membership::Start(o, nullptr).status().code(), StatusCode::kInvalidArgument);  // node
}

TEST(MemberRecord, JsonRoundTripAndRejections) {
  MemberRecord r;
  r.node = "n1";
  r.control_address = "127.0.0.2:7400";
  r.transport_address = std::string("\0\x01\x02\xff", 4);
  r.tiers = {{"host", 1ull << 40, 5}, {"disk", 2ull << 40, 0}};
  r.models = {{"llama", 0xffffffffffffffffULL}};
  r.version = "0.1.0";
  r.token_digest = TokenDigest("t");
  r.registered_unix_ms = 1765000000000;
  auto back = MemberRecord::FromJson(r.ToJson());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, r);
  EXPECT_EQ(MemberRecord::FromJson("[]").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(MemberRecord::FromJson("{}").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(TokenDigest(""), 0u);
  EXPECT_NE(TokenDigest("a"), TokenDigest("b"));
}

}  // namespace
}  // namespace kvd::cluster
