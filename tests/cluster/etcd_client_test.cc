// The etcd client against a real etcd-server (skipped when etcd is not installed).
#include "kvd/cluster/etcd_client.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <thread>
#include <utility>

#include "etcd_server.h"

namespace kvd::cluster {
namespace {

using std::chrono::milliseconds;

class EtcdClientTest : public cluster_test::EtcdTest {
 protected:
  EtcdClient Client() {
    return EtcdClient({.endpoints = {etcd_->endpoint()},
                       .connect_timeout = milliseconds(500),
                       .request_timeout = milliseconds(1000)});
  }
};

TEST_F(EtcdClientTest, PutAndRangeByPrefixWithBinaryBytes) {
  EtcdClient etcd = Client();
  const std::string binary_value("\x00\xff\x10 v", 5);
  ASSERT_TRUE(etcd.Put("/p/b", "2").ok());
  ASSERT_TRUE(etcd.Put("/p/a", binary_value).ok());
  ASSERT_TRUE(etcd.Put("/q/a", "outside").ok());
  ASSERT_TRUE(etcd.Put("/p", "the prefix itself, no slash").ok());
  auto range = etcd.RangePrefix("/p/");
  ASSERT_TRUE(range.ok()) << range.status();
  ASSERT_EQ(range->kvs.size(), 2u);
  EXPECT_EQ(range->kvs[0].key, "/p/a");
  EXPECT_EQ(range->kvs[0].value, binary_value);
  EXPECT_EQ(range->kvs[1].key, "/p/b");
  EXPECT_EQ(range->kvs[1].value, "2");
  EXPECT_GE(range->revision, 4);
  auto deleted = etcd.Delete("/p/a");
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_EQ(*deleted, 1);
  EXPECT_EQ(etcd.RangePrefix("/p/")->kvs.size(), 1u);
  EXPECT_EQ(etcd.RangePrefix("").status().code(), StatusCode::kInvalidArgument);
}

// The time of etcd's last answer: a reply or a watch message moves it on, a failed call does not.
TEST_F(EtcdClientTest, LastResponseIsTheTimeOfEtcdsLastAnswer) {
  EtcdClient etcd = Client();
  EXPECT_FALSE(etcd.last_response().has_value());
  const auto before_put = std::chrono::steady_clock::now();
  ASSERT_TRUE(etcd.Put("/last/a", "1").ok());
  const auto put = etcd.last_response();
  ASSERT_TRUE(put.has_value());
  EXPECT_GE(*put, before_put);
  EXPECT_LE(*put, std::chrono::steady_clock::now());
  auto watch = etcd.WatchPrefix("/last/", 0);
  ASSERT_TRUE(watch.ok()) << watch.status();
  const auto created = etcd.last_response();  // the watch's "created" message
  ASSERT_TRUE(created.has_value());
  EXPECT_GT(*created, *put);
  // An event on the watch, put by another client, is an answer to this one.
  std::this_thread::sleep_for(milliseconds(5));
  ASSERT_TRUE(Client().Put("/last/b", "2").ok());
  ASSERT_TRUE((*watch)->Next(milliseconds(2000)).ok());
  const auto event = etcd.last_response();
  ASSERT_TRUE(event.has_value());
  EXPECT_GT(*event, *created);
  // Copies share it; an error is no answer.
  EXPECT_EQ(EtcdClient(etcd).last_response(), event);
  watch->reset();
  etcd_->Kill();
  EXPECT_FALSE(etcd.Put("/last/c", "3").ok());
  EXPECT_EQ(etcd.last_response(), event);
}

// etcdctl's form of an endpoint, with the scheme, works as well as host:port.
TEST_F(EtcdClientTest, AnEndpointWithTheHttpSchemeWorks) {
  EtcdClient etcd({.endpoints = {"http://" + etcd_->endpoint()},
                   .connect_timeout = milliseconds(500),
                   .request_timeout = milliseconds(1000)});
  ASSERT_TRUE(etcd.Put("/scheme/a", "1").ok());
  auto range = etcd.RangePrefix("/scheme/");
  ASSERT_TRUE(range.ok()) << range.status();
  ASSERT_EQ(range->kvs.size(), 1u);
  EXPECT_EQ(range->kvs[0].value, "1");
}

TEST_F(EtcdClientTest, LeaseKeepsKeyUntilRevokedThenIsGone) {
  EtcdClient etcd = Client();
  auto lease = etcd.LeaseGrant(30);
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_NE(lease->id, 0);
  EXPECT_EQ(lease->ttl_s, 30);
  ASSERT_TRUE(etcd.Put("/l/x", "leased", lease->id).ok());
  auto range = etcd.RangePrefix("/l/");
  ASSERT_EQ(range->kvs.size(), 1u);
  EXPECT_EQ(range->kvs[0].lease, lease->id);
  auto kept = etcd.LeaseKeepAlive(lease->id);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->ttl_s, 30);
  auto ttl = etcd.LeaseTimeToLive(lease->id);
  ASSERT_TRUE(ttl.ok()) << ttl.status();
  EXPECT_GT(ttl->ttl_s, 0);
  EXPECT_EQ(ttl->granted_ttl_s, 30);

