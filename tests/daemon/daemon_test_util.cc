#include "daemon_test_util.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <random>

#include "kvd/proto/convert.h"

namespace kvd::daemon::testing {

RawClient::RawClient(const std::string& address) {
  if (address.rfind("unix:", 0) == 0) {
    std::string path = address.substr(5);
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::strncpy(sa.sun_path, path.c_str(), sizeof(sa.sun_path) - 1);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) Close();
    return;
  }
  size_t colon = address.rfind(':');
  std::string host = address.substr(0, colon), port = address.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0) return;
  fd_ = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (::connect(fd_, res->ai_addr, res->ai_addrlen) != 0) Close();
  ::freeaddrinfo(res);
}

RawClient::~RawClient() { Close(); }

bool RawClient::Readable() {
  pollfd p{fd_, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

void RawClient::Close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

bool RawClient::SendBytes(std::span<const uint8_t> bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

bool RawClient::Send(capnp::MallocMessageBuilder& request) {
  std::vector<uint8_t> frame = proto::EncodeFrame(request);
  return SendBytes(frame);
}

bool RawClient::ReadExact(uint8_t* out, size_t n, std::chrono::steady_clock::time_point deadline) {
  size_t done = 0;
  while (done < n) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return false;
    ssize_t r = ::recv(fd_, out + done, n - done, 0);
    if (r <= 0) return false;
    done += static_cast<size_t>(r);
  }
  return true;
}

std::unique_ptr<proto::DecodedMessage> RawClient::Read(std::chrono::milliseconds timeout) {
  if (fd_ < 0) return nullptr;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  uint8_t header[proto::kFrameHeaderBytes];
  if (!ReadExact(header, sizeof(header), deadline)) return nullptr;
  auto length = proto::ParseFrameHeader(header, 64u << 20);
  if (!length.ok()) return nullptr;
  std::vector<uint8_t> payload(*length);
  if (!ReadExact(payload.data(), payload.size(), deadline)) return nullptr;
  auto decoded = proto::DecodePayload(payload);
  if (!decoded.ok()) return nullptr;
  return std::move(*decoded);
}

std::unique_ptr<proto::DecodedMessage> RawClient::Call(capnp::MallocMessageBuilder& request) {
  if (!Send(request)) return nullptr;
  return Read();
}

bool RawClient::WaitClosed(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  uint8_t buf[256];
  while (true) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return false;
    ssize_t r = ::recv(fd_, buf, sizeof(buf), 0);
    if (r <= 0) return true;  // EOF or reset
  }
}

namespace {
const DaemonConfig& DefaultConfig() {
  static const DaemonConfig* config = new DaemonConfig();
  return *config;
}
}  // namespace

void BuildHello(capnp::MallocMessageBuilder& mb, const HelloArgs& a, uint64_t rid) {
  auto req = mb.initRoot<proto::Request>();
  req.setRequestId(rid);
  auto h = req.initHello();
  h.setProtocolVersion(a.version);
  h.setClientId("daemon-test");
  h.setRole(a.role);
  h.setNamespace(a.name_space);
  h.setModel(a.model);
  ModelLayout layout;
  if (a.layout) {
    layout = *a.layout;
  } else if (const ModelConfig* m = DefaultConfig().FindModel(a.model)) {
    layout = m->layout;
  }
  proto::ToProto(layout, h.initLayout());
  h.setHashSeedDigest(Digest64(a.seed));
  h.setChunkTokens(a.chunk_tokens);
  h.setWorkerAddress(kj::arrayPtr(reinterpret_cast<const capnp::byte*>(a.worker_address.data()),
                                  a.worker_address.size()));
  h.setCodecId(0);
}

void BuildReserve(capnp::MallocMessageBuilder& mb, Hash128 hash, uint32_t tokens, uint64_t bytes,
                  uint64_t rid) {
  auto req = mb.initRoot<proto::Request>();
  req.setRequestId(rid);
  auto r = req.initReserve();
  proto::ToProto(hash, r.initChunkHash());
  r.setTokens(tokens);
  r.setBytes(bytes);
}

void BuildCommit(capnp::MallocMessageBuilder& mb, uint64_t reservation, uint64_t checksum,
                 uint64_t rid) {
  auto req = mb.initRoot<proto::Request>();
  req.setRequestId(rid);
  auto c = req.initCommit();
  c.setReservationId(reservation);
  c.setChecksum(checksum);
}

void BuildLookup(capnp::MallocMessageBuilder& mb, const std::vector<Hash128>& chain, uint64_t rid) {
  auto req = mb.initRoot<proto::Request>();
  req.setRequestId(rid);
  auto l = req.initLookup();
  auto list = l.initChain(static_cast<unsigned>(chain.size()));
  for (unsigned i = 0; i < chain.size(); ++i) proto::ToProto(chain[i], list[i]);
}

void BuildGet(capnp::MallocMessageBuilder& mb, uint64_t lease, uint32_t index, uint64_t tag,
              uint64_t buffer_bytes, uint64_t rid) {
  auto req = mb.initRoot<proto::Request>();
  req.setRequestId(rid);
  auto g = req.initGet();
  g.setLeaseId(lease);
  g.setChunkIndex(index);
  g.setTag(tag);
  g.setBufferBytes(buffer_bytes);
}

Status ResponseStatus(proto::DecodedMessage& m) {
  auto r = m.Root<proto::Response>();
  if (r.which() != proto::Response::ERROR) return Status::Ok();
  return proto::FromProto(r.getError());
}

transport::TransportOptions LoopbackTransport(const std::string& domain) {
  transport::TransportOptions o;
  o.backend = "loopback";
  transport::MutableBackendOptions<transport::LoopbackOptions>(&o).loopback_domain = domain;
  return o;
}

Status ReplyStatus(const std::unique_ptr<proto::DecodedMessage>& reply) {
  return reply == nullptr ? Status::Unavailable("no reply") : ResponseStatus(*reply);
}

std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

namespace {
std::atomic<int> g_domain_counter{0};
}  // namespace

DaemonTest::DaemonTest() {
  std::string tag = std::to_string(::getpid()) + "-" + std::to_string(g_domain_counter++);
  config_.transport.backend = "loopback";
  loopback_domain_ = "daemon-test-" + tag;
  transport::MutableBackendOptions<transport::LoopbackOptions>(&config_.transport).loopback_domain =
      loopback_domain_;
  config_.transport.close_timeout_ms = 500;
  config_.listen.tcp = "127.0.0.1:0";
  unix_path_ = ::testing::TempDir() + "kvd-test-" + tag + ".sock";
  config_.listen.unix_path = unix_path_;
  config_.host_tier.capacity_bytes = 4u << 20;
  config_.limits.transfer_timeout_ms = 1000;
  deps_.clock = &clock_;
  deps_.expiry_period_ms = 10;
}

DaemonTest::~DaemonTest() { StopDaemon(); }

void DaemonTest::StartDaemon() {
  auto server = Server::Create(config_, std::move(deps_));
  ASSERT_TRUE(server.ok()) << server.status();
  server_ = std::move(*server);
  Status s = server_->Start();
  ASSERT_TRUE(s.ok()) << s;
  run_thread_ = std::thread([this] { server_->Run(); });
}

void DaemonTest::StopDaemon() {
  if (!server_) return;
  server_->Shutdown();
  if (run_thread_.joinable()) run_thread_.join();
  server_.reset();
}

const ModelLayout& DaemonTest::Layout(const std::string& model) const {
  return config_.FindModel(model)->layout;
}

std::unique_ptr<DaemonTest::Engine> DaemonTest::ConnectEngine(const std::string& model) {
  auto e = std::make_unique<Engine>();
  auto t = transport::CreateTransport(config_.transport);  // same backend and domain
  EXPECT_TRUE(t.ok()) << t.status();
  if (!t.ok()) return nullptr;
  e->transport = std::move(*t);
  e->conn = std::make_unique<RawClient>(TcpAddress());
  EXPECT_TRUE(e->conn->connected());
  HelloArgs args;
  args.model = model;
  args.worker_address = e->transport->LocalAddress().value();
  capnp::MallocMessageBuilder mb;
  BuildHello(mb, args);
  auto reply = e->conn->Call(mb);
  EXPECT_NE(reply, nullptr);
  if (reply == nullptr) return nullptr;
  Status s = ResponseStatus(*reply);
  EXPECT_TRUE(s.ok()) << s;
  auto hello = reply->Root<proto::Response>().getHello();
  e->session_id = hello.getSessionId();
  e->lease_releases_on_requests = hello.getLeaseReleasesOnRequests();
  auto addr = hello.getWorkerAddress();
  auto peer = e->transport->Connect(
      std::string_view(reinterpret_cast<const char*>(addr.begin()), addr.size()));
  EXPECT_TRUE(peer.ok()) << peer.status();
  if (!peer.ok()) return nullptr;
  e->daemon_peer = *peer;
  return e;
}

Status DaemonTest::Put(Engine& e, Hash128 hash, uint32_t tokens,
                       const std::vector<uint8_t>& bytes) {
  capnp::MallocMessageBuilder reserve;
  BuildReserve(reserve, hash, tokens, bytes.size());
  auto reply = e.conn->Call(reserve);
  if (reply == nullptr) return Status::Unavailable("no Reserve reply");
  KVD_RETURN_IF_ERROR(ResponseStatus(*reply));
  auto r = reply->Root<proto::Response>().getReserve();
  if (r.getAlreadyStored()) return Status::Ok();
  uint64_t reservation = r.getReservationId();
  uint64_t tag = r.getTag();
  auto send = e.transport->PostSend(e.daemon_peer, tag, bytes.data(), bytes.size());
  KVD_RETURN_IF_ERROR(send.status());
  capnp::MallocMessageBuilder commit;
  BuildCommit(commit, reservation, Checksum64(bytes.data(), bytes.size()));
  if (!e.conn->Send(commit)) return Status::Unavailable("cannot send Commit");
  // This test client has no progress thread: Wait drives its transport until the bytes left.
  Status ws = e.transport->Wait(*send, std::chrono::milliseconds(2000));
  if (!ws.ok()) {
    e.transport->Cancel(*send).IgnoreError();
    e.transport->Wait(*send, std::chrono::milliseconds(1000)).IgnoreError();
  }
  e.transport->Release(*send).IgnoreError();
  auto creply = e.conn->Read();
  if (creply == nullptr) return Status::Unavailable("no Commit reply");
  KVD_RETURN_IF_ERROR(ResponseStatus(*creply));
  return ws;
}

bool DaemonTest::WaitReservedBytes(uint64_t want, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (server_->host_tier()->GetStats().reserved_bytes == want) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

}  // namespace kvd::daemon::testing
