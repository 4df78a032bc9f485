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

// The command line (see --help); the has_* fields say whether an override flag was given.
struct DaemonFlags {
  std::string config_path, listen, unix_path, node, ready_file, log_format, log_level;
  bool print_default = false;
  CLI::Option* listen_opt = nullptr;
  CLI::Option* unix_opt = nullptr;
  CLI::Option* node_opt = nullptr;
};

void AddDaemonOptions(CLI::App& app, DaemonFlags* f) {
  app.add_option("--config", f->config_path,
                 "topology YAML (default: the embedded default, see --print-default-config)");
  f->listen_opt = app.add_option(
      "--listen", f->listen,
      "TCP listen address HOST:PORT (overrides listen.tcp; port 0 = ephemeral; none disables)");
  f->unix_opt = app.add_option("--unix", f->unix_path,
                               "unix-socket path (overrides listen.unix; auto, or none)");
  f->node_opt = app.add_option("--node", f->node, "node name (overrides node)");
  app.add_option("--ready-file", f->ready_file,
                 "once listening, write {\"tcp\",\"unix\",\"metrics\",\"pid\"} JSON here");
  app.add_option("--log-format", f->log_format,
                 "log record format (default text; env KVD_LOG_FORMAT)")
      ->check(CLI::IsMember({"text", "json"}));
  app.add_option("--log-level", f->log_level,
                 "debug, info, warning, error (default info; env "
                 "KVD_LOG_LEVEL)")
      ->check(CLI::IsMember({"debug", "info", "warning", "error"}));
  app.add_flag("--print-default-config", f->print_default,
               "print the embedded default topology and exit");
}

// --log-format and --log-level, when given.
void ApplyLogFlags(const DaemonFlags& f) {
  if (!f.log_format.empty()) {
    kvd::SetLogFormat(f.log_format == "json" ? kvd::LogFormat::kJson : kvd::LogFormat::kText);
  }
  if (!f.log_level.empty()) {
    kvd::LogLevel level;
    kvd::ParseLogLevel(f.log_level, &level);  // IsMember admits only valid levels
    kvd::SetLogLevel(level);
  }
}

// The topology (--config, else the embedded default) with the flags' overrides, validated and
// held against this machine's resources. -1 when it is fit to start, else the exit code (the
// message printed).
int LoadConfig(const DaemonFlags& f, kvd::daemon::DaemonConfig* out) {
  auto config = f.config_path.empty()
                    ? kvd::daemon::ParseConfigYaml(kvd::daemon::EmbeddedDefaultConfigYaml(),
                                                   "embedded default config")
                    : kvd::daemon::LoadConfigFile(f.config_path);
  if (!config.ok()) {
    std::cerr << "kvd: " << config.status().message() << "\n";
    return kExitUsage;
  }
  if (f.listen_opt->count() > 0) config->listen.tcp = f.listen == "none" ? "" : f.listen;
  if (f.unix_opt->count() > 0) config->listen.unix_path = f.unix_path == "none" ? "" : f.unix_path;
  if (f.node_opt->count() > 0) config->node_name = f.node;
  if (!f.config_path.empty()) {
    config->config_dir = std::filesystem::absolute(f.config_path).parent_path().string();
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
  *out = std::move(config).value();
  return -1;
}

// Fault-injection seam for the tests of a signal during start-up (KVD_TEST_STARTUP_PAUSE_MS):
// the arena and the transport exist, the listeners do not yet. A signal ends the pause early. It
// is polled: the signal may be handled on any thread (UCX's and the pool's exist by now), so this
// thread's sleep is not always the one it interrupts.
void PauseStartupForTests() {
  const char* pause = std::getenv("KVD_TEST_STARTUP_PAUSE_MS");
  if (pause == nullptr) return;
  KVD_LOG(INFO) << "start-up paused (KVD_TEST_STARTUP_PAUSE_MS)" << kvd::Kv("ms", pause);
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(std::strtol(pause, nullptr, 10));
  while (g_early_signal == 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// --ready-file's content: the addresses kvd listens on and its pid.
std::string ReadyJson(const kvd::daemon::Server& server) {
  return "{\"tcp\":\"" + JsonEscape(server.tcp_address()) + "\",\"unix\":\"" +
         JsonEscape(server.unix_path()) + "\",\"metrics\":\"" +
         JsonEscape(server.metrics_address()) + "\",\"pid\":" + std::to_string(::getpid()) + "}\n";
}

void LogReady(kvd::daemon::Server& server, const kvd::daemon::DaemonConfig& config) {
  const auto& host = server.config().host_tier;
  KVD_LOG(INFO) << "kvd ready" << kvd::Kv("node", config.node_name)
                << kvd::Kv("tcp", server.tcp_address()) << kvd::Kv("unix", server.unix_path())
                << kvd::Kv("metrics", server.metrics_address())
                << kvd::Kv("transport", server.transport()->capabilities().backend)
                << kvd::Kv("host_capacity", kvd::daemon::FormatByteSize(host.capacity_bytes))
                << kvd::Kv("models", config.models.size())
                << kvd::Kv("chunk_tokens", config.chunk_tokens);
}

// Creates and starts the server, announces it (--ready-file, the log) and serves until a signal.
// Returns the exit code.
int Serve(const kvd::daemon::DaemonConfig& config, const std::string& ready_file) {
  kvd::daemon::ServerDeps deps;
  deps.handle_signals = true;
  auto server = kvd::daemon::Server::Create(config, std::move(deps));
  if (!server.ok()) {
    KVD_LOG(ERROR) << "kvd cannot start" << kvd::Kv("status", server.status());
    return kExitRuntime;
  }
  PauseStartupForTests();
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
  if (!ready_file.empty() && !WriteReadyFile(ready_file, ReadyJson(**server))) {
    KVD_LOG(ERROR) << "cannot write the ready file" << kvd::Kv("path", ready_file);
    return kExitRuntime;
  }
  LogReady(**server, config);
  (*server)->Run();
  KVD_LOG(INFO) << "kvd stopped";
  server->reset();
  if (!ready_file.empty()) ::unlink(ready_file.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CatchEarlySignals();
  CLI::App app{"kvd: the KV-cache daemon", "kvd"};
  app.footer("exit codes: 0 clean shutdown, 1 cannot start, 2 bad command line or config");
  DaemonFlags flags;
  AddDaemonOptions(app, &flags);
  if (int rc = kvd::cli::Parse(app, argc, argv); rc >= 0) return rc;
  if (flags.print_default) {
    std::cout << kvd::daemon::EmbeddedDefaultConfigYaml();
    return 0;
  }
  ApplyLogFlags(flags);
  kvd::daemon::DaemonConfig config;
  if (int rc = LoadConfig(flags, &config); rc >= 0) return rc;
  return Serve(config, flags.ready_file);
}
