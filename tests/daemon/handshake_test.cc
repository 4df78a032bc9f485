// Handshake refusals, framing errors and connection limits of the in-process daemon.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>

#include "daemon_test_util.h"
#include "kvd/common/version.h"
#include "kvd/proto/convert.h"

namespace kvd::daemon::testing {
namespace {

using ::testing::HasSubstr;

class HandshakeTest : public DaemonTest {};

std::unique_ptr<proto::DecodedMessage> HelloWith(RawClient& c, const HelloArgs& args) {
  capnp::MallocMessageBuilder mb;
  BuildHello(mb, args);
  return c.Call(mb);
}

TEST_F(HandshakeTest, AdminHelloNeedsNoModelAndHealthWorks) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  RawClient c(TcpAddress());
  ASSERT_TRUE(c.connected());
  HelloArgs args;
  args.role = proto::Role::ADMIN;
  args.model = "";
  auto reply = HelloWith(c, args);
  ASSERT_NE(reply, nullptr);
  ASSERT_TRUE(ResponseStatus(*reply).ok()) << ResponseStatus(*reply);
  EXPECT_EQ(reply->Root<proto::Response>().getHello().getChunkTokens(), 256u);
  EXPECT_EQ(reply->Root<proto::Response>().getHello().getWorkerAddress().size(), 0u);
  // The version it names is the build's (project(kvd VERSION ...), kvd/common/version.h).
  EXPECT_EQ(std::string(reply->Root<proto::Response>().getHello().getDaemonVersion().cStr()),
            "kvd " KVD_VERSION_STRING);

  capnp::MallocMessageBuilder health;
  auto req = health.initRoot<proto::Request>();
  req.setRequestId(77);
  req.setHealth();
  auto h = c.Call(health);
  ASSERT_NE(h, nullptr);
  auto root = h->Root<proto::Response>();
  EXPECT_EQ(root.getRequestId(), 77u);
  ASSERT_EQ(root.which(), proto::Response::HEALTH);
  EXPECT_TRUE(root.getHealth().getOk());
  EXPECT_EQ(std::string(root.getHealth().getTransport().cStr()).rfind("loopback", 0), 0u);
}

TEST_F(HandshakeTest, UnknownModelIsRefusedAndConnectionClosed) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  RawClient c(TcpAddress());
  HelloArgs args;
  args.model = "gpt-17";
  args.layout = Layout();
  args.worker_address = "x";
  Status s = ReplyStatus(HelloWith(c, args));
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("unknown model \"gpt-17\""));
  EXPECT_THAT(s.message(), HasSubstr("stories260k"));
  EXPECT_TRUE(c.WaitClosed());
  // The daemon keeps serving others.
  auto engine = ConnectEngine();
  ASSERT_NE(engine, nullptr);
  EXPECT_TRUE(Put(*engine, Hash128{1, 2}, 4, RandomBytes(Layout().ChunkBytes(4), 1)).ok());
}

TEST_F(HandshakeTest, LayoutMismatchNamesTheField) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  RawClient c(TcpAddress());
  HelloArgs args;
  ModelLayout layout = Layout();
  layout.num_kv_heads = 2;  // registered: 4
  args.layout = layout;
  args.worker_address = "x";
  auto reply = HelloWith(c, args);
  ASSERT_NE(reply, nullptr);
  Status s = ResponseStatus(*reply);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("layout mismatch for model stories260k"));
  EXPECT_THAT(s.message(), HasSubstr("num_kv_heads: registered 4, client sent 2"));
  EXPECT_TRUE(c.WaitClosed());

  RawClient c2(TcpAddress());
  layout = Layout();
  layout.rope.pairing = RopePairing::kHalves;
  args.layout = layout;
  reply = HelloWith(c2, args);
  ASSERT_NE(reply, nullptr);
  EXPECT_THAT(ResponseStatus(*reply).message(), HasSubstr("rope.pairing"));
}

TEST_F(HandshakeTest, WrongHashSeedIsRefusedPlainly) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  RawClient c(TcpAddress());
  HelloArgs args;
  args.seed = "my-own-seed";
  args.worker_address = "x";
  Status s = ReplyStatus(HelloWith(c, args));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("hash seed mismatch: client digest 0x"));
  EXPECT_THAT(s.message(), HasSubstr("daemon digest 0x"));
  EXPECT_THAT(s.message(),
              HasSubstr("every client and daemon of a deployment must use the same seed"));
  EXPECT_TRUE(c.WaitClosed());
}

TEST_F(HandshakeTest, ProtocolVersionAndChunkSizeMismatch) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  {
    RawClient c(TcpAddress());
    HelloArgs args;
    args.version = 99;
    Status s = ReplyStatus(HelloWith(c, args));
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(s.message(), HasSubstr("protocol version mismatch: client speaks 99"));
    EXPECT_TRUE(c.WaitClosed());
  }
  {
    RawClient c(TcpAddress());
    HelloArgs args;
    args.chunk_tokens = 128;
    args.worker_address = "x";
    Status s = ReplyStatus(HelloWith(c, args));
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(s.message(), HasSubstr("client uses 128 tokens per chunk, daemon uses 256"));
  }
  {
    RawClient c(TcpAddress());
    HelloArgs args;  // engine without a transport address
    Status s = ReplyStatus(HelloWith(c, args));
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("workerAddress"));
  }
}