  ASSERT_TRUE(etcd.LeaseRevoke(lease->id).ok());
  EXPECT_TRUE(etcd.RangePrefix("/l/")->kvs.empty());  // the key went with its lease
  EXPECT_EQ(etcd.LeaseKeepAlive(lease->id).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(etcd.LeaseTimeToLive(lease->id)->ttl_s, -1);
  EXPECT_EQ(etcd.Put("/l/y", "v", lease->id).code(), StatusCode::kNotFound);
  EXPECT_EQ(etcd.LeaseRevoke(lease->id).code(), StatusCode::kNotFound);
}

TEST_F(EtcdClientTest, LeaseNotKeptAliveExpiresWithItsKey) {
  EtcdClient etcd = Client();
  auto lease = etcd.LeaseGrant(2);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_TRUE(etcd.Put("/e/x", "v", lease->id).ok());
  const auto start = std::chrono::steady_clock::now();
  bool gone = false;
  while (!gone && std::chrono::steady_clock::now() - start < std::chrono::seconds(8)) {
    gone = etcd.RangePrefix("/e/")->kvs.empty();
    if (!gone) usleep(100000);
  }
  EXPECT_TRUE(gone);
  EXPECT_EQ(etcd.LeaseKeepAlive(lease->id).status().code(), StatusCode::kNotFound);
}

TEST_F(EtcdClientTest, WatchStreamsPutsAndDeletesUnderThePrefixOnly) {
  EtcdClient etcd = Client();
  ASSERT_TRUE(etcd.Put("/w/before", "1").ok());
  auto range = etcd.RangePrefix("/w/");
  ASSERT_TRUE(range.ok());
  auto watch = etcd.WatchPrefix("/w/", range->revision + 1);
  ASSERT_TRUE(watch.ok()) << watch.status();
  // Nothing yet: the wait ends by its timeout, the watch stays usable.
  EXPECT_EQ((*watch)->Next(milliseconds(100)).status().code(), StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(etcd.Put("/x/elsewhere", "no").ok());
  ASSERT_TRUE(etcd.Put("/w/a", "va").ok());
  ASSERT_TRUE(etcd.Delete("/w/before").ok());
  std::vector<WatchEvent> events;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (events.size() < 2 && std::chrono::steady_clock::now() < deadline) {
    auto got = (*watch)->Next(milliseconds(500));
    if (got.ok()) events.insert(events.end(), got->begin(), got->end());
  }
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].type, WatchEvent::Type::kPut);
  EXPECT_EQ(events[0].kv.key, "/w/a");
  EXPECT_EQ(events[0].kv.value, "va");
  EXPECT_EQ(events[1].type, WatchEvent::Type::kDelete);
  EXPECT_EQ(events[1].kv.key, "/w/before");
  EXPECT_GT((*watch)->revision(), range->revision);
}

TEST_F(EtcdClientTest, InterruptEndsAWaitingNextAndEveryLaterOne) {
  EtcdClient etcd = Client();
  auto watch = etcd.WatchPrefix("/i/", 0);
  ASSERT_TRUE(watch.ok()) << watch.status();
  Status waited;
  std::thread waiter([&] { waited = (*watch)->Next(milliseconds(20000)).status(); });
  usleep(200000);  // the waiter is (most likely) inside Next; either way it must end CANCELLED
  (*watch)->Interrupt();
  waiter.join();
  EXPECT_EQ(waited.code(), StatusCode::kCancelled) << waited;
  ASSERT_TRUE(etcd.Put("/i/a", "1").ok());  // an event: still CANCELLED
  EXPECT_EQ((*watch)->Next(milliseconds(500)).status().code(), StatusCode::kCancelled);
  EXPECT_EQ((*watch)->Next(milliseconds(0)).status().code(), StatusCode::kCancelled);
}

TEST_F(EtcdClientTest, WatchEndsUnavailableWhenEtcdDies) {
  EtcdClient etcd = Client();
  auto watch = etcd.WatchPrefix("/d/", 0);
  ASSERT_TRUE(watch.ok()) << watch.status();
  etcd_->Kill();
  const auto start = std::chrono::steady_clock::now();
  Status ended;
  while (std::chrono::steady_clock::now() - start < std::chrono::seconds(5)) {
    ended = (*watch)->Next(milliseconds(200)).status();
    if (ended.code() != StatusCode::kDeadlineExceeded) break;
  }
  EXPECT_EQ(ended.code(), StatusCode::kUnavailable) << ended;
}

TEST_F(EtcdClientTest, SecondEndpointAnswersWhenTheFirstIsDown) {
  const std::string dead = "127.0.0.1:" + std::to_string(cluster_test::FreePort("127.0.0.1"));
  EtcdClient etcd({.endpoints = {dead, etcd_->endpoint()}});
  EXPECT_TRUE(etcd.Put("/f/a", "1").ok());
  EXPECT_EQ(etcd.RangePrefix("/f/")->kvs.size(), 1u);
}

// No etcd needed below.

TEST(EtcdClientUnreachable, NobodyListeningIsUnavailableNamingTheEndpoint) {
  const std::string dead = "127.0.0.1:" + std::to_string(cluster_test::FreePort("127.0.0.1"));
  EtcdClient etcd({.endpoints = {dead}});
  const auto start = std::chrono::steady_clock::now();
  auto lease = etcd.LeaseGrant(5);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  EXPECT_EQ(lease.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(lease.status().message().find(dead), std::string::npos) << lease.status();
  EXPECT_EQ(etcd.WatchPrefix("/a/", 0).status().code(), StatusCode::kUnavailable);
}

TEST(EtcdClientUnreachable, SilentPeerIsDeadlineExceededWithinTheTimeout) {
  // A socket that accepts connections (the kernel's backlog) and never answers.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(fd, 8), 0);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  EtcdClient etcd({.endpoints = {"127.0.0.1:" + std::to_string(ntohs(addr.sin_port))},
                   .request_timeout = milliseconds(300)});
  const auto start = std::chrono::steady_clock::now();
  Status s = etcd.Put("/a", "b");
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s;
  EXPECT_GE(took, milliseconds(250));
  EXPECT_LT(took, milliseconds(2000));
  EXPECT_EQ(etcd.WatchPrefix("/a/", 0).status().code(), StatusCode::kDeadlineExceeded);
  ::close(fd);
}

