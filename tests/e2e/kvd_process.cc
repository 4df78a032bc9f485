#include "kvd_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "kvd/proto/convert.h"
#include "kvd/proto/frame.h"
#include "kvd/proto/kvd.capnp.h"
#include "tied_spawn.h"

namespace kvd::e2e {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string Tail(const std::string& s, size_t n) {
  return s.size() > n ? s.substr(s.size() - n) : s;
}

// Waits for `pid` up to `timeout`; returns true and the status if it exited.
bool WaitFor(pid_t pid, std::chrono::milliseconds timeout, int* status) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    pid_t r = ::waitpid(pid, status, WNOHANG);
    if (r == pid) return true;
    if (r < 0) return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// What a kvd that outlived SIGTERM was doing, for the failure message: per thread its name,
// state, kernel wait channel and signal masks (pending, blocked, ignored, caught), from /proc.
std::string StuckProcessReport(pid_t pid) {
  std::ostringstream out;
  out << "[kvd_process] pid " << pid << " still running 10 s after SIGTERM\n";
  const std::string proc = "/proc/" + std::to_string(pid);
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator(proc + "/task", ec)) {
    const std::string dir = task.path().string();
    std::ifstream status(dir + "/status");
    std::ifstream wchan(dir + "/wchan");
    std::string line, fields, channel;
    while (std::getline(status, line)) {
      for (const char* key :
           {"Name:", "State:", "SigPnd:", "ShdPnd:", "SigBlk:", "SigIgn:", "SigCgt:"}) {
        if (line.rfind(key, 0) != 0) continue;
        const size_t value = line.find_first_not_of(" \t", std::strlen(key));
        fields += std::string(" ") + key + (value == std::string::npos ? "" : line.substr(value));
      }
    }
    std::getline(wchan, channel);
    out << "  tid " << task.path().filename().string() << fields << " wchan:" << channel << "\n";
  }
  return out.str();
}

int ExitCode(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return -WTERMSIG(status);
  return -1;
}

}  // namespace

ModelLayout Stories260kLayout() {
  ModelLayout l;
  l.num_layers = 5;
  l.num_kv_heads = 4;
  l.num_q_heads = 8;
  l.head_dim = 8;
  l.dtype = DType::kFloat32;
  l.rope.theta = 10000;
  l.rope.pairing = RopePairing::kInterleaved;
  return l;
}

ModelLayout Smollm2Layout() {
  ModelLayout l;
  l.num_layers = 30;
  l.num_kv_heads = 3;
  l.num_q_heads = 9;
  l.head_dim = 64;
  l.dtype = DType::kBFloat16;
  l.rope.theta = 100000;
  l.rope.pairing = RopePairing::kInterleaved;
  return l;
}

StatusOr<std::unique_ptr<KvdProcess>> KvdProcess::Start(const KvdConfig& c) {
  KVD_ASSIGN_OR_RETURN(std::unique_ptr<KvdProcess> p, Spawn(c));
  KVD_RETURN_IF_ERROR(p->WaitReady());
  return p;
}

