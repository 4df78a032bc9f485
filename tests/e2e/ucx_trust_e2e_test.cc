// A client that speaks UCX beyond kvd's protocol, against a real kvd: it opens an engine session
// of its own namespace (which hands it kvd's transport address), connects a UCX transport with
// RMA to kvd and forges a region over another namespace's chunk in kvd's memory (the address
// read from /proc/<kvd>/mem here, standing for a guess). kvd's default (transport.enable_rma
// false) gives it nothing and lets it change nothing; the control, kvd with enable_rma: true,
// shows the same requests read the chunk and overwrite it.
#include <capnp/message.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "e2e_common.h"
#include "kvd/common/hash.h"
#include "kvd/proto/convert.h"
#include "kvd/proto/frame.h"
#include "kvd/proto/kvd.capnp.h"
#include "kvd/transport/transport.h"
#include "listening_ports.h"

namespace kvd::e2e {
namespace {

using namespace std::chrono_literals;

// Bytes of the victim's chunk the attacker aims at.
constexpr size_t kProbeBytes = 4096;
// How long a forged request may take: with RMA on, milliseconds.
constexpr auto kForgedTimeout = 3000ms;

// Where kvd holds `needle` in its shared-memory arena (its memfd mappings), or NOT_FOUND.
StatusOr<uint64_t> FindInKvdArena(pid_t pid, const uint8_t* needle, size_t size) {
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  int mem = ::open(("/proc/" + std::to_string(pid) + "/mem").c_str(), O_RDONLY | O_CLOEXEC);
  if (mem < 0) return Status::Unavailable(std::string("open /proc/pid/mem: ") + strerror(errno));
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("memfd:") == std::string::npos) continue;
    uint64_t start = 0, end = 0;
    char perms[8] = {};
    if (std::sscanf(line.c_str(), "%lx-%lx %7s", &start, &end, perms) != 3 || perms[0] != 'r') {
      continue;
    }
    std::vector<uint8_t> bytes(end - start);
    if (::pread(mem, bytes.data(), bytes.size(), static_cast<off_t>(start)) !=
        static_cast<ssize_t>(bytes.size())) {
      continue;
    }
    if (void* hit = ::memmem(bytes.data(), bytes.size(), needle, size)) {
      ::close(mem);
      return start + static_cast<uint64_t>(static_cast<uint8_t*>(hit) - bytes.data());
    }
  }
  ::close(mem);
  return Status::NotFound("the chunk is in none of kvd's memfd mappings");
}

