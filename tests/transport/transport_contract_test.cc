// The Transport contract, run in one process over every backend configuration: loopback, UCX over
// tcp and UCX over shared memory (two UCX contexts/workers talking to each other), and "relay",
// a backend registered by the test itself (relay_backend.h).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "kvd/common/hash.h"
#include "kvd/transport/loopback_options.h"
#include "kvd/transport/nccl_options.h"
#include "kvd/transport/registry.h"
#include "kvd/transport/transport.h"
#include "kvd/transport/ucx_options.h"
#include "test_util.h"

namespace kvd::transport {
namespace {

using std::chrono::milliseconds;
using testing::FillPattern;
using testing::FirstMismatch;

// How TransportContractTest::RoundTrip posts its receive.
struct RecvShape {
  bool want_checksum = false;  // TransferRequest::want_checksum
  size_t spare = 0;            // posted length = n + spare (the message is n bytes)
};

class TransportContractTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    TransportOptions o = testing::OptionsFor(GetParam());
    MutableBackendOptions<LoopbackOptions>(&o).loopback_domain =
        ::testing::UnitTest::GetInstance()->current_test_info()->name();
    // The whole contract, RMA included (off by default: see ucx_options.h).
    MutableBackendOptions<UcxOptions>(&o).enable_rma = true;
    auto a = CreateTransport(o);
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = CreateTransport(o);
    ASSERT_TRUE(b.ok()) << b.status();
    a_ = std::move(a).value();
    b_ = std::move(b).value();
    auto a_addr = a_->LocalAddress();
    auto b_addr = b_->LocalAddress();
    ASSERT_TRUE(a_addr.ok() && b_addr.ok());
    auto ab = a_->Connect(*b_addr);
    ASSERT_TRUE(ab.ok()) << ab.status();
    auto ba = b_->Connect(*a_addr);
    ASSERT_TRUE(ba.ok()) << ba.status();
    a_to_b_ = *ab;
    b_to_a_ = *ba;
  }

  // Sends `n` pattern bytes a -> b with `tag` and checks them byte for byte; the receive's final
  // status goes to *received when given.
  void RoundTrip(size_t n, uint64_t tag, RecvShape shape = {}, TransferStatus* received = nullptr) {
    std::vector<uint8_t> src(n), dst(n + 16, 0xEE);
    FillPattern(tag, src.data(), n);
    auto recv = b_->PostRecv(b_to_a_, tag, dst.data(), n + shape.spare,
                             {.want_checksum = shape.want_checksum});
    ASSERT_TRUE(recv.ok()) << recv.status();
    auto send = a_->PostSend(a_to_b_, tag, src.data(), n);
    ASSERT_TRUE(send.ok()) << send.status();
    ASSERT_NO_FATAL_FAILURE(ProgressBoth(*recv, *send, n));
    TransferStatus rs = b_->Check(*recv);
    ASSERT_EQ(rs.state, TransferState::kDone) << rs.status;
    EXPECT_EQ(rs.bytes, n);
    EXPECT_EQ(a_->Check(*send).state, TransferState::kDone) << a_->Check(*send).status;
    EXPECT_EQ(FirstMismatch(tag, dst.data(), n), n);
    for (size_t i = n; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0xEE) << "wrote past the buffer";
    EXPECT_TRUE(b_->Release(*recv).ok());
    EXPECT_TRUE(a_->Release(*send).ok());
    if (received != nullptr) *received = rs;
  }

  // Progresses both sides from this thread (UCX needs both workers progressed) until the
  // receive on b and the send on a of `n` bytes are over.
  void ProgressBoth(TransferHandle recv, TransferHandle send, size_t n) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (b_->Check(recv).state == TransferState::kInProgress ||
           a_->Check(send).state == TransferState::kInProgress) {
      a_->Progress();
      b_->Progress();
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "transfer of " << n << " bytes hung";
    }
  }

  std::unique_ptr<Transport> a_, b_;
  PeerHandle a_to_b_, b_to_a_;
};

TEST_P(TransportContractTest, CapabilitiesNameTheBackend) {
  const Capabilities& c = a_->capabilities();
  EXPECT_EQ(c.backend, GetParam().rfind("ucx", 0) == 0 ? "ucx" : GetParam());
  EXPECT_TRUE(c.host_memory);
  EXPECT_TRUE(c.tag_messages);
  EXPECT_EQ(c.peer_failure_detection, GetParam() != "ucx-shm-trusted");
  EXPECT_GE(c.max_message_bytes, uint64_t{1} << 32);
}

TEST_P(TransportContractTest, TagSendRecvIsByteExact) {
  RoundTrip(1, 1);
  RoundTrip(64 << 10, 2);
  RoundTrip(8 << 20, 3);
}

TEST_P(TransportContractTest, ZeroLengthMessageIsAllowed) { RoundTrip(0, 4); }

