// kvd-cluster-bench: what a kvd cluster's lookups cost in staleness, and what the alternative (a
// router's index fed by every node's KV events) costs in memory.
//
//   kvd-cluster-bench --op staleness --addr READER --put-addr WRITER --holder NODE --model M
//                     [--tokens T] [--count N] [--events ENDPOINT] [--wait-ms W] [--json]
//   kvd-cluster-bench --op member --addr READER --model M --node NODE [--absent] [--wait-ms W]
//                     [--json]
//   kvd-cluster-bench --op router-index [--count N] [--nodes K] [--holders-per-chunk H]
//                     [--chain-chunks C] [--json]
//
// --op staleness, against two kvds of one cluster: N samples, one at a time. Each puts a chunk
// of T tokens (default 1) at WRITER (cluster.node NODE); from the put's commit acknowledgement,
// cluster-scope lookups of it at READER, one after another, until one lists NODE holding it
// (commit_to_visible: acknowledgement to the end of that lookup; max_lookups_to_visible: 1 when
// the first lookup after the acknowledgement already saw it). Then the chunk is evicted at
// WRITER (an admin Evict of that chunk) and lookups at READER run until NODE answers that it
// holds none of it (evict_to_invisible, max_lookups_to_invisible). Use cluster.peer_fetch "off"
// at READER, so that its lookups report without copying the chunk. With --events (WRITER's
// kv_events.endpoint) a ZeroMQ subscriber in this process also times the BlockStored and
// BlockRemoved events from the same acknowledgements (commit_to_event, evict_to_event): when a
// router fed by events could first know. Each change must show within --wait-ms (default 5000).
// Reports p50, p99 and max in microseconds. Before the samples, one cluster lookup at READER
// connects its kvd to its peers (a kvd connects to a peer on the first lookup that asks it).
//
// --op member: cluster-scope lookups at READER, one after another, until one lists NODE (or,
// with --absent, until none does: a dead member stays listed, with the error of its refused
// connection, until its lease expires); prints when (seen_unix_ns, wall clock) so that a script
// can subtract when it started or killed NODE.
//
// --op router-index needs no kvd: builds in this process the index a KV-aware router keeps of a
// cluster fed by every node's events, for N distinct chunks (default 1M) across K nodes (default
// 3), each chunk held by H of them (default 1), in chains of C chunks (default 16), in three
// structures: block hash -> node bitmask (the least any such index keeps), block hash -> holder
// entries (node, tier) as llm-d's indexer keeps it, and a prefix tree of blocks with a
// per-node block map as Dynamo's router keeps it. Reports heap and resident bytes per chunk.
//
// Exit 0 on success, 1 on a failed operation (or a change that did not show in time), 2 usage,
// 3 cannot connect.
#include <CLI/CLI.hpp>
#include <iostream>
#include <numeric>
#include <string>

#include "kvd/common/cli.h"
#include "router_index_bench.h"
#include "staleness_bench.h"
#include "util.h"

