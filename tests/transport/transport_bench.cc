// kvd-transport-bench: tag-message bandwidth between two processes through kvd::transport, to
// compare with `ucx_perftest -t tag_bw` on the same machine (see bench_vs_perftest.sh).
//
//   kvd-transport-bench [--config ucx-sm|ucx-tcp|ucx-shm-trusted|loopback-no] [--size 2097152]
//                       [--iters 200] [--window 16] [--reps 5] [--warmup 20]
//
// The process sends; it spawns itself (--child) as the receiver. Per repetition the receiver
// keeps `window` receives posted into one buffer (as ucx_perftest does) and the sender keeps
// `window` sends in flight from one buffer; time runs from "GO" to the receiver's "DONE".
// Prints one line per repetition and a summary with the median.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "child_process.h"
#include "kvd/common/cli.h"
#include "kvd/transport/transport.h"
#include "test_util.h"

using kvd::Status;
using namespace kvd::transport;  // NOLINT(google-build-using-namespace): a tool
using std::chrono::milliseconds;

namespace {

constexpr milliseconds kTimeout(30000);

// Keeps up to `window` transfers in flight: post(i) for i in [0, count), waiting in order.
Status Pipeline(Transport& t, size_t count, size_t window,
                const std::function<kvd::StatusOr<TransferHandle>(size_t)>& post) {
  std::deque<TransferHandle> in_flight;
  size_t next = 0;
  while (next < count || !in_flight.empty()) {
    while (next < count && in_flight.size() < window) {
      KVD_ASSIGN_OR_RETURN(TransferHandle h, post(next));
      in_flight.push_back(h);
      ++next;
    }
    TransferHandle h = in_flight.front();
    in_flight.pop_front();
    Status s = t.Wait(h, kTimeout);
    if (!s.ok()) return s;
    KVD_RETURN_IF_ERROR(t.Release(h));
  }
  return Status::Ok();
}

int RunChild(const std::string& config, size_t size, size_t window) {
  auto created = CreateTransport(testing::OptionsFor(config));
  if (!created.ok()) {
    std::cout << "ERR " << created.status() << std::endl;
    return 1;
  }
  auto t = std::move(created).value();
  std::cout << "ADDR " << testing::ToHex(*t->LocalAddress()) << std::endl;
  std::string line;
  if (!std::getline(std::cin, line) || line.rfind("ADDR ", 0) != 0) return 2;
  auto peer = t->Connect(testing::FromHex(line.substr(5)));
  if (!peer.ok()) {
    std::cout << "ERR " << peer.status() << std::endl;
    return 1;
  }
  auto region = t->AllocateRegistered(size);
  if (!region.ok()) {
    std::cout << "ERR " << region.status() << std::endl;
    return 1;
  }
  std::cout << "READY" << std::endl;
  uint64_t base = 0;
  while (std::getline(std::cin, line) && line.rfind("GO ", 0) == 0) {
    const size_t count = std::stoull(line.substr(3));
    Status s = Pipeline(*t, count, window,
                        [&](size_t i) { return t->PostRecv(*peer, base + i, region->data, size); });
    base += count;
    std::cout << (s.ok() ? std::string("DONE") : "ERR " + s.ToString()) << std::endl;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvd-transport-bench: tag-message bandwidth between two processes",
               "kvd-transport-bench"};
  std::string config = "ucx-sm";
  size_t size = 2097152, iters = 200, window = 16, warmup = 20;
  int reps = 5;
  bool is_child = false;
  app.add_option("--config", config, "ucx-sm, ucx-tcp, ucx-shm-trusted or loopback-no")
      ->capture_default_str();
  app.add_option("--size", size, "message bytes")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--iters", iters, "messages per repetition")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--window", window, "messages in flight")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "repetitions")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "messages before the timed ones")->capture_default_str();
  app.add_flag("--child", is_child, "the receiver (the bench spawns itself with it)");
  if (int rc = kvd::cli::Parse(app, argc, argv); rc >= 0) return rc;
  if (is_child) return RunChild(config, size, window);

  auto created = CreateTransport(testing::OptionsFor(config));
  if (!created.ok()) {
    std::cerr << "kvd-transport-bench: " << created.status() << "\n";
    return 1;
  }
  auto t = std::move(created).value();
  testing::ChildProcess child;
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  std::string exe = n > 0 ? std::string(self, static_cast<size_t>(n)) : argv[0];
  if (!child.Start({exe, "--child", "--config", config, "--size", std::to_string(size), "--window",
                    std::to_string(window)})) {
    std::cerr << "kvd-transport-bench: " << child.error() << "\n";
    return 1;
  }
  std::string line;
  auto expect = [&](const std::string& prefix) {
    if (!child.ReadLine(&line, kTimeout) || line.rfind(prefix, 0) != 0) {
      std::cerr << "kvd-transport-bench: child said '" << line << "' (" << child.error()
                << "), expected " << prefix << "\n";
      std::exit(1);
    }
  };
  expect("ADDR ");
  auto peer = t->Connect(testing::FromHex(line.substr(5)));
  if (!peer.ok()) {
    std::cerr << "kvd-transport-bench: " << peer.status() << "\n";
    return 1;
  }
  child.WriteLine("ADDR " + testing::ToHex(*t->LocalAddress()));
  expect("READY");
  auto region = t->AllocateRegistered(size);
  if (!region.ok()) {
    std::cerr << "kvd-transport-bench: " << region.status() << "\n";
    return 1;
  }
  testing::FillPattern(1, static_cast<uint8_t*>(region->data), size);

  uint64_t base = 0;
  auto round = [&](size_t count) -> double {
    auto t0 = std::chrono::steady_clock::now();
    child.WriteLine("GO " + std::to_string(count));
    Status s = Pipeline(*t, count, window,
                        [&](size_t i) { return t->PostSend(*peer, base + i, region->data, size); });
    base += count;
    if (!s.ok()) {
      std::cerr << "kvd-transport-bench: send failed: " << s << "\n";
      std::exit(1);
    }
    expect("DONE");
    std::chrono::duration<double> secs = std::chrono::steady_clock::now() - t0;
    return secs.count();
  };
  if (warmup > 0) round(warmup);
  std::vector<double> gbps;
  for (int r = 0; r < reps; ++r) {
    double secs = round(iters);
    double bytes = static_cast<double>(size) * static_cast<double>(iters);
    gbps.push_back(bytes / secs / 1e9);
    std::printf("rep %d: %.3f GB/s (%.1f MiB/s) %.1f ms\n", r, gbps.back(),
                bytes / secs / (1 << 20), secs * 1e3);
  }
  std::sort(gbps.begin(), gbps.end());
  std::printf(
      "kvd-transport-bench config=%s size=%zu iters=%zu window=%zu reps=%d median_GBps=%.3f "
      "median_MiBps=%.1f min_GBps=%.3f max_GBps=%.3f\n",
      config.c_str(), size, iters, window, reps, gbps[gbps.size() / 2],
      gbps[gbps.size() / 2] * 1e9 / (1 << 20), gbps.front(), gbps.back());
  child.WriteLine("BYE");
  child.Reap();
  return 0;
}
