// Two-phase put, lookup, get and their failure paths on the in-process daemon.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "daemon_test_util.h"
#include "kvd/proto/convert.h"
#include "kvd/transport/fault_injection.h"

namespace kvd::daemon::testing {
namespace {

using ::testing::HasSubstr;

class PutGetTest : public DaemonTest {
 protected:
  // Reserve only; returns {reservation id, tag} or fails the test.
  std::pair<uint64_t, uint64_t> Reserve(Engine& e, Hash128 hash, uint32_t tokens) {
    capnp::MallocMessageBuilder mb;
    BuildReserve(mb, hash, tokens, Layout().ChunkBytes(tokens));
    auto reply = e.conn->Call(mb);
    EXPECT_NE(reply, nullptr);
    if (reply == nullptr) return {0, 0};
    EXPECT_TRUE(ResponseStatus(*reply).ok()) << ResponseStatus(*reply);
    auto r = reply->Root<proto::Response>().getReserve();
    EXPECT_FALSE(r.getAlreadyStored());
    return {r.getReservationId(), r.getTag()};
  }

  Status CommitStatus(Engine& e, uint64_t reservation, uint64_t checksum) {
    capnp::MallocMessageBuilder mb;
    BuildCommit(mb, reservation, checksum);
    auto reply = e.conn->Call(mb);
    if (reply == nullptr) return Status::Unavailable("no reply");
    return ResponseStatus(*reply);
  }

  struct LookupResult {
    uint32_t chunks = 0;
    uint64_t tokens = 0;
    uint64_t lease = 0;
  };
  LookupResult Lookup(Engine& e, const std::vector<Hash128>& chain) {
    capnp::MallocMessageBuilder mb;
    BuildLookup(mb, chain);
    auto reply = e.conn->Call(mb);
    EXPECT_NE(reply, nullptr);
    if (reply == nullptr) return {};
    EXPECT_TRUE(ResponseStatus(*reply).ok()) << ResponseStatus(*reply);
    auto l = reply->Root<proto::Response>().getLookup();
    return {l.getMatchedChunks(), l.getMatchedTokens(), l.getLeaseId()};
  }

  // Get into `out` (resized to `buffer`): posts the receive first, as the protocol requires.
  Status Get(Engine& e, uint64_t lease, uint32_t index, std::vector<uint8_t>* out, size_t buffer,
             uint64_t* checksum = nullptr, uint32_t* tokens = nullptr) {
    out->assign(buffer, 0);
    const uint64_t tag = 0xABC000 + index;
    auto recv = e.transport->PostRecv(e.daemon_peer, tag, out->data(), out->size());
    KVD_RETURN_IF_ERROR(recv.status());
    capnp::MallocMessageBuilder mb;
    BuildGet(mb, lease, index, tag, buffer);
    if (!e.conn->Send(mb)) return Status::Unavailable("cannot send Get");
    // No progress thread here: drive the transport until the bytes are in or a reply is there.
    Status recv_status;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    do {
      recv_status = e.transport->Wait(*recv, std::chrono::milliseconds(1));
    } while (!recv_status.ok() && !e.conn->Readable() &&
             std::chrono::steady_clock::now() < deadline);
    auto reply = e.conn->Read();
    Status reply_status =
        reply == nullptr ? Status::Unavailable("no reply") : ResponseStatus(*reply);
    if (!recv_status.ok()) {
      e.transport->Cancel(*recv).IgnoreError();
      e.transport->Wait(*recv, std::chrono::milliseconds(1000)).IgnoreError();
    }
    e.transport->Release(*recv).IgnoreError();
    KVD_RETURN_IF_ERROR(reply_status);
    auto g = reply->Root<proto::Response>().getGet();
    out->resize(g.getBytes());
    if (checksum) *checksum = g.getChecksum();
    if (tokens) *tokens = g.getTokens();
    return recv_status;
  }
};

TEST_F(PutGetTest, PutLookupGetRoundTripIsByteExact) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  auto e = ConnectEngine();
  ASSERT_NE(e, nullptr);
  const ModelLayout& layout = Layout();
  auto c0 = RandomBytes(layout.ChunkBytes(256), 10);
  auto c1 = RandomBytes(layout.ChunkBytes(100), 11);
  ASSERT_TRUE(Put(*e, Hash128{0, 1}, 256, c0).ok());
  ASSERT_TRUE(Put(*e, Hash128{0, 2}, 100, c1).ok());

