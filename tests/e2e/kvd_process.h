// End-to-end harness: a real `kvd` process on an ephemeral port with a temp topology, tool and
// driver processes, and a raw frame connection for bad-input tests.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvd/client/client.h"
#include "kvd/common/status.h"

namespace kvd::e2e {

// High half of the chunk hashes the chaos driver puts.
inline constexpr uint64_t kChaosHi = 0xc4a05;
// Tokens per chaos chunk (40 KiB of stories260k KV: many puts per cycle, small disk footprint).
inline constexpr int kChaosTokens = 32;

inline std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t x = rng();
    std::memcpy(&v[i], &x, 8);
  }
  for (; i < n; ++i) v[i] = static_cast<uint8_t>(rng());
  return v;
}

struct KvdConfig {
  std::string ucx_tls = "sm,tcp";
  std::string host_capacity = "64MiB";
  // tiers.host.segment ("" = the default, 64 MiB: with the 64 MiB capacity above, the
  // shared-memory path is off). The shared-memory tests set a smaller one.
  std::string host_segment;
  // More `tiers.host` keys, one "key: value" per line (e.g. "verify_shm_commits: true").
  std::vector<std::string> host_extra;
  int64_t reservation_ttl_ms = 30000;
  int64_t lease_ttl_ms = 30000;
  int64_t transfer_timeout_ms = 10000;
  std::string max_frame_bytes = "4MiB";
  std::string hash_seed = "kvd-default-seed";
  int chunk_tokens = 256;
  // Non-empty: a disk tier (RocksDB, WAL on) at this directory, which outlives the process (a
  // restarted KvdProcess with the same path finds the chunks again).
  std::string disk_path;
  std::string disk_capacity = "256MiB";
  // More `tiers.disk` keys, one "key: value" per line (e.g. "sync_writes: true").
  std::vector<std::string> disk_extra;
  // Serve /metrics on an ephemeral loopback port (KvdProcess::metrics_address()).
  bool metrics = false;
  // Non-empty: auth.tokens_file (see AuthOptions).
  std::string tokens_file;
  std::string listen = "127.0.0.1:0";
  // Appended to the `limits:` section, one "key: value" per line (e.g. "max_sessions: 16").
  std::vector<std::string> extra_limits;
  // Appended verbatim to the `models:` list (more models, e.g. with a compression policy).
  std::string extra_models;
  // Appended verbatim at the top level of the topology (e.g. state_dir).
  std::string extra_yaml;
  // Non-empty: a GPU tier (tiers.gpu.capacity, device 0), which needs a CUDA device.
  std::string gpu_capacity;
  // transport.nccl_device / nccl_init_timeout_ms: the NCCL link of device sessions.
  int nccl_device = 0;
  int64_t nccl_init_timeout_ms = 30000;
  // transport.enable_rma (written only when true; kvd's default is false).
  bool enable_rma = false;
  // transport.backend: "ucx", or "none" (no bulk transport, shared-memory engines only).
  std::string transport_backend = "ucx";
  // transport.net_devices: the interfaces UCX may use.
  std::string net_devices = "lo";
  // Runs kvd under this command (e.g. {"ip", "netns", "exec", "ns1"}, which execs kvd in the
  // same process); empty (default): kvd directly.
  std::vector<std::string> exec_prefix;
};

// The stories260k layout registered in every e2e daemon (small chunks: 320 KiB per 256 tokens).
ModelLayout Stories260kLayout();
// The smollm2-135m layout (bf16, 5.6 MiB per 256-token chunk).
ModelLayout Smollm2Layout();

class KvdProcess {
 public:
  // Writes the config into a fresh temp dir, starts kvd (the build's, or $KVD_E2E_KVD) with
  // --listen 127.0.0.1:0 --unix <dir>/kvd.sock --ready-file, waits (10 s) for readiness. On failure
  // the error carries the tail of kvd's log.
  static StatusOr<std::unique_ptr<KvdProcess>> Start(const KvdConfig& config);
  // The first half of Start: writes the config and spawns kvd, without waiting for readiness
  // (tests of start-up itself). WaitReady is the second half.
  static StatusOr<std::unique_ptr<KvdProcess>> Spawn(const KvdConfig& config);
  Status WaitReady(std::chrono::milliseconds timeout = std::chrono::seconds(15));
  ~KvdProcess();  // Stop() if still running, then removes the temp dir

  const std::string& tcp_address() const { return tcp_; }
  // "host:port" of /metrics (KvdConfig::metrics), else "".
  const std::string& metrics_address() const { return metrics_; }
  std::string unix_address() const { return "unix:" + unix_; }
  pid_t pid() const { return pid_; }
  const KvdConfig& config() const { return config_; }
  bool Alive();
  // SIGTERM and wait (10 s) for exit; returns the exit code (or -signal).
  int Stop();
  void Kill();  // SIGKILL and reap
  std::string Log() const;

  // Client options for this daemon: engine role for stories260k over the daemon's ucx_tls.
  client::ClientOptions EngineOptions(const std::string& client_id = "e2e") const;
  // The same over the daemon's unix socket (the shared-memory path when the daemon offers it).
  client::ClientOptions UnixEngineOptions(const std::string& client_id = "e2e") const;
  client::ClientOptions AdminOptions() const;

 private:
  KvdProcess() = default;
  KvdConfig config_;
  std::string dir_, tcp_, unix_, log_path_, ready_path_, metrics_;
  pid_t pid_ = -1;
};

// GET http://<address><path> (HTTP/1.0): the response body, or UNAVAILABLE / the status line.
StatusOr<std::string> HttpGet(const std::string& address, const std::string& path);

// Runs a program (argv[0] is its path) with a timeout; returns its exit code (-signal if killed,
// 124 on timeout) and its stdout.
int RunProgram(const std::vector<std::string>& argv, std::string* out,
               std::chrono::milliseconds timeout = std::chrono::seconds(60));

// A child process whose stdout the test reads line by line.
class ChildProcess {
 public:
  static StatusOr<std::unique_ptr<ChildProcess>> Spawn(const std::vector<std::string>& argv);
  ~ChildProcess();  // SIGKILL + reap if still running
  // Reads one line (without '\n') within the timeout. DEADLINE_EXCEEDED / UNAVAILABLE (EOF).
  StatusOr<std::string> ReadLine(std::chrono::milliseconds timeout);
  void Kill();
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  int out_fd_ = -1;
  std::string buf_;
};

// A raw control connection that writes arbitrary bytes and reads frames (bad-input tests).
class RawConnection {
 public:
  // `source_ip` (IPv4, e.g. "127.0.0.2"): the local address to connect from ("" = any).
  static StatusOr<std::unique_ptr<RawConnection>> Open(const std::string& tcp_address,
                                                       const std::string& source_ip = "");
  ~RawConnection();
  Status Write(const void* data, size_t size);
  // Reads one response frame within the timeout and returns its Status (OK unless it is an
  // Error), or UNAVAILABLE if the daemon closed the connection first. A Hello reply's transport
  // address goes to *worker_address when given.
  Status ReadResponseStatus(std::chrono::milliseconds timeout,
                            std::string* worker_address = nullptr);
  // True once the daemon closed the connection (EOF within the timeout).
  bool ClosedByPeer(std::chrono::milliseconds timeout);
  void Close();

 private:
  int fd_ = -1;
};

// Polls `pred` every 20 ms until it holds or the timeout passes.
template <typename Pred>
bool Eventually(Pred&& pred, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    struct timespec ts {
      0, 20'000'000
    };
    nanosleep(&ts, nullptr);
  }
  return pred();
}

}  // namespace kvd::e2e
