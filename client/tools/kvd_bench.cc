// kvd-bench: put/get/lookup throughput and latency against a running kvd.
//
//   kvd-bench --addr ADDR --model M (--chunk-bytes B | --tokens T) --count N --concurrency C
//             --op put|get|both [--depth D] [--lookup-batch L] [--ucx-tls TLS]
//             [--net-devices DEV] [--no-shm] [--verify] [--json]
//
// Over a unix-socket address the clients use the shared-memory path when kvd grants it
// (reported as "shared_memory" in the output); --no-shm forces the transport (UCX) path.
// C client threads (one Client, one connection, one transport each) share N chunks of random
// bytes. Phases: put (Reserve -> send -> Commit), lookup (one single-chunk Lookup per chunk),
// get (one Lookup per L chunks (default 64), then Gets of D chunks in flight per call,
// checksum-verified by the library). Throughput (gbps) is bytes / time of the phase across all
// threads, not counting the bench's own work (generating each chunk's bytes before a put,
// --verify's compare after a get): the time is the longest thread's wall time minus that
// thread's own work; gbps_wall counts it too (GB/s = 1e9 bytes/s). Latencies are per
// call (per batch of D with --depth > 1). --op get still stores the chunks first (untimed
// output). Exit 0 on success, 1 on a failed operation, 2 usage, 3 cannot connect.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <thread>

#include "kvd/client/client.h"
#include "util.h"