  // Partial prefix: the third chunk is absent.
  LookupResult l = Lookup(*e, {Hash128{0, 1}, Hash128{0, 2}, Hash128{0, 3}});
  EXPECT_EQ(l.chunks, 2u);
  EXPECT_EQ(l.tokens, 356u);
  ASSERT_NE(l.lease, 0u);
  // A chain whose first chunk is absent matches nothing.
  EXPECT_EQ(Lookup(*e, {Hash128{0, 9}, Hash128{0, 1}}).chunks, 0u);

  std::vector<uint8_t> got;
  uint64_t checksum = 0;
  uint32_t tokens = 0;
  ASSERT_TRUE(Get(*e, l.lease, 1, &got, layout.ChunkBytes(256), &checksum, &tokens).ok());
  EXPECT_EQ(got, c1);
  EXPECT_EQ(checksum, Checksum64(c1.data(), c1.size()));
  EXPECT_EQ(tokens, 100u);
  ASSERT_TRUE(Get(*e, l.lease, 0, &got, c0.size()).ok());
  EXPECT_EQ(got, c0);

  // The same chunk again: alreadyStored, nothing to send.
  capnp::MallocMessageBuilder mb;
  BuildReserve(mb, Hash128{0, 1}, 256, c0.size());
  auto reply = e->conn->Call(mb);
  ASSERT_NE(reply, nullptr);
  EXPECT_TRUE(reply->Root<proto::Response>().getReserve().getAlreadyStored());

  auto stats = server_->host_tier()->GetStats();
  EXPECT_EQ(stats.chunk_count, 2u);
  EXPECT_EQ(stats.used_bytes, c0.size() + c1.size());
  EXPECT_EQ(stats.reserved_bytes, 0u);
}

TEST_F(PutGetTest, ReserveWithWrongSizesNamesTheNumbers) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  auto e = ConnectEngine();
  ASSERT_NE(e, nullptr);
  const uint64_t right = Layout().ChunkBytes(10);
  {
    capnp::MallocMessageBuilder mb;
    BuildReserve(mb, Hash128{1, 1}, 10, right + 4);
    Status s = ReplyStatus(e->conn->Call(mb));
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr(std::to_string(right + 4) + " != " + std::to_string(right) +
                                       " = layout.ChunkBytes(tokens=10)"));
  }
  {
    capnp::MallocMessageBuilder mb;
    BuildReserve(mb, Hash128{1, 1}, 257, Layout().ChunkBytes(257));
    Status s = ReplyStatus(e->conn->Call(mb));
    EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
    EXPECT_THAT(s.message(), HasSubstr("tokens 257 is outside [1, chunk_tokens=256]"));
  }
  EXPECT_EQ(server_->host_tier()->GetStats().reserved_bytes, 0u);
}

TEST_F(PutGetTest, CommitWithBadChecksumIsDataLossAndFreesSpace) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  auto e = ConnectEngine();
  ASSERT_NE(e, nullptr);
  auto bytes = RandomBytes(Layout().ChunkBytes(32), 3);
  auto [reservation, tag] = Reserve(*e, Hash128{2, 2}, 32);
  auto send = e->transport->PostSend(e->daemon_peer, tag, bytes.data(), bytes.size());
  ASSERT_TRUE(send.ok());
  EXPECT_TRUE(e->transport->Wait(*send, std::chrono::milliseconds(1000)).ok());
  Status s = CommitStatus(*e, reservation, Checksum64(bytes.data(), bytes.size()) ^ 1);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  e->transport->Release(*send).IgnoreError();
  EXPECT_TRUE(WaitReservedBytes(0));
  EXPECT_EQ(Lookup(*e, {Hash128{2, 2}}).chunks, 0u);
  // A second Commit of the failed reservation says it is gone.
  s = CommitStatus(*e, reservation, 0);
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_THAT(s.message(), HasSubstr("DATA_LOSS"));
}