class UcxTrustE2eTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    KvdConfig config;
    config.host_capacity = "64MiB";
    config.host_segment = "8MiB";  // the victim's chunk goes straight into a memfd segment
    config.enable_rma = GetParam();
    kvd_ = StartKvd(config);
    ASSERT_NE(kvd_, nullptr);
    client::ClientOptions o = kvd_->UnixEngineOptions("victim");
    o.name_space = "victim";
    victim_ = ConnectOrFail(o);
    ASSERT_NE(victim_, nullptr);
    ASSERT_TRUE(victim_->session().shared_memory) << kvd_->Log();
    chunk_ = RandomBytes(o.layout.ChunkBytes(256), 77);
    auto put = victim_->Put(kChunk, 256, chunk_.data(), chunk_.size());
    ASSERT_TRUE(put.ok()) << put.status();
    auto at = FindInKvdArena(kvd_->pid(), chunk_.data(), kProbeBytes);
    ASSERT_TRUE(at.ok()) << at.status();
    chunk_address_ = *at;
    ASSERT_NO_FATAL_FAILURE(ConnectAttacker());
  }

  // An engine session of namespace "attacker" over a raw connection (for kvd's transport address),
  // then a UCX transport with RMA connected to kvd, and a region forged over the victim's chunk.
  void ConnectAttacker() {
    transport::TransportOptions to;
    auto& ucx = transport::MutableBackendOptions<transport::UcxOptions>(&to);
    ucx.ucx_tls = "tcp";
    ucx.net_devices = "lo";
    ucx.cma_threshold_bytes = 0;
    ucx.enable_rma = true;
    auto t = transport::CreateTransport(to);
    ASSERT_TRUE(t.ok()) << t.status();
    attacker_ = std::move(t).value();
    std::string own_address = *attacker_->LocalAddress();
    auto raw = RawConnection::Open(kvd_->tcp_address());
    ASSERT_TRUE(raw.ok()) << raw.status();
    raw_ = std::move(raw).value();
    capnp::MallocMessageBuilder m;
    auto h = m.initRoot<proto::Request>();
    h.setRequestId(1);
    auto hello = h.initHello();
    hello.setProtocolVersion(proto::PROTOCOL_VERSION);
    hello.setClientId("attacker");
    hello.setRole(proto::Role::ENGINE);
    hello.setNamespace("attacker");
    hello.setModel("stories260k");
    proto::ToProto(Stories260kLayout(), hello.initLayout());
    hello.setHashSeedDigest(Digest64("kvd-default-seed"));
    hello.setChunkTokens(256);
    hello.setWorkerAddress(
        kj::arrayPtr(reinterpret_cast<const kj::byte*>(own_address.data()), own_address.size()));
    auto frame = proto::EncodeFrame(m);
    ASSERT_TRUE(raw_->Write(frame.data(), frame.size()).ok());
    std::string kvd_address;
    Status hello_status = raw_->ReadResponseStatus(5s, &kvd_address);
    ASSERT_TRUE(hello_status.ok()) << hello_status;
    ASSERT_FALSE(kvd_address.empty());
    auto peer = attacker_->Connect(kvd_address);
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
    auto own = attacker_->AllocateRegistered(kProbeBytes);
    ASSERT_TRUE(own.ok()) << own.status();
    auto exported = attacker_->ExportRegion(own->handle);
    ASSERT_TRUE(exported.ok()) << exported.status();
    // ExportRegion's layout: 8 bytes of magic, base address, size, then the packed key.
    const uint64_t size = kProbeBytes;
    std::memcpy(exported->data() + 8, &chunk_address_, 8);
    std::memcpy(exported->data() + 16, &size, 8);
    auto remote = attacker_->ImportRegion(peer_, *exported);
    ASSERT_TRUE(remote.ok()) << remote.status();
    forged_ = *remote;
  }

  // Posts a forged kRead / kWrite of kProbeBytes and waits for it.
  Status Forged(transport::TransferOp op, uint8_t* buffer) {
    transport::TransferRequest r;
    r.op = op;
    r.peer = peer_;
    r.buffer = buffer;
    r.length = kProbeBytes;
    r.remote = forged_;
    auto h = attacker_->Post(r);
    if (!h.ok()) return h.status();
    return attacker_->Wait(*h, kForgedTimeout);  // an unanswered request stays in flight
  }

  // The victim's chunk as a get returns it (an error when kvd finds it corrupt).
  StatusOr<std::vector<uint8_t>> VictimGet() {
    Hash128 chain[] = {kChunk};
    KVD_ASSIGN_OR_RETURN(client::LookupResult l, victim_->Lookup(chain));
    if (l.matched_chunks != 1) return Status::NotFound("the victim's chunk is gone");
    std::vector<uint8_t> out(chunk_.size());
    KVD_ASSIGN_OR_RETURN(client::GetResult g, victim_->Get(l.lease_id, 0, out.data(), out.size()));
    out.resize(g.bytes);
    return out;
  }

  // kvd still serves: the victim puts and reads back a new chunk.
  void ExpectKvdServes() {
    ASSERT_TRUE(kvd_->Alive()) << kvd_->Log();
    ExpectServes(*victim_, 78);
  }

  static constexpr Hash128 kChunk{0x5ec7e7, 1};
  std::unique_ptr<KvdProcess> kvd_;
  std::unique_ptr<client::Client> victim_;
  std::vector<uint8_t> chunk_;
  uint64_t chunk_address_ = 0;
  std::unique_ptr<transport::Transport> attacker_;
  std::unique_ptr<RawConnection> raw_;
  transport::PeerHandle peer_;
  transport::RemoteRegionHandle forged_;
};

