// kvdctl: inspect and manage a running kvd.
//
//   kvdctl [--addr ADDR] [--json] stats [--watch]
//   kvdctl [--addr ADDR] [--json] ls [--namespace N] [--model M] [--limit K]
//   kvdctl [--addr ADDR] [--json] evict (--all | --namespace N | --model M | --chunk HEX)
//   kvdctl [--addr ADDR] [--json] health
//   kvdctl [--addr ADDR] [--json] calibration [--model M]
//   kvdctl [--addr ADDR] calibrate --model M --model-file GGUF --from FILE [...]
//       runs `kvd-demo calibrate` (the reference engine; found next to kvdctl, else on PATH) with
//       the same arguments, so that kvdctl itself links no engine. See kvd-demo's usage.
//   kvdctl [--addr ADDR] [--json] events [--namespace N] [--count K] [--queue Q]
//   kvdctl [--json] cluster --etcd HOST:PORT[,...] --name CLUSTER
//       the members as etcd holds them (read from etcd, not from a kvd); the cluster token, if
//       any, from $KVD_CLUSTER_TOKEN (records with another token show as refused). Exit 1 when
//       etcd does not answer.
//
// ADDR is host:port or unix:/path (default $KVD_ADDR, else 127.0.0.1:7400).
// Exit codes: 0 ok (health: serving, DEGRADED included: it still serves, the status line says
//             what damage it found); 1 the daemon answered with an error (or health is not ok);
//             2 usage error; 3 cannot connect to the daemon (or it died mid-call).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <thread>

#include "cluster_view.h"
#include "kvd/client/client.h"
#include "kvd/client/json.h"
#include "kvd/common/cli.h"
#include "util.h"

namespace {

using kvd::Status;
using kvd::StatusCode;
using kvd::tools::HumanBytes;
using kvd::tools::HumanDuration;
using kvd::tools::PrintCalibration;
using kvd::tools::PrintTable;

constexpr int kExitOk = 0, kExitDaemonError = 1, kExitConnect = 3;  // usage: 2 (cli.h)

int Fail(const Status& s, bool json, bool connecting) {
  bool conn = connecting || s.code() == StatusCode::kUnavailable ||
              s.code() == StatusCode::kDeadlineExceeded;
  if (json) std::cout << kvd::client::StatusToJson(s) << "\n";
  std::cerr << "kvdctl: " << (connecting ? "cannot connect: " : "") << s.ToString() << "\n";
  return conn ? kExitConnect : kExitDaemonError;
}

// Nanoseconds as milliseconds with three decimals.
std::string Millis(uint64_t nanos) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", static_cast<double>(nanos) / 1e6);
  return buf;
}

std::string Pct(uint64_t part, uint64_t whole) {
  if (whole == 0) return "-";
  char buf[16];
  std::snprintf(buf, sizeof buf, "%.1f%%", 100.0 * part / whole);
  return buf;
}

