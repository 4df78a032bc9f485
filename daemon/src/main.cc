// kvd: the KV-cache daemon.
//
//   kvd [--config FILE] [--listen HOST:PORT] [--unix PATH|none] [--ready-file PATH]
//       [--log-format text|json] [--log-level debug|info|warning|error] [--print-default-config]
//
// Exit codes: 0 clean shutdown (SIGINT/SIGTERM), 1 cannot start (transport, memory, address in
// use), 2 bad command line or config (the message names the flag or key and the value).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <string_view>

#include "kvd/common/logging.h"
#include "kvd/daemon/config.h"
#include "kvd/daemon/server.h"

namespace {

constexpr int kExitRuntime = 1;
constexpr int kExitUsage = 2;

constexpr std::string_view kUsage = R"(usage: kvd [options]
  --config FILE            topology YAML (default: the embedded default, see --print-default-config)
  --listen HOST:PORT       TCP listen address (overrides listen.tcp; port 0 = ephemeral; "none" disables)
  --unix PATH              unix-socket path (overrides listen.unix; "auto", or "none" disables)
  --node NAME              node name (overrides node)
  --ready-file PATH        once listening, write {"tcp":...,"unix":...,"metrics":...,"pid":...} to PATH
  --log-format text|json   log record format (default text; env KVD_LOG_FORMAT)
  --log-level LEVEL        debug, info, warning, error (default info; env KVD_LOG_LEVEL)
  --print-default-config   print the embedded default topology and exit
  --help                   this text
)";

int Usage(const std::string& error) {
  std::cerr << "kvd: " << error << "\n" << kUsage;
  return kExitUsage;
}

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
  std::string config_path, listen, unix_path, node, ready_file;
  bool has_listen = false, has_unix = false, has_node = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    bool has_value = false;
    if (size_t eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    auto take = [&](std::string* out) -> bool {
      if (has_value) {
        *out = value;
        return true;
      }
      if (i + 1 >= argc) return false;
      *out = argv[++i];
      return true;
    };
    if (arg == "--help" || arg == "-h") {
      std::cout << kUsage;
      return 0;
    } else if (arg == "--print-default-config") {
      std::cout << kvd::daemon::EmbeddedDefaultConfigYaml();
      return 0;
    } else if (arg == "--config") {
      if (!take(&config_path)) return Usage("--config needs a file");
    } else if (arg == "--listen") {
      if (!take(&listen)) return Usage("--listen needs HOST:PORT");
      has_listen = true;
    } else if (arg == "--unix") {
      if (!take(&unix_path)) return Usage("--unix needs a path");
      has_unix = true;
    } else if (arg == "--node") {
      if (!take(&node)) return Usage("--node needs a name");
      has_node = true;
    } else if (arg == "--ready-file") {
      if (!take(&ready_file)) return Usage("--ready-file needs a path");
    } else if (arg == "--log-format") {
      std::string f;
      if (!take(&f)) return Usage("--log-format needs text or json");
      if (f == "json") {
        kvd::SetLogFormat(kvd::LogFormat::kJson);
      } else if (f == "text") {
        kvd::SetLogFormat(kvd::LogFormat::kText);
      } else {
        return Usage("--log-format: \"" + f + "\" is not text or json");
      }
    } else if (arg == "--log-level") {
      std::string l;
      kvd::LogLevel level;
      if (!take(&l)) return Usage("--log-level needs a level");
      if (!kvd::ParseLogLevel(l, &level)) {
        return Usage("--log-level: \"" + l + "\" is not debug, info, warning or error");
      }
      kvd::SetLogLevel(level);
    } else {
      return Usage("unknown argument \"" + std::string(argv[i]) + "\"");
    }
  }

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
  if (kvd::Status s = config->Validate(); !s.ok()) {
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
  if (kvd::Status s = (*server)->Start(); !s.ok()) {
    KVD_LOG(ERROR) << "kvd cannot listen" << kvd::Kv("status", s);
    return kExitRuntime;
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
