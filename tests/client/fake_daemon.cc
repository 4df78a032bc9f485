#include "fake_daemon.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "kvd/client/client.h"
#include "kvd/proto/convert.h"
#include "kvd/proto/frame.h"
#include "kvd/proto/kvd.capnp.h"

namespace kvd::client::testing {
namespace {

bool ReadExact(int fd, uint8_t* p, size_t n) {
  while (n > 0) {
    ssize_t r = ::recv(fd, p, n, 0);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

void WriteFrame(int fd, capnp::MessageBuilder& m) {
  auto bytes = proto::EncodeFrame(m);
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t w = ::send(fd, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (w <= 0) return;
    done += static_cast<size_t>(w);
  }
}

std::string Kind(proto::Request::Reader r) {
  switch (r.which()) {
    case proto::Request::HELLO:
      return "hello";
    case proto::Request::LOOKUP:
      return "lookup";
    case proto::Request::RESERVE:
      return "reserve";
    case proto::Request::COMMIT:
      return "commit";
    case proto::Request::ABORT:
      return "abort";
    case proto::Request::GET:
      return "get";
    case proto::Request::RELEASE_LEASE:
      return "release";
    case proto::Request::STATS:
      return "stats";
    case proto::Request::LIST:
      return "list";
    case proto::Request::EVICT:
      return "evict";
    case proto::Request::HEALTH:
      return "health";
    case proto::Request::BYE:
      return "bye";
    case proto::Request::CALIBRATION:
      return "calibration";
    case proto::Request::WEIGHTS:
      return "weights";
    case proto::Request::INLINE_PUT:  // never announced: counted to show none is sent
      return "inline_put";
    default:
      break;
  }
  return "?";
}

}  // namespace

FakeDaemon::FakeDaemon(std::string domain, FakeDaemonBehavior behavior)
    : domain_(std::move(domain)), behavior_(std::move(behavior)) {
  char tmpl[] = "/tmp/kvd-fake-XXXXXX";
  dir_ = ::mkdtemp(tmpl);
  path_ = dir_ + "/kvd.sock";
  transport::TransportOptions o;
  o.backend = "loopback";
  transport::MutableBackendOptions<transport::LoopbackOptions>(&o).loopback_domain = domain_;
  transport_ = std::move(transport::CreateTransport(o)).value();
  listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un sun{};
  sun.sun_family = AF_UNIX;
  std::strncpy(sun.sun_path, path_.c_str(), sizeof sun.sun_path - 1);
  ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&sun), sizeof sun);
  ::listen(listen_fd_, 8);
  thread_ = std::thread([this] { Serve(); });
}

FakeDaemon::~FakeDaemon() {
  Stop();
  ::unlink(path_.c_str());
  ::rmdir(dir_.c_str());
}

void FakeDaemon::Stop() {
  if (stop_.exchange(true)) return;
  if (thread_.joinable()) thread_.join();
  ::close(listen_fd_);
}

size_t FakeDaemon::stored_chunks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return chunks_.size();
}

int FakeDaemon::seen(const std::string& kind) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = seen_.find(kind);
  return it == seen_.end() ? 0 : it->second;
}

void FakeDaemon::Serve() {
  while (!stop_) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, 20) <= 0) continue;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    ServeConnection(fd);
    ::close(fd);
  }
}