// A one-connection HTTP server on loopback that answers any request with `body` (status 200).
class CannedGateway {
 public:
  explicit CannedGateway(std::string body) : body_(std::move(body)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    ::listen(fd_, 1);
    socklen_t len = sizeof addr;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    endpoint_ = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
    thread_ = std::thread([this] {
      int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      char buf[4096];
      ssize_t n = ::read(c, buf, sizeof buf);  // the whole small request
      (void)n;
      const std::string reply =
          "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
          "Content-Length: " +
          std::to_string(body_.size()) + "\r\n\r\n" + body_;
      n = ::write(c, reply.data(), reply.size());
      ::close(c);
    });
  }
  ~CannedGateway() {
    ::shutdown(fd_, SHUT_RDWR);
    thread_.join();
    ::close(fd_);
  }
  const std::string& endpoint() const { return endpoint_; }

 private:
  std::string body_, endpoint_;
  int fd_ = -1;
  std::thread thread_;
};

TEST(EtcdClientBadReplies, AreInternalErrorsNotCrashes) {
  {
    CannedGateway gateway("not json");
    Status s = EtcdClient({.endpoints = {gateway.endpoint()}}).Put("/a", "b");
    EXPECT_EQ(s.code(), StatusCode::kInternal) << s;
  }
  {
    CannedGateway gateway(R"({"code": 5, "message": 7})");  // an error object of the wrong shape
    Status s = EtcdClient({.endpoints = {gateway.endpoint()}}).Put("/a", "b");
    EXPECT_EQ(s.code(), StatusCode::kInternal) << s;
  }
  {
    CannedGateway gateway(R"({"code": 7, "message": "etcdserver: permission denied"})");
    Status s = EtcdClient({.endpoints = {gateway.endpoint()}}).Put("/a", "b");
    EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s;
  }
  {
    CannedGateway gateway(R"({"kvs": [{"key": "!!!!!"}]})");  // not base64
    auto r = EtcdClient({.endpoints = {gateway.endpoint()}}).RangePrefix("/a/");
    EXPECT_EQ(r.status().code(), StatusCode::kInternal) << r.status();
  }
}

