#include "pingpong_bench.h"

#include <sched.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

namespace kvd::tools::bench {
namespace {

// Reads or writes exactly `n` bytes (read when `out` is null); false on EOF or an error.
bool TransferAll(int fd, const uint8_t* out, uint8_t* in, size_t n) {
  size_t done = 0;
  while (done < n) {
    const ssize_t r =
        out != nullptr ? ::write(fd, out + done, n - done) : ::read(fd, in + done, n - done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    done += static_cast<size_t>(r);
  }
  return true;
}

// The ping-pong of --op pingpong and --pingpong-floor (see kvd_bench.cc's header comment): `count`
// round trips into a phase "pingpong", or with `cpus` (two CPU numbers) the two processes pinned
// apart, this thread to cpus[0] (its own affinity restored afterwards) and the echo to cpus[1],
// into "pingpong_cross_cpu". False (with a message on stderr) if the echo could not start or ended
// early, or the pinning failed.
constexpr size_t kPingPongBytes = 64;  // one message of the ping-pong

bool PingPong(int64_t count, PhaseResult* result, const std::vector<int>& cpus = {}) {
  constexpr size_t kMessageBytes = kPingPongBytes;
  const bool pinned = cpus.size() == 2;
  cpu_set_t own_mask;
  if (pinned && ::sched_getaffinity(0, sizeof own_mask, &own_mask) != 0) {
    std::cerr << "kvd-bench: sched_getaffinity: " << std::strerror(errno) << "\n";
    return false;
  }
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    std::cerr << "kvd-bench: socketpair: " << std::strerror(errno) << "\n";
    return false;
  }
  const pid_t child = ::fork();
  if (child < 0) {
    std::cerr << "kvd-bench: fork: " << std::strerror(errno) << "\n";
    ::close(fds[0]);
    ::close(fds[1]);
    return false;
  }
  if (child == 0) {  // the echo (only async-signal-safe calls): until the parent closes its end
    ::close(fds[0]);
    if (pinned) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpus[1], &one);
      if (::sched_setaffinity(0, sizeof one, &one) != 0) ::_exit(1);
    }
    uint8_t msg[kMessageBytes];
    while (TransferAll(fds[1], nullptr, msg, sizeof msg) &&
           TransferAll(fds[1], msg, nullptr, sizeof msg)) {
    }
    ::_exit(0);
  }
  ::close(fds[1]);
  result->name = pinned ? "pingpong_cross_cpu" : "pingpong";
  uint8_t msg[kMessageBytes] = {1}, back[kMessageBytes];
  bool failed = false;
  if (pinned) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpus[0], &one);
    if (::sched_setaffinity(0, sizeof one, &one) != 0) {
      std::cerr << "kvd-bench: sched_setaffinity: " << std::strerror(errno) << "\n";
      failed = true;
    }
  }
  const auto start = Clock::now();
  for (int64_t i = 0; i < count && !failed; ++i) {
    const auto t0 = Clock::now();
    failed = !TransferAll(fds[0], msg, nullptr, sizeof msg) ||
             !TransferAll(fds[0], nullptr, back, sizeof back);
    result->latencies_us.push_back(
        std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    ++result->ops;
  }
  result->seconds = result->wall_seconds =
      std::chrono::duration<double>(Clock::now() - start).count();
  result->bytes = result->ops * 2 * kMessageBytes;
  ::close(fds[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  if (pinned) ::sched_setaffinity(0, sizeof own_mask, &own_mask);
  if (failed) std::cerr << "kvd-bench: the echo process ended early\n";
  return !failed;
}

// Two CPUs this process may run on (the first two of its affinity mask), for the cross-CPU
// ping-pong; empty with fewer.
std::vector<int> TwoCpus() {
  cpu_set_t mask;
  std::vector<int> out;
  if (::sched_getaffinity(0, sizeof mask, &mask) != 0) return out;
  for (int c = 0; c < CPU_SETSIZE && out.size() < 2; ++c) {
    if (CPU_ISSET(c, &mask)) out.push_back(c);
  }
  if (out.size() < 2) out.clear();
  return out;
}

}  // namespace

bool PingPongPhases(int64_t count, std::vector<PhaseResult>* phases) {
  PhaseResult as_scheduled;
  bool ok = PingPong(count, &as_scheduled);
  phases->push_back(std::move(as_scheduled));
  if (const std::vector<int> cpus = TwoCpus(); ok && !cpus.empty()) {
    PhaseResult apart;
    ok = PingPong(count, &apart, cpus);
    phases->push_back(std::move(apart));
  }
  return ok;
}

int RunPingPong(int64_t count, bool json) {
  std::vector<PhaseResult> phases;
  const bool ok = PingPongPhases(count, &phases);
  nlohmann::json j = {
      {"count", count}, {"op", "pingpong"}, {"message_bytes", kPingPongBytes}, {"ok", ok}};
  PrintPhases(phases, std::move(j), json,
              "kvd-bench: unix socket pair ping-pong of " + std::to_string(kPingPongBytes) +
                  " B messages, count " + std::to_string(count));
  return ok ? 0 : 1;
}

}  // namespace kvd::tools::bench