StatusOr<std::unique_ptr<KvdProcess>> KvdProcess::Spawn(const KvdConfig& c) {
  std::unique_ptr<KvdProcess> p(new KvdProcess());
  p->config_ = c;
  char tmpl[] = "/tmp/kvd-e2e-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return Status::Internal("mkdtemp failed");
  p->dir_ = tmpl;
  p->unix_ = p->dir_ + "/kvd.sock";
  p->log_path_ = p->dir_ + "/kvd.log";
  const std::string config_path = p->dir_ + "/topology.yaml";
  const std::string& ready = p->ready_path_ = p->dir_ + "/ready.json";
  {
    std::ofstream y(config_path);
    y << "node: kvd-e2e\n"
      << "transport:\n  backend: " << c.transport_backend << "\n  ucx_tls: \"" << c.ucx_tls
      << "\"\n  net_devices: " << c.net_devices << "\n"
      << "  keepalive_interval_ms: 500\n"
      << (c.enable_rma ? "  enable_rma: true\n" : "") << "  nccl_device: " << c.nccl_device
      << "\n  nccl_init_timeout_ms: " << c.nccl_init_timeout_ms << "\n"
      << "chunk_tokens: " << c.chunk_tokens << "\n"
      << "hash_seed: " << c.hash_seed << "\n"
      << "models:\n"
      << "  - name: stories260k\n    layout: {layers: 5, kv_heads: 4, q_heads: 8, head_dim: 8, "
         "dtype: float32, rope: {theta: 10000, pairing: interleaved, scaling: none}}\n"
      << "  - name: smollm2-135m\n    layout: {layers: 30, kv_heads: 3, q_heads: 9, head_dim: "
         "64, dtype: bfloat16, rope: {theta: 100000, pairing: interleaved, scaling: none}}\n"
      << c.extra_models << c.extra_yaml << "tiers:\n  host:\n    capacity: " << c.host_capacity
      << "\n"
      << (c.host_segment.empty() ? "" : "    segment: " + c.host_segment + "\n") <<
        [&] {
          std::string extra;
          for (const std::string& l : c.host_extra) extra += "    " + l + "\n";
          return extra;
        }()
      << (c.gpu_capacity.empty() ? "" : "  gpu:\n    capacity: " + c.gpu_capacity + "\n")
      << (c.disk_path.empty() ? std::string()
                              : "  disk:\n    path: \"" + c.disk_path +
                                    "\"\n    capacity: " + c.disk_capacity + "\n")
      <<
        [&] {
          std::string extra;
          for (const std::string& l : c.disk_extra) extra += "    " + l + "\n";
          return c.disk_path.empty() ? std::string() : extra;
        }()
      << (c.metrics ? "metrics:\n  listen: 127.0.0.1:0\n" : "")
      << (c.tokens_file.empty() ? std::string()
                                : "auth:\n  tokens_file: \"" + c.tokens_file + "\"\n")
      << "limits:\n  max_frame_bytes: " << c.max_frame_bytes
      << "\n  reservation_ttl_ms: " << c.reservation_ttl_ms
      << "\n  lease_ttl_ms: " << c.lease_ttl_ms
      << "\n  transfer_timeout_ms: " << c.transfer_timeout_ms << "\n";
    for (const std::string& l : c.extra_limits) y << "  " << l << "\n";
  }
  // $KVD_E2E_KVD: another kvd binary to start (the tests against an older build, e.g. to see
  // a new test fail on it).
  const char* other = std::getenv("KVD_E2E_KVD");
  const std::string binary = other != nullptr && *other != '\0' ? other : KVD_BINARY;
  std::vector<std::string> argv = c.exec_prefix;
  for (const std::string& a :
       {binary, std::string("--config"), config_path, std::string("--listen"), c.listen,
        std::string("--unix"), p->unix_, std::string("--ready-file"), ready}) {
    argv.push_back(a);
  }
  const int log = ::open(p->log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log < 0)
    return Status::Internal("cannot create " + p->log_path_ + ": " + std::strerror(errno));
  auto pid = test_support::SpawnTied(argv, {.out = log, .err = log});
  ::close(log);
  if (!pid.ok()) return pid.status();
  p->pid_ = *pid;
  return p;
}

Status KvdProcess::WaitReady(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    if (std::filesystem::exists(ready_path_)) {
      auto j = nlohmann::json::parse(ReadFile(ready_path_), nullptr, false);
      if (!j.is_discarded() && j.contains("tcp")) {
        tcp_ = j["tcp"].get<std::string>();
        if (j.contains("metrics")) metrics_ = j["metrics"].get<std::string>();
        return Status::Ok();
      }
    }
    int status = 0;
    if (pid_ <= 0 || ::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return Status::Unavailable("kvd exited with " + std::to_string(ExitCode(status)) +
                                 " before it was ready; log:\n" + Tail(Log(), 3000));
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return Status::DeadlineExceeded("kvd not ready within " + std::to_string(timeout.count()) +
                                      " ms; log:\n" + Tail(Log(), 3000));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

StatusOr<std::string> HttpGet(const std::string& address, const std::string& path) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return Status::InvalidArgument("no port in " + address);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  if (::inet_pton(AF_INET, address.substr(0, colon).c_str(), &sa.sin_addr) != 1) {
    return Status::InvalidArgument("not an IPv4 address: " + address);
  }
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status::Unavailable("socket failed");
  std::string response;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0) {
    const std::string request = "GET " + path + " HTTP/1.0\r\nHost: " + address + "\r\n\r\n";
    if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
        static_cast<ssize_t>(request.size())) {
      char buf[8192];
      for (;;) {
        pollfd p{fd, POLLIN, 0};
        if (::poll(&p, 1, 5000) <= 0) break;
        const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
        if (n <= 0) break;
        response.append(buf, static_cast<size_t>(n));
      }
    }
  }
  ::close(fd);
  const size_t body = response.find("\r\n\r\n");
  if (body == std::string::npos) return Status::Unavailable("no HTTP response from " + address);
  if (response.compare(0, 12, "HTTP/1.1 200") != 0 &&
      response.compare(0, 12, "HTTP/1.0 200") != 0) {
    return Status::Unavailable(response.substr(0, response.find("\r\n")));
  }
  return response.substr(body + 4);
}