TEST_F(PutGetTest, CommitOfUnknownOrCommittedReservation) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  auto e = ConnectEngine();
  ASSERT_NE(e, nullptr);
  Status s = CommitStatus(*e, 424242, 0);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("unknown reservation 424242"));

  auto bytes = RandomBytes(Layout().ChunkBytes(8), 4);
  auto [reservation, tag] = Reserve(*e, Hash128{4, 4}, 8);
  auto send = e->transport->PostSend(e->daemon_peer, tag, bytes.data(), bytes.size());
  ASSERT_TRUE(send.ok());
  ASSERT_TRUE(e->transport->Wait(*send, std::chrono::milliseconds(1000)).ok());
  ASSERT_TRUE(CommitStatus(*e, reservation, Checksum64(bytes.data(), bytes.size())).ok());
  e->transport->Release(*send).IgnoreError();
  s = CommitStatus(*e, reservation, Checksum64(bytes.data(), bytes.size()));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("already committed"));

  // Another connection cannot commit this connection's reservation.
  auto [open, open_tag] = Reserve(*e, Hash128{4, 5}, 8);
  auto other = ConnectEngine();
  ASSERT_NE(other, nullptr);
  s = CommitStatus(*other, open, 0);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("belongs to another connection"));
}

TEST_F(PutGetTest, CommitWithoutBytesTimesOut) {
  config_.limits.transfer_timeout_ms = 100;
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  auto e = ConnectEngine();
  ASSERT_NE(e, nullptr);
  auto [reservation, tag] = Reserve(*e, Hash128{5, 5}, 8);
  Status s = CommitStatus(*e, reservation, 0);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.message(), HasSubstr("did not arrive within limits.transfer_timeout_ms=100"));
  EXPECT_TRUE(WaitReservedBytes(0));
}

TEST_F(PutGetTest, UncommittedReservationExpires) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  auto e = ConnectEngine();
  ASSERT_NE(e, nullptr);
  auto [reservation, tag] = Reserve(*e, Hash128{6, 6}, 64);
  EXPECT_EQ(server_->host_tier()->GetStats().reserved_bytes, Layout().ChunkBytes(64));
  clock_.AdvanceMillis(config_.limits.reservation_ttl_ms + 1);
  EXPECT_TRUE(WaitReservedBytes(0));
  Status s = CommitStatus(*e, reservation, 0);
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_THAT(s.message(), HasSubstr("expired"));
}

TEST_F(PutGetTest, ClientDisconnectMidPutReclaimsReservation) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  auto survivor = ConnectEngine();
  ASSERT_NE(survivor, nullptr);
  {
    auto e = ConnectEngine();
    ASSERT_NE(e, nullptr);
    Reserve(*e, Hash128{7, 7}, 128);
    Reserve(*e, Hash128{7, 8}, 128);
    EXPECT_EQ(server_->host_tier()->GetStats().reserved_bytes, 2 * Layout().ChunkBytes(128));
    e->conn->Close();  // gone before sending a byte
  }
  EXPECT_TRUE(WaitReservedBytes(0));
  EXPECT_EQ(server_->host_tier()->GetStats().reservations_open, 0u);
  // The other client is served throughout.
  auto bytes = RandomBytes(Layout().ChunkBytes(128), 5);
  EXPECT_TRUE(Put(*survivor, Hash128{7, 7}, 128, bytes).ok());
  EXPECT_EQ(Lookup(*survivor, {Hash128{7, 7}}).tokens, 128u);
}

TEST_F(PutGetTest, TransportPeerVanishingFailsTheCommit) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  auto e = ConnectEngine();
  ASSERT_NE(e, nullptr);
  auto [reservation, tag] = Reserve(*e, Hash128{8, 8}, 16);
  e->transport.reset();  // the client's transport dies; its control connection stays
  Status s = CommitStatus(*e, reservation, 0);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("receive of reservation"));
  EXPECT_TRUE(WaitReservedBytes(0));
}