TEST_F(HandshakeTest, RequestBeforeHelloIsRefused) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  RawClient c(UnixAddress());
  ASSERT_TRUE(c.connected());
  capnp::MallocMessageBuilder mb;
  BuildLookup(mb, {Hash128{1, 1}});
  Status s = ReplyStatus(c.Call(mb));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("first request on a connection must be Hello"));
  EXPECT_TRUE(c.WaitClosed());
}

TEST_F(HandshakeTest, TruncatedFrameClosesOnlyThatConnection) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  auto other = ConnectEngine();
  ASSERT_NE(other, nullptr);
  {
    RawClient c(TcpAddress());
    uint8_t header[proto::kFrameHeaderBytes];
    proto::EncodeFrameHeader(64, header);
    ASSERT_TRUE(c.SendBytes(header));
    std::vector<uint8_t> part(10, 0);
    ASSERT_TRUE(c.SendBytes(part));
    c.Close();  // mid-frame
  }
  {
    RawClient c(TcpAddress());
    ASSERT_TRUE(c.SendBytes(std::vector<uint8_t>{0x4B, 0x56}));  // half a header
    c.Close();
  }
  // The client connected before, and a new one, are both served.
  std::vector<uint8_t> bytes = RandomBytes(Layout().ChunkBytes(16), 2);
  EXPECT_TRUE(Put(*other, Hash128{3, 3}, 16, bytes).ok());
  auto fresh = ConnectEngine();
  ASSERT_NE(fresh, nullptr);
  capnp::MallocMessageBuilder lookup;
  BuildLookup(lookup, {Hash128{3, 3}});
  auto reply = fresh->conn->Call(lookup);
  ASSERT_NE(reply, nullptr);
  EXPECT_EQ(reply->Root<proto::Response>().getLookup().getMatchedTokens(), 16u);
}

TEST_F(HandshakeTest, OversizedFrameGetsOutOfRangeThenClose) {
  config_.limits.max_frame_bytes = 4096;
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  RawClient c(TcpAddress());
  uint8_t header[proto::kFrameHeaderBytes];
  proto::EncodeFrameHeader(1u << 20, header);
  ASSERT_TRUE(c.SendBytes(header));
  Status s = ReplyStatus(c.Read());
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_THAT(s.message(), HasSubstr("1048576"));
  EXPECT_THAT(s.message(), HasSubstr("4096"));
  EXPECT_TRUE(c.WaitClosed());
}

TEST_F(HandshakeTest, BadMagicGetsInvalidArgumentThenClose) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  RawClient c(TcpAddress());
  std::vector<uint8_t> garbage = {'G', 'E', 'T', ' ', '/', ' ', 'H', 'T', 'T', 'P', '/', '1'};
  ASSERT_TRUE(c.SendBytes(garbage));
  auto reply = c.Read();
  ASSERT_NE(reply, nullptr);
  EXPECT_EQ(ResponseStatus(*reply).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(c.WaitClosed());
}

TEST_F(HandshakeTest, MalformedPayloadGetsInvalidArgumentAndConnectionLives) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  RawClient c(TcpAddress());
  HelloArgs args;
  args.role = proto::Role::ADMIN;
  auto hello = HelloWith(c, args);
  ASSERT_NE(hello, nullptr);
  ASSERT_TRUE(ResponseStatus(*hello).ok());
  // A segment table that claims a huge segment: Cap'n Proto rejects it.
  std::vector<uint8_t> frame(proto::kFrameHeaderBytes + 16, 0);
  proto::EncodeFrameHeader(16, frame.data());
  uint32_t table[2] = {0, 0x7fffffff};
  std::memcpy(frame.data() + proto::kFrameHeaderBytes, table, sizeof(table));
  ASSERT_TRUE(c.SendBytes(frame));
  Status s = ReplyStatus(c.Read());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("malformed frame"));
  // Same connection still answers.
  capnp::MallocMessageBuilder health;
  health.initRoot<proto::Request>().setHealth();
  auto h = c.Call(health);
  ASSERT_NE(h, nullptr);
  EXPECT_EQ(h->Root<proto::Response>().which(), proto::Response::HEALTH);
}

TEST_F(HandshakeTest, MaxSessionsRefusesTheExtraConnection) {
  config_.limits.max_sessions = 1;
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  RawClient first(TcpAddress());
  HelloArgs args;
  args.role = proto::Role::ADMIN;
  ASSERT_NE(HelloWith(first, args), nullptr);
  RawClient second(TcpAddress());
  Status s = ReplyStatus(second.Read());
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("max_sessions=1"));
  EXPECT_TRUE(second.WaitClosed());
}

TEST_F(HandshakeTest, ShutdownWithOpenSessionsReturns) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon());
  auto engine = ConnectEngine();
  ASSERT_NE(engine, nullptr);
  capnp::MallocMessageBuilder reserve;
  BuildReserve(reserve, Hash128{9, 9}, 8, Layout().ChunkBytes(8));
  auto reply = engine->conn->Call(reserve);
  ASSERT_NE(reply, nullptr);
  ASSERT_TRUE(ResponseStatus(*reply).ok());
  auto start = std::chrono::steady_clock::now();
  StopDaemon();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_TRUE(engine->conn->WaitClosed());
}

}  // namespace
}  // namespace kvd::daemon::testing