void PrintStats(const kvd::client::Stats& s) {
  std::cout << "node " << s.node_name << "  uptime " << HumanDuration(s.uptime_ms) << "  sessions "
            << s.sessions << "\n\nTiers\n";
  std::vector<std::vector<std::string>> rows;
  for (const auto& t : s.tiers) {
    uint64_t lookups = t.hits + t.misses;
    rows.push_back({t.name, HumanBytes(t.capacity_bytes), HumanBytes(t.used_bytes),
                    Pct(t.used_bytes, t.capacity_bytes), HumanBytes(t.reserved_bytes),
                    HumanBytes(t.pinned_bytes), std::to_string(t.chunks),
                    std::to_string(t.evictions), std::to_string(t.hits), std::to_string(t.misses),
                    Pct(t.hits, lookups)});
  }
  PrintTable(std::cout,
             {"TIER", "CAPACITY", "USED", "USE%", "RESERVED", "PINNED", "CHUNKS", "EVICTIONS",
              "HITS", "MISSES", "HIT%"},
             rows);
  auto groups = [](const char* title, const std::vector<kvd::client::GroupStats>& g) {
    std::cout << "\n" << title << "\n";
    std::vector<std::vector<std::string>> r;
    for (const auto& x : g) r.push_back({x.name, std::to_string(x.chunks), HumanBytes(x.bytes)});
    if (r.empty()) r.push_back({"(none)", "0", "0 B"});
    PrintTable(std::cout, {"NAME", "CHUNKS", "BYTES"}, r);
  };
  groups("Models (cached)", s.models);
  groups("Namespaces", s.namespaces);
  if (!s.registered_models.empty()) {
    std::cout << "\nRegistered models\n";
    std::vector<std::vector<std::string>> r;
    for (const auto& m : s.registered_models) {
      r.push_back({m.name, HumanBytes(m.chunk_bytes), m.layout.ToString()});
    }
    PrintTable(std::cout, {"MODEL", "CHUNK", "LAYOUT"}, r);
  }
  if (!s.counters.empty()) {
    std::cout << "\nCounters\n";
    std::vector<std::vector<std::string>> r;
    for (const auto& [name, value] : s.counters) r.push_back({name, std::to_string(value)});
    PrintTable(std::cout, {"COUNTER", "VALUE"}, r);
  }
  if (!s.compression.empty()) {
    std::cout << "\nCompression time per stage (since start)\n";
    for (const auto& m : s.compression) {
      std::cout << "model " << m.model << " compresses on " << m.device << " (" << m.device_reason
                << ")\n";
      if (m.ea_min_queries == 0) continue;
      std::cout << "model " << m.model << " expected attention: "
                << (m.ExpectedAttentionActive() ? "active" : "keydiff-fallback") << " ("
                << m.ea_queries << " window queries per layer, scores from " << m.ea_min_queries
                << ")\n";
    }
    std::vector<std::vector<std::string>> r;
    for (const auto& m : s.compression) {
      for (const auto& t : m.stages) {
        r.push_back({m.model, t.stage, std::to_string(t.chunks), Millis(t.nanos),
                     t.chunks == 0 ? "-" : Millis(t.nanos / t.chunks)});
      }
    }
    PrintTable(std::cout, {"MODEL", "STAGE", "CHUNKS", "TOTAL MS", "MS/CHUNK"}, r);
  }
}

void PrintList(const kvd::client::ListResult& l) {
  std::vector<std::vector<std::string>> rows;
  for (const auto& c : l.chunks) {
    rows.push_back({c.hash.ToHex(), c.name_space, c.model, std::to_string(c.tokens),
                    HumanBytes(c.bytes), c.tier, HumanDuration(c.age_ms), HumanDuration(c.idle_ms),
                    std::to_string(c.leases)});
  }
  PrintTable(std::cout,
             {"CHUNK", "NAMESPACE", "MODEL", "TOKENS", "BYTES", "TIER", "AGE", "IDLE", "LEASES"},
             rows);
  std::cout << l.chunks.size() << " of " << l.total << " matching chunks shown\n";
}

