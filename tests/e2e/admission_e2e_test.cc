// Admission against a real kvd: the frame buffer budget, connections that never authenticate,
// per-peer counting that another loopback address does not dodge, idle sessions, and log lines
// a peer cannot forge.
#include <gmock/gmock.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <sstream>
#include <thread>

#include "e2e_common.h"
#include "kvd/common/utf8.h"

namespace kvd::e2e {
namespace {

using ::testing::HasSubstr;

// RSS samples until two in a row (100 ms apart) differ by under 1 MiB: the daemon has read what
// it was sent (or gave up on it). At most 5 s.
uint64_t SettledRss(pid_t pid) {
  uint64_t last = RssBytes(pid);
  for (int i = 0; i < 50; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const uint64_t now = RssBytes(pid);
    if ((now > last ? now - last : last - now) < (1u << 20)) return now;
    last = now;
  }
  return last;
}

// A raw connection to a unix socket path that sends nothing; -1 on failure.
int OpenUnix(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un sun{};
  sun.sun_family = AF_UNIX;
  std::snprintf(sun.sun_path, sizeof sun.sun_path, "%s", path.c_str());
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sun), sizeof sun) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Raises this process's open-file limit to at least `n` (kvd, started afterwards, inherits it).
void RaiseFileLimit(rlim_t n) {
  rlimit r{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &r), 0);
  if (r.rlim_cur >= n) return;
  ASSERT_GE(r.rlim_max, n) << "the hard open-file limit is below what the test needs";
  r.rlim_cur = n;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &r), 0);
}

TEST(AdmissionE2eTest, HalfFramesOf400ConnectionsStayWithinTheFrameBudget) {
  KvdConfig c;  // limits.frame_buffer_budget_bytes: the default, 64 MiB
  c.extra_limits = {"max_sessions_per_peer: 1000"};
  auto kvd = StartKvd(c);
  ASSERT_NE(kvd, nullptr);
  auto good = ConnectOrFail(kvd->EngineOptions());
  ASSERT_NE(good, nullptr);
  ExpectServes(*good, 1);
  const uint64_t before = SettledRss(kvd->pid());
  // Each connection authenticates (no tokens here: any Hello does), then sends the header of a
  // 4 MiB frame and half of its payload.
  const uint32_t payload = (4u << 20) - 64;
  uint8_t header[proto::kFrameHeaderBytes];
  proto::EncodeFrameHeader(payload, header);
  const std::vector<uint8_t> half(2u << 20, 0x5a);  // 2 MiB of the 4 MiB payload
  std::vector<std::unique_ptr<RawConnection>> conns;
  int sent = 0;
  for (int i = 0; i < 400; ++i) {
    auto r = OpenAuthenticated(*kvd);
    ASSERT_NE(r, nullptr);
    // kvd may refuse the frame at its header (budget spent) and close: the write then fails.
    if (r->Write(header, sizeof header).ok() && r->Write(half.data(), half.size()).ok()) {
      ++sent;
    }
    conns.push_back(std::move(r));
  }
  const uint64_t after = SettledRss(kvd->pid());
  const double growth_mib = (static_cast<double>(after) - static_cast<double>(before)) / 1048576.0;
  std::printf("400 connections x half of a 4 MiB frame (%d written in full): kvd rss %.1f -> %.1f "
              "MiB (%+.1f MiB; budget 64 MiB)\n",
              sent, before / 1048576.0, after / 1048576.0, growth_mib);
  EXPECT_LE(after, before + (64u << 20));
  ExpectServes(*good, 2);  // the engine is served throughout
  conns.clear();
}

TEST(AdmissionE2eTest, AFrameOverTheBeforeHelloCapIsRefusedAtItsHeader) {
  auto kvd = StartKvd(KvdConfig{});
  ASSERT_NE(kvd, nullptr);
  auto raw = RawConnection::Open(kvd->tcp_address());
  ASSERT_TRUE(raw.ok());
  uint8_t header[proto::kFrameHeaderBytes];
  proto::EncodeFrameHeader(1u << 20, header);
  ASSERT_TRUE((*raw)->Write(header, sizeof header).ok());
  Status s = (*raw)->ReadResponseStatus(std::chrono::seconds(3));
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange) << s;
  EXPECT_THAT(s.message(), HasSubstr("limits.max_frame_bytes_before_hello=16384"));
  EXPECT_TRUE((*raw)->ClosedByPeer(std::chrono::seconds(3)));
}

