// In-process daemon fixture and a raw-frame client for the daemon tests.
//
// The fixture runs a kvd::daemon::Server on the loopback transport (a domain of its own per
// test), an ephemeral TCP port and a temp unix socket, with a ManualClock driving every TTL.
// RawClient speaks frames over a blocking socket with poll() timeouts, so a test can send
// anything (truncated frames, garbage) and see exactly what the daemon answers.
#pragma once

#include <capnp/message.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "kvd/common/clock.h"
#include "kvd/common/hash.h"
#include "kvd/daemon/config.h"
#include "kvd/daemon/server.h"
#include "kvd/proto/frame.h"
#include "kvd/proto/kvd.capnp.h"
#include "kvd/transport/loopback_options.h"
#include "kvd/transport/transport.h"

namespace kvd::daemon::testing {

// A blocking control connection. Not thread-safe.
class RawClient {
 public:
  // "unix:/path" or "host:port". Asserts nothing; check connected().
  explicit RawClient(const std::string& address);
  ~RawClient();
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  bool connected() const { return fd_ >= 0; }
  // Writes raw bytes. false on error.
  bool SendBytes(std::span<const uint8_t> bytes);
  // Sends one Request (fills requestId automatically from a counter unless set).
  bool Send(capnp::MallocMessageBuilder& request);
  // Reads one Response frame; nullptr on timeout, EOF or a bad frame.
  std::unique_ptr<proto::DecodedMessage> Read(
      std::chrono::milliseconds timeout = std::chrono::milliseconds(5000));
  // Sends and reads the reply.
  std::unique_ptr<proto::DecodedMessage> Call(capnp::MallocMessageBuilder& request);
  // True once the daemon closed the connection (EOF) within `timeout`.
  bool WaitClosed(std::chrono::milliseconds timeout = std::chrono::milliseconds(5000));
  void Close();
  // True if a reply (or EOF) can be read now.
  bool Readable();

 private:
  bool ReadExact(uint8_t* out, size_t n, std::chrono::steady_clock::time_point deadline);
  int fd_ = -1;
};

// Request builders.
struct HelloArgs {
  proto::Role role = proto::Role::ENGINE;
  std::string model = "stories260k";
  std::optional<ModelLayout> layout;  // default: the model's registered layout
  std::string seed = "kvd-default-seed";
  uint32_t chunk_tokens = 256;
  uint32_t version = proto::PROTOCOL_VERSION;
  std::string worker_address;
  std::string name_space;
};
void BuildHello(capnp::MallocMessageBuilder& mb, const HelloArgs& args, uint64_t rid = 1);
void BuildReserve(capnp::MallocMessageBuilder& mb, Hash128 hash, uint32_t tokens, uint64_t bytes,
                  uint64_t rid = 2);
void BuildCommit(capnp::MallocMessageBuilder& mb, uint64_t reservation, uint64_t checksum,
                 uint64_t rid = 3);
void BuildLookup(capnp::MallocMessageBuilder& mb, const std::vector<Hash128>& chain,
                 uint64_t rid = 4);
void BuildGet(capnp::MallocMessageBuilder& mb, uint64_t lease, uint32_t index, uint64_t tag,
              uint64_t buffer_bytes, uint64_t rid = 5);

// Status of an Error response (OK if the response is not an error).
Status ResponseStatus(proto::DecodedMessage& m);
// The same for a reply that may not have come (nullptr: UNAVAILABLE "no reply").
Status ReplyStatus(const std::unique_ptr<proto::DecodedMessage>& reply);

// Transport options of the in-process loopback backend in `domain` (a test's daemon, its engines
// and their NCCL links each meet in one domain).
transport::TransportOptions LoopbackTransport(const std::string& domain);

class DaemonTest : public ::testing::Test {
 protected:
  // Tests may edit config_ before calling StartDaemon().
  DaemonTest();
  ~DaemonTest() override;

  void StartDaemon();
  void StopDaemon();

  // A connected engine client: transport (same loopback domain), control connection, Hello done.
  struct Engine {
    std::unique_ptr<transport::Transport> transport;
    transport::PeerHandle daemon_peer;
    std::unique_ptr<RawClient> conn;
    uint64_t session_id = 0;
    bool lease_releases_on_requests = false;  // HelloReply.leaseReleasesOnRequests
  };
  std::unique_ptr<Engine> ConnectEngine(const std::string& model = "stories260k");

  // Full put of `bytes` under `hash`: Reserve, send, Commit. Returns the Commit's status.
  Status Put(Engine& e, Hash128 hash, uint32_t tokens, const std::vector<uint8_t>& bytes);

  // Host tier reserved bytes polled until == want (teardown is asynchronous).
  bool WaitReservedBytes(uint64_t want,
                         std::chrono::milliseconds timeout = std::chrono::milliseconds(5000));

  const ModelLayout& Layout(const std::string& model = "stories260k") const;
  std::string TcpAddress() const { return server_->tcp_address(); }
  std::string UnixAddress() const { return "unix:" + server_->unix_path(); }

  DaemonConfig config_;
  std::string loopback_domain_;  // the loopback domain of config_.transport, this test's own
  ServerDeps deps_;
  ManualClock clock_{1'000'000'000};
  std::unique_ptr<Server> server_;
  std::thread run_thread_;
  std::string unix_path_;
};

std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed);

}  // namespace kvd::daemon::testing
