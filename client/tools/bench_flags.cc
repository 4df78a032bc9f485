#include "bench_flags.h"

#include <CLI/CLI.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "daemon_stats.h"
#include "kvd/common/cli.h"

namespace kvd::tools::bench {
namespace {

// The daemon's pid from kvd's --ready-file JSON ({"pid": N, ...}); 0 when absent.
int64_t PidFromReadyFile(const std::string& path, std::string* error) {
  std::error_code ec;
  std::ifstream in;
  if (std::filesystem::is_regular_file(path, ec)) in.open(path);
  if (!in.is_open()) {
    *error = "cannot read --ready-file " + path + " (not a readable file)";
    return 0;
  }
  auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("pid") || !j["pid"].is_number_integer()) {
    *error = "--ready-file " + path + " has no integer \"pid\"";
    return 0;
  }
  return j["pid"].get<int64_t>();
}

}  // namespace

void AddBenchOptions(CLI::App& app, BenchFlags* f) {
  kvd::tools::AddConnectionOptions(app, &f->connection);
  app.add_option("--model", f->model, "a model registered in kvd (all ops but memcpy)");
  app.add_option("--chunk-bytes", f->chunk_bytes_arg,
                 "bytes per chunk (a whole number of the model's tokens)")
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--tokens", f->tokens, "tokens per chunk (exactly one of this and --chunk-bytes)")
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--count", f->count, "chunks (default 100)")->transform(CLI::AsSizeValue(false));
  app.add_option("--concurrency", f->concurrency,
                 "client threads, one connection each (default 1)");
  app.add_option("--op", f->op,
                 "put, get, both (default), or the references without a daemon: memcpy, "
                 "pingpong");
  app.add_option("--depth", f->depth, "chunks in flight per client call (default 1)");
  app.add_option("--lookup-batch", f->lookup_batch,
                 "chunks per Lookup of the get phase (default 64)");
  app.add_option("--lookup-chain", f->lookup_chain,
                 "chunks per Lookup of the lookup phase (default 1); its ops are Lookup calls");
  app.add_option("--lookups", f->lookups,
                 "Lookup calls of the lookup phase in all, going round the chunks (default 0: "
                 "one per --lookup-chain chunks)")
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--pingpong-floor", f->pingpong_floor,
                 "a unix socket pair ping-pong of this many exchanges right before the lookup "
                 "phase, reported as phases \"pingpong\" and \"pingpong_cross_cpu\" (default 0: "
                 "none)")
      ->transform(CLI::AsSizeValue(false));
  auto* pid_opt = app.add_option("--daemon-pid", f->daemon_pid,
                                 "report the daemon's CPU, context switches and read/write "
                                 "system calls per operation (kvd on this machine)")
                      ->check(CLI::PositiveNumber);
  app.add_option("--ready-file", f->ready_file, "kvd's --ready-file output, naming its pid")
      ->excludes(pid_opt);
  app.add_flag("--no-shm", f->no_shm, "force the transport (UCX) path over a unix socket");
  app.add_flag("--verify", f->verify, "compare every byte read back");
  app.add_flag("--finite-values", f->finite,
               "chunks of finite values of magnitude ~1 (bf16/fp16/fp32; for a compressing model)");
  app.add_flag("--retry-busy", f->retry_busy,
               "retry puts refused for a full ingest pool (RESOURCE_EXHAUSTED) every 2 ms");
  app.add_option("--inline-put-bytes", f->inline_put_bytes,
                 "puts of at most this many bytes in one exchange (default 64 KiB; 0 = off)")
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--warmup", f->warmup,
                 "untimed put + get rounds per client thread before the timed phases, with keys "
                 "of their own (default 0); reported as phase \"warmup\"")
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--shm-inline-put-bytes", f->shm_inline_put_bytes,
                 "on the shared-memory path, inline puts only up to this too (default 32 KiB)")
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--reply-spin-us", f->reply_spin_us,
                 "how long a client waiting for kvd's reply looks for it before it sleeps, "
                 "microseconds (ClientOptions::reply_spin_us; default 50; 0 = sleep at once)");
  app.add_option("--scatter-bytes", f->scatter_bytes,
                 "--op memcpy: memcpy_scatter's destinations in all (default count x chunk bytes; "
                 "give kvd's arena size)")
      ->transform(CLI::AsSizeValue(false));
  app.add_flag("--in-place", f->in_place,
               "zero-copy puts and gets (ReservePut/CommitPut, ReadInPlace; shared memory only)");
  app.add_flag("--reserve-ahead", f->reserve_ahead,
               "shared-memory puts: each commit reserves the next put's slot "
               "(ClientOptions::reserve_ahead; one exchange per put)");
  app.add_option("--put-addr", f->put_addr,
                 "put through the kvd at this address (another member of --addr's cluster)");
  app.add_flag("--cluster", f->cluster,
               "cluster-scope lookups: chunks a peer holds are fetched into --addr's kvd");
  app.add_flag("--json", f->json, "print one JSON object");
}