TEST_F(PutGetTest, GetOfEvictedChunkAndStaleLease) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  auto e = ConnectEngine();
  ASSERT_NE(e, nullptr);
  auto bytes = RandomBytes(Layout().ChunkBytes(16), 6);
  ASSERT_TRUE(Put(*e, Hash128{9, 1}, 16, bytes).ok());
  LookupResult l = Lookup(*e, {Hash128{9, 1}});
  ASSERT_EQ(l.chunks, 1u);
  {
    capnp::MallocMessageBuilder mb;
    auto req = mb.initRoot<proto::Request>();
    req.initReleaseLease().setLeaseId(l.lease);
    auto reply = e->conn->Call(mb);
    ASSERT_NE(reply, nullptr);
    ASSERT_TRUE(ResponseStatus(*reply).ok());
  }
  {
    capnp::MallocMessageBuilder mb;
    mb.initRoot<proto::Request>().initEvict().setAll();
    // Evict is an admin request: the engine connection is refused, an admin one may.
    auto refused = e->conn->Call(mb);
    ASSERT_NE(refused, nullptr);
    Status denied = ResponseStatus(*refused);
    EXPECT_EQ(denied.code(), StatusCode::kPermissionDenied) << denied;
    EXPECT_THAT(denied.message(), HasSubstr("Evict is an admin request"));
    RawClient admin(UnixAddress());
    HelloArgs args;
    args.role = proto::Role::ADMIN;
    capnp::MallocMessageBuilder hello;
    BuildHello(hello, args);
    ASSERT_NE(admin.Call(hello), nullptr);
    auto reply = admin.Call(mb);
    ASSERT_NE(reply, nullptr);
    EXPECT_EQ(reply->Root<proto::Response>().getEvict().getChunks(), 1u);
  }
  std::vector<uint8_t> got;
  Status s = Get(*e, l.lease, 0, &got, bytes.size());
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s;
  LookupResult after = Lookup(*e, {Hash128{9, 1}});
  EXPECT_EQ(after.chunks, 0u);
  EXPECT_EQ(after.lease, 0u);
  s = Get(*e, after.lease, 0, &got, bytes.size());
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  s = Get(*e, 987654, 0, &got, bytes.size());
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
}

TEST_F(PutGetTest, GetIntoSmallBufferOrPastTheLease) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  auto e = ConnectEngine();
  ASSERT_NE(e, nullptr);
  auto bytes = RandomBytes(Layout().ChunkBytes(16), 7);
  ASSERT_TRUE(Put(*e, Hash128{10, 1}, 16, bytes).ok());
  LookupResult l = Lookup(*e, {Hash128{10, 1}});
  std::vector<uint8_t> got;
  Status s = Get(*e, l.lease, 0, &got, bytes.size() - 1);
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_THAT(s.message(), HasSubstr("buffer holds " + std::to_string(bytes.size() - 1)));
  s = Get(*e, l.lease, 1, &got, bytes.size());
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_EQ(server_->host_tier()->GetStats().reads_open, 0u);
}

TEST_F(PutGetTest, GetThatTheClientNeverReceivesTimesOutAndUnpins) {
  config_.limits.transfer_timeout_ms = 100;
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  auto e = ConnectEngine();
  ASSERT_NE(e, nullptr);
  auto bytes = RandomBytes(Layout().ChunkBytes(16), 8);
  ASSERT_TRUE(Put(*e, Hash128{11, 1}, 16, bytes).ok());
  LookupResult l = Lookup(*e, {Hash128{11, 1}});
  capnp::MallocMessageBuilder mb;
  BuildGet(mb, l.lease, 0, /*tag=*/555, bytes.size());  // no receive posted
  Status s = ReplyStatus(e->conn->Call(mb));
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.message(), HasSubstr("did not take the chunk"));
  EXPECT_EQ(server_->host_tier()->GetStats().reads_open, 0u);
}

TEST_F(PutGetTest, PipelinedRequestsAreAnsweredInOrder) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  auto e = ConnectEngine();
  ASSERT_NE(e, nullptr);
  const int kChunks = 8;
  std::vector<std::vector<uint8_t>> chunks;
  std::vector<std::pair<uint64_t, uint64_t>> reservations;
  for (int i = 0; i < kChunks; ++i) {
    chunks.push_back(RandomBytes(Layout().ChunkBytes(32), 100 + i));
    reservations.push_back(Reserve(*e, Hash128{12, static_cast<uint64_t>(i)}, 32));
  }
  // All Commits first (their bytes not yet sent), then the bytes in reverse order.
  for (int i = 0; i < kChunks; ++i) {
    capnp::MallocMessageBuilder mb;
    BuildCommit(mb, reservations[i].first, Checksum64(chunks[i].data(), chunks[i].size()),
                1000 + i);
    ASSERT_TRUE(e->conn->Send(mb));
  }
  std::vector<transport::TransferHandle> sends;
  for (int i = kChunks - 1; i >= 0; --i) {
    sends.push_back(
        e->transport
            ->PostSend(e->daemon_peer, reservations[i].second, chunks[i].data(), chunks[i].size())
            .value());
  }
  for (auto h : sends) ASSERT_TRUE(e->transport->Wait(h, std::chrono::seconds(2)).ok());
  for (int i = 0; i < kChunks; ++i) {
    auto reply = e->conn->Read();
    ASSERT_NE(reply, nullptr);
    EXPECT_EQ(reply->Root<proto::Response>().getRequestId(), 1000u + i);
    EXPECT_TRUE(ResponseStatus(*reply).ok()) << ResponseStatus(*reply);
  }
  for (auto h : sends) e->transport->Release(h).IgnoreError();
  EXPECT_EQ(server_->host_tier()->GetStats().chunk_count, static_cast<uint64_t>(kChunks));
}

