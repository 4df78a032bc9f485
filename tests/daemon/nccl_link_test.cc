// The daemon's NCCL link (NcclConnect, Reserve.overNccl, Get.overNccl) on the in-process daemon.
//
// NcclLinkRefusalTest runs the real thing: the daemon's default link is CreateTransport("nccl")
// on CUDA device 0, which on a machine without a GPU (or a build without NCCL) cannot start, and
// the daemon must say why and keep serving. NcclLinkTest replaces NCCL and the device through
// ServerDeps' seams (a loopback transport in a domain of its own, FakeDeviceMemory in host
// memory) so that every daemon-side step of a device session runs here: the join, the receive
// into device staging, the one copy into the reservation, the checksum over host bytes, the get
// staged back into device memory, the staging freed on every path, timeouts and teardown. The
// same path over real NCCL between two GPUs is the device script's row (tests/gpu).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "../storage/fake_device_memory.h"
#include "daemon_test_util.h"
#include "kvd/proto/convert.h"
#include "kvd/storage/device_memory.h"

namespace kvd::daemon::testing {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

void BuildNcclConnect(capnp::MallocMessageBuilder& mb, const std::string& address,
                      uint64_t rid = 9) {
  auto req = mb.initRoot<proto::Request>();
  req.setRequestId(rid);
  req.initNcclConnect().setAddress(
      kj::arrayPtr(reinterpret_cast<const capnp::byte*>(address.data()), address.size()));
}

uint64_t Counter(RawClient& conn, const std::string& name) {
  capnp::MallocMessageBuilder mb;
  auto req = mb.initRoot<proto::Request>();
  req.setRequestId(77);
  req.setStats();
  auto reply = conn.Call(mb);
  if (reply == nullptr) return ~uint64_t{0};
  for (auto c : reply->Root<proto::Response>().getStats().getCounters()) {
    if (c.getName() == name) return c.getValue();
  }
  return ~uint64_t{0};
}

// ---- the real link on this machine ----

class NcclLinkRefusalTest : public DaemonTest {};

TEST_F(NcclLinkRefusalTest, WithoutNcclOrADeviceTheLinkIsRefusedWithTheReasonAndTheSessionServes) {
  if (storage::CudaDeviceUnavailableReason(0).empty()) {
    GTEST_SKIP() << "CUDA device 0 is present: the link can start here (the refusal needs a "
                    "machine without a device)";
  }
  StartDaemon();
  auto e = ConnectEngine();
  ASSERT_NE(e, nullptr);
  capnp::MallocMessageBuilder mb;
  BuildNcclConnect(mb, "KVDNCCL1 bytes the daemon never reads when it cannot start NCCL");
  Status s = ReplyStatus(e->conn->Call(mb));
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("NCCL link unavailable: "));
  EXPECT_THAT(s.message(), AnyOf(HasSubstr("built without NCCL"), HasSubstr("no CUDA device")));

  // Asked again: the same reason at once (the first outcome is kept).
  capnp::MallocMessageBuilder again;
  BuildNcclConnect(again, "KVDNCCL1 again");
  Status s2 = ReplyStatus(e->conn->Call(again));
  EXPECT_EQ(s2.code(), s.code());
  EXPECT_EQ(s2.message(), s.message());

  // The refused session still puts and gets over its transport ...
  const uint32_t tokens = 256;
  auto bytes = RandomBytes(Layout().ChunkBytes(tokens), 11);
  Hash128 hash{0x1111, 0x2222};
  ASSERT_TRUE(Put(*e, hash, tokens, bytes).ok());
  // ... its device requests are refused precisely ...
  capnp::MallocMessageBuilder reserve;
  BuildReserve(reserve, Hash128{0x3333, 0x4444}, tokens, bytes.size());
  reserve.getRoot<proto::Request>().getReserve().setOverNccl(true);
  Status rs = ReplyStatus(e->conn->Call(reserve));
  EXPECT_EQ(rs.code(), StatusCode::kFailedPrecondition) << rs;
  EXPECT_THAT(rs.message(), HasSubstr("Reserve.overNccl: this session has no NCCL link"));
  // ... and another client is served too.
  auto other = ConnectEngine();
  ASSERT_NE(other, nullptr);
  ASSERT_TRUE(Put(*other, Hash128{0x5555, 0x6666}, tokens, bytes).ok());
  EXPECT_EQ(Counter(*other->conn, "nccl_refused"), 2u);
  EXPECT_EQ(Counter(*other->conn, "nccl_links"), 0u);
  EXPECT_TRUE(WaitReservedBytes(0));
}