TEST(AdmissionE2eTest, IdleUnauthenticatedConnectionsLockOutNeitherEnginesNorKvdctl) {
  // 550 over TCP and 550 over the unix socket, none sending a byte: more than max_sessions
  // (1024) + admin_reserve_sessions (16).
  constexpr int kPerSocket = 550;
  ASSERT_NO_FATAL_FAILURE(RaiseFileLimit(4096));
  auto kvd = StartKvd(KvdConfig{});
  ASSERT_NE(kvd, nullptr);
  const std::string unix_path = kvd->unix_address().substr(5);
  std::vector<std::unique_ptr<RawConnection>> tcp;
  std::vector<int> unix_fds;
  for (int i = 0; i < kPerSocket; ++i) {
    auto r = RawConnection::Open(kvd->tcp_address());
    ASSERT_TRUE(r.ok()) << r.status();
    tcp.push_back(std::move(*r));
    const int fd = OpenUnix(unix_path);
    ASSERT_GE(fd, 0) << std::strerror(errno);
    unix_fds.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // kvd accepted them all
  auto engine = client::Client::Connect(kvd->EngineOptions("engine-after-flood"));
  ASSERT_TRUE(engine.ok()) << engine.status();
  ExpectServes(**engine, 1);
  std::string out;
  int rc = RunProgram({KVDCTL_BINARY, "--addr", kvd->unix_address(), "health"}, &out);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_THAT(out, HasSubstr("serving"));
  rc = RunProgram({KVDCTL_BINARY, "--addr", kvd->tcp_address(), "health"}, &out);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_THAT(out, HasSubstr("serving"));
  // The displaced connections were told why.
  Status displaced = tcp.front()->ReadResponseStatus(std::chrono::seconds(3));
  EXPECT_EQ(displaced.code(), StatusCode::kResourceExhausted) << displaced;
  EXPECT_THAT(displaced.message(), HasSubstr("to make room for a newer one"));
  for (int fd : unix_fds) ::close(fd);
}

TEST(AdmissionE2eTest, AnotherLoopbackAddressOrAUnixSocketIsTheSamePeer) {
  KvdConfig c;
  c.extra_limits = {"max_sessions_per_peer: 4"};
  auto kvd = StartKvd(c);
  ASSERT_NE(kvd, nullptr);
  std::vector<std::unique_ptr<RawConnection>> held;
  for (int i = 0; i < 4; ++i) {  // four authenticated sessions from 127.0.0.1
    auto r = OpenAuthenticated(*kvd);
    ASSERT_NE(r, nullptr);
    held.push_back(std::move(r));
  }
  for (const char* source : {"127.0.0.1", "127.0.0.2", "127.1.2.3"}) {
    auto r = RawConnection::Open(kvd->tcp_address(), source);
    ASSERT_TRUE(r.ok()) << r.status();
    Status s = (*r)->ReadResponseStatus(std::chrono::seconds(3));
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << source << ": " << s;
    EXPECT_THAT(s.message(),
                HasSubstr("too many sessions from tcp:loopback: limits.max_sessions_per_peer=4"));
  }
  // Unix-socket peers count by uid: four admin sessions of this user, then a fifth is refused.
  std::vector<std::unique_ptr<client::Client>> unix_sessions;
  auto admin = kvd->AdminOptions();
  admin.address = kvd->unix_address();
  for (int i = 0; i < 4; ++i) {
    auto a = client::Client::Connect(admin);
    ASSERT_TRUE(a.ok()) << a.status();
    unix_sessions.push_back(std::move(*a));
  }
  auto fifth = client::Client::Connect(admin);
  EXPECT_EQ(fifth.status().code(), StatusCode::kResourceExhausted) << fifth.status();
  EXPECT_THAT(fifth.status().message(),
              HasSubstr("too many sessions from uid:" + std::to_string(::getuid())));
  held.pop_back();  // one TCP slot back
  ASSERT_TRUE(Eventually([&] { return client::Client::Connect(kvd->EngineOptions()).ok(); },
                         std::chrono::seconds(5)));
}

TEST(AdmissionE2eTest, IdleSessionsAreClosedUnlessTheyAskToBeKept) {
  KvdConfig c;
  c.extra_limits = {"idle_timeout_ms: 300"};
  auto kvd = StartKvd(c);
  ASSERT_NE(kvd, nullptr);
  auto idle = RawConnection::Open(kvd->tcp_address());
  auto kept = RawConnection::Open(kvd->tcp_address());
  ASSERT_TRUE(idle.ok() && kept.ok());
  const auto plain = AdminHelloFrame(false);
  const auto keep = AdminHelloFrame(true);
  ASSERT_TRUE((*idle)->Write(plain.data(), plain.size()).ok());
  ASSERT_TRUE((*kept)->Write(keep.data(), keep.size()).ok());
  ASSERT_TRUE((*idle)->ReadResponseStatus(std::chrono::seconds(3)).ok());
  ASSERT_TRUE((*kept)->ReadResponseStatus(std::chrono::seconds(3)).ok());
  auto engine = ConnectOrFail(kvd->EngineOptions());  // the kvd client's engines ask
  ASSERT_NE(engine, nullptr);
  EXPECT_TRUE((*idle)->ClosedByPeer(std::chrono::seconds(5)));
  EXPECT_FALSE((*kept)->ClosedByPeer(std::chrono::milliseconds(900)));  // 3x the timeout
  ExpectServes(*engine, 1);
  EXPECT_THAT(kvd->Log(), HasSubstr("closing idle session: no request within limits.idle_timeout_ms"));
}

TEST(AdmissionE2eTest, APeersStringsInTheTextLogAreEscaped) {
  auto kvd = StartKvd(KvdConfig{});
  ASSERT_NE(kvd, nullptr);
  // A refused Hello (unknown model) whose clientId forges a second log line and whose model
  // holds a byte that is not UTF-8.
  const std::string forged = "2026-01-01T00:00:00.000Z I session_data.cc:1] session ready";
  capnp::MallocMessageBuilder m;
  auto req = m.initRoot<proto::Request>();
  req.setRequestId(1);
  auto h = req.initHello();
  h.setProtocolVersion(proto::PROTOCOL_VERSION);
  h.setRole(proto::Role::ENGINE);
  h.setClientId("evil\n" + forged + " client=admin");
  const std::string model = "no-such-model\r\n\xff\xfe";
  h.setModel(capnp::Text::Reader(model.data(), model.size()));
  const auto frame = proto::EncodeFrame(m);
  auto raw = RawConnection::Open(kvd->tcp_address());
  ASSERT_TRUE(raw.ok());
  ASSERT_TRUE((*raw)->Write(frame.data(), frame.size()).ok());
  EXPECT_EQ((*raw)->ReadResponseStatus(std::chrono::seconds(3)).code(), StatusCode::kNotFound);
  ASSERT_TRUE(Eventually([&] { return kvd->Log().find("handshake refused") != std::string::npos; },
                         std::chrono::seconds(3)));
  const std::string log = kvd->Log();
  std::istringstream lines(log);
  std::string line;
  int refused = 0, forged_lines = 0;
  while (std::getline(lines, line)) {
    if (line.find("handshake refused") != std::string::npos) {
      ++refused;
      EXPECT_THAT(line, HasSubstr("client=evil\\n2026-01-01T00:00:00.000Z"));
      EXPECT_THAT(line, HasSubstr("model=no-such-model\\r\\n\\xff\\xfe"));
    }
    if (line.rfind(forged, 0) == 0) ++forged_lines;
  }
  EXPECT_EQ(refused, 1);
  EXPECT_EQ(forged_lines, 0) << log;
  EXPECT_TRUE(IsValidUtf8(log)) << "byte offset " << FirstInvalidUtf8(log);
}

}  // namespace
}  // namespace kvd::e2e
