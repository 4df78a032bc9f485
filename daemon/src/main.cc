// kvd: the KV-cache daemon.
//
//   kvd [--config FILE] [--listen HOST:PORT] [--unix PATH|none] [--node NAME] [--ready-file PATH]
//       [--log-format text|json] [--log-level debug|info|warning|error] [--print-default-config]
// (`kvd --help` lists them; parsed with CLI11.)
//
// Exit codes: 0 clean shutdown (SIGINT/SIGTERM), 1 cannot start (transport, memory, address in
// use), 2 bad command line or config (the message names the flag or key and the value).
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <string_view>
#include <thread>

#include "kvd/common/cli.h"
#include "kvd/common/logging.h"
#include "kvd/daemon/chunk_codec.h"
#include "kvd/daemon/config.h"
#include "kvd/daemon/server.h"

namespace {

constexpr int kExitRuntime = 1;
constexpr int kExitUsage = 2;

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

// A SIGINT / SIGTERM that arrives while kvd is starting (before the server's own handlers are
// in place at the end of Start) is remembered here, and kvd shuts down cleanly as soon as it
// can: every resource it holds (the arena, the transport's shared-memory segments, the unix
// socket, the ready file) is released on the normal path instead of the process dying with the
// default action half-way through an allocation.
volatile std::sig_atomic_t g_early_signal = 0;
extern "C" void RememberEarlySignal(int signal) { g_early_signal = signal; }

void CatchEarlySignals() {
  struct sigaction sa {};
  sa.sa_handler = RememberEarlySignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
}

bool WriteReadyFile(const std::string& path, const std::string& content) {
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) return false;
    out << content;
    if (!out.flush()) return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  CatchEarlySignals();
  CLI::App app{"kvd: the KV-cache daemon", "kvd"};
  app.footer("exit codes: 0 clean shutdown, 1 cannot start, 2 bad command line or config");
  std::string config_path, listen, unix_path, node, ready_file, log_format, log_level;
  bool print_default = false;
  app.add_option("--config", config_path,
                 "topology YAML (default: the embedded default, see --print-default-config)");
  auto* listen_opt = app.add_option(
      "--listen", listen,
      "TCP listen address HOST:PORT (overrides listen.tcp; port 0 = ephemeral; none disables)");
  auto* unix_opt = app.add_option("--unix", unix_path,
                                  "unix-socket path (overrides listen.unix; auto, or none)");
  auto* node_opt = app.add_option("--node", node, "node name (overrides node)");
  app.add_option("--ready-file", ready_file,
                 "once listening, write {\"tcp\",\"unix\",\"metrics\",\"pid\"} JSON here");
  app.add_option("--log-format", log_format, "log record format (default text; env KVD_LOG_FORMAT)")
      ->check(CLI::IsMember({"text", "json"}));
  app.add_option("--log-level", log_level,
                 "debug, info, warning, error (default info; env "
                 "KVD_LOG_LEVEL)")
      ->check(CLI::IsMember({"debug", "info", "warning", "error"}));
  app.add_flag("--print-default-config", print_default,
               "print the embedded default topology and exit");
  if (int rc = kvd::cli::Parse(app, argc, argv); rc >= 0) return rc;
  if (print_default) {
    std::cout << kvd::daemon::EmbeddedDefaultConfigYaml();
    return 0;
  }
  if (!log_format.empty()) {
    kvd::SetLogFormat(log_format == "json" ? kvd::LogFormat::kJson : kvd::LogFormat::kText);
  }
  if (!log_level.empty()) {
    kvd::LogLevel level;
    kvd::ParseLogLevel(log_level, &level);  // IsMember above admits only valid levels
    kvd::SetLogLevel(level);
  }
  const bool has_listen = listen_opt->count() > 0, has_unix = unix_opt->count() > 0,
             has_node = node_opt->count() > 0;