// ---- the daemon's link path over the seams ----

class NcclLinkTest : public DaemonTest {
 protected:
  NcclLinkTest() {
    link_domain_ = loopback_domain_ + "-nccl";
    deps_.nccl_transport = transport::CreateTransport(LoopbackTransport(link_domain_)).value();
    auto memory = std::make_unique<storage::testing::FakeDeviceMemory>(64u << 20);
    memory_ = memory.get();
    deps_.nccl_device_memory = std::move(memory);
    config_.limits.transfer_timeout_ms = 400;
  }

  // An engine session with its link joined: `link` is the client's "NCCL" transport.
  struct LinkedEngine {
    std::unique_ptr<Engine> engine;
    std::unique_ptr<transport::Transport> link;
    transport::PeerHandle daemon_link_peer;
  };
  LinkedEngine ConnectLinked() {
    LinkedEngine le;
    le.engine = ConnectEngine();
    EXPECT_NE(le.engine, nullptr);
    if (le.engine == nullptr) return le;
    le.link = transport::CreateTransport(LoopbackTransport(link_domain_)).value();
    capnp::MallocMessageBuilder mb;
    BuildNcclConnect(mb, le.link->LocalAddress().value());
    auto reply = le.engine->conn->Call(mb);
    Status s = ReplyStatus(reply);
    EXPECT_TRUE(s.ok()) << s;
    if (!s.ok()) return le;
    auto r = reply->Root<proto::Response>().getNcclConnected();
    EXPECT_EQ(r.getDevice(), 0);
    // A backend with bootstrap bytes (NCCL) joins with them, the others with the address.
    auto boot = r.getBootstrap();
    auto addr = r.getAddress();
    EXPECT_EQ(boot.size(), 0u) << "loopback needs no bootstrap bytes";
    auto peer = le.link->Connect(
        std::string_view(reinterpret_cast<const char*>(addr.begin()), addr.size()));
    EXPECT_TRUE(peer.ok()) << peer.status();
    if (peer.ok()) le.daemon_link_peer = *peer;
    return le;
  }

  // Reserve over the link: {reservation, tag}, or the error.
  StatusOr<std::pair<uint64_t, uint64_t>> ReserveOverLink(Engine& e, Hash128 hash, uint64_t bytes) {
    capnp::MallocMessageBuilder mb;
    BuildReserve(mb, hash, 256, bytes);
    mb.getRoot<proto::Request>().getReserve().setOverNccl(true);
    auto reply = e.conn->Call(mb);
    KVD_RETURN_IF_ERROR(ReplyStatus(reply));
    auto r = reply->Root<proto::Response>().getReserve();
    return std::make_pair(r.getReservationId(), r.getTag());
  }

  // Sends `bytes` over the link with `tag`, then commits with `checksum`: the Commit's status.
  Status SendAndCommit(LinkedEngine& le, uint64_t reservation, uint64_t tag,
                       const std::vector<uint8_t>& bytes, uint64_t checksum) {
    auto send = le.link->PostSend(le.daemon_link_peer, tag, bytes.data(), bytes.size());
    KVD_RETURN_IF_ERROR(send.status());
    capnp::MallocMessageBuilder commit;
    BuildCommit(commit, reservation, checksum);
    if (!le.engine->conn->Send(commit)) return Status::Unavailable("cannot send Commit");
    Status ws = le.link->Wait(*send, std::chrono::milliseconds(2000));
    le.link->Release(*send).IgnoreError();
    Status cs = ReplyStatus(le.engine->conn->Read());
    KVD_RETURN_IF_ERROR(cs);
    return ws;
  }

  // Reserves `bytes` as chunk `hash` over the link, sends them and commits with their checksum:
  // the first error.
  Status PutOverLink(LinkedEngine& le, Hash128 hash, const std::vector<uint8_t>& bytes) {
    KVD_ASSIGN_OR_RETURN(auto r, ReserveOverLink(*le.engine, hash, bytes.size()));
    return SendAndCommit(le, r.first, r.second, bytes, Checksum64(bytes.data(), bytes.size()));
  }

