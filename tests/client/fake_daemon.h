// A scripted, in-process stand-in for kvd for the client's unit tests: speaks the real frame
// protocol over a unix socket and moves bulk bytes over the loopback transport. It keeps chunks
// in a map and lets a test inject misbehaviour (hang, close, error replies, corrupt bytes).
// One connection at a time, served on its own thread.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvd/client/client.h"
#include "kvd/common/hash.h"
#include "kvd/common/status.h"
#include "kvd/transport/loopback_options.h"
#include "kvd/transport/transport.h"

namespace kvd::client::testing {

struct FakeDaemonBehavior {
  // Request kinds by name ("lookup", "reserve", "commit", "get", "stats", ...).
  std::string hang_on;         // never answer this kind (the client must time out)
  std::string close_on;        // close the connection on this kind (the daemon "died")
  std::string refuse_hello;    // non-empty: refuse Hello with FAILED_PRECONDITION and this text
  bool get_not_found = false;  // Get replies NOT_FOUND and sends nothing
  bool corrupt_get = false;    // Get flips one byte of what it sends (checksum stays the true one)
  // Answer like a kvd that predates InlinePut: HelloReply carries maxFrameBytes (a frame limit
  // that would allow small puts inline) but not inlinePut.
  bool predates_inline_put = false;
};

class FakeDaemon {
 public:
  // Listens on a fresh unix socket; bulk bytes over loopback domain `domain`.
  FakeDaemon(std::string domain, FakeDaemonBehavior behavior);
  ~FakeDaemon();

  std::string address() const { return "unix:" + path_; }
  size_t stored_chunks() const;
  // Number of requests of each kind seen ("releaseLeases": requests carrying that field).
  int seen(const std::string& kind) const;
  void Stop();

 private:
  void Serve();
  void ServeConnection(int fd);

  std::string domain_;
  FakeDaemonBehavior behavior_;
  std::string dir_, path_;
  int listen_fd_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::unique_ptr<transport::Transport> transport_;
  mutable std::mutex mu_;
  std::map<Hash128, std::vector<uint8_t>> chunks_;  // GUARDED_BY(mu_)
  std::map<std::string, int> seen_;                 // GUARDED_BY(mu_)
};

// The model the fake daemon registers ("tiny": 2 layers, 2 KV heads, 4 query heads, head_dim 8,
// float32).
ModelLayout TinyLayout();
// The options a test client connects to `daemon` with: model "tiny" (TinyLayout), chunks of 32
// tokens in blocks of 16, the loopback transport of `domain` (the daemon's), request timeout 2 s,
// transfer timeout 20 s.
ClientOptions TinyClientOptions(const FakeDaemon& daemon, const std::string& domain);

// What a plain engine does with host memory: connect to `daemon`, put one 32-token chunk of the
// tiny layout under `key`, look it up and read it back (gtest assertions; byte-exact).
void PutAndGetOneHostChunk(const FakeDaemon& daemon, const std::string& domain, Hash128 key);

}  // namespace kvd::client::testing