// The daemon reads whatever the socket has and handles every whole frame in it: frames that
// arrive in one write, frames split across many small writes, and a burst beyond the
// pipelining limit are all answered, once each and in order; a bad header after good frames in
// the same write gets its error after their replies, then the connection closes.
TEST_F(PutGetTest, FramesAreAnsweredInOrderHoweverTheBytesArrive) {
  config_.limits.max_inflight_per_session = 4;
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  auto e = ConnectEngine();
  ASSERT_NE(e, nullptr);
  ASSERT_TRUE(Put(*e, Hash128{15, 1}, 16, RandomBytes(Layout().ChunkBytes(16), 15)).ok());
  // `n` Lookups of the stored chunk (request ids first_rid, first_rid + 1, ...) as one byte
  // string.
  auto lookups = [](int n, uint64_t first_rid) {
    std::vector<uint8_t> bytes;
    for (int i = 0; i < n; ++i) {
      capnp::MallocMessageBuilder mb;
      BuildLookup(mb, {Hash128{15, 1}}, first_rid + i);
      std::vector<uint8_t> frame = proto::EncodeFrame(mb);
      bytes.insert(bytes.end(), frame.begin(), frame.end());
    }
    return bytes;
  };
  auto expect_replies = [&](int n, uint64_t first_rid) {
    for (int i = 0; i < n; ++i) {
      auto reply = e->conn->Read();
      ASSERT_NE(reply, nullptr) << "reply " << i;
      auto r = reply->Root<proto::Response>();
      EXPECT_EQ(r.getRequestId(), first_rid + i);
      ASSERT_TRUE(r.isLookup()) << ResponseStatus(*reply);
      EXPECT_EQ(r.getLookup().getMatchedChunks(), 1u);
    }
  };
  {
    SCOPED_TRACE("20 frames in one write, 4 in flight at most");
    ASSERT_TRUE(e->conn->SendBytes(lookups(20, 100)));
    expect_replies(20, 100);
  }
  {
    SCOPED_TRACE("5 frames in writes of 7 bytes");
    const std::vector<uint8_t> bytes = lookups(5, 200);
    for (size_t at = 0; at < bytes.size(); at += 7) {
      const size_t n = std::min<size_t>(7, bytes.size() - at);
      ASSERT_TRUE(e->conn->SendBytes({bytes.data() + at, n}));
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    expect_replies(5, 200);
  }
  {
    SCOPED_TRACE("2 frames, then a bad header, in one write");
    std::vector<uint8_t> bytes = lookups(2, 300);
    const std::vector<uint8_t> garbage(proto::kFrameHeaderBytes, 0xEE);
    bytes.insert(bytes.end(), garbage.begin(), garbage.end());
    ASSERT_TRUE(e->conn->SendBytes(bytes));
    expect_replies(2, 300);
    Status s = ReplyStatus(e->conn->Read());
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("bad frame magic"));
    EXPECT_TRUE(e->conn->WaitClosed());
  }
}