  // Lookup of one chunk: its lease (0 when not stored).
  uint64_t Lease(Engine& e, Hash128 hash) {
    capnp::MallocMessageBuilder mb;
    BuildLookup(mb, {hash});
    auto reply = e.conn->Call(mb);
    if (ReplyStatus(reply).ok() == false) return 0;
    return reply->Root<proto::Response>().getLookup().getLeaseId();
  }

  // Get over the link into `out`: the Get's status (and the checksum it carried).
  Status GetOverLink(LinkedEngine& le, uint64_t lease, std::vector<uint8_t>* out,
                     uint64_t* checksum) {
    const uint64_t tag = 0xD00D;
    auto recv = le.link->PostRecv(le.daemon_link_peer, tag, out->data(), out->size());
    KVD_RETURN_IF_ERROR(recv.status());
    capnp::MallocMessageBuilder mb;
    BuildGet(mb, lease, 0, tag, out->size());
    mb.getRoot<proto::Request>().getGet().setOverNccl(true);
    if (!le.engine->conn->Send(mb)) return Status::Unavailable("cannot send Get");
    Status rs;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    do {
      rs = le.link->Wait(*recv, std::chrono::milliseconds(1));
    } while (!rs.ok() && !le.engine->conn->Readable() &&
             std::chrono::steady_clock::now() < deadline);
    auto reply = le.engine->conn->Read();
    if (!rs.ok()) {
      le.link->Cancel(*recv).IgnoreError();
      le.link->Wait(*recv, std::chrono::milliseconds(1000)).IgnoreError();
    }
    le.link->Release(*recv).IgnoreError();
    KVD_RETURN_IF_ERROR(ReplyStatus(reply));
    *checksum = reply->Root<proto::Response>().getGet().getChecksum();
    return rs;
  }