void FakeDaemon::ServeConnection(int fd) {
  transport::PeerHandle peer;
  struct Reservation {
    Hash128 hash;
    std::vector<uint8_t> bytes;
    transport::TransferHandle recv;
  };
  std::map<uint64_t, std::unique_ptr<Reservation>> reservations;
  std::map<uint64_t, std::vector<Hash128>> leases;
  uint64_t next_id = 1;
  bool hung = false;
  auto drop = [&](Reservation& r) {
    transport_->Cancel(r.recv).IgnoreError();
    transport_->Wait(r.recv, std::chrono::milliseconds(1000)).IgnoreError();
    transport_->Release(r.recv).IgnoreError();
  };
  while (!stop_) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 20) <= 0) continue;
    uint8_t header[proto::kFrameHeaderBytes];
    if (!ReadExact(fd, header, sizeof header)) break;
    auto len = proto::ParseFrameHeader(header, proto::kDefaultMaxFrameBytes);
    if (!len.ok()) break;
    std::vector<uint8_t> payload(*len);
    if (!ReadExact(fd, payload.data(), payload.size())) break;
    auto msg = std::move(proto::DecodePayload(payload)).value();
    auto req = msg->Root<proto::Request>();
    std::string kind = Kind(req);
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++seen_[kind];
      // A client must not send these to a daemon that did not offer to take them.
      if (req.hasReleaseLeases()) ++seen_["releaseLeases"];
    }
    if (hung) continue;
    if (kind == behavior_.close_on) break;
    if (kind == behavior_.hang_on) {
      hung = true;
      continue;
    }
    capnp::MallocMessageBuilder out;
    auto resp = out.initRoot<proto::Response>();
    resp.setRequestId(req.getRequestId());
    auto fail = [&](Status s) { proto::ToProto(s, resp.initError()); };
    switch (req.which()) {
      case proto::Request::HELLO: {
        auto h = req.getHello();
        if (!behavior_.refuse_hello.empty()) {
          fail(Status::FailedPrecondition(behavior_.refuse_hello));
          WriteFrame(fd, out);
          return;
        }
        if (h.getRole() == proto::Role::ENGINE) {
          auto a = h.getWorkerAddress();
          peer = std::move(transport_->Connect(std::string_view(
                               reinterpret_cast<const char*>(a.begin()), a.size())))
                     .value();
        }
        auto r = resp.initHello();
        r.setSessionId(7);
        r.setDaemonVersion("fake");
        r.setNodeName("fake-node");
        r.setChunkTokens(h.getChunkTokens());
        std::string me = std::move(transport_->LocalAddress()).value();
        r.setWorkerAddress(kj::arrayPtr(reinterpret_cast<const kj::byte*>(me.data()), me.size()));
        r.setTransport("loopback");
        if (behavior_.predates_inline_put) r.setMaxFrameBytes(proto::kDefaultMaxFrameBytes);
        break;
      }
      case proto::Request::INLINE_PUT:  // never announced (HelloReply.inlinePut)
        fail(Status::Unimplemented("fake daemon: " + kind));
        break;
      case proto::Request::RESERVE: {
        auto rv = req.getReserve();
        Hash128 h = proto::FromProto(rv.getChunkHash());
        auto r = resp.initReserve();
        std::lock_guard<std::mutex> lock(mu_);
        if (chunks_.count(h)) {
          r.setAlreadyStored(true);
          break;
        }
        auto res = std::make_unique<Reservation>();
        res->hash = h;
        res->bytes.resize(rv.getBytes());
        uint64_t id = next_id++;
        res->recv =
            std::move(transport_->PostRecv(peer, 1000 + id, res->bytes.data(), res->bytes.size()))
                .value();
        r.setReservationId(id);
        r.setTag(1000 + id);
        r.setTtlMs(1000);
        reservations[id] = std::move(res);
        break;
      }
      case proto::Request::COMMIT: {
        auto c = req.getCommit();
        auto it = reservations.find(c.getReservationId());
        if (it == reservations.end()) {
          fail(Status::NotFound("unknown reservation " + std::to_string(c.getReservationId())));
          break;
        }
        Status s = transport_->Wait(it->second->recv, std::chrono::milliseconds(2000));
        transport_->Release(it->second->recv).IgnoreError();
        if (s.ok() &&
            Checksum64(it->second->bytes.data(), it->second->bytes.size()) != c.getChecksum()) {
          s = Status::DataLoss("checksum mismatch at commit");
        }
        if (!s.ok()) {
          fail(s);
        } else {
          resp.initCommit().setBytes(it->second->bytes.size());
          std::lock_guard<std::mutex> lock(mu_);
          chunks_[it->second->hash] = std::move(it->second->bytes);
        }
        reservations.erase(it);
        break;
      }
      case proto::Request::ABORT:
        if (auto it = reservations.find(req.getAbort().getReservationId());
            it != reservations.end()) {
          drop(*it->second);
          reservations.erase(it);
        }
        resp.setAck();
        break;
      case proto::Request::LOOKUP: {
        std::vector<Hash128> matched;
        {
          std::lock_guard<std::mutex> lock(mu_);
          for (auto h : req.getLookup().getChain()) {
            Hash128 k = proto::FromProto(h);
            if (!chunks_.count(k)) break;
            matched.push_back(k);
          }
        }
        auto r = resp.initLookup();
        r.setMatchedChunks(static_cast<uint32_t>(matched.size()));
        r.setMatchedTokens(matched.size() * 32);
        if (!matched.empty()) {
          uint64_t id = next_id++;
          leases[id] = matched;
          r.setLeaseId(id);
          r.setLeaseTtlMs(5000);
        }
        break;
      }
      case proto::Request::GET: {
        auto g = req.getGet();
        auto it = leases.find(g.getLeaseId());
        if (behavior_.get_not_found || it == leases.end() ||
            g.getChunkIndex() >= it->second.size()) {
          fail(Status::NotFound("chunk not found"));
          break;
        }
        std::vector<uint8_t> bytes;
        {
          std::lock_guard<std::mutex> lock(mu_);
          bytes = chunks_[it->second[g.getChunkIndex()]];
        }
        uint64_t checksum = Checksum64(bytes.data(), bytes.size());
        if (behavior_.corrupt_get && !bytes.empty()) bytes[bytes.size() / 2] ^= 0x40;
        Status s = transport_->SendBlocking(peer, g.getTag(), bytes.data(), bytes.size(),
                                            std::chrono::milliseconds(2000));
        if (!s.ok()) {
          fail(s);
          break;
        }
        auto r = resp.initGet();
        r.setBytes(bytes.size());
        r.setChecksum(checksum);
        r.setTokens(32);
        break;
      }
      case proto::Request::RELEASE_LEASE:
        leases.erase(req.getReleaseLease().getLeaseId());
        resp.setAck();
        break;
      case proto::Request::STATS: {
        auto s = resp.initStats();
        s.setNodeName("fake-node");
        auto tiers = s.initTiers(1);
        tiers[0].setName("host");
        tiers[0].setCapacityBytes(1 << 20);
        std::lock_guard<std::mutex> lock(mu_);
        tiers[0].setChunks(chunks_.size());
        auto models = s.initRegisteredModels(1);
        models[0].setName("tiny");
        models[0].setChunkBytes(4096);
        break;
      }
      case proto::Request::HEALTH: {
        auto h = resp.initHealth();
        h.setOk(true);
        h.setStatus("serving");
        break;
      }
      case proto::Request::BYE:
        resp.setAck();
        WriteFrame(fd, out);
        for (auto& [id, r] : reservations) drop(*r);
        if (peer.valid()) transport_->Disconnect(peer).IgnoreError();
        return;
      default:
        fail(Status::Unimplemented("fake daemon: " + kind));
    }
    WriteFrame(fd, out);
  }
  for (auto& [id, r] : reservations) drop(*r);
  if (peer.valid()) transport_->Disconnect(peer).IgnoreError();
}