// Request.releaseLeases: leases a client is done with ride on its next request of any kind
// (HelloReply.leaseReleasesOnRequests says kvd takes them) and end before that request is
// handled; an id that is no live lease of this connection (another's, never issued) is
// skipped. The ReleaseLease exchange of older clients keeps working.
TEST_F(PutGetTest, LeasesEndWithTheNextRequestThatCarriesThem) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  auto a = ConnectEngine();
  auto b = ConnectEngine();
  ASSERT_TRUE(a != nullptr && b != nullptr);
  EXPECT_TRUE(a->lease_releases_on_requests);
  ASSERT_TRUE(Put(*a, Hash128{16, 1}, 16, RandomBytes(Layout().ChunkBytes(16), 16)).ok());
  LookupResult la = Lookup(*a, {Hash128{16, 1}});
  LookupResult lb = Lookup(*b, {Hash128{16, 1}});
  ASSERT_TRUE(la.chunks == 1u && lb.chunks == 1u);
  EXPECT_EQ(server_->host_tier()->GetStats().leases_open, 2u);
  {
    // a's next request, a Lookup that matches nothing, carries a's lease, b's and a made-up id.
    capnp::MallocMessageBuilder mb;
    BuildLookup(mb, {Hash128{16, 99}}, 40);
    auto ids = mb.getRoot<proto::Request>().initReleaseLeases(3);
    ids.set(0, la.lease);
    ids.set(1, lb.lease);
    ids.set(2, 987654321);
    auto reply = a->conn->Call(mb);
    ASSERT_NE(reply, nullptr);
    ASSERT_TRUE(ResponseStatus(*reply).ok()) << ResponseStatus(*reply);
    EXPECT_EQ(reply->Root<proto::Response>().getLookup().getMatchedChunks(), 0u);
  }
  EXPECT_EQ(server_->host_tier()->GetStats().leases_open, 1u) << "b's lease must stay";
  {
    capnp::MallocMessageBuilder mb;
    BuildGet(mb, la.lease, 0, 77, Layout().ChunkBytes(16), 41);
    Status s = ReplyStatus(a->conn->Call(mb));
    EXPECT_EQ(s.code(), StatusCode::kAborted) << s;
    EXPECT_THAT(s.message(), HasSubstr("was already released"));
  }
  {
    capnp::MallocMessageBuilder mb;
    mb.initRoot<proto::Request>().initReleaseLease().setLeaseId(lb.lease);
    EXPECT_TRUE(ReplyStatus(b->conn->Call(mb)).ok());
  }
  EXPECT_EQ(server_->host_tier()->GetStats().leases_open, 0u);
}

TEST_F(PutGetTest, InjectedPostFailureIsReportedAndNothingLeaks) {
  const transport::TransportOptions opts = LoopbackTransport(loopback_domain_);
  transport::FaultPlan plan;
  plan.fail_post_number = 1;  // the daemon's first Post: the receive of the first Reserve
  auto inner = transport::CreateTransport(opts);
  ASSERT_TRUE(inner.ok());
  deps_.transport = std::make_unique<transport::FaultInjectingTransport>(std::move(*inner), plan);
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  auto e = ConnectEngine();
  ASSERT_NE(e, nullptr);
  capnp::MallocMessageBuilder mb;
  BuildReserve(mb, Hash128{13, 1}, 8, Layout().ChunkBytes(8));
  Status s = ReplyStatus(e->conn->Call(mb));
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("injected fault"));
  EXPECT_EQ(server_->host_tier()->GetStats().reserved_bytes, 0u);
  // The next put goes through.
  EXPECT_TRUE(Put(*e, Hash128{13, 1}, 8, RandomBytes(Layout().ChunkBytes(8), 9)).ok());
}