// A receive posted with want_checksum: where the backend reports a checksum, it is Checksum64 of
// exactly the bytes that landed. UCX's same-host path (ucx-sm, from 64 KiB) must report it; a
// size that is not a multiple of the backend's hashing block checks the block seams.
TEST_P(TransportContractTest, ReceiveChecksumIsThatOfTheBytesReceived) {
  const bool same_host_path = GetParam() == "ucx-sm";
  uint64_t tag = 40;
  for (size_t n : {size_t{100}, size_t{64} << 10, (size_t{1} << 20) + 3, size_t{8} << 20}) {
    std::vector<uint8_t> src(n);
    for (bool want : {true, false}) {
      ++tag;
      TransferStatus rs;
      // Room to spare in the posted buffer: the checksum covers the received bytes only.
      ASSERT_NO_FATAL_FAILURE(RoundTrip(n, tag, {.want_checksum = want, .spare = 8}, &rs));
      if (!want) {
        EXPECT_FALSE(rs.checksum_valid) << n << " bytes: a checksum nobody asked for";
      } else if (same_host_path && n >= (size_t{64} << 10)) {
        EXPECT_TRUE(rs.checksum_valid) << n << " bytes over the same-host path";
      }
      if (rs.checksum_valid) {
        FillPattern(tag, src.data(), n);  // what RoundTrip sent
        EXPECT_EQ(rs.checksum, Checksum64(src.data(), n)) << n << " bytes";
      }
    }
  }
}

TEST_P(TransportContractTest, SendBeforeRecvIsMatchedLater) {
  const size_t n = 100000;
  std::vector<uint8_t> src(n), dst(n);
  FillPattern(9, src.data(), n);
  auto send = a_->PostSend(a_to_b_, 9, src.data(), n);
  ASSERT_TRUE(send.ok()) << send.status();
  for (int i = 0; i < 100; ++i) a_->Progress(), b_->Progress();
  size_t got = 0;
  std::thread sender([&] { (void)a_->Wait(*send, milliseconds(10000)); });
  Status s = b_->RecvBlocking(b_to_a_, 9, dst.data(), n, milliseconds(10000), &got);
  sender.join();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(got, n);
  EXPECT_EQ(FirstMismatch(9, dst.data(), n), n);
  EXPECT_EQ(a_->Check(*send).state, TransferState::kDone);
  EXPECT_TRUE(a_->Release(*send).ok());
}

TEST_P(TransportContractTest, BothDirectionsWork) {
  std::vector<uint8_t> x(4096), y(4096);
  FillPattern(11, x.data(), x.size());
  std::thread t([&] {
    EXPECT_TRUE(a_->SendBlocking(a_to_b_, 11, x.data(), x.size(), milliseconds(10000)).ok());
  });
  ASSERT_TRUE(b_->RecvBlocking(b_to_a_, 11, y.data(), y.size(), milliseconds(10000)).ok());
  t.join();
  FillPattern(12, y.data(), y.size());
  std::thread t2([&] {
    EXPECT_TRUE(b_->SendBlocking(b_to_a_, 12, y.data(), y.size(), milliseconds(10000)).ok());
  });
  ASSERT_TRUE(a_->RecvBlocking(a_to_b_, 12, x.data(), x.size(), milliseconds(10000)).ok());
  t2.join();
  EXPECT_EQ(FirstMismatch(12, x.data(), x.size()), x.size());
}

TEST_P(TransportContractTest, RecvWithoutDataTimesOutThenCancels) {
  std::vector<uint8_t> buf(1024);
  auto recv = b_->PostRecv(b_to_a_, 77, buf.data(), buf.size());
  ASSERT_TRUE(recv.ok());
  auto start = std::chrono::steady_clock::now();
  Status s = b_->Wait(*recv, milliseconds(100));
  auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("did not finish within 100 ms"), std::string::npos) << s;
  EXPECT_LT(took, std::chrono::seconds(2));
  EXPECT_EQ(b_->Check(*recv).state, TransferState::kInProgress);
  Status early = b_->Release(*recv);
  EXPECT_EQ(early.code(), StatusCode::kFailedPrecondition) << early;
  ASSERT_TRUE(b_->Cancel(*recv).ok());
  Status after = b_->Wait(*recv, milliseconds(1000));
  EXPECT_EQ(after.code(), StatusCode::kCancelled) << after;
  EXPECT_TRUE(b_->Release(*recv).ok());
}

TEST_P(TransportContractTest, LongerMessageThanBufferIsOutOfRange) {
  std::vector<uint8_t> src(1000), dst(100);
  auto recv = b_->PostRecv(b_to_a_, 5, dst.data(), dst.size());
  ASSERT_TRUE(recv.ok());
  std::thread t(
      [&] { (void)a_->SendBlocking(a_to_b_, 5, src.data(), src.size(), milliseconds(5000)); });
  Status s = b_->Wait(*recv, milliseconds(5000));
  t.join();
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange) << s;
  EXPECT_TRUE(b_->Release(*recv).ok());
}

TEST_P(TransportContractTest, LargeMessageIntoSmallerBufferIsOutOfRange) {
  // Above the cma threshold: on ucx-sm this takes the descriptor path.
  std::vector<uint8_t> src(256 << 10), dst(100 << 10);
  auto recv = b_->PostRecv(b_to_a_, 6, dst.data(), dst.size());
  ASSERT_TRUE(recv.ok());
  auto send = a_->PostSend(a_to_b_, 6, src.data(), src.size());
  ASSERT_TRUE(send.ok());
  std::thread t([&] { (void)a_->Wait(*send, milliseconds(5000)); });
  Status s = b_->Wait(*recv, milliseconds(5000));
  t.join();
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange) << s;
  EXPECT_NE(a_->Check(*send).state, TransferState::kInProgress);
  EXPECT_TRUE(b_->Release(*recv).ok());
  EXPECT_TRUE(a_->Release(*send).ok());
}