KvdProcess::~KvdProcess() {
  if (pid_ > 0) Stop();
  std::error_code ec;
  if (!dir_.empty() && !std::getenv("KVD_E2E_KEEP")) std::filesystem::remove_all(dir_, ec);
}

bool KvdProcess::Alive() {
  if (pid_ <= 0) return false;
  int status;
  if (::waitpid(pid_, &status, WNOHANG) == pid_) {
    pid_ = -1;
    return false;
  }
  return true;
}

int KvdProcess::Stop() {
  if (pid_ <= 0) return -1;
  ::kill(pid_, SIGTERM);
  int status = 0;
  if (!WaitFor(pid_, std::chrono::seconds(10), &status)) {
    std::ofstream(log_path_, std::ios::app) << StuckProcessReport(pid_);  // read with Log()
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return -SIGKILL;
  }
  pid_ = -1;
  return ExitCode(status);
}

void KvdProcess::Kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status;
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
}

std::string KvdProcess::Log() const { return ReadFile(log_path_); }

client::ClientOptions KvdProcess::EngineOptions(const std::string& client_id) const {
  client::ClientOptions o;
  o.address = tcp_;
  o.client_id = client_id;
  o.model = "stories260k";
  o.layout = Stories260kLayout();
  o.hash_seed = config_.hash_seed;
  o.chunk_tokens = config_.chunk_tokens;
  auto& ucx = transport::MutableBackendOptions<transport::UcxOptions>(&o.transport);
  ucx.ucx_tls = config_.ucx_tls;
  ucx.net_devices = "lo";
  o.connect_timeout_ms = 5000;
  o.request_timeout_ms = 5000;
  o.transfer_timeout_ms = 5000;
  return o;
}

client::ClientOptions KvdProcess::UnixEngineOptions(const std::string& client_id) const {
  client::ClientOptions o = EngineOptions(client_id);
  o.address = unix_address();
  return o;
}

client::ClientOptions KvdProcess::AdminOptions() const {
  client::ClientOptions o;
  o.address = tcp_;
  o.role = client::Role::kAdmin;
  o.client_id = "e2e-admin";
  return o;
}

int RunProgram(const std::vector<std::string>& argv, std::string* out,
               std::chrono::milliseconds timeout) {
  int pipefd[2];
  if (::pipe2(pipefd, O_CLOEXEC) != 0) return -1;
  auto spawned = test_support::SpawnTied(argv, {.out = pipefd[1]});
  ::close(pipefd[1]);
  if (!spawned.ok()) {
    ::close(pipefd[0]);
    return -1;
  }
  const pid_t pid = *spawned;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  char buf[4096];
  while (true) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      ::close(pipefd[0]);
      return 124;
    }
    pollfd p{pipefd[0], POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    ssize_t n = ::read(pipefd[0], buf, sizeof buf);
    if (n <= 0) break;
    if (out) out->append(buf, static_cast<size_t>(n));
  }
  ::close(pipefd[0]);
  int status = 0;
  if (!WaitFor(pid, timeout, &status)) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    return 124;
  }
  return ExitCode(status);
}

StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Spawn(const std::vector<std::string>& argv) {
  int pipefd[2];
  if (::pipe2(pipefd, O_CLOEXEC) != 0) return Status::Internal("pipe failed");
  auto c = std::unique_ptr<ChildProcess>(new ChildProcess());
  auto pid = test_support::SpawnTied(argv, {.out = pipefd[1]});
  ::close(pipefd[1]);
  if (!pid.ok()) {
    ::close(pipefd[0]);
    return pid.status();
  }
  c->pid_ = *pid;
  c->out_fd_ = pipefd[0];
  return c;
}

ChildProcess::~ChildProcess() {
  Kill();
  if (out_fd_ >= 0) ::close(out_fd_);
}