  auto config = config_path.empty()
                    ? kvd::daemon::ParseConfigYaml(kvd::daemon::EmbeddedDefaultConfigYaml(),
                                                   "embedded default config")
                    : kvd::daemon::LoadConfigFile(config_path);
  if (!config.ok()) {
    std::cerr << "kvd: " << config.status().message() << "\n";
    return kExitUsage;
  }
  if (has_listen) config->listen.tcp = listen == "none" ? "" : listen;
  if (has_unix) config->listen.unix_path = unix_path == "none" ? "" : unix_path;
  if (has_node) config->node_name = node;
  if (!config_path.empty()) {
    config->config_dir = std::filesystem::absolute(config_path).parent_path().string();
  }
  if (kvd::Status s = config->Validate(); !s.ok()) {
    std::cerr << "kvd: " << s.message() << "\n";
    return kExitUsage;
  }
  if (kvd::Status s = config->CheckResources(kvd::daemon::MachineResources::Probe(*config));
      !s.ok()) {
    if (!config->allow_overcommit) {
      std::cerr << "kvd: " << s.message() << "\n";
      return kExitUsage;
    }
    KVD_LOG(WARNING) << "starting over this machine's capacity (tiers.allow_overcommit)"
                     << kvd::Kv("problem", s.message());
  }

  // compression.device: cuda that this process cannot honour is a configuration error.
  if (kvd::Status s = kvd::daemon::CheckIngestDevices(*config); !s.ok()) {
    std::cerr << "kvd: " << s.message() << "\n";
    return kExitUsage;
  }

  kvd::daemon::ServerDeps deps;
  deps.handle_signals = true;
  auto server = kvd::daemon::Server::Create(*config, std::move(deps));
  if (!server.ok()) {
    KVD_LOG(ERROR) << "kvd cannot start" << kvd::Kv("status", server.status());
    return kExitRuntime;
  }
  if (const char* pause = std::getenv("KVD_TEST_STARTUP_PAUSE_MS"); pause != nullptr) {
    // Fault-injection seam for the tests of a signal during start-up: the arena and the
    // transport exist, the listeners do not yet. A signal ends the pause early. It is polled:
    // the signal may be handled on any thread (UCX's and the pool's exist by now), so this
    // thread's sleep is not always the one it interrupts.
    KVD_LOG(INFO) << "start-up paused (KVD_TEST_STARTUP_PAUSE_MS)" << kvd::Kv("ms", pause);
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::milliseconds(std::strtol(pause, nullptr, 10));
    while (g_early_signal == 0 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  if (kvd::Status s = (*server)->Start(); !s.ok()) {
    KVD_LOG(ERROR) << "kvd cannot listen" << kvd::Kv("status", s);
    return kExitRuntime;
  }
  if (g_early_signal != 0) {
    // Arrived during start-up, before the server's handlers: stop now, on the normal path.
    KVD_LOG(INFO) << "signal received during start-up, shutting down"
                  << kvd::Kv("signal", static_cast<int>(g_early_signal));
    (*server)->Shutdown();
    (*server)->Run();
    server->reset();
    KVD_LOG(INFO) << "kvd stopped";
    return 0;
  }
  const std::string tcp = (*server)->tcp_address();
  const std::string unix_socket = (*server)->unix_path();
  if (!ready_file.empty()) {
    std::string json = "{\"tcp\":\"" + JsonEscape(tcp) + "\",\"unix\":\"" +
                       JsonEscape(unix_socket) + "\",\"metrics\":\"" +
                       JsonEscape((*server)->metrics_address()) +
                       "\",\"pid\":" + std::to_string(::getpid()) + "}\n";
    if (!WriteReadyFile(ready_file, json)) {
      KVD_LOG(ERROR) << "cannot write the ready file" << kvd::Kv("path", ready_file);
      return kExitRuntime;
    }
  }
  const auto& host = (*server)->config().host_tier;
  KVD_LOG(INFO) << "kvd ready" << kvd::Kv("node", config->node_name) << kvd::Kv("tcp", tcp)
                << kvd::Kv("unix", unix_socket) << kvd::Kv("metrics", (*server)->metrics_address())
                << kvd::Kv("transport", (*server)->transport()->capabilities().backend)
                << kvd::Kv("host_capacity", kvd::daemon::FormatByteSize(host.capacity_bytes))
                << kvd::Kv("models", config->models.size())
                << kvd::Kv("chunk_tokens", config->chunk_tokens);
  (*server)->Run();
  KVD_LOG(INFO) << "kvd stopped";
  server->reset();
  if (!ready_file.empty()) ::unlink(ready_file.c_str());
  return 0;
}