ModelLayout TinyLayout() {
  ModelLayout l;
  l.num_layers = 2;
  l.num_kv_heads = 2;
  l.num_q_heads = 4;
  l.head_dim = 8;
  l.dtype = DType::kFloat32;
  return l;
}

ClientOptions TinyClientOptions(const FakeDaemon& daemon, const std::string& domain) {
  ClientOptions o;
  o.address = daemon.address();
  o.model = "tiny";
  o.layout = TinyLayout();
  o.chunk_tokens = 32;
  o.block_tokens = 16;
  o.transport.backend = "loopback";
  transport::MutableBackendOptions<transport::LoopbackOptions>(&o.transport).loopback_domain =
      domain;
  o.request_timeout_ms = 2000;
  o.transfer_timeout_ms = 20000;
  return o;
}

void PutAndGetOneHostChunk(const FakeDaemon& daemon, const std::string& domain, Hash128 key) {
  auto client = Client::Connect(TinyClientOptions(daemon, domain));
  ASSERT_TRUE(client.ok()) << client.status();
  std::vector<uint8_t> bytes(8192);  // 32 tokens x 2 layers x 2 heads x (K, V) x 8 x 4 bytes
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7 + key.lo);
  const std::vector<Hash128> chain{key};
  auto put = (*client)->Put(chain[0], 32, bytes.data(), bytes.size());
  ASSERT_TRUE(put.ok()) << put.status();
  auto hit = (*client)->Lookup(chain);
  ASSERT_TRUE(hit.ok()) << hit.status();
  ASSERT_EQ(hit->matched_chunks, 1u);
  std::vector<uint8_t> back(bytes.size());
  const std::vector<GetItem> items{{0, back.data(), back.size()}};
  auto got = (*client)->GetChunks(hit->lease_id, items);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(back, bytes);
}

}  // namespace kvd::client::testing