void ChildProcess::Kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

StatusOr<std::string> ChildProcess::ReadLine(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    if (size_t nl = buf_.find('\n'); nl != std::string::npos) {
      std::string line = buf_.substr(0, nl);
      buf_.erase(0, nl + 1);
      return line;
    }
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return Status::DeadlineExceeded("child printed no line in time");
    pollfd p{out_fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    char tmp[1024];
    ssize_t n = ::read(out_fd_, tmp, sizeof tmp);
    if (n <= 0) return Status::Unavailable("child closed its stdout");
    buf_.append(tmp, static_cast<size_t>(n));
  }
}

StatusOr<std::unique_ptr<RawConnection>> RawConnection::Open(const std::string& tcp_address,
                                                             const std::string& source_ip) {
  auto addr = client::ParseDaemonAddress(tcp_address);
  if (!addr.ok()) return addr.status();
  sockaddr_in sin{};
  sin.sin_family = AF_INET;
  sin.sin_port = htons(addr->port);
  ::inet_pton(AF_INET, addr->host.c_str(), &sin.sin_addr);
  auto c = std::unique_ptr<RawConnection>(new RawConnection());
  c->fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (c->fd_ < 0) return Status::Unavailable(std::string("socket: ") + std::strerror(errno));
  // A write the daemon never drains fails after 10 s instead of hanging the test.
  timeval send_timeout{10, 0};
  ::setsockopt(c->fd_, SOL_SOCKET, SO_SNDTIMEO, &send_timeout, sizeof send_timeout);
  if (!source_ip.empty()) {
    sockaddr_in src{};
    src.sin_family = AF_INET;
    ::inet_pton(AF_INET, source_ip.c_str(), &src.sin_addr);
    if (::bind(c->fd_, reinterpret_cast<sockaddr*>(&src), sizeof src) != 0) {
      return Status::Unavailable("bind " + source_ip + ": " + std::strerror(errno));
    }
  }
  if (::connect(c->fd_, reinterpret_cast<sockaddr*>(&sin), sizeof sin) != 0) {
    return Status::Unavailable(std::string("connect: ") + std::strerror(errno));
  }
  return c;
}

RawConnection::~RawConnection() { Close(); }

void RawConnection::Close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

Status RawConnection::Write(const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::send(fd_, p, size, MSG_NOSIGNAL);
    if (n <= 0) return Status::Unavailable("send failed");
    p += n;
    size -= static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status RawConnection::ReadResponseStatus(std::chrono::milliseconds timeout,
                                         std::string* worker_address) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<uint8_t> buf;
  auto fill = [&](size_t want) -> Status {
    while (buf.size() < want) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return Status::DeadlineExceeded("no response in time");
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      uint8_t tmp[4096];
      ssize_t n = ::recv(fd_, tmp, std::min(sizeof tmp, want - buf.size()), 0);
      if (n <= 0) return Status::Unavailable("daemon closed the connection");
      buf.insert(buf.end(), tmp, tmp + n);
    }
    return Status::Ok();
  };
  KVD_RETURN_IF_ERROR(fill(proto::kFrameHeaderBytes));
  KVD_ASSIGN_OR_RETURN(uint32_t len, proto::ParseFrameHeader(buf, proto::kDefaultMaxFrameBytes));
  KVD_RETURN_IF_ERROR(fill(proto::kFrameHeaderBytes + len));
  KVD_ASSIGN_OR_RETURN(auto msg,
                       proto::DecodePayload(std::span(buf).subspan(proto::kFrameHeaderBytes)));
  Status result = Status::Internal("no status");
  KVD_RETURN_IF_ERROR(proto::TryDecode([&]() -> Status {
    auto r = msg->Root<proto::Response>();
    result = r.isError() ? proto::FromProto(r.getError()) : Status::Ok();
    if (worker_address != nullptr && r.isHello()) {
      auto a = r.getHello().getWorkerAddress();
      worker_address->assign(reinterpret_cast<const char*>(a.begin()), a.size());
    }
    return Status::Ok();
  }));
  return result;
}

bool RawConnection::ClosedByPeer(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    char tmp[4096];
    ssize_t n = ::recv(fd_, tmp, sizeof tmp, 0);
    if (n <= 0) return true;  // EOF or reset
  }
  return false;
}

}  // namespace kvd::e2e
