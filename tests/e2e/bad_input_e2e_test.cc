// Bad input against a real kvd, each one followed by proof that ANOTHER client keeps being
// served: handshake refusals, malformed / truncated / oversized frames, wrong put sizes,
// checksum mismatch, unknown reservations, and a client killed in the middle of a put.
#include <capnp/message.h>

#include <thread>

#include "e2e_common.h"
#include "kvd/proto/convert.h"
#include "kvd/proto/frame.h"
#include "kvd/proto/kvd.capnp.h"
#include "kvd/transport/transport.h"

namespace kvd::e2e {
namespace {

class BadInputE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KvdConfig c;
    c.ucx_tls = "tcp";
    kvd_ = StartKvd(c);
    ASSERT_NE(kvd_, nullptr);
    good_ = ConnectOrFail(kvd_->EngineOptions("good"));
    admin_ = ConnectOrFail(kvd_->AdminOptions());
    ASSERT_NE(good_, nullptr);
    ExpectServes(*good_, 100);
  }
  void TearDown() override {
    if (good_) {
      ExpectServes(*good_, 200);  // after the bad input, still served
    }
    good_.reset();
    admin_.reset();
    if (kvd_) {
      EXPECT_TRUE(kvd_->Alive()) << kvd_->Log();
      EXPECT_EQ(kvd_->Stop(), 0) << kvd_->Log();
    }
  }
  Status HandshakeWith(const std::function<void(client::ClientOptions&)>& change) {
    auto o = kvd_->EngineOptions("bad");
    change(o);
    return client::Client::Connect(o).status();
  }
  std::unique_ptr<KvdProcess> kvd_;
  std::unique_ptr<client::Client> good_, admin_;
};

TEST_F(BadInputE2eTest, HandshakeRefusalsNameTheMismatch) {
  Status s = HandshakeWith([](auto& o) { o.model = "no-such-model"; });
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find("unknown model"), std::string::npos) << s;

  s = HandshakeWith([](auto& o) { o.layout.head_dim = 16; });
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("layout mismatch"), std::string::npos) << s;
  EXPECT_NE(s.message().find("head_dim"), std::string::npos) << s;

  s = HandshakeWith([](auto& o) { o.hash_seed = "some-other-seed"; });
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("hash seed mismatch"), std::string::npos) << s;

  s = HandshakeWith([](auto& o) { o.chunk_tokens = 128; });
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("chunk size mismatch"), std::string::npos) << s;
  ExpectServes(*good_, 1);
}

// Error text is always valid UTF-8 on the wire, whatever bytes a request carried; names a session
// keeps (namespace, client id) must be UTF-8 to begin with.
TEST_F(BadInputE2eTest, InvalidUtf8InHelloIsRefusedAndNeverEchoedRaw) {
  const std::string fffd = "\xef\xbf\xbd";
  Status s = HandshakeWith([](auto& o) { o.model = "m\xff\xfe\xc3"; });
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find("unknown model \"m" + fffd + fffd + fffd + "\""), std::string::npos)
      << s;
  EXPECT_EQ(proto::ValidUtf8(s.message()), s.message());

  s = HandshakeWith([](auto& o) { o.name_space = "tenant\xc0\xaf"; });  // overlong '/'
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("Hello.namespace \"tenant" + fffd + fffd + "\" is not valid UTF-8"),
            std::string::npos)
      << s;

  s = HandshakeWith([](auto& o) { o.client_id = "engine-\xed\xa0\x80"; });  // a surrogate
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(
      s.message().find("Hello.clientId \"engine-" + fffd + fffd + fffd + "\" is not valid UTF-8"),
      std::string::npos)
      << s;

  // Valid multi-byte names are accepted and served.
  auto o = kvd_->EngineOptions("\xf0\x9f\x98\x80");
  o.name_space = "caf\xc3\xa9-\xe2\x82\xac";
  auto named = ConnectOrFail(o);
  ASSERT_NE(named, nullptr);
  ExpectServes(*named, 7);
  ExpectServes(*good_, 8);
}