std::string CheckFlags(BenchFlags* f) {
  const std::string& op = f->op;
  if (op != "put" && op != "get" && op != "both" && op != "memcpy" && op != "pingpong")
    return "--op must be put, get, both, memcpy or pingpong";
  if (f->count <= 0 || f->concurrency <= 0 || f->depth <= 0 || f->lookup_batch <= 0 ||
      f->lookup_chain <= 0) {
    return "--count, --concurrency, --depth, --lookup-batch and --lookup-chain must be > 0";
  }
  if (f->warmup < 0) return "--warmup must be >= 0";
  if (f->lookups < 0 || f->pingpong_floor < 0) {
    return "--lookups and --pingpong-floor must be >= 0";
  }
  if ((f->lookups > 0 || f->pingpong_floor > 0) && op != "get" && op != "both") {
    return "--lookups and --pingpong-floor need a lookup phase (--op get or both)";
  }
  if (f->in_place && (f->depth != 1 || f->no_shm || op == "memcpy" || op == "pingpong")) {
    return "--in-place needs --depth 1 and the shared-memory path (not --no-shm)";
  }
  if (f->warmup > 0 && (op == "memcpy" || op == "pingpong")) {
    return "--warmup needs a daemon (not --op " + op + ")";
  }
  if (f->scatter_bytes < 0) return "--scatter-bytes must be >= 0";
  if (f->scatter_bytes > 0 && op != "memcpy") return "--scatter-bytes needs --op memcpy";
  if (!f->ready_file.empty()) {
    std::string why;
    f->daemon_pid = PidFromReadyFile(f->ready_file, &why);
    if (f->daemon_pid <= 0) return why;
  }
  if (f->daemon_pid > 0) {
    auto probe = kvd::tools::SampleProcess(static_cast<pid_t>(f->daemon_pid));
    if (!probe.ok()) {
      return "daemon pid " + std::to_string(f->daemon_pid) + ": " + probe.status().ToString();
    }
  }
  return "";
}

int ConfigureClients(const CLI::App& app, const BenchFlags& f, kvd::client::ClientOptions* base,
                     ChunkShape* shape) {
  auto usage_error = [&](const std::string& why) { return kvd::cli::UsageError(app, why); };
  uint32_t chunk_tokens = 0;
  auto info = kvd::tools::FindModel(*base, f.model, &chunk_tokens);
  if (!info.ok()) {
    std::cerr << "kvd-bench: " << info.status() << "\n";
    return info.status().code() == kvd::StatusCode::kUnavailable ? 3 : 1;
  }
  const kvd::ModelLayout layout = info->layout;
  const size_t per_token = layout.ChunkBytes(1);
  shape->tokens = f.tokens;
  if (f.chunk_bytes_arg > 0) {
    if (f.chunk_bytes_arg % per_token != 0) {
      return usage_error("--chunk-bytes " + std::to_string(f.chunk_bytes_arg) +
                         " is not a whole number of tokens of " + f.model + " (" +
                         std::to_string(per_token) + " bytes per token)");
    }
    shape->tokens = f.chunk_bytes_arg / per_token;
  }
  if (shape->tokens > static_cast<int64_t>(chunk_tokens)) {
    return usage_error("a chunk holds at most " + std::to_string(chunk_tokens) + " tokens, asked " +
                       std::to_string(shape->tokens));
  }
  shape->chunk_bytes = layout.ChunkBytes(static_cast<int>(shape->tokens));
  base->model = f.model;
  base->layout = layout;
  base->chunk_tokens = static_cast<int>(chunk_tokens);
  base->block_tokens = std::gcd(16, static_cast<int>(chunk_tokens));
  base->max_in_flight = static_cast<int>(f.depth);
  base->shared_memory = !f.no_shm;
  base->reserve_ahead = f.reserve_ahead;
  base->inline_put_bytes = static_cast<size_t>(std::max<int64_t>(f.inline_put_bytes, 0));
  base->shm_inline_put_bytes = static_cast<size_t>(std::max<int64_t>(f.shm_inline_put_bytes, 0));
  if (f.reply_spin_us < 0) return usage_error("--reply-spin-us must be >= 0");
  // Validate() names a value above the limit.
  base->reply_spin_us = static_cast<uint32_t>(
      std::min<int64_t>(f.reply_spin_us, kvd::client::ClientOptions::kMaxReplySpinUs + int64_t{1}));
  if (Status v = base->Validate(); !v.ok()) return usage_error(v.message());
  return -1;
}

}  // namespace kvd::tools::bench