// Replaces kvdctl with `kvd-demo calibrate ARGS` (kvd-demo next to this binary, else on PATH).
// Returns only when that cannot be run.
int ExecCalibrate(const std::string& addr, const std::vector<std::string>& rest) {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  const std::filesystem::path sibling = self.parent_path() / "kvd-demo";
  const std::string program =
      !ec && std::filesystem::exists(sibling, ec) ? sibling.string() : std::string("kvd-demo");
  std::vector<std::string> args = {program, "calibrate"};
  if (!addr.empty()) args.insert(args.end(), {"--addr", addr});
  args.insert(args.end(), rest.begin(), rest.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  ::execvp(program.c_str(), argv.data());
  std::cerr << "kvdctl: calibrate runs `kvd-demo calibrate` (the reference engine, built as "
               "build/bin/kvd-demo): cannot run "
            << program << " (not next to kvdctl in " << self.parent_path().string()
            << " nor on PATH): " << std::strerror(errno) << "\n";
  return kExitDaemonError;
}

// The command line: the global flags and those of every command (see --help).
struct CtlFlags {
  std::string addr, client_id;
  int64_t timeout_ms = 0;
  bool json = false;
  bool watch = false;                           // stats
  std::string ns, model, chunk;                 // ls, evict, calibration, events
  int64_t limit = 100;                          // ls
  bool all = false;                             // evict
  int64_t count = 0, queue = 0;                 // events
  kvd::tools::ClusterViewOptions cluster_view;  // cluster
};

void AddGlobalOptions(CLI::App& app, CtlFlags* f) {
  app.add_option("--addr", f->addr, "daemon address (ADDR)");
  app.add_flag("--json", f->json, "print one JSON object");
  app.add_option("--timeout-ms", f->timeout_ms, "connect and request timeout")
      ->check(CLI::PositiveNumber);
  app.add_option("--client-id", f->client_id, "name shown in the daemon's logs");
}

// stats, ls, evict, health, calibration and calibrate (whose arguments kvd-demo parses).
void AddDaemonCommands(CLI::App& app, CtlFlags* f) {
  app.add_subcommand("stats", "per tier, per model and per namespace occupancy")
      ->add_flag("--watch", f->watch, "redraw every second until interrupted");
  CLI::App* ls = app.add_subcommand("ls", "list cached chunks, most recent first");
  ls->add_option("--namespace", f->ns, "only this namespace");
  ls->add_option("--model", f->model, "only this model");
  ls->add_option("--limit", f->limit, "at most this many (default 100; 0 = all)")
      ->check(CLI::Range(int64_t{0}, int64_t{UINT32_MAX}));
  CLI::App* evict = app.add_subcommand("evict", "evict unpinned chunks (exactly one scope)");
  evict->add_flag("--all", f->all, "every chunk");
  evict->add_option("--namespace", f->ns, "the chunks of a namespace");
  evict->add_option("--model", f->model, "the chunks of a model");
  evict->add_option("--chunk", f->chunk, "one chunk (32 hex digits)");
  app.add_subcommand("health", "daemon and tier health");
  app.add_subcommand("calibration",
                     "VECTOR calibration per model: tokens seen / needed, state, R^2 per layer "
                     "and KV head, which heads route")
      ->add_option("--model", f->model,
                   "only this model (default: every model that routes values)");
  app.add_subcommand(
      "calibrate",
      "feed a corpus through the reference engine so that a model's VECTOR calibration completes: "
      "runs `kvd-demo calibrate ARGS` (--model M --model-file GGUF --from FILE [--token-ids] "
      "[--segment-tokens N] [--threads N] [--ucx-tls T] [--net-devices D] [--namespace NS])");
}

// events and cluster.
void AddStreamAndClusterCommands(CLI::App& app, CtlFlags* f) {
  CLI::App* events = app.add_subcommand(
      "events", "stream KV cache events (stored / removed / dropped), one line each");
  events->add_option("--namespace", f->ns, "only this namespace (default: all)");
  events
      ->add_option("--count", f->count,
                   "stop after this many events (default 0: until interrupted)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  events->add_option("--queue", f->queue, "events kvd queues for us before it drops (0 = default)")
      ->check(CLI::Range(int64_t{0}, int64_t{UINT32_MAX}));
  CLI::App* cluster = app.add_subcommand(
      "cluster",
      "members of a kvd cluster from etcd: health, lease left, registration age, "
      "occupancy per tier, models");
  cluster->add_option("--etcd", f->cluster_view.etcd, "etcd endpoints host:port (comma-separated)")
      ->delimiter(',')
      ->required();
  cluster->add_option("--name", f->cluster_view.name, "the cluster's name (cluster.name)")
      ->required();
}

// `calibrate`: every argument after it goes to kvd-demo as is (not parsed here). Scans argv for
// the command; when it is calibrate, replaces kvdctl with kvd-demo and returns only if that
// cannot run. -1 when the command is another.
int ForwardCalibrate(int argc, char** argv) {
  std::string addr;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--addr" || a == "--timeout-ms" || a == "--client-id") {
      if (a == "--addr" && i + 1 < argc) addr = argv[i + 1];
      ++i;
    } else if (a.rfind("--addr=", 0) == 0) {
      addr = a.substr(7);
    } else if (a.rfind("-", 0) != 0) {
      if (a != "calibrate") break;
      if (addr.empty()) {
        if (const char* env = std::getenv("KVD_ADDR")) addr = env;
      }
      return ExecCalibrate(addr, std::vector<std::string>(argv + i + 1, argv + argc));
    }
  }
  return -1;
}