TEST_F(BadInputE2eTest, TruncatedOversizedAndMalformedFrames) {
  // Truncated: a header promising 64 bytes, 10 bytes, then the client vanishes.
  {
    auto raw = RawConnection::Open(kvd_->tcp_address());
    ASSERT_TRUE(raw.ok());
    uint8_t header[proto::kFrameHeaderBytes];
    proto::EncodeFrameHeader(64, header);
    ASSERT_TRUE((*raw)->Write(header, sizeof header).ok());
    ASSERT_TRUE((*raw)->Write("0123456789", 10).ok());
  }
  ExpectServes(*good_, 2);
  // Over the limit (4 MiB): OUT_OF_RANGE naming the limit, then the daemon closes.
  {
    auto raw = RawConnection::Open(kvd_->tcp_address());
    ASSERT_TRUE(raw.ok());
    uint8_t header[proto::kFrameHeaderBytes];
    proto::EncodeFrameHeader(64u << 20, header);
    ASSERT_TRUE((*raw)->Write(header, sizeof header).ok());
    Status s = (*raw)->ReadResponseStatus(std::chrono::seconds(3));
    EXPECT_EQ(s.code(), StatusCode::kOutOfRange) << s;
    EXPECT_TRUE((*raw)->ClosedByPeer(std::chrono::seconds(3)));
  }
  ExpectServes(*good_, 3);
  // Malformed payload: 16 bytes that are not a Cap'n Proto message.
  {
    auto raw = RawConnection::Open(kvd_->tcp_address());
    ASSERT_TRUE(raw.ok());
    uint8_t frame[proto::kFrameHeaderBytes + 16];
    proto::EncodeFrameHeader(16, frame);
    std::memset(frame + proto::kFrameHeaderBytes, 0xff, 16);
    ASSERT_TRUE((*raw)->Write(frame, sizeof frame).ok());
    Status s = (*raw)->ReadResponseStatus(std::chrono::seconds(3));
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  }
  // Bad magic.
  {
    auto raw = RawConnection::Open(kvd_->tcp_address());
    ASSERT_TRUE(raw.ok());
    const char junk[] = "GET / HTTP/1.1\r\n\r\n";
    ASSERT_TRUE((*raw)->Write(junk, sizeof junk - 1).ok());
    EXPECT_TRUE((*raw)->ClosedByPeer(std::chrono::seconds(3)));
  }
  ExpectServes(*good_, 4);
}

TEST_F(BadInputE2eTest, WrongPutByteCountAndChecksumMismatch) {
  auto o = kvd_->EngineOptions("sloppy");
  o.verify_locally = false;
  auto bad = ConnectOrFail(o);
  ASSERT_NE(bad, nullptr);
  auto data = RandomBytes(o.layout.ChunkBytes(256) - 64, 5);
  auto r = bad->Put({5, 5}, 256, data.data(), data.size());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find(std::to_string(o.layout.ChunkBytes(256))), std::string::npos)
      << r.status();
  ExpectServes(*good_, 5);

  o.verify_locally = true;
  client::TestHooks hooks;
  hooks.corrupt_checksum = 0x1;
  auto corrupt = ConnectOrFail(o, hooks);
  ASSERT_NE(corrupt, nullptr);
  auto full = RandomBytes(o.layout.ChunkBytes(256), 6);
  r = corrupt->Put({6, 6}, 256, full.data(), full.size());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
  EXPECT_EQ(Present(*good_, {6, 6}), 0u);
  EXPECT_TRUE(
      Eventually([&] { return HostTier(*admin_).reserved_bytes == 0; }, std::chrono::seconds(2)));
}