namespace {

struct Flags {
  kvd::tools::ConnectionFlags connection;
  std::string op, model, put_addr, holder, node, events;
  int64_t count = 0, tokens = 1, wait_ms = 0, nodes = 3, holders_per_chunk = 1, chain_chunks = 16;
  bool absent = false, json = false;
};

void AddOptions(CLI::App& app, Flags* f) {
  kvd::tools::AddConnectionOptions(app, &f->connection);
  app.add_option("--op", f->op, "staleness | member | router-index")
      ->required()
      ->check(CLI::IsMember({"staleness", "member", "router-index"}));
  app.add_option("--model", f->model, "model registered at both kvds");
  app.add_option("--put-addr", f->put_addr, "staleness: the writer kvd's address");
  app.add_option("--holder", f->holder, "staleness: the writer's cluster.node");
  app.add_option("--events", f->events, "staleness: the writer's kv_events.endpoint");
  app.add_option("--tokens", f->tokens, "staleness: tokens per chunk (default 1)");
  app.add_option("--count", f->count,
                 "staleness: samples (default 100); router-index: chunks (default 1M)")
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--wait-ms", f->wait_ms, "the most one change may take to show");
  app.add_option("--node", f->node, "member: the cluster.node watched for");
  app.add_flag("--absent", f->absent, "member: wait until no lookup lists it");
  app.add_option("--nodes", f->nodes, "router-index: nodes (default 3)");
  app.add_option("--holders-per-chunk", f->holders_per_chunk,
                 "router-index: nodes holding each chunk (default 1)");
  app.add_option("--chain-chunks", f->chain_chunks, "router-index: chunks per chain (default 16)");
  app.add_flag("--json", f->json, "one JSON object on stdout");
}

// The engine options of a client of `address` for --model (layout and chunk size asked from
// that kvd). -1 when all is well, else the exit code.
int EngineOptions(const Flags& f, const std::string& address, kvd::client::ClientOptions* o) {
  kvd::tools::ApplyConnectionFlags(f.connection, o);
  if (!address.empty()) o->address = address;
  uint32_t chunk_tokens = 0;
  auto info = kvd::tools::FindModel(*o, f.model, &chunk_tokens);
  if (!info.ok()) {
    std::cerr << "kvd-cluster-bench: " << info.status() << "\n";
    return info.status().code() == kvd::StatusCode::kUnavailable ? 3 : 1;
  }
  o->model = f.model;
  o->layout = info->layout;
  o->chunk_tokens = static_cast<int>(chunk_tokens);
  o->block_tokens = std::gcd(16, static_cast<int>(chunk_tokens));
  return -1;
}

int RunStaleness(const CLI::App& app, const Flags& f) {
  if (f.model.empty() || f.put_addr.empty() || f.holder.empty()) {
    return kvd::cli::UsageError(app, "--op staleness needs --model, --put-addr and --holder");
  }
  kvd::tools::cluster_bench::StalenessOptions o;
  if (int rc = EngineOptions(f, "", &o.reader); rc >= 0) return rc;
  if (int rc = EngineOptions(f, f.put_addr, &o.writer); rc >= 0) return rc;
  o.holder = f.holder;
  o.events = f.events;
  if (f.count > 0) o.samples = f.count;
  if (f.wait_ms > 0) o.wait_ms = f.wait_ms;
  if (f.tokens < 1 || f.tokens > o.writer.chunk_tokens) {
    return kvd::cli::UsageError(app, "--tokens must be 1 to the chunk's tokens");
  }
  o.tokens = static_cast<int>(f.tokens);
  return kvd::tools::cluster_bench::RunStaleness(o, f.json);
}

int RunMember(const CLI::App& app, const Flags& f) {
  if (f.model.empty() || f.node.empty()) {
    return kvd::cli::UsageError(app, "--op member needs --model and --node");
  }
  kvd::tools::cluster_bench::MemberWatchOptions o;
  if (int rc = EngineOptions(f, "", &o.reader); rc >= 0) return rc;
  o.node = f.node;
  o.absent = f.absent;
  if (f.wait_ms > 0) o.wait_ms = f.wait_ms;
  return kvd::tools::cluster_bench::RunMemberWatch(o, f.json);
}

int RunRouterIndex(const CLI::App& app, const Flags& f) {
  kvd::tools::cluster_bench::RouterIndexOptions o;
  if (f.count > 0) o.chunks = f.count;
  if (f.nodes < 1 || f.nodes > 32 || f.holders_per_chunk < 1 || f.holders_per_chunk > f.nodes ||
      f.chain_chunks < 1) {
    return kvd::cli::UsageError(
        app, "--nodes must be 1 to 32, --holders-per-chunk 1 to --nodes, --chain-chunks >= 1");
  }
  o.nodes = static_cast<int>(f.nodes);
  o.holders_per_chunk = static_cast<int>(f.holders_per_chunk);
  o.chain_chunks = static_cast<int>(f.chain_chunks);
  return kvd::tools::cluster_bench::RunRouterIndex(o, f.json);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvd-cluster-bench: staleness of cluster lookups, memory of an events-fed index",
               "kvd-cluster-bench"};
  app.footer("exit codes: 0 ok, 1 a failed operation, 2 usage, 3 cannot connect");
  Flags flags;
  AddOptions(app, &flags);
  if (int rc = kvd::cli::Parse(app, argc, argv); rc >= 0) return rc;
  if (flags.op == "staleness") return RunStaleness(app, flags);
  if (flags.op == "member") return RunMember(app, flags);
  return RunRouterIndex(app, flags);
}