TEST_F(PutGetTest, AdminStatsListEvict) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  auto e = ConnectEngine();
  ASSERT_NE(e, nullptr);
  auto bytes = RandomBytes(Layout().ChunkBytes(64), 12);
  ASSERT_TRUE(Put(*e, Hash128{14, 1}, 64, bytes).ok());
  ASSERT_TRUE(Put(*e, Hash128{14, 2}, 64, bytes).ok());

  RawClient admin(UnixAddress());
  HelloArgs args;
  args.role = proto::Role::ADMIN;
  capnp::MallocMessageBuilder hello;
  BuildHello(hello, args);
  ASSERT_NE(admin.Call(hello), nullptr);

  capnp::MallocMessageBuilder stats_req;
  stats_req.initRoot<proto::Request>().setStats();
  auto stats = admin.Call(stats_req);
  ASSERT_NE(stats, nullptr);
  auto st = stats->Root<proto::Response>().getStats();
  ASSERT_EQ(st.getTiers().size(), 1u);
  EXPECT_EQ(st.getTiers()[0].getChunks(), 2u);
  EXPECT_EQ(st.getTiers()[0].getUsedBytes(), 2 * bytes.size());
  EXPECT_EQ(st.getTiers()[0].getCapacityBytes(), config_.host_tier.capacity_bytes);
  EXPECT_EQ(st.getSessions(), 2u);
  ASSERT_EQ(st.getModels().size(), 1u);
  EXPECT_EQ(std::string(st.getModels()[0].getName().cStr()), "stories260k");
  EXPECT_EQ(st.getRegisteredModels().size(), 3u);
  bool found = false;
  for (auto c : st.getCounters()) {
    if (std::string(c.getName().cStr()) == "puts_committed") {
      EXPECT_EQ(c.getValue(), 2u);
      found = true;
    }
  }
  EXPECT_TRUE(found);

  capnp::MallocMessageBuilder list_req;
  auto list = list_req.initRoot<proto::Request>().initList();
  list.setModel("stories260k");
  list.setLimit(1);
  auto listed = admin.Call(list_req);
  ASSERT_NE(listed, nullptr);
  EXPECT_EQ(listed->Root<proto::Response>().getList().getTotal(), 2u);
  EXPECT_EQ(listed->Root<proto::Response>().getList().getChunks().size(), 1u);

  capnp::MallocMessageBuilder evict_req;
  proto::ToProto(Hash128{14, 2}, evict_req.initRoot<proto::Request>().initEvict().initChunk());
  auto evicted = admin.Call(evict_req);
  ASSERT_NE(evicted, nullptr);
  EXPECT_EQ(evicted->Root<proto::Response>().getEvict().getChunks(), 1u);
  EXPECT_EQ(evicted->Root<proto::Response>().getEvict().getBytes(), bytes.size());
  EXPECT_EQ(server_->host_tier()->GetStats().chunk_count, 1u);

  // Admin connections cannot put.
  capnp::MallocMessageBuilder reserve;
  BuildReserve(reserve, Hash128{1, 1}, 8, Layout().ChunkBytes(8));
  auto refused = admin.Call(reserve);
  ASSERT_NE(refused, nullptr);
  EXPECT_EQ(ResponseStatus(*refused).code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(ResponseStatus(*refused).message(), HasSubstr("engine role"));
}

// The same round trip over UCX (two UCX contexts in this process), tcp and shared memory.
class UcxPutGetTest : public PutGetTest, public ::testing::WithParamInterface<const char*> {};

TEST_P(UcxPutGetTest, RoundTripAndDisconnect) {
  config_.transport = DaemonConfig::DefaultTransportOptions();
  transport::MutableBackendOptions<transport::UcxOptions>(&config_.transport).ucx_tls = GetParam();
  config_.transport.close_timeout_ms = 500;
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  auto e = ConnectEngine();
  ASSERT_NE(e, nullptr);
  const ModelLayout& layout = Layout();
  std::vector<std::vector<uint8_t>> chunks;
  for (uint64_t i = 0; i < 4; ++i) {
    chunks.push_back(RandomBytes(layout.ChunkBytes(256), 200 + i));
    ASSERT_TRUE(Put(*e, Hash128{20, i}, 256, chunks.back()).ok());
  }
  LookupResult l = Lookup(*e, {Hash128{20, 0}, Hash128{20, 1}, Hash128{20, 2}, Hash128{20, 3}});
  ASSERT_EQ(l.chunks, 4u);
  for (uint32_t i = 0; i < 4; ++i) {
    std::vector<uint8_t> got;
    ASSERT_TRUE(Get(*e, l.lease, i, &got, chunks[i].size()).ok());
    EXPECT_EQ(got, chunks[i]) << i;
  }
  // A client that goes away mid-put: its reservation comes back.
  Reserve(*e, Hash128{20, 9}, 256);
  e->conn->Close();
  e->transport.reset();
  EXPECT_TRUE(WaitReservedBytes(0));
}

INSTANTIATE_TEST_SUITE_P(Tls, UcxPutGetTest, ::testing::Values("tcp", "sm,tcp"),
                         [](const auto& info) {
                           return std::string(info.param) == "tcp" ? "Tcp" : "SharedMemory";
                         });

}  // namespace
}  // namespace kvd::daemon::testing