// A raw engine session (its own UCX worker for the address) to send what the library never does.
TEST_F(BadInputE2eTest, CommitOfAnUnknownReservationIsNotFound) {
  transport::TransportOptions to;
  auto& ucx = transport::MutableBackendOptions<transport::UcxOptions>(&to);
  ucx.ucx_tls = "tcp";
  ucx.net_devices = "lo";
  auto t = transport::CreateTransport(to);
  ASSERT_TRUE(t.ok()) << t.status();
  auto addr = (*t)->LocalAddress();
  ASSERT_TRUE(addr.ok());
  auto raw = RawConnection::Open(kvd_->tcp_address());
  ASSERT_TRUE(raw.ok());
  auto send = [&](auto fill) {
    capnp::MallocMessageBuilder m;
    auto req = m.initRoot<proto::Request>();
    req.setRequestId(1);
    fill(req);
    auto frame = proto::EncodeFrame(m);
    return (*raw)->Write(frame.data(), frame.size());
  };
  ASSERT_TRUE(send([&](proto::Request::Builder r) {
                auto h = r.initHello();
                h.setProtocolVersion(proto::PROTOCOL_VERSION);
                h.setClientId("raw");
                h.setRole(proto::Role::ENGINE);
                h.setModel("stories260k");
                proto::ToProto(Stories260kLayout(), h.initLayout());
                h.setHashSeedDigest(Digest64("kvd-default-seed"));
                h.setChunkTokens(256);
                h.setWorkerAddress(
                    kj::arrayPtr(reinterpret_cast<const kj::byte*>(addr->data()), addr->size()));
              }).ok());
  ASSERT_TRUE((*raw)->ReadResponseStatus(std::chrono::seconds(3)).ok());
  ASSERT_TRUE(send([](proto::Request::Builder r) {
                auto c = r.initCommit();
                c.setReservationId(987654321);
                c.setChecksum(1);
              }).ok());
  Status s = (*raw)->ReadResponseStatus(std::chrono::seconds(3));
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find("987654321"), std::string::npos) << s;
  ExpectServes(*good_, 7);
}

TEST_F(BadInputE2eTest, ClientKilledMidPutHasItsReservationReclaimed) {
  auto before = HostTier(*admin_);
  auto child = ChildProcess::Spawn({KVD_E2E_DRIVER, "hold", kvd_->tcp_address(), "tcp"});
  ASSERT_TRUE(child.ok()) << child.status();
  auto line = (*child)->ReadLine(std::chrono::seconds(10));
  ASSERT_TRUE(line.ok()) << line.status() << "\n" << kvd_->Log();
  ASSERT_EQ(*line, "SENT");
  EXPECT_GT(HostTier(*admin_).reserved_bytes, before.reserved_bytes);
  auto sessions_with_child = admin_->GetStats()->sessions;
  (*child)->Kill();  // SIGKILL between send and commit
  EXPECT_TRUE(
      Eventually([&] { return HostTier(*admin_).reserved_bytes == 0; }, std::chrono::seconds(5)))
      << "reserved bytes of the killed client were not reclaimed";
  EXPECT_TRUE(Eventually([&] { return admin_->GetStats()->sessions < sessions_with_child; },
                         std::chrono::seconds(5)));
  ExpectServes(*good_, 8);
}

TEST_F(BadInputE2eTest, ClientKilledWhileBytesMoveLeavesNoReservation) {
  for (int delay_ms : {0, 3, 11}) {
    auto child = ChildProcess::Spawn({KVD_E2E_DRIVER, "flood", kvd_->tcp_address(), "tcp"});
    ASSERT_TRUE(child.ok()) << child.status();
    auto line = (*child)->ReadLine(std::chrono::seconds(20));
    ASSERT_TRUE(line.ok()) << line.status() << "\n" << kvd_->Log();
    EXPECT_EQ(line->rfind("PUT ", 0), 0u) << *line;
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    (*child)->Kill();  // SIGKILL somewhere in reserve / send / commit of the next batch
    EXPECT_TRUE(
        Eventually([&] { return HostTier(*admin_).reserved_bytes == 0; }, std::chrono::seconds(5)))
        << "delay " << delay_ms << " ms: reserved bytes were not reclaimed";
    ExpectServes(*good_, 300 + delay_ms);
  }
}

}  // namespace
}  // namespace kvd::e2e