TEST_P(UcxTrustE2eTest, ForgedReadOfAnotherNamespacesChunk) {
  // kvd says so at start when RMA is on.
  EXPECT_EQ(kvd_->Log().find("transport.enable_rma is on") != std::string::npos, GetParam());
  std::vector<uint8_t> got(kProbeBytes, 0);
  Status s = Forged(transport::TransferOp::kRead, got.data());
  const bool leaked = std::memcmp(got.data(), chunk_.data(), kProbeBytes) == 0;
  if (GetParam()) {  // the control: kvd with enable_rma: true
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_TRUE(leaked) << "the control did not read the chunk: the test's attack is broken";
  } else {
    EXPECT_FALSE(s.ok()) << "the target acknowledged a forged request";
    EXPECT_FALSE(leaked) << "another namespace's chunk reached the attacker";
    EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](uint8_t b) { return b == 0; }));
  }
  ASSERT_NO_FATAL_FAILURE(ExpectKvdServes());
}

TEST_P(UcxTrustE2eTest, ForgedWriteOverAnotherNamespacesChunk) {
  std::vector<uint8_t> evil(kProbeBytes, 0xAB);
  Status s = Forged(transport::TransferOp::kWrite, evil.data());
  auto got = VictimGet();
  if (GetParam()) {
    EXPECT_TRUE(s.ok()) << s;
    // kvd refuses the corrupted chunk, or the victim gets the attacker's bytes.
    EXPECT_FALSE(got.ok() && *got == chunk_) << "the control did not change the chunk";
  } else {
    EXPECT_FALSE(s.ok()) << "the target acknowledged a forged request";
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(*got == chunk_) << "a forged write changed another namespace's chunk";
  }
  ASSERT_NO_FATAL_FAILURE(ExpectKvdServes());
}

// transport.backend: none: kvd opens no UCX listener at all (so nothing on the node can reach
// its memory through UCX), serves engines on the shared-memory path byte-exact, and refuses at
// the handshake, naming the setting, an engine that would need the transport.
TEST(TransportNoneE2eTest, NoUcxListenerSharedMemoryServedOthersRefusedAtHello) {
  KvdConfig config;
  config.host_capacity = "64MiB";
  config.host_segment = "8MiB";
  auto ucx = StartKvd(config);  // the comparison: the default backend listens for UCX too
  ASSERT_NE(ucx, nullptr);
  const size_t ucx_ports = test_support::ListeningTcpPorts(ucx->pid()).size();
  ucx.reset();
  config.transport_backend = "none";
  auto kvd = StartKvd(config);
  ASSERT_NE(kvd, nullptr);
  const std::set<uint16_t> ports = test_support::ListeningTcpPorts(kvd->pid());
  const std::string control = kvd->tcp_address().substr(kvd->tcp_address().rfind(':') + 1);
  EXPECT_EQ(ports, std::set<uint16_t>{static_cast<uint16_t>(std::stoul(control))})
      << "kvd listens on more than its control port";
  EXPECT_EQ(ucx_ports, 2u) << "with UCX: the control port and UCX's tcp";

  auto shm = ConnectOrFail(kvd->UnixEngineOptions("shm"));
  ASSERT_NE(shm, nullptr);
  ASSERT_TRUE(shm->session().shared_memory);
  ExpectServes(*shm, 79);

  client::ClientOptions no_shm = kvd->UnixEngineOptions("no-shm");
  no_shm.shared_memory = false;
  for (const client::ClientOptions& o : {kvd->EngineOptions("tcp"), no_shm}) {
    auto c = client::Client::Connect(o);
    ASSERT_FALSE(c.ok()) << o.client_id << " was served without shared memory";
    EXPECT_EQ(c.status().code(), StatusCode::kFailedPrecondition) << c.status();
    EXPECT_NE(c.status().message().find("transport.backend: none"), std::string::npos)
        << c.status();
  }
  ASSERT_TRUE(kvd->Alive()) << kvd->Log();
  ExpectServes(*shm, 80);
}

INSTANTIATE_TEST_SUITE_P(EnableRma, UcxTrustE2eTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("ControlRmaOn")
                                             : std::string("DefaultRmaOff");
                         });

}  // namespace
}  // namespace kvd::e2e