namespace {

using Clock = std::chrono::steady_clock;
using kvd::Status;

struct PhaseResult {
  std::string name;
  uint64_t ops = 0, bytes = 0;
  double seconds = 0;       // wall time less the bench's own work (see the header comment)
  double wall_seconds = 0;  // wall time of the phase
  std::vector<double> latencies_us;
  double Percentile(double p) const {
    if (latencies_us.empty()) return 0;
    std::vector<double> v = latencies_us;
    size_t k = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
    std::nth_element(v.begin(), v.begin() + k, v.end());
    return v[k];
  }
  double Gbps() const { return seconds > 0 ? bytes / seconds / 1e9 : 0; }
  double GbpsWall() const { return wall_seconds > 0 ? bytes / wall_seconds / 1e9 : 0; }
};

// Fills a chunk deterministically from (run, index) so --verify can regenerate it.
void FillChunk(uint8_t* p, size_t n, uint64_t run, uint64_t index) {
  uint64_t x = run * 0x9E3779B97F4A7C15ull ^ (index + 1) * 0xBF58476D1CE4E5B9ull;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(p + i, &x, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<uint8_t>(x >> (8 * (i % 8)));
}

kvd::Hash128 ChunkHash(uint64_t run, uint64_t index) {
  uint64_t words[2] = {run, index};
  return kvd::HashBytes(words, sizeof words, 0x6b76642d62656e63ull);
}

}  // namespace

int main(int argc, char** argv) {
  std::set<std::string> valued = {"--model",       "--chunk-bytes", "--tokens", "--count",
                                  "--concurrency", "--op",          "--depth",  "--lookup-batch"};
  valued.insert(kvd::tools::kConnectionFlags.begin(), kvd::tools::kConnectionFlags.end());
  kvd::tools::Args args(argc, argv, {"--json", "--verify", "--no-shm", "--help"}, valued);
  const char* usage =
      "usage: kvd-bench --addr ADDR --model M (--chunk-bytes B | --tokens T) --count N\n"
      "                 --concurrency C --op put|get|both [--depth D] [--lookup-batch L]\n"
      "                 [--ucx-tls TLS] [--net-devices DEV] [--no-shm] [--verify] [--json]\n";
  if (args.Has("--help")) {
    std::cout << usage;
    return 0;
  }
  kvd::client::ClientOptions base;
  kvd::tools::ApplyConnectionArgs(args, &base);
  const std::string model = args.Get("--model");
  const std::string op = args.Get("--op", "both");
  const int64_t count = args.GetInt("--count", 100);
  const int64_t concurrency = args.GetInt("--concurrency", 1);
  const int64_t depth = args.GetInt("--depth", 1);
  const int64_t lookup_batch = args.GetInt("--lookup-batch", 64);
  int64_t tokens = args.GetInt("--tokens", 0);
  const int64_t chunk_bytes_arg = args.GetInt("--chunk-bytes", 0);
  const bool json = args.Has("--json"), verify = args.Has("--verify");
  auto usage_error = [&](const std::string& why) {
    std::cerr << "kvd-bench: " << why << "\n" << usage;
    return 2;
  };
  if (!args.ok()) return usage_error(args.error());
  if (model.empty()) return usage_error("--model is required");
  if (op != "put" && op != "get" && op != "both")
    return usage_error("--op must be put, get or both");
  if (count <= 0 || concurrency <= 0 || depth <= 0 || lookup_batch <= 0) {
    return usage_error("--count, --concurrency, --depth and --lookup-batch must be > 0");
  }
  if ((tokens > 0) == (chunk_bytes_arg > 0)) {
    return usage_error("give exactly one of --chunk-bytes and --tokens");
  }

  uint32_t chunk_tokens = 0;
  auto info = kvd::tools::FindModel(base, model, &chunk_tokens);
  if (!info.ok()) {
    std::cerr << "kvd-bench: " << info.status() << "\n";
    return info.status().code() == kvd::StatusCode::kUnavailable ? 3 : 1;
  }
  const kvd::ModelLayout layout = info->layout;
  const size_t per_token = layout.ChunkBytes(1);
  if (chunk_bytes_arg > 0) {
    if (chunk_bytes_arg % per_token != 0) {
      return usage_error("--chunk-bytes " + std::to_string(chunk_bytes_arg) +
                         " is not a whole number of tokens of " + model + " (" +
                         std::to_string(per_token) + " bytes per token)");
    }
    tokens = chunk_bytes_arg / per_token;
  }
  if (tokens > static_cast<int64_t>(chunk_tokens)) {
    return usage_error("a chunk holds at most " + std::to_string(chunk_tokens) + " tokens, asked " +
                       std::to_string(tokens));
  }
  const size_t chunk_bytes = layout.ChunkBytes(static_cast<int>(tokens));
  base.model = model;
  base.layout = layout;
  base.chunk_tokens = static_cast<int>(chunk_tokens);
  base.block_tokens = std::gcd(16, static_cast<int>(chunk_tokens));
  base.max_in_flight = static_cast<int>(depth);
  base.shared_memory = !args.Has("--no-shm");

  const uint64_t run = static_cast<uint64_t>(Clock::now().time_since_epoch().count()) ^
                       (static_cast<uint64_t>(::getpid()) << 32);
  const int nthreads = static_cast<int>(std::min(concurrency, count));
  std::vector<std::unique_ptr<kvd::client::Client>> clients(nthreads);
  for (int t = 0; t < nthreads; ++t) {
    auto c = kvd::client::Client::Connect(base);
    if (!c.ok()) {
      std::cerr << "kvd-bench: connect: " << c.status() << "\n";
      return c.status().code() == kvd::StatusCode::kUnavailable ? 3 : 1;
    }
    clients[t] = std::move(c).value();
  }

  std::mutex mu;
  Status first_error;
  std::vector<double> own_s(nthreads, 0.0);  // per thread: seconds of the bench's own work
  auto run_phase = [&](const std::string& name, auto&& body) {
    PhaseResult result;
    result.name = name;
    std::vector<std::thread> threads;
    std::fill(own_s.begin(), own_s.end(), 0.0);
    std::vector<double> busy_s(nthreads, 0.0);
    auto start = Clock::now();
    for (int t = 0; t < nthreads; ++t) {
      threads.emplace_back([&, t]() {
        std::vector<double> lat;
        uint64_t ops = 0, bytes = 0;
        Status s = body(t, lat, ops, bytes);
        busy_s[t] = std::chrono::duration<double>(Clock::now() - start).count() - own_s[t];
        std::lock_guard<std::mutex> lock(mu);
        if (!s.ok() && first_error.ok()) first_error = s.WithContext(name);
        result.latencies_us.insert(result.latencies_us.end(), lat.begin(), lat.end());
        result.ops += ops;
        result.bytes += bytes;
      });
    }
    for (auto& th : threads) th.join();
    result.wall_seconds = std::chrono::duration<double>(Clock::now() - start).count();
    result.seconds = *std::max_element(busy_s.begin(), busy_s.end());
    return result;
  };
  // Chunk indices of thread t: t, t + nthreads, ...
  auto indices = [&](int t) {
    std::vector<uint64_t> v;
    for (uint64_t i = t; i < static_cast<uint64_t>(count); i += nthreads) v.push_back(i);
    return v;
  };
  auto us_since = [](Clock::time_point t0) {
    return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  };

  std::vector<PhaseResult> phases;
  phases.push_back(run_phase(
      "put", [&](int t, std::vector<double>& lat, uint64_t& ops, uint64_t& bytes) -> Status {
        auto idx = indices(t);
        std::vector<std::vector<uint8_t>> bufs(depth, std::vector<uint8_t>(chunk_bytes));
        for (size_t i = 0; i < idx.size(); i += depth) {
          size_t n = std::min<size_t>(depth, idx.size() - i);
          std::vector<kvd::client::PutItem> items(n);
          auto fill0 = Clock::now();
          for (size_t j = 0; j < n; ++j) {
            FillChunk(bufs[j].data(), chunk_bytes, run, idx[i + j]);
            items[j] = {ChunkHash(run, idx[i + j]), static_cast<int>(tokens), bufs[j].data(),
                        chunk_bytes};
          }
          auto t0 = Clock::now();
          own_s[t] += std::chrono::duration<double>(t0 - fill0).count();
          auto r = clients[t]->PutChunks(items);
          lat.push_back(us_since(t0));
          if (!r.ok()) return r.status();
          ops += n;
          bytes += n * chunk_bytes;
        }
        return Status::Ok();
      }));

  if (op != "put" && first_error.ok()) {
    phases.push_back(run_phase(
        "lookup", [&](int t, std::vector<double>& lat, uint64_t& ops, uint64_t& bytes) -> Status {
          for (uint64_t i : indices(t)) {
            kvd::Hash128 h = ChunkHash(run, i);
            auto t0 = Clock::now();
            auto r = clients[t]->Lookup({&h, 1});
            lat.push_back(us_since(t0));
            if (!r.ok()) return r.status();
            if (r->matched_chunks != 1) {
              return Status::NotFound("chunk " + std::to_string(i) +
                                      " missing at lookup (evicted? "
                                      "the host tier may be smaller than count x chunk bytes)");
            }
            ++ops;
            KVD_RETURN_IF_ERROR(clients[t]->ReleaseLease(r->lease_id));
          }
          return Status::Ok();
        }));
  }
  if (op != "put" && first_error.ok()) {
    phases.push_back(run_phase(
        "get", [&](int t, std::vector<double>& lat, uint64_t& ops, uint64_t& bytes) -> Status {
          // As an engine reads a prompt: one Lookup (one lease) for a run of up to `lookup_batch`
          // chunks, then Gets of `depth` chunks per call, then one ReleaseLease. The latency is
          // per Get call; the throughput counts the whole phase (lookups and releases included).
          auto idx = indices(t);
          std::vector<std::vector<uint8_t>> bufs(depth, std::vector<uint8_t>(chunk_bytes));
          std::vector<uint8_t> expect(verify ? chunk_bytes : 0);
          for (size_t b = 0; b < idx.size(); b += lookup_batch) {
            size_t nb = std::min<size_t>(lookup_batch, idx.size() - b);
            std::vector<kvd::Hash128> chain(nb);
            for (size_t j = 0; j < nb; ++j) chain[j] = ChunkHash(run, idx[b + j]);
            auto l = clients[t]->Lookup(chain);
            if (!l.ok()) return l.status();
            if (l->matched_chunks != nb) {
              return Status::NotFound("only " + std::to_string(l->matched_chunks) + " of " +
                                      std::to_string(nb) + " chunks found at get");
            }
            for (size_t i = 0; i < nb; i += depth) {
              size_t n = std::min<size_t>(depth, nb - i);
              std::vector<kvd::client::GetItem> items(n);
              for (size_t j = 0; j < n; ++j) {
                items[j] = {static_cast<uint32_t>(i + j), bufs[j].data(), chunk_bytes};
              }
              auto t0 = Clock::now();
              auto r = clients[t]->GetChunks(l->lease_id, items);
              lat.push_back(us_since(t0));
              if (!r.ok()) return r.status();
              if (verify) {
                auto v0 = Clock::now();
                for (size_t j = 0; j < n; ++j) {
                  FillChunk(expect.data(), chunk_bytes, run, idx[b + i + j]);
                  if (std::memcmp(expect.data(), bufs[j].data(), chunk_bytes) != 0) {
                    return Status::DataLoss("chunk " + std::to_string(idx[b + i + j]) + " differs");
                  }
                }
                own_s[t] += std::chrono::duration<double>(Clock::now() - v0).count();
              }
              ops += n;
              bytes += n * chunk_bytes;
            }
            KVD_RETURN_IF_ERROR(clients[t]->ReleaseLease(l->lease_id));
          }
          return Status::Ok();
        }));
  }
  const bool shm_used = !clients.empty() && clients[0] && clients[0]->session().shared_memory;
  clients.clear();

  if (json) {
    nlohmann::json j = {
        {"model", model}, {"chunk_bytes", chunk_bytes},        {"tokens", tokens},
        {"count", count}, {"concurrency", nthreads},           {"depth", depth},
        {"op", op},       {"ucx_tls", base.transport.ucx_tls}, {"ok", first_error.ok()}};
    j["shared_memory"] = shm_used;
    for (const auto& p : phases) {
      if (op == "get" && p.name == "put") continue;
      j[p.name] = {{"ops", p.ops},
                   {"bytes", p.bytes},
                   {"seconds", p.seconds},
                   {"gbps", p.Gbps()},
                   {"wall_seconds", p.wall_seconds},
                   {"gbps_wall", p.GbpsWall()},
                   {"ops_per_s", p.seconds > 0 ? p.ops / p.seconds : 0},
                   {"p50_us", p.Percentile(0.50)},
                   {"p90_us", p.Percentile(0.90)},
                   {"p99_us", p.Percentile(0.99)}};
    }
    if (!first_error.ok()) j["error"] = first_error.ToString();
    std::cout << j.dump(2) << "\n";
  } else {
    std::cout << "kvd-bench: model " << model << ", " << kvd::tools::HumanBytes(chunk_bytes)
              << " chunks (" << tokens << " tokens), count " << count << ", concurrency "
              << nthreads << ", depth " << depth << ", ucx_tls '" << base.transport.ucx_tls
              << "'\n";
    std::vector<std::vector<std::string>> rows;
    char buf[6][32];
    for (const auto& p : phases) {
      if (op == "get" && p.name == "put") continue;
      std::snprintf(buf[0], 32, "%.3f", p.Gbps());
      std::snprintf(buf[1], 32, "%.0f", p.seconds > 0 ? p.ops / p.seconds : 0);
      std::snprintf(buf[2], 32, "%.1f", p.Percentile(0.5));
      std::snprintf(buf[3], 32, "%.1f", p.Percentile(0.9));
      std::snprintf(buf[4], 32, "%.1f", p.Percentile(0.99));
      rows.push_back({p.name, std::to_string(p.ops), p.name == "lookup" ? "-" : buf[0], buf[1],
                      buf[2], buf[3], buf[4]});
    }
    kvd::tools::PrintTable(std::cout, {"OP", "OPS", "GB/s", "OPS/s", "p50 us", "p90 us", "p99 us"},
                           rows);
  }
  if (!first_error.ok()) {
    std::cerr << "kvd-bench: " << first_error << "\n";
    return 1;
  }
  return 0;
}
