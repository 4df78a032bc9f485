#include "etcd_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "kvd/cluster/etcd_client.h"
#include "tied_spawn.h"

namespace kvd::cluster_test {

std::string EtcdServer::Binary() {
  const char* env = std::getenv("KVD_ETCD_BINARY");
  std::string path = env != nullptr && *env != '\0' ? env : "/usr/bin/etcd";
  return ::access(path.c_str(), X_OK) == 0 ? path : "";
}

int FreePort(const std::string& ip) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  ::inet_pton(AF_INET, ip.c_str(), &addr.sin_addr);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    socklen_t len = sizeof addr;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

StatusOr<std::unique_ptr<EtcdServer>> EtcdServer::Start(const std::string& ip) {
  if (Binary().empty()) return Status::Unimplemented("etcd is not installed");
  auto server = std::unique_ptr<EtcdServer>(new EtcdServer());
  server->ip_ = ip;
  char tmpl[] = "/tmp/kvd-etcd-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return Status::Internal("mkdtemp failed");
  server->dir_ = tmpl;
  server->endpoint_ = ip + ":" + std::to_string(FreePort(ip));
  server->peer_url_ = "http://" + ip + ":" + std::to_string(FreePort(ip));
  KVD_RETURN_IF_ERROR(server->Spawn());
  return server;
}

Status EtcdServer::Spawn() {
  const std::string client_url = "http://" + endpoint_;
  std::vector<std::string> argv = {Binary(),
                                   "--name=kvd-test",
                                   "--data-dir=" + dir_ + "/data",
                                   "--listen-client-urls=" + client_url,
                                   "--advertise-client-urls=" + client_url,
                                   "--listen-peer-urls=" + peer_url_,
                                   "--initial-advertise-peer-urls=" + peer_url_,
                                   "--initial-cluster=kvd-test=" + peer_url_,
                                   "--log-level=warn"};
  int log = ::open((dir_ + "/etcd.log").c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log < 0) return Status::Internal("cannot open the etcd log in " + dir_);
  auto pid = test_support::SpawnTied(argv, {.in = -1, .out = log, .err = log});
  ::close(log);
  if (!pid.ok()) return pid.status();
  pid_ = *pid;
  cluster::EtcdClient client({.endpoints = {endpoint_},
                              .connect_timeout = std::chrono::milliseconds(200),
                              .request_timeout = std::chrono::milliseconds(500)});
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    if (client.RangePrefix("/").ok()) return Status::Ok();
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return Status::Unavailable("etcd exited at start: " + Log());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  Kill();
  return Status::Unavailable("etcd did not answer within 10 s: " + Log());
}

void EtcdServer::Kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status = 0;
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
}

Status EtcdServer::Restart() {
  Kill();
  return Spawn();
}

std::string EtcdServer::Log() const {
  std::ifstream in(dir_ + "/etcd.log");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  return text.size() > 2000 ? text.substr(text.size() - 2000) : text;
}

void EtcdTest::SetUp() {
  if (EtcdServer::Binary().empty()) GTEST_SKIP() << "etcd is not installed (etcd-server)";
  auto server = EtcdServer::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  etcd_ = std::move(*server);
}

EtcdServer::~EtcdServer() {
  Kill();
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

}  // namespace kvd::cluster_test
