// A child process on pipes, for the multi-process transport tests and the bench: started with
// test_support::SpawnTied (no fork of a process that already runs UCX threads; the child dies
// with this process), talked to by lines.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "tied_spawn.h"

namespace kvd::transport::testing {

class ChildProcess {
 public:
  ChildProcess() = default;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess() {
    if (pid_ > 0) {
      Kill();
      Reap();
    }
    if (in_ >= 0) close(in_);
    if (out_ >= 0) close(out_);
  }

  // Starts argv[0] with argv; returns false (and sets error()) on failure.
  // Ignores SIGPIPE in this process (writing to a killed child must not kill the test).
  bool Start(const std::vector<std::string>& args) {
    signal(SIGPIPE, SIG_IGN);
    int to_child[2], from_child[2];
    if (pipe2(to_child, O_CLOEXEC) != 0 || pipe2(from_child, O_CLOEXEC) != 0) return Fail("pipe");
    auto pid = test_support::SpawnTied(args, {.in = to_child[0], .out = from_child[1]});
    close(to_child[0]);
    close(from_child[1]);
    in_ = to_child[1];
    out_ = from_child[0];
    if (!pid.ok()) return Fail(pid.status().ToString());
    pid_ = *pid;
    return true;
  }

  bool WriteLine(const std::string& line) {
    std::string s = line + "\n";
    return write(in_, s.data(), s.size()) == static_cast<ssize_t>(s.size());
  }

  // Reads one line (without '\n'); false on EOF or timeout.
  bool ReadLine(std::string* line, std::chrono::milliseconds timeout) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      size_t nl = buffer_.find('\n');
      if (nl != std::string::npos) {
        *line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return true;
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return Fail("timeout reading from the child");
      pollfd p{out_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char chunk[4096];
      ssize_t n = read(out_, chunk, sizeof(chunk));
      if (n <= 0) return Fail("the child closed its output");
      buffer_.append(chunk, static_cast<size_t>(n));
    }
  }

  void Kill() {
    if (pid_ > 0) kill(pid_, SIGKILL);
  }
  // Waits for exit; returns the wait status.
  int Reap() {
    int status = 0;
    if (pid_ > 0) waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }
  const std::string& error() const { return error_; }

 private:
  bool Fail(std::string what) {
    error_ = std::move(what);
    return false;
  }
  pid_t pid_ = -1;
  int in_ = -1;
  int out_ = -1;
  std::string buffer_;
  std::string error_;
};

// The directory of the running executable (helpers are built next to it).
inline std::string ExecutableDir() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  std::string path(buf, static_cast<size_t>(n));
  return path.substr(0, path.rfind('/'));
}

}  // namespace kvd::transport::testing