TEST_P(TransportContractTest, TinyReceiveBuffers) {
  // Receives shorter than a cma descriptor go through a bounce buffer in the UCX backend.
  std::vector<uint8_t> src(30), dst(20, 0xEE);
  testing::FillPattern(7, src.data(), src.size());
  std::thread t([&] { (void)a_->SendBlocking(a_to_b_, 7, src.data(), 10, milliseconds(5000)); });
  size_t got = 0;
  ASSERT_TRUE(b_->RecvBlocking(b_to_a_, 7, dst.data(), dst.size(), milliseconds(5000), &got).ok());
  t.join();
  EXPECT_EQ(got, 10u);
  EXPECT_EQ(testing::FirstMismatch(7, dst.data(), 10), 10u);
  EXPECT_EQ(dst[10], 0xEE);
  std::thread t2([&] { (void)a_->SendBlocking(a_to_b_, 8, src.data(), 30, milliseconds(5000)); });
  Status s = b_->RecvBlocking(b_to_a_, 8, dst.data(), dst.size(), milliseconds(5000));
  t2.join();
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange) << s;
}

TEST_P(TransportContractTest, InvalidArgumentsGiveSpecificErrors) {
  TransferRequest r;
  r.op = TransferOp::kSend;
  r.peer = a_to_b_;
  r.buffer = nullptr;
  r.length = 10;
  auto s = a_->Post(r);
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("buffer is null"), std::string::npos) << s.status();

  uint8_t byte = 0;
  auto big_tag = a_->PostSend(a_to_b_, kMaxTag + 1, &byte, 1);
  EXPECT_EQ(big_tag.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(big_tag.status().message().find("kMaxTag"), std::string::npos) << big_tag.status();
  auto no_peer = a_->PostSend(PeerHandle{}, 1, &byte, 1);
  EXPECT_EQ(no_peer.status().code(), StatusCode::kInvalidArgument) << no_peer.status();
  auto unknown_peer = a_->PostSend(PeerHandle{999999}, 1, &byte, 1);
  EXPECT_EQ(unknown_peer.status().code(), StatusCode::kNotFound) << unknown_peer.status();

  TransferHandle bogus{123456789};
  EXPECT_EQ(a_->Check(bogus).status.code(), StatusCode::kNotFound);
  EXPECT_EQ(a_->Wait(bogus, milliseconds(1)).code(), StatusCode::kNotFound);
  EXPECT_EQ(a_->Cancel(bogus).code(), StatusCode::kNotFound);
  EXPECT_EQ(a_->Release(bogus).code(), StatusCode::kNotFound);
  EXPECT_EQ(a_->Disconnect(PeerHandle{424242}).code(), StatusCode::kNotFound);
  EXPECT_EQ(a_->PeerStatus(PeerHandle{424242}).code(), StatusCode::kNotFound);
  EXPECT_EQ(a_->DeregisterMemory(RegionHandle{424242}).code(), StatusCode::kNotFound);

  EXPECT_EQ(a_->Connect("").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a_->Connect("garbage-address").status().code(), StatusCode::kInvalidArgument);

  EXPECT_EQ(a_->AllocateRegistered(0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a_->RegisterMemory(nullptr, 10).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a_->RegisterMemory(&byte, 0).status().code(), StatusCode::kInvalidArgument);
  if (!a_->capabilities().cuda_memory) {  // else ucx_cuda_memory_test covers CUDA memory
    EXPECT_EQ(a_->AllocateRegistered(10, MemoryType::kCuda).status().code(),
              StatusCode::kUnimplemented);
  }
}

TEST_P(TransportContractTest, AllocatedRegionsAreCacheLineAligned) {
  // Odd sizes too: the daemon carves 64-byte aligned chunks from the start of its arena.
  for (size_t bytes : {size_t{1}, size_t{100}, size_t{4097}, size_t{1} << 20}) {
    auto region = b_->AllocateRegistered(bytes);
    ASSERT_TRUE(region.ok()) << region.status();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(region->data) % kRegisteredAlignment, 0u)
        << "region of " << bytes << " bytes at " << region->data;
    EXPECT_EQ(region->size, bytes);
    std::memset(region->data, 0xab, bytes);  // every byte is writable
    EXPECT_TRUE(b_->DeregisterMemory(region->handle).ok());
  }
}

TEST_P(TransportContractTest, AllocatedRegionIsUsableAndReleasable) {
  auto region = b_->AllocateRegistered(1 << 20);
  ASSERT_TRUE(region.ok()) << region.status();
  ASSERT_NE(region->data, nullptr);
  EXPECT_EQ(region->size, size_t{1} << 20);
  std::memset(region->data, 0, region->size);
  // Receive into a slice of the arena, as the daemon does for a put.
  std::vector<uint8_t> src(300000);
  FillPattern(21, src.data(), src.size());
  uint8_t* slice = static_cast<uint8_t*>(region->data) + 4096;
  std::thread t([&] {
    EXPECT_TRUE(a_->SendBlocking(a_to_b_, 21, src.data(), src.size(), milliseconds(10000)).ok());
  });
  ASSERT_TRUE(b_->RecvBlocking(b_to_a_, 21, slice, src.size(), milliseconds(10000)).ok());
  t.join();
  EXPECT_EQ(FirstMismatch(21, slice, src.size()), src.size());
  EXPECT_EQ(static_cast<uint8_t*>(region->data)[4095], 0);

  std::vector<uint8_t> own(8192);
  auto reg = a_->RegisterMemory(own.data(), own.size());
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_EQ(reg->data, own.data());
  EXPECT_TRUE(a_->DeregisterMemory(reg->handle).ok());
  EXPECT_EQ(a_->DeregisterMemory(reg->handle).code(), StatusCode::kNotFound);
  EXPECT_TRUE(b_->DeregisterMemory(region->handle).ok());
}

