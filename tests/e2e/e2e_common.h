// Shared helpers of the e2e test files.
#pragma once

#include <capnp/message.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kvd/client/client.h"
#include "kvd/client/kvd_client.h"
#include "kvd/proto/frame.h"
#include "kvd/proto/kvd.capnp.h"
#include "kvd_process.h"
#include "test_hooks.h"

namespace kvd::e2e {

// A fresh folder /tmp/<prefix>XXXXXX, removed with everything in it when this goes out of scope
// (a disk tier's RocksDB, a tokens file).
class TempDir {
 public:
  explicit TempDir(const std::string& prefix) {
    std::string tmpl = "/tmp/" + prefix + "XXXXXX";
    if (::mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
    EXPECT_FALSE(path_.empty()) << "mkdtemp " << tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

inline std::vector<int32_t> RandomTokens(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % 32000);
  return t;
}

// Tenants through a real kvd: a temp directory whose tokens file (mode 0600, `tokens_`) holds
// `tokens_text`, and the kvd the test starts in `kvd_` (stopped, exit 0 expected, at the end).
class TenantsE2eFixture : public ::testing::Test {
 protected:
  explicit TenantsE2eFixture(std::string tokens_text) : tokens_text_(std::move(tokens_text)) {}
  void SetUp() override {
    char tmpl[] = "/tmp/kvd-tenants-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    tokens_ = dir_ + "/tokens";
    std::ofstream(tokens_) << tokens_text_;
    ::chmod(tokens_.c_str(), 0600);
  }
  void TearDown() override {
    if (kvd_ && kvd_->Alive()) {
      EXPECT_EQ(kvd_->Stop(), 0) << kvd_->Log();
    }
    kvd_.reset();
    std::filesystem::remove_all(dir_);
  }
  std::string tokens_text_, dir_, tokens_;
  std::unique_ptr<KvdProcess> kvd_;
};

// A value of a kvd_<name> series on `kvd`'s /metrics page; -1 when absent or unreachable.
inline double MetricValue(const KvdProcess& kvd, const std::string& name) {
  auto page = HttpGet(kvd.metrics_address(), "/metrics");
  if (!page.ok()) return -1;
  const std::string prefix = "\n" + name + "{";
  size_t at = page->find(prefix);
  if (at == std::string::npos) return -1;
  size_t space = page->find("} ", at);
  return std::atof(page->c_str() + space + 2);
}

inline std::unique_ptr<KvdProcess> StartKvd(const KvdConfig& config) {
  auto k = KvdProcess::Start(config);
  EXPECT_TRUE(k.ok()) << k.status();
  return k.ok() ? std::move(k).value() : nullptr;
}

inline std::unique_ptr<client::Client> ConnectOrFail(const client::ClientOptions& o,
                                                     const client::TestHooks& hooks = {}) {
  auto c = client::ConnectWithTestHooks(o, hooks);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(c).value() : nullptr;
}

// A kvd older than one protocol feature: a current kvd (64 MiB arena in 8 MiB segments) with
// `protocol.<feature>: false`, which serves clients as a kvd that predates the feature did; with
// an admin client and an engine client ("current") of it. ok() is false when any part failed
// (the failure is already reported).
struct OlderKvd {
  std::unique_ptr<KvdProcess> kvd;
  std::unique_ptr<client::Client> admin;
  std::unique_ptr<client::Client> engine;
  bool ok() const { return kvd && admin && engine; }
};
inline OlderKvd StartKvdWithout(const std::string& feature) {
  KvdConfig config;
  config.host_capacity = "64MiB";
  config.host_segment = "8MiB";
  config.extra_yaml = "protocol:\n  " + feature + ": false\n";
  OlderKvd older;
  older.kvd = StartKvd(config);
  if (older.kvd == nullptr) return older;
  older.admin = ConnectOrFail(older.kvd->AdminOptions());
  older.engine = ConnectOrFail(older.kvd->UnixEngineOptions("current"));
  return older;
}

// The C ABI's kvd_config for the C++ options of an engine (address, model, layout, ...); its
// strings point into `o`, which must outlive the config.
inline kvd_config CConfig(const client::ClientOptions& o) {
  kvd_config c;
  kvd_config_init(&c);
  c.address = o.address.c_str();
  c.client_id = o.client_id.c_str();
  c.name_space = o.name_space.c_str();
  c.model = o.model.c_str();
  c.layout.num_layers = o.layout.num_layers;
  c.layout.num_kv_heads = o.layout.num_kv_heads;
  c.layout.num_q_heads = o.layout.num_q_heads;
  c.layout.head_dim = o.layout.head_dim;
  c.layout.dtype = static_cast<int32_t>(o.layout.dtype);
  c.layout.tp_rank = o.layout.tp_rank;
  c.layout.tp_size = o.layout.tp_size;
  c.layout.rope_theta = o.layout.rope.theta;
  c.layout.rope_rotary_dim = o.layout.rope.rotary_dim;
  c.layout.rope_pairing = static_cast<int32_t>(o.layout.rope.pairing);
  c.layout.rope_scaling = static_cast<int32_t>(o.layout.rope.scaling);
  c.layout.rope_factor = o.layout.rope.factor;
  c.layout.rope_low_freq_factor = o.layout.rope.low_freq_factor;
  c.layout.rope_high_freq_factor = o.layout.rope.high_freq_factor;
  c.layout.rope_original_max_positions = o.layout.rope.original_max_positions;
  c.chunk_tokens = o.chunk_tokens;
  c.block_tokens = o.block_tokens;
  c.hash_seed = o.hash_seed.c_str();
  const auto& ucx = transport::BackendOptionsOf<transport::UcxOptions>(o.transport);
  c.ucx_tls = ucx.ucx_tls.empty() ? nullptr : ucx.ucx_tls.c_str();
  c.net_devices = ucx.net_devices.empty() ? nullptr : ucx.net_devices.c_str();
  return c;
}

// The UCX transports of `o` (UcxOptions::ucx_tls), as the e2e driver takes them.
inline const std::string& UcxTls(const client::ClientOptions& o) {
  return transport::BackendOptionsOf<transport::UcxOptions>(o.transport).ucx_tls;
}

// Puts one full random chunk under `hash` and returns its bytes.
inline std::vector<uint8_t> PutChunk(client::Client& c, const Hash128& hash, uint64_t seed,
                                     int tokens = 256) {
  auto data = RandomBytes(c.options().layout.ChunkBytes(tokens), seed);
  auto r = c.Put(hash, tokens, data.data(), data.size());
  EXPECT_TRUE(r.ok()) << r.status();
  return data;
}

// Looks up one chunk; returns matched chunks (0 or 1) and releases the lease.
inline uint32_t Present(client::Client& c, const Hash128& hash) {
  auto r = c.Lookup({&hash, 1});
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return 0;
  if (r->lease_id) {
    EXPECT_TRUE(c.ReleaseLease(r->lease_id).ok());
  }
  return r->matched_chunks;
}

// Looks up and gets one chunk of `bytes` (a test failure and empty when it is not served),
// releasing the lease.
inline std::vector<uint8_t> FetchOne(client::Client& c, const Hash128& h, size_t bytes) {
  auto hit = c.Lookup({&h, 1});
  EXPECT_TRUE(hit.ok()) << hit.status();
  if (!hit.ok() || hit->matched_chunks != 1) return {};
  std::vector<uint8_t> out(bytes);
  auto g = c.Get(hit->lease_id, 0, out.data(), out.size());
  EXPECT_TRUE(g.ok()) << g.status();
  EXPECT_TRUE(c.ReleaseLease(hit->lease_id).ok());
  return g.ok() ? out : std::vector<uint8_t>{};
}

// One request that takes nothing (a Lookup of a key never stored): what the client defers to
// its next request (ended shared-memory reads, released leases) reaches kvd with it.
inline void SendNextRequest(client::Client& c) {
  const Hash128 never_stored{0x6e657874, ~uint64_t{0}};
  auto r = c.Lookup({&never_stored, 1});
  EXPECT_TRUE(r.ok()) << r.status();
  if (r.ok()) {
    EXPECT_EQ(r->lease_id, 0u);
  }
}

// A full put -> lookup -> get cycle with byte comparison; what "the daemon keeps serving other
// clients" means in these tests.
inline void ExpectServes(client::Client& c, uint64_t seed) {
  Hash128 h{0xabcdef, seed};
  auto data = PutChunk(c, h, seed, 64);
  auto hit = c.Lookup({&h, 1});
  ASSERT_TRUE(hit.ok()) << hit.status();
  ASSERT_EQ(hit->matched_chunks, 1u);
  std::vector<uint8_t> out(data.size());
  auto g = c.Get(hit->lease_id, 0, out.data(), out.size());
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(out, data);
  EXPECT_TRUE(c.ReleaseLease(hit->lease_id).ok());
}

// Counter `name` of `stats`; a test failure (and 0) when the daemon reports no such counter.
inline uint64_t CounterValue(const client::Stats& stats, const std::string& name) {
  for (const auto& [n, v] : stats.counters) {
    if (n == name) return v;
  }
  ADD_FAILURE() << "no counter " << name << " in stats";
  return 0;
}

// The same from a fresh GetStats of `c`.
inline uint64_t CounterValue(client::Client& c, const std::string& name) {
  auto s = c.GetStats();
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? CounterValue(*s, name) : 0;
}

// Runs `fn` in a forked child (no core file) and returns its wait status; the child exits 0
// when `fn` returns.
inline int WaitStatusOfChild(const std::function<void()>& fn) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const rlimit no_core{0, 0};
    ::setrlimit(RLIMIT_CORE, &no_core);
    std::signal(SIGSEGV, SIG_DFL);  // not UCX's handler, which would print a backtrace
    fn();
    ::_exit(0);
  }
  int status = 0;
  EXPECT_GT(pid, 0) << std::strerror(errno);
  if (pid > 0) {
    EXPECT_EQ(::waitpid(pid, &status, 0), pid);
  }
  return status;
}

inline client::TierStats HostTier(client::Client& admin) {
  auto s = admin.GetStats();
  EXPECT_TRUE(s.ok()) << s.status();
  if (s.ok()) {
    for (const auto& t : s->tiers) {
      if (t.name == "host") return t;
    }
  }
  ADD_FAILURE() << "no host tier in stats";
  return {};
}

// Resident memory of a process (VmRSS, bytes) from /proc.
inline uint64_t RssBytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

// An admin Hello frame (raw connections of the limits tests); `keep_idle`: Hello.keepIdle.
inline std::vector<uint8_t> AdminHelloFrame(bool keep_idle = false) {
  capnp::MallocMessageBuilder m;
  auto req = m.initRoot<proto::Request>();
  req.setRequestId(1);
  auto h = req.initHello();
  h.setProtocolVersion(proto::PROTOCOL_VERSION);
  h.setClientId("raw-admin");
  h.setRole(proto::Role::ADMIN);
  h.setKeepIdle(keep_idle);
  return proto::EncodeFrame(m);
}

// A raw connection to kvd's TCP socket whose admin Hello (AdminHelloFrame) was accepted; null
// (a test failure) otherwise.
inline std::unique_ptr<RawConnection> OpenAuthenticated(const KvdProcess& kvd,
                                                        bool keep_idle = true) {
  auto r = RawConnection::Open(kvd.tcp_address());
  if (!r.ok()) {
    ADD_FAILURE() << r.status();
    return nullptr;
  }
  const auto hello = AdminHelloFrame(keep_idle);
  Status s = (*r)->Write(hello.data(), hello.size());
  if (s.ok()) s = (*r)->ReadResponseStatus(std::chrono::seconds(5));
  if (!s.ok()) {
    ADD_FAILURE() << "admin Hello: " << s;
    return nullptr;
  }
  return std::move(*r);
}

}  // namespace kvd::e2e