TEST(EtcdClientBadReplies, EveryGrpcCodeMapsOntoKvdsCode) {
  // gRPC's codes by number (grpc/status.h); UNKNOWN, INTERNAL and codes past 16 are INTERNAL.
  const std::pair<int, StatusCode> cases[] = {
      {0, StatusCode::kOk},
      {1, StatusCode::kCancelled},
      {2, StatusCode::kInternal},
      {3, StatusCode::kInvalidArgument},
      {4, StatusCode::kDeadlineExceeded},
      {5, StatusCode::kNotFound},
      {6, StatusCode::kAlreadyExists},
      {7, StatusCode::kPermissionDenied},
      {8, StatusCode::kResourceExhausted},
      {9, StatusCode::kFailedPrecondition},
      {10, StatusCode::kAborted},
      {11, StatusCode::kOutOfRange},
      {12, StatusCode::kUnimplemented},
      {13, StatusCode::kInternal},
      {14, StatusCode::kUnavailable},
      {15, StatusCode::kDataLoss},
      {16, StatusCode::kPermissionDenied},
      {17, StatusCode::kInternal},
      {-1, StatusCode::kInternal},
  };
  for (const auto& [grpc, want] : cases) {
    CannedGateway gateway(R"({"code": )" + std::to_string(grpc) + R"(, "message": "m"})");
    Status s = EtcdClient({.endpoints = {gateway.endpoint()}}).Put("/a", "b");
    EXPECT_EQ(s.code(), want) << "gRPC code " << grpc << ": " << s;
    if (want == StatusCode::kInternal) {
      EXPECT_NE(s.message().find("gRPC code " + std::to_string(grpc)), std::string::npos) << s;
    }
  }
}

TEST(EtcdClientOptions, ValidateNamesTheBadEndpoint) {
  EXPECT_EQ(EtcdClientOptions{}.Validate().code(), StatusCode::kInvalidArgument);
  Status s = EtcdClientOptions{.endpoints = {"127.0.0.1"}}.Validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("127.0.0.1"), std::string::npos);
  EtcdClientOptions good{.endpoints = {"localhost:2379", "[::1]:2379", "http://10.0.0.5:2379"}};
  EXPECT_TRUE(good.Validate().ok());
  // kvd speaks plain HTTP to etcd: a TLS endpoint is refused, saying so.
  s = EtcdClientOptions{.endpoints = {"https://10.0.0.5:2379"}}.Validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("https"), std::string::npos) << s;
}

TEST(PrefixRangeEnd, IncrementsTheLastByteBelow0xff) {
  EXPECT_EQ(PrefixRangeEnd("/kvd/"), "/kvd0");
  EXPECT_EQ(PrefixRangeEnd(std::string("a\xff", 2)), "b");
}

}  // namespace
}  // namespace kvd::cluster
