// A real etcd-server for tests: a private instance on free loopback ports with a temp data dir,
// tied to the test process (it dies with it). Tests skip when etcd is not installed.
#pragma once

#include <gtest/gtest.h>
#include <sys/types.h>

#include <memory>
#include <string>

#include "kvd/common/status.h"

namespace kvd::cluster_test {

class EtcdServer {
 public:
  // The etcd binary: $KVD_ETCD_BINARY, else /usr/bin/etcd (Debian's etcd-server); "" when absent.
  static std::string Binary();
  // Starts etcd listening for clients on `ip`:<free port> and waits (10 s) until it answers.
  // UNAVAILABLE with the tail of its log when it does not.
  static StatusOr<std::unique_ptr<EtcdServer>> Start(const std::string& ip = "127.0.0.1");
  ~EtcdServer();  // kills etcd, removes the data dir

  // "ip:port" of the client endpoint.
  const std::string& endpoint() const { return endpoint_; }
  // SIGKILL and reap (the data dir stays: Restart finds it).
  void Kill();
  // Starts etcd again on the same ports and data dir and waits until it answers.
  Status Restart();
  std::string Log() const;

 private:
  EtcdServer() = default;
  Status Spawn();
  std::string ip_, dir_, endpoint_, peer_url_;
  pid_t pid_ = -1;
};

// A fixture base: a fresh etcd per test in etcd_; the test is skipped when etcd is not installed.
// A derived SetUp calls EtcdTest::SetUp() first and returns if IsSkipped() or HasFatalFailure().
class EtcdTest : public ::testing::Test {
 protected:
  void SetUp() override;
  std::unique_ptr<EtcdServer> etcd_;
};

// A TCP port on `ip` that nothing listens on right now (bound and released).
int FreePort(const std::string& ip);

}  // namespace kvd::cluster_test