  // Every staging buffer is back with the link (asked over `conn`, polled: the last put's
  // handler may still be finishing), and the device holds exactly `allocated` of them.
  bool WaitStagingReturned(RawClient& conn, uint64_t allocated = 1) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (std::chrono::steady_clock::now() < deadline) {
      if (Counter(conn, "nccl_staging_in_use") == 0 &&
          Counter(conn, "nccl_staging_allocated") == allocated &&
          memory_->live_count() == allocated) {
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }

  std::string link_domain_;
  storage::testing::FakeDeviceMemory* memory_ = nullptr;  // owned by the daemon
};

TEST_F(NcclLinkTest, PutAndGetOverTheLinkAreByteExactThroughDeviceStaging) {
  StartDaemon();
  LinkedEngine le = ConnectLinked();
  ASSERT_NE(le.link, nullptr);
  const uint64_t n = Layout().ChunkBytes(256);
  auto bytes = RandomBytes(n, 21);
  const Hash128 hash{0xAB, 0xCD};
  auto r = ReserveOverLink(*le.engine, hash, n);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(memory_->live_count(), 1u) << "the receive lands in device staging";
  ASSERT_TRUE(
      SendAndCommit(le, r->first, r->second, bytes, Checksum64(bytes.data(), bytes.size())).ok());
  EXPECT_EQ(memory_->d2h.load(), 1) << "one copy out of staging into the reservation";
  EXPECT_TRUE(WaitStagingReturned(*le.engine->conn));

  // The chunk is an ordinary stored chunk: a get over the transport returns the same bytes ...
  const uint64_t lease = Lease(*le.engine, hash);
  ASSERT_NE(lease, 0u);
  std::vector<uint8_t> out(n, 0);
  uint64_t checksum = 0;
  // ... and so does a get over the link, staged through device memory.
  ASSERT_TRUE(GetOverLink(le, lease, &out, &checksum).ok());
  EXPECT_EQ(out, bytes);
  EXPECT_EQ(checksum, Checksum64(bytes.data(), bytes.size()));
  EXPECT_EQ(memory_->h2d.load(), 1);
  EXPECT_TRUE(WaitStagingReturned(*le.engine->conn)) << "the get reused the put's buffer";
  // More puts of the same size reuse that one buffer too (no device allocation per chunk).
  for (uint64_t i = 0; i < 3; ++i) {
    Status s = PutOverLink(le, Hash128{0xAB, 0x100 + i}, RandomBytes(n, 100 + i));
    ASSERT_TRUE(s.ok()) << s;
  }
  EXPECT_TRUE(WaitStagingReturned(*le.engine->conn));
  EXPECT_EQ(Counter(*le.engine->conn, "nccl_links"), 1u);
  // The same session still puts over its transport.
  ASSERT_TRUE(Put(*le.engine, Hash128{0xEF, 0x01}, 256, RandomBytes(n, 22)).ok());
}

// A GPU tier (on the fake device too): a put over the link is also copied up into it from the
// staging buffer, and a get over the link is then sent from the GPU tier's copy, device to device.
TEST_F(NcclLinkTest, WithAGpuTierPutsGoUpDeviceToDeviceAndGetsAreSentFromIt) {
  config_.gpu_tier.emplace();
  config_.gpu_tier->capacity_bytes = 4u << 20;
  auto gpu_memory = std::make_unique<storage::testing::FakeDeviceMemory>(8u << 20);
  storage::testing::FakeDeviceMemory* gpu = gpu_memory.get();
  deps_.gpu_device_memory = std::move(gpu_memory);
  StartDaemon();
  LinkedEngine le = ConnectLinked();
  ASSERT_NE(le.link, nullptr);
  const uint64_t n = Layout().ChunkBytes(256);
  auto bytes = RandomBytes(n, 61);
  const Hash128 hash{0x6b, 0x1};
  Status put = PutOverLink(le, hash, bytes);
  ASSERT_TRUE(put.ok()) << put;
  EXPECT_EQ(gpu->d2d.load(), 1) << "copied up from the staging buffer";
  EXPECT_EQ(gpu->h2d.load(), 0) << "not through the host";
  capnp::MallocMessageBuilder stats;
  auto req = stats.initRoot<proto::Request>();
  req.setRequestId(78);
  req.setStats();
  auto reply = le.engine->conn->Call(stats);
  ASSERT_TRUE(ReplyStatus(reply).ok());
  auto tiers = reply->Root<proto::Response>().getStats().getTiers();
  ASSERT_EQ(tiers.size(), 2u);
  EXPECT_EQ(std::string(tiers[0].getName().cStr()), "gpu");
  EXPECT_EQ(tiers[0].getChunks(), 1u);
  EXPECT_EQ(tiers[1].getChunks(), 1u) << "the host copy stays";

  const uint64_t lease = Lease(*le.engine, hash);
  ASSERT_NE(lease, 0u);
  std::vector<uint8_t> out(n, 0);
  uint64_t checksum = 0;
  ASSERT_TRUE(GetOverLink(le, lease, &out, &checksum).ok());
  EXPECT_EQ(out, bytes);
  EXPECT_EQ(checksum, Checksum64(bytes.data(), bytes.size()));
  EXPECT_EQ(gpu->d2d.load(), 2) << "the get was staged from the GPU tier's copy";
  EXPECT_EQ(memory_->h2d.load(), 0) << "not from the host copy";
  EXPECT_TRUE(WaitStagingReturned(*le.engine->conn));
}

TEST_F(NcclLinkTest, BadLinkRequestsGetSpecificErrorsAndTheSessionKeepsServing) {
  StartDaemon();
  auto plain = ConnectEngine();
  ASSERT_NE(plain, nullptr);
  const uint64_t n = Layout().ChunkBytes(256);
  // Device requests before NcclConnect.
  auto r = ReserveOverLink(*plain, Hash128{1, 2}, n);
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("send NcclConnect first"));
  capnp::MallocMessageBuilder get;
  BuildGet(get, 123, 0, 5, n);
  get.getRoot<proto::Request>().getGet().setOverNccl(true);
  Status gs = ReplyStatus(plain->conn->Call(get));
  EXPECT_EQ(gs.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(gs.message(), HasSubstr("Get.overNccl: this session has no NCCL link"));
  // An empty address, then bytes the link cannot read.
  capnp::MallocMessageBuilder empty;
  BuildNcclConnect(empty, "");
  Status es = ReplyStatus(plain->conn->Call(empty));
  EXPECT_EQ(es.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(es.message(), HasSubstr("NcclConnect.address is empty"));
  capnp::MallocMessageBuilder garbage;
  BuildNcclConnect(garbage, "not an address");
  Status bs = ReplyStatus(plain->conn->Call(garbage));
  EXPECT_NE(bs.code(), StatusCode::kOk);
  EXPECT_THAT(bs.message(), HasSubstr("NcclConnect: cannot join the client's NCCL transport"));
  ASSERT_TRUE(Put(*plain, Hash128{3, 4}, 256, RandomBytes(n, 23)).ok());

  // A second NcclConnect on a linked session.
  LinkedEngine le = ConnectLinked();
  ASSERT_NE(le.link, nullptr);
  capnp::MallocMessageBuilder twice;
  BuildNcclConnect(twice, le.link->LocalAddress().value());
  Status ts = ReplyStatus(le.engine->conn->Call(twice));
  EXPECT_EQ(ts.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(ts.message(), HasSubstr("already has an NCCL link"));
}

TEST_F(NcclLinkTest, ChecksumMismatchAndCopyFailureReturnTheSpaceAndFreeTheStaging) {
  StartDaemon();
  LinkedEngine le = ConnectLinked();
  ASSERT_NE(le.link, nullptr);
  const uint64_t n = Layout().ChunkBytes(256);
  auto bytes = RandomBytes(n, 31);
  const uint64_t good = Checksum64(bytes.data(), bytes.size());

  auto r1 = ReserveOverLink(*le.engine, Hash128{7, 1}, n);
  ASSERT_TRUE(r1.ok());
  Status s1 = SendAndCommit(le, r1->first, r1->second, bytes, good ^ 1);
  EXPECT_EQ(s1.code(), StatusCode::kDataLoss) << s1;
  EXPECT_THAT(s1.message(), HasSubstr("checksum mismatch"));

  auto r2 = ReserveOverLink(*le.engine, Hash128{7, 2}, n);
  ASSERT_TRUE(r2.ok());
  memory_->FailNextCopies(1);
  Status s2 = SendAndCommit(le, r2->first, r2->second, bytes, good);
  EXPECT_EQ(s2.code(), StatusCode::kInternal) << s2;
  EXPECT_THAT(s2.message(), HasSubstr("out of device staging"));
  EXPECT_TRUE(WaitStagingReturned(*le.engine->conn));
  EXPECT_TRUE(WaitReservedBytes(0));
  EXPECT_EQ(Lease(*le.engine, Hash128{7, 1}), 0u);
  EXPECT_EQ(Lease(*le.engine, Hash128{7, 2}), 0u);
  // The session goes on: the same chunk put again is stored.
  Status again = PutOverLink(le, Hash128{7, 2}, bytes);
  ASSERT_TRUE(again.ok()) << again;
  EXPECT_NE(Lease(*le.engine, Hash128{7, 2}), 0u);
}

TEST_F(NcclLinkTest, BytesThatNeverArriveTimeOutAndAClientThatVanishesIsCleanedUp) {
  StartDaemon();
  auto watcher = ConnectEngine();  // reads the stats while the others come and go
  ASSERT_NE(watcher, nullptr);
  LinkedEngine le = ConnectLinked();
  ASSERT_NE(le.link, nullptr);
  const uint64_t n = Layout().ChunkBytes(256);
  auto r = ReserveOverLink(*le.engine, Hash128{9, 1}, n);
  ASSERT_TRUE(r.ok());
  capnp::MallocMessageBuilder commit;
  BuildCommit(commit, r->first, 42);
  Status cs = ReplyStatus(le.engine->conn->Call(commit));
  EXPECT_EQ(cs.code(), StatusCode::kDeadlineExceeded) << cs;
  EXPECT_THAT(cs.message(), HasSubstr("did not arrive within limits.transfer_timeout_ms=400"));
  EXPECT_TRUE(WaitStagingReturned(*watcher->conn));
  EXPECT_TRUE(WaitReservedBytes(0));

  // A reservation over the link left open, then the client goes away.
  auto open = ReserveOverLink(*le.engine, Hash128{9, 2}, n);
  ASSERT_TRUE(open.ok());
  EXPECT_EQ(Counter(*watcher->conn, "nccl_staging_in_use"), 1u);
  le.engine->conn->Close();
  EXPECT_TRUE(WaitStagingReturned(*watcher->conn));
  EXPECT_TRUE(WaitReservedBytes(0));
  // The daemon serves the next client.
  LinkedEngine next = ConnectLinked();
  ASSERT_NE(next.link, nullptr);
  Status put = PutOverLink(next, Hash128{9, 3}, RandomBytes(n, 41));
  EXPECT_TRUE(put.ok()) << put;
}

}  // namespace
}  // namespace kvd::daemon::testing
