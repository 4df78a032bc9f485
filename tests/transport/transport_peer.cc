// transport_peer: the other process of the multi-process transport tests and of
// kvd-transport-bench's peer role. Talks to its parent over stdin/stdout, one line each:
//   -> "ADDR <hex>"          its transport address
//   <- "ADDR <hex>"          the parent's address (it Connects)
//   -> "READY"
//   <- "GO"                  start the role
//   -> "DONE OK" | "DONE ERR <status>"
//   <- "BYE" (or EOF)        exit
// Roles: send (sends one message per --sizes entry, tag --tag + i, pattern bytes seeded by tag),
// recv (receives them and checks every byte), idle (only connects). --die-after-ms N: SIGKILL
// itself N ms after GO, whatever it is doing.
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "kvd/common/cli.h"
#include "kvd/transport/transport.h"
#include "test_util.h"

using kvd::Status;
using namespace kvd::transport;  // NOLINT(google-build-using-namespace): a test tool
using std::chrono::milliseconds;

namespace {

void Say(const std::string& line) {
  std::cout << line << std::endl;  // flushes
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"transport_peer: the other process of the multi-process transport tests",
               "transport_peer"};
  std::string config = "ucx-tcp", role = "idle";
  std::vector<size_t> sizes = {1};
  uint64_t tag = 1;
  int die_after_ms = -1, timeout_ms = 20000;
  app.add_option("--config", config, "transport configuration (test_util.h)")
      ->capture_default_str();
  app.add_option("--role", role, "send, recv or idle")
      ->capture_default_str()
      ->check(CLI::IsMember({"send", "recv", "idle"}));
  app.add_option("--sizes", sizes, "message sizes, comma separated")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--tag", tag, "tag of the first message")->capture_default_str();
  app.add_option("--die-after-ms", die_after_ms, "SIGKILL itself this long after GO (-1: never)")
      ->capture_default_str();
  app.add_option("--timeout-ms", timeout_ms, "per-transfer timeout")->capture_default_str();
  if (int rc = kvd::cli::Parse(app, argc, argv); rc >= 0) return rc;

  auto created = CreateTransport(testing::OptionsFor(config));
  if (!created.ok()) {
    Say("DONE ERR " + created.status().ToString());
    return 1;
  }
  std::unique_ptr<Transport> t = std::move(created).value();
  Say("ADDR " + testing::ToHex(*t->LocalAddress()));
  std::string line;
  if (!std::getline(std::cin, line) || line.rfind("ADDR ", 0) != 0) return 2;
  auto peer = t->Connect(testing::FromHex(line.substr(5)));
  if (!peer.ok()) {
    Say("DONE ERR " + peer.status().ToString());
    return 1;
  }
  // Senders prepare their bytes before READY, so --die-after-ms strikes during the transfer.
  std::vector<std::vector<uint8_t>> outgoing;
  if (role == "send") {
    for (size_t i = 0; i < sizes.size(); ++i) {
      outgoing.emplace_back(sizes[i]);
      testing::FillPattern(tag + i, outgoing.back().data(), sizes[i]);
    }
  }
  Say("READY");
  if (!std::getline(std::cin, line) || line != "GO") return 2;
  if (die_after_ms >= 0) {
    std::thread([die_after_ms] {
      std::this_thread::sleep_for(milliseconds(die_after_ms));
      kill(getpid(), SIGKILL);
    }).detach();
  }

  size_t max_size = 1;
  for (size_t s : sizes) max_size = std::max(max_size, s);
  std::vector<uint8_t> buf(role == "recv" ? max_size : 0);
  Status st;
  for (size_t i = 0; i < sizes.size() && st.ok() && role != "idle"; ++i) {
    const uint64_t msg_tag = tag + i;
    if (role == "send") {
      st = t->SendBlocking(*peer, msg_tag, outgoing[i].data(), sizes[i], milliseconds(timeout_ms));
    } else if (role == "recv") {
      size_t got = 0;
      st = t->RecvBlocking(*peer, msg_tag, buf.data(), sizes[i], milliseconds(timeout_ms), &got);
      if (st.ok() && got != sizes[i]) {
        st = Status::DataLoss("got " + std::to_string(got) + " bytes, expected " +
                              std::to_string(sizes[i]));
      }
      size_t bad = testing::FirstMismatch(msg_tag, buf.data(), sizes[i]);
      if (st.ok() && bad != sizes[i]) {
        st = Status::DataLoss("byte " + std::to_string(bad) + " of message " + std::to_string(i) +
                              " is wrong");
      }
    }
  }
  Say(st.ok() ? "DONE OK" : "DONE ERR " + st.ToString());
  // Keep the endpoint alive (and progressed, so the parent's receives complete) until BYE/EOF.
  std::thread progress([&] {
    while (true) {
      if (t->Progress() == 0) (void)t->WaitForEvents(milliseconds(10));
    }
  });
  progress.detach();
  while (std::getline(std::cin, line) && line != "BYE") {
  }
  std::fflush(stdout);
  _exit(st.ok() ? 0 : 1);  // the detached progress thread still uses t: skip destructors
}