// kvdctl cluster: reads etcd, not a kvd.
int RunCluster(const CtlFlags& f) {
  kvd::tools::ClusterViewOptions view = f.cluster_view;
  view.json = f.json;
  if (f.timeout_ms > 0) view.timeout_ms = f.timeout_ms;
  if (const char* token = std::getenv("KVD_CLUSTER_TOKEN")) view.token = token;
  return kvd::tools::ShowCluster(view, std::cout, std::cerr);
}

// The admin client's options from the flags and the environment.
kvd::client::ClientOptions AdminOptions(const CtlFlags& f) {
  kvd::client::ClientOptions o;
  o.role = kvd::client::Role::kAdmin;
  o.connect_timeout_ms = 3000;
  if (!f.addr.empty()) {
    o.address = f.addr;
  } else if (const char* env = std::getenv("KVD_ADDR")) {
    o.address = env;
  }
  if (!f.client_id.empty()) o.client_id = f.client_id;
  if (f.timeout_ms > 0) o.connect_timeout_ms = o.request_timeout_ms = f.timeout_ms;
  // Over TCP to a daemon with auth.tokens_file: the admin token (from the environment, not
  // argv, where ps would show it).
  if (const char* token = std::getenv("KVD_ADMIN_TOKEN")) o.auth_token = token;
  return o;
}

// evict's one scope into `filter`. Empty when all is well, else the usage error.
std::string EvictScope(const CtlFlags& f, kvd::client::EvictFilter* filter) {
  int scopes = f.all + !f.ns.empty() + !f.model.empty() + !f.chunk.empty();
  if (scopes != 1) return "evict needs exactly one of --all, --namespace, --model, --chunk";
  if (!f.ns.empty()) {
    filter->kind = kvd::client::EvictFilter::Kind::kNamespace;
    filter->name = f.ns;
  } else if (!f.model.empty()) {
    filter->kind = kvd::client::EvictFilter::Kind::kModel;
    filter->name = f.model;
  } else if (!f.chunk.empty()) {
    filter->kind = kvd::client::EvictFilter::Kind::kChunk;
    if (!kvd::Hash128::FromHex(f.chunk, &filter->chunk)) {
      return "--chunk needs 32 hex digits, got '" + f.chunk + "'";
    }
  }
  return "";
}

// --watch: one frame per second (the screen is cleared first on a terminal; with --json one
// compact object per line) until interrupted or the daemon goes away.
int RunStats(kvd::client::Client& c, const CtlFlags& f) {
  const bool tty = ::isatty(STDOUT_FILENO) == 1;
  for (;;) {
    auto next = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    auto s = c.GetStats();
    if (!s.ok()) return Fail(s.status(), f.json, false);
    if (f.json) {
      std::cout << kvd::client::StatsToJson(*s, f.watch ? -1 : 2) << std::endl;
    } else {
      if (f.watch && tty) std::cout << "\033[H\033[2J";
      PrintStats(*s);
      if (f.watch && !tty) std::cout << "--\n";
      std::cout << std::flush;
    }
    if (!f.watch) break;
    std::this_thread::sleep_until(next);
  }
  return kExitOk;
}

int RunList(kvd::client::Client& c, const CtlFlags& f) {
  auto l = c.List({f.ns, f.model, static_cast<uint32_t>(f.limit)});
  if (!l.ok()) return Fail(l.status(), f.json, false);
  if (f.json)
    std::cout << kvd::client::ListToJson(*l) << "\n";
  else
    PrintList(*l);
  return kExitOk;
}

int RunEvict(kvd::client::Client& c, const kvd::client::EvictFilter& filter, bool json) {
  auto e = c.Evict(filter);
  if (!e.ok()) return Fail(e.status(), json, false);
  if (json) {
    std::cout << kvd::client::EvictToJson(*e) << "\n";
  } else {
    std::cout << "evicted " << e->chunks << " chunks (" << HumanBytes(e->bytes) << ")";
    if (e->skipped_pinned) std::cout << "; " << e->skipped_pinned << " leased chunks kept";
    std::cout << "\n";
  }
  return kExitOk;
}