TEST_P(TransportContractTest, RmaReadAndWriteOfAnExportedRegion) {
  if (!a_->capabilities().rma) GTEST_SKIP() << "no RMA";
  auto region = b_->AllocateRegistered(1 << 20);
  ASSERT_TRUE(region.ok()) << region.status();
  FillPattern(31, static_cast<uint8_t*>(region->data), region->size);
  auto exported = b_->ExportRegion(region->handle);
  ASSERT_TRUE(exported.ok()) << exported.status();
  auto remote = a_->ImportRegion(a_to_b_, *exported);
  ASSERT_TRUE(remote.ok()) << remote.status();

  std::vector<uint8_t> local(65536);
  TransferRequest read;
  read.op = TransferOp::kRead;
  read.peer = a_to_b_;
  read.buffer = local.data();
  read.length = local.size();
  read.remote = *remote;
  read.remote_offset = 0;
  auto h = a_->Post(read);
  ASSERT_TRUE(h.ok()) << h.status();
  // Over tcp (and sm with peer failure detection) UCX emulates RMA with messages: the target
  // must progress.
  std::atomic<bool> stop{false};
  std::thread progress_b([&] {
    while (!stop) b_->Progress();
  });
  Status s = a_->Wait(*h, milliseconds(10000));
  stop = true;
  progress_b.join();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(FirstMismatch(31, local.data(), local.size()), local.size());
  EXPECT_TRUE(a_->Release(*h).ok());

  FillPattern(32, local.data(), local.size());
  TransferRequest write = read;
  write.op = TransferOp::kWrite;
  write.remote_offset = 1000;
  h = a_->Post(write);
  ASSERT_TRUE(h.ok()) << h.status();
  stop = false;
  std::thread progress_b2([&] {
    while (!stop) b_->Progress();
  });
  s = a_->Wait(*h, milliseconds(10000));
  stop = true;
  progress_b2.join();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(FirstMismatch(32, static_cast<uint8_t*>(region->data) + 1000, local.size()),
            local.size());
  EXPECT_TRUE(a_->Release(*h).ok());

  TransferRequest beyond = read;
  beyond.remote_offset = (1 << 20) - 10;
  EXPECT_EQ(a_->Post(beyond).status().code(), StatusCode::kOutOfRange);
  TransferRequest empty = read;
  empty.length = 0;
  EXPECT_EQ(a_->Post(empty).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a_->ImportRegion(a_to_b_, "nonsense").status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(a_->ReleaseRemoteRegion(*remote).ok());
  EXPECT_EQ(a_->ReleaseRemoteRegion(*remote).code(), StatusCode::kNotFound);
}

TEST_P(TransportContractTest, DisconnectCancelsThePeersTransfers) {
  std::vector<uint8_t> buf(1024);
  auto recv = b_->PostRecv(b_to_a_, 55, buf.data(), buf.size());
  auto any = b_->PostRecv(kAnyPeer, 56, buf.data(), buf.size());
  ASSERT_TRUE(recv.ok() && any.ok());
  Status d = b_->Disconnect(b_to_a_);
  ASSERT_TRUE(d.ok()) << d;
  EXPECT_EQ(b_->Wait(*recv, milliseconds(1000)).code(), StatusCode::kCancelled);
  EXPECT_EQ(b_->Check(*any).state, TransferState::kInProgress);  // kAnyPeer is not touched
  EXPECT_EQ(b_->PeerStatus(b_to_a_).code(), StatusCode::kNotFound);
  uint8_t byte = 0;
  EXPECT_EQ(b_->PostSend(b_to_a_, 1, &byte, 1).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(b_->Cancel(*any).ok());
  EXPECT_EQ(b_->Wait(*any, milliseconds(1000)).code(), StatusCode::kCancelled);
  EXPECT_TRUE(b_->Release(*recv).ok());
  EXPECT_TRUE(b_->Release(*any).ok());
}

TEST_P(TransportContractTest, PeerCountsFollowConnectAndDisconnect) {
  PeerCounts c = b_->peer_counts();
  EXPECT_EQ(c.open, 1u);
  EXPECT_EQ(c.connects, 1u);
  EXPECT_EQ(c.disconnects, 0u);
  EXPECT_EQ(c.vanished, 0u);
  // Connecting twice to one address gives a second peer; each Disconnect closes one for good.
  auto a_addr = a_->LocalAddress();
  ASSERT_TRUE(a_addr.ok());
  auto again = b_->Connect(*a_addr);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(b_->peer_counts().open, 2u);
  ASSERT_TRUE(b_->Disconnect(b_to_a_).ok());
  ASSERT_TRUE(b_->Disconnect(*again).ok());
  c = b_->peer_counts();
  EXPECT_EQ(c.open, 0u);
  EXPECT_EQ(c.connects, 2u);
  EXPECT_EQ(c.disconnects, 2u);
  EXPECT_EQ(c.vanished, 0u) << "a Disconnect is not a vanished peer";
  EXPECT_EQ(b_->Disconnect(b_to_a_).code(), StatusCode::kNotFound);
  EXPECT_EQ(b_->peer_counts().disconnects, 2u);
  // The other side still holds its peer, and still works towards a new one.
  EXPECT_EQ(a_->peer_counts().open, 1u);
}

TEST_P(TransportContractTest, DestroyedPeerFailsItsReceivesWithUnavailable) {
  if (!a_->capabilities().peer_failure_detection) GTEST_SKIP() << "no peer failure detection";
  std::vector<uint8_t> buf(1024);
  // Make sure the endpoints are wired up before the peer goes.
  std::vector<uint8_t> x(16);
  std::thread t([&] {
    EXPECT_TRUE(a_->SendBlocking(a_to_b_, 60, x.data(), x.size(), milliseconds(10000)).ok());
  });
  ASSERT_TRUE(b_->RecvBlocking(b_to_a_, 60, buf.data(), buf.size(), milliseconds(10000)).ok());
  t.join();
  auto recv = b_->PostRecv(b_to_a_, 61, buf.data(), buf.size());
  ASSERT_TRUE(recv.ok());
  a_.reset();
  Status s = b_->Wait(*recv, milliseconds(10000));
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_EQ(b_->PeerStatus(b_to_a_).code(), StatusCode::kUnavailable);
  uint8_t byte = 0;
  EXPECT_EQ(b_->PostSend(b_to_a_, 1, &byte, 1).status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(b_->Release(*recv).ok());
  // A vanished peer stays open (its handle is valid) until the owner Disconnects it.
  EXPECT_EQ(b_->peer_counts().vanished, 1u);
  EXPECT_EQ(b_->peer_counts().open, 1u);
  ASSERT_TRUE(b_->Disconnect(b_to_a_).ok());
  EXPECT_EQ(b_->peer_counts().open, 0u);
}

TEST_P(TransportContractTest, ProgressThreadAndPostingThreadCoexist) {
  // The daemon's shape: one thread progresses and sleeps on events, another posts and waits.
  std::atomic<bool> stop{false};
  std::thread progress([&] {
    while (!stop.load()) {
      if (b_->Progress() == 0) (void)b_->WaitForEvents(milliseconds(5));
    }
  });
  std::vector<uint8_t> src(2 << 20), dst(2 << 20);
  for (uint64_t tag = 100; tag < 110; ++tag) {
    FillPattern(tag, src.data(), src.size());
    auto recv = b_->PostRecv(b_to_a_, tag, dst.data(), dst.size());
    ASSERT_TRUE(recv.ok());
    ASSERT_TRUE(a_->SendBlocking(a_to_b_, tag, src.data(), src.size(), milliseconds(10000)).ok());
    ASSERT_TRUE(b_->Wait(*recv, milliseconds(10000)).ok());
    EXPECT_EQ(FirstMismatch(tag, dst.data(), dst.size()), dst.size());
    EXPECT_TRUE(b_->Release(*recv).ok());
  }
  stop = true;
  progress.join();
}

TEST_P(TransportContractTest, WakeupEndsALongWaitForEvents) {
  // An idle progress thread sleeps in WaitForEvents with a long timeout; Wakeup (new work that is
  // not a Post) must end that sleep, whether it comes before the sleep or during it. Without it
  // each wait below would last its whole 60 s timeout.
  while (b_->Progress() > 0) {
  }
  const auto limit = std::chrono::seconds(30);
  b_->Wakeup();  // before: the next wait returns at once
  auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(b_->WaitForEvents(milliseconds(60000)).ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, limit);
  std::atomic<bool> woke{false};
  t0 = std::chrono::steady_clock::now();
  std::thread sleeper([&] {
    while (b_->Progress() > 0) {
    }
    (void)b_->WaitForEvents(milliseconds(60000));
    woke = true;
  });
  while (!woke.load() && std::chrono::steady_clock::now() - t0 < limit) {
    b_->Wakeup();  // during: repeated, since the sleeper may not be asleep yet
    std::this_thread::sleep_for(milliseconds(20));
  }
  sleeper.join();
  EXPECT_TRUE(woke.load());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, limit);
}

TEST_P(TransportContractTest, ManyThreadsPostWhileProgressThreadsRun) {
  // The thread-safety contract: 4 threads each send 12 messages a -> b (sizes across the cma
  // threshold) while 4 others receive them, with a progress thread on each side.
  constexpr int kThreads = 4, kMessages = 12;
  std::atomic<bool> stop{false};
  auto progress = [&](Transport* t) {
    while (!stop.load()) {
      if (t->Progress() == 0) (void)t->WaitForEvents(milliseconds(2));
    }
  };
  std::thread pa(progress, a_.get()), pb(progress, b_.get());
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int k = 0; k < kThreads; ++k) {
    threads.emplace_back([&, k] {
      std::vector<uint8_t> buf(300 << 10);
      for (int m = 0; m < kMessages; ++m) {
        const uint64_t tag = 1000 + k * 100 + m;
        const size_t n = (m % 3 == 0) ? 100 : (m % 3 == 1) ? (70 << 10) : (300 << 10);
        size_t got = 0;
        Status s =
            b_->RecvBlocking(b_to_a_, tag, buf.data(), buf.size(), milliseconds(20000), &got);
        if (!s.ok() || got != n || FirstMismatch(tag, buf.data(), n) != n) {
          ADD_FAILURE() << "message " << tag << ": " << s << " got " << got;
          ++bad;
        }
      }
    });
    threads.emplace_back([&, k] {
      std::vector<uint8_t> buf(300 << 10);
      for (int m = 0; m < kMessages; ++m) {
        const uint64_t tag = 1000 + k * 100 + m;
        const size_t n = (m % 3 == 0) ? 100 : (m % 3 == 1) ? (70 << 10) : (300 << 10);
        FillPattern(tag, buf.data(), n);
        Status s = a_->SendBlocking(a_to_b_, tag, buf.data(), n, milliseconds(20000));
        if (!s.ok()) {
          ADD_FAILURE() << "send " << tag << ": " << s;
          ++bad;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  stop = true;
  pa.join();
  pb.join();
  EXPECT_EQ(bad.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, TransportContractTest,
                         ::testing::Values("loopback", "ucx-tcp", "ucx-sm", "ucx-shm-trusted",
                                           "relay"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n) c = c == '-' ? '_' : c;
                           return n;
                         });

TEST(TransportRegistryTest, UnknownBackendListsTheRegisteredOnes) {
  TransportOptions o;
  o.backend = "no-such-backend";
  auto t = CreateTransport(o);
  EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
  EXPECT_NE(t.status().message().find("loopback"), std::string::npos) << t.status();
  EXPECT_NE(t.status().message().find("nccl"), std::string::npos) << t.status();
}

TEST(TransportRegistryTest, NewBackendRegistersWithoutEditingTheBase) {
  ASSERT_TRUE(RegisterTransportBackend("test-wrapper", [](const TransportOptions& o) {
                TransportOptions inner = o;
                inner.backend = "loopback";
                return CreateTransport(inner);
              }).ok());
  EXPECT_EQ(
      RegisterTransportBackend("loopback",
                               [](const TransportOptions&) {
                                 return StatusOr<std::unique_ptr<Transport>>(Status::Internal("x"));
                               })
          .code(),
      StatusCode::kAlreadyExists);
  TransportOptions o;
  o.backend = "test-wrapper";
  auto t = CreateTransport(o);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->capabilities().backend, "loopback");
  auto names = RegisteredTransportBackends();
  EXPECT_NE(std::find(names.begin(), names.end(), "test-wrapper"), names.end());
}

// A backend registered outside transport/ binds its own topology keys into its own options.
TEST(TransportRegistryTest, RegisteredBackendBindsItsOwnKeys) {
  TransportOptions o = testing::OptionsFor("relay");
  EXPECT_EQ(o.backend, "relay");
  testing::RelayOptions relay = BackendOptionsOf<testing::RelayOptions>(o);
  EXPECT_EQ(relay.channel, "contract");
  EXPECT_EQ(relay.progress_passes, 2);
  EXPECT_EQ(testing::RelayOptions{}.channel, "default");  // documented defaults
  EXPECT_EQ(testing::RelayOptions{}.progress_passes, 1);
  EXPECT_EQ(BackendOptionsOf<testing::RelayOptions>(TransportOptions{}).channel, "default");
  // Copies do not share what a binder writes afterwards.
  TransportOptions copy = o;
  ASSERT_TRUE(BindTransportOptions({{"relay_channel", "other"}}, &copy).ok());
  EXPECT_EQ(BackendOptionsOf<testing::RelayOptions>(copy).channel, "other");
  EXPECT_EQ(BackendOptionsOf<testing::RelayOptions>(o).channel, "contract");
  EXPECT_EQ(BackendOptionsOf<testing::RelayOptions>(copy).progress_passes, 2);
}

TEST(TransportRegistryTest, BindingErrorsNameTheKey) {
  ASSERT_TRUE(testing::RegisterRelayBackend().ok());
  struct Case {
    TransportSection section;
    std::string expected;
  };
  std::vector<Case> cases = {
      {{{"backend", "relay"}, {"relay_chanel", "x"}}, "transport.relay_chanel: unknown key"},
      // A backend's keys are not known with another backend chosen (the built-ins' are).
      {{{"backend", "ucx"}, {"relay_channel", "x"}}, "transport.relay_channel: unknown key"},
      {{{"backend", "relay"}, {"relay_progress_passes", "0"}},
       "transport.relay_progress_passes: \"0\" is outside [1, 64]"},
      {{{"backend", "relay"}, {"relay_progress_passes", "two"}},
       "transport.relay_progress_passes: \"two\" is not an integer"},
      {{{"backend", "loopback"}, {"nccl_device", "2000"}}, "transport.nccl_device"},
      {{{"enable_rma", "maybe"}}, "transport.enable_rma: \"maybe\" is not a boolean"},
  };
  for (const Case& c : cases) {
    TransportOptions o;
    Status s = BindTransportOptions(c.section, &o);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.expected;
    EXPECT_NE(s.message().find(c.expected), std::string::npos) << s;
  }
  // The built-in backends' keys bind whichever backend is chosen; a key without a value is
  // known and keeps its default.
  TransportOptions o;
  ASSERT_TRUE(BindTransportOptions({{"backend", "relay"},
                                    {"ucx_tls", "tcp"},
                                    {"nccl_device", "3"},
                                    {"loopback_domain", std::nullopt},
                                    {"close_timeout_ms", "10"}},
                                   &o)
                  .ok());
  EXPECT_EQ(BackendOptionsOf<UcxOptions>(o).ucx_tls, "tcp");
  EXPECT_EQ(BackendOptionsOf<NcclOptions>(o).nccl_device, 3);
  EXPECT_EQ(BackendOptionsOf<LoopbackOptions>(o).loopback_domain, "default");
  EXPECT_EQ(o.close_timeout_ms, 10);
}

TEST(TransportRegistryTest, CreateValidatesTheBackendsOwnOptions) {
  TransportOptions o = testing::OptionsFor("relay");
  MutableBackendOptions<testing::RelayOptions>(&o).channel = "";
  auto t = CreateTransport(o);
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("RelayOptions.channel"), std::string::npos) << t.status();
  TransportBackend keyless;
  keyless.name = "test-keyless";
  keyless.create = [](const TransportOptions&) {
    return StatusOr<std::unique_ptr<Transport>>(Status::Internal("x"));
  };
  keyless.keys.push_back({"test_key", nullptr});
  EXPECT_EQ(RegisterTransportBackend(keyless).code(), StatusCode::kInvalidArgument);
}

// RMA is off unless asked for (ucx_options.h: with it on, any peer can read and write this
// process's memory): the UCX backend then refuses every one-sided call with UNIMPLEMENTED naming
// the option.
TEST(UcxTransportTest, RmaIsOffByDefaultAndRefusedClearly) {
  ASSERT_FALSE(UcxOptions{}.enable_rma);
  TransportOptions o = testing::OptionsFor("ucx-tcp");
  auto a = CreateTransport(o);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_FALSE((*a)->capabilities().rma);
  auto region = (*a)->AllocateRegistered(4096);
  ASSERT_TRUE(region.ok()) << region.status();  // registration itself needs no RMA
  auto exported = (*a)->ExportRegion(region->handle);
  EXPECT_EQ(exported.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(exported.status().message().find("enable_rma"), std::string::npos) << exported.status();
  auto peer = (*a)->Connect(*(*a)->LocalAddress());
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_EQ((*a)->ImportRegion(*peer, "KVDUCXR1 and some bytes").status().code(),
            StatusCode::kUnimplemented);
  std::vector<uint8_t> buf(64);
  TransferRequest read;
  read.op = TransferOp::kRead;
  read.peer = *peer;
  read.buffer = buf.data();
  read.length = buf.size();
  auto h = (*a)->Post(read);
  EXPECT_EQ(h.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(h.status().message().find("enable_rma"), std::string::npos) << h.status();
  EXPECT_TRUE((*a)->DeregisterMemory(region->handle).ok());
}

TEST(TransportOptionsTest, ValidateNamesTheField) {
  TransportOptions o;
  MutableBackendOptions<UcxOptions>(&o).ucx_tls = "tcp;rm -rf";
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(o.Validate().message().find("ucx_tls"), std::string::npos);
  o = {};
  MutableBackendOptions<UcxOptions>(&o).keepalive_interval_ms = -1;
  EXPECT_NE(o.Validate().message().find("keepalive_interval_ms"), std::string::npos);
  o = {};
  o.backend = "";
  EXPECT_EQ(CreateTransport(o).status().code(), StatusCode::kInvalidArgument);
}

// Options a backend declares without member initializers read as zeros when none are set
// (BackendOptionsOf's defaults are value-initialized, as MutableBackendOptions' are).
struct BareOptions : BackendOptions {
  int count;
  double share;
  Status Validate() const override { return Status::Ok(); }
};

TEST(TransportOptionsTest, UnsetOptionsWithoutInitializersReadAsZero) {
  const TransportOptions o;
  EXPECT_EQ(BackendOptionsOf<BareOptions>(o).count, 0);
  EXPECT_EQ(BackendOptionsOf<BareOptions>(o).share, 0.0);
  TransportOptions set;
  EXPECT_EQ(MutableBackendOptions<BareOptions>(&set).count, 0);
}

TEST(UcxTransportTest, UnknownTransportNameIsExplained) {
  TransportOptions o;
  MutableBackendOptions<UcxOptions>(&o).ucx_tls = "nosuchtransport";
  auto t = CreateTransport(o);
  if (t.ok()) {
    // UCX 1.13 may accept unknown names and find no transport only when connecting.
    auto addr = (*t)->LocalAddress();
    ASSERT_TRUE(addr.ok());
    auto peer = (*t)->Connect(*addr);
    ASSERT_FALSE(peer.ok());
    EXPECT_EQ(peer.status().code(), StatusCode::kUnavailable) << peer.status();
    EXPECT_NE(peer.status().message().find("UCX_TLS=nosuchtransport"), std::string::npos);
    return;
  }
  EXPECT_EQ(t.status().code(), StatusCode::kUnavailable) << t.status();
  EXPECT_NE(t.status().message().find("UCX_TLS=nosuchtransport"), std::string::npos) << t.status();
}

}  // namespace
}  // namespace kvd::transport

namespace kvd::transport {
namespace {

// The same-host cma path reads a sender's memory only if the sender proves it holds the
// receiver's secret nonce (handed out inside LocalAddress). A sender that connected with a
// tampered address (wrong nonce) is refused: nothing is read, both sides fail.
TEST(UcxCmaPathTest, SenderWithoutTheNonceIsRefused) {
  TransportOptions o = testing::OptionsFor("ucx-sm");
  auto a = CreateTransport(o);
  auto b = CreateTransport(o);
  ASSERT_TRUE(a.ok() && b.ok());
  std::string b_addr = *(*b)->LocalAddress();
  const size_t nonce_at = 8 + 5 * 8;  // "KVDUCX1:" + uuid, host, pid, flags, probe
  ASSERT_GT(b_addr.size(), nonce_at + 16);
  b_addr[nonce_at] ^= 0x5A;
  auto a_to_b = (*a)->Connect(b_addr);
  ASSERT_TRUE(a_to_b.ok()) << a_to_b.status();
  auto b_to_a = (*b)->Connect(*(*a)->LocalAddress());
  ASSERT_TRUE(b_to_a.ok());

  std::vector<uint8_t> src(1 << 20, 0xAB), dst(1 << 20, 0);
  auto recv = (*b)->PostRecv(*b_to_a, 1, dst.data(), dst.size());
  auto send = (*a)->PostSend(*a_to_b, 1, src.data(), src.size());
  ASSERT_TRUE(recv.ok() && send.ok());
  std::thread t([&] { (void)(*a)->Wait(*send, milliseconds(5000)); });
  Status s = (*b)->Wait(*recv, milliseconds(5000));
  t.join();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("could not prove"), std::string::npos) << s;
  // (The first bytes hold the refused descriptor: a failed receive's buffer is undefined.)
  EXPECT_EQ(dst[4096], 0);
  EXPECT_EQ(dst.back(), 0);
  EXPECT_EQ((*a)->Check(*send).status.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE((*b)->Release(*recv).ok());
  EXPECT_TRUE((*a)->Release(*send).ok());
}

// A cma receive acks its sender, and the sender answers its own caller only on that ack (kvd's
// get: the daemon replies once the client has taken the chunk). A receiver may stop driving its
// transport as soon as its receive completes (kvd's client then sleeps on the control socket), so
// the receive must not complete while its ack is still queued inside UCX, which queues it when
// the receiver's path back to the sender is backed up. Here b backs its path to a up with small
// sends a is not reading; a's cma send's ack then queues behind them.
TEST(UcxCmaPathTest, AReceiveCompletesOnlyOnceItsAckHasLeft) {
  TransportOptions o = testing::OptionsFor("ucx-sm");
  auto a = CreateTransport(o);
  auto b = CreateTransport(o);
  ASSERT_TRUE(a.ok() && b.ok());
  auto a_to_b = (*a)->Connect(*(*b)->LocalAddress());
  auto b_to_a = (*b)->Connect(*(*a)->LocalAddress());
  ASSERT_TRUE(a_to_b.ok() && b_to_a.ok());
  // Both directions wired up (UCX connects an endpoint on its first send, driven by the sender's
  // progress): a's descriptor below then reaches b without a progressing.
  for (auto [from, to, peer] :
       {std::tuple{a->get(), b->get(), *a_to_b}, std::tuple{b->get(), a->get(), *b_to_a}}) {
    std::vector<uint8_t> out(1 << 20, 0x22), in(1 << 20);
    auto r = to->PostRecv(to == b->get() ? *b_to_a : *a_to_b, 5, in.data(), in.size());
    auto s = from->PostSend(peer, 5, out.data(), out.size());
    ASSERT_TRUE(r.ok() && s.ok());
    std::thread sender([&] { (void)from->Wait(*s, milliseconds(5000)); });
    ASSERT_TRUE(to->Wait(*r, milliseconds(5000)).ok());
    sender.join();
    ASSERT_EQ(from->Check(*s).state, TransferState::kDone);
    EXPECT_TRUE(to->Release(*r).ok() && from->Release(*s).ok());
  }

  // b -> a backed up: 4 KiB sends (under the cma threshold, through UCX) until one stays queued.
  std::vector<uint8_t> small(4096, 0x11);
  std::vector<TransferHandle> flood;
  bool backed_up = false;
  for (int i = 0; i < 16384 && !backed_up; ++i) {
    auto s = (*b)->PostSend(*b_to_a, 1000 + i, small.data(), small.size());
    ASSERT_TRUE(s.ok()) << s.status();
    flood.push_back(*s);
    if (i % 256 == 255) {
      for (int k = 0; k < 16; ++k) (*b)->Progress();
      backed_up = (*b)->Check(flood.back()).state == TransferState::kInProgress;
    }
  }
  ASSERT_TRUE(backed_up) << "b's path to a did not back up after " << flood.size() << " sends";

  std::vector<uint8_t> src(1 << 20), dst(1 << 20, 0);
  FillPattern(7, src.data(), src.size());
  auto send = (*a)->PostSend(*a_to_b, 7, src.data(), src.size());
  auto recv = (*b)->PostRecv(*b_to_a, 7, dst.data(), dst.size());
  ASSERT_TRUE(send.ok() && recv.ok());
  // a is not progressing: b has copied the bytes, but its ack cannot leave yet.
  Status early = (*b)->Wait(*recv, milliseconds(500));
  EXPECT_EQ(early.code(), StatusCode::kDeadlineExceeded)
      << "the receive completed while its ack was still queued: " << early;

  // a reads again. b drives its transport only until its receive completes, as kvd's client
  // does; the ack must have left by then, so a's send completes on a's progress alone.
  std::atomic<bool> received{false};
  std::thread client([&] {
    if ((*b)->Check(*recv).state == TransferState::kInProgress) {
      (void)(*b)->Wait(*recv, milliseconds(10000));
    }
    received = true;
  });
  Status sent = (*a)->Wait(*send, milliseconds(5000));
  client.join();
  EXPECT_TRUE(sent.ok()) << "a never got b's ack: " << sent;
  ASSERT_EQ((*b)->Check(*recv).state, TransferState::kDone) << (*b)->Check(*recv).status;
  EXPECT_EQ(FirstMismatch(7, dst.data(), dst.size()), dst.size());

  // Drain the flood (a matches each send), then release everything.
  std::vector<uint8_t> sink(4096);
  for (size_t i = 0; i < flood.size(); ++i) {
    auto r = (*a)->PostRecv(*a_to_b, 1000 + i, sink.data(), sink.size());
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE((*a)->Wait(*r, milliseconds(5000)).ok());
    EXPECT_TRUE((*a)->Release(*r).ok());
  }
  for (TransferHandle h : flood) {
    ASSERT_TRUE((*b)->Wait(h, milliseconds(5000)).ok());
    EXPECT_TRUE((*b)->Release(h).ok());
  }
  EXPECT_TRUE((*a)->Release(*send).ok());
  EXPECT_TRUE((*b)->Release(*recv).ok());
}
}  // namespace
}  // namespace kvd::transport
