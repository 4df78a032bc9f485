// The fault-injection decorator over the loopback backend: the seam daemon and client failure
// tests use.
#include "kvd/transport/fault_injection.h"

#include <gtest/gtest.h>

#include <vector>

#include "test_util.h"

namespace kvd::transport {
namespace {

using std::chrono::milliseconds;

class FaultInjectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TransportOptions o;
    o.backend = "loopback";
    MutableBackendOptions<LoopbackOptions>(&o).loopback_domain =
        std::string("fault-") + ::testing::UnitTest::GetInstance()->current_test_info()->name();
    auto a = CreateTransport(o);
    auto b = CreateTransport(o);
    ASSERT_TRUE(a.ok() && b.ok());
    faulty_ = new FaultInjectingTransport(std::move(a).value(), FaultPlan{});
    a_.reset(faulty_);
    b_ = std::move(b).value();
    a_to_b_ = a_->Connect(*b_->LocalAddress()).value();
    b_to_a_ = b_->Connect(*a_->LocalAddress()).value();
  }

  std::unique_ptr<Transport> a_, b_;
  FaultInjectingTransport* faulty_ = nullptr;
  PeerHandle a_to_b_, b_to_a_;
};

TEST_F(FaultInjectionTest, PassesThroughWithoutFaults) {
  std::vector<uint8_t> src(1000), dst(1000);
  testing::FillPattern(1, src.data(), src.size());
  auto recv = b_->PostRecv(b_to_a_, 1, dst.data(), dst.size());
  ASSERT_TRUE(a_->SendBlocking(a_to_b_, 1, src.data(), src.size(), milliseconds(1000)).ok());
  ASSERT_TRUE(b_->Wait(*recv, milliseconds(1000)).ok());
  EXPECT_EQ(testing::FirstMismatch(1, dst.data(), dst.size()), dst.size());
  EXPECT_EQ(faulty_->post_count(), 1);
  EXPECT_EQ(a_->capabilities().backend, "loopback");
}

TEST_F(FaultInjectionTest, TheNthPostFails) {
  FaultPlan plan;
  plan.fail_post_number = 2;
  plan.post_failure = Status::ResourceExhausted("injected: no send slot");
  faulty_->SetPlan(plan);
  uint8_t byte = 7;
  std::vector<TransferHandle> ok;
  auto first = a_->PostSend(a_to_b_, 1, &byte, 1);
  ASSERT_TRUE(first.ok());
  auto second = a_->PostSend(a_to_b_, 2, &byte, 1);
  EXPECT_EQ(second.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(second.status().message().find("no send slot"), std::string::npos);
  auto third = a_->PostSend(a_to_b_, 3, &byte, 1);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(faulty_->post_count(), 3);
  for (auto h : {*first, *third}) {
    ASSERT_TRUE(a_->Cancel(h).ok());
    EXPECT_TRUE(a_->Release(h).ok());
  }
}

TEST_F(FaultInjectionTest, TheNthReceiveArrivesDamaged) {
  FaultPlan plan;
  plan.corrupt_recv_number = 2;
  faulty_->SetPlan(plan);
  std::vector<uint8_t> src(1000);
  testing::FillPattern(1, src.data(), src.size());
  for (uint64_t tag = 1; tag <= 3; ++tag) {
    std::vector<uint8_t> dst(src.size());
    auto recv = a_->PostRecv(a_to_b_, tag, dst.data(), dst.size());
    ASSERT_TRUE(recv.ok()) << recv.status();
    ASSERT_TRUE(b_->SendBlocking(b_to_a_, tag, src.data(), src.size(), milliseconds(1000)).ok());
    ASSERT_TRUE(a_->Wait(*recv, milliseconds(1000)).ok());
    const TransferStatus done = a_->Check(*recv);
    EXPECT_EQ(done.state, TransferState::kDone);
    EXPECT_EQ(done.bytes, src.size());
    // Only the second receive is damaged, in one byte, and only once however often it is checked.
    size_t differing = 0;
    for (size_t i = 0; i < src.size(); ++i) differing += dst[i] != src[i];
    EXPECT_EQ(differing, tag == 2 ? 1u : 0u) << "receive " << tag;
    if (tag == 2) EXPECT_FALSE(done.checksum_valid);
    EXPECT_TRUE(a_->Release(*recv).ok());
  }
}

TEST_F(FaultInjectionTest, PeerVanishesAfterKBytes) {
  FaultPlan plan;
  plan.vanish_after_bytes = 1500;
  faulty_->SetPlan(plan);
  std::vector<uint8_t> src(1000), dst(1000);
  // A receive on the faulty side, in flight when the peer vanishes.
  auto pending = a_->PostRecv(a_to_b_, 99, dst.data(), 100);
  ASSERT_TRUE(pending.ok());
  // 100 + 1000 bytes fit under the limit.
  auto recv = b_->PostRecv(b_to_a_, 1, dst.data(), dst.size());
  ASSERT_TRUE(a_->SendBlocking(a_to_b_, 1, src.data(), src.size(), milliseconds(1000)).ok());
  ASSERT_TRUE(b_->Wait(*recv, milliseconds(1000)).ok());
  ASSERT_TRUE(b_->Release(*recv).ok());
  // The next 1000 would cross 1500: the peer vanishes.
  auto crossing = a_->PostSend(a_to_b_, 2, src.data(), src.size());
  ASSERT_TRUE(crossing.ok());
  EXPECT_EQ(a_->Check(*crossing).state, TransferState::kError);
  EXPECT_EQ(a_->Wait(*crossing, milliseconds(10)).code(), StatusCode::kUnavailable);
  Status p = a_->Wait(*pending, milliseconds(1000));
  EXPECT_EQ(p.code(), StatusCode::kUnavailable) << p;
  EXPECT_NE(p.message().find("vanished"), std::string::npos) << p;
  EXPECT_EQ(a_->PeerStatus(a_to_b_).code(), StatusCode::kUnavailable);
  EXPECT_EQ(a_->PostSend(a_to_b_, 3, src.data(), 1).status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(a_->Release(*crossing).ok());
  EXPECT_TRUE(a_->Release(*pending).ok());
  EXPECT_EQ(a_->Release(*pending).code(), StatusCode::kNotFound);
}

TEST_F(FaultInjectionTest, VanishPeerNowAndConnectFailure) {
  EXPECT_EQ(faulty_->VanishPeer(PeerHandle{12345}).code(), StatusCode::kNotFound);
  std::vector<uint8_t> dst(10);
  auto pending = a_->PostRecv(a_to_b_, 5, dst.data(), dst.size());
  ASSERT_TRUE(faulty_->VanishPeer(a_to_b_).ok());
  EXPECT_EQ(a_->Wait(*pending, milliseconds(100)).code(), StatusCode::kUnavailable);
  EXPECT_TRUE(a_->Release(*pending).ok());

  FaultPlan plan;
  plan.connect_failure = Status::Unavailable("injected: unreachable");
  faulty_->SetPlan(plan);
  auto c = a_->Connect(*b_->LocalAddress());
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(c.status().message().find("injected"), std::string::npos);
}

}  // namespace
}  // namespace kvd::transport