int RunCalibration(kvd::client::Client& c, const CtlFlags& f) {
  auto cal = c.GetCalibration(f.model);
  if (!cal.ok()) return Fail(cal.status(), f.json, false);
  if (f.json)
    std::cout << kvd::client::CalibrationToJson(*cal) << "\n";
  else
    PrintCalibration(std::cout, *cal);
  return kExitOk;
}

// One line per event (JSON with --json) until interrupted, the daemon goes away, or --count.
int RunEvents(kvd::client::Client& c, const CtlFlags& f) {
  auto sub = c.SubscribeEvents({f.ns, static_cast<uint32_t>(f.queue)});
  if (!sub.ok()) return Fail(sub.status(), f.json, false);
  int64_t seen = 0;
  while (f.count == 0 || seen < f.count) {
    auto batch = c.PollEvents(1000);
    if (!batch.ok()) return Fail(batch.status(), f.json, false);
    for (const auto& e : *batch) {
      std::cout << (f.json ? kvd::client::EventToJson(e) : kvd::client::EventToText(e)) << "\n";
      if (f.count != 0 && ++seen >= f.count) break;
    }
    std::cout << std::flush;
  }
  return kExitOk;
}

int RunHealth(kvd::client::Client& c, bool json) {
  auto h = c.GetHealth();
  if (!h.ok()) return Fail(h.status(), json, false);
  if (json) {
    std::cout << kvd::client::HealthToJson(*h) << "\n";
  } else {
    std::cout << (!h->ok        ? "UNHEALTHY"
                  : h->degraded ? "DEGRADED"
                                : "OK")
              << "  " << h->status << "  uptime " << HumanDuration(h->uptime_ms) << "  transport "
              << h->transport << "\n";
    std::vector<std::vector<std::string>> rows;
    for (const auto& t : h->tiers) rows.push_back({t.name, t.ok ? "ok" : "FAIL", t.detail});
    if (!rows.empty()) PrintTable(std::cout, {"TIER", "STATE", "DETAIL"}, rows);
  }
  return h->ok ? kExitOk : kExitDaemonError;
}

// The commands that talk to one kvd: connects as admin and runs `cmd`. Returns the exit code.
int RunDaemonCommand(const CLI::App& app, const std::string& cmd, const CtlFlags& f) {
  kvd::client::EvictFilter filter;
  if (cmd == "evict") {
    if (std::string why = EvictScope(f, &filter); !why.empty()) {
      return kvd::cli::UsageError(app, why);
    }
  }
  auto client = kvd::client::Client::Connect(AdminOptions(f));
  if (!client.ok()) {
    if (client.status().code() == StatusCode::kInvalidArgument)
      return kvd::cli::UsageError(app, client.status().message());
    return Fail(client.status(), f.json, true);
  }
  kvd::client::Client& c = **client;
  if (cmd == "stats") return RunStats(c, f);
  if (cmd == "ls") return RunList(c, f);
  if (cmd == "evict") return RunEvict(c, filter, f.json);
  if (cmd == "calibration") return RunCalibration(c, f);
  if (cmd == "events") return RunEvents(c, f);
  return RunHealth(c, f.json);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvdctl: inspect and manage a running kvd", "kvdctl"};
  app.fallthrough();  // global options may follow the command
  app.require_subcommand(1);
  app.footer(
      "ADDR: host:port or unix:/path (default $KVD_ADDR, else 127.0.0.1:7400)\n"
      "over TCP to a daemon with auth.tokens_file, the admin token is read from $KVD_ADMIN_TOKEN\n"
      "exit codes: 0 ok, 1 daemon error or unhealthy, 2 usage, 3 cannot connect");
  CtlFlags flags;
  AddGlobalOptions(app, &flags);
  AddDaemonCommands(app, &flags);
  AddStreamAndClusterCommands(app, &flags);
  if (int rc = ForwardCalibrate(argc, argv); rc >= 0) return rc;
  if (int rc = kvd::cli::Parse(app, argc, argv); rc >= 0) return rc;
  const std::string cmd = app.get_subcommands().front()->get_name();
  if (cmd == "cluster") return RunCluster(flags);
  return RunDaemonCommand(app, cmd, flags);
}
